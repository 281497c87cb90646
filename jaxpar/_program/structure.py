"""Structural keys: two pieces of a program with equal keys compute the same thing.

The batching passes run several members' code as one ``vmap``ped copy of the first
member's, so "these are the same" must mean the same computation, not the same
printed text: ``str(jaxpr)`` hides a ``custom_jvp`` rule, a ``custom_vjp``'s
backward function and its non-differentiable arguments, a callback's function,
and the value of a large constant. Both ``batch_scans`` (scan bodies) and
``batch_branches`` (equations) compare through this module.

The key of a jaxpr lists its equations in order, each as its primitive (the
object, so two primitives sharing a name differ), its parameters, its context
(compute type, XLA metadata, threefry mode...), the results' types and where
each input comes from, with variables numbered by definition so that renaming
does not matter. Values are compared as follows:

* ``bool``/``int``/``str``/``None``/dtypes by type and value, floats and complex
  numbers bit for bit (``-0.0`` is not ``0.0``; ``nan`` equals itself);
* NumPy scalars, arrays, JAX arrays and literals by dtype, shape and bytes;
* nested jaxprs recursively, tuples, lists and dicts item by item;
* any other hashable object by its type and ``==`` -- for functions, methods and
  ufuncs that is identity, for JAX's callback wrappers and ``WrappedFun``s it
  compares the wrapped function and its static arguments;
* an unhashable object (a ``custom_vjp`` backward function closing over its
  non-differentiable arguments) by identity.

Example::

    keys = StructuralKeys()
    keys.jaxpr(scan_a.params["jaxpr"]) == keys.jaxpr(scan_b.params["jaxpr"])

Sharp edges:
  * Identity keys hold while the objects live: compare keys made from jaxprs that
    are alive, within one pass (a ``StructuralKeys`` per call).
  * Two jaxprs that differ only in the order of independent equations get
    different keys (so they are not batched; that is safe).
  * A ``custom_jvp``/``custom_vjp`` function called in two separately traced bodies
    compares different (JAX wraps its rules anew per trace); one step function used
    by two scans is traced once and compares equal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from typing import Any

import numpy as np

from .. import _compat
from .._compat import Atom, JaxprEqn, JaxprLike
from .._memo import IdentityMemo

# Compared by type and value.
_ATOMIC_TYPES = frozenset({int, bool, str, type(None), np.dtype})


class StructuralKey:
    """A nested key whose hash is computed once (a jaxpr's key is as large as the jaxpr)."""

    __slots__ = ("_hash", "_value")

    def __init__(self, value: Hashable):
        self._value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, StructuralKey) and self._hash == other._hash
                                 and self._value == other._value)

    def __repr__(self) -> str:
        return f"StructuralKey({self._hash:#x})"


def const_fingerprint(value: Any) -> Hashable:
    """An array's (or array-like's) dtype, shape and a digest of its bytes; identity for
    what has no bytes (tracers, key arrays)."""
    try:
        array = np.asarray(value)
    except Exception:  # tracers or extended dtypes: compare by identity
        return ("id", id(value))
    if array.dtype == object:
        return ("id", id(value))
    return ("array", array.shape, array.dtype.str,
            hashlib.sha1(np.ascontiguousarray(array).tobytes()).hexdigest())


def literal_key(value: Any) -> Hashable:
    """A literal's (or any constant's) value, compared bit for bit with its type."""
    kind = type(value)
    if kind in _ATOMIC_TYPES:
        return (kind, value)
    if kind is float:
        return (float, value.hex())
    if kind is complex:
        return (complex, value.real.hex(), value.imag.hex())
    if isinstance(value, np.generic):
        return ("scalar", value.dtype.str, value.tobytes())
    return const_fingerprint(value)


class StructuralKeys:
    """Structural keys of jaxprs, equations and parameter values, memoised for one pass."""

    def __init__(self) -> None:
        self._jaxprs: IdentityMemo[JaxprLike, StructuralKey] = IdentityMemo()
        # Parameter dicts and equation contexts by identity: rewritten levels keep their
        # equations' ``params`` and ``ctx`` objects, so the passes of one call compute
        # each key once.
        self._shared: IdentityMemo[object, Hashable] = IdentityMemo()

    def jaxpr(self, jaxpr: JaxprLike) -> StructuralKey:
        """Equal for two jaxprs (open or closed) that compute the same function."""
        found = self._jaxprs.get(jaxpr)
        if found is not None:
            return found
        inner, consts = _compat.open_jaxpr(jaxpr)
        number: dict[Any, int] = {}
        for v in [*inner.constvars, *inner.invars]:
            number[v] = len(number)

        def ref(atom: Atom) -> Hashable:
            if _compat.is_literal(atom):
                return ("lit", atom.aval, literal_key(_compat.literal_value(atom)))
            return number[atom]

        eqn_keys = []
        for eqn in inner.eqns:
            eqn_keys.append((self.equation(eqn), tuple(ref(a) for a in eqn.invars),
                             tuple(v.aval for v in eqn.outvars)))
            for v in eqn.outvars:
                if not _compat.is_drop_var(v):
                    number[v] = len(number)
        key = StructuralKey((
            "jaxpr", type(jaxpr).__name__,
            tuple(v.aval for v in inner.constvars), tuple(self.value(c) for c in consts),
            tuple(v.aval for v in inner.invars), tuple(eqn_keys),
            tuple(ref(v) for v in inner.outvars)))
        self._jaxprs.set(jaxpr, key)
        return key

    def equation(self, eqn: JaxprEqn) -> Hashable:
        """The equation itself: primitive, parameters and context (not its operands)."""
        ctx = eqn.ctx
        context = self._shared.get(ctx)
        if context is None:
            context = self.value(ctx)
            self._shared.set(ctx, context)
        return (eqn.primitive, self.params(eqn.params), context)

    def params(self, params: dict[str, Any]) -> Hashable:
        found = self._shared.get(params)
        if found is None:
            found = tuple((name, self.value(value)) for name, value in sorted(params.items()))
            self._shared.set(params, found)
        return found

    def value(self, value: Any) -> Hashable:
        """A parameter or constant value, compared as the module docstring says."""
        kind = type(value)
        if kind in _ATOMIC_TYPES or kind is float or kind is complex or isinstance(
                value, np.generic):
            return literal_key(value)
        if _compat.is_jaxpr_like(value):
            return self.jaxpr(value)
        if isinstance(value, (tuple, list)):
            return (kind.__name__, tuple(self.value(item) for item in value))
        if isinstance(value, dict):
            return ("dict", tuple((self.value(k), self.value(v)) for k, v in value.items()))
        if isinstance(value, np.ndarray) or _is_array(value):
            return const_fingerprint(value)
        try:
            hash(value)
        except TypeError:
            return ("id", id(value))
        return (kind, value)


def _is_array(value: Any) -> bool:
    import jax

    return isinstance(value, jax.Array) and not _compat.is_tracer(value)
