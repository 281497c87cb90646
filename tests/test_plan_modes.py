"""The CUDA-graph mode per function (``jaxpar/_plan/modes.py``, issue 19 point 2).

On target ``"gpu"`` the plan chooses the mode a function is compiled in (XLA's default
``lhs``, ``concurrent`` graphs, or graphs ``off``) from the GPU model, and the choice
goes into that function's own ``jax.jit`` as ``compiler_options``. Checked here: the
choice and its margin, the option and its errors, a mode the user set is kept, nothing
changes on the CPU target, the options reach a deviceless H200 compile (XLA's own
dump of the compiled executable: its debug options and its command buffer's parallel
graph nodes), and a guard over GPU-suite programs that gain real concurrency.
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
from helpers import PLUGIN_MESSAGE, PLUGIN_OK, needs_plugin, suite_evaluation

import jaxpar
from jaxpar import _compiled
from jaxpar._analysis import Analysis
from jaxpar._flags import command_buffer_mode_set, command_buffer_options
from jaxpar._gpu_model import CommandBufferMode
from jaxpar._memo import IdentityMemo
from jaxpar._options import Options
from jaxpar._plan import plan_jaxpr
from jaxpar._plan.modes import MIN_GAIN, choose_mode, estimate_plain_seconds, estimate_seconds
from jaxpar.passes import run_passes

LHS, CONCURRENT, OFF = CommandBufferMode.LHS, CommandBufferMode.CONCURRENT, CommandBufferMode.OFF
CONCURRENT_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


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
    kept = choose_mode({LHS: 100e-6, CONCURRENT: 100e-6 * (1 - MIN_GAIN / 2), OFF: 2e-4}, LHS)
    assert (kept.mode, kept.chosen, kept.xla_options) == (LHS, False, {})
    assert "kept the process's lhs mode" in kept.reason
    chosen = choose_mode({LHS: 100e-6, CONCURRENT: 90e-6, OFF: 95e-6}, LHS)
    assert (chosen.mode, chosen.chosen) == (CONCURRENT, True)
    assert chosen.xla_options == CONCURRENT_OPTIONS
    assert "x0.900" in chosen.reason and "lhs mode" in chosen.reason
    off = choose_mode({LHS: 100e-6, CONCURRENT: 99e-6, OFF: 80e-6}, LHS)
    assert off.xla_options == {"xla_gpu_enable_command_buffer": ""}
    assert choose_mode({CONCURRENT: 10e-6, LHS: 9.9e-6}, CONCURRENT).mode is CONCURRENT


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
        dataclasses.replace(settings, command_buffers=mode))) for mode in (LHS, CONCURRENT, OFF)}
    fresh = {mode: estimate_seconds(plan, costs, mode) for mode, plan in plans.items()}
    plain = {mode: estimate_plain_seconds(closed, costs, mode) for mode in plans}
    # The modes price this program differently, so a memo mixing them up would show.
    assert len(set(fresh.values())) > 1 and len(set(plain.values())) > 1
    for order in ((LHS, CONCURRENT, OFF), (OFF, CONCURRENT, LHS)):
        memo: IdentityMemo[Any, Any] = IdentityMemo()
        for mode in order:
            assert estimate_plain_seconds(closed, costs, mode, memo) == plain[mode]
            assert estimate_seconds(plans[mode], costs, mode, memo) == fresh[mode]


def test_independent_work_is_compiled_in_concurrent_mode() -> None:
    plan = jaxpar.inspect(towers, target="gpu")(*specs(towers_args()))
    assert plan.xla_options == CONCURRENT_OPTIONS
    assert plan.mode is not None and plan.mode.mode is CONCURRENT
    assert plan.mode.estimate(CONCURRENT) < plan.mode.estimate(LHS) * (1 - MIN_GAIN)
    text = plan.text()
    assert "XLA options: xla_gpu_command_buffer_scheduling_mode='CONCURRENT'" in text
    assert "against" in text and "in the process's lhs mode" in text
    assert "concurrent graphs against the plain program in the user's lhs mode" in text
    assert plan.mode.plain_seconds is not None
    assert plan.mode.estimate(CONCURRENT) < plan.mode.plain_seconds
    assert plan.to_dict()["xla_options"] == CONCURRENT_OPTIONS


def test_a_chain_keeps_the_users_mode() -> None:
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    plan = jaxpar.inspect(chain, target="gpu")(x)
    assert plan.xla_options == {}
    assert plan.mode is not None and not plan.mode.chosen
    assert "XLA options: none" in plan.text()
    # Graphs off is no candidate without stream regions holding loops (launched one by
    # one, the chain's first kernel would start sooner than after the graph's launch).
    assert plan.mode.estimate(OFF) is None and plan.mode.estimate(CONCURRENT) is not None


def test_cpu_target_is_unchanged() -> None:
    args = towers_args()
    plan = jaxpar.inspect(towers, target="cpu")(*specs(args))
    assert plan.mode is None and plan.xla_options == {}
    assert "XLA options" not in plan.text()
    fn = jaxpar.parallel_branches(towers, target="cpu")
    np.testing.assert_array_equal(fn(*args), jax.jit(towers)(*args))
    assert fn._jitted_with == {}


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


def test_calls_use_the_chosen_options_and_stay_exact() -> None:
    args = towers_args()
    fn = jaxpar.parallel_branches(towers, target="gpu")
    np.testing.assert_allclose(fn(*args), jax.jit(towers)(*args), rtol=1e-5)
    assert list(fn._jitted_with) == [tuple(CONCURRENT_OPTIONS.items())]
    # Under grad the call is a nested jit, which takes no compiler options (jax 0.10).
    got = jax.grad(lambda a: fn(a, *args[1:]))(args[0])
    want = jax.grad(lambda a: towers(a, *args[1:]))(args[0])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert command_buffer_options("serialize") == {
        "xla_gpu_command_buffer_scheduling_mode": "SERIALIZE"}


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
    ("auto", True), ("concurrent", True), ("keep", False), ("lhs", False)])
def test_lowered_compile_uses_the_chosen_options(tmp_path: Path, mode: str,
                                                 parallel: bool) -> None:
    mesh = _compiled.make_gpu_mesh("h200", 1)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
              for s in specs(towers_args())]
    fn = jaxpar.parallel_branches(towers, target="gpu", command_buffers=mode)
    fn.lower(*shapes).compile(compiler_options={"xla_dump_to": str(tmp_path)})
    # XLA's dump of the debug options it compiled with (defaults, LHS, left out).
    debug = "".join(p.read_text() for p in tmp_path.glob("*.debug_options"))
    assert ("xla_gpu_command_buffer_scheduling_mode: CONCURRENT" in debug) is parallel
    # XLA's command buffer of the compiled executable: independent kernels are graph
    # nodes without a predecessor (parallel) only in the concurrent mode.
    thunks = "".join(p.read_text() for p in
                     tmp_path.glob("*thunk_sequence_after_thunk_passes.txt"))
    sources = _parallel_sources(thunks)
    assert sources, "no command buffer in the compiled executable"
    assert (max(sources) >= 2) is parallel, thunks[:2000]


# --------------------------------------------------------------------------- the suite

# GPU-suite programs whose plain program gains no concurrency in XLA's default mode and
# that jaxpar compiles in a mode where independent work really overlaps.
GAINING = [  # the cheapest to compile of the 18 in docs/benchmarks.md
    "gptj_parallel_block",
    "attention",
    "inception_block",
    "slogdet_inv",
    "seed_002_two_scans",
    "siamese_grad",
]


@pytest.fixture(scope="module")
def suite_results() -> dict[str, dict[str, Any]]:
    if not PLUGIN_OK:
        pytest.skip(PLUGIN_MESSAGE)
    # The GPU guard's compiles of these programs when it ran first (helpers).
    return {name: suite_evaluation(name) for name in GAINING}


@needs_plugin
def test_suite_programs_gain_real_concurrency(suite_results: dict[str, dict[str, Any]]
                                              ) -> None:
    gaining = []
    for name, result in suite_results.items():
        assert result["compile"] == "ok", (name, result["compile"])
        # Never worse than the plain program in the user's mode.
        assert result["chosen_ratio"] <= 1.0, (name, result["verdict"])
        if (not result["plain_runs_concurrently"] and result["runs_concurrently"]
                and result["chosen_ratio"] <= 1 - MIN_GAIN):
            gaining.append(name)
            assert result["xla_options"], name
    assert len(gaining) >= 6, {n: (r["chosen_mode"], r["chosen_ratio"])
                               for n, r in suite_results.items()}


def towers_or_chain(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """``towers`` where the arguments' widths differ, a chain of ``a`` where they agree:
    one function whose signatures' plans choose different XLA options."""
    if a.shape == b.shape == c.shape:
        return chain(a + b * c).sum()
    return towers(a, b, c)


def chain_args() -> tuple[jax.Array, ...]:
    """Three arrays of one width: ``towers_or_chain`` runs the chain on them."""
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    return tuple(jax.random.normal(k, (128, 128)) / 128 for k in keys)


@pytest.mark.parametrize("first", ["towers", "chain"])
def test_each_signature_runs_under_the_options_its_plan_chose(
        first: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call runs the jit its key's earlier signatures chose without looking its own plan
    up first (``_jit_for``); a new signature whose plan chooses other options is sent to
    its own jit, and from then on the key's calls look their plan up first."""
    from jaxpar import _api

    towers_in = towers_args()
    chain_in = chain_args()
    inputs = {"towers": towers_in, "chain": chain_in}
    assert jaxpar.inspect(towers_or_chain, target="gpu")(*towers_in).xla_options \
        == CONCURRENT_OPTIONS
    assert jaxpar.inspect(towers_or_chain, target="gpu")(*chain_in).xla_options == {}
    looked_up: list[int] = []
    jit_for = _api._jit_for
    monkeypatch.setattr(_api, "_jit_for",
                        lambda *a, **k: looked_up.append(1) or jit_for(*a, **k))
    fn = jaxpar.parallel_branches(towers_or_chain, target="gpu")
    want = {name: jax.jit(towers_or_chain)(*args) for name, args in inputs.items()}
    second = "chain" if first == "towers" else "towers"
    np.testing.assert_allclose(fn(*inputs[first]), want[first], rtol=1e-5)
    assert len(looked_up) == 1
    np.testing.assert_allclose(fn(*inputs[first]), want[first], rtol=1e-5)
    assert len(looked_up) == 1  # the remembered jit, run without a lookup
    np.testing.assert_allclose(fn(*inputs[second]), want[second], rtol=1e-5)
    assert len(looked_up) == 2  # sent back from the first signature's jit
    for name in (first, second, first, second):
        np.testing.assert_allclose(fn(*inputs[name]), want[name], rtol=1e-5)
    assert len(looked_up) == 6  # a key that saw two choices looks up every call
    # One entry per signature in each jit it ran in: the jit carrying its plan's
    # options, and the first signature's jit for the one sent back from it. Top-level
    # calls never run in the jit that transformations trace into.
    concurrent = fn._jitted_with[tuple(CONCURRENT_OPTIONS.items())]
    plain = fn._jitted_with[()]
    assert (plain._cache_size(), concurrent._cache_size()) == (
        (1, 2) if first == "towers" else (2, 1))
    assert fn._jitted._cache_size() == 0
    assert fn.analyses == 2


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_a_trace_under_a_transformation_is_not_taken_for_a_top_level_one(
        transform: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signature traced under grad or vmap (in the jit transformations run, with the
    same key as a top-level call) and then called at the top level runs under its plan's
    options, though the key's earlier top-level signature chose none (found by review:
    jax's trace cache answered the top-level call without a trace to check)."""
    from jaxpar import _api

    towers_in = towers_args()
    chain_in = chain_args()
    fn = jaxpar.parallel_branches(towers_or_chain, target="gpu")
    fn(*chain_in)  # the key remembers the jit with no options
    if transform == "grad":
        jax.grad(fn)(*towers_in)
    else:
        jax.vmap(fn)(*[x[None] for x in towers_in])
    staged: list[Any] = []
    cached_jit = _api._cached_jit
    monkeypatch.setattr(_api, "_cached_jit",
                        lambda cache, options, make: staged.append(options)
                        or cached_jit(cache, options, make))
    np.testing.assert_allclose(fn(*towers_in), jax.jit(towers_or_chain)(*towers_in),
                               rtol=1e-5)
    assert staged == [CONCURRENT_OPTIONS]  # sent back, then run in the concurrent jit
    assert fn._jitted_with[tuple(CONCURRENT_OPTIONS.items())]._cache_size() == 1


def test_lowering_twice_keeps_the_plans_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """``lower`` learns the options from a trace; a second ``lower`` of the same
    signature lowers with them too (its trace was cached, so it lowered without)."""
    from jaxpar._api import ParallelBranches

    fn = jaxpar.parallel_branches(towers, target="gpu")
    asked: list[Any] = []
    staged = ParallelBranches._staged
    monkeypatch.setattr(ParallelBranches, "_staged",
                        lambda self, options=None: asked.append(options)
                        or staged(self, options))
    for _ in range(2):
        fn.lower(*specs(towers_args()))
    assert asked == [None, CONCURRENT_OPTIONS] * 2
