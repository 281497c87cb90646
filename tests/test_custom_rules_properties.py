"""Property-based tests of `jaxpar.parallel_branches` on programs of custom rules, effects,
host callbacks, weak and key types, and checkify hazards (`programs.rule_programs`,
`programs.checkify_programs`: what broke the rewrites before, and its neighbours).

For a random program `f`, a drawn target, and `g = parallel_branches(f, **options)` with both
the target's default options and every section forced into streams (`FORCED`, with
`batch_scans=True`: the default pricing keeps most of the emission path away from programs
this small):

- `g(*args)` returns what `jax.jit(f)(*args)` returns (keys by their data, weak types kept),
  with the same effects: as many debug prints and callbacks, with the same tags and values.
- `jax.jit(jax.grad(loss))` of `g` and of `f` agree, with the same effects: a rule sees the
  cotangents `jax.jit` gives it, however twins are merged or members batched.
- `checkify.checkify(g, errors=...)` reports the error `checkify.checkify(jax.jit(f))` reports,
  for every option set, and returns the same values.

Values are compared bit for bit where `target="cpu"` runs with its defaults (the program is
re-emitted unchanged), else, and gradients always, within the tolerances of
`test_parallel_branches_properties.py`. Effects are
compared as sorted lists of (tag, value). Each example runs two configurations, so the
properties use a fraction of the profile's examples; run
`JAXPAR_HYPOTHESIS_PROFILE=thorough` to hunt.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental import checkify

import jaxpar

try:
    from helpers.environment import fraction_of_examples
    from programs import Program, checkify_programs, collect_effects, rule_programs
except ImportError:  # tests/ imported as a package
    from tests.helpers.environment import fraction_of_examples
    from tests.programs import Program, checkify_programs, collect_effects, rule_programs

VALUE_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
EFFECT_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}  # sums printed or passed to a callback
FORCED: dict[str, Any] = {"min_cost_us": 0.0, "force_streams": True, "batch_scans": True}

ERROR_SETS: dict[str, Any] = {
    "index": checkify.index_checks,
    "nan": checkify.nan_checks,
    "div": checkify.div_checks,
    "float": checkify.float_checks,
    "user": checkify.user_checks,
    "index+user": checkify.index_checks | checkify.user_checks,
    "automatic": checkify.automatic_checks,
    "all": checkify.all_checks,
}

targets = st.sampled_from(("gpu", "cpu"))


def configurations(target: str) -> tuple[dict[str, Any], ...]:
    """The target's defaults, then every section forced into streams."""
    return {"target": target}, {"target": target, **FORCED}


def exact(options: dict[str, Any]) -> bool:
    return options == {"target": "cpu"}


def _host_leaf(leaf: Any) -> tuple[np.ndarray, str, Any]:
    """A leaf as NumPy data, its dtype's name and its weak type (keys by their data)."""
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(leaf)), str(leaf.dtype), False
    return np.asarray(leaf), str(np.asarray(leaf).dtype), getattr(leaf, "weak_type", None)


def assert_same_tree(actual: Any, expected: Any, tolerance: dict[str, float] | None) -> None:
    """Same structure, shapes, dtypes (keys too) and weak types; leaves bit-exact, or within
    `tolerance` (NaN where NaN)."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    leaves = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    for i, (a, e) in enumerate(leaves):
        (a_data, a_dtype, a_weak), (e_data, e_dtype, e_weak) = _host_leaf(a), _host_leaf(e)
        assert (a_data.shape, a_dtype) == (e_data.shape, e_dtype), f"leaf {i}"
        assert a_weak == e_weak, f"leaf {i}: weak_type {a_weak}, jax.jit gives {e_weak}"
        if tolerance and a_data.dtype.kind in "fc":
            np.testing.assert_allclose(a_data, e_data, err_msg=f"leaf {i}", **tolerance)
        else:
            np.testing.assert_array_equal(a_data, e_data, err_msg=f"leaf {i}")


def assert_same_effects(actual: list[tuple[str, float]], expected: list[tuple[str, float]],
                        tolerance: dict[str, float] | None) -> None:
    tags = [tag for tag, _ in actual]
    assert tags == [tag for tag, _ in expected], (
        f"effects {actual}, jax.jit has {expected}")
    got, want = np.array([v for _, v in actual]), np.array([v for _, v in expected])
    if tolerance:
        np.testing.assert_allclose(got, want, err_msg=f"effects {actual} vs {expected}",
                                   **tolerance)
    else:
        np.testing.assert_array_equal(got, want, err_msg=f"effects {actual} vs {expected}")


def assert_same_run(actual: Callable[[], Any], expected: Callable[[], Any],
                    tolerance: dict[str, float] | None) -> None:
    """Both raise, or both return equal trees; with the same effects either way."""
    (want_kind, want), want_effects = collect_effects(expected)
    (got_kind, got), got_effects = collect_effects(actual)
    if want_kind == "raised":
        assert got_kind == "raised", f"jax.jit raises {want!r}, the rewrite returns a value"
    elif got_kind == "raised":
        raise AssertionError("the rewrite raises where jax.jit does not") from got
    else:
        assert_same_tree(got, want, tolerance)
    assert_same_effects(got_effects, want_effects, tolerance and EFFECT_TOLERANCE)


def float_loss(fn: Callable[..., Any]) -> Callable[..., jax.Array]:
    """The sum of every floating output leaf (keys and integers have no gradient)."""
    def loss(*args: jax.Array) -> jax.Array:
        leaves = [leaf for leaf in jax.tree.leaves(fn(*args))
                  if jnp.issubdtype(leaf.dtype, jnp.floating)]
        return sum((jnp.sum(leaf) for leaf in leaves), jnp.zeros((), jnp.float32))

    return loss


_examples = fraction_of_examples
# 6 examples in the default ci profile (10 a property), 12 in `full`: fewer would leave out
# some of the node kinds that 6 draw (host callbacks, key scans, parallel members).


@_examples(0.6)
@given(program=rule_programs(), target=targets)
def test_rule_values_and_effects_match(program: Program, target: str) -> None:
    for options in configurations(target):
        g = jaxpar.parallel_branches(program.fn, **options)
        assert_same_run(partial(g, *program.args), partial(jax.jit(program.fn), *program.args),
                        None if exact(options) else VALUE_TOLERANCE)


@_examples(0.6)
@given(program=rule_programs(), target=targets)
def test_rule_grads_and_effects_match(program: Program, target: str) -> None:
    argnums = tuple(range(len(program.args)))
    expected = jax.jit(jax.grad(float_loss(program.fn), argnums))
    for options in configurations(target):
        g = jaxpar.parallel_branches(program.fn, **options)
        actual = jax.jit(jax.grad(float_loss(g), argnums))
        assert_same_run(partial(actual, *program.args), partial(expected, *program.args),
                        GRAD_TOLERANCE)


@_examples(0.6)
@given(program=checkify_programs(), target=targets, errors=st.sampled_from(tuple(ERROR_SETS)))
def test_checkify_errors_match(program: Program, target: str, errors: str) -> None:
    def checked(fn: Callable[..., Any]) -> Callable[[], Any]:
        def run() -> Any:
            error, out = checkify.checkify(fn, errors=ERROR_SETS[errors])(*program.args)
            return error.get(), out

        return run

    (want_kind, want), _ = collect_effects(checked(jax.jit(program.fn)))
    assert want_kind == "ok", f"checkify of jax.jit raises {want!r}"
    for options in configurations(target):
        g = jaxpar.parallel_branches(program.fn, **options)
        (got_kind, got), _ = collect_effects(checked(g))
        if got_kind == "raised":
            raise AssertionError(f"checkify of the rewrite raises (options {options})") from got
        assert got[0] == want[0], (
            f"checkify({errors}) reports {got[0]!r}, for jax.jit {want[0]!r} (options {options})")
        assert_same_tree(got[1], want[1], None if exact(options) else VALUE_TOLERANCE)
