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
from helpers.lowered import lower_for_gpu, nested_stream_calls, stream_calls
from helpers.trees import assert_same_values, assert_tree_equal
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
# traces such values with those axes bound.


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
    return [d for d in plan.decisions
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


# --- reverse mode of a body with grouped collectives -----------------------------------------


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


# --- a decorated function nested in a shard_map body over 8 devices: the CPU promise ------
# (docs/guide.md, "Same values"): bit for bit what a nested jax.jit gives, values and
# gradients, eagerly or under an outer jit; under an outer jit, the value bit for bit what
# jax.jit of the undecorated function gives. Against the undecorated function run
# eagerly, no bits are promised (jax.jit's own value moves by an ulp between jax patch
# releases: 557.00055 and 557.0006): values and gradients within 4e-7 of their largest
# magnitude, as the nested jax.jit's.


def _two_chains(x, w, s):  # two independent chains and a Python float
    a = jnp.tanh(jnp.tanh(x @ w) @ w)
    b = jnp.tanh(jnp.sin(x @ w.T * s) @ w)
    return a + b


def _nested_in_shard_map(decorate):
    inner = decorate(_two_chains)
    mesh = Mesh(np.array(jax.devices("cpu")[:MESH_DEVICES]), ("x",))

    def loss(x, w):
        body = lambda y, v: jnp.sum(inner(y * y[0, 1], v, 1.7) ** 2)[None]
        return jnp.sum(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()),
                                     out_specs=P("x"))(x, w))

    return loss


@pytest.mark.cpu_devices(MESH_DEVICES)
def test_nested_in_a_shard_map_body_on_eight_devices_is_bit_exact_with_a_nested_jit():
    x = jax.random.normal(jax.random.key(0), (8 * MESH_DEVICES, 16))
    w = jax.random.normal(jax.random.key(1), (16, 16)) * 0.3
    got_fn = _nested_in_shard_map(lambda f: jaxpar.parallel_branches(f, target="cpu"))
    want_fn = _nested_in_shard_map(jax.jit)
    plain_fn = _nested_in_shard_map(lambda f: f)
    for transform in (lambda f: jax.value_and_grad(f, argnums=(0, 1)),
                      lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))):
        got = transform(got_fn)(x, w)
        assert_tree_equal(got, transform(want_fn)(x, w))
        value, grads = transform(plain_fn)(x, w)
        for g, p in zip((got[0], *got[1]), (value, *grads), strict=True):
            np.testing.assert_allclose(g, p, rtol=0, atol=4e-7 * float(np.max(np.abs(p))))
    np.testing.assert_array_equal(jax.jit(got_fn)(x, w), jax.jit(plain_fn)(x, w))


def test_shardings_given_as_options_are_those_of_the_compiled_program():
    """``in_shardings``/``out_shardings`` taken as ``jax.jit`` takes them: the call's inputs
    are placed and its output laid out by them, and the compiled program has them; under
    an outer jit they are sharding constraints."""
    devices = np.array(jax.devices("cpu")[:MESH_DEVICES]).reshape(4, 2)
    mesh = Mesh(devices, ("x", "y"))
    x_sharding = NamedSharding(mesh, P("x", None))
    w_sharding = NamedSharding(mesh, P(None, "y"))
    out_sharding = NamedSharding(mesh, P("x", "y"))
    g = jaxpar.parallel_branches(branches, in_shardings=(x_sharding, w_sharding),
                                 out_shardings=out_sharding)
    plain = jax.jit(branches, in_shardings=(x_sharding, w_sharding),
                    out_shardings=out_sharding)
    x, w = _args()
    got = g(x, w)
    # Values to a float's rounding: the partitioned program may sum in another order.
    np.testing.assert_allclose(got, plain(x, w), rtol=1e-6, atol=1e-6)
    assert got.sharding.is_equivalent_to(out_sharding, got.ndim)
    compiled = g.lower(x, w).compile()
    (ins, _), outs = compiled.input_shardings, compiled.output_shardings
    assert ins[0].is_equivalent_to(x_sharding, 2) and ins[1].is_equivalent_to(w_sharding, 2)
    assert outs.is_equivalent_to(out_sharding, 2)
    nested = jax.jit(lambda x, w: g(x, w) * 2.0)(x, w)
    np.testing.assert_allclose(nested, plain(x, w) * 2.0, rtol=1e-6, atol=1e-6)
