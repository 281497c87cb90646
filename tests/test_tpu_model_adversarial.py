"""Adversarial tests of the TPU target on the CPU (``target="tpu"``): the block form of
``unroll_scans`` (``_block_emitter``) and ``_tpu_model.block_factor`` against ``jax.jit``
on loops that stress them (nested scans, reverse, lengths without divisors, no xs or ys,
int and bool carries, PRNG keys, gradients and vmap through the blocks)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxpar
from jaxpar._tpu_model import MAX_BLOCK_EQNS


def _assert_same(got: Any, want: Any) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
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
