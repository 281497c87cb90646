"""The scopes a decorated function's calls open around the traces they start, kept in
jaxpar's one per-thread channel (``jaxpar._channel``): whether a trace is the body of a
user's ``on_stream`` call, and which function's trace is compiled with its plan's XLA
options.

Example::

    with stream_call_body():
        assert inside_stream_call()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .._channel import CHANNEL


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
