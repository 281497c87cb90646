"""A `psum`/`pmean` over a `jax.vmap` axis name is a reduction on this device.

`jax.vmap(f, axis_name="batch")` with `pmean(x, "batch")` inside is what Equinox's and
Flax's BatchNorm with `axis_name` produce. Traced at the unbatched shapes, `f` holds a
`psum` over the *name*, which jaxpar took for a cross-device collective: it never put the
work around it in a region, even forced. A name bound by a `vmap` on this device (without
`spmd_axis_name`, which spreads the axis over devices) now counts as local, and the plan is
keyed by those names, so the same function under a `shard_map` axis of that name keeps
its collective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.lowered import lower_for_gpu, stream_calls
from helpers.trees import assert_tree_close

import jaxpar
from jaxpar import _compat
from jaxpar._program import primitives as _primitives

FORCED = {"target": "gpu", "force_streams": True, "min_cost_us": 0.0}
W = jnp.full((8, 8), 0.1)


def normalized_towers(a, b):
    """Two towers, each normalized by its batch statistics over the vmap axis."""
    x = jnp.tanh(a @ W) @ W
    x = x - jax.lax.pmean(x, "batch")
    y = jnp.sin(b @ W) @ W
    # (pmax has no derivative on jax 0.12: its operand carries none.)
    y = y / (1.0 + jax.lax.pmax(jax.lax.stop_gradient(jnp.abs(y)), "batch"))
    return x, y


A = jnp.linspace(-1.0, 1.0, 3 * 4 * 8).reshape(3, 4, 8)


def test_work_around_a_vmap_axis_psum_goes_on_streams_when_forced():
    pb = jaxpar.parallel_branches(normalized_towers, **FORCED)
    mapped = jax.vmap(pb, axis_name="batch")
    want = jax.vmap(normalized_towers, axis_name="batch")(A, A * 0.5)
    assert_tree_close(mapped(A, A * 0.5), want)
    assert len(stream_calls(lower_for_gpu(mapped, A, A * 0.5))) == 2
    # Under jit and grad as well.
    loss = lambda f: lambda a, b: sum(jnp.sum(t ** 2) for t in jax.vmap(f, axis_name="batch")(a, b))
    assert_tree_close(jax.jit(jax.grad(loss(pb)))(A, A * 0.5),
                      jax.grad(loss(normalized_towers))(A, A * 0.5), rtol=1e-5, atol=1e-6)


def test_nested_vmaps_name_both_axes():
    def f(a):
        return jax.lax.psum(jnp.tanh(a @ W), ("outer", "inner")), jnp.sin(a @ W.T) @ W

    pb = jaxpar.parallel_branches(f, **FORCED)
    both = jax.vmap(jax.vmap(pb, axis_name="inner"), axis_name="outer")
    args = jnp.stack([A, -A])
    assert_tree_close(both(args), jax.vmap(jax.vmap(f, axis_name="inner"), axis_name="outer")(args))
    assert len(stream_calls(lower_for_gpu(both, args))) == 2


def test_vmap_axis_names_are_read_from_the_tracers():
    seen = []

    def record(x):
        seen.append(_compat.vmap_axis_names([x]))
        return x

    jax.vmap(jax.vmap(record, axis_name="i"), axis_name="j")(jnp.ones((2, 3)))
    jax.vmap(record)(jnp.ones(2))  # unnamed
    record(jnp.ones(2))  # not mapped at all
    assert seen == [frozenset({"i", "j"}), frozenset(), frozenset()]


def test_spmd_axis_names_stay_collectives():
    seen = []

    def record(x):
        seen.append(_compat.vmap_axis_names([x]))
        return x

    mesh = jax.make_mesh((1,), ("devices",))
    with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else mesh:
        jax.vmap(record, axis_name="i", spmd_axis_name="devices")(jnp.ones((1, 2)))
    assert seen == [frozenset()]


def test_is_collective_reads_the_local_axes():
    def f(x):
        return jax.lax.psum(x, "batch"), jax.lax.ppermute(x, "batch", [(0, 0)])

    jaxpr = jax.make_jaxpr(f, axis_env=[("batch", 2)])(jnp.ones(3))
    psum, ppermute = jaxpr.eqns
    assert _primitives.is_collective(psum) and _primitives.is_collective(ppermute)
    with _primitives.local_axes(frozenset({"batch"})):
        assert not _primitives.is_collective(psum)
        assert _primitives.is_collective(ppermute)  # moves data between members: kept
    assert _primitives.is_collective(psum)


def test_the_same_function_under_shard_map_keeps_its_collective():
    pb = jaxpar.parallel_branches(normalized_towers, **FORCED)
    jax.vmap(pb, axis_name="batch")(A, A * 0.5)  # planned with "batch" local
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))
    sharded = jax.jit(jax.shard_map(pb, mesh=mesh, in_specs=jax.P("batch"),
                                    out_specs=jax.P("batch")))
    want = jax.jit(jax.shard_map(normalized_towers, mesh=mesh, in_specs=jax.P("batch"),
                                 out_specs=jax.P("batch")))(A[0], A[0] * 0.5)
    assert_tree_close(sharded(A[0], A[0] * 0.5), want)
    assert pb.analyses == 2  # a second plan: the names are not local there


@pytest.mark.parametrize("framework", ["equinox"])
def test_equinox_batchnorm_under_filter_vmap(framework):
    eqx = pytest.importorskip(framework)
    keys = jax.random.split(jax.random.key(0), 2)
    towers = [eqx.nn.Sequential([eqx.nn.Linear(8, 8, key=k), eqx.nn.Lambda(jnp.tanh)])
              for k in keys]
    norms = [eqx.nn.BatchNorm(8, axis_name="batch") for _ in keys]
    state = eqx.nn.State(norms)

    def two(towers, norms, state, a, b):
        x, state = norms[0](towers[0](a), state)
        y, state = norms[1](towers[1](b), state)
        return x + y, state

    pb = jaxpar.parallel_branches(two, **FORCED)
    run = lambda f: eqx.filter_vmap(f, in_axes=(None, None, None, 0, 0), out_axes=(0, None),
                                    axis_name="batch")
    a = jax.random.normal(jax.random.key(1), (5, 8))
    got, got_state = run(pb)(towers, norms, state, a, -a)
    want, want_state = run(two)(towers, norms, state, a, -a)
    assert_tree_close(got, want)
    assert_tree_close(jax.tree.leaves(got_state), jax.tree.leaves(want_state))
    assert np.isfinite(np.asarray(got)).all()
