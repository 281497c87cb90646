"""The batching passes merge only what is the same, and batch only what vmap maps faithfully.

Issue 10, points 2 and 3. ``batch_scans`` and ``batch_branches`` run several members as one
``vmap``ped copy of the first member, so

* "the same" must compare parameters by value (a callback's function, a ``custom_jvp`` rule, a
  ``custom_vjp``'s non-differentiable arguments, constants), not the printed jaxpr; and
* the batched form must compute what each member computes alone, at the members' cost: no
  ``rbg`` random bits under ``vmap``, no callback without a ``vmap_method``, no ``cond`` or
  ``while`` whose predicate differs per member (``jaxpar.passes._batching``).

Each test checks the decision (structure) and the values (and gradients where the difference
lies in a differentiation rule) against ``jax.jit`` of the original; the positive controls show
the same program shape is batched where it is safe, so the tests can fail.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from test_loops import as_function, assert_close, eqns_of, primitives

import jaxpar
from jaxpar import _compat
from jaxpar.passes import (
    KIND_BATCHED,
    KIND_BATCHED_SUBGRAPHS,
    KIND_FUSED,
    apply_loop_passes,
    batch_branches,
    batch_scans,
)

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
F32 = jax.ShapeDtypeStruct((8,), jnp.float32)


def kinds(decisions: Any) -> list[str]:
    return [d.kind for d in decisions]


def check(closed: Any, new: Any, fn: Callable[..., Any], args: tuple[Any, ...],
          grads: bool = False) -> None:
    """Well formed, and the same values (and gradients) as ``jax.jit(fn)``."""
    jex_core.check_jaxpr(_compat.open_jaxpr(new)[0])
    leaves = jax.tree.leaves(args)
    assert_close(as_function(new)(*leaves), jax.tree.leaves(jax.jit(fn)(*args)), **TOLERANCE)
    if grads:
        def loss(*a: Any) -> Any:
            return sum(jnp.sum(jnp.sin(o)) for o in as_function(new)(*a))
        want = jax.jit(jax.grad(lambda *a: sum(jnp.sum(jnp.sin(o)) for o in
                                               jax.tree.leaves(fn(*a))),
                                argnums=tuple(range(len(leaves)))))(*leaves)
        got = jax.grad(loss, argnums=tuple(range(len(leaves))))(*leaves)
        assert_close(got, want, **TOLERANCE)


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


# (step a, step b, merged when equal?, differentiate?)
_SCAN_PAIRS = {
    "pure_callback sin vs cos": (callback_step(np.sin), callback_step(np.cos), False, False),
    "pure_callback sin vs sin": (callback_step(np.sin), callback_step(np.sin), True, False),
    "custom_vjp nondiff 3.0 vs 5.0": (vjp_step(3.0), vjp_step(5.0), False, True),
    "custom_jvp different rules": (lambda c, x: (SIN_RULE_1(c * x), None),
                                   lambda c, x: (SIN_RULE_3(c * x), None), False, True),
    # One step function: JAX traces its body once, so both scans hold the same rule.
    "custom_jvp the same rule": (sin_step, sin_step, True, True),
    "different constants": (constant_step(np.full(8, 2.0, np.float32)),
                            constant_step(np.full(8, 3.0, np.float32)), False, False),
}


@pytest.mark.parametrize("case", list(_SCAN_PAIRS))
def test_scan_bodies_are_compared_by_value(case: str) -> None:
    step_a, step_b, merged, grads = _SCAN_PAIRS[case]
    f = two_scans(step_a, step_b)
    args = scan_args()
    closed = jax.make_jaxpr(f)(*args)
    new, decisions = batch_scans(closed)
    assert kinds(decisions) == ([KIND_BATCHED] if merged else []), case
    check(closed, new, f, args, grads=grads)


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
    closed = jax.make_jaxpr(f)(*args)
    new, decisions = batch_scans(closed)
    assert decisions == () and new is closed
    for v in seen.values():
        v.clear()
    as_function(new)(*args)
    assert len(seen["a"]) == len(seen["b"]) == 5 and seen["a"] != seen["b"]


def test_branch_members_are_compared_by_value() -> None:
    """batch_branches compares equations through the same structural keys."""
    def member(fn: Any, w: jax.Array, x: jax.Array) -> jax.Array:
        y = jnp.tanh(jnp.tanh(x @ w) @ w)
        return jax.pure_callback(fn, jax.ShapeDtypeStruct(y.shape, y.dtype), y,
                                 vmap_method="sequential")

    def f(x: jax.Array, ws: list[jax.Array]) -> Any:
        return [member(fn, w, x) for fn, w in zip((np.sin, np.cos, np.sin, np.cos), ws,
                                                  strict=True)]

    args = (jnp.eye(32) * 0.5, [jnp.eye(32) * (0.1 + 0.1 * k) for k in range(4)])
    closed = jax.make_jaxpr(f)(*args)
    new, decisions = batch_branches(closed, target="gpu")
    # The callbacks are batched in pairs (sin with sin, cos with cos: the values say which).
    batched = [d for d in decisions if d.kind == KIND_BATCHED_SUBGRAPHS]
    assert any(set(d.primitives) == {"pure_callback"} and len(d.eqns) == 2 for d in batched)
    check(closed, new, f, args)


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
    closed = jax.make_jaxpr(f)(*args)
    new, decisions = batch_branches(closed, target="gpu")
    draws = [e for e in eqns_of(new) if e.primitive.name in ("jit", "pjit")
             and "random_bits" in primitives(e.params["jaxpr"], recursive=True)]
    assert len(draws) == (1 if batched else 4), impl
    if batched:
        assert KIND_BATCHED_SUBGRAPHS in kinds(decisions)
    # Key arrays are not jaxpr inputs of as_function: compare through the wrapped function.
    got = jax.jit(lambda *a: as_function(new)(*jax.tree.leaves(a)))(*args)
    want = jax.tree.leaves(jax.jit(f)(*args))
    assert_close(got, want, **TOLERANCE)


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
        closed = jax.make_jaxpr(f)(*args)
        new, decisions = batch_scans(closed)
        assert kinds(decisions) == ([KIND_BATCHED] if batched else []), impl
        got = jax.jit(as_function(new))(*args)
        assert_close(got, jax.tree.leaves(jax.jit(f)(*args)), **TOLERANCE)
        # With fusion on, the scans left unbatched are fused instead.
        if not batched:
            fused, decisions = apply_loop_passes(closed, fuse=True, batch=True, unroll=None,
                                                 target="gpu")
            assert kinds(decisions) == [KIND_FUSED]
            got = jax.jit(as_function(fused))(*args)
            assert_close(got, jax.tree.leaves(jax.jit(f)(*args)), **TOLERANCE)


def test_pure_callback_without_vmap_method_is_not_batched() -> None:
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
        closed = jax.make_jaxpr(fn)(*args)
        new, decisions = batch_branches(closed, target="gpu")  # never raises
        callbacks = [e for e in eqns_of(new) if e.primitive.name == "pure_callback"]
        # Without a vmap_method only the matmuls before the callbacks are batched.
        assert len(callbacks) == (4 if method is None else 0), method
        assert KIND_BATCHED_SUBGRAPHS in kinds(decisions)
        check(closed, new, fn, args)
        plan = jaxpar.inspect(fn, target="gpu")(*args)  # raised NotImplementedError
        assert any(d.kind == KIND_BATCHED_SUBGRAPHS for d in plan.subgraphs)
        assert_close(jaxpar.parallel_branches(fn, target="gpu")(*args), jax.jit(fn)(*args),
                     **TOLERANCE)
    # Scans calling it are not batched either (and batch_scans does not raise).
    f2 = two_scans(callback_step(np.sin, None), callback_step(np.sin, None))
    closed = jax.make_jaxpr(f2)(*scan_args())
    new, decisions = batch_scans(closed)
    assert decisions == () and new is closed


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
    closed = jax.make_jaxpr(f)(*args)
    new, decisions = batch_branches(closed, target="gpu")
    conds = [e for e in eqns_of(new) if e.primitive.name == "cond"]
    if shared:
        # One cond, on the shared predicate, whose branches hold the batched members.
        assert len(conds) == 1 and "select_n" not in primitives(new)
    else:
        # The four conds stay (no select running the while for every member); the matmuls
        # before them are batched.
        assert len(conds) == 4 and primitives(new, recursive=True).count("while") == 4
        assert any("takes a different branch per member" in d.reason for d in decisions)
    assert KIND_BATCHED_SUBGRAPHS in kinds(decisions)
    check(closed, new, f, args)


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
    closed = jax.make_jaxpr(f)(*args)
    new, decisions = batch_scans(closed)
    assert kinds(decisions) == ([KIND_BATCHED] if shared else [])
    check(closed, new, f, args)


def test_static_refusal_reaches_into_nested_jaxprs() -> None:
    from jaxpar.passes._batching import static_refusal

    def f(key: Any, x: jax.Array) -> Any:
        inner = jax.jit(jax.checkpoint(lambda k, v: v + jax.random.normal(k, v.shape)))
        return lax.cond(x[0] > 0, inner, lambda k, v: v, key, x)

    for impl, refused in (("rbg", True), ("threefry2x32", False)):
        closed = jax.make_jaxpr(f)(jax.random.key(0, impl=impl), jnp.ones(4))
        (cond,) = [e for e in eqns_of(closed) if e.primitive.name == "cond"]
        assert (static_refusal(cond) is not None) == refused, impl


def test_allow_list_names_exist() -> None:
    """Every primitive the allow-list names is a real primitive name of this jax."""
    from jaxpar import _compat
    from jaxpar.passes import _batching

    assert _batching.FAITHFUL_PRIMITIVES <= _compat.all_primitive_names()
    assert {"add", "dot_general", "jit", "scan", "cond", "while"} <= _batching.FAITHFUL_PRIMITIVES
    for absent in ("rng_bit_generator", "psum", "sharding_constraint"):
        assert absent not in _batching.FAITHFUL_PRIMITIVES
