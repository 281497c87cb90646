"""Static objects as cache keys. A plain object reaching the function as a static leaf (a
config, a mutable dataclass, a plain class's ``self``) would key the cache by identity,
so a changed object returned the old result: it is keyed by a snapshot of its state
instead (``StateKeyed``, ``key_static_object``), by identity only where the state cannot
be compared, and a ``StaticArgumentWarning`` says which, once per function and argument.

Example::

    key, seen = key_static_object(config)   # a StateKeyed, True: a change is seen
    state_kind(type(config))                # "attributes"

Sharp edges:
  * A snapshot visits at most ``_MAX_STATE_VALUES`` values, ``_MAX_STATE_DEPTH`` deep,
    and every call pays for it; beyond that the object is keyed by identity.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .. import _compat
from .names import argument_path, function_name, quoted_name


class StaticArgumentWarning(UserWarning):
    """An argument leaf that is neither an array nor a value with its own equality (a
    config object, the ``self`` of a plain class) reached the function as a static value:
    its numbers are constants of the compiled program. Warned once per function and
    argument; the message says whether a later change to the object is seen."""


class StateKeyed:
    """A static object keyed by a snapshot of its state (``key_static_object``): equal to
    another with an equal snapshot, so equal configs share a trace and a changed one
    traces again. ``value`` is the object itself, which the function receives."""

    __slots__ = ("hash", "state", "value")

    def __init__(self, value: Any, state: Any):
        self.value = value
        self.state = state
        self.hash = hash(state)  # every jit call hashes its key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StateKeyed) and self.state == other.state

    def __hash__(self) -> int:
        return self.hash

    def __repr__(self) -> str:  # no address: the repr keys tuning decisions on disk
        return f"{type(self.value).__qualname__}{self.state[1]!r}"


class _SameArray:
    """A JAX array in a static object's state: immutable, so the same array is the same
    value. Holds it, so its ``id`` is not reused while a key holds it."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SameArray) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)

    def __repr__(self) -> str:
        return f"{getattr(self.value, 'dtype', '?')}{list(getattr(self.value, 'shape', ()))}"


class _NoStateKey(Exception):
    """The object's state cannot be compared by value (an unhashable value, a cycle, too
    large): it is keyed by identity."""


# Types whose instances are keyed as themselves although their hash is the object's
# identity: functions and other callables (as jax.jit keys a static function), classes,
# modules and sentinels.
_KEYED_AS_THEMSELVES = (types.ModuleType, type(None), type(...), type(NotImplemented))
# How a type's instances are keyed as static leaves (``state_kind``), found once per type.
_STATE_KINDS: dict[type, str | None] = {}
_UNKNOWN = "unknown"
# A snapshot visits at most this many values, this deep: a call pays for it each time.
_MAX_STATE_VALUES = 256
_MAX_STATE_DEPTH = 8
_MAX_STATE_ARRAY_SIZE = 1024  # numpy arrays in a snapshot are copied as bytes
_PLAIN_STATE_TYPES = frozenset({bool, int, str, bytes, complex, type(None)})


def state_kind(cls: type) -> str | None:
    """How a static leaf of type ``cls`` is keyed: None, as itself by its own ``__eq__``
    and ``__hash__`` (strings, numbers, functions and other callables, enum members,
    frozen dataclasses); ``"fields"`` (a dataclass) or ``"attributes"`` (an object with
    a ``__dict__`` and identity hashing) by a snapshot of its state; ``"opaque"`` (no
    ``__dict__``) by identity."""
    kind = _STATE_KINDS.get(cls, _UNKNOWN)
    if kind is _UNKNOWN:
        kind = _STATE_KINDS[cls] = _classify_static_type(cls)
    return kind


def _classify_static_type(cls: type) -> str | None:
    hashing = getattr(cls, "__hash__", None)
    if dataclasses.is_dataclass(cls):  # a frozen one hashes its fields; others compare them
        return "fields" if hashing is None or hashing is object.__hash__ else None
    callable_instances = any("__call__" in vars(klass) for klass in cls.__mro__)
    if hashing is not object.__hash__ or callable_instances or cls is object \
            or issubclass(cls, _KEYED_AS_THEMSELVES):
        return None
    if not getattr(cls, "__dictoffset__", 0) or any(
            {slots} if isinstance(slots := vars(klass).get("__slots__", ()), str)
            else set(slots) - {"__dict__", "__weakref__"} for klass in cls.__mro__):
        return "opaque"  # slots would be missed by a snapshot of __dict__
    return "attributes"


def key_static_object(value: Any) -> tuple[Any, bool]:
    """``(key, seen)``: ``value`` keyed by a snapshot of its state (a ``StateKeyed``,
    ``seen``: a change to it makes a new key), or by itself where the state cannot be
    compared (``seen`` False: identity, so a change is not seen)."""
    try:
        return StateKeyed(value, _state_of(value, [_MAX_STATE_VALUES], 0)), True
    except Exception:  # _NoStateKey; or a property, __hash__ or field that raises
        return value, False


def _state_of(value: Any, budget: list[int], depth: int) -> Any:
    """A hashable snapshot of ``value``, equal for equal states (``key_static_object``).

    Raises:
      _NoStateKey: where there is none.
    """
    cls = type(value)
    if cls in _PLAIN_STATE_TYPES:  # the type, because 1 == 1.0 == True
        return (cls, value)
    if cls is float:  # the hex form tells -0.0 from 0.0, and a nan equals itself
        return (float, value.hex())
    # Containers pay for their items up front, scalars being free above.
    budget[0] -= len(value) if isinstance(value, (list, tuple, dict, set, frozenset)) else 1
    if budget[0] < 0 or depth > _MAX_STATE_DEPTH:
        raise _NoStateKey
    if isinstance(value, (list, tuple)):
        return (cls, tuple([_state_of(item, budget, depth + 1) for item in value]))
    if isinstance(value, dict):
        return (cls, frozenset([(key, _state_of(item, budget, depth + 1))
                                for key, item in value.items()]))
    if isinstance(value, (set, frozenset)):
        return (cls, frozenset(value))
    if isinstance(value, jax.Array):
        if _compat.is_tracer(value):  # another trace's value: never part of a key
            raise _NoStateKey
        return _SameArray(value)
    if isinstance(value, np.ndarray):
        if value.size > _MAX_STATE_ARRAY_SIZE or value.dtype.hasobject:
            raise _NoStateKey
        return (np.ndarray, str(value.dtype), value.shape, value.tobytes())
    kind = state_kind(cls)
    if kind == "fields":
        return (cls, tuple([(field.name, _state_of(getattr(value, field.name), budget, depth + 1))
                            for field in dataclasses.fields(value)]))
    if kind == "attributes":
        return (cls, tuple([(name, _state_of(item, budget, depth + 1))
                            for name, item in vars(value).items()]))
    if kind == "opaque":
        raise _NoStateKey
    try:
        hash(value)
    except TypeError:
        raise _NoStateKey from None
    return value


# Per function, the arguments whose static object was warned about: (structure, leaf
# index, seen), which skips finding the path, and (path, seen).
_warned_static: weakref.WeakKeyDictionary[Any, set[Any]] = weakref.WeakKeyDictionary()
_warned_static_by_name: dict[str, set[Any]] = {}  # functions without weak references
# jaxpar's own directory (this module's parent package's parent): frames in it are not
# the user's.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _warned_arguments(fun: Callable[..., Any]) -> set[Any]:
    owner = getattr(fun, "__wrapped__", fun)  # the user's function, not NnxCall's wrapper
    try:
        return _warned_static.setdefault(owner, set())
    except TypeError:
        return _warned_static_by_name.setdefault(function_name(owner), set())


def warn_static_object(fun: Callable[..., Any], marked: Any, index: int, in_tree: Any,
                        value: Any, seen: bool,
                        is_graph_node: Callable[[Any], bool] | None, api: str) -> None:
    """Warns (``StaticArgumentWarning``), once per function and argument, that an object
    argument is static, how it is keyed, and what to pass instead."""
    warned = _warned_arguments(fun)
    if (in_tree, index, seen) in warned:
        return
    path = argument_path(fun, marked, index, is_graph_node)
    warned.add((in_tree, index, seen))
    if (path, seen) in warned:
        return
    warned.add((path, seen))
    if seen:
        keyed = (f"it is keyed by a snapshot of its {state_kind(type(value))}, so a "
                 "change to them is seen (the next call traces and compiles again)")
    else:
        keyed = ("it cannot be compared by value (it has no __dict__, or holds a value "
                 "jaxpar cannot compare: a traced value, a large NumPy array, a cycle), so it "
                 "is keyed by identity: a change to it after a call is NOT seen, later calls "
                 "reuse the program traced with its old state")
    top = path.split("[", 1)[0]
    fix = (f"static_argnums=({path[5:].split(']', 1)[0]},)" if top == "args"
           else f"static_argnames=({top!r},)")
    warnings.warn(
        f"jaxpar: argument `{path}` of {quoted_name(fun)} is an object of type "
        f"{type(value).__qualname__}, neither an array nor a pytree, so {api} passes it to "
        "the function as a static value (as eqx.filter_jit does; jax.jit refuses it): the "
        "numbers it holds are constants of the compiled program, and each new value traces "
        f"and compiles anew. {keyed[0].upper()}{keyed[1:]}. To trace its numbers, pass them "
        "as arrays (in a dict, a NamedTuple or a dataclass registered as a pytree); to make "
        f"it static as jax.jit does, name it in {fix} (then keyed by its __hash__). Warned "
        "once per function and argument.",
        StaticArgumentWarning, stacklevel=_stacklevel_outside_jaxpar())


def _stacklevel_outside_jaxpar() -> int:
    """The ``stacklevel`` for ``warnings.warn`` in the caller that names the first frame
    outside jaxpar: the user's call."""
    frame = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
