"""The tuner (``parallel_branches(f, tune=True)``, ``jaxpar/_tune.py``): the decision rule
under a deterministic fake timer, the stored decision and its key, and a second process
that compiles only the winner."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.calls import jaxpar_frames
from helpers.trees import assert_tree_close, assert_tree_equal
from jax import lax

import jaxpar
from jaxpar import _tune

REWRITE = "jaxpar (chosen options)"


def step(carry, x):
    return 0.9 * carry + 0.1 * jnp.sin(x), carry[0]


def loop(c, xs):
    """A scan that ``unroll=4`` unrolls by 4: a program other than plain's."""
    return lax.scan(step, c, xs)


C = np.linspace(0.0, 1.0, 8).astype(np.float32)
XS = np.linspace(-1.0, 1.0, 20 * 8).reshape(20, 8).astype(np.float32)


@pytest.fixture(autouse=True)
def tune_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "tune"
    monkeypatch.setenv(_tune.TUNE_DIR_VARIABLE, str(directory))
    return directory


def fake_timer(monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float]) -> list[str]:
    """Times every candidate as ``seconds[label]`` (still running it); returns the labels
    timed, in order."""
    timed: list[str] = []

    def timer(label, run):
        jax.block_until_ready(run())
        timed.append(label)
        return seconds[label]

    monkeypatch.setattr(_tune, "_timer", timer)
    return timed


def no_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    def timer(label, run):
        raise AssertionError(f"the tuner measured {label!r} where a decision was stored")

    monkeypatch.setattr(_tune, "_timer", timer)


def tuned_loop() -> jaxpar.ParallelBranches:
    return jaxpar.parallel_branches(loop, target="cpu", unroll=4, tune=True)


def test_plain_jit_wins_when_the_rewrite_is_no_faster(monkeypatch):
    timed = fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 1.0})
    f = tuned_loop()
    assert_tree_equal(f(C, XS), jax.jit(loop)(C, XS))
    tuning = f.tuning(C, XS)
    assert tuning.chosen == "jax.jit" and tuning.source == "measured"
    # The other jaxpar candidates are the same program on the CPU: timed once.
    assert set(timed) == {"jax.jit", REWRITE}
    assert tuning.row("jaxpar (user's mode)").same_as == REWRITE
    assert tuning.ratio("jaxpar without matmul batching") == 1.0


def test_a_rewrite_inside_the_noise_margin_loses(monkeypatch):
    fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 1.0 - _tune.MARGIN / 2})
    assert tuned_loop().tuning(C, XS).chosen == "jax.jit"


def test_a_faster_rewrite_is_chosen_and_runs(monkeypatch):
    fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 0.5})
    f = tuned_loop()
    assert_tree_close(f(C, XS), jax.jit(loop)(C, XS))
    tuning = f.tuning(C, XS)
    assert tuning.chosen == REWRITE and tuning.ratio(REWRITE) == 0.5
    # What runs is the rewrite: its trace has the unrolled scan.
    assert "unroll=4" in str(jax.make_jaxpr(f)(C, XS))
    plan = jaxpar.inspect(f)(C, XS)
    assert plan.tuning == tuning
    assert f"* {REWRITE}" in str(plan) and "x0.500" in str(plan)
    assert plan.to_dict()["tuning"]["chosen"] == REWRITE


def test_candidates_are_timed_with_the_functions_donation(monkeypatch):
    """tune=True times the programs the call runs: compiled with its donation (each timed
    run donates copies), so the call's own argument is donated as jax.jit donates it,
    and the values are jax.jit's."""
    from jaxpar._dispatch import decisions

    fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 0.5})
    built: list[Any] = []
    programs = decisions.candidate_programs

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = programs(*args, **kwargs)
        built.extend(p for p in out if p.run is not None)
        return out

    monkeypatch.setattr(decisions, "candidate_programs", spy)
    f = jaxpar.parallel_branches(loop, target="cpu", unroll=4, tune=True, donate_argnums=0)
    probe = jnp.asarray(C)
    jax.jit(loop, donate_argnums=0)(probe, XS)
    c = jnp.asarray(C)
    assert_tree_close(f(c, XS), jax.jit(loop)(C, XS))
    assert c.is_deleted() == probe.is_deleted()
    assert f.tuning(C, XS).chosen == REWRITE
    assert {p.candidate.label for p in built} >= {"jax.jit", REWRITE}
    for program in built:
        text = program.run.jitted.lower(C, XS).as_text()
        assert "tf.aliasing_output" in text or "jax.buffer_donor" in text, program.candidate


@pytest.mark.parametrize("chosen", ["jax.jit", REWRITE])
def test_a_decided_signature_runs_in_jax_jits_own_dispatch(monkeypatch, chosen):
    """After the call that decides, the signature's calls run in its environment's jit
    (``_dispatch.fast``): the decided program, in JAX's C++ dispatch (no Python frame of
    jaxpar's, so no key built and no decision looked up), and nothing measured again."""
    timed = fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 0.5 if chosen == REWRITE
                                     else 1.0})
    f = tuned_loop()
    want = jax.jit(loop)(C, XS)
    assert_tree_close(f(C, XS), want)
    measured = list(timed)
    for _ in range(3):
        assert jaxpar_frames(lambda: f(C, XS)) == []
        assert_tree_close(f(C, XS), want)
    assert timed == measured
    (fast,) = f._state.memos.fast_by_mode.values()
    assert fast.routed.cache_size() == 1
    assert f.tuning(C, XS).chosen == chosen


def test_a_clear_loser_stops_early(monkeypatch):
    # Short times, so the budget's seconds buy plain the most repeats.
    timed = fake_timer(monkeypatch, {"jax.jit": 1e-3, REWRITE: 2e-3})
    tuning = tuned_loop().tuning(C, XS)
    budget = _tune.TuneBudget()
    assert tuning.chosen == "jax.jit"
    assert tuning.row(REWRITE).stopped_early
    # A round is 5 back-to-back calls (1 ms a call: 5 ms a round, ``_tune.ROUND_S``).
    assert tuning.round_calls == 5
    assert tuning.row(REWRITE).runs == budget.min_repeats * 5
    assert tuning.row("jax.jit").runs == budget.max_repeats * 5
    assert timed.count(REWRITE) == budget.min_repeats + 1  # and the warm-up


@pytest.mark.parametrize(("times", "chosen"), [
    ({"jax.jit": 1.0, "a": 1.2, "b": 1.1}, "jax.jit"),        # plain fastest
    ({"jax.jit": 1.0, "a": 0.9, "b": 0.5}, "b"),              # the fastest rewrite
    ({"jax.jit": 1.0, "a": 0.98}, "jax.jit"),                 # inside the 3% margin
    ({"jax.jit": 1.0, "a": 0.97}, "jax.jit"),                 # on it: plain
    ({"jax.jit": 1.0, "a": 0.969}, "a"),                      # past it
    ({"jax.jit": 1.0, "a": 0.5, "b": 0.5}, "a"),              # equal rewrites: the earlier
    ({"b": 0.5, "jax.jit": 1.0, "a": 0.5}, "b"),
    ({"jax.jit": 2e-3, "a": 1.5e-3}, "a"),                    # times, not ratios
    ({"jax.jit": 1.0}, "jax.jit"),
])
def test_choose(times, chosen):
    assert _tune.choose(times, _tune.MARGIN) == chosen


def test_choose_needs_plain():
    with pytest.raises(ValueError, match=r"plain jax\.jit"):
        _tune.choose({"a": 1.0}, _tune.MARGIN)


def test_a_clear_loser_is_not_chosen_when_load_rises_after_it_stopped(monkeypatch):
    """The rewrite takes twice plain's time in every round, and is stopped after
    ``min_repeats`` rounds; then the machine gets four times slower and plain goes on
    alone. Its median time ends above the stopped rewrite's, its per-round ratios do not:
    the decision compares per-round ratios, and a stopped candidate never wins."""
    budget = _tune.TuneBudget()
    calls: list[str] = []

    def timer(label, run):
        jax.block_until_ready(run())
        # Two programs: two first timings, then rounds of two; the load rises after
        # min_repeats rounds (a round's two timings see the same load).
        load = 1.0 if len(calls) < 2 + 2 * budget.min_repeats else 4.0
        calls.append(label)
        return load * {"jax.jit": 1e-3, REWRITE: 2e-3}[label]

    monkeypatch.setattr(_tune, "_timer", timer)
    tuning = tuned_loop().tuning(C, XS)
    assert tuning.row(REWRITE).stopped_early
    assert tuning.row(REWRITE).runs == budget.min_repeats * tuning.round_calls
    # Medians alone would pick the rewrite: 2 ms against plain's 4 ms.
    assert tuning.row(REWRITE).median_s < tuning.row("jax.jit").median_s
    assert tuning.ratio(REWRITE) == 2.0 and tuning.ratio("jax.jit") == 1.0
    assert tuning.chosen == "jax.jit"


def test_a_faster_program_hit_by_load_in_its_first_rounds_is_not_stopped(monkeypatch):
    """Load hits the rewrite's runs in four of the first five rounds (four times slower);
    otherwise it takes half of plain's time. Its median ratio after five rounds is 2, but
    it was not slower in every round: it goes on, and wins."""
    budget = _tune.TuneBudget()
    runs: dict[str, int] = {"jax.jit": 0, REWRITE: 0}

    def timer(label, run):
        jax.block_until_ready(run())
        runs[label] += 1
        # The first timing of each program is not a round's: rounds are runs 2, 3, ...
        hit = label == REWRITE and runs[label] in (2, 3, 5, 6)
        return {"jax.jit": 1e-3, REWRITE: 0.5e-3}[label] * (4.0 if hit else 1.0)

    monkeypatch.setattr(_tune, "_timer", timer)
    tuning = tuned_loop().tuning(C, XS)
    assert not tuning.row(REWRITE).stopped_early
    assert tuning.row(REWRITE).runs == tuning.row("jax.jit").runs > budget.min_repeats
    assert tuning.chosen == REWRITE and tuning.ratio(REWRITE) == 0.5


def test_per_round_ratios_decide_under_drifting_load(monkeypatch):
    """The load drifts from round to round (one round in three four times slower); in
    each round the rewrite takes 0.9 of plain's time. The decision sees 0.9."""
    calls: list[str] = []

    def timer(label, run):
        jax.block_until_ready(run())
        load = 4.0 if (len(calls) // 2) % 3 == 2 else 1.0
        calls.append(label)
        return load * {"jax.jit": 1e-3, REWRITE: 0.9e-3}[label]

    monkeypatch.setattr(_tune, "_timer", timer)
    tuning = tuned_loop().tuning(C, XS)
    assert tuning.chosen == REWRITE
    assert tuning.ratio(REWRITE) == pytest.approx(0.9)
    assert not tuning.row(REWRITE).stopped_early


def test_a_stored_decision_without_ratios_still_loads(monkeypatch, tune_dir):
    """Decision files written before the rows carried ``ratio``: the ratio of the
    medians is shown instead."""
    fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 0.5})
    path = Path(tuned_loop().tuning(C, XS).path)
    document = json.loads(path.read_text())
    for row in document["rows"]:
        row.pop("ratio")
    path.write_text(json.dumps(document))
    no_timing(monkeypatch)
    stored = tuned_loop().tuning(C, XS)
    assert stored.source == "stored" and stored.chosen == REWRITE
    assert stored.row(REWRITE).ratio is None and stored.ratio(REWRITE) == 0.5


def test_under_an_outer_jit_the_decision_of_a_concrete_call_is_reused(monkeypatch):
    timed = fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 0.5})
    f = tuned_loop()
    # No decision yet: under tracing nothing is measured, and the plan runs.
    assert_tree_close(jax.jit(f)(C, XS), jax.jit(loop)(C, XS))
    assert "unroll=4" in str(jax.make_jaxpr(f)(C, XS))  # the plan, as without tuning
    assert timed == []
    assert_tree_close(f(C, XS), jax.jit(loop)(C, XS))
    assert "unroll=4" in str(jax.make_jaxpr(f)(C, XS))
    grads = jax.grad(lambda c: f(c, XS)[0].sum())(jnp.asarray(C))
    assert_tree_close(grads, jax.grad(lambda c: loop(c, XS)[0].sum())(jnp.asarray(C)))
    batched = jax.vmap(f, in_axes=(0, None))(np.stack([C, C]), XS)
    assert_tree_close(batched, jax.vmap(loop, in_axes=(0, None))(np.stack([C, C]), XS))


def test_plain_decision_runs_the_original_under_tracing(monkeypatch):
    fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 1.0})
    f = tuned_loop()
    f(C, XS)
    text = str(jax.make_jaxpr(f)(C, XS))
    assert "unroll=1" in text and "unroll=4" not in text


def test_a_stored_decision_is_reused_without_measuring(monkeypatch, tune_dir):
    fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 0.5})
    first = tuned_loop().tuning(C, XS)
    assert first.path is not None and Path(first.path).parent == tune_dir
    no_timing(monkeypatch)
    again = tuned_loop()
    assert_tree_close(again(C, XS), jax.jit(loop)(C, XS))
    stored = again.tuning(C, XS)
    assert stored.source == "stored" and stored.chosen == REWRITE and stored.key == first.key
    assert stored.rows == first.rows


def test_the_key_changes_with_shapes_dtypes_options_and_xla_flags(monkeypatch):
    fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 1.0})
    key = tuned_loop().tuning(C, XS).key
    assert tuned_loop().tuning(C, XS).key == key  # and is stable
    assert tuned_loop().tuning(C, XS[:12]).key != key
    assert tuned_loop().tuning(C.astype(np.float16), XS.astype(np.float16)).key != key
    other = jaxpar.parallel_branches(loop, target="cpu", unroll=2, tune=True)
    assert other.tuning(C, XS).key != key
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")
                       + " --xla_cpu_enable_fast_math=false")
    assert tuned_loop().tuning(C, XS).key != key


def test_the_key_ignores_object_addresses():
    assert _tune.fingerprint("f at 0x7f00aa") == _tune.fingerprint("f at 0x7f11bb")
    assert _tune.fingerprint("a") != _tune.fingerprint("b")


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "other"}),
                                     json.dumps([1, 2])])
def test_a_corrupt_decision_file_is_ignored_with_a_warning(monkeypatch, content):
    fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 0.5})
    path = Path(tuned_loop().tuning(C, XS).path)
    path.write_text(content)
    f = tuned_loop()
    with pytest.warns(_tune.TuneCacheWarning, match="corrupt decision file"):
        out = f(C, XS)
    assert_tree_close(out, jax.jit(loop)(C, XS))
    assert f.tuning(C, XS).source == "measured"
    assert json.loads(path.read_text())["chosen"] == REWRITE  # replaced by a good one


def test_an_unwritable_directory_warns_and_still_runs(monkeypatch, tmp_path):
    fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 0.5})
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(_tune.TUNE_DIR_VARIABLE, str(blocker / "tune"))
    f = tuned_loop()
    with pytest.warns(_tune.TuneCacheWarning, match="cannot store"):
        assert_tree_close(f(C, XS), jax.jit(loop)(C, XS))
    assert f.tuning(C, XS).path is None


def test_a_budget_is_an_option_and_checks_its_figures(monkeypatch):
    """``tune=jaxpar.TuneBudget(...)``: its rounds are what the decision used."""
    fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 3.0})
    budget = jaxpar.TuneBudget(min_repeats=3, max_repeats=3, loser_margin=100.0)
    f = jaxpar.parallel_branches(loop, target="cpu", unroll=4, tune=budget)
    assert f.tune is budget
    assert f.tuning(C, XS).row("jax.jit").runs == 3
    for bad, field in [({"combine": "mean"}, "combine"), ({"margin": 1.5}, "margin"),
                       ({"min_repeats": 5, "max_repeats": 2}, "min_repeats"),
                       ({"seconds": -1.0}, "seconds"), ({"loser_margin": -0.1}, "loser_margin")]:
        with pytest.raises(ValueError, match=field):
            jaxpar.TuneBudget(**bad)


@pytest.mark.parametrize("how", ["option", "environment"])
def test_read_only_without_a_stored_decision_runs_the_plan_unmeasured(monkeypatch, how,
                                                                      tune_dir):
    no_timing(monkeypatch)
    if how == "environment":
        monkeypatch.setenv(_tune.READ_ONLY_VARIABLE, "1")
    f = jaxpar.parallel_branches(loop, target="cpu", unroll=4,
                                 tune=jaxpar.TuneBudget(read_only=how == "option"))
    with pytest.warns(jaxpar.TuneCacheWarning, match="read-only and no stored decision"):
        got = f(C, XS)
    assert_tree_equal(got, jaxpar.parallel_branches(loop, target="cpu", unroll=4)(C, XS))
    tuning = f.tuning(C, XS)
    assert (tuning.source, tuning.chosen) == (_tune.UNMEASURED, REWRITE)
    assert not tune_dir.exists() or list(tune_dir.iterdir()) == []
    assert "not measured" in jaxpar.inspect(f)(C, XS).text()


@pytest.mark.parametrize("callback", ["pure", "io", "debug"])
def test_a_program_calling_the_host_is_not_timed(monkeypatch, callback, tune_dir):
    # Timing repeats a call thousands of times: a pure_callback's host function ran 7,242
    # times in one tuned first call (found by a review), where jax.jit runs it 20 times.
    from jax.experimental import io_callback

    no_timing(monkeypatch)
    calls: list[int] = []

    def host(v):
        calls.append(1)
        return np.asarray(v, np.float32)

    def with_host(c, xs):
        def body(carry, x):
            if callback == "pure":
                x = jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
            elif callback == "io":
                x = io_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
            else:
                jax.debug.callback(host, x)
            return step(carry, x)
        return lax.scan(body, c, xs)

    f = jaxpar.parallel_branches(with_host, target="cpu", unroll=4, tune=True)
    with pytest.warns(jaxpar.TuneCacheWarning, match="calls the host"):
        got = f(C, XS)
    jax.effects_barrier()
    assert len(calls) == len(XS)  # one call's steps, once each
    assert_tree_close(got, jax.jit(with_host)(C, XS))
    tuning = f.tuning(C, XS)
    assert (tuning.source, tuning.chosen) == (_tune.UNMEASURED, REWRITE)
    assert "calls the host" in tuning.verdict() and "the plan runs" in tuning.verdict()
    assert not tune_dir.exists() or list(tune_dir.iterdir()) == []


def test_read_only_runs_a_shipped_decision(monkeypatch, tune_dir):
    """Measured once, the file copied elsewhere, then only read there."""
    fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 0.5})
    tuned_loop()(C, XS)
    shipped = tune_dir.parent / "shipped"
    shipped.mkdir()
    for path in tune_dir.glob("*.json"):
        (shipped / path.name).write_text(path.read_text())
    monkeypatch.setenv(_tune.TUNE_DIR_VARIABLE, str(shipped))
    no_timing(monkeypatch)
    f = jaxpar.parallel_branches(loop, target="cpu", unroll=4,
                                 tune=jaxpar.TuneBudget(read_only=True))
    f(C, XS)
    tuning = f.tuning(C, XS)
    assert (tuning.source, tuning.chosen) == (_tune.STORED, REWRITE)


def test_decision_files_are_readable_by_their_owner_only(monkeypatch, tune_dir):
    fake_timer(monkeypatch, {"jax.jit": 1.0, REWRITE: 0.5})
    umask = os.umask(0o022)
    try:
        path = Path(tuned_loop().tuning(C, XS).path)
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o600
    # A file that replaces another (here a corrupt one a user made readable to all) is
    # written anew, readable by its owner only.
    path.write_text("{")
    os.chmod(path, 0o644)
    umask = os.umask(0o022)
    try:
        with pytest.warns(_tune.TuneCacheWarning, match="corrupt decision file"):
            again = Path(tuned_loop().tuning(C, XS).path)
    finally:
        os.umask(umask)
    assert again == path and path.stat().st_mode & 0o777 == 0o600
    assert json.loads(path.read_text())["processes"] == 1


def test_tune_must_be_a_bool():
    with pytest.raises(TypeError, match=r"tune must be True, False or a jaxpar\.TuneBudget"):
        jaxpar.parallel_branches(loop, tune="yes")


def test_without_tune_nothing_is_measured(monkeypatch):
    no_timing(monkeypatch)
    f = jaxpar.parallel_branches(loop, target="cpu", unroll=4)
    assert f.tuning(C, XS) is None
    assert jaxpar.inspect(f)(C, XS).tuning is None


CHILD = textwrap.dedent("""
    import json, logging, sys
    import jax, numpy as np
    from jax import lax
    import jax.numpy as jnp
    import jaxpar
    from jaxpar import _tune

    def step(carry, x):
        return 0.9 * carry + 0.1 * jnp.sin(x), carry[0]

    def loop(c, xs):
        return lax.scan(step, c, xs)

    def timer(label, run):
        if sys.argv[1] == "second":
            raise AssertionError("measured in the second process")
        jax.block_until_ready(run())
        return {"jax.jit": 1.0}.get(label, 0.5)

    _tune._timer = timer
    compiles = []

    class Count(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Compiling "):
                compiles.append(record.getMessage().split(" with ")[0])

    logging.getLogger("jax").addHandler(Count())
    jax.config.update("jax_log_compiles", True)
    c = np.linspace(0.0, 1.0, 8).astype(np.float32)
    xs = np.linspace(-1.0, 1.0, 160).reshape(20, 8).astype(np.float32)
    f = jaxpar.parallel_branches(loop, target="cpu", unroll=4, tune=True)
    out = f(c, xs)
    tuning = f.tuning(c, xs)
    print("RESULT", json.dumps([tuning.source, tuning.chosen, compiles]))
    print("VALUES", json.dumps(np.asarray(out[0]).tolist()))
""")


def test_a_second_process_compiles_only_the_stored_winner(tmp_path, tune_dir):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, _tune.TUNE_DIR_VARIABLE: str(tune_dir), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(Path(jaxpar.__file__).parent.parent),
                                          os.environ.get("PYTHONPATH", "")])}

    def run(which):
        done = subprocess.run([sys.executable, str(script), which], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = dict(line.split(" ", 1) for line in done.stdout.splitlines()
                     if line.startswith(("RESULT ", "VALUES ")))
        return json.loads(lines["RESULT"]), json.loads(lines["VALUES"])

    (source, chosen, compiles), first_values = run("first")
    assert (source, chosen) == ("measured", REWRITE)
    assert len(compiles) >= 2, compiles  # plain and the rewrite, at least
    (source, chosen, compiles), second_values = run("second")
    assert (source, chosen) == ("stored", REWRITE)
    assert len(compiles) == 1, compiles
    assert second_values == first_values
    np.testing.assert_allclose(second_values, np.asarray(jax.jit(loop)(C, XS)[0]),
                               rtol=1e-6)


def test_log_compiles_counter_sees_compiles(caplog):
    """The subprocess test counts jax's "Compiling ..." records; check that they exist."""
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        jax.jit(lambda x: x * 3.0 + 1.0)(np.ones(3, np.float32))
    assert any(r.getMessage().startswith("Compiling ") for r in caplog.records)


def test_the_verdict_names_the_best_rewrite_that_was_eligible():
    """Beside a kept jax.jit program the verdict gives the model's plan's measured figure
    (the device's correction of the estimate) and the best rewrite that was eligible: one
    timed to the end (a stopped one's median of fewer, earlier rounds read x0.877 beside a
    kept jax.jit, on a loaded CPU), never a row that is jax.jit's own program."""
    rows = (_tune.Measured(_tune.PLAIN, 1.0, 8, ratio=1.0),
            _tune.Measured("jaxpar (chosen options)", 0.877, 4, stopped_early=True,
                           ratio=0.877),
            _tune.Measured("jaxpar unrolled by 8", 0.99, 8, ratio=0.99))
    tuning = _tune.Tuning(_tune.PLAIN, rows, _tune.MEASURED, key="k")
    assert tuning.verdict().endswith(
        "kept jax.jit's program (the model's plan x0.877; the best rewrite x0.990)")
    only_stopped = _tune.Tuning(_tune.PLAIN, rows[:2], _tune.MEASURED, key="k")
    assert only_stopped.verdict().endswith("kept jax.jit's program (the model's plan x0.877)")
    # A row that is jax.jit's own program is no rewrite.
    same = (*rows[:2], _tune.Measured("jaxpar without unrolling", None, 0,
                                      same_as=_tune.PLAIN))
    assert _tune.Tuning(_tune.PLAIN, same, _tune.MEASURED, key="k").verdict().endswith(
        "kept jax.jit's program (the model's plan x0.877)")
