"""One checker for jaxpar's jaxpr passes (``jaxpar.passes``), modelled on JAX's own pass tests.

JAX tests a pass such as ``pe.dce_jaxpr`` by running it, checking the result with
``check_jaxpr``, counting its equations and comparing what it computes with the input
(``DCETest.assert_dce_result``); ``jax.test_util.check_grads`` compares gradients with
tolerances by dtype. ``check_pass`` does all of that for a pass
``closed_jaxpr -> (new_closed_jaxpr, decisions)``:

1. the input is not mutated (its text is the same before and after);
2. the output is well formed (``jax.extend.core.check_jaxpr``) and keeps the signature
   (the shapes and dtypes of the inputs and outputs);
3. the output has the intended structure: the decisions' kinds, primitive counts at every
   level, ``new is closed`` where the pass must leave the program alone, and any predicate;
4. original and rewritten compute the same values: bit-exact where only tags change
   (``exact=True``), else within tolerances by dtype (``TOLERANCES``);
5. the same gradients of ``sum(sin(float outputs))`` with respect to the float inputs;
6. idempotence: the pass applied to its own output returns it unchanged (the same object)
   and decides no further rewrite.

Example::

    from functools import partial
    from pass_checker import check_pass

    result = check_pass(partial(batch_branches, target="gpu"), ensemble, *ensemble_args(),
                        kinds=["batched subgraphs"], counts={"dot_general": 3})
    result.new, result.decisions          # for the assertions the test adds

The parts (``assert_well_formed``, ``assert_same_outputs``, ``assert_same_gradients``,
``assert_idempotent``, ``unmutated``) are public for the property tests and the end-to-end
tests of ``jaxpar.parallel_branches``, which compare functions rather than jaxprs.

Sharp edges:
    Values and gradients run under ``jax.jit`` (two compiles a side), or eagerly, the
    jaxpr run equation by equation (one compile per primitive and shape, about 4x the
    compiles), where ``exact`` asks for bit-equality or ``jit=False`` is passed: the two
    compile differently and so round differently in the last bits. Key-typed inputs need
    ``jit=True``. Programs given as shapes (``jax.ShapeDtypeStruct``) can only be checked
    for structure (``values=False``), or left alone (``unchanged=True``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from helpers.lowered import canonical_jaxpr_text

from jaxpar import _compat
from jaxpar.passes import DecisionKind

__all__ = [
    "REPORT_KINDS",
    "TOLERANCES",
    "PassResult",
    "all_eqns",
    "as_function",
    "assert_idempotent",
    "assert_matches",
    "assert_same_gradients",
    "assert_same_outputs",
    "assert_same_signature",
    "assert_well_formed",
    "check_pass",
    "count_primitive",
    "eqns_of",
    "kinds",
    "primitives",
    "scalar_loss",
    "sum_loss",
    "unmutated",
]

# Decisions that report without rewriting: a pass run on its own output may repeat these.
REPORT_KINDS = frozenset({DecisionKind.LEFT_ALONE, DecisionKind.HOST_SYNC,
                          DecisionKind.SUBGRAPHS_LEFT_ALONE, DecisionKind.MATMULS_LEFT_ALONE})

# Tolerances by dtype where a rewrite reorders arithmetic (jax.test_util's defaults, with
# float32 at last-bits level for XLA's different fusion of a rewritten program). Integer,
# boolean and key results are always compared exactly.
TOLERANCES: dict[str, dict[str, float]] = {
    "bfloat16": {"rtol": 1e-2, "atol": 1e-2},
    "float16": {"rtol": 1e-3, "atol": 1e-3},
    "float32": {"rtol": 1e-5, "atol": 1e-6},
    "complex64": {"rtol": 1e-5, "atol": 1e-6},
    "float64": {"rtol": 1e-12, "atol": 1e-12},
    "complex128": {"rtol": 1e-12, "atol": 1e-12},
}

# A caller's tolerance: {"rtol": .., "atol": ..} for float32 (and complex64), the dtype the
# test programs use, or {dtype name: {"rtol": .., "atol": ..}} for any dtypes.
Tolerance = Mapping[str, Any]


class PassResult(NamedTuple):
    """What ``check_pass`` ran: the input, the output, the decisions, and the decisions of
    the second application (``()`` where idempotence was not checked)."""

    closed: Any
    new: Any
    decisions: tuple[Any, ...]
    repeat_decisions: tuple[Any, ...]


# --- reading jaxprs --------------------------------------------------------------------------


def eqns_of(jaxpr: Any) -> list[Any]:
    """The equations of ``jaxpr``'s top level."""
    return list(_compat.open_jaxpr(jaxpr)[0].eqns)


def all_eqns(jaxpr: Any) -> list[Any]:
    """Every equation of ``jaxpr``, each followed by those of its nested jaxprs."""
    found = []
    for eqn in eqns_of(jaxpr):
        found.append(eqn)
        for _, _, sub in _compat.eqn_subjaxprs(eqn):
            found.extend(all_eqns(sub))
    return found


def primitives(jaxpr: Any, recursive: bool = False) -> list[str]:
    """Primitive names of ``jaxpr``'s equations in order; with ``recursive``, each followed
    by those of its nested jaxprs."""
    names = []
    for eqn in eqns_of(jaxpr):
        names.append(eqn.primitive.name)
        if recursive:
            for _, _, sub in _compat.eqn_subjaxprs(eqn):
                names.extend(primitives(sub, recursive=True))
    return names


def count_primitive(jaxpr: Any, name: str) -> int:
    """Equations of primitive ``name`` at every level of ``jaxpr``."""
    return primitives(jaxpr, recursive=True).count(name)


def kinds(decisions: Sequence[Any]) -> list[str]:
    return [d.kind for d in decisions]


def as_function(jaxpr: Any) -> Callable[..., list[Any]]:
    """``jaxpr`` (closed or open) as a function of its inputs, run equation by equation."""
    def fn(*args: Any) -> list[Any]:
        return _compat.jaxpr_eval(jaxpr, *args)
    return fn


def scalar_loss(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``sum(sin(leaf))`` over ``fn``'s floating outputs: a loss whose cotangents differ per
    element, so a gradient that mixes up elements shows."""
    def loss(*args: Any) -> Any:
        return sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(fn(*args))
                   if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact))
    return loss


def sum_loss(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The plain sum of ``fn``'s floating outputs (cotangents all ones)."""
    def loss(*args: Any) -> Any:
        return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(fn(*args))
                   if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact))
    return loss


# --- the checks ------------------------------------------------------------------------------


def assert_well_formed(jaxpr: Any) -> None:
    """JAX's own type check of every equation, nested jaxprs included."""
    jex_core.check_jaxpr(_compat.open_jaxpr(jaxpr)[0])


def _signature(jaxpr: Any) -> tuple[list[Any], list[Any]]:
    inner = _compat.open_jaxpr(jaxpr)[0]
    return ([(v.aval.shape, v.aval.dtype) for v in inner.invars],
            [(v.aval.shape, v.aval.dtype) for v in inner.outvars])


def assert_same_signature(new: Any, closed: Any) -> None:
    """``new`` takes and returns what ``closed`` does (shapes and dtypes)."""
    (new_in, new_out), (old_in, old_out) = _signature(new), _signature(closed)
    assert new_in == old_in, f"inputs changed: {new_in} vs {old_in}"
    assert new_out == old_out, f"outputs changed: {new_out} vs {old_out}"


@contextlib.contextmanager
def unmutated(jaxpr: Any, what: str = "the pass's input") -> Iterator[None]:
    """Asserts that the body leaves ``jaxpr``'s text as it was."""
    before = str(jaxpr)
    yield
    assert str(jaxpr) == before, f"{what} was mutated"


def _tolerance(dtype: np.dtype, tolerance: Tolerance | None) -> dict[str, float] | None:
    """rtol/atol for ``dtype``; ``None`` where values must be equal."""
    if not jnp.issubdtype(dtype, jnp.inexact):
        return None
    name = np.dtype(dtype).name
    if tolerance:
        if "rtol" in tolerance or "atol" in tolerance:
            if name in ("float32", "complex64"):
                return {"rtol": 0.0, "atol": 0.0, **tolerance}
        elif name in tolerance:
            return {"rtol": 0.0, "atol": 0.0, **tolerance[name]}
    if name not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {name}: pass tolerance={{{name!r}: ...}}")
    return TOLERANCES[name]


def assert_matches(got: Any, want: Any, exact: bool = False,
                   tolerance: Tolerance | None = None, what: str = "values") -> None:
    """Same tree, shapes and dtypes; equal values where ``exact`` or not floating, else
    within the dtype's tolerance (``TOLERANCES``, or the caller's ``tolerance``)."""
    got_leaves, got_tree = jax.tree.flatten(got)
    want_leaves, want_tree = jax.tree.flatten(want)
    assert got_tree == want_tree, f"{what}: tree structures differ: {got_tree} vs {want_tree}"
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        g_dtype, w_dtype = jnp.result_type(g), jnp.result_type(w)
        assert np.shape(g) == np.shape(w), f"{what} {i}: shape {np.shape(g)} vs {np.shape(w)}"
        assert g_dtype == w_dtype, f"{what} {i}: dtype {g_dtype} vs {w_dtype}"
        if jnp.issubdtype(g_dtype, jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        g, w = np.asarray(g), np.asarray(w)
        bounds = None if exact else _tolerance(g_dtype, tolerance)
        if bounds is None:
            np.testing.assert_array_equal(g, w, err_msg=f"{what} {i}")
        else:
            np.testing.assert_allclose(g, w, **bounds, err_msg=f"{what} {i}")


def _flat(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Callable[..., Any], list[Any]]:
    """``fn`` as a function of the leaves of ``args``, and those leaves."""
    leaves, tree = jax.tree.flatten(tuple(args))
    return (lambda *flat: fn(*jax.tree.unflatten(tree, flat))), leaves


def _is_abstract(leaves: Sequence[Any]) -> bool:
    return any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)


def assert_same_outputs(fn: Callable[..., Any], reference: Callable[..., Any],
                        args: Sequence[Any], exact: bool = False,
                        tolerance: Tolerance | None = None, jit: bool = False) -> None:
    """``fn(*args)`` matches ``reference(*args)`` (see ``assert_matches``); both run under
    ``jax.jit`` where ``jit``."""
    wrap = jax.jit if jit else (lambda f: f)
    want = wrap(reference)(*args)
    assert_matches(wrap(fn)(*args), want, exact, tolerance, "output")


def assert_same_gradients(fn: Callable[..., Any], reference: Callable[..., Any],
                          args: Sequence[Any], tolerance: Tolerance | None = None,
                          jit: bool = False, exact: bool = False,
                          argnums: Sequence[int] | None = None,
                          loss: Callable[..., Any] = scalar_loss) -> None:
    """Gradients of ``loss`` (``scalar_loss`` by default) with respect to every floating leaf
    of ``args`` (or the leaves ``argnums`` picks) match."""
    flat_fn, leaves = _flat(fn, args)
    flat_reference, _ = _flat(reference, args)
    if argnums is None:
        argnums = tuple(i for i, leaf in enumerate(leaves)
                        if jnp.issubdtype(jnp.result_type(leaf), jnp.floating))
    argnums = tuple(argnums)
    if not argnums:
        raise ValueError("no floating input to differentiate with respect to: pass grads=False")
    wrap = jax.jit if jit else (lambda f: f)
    # The reference first: where it cannot be differentiated, nothing else is compiled.
    want = wrap(jax.grad(loss(flat_reference), argnums))(*leaves)
    got = wrap(jax.grad(loss(flat_fn), argnums))(*leaves)
    assert_matches(got, want, exact, tolerance, "gradient")


def assert_idempotent(pass_fn: Callable[[Any], tuple[Any, Any]], new: Any) -> tuple[Any, ...]:
    """``pass_fn`` on its own output returns that object and decides no further rewrite.

    Returns the second run's decisions.
    """
    with unmutated(new, "the pass's output, given back to it,"):
        again, decisions = pass_fn(new)
    changing = [d for d in decisions if d.kind not in REPORT_KINDS]
    assert not changing, f"applying the pass again rewrote more: {changing}"
    assert again is new, ("applying the pass again made a new jaxpr"
                          + ("" if canonical_jaxpr_text(again) == canonical_jaxpr_text(new)
                             else f":\n{again}\ninstead of\n{new}"))
    return tuple(decisions)


def check_pass(pass_fn: Callable[[Any], tuple[Any, Any]], program: Any, *args: Any,
               kinds: Sequence[str] | None = None, counts: Mapping[str, int] | None = None,
               expect: Callable[[PassResult], Any] | None = None, unchanged: bool = False,
               values: bool = True, grads: bool = True, idempotent: bool = True,
               exact: bool = False, tolerance: Tolerance | None = None,
               grad_tolerance: Tolerance | None = None, jit: bool | None = None) -> PassResult:
    """Runs ``pass_fn`` on ``program`` and checks the result (see the module docstring).

    Args:
        pass_fn: ``closed_jaxpr -> (new_closed_jaxpr, decisions)``; bind options with
            ``functools.partial``.
        program: a closed jaxpr, or a function traced with ``jax.make_jaxpr`` on ``args``.
        *args: inputs (pytrees) to trace ``program`` with and to compare values on.
        kinds: the decisions' kinds, in order.
        counts: ``{primitive name: equations}`` at every level of the output.
        expect: called with the ``PassResult``; it asserts, or returns ``False`` to fail.
        unchanged: the pass must return its input object (nothing to compare then).
        values: compare the values of input and output on ``args``.
        grads: compare the gradients too (with respect to the floating inputs).
        idempotent: apply the pass again to its output (see ``assert_idempotent``).
        exact: bit-exact values and gradients (for rewrites that only add tags).
        tolerance: values' tolerance (see ``Tolerance``); ``TOLERANCES`` by default.
        grad_tolerance: gradients' tolerance, likewise.
        jit: run values and gradients under ``jax.jit``; False: equation by equation.
            Default: under ``jax.jit`` unless ``exact``.

    Returns:
        ``PassResult(closed, new, decisions, repeat_decisions)``.
    """
    closed = (program if _compat.is_jaxpr_like(program)
              else jax.make_jaxpr(program)(*args))
    with unmutated(closed):
        new, decisions = pass_fn(closed)
    decisions = tuple(decisions)
    if unchanged:
        assert new is closed, f"the pass rewrote what it must leave alone: {decisions}"
    else:
        assert_well_formed(new)
        assert_same_signature(new, closed)
    repeat = assert_idempotent(pass_fn, new) if idempotent and not unchanged else ()
    result = PassResult(closed, new, decisions, repeat)
    if kinds is not None:
        assert [d.kind for d in decisions] == list(kinds), [d.kind for d in decisions]
    if counts:
        found = {name: count_primitive(new, name) for name in counts}
        assert found == dict(counts), f"primitive counts {found}, expected {dict(counts)}"
    if expect is not None:
        assert expect(result) is not False, f"structure predicate {expect.__name__} failed"
    if unchanged or not (values or grads):
        return result
    leaves = jax.tree.leaves(args)
    if _is_abstract(leaves):
        raise ValueError("args are shapes (jax.ShapeDtypeStruct): pass values=False and "
                         "grads=False, or concrete arrays")
    new_fn, old_fn = jex_core.jaxpr_as_fun(new), jex_core.jaxpr_as_fun(closed)
    if jit is None:
        jit = not exact
    if values:
        assert_same_outputs(new_fn, old_fn, leaves, exact, tolerance, jit)
    if grads:
        assert_same_gradients(new_fn, old_fn, leaves, grad_tolerance, jit, exact)
    return result
