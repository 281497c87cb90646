"""`parallel_branches` composed with `shard_map` over 4 fake CPU devices: a decorated
function inside a shard_map body, and a shard_map'ed function decorated; and decorated
functions of inputs sharded over a (4, 2) mesh of 8 devices, with `Auto` and `Explicit` axes.

The module asks for 8 CPU devices before JAX's backend starts. When an earlier test module
already started it with fewer devices, the tests (marked `cpu_devices`) run in one fresh
pytest process that has them (tests/conftest.py).
"""

from __future__ import annotations

import jax

try:  # 8 devices, or more where a process started for the device tests asks for more
    if jax.config.jax_num_cpu_devices < 8:  # MESH_DEVICES
        jax.config.update("jax_num_cpu_devices", 8)
except RuntimeError:  # the backend is already up: conftest runs the tests in a subprocess
    pass

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_same_values,
    assert_tree_equal,
    lower_for_gpu,
    nested_stream_calls,
    stream_calls,
)
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar

NUM_DEVICES = 4
MESH_DEVICES = 8  # the (4, 2) meshes of the tests of sharded inputs
pytestmark = pytest.mark.cpu_devices(NUM_DEVICES)


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[:NUM_DEVICES]), ("x",))


def branches(x, w):
    return jnp.tanh(x @ w) + jnp.sin(x @ w.T)


def _args():
    x = jnp.linspace(-1.0, 1.0, 32 * 16).reshape(32, 16)
    w = jnp.linspace(0.5, -0.5, 16 * 16).reshape(16, 16)
    return x, w


def _shard_map(body, mesh):
    return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))


def test_decorated_function_inside_shard_map_body():
    mesh = _mesh()
    g = jaxpar.parallel_branches(branches, target="gpu", min_cost_us=0.0, force_streams=True)
    x, w = _args()
    got = jax.jit(_shard_map(g, mesh))(x, w)
    want = jax.jit(_shard_map(branches, mesh))(x, w)
    assert_same_values(got, want, "gpu")
    text = lower_for_gpu(_shard_map(g, mesh), x, w)
    calls = stream_calls(text)
    assert sorted(attrs["_xla_stream_annotation"] for _, attrs in calls) == ["1", "2"]
    assert nested_stream_calls(text) == []


def test_shard_mapped_function_decorated():
    mesh = _mesh()
    sharded = _shard_map(branches, mesh)
    for target in ("gpu", "cpu"):
        g = jaxpar.parallel_branches(sharded, target=target, min_cost_us=0.0)
        x, w = _args()
        assert_same_values(g(*_args()), jax.jit(sharded)(x, w), target)
        assert_same_values(jax.jit(g)(x, w), jax.jit(sharded)(x, w), target)


def test_shard_map_with_collective_and_decorated_body():
    mesh = _mesh()

    def body(x, w):
        y = jnp.tanh(x @ w) + jnp.sin(x @ w.T)
        return jax.lax.psum(y, "x")

    def decorated_body(x, w):
        inner = jaxpar.parallel_branches(branches, target="gpu", min_cost_us=0.0)
        return jax.lax.psum(inner(x, w), "x")

    specs = {"in_specs": (P("x"), P()), "out_specs": P()}
    x, w = _args()
    got = jax.jit(jax.shard_map(decorated_body, mesh=mesh, **specs))(x, w)
    want = jax.jit(jax.shard_map(body, mesh=mesh, **specs))(x, w)
    assert_same_values(got, want, "gpu")


def test_grad_through_shard_map_with_decorated_body():
    mesh = _mesh()
    g = jaxpar.parallel_branches(branches, target="gpu", min_cost_us=0.0)
    x, w = _args()

    def loss(fn):
        return lambda x, w: jnp.sum(_shard_map(fn, mesh)(x, w) ** 2)

    got = jax.jit(jax.grad(loss(g), argnums=(0, 1)))(x, w)
    want = jax.jit(jax.grad(loss(branches), argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)


# --- loop and subgraph passes inside a shard_map body ---------------------------------------
# Their rewrites are traced on the body's values, whose types name the mesh axes: JAX only
# traces such values with those axes bound (issue 10, point 5).


def _ensemble_body(x, w1, w2, w3, w4):
    return [jnp.tanh(jnp.tanh(x @ w) @ w) for w in (w1, w2, w3, w4)]


def _scans_body(x, w1, w2, w3, w4):
    def step(w):
        return lambda c, _: (jnp.tanh(c @ w), None)
    return [jax.lax.scan(step(w), x, None, length=5)[0] for w in (w1, w2, w3, w4)]


def _mixed_scans_body(x, w1, w2, w3, w4):
    first = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w1), None), x, None, length=5)[0]
    second = jax.lax.scan(lambda c, _: (jnp.sin(c @ w2) + w3[0], None), x, None, length=5)[0]
    return [first, second, x @ w4]


def _shard_map_program(body, outputs):
    return jax.shard_map(body, mesh=_mesh(), in_specs=(P("x"),) + (P(),) * 4,
                         out_specs=[P("x")] * outputs)


def _weights():
    return [jnp.linspace(-0.3, 0.3, 16 * 16).reshape(16, 16) * (k + 1) for k in range(4)]


def _decisions_inside_body(fn, args, kind, **options):
    plan = jaxpar.inspect(fn, target="gpu", **options)(*args)
    return [d for d in (*plan.loops, *plan.subgraphs)
            if d.kind == kind and d.location.startswith("/shard_map#")]


def test_loop_and_subgraph_passes_inside_shard_map_body():
    x = jnp.linspace(-1.0, 1.0, 32 * 16).reshape(32, 16)
    args = (x, *_weights())
    cases = [
        (_ensemble_body, 4, "batched subgraphs",
         {"batch_branches": True, "batch_scans": False, "fuse_scans": False}),
        (_scans_body, 4, "batched",
         {"batch_branches": False, "batch_scans": True, "fuse_scans": False}),
        (_mixed_scans_body, 3, "fused",
         {"batch_branches": False, "batch_scans": False, "fuse_scans": True}),
    ]
    for body, outputs, kind, options in cases:
        fn = _shard_map_program(body, outputs)
        assert _decisions_inside_body(fn, args, kind, **options), (body.__name__, kind)
        want = jax.jit(fn)(*args)
        g = jaxpar.parallel_branches(fn, target="gpu", **options)
        assert_same_values(g(*args), want, "gpu")
        assert_same_values(jax.jit(g)(*args), want, "gpu")


# --- inputs sharded over a (4, 2) mesh ---------------------------------------------------

W8 = jnp.linspace(-0.2, 0.2, 64).reshape(8, 8)


def reductions(a, b):
    return (jnp.tanh(a * 2.0).sum(axis=1), jnp.sin(b + 1.0).sum(), jnp.cos(a) * 3.0,
            jnp.exp(b).sum(axis=0))


def matmuls(a, b):
    return jnp.tanh(a @ W8) @ W8, jnp.sin(b @ W8) @ W8.T, (a @ b.T).sum()


def mixed(a, b):
    u, v = jnp.tanh(a @ W8), jnp.sin(b @ W8)
    return u.T, v[0], u + 1.0, (u @ v.T).sum(axis=0)


def members(a, b):
    """Independent members, each with results of two shardings (a region with several
    results of one dtype, which jax 0.10 packs into one flat array)."""
    return (jnp.tanh(a * 2.0).sum(axis=1), jnp.cos(a) * 3.0, jnp.sin(b + 1.0).sum(axis=1),
            jnp.exp(b) * 2.0, (W8 @ W8).sum(axis=0))


def _mesh_4x2(axis_type):
    return jax.make_mesh((4, 2), ("x", "y"), axis_types=(axis_type, axis_type),
                         devices=jax.devices("cpu")[:MESH_DEVICES])


def _sharded(mesh, a_spec, b_spec):
    a = jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)
    b = jnp.linspace(0.0, 2.0, 64).reshape(8, 8)
    return (jax.device_put(a, NamedSharding(mesh, a_spec)),
            jax.device_put(b, NamedSharding(mesh, b_spec)))


def _assert_like_jit(got, want, target):
    assert_same_values(got, want, target)
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (index, g.sharding, w.sharding)


@pytest.mark.cpu_devices(MESH_DEVICES)
@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_members_on_an_explicit_mesh(target):
    # jax 0.10 packs a region's results into one flat array: a concatenate of values of
    # different explicit shardings is a ShardingTypeError.
    mesh = _mesh_4x2(AxisType.Explicit)
    g = jaxpar.parallel_branches(members, target=target, force_streams=True, min_cost_us=0.0)
    with jax.set_mesh(mesh):
        args = _sharded(mesh, P("x", None), P())
        want = jax.jit(members)(*args)
        _assert_like_jit(g(*args), want, target)
        _assert_like_jit(jax.jit(g)(*args), want, target)
        if target == "gpu":
            assert len(stream_calls(lower_for_gpu(g, *args))) >= 2
    assert_tree_equal(jax.jit(members)(*args),
                      jaxpar.parallel_branches(members, target=target)(*args))


SHARDED_PROGRAMS = {"reductions": reductions, "matmuls": matmuls, "mixed": mixed}
SPECS = {"x_by_y": (P("x", None), P(None, "y")), "y_by_x": (P(None, "x"), P("y", None)),
         "x_replicated": (P("x", None), P())}


@pytest.mark.cpu_devices(MESH_DEVICES)
@pytest.mark.parametrize("specs", sorted(SPECS))
@pytest.mark.parametrize("program", sorted(SHARDED_PROGRAMS))
@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_forced_regions_keep_the_output_shardings_of_jit(target, program, specs):
    # A constant passed into a region's non-inlined call, or results packed into one flat
    # array (jax 0.10), made XLA shard a result across devices where jax.jit replicates it.
    fn = SHARDED_PROGRAMS[program]
    mesh = _mesh_4x2(AxisType.Auto)
    args = _sharded(mesh, *SPECS[specs])
    want = jax.jit(fn)(*args)
    g = jaxpar.parallel_branches(fn, target=target, force_streams=True, min_cost_us=0.0)
    _assert_like_jit(g(*args), want, target)
    if target == "gpu":
        assert len(stream_calls(lower_for_gpu(g, *args))) >= 2
