"""The one per-thread channel between a decorated function's calls and the traces they start.

A call and the trace it starts run in one thread, but JAX sits between them (``jax.jit``
traces the function it was given), so what a trace must know about its call travels
here: whether it is the body of a user's ``on_stream`` call, which function's trace is
compiled with its plan's XLA options, and which traces closed over another trace's values.

Example::

    with stream_call_body():
        assert inside_stream_call()
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class _Channel(threading.local):
    """Per thread: ``stream_depth``, how many ``on_stream`` bodies are being traced;
    ``options_owner``, the call state whose trace a jit compiles with the plan's XLA
    options (no ``XlaOptionsNotAppliedWarning`` is due for it); ``traced_consts``, the ids of
    call states whose last trace closed over another trace's tracers (``jax.jit`` must not
    reuse it)."""

    def __init__(self) -> None:
        self.stream_depth = 0
        self.options_owner: Any = None
        self.traced_consts: set[int] = set()


CHANNEL = _Channel()


def inside_stream_call() -> bool:
    """Whether we are tracing the body of a user's ``on_stream`` call."""
    return CHANNEL.stream_depth > 0


@contextlib.contextmanager
def stream_call_body() -> Iterator[None]:
    """Within: the body of a user's ``on_stream`` call is being traced."""
    CHANNEL.stream_depth += 1
    try:
        yield
    finally:
        CHANNEL.stream_depth -= 1


@contextlib.contextmanager
def options_applied(state: Any) -> Iterator[None]:
    """Within: traces of ``state``'s function are compiled with its plan's XLA options by
    whoever traces them (``lower`` with the options, ``gpu_preview``, the top-level jits),
    so no warning is due."""
    before = CHANNEL.options_owner
    CHANNEL.options_owner = state
    try:
        yield
    finally:
        CHANNEL.options_owner = before
