"""A call's outputs, split as ``eqx.filter_jit`` partitions its output: array leaves are
the jaxpr's outputs, other leaves (functions, a returned module's static fields) come
back as they are (``OutputStatics``).

Example::

    dynamic, statics = split_outputs(fun(*args), static_scalars=False)
    statics.rebuild(dynamic)                 # the output again
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from .. import _compat
from .._frameworks import holds_equinox_module
from .arguments import ARRAY_TYPES, PYTHON_SCALARS


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
        if (isinstance(leaf, ARRAY_TYPES) or _compat.is_tracer(leaf)
                or hasattr(leaf, "__jax_array__")
                or (isinstance(leaf, PYTHON_SCALARS) and not static_scalars)):
            dynamic.append(leaf)
        else:
            static.append((index, leaf))
    return dynamic, OutputStatics(tree, tuple(static))
