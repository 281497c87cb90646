"""A function whose equations carry XLA attributes as JAX attaches them: a metadata scope
(``set_xla_metadata``) and metadata calls, with and without attributes. For the tests of
what jaxpar reads from equations (``_compat``, ``_ops``).

Example::

    from helpers.metadata import placed_by_jax

    jax.make_jaxpr(placed_by_jax)(x)   # a dot in a scope, a stream-annotated sin, a bare cos
    answers(placed_by_jax, shortcut, full)   # [(shortcut(e), bool(full(e))), ...]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.xla_metadata import set_xla_metadata

from helpers.lowered import all_equations

try:  # jax >= 0.11
    from jax.experimental.xla_metadata import xla_metadata_call
except ImportError:  # jax 0.8 - 0.10
    from jax.experimental.scheduling_groups import xla_metadata_call


def placed_by_jax(x: jax.Array) -> jax.Array:
    """Attributes as JAX attaches them: a metadata scope, and metadata calls."""
    with set_xla_metadata(note="1"):
        y = x @ x
    z = xla_metadata_call(jnp.sin, _xla_stream_annotation="1", inlineable="false")(x)
    bare = xla_metadata_call(jnp.cos)(x)  # a metadata call without attributes
    return y + z + bare


def answers(fn: Callable[[jax.Array], jax.Array], shortcut: Callable[[Any], bool],
            full: Callable[[Any], Any]) -> list[tuple[bool, bool]]:
    """``(shortcut(e), bool(full(e)))`` for every equation ``e`` (nested ones too) of ``fn``
    and of its gradient, at an 8x8 input: where a hot path's shortcut must agree with the
    full answer it stands for."""
    x = jnp.ones((8, 8))
    programs = [jax.make_jaxpr(fn)(x), jax.make_jaxpr(jax.grad(lambda v: fn(v).sum()))(x)]
    return [(shortcut(e), bool(full(e))) for program in programs
            for e in all_equations(program)]
