"""Emission of one collectives group: ONE non-inlined call XLA launches as a group.

The planner's collectives stage (``jaxpar._plan.collectives``) decides which
collectives of a level form a group; the emitter (``_emit``) calls
``emit_collective_group`` for each.

Example::

    outs = emit_collective_group([jaxpr.eqns[i] for i in group.eqns], invals)

Sharp edges:
  * The call carries ``{_collectives_group="", inlineable="false"}``
    (``COLLECTIVES_GROUP_ATTRIBUTES``), which XLA's
    ``ExplicitCollectivesGroupAsyncWrapper`` needs (jax >= 0.6).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import _compat
from ._plan.collectives import COLLECTIVES_GROUP_ATTRIBUTES

__all__ = ["emit_collective_group"]


def emit_collective_group(eqns: Sequence[Any], invals: Sequence[Sequence[Any]],
                          attributes: Mapping[str, str] = COLLECTIVES_GROUP_ATTRIBUTES
                          ) -> list[list[Any]]:
    """Emits ``eqns`` (collectives) as ONE non-inlined call launched as a group.

    Each equation is re-bound with its source info and context inside a
    ``_compat.stream_call`` carrying ``{_collectives_group="",
    inlineable="false"}``. Works under any trace (jit, grad, vmap, inside a
    ``shard_map`` body or a scan body).

    Args:
      eqns: the group's equations, e.g. ``[jaxpr.eqns[i] for i in group.eqns]``.
      invals: for each equation, the values of its invars.
      attributes: the call's frontend attributes.

    Returns:
      For each equation, the values of its outvars.

    Raises:
      ValueError: ``eqns`` and ``invals`` differ in length.
    """
    if len(eqns) != len(invals):
        raise ValueError(f"emit_collective_group: {len(eqns)} equations but "
                         f"{len(invals)} input lists")
    counts = [len(v) for v in invals]
    out_counts = [len(e.outvars) for e in eqns]

    def body(*flat: Any) -> tuple[Any, ...]:
        outs: list[Any] = []
        start = 0
        for eqn, count in zip(eqns, counts, strict=True):
            outs.extend(_compat.bind_eqn(eqn, flat[start:start + count]))
            start += count
        return tuple(outs)

    call: Callable[..., Any] = _compat.stream_call(body, dict(attributes))
    flat_out = list(call(*[v for vals in invals for v in vals]))
    result, start = [], 0
    for count in out_counts:
        result.append(flat_out[start:start + count])
        start += count
    return result
