"""Common subexpressions are shared before planning (``jaxpar/passes/share_common.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from pass_checker import assert_matches, assert_same_outputs, check_pass, count_primitive

import jaxpar
from jaxpar.passes import share_common


def slogdet_and_inv(s):
    """Two users of one LU factorisation: XLA computes it once (its CSE sees through calls)."""
    sign, logdet = jnp.linalg.slogdet(s)
    return sign * logdet, jnp.linalg.inv(s) @ s


def spd(n=256):
    a = jax.random.normal(jax.random.key(0), (n, n))
    return a @ a.T / n + jnp.eye(n)


def two_factorisations(s):
    lu1, _, _ = jax.lax.linalg.lu(s)
    lu2, _, _ = jax.lax.linalg.lu(s)
    return jnp.tanh(lu1) @ s, jnp.sin(lu2) @ s


def test_equal_equations_of_one_level_are_merged():
    check_pass(share_common, two_factorisations, spd(), exact=True, grads=False,
               counts={"lu": 1}, expect=lambda r: count_primitive(r.closed, "lu") == 2)


def test_pipeline_shares_before_planning(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    # Without sharing, each lu would head a branch of its own and make a section.
    forced = jaxpar.inspect(two_factorisations, target="gpu", force_streams=True)(spd())
    regions = [r for sec in forced.sections for r in sec.regions]
    assert all(dict(r.primitives).get("lu", 0) == 0 for r in regions)
    g = jaxpar.parallel_branches(two_factorisations, target="gpu")
    assert_same_outputs(g, two_factorisations, (spd(),), jit=True,
                        tolerance={"rtol": 1e-6, "atol": 1e-6})


def test_twins_behind_calls_keep_the_cut_away(monkeypatch):
    # slogdet's lu sits inside its custom_jvp and inv's inside a jit: merging them would
    # change the calls, so the planner refuses to put them in two regions instead.
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    plan = jaxpar.inspect(slogdet_and_inv, target="gpu")(spd())
    assert not plan.sections
    assert any("CSE" in note.detail for note in plan.left_alone)
    forced = jaxpar.inspect(slogdet_and_inv, target="gpu", force_streams=True)(spd())
    assert forced.sections


def test_what_must_not_be_shared_is_kept():
    def f(x):
        a = jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        b = jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        c = jax.pure_callback(np.cos, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        d = jnp.tanh(x) + jnp.tanh(x * 1.0)     # different operands: two tanh
        return a + b + c + d
    check_pass(share_common, f, jnp.ones(4), values=False, grads=False,
               counts={"pure_callback": 3, "tanh": 2})


def test_equal_parameters_by_value_different_ones_kept():
    def f(x):
        return (jnp.sum(x, axis=0), jnp.sum(x, axis=0), jnp.sum(x, axis=1),
                jax.lax.cumsum(x, 0), jax.lax.cumsum(x, 0, reverse=True))
    check_pass(share_common, f, jnp.arange(9.0).reshape(3, 3), exact=True,
               grads=False, counts={"reduce_sum": 2, "cumsum": 2})


def test_pipeline_values_and_grads():
    g = jaxpar.parallel_branches(lambda s: sum(jnp.sum(o) for o in slogdet_and_inv(s)),
                                 target="gpu")
    s = spd()
    assert_matches(jax.jit(g)(s), jax.jit(lambda s: sum(jnp.sum(o) for o in
                                                          slogdet_and_inv(s)))(s),
                   tolerance={"rtol": 1e-5, "atol": 1e-5})
    assert_matches(jax.grad(g)(s), jax.grad(lambda s: sum(jnp.sum(o) for o in
                                                           slogdet_and_inv(s)))(s),
                   tolerance={"rtol": 1e-4, "atol": 1e-5})


def _chain(x, links=70):
    for _ in range(links):
        x = jnp.sin(x) * 1.01
    return x


def test_a_chain_computed_twice_is_shared_in_one_sweep():
    # Longer than the walker's rounds: shared one link per round, it never settled.
    def twice(x):
        return _chain(x) + _chain(x)

    check_pass(share_common, twice, jnp.linspace(0.0, 1.0, 8), exact=True, grads=True,
               counts={"sin": 70, "mul": 70})
    for target in ("gpu", "cpu"):
        x = jnp.linspace(0.0, 1.0, 8)
        np.testing.assert_array_equal(jaxpar.parallel_branches(twice, target=target)(x),
                                      jax.jit(twice)(x))


def test_readers_of_twins_kept_apart_stay_apart():
    # Two calls of one jitted function holding a custom_vjp are equal but not merged (its
    # backward rule would see their cotangents summed), so the sins reading them read
    # different values and stay two; the cos twins beside them are merged.
    @jax.custom_vjp
    def clipped(x):
        return jnp.tanh(x)

    clipped.defvjp(lambda x: (jnp.tanh(x), x), lambda x, ct: (jnp.clip(ct, -1.0, 1.0),))
    inner = jax.jit(lambda x: clipped(x) * 2.0)

    def f(x):
        return jnp.sin(inner(x)) + jnp.sin(inner(x)), jnp.cos(x) * jnp.cos(x)

    result = check_pass(share_common, f, jnp.ones(4), exact=True, grads=True,
                        counts={"jit": 2, "sin": 2, "cos": 1})
    assert [d.kind for d in result.decisions] == ["left alone"]
