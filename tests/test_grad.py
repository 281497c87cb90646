"""`parallel_branches` composed with `jax.grad`: gradients match the original's, through
jit, for higher order, and the backward pass keeps stream annotations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FOUR_BRANCHES_OPTIONS,
    LOOPS_OFF,
    STREAM_ATTRIBUTE,
    assert_tree_close,
    four_branches,
    four_branches_args,
    lower_for_gpu,
    nested_stream_calls,
    stream_calls,
    two_scans,
    two_scans_args,
)
from jax.test_util import check_grads

import jaxpar

TARGETS = ["gpu", "cpu"]
RTOL, ATOL = 1e-5, 1e-5


def scans_loss(a, b):
    x, y = two_scans(a, b)
    return jnp.sum(x * x) + jnp.sum(jnp.sin(y))


def branches_loss(a, b, c, d):
    return jnp.sum(four_branches(a, b, c, d) ** 2)


@pytest.mark.parametrize("target", TARGETS)
def test_grad_two_scans(target):
    g = jaxpar.parallel_branches(scans_loss, target=target)
    args = two_scans_args()
    got = jax.grad(g, argnums=(0, 1))(*args)
    want = jax.grad(scans_loss, argnums=(0, 1))(*args)
    assert_tree_close(got, want, RTOL, ATOL)


@pytest.mark.parametrize("target", TARGETS)
def test_grad_of_decorated_inner_function(target):
    g = jaxpar.parallel_branches(four_branches, **{**FOUR_BRANCHES_OPTIONS, "target": target})
    args = four_branches_args()

    def loss(*args):
        return jnp.sum(g(*args) ** 2)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    want = jax.jit(jax.grad(branches_loss, argnums=(0, 1, 2, 3)))(*args)
    assert_tree_close(got, want, RTOL, ATOL)


def test_value_and_grad_with_pytree_args():
    def loss(params, x):
        return jnp.sum(jnp.tanh(x @ params["w1"])) + jnp.sum(jnp.sin(x @ params["w2"]) ** 2)

    g = jaxpar.parallel_branches(loss, target="gpu", min_cost_us=0.0)
    params = {"w1": jnp.eye(16) * 0.7, "w2": jnp.ones((16, 16)) * 0.05}
    x = jnp.linspace(-1.0, 1.0, 128).reshape(8, 16)
    got = jax.value_and_grad(g)(params, x)
    want = jax.value_and_grad(loss)(params, x)
    assert_tree_close(got, want, RTOL, ATOL)


def test_grad_lowers_with_annotations_in_forward_and_backward():
    g = jaxpar.parallel_branches(scans_loss, target="gpu", **LOOPS_OFF)
    text = lower_for_gpu(jax.grad(g, argnums=(0, 1)), *two_scans_args())
    calls = stream_calls(text)
    # Forward regions and their transposes: at least the two forward calls, ids in {1, 2}.
    assert len(calls) >= 2
    assert {attrs[STREAM_ATTRIBUTE] for _, attrs in calls} <= {"1", "2"}
    assert nested_stream_calls(text) == []


def small_loss(x, y):
    return jnp.sum(jnp.sin(x @ y)) + jnp.sum(jnp.cos(y @ x) * x)


def test_grad_of_grad_small_case():
    g = jaxpar.parallel_branches(small_loss, target="gpu", min_cost_us=0.0)
    x = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)
    y = jnp.linspace(0.5, -0.5, 16).reshape(4, 4)
    assert len(stream_calls(lower_for_gpu(g, x, y))) == 2

    def second(fn):
        return jax.grad(lambda x, y: jnp.sum(jax.grad(fn)(x, y) ** 2))(x, y)

    assert_tree_close(second(g), second(small_loss), 1e-4, 1e-5)
    hessian_got = jax.hessian(g)(x, y)
    hessian_want = jax.hessian(small_loss)(x, y)
    assert_tree_close(hessian_got, hessian_want, 1e-4, 1e-5)


def test_check_grads_numerically():
    g = jaxpar.parallel_branches(small_loss, target="gpu", min_cost_us=0.0)
    x = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(4, 4)
    y = np.linspace(0.5, -0.5, 16, dtype=np.float32).reshape(4, 4)
    check_grads(g, (x, y), order=2, modes=("fwd", "rev"), atol=5e-2, rtol=5e-2)


def test_jvp_and_vjp():
    g = jaxpar.parallel_branches(small_loss, target="gpu", min_cost_us=0.0)
    x = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)
    y = jnp.linspace(0.5, -0.5, 16).reshape(4, 4)
    tangents = (jnp.ones_like(x), jnp.full_like(y, 0.5))
    assert_tree_close(jax.jvp(g, (x, y), tangents), jax.jvp(small_loss, (x, y), tangents),
                      RTOL, ATOL)
    _, pullback_got = jax.vjp(g, x, y)
    _, pullback_want = jax.vjp(small_loss, x, y)
    assert_tree_close(pullback_got(jnp.float32(1.5)), pullback_want(jnp.float32(1.5)),
                      RTOL, ATOL)
