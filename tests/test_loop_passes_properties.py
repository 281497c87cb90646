"""Property tests of the loop passes on random scan-heavy programs (tests/programs.py).

For every drawn program, ``apply_passes`` with the GPU defaults (fuse, batch,
unroll="auto") must give a well-formed jaxpr that computes the same values, gradients and
``vmap``ped values as the program, and applying the passes again must change nothing.
The hypothesis profile comes from tests/conftest.py (``JAXPAR_HYPOTHESIS_PROFILE``; 10
examples a property by default, 20 under ``JAXPAR_FULL=1``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import pytest
from helpers.environment import fraction_of_examples
from hypothesis import given
from hypothesis import strategies as st
from pass_checker import (
    assert_matches,
    assert_same_gradients,
    assert_same_outputs,
    assert_well_formed,
    check_pass,
    unmutated,
)
from programs import Program, loop_programs, scan_programs, stacked_batch

import jaxpar
from jaxpar.passes import apply_passes, pass_defaults

# Fusion and unrolling change how XLA compiles the loop bodies, hence float32 rounding.
VALUE_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
GRAD_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}


def _loop_passes(target: str) -> Any:
    return partial(apply_passes, **pass_defaults(target), target=target)


def _rewrite(program: Program, target: str = "gpu") -> tuple[Any, Any]:
    closed = jax.make_jaxpr(program.fn)(*program.args)
    with unmutated(closed):
        new, _ = _loop_passes(target)(closed)
    assert_well_formed(new)
    return closed, new


def _fn(jaxpr: Any) -> Any:
    return jex_core.jaxpr_as_fun(jaxpr)


def _loss(fn: Any) -> Any:
    def loss(*args: Any) -> Any:
        return sum(jnp.sum(jnp.tanh(leaf)) for leaf in jax.tree.leaves(fn(*args)))
    return loss


def _assert_close(got: Any, want: Any, tolerance: dict[str, float]) -> None:
    """Within ``tolerance`` at every floating dtype (``assert_matches``)."""
    assert_matches(got, want, tolerance={"float32": tolerance, "float64": tolerance})


def _same_gradients_and_vmap(program: Program, closed: Any, new: Any) -> None:
    assert_same_gradients(_fn(new), _fn(closed), program.args, tolerance=GRAD_TOLERANCE,
                          jit=True, loss=_loss)
    batch = stacked_batch(program.args)
    assert_same_outputs(jax.vmap(_fn(new)), jax.vmap(_fn(closed)), batch,
                        tolerance=VALUE_TOLERANCE, jit=True)


@given(scan_programs())
def test_same_values_and_idempotent(program: Program) -> None:
    check_pass(_loop_passes("gpu"), program.fn, *program.args, grads=False, jit=True,
               tolerance=VALUE_TOLERANCE)


@given(scan_programs())
def test_same_gradients_and_vmap(program: Program) -> None:
    _same_gradients_and_vmap(program, *_rewrite(program))


# ---- Loop programs: counter `while`s of every dtype and step, int/bool scan carries ----------
# (programs.loop_program_specs). Under both targets' loop settings; a quarter of the
# profile's examples each, as these compile more.

_examples = fraction_of_examples


@_examples(0.1)
@given(loop_programs(), st.sampled_from(("gpu", "cpu")))
def test_loop_programs_same_values_and_idempotent(program: Program, target: str) -> None:
    check_pass(_loop_passes(target), program.fn, *program.args, grads=False, jit=True,
               tolerance=VALUE_TOLERANCE)


@_examples(0.1)
@given(loop_programs(), st.sampled_from(("gpu", "cpu")))
def test_loop_programs_same_gradients_and_vmap(program: Program, target: str) -> None:
    closed, new = _rewrite(program, target)
    try:
        _same_gradients_and_vmap(program, closed, new)
    except ValueError as error:  # a while with a traced trip count: no reverse mode
        assert "Reverse-mode differentiation does not work" in str(error)
        # ... in the program itself, not only in its rewrite (tracing raises it).
        with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
            jax.make_jaxpr(jax.grad(_loss(_fn(closed)), tuple(range(len(program.args)))))(
                *program.args)
        batch = stacked_batch(program.args)
        assert_same_outputs(jax.vmap(_fn(new)), jax.vmap(_fn(closed)), batch,
                            tolerance=VALUE_TOLERANCE, jit=True)


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
