"""Tracing proper: a user function at a ``Signature`` to a closed jaxpr over its traced
leaves. The jaxpr is traced from abstract values only, so one trace serves every call
with the same signature.

Example::

    traced = trace(f, sig)        # traced.jaxpr takes the leaves; static values are constants

Sharp edges:
  * An error raised while tracing keeps its class (a user's ``ValueError``, JAX's
    ``ConcretizationTypeError``), as under ``jax.jit``; jaxpar's context travels as a
    note (``messages.trace_error_note``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from .. import _compat
from .._channel import CHANNEL
from .._compat import ClosedJaxpr
from .arguments import Signature
from .messages import name_string_leaves, trace_error_note
from .outputs import OutputStatics, split_outputs


@dataclasses.dataclass(frozen=True)
class Traced:
    jaxpr: ClosedJaxpr  # ClosedJaxpr (jax <= 0.10) or Jaxpr with consts (0.11+)
    outputs: OutputStatics  # the output structure and static leaves; the jaxpr gives the rest
    consts_are_tracers: bool




def tracing_for_a_plan() -> bool:
    """Whether jaxpar is tracing a function to plan it (on this thread): a decorated
    function called inside is part of that function's program."""
    return CHANNEL.plan_depth > 0


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
    CHANNEL.plan_depth += 1
    try:
        jaxpr = jax.make_jaxpr(call)(*args, **kwargs)
    except Exception as error:
        # The error keeps its class (a user's ValueError, JAX's ConcretizationTypeError),
        # as under jax.jit; jaxpar's context travels as a note.
        note = trace_error_note(fun, sig, error)
        if note not in getattr(error, "__notes__", ()):  # one exception object raised again
            error.add_note(note)
            name_string_leaves(fun, sig, error)
        raise
    finally:
        CHANNEL.plan_depth -= 1
    _, consts = _compat.open_jaxpr(jaxpr)
    return Traced(jaxpr, out_tree_box[-1], any(_compat.is_tracer(c) for c in consts))
