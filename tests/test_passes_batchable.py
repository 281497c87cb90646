"""``jaxpar.passes._batchable``: the batching passes merge only what is the same, and batch only
what vmap maps faithfully.

``batch_scans`` and ``batch_branches`` run several members as one ``vmap``ped copy of the
first member, so

* "the same" must compare parameters by value (a callback's function, a ``custom_jvp`` rule, a
  ``custom_vjp``'s non-differentiable arguments, constants), not the printed jaxpr; and
* the batched form must compute what each member computes alone, at the members' cost: no
  ``rbg`` random bits under ``vmap``, no host callback (not even with a
  ``vmap_method``), no unchecked custom rule, no ``cond`` or
  ``while`` whose predicate differs per member (``jaxpar.passes._batchable``).

Each test checks the decision (structure) and the values (and gradients where the difference
lies in a differentiation rule) against the original through ``check_pass``
(tests/pass_checker.py), under ``jax.jit`` where keys are inputs; the positive controls show
the same program shape is batched where it is safe, so the tests can fail.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from pass_checker import (
    PassResult,
    as_function,
    assert_matches,
    check_pass,
    eqns_of,
    kinds,
    primitives,
)

import jaxpar
from jaxpar.passes import DecisionKind, _batchable, apply_passes, batch_branches, batch_scans

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
F32 = jax.ShapeDtypeStruct((8,), jnp.float32)


def check(pass_fn: Callable[..., Any], fn: Callable[..., Any], args: tuple[Any, ...],
          grads: bool = False, **checks: Any) -> PassResult:
    """``check_pass`` at this file's tolerance; gradients only where asked."""
    return check_pass(pass_fn, fn, *args, grads=grads, tolerance=TOLERANCE,
                      grad_tolerance=TOLERANCE, **checks)


batch_for_gpu = partial(batch_branches, target="gpu")


# --- two scans, bodies differing in one parameter -------------------------------------------


def two_scans(step_a: Callable[..., Any], step_b: Callable[..., Any]) -> Callable[..., Any]:
    def f(a: jax.Array, b: jax.Array, xs: jax.Array) -> Any:
        return lax.scan(step_a, a, xs)[0], lax.scan(step_b, b, xs)[0]
    return f


def scan_args() -> tuple[jax.Array, jax.Array, jax.Array]:
    a = jnp.linspace(0.1, 0.9, 8)
    return a, a[::-1] * 0.5, jnp.linspace(-1.0, 1.0, 5 * 8).reshape(5, 8)


def callback_step(fn: Any, vmap_method: str | None = "sequential") -> Callable[..., Any]:
    def step(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        return jax.pure_callback(fn, F32, c + x, vmap_method=vmap_method), None
    return step


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def scaled(x: jax.Array, scale: float) -> jax.Array:
    return x * 2.0


scaled.defvjp(lambda x, scale: (x * 2.0, None), lambda scale, _, g: (g * scale,))


def vjp_step(scale: float) -> Callable[..., Any]:
    return lambda c, x: (scaled(c * x, scale), None)


def custom_sin(factor: float) -> Any:
    @jax.custom_jvp
    def f(x: jax.Array) -> jax.Array:
        return jnp.sin(x)

    f.defjvp(lambda primals, tangents: (jnp.sin(primals[0]), factor * tangents[0]))
    return f


SIN_RULE_1, SIN_RULE_3 = custom_sin(1.0), custom_sin(3.0)


def sin_step(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return SIN_RULE_3(c * x), None


def constant_step(constant: np.ndarray) -> Callable[..., Any]:
    inner = jax.jit(lambda c: c * jnp.asarray(constant))
    return lambda c, x: (inner(c) + x, None)


# (step a, step b, the decisions' kinds, differentiate?)
_SCAN_PAIRS = {
    "pure_callback sin vs cos": (callback_step(np.sin), callback_step(np.cos), [], False),
    # Equal, but a host callback is never put under a vmap the program did not write.
    "pure_callback sin vs sin": (callback_step(np.sin), callback_step(np.sin),
                                 [DecisionKind.LEFT_ALONE], False),
    "custom_vjp nondiff 3.0 vs 5.0": (vjp_step(3.0), vjp_step(5.0), [], True),
    "custom_jvp different rules": (lambda c, x: (SIN_RULE_1(c * x), None),
                                   lambda c, x: (SIN_RULE_3(c * x), None), [], True),
    # One step function: JAX traces its body once, so both scans hold the same rule.
    "custom_jvp the same rule": (sin_step, sin_step, [DecisionKind.BATCHED], True),
    "different constants": (constant_step(np.full(8, 2.0, np.float32)),
                            constant_step(np.full(8, 3.0, np.float32)), [], False),
}


@pytest.mark.parametrize("case", list(_SCAN_PAIRS))
def test_scan_bodies_are_compared_by_value(case: str) -> None:
    step_a, step_b, expected, grads = _SCAN_PAIRS[case]
    f = two_scans(step_a, step_b)
    check(batch_scans, f, scan_args(), grads=grads, unchanged=DecisionKind.BATCHED not in expected,
          kinds=expected)


@pytest.mark.parametrize("callback", ["debug", "io"])
def test_scans_with_callback_effects_are_not_batched(callback: str) -> None:
    seen: dict[str, list[float]] = {"a": [], "b": []}

    def record(name: str) -> Callable[..., Any]:
        def fn(v: Any) -> Any:
            seen[name].append(float(np.asarray(v)[0]))
            return np.asarray(v)
        return fn

    def step(name: str) -> Callable[..., Any]:
        def body(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
            if callback == "debug":
                jax.debug.callback(record(name), c)
                return jnp.sin(c + x), None
            return jax.experimental.io_callback(record(name), F32, jnp.sin(c + x)), None
        return body

    f = two_scans(step("a"), step("b"))
    args = scan_args()
    new = check(batch_scans, f, args, unchanged=True, kinds=[]).new
    for v in seen.values():
        v.clear()
    as_function(new)(*args)
    assert len(seen["a"]) == len(seen["b"]) == 5 and seen["a"] != seen["b"]


def test_branch_members_are_compared_by_value() -> None:
    """batch_branches compares equations through the same structural keys."""
    def member(scale: np.ndarray, w: jax.Array, x: jax.Array) -> jax.Array:
        y = jnp.tanh(jnp.tanh(x @ w) @ w)
        # A fresh jit per member, closing over a constant the printed jaxpr does not show.
        return jax.jit(lambda v: v * jnp.asarray(scale))(y)

    two, three = np.full(32, 2.0, np.float32), np.full(32, 3.0, np.float32)

    def f(x: jax.Array, ws: list[jax.Array]) -> Any:
        return [member(c, w, x) for c, w in zip((two, three, two, three), ws, strict=True)]

    args = (jnp.eye(32) * 0.5, [jnp.eye(32) * (0.1 + 0.1 * k) for k in range(4)])
    def calls_in_pairs(r: PassResult) -> None:
        # The calls are batched in pairs (2.0 with 2.0, 3.0 with 3.0: the values say
        # which).
        # (compared by their printed text, the four calls would be one group of four),
        # batched or left alone as the cost model says (a call's result leaving the
        # program is sliced out of the batched one at the cost of a kernel).
        calls = [d for d in r.decisions if "subgraphs" in d.kind.value
                 and set(d.primitives) == {"jit"}]
        assert calls and all(len(d.eqns) == 2 for d in calls), r.decisions

    check(batch_for_gpu, f, args, expect=calls_in_pairs)


# --- what vmap maps faithfully and cheaply --------------------------------------------------


def random_members(impl: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    def f(keys: list[jax.Array], x: jax.Array, ws: list[jax.Array]) -> Any:
        return [jnp.tanh(jnp.tanh(x @ w) @ w) + jax.random.normal(k, (32, 32))
                for k, w in zip(keys, ws, strict=True)]

    keys = [jax.random.key(k, impl=impl) for k in range(4)]
    return f, (keys, jnp.eye(32) * 0.5, [jnp.eye(32) * (0.1 + 0.1 * k) for k in range(4)])


@pytest.mark.parametrize(("impl", "batched"), [("rbg", False), ("unsafe_rbg", False),
                                                ("threefry2x32", True)])
def test_random_bits_are_batched_only_for_threefry_keys(impl: str, batched: bool) -> None:
    f, args = random_members(impl)

    def draws_by_key_type(r: PassResult) -> None:
        draws = [e for e in eqns_of(r.new) if e.primitive.name in ("jit", "pjit")
                 and "random_bits" in primitives(e.params["jaxpr"], recursive=True)]
        assert len(draws) == (1 if batched else 4), impl
        if batched:
            assert DecisionKind.BATCHED_SUBGRAPHS in kinds(r.decisions)

    # Key arrays are inputs: the values are compared under jax.jit.
    check(batch_for_gpu, f, args, jit=True, expect=draws_by_key_type)


def test_random_bits_in_scan_bodies_follow_the_key_type() -> None:
    def step(c: Any, x: jax.Array) -> tuple[Any, None]:
        key, value = c
        key, sub = jax.random.split(key)
        return (key, jnp.sin(value + x) + jax.random.normal(sub, value.shape)), None

    def f(k1: Any, k2: Any, a: jax.Array, b: jax.Array, xs: jax.Array) -> Any:
        return lax.scan(step, (k1, a), xs)[0][1], lax.scan(step, (k2, b), xs)[0][1]

    for impl, batched in (("rbg", False), ("threefry2x32", True)):
        keys = (jax.random.key(1, impl=impl), jax.random.key(2, impl=impl))
        a, b, xs = scan_args()
        args = (*keys, a, b, xs)
        check(batch_scans, f, args, jit=True, unchanged=not batched,
              kinds=[DecisionKind.BATCHED] if batched else [DecisionKind.LEFT_ALONE])
        # With fusion on, the scans left unbatched are fused instead.
        if not batched:
            check(partial(apply_passes, fuse_scans=True, batch_scans=True, unroll=None,
                          target="gpu"), f, args, jit=True,
                  kinds=[DecisionKind.FUSED, DecisionKind.LEFT_ALONE])


def test_pure_callbacks_are_never_batched() -> None:
    """Not even with a vmap_method: the program never vmapped them."""
    def f(x: jax.Array, ws: list[jax.Array], vmap_method: str | None) -> Any:
        outs = []
        for w in ws:
            y = jnp.tanh(jnp.tanh(x @ w) @ w)
            outs.append(jax.pure_callback(np.sin, jax.ShapeDtypeStruct(y.shape, y.dtype), y,
                                          vmap_method=vmap_method))
        return outs

    args = (jnp.eye(32) * 0.5, [jnp.eye(32) * (0.1 + 0.1 * k) for k in range(4)])
    for method in (None, "sequential"):
        fn = partial(f, vmap_method=method)

        def matmuls_batched(r: PassResult, method: str | None = method) -> None:
            callbacks = [e for e in eqns_of(r.new) if e.primitive.name == "pure_callback"]
            # Only the matmuls before the callbacks are batched.
            assert len(callbacks) == 4, method
            assert DecisionKind.BATCHED_SUBGRAPHS in kinds(r.decisions)

        check(batch_for_gpu, fn, args, expect=matmuls_batched)  # the pass never raises
        plan = jaxpar.inspect(fn, target="gpu")(*args)  # raised NotImplementedError
        assert any(d.kind == DecisionKind.BATCHED_SUBGRAPHS for d in plan.decisions)
        assert_matches(jaxpar.parallel_branches(fn, target="gpu")(*args), jax.jit(fn)(*args),
                       tolerance=TOLERANCE)
    # Scans calling it are not batched either (and batch_scans does not raise).
    f2 = two_scans(callback_step(np.sin, None), callback_step(np.sin, None))
    check(batch_scans, f2, scan_args(), unchanged=True, kinds=[DecisionKind.LEFT_ALONE])


def cond_members(shared: bool) -> Callable[..., Any]:
    """Four members, each a cond whose expensive branch is a 1000-trip while."""
    def expensive(v: jax.Array) -> jax.Array:
        return lax.while_loop(lambda c: c[0] < 1000, lambda c: (c[0] + 1, jnp.sin(c[1]) @ c[1]),
                              (0, v))[1]

    def f(x: jax.Array, ws: list[jax.Array]) -> Any:
        outs = []
        for w in ws:
            y = jnp.tanh(jnp.tanh(x @ w) @ w)
            predicate = jnp.sum(x) > 1e9 if shared else jnp.sum(y) > 1e9
            outs.append(lax.cond(predicate, expensive, lambda v, w=w: jnp.tanh(v @ w), y))
        return outs
    return f


@pytest.mark.parametrize("shared", [False, True])
def test_conds_are_batched_only_on_a_shared_predicate(shared: bool) -> None:
    f = cond_members(shared)
    args = (jnp.eye(32) * 0.5, [jnp.eye(32) * (0.1 + 0.1 * k) for k in range(4)])
    def conds_by_predicate(r: PassResult) -> None:
        conds = [e for e in eqns_of(r.new) if e.primitive.name == "cond"]
        if shared:
            # One cond, on the shared predicate, whose branches hold the batched members.
            assert len(conds) == 1 and "select_n" not in primitives(r.new)
        else:
            # The four conds stay (no select running the while for every member); the
            # matmuls before them are batched.
            assert len(conds) == 4 and primitives(r.new, recursive=True).count("while") == 4
            assert any("takes a different branch per member" in d.reason for d in r.decisions)
        assert DecisionKind.BATCHED_SUBGRAPHS in kinds(r.decisions)

    check(batch_for_gpu, f, args, expect=conds_by_predicate)


@pytest.mark.parametrize("shared", [False, True])
def test_scans_holding_a_while_are_batched_only_on_a_shared_predicate(shared: bool) -> None:
    def step(c: jax.Array, x: jax.Array, limit: jax.Array) -> tuple[jax.Array, None]:
        bound = limit if shared else jnp.sum(c) * 3.0

        def body(s: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            return s[0] + 1.0, jnp.sin(s[1]) + x
        return lax.while_loop(lambda s: s[0] < bound, body, (0.0, c))[1], None

    def f(a: jax.Array, b: jax.Array, xs: jax.Array, limit: jax.Array) -> Any:
        body = partial(step, limit=limit)
        return lax.scan(body, a, xs)[0], lax.scan(body, b, xs)[0]

    args = (*scan_args(), jnp.float32(4.0))
    check(batch_scans, f, args, unchanged=not shared,
          kinds=[DecisionKind.BATCHED] if shared else [DecisionKind.LEFT_ALONE])


def test_static_refusal_reaches_into_nested_jaxprs() -> None:
    from jaxpar.passes._batchable import static_refusal

    def f(key: Any, x: jax.Array) -> Any:
        inner = jax.jit(jax.checkpoint(lambda k, v: v + jax.random.normal(k, v.shape)))
        return lax.cond(x[0] > 0, inner, lambda k, v: v, key, x)

    for impl, refused in (("rbg", True), ("threefry2x32", False)):
        closed = jax.make_jaxpr(f)(jax.random.key(0, impl=impl), jnp.ones(4))
        (cond,) = [e for e in eqns_of(closed) if e.primitive.name == "cond"]
        assert (static_refusal(cond) is not None) == refused, impl


def test_allow_list_names_exist() -> None:
    """Every primitive the allow-list names is a real primitive name of this jax."""
    from jaxpar import _ops

    assert _batchable.FAITHFUL_PRIMITIVES <= _ops.all_primitive_names()
    assert {"add", "dot_general", "jit", "scan", "cond", "while"} <= _batchable.FAITHFUL_PRIMITIVES
    for absent in ("rng_bit_generator", "ppermute", "all_gather", "sharding_constraint"):
        assert absent not in _batchable.FAITHFUL_PRIMITIVES


def test_psum_batches_only_over_positional_axes() -> None:
    """A psum over a vmap axis name (positional axes in the jaxpr) is a local reduction
    and batches; over a named axis it communicates and does not."""

    x = jnp.ones((4, 3))
    local = jax.make_jaxpr(jax.vmap(lambda v: jax.lax.psum(v, "b"), axis_name="b"))(x)
    named = jax.make_jaxpr(lambda v: jax.lax.psum(v, "i"), axis_env=[("i", 2)])(x)
    assert _batchable.equation_refusal(local.jaxpr.eqns[0], [True]) is None
    why = _batchable.equation_refusal(named.jaxpr.eqns[0], [True])
    assert why is not None and "named axis" in why
