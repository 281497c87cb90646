"""jaxpar's own primitives and all their rules: what the emitted program is made of
beyond JAX's primitives. (What they need of JAX's internals, and what differs between
jax releases, is ``_compat``'s: nothing here reads JAX's internals.) Its modules, each
importing only the ones listed before it:

  call_rules     the rules jaxpar's two call-like primitives share (abstract eval, jet)
  stream_region  ``stream_region_p``: one region of the emitted program, a non-inlined
                 call with frontend attributes, and its rules
  program        ``program_p``: the rewritten program as one equation that remembers the
                 program it came from (checkify in the user's order), and its rules
  equations      what an equation carries where these primitives count too (frontend
                 attributes), and every primitive's name

Example::

    from jaxpar import _ops
    outs = _ops.bind_stream_region(body, args, region)
    _ops.has_frontend_attributes(eqn)
"""

from __future__ import annotations

from .equations import all_primitive_names, eqn_frontend_attributes, has_frontend_attributes
from .program import PROGRAM, ProgramSource, bind_program, program_p
from .stream_region import (
    STREAM_REGION,
    bind_stream_region,
    packable,
    stream_region_p,
)

__all__ = [
    "PROGRAM",
    "STREAM_REGION",
    "ProgramSource",
    "all_primitive_names",
    "bind_program",
    "bind_stream_region",
    "eqn_frontend_attributes",
    "has_frontend_attributes",
    "packable",
    "program_p",
    "stream_region_p",
]
