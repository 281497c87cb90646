"""The CUDA-graph mode per function (``jaxpar/_plan/modes.py``).

On target ``"gpu"`` the plan may choose the mode a function is compiled in (XLA's
default ``lhs``, ``concurrent_regions`` graphs, or graphs ``off``) from the GPU model,
and the choice goes into that function's own ``jax.jit`` as ``compiler_options``. A
choice must win at the nominal figures and at the pessimistic end of every uncertain
figure's range, within the memory budget: with the built-in (unmeasured) figures no
mode change holds, and with figures measured on a GPU (``calibrated``) one may. Checked
here: the choice, its margin and its ends, the option and its errors, a mode the user
set is kept, nothing changes on the CPU target, the options reach a deviceless H200
compile (XLA's own dump of the compiled executable: its debug options and its command
buffer's parallel graph nodes), the dispatch of the chosen options, and the warning
when an outer jit takes them away.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.benchmarks import CONCURRENCY_PAYS, calibrated_gpu, suite_evaluation
from helpers.calls import jaxpar_frames
from helpers.environment import PLUGIN_MESSAGE, PLUGIN_OK, needs_plugin
from helpers.programs import fan, fan_args

import jaxpar
from jaxpar import _compiled
from jaxpar._analysis import Analysis
from jaxpar._flags import command_buffer_mode_set, command_buffer_options
from jaxpar._memo import IdentityMemo
from jaxpar._model.gpu import CommandBufferMode
from jaxpar._options import Options
from jaxpar._plan import plan_jaxpr
from jaxpar._plan.gpu_time import estimate_plain_seconds, estimate_seconds
from jaxpar._plan.modes import (
    MIN_GAIN,
    ModeEnds,
    ModeSteps,
    choose_mode,
    optimistic,
    pessimistic,
)
from jaxpar.passes import LevelResult, Pass, run_passes
from jaxpar.passes._walk import Step

LHS, CONCURRENT, OFF = CommandBufferMode.LHS, CommandBufferMode.CONCURRENT, CommandBufferMode.OFF
REGIONS = CommandBufferMode.CONCURRENT_REGIONS
CONCURRENT_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
REGIONS_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT_REGIONS"}


@pytest.fixture
def calibrated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """This machine planning for a GPU whose figures were measured (``calibrate.py``) and
    under which small independent kernels pay off as parallel graph nodes at every end
    (``helpers.benchmarks.CONCURRENCY_PAYS``): the profile target ``"gpu"`` plans with off a
    GPU."""
    from jaxpar._model import gpu as _gpu_model

    profile = dataclasses.replace(calibrated_gpu(tmp_path, **CONCURRENCY_PAYS), name="gpu",
                                  device_kind="")
    monkeypatch.setitem(_gpu_model.GPU_PROFILES, _gpu_model.GENERIC_GPU, profile)  # type: ignore[index]
    return profile


def towers(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """Three independent matmul chains of different widths (nothing to batch)."""
    outs = []
    for x in (a, b, c):
        for _ in range(3):
            x = jnp.tanh(x @ x)
        outs.append(x.sum())
    return outs[0] + outs[1] + outs[2]


def chain(x: jax.Array) -> jax.Array:
    for _ in range(6):
        x = jnp.tanh(x @ x)
    return x


def towers_args() -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return tuple(jax.random.normal(k, (n, n)) / n for k, n in zip(keys, (128, 192, 256),
                                                                   strict=True))


def specs(args: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)


@pytest.fixture(autouse=True)
def _no_mode_in_xla_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = " ".join(f for f in __import__("os").environ.get("XLA_FLAGS", "").split()
                     if not command_buffer_mode_set(f))
    monkeypatch.setenv("XLA_FLAGS", flags)


# --------------------------------------------------------------------------- the choice


def test_choose_mode_needs_the_margin_over_the_users_mode() -> None:
    kept = choose_mode({LHS: 100e-6, REGIONS: 100e-6 * (1 - MIN_GAIN / 2), OFF: 2e-4}, LHS)
    assert (kept.mode, kept.chosen, kept.xla_options) == (LHS, False, {})
    assert "kept the process's lhs mode" in kept.reason
    assert "estimated, not measured on a GPU" in kept.reason
    chosen = choose_mode({LHS: 100e-6, REGIONS: 90e-6, OFF: 95e-6}, LHS, measured=True)
    assert (chosen.mode, chosen.chosen) == (REGIONS, True)
    assert chosen.xla_options == REGIONS_OPTIONS
    assert "x0.900" in chosen.reason and "lhs mode" in chosen.reason
    assert "not measured" not in chosen.reason
    off = choose_mode({LHS: 100e-6, REGIONS: 99e-6, OFF: 80e-6}, LHS)
    assert off.xla_options == {"xla_gpu_enable_command_buffer": ""}
    assert choose_mode({CONCURRENT: 10e-6, LHS: 9.9e-6}, CONCURRENT).mode is CONCURRENT


def test_choose_mode_needs_the_gain_at_the_pessimistic_end() -> None:
    nominal = {LHS: 100e-6, REGIONS: 80e-6}
    holds = ModeEnds(REGIONS, (90e-6, 100e-6), (60e-6, 100e-6))
    fails = ModeEnds(REGIONS, (98e-6, 100e-6), (60e-6, 100e-6))
    chosen = choose_mode(nominal, LHS, [holds])
    assert chosen.mode is REGIONS and "x0.900 to x0.600 over the model's ranges" in chosen.reason
    kept = choose_mode(nominal, LHS, [fails])
    assert kept.mode is LHS and not kept.chosen
    assert "x0.980 at the pessimistic end" in kept.reason
    assert "x0.600 at the optimistic end" in kept.reason
    assert kept.ends_of(REGIONS) is fails
    assert kept.to_dict()["ends"][0]["mode"] == "concurrent_regions"


def test_choose_mode_refuses_a_mode_over_the_memory_budget() -> None:
    why = "concurrent_regions mode would need est. 3.0 MiB more temporary memory"
    kept = choose_mode({LHS: 100e-6, REGIONS: 50e-6}, LHS, refused={REGIONS: why})
    assert kept.mode is LHS and why in kept.reason


def test_the_ends_of_the_ranges_favour_each_side() -> None:
    """The pessimistic end of a branching mode's ranges is the one that favours a chain:
    a small floor to hide, a dear branching node; the optimistic end the other."""
    gpu = Options.create(target="gpu").resolve("gpu").gpu
    assert gpu is not None and not gpu.calibrated
    low = pessimistic(gpu, REGIONS)
    high = optimistic(gpu, REGIONS)
    assert low.graph_floor_s == gpu.span("graph_floor_s")[0] < high.graph_floor_s
    assert low.dag_node_s == gpu.span("dag_node_s")[1] > high.dag_node_s
    assert low.chain_node_s == gpu.span("chain_node_s")[0]
    # Graphs off against a chain: a dear launch, a cheap graph.
    off = pessimistic(gpu, OFF)
    assert off.launch_s == gpu.span("launch_s")[1] and off.graph_floor_s == low.graph_floor_s


def test_where_a_candidate_wins_its_pessimistic_end_is_the_worst_corner(
        calibrated: Any) -> None:
    """On random programs of independent small kernels and matmuls, wherever
    ``concurrent_regions`` beats LHS at its pessimistic end, its ratio there is at least
    its ratio at every corner of the figures' ranges: winning there is winning at every
    end. (Where it loses there it is not chosen, whatever the other corners say.) With
    figures measured on a GPU under which concurrency pays, so that many programs win."""
    import itertools
    import random

    names = [name for name, _, _ in calibrated.ranges]
    corners = [dict(zip(names, ends, strict=True))
               for ends in itertools.product(("low", "high"), repeat=len(names))]
    checked = 0
    for seed in range(10):
        rng = random.Random(seed)
        widths = [rng.choice((16, 48, 96, 256)) for _ in range(rng.randint(2, 6))]
        steps = [[rng.random() < 0.7 for _ in range(rng.randint(1, 4))] for _ in widths]

        def program(*xs: jax.Array, steps: list[list[bool]] = steps) -> jax.Array:
            outs = []
            for x, small in zip(xs, steps, strict=True):
                for cheap in small:
                    x = jnp.cumsum(x, axis=0) * 0.5 if cheap else jnp.tanh(x @ x.T @ x)
                outs.append(x.sum())
            return sum(outs)

        closed = jax.make_jaxpr(program)(*[jax.ShapeDtypeStruct((w, w), jnp.float32)
                                           for w in widths])
        settings = Options.create(target="gpu").resolve("gpu")
        assert settings.gpu is calibrated
        analysis = Analysis(settings)
        plans = {mode: plan_jaxpr(closed, analysis.with_settings(
            settings.priced_in(mode))) for mode in (LHS, REGIONS)}

        def ratio(at: Any, plans: Any = plans, costs: Any = analysis.costs) -> float:
            return (estimate_seconds(plans[REGIONS], costs, REGIONS, gpu=at)
                    / estimate_seconds(plans[LHS], costs, LHS, gpu=at))

        worst = ratio(pessimistic(calibrated, REGIONS))
        if worst >= 1:
            continue
        checked += 1
        for corner in corners[seed::5]:
            assert ratio(calibrated.at(corner)) <= worst * (1 + 1e-9), (
                seed, sorted(corner.items()))
        assert ratio(optimistic(calibrated, REGIONS)) <= worst
    assert checked >= 4


def towers_and_loops(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """``towers`` beside a while loop of tiny kernels (launch-bound: its trips cost what
    the mode makes them cost) and a cond."""

    def step(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        i, x = carry
        for _ in range(6):
            x = jnp.tanh(x @ x)
        return i + 1, x

    trips = (b[0, 0] > 0).astype(jnp.int32) + 3  # traced: the loop stays a loop
    _, looped = jax.lax.while_loop(lambda carry: carry[0] < trips, step, (0, a[:8, :8]))
    branch = jax.lax.cond(b[0, 0] > 0, lambda y: jnp.tanh(y @ y), lambda y: y * 2.0, b)
    return towers(a, b, c) + looped.sum() + branch.sum()


def test_estimates_sharing_a_memo_equal_fresh_ones() -> None:
    """The memo the estimates of one call share (each equation's kernel time, each nested
    level's span per mode) changes no figure: every mode's estimate of its plan, and of
    the plain program, equals a fresh model's, in whichever order they run."""
    args = towers_args()
    closed = jax.make_jaxpr(towers_and_loops)(*args)
    settings = Options.create(target="gpu").resolve("gpu")
    analysis = Analysis(settings)
    jaxpr, _ = run_passes(closed, analysis=analysis)
    costs = analysis.costs
    plans = {mode: plan_jaxpr(jaxpr, analysis.with_settings(
        settings.priced_in(mode))) for mode in (LHS, CONCURRENT, OFF)}
    fresh = {mode: estimate_seconds(plan, costs, mode) for mode, plan in plans.items()}
    plain = {mode: estimate_plain_seconds(closed, costs, mode) for mode in plans}
    # The modes price this program differently, so a memo mixing them up would show.
    assert len(set(fresh.values())) > 1 and len(set(plain.values())) > 1
    for order in ((LHS, CONCURRENT, OFF), (OFF, CONCURRENT, LHS)):
        memo: IdentityMemo[Any, Any] = IdentityMemo()
        for mode in order:
            assert estimate_plain_seconds(closed, costs, mode, memo) == plain[mode]
            assert estimate_seconds(plans[mode], costs, mode, memo) == fresh[mode]


def test_built_in_figures_change_no_mode() -> None:
    """With the GPU model's built-in figures (public third-party measurements, none on an
    H100/H200) small independent kernels win in concurrent_regions mode at the nominal
    figures, not at the pessimistic end of their ranges: the user's mode is kept, and the
    plan says both ends."""
    plan = jaxpar.inspect(fan, target="gpu")(*specs(fan_args()))
    assert plan.xla_options == {}
    assert plan.mode is not None and not plan.mode.chosen and plan.mode.mode is LHS
    assert not plan.mode.measured
    assert plan.mode.estimate(REGIONS) < plan.mode.estimate(LHS) * (1 - MIN_GAIN)
    ends = plan.mode.ends_of(REGIONS)
    assert ends is not None
    assert ends.optimistic_ratio < 1 - MIN_GAIN < ends.pessimistic_ratio
    # The short form has no mode line where jaxpar keeps the mode; the long form says why.
    assert "XLA options" not in plan.text()
    text = plan.text(verbose=True)
    assert "at the pessimistic end of their ranges" in text
    assert "estimated, not measured on a GPU" in text
    assert plan.to_dict()["mode"]["ends"][0]["mode"] == "concurrent_regions"
    towers_plan = jaxpar.inspect(towers, target="gpu")(*specs(towers_args()))
    assert towers_plan.xla_options == {}


def test_small_independent_kernels_use_concurrent_regions_on_a_calibrated_gpu(
        calibrated: Any) -> None:
    plan = jaxpar.inspect(fan, target="gpu")(*specs(fan_args()))
    assert plan.xla_options == REGIONS_OPTIONS
    assert plan.mode is not None and plan.mode.mode is REGIONS and plan.mode.measured
    ends = plan.mode.ends_of(REGIONS)
    assert ends is not None and ends.pessimistic_ratio <= 1 - MIN_GAIN
    short = plan.text()
    assert ("  XLA options: xla_gpu_command_buffer_scheduling_mode='CONCURRENT_REGIONS': this "
            "function's CUDA graphs run in concurrent_regions mode (the process's: lhs): its "
            "small independent kernels run as parallel CUDA-graph nodes") in short.splitlines()
    assert "figures calibrated on this GPU; jaxpar's program with CUDA graphs in " \
           "concurrent_regions mode, jax.jit's in the process's lhs" in short
    text = plan.text(verbose=True)
    assert "XLA options: xla_gpu_command_buffer_scheduling_mode='CONCURRENT_REGIONS'" in text
    assert "over the model's ranges" in text and "not measured" not in text
    assert plan.mode.plain_seconds is not None
    assert plan.mode.estimate(REGIONS) < plan.mode.plain_seconds
    assert plan.to_dict()["xla_options"] == REGIONS_OPTIONS
    # Matmul chains fill the GPU: nothing of theirs runs beside anything, at any end.
    towers_plan = jaxpar.inspect(towers, target="gpu")(*specs(towers_args()))
    assert towers_plan.xla_options == {}


def test_a_mode_over_the_memory_budget_is_refused(calibrated: Any) -> None:
    plan = jaxpar.inspect(fan, target="gpu", memory=0)(*specs(fan_args()))
    assert plan.xla_options == {}
    assert plan.mode is not None and "concurrent_regions mode would need" in plan.mode.reason
    assert plan.memory is not None and plan.memory.allowed_bytes == 0


def test_only_a_mode_that_gains_is_priced_for_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory model is asked about a candidate mode only where it gains at the nominal
    figures (``choose_mode`` never keeps another, nor cites its memory): the chain's
    candidates gain nothing, so only the plain program and the plan are priced, in the
    user's mode; the plan and its figures are those the model gives when every mode is
    priced (the memory of the chosen program)."""
    from jaxpar._model.memory import MemoryModel

    asked: list[Any] = []
    temp_bytes = MemoryModel.temp_bytes

    def counted(self: MemoryModel, jaxpr: Any, mode: Any, sections: Any = ()) -> float:
        asked.append(mode)
        return temp_bytes(self, jaxpr, mode, sections)

    monkeypatch.setattr(MemoryModel, "temp_bytes", counted)
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    plan = jaxpar.inspect(chain, target="gpu")(x)
    assert plan.mode is not None and not plan.mode.chosen
    assert plan.mode.estimate(REGIONS) is not None  # judged, at its nominal figures
    assert set(asked) == {plan.mode.user_mode}, asked
    assert plan.memory is not None and plan.memory.jaxpar_bytes > 0


def test_a_chain_keeps_the_users_mode() -> None:
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    plan = jaxpar.inspect(chain, target="gpu")(x)
    assert plan.xla_options == {}
    assert plan.mode is not None and not plan.mode.chosen
    assert "XLA options" not in plan.text() and "XLA options: none" in plan.text(verbose=True)
    # Graphs off is no candidate without stream regions holding loops (launched one by
    # one, the chain's first kernel would start sooner than after the graph's launch).
    assert plan.mode.estimate(OFF) is None and plan.mode.estimate(REGIONS) is not None
    assert plan.mode.estimate(CONCURRENT) is None  # never better than concurrent_regions


def test_cpu_target_is_unchanged() -> None:
    args = towers_args()
    plan = jaxpar.inspect(towers, target="cpu")(*specs(args))
    assert plan.mode is None and plan.xla_options == {}
    assert "XLA options" not in plan.text()
    fn = jaxpar.parallel_branches(towers, target="cpu")
    np.testing.assert_array_equal(fn(*args), jax.jit(towers)(*args))
    assert fn._state.jitted_with == {}


def test_mode_steps_share_a_pass_s_first_visit_between_modes_that_price_alike() -> None:
    """``ModeSteps``: a pass that prices no launch takes its step in every mode; one that
    prices launches only in a mode pricing them alike (graphs off and LHS: serially),
    unless it said it decides alike, or decides exactly as in the other pricing (then it
    gets the other's step, the level it rebuilt included). Never at another path."""
    settings = Options().resolve("gpu")
    lhs, off, regions = (settings.priced_in(m) for m in (
        CommandBufferMode.LHS, CommandBufferMode.OFF, CommandBufferMode.CONCURRENT_REGIONS))
    level = jax.make_jaxpr(jnp.sin)(1.0)
    plain = Pass("plain", lambda lv, a: LevelResult(), lambda s: True, "prices no launch")
    priced = dataclasses.replace(plain, name="priced", prices_launches=True)
    alike = dataclasses.replace(plain, name="alike", prices_launches=True)
    steps = ModeSteps()
    kept = {}
    for row in (plain, priced, alike):
        assert steps.find(row, level, "/", lhs) is None
        kept[row.name] = Step(level, [], [])
        assert steps.keep(row, level, "/", lhs, kept[row.name], row is alike) is kept[row.name]
    assert steps.find(plain, level, "/", regions) is kept["plain"]
    assert steps.find(alike, level, "/", regions) is kept["alike"]
    assert steps.find(priced, level, "/", off) is kept["priced"]
    assert steps.find(priced, level, "/", regions) is None
    assert steps.find(plain, level, "/scan#0.jaxpr", lhs) is None
    # Run again in the branching pricing, it decided as before: the first step is taken.
    assert steps.keep(priced, level, "/", regions, Step(level, [], []), False) is kept["priced"]
    assert steps.find(priced, level, "/", regions) is kept["priced"]


# --------------------------------------------------------------------------- the option


def test_users_mode_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    shapes = specs(towers_args())
    keep = jaxpar.inspect(towers, target="gpu", command_buffers="keep")(*shapes)
    assert keep.xla_options == {} and "command_buffers='keep'" in keep.mode.reason
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_scheduling_mode=LHS")
    flags = jaxpar.inspect(towers, target="gpu")(*shapes)
    assert flags.xla_options == {} and "XLA_FLAGS" in flags.mode.reason
    # An explicit option overrides XLA_FLAGS for this function.
    off = jaxpar.inspect(towers, target="gpu", command_buffers="off")(*shapes)
    assert off.xla_options == {"xla_gpu_enable_command_buffer": ""}
    assert off.mode.mode is OFF


def test_forced_streams_keep_the_users_mode_and_say_so() -> None:
    # force_streams plans the sections in the process's mode, with "auto" too: the reason
    # names it (it named only XLA_FLAGS and command_buffers='keep', neither of them set).
    plan = jaxpar.inspect(towers, target="gpu", force_streams=True)(*specs(towers_args()))
    assert plan.xla_options == {} and not plan.mode.chosen
    assert "force_streams=True" in plan.mode.reason


@pytest.mark.parametrize("value", ["fast", "CONCURRENT", None, 1])
def test_bad_mode_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match=r"command_buffers must be one of 'auto', 'keep'"):
        jaxpar.parallel_branches(towers, command_buffers=value)
    with pytest.raises(ValueError, match=r"command_buffers must be one of"):
        jaxpar.inspect(towers, command_buffers=value)


def test_mode_enum_is_accepted() -> None:
    fn = jaxpar.parallel_branches(towers, target="gpu", command_buffers=CONCURRENT)
    assert fn.options.command_buffers == "concurrent"


def test_calls_use_the_chosen_options_and_stay_exact(calibrated: Any) -> None:
    args = fan_args()
    fn = jaxpar.parallel_branches(fan, target="gpu")
    np.testing.assert_array_equal(fn(*args), jax.jit(fan)(*args))
    # Top-level calls run in their environment's jits, which carry the plan's options.
    assert [fast.options for fast in fn._state.memos.fast_by_mode.values()] == [
        tuple(REGIONS_OPTIONS.items())]
    assert fn._state.jitted_with == {}
    # Under grad the call is a nested jit, which takes no compiler options (jax 0.10).
    with pytest.warns(jaxpar.XlaOptionsNotAppliedWarning):
        got = jax.grad(lambda a: fn(a, *args[1:]))(args[0])
    want = jax.grad(lambda a: fan(a, *args[1:]))(args[0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert command_buffer_options("serialize") == {
        "xla_gpu_command_buffer_scheduling_mode": "SERIALIZE"}


def test_an_outer_jit_that_drops_the_options_is_warned_about_once(calibrated: Any) -> None:
    import warnings

    args = fan_args()
    fn = jaxpar.parallel_branches(fan, target="gpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(*args)  # at the top level: its own jit carries the options
        assert not caught
        step = jax.jit(lambda *xs: fn(*xs) * 2.0)
        np.testing.assert_allclose(step(*args), 2.0 * jax.jit(fan)(*args), rtol=1e-6)
        jax.jit(lambda *xs: fn(*xs) + 1.0)(*args)  # another outer jit: warned already
    lost = [w for w in caught if issubclass(w.category, jaxpar.XlaOptionsNotAppliedWarning)]
    assert len(lost) == 1
    message = str(lost[0].message)
    assert "`fan`" in message and "CONCURRENT_REGIONS" in message
    assert "compiler_options=jaxpar.inspect(fan)(*args).xla_options" in message
    # The remedy: the outer jit compiled with the plan's options.
    options = jaxpar.inspect(fn)(*specs(args)).xla_options
    assert options == REGIONS_OPTIONS
    jax.jit(lambda *xs: fn(*xs) * 2.0, compiler_options=options)(*args)
    # A mode the user set is not jaxpar's choice; nor is the process's own mode.
    for mode in ("keep", "lhs"):
        kept = jaxpar.parallel_branches(fan, target="gpu", command_buffers=mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.jit(kept)(*args)
        assert not [w for w in caught
                    if issubclass(w.category, jaxpar.XlaOptionsNotAppliedWarning)]


# --------------------------------------------------------------------------- deviceless


def _parallel_sources(thunks: str) -> list[int]:
    """Per command buffer in an XLA thunk dump: its nodes with no predecessor."""
    counts: list[int] = []
    for line in thunks.splitlines():
        if "kCommandBuffer" in line:
            counts.append(0)
        elif counts and re.match(r"\s+\d+: \S+ \[source\b", line):
            counts[-1] += 1
    return counts


@needs_plugin
@pytest.mark.parametrize(("mode", "parallel"), [
    ("auto", True), ("concurrent_regions", True), ("concurrent", True), ("keep", False),
    ("lhs", False)])
def test_lowered_compile_uses_the_chosen_options(tmp_path: Path, mode: str, parallel: bool,
                                                 calibrated: Any) -> None:
    mesh = _compiled.make_gpu_mesh("h200", 1)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
              for s in specs(fan_args())]
    fn = jaxpar.parallel_branches(fan, target="gpu", command_buffers=mode)
    fn.lower(*shapes).compile(compiler_options={"xla_dump_to": str(tmp_path)})
    # XLA's dump of the debug options it compiled with (defaults, LHS, left out).
    debug = "".join(p.read_text() for p in tmp_path.glob("*.debug_options"))
    assert ("xla_gpu_command_buffer_scheduling_mode: CONCURRENT" in debug) is parallel
    assert ("CONCURRENT_REGIONS" in debug) is (mode in ("auto", "concurrent_regions"))
    # XLA's command buffer of the compiled executable: independent kernels are graph
    # nodes without a predecessor (parallel) only in the branching modes.
    thunks = "".join(p.read_text() for p in
                     tmp_path.glob("*thunk_sequence_after_thunk_passes.txt"))
    sources = _parallel_sources(thunks)
    assert sources, "no command buffer in the compiled executable"
    assert (max(sources) >= 2) is parallel, thunks[:2000]


# --------------------------------------------------------------------------- the suite

# GPU-suite programs, the cheapest to compile (docs/benchmarks.md).
SUITE = ["gptj_parallel_block", "attention", "inception_block", "slogdet_inv",
         "seed_002_two_scans", "siamese_grad"]


@pytest.fixture(scope="module")
def suite_results() -> dict[str, dict[str, Any]]:
    if not PLUGIN_OK:
        pytest.skip(PLUGIN_MESSAGE)
    # The GPU guard's compiles of these programs when it ran first (helpers).
    return {name: suite_evaluation(name) for name in SUITE}


@needs_plugin
def test_suite_programs_keep_xlas_mode_with_the_built_in_figures(
        suite_results: dict[str, dict[str, Any]]) -> None:
    """With figures nobody measured on this GPU, no suite program changes XLA's mode, and
    none is estimated slower than plain in it."""
    for name, result in suite_results.items():
        assert result["compile"] == "ok", (name, result["compile"])
        assert result["chosen_mode"] == "lhs" and result["xla_options"] == {}, name
        assert result["chosen_ratio"] <= 1.0, (name, result["verdict"])


def fan_or_chain(*xs: jax.Array) -> jax.Array:
    """``fan`` where the arguments' heights differ, a chain where they agree: one
    function whose signatures' plans choose different XLA options."""
    if len({x.shape for x in xs}) == 1:
        return chain(xs[0] @ xs[1].T).sum()
    return fan(*xs)


def chain_args() -> tuple[jax.Array, ...]:
    """Eight arrays of one shape: ``fan_or_chain`` runs the chain on them."""
    keys = jax.random.split(jax.random.PRNGKey(1), 8)
    return tuple(jax.random.normal(k, (64, 64)) / 64 for k in keys)


@pytest.mark.parametrize("first", ["fan", "chain"])
def test_each_signature_runs_under_the_options_its_plan_chose(
        first: str, monkeypatch: pytest.MonkeyPatch, calibrated: Any) -> None:
    """Top-level calls run in their environment's jit (``_dispatch.fast``), which compiles
    with the options of the first signature's plan (moved there from none before any
    signature ran in it, the plan looked up before the jit is chosen), in JAX's C++
    dispatch from then on. A signature whose plan chooses other options runs in the same
    jit made with its plan's options (``FastPath.with_options``), reached through the
    environment's jit's miss at every call."""
    from jaxpar._dispatch import fast

    fan_in = fan_args()
    chain_in = chain_args()
    inputs = {"fan": fan_in, "chain": chain_in}
    options = {"fan": tuple(REGIONS_OPTIONS.items()), "chain": ()}
    assert jaxpar.inspect(fan_or_chain, target="gpu")(*fan_in).xla_options == REGIONS_OPTIONS
    assert jaxpar.inspect(fan_or_chain, target="gpu")(*chain_in).xla_options == {}
    made: list[Any] = []  # each FastPath
    real = fast.FastPath
    monkeypatch.setattr(fast, "FastPath",
                        lambda *args, **kwargs: made.append(real(*args, **kwargs)) or made[-1])
    fn = jaxpar.parallel_branches(fan_or_chain, target="gpu")
    want = {name: jax.jit(fan_or_chain)(*args) for name, args in inputs.items()}
    second = "chain" if first == "fan" else "fan"
    for _ in range(2):
        np.testing.assert_allclose(fn(*inputs[first]), want[first], rtol=1e-5)
    assert [path.options for path in made] == [(), options[first]][:1 + (first == "fan")]
    assert made[-1].routed.cache_size() == 1  # compiled once, in the jit carrying its options
    assert jaxpar_frames(lambda: fn(*inputs[first])) == []
    np.testing.assert_allclose(fn(*inputs[second]), want[second], rtol=1e-5)
    environments = made[:-1]
    other = made[-1]
    assert other.options == options[second] and environments[-1].others == {
        options[second]: other}
    assert other.routed.cache_size() == 1
    for name in (first, second, first, second):
        np.testing.assert_allclose(fn(*inputs[name]), want[name], rtol=1e-5)
    frames = jaxpar_frames(lambda: fn(*inputs[second]))
    assert any(frame.endswith(":route") for frame in frames)
    assert not any(frame.endswith(":analyse") for frame in frames)
    assert environments[-1].routed.cache_size() == 2  # the second's entry sends it to Python
    assert other.routed.cache_size() == 1
    assert fn._state.jitted_with == {}
    assert fn._state.jitted._cache_size() == 0
    assert fn.analyses == 2


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_a_trace_under_a_transformation_is_not_taken_for_a_top_level_one(
        transform: str, monkeypatch: pytest.MonkeyPatch, calibrated: Any) -> None:
    """A signature traced under grad or vmap (in the jit transformations run, with the
    same key as a top-level call) and then called at the top level runs under its plan's
    options, though the key's earlier top-level signature chose none (found by review:
    jax's trace cache answered the top-level call without a trace to check)."""
    import warnings

    fan_in = fan_args()
    chain_in = chain_args()
    fn = jaxpar.parallel_branches(fan_or_chain, target="gpu")
    fn(*chain_in)  # the environment's jit compiles with no options
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxpar.XlaOptionsNotAppliedWarning)
        if transform == "grad":
            jax.grad(fn)(*fan_in)
        else:
            jax.vmap(fn)(*[x[None] for x in fan_in])
    np.testing.assert_allclose(fn(*fan_in), jax.jit(fan_or_chain)(*fan_in), rtol=1e-5)
    # Its plan's options found before the jit was chosen: the concurrent_regions jit.
    (environment,) = fn._state.memos.fast_by_mode.values()
    assert environment.others[tuple(REGIONS_OPTIONS.items())].routed.cache_size() == 1


def test_lowering_twice_keeps_the_plans_options(monkeypatch: pytest.MonkeyPatch,
                                                calibrated: Any) -> None:
    """``lower`` learns the options from a trace; a second ``lower`` of the same
    signature lowers with them too (its trace was cached, so it lowered without)."""
    from jaxpar._dispatch import StagedJits

    fn = jaxpar.parallel_branches(fan, target="gpu")
    asked: list[Any] = []
    staged = StagedJits.get
    monkeypatch.setattr(StagedJits, "get",
                        lambda self, options=None: asked.append(options)
                        or staged(self, options))
    for _ in range(2):
        fn.lower(*specs(fan_args()))
    assert asked == [None, REGIONS_OPTIONS] * 2
