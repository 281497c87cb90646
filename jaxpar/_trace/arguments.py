"""A call's arguments: which are static (``StaticArgs``, as ``jax.jit``'s
``static_argnums``/``static_argnames``), and their split into a hashable ``Layout`` and
the leaves to trace (``split_arguments``), whose abstract values complete the
``Signature`` the rewrite cache is keyed by.

Arguments are pytrees (positional and keyword). Their leaves split, as
``eqx.filter_jit`` splits them, into traced leaves (arrays, and Python scalars as
``jax.jit`` traces them) and static leaves (other hashable values such as functions or
strings, and the arguments named by ``static_argnums`` / ``static_argnames``), which key
the cache by value. When an argument holds an Equinox module, Python scalars are static
too, as in ``eqx.filter_jit``.

Example::

    layout, leaves = split_arguments(f, (x, 3), {}, StaticArgs.resolve(f, 1, None))
    sig = Signature(layout, tuple(abstract(leaf) for leaf in leaves))

Sharp edges:
  * A Python scalar is traced as ``jax.jit`` traces it (a weakly typed argument),
    also when the function is called under another transformation: folded into
    the trace as a constant it changed how XLA fused the program, and so the
    last bit of results and gradients, inside loop bodies. Under a transformation
    a function that needs the scalar as a Python value (``range(n)``) is traced
    again with its Python scalars static (``parallel_branches`` does this; see
    ``Scalars`` and ``messages.needs_python_values``), where ``jax.jit`` raises.
  * Static leaves must be hashable; unhashable non-array leaves are refused with
    the argument's path. A plain object is keyed by a snapshot of its state
    (``static_keys``). ``static_argnums``/``static_argnames`` values are keyed as
    ``jax.jit`` keys them.
  * Flax NNX objects (graph nodes) reaching ``split_arguments`` are refused (their
    state updates would be lost, see ``NNX_RECIPE``); ``parallel_branches`` and
    ``inspect`` split them first (``_frameworks``).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect as _pyinspect
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from .. import _compat
from .._frameworks import holds_equinox_module, nnx_graph_node_check
from .._spelling import did_you_mean
from .names import argument_path, quoted_name
from .static_keys import StateKeyed, key_static_object, state_kind, warn_static_object


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
        label = quoted_name(fun)
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


ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


class NonHashableStaticArgument(ValueError, TypeError):
    """An unhashable static argument: a ``ValueError``, as ``jax.jit`` raises, and a
    ``TypeError``, as jaxpar raised before."""
PYTHON_SCALARS = (bool, int, float, complex)


NNX_RECIPE = """\
    graphdef, state = nnx.split(model)

    @jaxpar.parallel_branches
    def step(state, x):
        model = nnx.merge(graphdef, state)
        y = model(x)
        return y, nnx.state(model)      # the updated state, returned

    y, state = step(state, x)
    nnx.update(model, state)            # write it back to the module"""


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
        elif isinstance(leaf, ARRAY_TYPES) or _compat.is_tracer(leaf):
            if not isinstance(leaf, jax.Array) and not _compat.is_tracer(leaf):
                _check_traceable(fun, marked, index, leaf, is_graph_node, api)
            traced.append(leaf)
        elif isinstance(leaf, PYTHON_SCALARS) and trace_scalars:
            _check_traceable(fun, marked, index, leaf, is_graph_node, api)
            traced.append(leaf)
        elif not isinstance(leaf, PYTHON_SCALARS) and _compat.jax_value_type(leaf):
            traced.append(leaf)  # a token, a library's extended-dtype array: as jax.jit
        elif isinstance(leaf, jax.ShapeDtypeStruct) and allow_abstract:
            traced.append(leaf)
        elif isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"argument `{argument_path(fun, marked, index, is_graph_node)}` of "
                f"{quoted_name(fun)} is a jax.ShapeDtypeStruct: call the function with arrays; "
                "inspect() also accepts jax.ShapeDtypeStruct.")
        elif is_graph_node is not None and is_graph_node(leaf):
            raise TypeError(
                f"argument `{argument_path(fun, marked, index, is_graph_node)}` of "
                f"{quoted_name(fun)} is a Flax NNX {type(leaf).__name__}: {api} traces a copy "
                "of its state, so state the call updates (BatchNorm statistics, RNG counters, "
                "caches) would be lost silently. Pass its state and return the updated state "
                "instead:\n"
                f"{NNX_RECIPE}")
        else:
            value = leaf.value if isinstance(leaf, StaticArg) else leaf
            keyed = value
            if not isinstance(leaf, StaticArg) and state_kind(type(value)) is not None:
                keyed, seen = key_static_object(value)  # a config object, a plain `self`
                warn_static_object(fun, marked, index, in_tree, value, seen, is_graph_node,
                                    api)
            try:
                hash(keyed)
            except TypeError:
                where = argument_path(fun, marked, index, is_graph_node)
                if isinstance(leaf, StaticArg) and _compat.is_tracer(value):
                    raise TypeError(
                        f"static argument `{where}` of {quoted_name(fun)} is a traced value: a "
                        "transformation around the decorated function (jax.jit, vmap, grad) "
                        "traced it. Make it static there too, e.g. jax.jit(g, "
                        "static_argnums=...) with the same numbers or names, or close over "
                        "it.") from None
                if isinstance(leaf, StaticArg):
                    raise NonHashableStaticArgument(
                        "Non-hashable static arguments are not supported (as in jax.jit): "
                        f"static argument `{where}` of {quoted_name(fun)} is an unhashable "
                        f"{type(value).__name__}: static values key the compilation cache, "
                        "as in jax.jit. Pass a hashable value (a tuple rather than a list, a "
                        "frozen dataclass), or bind it with functools.partial or a closure "
                        "before decorating.") from None
                raise TypeError(
                    f"argument `{where}` of {quoted_name(fun)} is a {type(value).__name__}, "
                    f"neither an array nor hashable: {api} traces array leaves and treats other "
                    "leaves as static values, which key the compilation cache and must be "
                    "hashable. Pass an array, make the value hashable (a tuple, a frozen "
                    "dataclass), or bind it with functools.partial or a closure before "
                    "decorating.") from None
            static.append((index, type(value), keyed))
    return Layout(in_tree, tuple(static), static_scalars), traced


def _check_traceable(fun: Callable[..., Any], marked: Any, index: int, leaf: Any,
                     is_graph_node: Callable[[Any], bool] | None, api: str) -> None:
    """Raises, naming the argument, when JAX cannot trace ``leaf`` as an array."""
    try:
        jax.typeof(leaf)
    except OverflowError as error:
        raise OverflowError(
            f"argument `{argument_path(fun, marked, index, is_graph_node)}` of "
            f"{quoted_name(fun)}: {error}. "
            "Pass an array of a wide enough dtype (with jax_enable_x64 for 64-bit), or make "
            f"the argument static with {api}(..., static_argnums=/static_argnames=)."
        ) from error
    except TypeError as error:
        dtype = getattr(leaf, "dtype", None)
        what = f"an array of dtype {dtype}" if dtype is not None else f"a {type(leaf).__name__}"
        raise TypeError(
            f"argument `{argument_path(fun, marked, index, is_graph_node)}` of "
            f"{quoted_name(fun)} is {what}, "
            f"which JAX cannot trace ({error}). Encode it as numbers (e.g. "
            "np.unique(labels, return_inverse=True)), or bind it with functools.partial or a "
            "closure before decorating.") from error


def abstract(leaf: Any) -> Any:
    """The abstract value of a traced leaf (a tracer, array, scalar or ShapeDtypeStruct)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                    weak_type=getattr(leaf, "weak_type", False))
    # The full abstract value: inside shard_map it records the varying mesh axes,
    # which the trace needs to insert the same casts JAX would.
    return jax.typeof(leaf)


def has_python_scalars(leaves: Sequence[Any]) -> bool:
    array_impl = _compat.ARRAY_IMPL
    return any(type(leaf) is not array_impl and isinstance(leaf, PYTHON_SCALARS)
               for leaf in leaves)
