"""Static arguments of ``parallel_branches`` (``jaxpar._api``), as `jax.jit` has them
(`static_argnums`/`static_argnames`) and as `eqx.filter_jit` treats non-array leaves (issue 13,
point 1)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_equal, needs_plugin

import jaxpar


def layers(x, w, n, *, scale=1.0):
    for _ in range(n):
        x = jnp.tanh(x @ w)
    return x * scale


X = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)
W = jnp.eye(4) * 0.5 + 0.1


def test_static_argnums_steers_tracing_and_keys_the_cache():
    g = jaxpar.parallel_branches(layers, target="cpu", static_argnums=2)
    want = jax.jit(layers, static_argnums=2)
    assert_tree_equal(g(X, W, 3), want(X, W, 3))
    assert g.analyses == 1
    assert_tree_equal(g(X + 1.0, W, 3), want(X + 1.0, W, 3))
    assert g.analyses == 1
    assert_tree_equal(g(X, W, 5), want(X, W, 5))
    assert g.analyses == 2
    assert g.static_argnums == (2,) and g.static_argnames == ("n",)


def test_negative_static_argnums_count_from_the_end():
    g = jaxpar.parallel_branches(layers, target="cpu", static_argnums=-1)
    assert_tree_equal(g(X, W, 2), jax.jit(layers, static_argnums=-1)(X, W, 2))


def test_static_argnames_cover_keyword_and_positional_calls():
    g = jaxpar.parallel_branches(layers, target="cpu", static_argnames="n")
    assert g.static_argnums == (2,)
    want = jax.jit(layers, static_argnames="n")(X, W, n=2)
    assert_tree_equal(g(X, W, n=2), want)
    assert_tree_equal(g(X, W, 2), want)


def test_keyword_only_static_argname():
    def scaled(x, *, mode):
        return x * 2.0 if mode == "double" else x

    g = jaxpar.parallel_branches(scaled, target="cpu", static_argnames="mode")
    assert g.static_argnums == ()
    assert_tree_equal(g(X, mode="double"), X * 2.0)


def test_static_values_are_keyed_by_type_too():
    def kind(x, n):
        return x * n

    g = jaxpar.parallel_branches(kind, target="cpu", static_argnums=1)
    want = jax.jit(kind, static_argnums=1)
    assert_tree_equal(g(X, 2), want(X, 2))
    assert_tree_equal(g(X, 2.0), want(X, 2.0))  # 2 == 2.0, but another static value
    assert g.analyses == 2


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"static_argnums": 3}, ValueError, r"static_argnums=\(3,\) .* takes 3 positional"),
    ({"static_argnums": -4}, ValueError, r"out of range"),
    ({"static_argnums": "2"}, TypeError, r"static_argnums must be an int"),
    # A bool is an int to Python (jax.jit reads True as 1), never meant as a position.
    ({"static_argnums": True}, TypeError, r"static_argnums must be an int .*positions"),
    ({"static_argnums": [0, True]}, TypeError, r"got \[0, True\]"),
    ({"static_argnames": "m"}, ValueError, r"no argument named 'm'"),
    ({"static_argnames": 2}, TypeError, r"static_argnames must be a str"),
])
def test_static_arguments_are_validated_like_jax_jit(kwargs, error, match):
    with pytest.raises(error, match=match):
        jaxpar.parallel_branches(layers, **kwargs)


def test_positional_only_static_argname_is_refused():
    def pos_only(x, n, /):
        return x * n

    with pytest.raises(ValueError, match="positional-only"):
        jaxpar.parallel_branches(pos_only, static_argnames="n")


def test_varargs_accept_any_static_argnum():
    def many(*xs):
        return xs[0] * len(xs[1])

    g = jaxpar.parallel_branches(many, target="cpu", static_argnums=1)
    assert_tree_equal(g(X, (1, 2, 3)), X * 3)


def test_unhashable_static_value_names_the_argument():
    g = jaxpar.parallel_branches(layers, static_argnums=2)
    with pytest.raises(TypeError, match=r"static argument `n` of `layers` is an unhashable list"):
        g(X, W, [1, 2])


def test_static_argument_traced_by_an_outer_jit_says_to_make_it_static_there():
    # The outer jit traces the int: the message is about the outer jit, not about hashing.
    g = jaxpar.parallel_branches(layers, static_argnums=2)
    with pytest.raises(TypeError, match=r"static argument `n` of `layers` is a traced value.*"
                                        r"static_argnums"):
        jax.jit(g)(X, W, 3)
    assert_tree_equal(jax.jit(g, static_argnums=2)(X, W, 3),
                      jax.jit(layers, static_argnums=2)(X, W, 3))


def test_python_int_without_static_argnums_names_it():
    g = jaxpar.parallel_branches(layers, target="cpu")
    with pytest.raises(jaxpar.TraceError, match=r"argument n"):
        g(X, W, 3)


# --- under other transformations --------------------------------------------------------------


def test_jit_of_decorated_with_static_argnums():
    # The outer jit's static int reaches the decorated function as a Python value, which
    # stays one under a transformation.
    g = jaxpar.parallel_branches(layers, target="cpu")
    got = jax.jit(g, static_argnums=2)(X, W, 3)
    assert_tree_equal(got, jax.jit(layers, static_argnums=2)(X, W, 3))
    got = jax.jit(g, static_argnames="n")(X, W, n=2)
    assert_tree_equal(got, jax.jit(layers, static_argnames="n")(X, W, n=2))


def test_vmap_with_python_scalar_argument():
    g = jaxpar.parallel_branches(layers, target="cpu")
    xs = jnp.stack([X, X * 0.5])
    got = jax.vmap(g, in_axes=(0, None, None))(xs, W, 2)
    assert_tree_equal(got, jax.vmap(functools.partial(layers, n=2), in_axes=(0, None))(xs, W))


def test_inspect_takes_static_arguments():
    plan = jaxpar.inspect(layers, target="cpu", static_argnums=2)(X, W, 3)
    assert plan.num_eqns >= 6
    decorated = jaxpar.parallel_branches(layers, static_argnames="n")
    assert jaxpar.inspect(decorated, target="cpu")(X, W, n=3).num_eqns == plan.num_eqns


def test_hashable_leaves_inside_pytrees_are_static():
    def apply(params, x):
        return params["act"](x @ params["w"])

    g = jaxpar.parallel_branches(apply, target="cpu")
    for act in (jnp.tanh, jax.nn.gelu, jnp.tanh):
        want = jax.jit(lambda w, x, act=act: act(x @ w))(W, X)
        assert_tree_equal(g({"w": W, "act": act}, X), want)
    assert g.analyses == 2  # one plan per function, reused for the second tanh


# --- Equinox ----------------------------------------------------------------------------------


def test_equinox_module_with_function_leaves():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 3, 8, depth=2, activation=jax.nn.gelu, key=jax.random.key(0))
    xs = jnp.linspace(-1.0, 1.0, 20).reshape(5, 4)

    def forward(model, xs):
        return jax.vmap(model)(xs)

    g = jaxpar.parallel_branches(forward, target="cpu")
    want = eqx.filter_jit(forward)(model, xs)
    assert_tree_equal(g(model, xs), want)
    assert_tree_equal(eqx.filter_jit(g)(model, xs), want)

    def loss(model, xs):
        return jnp.sum(forward(model, xs) ** 2)

    decorated_loss = jaxpar.parallel_branches(loss, target="cpu")
    grads = eqx.filter_grad(decorated_loss)(model, xs)
    want_grads = eqx.filter_jit(eqx.filter_grad(loss))(model, xs)
    jax.tree_util.tree_map(np.testing.assert_array_equal, eqx.filter(grads, eqx.is_array),
                           eqx.filter(want_grads, eqx.is_array))


# --- gpu_preview takes them like the decorator --------------------------------------------


@needs_plugin
def test_gpu_preview_takes_static_and_keyword_arguments():
    # n steers the trace (a Python loop), scale is a keyword argument.
    preview = jaxpar.gpu_preview(layers, X, W, 3, static_argnums=2, kwargs={"scale": 2.0},
                                 batch_matmuls=False)
    want = jaxpar.inspect(layers, target="gpu", static_argnums=2, batch_matmuls=False)(
        X, W, 3, scale=2.0)
    assert preview.plan.num_eqns == want.num_eqns
    assert preview.plain.kernels == preview.jaxpar.kernels >= 3  # three dependent matmuls
    # A decorated function brings its static arguments along.
    decorated = jaxpar.parallel_branches(layers, static_argnames="n", batch_matmuls=False)
    again = jaxpar.gpu_preview(decorated, X, W, kwargs={"n": 3, "scale": 2.0})
    assert again.plan.num_eqns == want.num_eqns
    assert again.plain.kernels == preview.plain.kernels
