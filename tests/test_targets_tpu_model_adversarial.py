"""Adversarial tests of the TPU target on the CPU (``target="tpu"``): the block form of
``unroll_scans`` (``_block_emitter``) and ``targets.tpu_model.block_factor`` against ``jax.jit``
on loops that stress them (nested scans, reverse, lengths without divisors, no xs or ys,
int and bool carries, PRNG keys, gradients and vmap through the blocks)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxpar
from jaxpar.targets.tpu_model import MAX_BLOCK_EQNS


def _assert_same(got: Any, want: Any) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):  # PRNG keys
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                       rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(a, b)


def _nested(c: Any, xs: Any) -> Any:
    """An outer scan whose body runs an inner scan of 40 trips: each is a tiny body."""
    def outer(c: Any, x: Any) -> Any:
        inner, _ = lax.scan(lambda d, y: (jnp.sin(d) + y, None), c, jnp.tile(x, (40, 1)))
        return inner, c
    return lax.scan(outer, c, xs)


def test_nested_scans_read_by_blocks_keep_the_unrolled_body_within_its_limit() -> None:
    # The inner scan was read by blocks of 40 (40 copies of its body), and the outer one
    # was read by blocks of 40 too: 1,600 copies of the inner body, which counted as one
    # equation; its gradient's XLA:CPU compile ran out of memory (std::bad_alloc).
    c, xs = jnp.ones(8), jnp.linspace(0.0, 1.0, 80 * 8).reshape(80, 8)
    plan = jaxpar.inspect(_nested, target="tpu")(c, xs)
    factors = [d.unroll or 1 for d in plan.decisions]
    assert len(factors) == 2 and factors[0] == 40
    inner_eqns = len(jax.make_jaxpr(lambda d, y: (jnp.sin(d) + y, None))(c, xs[0]).eqns)
    assert factors[0] * factors[1] * inner_eqns <= MAX_BLOCK_EQNS
    g = jaxpar.parallel_branches(_nested, target="tpu")
    _assert_same(g(c, xs), jax.jit(_nested)(c, xs))
    _assert_same(jax.grad(lambda c: g(c, xs)[0].sum())(c),
                 jax.grad(lambda c: _nested(c, xs)[0].sum())(c))


def _tiny(c: Any, x: Any) -> Any:
    return jnp.sin(c) * 0.9 + x, c * 2


_XS = jnp.linspace(0.0, 1.0, 80 * 8).reshape(80, 8)
_KEYS = jax.random.split(jax.random.key(0), 80)
# (name, function, arguments, whether gradients and vmap apply, whether it is read by blocks)
_LOOPS: list[tuple[str, Any, tuple[Any, ...], bool, bool]] = [
    ("reverse", lambda c, xs: lax.scan(_tiny, c, xs, reverse=True), (jnp.ones(8), _XS),
     True, True),
    ("prime length", lambda c, xs: lax.scan(_tiny, c, xs), (jnp.ones(8), _XS[:41]), True,
     False),
    ("no xs", lambda c: lax.scan(lambda c, _: (jnp.sin(c) + 1.0, c), c, None, length=80),
     (jnp.ones(8),), True, True),
    ("no ys", lambda c, xs: lax.scan(lambda c, x: (jnp.sin(c) + x, None), c, xs),
     (jnp.ones(8), _XS), True, True),
    ("int and bool carries, ys of five dtypes", lambda c, xs: lax.scan(
        lambda c, x: ((c[0] * 3 + 1, jnp.logical_not(c[1])),
                      (c[0], c[1], x.astype(jnp.int8), x.astype(jnp.bfloat16),
                       x.astype(jnp.float16))), c, xs),
     ((jnp.int32(1), jnp.bool_(True)), _XS), False, True),
    ("PRNG keys scanned", lambda c, keys: lax.scan(
        lambda c, k: (c + jax.random.normal(k, c.shape), k), c, keys), (jnp.ones(8), _KEYS),
     False, True),
    ("fori_loop", lambda c: lax.fori_loop(0, 80, lambda i, c: jnp.sin(c) + i, c),
     (jnp.ones(8),), True, True),
    ("checkpointed body", lambda c, xs: lax.scan(jax.checkpoint(_tiny), c, xs),
     (jnp.ones(8), _XS), True, True),
    ("pytree xs and a closed-over weight", lambda c, xs, w: lax.scan(
        lambda c, x: (jnp.tanh(c * w + x["a"] * x["b"]), {"c": c}), c, xs),
     (jnp.ones(8), {"a": _XS, "b": _XS * 2}, jnp.full(8, 0.3)), True, True),
]


@pytest.mark.parametrize(("name", "fn", "args", "differentiable", "blocked"), _LOOPS,
                         ids=[loop[0] for loop in _LOOPS])
def test_loops_on_target_tpu_compute_what_jax_jit_computes(
        name: str, fn: Any, args: tuple[Any, ...], differentiable: bool,
        blocked: bool) -> None:
    g = jaxpar.parallel_branches(fn, target="tpu")
    assert ("jaxpar_blocks" in g.lower(*args).as_text(debug_info=True)) is blocked
    _assert_same(g(*args), jax.jit(fn)(*args))
    if not differentiable:
        return

    def total(f: Any) -> Any:
        return lambda *a: sum(jnp.sum(leaf) for leaf in jax.tree_util.tree_leaves(f(*a)))

    argnums = tuple(range(len(args)))
    _assert_same(jax.grad(total(g), argnums)(*args), jax.grad(total(fn), argnums)(*args))
    batched = jax.tree_util.tree_map(lambda a: jnp.stack([a, a * 0.5]), args)
    _assert_same(jax.vmap(g)(*batched), jax.vmap(fn)(*batched))
