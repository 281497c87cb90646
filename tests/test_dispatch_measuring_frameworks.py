"""Measuring by default with Flax NNX modules and Equinox modules as arguments
(``jaxpar/_dispatch/fast.py``'s split calls, ``measuring.py``): measured like any other
call. The first call traces the function once, as ``jax.jit``/``nnx.jit``/
``eqx.filter_jit`` do; candidates are timed on the call's split state; the decision is
reached at a later call; values equal ``nnx.jit``'s and ``eqx.filter_jit``'s at every
call; the state an NNX call changes is written back at every call, the measured ones
included."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.measuring import fake_timer
from helpers.trees import assert_tree_close, assert_tree_equal
from jax import lax

import jaxpar
from jaxpar import _tune
from jaxpar._dispatch import measuring

pytestmark = pytest.mark.usefixtures("private_decisions")

REWRITE = "jaxpar (chosen options)"
PLAIN_LABEL = _tune.PLAIN
STEPS = 64


def counting(fun: Any) -> tuple[Any, list[int]]:
    """``fun`` counting its Python calls (each one a trace)."""
    count = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return fun(*args, **kwargs)

    return counted, count


def rnn_module(nnx: Any) -> Any:
    """A small NNX RNN over ``STEPS`` steps (a scan the TPU plan reads by blocks), counting
    its calls in a BatchStat (state the call changes)."""

    class Rnn(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.cell = nnx.Linear(16, 16, rngs=rngs)
            self.inputs = nnx.Linear(4, 16, rngs=rngs)
            self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

        def __call__(self, xs: jax.Array) -> jax.Array:
            self.calls[...] += 1

            def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
                h = jnp.tanh(self.cell(h) + self.inputs(x))
                return h, h

            return lax.scan(step, jnp.zeros((2, 16)), xs)[1]

    return Rnn(nnx.Rngs(0))


def run_model(model: Any, xs: jax.Array) -> jax.Array:
    return model(xs)


XS = jax.random.normal(jax.random.key(1), (STEPS, 2, 4))
# The two ways an NNX call runs: in nnx.jit (arrays and Python scalars beside the
# objects), or split by jaxpar into its flat jit (other values beside them: here a NumPy
# array, as a string or a config object would).
INPUTS = {"nnx.jit": XS, "split": np.asarray(XS)}


def decisions_traced(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each program traced from now on runs a rewrite (the tuner's decided key)."""
    seen: list[bool] = []
    decided = measuring.MeasuringTuner.decided_key

    def spy(self: Any, state: Any, key: Any, leaves: Any) -> Any:
        out = decided(self, state, key, leaves)
        seen.append(out.rewrite)
        return out

    monkeypatch.setattr(measuring.MeasuringTuner, "decided_key", spy)
    return seen


@pytest.mark.parametrize("inputs", sorted(INPUTS))
def test_an_nnx_rnn_is_measured_and_its_state_updates_are_kept(manual, monkeypatch, inputs):
    nnx = pytest.importorskip("flax.nnx")
    timed = fake_timer(monkeypatch, {REWRITE: 0.5})
    traced = decisions_traced(monkeypatch)
    xs = INPUTS[inputs]
    ours, theirs = rnn_module(nnx), rnn_module(nnx)
    f = jaxpar.parallel_branches(run_model, target="tpu", measure=True)
    reference = nnx.jit(run_model)
    for call in range(1, 7):
        got = f(ours, xs)
        assert_tree_close(got, reference(theirs, XS), rtol=1e-5, atol=1e-6)
        assert int(ours.calls[...]) == int(theirs.calls[...]) == call  # written back
        if call == 1:
            assert f.analyses == 0 and timed == []  # jax.jit's program, nothing planned
            assert traced == [False]
            assert f.tuning(ours, xs).source == measuring.PENDING
        if call == 3:  # the boundary that decided: timed on the split state, written back
            assert PLAIN_LABEL in timed and REWRITE in timed
        manual.run()
    tuning = f.tuning(ours, xs)
    assert tuning.chosen == REWRITE and tuning.source == _tune.MEASURED
    assert "2.00x faster than jax.jit (x0.500)" in tuning.verdict()
    # After the switch the call's path traced the function again, running the winner.
    assert traced[-1] is True
    assert "measured on " in jaxpar.inspect(f)(ours, xs).text()
    timed.clear()
    f(ours, xs)
    assert timed == []  # decided once


def test_an_nnx_call_that_no_rewrite_beats_keeps_jax_jits_program(manual, monkeypatch):
    nnx = pytest.importorskip("flax.nnx")
    fake_timer(monkeypatch, {REWRITE: 1.5, "jaxpar unrolled by 8": 1.2,
                             "jaxpar unrolled by 16": 1.1})
    ours, theirs = rnn_module(nnx), rnn_module(nnx)
    f = jaxpar.parallel_branches(run_model, target="tpu", measure=True)
    for _ in range(4):
        assert_tree_equal(f(ours, XS), nnx.jit(run_model)(theirs, XS))  # bit for bit
        manual.run()
    tuning = f.tuning(ours, XS)
    assert tuning.chosen == PLAIN_LABEL and "no rewrite faster" in tuning.verdict()


def equinox_model(eqx: Any) -> Any:
    """An Equinox module with a function field and an int field (static leaves of
    jaxpar's, as eqx.filter_jit makes them) around a scan."""

    class Scanner(eqx.Module):
        cell: eqx.nn.Linear
        activation: Any
        steps: int

        def __call__(self, xs: jax.Array) -> jax.Array:
            def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
                h = self.activation(self.cell(h) + x)
                return h, h

            return lax.scan(step, jnp.zeros(8), xs[: self.steps])[1]

    return Scanner(eqx.nn.Linear(8, 8, key=jax.random.key(2)), jnp.tanh, STEPS)


def test_an_equinox_module_is_measured(manual, monkeypatch):
    eqx = pytest.importorskip("equinox")
    timed = fake_timer(monkeypatch, {REWRITE: 0.5})
    model = equinox_model(eqx)
    xs = jnp.asarray(np.asarray(jax.random.normal(jax.random.key(3), (STEPS, 8))))
    f = jaxpar.parallel_branches(run_model, target="tpu", measure=True)
    want = eqx.filter_jit(run_model)(model, xs)
    for call in range(1, 5):
        assert_tree_close(f(model, xs), want, rtol=1e-5, atol=1e-6)
        if call == 1:
            assert f.analyses == 0 and timed == []
        manual.run()
    tuning = f.tuning(model, xs)
    assert tuning.chosen == REWRITE and tuning.source == _tune.MEASURED
    # A second signature of the same structure (remembered split) is measured too.
    short = xs[: STEPS // 2]
    model_short = eqx.tree_at(lambda m: m.steps, model, STEPS // 2)
    for _ in range(3):
        assert_tree_close(f(model_short, short), eqx.filter_jit(run_model)(model_short, short),
                          rtol=1e-5, atol=1e-6)
        manual.run()
    assert f.tuning(model_short, short).chosen == REWRITE


def test_the_first_call_traces_the_function_as_often_as_jax_jit(manual):
    x = jnp.linspace(0.0, 1.0, 32)

    def body(x: jax.Array) -> jax.Array:
        return lax.scan(lambda c, v: (c * 0.9 + v, c), 0.0, x)[1]

    counted, count = counting(body)
    jax.jit(counted)(x)
    assert count == [1]
    count[0] = 0
    jaxpar.parallel_branches(counted, target="tpu", measure=True)(x)
    assert count == [1]  # one trace: jax.jit's, of the function as it is


def test_the_first_nnx_and_equinox_calls_trace_as_often_as_their_jits(manual):
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    counted, count = counting(run_model)
    nnx.jit(counted)(rnn_module(nnx), XS)
    want = count[0]
    count[0] = 0
    jaxpar.parallel_branches(counted, target="tpu", measure=True)(rnn_module(nnx), XS)
    assert count[0] == want == 1
    xs = jnp.zeros((STEPS, 8))
    count[0] = 0
    eqx.filter_jit(counted)(equinox_model(eqx), xs)
    want = count[0]
    count[0] = 0
    jaxpar.parallel_branches(counted, target="tpu", measure=True)(equinox_model(eqx), xs)
    assert count[0] == want == 1


def holder_module(nnx: Any, steps: int) -> Any:
    """An NNX module holding its inputs: a call passes the module alone (the NNX path
    then runs nnx.jit's program, also for a module of tracers under an outer trace).
    One class for every call (the path is chosen by the arguments' types)."""
    if "Holder" not in _HOLDER:

        class Holder(nnx.Module):
            def __init__(self, steps: int) -> None:
                self.xs = nnx.Param(jnp.linspace(-1.0, 1.0, steps * 4).reshape(steps, 4))

            def __call__(self) -> jax.Array:
                return lax.scan(lambda c, x: (0.9 * c + 0.1 * jnp.sin(x), c[0]),
                                jnp.zeros(4), self.xs[...])[1]

        _HOLDER["Holder"] = Holder
    return _HOLDER["Holder"](steps)


_HOLDER: dict[str, Any] = {}


def call_holder(model: Any) -> jax.Array:
    return model()


def summed(inner: Any) -> Any:
    def outer(model: Any) -> jax.Array:
        return inner(model).sum()

    return outer


def test_an_nnx_call_under_nnx_jit_is_not_measured_and_runs(manual, monkeypatch):
    # The first top-level call installs the NNX router; a call of a new signature under
    # an outer nnx.jit then traces the function anew with tracers in the module: no call
    # to measure (it raised ConcretizationTypeError registering it): it runs as
    # nnx.jit's would and registers nothing.
    nnx = pytest.importorskip("flax.nnx")
    fake_timer(monkeypatch, {REWRITE: 0.5})
    f = jaxpar.parallel_branches(call_holder, target="tpu", measure=True)
    f(holder_module(nnx, STEPS))
    manual.run()
    got = nnx.jit(summed(f))(holder_module(nnx, STEPS // 2))  # a new signature
    want = nnx.jit(summed(call_holder))(holder_module(nnx, STEPS // 2))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    tuner = f._state.tuner
    assert len(tuner.pending) + len(tuner.decisions) == 1  # the top-level signature only


def test_a_decorated_nnx_function_calling_another_is_measured(manual, monkeypatch):
    # The inner function's call under the outer one's trace leaves the outer's 'traced
    # anew' for it: the outer signature is registered (measured), the inner's traced
    # call is not (it raised ConcretizationTypeError registering the inner one).
    nnx = pytest.importorskip("flax.nnx")
    fake_timer(monkeypatch, {REWRITE: 0.5})
    inner = jaxpar.parallel_branches(call_holder, target="tpu", measure=True)
    inner(holder_module(nnx, STEPS))  # installs its NNX router
    manual.run()
    outer = jaxpar.parallel_branches(summed(inner), target="tpu", measure=True)
    got = outer(holder_module(nnx, STEPS))
    want = nnx.jit(summed(call_holder))(holder_module(nnx, STEPS))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert len(outer._state.tuner.pending) == 1
    assert len(inner._state.tuner.pending) + len(inner._state.tuner.decisions) == 1


def test_a_split_calls_first_call_time_is_what_its_build_deadline_counts(manual, monkeypatch):
    # The build's deadline is a multiple of the first call (trace, compile, run). A call
    # jaxpar splits (NNX objects, an Equinox module) registers its signature after it
    # ran; its first call's time is still what is counted.
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    started: list[float] = []
    original = measuring.MeasuringTuner.start

    def start(self: Any, state: Any, pending: Any, *first_call_s: Any) -> None:
        original(self, state, pending, *first_call_s)
        started.append(pending.first_call_s)

    monkeypatch.setattr(measuring.MeasuringTuner, "start", start)

    def slow(model: Any, xs: jax.Array) -> jax.Array:
        time.sleep(0.3)  # a trace of 0.3 s at least
        return run_model(model, xs)

    jaxpar.parallel_branches(slow, target="tpu", measure=True)(rnn_module(nnx), XS)
    jaxpar.parallel_branches(slow, target="tpu", measure=True)(equinox_model(eqx),
                                                               jnp.zeros((STEPS, 8)))
    assert len(started) == 2 and min(started) >= 0.3


def test_a_split_call_that_cannot_be_registered_runs_and_tuning_says_why(manual, monkeypatch):
    # Registering a split call for measuring raised: the call still runs jax.jit's
    # program, every call, and tuning() says why these shapes are not measured.
    eqx = pytest.importorskip("equinox")
    model = equinox_model(eqx)
    xs = jnp.asarray(np.asarray(jax.random.normal(jax.random.key(3), (STEPS, 8))))

    def broken(self: Any, state: Any, key: Any, leaves: Any) -> Any:
        raise RuntimeError("no room for it")

    monkeypatch.setattr(measuring.MeasuringTuner, "register", broken)
    f = jaxpar.parallel_branches(run_model, target="tpu", measure=True)
    want = eqx.filter_jit(run_model)(model, xs)
    for _ in range(3):
        assert_tree_close(f(model, xs), want, rtol=1e-5, atol=1e-6)
        manual.run()
    tuning = f.tuning(model, xs)
    assert tuning.chosen == PLAIN_LABEL and tuning.source == measuring.NOT_MEASURED
    assert tuning.why == ("these shapes could not be registered for measuring "
                          "(RuntimeError: no room for it): they run jax.jit's program")
