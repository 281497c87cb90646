"""The pass checker (tests/pass_checker.py) fails where a pass is wrong: toy passes that
mutate their input, change values or gradients, rewrite again and again, or miss the
intended structure."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pass_checker import assert_matches, check_pass, eqns_of

from jaxpar import _compat

X = jnp.linspace(0.1, 1.0, 4)


def program(x: jax.Array) -> jax.Array:
    return jnp.sin(x) * 2.0


def identity_pass(closed: Any) -> tuple[Any, tuple[Any, ...]]:
    return closed, ()


def retrace_pass(fn: Any) -> Any:
    """A 'pass' that returns a fresh trace of ``fn``: a new object every time (a new lambda
    each call, as ``jax.make_jaxpr`` caches traces per function)."""
    return lambda closed: (jax.make_jaxpr(lambda x: fn(x))(X), ())


def test_a_faithful_rewrite_passes() -> None:
    made: list[Any] = []

    def rewrite(closed: Any) -> tuple[Any, tuple[Any, ...]]:
        if any(closed is new for new in made):  # its own output: nothing left to do
            return closed, ()
        made.append(jax.make_jaxpr(lambda x: 2.0 * jnp.sin(x))(X))
        return made[-1], ()

    result = check_pass(rewrite, program, X, exact=True)
    assert result.new is made[0] and result.new is not result.closed


def test_the_checker_passes_a_pass_that_leaves_the_program_alone() -> None:
    result = check_pass(identity_pass, program, X, unchanged=True, kinds=[],
                        counts={"sin": 1})
    assert result.new is result.closed


def test_mutating_the_input_fails() -> None:
    def mutating(closed: Any) -> tuple[Any, tuple[Any, ...]]:
        _compat.open_jaxpr(closed)[0].eqns.pop()
        return closed, ()

    # A program of its own: jax.make_jaxpr caches traces, and this one is broken for good.
    with pytest.raises(AssertionError, match="mutated"):
        check_pass(mutating, lambda x: jnp.sin(x) * 2.0, X, values=False, grads=False,
                   idempotent=False)


def test_different_values_fail() -> None:
    with pytest.raises(AssertionError, match="output 0"):
        check_pass(retrace_pass(lambda x: jnp.sin(x) * 2.0001), program, X, idempotent=False)


def test_different_gradients_fail() -> None:
    # Same values at X (cos(x) - cos(x) = 0 added), other gradients.
    def other(x: jax.Array) -> jax.Array:
        return jnp.sin(x) * 2.0 + (x - jax.lax.stop_gradient(x)) * 3.0

    with pytest.raises(AssertionError, match="gradient 0"):
        check_pass(retrace_pass(other), program, X, idempotent=False)


def test_rewriting_its_own_output_again_fails() -> None:
    with pytest.raises(AssertionError, match="again"):
        check_pass(retrace_pass(program), program, X, values=False, grads=False)


def test_a_changed_signature_fails() -> None:
    with pytest.raises(AssertionError, match="outputs changed"):
        check_pass(retrace_pass(lambda x: (jnp.sin(x) * 2.0)[:2]), program, X,
                   idempotent=False)


def test_structure_checks_fail() -> None:
    with pytest.raises(AssertionError, match="primitive counts"):
        check_pass(identity_pass, program, X, unchanged=True, counts={"sin": 2})
    with pytest.raises(AssertionError):
        check_pass(identity_pass, program, X, unchanged=True, kinds=["fused"])
    with pytest.raises(AssertionError, match="predicate"):
        check_pass(identity_pass, program, X, unchanged=True,
                   expect=lambda r: len(eqns_of(r.new)) == 5)
    with pytest.raises(AssertionError, match="must leave alone"):
        check_pass(retrace_pass(program), program, X, unchanged=True)


def test_tolerances_follow_the_dtype() -> None:
    value = np.linspace(0.5, 1.0, 5)
    nudged = value * (1 + 3e-4)
    assert_matches(nudged.astype(np.float16), value.astype(np.float16))
    with pytest.raises(AssertionError):
        assert_matches(nudged.astype(np.float32), value.astype(np.float32))
    assert_matches(nudged.astype(np.float32), value.astype(np.float32),
                   tolerance={"rtol": 1e-3})
    with pytest.raises(AssertionError):
        assert_matches(np.arange(3) + 1, np.arange(3))  # integers: exact
    with pytest.raises(AssertionError, match="dtype"):
        assert_matches(value.astype(np.float32), value.astype(np.float16))
    with pytest.raises(AssertionError):
        assert_matches(nudged.astype(np.float32), value.astype(np.float32), exact=True,
                       tolerance={"rtol": 1.0})
