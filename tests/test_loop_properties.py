"""Property tests of the loop passes on random scan-heavy programs (tests/programs.py).

For every drawn program, ``apply_loop_passes`` with the GPU defaults (fuse, batch,
unroll="auto") must give a well-formed jaxpr that computes the same values, gradients and
``vmap``ped values as the program, and applying the passes again must change nothing.
The hypothesis profile comes from tests/conftest.py (``JAXPAR_HYPOTHESIS_PROFILE``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from helpers import fraction_of_examples
from hypothesis import given
from hypothesis import strategies as st
from programs import Program, loop_programs, scan_programs, stacked_batch

import jaxpar
from jaxpar import _compat
from jaxpar.passes import apply_loop_passes, loop_defaults

# Fusion and unrolling change how XLA compiles the loop bodies, hence float32 rounding.
VALUE_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
GRAD_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}


def _rewrite(program: Program) -> tuple[Any, Any]:
    closed = jax.make_jaxpr(program.fn)(*program.args)
    new, _ = apply_loop_passes(closed, **loop_defaults("gpu"), target="gpu")
    return closed, new


def _fn(jaxpr: Any) -> Any:
    return jex_core.jaxpr_as_fun(jaxpr)


def _assert_close(got: Any, want: Any, tolerance: dict[str, float]) -> None:
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert np.shape(g) == np.shape(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **tolerance)


def _loss(fn: Any) -> Any:
    def loss(*args: Any) -> Any:
        return sum(jnp.sum(jnp.tanh(leaf)) for leaf in jax.tree.leaves(fn(*args)))
    return loss


@given(scan_programs())
def test_same_values_and_idempotent(program: Program) -> None:
    closed, new = _rewrite(program)
    jex_core.check_jaxpr(_compat.open_jaxpr(new)[0])
    _assert_close(jax.jit(_fn(new))(*program.args), jax.jit(_fn(closed))(*program.args),
                  VALUE_TOLERANCE)
    again, _ = apply_loop_passes(new, **loop_defaults("gpu"), target="gpu")
    assert again is new


@given(scan_programs())
def test_same_gradients_and_vmap(program: Program) -> None:
    closed, new = _rewrite(program)
    argnums = tuple(range(len(program.args)))
    _assert_close(jax.jit(jax.grad(_loss(_fn(new)), argnums))(*program.args),
                  jax.jit(jax.grad(_loss(_fn(closed)), argnums))(*program.args), GRAD_TOLERANCE)
    batch = stacked_batch(program.args)
    _assert_close(jax.jit(jax.vmap(_fn(new)))(*batch), jax.jit(jax.vmap(_fn(closed)))(*batch),
                  VALUE_TOLERANCE)


# ---- Loop programs: counter `while`s of every dtype and step, int/bool scan carries ----------
# (programs.loop_program_specs). Under both targets' loop settings; a quarter of the
# profile's examples each, as these compile more.

_examples = fraction_of_examples


def _rewrite_for(program: Program, target: str) -> tuple[Any, Any]:
    closed = jax.make_jaxpr(program.fn)(*program.args)
    new, _ = apply_loop_passes(closed, **loop_defaults(target), target=target)
    return closed, new


@_examples(0.1)
@given(loop_programs(), st.sampled_from(("gpu", "cpu")))
def test_loop_programs_same_values_and_idempotent(program: Program, target: str) -> None:
    closed, new = _rewrite_for(program, target)
    jex_core.check_jaxpr(_compat.open_jaxpr(new)[0])
    _assert_close(jax.jit(_fn(new))(*program.args), jax.jit(_fn(closed))(*program.args),
                  VALUE_TOLERANCE)
    again, _ = apply_loop_passes(new, **loop_defaults(target), target=target)
    assert again is new


@_examples(0.1)
@given(loop_programs(), st.sampled_from(("gpu", "cpu")))
def test_loop_programs_same_gradients_and_vmap(program: Program, target: str) -> None:
    closed, new = _rewrite_for(program, target)
    argnums = tuple(range(len(program.args)))
    try:
        want = jax.jit(jax.grad(_loss(_fn(closed)), argnums))(*program.args)
    except ValueError as error:  # a while with a traced trip count: no reverse mode
        assert "Reverse-mode differentiation does not work" in str(error)
    else:
        _assert_close(jax.jit(jax.grad(_loss(_fn(new)), argnums))(*program.args), want,
                      GRAD_TOLERANCE)
    batch = stacked_batch(program.args)
    _assert_close(jax.jit(jax.vmap(_fn(new)))(*batch), jax.jit(jax.vmap(_fn(closed)))(*batch),
                  VALUE_TOLERANCE)


@_examples(0.1)
@given(loop_programs(x64=True), st.sampled_from(("gpu", "cpu")))
def test_loop_programs_under_x64(program: Program, target: str) -> None:
    """int64/uint64 counters exist only under x64: the whole decorated call runs there."""
    with jax.enable_x64(True):
        g = jaxpar.parallel_branches(program.fn, target=target)
        want = jax.jit(program.fn)(*program.args)
        got = g(*program.args)
        tolerance = {"rtol": 0.0, "atol": 0.0} if target == "cpu" else VALUE_TOLERANCE
        _assert_close(got, want, tolerance)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.dtype == b.dtype
