"""Measuring by default (``parallel_branches(measure=...)``, ``jaxpar/_dispatch/measuring.py``):
the first call runs ``jax.jit``'s program and compiles nothing else; the candidates build
on the measuring thread (here a worker the test runs by hand, or the real thread); a later
call times them (a deterministic fake timer) and the winner runs from then on; decisions
are stored and a later decoration measures nothing; failures and contexts the thread
cannot share keep ``jax.jit``'s program. Values against ``jax.jit`` at every call."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.measuring import ManualWorker, compiles, fake_timer
from helpers.trees import assert_tree_close, assert_tree_equal
from jax import lax

import jaxpar
from jaxpar import _tune
from jaxpar._dispatch import decisions, measuring, shared

pytestmark = pytest.mark.usefixtures("private_decisions")

REWRITE = "jaxpar (chosen options)"
PLAIN = _tune.PLAIN


def loop(c, xs):
    """A scan whose TPU plan reads it by blocks (a program other than jax.jit's)."""
    return lax.scan(lambda c, x: (0.9 * c + 0.1 * jnp.sin(x), c[0]), c, xs)


C = np.linspace(0.0, 1.0, 8).astype(np.float32)
XS = np.linspace(-1.0, 1.0, 200 * 8).reshape(200, 8).astype(np.float32)


def drive(f: Any, manual: ManualWorker, *args: Any, calls: int = 3) -> list[Any]:
    """``calls`` calls, the measuring thread's work run after each (call 2 queues the
    build, call 3 decides); their results."""
    outs = []
    for _ in range(calls):
        outs.append(f(*(args or (C, XS))))
        manual.run()
    return outs


def measured_loop(**options: Any) -> jaxpar.ParallelBranches:
    return jaxpar.parallel_branches(loop, target="tpu", measure=True, **options)


def test_the_first_call_runs_jax_jits_program_and_plans_nothing(manual, monkeypatch):
    timed = fake_timer(monkeypatch, {REWRITE: 0.5})
    f = measured_loop()
    compiled = compiles()
    got = f(C, XS)
    assert_tree_equal(got, jax.jit(loop)(C, XS))  # jax.jit's program, bit for bit
    assert f.analyses == 0 and timed == []  # no plan, no timing before the call returned
    assert compiled.count("jit(loop)") == 2  # the call's own program, and jax.jit's above
    assert manual.tasks == []  # the build is queued at the next call, not beside this one
    assert f.tuning(C, XS).source == measuring.PENDING
    assert_tree_equal(f(C, XS), jax.jit(loop)(C, XS))
    assert len(manual.tasks) == 1


def test_a_faster_rewrite_is_measured_at_a_later_call_and_then_runs(manual, monkeypatch):
    timed = fake_timer(monkeypatch, {REWRITE: 0.5})
    f = measured_loop()
    want = jax.jit(loop)(C, XS)
    f(C, XS)
    assert manual.run() == 0  # nothing queued by the first call
    f(C, XS)
    assert manual.run() == 1  # the build: candidates traced, planned, compiled
    assert f.analyses >= 1 and timed == []
    assert_tree_equal(f(C, XS), want)  # the boundary call: timed, still jax.jit's result
    assert PLAIN in timed and REWRITE in timed
    tuning = f.tuning(C, XS)
    assert tuning.chosen == REWRITE and tuning.source == _tune.MEASURED
    assert tuning.measure_s is not None and tuning.measure_s >= 0
    assert "2.00x faster than jax.jit (x0.500)" in tuning.verdict()
    before = f._state.installed
    manual.run()  # the winner compiled into a fresh jit, then installed
    assert f._state.installed is not before
    assert_tree_close(f(C, XS), want, rtol=1e-5, atol=1e-6)
    # The installed jit runs the winner: its program is the plan's, not jax.jit's.
    assert f.lower(C, XS).as_text() != jax.jit(loop).lower(C, XS).as_text()
    timed.clear()
    f(C, XS)
    assert timed == []  # decided: nothing is timed again
    lines = jaxpar.inspect(f)(C, XS).text().splitlines()
    estimate = next(i for i, line in enumerate(lines) if "(estimated)" in line)
    assert lines[estimate + 1].startswith("  measured on ")  # beside the model's estimate
    assert sum("measured on" in line for line in lines) == 1


def test_a_slower_rewrite_is_never_kept(manual, monkeypatch):
    fake_timer(monkeypatch, {REWRITE: 1.5, "jaxpar unrolled by 8": 1.2,
                             "jaxpar unrolled by 16": 1.01})
    f = measured_loop()
    drive(f, manual, calls=2)
    installed = f._state.installed
    f(C, XS)
    assert manual.run() == 0  # nothing to compile: jax.jit's program stays installed
    assert f._state.installed is installed
    tuning = f.tuning(C, XS)
    assert tuning.chosen == PLAIN
    assert "no rewrite faster: kept jax.jit's program" in tuning.verdict()
    assert_tree_equal(f(C, XS), jax.jit(loop)(C, XS))


def test_a_stored_decision_is_compiled_in_the_background_and_nothing_is_timed(
        manual, monkeypatch, private_decisions):
    fake_timer(monkeypatch, {REWRITE: 0.5})
    first = measured_loop()
    drive(first, manual)
    assert list(private_decisions.glob("*.json"))
    shared.forget_shared_states()  # as in a new process
    timed = fake_timer(monkeypatch, {})
    second = measured_loop()
    assert second._state is not first._state
    drive(second, manual)
    assert timed == []
    tuning = second.tuning(C, XS)
    assert tuning.chosen == REWRITE and tuning.source == _tune.STORED
    assert_tree_close(second(C, XS), jax.jit(loop)(C, XS), rtol=1e-5, atol=1e-6)


def test_where_every_candidate_is_jax_jits_program_nothing_is_timed(manual, monkeypatch):
    timed = fake_timer(monkeypatch, {})

    def matmuls(a, b):
        return jnp.tanh(a @ b) @ b

    f = jaxpar.parallel_branches(matmuls, target="tpu", measure=True)
    a = jnp.ones((16, 16))
    drive(f, manual, a, a)
    assert timed == []
    tuning = f.tuning(a, a)
    assert tuning.chosen == PLAIN and tuning.source == measuring.NOTHING_TO_MEASURE
    assert "nothing to measure" in tuning.verdict()


def test_a_failed_build_keeps_jax_jits_program_and_says_why(manual, monkeypatch):
    fake_timer(monkeypatch, {REWRITE: 0.5})

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(measuring, "candidate_programs", broken)
    f = measured_loop()
    for out in drive(f, manual):
        assert_tree_equal(out, jax.jit(loop)(C, XS))
    tuning = f.tuning(C, XS)
    assert tuning.chosen == PLAIN
    assert "not measured: building the candidates failed (RuntimeError: no compiler today)" \
        in tuning.verdict()


def test_a_context_the_measuring_thread_does_not_share_is_not_measured(monkeypatch):
    """The real thread: a call under ``default_matmul_precision`` traces otherwise than
    the thread would."""
    timed = fake_timer(monkeypatch, {REWRITE: 0.5})
    f = measured_loop()
    with jax.default_matmul_precision("highest"):
        want = jax.jit(loop)(C, XS)
        for _ in range(3):
            assert_tree_equal(f(C, XS), want)
            assert measuring.wait_idle(120)
        tuning = f.tuning(C, XS)
    assert timed == []
    assert tuning.chosen == PLAIN and "JAX context manager" in tuning.verdict()


def test_the_real_thread_decides_and_switches(monkeypatch):
    fake_timer(monkeypatch, {REWRITE: 0.5})
    f = measured_loop()
    want = jax.jit(loop)(C, XS)
    plain_text = jax.jit(loop).lower(C, XS).as_text()
    first = None
    for _ in range(4):
        assert_tree_close(f(C, XS), want, rtol=1e-5, atol=1e-6)
        first = first or f._state.installed
        assert measuring.wait_idle(120)
    assert f.tuning(C, XS).chosen == REWRITE
    assert f._state.boundary is None and f._state.installed is not first  # switched
    assert f.lower(C, XS).as_text() != plain_text


def test_a_built_signature_not_called_again_stops_holding_the_boundary(manual, monkeypatch):
    fake_timer(monkeypatch, {REWRITE: 0.5})
    f = measured_loop()
    once = XS[:100]
    f(C, once)  # called once (a last partial batch): registered
    for _ in range(measuring.BOUNDARY_CALLS + 8):
        f(C, XS)
        manual.run()
    assert f.tuning(C, XS).chosen == REWRITE
    assert f._state.boundary is None  # the other signature's build no longer holds it
    assert f.tuning(C, once).source == measuring.PENDING  # built, never timed: jax.jit's
    assert_tree_equal(f(C, once), jax.jit(loop)(C, once))


def test_the_first_call_on_target_gpu_plans_nothing_and_compiles_jax_jits_program(manual):
    f = jaxpar.parallel_branches(loop, target="gpu", measure=True)
    assert_tree_equal(f(C, XS), jax.jit(loop)(C, XS))
    assert f.analyses == 0  # no plan made for the first call, nor its XLA options
    assert f._state.memos.fast_by_mode and all(  # no move to a plan's options
        not path.options for path in f._state.memos.fast_by_mode.values())
    sines = jax.jit(loop).lower(C, XS).as_text().count("stablehlo.sine")
    assert f.lower(C, XS).as_text().count("stablehlo.sine") == sines


def test_under_a_transformation_a_decision_is_reused_else_jax_jits_program_runs(
        manual, monkeypatch):
    fake_timer(monkeypatch, {PLAIN: 1.0, REWRITE: 0.5})
    f = measured_loop()

    def loss(c):
        return jnp.sum(f(c, XS)[0])

    def plain_loss(c):
        return jnp.sum(loop(c, XS)[0])

    plain_text = jax.jit(jax.grad(plain_loss)).lower(C).as_text()
    before = jax.jit(jax.grad(loss)).lower(C).as_text()
    assert manual.tasks == []  # a traced call measures nothing
    # Unmeasured: jax.jit's program (one trip's multiplies, rolled), not the plan's (read
    # by blocks: a block's trips unrolled).
    ops = plain_text.count("stablehlo.multiply")
    assert before.count("stablehlo.multiply") == ops
    drive(f, manual)
    assert f.tuning(C, XS).chosen == REWRITE
    after = jax.jit(jax.grad(loss)).lower(C).as_text()
    assert after.count("stablehlo.multiply") > ops  # the decision at these shapes, reused
    assert_tree_close(jax.jit(jax.grad(loss))(C), jax.jit(jax.grad(plain_loss))(C),
                      rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["False", "environment"])
def test_measuring_off(manual, monkeypatch, how):
    timed = fake_timer(monkeypatch, {REWRITE: 0.5})
    if how == "environment":
        monkeypatch.setenv(measuring.MEASURE_VARIABLE, "0")
        f = measured_loop()
    else:
        f = jaxpar.parallel_branches(loop, target="tpu", measure=False)
    want = jaxpar.parallel_branches(loop, target="tpu", measure=False).lower(C, XS).as_text()
    f(C, XS)
    f(C, XS)
    assert manual.tasks == [] and timed == []
    assert f.lower(C, XS).as_text() == want  # the model's plan from the first call
    assert f.tuning(C, XS) is None


def test_auto_is_off_on_a_cpu_for_every_target(manual, monkeypatch):
    fake_timer(monkeypatch, {REWRITE: 0.5})
    for target in ("tpu", "gpu", "cpu", "auto"):
        f = jaxpar.parallel_branches(loop, target=target)
        assert f.measure == "auto"
        f(C, XS)
        assert manual.tasks == [] and f.tuning(C, XS) is None


@pytest.mark.parametrize("bad", ["yes", 1, None, "on"])
def test_measure_takes_auto_true_or_false(bad):
    with pytest.raises(ValueError, match=r"measure=.*'auto'.*True.*False"):
        jaxpar.parallel_branches(loop, measure=bad)


def test_donating_functions_are_measured_and_the_call_keeps_its_donation(
        manual, monkeypatch):
    fake_timer(monkeypatch, {REWRITE: 0.5})
    f = jaxpar.parallel_branches(loop, target="tpu", measure=True, donate_argnums=0)
    donating = jax.jit(loop, donate_argnums=0)
    probe = jnp.asarray(C)
    donating(probe, XS)
    want = jax.jit(loop)(C, XS)
    for _ in range(4):
        c = jnp.asarray(C)
        assert_tree_close(f(c, XS), want, rtol=1e-5, atol=1e-6)
        # The call donates as jax.jit does on this backend (the timing ran before it).
        assert c.is_deleted() == probe.is_deleted()
        manual.run()
    assert f.tuning(jnp.asarray(C), XS).chosen == REWRITE


def test_a_report_of_a_decision_in_words():
    rows = tuple(_tune.Measured(c.label, None, 0) for c in _tune.CANDIDATES)
    tuning = _tune.Tuning(PLAIN, rows, measuring.NOT_MEASURED, "k", why="the reason")
    assert tuning.lines() == ["  not measured: the reason"]
    pending = _tune.Tuning("", rows, measuring.PENDING, "k")
    assert pending.verdict() == "measuring"


def test_a_program_with_side_effects_is_not_timed_and_runs_jax_jits_program(manual, monkeypatch):
    timed = fake_timer(monkeypatch, {REWRITE: 0.5})
    printed: list[Any] = []

    def noisy(c, xs):
        jax.debug.callback(lambda v: printed.append(float(v)), c[0])
        return loop(c, xs)

    f = jaxpar.parallel_branches(noisy, target="tpu", measure=True)
    want = jax.jit(loop)(C, XS)
    for out in drive(f, manual, calls=4):
        assert_tree_close(out, want, rtol=1e-5, atol=1e-6)
    jax.effects_barrier()
    assert timed == [] and len(printed) == 4  # one print a call: nothing ran twice
    tuning = f.tuning(C, XS)
    assert tuning.chosen == PLAIN and "side effects" in tuning.verdict()
    assert "jax.jit's program runs" in tuning.verdict()


def test_a_program_with_a_pure_callback_in_its_loop_is_not_timed(manual, monkeypatch):
    # pure_callback has no effect in the jaxpr; timing would call the host thousands of
    # times (found by an adversarial session: 1,230 calls of it in one deciding call).
    timed = fake_timer(monkeypatch, {REWRITE: 0.5})
    host_calls: list[int] = []

    def host(v):
        host_calls.append(1)
        return np.asarray(v * 0.5, np.float32)

    def with_host(c, xs):
        def step(carry, x):
            half = jax.pure_callback(host, jax.ShapeDtypeStruct((), jnp.float32), x.sum())
            return carry * 0.5 + half, half
        return loop(c, xs), jax.lax.scan(step, jnp.float32(0), xs)

    f = jaxpar.parallel_branches(with_host, target="tpu", measure=True)
    want = jax.jit(with_host)(C, XS)
    host_calls.clear()
    for out in drive(f, manual, calls=4):
        assert_tree_close(out, want, rtol=1e-5, atol=1e-6)
    assert timed == [] and len(host_calls) == 4 * len(XS)  # each call's steps, once
    tuning = f.tuning(C, XS)
    assert tuning.chosen == PLAIN and "pure_callback" in tuning.verdict()


def test_two_signatures_each_decide_once(manual, monkeypatch):
    timed = fake_timer(monkeypatch, {REWRITE: 0.5})
    f = measured_loop()
    short = XS[:100]
    for _ in range(4):
        f(C, XS)
        manual.run()
        f(C, short)
        manual.run()
    assert PLAIN in timed
    assert f.tuning(C, XS).chosen == REWRITE and f.tuning(C, short).chosen == REWRITE
    timed.clear()
    installed = f._state.installed
    for _ in range(2):
        f(C, XS)
        f(C, short)
        manual.run()
    assert timed == [] and f._state.installed is installed  # nothing decided or switched again
    assert_tree_close(f(C, short), jax.jit(loop)(C, short), rtol=1e-5, atol=1e-6)


def test_a_while_loop_of_unknown_trips_gets_a_candidate(manual, monkeypatch):
    """A Newton iteration to tolerance: the candidate running 4 guarded body copies a
    trip is built, timed, and runs where it was measured faster; values as jax.jit's."""
    label = "jaxpar, while loops by 4"
    timed = fake_timer(monkeypatch, {label: 0.6})

    def newton(x):
        def cond(c):
            return (jnp.abs(c[0] * c[0] - x).max() > 1e-4 * x.max()) & (c[1] < 100)

        return lax.while_loop(cond, lambda c: ((c[0] + x / c[0]) / 2, c[1] + 1), (x, 0))

    x = jnp.linspace(1.0, 50.0, 64)
    f = jaxpar.parallel_branches(newton, target="tpu", measure=True)
    want = jax.jit(newton)(x)
    for out in drive(f, manual, x, calls=4):
        assert_tree_close(out, want, rtol=1e-6, atol=1e-6)
    assert label in timed and f.tuning(x).chosen == label
    text, plain = f.lower(x).as_text(), jax.jit(newton).lower(x).as_text()
    assert text.count("stablehlo.while") == 1 and "stablehlo.select" in text
    # Four copies of the body's division a trip, the last three selected by the condition.
    assert text.count("stablehlo.divide") == 4 * plain.count("stablehlo.divide") > 0


class Recorded:
    """A fake output: waiting for it is recorded (``jax.block_until_ready`` calls its
    ``block_until_ready``)."""

    def __init__(self, events: list[str], label: str):
        self.events, self.label = events, label

    def block_until_ready(self) -> Recorded:
        self.events.append(f"wait {self.label}")
        return self


def test_a_timing_round_dispatches_k_calls_back_to_back_before_waiting():
    """The real timer: after the warm-up and one timed call each, every round dispatches
    ``round_calls`` calls of a candidate one after another and only then waits for them
    (as a loop of calls overlaps dispatch with execution), jax.jit's program and the
    rewrite alike, interleaved round by round."""
    events: list[str] = []

    def run(label: str) -> Any:
        def call() -> Recorded:
            events.append(f"call {label}")
            return Recorded(events, label)
        return call

    candidates = {c.label: c for c in _tune.CANDIDATES}
    programs = [_tune.Program(candidates[PLAIN], run(PLAIN)),
                _tune.Program(candidates[REWRITE], run(REWRITE))]
    budget = _tune.TuneBudget(seconds=0.0, min_repeats=3, max_repeats=3)
    tuning = _tune.measure(programs, "k", budget)
    calls = _tune.ROUND_CALLS  # a fake call takes microseconds: the most a round makes
    assert tuning.round_calls == calls
    assert f"rounds of {calls} back-to-back calls" in tuning.lines()[0]
    rounds = events[8:]  # the warm-up and the first timed call: call, wait, for each
    assert events[:8] == [f"{what} {label}" for label in (PLAIN, REWRITE)
                          for what in ("call", "wait")] * 2
    assert len(rounds) == 3 * 2 * 2 * calls
    for start in range(0, len(rounds), 2 * calls):
        label = rounds[start].split(" ", 1)[1]
        assert rounds[start:start + 2 * calls] == [f"call {label}"] * calls + [
            f"wait {label}"] * calls
    assert {row.runs for row in tuning.rows if row.median_s is not None} == {3 * calls}


def test_timing_back_to_back_calls_keeps_jax_jits_values_on_the_cpu():
    """The real timer and thread, a real program: decided from rounds of back-to-back
    calls, and every call returns jax.jit's values."""
    f = measured_loop()
    want = jax.jit(loop)(C, XS)
    for _ in range(4):
        assert_tree_close(f(C, XS), want, rtol=1e-5, atol=1e-6)
        assert measuring.wait_idle(300)
    tuning = f.tuning(C, XS)
    assert tuning.source == _tune.MEASURED and tuning.round_calls > 1
    assert all(row.runs % tuning.round_calls == 0 for row in tuning.rows)
    assert_tree_close(f(C, XS), want, rtol=1e-5, atol=1e-6)


def test_the_build_stops_at_its_deadline_and_what_was_built_is_timed(manual, monkeypatch):
    """A fake clock, 10 s a read: the first call "takes" 10 s and the deadline is 25 s
    (``BUILD_DEADLINE_MIN_S``; no multiple here), so after jax.jit's program and the plan
    (always built) only the next two in build order are: the unroll by 8 and by 16, not
    the loops rolled (built after them). What was built is timed and decided;
    the report says where the build stopped; values are jax.jit's at every call."""
    timed = fake_timer(monkeypatch, {"jaxpar unrolled by 8": 0.5})
    now = [0.0]

    def clock() -> float:
        now[0] += 10.0
        return now[0]

    monkeypatch.setattr(measuring, "_clock", clock)
    monkeypatch.setattr(measuring, "BUILD_DEADLINE_FACTOR", 0.0)
    monkeypatch.setattr(measuring, "BUILD_DEADLINE_MIN_S", 25.0)
    f = measured_loop()
    want = jax.jit(loop)(C, XS)
    for out in drive(f, manual, calls=4):
        assert_tree_close(out, want, rtol=1e-5, atol=1e-6)
    own = [c.label for c in _tune.CANDIDATES
           if c.targets is None or "tpu" in c.targets]
    tuning = f.tuning(C, XS)
    assert tuning.chosen == "jaxpar unrolled by 8"
    assert tuning.built is not None and tuning.built.startswith(f"built 4 of {len(own)} ")
    assert "stopped at the deadline (25 s)" in tuning.built
    assert tuning.built in "\n".join(tuning.lines())
    assert tuning.built in jaxpar.inspect(f)(C, XS).text()
    # Stored with the decision: a later process reads where its build stopped.
    stored = _tune.load(tuning.key)
    assert stored is not None and stored.source == _tune.STORED
    assert (stored.built, stored.round_calls) == (tuning.built, tuning.round_calls)
    assert "jaxpar without unrolling" not in timed and "jaxpar unrolled by 8" in timed
    assert tuning.row("jaxpar without unrolling").median_s is None
    assert_tree_close(f(C, XS), want, rtol=1e-5, atol=1e-6)


def test_the_deadline_is_a_multiple_of_the_first_call_at_least_some_seconds():
    assert measuring.build_deadline_s(0.1) == measuring.BUILD_DEADLINE_MIN_S
    assert measuring.build_deadline_s(10.0) == 10.0 * measuring.BUILD_DEADLINE_FACTOR
    assert [c.label for c in decisions.build_order()[:8]] == [
        PLAIN, REWRITE, "jaxpar unrolled by 8", "jaxpar, scan inputs hoisted, unrolled by 8",
        "jaxpar unrolled by 16", "jaxpar without unrolling", "jaxpar, linear scans associative",
        "jaxpar, scan inputs hoisted"]
    assert sorted(c.label for c in decisions.build_order()) == sorted(
        c.label for c in _tune.CANDIDATES)


def test_candidates_are_compiled_with_the_functions_donation_and_shardings(
        manual, monkeypatch):
    """The candidates' programs carry the function's jit options: donated arguments
    (``tf.aliasing_output``/``jax.buffer_donor``) and shardings (``sdy.sharding``/
    ``mhlo.sharding``); jax.jit's candidate is jax.jit's own program with the same
    options. Timing runs donate copies: every call returns jax.jit's values and donates
    its own argument as jax.jit does."""
    fake_timer(monkeypatch, {REWRITE: 0.5})
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    options = dict(donate_argnums=0, in_shardings=(device, device), out_shardings=device)
    f = jaxpar.parallel_branches(loop, target="tpu", measure=True, **options)
    reference = jax.jit(loop, **options)
    want = jax.jit(loop)(C, XS)
    probe = jnp.asarray(C)
    reference(probe, XS)
    programs: list[Any] = []
    for call in range(4):
        c = jnp.asarray(C)
        assert_tree_close(f(c, XS), want, rtol=1e-5, atol=1e-6)
        assert c.is_deleted() == probe.is_deleted()
        if call == 1:  # the build ran after the second call: the programs to time
            manual.run()
            programs = list(next(iter(f._tuner.pending.values())).programs)
        manual.run()
    assert f.tuning(jnp.asarray(C), XS).chosen == REWRITE
    built = {p.candidate.label: p.run for p in programs if p.run is not None}
    assert set(built) >= {PLAIN, REWRITE}
    for label, run in built.items():
        text = run.jitted.lower(C, XS).as_text()
        assert "tf.aliasing_output" in text or "jax.buffer_donor" in text, label
        assert "sdy.sharding" in text or "mhlo.sharding" in text, label
    assert built[PLAIN].jitted.lower(C, XS).as_text() == reference.lower(C, XS).as_text()
    # A round's runs donate their own copies, as many as DONATED_COPIES_BYTES allows.
    run = built[REWRITE].at([jnp.asarray(C), jnp.asarray(XS)])
    monkeypatch.setattr(decisions, "DONATED_COPIES_BYTES", 2 * C.nbytes)
    calls = run.fresh(8)
    assert len(calls) == 2
    for call in calls:
        assert_tree_close(call(), want, rtol=1e-5, atol=1e-6)
    assert not run.leaves[0].is_deleted()


def test_a_round_makes_calls_for_about_5_ms_at_most_8_and_1_gib_of_outputs():
    assert _tune.round_calls(1e-4) == _tune.ROUND_CALLS == 8
    assert _tune.round_calls(1e-3) == 5  # 5 ms a round
    assert _tune.round_calls(0.004) == 2
    assert _tune.round_calls(0.005) == _tune.round_calls(2.0) == 1  # a call a round
    assert _tune.round_calls(1e-4, out_bytes=_tune.ROUND_BYTES // 3) == 3
    assert _tune.round_calls(1e-4, out_bytes=2 * _tune.ROUND_BYTES) == 1


def test_a_build_stopped_before_any_rewrite_is_not_nothing_to_measure(
        manual, monkeypatch, private_decisions):
    """unroll=None: the plan is jax.jit's program, lax.scan's unroll by 8 is not. A
    deadline that stops the build after the two always built leaves no other program to
    time: that is not "every candidate compiles to jax.jit's program", and no decision is
    stored for later processes (they build again)."""
    timed = fake_timer(monkeypatch, {"jaxpar unrolled by 8": 0.5})
    monkeypatch.setattr(measuring, "BUILD_DEADLINE_FACTOR", 0.0)
    monkeypatch.setattr(measuring, "BUILD_DEADLINE_MIN_S", 0.0)
    f = measured_loop(unroll=None)
    for out in drive(f, manual, calls=4):
        assert_tree_equal(out, jax.jit(loop)(C, XS))
    tuning = f.tuning(C, XS)
    assert timed == []
    assert tuning.chosen == PLAIN and tuning.source != measuring.NOTHING_TO_MEASURE
    assert "stopped at the deadline" in tuning.verdict()
    assert not list(private_decisions.rglob("*.json"))


def failing_build(monkeypatch: pytest.MonkeyPatch, label: str, message: str) -> None:
    """The candidate ``label``'s build raises ``RuntimeError(message)``."""
    built = decisions._built

    def breaking(state: Any, key: Any, leaves: Any, candidate: Any, *rest: Any) -> Any:
        if candidate.label == label:
            raise RuntimeError(message)
        return built(state, key, leaves, candidate, *rest)

    monkeypatch.setattr(decisions, "_built", breaking)


def test_a_candidate_that_cannot_be_built_is_left_out_and_named(manual, monkeypatch):
    """One candidate whose build raises (a pass that cannot rewrite this program) is not
    timed; the others are, the decision is made, and tuning() names it and the error.
    jax.jit's program and the plan are built as the call builds them (their errors are
    the call's)."""
    fake_timer(monkeypatch, {"jaxpar unrolled by 8": 0.5})
    failing_build(monkeypatch, "jaxpar unrolled by 16", "this pass cannot rewrite it")
    f = measured_loop()
    for out in drive(f, manual, calls=4):
        assert_tree_close(out, jax.jit(loop)(C, XS), rtol=1e-5, atol=1e-6)
    tuning = f.tuning(C, XS)
    assert tuning.chosen == "jaxpar unrolled by 8" and tuning.source == _tune.MEASURED
    row = tuning.row("jaxpar unrolled by 16")
    assert row.median_s is None and row.runs == 0
    assert tuning.built == ("1 could not be built, not timed: 'jaxpar unrolled by 16' "
                            "(RuntimeError: this pass cannot rewrite it)")
    assert tuning.built in "\n".join(tuning.lines())


def test_under_tune_a_candidate_that_cannot_be_built_never_breaks_the_call(monkeypatch):
    failing_build(monkeypatch, "jaxpar unrolled by 8", "no")
    f = jaxpar.parallel_branches(loop, target="tpu", tune=True)
    assert_tree_close(f(C, XS), jax.jit(loop)(C, XS), rtol=1e-5, atol=1e-6)
    assert f.tuning(C, XS).row("jaxpar unrolled by 8").runs == 0
