"""Stream regions (``jaxpar._emit.region_call``) under every autodiff transformation, and the
scheduling groups they get.

Regions holding loops used to break `grad` under `jax.checkpoint` (JAX's transpose of an
`xla_metadata_call` whose body is a JVP'ed scan asserts), and the backward pass inherited the
forward regions' scheduling group, which XLA:GPU rejects as "annotation groups with gaps".
Each region is now an equation of jaxpar's own `stream_region_p`, whose JVP rule emits a
forward and a linear region in groups of their own (`jaxpar._ops.stream_region`). Lowering
only: no GPU or plugin needed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.lowered import GROUP_ATTRIBUTE, STREAM_ATTRIBUTE, lower_for_gpu, stream_calls
from helpers.trees import assert_tree_close, assert_tree_equal
from jax import lax

import jaxpar

# Regions holding loops are what is differentiated here: forced past the GPU pricing, which
# keeps small loops out of regions under XLA's default CUDA-graph mode (tests/test_plan_pricing.py).
OPTIONS = {"target": "gpu", "fuse_scans": False, "batch_scans": False,
           "batch_branches": False, "unroll": None, "min_cost_us": 0.0, "force_streams": True}
RTOL, ATOL = 2e-5, 2e-5


def two_scans(a, b, xs):
    """The README's example: two independent scans."""
    r1, _ = lax.scan(lambda c, x: (jnp.tanh(c @ x), None), a, xs)
    r2, _ = lax.scan(lambda c, x: (jnp.sin(x @ c) + c, None), b, xs)
    return r1, r2


def args(n=8, length=3):
    k = jax.random.split(jax.random.key(0), 3)
    return (0.4 * jax.random.normal(k[0], (n, n)), 0.4 * jax.random.normal(k[1], (n, n)),
            0.4 * jax.random.normal(k[2], (length, n, n)))


def loss_of(fn):
    return lambda *z: sum(jnp.sum(jnp.sin(o)) for o in fn(*z))


POLICIES = {
    "none": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


def checkpointed(policy_name):
    return jax.checkpoint(two_scans, policy=POLICIES[policy_name])


def nested_checkpoint(a, b, xs):
    inner = jax.checkpoint(two_scans)
    r1, r2 = inner(a, b, xs)
    return jax.checkpoint(lambda u, v: (jnp.tanh(u), v * 2.0))(r1, r2)


VARIANTS = {f"checkpoint[{name}]": functools.partial(checkpointed, name) for name in POLICIES}
VARIANTS["nested checkpoint"] = lambda: nested_checkpoint
VARIANTS["no checkpoint"] = lambda: two_scans


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_grad_of_checkpointed_regions_matches_jax(variant):
    fn = VARIANTS[variant]()
    g = jaxpar.parallel_branches(fn, **OPTIONS)
    grad = jax.jit(jax.grad(loss_of(g), argnums=(0, 1, 2)))
    assert_tree_close(grad(*args()), jax.jit(jax.grad(loss_of(fn), argnums=(0, 1, 2)))(*args()),
                      rtol=RTOL, atol=ATOL)
    calls = stream_calls(lower_for_gpu(jax.grad(loss_of(g), argnums=(0, 1, 2)), *args()))
    assert {attrs[STREAM_ATTRIBUTE] for _, attrs in calls} == {"1", "2"}


def test_checkpoint_around_the_rewritten_function():
    g = jax.checkpoint(jaxpar.parallel_branches(two_scans, **OPTIONS))
    assert_tree_close(jax.jit(jax.grad(loss_of(g), argnums=(0, 1, 2)))(*args()),
                      jax.jit(jax.grad(loss_of(two_scans), argnums=(0, 1, 2)))(*args()),
                      rtol=RTOL, atol=ATOL)


def test_checkpointed_two_scans_at_512_lower_with_streams():
    """The gradient of the two scans under jax.checkpoint at 512x512 (lowered with
    ShapeDtypeStructs)."""
    g = jaxpar.parallel_branches(jax.checkpoint(two_scans), target="gpu", fuse_scans=False,
                                 batch_scans=False, force_streams=True)
    a = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    xs = jax.ShapeDtypeStruct((8, 512, 512), jnp.float32)
    text = lower_for_gpu(jax.grad(lambda *z: sum(jnp.sum(o) for o in g(*z))), a, a, xs)
    assert len(stream_calls(text)) >= 2


def test_jvp_and_vjp_match_jax():
    g = jaxpar.parallel_branches(jax.checkpoint(two_scans), **OPTIONS)
    primals = args()
    tangents = tuple(jnp.cos(p) for p in primals)
    want = jax.jvp(two_scans, primals, tangents)
    assert_tree_close(jax.jit(lambda *p: jax.jvp(g, p, tangents))(*primals), want,
                      rtol=RTOL, atol=ATOL)
    out, pullback = jax.vjp(g, *primals)
    out_ref, pullback_ref = jax.vjp(two_scans, *primals)
    cts = tuple(jnp.sin(o) for o in out_ref)
    assert_tree_close(out, out_ref, rtol=RTOL, atol=ATOL)
    assert_tree_close(pullback(cts), pullback_ref(cts), rtol=RTOL, atol=ATOL)


def test_linear_transpose_matches_jax():
    w1, w2, xs = args()

    def linear(a, b):  # linear in (a, b): two independent linear scans
        r1, _ = lax.scan(lambda c, x: (c @ w1 + x, None), a, xs)
        r2, _ = lax.scan(lambda c, x: (w2 @ c - x @ c, None), b, xs)
        return r1, r2

    g = jaxpar.parallel_branches(linear, **OPTIONS)
    a, b = w1 * 0, w2 * 0
    cts = (jnp.cos(w1), jnp.sin(w2))
    assert_tree_close(jax.linear_transpose(g, a, b)(cts), jax.linear_transpose(linear, a, b)(cts),
                      rtol=RTOL, atol=ATOL)


def test_hessian_matches_jax():
    fn = jax.checkpoint(two_scans)
    g = jaxpar.parallel_branches(fn, **OPTIONS)
    a, b, xs = args(n=3, length=2)
    want = jax.hessian(loss_of(fn))(a, b, xs)
    assert_tree_close(jax.jit(jax.hessian(loss_of(g)))(a, b, xs), want, rtol=1e-4, atol=1e-5)


def test_regions_with_integer_inputs_and_outputs_differentiate():
    def f(x, y, idx):
        u = jnp.tanh(x @ x)[idx]  # an integer input into one region
        v = jnp.sin(y @ y)
        return jnp.sum(u) + jnp.sum(v), jnp.argmax(v, axis=0)  # an integer output

    g = jaxpar.parallel_branches(f, **OPTIONS)
    x, y, _ = args()
    idx = jnp.array([0, 3, 5])
    assert stream_calls(lower_for_gpu(g, x, y, idx))
    assert_tree_close(jax.jit(jax.grad(lambda *z: g(*z)[0], argnums=(0, 1)))(x, y, idx),
                      jax.grad(lambda *z: f(*z)[0], argnums=(0, 1))(x, y, idx),
                      rtol=RTOL, atol=ATOL)
    assert_tree_close(jax.jvp(g, (x, y, idx), (x, y, np.zeros(3, jax.dtypes.float0)))[1][0],
                      jax.jvp(f, (x, y, idx), (x, y, np.zeros(3, jax.dtypes.float0)))[1][0],
                      rtol=RTOL, atol=ATOL)


def test_vmap_of_grad_matches_jax():
    g = jaxpar.parallel_branches(jax.checkpoint(two_scans), **OPTIONS)
    a, b, xs = args()
    batch = jnp.stack([a, 0.5 * a])
    grad = jax.grad(loss_of(g), argnums=(0, 1))
    want = jax.vmap(jax.grad(loss_of(two_scans), argnums=(0, 1)), in_axes=(0, None, None))
    assert_tree_close(jax.jit(jax.vmap(grad, in_axes=(0, None, None)))(batch, b, xs),
                      want(batch, b, xs), rtol=RTOL, atol=ATOL)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scaled(act, x, scale):
    return act(x) * scale


def _scaled_fwd(act, x, scale):
    # Residuals holding an integer array and None: the linear half of a region gets both.
    return act(x) * scale, (x, jnp.arange(x.shape[-1]), None)


def _scaled_bwd(act, residuals, g):
    x, index, nothing = residuals
    assert nothing is None
    return g * jnp.cos(x) * (index + 1.0), jnp.zeros(())


_scaled.defvjp(_scaled_fwd, _scaled_bwd)


def custom_vjp_branches(x, y):
    """Two independent branches through a custom_vjp with a function argument."""
    return _scaled(jnp.sin, x @ x, 3.0).sum() + _scaled(jnp.tanh, y * 2.0, 2.0).sum()


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_vmap_of_grad_through_custom_vjp_with_a_function_argument(target):
    # jax.grad differentiates x only: y's tangent is zero. The rewritten program's JVP
    # made it a dense zero, a known value, so the linear half of y's region (a
    # custom_vjp's ``custom_lin``) ran as primal work, and vmap, batching it, failed
    # with "can't apply forward-mode autodiff (jvp) to a custom_vjp function".
    g = jaxpar.parallel_branches(custom_vjp_branches, target=target, min_cost_us=0.0,
                                 force_streams=True)
    x, y, _ = args()
    xs, ys = jnp.stack([x, 0.5 * x, -x]), jnp.stack([y, -y, 2.0 * y])
    for argnums in (0, (0, 1)):
        want = jax.jit(jax.vmap(jax.grad(custom_vjp_branches, argnums)))(xs, ys)
        got = jax.jit(jax.vmap(jax.grad(g, argnums)))(xs, ys)
        if target == "gpu":
            assert_tree_close(got, want, rtol=RTOL, atol=ATOL)
        else:
            assert_tree_equal(got, want)
    if target == "gpu":
        assert stream_calls(lower_for_gpu(g, x, y))


# --- scheduling groups -------------------------------------------------------------------


def _groups(text):
    """Scheduling group -> stream ids of the stream calls in lowered text."""
    groups: dict[str, list[str]] = {}
    for _, attrs in stream_calls(text):
        groups.setdefault(attrs[GROUP_ATTRIBUTE], []).append(attrs[STREAM_ATTRIBUTE])
    return groups


def test_backward_regions_get_groups_of_their_own():
    """Forward and backward regions sharing a group connect through the loss: XLA's "gap"."""
    g = jaxpar.parallel_branches(two_scans, **OPTIONS)
    text = lower_for_gpu(jax.grad(loss_of(g), argnums=(0, 1, 2)), *args())
    groups = _groups(text)
    # One group for the two forward regions, one for the two backward regions.
    assert sorted(sorted(streams) for streams in groups.values()) == [["1", "2"], ["1", "2"]]


def test_each_call_of_a_rewritten_function_gets_its_own_group():
    g = jaxpar.parallel_branches(two_scans, **OPTIONS)
    a, b, xs = args()

    def twice(a, b, xs):
        r1, r2 = g(a, b, xs)
        return g(jnp.tanh(r1), jnp.tanh(r2), xs)  # main-stream work between the two calls

    groups = _groups(lower_for_gpu(twice, a, b, xs))
    assert sorted(sorted(streams) for streams in groups.values()) == [["1", "2"], ["1", "2"]]
