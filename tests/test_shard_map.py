"""`parallel_branches` composed with `shard_map` over 4 fake CPU devices: a decorated
function inside a shard_map body, and a shard_map'ed function decorated.

The module asks for 4 CPU devices before JAX's backend starts. When an earlier test module
already started it with fewer devices, the tests (marked `cpu_devices`) run in one fresh
pytest process that has them (tests/conftest.py).
"""

from __future__ import annotations

import jax

try:  # 4 devices, or more where a process started for the device tests asks for more
    if jax.config.jax_num_cpu_devices < 4:
        jax.config.update("jax_num_cpu_devices", 4)
except RuntimeError:  # the backend is already up: conftest runs the tests in a subprocess
    pass

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_values, lower_for_gpu, nested_stream_calls, stream_calls
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxpar

NUM_DEVICES = 4
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


# --- reverse mode of a body with grouped collectives (issue 32, point 6) ---------------------


def _collective_matmul_body(x, w1, w2):
    # Two matmul chains, each sending its result round the ring the opposite way (the
    # two ppermutes form one collectives group on the GPU target), then a psum.
    forward = [(i, (i + 1) % NUM_DEVICES) for i in range(NUM_DEVICES)]
    backward = [(i, (i - 1) % NUM_DEVICES) for i in range(NUM_DEVICES)]
    a = jax.lax.ppermute(jnp.tanh(x @ w1), "x", forward)
    b = jax.lax.ppermute(jnp.tanh(x @ w2), "x", backward)
    return a @ w1 + b @ w2 + jax.lax.psum(jnp.sum(a * b), "x")


def _assert_same_gradients(got, want, target):
    """Bit for bit on the CPU target; on the GPU target (calls XLA fuses around) close
    relative to each leaf's largest entry, as sums of large terms cancel to small ones."""
    if target == "cpu":
        jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)
        return
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(w))))


def _collective_matmul_args():
    keys = jax.random.split(jax.random.key(3), 3)
    return (jax.random.normal(keys[0], (32, 16)),
            jax.random.normal(keys[1], (16, 16)) * 0.3, jax.random.normal(keys[2], (16, 16)) * 0.3)


def _collective_matmul_loss(body, decorate_body):
    sharded = jax.shard_map(body if decorate_body is None else decorate_body(body),
                            mesh=_mesh(), in_specs=(P("x"), P(), P()), out_specs=P("x"))
    return lambda x, w1, w2: jnp.sum(jnp.sin(sharded(x, w1, w2)))


_REVERSE_MODES = {
    "grad": lambda f: jax.grad(f, argnums=(0, 1, 2)),
    "jit_grad": lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2))),
    "value_and_grad": lambda f: jax.value_and_grad(f, argnums=(0, 1, 2)),
    "vjp": lambda f: lambda *args: jax.vjp(f, *args)[1](jnp.float32(1.5)),
}


@pytest.mark.parametrize("mode", sorted(_REVERSE_MODES))
@pytest.mark.parametrize("target", ["gpu", "cpu"])
def test_reverse_mode_of_decorated_body_with_grouped_collectives(target, mode):
    # The ppermute group was a bare xla_metadata_call, which JAX differentiates whole:
    # reverse mode of the shard_map (eager, or under jit) raised "Linearization failed
    # to produce known values for all output primals".
    transform = _REVERSE_MODES[mode]
    args = _collective_matmul_args()
    want = jax.jit(transform(_collective_matmul_loss(_collective_matmul_body, None)))(*args)
    decorate = lambda f: jaxpar.parallel_branches(f, target=target)
    got = transform(_collective_matmul_loss(_collective_matmul_body, decorate))(*args)
    _assert_same_gradients(got, want, target)


def test_reverse_mode_of_grouped_collectives_keeps_groups():
    # The derivative's ppermutes (forward, tangent and transposed) are groups too.
    args = _collective_matmul_args()
    decorate = lambda f: jaxpar.parallel_branches(f, target="gpu")
    loss = _collective_matmul_loss(_collective_matmul_body, decorate)
    assert "_collectives_group" in jax.jit(loss).lower(*args).as_text()
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).as_text()
    assert text.count("_collectives_group") >= 2


@pytest.mark.parametrize("target", ["gpu", "cpu"])
def test_reverse_mode_of_decorated_shard_map_with_grouped_collectives(target):
    args = _collective_matmul_args()
    sharded = jax.shard_map(_collective_matmul_body, mesh=_mesh(),
                            in_specs=(P("x"), P(), P()), out_specs=P("x"))
    g = jaxpar.parallel_branches(sharded, target=target)
    for mode in ("grad", "vjp"):
        transform = _REVERSE_MODES[mode]
        want = jax.jit(transform(lambda *a: jnp.sum(jnp.sin(sharded(*a)))))(*args)
        got = transform(lambda *a: jnp.sum(jnp.sin(g(*a))))(*args)
        _assert_same_gradients(got, want, target)
