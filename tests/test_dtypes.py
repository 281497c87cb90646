"""Weak types and extended dtypes (PRNG keys, float0 tangents) through the rewrites, the
emitter and the cost model: every result keeps ``jax.jit``'s type and values."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxpar
from jaxpar import _compat
from jaxpar._analysis import Analysis
from jaxpar._options import Options

FORCED = {"target": "gpu", "min_cost_us": 0.0, "force_streams": True}
W = jnp.eye(8) * 0.5


def _values(tree: Any) -> list[np.ndarray]:
    """Leaves as NumPy arrays, key arrays as their key data."""
    return [np.asarray(jax.random.key_data(v))
            if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else np.asarray(v)
            for v in jax.tree_util.tree_leaves(tree)]


def assert_like_jit(f: Any, args: tuple[Any, ...], **options: Any) -> None:
    """Same types (weak types included) and values as ``jax.jit(f)``."""
    want = jax.jit(f)(*args)
    got = jaxpar.parallel_branches(f, **options)(*args)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    assert ([jax.typeof(v) for v in jax.tree_util.tree_leaves(got)]
            == [jax.typeof(v) for v in jax.tree_util.tree_leaves(want)])
    for g, w in zip(_values(got), _values(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


# --- weak types ------------------------------------------------------------------------------


def fused_unequal_lengths(xs: jax.Array) -> Any:
    # A Python-scalar carry comes in weak and goes out strong (``+ x``); the ys read the
    # carry coming in, so they are weak. The later segments of the fused scan start from
    # a strong carry and must still give weak ys.
    r1 = lax.scan(lambda c, x: (c * 0.5 + x, c), 1.0, xs)
    r2 = lax.scan(lambda c, x: (c * 1.5, c), 3.0, xs[:4])
    r3 = lax.scan(lambda c, x: (c * 2.5 + x, c), 2.0, xs[:2], reverse=True)
    return r1, r2, r3


def batched_weak_scans(xs: jax.Array) -> Any:
    step = lambda c, x: (c * 0.5 + x, c)
    return lax.scan(step, 1.0, xs), lax.scan(step, 2.0, xs * 2.0)


def static_fori_weak(xs: jax.Array) -> Any:
    return lax.fori_loop(jnp.int32(0), jnp.int32(5),
                         lambda i, c: (c[0] * 0.5 + xs[0], c[1] * 2.0), (1.0, 2.0))


def unrolled_regions_weak(xs: jax.Array) -> Any:
    # The emitter unrolls a scan whose body holds regions (``_emit.unrolled_scan``): the
    # second copy starts from the strong carry the first one left.
    def step(c: Any, x: jax.Array) -> Any:
        return c + jnp.sum(jnp.tanh(x @ W) @ W) + jnp.sum(jnp.sin(x @ W.T) @ W), c

    return lax.scan(step, 1.0, jnp.ones((4, 4, 8)) * xs[0], unroll=2)


@pytest.mark.parametrize("program", [fused_unequal_lengths, batched_weak_scans,
                                     static_fori_weak, unrolled_regions_weak])
@pytest.mark.parametrize("options", [{"target": "gpu"}, FORCED], ids=["gpu", "forced"])
def test_rewrites_keep_weak_types(program: Any, options: dict[str, Any]) -> None:
    assert_like_jit(program, (jnp.arange(7.0),), **options)


def test_fused_scans_with_weak_ys_are_fused() -> None:
    # Without unrolling: with unroll="auto" the model may rate the scans faster apart, and
    # jaxpar then leaves the fusion out (test_pipeline).
    plan = jaxpar.inspect(fused_unequal_lengths, target="gpu", unroll=None)(jnp.arange(7.0))
    assert any(d.pass_name == "fuse_scans" and d.kind == "fused" for d in plan.decisions)


def test_with_weak_type_only_changes_the_weak_flag() -> None:
    weak = jax.ShapeDtypeStruct((), jnp.float32, weak_type=True)
    strong = jnp.float32(2.0)
    made_weak = jax.make_jaxpr(lambda x: _compat.with_weak_type(x, jax.typeof(1.0)))(strong)
    assert made_weak.out_avals[0].weak_type and made_weak.out_avals[0].dtype == jnp.float32
    assert _compat.with_weak_type(strong, jax.typeof(strong)) is strong
    same = jax.make_jaxpr(lambda x: _compat.with_weak_type(x, jax.typeof(strong)))(weak)
    assert not same.out_avals[0].weak_type
    assert float(jax.jit(lambda x: _compat.with_weak_type(x, jax.typeof(1.0)))(strong)) == 2.0


# --- PRNG keys -------------------------------------------------------------------------------


def _branch(k: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
    k1 = jax.random.fold_in(k, jnp.argmax((a @ W)[0]))
    return k1, jax.random.fold_in(k1, jnp.argmax((jax.random.normal(k1, (8, 8)) @ W)[0]))


def two_keys_per_region(ka: jax.Array, kb: jax.Array, a: jax.Array, b: jax.Array) -> Any:
    return _branch(ka, a), _branch(kb, b)


def one_key_per_region(ka: jax.Array, kb: jax.Array, a: jax.Array, b: jax.Array) -> Any:
    return _branch(ka, a)[1], jnp.tanh(b @ W) @ W


def keys_in_nested_outputs(ka: jax.Array, kb: jax.Array, a: jax.Array, b: jax.Array) -> Any:
    return ({"x": (_branch(ka, a), jnp.sin(a @ W) @ W)},
            [_branch(kb, b)[0], jnp.sum(b @ W @ W)])


def _key_args() -> tuple[jax.Array, ...]:
    ka, kb = jax.random.split(jax.random.key(0))
    a = jnp.arange(32.0).reshape(4, 8)
    return ka, kb, a, -a


@pytest.mark.parametrize("program", [two_keys_per_region, one_key_per_region,
                                     keys_in_nested_outputs])
def test_stream_regions_return_keys(program: Any) -> None:
    options = {**FORCED, "batch_branches": False, "batch_matmuls": False}
    args = _key_args()
    assert jaxpar.inspect(program, **options)(*args).num_regions >= 2
    assert_like_jit(program, args, **options)
    text = jaxpar.parallel_branches(program, **options).lower(*args).as_text()
    assert "_xla_stream_annotation" in text


def _key_step(k: jax.Array, x: jax.Array) -> Any:
    k, sub = jax.random.split(k)
    return k, (sub, jax.random.normal(sub, (8,)) @ W + x)


def _key_step_tanh(k: jax.Array, x: jax.Array) -> Any:
    k, sub = jax.random.split(k)
    return k, (sub, jnp.tanh(jax.random.normal(sub, (8,)) @ W) * x)


def key_scans(ka: jax.Array, kb: jax.Array, a: jax.Array, b: jax.Array) -> Any:
    return (lax.scan(_key_step, ka, a), lax.scan(_key_step_tanh, kb, b[:3]),
            lax.scan(_key_step, kb, b, reverse=True))


@pytest.mark.parametrize("options", [{"target": "gpu"},
                                     {**FORCED, "batch_scans": False, "unroll": None}],
                         ids=["gpu", "forced-fused"])
def test_key_carries_and_ys_through_scan_passes(options: dict[str, Any]) -> None:
    args = _key_args()
    plan = jaxpar.inspect(key_scans, **options)(*args)
    # The passes fused the scans; where the model rates the fused program slower (on the
    # GPU target it does, 76.8 us against 71.5), jaxpar runs them apart and says so.
    refused = [d for item in plan.memory.left_out for d in item.decisions]
    made = {d.pass_name for d in (*plan.decisions, *refused) if d.kind != "left alone"}
    assert {"fuse_scans"} <= made
    assert_like_jit(key_scans, args, **options)


def test_key_gradients_flow_as_float0() -> None:
    def loss(a: jax.Array, ka: jax.Array, kb: jax.Array) -> jax.Array:
        (_, k2), (_, k4) = two_keys_per_region(ka, kb, jnp.tanh(a), a * 2.0)
        return (jnp.sum(jax.random.normal(k2, (8,)) * a[0])
                + jnp.sum(jax.random.normal(k4, (8,)) * a[1]) + jnp.sum(jnp.tanh(a @ W)))

    args = (_key_args()[2], *_key_args()[:2])
    options = {**FORCED, "batch_branches": False, "batch_matmuls": False}
    want = jax.grad(jax.jit(loss))(*args)
    got = jax.grad(jaxpar.parallel_branches(loss, **options))(*args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# --- cost model ------------------------------------------------------------------------------


@pytest.mark.parametrize(("impl", "itemsize"), [("threefry2x32", 8), ("rbg", 16)])
def test_key_arrays_are_costed_by_their_bytes(impl: str, itemsize: int) -> None:
    keys = jax.random.split(jax.random.key(0, impl=impl), 6)
    assert _compat.aval_nbytes(jax.typeof(keys)) == 6 * itemsize
    assert _compat.is_extended_dtype(keys.dtype)
    assert _compat.itemsize(jnp.float32) == 4
    assert _compat.itemsize(jax.dtypes.float0) == 0
    assert not _compat.is_extended_dtype(jax.dtypes.float0)
    jaxpr = jax.make_jaxpr(lambda k: jax.vmap(jax.random.fold_in, (0, None))(k, 3))(keys)
    cost = Analysis(Options().resolve("gpu")).costs.jaxpr_cost(jaxpr)
    assert cost.bytes > 0


# --- extended dtypes other than PRNG keys ----------------------------------------------------
# JAX's ExtendedDType requires only `type` and `_rules`: no `itemsize`, which NumPy-minded
# code assumes. jaxpar prices one by its physical representation, as it prices key types.


def _foo_dtype():
    from jax._src import core
    from jax._src import dtypes as jax_dtypes

    class foo(jax_dtypes.extended):  # lower case, as JAX names its scalar types
        pass

    class FooTyRules:
        @staticmethod
        def physical_element_aval(dtype):
            return core.ShapedArray((2,), jnp.dtype("uint32"))

    class FooTy(jax_dtypes.ExtendedDType):
        type = foo
        name = "foo"
        _rules = FooTyRules

        def __hash__(self):
            return hash(FooTy)

        def __eq__(self, other):
            return type(other) is FooTy

        def __repr__(self):
            return self.name

        __str__ = __repr__

    make_p = core.Primitive("make_foo")
    make_p.def_abstract_eval(lambda x: core.ShapedArray(x.shape, FooTy()))
    take_p = core.Primitive("take_foo")
    take_p.def_abstract_eval(lambda k: core.ShapedArray(k.shape, jnp.dtype("uint32")))
    return FooTy(), core.ShapedArray, make_p, take_p


def test_extended_dtype_without_itemsize_is_priced_by_its_physical_element():
    foo, shaped_array, _, _ = _foo_dtype()
    assert not hasattr(foo, "itemsize")
    assert _compat.is_extended_dtype(foo)
    assert _compat.itemsize(foo) == 8  # uint32[2] per element
    assert _compat.aval_nbytes(shaped_array((3,), foo)) == 24


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_extended_dtype_without_itemsize_is_planned(target):
    _, _, make_p, take_p = _foo_dtype()

    def two_branches(x, y):
        return take_p.bind(make_p.bind(x @ x)) + take_p.bind(make_p.bind(y @ y))

    x = jnp.ones((64, 64))
    plan = jaxpar.inspect(two_branches, target=target)(x, x)
    assert plan.to_dict()["function"].endswith("two_branches")


# An extended dtype with lowerings, run (not only planned) through gather, scatter,
# select, transpose, reverse, scan and vmap on both targets. Its physical
# element is (bits of a float32, bits + 1): ``take`` reads the bits back, so results
# depend on the data and compare with ``jax.jit``'s value for value.


@pytest.fixture
def foo_ops():
    from jax._src import core
    from jax._src.interpreters import batching, mlir

    foo, _, make_p, take_p = _foo_dtype()

    def make_physical(x):
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
        return jnp.stack([bits, bits + 1], axis=-1)

    def take_physical(k):  # the first word: a float32's bits
        return k[..., 0]

    def make_rule(ctx, x):
        out = ctx.replace(avals_out=[core.physical_aval(ctx.avals_out[0])])
        return mlir.lower_fun(make_physical, multiple_results=False)(out, x)

    def take_rule(ctx, k):
        phys = ctx.replace(avals_in=[core.physical_aval(ctx.avals_in[0])])
        return mlir.lower_fun(take_physical, multiple_results=False)(phys, k)

    mlir.register_lowering(make_p, make_rule)
    mlir.register_lowering(take_p, take_rule)
    batching.defvectorized(make_p)
    batching.defvectorized(take_p)
    yield foo, make_p.bind, take_p.bind
    del mlir._lowerings[make_p], mlir._lowerings[take_p]
    del batching.primitive_batchers[make_p], batching.primitive_batchers[take_p]


def _foo_program(make, take_bits):
    def take(k):
        return jax.lax.bitcast_convert_type(take_bits(k), jnp.float32)

    def program(x, y, idx):
        k, other = make(x), make(y)                       # foo[6,4] each
        gathered = k[idx]                                 # gather
        scattered = k.at[idx].set(other[idx])             # scatter
        chosen = jax.lax.select(x > 0, k, other)          # select
        _, rows = jax.lax.scan(lambda c, row: (c, jax.lax.rev(row, (0,))), 0.0,
                               scattered)                 # scan over foo rows
        flipped = jax.lax.transpose(k, (1, 0))
        return (take(gathered).sum(0) * 2.0 + take(rows).sum(0),
                take(chosen).sum(0) - take(flipped).sum(1))
    return program


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_extended_dtype_runs_through_gather_scatter_scan_and_vmap(foo_ops, target):
    _, make, take = foo_ops
    program = _foo_program(make, take)
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 4))
    y = jax.random.normal(jax.random.PRNGKey(1), (6, 4))
    idx = jnp.array([4, 0, 2])
    fn = jaxpar.parallel_branches(program, target=target)
    want = jax.jit(program)(x, y, idx)
    got = fn(x, y, idx)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # The rows the take reads back are the data: not a constant.
    assert float(jnp.abs(want[0]).sum()) > 0
    batched_x = jnp.stack([x, -x, x * 0.5])
    got_v = jax.vmap(fn, in_axes=(0, None, None))(batched_x, y, idx)
    want_v = jax.vmap(jax.jit(program), in_axes=(0, None, None))(batched_x, y, idx)
    for g, w in zip(got_v, want_v, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    plan = jaxpar.inspect(program, target=target)(x, y, idx)
    assert plan.to_dict()["function"].endswith("program")


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_a_token_argument_is_traced_as_by_jax_jit(target):
    # A token is not an array, but JAX gives it an abstract value: jax.jit traces it (a
    # new token comes back), it is not a static value (which came back as the same object).
    def f(token, x):
        return token, x + 1

    token = jax.lax.create_token()
    fn = jaxpar.parallel_branches(f, target=target)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no StaticArgumentWarning
        got = fn(token, jnp.ones(2))
    want = jax.jit(f)(token, jnp.ones(2))
    assert type(got[0]) is type(want[0]) and got[0] is not token
    np.testing.assert_array_equal(got[1], want[1])
    assert fn.lower(token, jnp.ones(2)).as_text().count("!stablehlo.token") >= 1
