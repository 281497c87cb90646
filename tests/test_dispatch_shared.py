"""Decorations of one function with the same options share their plans and compiled
programs (``jaxpar._dispatch.shared``), as ``jax.jit``'s share its caches (JAX's
``test_jit_global_cache``); other options, ``tune=True`` and options that cannot be
hashed share nothing; the function and its decorations deleted free the shared state."""

from __future__ import annotations

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import pytest
from helpers.trees import assert_tree_equal

import jaxpar
from jaxpar._dispatch.shared import shared_states


def counting(traces: list[int]):
    """A function that counts its traces (a Python side effect, as JAX's test counts)."""

    def f(x):
        traces.append(1)
        return jnp.sin(x) * 2.0 + 1.0

    return f


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_decorating_a_function_twice_traces_it_once_as_jax_jit(target):
    traces: list[int] = []
    f = counting(traces)
    first = jaxpar.parallel_branches(f, target=target)(2)
    second = jaxpar.parallel_branches(f, target=target)(3)
    assert len(traces) == 1
    jaxpar.parallel_branches(f, target=target)(jnp.ones(3))  # a new shape: traced again
    assert len(traces) == 2
    assert_tree_equal((first, second), (jax.jit(f)(2), jax.jit(f)(3)))


def test_a_step_decorated_inline_in_a_loop_traces_once():
    traces: list[int] = []

    def step(state, batch):
        traces.append(1)
        return jax.tree_util.tree_map(lambda s: jnp.tanh(s + batch.sum()), state)

    state = want = {"w": jnp.linspace(0.0, 1.0, 6), "b": jnp.ones(2)}
    for i in range(5):
        batch = jnp.full(3, float(i))
        state = jaxpar.parallel_branches(step)(state, batch)
        want = jax.jit(step)(want, batch)
    assert_tree_equal(state, want)
    assert len(traces) == 1 + 1  # jaxpar's trace, then jax.jit's


def test_each_decoration_keeps_its_own_attributes():
    traces: list[int] = []
    f = counting(traces)
    g = jaxpar.parallel_branches(f, target="cpu")
    g(jnp.ones(2))
    h = jaxpar.parallel_branches(f, target="cpu")
    h(jnp.ones(2))
    assert h is not g and h.__wrapped__ is f and g.__wrapped__ is f
    assert (g.analyses, h.analyses, len(traces)) == (1, 0, 1)  # h planned nothing
    h(jnp.ones(4))  # planned for both: g counts it, and its calls find it
    assert (g.analyses, h.analyses, len(traces)) == (2, 1, 2)
    g(jnp.ones(4))
    assert (g.analyses, h.analyses, len(traces)) == (2, 1, 2)


def test_clear_cache_of_one_decoration_clears_its_twins():
    # As jax.jit(f).clear_cache() evicts f from the caches its jits share.
    traces: list[int] = []
    f = counting(traces)
    g, h = jaxpar.parallel_branches(f), jaxpar.parallel_branches(f)
    x = jnp.ones(2)
    g(x)
    h(x)
    assert len(traces) == 1
    h.clear_cache()
    assert_tree_equal(g(x), jax.jit(f)(x))
    assert len(traces) == 2 + 1  # traced again (and once by jax.jit)


@pytest.mark.parametrize("options", [
    {"target": "gpu"}, {"unroll": 2}, {"min_cost_us": 1.0}, {"fuse_scans": False},
    {"static_argnums": 1}, {"donate_argnums": 0}, {"memory": "any"},
], ids=lambda options: next(iter(options)))
def test_other_options_are_traced_apart(options):
    traces: list[int] = []

    def f(x, n=1):
        traces.append(1)
        return jnp.sin(x) * n

    jaxpar.parallel_branches(f)(jnp.ones(2), 2)
    out = jaxpar.parallel_branches(f, **options)(jnp.ones(2), 2)
    assert len(traces) == 2
    jaxpar.parallel_branches(f, **options)(jnp.ones(2), 2)  # the same options again
    assert len(traces) == 2
    assert_tree_equal(out, jax.jit(f)(jnp.ones(2), 2))


def test_tune_decorations_share_nothing():
    # A tuner holds the decisions of its own decoration; a decoration without tune=True
    # shares nothing with it either.
    def f(x):
        return jnp.sin(x)

    first, second = (jaxpar.parallel_branches(f, tune=True) for _ in range(2))
    plain = jaxpar.parallel_branches(f)
    assert len({id(first._state), id(second._state), id(plain._state)}) == 3
    assert plain._state is jaxpar.parallel_branches(f)._state


def test_unhashable_options_fall_back_to_no_sharing():
    traces: list[int] = []
    f = counting(traces)
    device = jax.devices()[0]
    shardings = [jax.sharding.SingleDeviceSharding(device)]  # a list: not hashable
    x = jnp.ones(2)
    outs = [jaxpar.parallel_branches(f, in_shardings=shardings)(x) for _ in range(2)]
    assert len(traces) == 2
    assert_tree_equal(outs, [jax.jit(f, in_shardings=shardings)(x)] * 2)


def test_equal_but_distinct_functions_share_nothing():
    # Keyed by the function's identity, as two equal Equinox modules may hold other arrays.
    traces: list[int] = []
    f = counting(traces)
    for _ in range(2):
        jaxpar.parallel_branches(functools.partial(f))(jnp.ones(2))
    assert len(traces) == 2


def test_a_deleted_function_releases_its_shared_state():
    gc.collect()
    before = shared_states()
    x = jnp.ones(10)
    f = (lambda x: lambda y: jnp.tanh(x) * y)(x)
    g = jaxpar.parallel_branches(f)
    g(2.0)
    jaxpar.parallel_branches(f)(3.0)  # a second decoration, dropped at once
    assert shared_states() == before + 1
    held, x = weakref.ref(f), weakref.ref(x)
    del f, g
    gc.collect()
    assert held() is None and x() is None
    assert shared_states() == before


def test_a_deleted_function_is_freed_without_the_cyclic_collector():
    # No cycle through the shared state: jax.jit frees a deleted function at once, so
    # does jaxpar (JAX's test_jit_reference_dropping, with the collector off).
    gc.collect()
    gc.disable()
    try:
        f = (lambda y: jnp.cos(y) + 1.0)
        jaxpar.parallel_branches(f, target="gpu")(jnp.ones(3))
        jaxpar.parallel_branches(f, target="gpu")(jnp.ones(3))
        held = weakref.ref(f)
        del f
        assert held() is None
    finally:
        gc.enable()
