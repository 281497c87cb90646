"""What jaxpar says when it refuses a function or cannot trace one: ``check_function``
(what ``jax.jit`` refuses at decoration time, in its words, then what to do) and the
note an error raised while tracing carries (``trace_error_note``: the function, the
argument JAX blames, advice, and the arguments, shortened).

Example::

    try:
        traced = trace(f, sig)
    except Exception as error:
        raised_while_tracing(error)          # True: it carries jaxpar's note
        error_text(error)                    # the message and the note
"""

from __future__ import annotations

import inspect as _pyinspect
import re
from collections.abc import Callable
from typing import Any

import jax

from .arguments import Layout, Signature, StaticArg
from .names import describe_path, quoted_name, short_repr
from .static_keys import StateKeyed


class TraceError(RuntimeError):
    """Kept for compatibility: jaxpar raises it no more.

    An error raised while tracing the decorated function reaches the caller with its own
    class, as under ``jax.jit`` (a ``ValueError`` of the function, JAX's
    ``ConcretizationTypeError``), with jaxpar's context as a note (``raised_while_tracing``).
    """


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
        raise refuse(f"Expected a function, got a generator function: {quoted_name(fun)}",
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
    return [describe_path(fun, path) for path, _ in paths]


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


# Errors that come from turning a traced array into a Python value: only these get the
# advice about static arguments.
_CONVERSION_ERRORS: tuple[type[BaseException], ...] = tuple(
    cls for cls in (getattr(jax.errors, name, None) for name in (
        "ConcretizationTypeError", "TracerBoolConversionError", "TracerIntegerConversionError",
        "TracerArrayConversionError", "NonConcreteBooleanIndexError"))
    if isinstance(cls, type))


_ARGUMENT_IN_ERROR = re.compile(r"depends on the values? of the arguments? (.+?)\.?$", re.MULTILINE)
_SHOWN_ARGUMENTS = 8


def name_string_leaves(fun: Callable[..., Any], sig: Signature, error: BaseException) -> None:
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
    error.args = (f"{error.args[0]} (jaxpar: tracing {quoted_name(fun)} with a string "
                  f"argument {named}, passed to it as a static Python value; if an array was "
                  "meant, pass one)",)


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
    return (f"{_NOTE_START}{quoted_name(fun)}{where}: the {type(error).__name__} above "
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
