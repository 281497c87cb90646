"""`parallel_branches` composed with `jax.vmap`: in_axes / out_axes variants, nested vmap,
vmap under jit, and annotations in the batched program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers.lowered import STREAM_ATTRIBUTE, lower_for_gpu, stream_calls
from helpers.programs import LOOPS_OFF, two_scans, two_scans_args
from helpers.trees import assert_same_values, assert_tree_close

import jaxpar

TARGETS = ["gpu", "cpu"]


def pair(x, w):
    return jnp.tanh(x @ w), jnp.sin(w @ x.T)


def batch(n=3, size=16):
    xs = jnp.stack([jnp.linspace(-1.0, 1.0, size * size).reshape(size, size) * (i + 1)
                    for i in range(n)]) * 0.1
    ws = jnp.stack([jnp.eye(size) * (0.5 + 0.1 * i) for i in range(n)])
    return xs, ws


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("in_axes", [(0, 0), (0, None), (None, 0), (1, 2), 0])
def test_vmap_in_axes(target, in_axes):
    g = jaxpar.parallel_branches(pair, target=target, min_cost_us=0.0)
    xs, ws = batch()
    args_by_axes = {
        (0, 0): (xs, ws),
        (0, None): (xs, ws[0]),
        (None, 0): (xs[0], ws),
        (1, 2): (jnp.moveaxis(xs, 0, 1), jnp.moveaxis(ws, 0, 2)),
        0: (xs, ws),
    }
    args = args_by_axes[in_axes]
    want = jax.jit(jax.vmap(pair, in_axes=in_axes))(*args)
    assert_same_values(jax.vmap(g, in_axes=in_axes)(*args), want, target)


@pytest.mark.parametrize("target", TARGETS)
def test_vmap_out_axes_and_jit(target):
    g = jaxpar.parallel_branches(pair, target=target, min_cost_us=0.0)
    xs, ws = batch()
    got = jax.jit(jax.vmap(g, out_axes=(1, 2)))(xs, ws)
    want = jax.jit(jax.vmap(pair, out_axes=(1, 2)))(xs, ws)
    assert_same_values(got, want, target)


def test_vmap_of_pytree_and_kwargs():
    def f(params, x, *, bias):
        return {"a": jnp.tanh(x @ params["w1"]) + bias, "b": jnp.cos(x @ params["w2"])}

    g = jaxpar.parallel_branches(f, target="gpu", min_cost_us=0.0,
                                 force_streams=True)
    xs, ws = batch()
    params = {"w1": ws, "w2": ws * 0.5}
    got = jax.vmap(lambda p, x: g(p, x, bias=jnp.float32(0.5)))(params, xs)
    want = jax.vmap(lambda p, x: f(p, x, bias=jnp.float32(0.5)))(params, xs)
    assert_same_values(got, want, "gpu")


def test_nested_vmap():
    g = jaxpar.parallel_branches(pair, target="gpu", min_cost_us=0.0,
                                 force_streams=True)
    xs, ws = batch()
    xss = jnp.stack([xs, xs * 2.0])
    got = jax.vmap(jax.vmap(g, in_axes=(0, None)), in_axes=(0, None))(xss, ws[0])
    want = jax.jit(jax.vmap(jax.vmap(pair, in_axes=(0, None)), in_axes=(0, None)))(xss, ws[0])
    assert_same_values(got, want, "gpu")


def test_vmap_of_two_scans_keeps_annotations():
    g = jaxpar.parallel_branches(two_scans, target="gpu", **LOOPS_OFF)
    a, b = two_scans_args()
    a_batch, b_batch = jnp.stack([a, a * 0.5]), jnp.stack([b, -b])
    batched = jax.vmap(g)
    calls = stream_calls(lower_for_gpu(batched, a_batch, b_batch))
    assert sorted(attrs[STREAM_ATTRIBUTE] for _, attrs in calls) == ["1", "2"]
    assert_same_values(batched(a_batch, b_batch),
                       jax.jit(jax.vmap(two_scans))(a_batch, b_batch), "gpu")


def test_grad_of_vmap():
    g = jaxpar.parallel_branches(pair, target="gpu", min_cost_us=0.0,
                                 force_streams=True)
    xs, ws = batch()

    def loss(fn):
        return lambda xs, ws: sum(jnp.sum(o ** 2) for o in jax.vmap(fn)(xs, ws))

    assert_tree_close(jax.grad(loss(g), argnums=(0, 1))(xs, ws),
                      jax.grad(loss(pair), argnums=(0, 1))(xs, ws), 1e-5, 1e-5)


# ---------------------------------------------------------------- a psum over a vmap axis name


def _batch_norm(x):
    """What Equinox's and Flax's BatchNorm with ``axis_name`` compute, per example."""
    mean = jax.lax.pmean(x, "batch")
    var = jax.lax.pmean((x - mean) ** 2, "batch")
    return (x - mean) / jnp.sqrt(var + 1e-5)


def _tower(w1, w2, x):
    h = jax.vmap(_batch_norm, axis_name="batch")(jnp.tanh(x @ w1))
    return jnp.tanh(h @ w2)


def _two_towers(p, q, x):
    return (_tower(*p, x) * _tower(*q, x)).sum()


def _towers_args(width=32):
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    p = (jax.random.normal(k[0], (width, width)) / 6, jax.random.normal(k[1], (width, width)) / 6)
    q = (jax.random.normal(k[2], (width, width)) / 6, jax.random.normal(k[3], (width, width)) / 6)
    return p, q, jax.random.normal(k[4], (16, width))


def test_psum_over_a_vmap_axis_is_a_local_reduction():
    from jaxpar._program.primitives import is_collective

    x = jnp.ones((4, 3))
    local = jax.make_jaxpr(jax.vmap(_batch_norm, axis_name="batch"))(x)
    psums = [e for e in local.jaxpr.eqns if e.primitive.name == "psum"]
    assert psums and all(e.params["axes"] == (0,) for e in psums)  # positional: vmap's
    assert not any(is_collective(e) for e in psums)
    named = jax.make_jaxpr(lambda v: jax.lax.psum(v, "i"), axis_env=[("i", 2)])(x)
    assert is_collective(named.jaxpr.eqns[0])  # a named axis communicates


def test_work_around_a_vmap_axis_psum_is_placed_in_regions():
    args = _towers_args()
    options = dict(target="gpu", force_streams=True, batch_branches=False, batch_matmuls=False)
    plan = jaxpar.inspect(_two_towers, **options)(*args)
    assert plan.sections and len(plan.sections[0].regions) == 2
    assert "collective" not in str(plan)
    g = jaxpar.parallel_branches(_two_towers, **options)
    assert len(stream_calls(lower_for_gpu(g, *args))) == 2
    assert_tree_close(g(*args), jax.jit(_two_towers)(*args), rtol=1e-5, atol=1e-5)
    assert_tree_close(jax.grad(g, argnums=(0, 1))(*args),
                      jax.jit(jax.grad(_two_towers, argnums=(0, 1)))(*args),
                      rtol=1e-4, atol=1e-5)


def test_towers_with_vmap_axis_psums_are_batched():
    args = _towers_args()
    # In XLA's default CUDA-graph mode (lhs), where batching the towers saves launches (the
    # mode jaxpar would choose, concurrent, overlaps them unbatched instead).
    plan = jaxpar.inspect(_two_towers, target="gpu", command_buffers="lhs")(*args)
    assert [d.kind for d in plan.decisions] == ["batched subgraphs"]
    g = jaxpar.parallel_branches(_two_towers, target="gpu", command_buffers="lhs")
    assert_tree_close(g(*args), jax.jit(_two_towers)(*args), rtol=1e-5, atol=1e-5)
    assert_tree_close(jax.grad(g, argnums=(0, 1))(*args),
                      jax.jit(jax.grad(_two_towers, argnums=(0, 1)))(*args),
                      rtol=1e-4, atol=1e-5)
