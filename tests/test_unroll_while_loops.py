"""``unroll_while_loops``: k guarded runs of a ``while`` body per trip (``unroll_while=k``).

The rewritten loop must end on the original's final carry for every trip count (0, 1,
k-1, k, k+1, 3k+2, data-dependent ones, lanes of a ``vmap`` stopping apart), keep its
condition as the outer condition, hold k copies of the body (selected by the condition,
or under ``lax.cond`` where the body holds a ``while`` or a host callback), compose
with ``jvp`` and ``scan`` both ways, leave effects, inner loops and large bodies alone,
and refuse bad option values naming ``unroll_while``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from pass_checker import all_eqns, assert_matches, check_pass, count_primitive, eqns_of

import jaxpar
from jaxpar._options import Options
from jaxpar.passes import WHILE_SCOPE, apply_passes, unroll_while_loops

K = 4


def _counted(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``n`` trips (``n`` traced: no static trip count) of a body with one ``sin``."""
    def body(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        i, y = c
        return i + 1, jnp.sin(y) * 1.5 + 0.25
    return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))


def _growing(x: jax.Array) -> jax.Array:
    """Runs until ``|x|`` passes 10: how many trips depends on ``x``."""
    return lax.while_loop(lambda y: jnp.sum(y * y) < 100.0, lambda y: y * 1.5 + 0.1, x)


def _decorated(fun: Any, copies: int = K, **options: Any) -> Any:
    return jaxpar.parallel_branches(fun, unroll_while=copies, measure=False, **options)


def _whiles(jaxpr: Any) -> list[Any]:
    return [e for e in all_eqns(jaxpr) if e.primitive.name == "while"]


X = jnp.linspace(0.1, 0.9, 5, dtype=jnp.float32)


# ---------------------------------------------------------------- values and structure


@pytest.mark.parametrize("trips", [0, 1, K - 1, K, K + 1, 3 * K + 2])
def test_every_trip_count_ends_on_the_original_carry(trips: int) -> None:
    # The same arithmetic on the same values: bit-equal to the original jaxpr's carry.
    result = check_pass(partial(unroll_while_loops, unroll_while=K), _counted, X,
                        jnp.int32(trips), kinds=["unrolled"], grads=False, exact=True,
                        counts={"while": 1, "cond": 0, "select_n": 2 * (K - 1), "sin": K})
    (decision,) = result.decisions
    assert decision.unroll == K and decision.pass_name == "unroll_while_loops"
    assert f"selected by the loop's condition (computed past the stop and dropped: at most " \
           f"{K - 1} runs a loop)" in decision.reason
    # And jax.jit's values, through the decorator.
    got = _decorated(_counted)(X, jnp.int32(trips))
    assert_matches(got, jax.jit(_counted)(X, jnp.int32(trips)))
    assert int(got[0]) == trips


def _guarded_by_cond(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``_counted`` whose body holds a ``while`` (a fixed 2 trips, by a traced bound)."""
    def body(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        i, y = c
        two = lax.while_loop(lambda t: t[0] < n - n + 2,
                             lambda t: (t[0] + 1, jnp.sin(t[1])), (jnp.int32(0), y))[1]
        return i + 1, two * 1.5 + 0.25
    return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))


def test_the_outer_condition_is_the_loops_own_and_the_body_holds_k_copies() -> None:
    closed = jax.make_jaxpr(_counted)(X, jnp.int32(3))
    new, _ = unroll_while_loops(closed, unroll_while=3)
    (old_loop,), (loop,) = _whiles(closed), _whiles(new)
    old_cond = [e.primitive.name for e in eqns_of(old_loop.params["cond_jaxpr"])]
    assert [e.primitive.name for e in eqns_of(loop.params["cond_jaxpr"])] == old_cond
    body = eqns_of(loop.params["body_jaxpr"])
    # The first run unguarded, the next two selected by the condition: straight-line
    # code, three sines, each copy's carry kept where the condition (a `lt`) holds.
    assert sum(e.primitive.name == "sin" for e in body) == 3
    assert not [e for e in body if e.primitive.name == "cond"]
    selects = [e for e in body if e.primitive.name == "select_n"]
    tests = {e.outvars[0] for e in body if e.primitive.name == "lt"}
    assert len(selects) == 4 and len(tests) == 2
    assert all(e.invars[0] in tests for e in selects)
    # Before each guarded copy, the one carry the condition reads (the count, not the
    # vector) goes behind an optimization barrier.
    barriers = [e for e in body if e.primitive.name == "optimization_barrier"]
    assert [[v.aval.shape for v in e.invars] for e in barriers] == [[()], [()]]
    assert WHILE_SCOPE in str(loop.source_info.name_stack)
    # The user's line stays on the emitted equations.
    assert "test_unroll_while_loops.py" in str(jaxpar._compat.source_summary(loop))


def test_a_body_holding_a_while_runs_its_copies_under_cond() -> None:
    # An inner loop run on a stopped state need not end: its copies are branches.
    for trips in (0, 1, 3, 7):
        result = check_pass(partial(unroll_while_loops, unroll_while=3), _guarded_by_cond, X,
                            jnp.int32(trips), kinds=["left alone", "unrolled"], grads=False,
                            exact=True)
        (loop,) = [e for e in _whiles(result.new)
                   if WHILE_SCOPE in str(e.source_info.name_stack)]
        conds = [e for e in eqns_of(loop.params["body_jaxpr"]) if e.primitive.name == "cond"]
        assert len(conds) == 2  # the first run unguarded, the next two under the condition
        for guard in conds:  # one branch passes the carry on, the other runs the body
            inner = sorted(count_primitive(b, "while") for b in guard.params["branches"])
            assert inner == [0, 1]
        assert "lax.cond: the body holds a while loop" in result.decisions[1].reason
        assert_matches(_decorated(_guarded_by_cond, 3)(X, jnp.int32(trips)),
                       jax.jit(_guarded_by_cond)(X, jnp.int32(trips)))


def test_a_body_calling_the_host_runs_its_copies_under_cond() -> None:
    calls: list[int] = []

    def counted_on_host(v: Any) -> Any:
        calls.append(1)
        return np.asarray(v) * 0.5

    def program(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            y = jax.pure_callback(counted_on_host, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                  c[1])
            return c[0] + 1, y + 1.0
        return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))

    (decision,) = unroll_while_loops(jax.make_jaxpr(program)(X, jnp.int32(5)),
                                     unroll_while=K)[1]
    assert "lax.cond: the body holds a host callback" in decision.reason
    got = _decorated(program)(X, jnp.int32(5))
    assert len(calls) == 5  # once a trip, never past the stop
    assert_matches(got, jax.jit(program)(X, jnp.int32(5)))


def test_a_float_time_stops_on_jax_jits_trip() -> None:
    # t += h eight times is 0.07999999 in float32, so `t < 0.08` runs a ninth trip;
    # XLA folding the copies' adds into t + 2h, t + 3h ... would end at 0.08 a trip early.
    def integrate(y: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            return c[0] + 0.01, c[1] - 0.01 * c[1] * c[1]
        return lax.while_loop(lambda c: c[0] < 0.08, body, (jnp.float32(0.0), y))

    want = jax.jit(integrate)(X)
    assert float(want[0]) == pytest.approx(0.09, abs=1e-6)
    for copies in (2, 3, 4, 8):
        assert_matches(_decorated(integrate, copies)(X), want)


def test_a_float_time_tested_through_a_flag_stops_on_jax_jits_trip() -> None:
    # The condition reads a flag the body computes from t: t is tested too.
    def integrate(y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        def body(c: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[Any, Any, Any]:
            t = c[0] + 0.01
            return t, t >= 0.08, c[2] - 0.01 * c[2] * c[2]
        return lax.while_loop(lambda c: ~c[1], body, (jnp.float32(0.0), False, y))

    want = jax.jit(integrate)(X)
    assert float(want[0]) == pytest.approx(0.09, abs=1e-6)
    for copies in (2, 4):
        assert_matches(_decorated(integrate, copies)(X), want)
    batched = jnp.stack([X, X * 0.5])
    assert_matches(_decorated(jax.vmap(integrate))(batched), jax.jit(jax.vmap(integrate))(batched))
    # Both t and the flag pass the barrier; y does not.
    new, _ = unroll_while_loops(jax.make_jaxpr(integrate)(X), unroll_while=2)
    (loop,) = _whiles(new)
    (barrier,) = [e for e in eqns_of(loop.params["body_jaxpr"])
                  if e.primitive.name == "optimization_barrier"]
    assert sorted(str(v.aval.dtype) for v in barrier.invars) == ["bool", "float32"]


def test_a_custom_jvp_rule_holding_a_while_keeps_its_copies_under_cond() -> None:
    # The primal reads no loop, but a jvp of the program runs the rule's, which ends
    # only for r >= 0: past the stop r is -1.
    @jax.custom_jvp
    def step(y: jax.Array, r: jax.Array) -> jax.Array:
        return y + r

    @step.defjvp
    def step_jvp(primals: Any, tangents: Any) -> Any:
        y, r = primals
        z = lax.while_loop(lambda u: u != 0.0, lambda u: u - 1.0, r)
        return step(y, r), tangents[0] + z * tangents[1]

    def program(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
        return lax.while_loop(lambda c: c[0] < n, lambda c: (
            c[0] + 1, step(c[1], (n - 1 - c[0]).astype(jnp.float32))), (jnp.int32(0), x))

    closed = jax.make_jaxpr(program)(jnp.float32(0.5), jnp.int32(3))
    (decision,) = unroll_while_loops(closed, unroll_while=K)[1]
    assert "lax.cond: the body holds a while loop" in decision.reason
    decorated = _decorated(program)

    def first_output(f: Any) -> Any:
        return lambda x: f(x, jnp.int32(3))[1]

    got = jax.jvp(first_output(decorated), (jnp.float32(0.5),), (jnp.float32(1.0),))
    want = jax.jvp(first_output(jax.jit(program)), (jnp.float32(0.5),), (jnp.float32(1.0),))
    assert_matches(got, want)


def test_custom_jvp_rules_calling_their_own_function_are_selected() -> None:
    # jax.nn.relu's rule, and a user's, call the function they differentiate: reading
    # rules within rules would not end; the copies are selected, and jvp goes through.
    @jax.custom_jvp
    def shift(y: jax.Array) -> jax.Array:
        return y + 1.0

    @shift.defjvp
    def shift_jvp(primals: Any, tangents: Any) -> Any:
        return shift(primals[0]), tangents[0] * 1.0

    def program(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
        return lax.while_loop(lambda c: c[0] < n, lambda c: (
            c[0] + 1, jax.nn.relu(shift(c[1]) - 1.5)), (jnp.int32(0), x))

    result = check_pass(partial(unroll_while_loops, unroll_while=K), program, X,
                        jnp.int32(6), kinds=["unrolled"], grads=False, exact=True,
                        counts={"cond": 0})
    assert "selected by the loop's condition" in result.decisions[0].reason
    for n in (0, 3, 6):
        assert_matches(_decorated(program)(X, jnp.int32(n)), jax.jit(program)(X, jnp.int32(n)))
    got = jax.jvp(lambda x: _decorated(program)(x, jnp.int32(6))[1], (X,), (jnp.ones_like(X),))
    want = jax.jvp(lambda x: jax.jit(program)(x, jnp.int32(6))[1], (X,), (jnp.ones_like(X),))
    assert_matches(got, want)


def _runs_to(r: jax.Array) -> jax.Array:
    """Counts up to ``r``: ends only for ``r`` a whole number >= 0."""
    return lax.while_loop(lambda j: j != r, lambda j: j + 1.0, jnp.float32(0.0))


def _stepped(g: Any) -> Any:
    """A loop of ``n`` trips whose body calls ``g(y, n - 1 - i)``: -1 only past the stop."""
    def program(x: jax.Array, n: jax.Array) -> jax.Array:
        return lax.while_loop(lambda c: c[0] < n, lambda c: (
            c[0] + 1, g(c[1], (n - 1 - c[0]).astype(jnp.float32))), (jnp.int32(0), x))[1]
    return program


def test_rules_two_deep_and_rules_with_symbolic_zeros_keep_copies_under_cond() -> None:
    # A rule calling a function whose own rule loops (a second-order jvp runs it), and
    # a rule that loops only where a tangent is a symbolic zero (never traced here).
    @jax.custom_jvp
    def inner(v: jax.Array, r: jax.Array) -> jax.Array:
        return jnp.cos(v)

    @inner.defjvp
    def inner_jvp(primals: Any, tangents: Any) -> Any:
        v, r = primals
        return inner(v, r), -jnp.sin(v) * tangents[0] + 0.0 * _runs_to(r)

    @jax.custom_jvp
    def outer(v: jax.Array, r: jax.Array) -> jax.Array:
        return jnp.sin(v)

    @outer.defjvp
    def outer_jvp(primals: Any, tangents: Any) -> Any:
        return outer(*primals), inner(*primals) * tangents[0]

    @jax.custom_jvp
    def zeros(v: jax.Array, r: jax.Array) -> jax.Array:
        return jnp.sin(v)

    def zeros_jvp(primals: Any, tangents: Any) -> Any:
        (v, r), (tv, tr) = primals, tangents
        out = jnp.cos(v) * tv
        if type(tr) is jax.custom_derivatives.SymbolicZero:
            out = out + 0.0 * _runs_to(r)
        return zeros(v, r), out

    zeros.defjvp(zeros_jvp, symbolic_zeros=True)
    x, n, ones = jnp.linspace(-2.0, 2.0, 4), jnp.int32(5), jnp.ones(4)
    for g, why in ((outer, "holds a while loop"), (zeros, "with symbolic zeros")):
        program = _stepped(g)
        (decision,) = unroll_while_loops(jax.make_jaxpr(program)(x, n), unroll_while=2)[1]
        assert "lax.cond" in decision.reason and why in decision.reason, decision.reason
        decorated = _decorated(program, 2)

        def second(f: Any) -> Any:
            return jax.jvp(lambda a: jax.jvp(lambda b: f(b, n), (a,), (ones,))[1], (x,),
                           (ones,))

        assert_matches(second(decorated), second(jax.jit(program)))


def test_a_loop_under_vmap_whose_body_holds_a_while_is_left_alone() -> None:
    # Its copies select lanes: once both lanes stop, a copy would run the inner loop on
    # the final state (r = -1 there, and that inner loop never ends).
    def one(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            r = (n - 1 - c[0]).astype(jnp.float32)
            z = lax.while_loop(lambda u: u != 0.0, lambda u: u - 1.0, r)
            return c[0] + 1, c[1] + z + 1.0
        return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))

    xs, ns = jnp.array([0.5, 0.25]), jnp.array([3, 3], dtype=jnp.int32)
    result = check_pass(partial(unroll_while_loops, unroll_while=K), jax.vmap(one), xs, ns,
                        kinds=["left alone", "left alone"], unchanged=True)
    outer = next(d for d in result.decisions if "inside another" not in d.reason)
    assert "a value per lane" in outer.reason and "holds a while loop" in outer.reason
    assert_matches(_decorated(jax.vmap(one))(xs, ns), jax.jit(jax.vmap(one))(xs, ns))


def test_selected_copies_past_the_stop_are_dropped() -> None:
    # Past the stop (i == n == 5) the copies divide by zero and read x[5], past its
    # end; before it neither happens: computed there only, and dropped.
    def program(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            i, y = c
            step = 1.0 / (n - i).astype(x.dtype)  # infinite once i == n
            return i + 1, y + step * lax.dynamic_index_in_dim(x, i, keepdims=False)
        return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))

    n = jnp.int32(X.shape[0])
    new, _ = unroll_while_loops(jax.make_jaxpr(program)(X, n), unroll_while=K)
    assert count_primitive(new, "cond") == 0 and count_primitive(new, "select_n") > 0
    for copies in (2, 3, K):  # trips 5: the last trip's copies run past the stop
        got = _decorated(program, copies)(X, n)
        assert_matches(got, jax.jit(program)(X, n))
        assert bool(jnp.all(jnp.isfinite(got[1])))


def test_a_newton_iteration_to_tolerance() -> None:
    def newton_sqrt(a: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            i, x = c
            return i + 1, 0.5 * (x + a / x)
        def go(c: tuple[jax.Array, jax.Array]) -> jax.Array:
            i, x = c
            return jnp.logical_and(jnp.max(jnp.abs(x * x - a)) > 1e-5 * jnp.max(a), i < 100)
        return lax.while_loop(go, body, (jnp.int32(0), a))

    for a in (jnp.array([2.0, 9.0, 1e4]), jnp.array([1.0, 1.0, 1.0])):  # many trips, none
        got = _decorated(newton_sqrt, 3)(a)
        want = jax.jit(newton_sqrt)(a)
        assert_matches(got, want, exact=True)
        np.testing.assert_allclose(got[1], jnp.sqrt(a), rtol=1e-5)
    assert int(jax.jit(newton_sqrt)(jnp.array([1.0, 1.0]))[0]) == 0
    plan = jaxpar.inspect(newton_sqrt, unroll_while=3)(jnp.array([2.0, 9.0]))
    assert "unrolled" in [d.kind for d in plan.decisions]


def test_vmapped_lanes_stop_at_different_trips() -> None:
    xs = jnp.tile(X, (6, 1))
    ns = jnp.array([0, 1, K - 1, K, K + 1, 3 * K + 2], dtype=jnp.int32)
    want = jax.jit(jax.vmap(_counted))(xs, ns)
    # vmap of the decorated function, and the decorated function of a vmapped loop.
    assert_matches(jax.vmap(_decorated(_counted))(xs, ns), want)
    assert_matches(_decorated(jax.vmap(_counted))(xs, ns), want)
    assert [int(i) for i in want[0]] == [int(n) for n in ns]
    # A loop vmapped before the pass has a condition per lane: K selecting trips a trip.
    check_pass(partial(unroll_while_loops, unroll_while=K), jax.vmap(_counted), xs, ns,
               kinds=["unrolled"], grads=False, exact=True,
               counts={"while": 1, "sin": K, "cond": 0, "select_n": 2 * K})
    starts = jnp.array([[0.01], [0.5], [3.0], [20.0]]) * jnp.ones((4, 3))  # 0 to ~10 trips
    assert_matches(jax.vmap(_decorated(_growing))(starts), jax.jit(jax.vmap(_growing))(starts))


def test_forward_mode_goes_through_the_rewritten_loop() -> None:
    tangent = jnp.ones_like(X)
    for start in (X, X * 30.0):  # several trips, none
        got = jax.jvp(_decorated(_growing), (start,), (tangent,))
        want = jax.jvp(jax.jit(_growing), (start,), (tangent,))
        assert_matches(got, want)
    assert float(jnp.max(jax.jvp(_decorated(_growing), (X,), (tangent,))[1])) > 1.0


def test_a_while_loop_inside_a_scan_is_rewritten() -> None:
    def scanned(x: jax.Array, ns: jax.Array) -> tuple[jax.Array, jax.Array]:
        def step(carry: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
            i, y = _counted(carry, n)
            return y, i
        return lax.scan(step, x, ns)

    ns = jnp.array([0, 2, 5, 9], dtype=jnp.int32)
    result = check_pass(partial(unroll_while_loops, unroll_while=K), scanned, X, ns,
                        kinds=["unrolled"], grads=False, exact=True,
                        counts={"scan": 1, "while": 1, "cond": 0, "sin": K})
    assert result.decisions[0].location == "/scan#0.jaxpr"
    assert_matches(_decorated(scanned)(X, ns), jax.jit(scanned)(X, ns))


def test_a_scan_inside_the_body_is_copied_with_it() -> None:
    def with_scan(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            i, y = c
            y, _ = lax.scan(lambda h, w: (jnp.tanh(h * w + 0.1), None), y,
                            jnp.linspace(0.5, 1.5, 3))
            return i + 1, y
        return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))

    for trips in (0, 5, 8):
        check_pass(partial(unroll_while_loops, unroll_while=K), with_scan, X,
                   jnp.int32(trips), kinds=["unrolled"], grads=False, exact=True,
                   counts={"while": 1, "scan": K})
        assert_matches(_decorated(with_scan)(X, jnp.int32(trips)),
                       jax.jit(with_scan)(X, jnp.int32(trips)))


def test_only_the_outermost_while_loop_is_rewritten() -> None:
    def nested(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            i, y = c
            return i + 1, _growing(y * 0.05)
        return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))

    result = check_pass(partial(unroll_while_loops, unroll_while=K), nested, X,
                        jnp.int32(6), grads=False, exact=True)
    assert sorted(d.kind for d in result.decisions) == ["left alone", "unrolled"]
    inner = next(d for d in result.decisions if d.kind == "left alone")
    assert "inside another while loop" in inner.reason and "while#" in inner.location
    # The outer loop and its inner loop in each of the K copies, each inner one as written.
    assert len(_whiles(result.new)) == 1 + K
    assert all(WHILE_SCOPE not in str(e.source_info.name_stack)
               for e in _whiles(result.new)[1:])


def test_the_option_is_off_by_default_and_reaches_apply_passes() -> None:
    for target in ("cpu", "gpu", "tpu"):
        settings = Options().resolve(target, async_limit=2, command_buffers="lhs")
        assert settings.unroll_while is None and "unroll_while_loops" not in settings.passes
    plan = jaxpar.inspect(_counted)(X, jnp.int32(3))
    assert not [d for d in plan.decisions if d.pass_name == "unroll_while_loops"]
    closed = jax.make_jaxpr(_counted)(X, jnp.int32(3))
    new, decisions = apply_passes(closed, target="tpu", unroll_while=3)
    assert [d.kind for d in decisions if d.pass_name == "unroll_while_loops"] == ["unrolled"]
    assert count_primitive(new, "sin") == 3
    assert apply_passes(closed, target="tpu", unroll_while=None)[0] is closed


def test_the_plan_names_the_users_loop() -> None:
    text = jaxpar.inspect(_counted, unroll_while=K, target="cpu")(X, jnp.int32(3)).text()
    line = next(line for line in text.splitlines() if "unrolled by 4" in line)
    assert "test_unroll_while_loops.py" in line and WHILE_SCOPE not in text


# ---------------------------------------------------------------- left alone


def _printing(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    def body(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        jax.debug.print("trip {i}", i=c[0])
        return c[0] + 1, c[1] * 2.0
    return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))


def _calling_back(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    def body(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        y = jax.experimental.io_callback(lambda v: np.asarray(v) + 1, c[1], c[1],
                                         ordered=True)
        return c[0] + 1, y
    return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))


@pytest.mark.parametrize("program", [_printing, _calling_back])
def test_loops_with_effects_are_left_alone(program: Any) -> None:
    result = check_pass(partial(unroll_while_loops, unroll_while=K), program, X,
                        jnp.int32(3), kinds=["left alone"], unchanged=True)
    assert "effects" in result.decisions[0].reason


def test_a_large_body_is_left_alone() -> None:
    def large(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            y = c[1]
            for _ in range(100):
                y = jnp.sin(y) + 0.5
            return c[0] + 1, y
        return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))

    result = check_pass(partial(unroll_while_loops, unroll_while=K), large, X, jnp.int32(2),
                        kinds=["left alone"], unchanged=True)
    assert "more than 512" in result.decisions[0].reason
    # Two copies fit.
    check_pass(partial(unroll_while_loops, unroll_while=2), large, X, jnp.int32(3),
               kinds=["unrolled"], grads=False, exact=True)


@pytest.mark.parametrize("value", [1, 0, -2, "4", True, 2.0])
def test_bad_values_are_refused_naming_the_option(value: Any) -> None:
    with pytest.raises(ValueError, match=r"unroll_while must be .*an int >= 2"):
        jaxpar.parallel_branches(_counted, unroll_while=value)
    with pytest.raises(ValueError, match="unroll_while must be"):
        jaxpar.inspect(_counted, unroll_while=value)
    with pytest.raises(ValueError, match="unroll_while must be"):
        unroll_while_loops(jax.make_jaxpr(_counted)(X, jnp.int32(1)), unroll_while=value)


# ---------------------------------------------------------------- library loops


def test_bfgs_from_jax_scipy() -> None:
    from jax.scipy.optimize import minimize

    def solve(start: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        def bowl(p: jax.Array) -> jax.Array:
            return jnp.sum(jnp.array([1.0, 10.0, 100.0]) * (p - 1.0) ** 2) + 0.5 * jnp.sum(p ** 4)
        found = minimize(bowl, start, method="BFGS", options={"maxiter": 200})
        return found.x, found.nit, found.success

    start = jnp.array([3.0, -2.0, 1.0])
    closed = jax.make_jaxpr(solve)(start)
    new, decisions = unroll_while_loops(closed, unroll_while=K)
    assert "unrolled" in [d.kind for d in decisions]
    assert count_primitive(new, "cond") >= count_primitive(closed, "cond") + K - 1
    got, want = _decorated(solve)(start), jax.jit(solve)(start)
    assert_matches(got, want)
    assert int(got[1]) == int(want[1]) > K and int(got[1]) % K  # not a multiple of K
    assert bool(got[2])  # converged


def test_a_nuts_step_from_blackjax() -> None:
    blackjax = pytest.importorskip("blackjax")

    def logdensity(p: jax.Array) -> jax.Array:
        return -0.5 * jnp.sum((p - 1.0) ** 2 / jnp.array([1.0, 4.0, 0.25]))

    nuts = blackjax.nuts(logdensity, step_size=0.3, inverse_mass_matrix=jnp.ones(3))

    def steps(key: jax.Array, position: jax.Array) -> tuple[jax.Array, jax.Array]:
        def one(state: Any, key: jax.Array) -> tuple[Any, jax.Array]:
            state, info = nuts.step(key, state)
            return state, info.num_integration_steps
        state, counts = lax.scan(one, nuts.init(position), jax.random.split(key, 5))
        return state.position, counts

    key, position = jax.random.key(0), jnp.zeros(3)
    plan = jaxpar.inspect(steps, unroll_while=K, target="cpu")(key, position)
    assert "unrolled" in [d.kind for d in plan.decisions
                          if d.pass_name == "unroll_while_loops"]
    got, want = _decorated(steps)(key, position), jax.jit(steps)(key, position)
    assert_matches(got, want)
    assert len(set(int(c) for c in want[1])) > 1  # trajectories of different lengths
