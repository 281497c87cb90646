"""A function whose equations carry XLA attributes as JAX attaches them: a metadata scope
(``set_xla_metadata``) and metadata calls, with and without attributes. For the tests of
what jaxpar reads from equations (``_compat``, ``_ops``).

Example::

    from helpers.metadata import placed_by_jax

    jax.make_jaxpr(placed_by_jax)(x)   # a dot in a scope, a stream-annotated sin, a bare cos
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.xla_metadata import set_xla_metadata

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
