"""Where an equation comes from: the user's source line, the layer path of its name
stack, the names a report shows, and source info carried over to a new trace."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Hashable
from typing import Any

from jax._src import source_info_util as _source_info_util

from .jaxprs import JaxprEqn, JaxprLike, open_jaxpr

# jaxpar's own folder (this package's parent): frames in it are never the user's.
_JAXPAR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def source_summary(eqn: JaxprEqn) -> str:
    """``[scope] file:line:column (function)`` of the user code that created ``eqn``.

    ``scope`` is the equation's name stack without JAX's transformation wrappers: the
    layer path a Flax Linen model gives (``TwoTowers/query/dense0``), the module name
    Equinox gives (``eqx.nn.Linear``), a ``jax.named_scope``; ``(backward)`` marks an
    equation of a transposed (reverse-mode) computation (after the line where it has no
    scope). It is left out when empty.
    Never one of jaxpar's own frames: an equation jaxpar made itself (such as the
    stacking of batched operands) is ``<added by jaxpar>``. The path is relative to the
    working directory when the file lies under it, and ``package/module.py`` for an
    installed package (site-packages).
    """
    try:
        frame = next(iter(_source_info_util.user_frames(eqn.source_info.traceback)), None)
    except Exception:
        return "<unknown>"
    if frame is None:
        return "<unknown>"
    if frame.file_name.startswith(_JAXPAR_DIR):
        return "<added by jaxpar>"
    column = f":{frame.start_column}" if frame.start_column else ""
    scope = name_scope(eqn)
    # A scope says "(backward)" itself; without one, the line does (a gradient's scans
    # have their forward twins' lines).
    back = " (backward)" if not scope and backward(eqn) else ""
    return (f"{f'[{scope}] ' if scope else ''}{_display_path(frame.file_name)}:"
            f"{frame.start_line}{column} ({frame.function_name}){back}")


def user_source(eqn: JaxprEqn) -> str:
    """``file:line (function)`` of the first frame of ``eqn``'s traceback in the user's
    own code: outside JAX, jaxpar and installed packages (a Flax or Equinox layer's
    ``__call__``), so a Flax ``nnx.Linear`` is placed where the user's model calls it.
    The first frame outside JAX when every frame is in a package; ``""`` without one.
    """
    try:
        frames = list(_source_info_util.user_frames(eqn.source_info.traceback))
    except Exception:
        return ""
    own = next((f for f in frames if not _in_a_package(f.file_name)), None)
    frame = own or next(iter(frames), None)
    if frame is None or frame.file_name.startswith(_JAXPAR_DIR):
        return ""
    return f"{_display_path(frame.file_name)}:{frame.start_line} ({frame.function_name})"


def _in_a_package(path: str) -> bool:
    """Whether ``path`` is a module of an installed package (or of jaxpar)."""
    return path.startswith(_JAXPAR_DIR) or any(path.startswith(folder)
                                               for folder in _site_packages())


def backward(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` belongs to a transposed (reverse-mode) computation: its name stack
    holds a ``transpose(...)`` wrapper."""
    try:
        return "transpose(" in str(eqn.source_info.name_stack)
    except Exception:
        return False


def argument_names(jaxpr: JaxprLike) -> tuple[str | None, ...]:
    """Per input of a traced jaxpr, the name JAX gave it from the traced function's
    parameters (``model.towers[0]['kernel']``, ``x``); None where it has none, and
    empty when the jaxpr records no names (or not one per input)."""
    inner, _ = open_jaxpr(jaxpr)
    names = getattr(getattr(inner, "debug_info", None), "arg_names", None)
    if names is None or len(names) != len(inner.invars):
        return ()
    return tuple(name if isinstance(name, str) and name else None for name in names)


def source_key(eqn: JaxprEqn) -> Hashable:
    """What ``source_summary(eqn)`` is made from: the traceback (jaxlib compares and
    hashes one frame by frame, so the equations a Python loop makes on one line share
    theirs) and the name stack. Equal keys, equal summaries (in one working directory).

    Raises:
      TypeError: the key is not hashable (then call ``source_summary`` itself).
    """
    info = eqn.source_info
    key = (info.traceback, info.name_stack)
    hash(key)
    return key


_WRAPPER = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)$")


def name_scope(eqn: JaxprEqn) -> str:
    """The equation's name stack as a user's layer path, without transformation wrappers.

    ``transpose(jvp(TwoTowers))/query/dense0`` -> ``TwoTowers/query/dense0 (backward)``.
    """
    try:
        text = str(eqn.source_info.name_stack)
    except Exception:
        return ""
    parts, backward = [], False
    for part in text.split("/"):
        while match := _WRAPPER.match(part):
            backward |= match.group(1) == "transpose"
            part = match.group(2)
        if part and part not in ("jvp", "transpose", "vmap", "checkpoint", "remat"):
            parts.append(part)
    if parts and parts[0] in parts[1:]:  # an accumulation of two scopes: the innermost
        parts = parts[len(parts) - 1 - parts[::-1].index(parts[0]):]
    scope = "/".join(parts)
    return f"{scope} (backward)" if scope and backward else scope


def display_name(eqn: JaxprEqn) -> str:
    """What to call ``eqn`` in a report: the wrapped function's name for a custom rule
    (``relu``, not ``custom_jvp_call``), the jitted function's for a nested ``jit``."""
    name = eqn.primitive.name
    if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
        for key in ("call_jaxpr", "fun_jaxpr"):
            inner = eqn.params.get(key)
            debug = getattr(getattr(inner, "jaxpr", inner), "debug_info", None)
            func_name = getattr(debug, "func_name", None)
            if func_name and func_name != "<lambda>":
                return str(func_name)
    elif name in ("pjit", "jit") and eqn.params.get("name") not in (None, "<lambda>"):
        return f"jit({eqn.params['name']})"
    return name


def _site_packages() -> tuple[str, ...]:
    """Folders packages are installed in, longest first (``sys.path`` entries named so)."""
    folders = {os.path.join(os.path.abspath(entry), "") for entry in sys.path
               if entry and os.path.basename(entry.rstrip(os.sep)) in ("site-packages",
                                                                      "dist-packages")}
    return tuple(sorted(folders, key=len, reverse=True))


def _display_path(path: str) -> str:
    """``path`` relative to the working directory when under it, ``package/module.py``
    for an installed package, else as it is."""
    cwd = os.getcwd()
    shown = _display_paths.get((path, cwd))
    if shown is None:
        try:
            relative = os.path.relpath(path, cwd)
        except ValueError:  # another drive on Windows
            relative = os.pardir
        shown = path if relative.startswith(os.pardir) else relative
        for folder in _site_packages():
            if path.startswith(folder):
                shown = path[len(folder):]
                break
        if len(_display_paths) >= 4096:  # a program spans few files: never in practice
            _display_paths.clear()
        _display_paths[(path, cwd)] = shown
    return shown


_display_paths: dict[tuple[str, str], str] = {}


def rebased_source(traced: Any, first: Any, now: Any) -> Any:
    """The source info of an equation traced under a member equation whose source info
    was ``first``, as a trace under a member with source info ``now`` gives it: ``now``'s
    traceback, and ``traced``'s name stack with ``first``'s scopes (its end: a bind puts
    an equation's scopes under the current ones) replaced by ``now``'s; where they are
    not its end, ``now``'s name stack."""
    stack, old, new = traced.name_stack.stack, first.name_stack.stack, now.name_stack.stack
    if old == new:
        name_stack = traced.name_stack
    elif stack[len(stack) - len(old):] == old:
        name_stack = _source_info_util.NameStack(stack[:len(stack) - len(old)] + new)
    else:
        name_stack = now.name_stack
    return _source_info_util.SourceInfo(now.traceback, name_stack)
