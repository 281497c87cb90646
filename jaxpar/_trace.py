"""Tracing: a user function and its arguments to a closed jaxpr.

Arguments are pytrees (positional and keyword). Their leaves split, as
``eqx.filter_jit`` splits them, into traced leaves (arrays, and Python scalars
as ``jax.jit`` traces them) and static leaves (other hashable values such as
functions or strings, and the arguments named by ``static_argnums`` /
``static_argnames``), which key the cache by value. When an argument holds an
Equinox module, Python scalars are static too, as in ``eqx.filter_jit``. The
jaxpr is traced from abstract values only, so one trace serves every call with
the same signature. Outputs split the same way: array leaves are the jaxpr's
outputs, other leaves (functions, a returned module's static fields) come back
as they are (``OutputStatics``).

Example::

    layout, leaves = split_arguments(f, (x, 3), {}, StaticArgs.resolve(f, 1, None))
    sig = Signature(layout, tuple(jax.typeof(leaf) for leaf in leaves))
    traced = trace(f, sig)        # traced.jaxpr takes the leaves; 3 is a constant

Sharp edges:
  * A Python scalar is traced as ``jax.jit`` traces it (a weakly typed argument),
    also when the function is called under another transformation: folded into
    the trace as a constant it changed how XLA fused the program, and so the
    last bit of results and gradients, inside loop bodies. Under a transformation
    a function that needs the scalar as a Python value (``range(n)``) is traced
    again with its Python scalars static (``parallel_branches`` does this; see
    ``Scalars`` and ``needs_python_values``), where ``jax.jit`` raises.
  * Static leaves must be hashable; unhashable non-array leaves are refused with
    the argument's path. A plain object (a config, a mutable dataclass, a plain
    class's ``self``) would key the cache by identity, so a changed object returned
    the old result: it is keyed by a snapshot of its state instead (``StateKeyed``,
    ``key_static_object``), by identity only where the state cannot be compared, and
    a ``StaticArgumentWarning`` says which, once per function and argument.
    ``static_argnums``/``static_argnames`` values are keyed as ``jax.jit`` keys them.
  * Flax NNX objects (graph nodes) reaching ``split_arguments`` are refused (their
    state updates would be lost, see ``NNX_RECIPE``); ``parallel_branches`` and
    ``inspect`` split them first (``_frameworks``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect as _pyinspect
import operator
import os
import re
import reprlib
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from . import _compat
from ._compat import ClosedJaxpr
from ._frameworks import holds_equinox_module, nnx_graph_node_check
from ._options import did_you_mean


class TraceError(RuntimeError):
    """Kept for compatibility: jaxpar raises it no more.

    An error raised while tracing the decorated function reaches the caller with its own
    class, as under ``jax.jit`` (a ``ValueError`` of the function, JAX's
    ``ConcretizationTypeError``), with jaxpar's context as a note (``raised_while_tracing``).
    """


class StaticArg:
    """Marks a ``static_argnums``/``static_argnames`` value: one static leaf, never flattened."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


_POSITIONAL = (_pyinspect.Parameter.POSITIONAL_ONLY, _pyinspect.Parameter.POSITIONAL_OR_KEYWORD)
_KEYWORD = (_pyinspect.Parameter.POSITIONAL_OR_KEYWORD, _pyinspect.Parameter.KEYWORD_ONLY)


def _index_tuple(value: Any, name: str) -> tuple[int, ...]:
    try:
        items = (value,) if isinstance(value, int) else tuple(value)
        if any(isinstance(i, bool) for i in items):  # an int to Python, never a position
            raise TypeError
        return tuple(operator.index(i) for i in items)
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of ints (argument positions), "
                        f"got {value!r}") from None


def _str_tuple(value: Any, name: str) -> tuple[str, ...]:
    try:
        items = (value,) if isinstance(value, str) else tuple(value)
    except TypeError:
        items = (value,)
    if not all(isinstance(i, str) for i in items):
        raise TypeError(f"{name} must be a str or a sequence of str, got {value!r}")
    return items


@dataclasses.dataclass(frozen=True, slots=True)
class StaticArgs:
    """Which arguments are static, as ``jax.jit``'s ``static_argnums``/``static_argnames``."""

    nums: tuple[int, ...] = ()
    names: tuple[str, ...] = ()

    @classmethod
    def resolve(cls, fun: Callable[..., Any], static_argnums: int | Iterable[int] | None,
                static_argnames: str | Iterable[str] | None) -> StaticArgs:
        """Validates and completes them as ``jax.jit`` does: given only numbers, the names
        of those positional-or-keyword parameters are static too, and the other way round.

        Raises:
          TypeError: not ints / not strings.
          ValueError: a number or name ``fun`` does not accept.
        """
        if static_argnums is None and static_argnames is None:
            return cls()
        nums = () if static_argnums is None else _index_tuple(static_argnums, "static_argnums")
        names = () if static_argnames is None else _str_tuple(static_argnames,
                                                              "static_argnames")
        try:
            params = list(_pyinspect.signature(fun).parameters.values())
        except (TypeError, ValueError):  # builtins without a signature: no validation
            return cls(nums, names)
        label = _name(fun)
        if not any(p.kind is p.VAR_POSITIONAL for p in params):
            positional = sum(p.kind in _POSITIONAL for p in params)
            bad = [i for i in nums if not -positional <= i < positional]
            if bad:
                raise ValueError(f"static_argnums={nums} for {label}, which takes "
                                 f"{positional} positional argument(s): {bad} out of range. "
                                 "Count from 0 (negative numbers count from the end).")
        # jax.jit refuses the names of positional-only parameters and of ``*args``.
        positional_only = {p.name for p in params
                           if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)}
        if bad_names := sorted(positional_only & set(names)):
            raise ValueError(f"static_argnames={names} for {label}: {bad_names} are "
                             "positional-only (or *args); use static_argnums for them.")
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            valid = [p.name for p in params if p.kind in _KEYWORD]
            if bad_names := sorted(set(names) - set(valid)):
                hints = "".join(did_you_mean(n, valid) for n in bad_names)
                raise ValueError(f"static_argnames={names} for {label}: it takes no argument "
                                 f"named {', '.join(map(repr, bad_names))}{hints}; its "
                                 f"arguments are {', '.join(valid) or 'none'}.")
        if static_argnums is None:
            nums = tuple(i for i, p in enumerate(params)
                         if p.kind is p.POSITIONAL_OR_KEYWORD and p.name in names)
        elif static_argnames is None:
            names = tuple(p.name for i, p in enumerate(params)
                          if p.kind is p.POSITIONAL_OR_KEYWORD and i in nums)
        return cls(nums, names)

    def mark(self, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` with the static ones wrapped in ``StaticArg``."""
        if not (self.nums or self.names):
            return args, kwargs
        nums = {i if i >= 0 else i + len(args) for i in self.nums}
        marked = tuple(StaticArg(a) if i in nums else a for i, a in enumerate(args))
        marked_kwargs = {k: StaticArg(v) if k in self.names else v for k, v in kwargs.items()}
        return marked, marked_kwargs


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """How one call's arguments split into traced leaves and static values (hashable).

    ``in_tree`` is the structure of ``(args, kwargs)`` (a ``static_argnums`` value is
    one leaf); ``statics`` holds ``(leaf index, type, value)`` of every static leaf
    (a ``StateKeyed`` value for an object keyed by its state, see ``key_static_object``).
    The type is part of the key because ``1 == 1.0 == True``. ``static_scalars``: an
    argument holds an Equinox module, so Python scalars are static (in the outputs too).
    """

    in_tree: Any
    statics: tuple[tuple[int, type, Any], ...]
    static_scalars: bool = False

    def rebuild(self, traced: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's ``(args, kwargs)`` from the traced leaves and the static values."""
        static = {index: value.value if isinstance(value, StateKeyed) else value
                  for index, _, value in self.statics}
        values = iter(traced)
        leaves = [static[i] if i in static else next(values)
                  for i in range(self.in_tree.num_leaves)]
        args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, leaves)
        return (tuple(a.value if isinstance(a, StaticArg) else a for a in args),
                {k: v.value if isinstance(v, StaticArg) else v for k, v in kwargs.items()})

    def traced_arguments(self, traced: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` holding only the traced leaves (None where static values are),
        so ``jax.make_jaxpr`` names each leaf after the user's parameter."""
        static = {index for index, _, _ in self.statics}
        values = iter(traced)
        leaves = [None if i in static else next(values) for i in range(self.in_tree.num_leaves)]
        args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, leaves)
        return tuple(args), dict(kwargs)


@dataclasses.dataclass(frozen=True, slots=True)
class Signature:
    """What the rewrite cache is keyed by: structure, static values, shapes and dtypes."""

    layout: Layout
    avals: tuple[Any, ...]

    @property
    def in_tree(self) -> Any:
        return self.layout.in_tree


_ARRAYS = (jax.Array, np.ndarray, np.generic)


class NonHashableStaticArgument(ValueError, TypeError):
    """An unhashable static argument: a ``ValueError``, as ``jax.jit`` raises, and a
    ``TypeError``, as jaxpar raised before."""
_PYTHON_SCALARS = (bool, int, float, complex)


class OutputStatics:
    """A call's output structure and its static (non-array) leaves.

    A pytree node with no children, so it leaves a ``jax.jit`` through the output's
    tree structure, as Equinox's ``Static`` does; ``rebuild`` puts the output together
    from the array leaves.
    """

    __slots__ = ("statics", "tree")

    def __init__(self, tree: Any, statics: tuple[tuple[int, Any], ...]):
        self.tree = tree
        self.statics = statics

    def rebuild(self, dynamic: Sequence[Any]) -> Any:
        if not self.statics:
            return jax.tree_util.tree_unflatten(self.tree, dynamic)
        static = dict(self.statics)
        values = iter(dynamic)
        leaves = [static[i] if i in static else next(values)
                  for i in range(self.tree.num_leaves)]
        return jax.tree_util.tree_unflatten(self.tree, leaves)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OutputStatics) or self.tree != other.tree:
            return False
        if len(self.statics) != len(other.statics):
            return False
        return all(i == j and (a is b or _equal(a, b))
                   for (i, a), (j, b) in zip(self.statics, other.statics, strict=True))

    def __hash__(self) -> int:  # coarse: static values need not be hashable
        return hash(len(self.statics))


def _equal(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # values without a plain boolean equality are equal only to themselves
        return False


jax.tree_util.register_pytree_node(OutputStatics, lambda node: ((), node),
                                   lambda node, _: node)


class _Packed:
    """A call's array outputs with its ``OutputStatics``: a pytree node whose unflattening
    rebuilds the call's output, so a ``jax.jit`` returning it hands back that output."""

    __slots__ = ("dynamic", "outputs")

    def __init__(self, dynamic: Sequence[Any], outputs: OutputStatics):
        self.dynamic = dynamic
        self.outputs = outputs


jax.tree_util.register_pytree_node(_Packed, lambda node: (node.dynamic, node.outputs),
                                   lambda outputs, dynamic: outputs.rebuild(dynamic))


def packed_outputs(dynamic: Sequence[Any], outputs: OutputStatics) -> Any:
    """What a ``jax.jit`` returns to hand back the call's output itself (no rebuilding after
    the call): the output's own tree when every leaf is an array, else a node that
    ``jax.jit``'s unflattening turns into it (``OutputStatics.rebuild``)."""
    if not outputs.statics:
        return jax.tree_util.tree_unflatten(outputs.tree, dynamic)
    return _Packed(list(dynamic), outputs)


def split_outputs(out: Any, static_scalars: bool) -> tuple[list[Any], OutputStatics]:
    """The array leaves of ``out`` and the rest, as ``eqx.filter_jit`` partitions its
    output: leaves that are not arrays (functions, strings, a module's static fields)
    are static; Python scalars too when ``static_scalars`` or ``out`` holds an Equinox
    module, else they become arrays as under ``jax.jit``."""
    leaves, tree = jax.tree_util.tree_flatten(out)
    static_scalars = static_scalars or holds_equinox_module(out)
    dynamic: list[Any] = []
    static: list[tuple[int, Any]] = []
    for index, leaf in enumerate(leaves):
        if (isinstance(leaf, _ARRAYS) or _compat.is_tracer(leaf) or hasattr(leaf, "__jax_array__")
                or (isinstance(leaf, _PYTHON_SCALARS) and not static_scalars)):
            dynamic.append(leaf)
        else:
            static.append((index, leaf))
    return dynamic, OutputStatics(tree, tuple(static))


@dataclasses.dataclass(frozen=True)
class Traced:
    jaxpr: ClosedJaxpr  # ClosedJaxpr (jax <= 0.10) or Jaxpr with consts (0.11+)
    outputs: OutputStatics  # the output structure and static leaves; the jaxpr gives the rest
    consts_are_tracers: bool


NNX_RECIPE = """\
    graphdef, state = nnx.split(model)

    @jaxpar.parallel_branches
    def step(state, x):
        model = nnx.merge(graphdef, state)
        y = model(x)
        return y, nnx.state(model)      # the updated state, returned

    y, state = step(state, x)
    nnx.update(model, state)            # write it back to the module"""


def _describe_path(fun: Callable[..., Any], path: tuple[Any, ...]) -> str:
    """Turns a key path into the user's words: `x['a'][0]` rather than `[0][0]['a'][0]`."""
    head, rest = path[0], path[1:]
    top = getattr(head, "idx", None)
    name = None
    if top is not None and len(rest) >= 1:  # (args, kwargs)[0] -> positional
        if top == 0:
            position = getattr(rest[0], "idx", None)
            try:
                params = list(_pyinspect.signature(fun).parameters.values())
                if position is not None and position < len(params) and params[position].kind in (
                        params[position].POSITIONAL_ONLY, params[position].POSITIONAL_OR_KEYWORD):
                    name = params[position].name
            except (TypeError, ValueError):
                pass
            name = name or f"args[{position}]"
            rest = rest[1:]
        else:
            key = getattr(rest[0], "key", None)
            name = str(key)
            rest = rest[1:]
    return (name or "argument") + jax.tree_util.keystr(tuple(rest))



class Scalars(enum.Enum):
    """What ``split_arguments`` does with Python scalar leaves (``bool``, ``int``, ...)."""

    TRACED = "traced"  # as jax.jit traces them: weakly typed arguments
    STATIC = "static"  # Python values, as static leaves
    STATIC_UNDER_TRACE = "static under a trace"  # traced unless another leaf is a tracer


def split_arguments(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                    statics: StaticArgs = StaticArgs(), *, allow_abstract: bool = False,
                    api: str = "parallel_branches", scalars: Scalars = Scalars.TRACED
                    ) -> tuple[Layout, list[Any]]:
    """Splits a call's arguments into a hashable ``Layout`` and the leaves to trace.

    Raises:
      TypeError: an NNX module, an unhashable non-array leaf or static argument, an
        abstract value where arrays are needed, or an array JAX cannot trace (each
        naming the argument).
      OverflowError: a Python int too large for JAX's integer type (naming it).
    """
    marked = statics.mark(args, kwargs)
    is_graph_node = nnx_graph_node_check()
    leaves, in_tree = jax.tree_util.tree_flatten(marked, is_leaf=is_graph_node)
    # eqx.filter_jit's rule: with an Equinox module among the arguments, every leaf that
    # is not an array is static, Python scalars included (hidden_size: int, Dropout.p).
    static_scalars = holds_equinox_module(marked)
    trace_scalars = not static_scalars and (scalars is Scalars.TRACED or (
        scalars is Scalars.STATIC_UNDER_TRACE
        and not any(_compat.is_tracer(leaf) for leaf in leaves)))
    traced: list[Any] = []
    static: list[tuple[int, type, Any]] = []
    array_impl = _compat.ARRAY_IMPL
    for index, leaf in enumerate(leaves):
        if type(leaf) is array_impl:  # most leaves of most calls
            traced.append(leaf)
        elif isinstance(leaf, _ARRAYS) or _compat.is_tracer(leaf):
            if not isinstance(leaf, jax.Array) and not _compat.is_tracer(leaf):
                _check_traceable(fun, marked, index, leaf, is_graph_node, api)
            traced.append(leaf)
        elif isinstance(leaf, _PYTHON_SCALARS) and trace_scalars:
            _check_traceable(fun, marked, index, leaf, is_graph_node, api)
            traced.append(leaf)
        elif not isinstance(leaf, _PYTHON_SCALARS) and _compat.jax_value_type(leaf):
            traced.append(leaf)  # a token, a library's extended-dtype array: as jax.jit
        elif isinstance(leaf, jax.ShapeDtypeStruct) and allow_abstract:
            traced.append(leaf)
        elif isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"argument `{_where(fun, marked, index, is_graph_node)}` of {_name(fun)} is a "
                "jax.ShapeDtypeStruct: call the function with arrays; inspect() also accepts "
                "jax.ShapeDtypeStruct.")
        elif is_graph_node is not None and is_graph_node(leaf):
            raise TypeError(
                f"argument `{_where(fun, marked, index, is_graph_node)}` of {_name(fun)} is a "
                f"Flax NNX {type(leaf).__name__}: {api} traces a copy of its state, so state "
                "the call updates (BatchNorm statistics, RNG counters, caches) would be lost "
                "silently. Pass its state and return the updated state instead:\n"
                f"{NNX_RECIPE}")
        else:
            value = leaf.value if isinstance(leaf, StaticArg) else leaf
            keyed = value
            if not isinstance(leaf, StaticArg) and state_kind(type(value)) is not None:
                keyed, seen = key_static_object(value)  # a config object, a plain `self`
                _warn_static_object(fun, marked, index, in_tree, value, seen, is_graph_node,
                                    api)
            try:
                hash(keyed)
            except TypeError:
                where = _where(fun, marked, index, is_graph_node)
                if isinstance(leaf, StaticArg) and _compat.is_tracer(value):
                    raise TypeError(
                        f"static argument `{where}` of {_name(fun)} is a traced value: a "
                        "transformation around the decorated function (jax.jit, vmap, grad) "
                        "traced it. Make it static there too, e.g. jax.jit(g, "
                        "static_argnums=...) with the same numbers or names, or close over "
                        "it.") from None
                if isinstance(leaf, StaticArg):
                    raise NonHashableStaticArgument(
                        "Non-hashable static arguments are not supported (as in jax.jit): "
                        f"static argument `{where}` of {_name(fun)} is an unhashable "
                        f"{type(value).__name__}: static values key the compilation cache, "
                        "as in jax.jit. Pass a hashable value (a tuple rather than a list, a "
                        "frozen dataclass), or bind it with functools.partial or a closure "
                        "before decorating.") from None
                raise TypeError(
                    f"argument `{where}` of {_name(fun)} is a {type(value).__name__}, neither "
                    f"an array nor hashable: {api} traces array leaves and treats other leaves "
                    "as static values, which key the compilation cache and must be hashable. "
                    "Pass an array, make the value hashable (a tuple, a frozen dataclass), or "
                    "bind it with functools.partial or a closure before decorating.") from None
            static.append((index, type(value), keyed))
    return Layout(in_tree, tuple(static), static_scalars), traced


def _where(fun: Callable[..., Any], marked: Any, index: int,
           is_graph_node: Callable[[Any], bool] | None) -> str:
    paths, _ = jax.tree_util.tree_flatten_with_path(marked, is_leaf=is_graph_node)
    return _describe_path(fun, paths[index][0])


def _check_traceable(fun: Callable[..., Any], marked: Any, index: int, leaf: Any,
                     is_graph_node: Callable[[Any], bool] | None, api: str) -> None:
    """Raises, naming the argument, when JAX cannot trace ``leaf`` as an array."""
    try:
        jax.typeof(leaf)
    except OverflowError as error:
        raise OverflowError(
            f"argument `{_where(fun, marked, index, is_graph_node)}` of {_name(fun)}: {error}. "
            "Pass an array of a wide enough dtype (with jax_enable_x64 for 64-bit), or make "
            f"the argument static with {api}(..., static_argnums=/static_argnames=)."
        ) from error
    except TypeError as error:
        dtype = getattr(leaf, "dtype", None)
        what = f"an array of dtype {dtype}" if dtype is not None else f"a {type(leaf).__name__}"
        raise TypeError(
            f"argument `{_where(fun, marked, index, is_graph_node)}` of {_name(fun)} is {what}, "
            f"which JAX cannot trace ({error}). Encode it as numbers (e.g. "
            "np.unique(labels, return_inverse=True)), or bind it with functools.partial or a "
            "closure before decorating.") from error


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
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warned_arguments(fun: Callable[..., Any]) -> set[Any]:
    owner = getattr(fun, "__wrapped__", fun)  # the user's function, not NnxCall's wrapper
    try:
        return _warned_static.setdefault(owner, set())
    except TypeError:
        return _warned_static_by_name.setdefault(function_name(owner), set())


def _warn_static_object(fun: Callable[..., Any], marked: Any, index: int, in_tree: Any,
                        value: Any, seen: bool,
                        is_graph_node: Callable[[Any], bool] | None, api: str) -> None:
    """Warns (``StaticArgumentWarning``), once per function and argument, that an object
    argument is static, how it is keyed, and what to pass instead."""
    warned = _warned_arguments(fun)
    if (in_tree, index, seen) in warned:
        return
    path = _where(fun, marked, index, is_graph_node)
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
        f"jaxpar: argument `{path}` of {_name(fun)} is an object of type "
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


def abstract(leaf: Any) -> Any:
    """The abstract value of a traced leaf (a tracer, array, scalar or ShapeDtypeStruct)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                    weak_type=getattr(leaf, "weak_type", False))
    # The full abstract value: inside shard_map it records the varying mesh axes,
    # which the trace needs to insert the same casts JAX would.
    return jax.typeof(leaf)


def function_name(fun: Any) -> str:
    """``fun``'s name for labels and messages. Never calls ``repr``, which may raise:
    ``jax.jit`` accepts a callable whose ``__repr__`` fails, and so must jaxpar."""
    name = getattr(fun, "__qualname__", None) or getattr(fun, "__name__", None)
    return name if isinstance(name, str) else f"<{type(fun).__name__} object>"


def _name(fun: Callable[..., Any]) -> str:
    return f"`{function_name(fun)}`"


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60


def short_repr(value: Any) -> str:
    """A bounded ``repr`` for messages; a ``__repr__`` that raises gives a placeholder."""
    try:
        return _SHORT.repr(value)
    except Exception:  # reprlib guards instances, not every container element
        return f"<{type(value).__name__} object>"


def check_function(fun: Any, api: str) -> None:
    """Refuses at decoration time what ``jax.jit`` refuses, with its exception type
    (TypeError) and its words, then what to do.

    ``jax.jit`` (0.10.2 - 0.12) refuses a ``staticmethod`` object ("staticmethod arguments
    are not supported"), anything not callable, a ``classmethod`` object included
    ("Expected a callable value"), and a generator function ("Expected a function, got a
    generator function"; calling it runs nothing: it returns a generator).
    """
    def refuse(jax_words: str, advice: str) -> TypeError:
        return TypeError(f"{api} refuses what jax.jit refuses; jax.jit says: {jax_words}. "
                         f"{advice}")

    if isinstance(fun, (staticmethod, classmethod)):
        kind = type(fun).__name__
        jax_words = ("staticmethod arguments are not supported" if kind == "staticmethod"
                     else "Expected a callable value")
        raise refuse(f"{jax_words}, got {short_repr(fun)}",
                     f"Pass the function itself, and on a method apply @{kind} outermost "
                     f"(above @{api}).")
    if not callable(fun):
        call = "on_stream(stream)(fun)" if api == "on_stream" else f"{api}(fun, ...)"
        raise refuse(f"Expected a callable value, got {short_repr(fun)}",
                     f"A value of type {type(fun).__name__} is not callable: decorate a "
                     f"function, or call {call}.")
    if _pyinspect.isgeneratorfunction(fun):
        raise refuse(f"Expected a function, got a generator function: {_name(fun)}",
                     "Calling it only creates a generator, so there is nothing to trace; "
                     "return the values instead of yielding them.")


def _leaf_paths(fun: Callable[..., Any], layout: Layout) -> list[str] | None:
    """Per leaf of ``layout``, its path in the user's words (``b``, ``params['w']``);
    None where the argument containers cannot be rebuilt."""
    try:
        tree = jax.tree_util.tree_unflatten(layout.in_tree, range(layout.in_tree.num_leaves))
        paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    except Exception:  # a pytree whose unflattening checks its leaves
        return None
    if len(paths) != layout.in_tree.num_leaves:
        return None
    return [_describe_path(fun, path) for path, _ in paths]


def _describe_static(value: Any) -> str:
    return f"static {type(value).__name__} {short_repr(value)}"


def describe_arguments(fun: Callable[..., Any], sig: Signature, limit: int | None = None
                       ) -> str:
    """Every argument leaf of one call: ``a: float32[4, 8], b: static str 'abc'``
    (the first ``limit`` of them, then how many more).

    Traced leaves show their type; static leaves (strings, functions, ``static_argnums``)
    their type and a short ``repr``, so an error raised by a static value inside the
    function does not read as if the argument had vanished.
    """
    layout = sig.layout
    static = {index: value for index, _, value in layout.statics}
    paths = _leaf_paths(fun, layout)
    avals = iter(sig.avals)
    parts = []
    for index in range(layout.in_tree.num_leaves):
        if index in static:
            value = static[index]
            text = _describe_static(value.value if isinstance(value, (StaticArg, StateKeyed))
                                    else value)
        else:
            aval = next(avals)
            text = f"{aval.dtype}{list(aval.shape)}"
        parts.append(text if paths is None else f"{paths[index]}: {text}")
    more = len(parts) - limit if limit is not None else 0
    return ", ".join(parts[:limit]) + (f", ... ({more} more)" if more > 0 else "")


def _static_leaves_hint(fun: Callable[..., Any], sig: Signature) -> str:
    """Names the string leaves: a string where an array belongs reaches the function as
    a Python value (a static leaf), so the error comes from inside it."""
    strings = [(index, value) for index, _, value in sig.layout.statics
               if isinstance(value, (str, bytes))]
    if not strings:
        return ""
    paths = _leaf_paths(fun, sig.layout)
    named = "; ".join(
        f"`{paths[index] if paths is not None else f'leaf {index}'}` is a "
        f"{_describe_static(value)}" for index, value in strings)
    return (f"\nNote: argument {named}. parallel_branches passes argument leaves that are "
            "not arrays to the function as Python values (static, as eqx.filter_jit does; "
            "jax.jit refuses them). If an array was meant, pass one (jnp.asarray(...)).")


def _name_string_leaves(fun: Callable[..., Any], sig: Signature, error: BaseException) -> None:
    """Names a string leaf in ``error``'s own message, as ``jax.jit`` names an argument it
    cannot take ("... passed to the function at path w"): a ``TypeError`` raised where a
    string met an array operation reads, in ``str(error)``, as if the argument had vanished
    (the note, shown under it in a traceback, says the rest). Only a ``TypeError`` or
    ``AttributeError`` (what a string meeting an array operation raises) whose message is
    its one argument."""
    strings = [(index, value) for index, _, value in sig.layout.statics
               if isinstance(value, (str, bytes))]
    if not (strings and isinstance(error, (TypeError, AttributeError))
            and len(error.args) == 1 and str(error) == error.args[0]):
        return
    paths = _leaf_paths(fun, sig.layout)
    named = ", ".join(f"at path {paths[index] if paths is not None else f'leaf {index}'} "
                      f"({_describe_static(value)})" for index, value in strings)
    error.args = (f"{error.args[0]} (jaxpar: tracing {_name(fun)} with a string argument "
                  f"{named}, passed to it as a static Python value; if an array was meant, "
                  "pass one)",)


# Errors that come from turning a traced array into a Python value: only these get the
# advice about static arguments.
_CONVERSION_ERRORS: tuple[type[BaseException], ...] = tuple(
    cls for cls in (getattr(jax.errors, name, None) for name in (
        "ConcretizationTypeError", "TracerBoolConversionError", "TracerIntegerConversionError",
        "TracerArrayConversionError", "NonConcreteBooleanIndexError"))
    if isinstance(cls, type))


_ARGUMENT_IN_ERROR = re.compile(r"depends on the values? of the arguments? (.+?)\.?$", re.MULTILINE)
_SHOWN_ARGUMENTS = 8


def trace_error_note(fun: Callable[..., Any], sig: Signature, error: BaseException) -> str:
    """jaxpar's context for an error raised tracing ``fun``, added to it as a note: the
    function and the argument JAX blames first, advice, then the arguments, shortened."""
    blamed = _ARGUMENT_IN_ERROR.search(str(error))
    where = f" (argument {blamed.group(1)})" if blamed else ""
    hint = ""
    if isinstance(error, _CONVERSION_ERRORS):
        hint = ("\nparallel_branches traces the function with abstract values, like "
                "jax.jit: it must not convert traced arrays to Python values. Use jnp/lax "
                "operations, mark the argument static (parallel_branches(f, "
                "static_argnums=..., static_argnames=...)), or bind it with "
                "functools.partial before decorating.")
        if sig.layout.static_scalars:
            hint += (" In an Equinox module, Python values (int, float, bool, functions) "
                     "are static as in eqx.filter_jit; a field holding an array is traced: "
                     "hold a Python value there, or declare it eqx.field(static=True).")
    return (f"{_NOTE_START}{_name(fun)}{where}: the {type(error).__name__} above "
            f"was raised while tracing it.{hint}{_static_leaves_hint(fun, sig)}"
            f"\nTraced with {sig.layout.in_tree.num_leaves} argument(s): "
            f"{describe_arguments(fun, sig, _SHOWN_ARGUMENTS)}.")


_NOTE_START = "jaxpar could not trace "


def raised_while_tracing(error: BaseException) -> bool:
    """Whether ``error`` was raised tracing a function (``trace`` gave it a note)."""
    return any(isinstance(note, str) and note.startswith(_NOTE_START)
               for note in getattr(error, "__notes__", ()))


def error_text(error: BaseException) -> str:
    """An error's message and its notes (jaxpar's context), as a traceback shows them."""
    return "\n".join([str(error), *getattr(error, "__notes__", ())])


def needs_python_values(error: BaseException) -> bool:
    """Whether tracing failed converting a traced value to a Python value (``range(n)``
    of a traced ``n``), so the same call with Python scalars static might trace."""
    return isinstance(error, _CONVERSION_ERRORS)


def has_python_scalars(leaves: Sequence[Any]) -> bool:
    array_impl = _compat.ARRAY_IMPL
    return any(type(leaf) is not array_impl and isinstance(leaf, _PYTHON_SCALARS)
               for leaf in leaves)


_tracing = threading.local()


def tracing_for_a_plan() -> bool:
    """Whether jaxpar is tracing a function to plan it (on this thread): a decorated
    function called inside is part of that function's program."""
    return getattr(_tracing, "depth", 0) > 0


def trace(fun: Callable[..., Any], sig: Signature) -> Traced:
    """Traces ``fun`` at ``sig`` to a closed jaxpr over the traced leaves."""
    out_tree_box: list[OutputStatics] = []
    layout = sig.layout

    # jax names traced arguments after the wrapped function's parameters (``n``,
    # ``params['w']``), so its errors name the user's argument, not ``flat_args[2]``.
    @functools.wraps(fun)
    def call(*args: Any, **kwargs: Any) -> list[Any]:
        full_args, full_kwargs = layout.rebuild(jax.tree_util.tree_leaves((args, kwargs)))
        flat_out, outputs = split_outputs(fun(*full_args, **full_kwargs), layout.static_scalars)
        out_tree_box.append(outputs)
        return flat_out

    args, kwargs = layout.traced_arguments(sig.avals)
    _tracing.depth = getattr(_tracing, "depth", 0) + 1
    try:
        jaxpr = jax.make_jaxpr(call)(*args, **kwargs)
    except Exception as error:
        # The error keeps its class (a user's ValueError, JAX's ConcretizationTypeError),
        # as under jax.jit; jaxpar's context travels as a note.
        note = trace_error_note(fun, sig, error)
        if note not in getattr(error, "__notes__", ()):  # one exception object raised again
            error.add_note(note)
            _name_string_leaves(fun, sig, error)
        raise
    finally:
        _tracing.depth -= 1
    _, consts = _compat.open_jaxpr(jaxpr)
    return Traced(jaxpr, out_tree_box[-1], any(_compat.is_tracer(c) for c in consts))
