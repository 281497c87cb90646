"""How the batching passes batch members: which scans may run as one (``body_key``,
``batch_refusal``), the chunks a batch is cut into (``member_chunks``, at most
``MAX_BATCH_MEMBERS`` members), and the batched computation they emit (``vmap_members``:
shared operands passed once, the others stacked).

Example::

    member_chunks(list(range(70)))               # three batches: 24, 23 and 23 members
    outs = vmap_members(fn, columns, count, eqn)  # per member, fn's results

Sharp edges:
  * A column is shared only when every member passes the very same object
    (``shared_column``); equal values that are distinct objects are stacked.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

from .. import _compat
from .._compat import Atom, JaxprEqn
from .._program import primitives as _primitives
from .._program.graph import Graph
from .._program.structure import StructuralKeys
from ._batchable import equation_refusal, static_refusal

# Most members one batched computation takes (``member_chunks``). XLA compiles each
# distinct kernel once, so a thousand identical members compile about one kernel's
# worth; batched, their stacking (one operand each) and the slices of their results
# (one offset each) are a thousand distinct kernels. Deviceless H200, jaxlib 0.10.2,
# 1,000 members ``tanh(x_i @ w_i)`` of 8x16 @ 16x16: plain ``jax.jit`` compiled in
# 1.3-2.3 s, one batch of 1,000 in 5.8 s with its results kept stacked and 31.7 s sliced
# out one by one; batches of 32 in under twice plain (``benchmarks/compile_time.py``).
MAX_BATCH_MEMBERS = 32

def stack_columns(columns: Sequence[Sequence[Any]]) -> tuple[list[Any], list[int | None]]:
    """Per column of the members' values: the one value of a shared column (axis None),
    or the values stacked along a new leading axis (axis 0)."""
    values: list[Any] = []
    axes: list[int | None] = []
    for column in columns:
        if shared_column(column):
            values.append(column[0])
            axes.append(None)
        else:
            values.append(jnp.stack([jnp.asarray(v) for v in column]))
            axes.append(0)
    return values, axes


def vmap_members(fn: Callable[..., Sequence[Any]], columns: list[list[Any]], count: int,
                 context: Any) -> list[list[Any]]:
    """Runs ``fn`` once for ``count`` members, batched: what batching passes emit.

    ``columns`` holds, per operand of ``fn``, the members' values. A column whose values
    are all the same object is passed once, unbatched (a shared operand); the others are
    stacked along a new leading axis and ``fn`` runs under ``jax.vmap``. New equations
    get ``context``'s (an equation's) source info. Returns, per member, ``fn``'s results.
    """
    operands, in_axes = stack_columns(columns)
    with _compat.eqn_context(context):
        if any(axis == 0 for axis in in_axes):
            outs = jax.vmap(fn, in_axes=tuple(in_axes))(*operands)
            return [[lax.index_in_dim(out, m, keepdims=False) for out in outs]
                    for m in range(count)]
        shared = list(fn(*operands))  # the very same computation, repeated
    return [shared] * count


_Member = TypeVar("_Member")


def member_chunks(members: Sequence[_Member], limit: int = MAX_BATCH_MEMBERS
                  ) -> list[list[_Member]]:
    """``members`` in consecutive chunks of at most ``limit``, as even as can be: the
    batches a batching pass makes of them.

    This is what bounds XLA's compile time: every chunk stacks at most ``limit``
    operands and slices its results out at ``limit`` offsets at most, and chunks of
    one size compile to the same kernels, so the distinct kernels the batched form
    adds stay bounded however many members there are (at most two sizes of chunk).

    Example::

        member_chunks(list(range(70)))  # three chunks of 24, 23 and 23 members
    """
    count = len(members)
    if count <= limit:
        return [list(members)]
    parts = -(-count // limit)
    size, extra = divmod(count, parts)
    chunks, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        chunks.append(list(members[start:end]))
        start = end
    return chunks


def stacked_width(eqns: Sequence[JaxprEqn], graph: Graph, members: Sequence[int]) -> int:
    """How many values each of ``members`` already batches: the most operands of a
    ``stack`` among them or feeding them (1: none). Batching batches again nests the
    stacks, and XLA then compiles a slice per value at every offset of the outer and the
    inner stack together, so a batch of these counts ``width`` members each."""
    width = 1
    for i in members:
        for j in (i, *graph.preds[i]):
            if eqns[j].primitive.name == _primitives.STACK:
                width = max(width, len(eqns[j].invars))
    return width


def shared_column(column: Sequence[Any]) -> bool:
    """Whether every member passes the very same object (then it is not stacked)."""
    return all(v is column[0] for v in column[1:])


def body_key(eqn: JaxprEqn, keys: StructuralKeys) -> Hashable | None:
    """Equal for two scans exactly when they run the same computation on same-typed
    operands (compared structurally: ``_program.structure``); None for a scan that can never be
    batched (``_batchable.static_refusal``)."""
    if static_refusal(eqn) is not None:
        return None
    return (keys.equation(eqn),
            tuple((v.aval, getattr(v.aval, "weak_type", False)) for v in eqn.invars))


def batch_refusal(eqns: Sequence[JaxprEqn], group: Sequence[int]) -> str | None:
    """Why the scans ``group`` (same ``body_key``) cannot run as one vmapped scan, or None:
    what ``vmap`` would make of them, given which operands they share."""
    columns = [[_operand(eqns[m].invars[position]) for m in group]
               for position in range(len(eqns[group[0]].invars))]
    return equation_refusal(eqns[group[0]], [not shared_column(c) for c in columns])


def _operand(atom: Atom) -> Any:
    """What the emitter receives for ``atom`` (see ``_walk._trace_rewrite``)."""
    return _compat.literal_value(atom) if _compat.is_literal(atom) else atom

