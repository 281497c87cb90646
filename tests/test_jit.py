"""`parallel_branches` composed with `jax.jit`: inside another jit, jit of the decorated
function, and the annotations surviving into the lowered program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.lowered import (
    GROUP_ATTRIBUTE,
    STREAM_ATTRIBUTE,
    function_bodies,
    lower_for_gpu,
    nested_stream_calls,
    stream_calls,
)
from helpers.programs import (
    FOUR_BRANCHES_OPTIONS,
    LOOPS_OFF,
    four_branches,
    four_branches_args,
    pure_chain,
    pure_chain_args,
    two_scans,
    two_scans_args,
)
from helpers.trees import assert_same_values, assert_tree_equal

import jaxpar

TARGETS = ["gpu", "cpu"]


@pytest.mark.parametrize("target", TARGETS)
def test_jit_of_decorated_matches_jit_of_original(target):
    args = two_scans_args()
    g = jaxpar.parallel_branches(two_scans, target=target)
    want = jax.jit(two_scans)(*args)
    assert_same_values(jax.jit(g)(*args), want, target)
    assert_same_values(g(*args), want, target)


@pytest.mark.parametrize("target", TARGETS)
def test_decorated_called_inside_another_jit(target):
    args = four_branches_args()
    g = jaxpar.parallel_branches(four_branches, **{**FOUR_BRANCHES_OPTIONS, "target": target})

    def outer(a, b, c, d):
        return jnp.sum(g(a, b, c, d) * 2.0) + jnp.sum(a)

    def reference(a, b, c, d):
        return jnp.sum(four_branches(a, b, c, d) * 2.0) + jnp.sum(a)

    assert_same_values(jax.jit(outer)(*args), jax.jit(reference)(*args), target)


def test_jit_of_decorated_lowers_with_annotations():
    args = two_scans_args()
    g = jaxpar.parallel_branches(two_scans, target="gpu", **LOOPS_OFF)
    outer = jax.jit(lambda a, b: [x * 2 for x in g(a, b)])
    calls = stream_calls(lower_for_gpu(outer, *args))
    assert sorted(attrs[STREAM_ATTRIBUTE] for _, attrs in calls) == ["1", "2"]
    # jit of jit of the decorated function: still two calls, none nested.
    text = lower_for_gpu(jax.jit(jax.jit(g)), *args)
    assert len(stream_calls(text)) == 2
    assert nested_stream_calls(text) == []


def test_two_decorated_calls_in_one_jit_get_their_own_sections():
    args = two_scans_args()
    g = jaxpar.parallel_branches(two_scans, target="gpu", **LOOPS_OFF)

    def twice(a, b):
        x, y = g(a, b)
        return g(x, y)

    text = lower_for_gpu(twice, *args)
    # Each call is one jitted call, traced per call site: XLA inlines both into one
    # computation, so their scheduling groups must differ (equal groups linked through
    # other work abort the GPU compile).
    bodies = function_bodies(text)
    holders = [name for name, body in bodies.items() if len(stream_calls("\n".join(body))) == 2]
    assert len(holders) == 2
    calls = stream_calls(text)
    assert len(calls) == 4
    groups = {attrs.get(GROUP_ATTRIBUTE) for _, attrs in calls}
    assert len(groups) == 2 and None not in groups
    assert nested_stream_calls(text) == []
    assert_same_values(jax.jit(twice)(*args),
                       jax.jit(lambda a, b: two_scans(*two_scans(a, b)))(*args), "gpu")


def test_jit_with_closure_constants():
    w = jnp.linspace(-1.0, 1.0, 64 * 64).reshape(64, 64)

    def f(x, y):
        return jnp.tanh(x @ w), jnp.sin(y @ w.T)

    g = jaxpar.parallel_branches(f, target="gpu", min_cost_us=0.0,
                                 force_streams=True)
    x = jnp.ones((64, 64))
    assert_same_values(jax.jit(g)(x, x + 1.0), jax.jit(f)(x, x + 1.0), "gpu")
    assert len(stream_calls(lower_for_gpu(g, x, x))) == 2


def test_jit_with_traced_closure_is_not_cached():
    def outer(x, scale):
        g = jaxpar.parallel_branches(lambda y: (jnp.sin(y @ y) * scale, jnp.cos(y @ y.T)),
                                     target="gpu", min_cost_us=0.0,
                                 force_streams=True)
        return g(x)

    x = jnp.eye(8) * 0.3
    want = jax.jit(lambda x, s: (jnp.sin(x @ x) * s, jnp.cos(x @ x.T)))(x, 2.0)
    assert_same_values(jax.jit(outer)(x, 2.0), want, "gpu")
    assert_same_values(jax.jit(outer)(x, 3.0), jax.jit(
        lambda x, s: (jnp.sin(x @ x) * s, jnp.cos(x @ x.T)))(x, 3.0), "gpu")


def test_jit_retraces_for_new_shapes():
    g = jaxpar.parallel_branches(pure_chain, target="gpu")
    jitted = jax.jit(g)
    (x,) = pure_chain_args()
    assert_tree_equal(jitted(x), jax.jit(pure_chain)(x))
    assert_tree_equal(jitted(x[:128, :128]), jax.jit(pure_chain)(x[:128, :128]))
    assert g.analyses == 2


def test_jit_static_argnums_around_decorated():
    g = jaxpar.parallel_branches(four_branches, **FOUR_BRANCHES_OPTIONS)

    def outer(args, power):
        return g(*args) ** power

    args = four_branches_args()
    jitted = jax.jit(outer, static_argnums=1)
    assert_same_values(jitted(args, 2), jax.jit(lambda a: four_branches(*a) ** 2)(args), "gpu")


# --- JAX's trace context flipped between calls ------------------------------------------------
# jax.jit keys its caches on the trace context; the plan cache must too, or a plan traced under
# one configuration is reused under another.


@pytest.mark.parametrize("target", TARGETS)
def test_enable_x64_after_a_first_call(target):
    def f(x):
        return x * jnp.arange(3.0) + 1.5

    g = jaxpar.parallel_branches(f, target=target)
    x = np.float32(2.0)
    assert_tree_equal(g(x), jax.jit(f)(x))
    with jax.enable_x64(True):
        want = jax.jit(f)(x)
        got = g(x)
    assert want.dtype == jnp.float64
    assert got.dtype == want.dtype
    assert_tree_equal(got, want)
    assert_tree_equal(g(x), jax.jit(f)(x))  # and back
    assert g(x).dtype == jnp.float32


def test_rank_promotion_raise_after_a_first_call():
    def f(x, y):
        return x + y

    g = jaxpar.parallel_branches(f, target="cpu")
    x, y = jnp.ones(3), jnp.ones((2, 1))
    assert_tree_equal(g(x, y), jax.jit(f)(x, y))
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="rank_promotion") as want:
            jax.jit(f)(x, y)
        with pytest.raises(ValueError, match="rank_promotion") as got:
            g(x, y)
    assert type(got.value) is type(want.value)
    assert_tree_equal(g(x, y), jax.jit(f)(x, y))


def test_numpy_dtype_promotion_strict_after_a_first_call():
    def f(x, y):
        return x + y

    g = jaxpar.parallel_branches(f, target="cpu")
    x, y = jnp.ones(3, jnp.float32), jnp.ones(3, jnp.bfloat16)
    assert_tree_equal(g(x, y), jax.jit(f)(x, y))
    with jax.numpy_dtype_promotion("strict"):
        with pytest.raises(Exception, match="promot") as want:
            jax.jit(f)(x, y)
        with pytest.raises(type(want.value), match="promot") as got:
            g(x, y)
    assert type(got.value) is type(want.value)


def test_default_matmul_precision_after_a_first_call():
    def f(x, w):
        return jnp.tanh(x @ w) @ w

    g = jaxpar.parallel_branches(f, target="cpu")
    x = w = jnp.ones((8, 8))
    jax.jit(g).lower(x, w)
    plain = jax.jit(g).trace(x, w).jaxpr
    with jax.default_matmul_precision("highest"):
        want = jax.jit(f).trace(x, w).jaxpr
        got = jax.jit(g).trace(x, w).jaxpr
    precisions = {str(e.params["precision"]) for e in want.eqns if "precision" in e.params}
    assert precisions and "HIGHEST" in str(precisions)
    assert "HIGHEST" in str(got) and "HIGHEST" not in str(plain)


_box: dict[str, object] = {}


@jaxpar.parallel_branches(target="cpu")
def _reads_box(x):
    return x * _box["scale"]


def test_same_decorated_function_closing_over_new_tracers_each_trace():
    # Every call is one jitted call; a trace that closed over another trace's tracers must
    # not be reused by the next outer trace (jax.jit itself would leak the old tracer).
    def outer(scale, x):
        _box["scale"] = scale
        return _reads_box(x)

    x = jnp.arange(3.0)
    assert_tree_equal(jax.jit(outer)(2.0, x), x * 2.0)
    assert_tree_equal(jax.jit(lambda s, x: outer(s, x) + 1.0)(5.0, x), x * 5.0 + 1.0)
    assert_tree_equal(jax.grad(lambda s: jnp.sum(outer(s, x)))(3.0), jnp.sum(x))
