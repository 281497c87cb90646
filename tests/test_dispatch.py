"""How a decorated function's calls run (``jaxpar._dispatch``): JAX's C++ dispatch once a
signature is compiled, jaxpar's Python only where a call misses; ``jax.jit``'s own options
(donation, ``keep_unused``) taken as ``jax.jit`` takes them; framework objects routed
through jaxpar's split, never blocking."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.calls import jaxpar_frames
from helpers.trees import assert_tree_equal

import jaxpar


def step(params, state, x):
    """A training step's shape: new parameters and state from the old ones."""
    grads = jax.tree_util.tree_map(lambda p: jnp.tanh(p * x.sum()), params)
    new_state = jax.tree_util.tree_map(lambda s, g: 0.9 * s + g, state, grads)
    return jax.tree_util.tree_map(lambda p, s: p - 0.1 * s, params, new_state), new_state


def step_args():
    params = {"w": jnp.linspace(0.0, 1.0, 12).reshape(3, 4), "b": jnp.ones(4)}
    state = jax.tree_util.tree_map(jnp.zeros_like, params)
    return params, state, jnp.arange(4.0)


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_a_compiled_call_runs_no_python_of_jaxpars(target):
    g = jaxpar.parallel_branches(step, target=target)
    args = step_args()
    want = jax.jit(step)(*args)
    assert_tree_equal(g(*args), want)
    assert jaxpar_frames(lambda: g(*args)) == []
    assert_tree_equal(g(*args), want)


def test_static_argnums_calls_run_in_jax_dispatch_too():
    def f(x, n, *, activation):
        for _ in range(n):
            x = activation(x)
        return x

    g = jaxpar.parallel_branches(f, static_argnums=1, static_argnames="activation")
    x = jnp.linspace(0.0, 1.0, 8)
    want = jax.jit(f, static_argnums=1, static_argnames="activation")(x, 3, activation=jnp.sin)
    assert_tree_equal(g(x, 3, activation=jnp.sin), want)
    assert jaxpar_frames(lambda: g(x, 3, activation=jnp.sin)) == []
    assert g.analyses == 1
    g(x, 2, activation=jnp.sin)  # another static value: another signature
    assert g.analyses == 2


@pytest.mark.parametrize("by", ["argnums", "argnames"])
def test_donated_arguments_are_deleted_as_under_jax_jit(by):
    options = {"donate_argnums": (0, 1)} if by == "argnums" else {
        "donate_argnames": ("params", "state")}
    g = jaxpar.parallel_branches(step, **options)
    plain = jax.jit(step, **options)
    want = plain(*step_args())
    params, state, x = step_args()
    got = g(params, state, x)
    assert_tree_equal(got, want)
    donated = jax.tree_util.tree_leaves((params, state))
    assert all(leaf.is_deleted() for leaf in donated)
    assert not x.is_deleted()
    assert g.jit_options.donate_argnums == (0, 1)
    assert g.jit_options.donate_argnames == ("params", "state")
    # Later calls donate too, from JAX's C++ dispatch.
    params, state, x = step_args()
    assert jaxpar_frames(lambda: g(params, state, x)) == []
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves((params, state)))


def test_donation_shows_in_the_lowered_program_as_for_jax_jit():
    g = jaxpar.parallel_branches(step, donate_argnums=0)
    ours = g.lower(*step_args()).as_text()
    theirs = jax.jit(step, donate_argnums=0).lower(*step_args()).as_text()
    assert ours.count("tf.aliasing_output") == theirs.count("tf.aliasing_output") > 0


def test_donation_with_static_leaves_and_under_transformations():
    def f(x, y, activation):
        return {"tanh": jnp.tanh, "sin": jnp.sin}[activation](x) + y

    g = jaxpar.parallel_branches(f, donate_argnums=0)
    x, y = jnp.ones(4), jnp.arange(4.0)
    # A string leaf: jaxpar's split, then the flat jit donating the leaves of argument 0.
    want = jax.jit(f, static_argnums=2)(jnp.ones(4), y, "tanh")
    got = g(x, y, "tanh")
    assert_tree_equal(got, want)
    assert x.is_deleted() and not y.is_deleted()
    # Under grad and an outer jit donation does nothing, as for a jax.jit inside another.
    x = jnp.ones(4)
    grad = jax.grad(lambda x: g(x, y, "sin").sum())(x)
    np.testing.assert_allclose(grad, jnp.cos(jnp.ones(4)), rtol=1e-6)
    assert not x.is_deleted()
    assert_tree_equal(jax.jit(lambda x: g(x, y, "sin"))(x),
                      jax.jit(f, static_argnums=2)(x, y, "sin"))


def test_keep_unused_keeps_the_argument():
    def f(x, unused):
        return x * 2.0

    for keep in (False, True):
        ours = jaxpar.parallel_branches(f, keep_unused=keep).lower(jnp.ones(3), jnp.ones(5))
        theirs = jax.jit(f, keep_unused=keep).lower(jnp.ones(3), jnp.ones(5))
        assert ("tensor<5xf32>" in ours.as_text()) is keep
        assert ("tensor<5xf32>" in theirs.as_text()) is keep


def test_jit_options_are_checked_as_jax_jit_checks_them():
    with pytest.raises(ValueError):  # jax.jit's own check: a donated static argument
        jaxpar.parallel_branches(lambda x, n: x, static_argnums=1, donate_argnums=1)
    with pytest.raises(TypeError, match="keep_unused must be True or False"):
        jaxpar.parallel_branches(lambda x: x, keep_unused="yes")


def test_flax_nnx_objects_are_split_and_written_back_every_call():
    nnx = pytest.importorskip("flax.nnx")

    class Counter(nnx.Module):
        def __init__(self):
            self.count = nnx.Variable(jnp.zeros(()))
            self.w = nnx.Param(jnp.ones(3))

        def __call__(self, x):
            self.count.value = self.count.value + 1
            return x * self.w.value

    model = Counter()
    g = jaxpar.parallel_branches(lambda m, x: m(x))
    x = jnp.arange(3.0)
    for k in range(1, 4):
        assert_tree_equal(g(model, x), x)
        assert float(model.count.value) == k
    assert g.analyses == 1


def test_nnx_calls_with_and_without_static_values_alternate():
    """After calls routed to nnx.jit, a call holding a static value (which nnx.jit
    refuses) takes jaxpar's split, and the next plain one nnx.jit again; state written
    back every time."""
    nnx = pytest.importorskip("flax.nnx")

    class Counter(nnx.Module):
        def __init__(self):
            self.count = nnx.Variable(jnp.zeros(()))

        def __call__(self, x, scale=1.0):
            self.count.value = self.count.value + 1
            return x * scale

    model = Counter()
    g = jaxpar.parallel_branches(lambda m, x, how: m(x, 2.0 if how == "double" else 1.0))
    x = jnp.arange(3.0)
    assert_tree_equal(g(model, x, 1), x)        # arrays and a Python scalar: nnx.jit
    assert_tree_equal(g(model, x, "double"), x * 2)  # a string: jaxpar's split
    assert_tree_equal(g(model, x, 1), x)
    assert float(model.count.value) == 3


def test_equinox_calls_never_block(monkeypatch):
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))  # an activation: a static leaf
    g = jaxpar.parallel_branches(lambda m, x: m(x))
    x = jnp.ones(4)
    want = jax.jit(lambda x: model(x))(x)
    assert_tree_equal(g(model, x), want)
    blocked = []
    real = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda *a: blocked.append(a) or real(*a))
    for _ in range(3):
        out = g(model, x)
    assert blocked == []
    assert_tree_equal(out, want)


def test_no_exception_is_raised_inside_jaxpar_on_a_call():
    """The paths of a call are chosen before any jit runs: no exception of jaxpar's is
    thrown (through ``jax.jit`` or elsewhere) to restart a trace or a call (first calls,
    new signatures, static leaves, transformations)."""
    raised: list[str] = []

    def tracer(frame, event, arg):
        if event == "exception" and arg[0].__module__.startswith("jaxpar"):
            raised.append(f"{frame.f_code.co_name}: {arg[0].__name__}")
        return tracer

    g = jaxpar.parallel_branches(lambda x, s: jnp.tanh(x) * len(s), target="gpu")
    x = jnp.ones(4)
    sys.settrace(tracer)
    try:
        g(x, "ab")
        g(x, "abc")
        jax.grad(lambda x: g(x, "a").sum())(x)
        jax.vmap(lambda x: g(x, "a"))(jnp.ones((2, 4)))
        h = jaxpar.parallel_branches(step, target="gpu")
        h(*step_args())
        h(*step_args())
    finally:
        sys.settrace(None)
    assert raised == []


def test_disable_jit_runs_the_function_eagerly():
    seen = []

    def f(x):
        seen.append(isinstance(x, jax.core.Tracer))
        return x * 2.0

    g = jaxpar.parallel_branches(f)
    x = jnp.arange(3.0)
    with jax.disable_jit():
        assert_tree_equal(g(x), x * 2.0)
    assert seen == [False] and g.analyses == 0
    g(x)  # compiled now
    with jax.disable_jit():  # JAX's C++ dispatch calls the function eagerly
        g(x)
    assert seen == [False, True, False]


def test_deleting_the_function_frees_its_compiled_programs():
    import gc
    import weakref

    gc.disable()
    try:
        x = jnp.ones(10)
        g = jaxpar.parallel_branches((lambda x: lambda y: jnp.tanh(x) + y)(x))
        ref = weakref.ref(x)
        del x
        g(jnp.ones(10))
        g(jnp.ones(10))
        assert ref() is not None
        del g
        assert ref() is None  # reference counting alone: no cycle holds the programs
    finally:
        gc.enable()
