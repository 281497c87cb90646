"""XLA frontend attributes as JAX carries them: ``stream_call`` (one non-inlined call
carrying attributes, JAX's ``xla_metadata_call``), and the attributes JAX attached to an
equation (its context's ``xla_metadata`` and ``compute_type``, an ``xla_metadata_call``'s
parameters). Those of jaxpar's own regions are ``_ops.eqn_frontend_attributes``'s.

Example::

    call = stream_call(body, {"_xla_stream_annotation": "1", "inlineable": "false"})
    jax_frontend_attributes(eqn)            # {"_xla_stream_annotation": "1", ...}

Sharp edge: ``xla_metadata_call`` moved from ``jax.experimental.scheduling_groups``
(0.8-0.10) to ``jax.experimental.xla_metadata`` (0.11+) and changed its equation
parameters; ``jax_frontend_attributes`` reads both layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .jaxprs import JAX_VERSION, JaxprEqn, internal_primitive_name

try:  # jax >= 0.11
    from jax.experimental.xla_metadata import (  # type: ignore[attr-defined]
        xla_metadata_call as _xla_metadata_call,
    )
except ImportError:  # jax 0.8 - 0.10
    from jax.experimental.scheduling_groups import (  # type: ignore[no-redef]
        xla_metadata_call as _xla_metadata_call,
    )

# XLA:GPU up to the XLA in jax 0.10 does not overlap a stream-annotated call that
# returns a tuple with anything else (seen deviceless on an H200 with jaxlib 0.10.2;
# fixed by 0.12). The emitter then packs same-dtype results into one array.
PACK_MULTI_RESULT_CALLS = JAX_VERSION < (0, 11)


def stream_call(fn: Callable[..., Any], attributes: dict[str, str]) -> Callable[..., Any]:
    """Wraps ``fn`` so it lowers to one non-inlined call with ``attributes``."""
    return _xla_metadata_call(fn, **attributes)


_XLA_METADATA_CALL = internal_primitive_name("xla_metadata_call_p", "xla_metadata_call")


def jax_frontend_attributes(eqn: JaxprEqn) -> dict[str, str]:
    """The XLA frontend attributes JAX attached to ``eqn``: its context's, then an
    ``xla_metadata_call``'s own."""
    attrs: dict[str, str] = {}
    ctx_meta = getattr(eqn.ctx, "xla_metadata", None)
    if ctx_meta:
        attrs.update({str(k): str(v) for k, v in dict(ctx_meta).items()})
    compute_type = getattr(eqn.ctx, "compute_type", None)
    if compute_type is not None:
        attrs["_xla_compute_type"] = str(compute_type)
    if eqn.primitive.name == _XLA_METADATA_CALL:
        if "xla_metadata" in eqn.params:  # jax >= 0.11
            attrs.update({str(k): str(v) for k, v in eqn.params["xla_metadata"]})
        else:  # jax 0.8 - 0.10: the attributes are the parameters themselves
            attrs.update({str(k): str(v) for k, v in eqn.params.items() if k != "jaxpr"})
    return attrs


def has_jax_frontend_attributes(eqn: JaxprEqn) -> bool:
    """``bool(jax_frontend_attributes(eqn))`` without building the dict (the passes ask
    ``_ops.has_frontend_attributes`` of every equation of every level they visit)."""
    ctx = eqn.ctx
    if getattr(ctx, "xla_metadata", None) or getattr(ctx, "compute_type", None) is not None:
        return True
    if eqn.primitive.name == _XLA_METADATA_CALL:
        return bool(jax_frontend_attributes(eqn))
    return False
