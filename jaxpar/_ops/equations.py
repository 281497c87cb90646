"""What the rest of jaxpar reads of an equation where jaxpar's own primitives count too:
the XLA frontend attributes it carries (JAX's, and a stream region's), and the names of
every primitive there is.

Example::

    eqn_frontend_attributes(eqn)      # {"_xla_stream_annotation": "1", "inlineable": ...}
    has_frontend_attributes(eqn)      # the same as a bool, without building the dict
"""

from __future__ import annotations

from .. import _compat
from .._compat import JaxprEqn
from .program import PROGRAM
from .stream_region import STREAM_REGION, stream_region_p


def eqn_frontend_attributes(eqn: JaxprEqn) -> dict[str, str]:
    """The XLA frontend attributes the user or jaxpar attached to ``eqn``."""
    attrs = _compat.jax_frontend_attributes(eqn)
    if eqn.primitive is stream_region_p:
        attrs.update(dict(eqn.params["region"].attributes))
    return attrs


def has_frontend_attributes(eqn: JaxprEqn) -> bool:
    """``bool(eqn_frontend_attributes(eqn))`` without building the dict: the passes ask
    this of every equation of every level they visit."""
    if eqn.primitive is stream_region_p:
        return bool(eqn_frontend_attributes(eqn))
    return _compat.has_jax_frontend_attributes(eqn)


def all_primitive_names() -> frozenset[str]:
    """Names of every primitive the running jax defines at module level, and of jaxpar's
    own (for tests)."""
    return _compat.jax_primitive_names() | {STREAM_REGION, PROGRAM}
