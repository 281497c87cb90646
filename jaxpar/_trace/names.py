"""How jaxpar's messages name things: a function, a value (a bounded ``repr``) and an
argument leaf (its path in the user's words: ``params['w']``, not ``[0][0]['w']``).

Example::

    function_name(f)                             # "Model.__call__"
    argument_path(f, marked, 2, is_graph_node)   # "x['a'][0]"

Sharp edges:
  * Nothing here calls a ``repr`` that may raise: ``jax.jit`` accepts a callable whose
    ``__repr__`` fails, and so must jaxpar.
"""

from __future__ import annotations

import inspect as _pyinspect
import reprlib
from collections.abc import Callable
from typing import Any

import jax


def describe_path(fun: Callable[..., Any], path: tuple[Any, ...]) -> str:
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


def argument_path(fun: Callable[..., Any], marked: Any, index: int,
           is_graph_node: Callable[[Any], bool] | None) -> str:
    paths, _ = jax.tree_util.tree_flatten_with_path(marked, is_leaf=is_graph_node)
    return describe_path(fun, paths[index][0])


def function_name(fun: Any) -> str:
    """``fun``'s name for labels and messages. Never calls ``repr``, which may raise:
    ``jax.jit`` accepts a callable whose ``__repr__`` fails, and so must jaxpar."""
    name = getattr(fun, "__qualname__", None) or getattr(fun, "__name__", None)
    return name if isinstance(name, str) else f"<{type(fun).__name__} object>"


def quoted_name(fun: Callable[..., Any]) -> str:
    return f"`{function_name(fun)}`"


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60


def short_repr(value: Any) -> str:
    """A bounded ``repr`` for messages; a ``__repr__`` that raises gives a placeholder."""
    try:
        return _SHORT.repr(value)
    except Exception:  # reprlib guards instances, not every container element
        return f"<{type(value).__name__} object>"
