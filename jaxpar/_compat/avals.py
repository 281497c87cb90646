"""Abstract values: dtypes (extended ones included), bytes and element counts, weak
types and PRNG key implementations."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax._src import core as _core
from jax._src.lax import lax as _lax_internal


def prng_impl_name(aval: Any) -> str | None:
    """The PRNG implementation (``"threefry2x32"``, ``"rbg"``, ``"unsafe_rbg"``) of a key
    array's type; None for other types. Key dtypes keep it as ``dtype._impl`` (0.4.16 -
    0.12); ``jax.random.key_impl`` only answers for arrays, not types."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None or not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    impl = getattr(dtype, "_impl", None)
    return str(getattr(impl, "name", impl))


def with_weak_type(value: Any, aval: Any) -> Any:
    """``value`` with ``aval``'s weak type when only that differs (the same numbers).

    JAX has no public cast that makes a value weakly typed (``lax.convert_element_type``
    always makes it strong); ``lax._convert_element_type`` is what ``jnp`` uses
    (0.4 - 0.12).
    """
    weak = getattr(aval, "weak_type", None)
    if weak is None:  # tokens, refs: no weak type
        return value
    current = jax.typeof(value)
    if (getattr(current, "weak_type", weak) == weak
            or getattr(current, "dtype", None) != aval.dtype):
        return value
    return _lax_internal._convert_element_type(value, aval.dtype, weak_type=weak)


def jax_value_type(value: Any) -> bool:
    """Whether ``jax.jit`` traces ``value`` though it is no array: a token, or an array
    type a library registers for its extended dtype (``core.pytype_aval_mappings``, 0.4 -
    0.12). The table also holds types ``jax.jit`` refuses or jaxpar handles elsewhere
    (``str``, scalars, ``ShapeDtypeStruct``, refs), so only those two kinds of value
    count."""
    to_aval = _core.pytype_aval_mappings.get(type(value))
    if to_aval is None or isinstance(value, (str, type, jax.ShapeDtypeStruct)):
        return False
    try:
        aval = to_aval(value)
    except Exception:  # a type JAX maps only to refuse it
        return False
    return (isinstance(aval, _core.AbstractToken)
            or is_extended_dtype(getattr(aval, "dtype", None)))


def is_extended_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is one of JAX's extended dtypes (PRNG keys), which NumPy cannot
    interpret: ``np.dtype``, ``np.issubdtype`` and ``np.zeros`` raise on them.

    ``float0`` (the tangent type of integers and keys) is a NumPy structured dtype, so it
    is not extended; it has no elements worth a byte (``itemsize`` 0).
    """
    return dtype is not None and bool(jax.dtypes.issubdtype(dtype, jax.dtypes.extended))


def itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype``, extended dtypes included (a threefry key: 8)."""
    try:
        return _ITEMSIZES[dtype]
    except (KeyError, TypeError):  # a new dtype, or an unhashable one
        pass
    if is_extended_dtype(dtype):
        size = _extended_itemsize(dtype)
    else:
        size = int(np.dtype(dtype).itemsize)
    try:
        _ITEMSIZES[dtype] = size
    except TypeError:
        pass
    return size


def _extended_itemsize(dtype: Any) -> int:
    """Bytes per element of an extended dtype: its ``itemsize`` where it has one (PRNG
    key types, 0.10.2 - 0.12), else its physical element's (``ExtendedDType`` requires
    only ``type`` and ``_rules``; ``_rules.physical_element_aval`` gives the physical
    representation), else 0 (priced as free, as an unknown type is)."""
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    try:
        physical = dtype._rules.physical_element_aval(dtype)
        if is_extended_dtype(physical.dtype):  # no recursion through a strange rule
            return 0
        return math.prod(physical.shape) * itemsize(physical.dtype)
    except Exception:  # a rule that cannot answer for the type alone
        return 0


# dtype -> bytes per element: the cost model asks for every operand and result of every
# equation, and the extended-dtype test alone costs more than the rest of ``aval_nbytes``.
_ITEMSIZES: dict[Any, int] = {}


def aval_nbytes(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return math.prod(shape) * itemsize(dtype)


def aval_size(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    return math.prod(shape) if shape is not None else 0
