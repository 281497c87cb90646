"""Tracing: a user function and its arguments to a closed jaxpr.

Arguments are pytrees (positional and keyword); every leaf must be an array
(or a Python/NumPy scalar, or a ``jax.ShapeDtypeStruct`` where abstract
arguments are allowed). The jaxpr is traced from abstract values only, so one
trace serves every call with the same signature.

Example::

    traced = trace(f, (x,), {"scale": 2.0})
    traced.jaxpr, traced.in_tree, traced.out_tree

Sharp edges:
  * Non-array leaves (strings, objects) are rejected with the argument's
    path: bind them with ``functools.partial`` before decorating.
"""

from __future__ import annotations

import dataclasses
import inspect as _pyinspect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _compat


class TraceError(RuntimeError):
    """The decorated function could not be traced to a jaxpr."""


@dataclasses.dataclass(frozen=True, slots=True)
class Signature:
    """What the rewrite cache is keyed by: structure, shapes and dtypes."""

    in_tree: Any
    avals: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Traced:
    jaxpr: Any  # ClosedJaxpr (jax <= 0.10) or Jaxpr with consts (0.11+)
    out_tree: Any
    consts_are_tracers: bool


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


def _is_array_like(leaf: Any, allow_abstract: bool) -> bool:
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
        return True
    if _compat.is_tracer(leaf):
        return True
    return allow_abstract and isinstance(leaf, jax.ShapeDtypeStruct)


def signature(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              allow_abstract: bool = False) -> tuple[Signature, list[Any]]:
    """Flattens ``(args, kwargs)`` and checks every leaf is an array."""
    leaves_with_paths, in_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = []
    for path, leaf in leaves_with_paths:
        if not _is_array_like(leaf, allow_abstract):
            where = _describe_path(fun, path)
            hint = ("; inspect() also accepts jax.ShapeDtypeStruct" if not allow_abstract else "")
            raise TypeError(
                f"argument `{where}` of {_name(fun)} is a {type(leaf).__name__}, not an array: "
                "jaxpar traces every leaf of the arguments as an array. Pass an array (or "
                "Python/NumPy scalar), or bind non-array values with functools.partial or a "
                f"closure before decorating{hint}.")
        leaves.append(leaf)
    avals = tuple(_abstract(leaf) for leaf in leaves)
    return Signature(in_tree, avals), leaves


def _abstract(leaf: Any) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                    weak_type=getattr(leaf, "weak_type", False))
    # The full abstract value: inside shard_map it records the varying mesh axes,
    # which the trace needs to insert the same casts JAX would.
    return jax.typeof(leaf)


def _name(fun: Callable[..., Any]) -> str:
    return f"`{getattr(fun, '__qualname__', None) or getattr(fun, '__name__', repr(fun))}`"


def trace(fun: Callable[..., Any], sig: Signature) -> Traced:
    """Traces ``fun`` at ``sig`` to a closed jaxpr over the flat leaves."""
    out_tree_box: list[Any] = []

    def flat_fun(*flat_args: Any) -> list[Any]:
        args, kwargs = jax.tree_util.tree_unflatten(sig.in_tree, flat_args)
        out = fun(*args, **kwargs)
        flat_out, out_tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(out_tree)
        return flat_out

    try:
        jaxpr = jax.make_jaxpr(flat_fun)(*sig.avals)
    except Exception as error:
        shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in sig.avals)
        raise TraceError(
            f"jaxpar could not trace {_name(fun)} with arguments ({shapes}): "
            f"{type(error).__name__}: {error}\n"
            "parallel_branches traces the function with abstract values, like jax.jit: "
            "it must not convert traced arrays to Python values (use jnp/lax operations, "
            "or bind such arguments with functools.partial before decorating).") from error
    _, consts = _compat.open_jaxpr(jaxpr)
    return Traced(jaxpr, out_tree_box[-1], any(_compat.is_tracer(c) for c in consts))
