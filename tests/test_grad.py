"""`parallel_branches` composed with `jax.grad`: gradients match the original's, through
jit, for higher order, and the backward pass keeps stream annotations."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.lowered import STREAM_ATTRIBUTE, lower_for_gpu, nested_stream_calls, stream_calls
from helpers.programs import (
    FOUR_BRANCHES_OPTIONS,
    LOOPS_OFF,
    four_branches,
    four_branches_args,
    two_scans,
    two_scans_args,
)
from helpers.trees import assert_tree_close
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jaxpar
from jaxpar import _compat

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

    g = jaxpar.parallel_branches(loss, target="gpu", min_cost_us=0.0,
                                 force_streams=True)
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
    g = jaxpar.parallel_branches(small_loss, target="gpu", min_cost_us=0.0,
                                 force_streams=True)
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
    g = jaxpar.parallel_branches(small_loss, target="gpu", min_cost_us=0.0,
                                 force_streams=True)
    x = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(4, 4)
    y = np.linspace(0.5, -0.5, 16, dtype=np.float32).reshape(4, 4)
    check_grads(g, (x, y), order=2, modes=("fwd", "rev"), atol=5e-2, rtol=5e-2)


def test_jvp_and_vjp():
    g = jaxpar.parallel_branches(small_loss, target="gpu", min_cost_us=0.0,
                                 force_streams=True)
    x = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)
    y = jnp.linspace(0.5, -0.5, 16).reshape(4, 4)
    tangents = (jnp.ones_like(x), jnp.full_like(y, 0.5))
    assert_tree_close(jax.jvp(g, (x, y), tangents), jax.jvp(small_loss, (x, y), tangents),
                      RTOL, ATOL)
    _, pullback_got = jax.vjp(g, x, y)
    _, pullback_want = jax.vjp(small_loss, x, y)
    assert_tree_close(pullback_got(jnp.float32(1.5)), pullback_want(jnp.float32(1.5)),
                      RTOL, ATOL)


# --- eager transformations stay compiled ---------------------------------------------------
# Without an outer jit, grad of the decorated function must be one jitted call, as grad of a
# jax.jit function is, not one compile and dispatch per primitive. Counted with
# jax.log_compiles after jax.clear_caches(), never timed.


class _CompileCounter(logging.Handler):
    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        if "Compiling" in record.getMessage():
            self.count += 1


def _compiles(fn, *args):
    jax.clear_caches()
    counter = _CompileCounter()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    try:
        with jax.log_compiles():
            out = jax.block_until_ready(fn(*args))
    finally:
        logger.removeHandler(counter)
    return counter.count, out


def two_towers(x, w):
    a = b = x
    for _ in range(3):
        a = jnp.tanh(a @ w)
        b = jnp.sin(b @ w.T)
    return jnp.sum(a * b)


def _tower_args():
    return (jnp.linspace(-1.0, 1.0, 64).reshape(8, 8),
            jnp.linspace(0.5, -0.5, 64).reshape(8, 8))


def _transformations():
    tangents = tuple(jnp.ones((8, 8)) * s for s in (0.5, -0.25))
    return {
        "grad": lambda f: jax.grad(f, argnums=(0, 1)),
        "value_and_grad": lambda f: jax.value_and_grad(f),
        "jvp": lambda f: lambda *a: jax.jvp(f, a, tangents),
        "vjp": lambda f: lambda *a: jax.vjp(f, *a)[1](jnp.float32(1.5)),
        "jacrev": lambda f: jax.jacrev(f, argnums=1),
        "hessian": lambda f: jax.hessian(f),
    }


@pytest.mark.parametrize("name", sorted(_transformations()))
def test_eager_transformation_runs_compiled_and_bit_exact_on_cpu(name):
    transform = _transformations()[name]
    args = _tower_args()
    reference_compiles, want = _compiles(transform(jax.jit(two_towers)), *args)
    g = jaxpar.parallel_branches(two_towers, target="cpu")
    compiles, got = _compiles(transform(g), *args)
    assert compiles <= reference_compiles, (name, compiles, reference_compiles)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)


def test_eager_grad_on_gpu_target_runs_compiled():
    args = _tower_args()
    reference_compiles, want = _compiles(jax.grad(jax.jit(two_towers)), *args)
    eager_compiles, _ = _compiles(jax.grad(two_towers), *args)
    assert reference_compiles < eager_compiles  # the count tells op by op from compiled
    g = jaxpar.parallel_branches(two_towers, target="gpu", min_cost_us=0.0,
                                 force_streams=True)
    compiles, got = _compiles(jax.grad(g), *args)
    assert compiles <= reference_compiles
    assert_tree_close(got, want, rtol=RTOL, atol=ATOL)
    # A second call reuses the compiled programs.
    assert _compiles_without_clearing(jax.grad(g), *args) == 0


def _compiles_without_clearing(fn, *args):
    counter = _CompileCounter()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    try:
        with jax.log_compiles():
            jax.block_until_ready(fn(*args))
    finally:
        logger.removeHandler(counter)
    return counter.count


# --- nested on the CPU target: bit for bit with jax.jit ------------------------------------------

_W = jax.random.normal(jax.random.key(1), (8, 8)) * 0.3


def _scaled_tanh(x, n):  # n: a Python int, traced as jax.jit traces it
    return jnp.tanh(x * n) @ _W


def _scaled_logsumexp(x, s):  # s: a Python float
    return jax.nn.logsumexp(x * s, axis=-1)


def _nestings(inner, scalar, decorate):
    """The outer programs: ``inner`` (jitted or decorated) called with a Python scalar
    inside a decorated function, a scan, cond or checkpoint body, and a shard_map body."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    return {
        "decorated": lambda x: jnp.sum(decorate(lambda y: inner(y * y[0, 0], scalar))(x)),
        "scan": lambda x: lax.scan(
            lambda c, xi: (c + jnp.sum(inner(xi[None] * c, scalar)), None), 1.0, x)[0],
        "cond": lambda x: jnp.sum(lax.cond(x[0, 0] > 0, lambda y: inner(y * y[0, 1], scalar),
                                           lambda y: inner(y, scalar) * 2.0, x)),
        "checkpoint": lambda x: jnp.sum(jax.checkpoint(
            lambda y: lax.scan(lambda c, yi: (c + jnp.sum(inner(yi[None] * c, scalar)), None),
                               1.0, y)[0])(x)),
        "shard_map": lambda x: jnp.sum(jax.shard_map(
            lambda y: inner(y * y[0, 1], scalar), mesh=mesh, in_specs=P("x"),
            out_specs=P("x"))(x)),
    }


@pytest.mark.parametrize("nesting", ["decorated", "scan", "cond", "checkpoint", "shard_map"])
@pytest.mark.parametrize(("inner", "scalar"), [(_scaled_tanh, 3), (_scaled_logsumexp, 1.7)],
                         ids=["int", "float"])
def test_nested_cpu_target_is_bit_exact(nesting, inner, scalar):
    # A Python scalar passed to a nested decorated function is traced, as jax.jit traces
    # it; folded into the trace as a constant, XLA fused the program differently and the
    # gradients moved by an ulp.
    decorate = functools.partial(jaxpar.parallel_branches, target="cpu")
    want_fn = _nestings(jax.jit(inner), scalar, jax.jit)[nesting]
    got_fn = _nestings(decorate(inner), scalar, decorate)[nesting]
    x = jax.random.normal(jax.random.key(0), (4, 8))
    want = jax.value_and_grad(jax.jit(want_fn))(x)
    got = jax.value_and_grad(jax.jit(got_fn))(x)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)
    # The same calls: the scalar is an argument of the inner call, not a constant in it.
    name = inner.__name__
    assert _call_arities(jax.make_jaxpr(got_fn)(x), name) == _call_arities(
        jax.make_jaxpr(want_fn)(x), name)


# --- nested on the CPU target, a program with independent branches ----------------------------
# The promise (docs/guide.md, "Same values"): bit for bit what jax.jit computes with jax.jit in
# each decoration's place, at every nesting, eager or jitted. Against the undecorated function
# inlined, values are bit for bit and gradients within a few ulps: JAX differentiates a nested
# call (a nested jax.jit as much as a decorated function) as a unit, which sums some of the
# gradient's terms in another order.

_W1 = jax.random.normal(jax.random.key(11), (8, 8)) * 0.4
_W2 = jax.random.normal(jax.random.key(12), (8, 8)) * 0.4


def _two_chains(x, w1, w2, s):  # two independent matmul chains and their sums; s a Python float
    a = jnp.tanh(jnp.tanh(x @ w1) @ w1)
    b = jnp.tanh(jnp.sin(x @ w2 * s) @ w2)
    return a + b, jnp.sum(a) + jnp.sum(b * b)


def _chains_loss(inner, x, w1, w2):
    out, total = inner(x, w1, w2, 1.7)
    return jnp.sum(out * out) + total


def _branch_nestings(decorate):
    """Losses of (x, w1, w2) calling ``decorate(_two_chains)`` inside another decorated
    function (beside a branch of its own), a scan, cond or checkpoint body, and a shard_map
    body; ``decorate`` is jaxpar's, ``jax.jit`` or none."""
    inner = decorate(_two_chains)
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))

    def in_scan(x, w1, w2):
        def step(c, xi):
            loss = _chains_loss(inner, xi * c, w1, w2)
            return c + 0.01 * loss, loss
        c, losses = lax.scan(step, 1.0, x.reshape(2, 4, 8))
        return c + jnp.sum(losses)

    return {
        "decorated": lambda x, w1, w2: decorate(
            lambda x, w1, w2: _chains_loss(inner, x * 1.5, w1, w2) + jnp.sum(jnp.tanh(x @ w1))
        )(x, w1, w2),
        "scan": in_scan,
        "cond": lambda x, w1, w2: lax.cond(
            x[0, 0] > -10.0, lambda y: _chains_loss(inner, y, w1, w2),
            lambda y: _chains_loss(inner, y * 2.0, w1, w2), x),
        "checkpoint": lambda x, w1, w2: jax.checkpoint(
            lambda y, v1, v2: _chains_loss(inner, y, v1, v2))(x, w1, w2),
        "shard_map": lambda x, w1, w2: jnp.sum(jax.shard_map(
            lambda y, v1, v2: _chains_loss(inner, y, v1, v2)[None], mesh=mesh,
            in_specs=(P("x"), P(), P()), out_specs=P("x"))(x, w1, w2)),
    }


_NESTINGS = ["decorated", "scan", "cond", "checkpoint", "shard_map"]
_CPU = functools.partial(jaxpar.parallel_branches, target="cpu")


def _chains_args():
    return jax.random.normal(jax.random.key(13), (8, 8)), _W1, _W2


@pytest.mark.parametrize("nesting", _NESTINGS)
def test_nested_branches_on_cpu_target_are_bit_exact_with_jit_in_place(nesting):
    args = _chains_args()
    got_fn = _branch_nestings(_CPU)[nesting]
    want_fn = _branch_nestings(jax.jit)[nesting]
    transforms = {
        "value_and_grad": lambda f: jax.value_and_grad(f, argnums=(0, 1, 2)),
        "jit(value_and_grad)": lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))),
        "vjp": lambda f: lambda *a: jax.vjp(f, *a)[1](jnp.float32(0.75)),
    }
    for name, transform in transforms.items():
        got, want = transform(got_fn)(*args), transform(want_fn)(*args)
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                        strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"{nesting}, {name}")


@pytest.mark.parametrize("nesting", _NESTINGS)
def test_nested_branches_on_cpu_target_against_the_undecorated_function(nesting):
    args = _chains_args()
    got_fn = _branch_nestings(_CPU)[nesting]
    plain_fn = _branch_nestings(lambda f: f)[nesting]
    np.testing.assert_array_equal(jax.jit(got_fn)(*args), jax.jit(plain_fn)(*args))
    grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2)))
    got, want = grad(got_fn)(*args), grad(plain_fn)(*args)
    # A few ulps of each gradient's scale: the order of a sum, not a lost term.
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=4e-7 * float(np.max(np.abs(w))))
    # A nested jax.jit differs from the undecorated function as much, and the same way.
    jitted = grad(_branch_nestings(jax.jit)[nesting])(*args)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, jitted)


def test_top_level_branches_on_cpu_target_are_bit_exact_with_the_undecorated_function():
    args = _chains_args()
    loss = functools.partial(_chains_loss, _two_chains)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    for got in (jax.value_and_grad(_CPU(loss), argnums=(0, 1, 2))(*args),
                jax.jit(jax.value_and_grad(_CPU(loss), argnums=(0, 1, 2)))(*args)):
        jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)


def _call_arities(closed, name):
    """How many operands each ``jit`` call of ``name`` takes, anywhere in ``closed``."""
    inner, _ = _compat.open_jaxpr(closed)
    found = []
    for eqn in inner.eqns:
        if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == name:
            found.append(len(eqn.invars))
        for _, _, sub in _compat.eqn_subjaxprs(eqn):
            found += _call_arities(sub, name)
    return sorted(found)


def test_nested_function_needing_a_python_scalar_still_traces():
    # Where jax.jit would fail (range of a traced int), a nested call retraces with its
    # Python scalars static, as before.
    def layers(x, n):
        for _ in range(n):
            x = jnp.tanh(x @ _W)
        return x

    g = jaxpar.parallel_branches(layers, target="cpu")
    x = jnp.ones((2, 8))
    outer = jax.jit(lambda x: g(x, 3))
    np.testing.assert_array_equal(outer(x), jax.jit(lambda x: layers(x, 3))(x))
    assert g.analyses == 1  # the static layout is remembered: no second failed trace
    np.testing.assert_array_equal(jax.jit(lambda x: g(x * 2.0, 3))(x), layers(x * 2.0, 3))
    assert g.analyses == 1
    with pytest.raises(jax.errors.TracerIntegerConversionError, match="static_argnums"):
        g(x, 3)  # at the top level, as jax.jit
