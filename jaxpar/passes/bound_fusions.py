"""Bound what one XLA kernel reads of batched members' results (compile time).

The batching passes stack members and slice each member's results back out of the
stacked result. XLA fuses elementwise work with the slices it reads, and the slices
of one stacked array are one parameter of the fusion, so XLA's limit on a fusion's
operands never splits such a kernel: the sum of a thousand members' results
(``sum(outs)``) became one kernel reading a thousand slices at a thousand offsets,
which XLA compiled about five times slower than plain ``jax.jit`` compiles the
unbatched program, whose chain reads a parameter per member and is split at XLA's
operand limit (``benchmarks/compile_time.py``).

This pass follows elementwise chains (``_primitives.ELEMENTWISE``, and the layout
ops XLA fuses with them, ``LAYOUT_ONLY``) from the slices jaxpar made, counting how
many such slices each value has read since the last barrier, and puts an
``optimization_barrier`` after the equation whose count reaches
``MAX_FUSED_SLICES``. XLA never fuses across a barrier, so no kernel reads more of
those slices than that. A barrier is the identity: values and derivatives are the
same bit for bit; a chain over ``n`` members' results costs about
``n / MAX_FUSED_SLICES`` kernels instead of one.

Example::

    def ensemble(xs, ws):                       # 1,000 members
        return sum(jnp.tanh(x @ w) for x, w in zip(xs, ws))

    # batch_matmuls batches the matmuls; this pass then puts a barrier on the sum
    # after every 32 of the members' slices it has added.
    new_jaxpr, decisions = run_passes(jax.make_jaxpr(ensemble)(xs, ws), target="gpu")

Sharp edges:
  * Counts add up along a chain (a value read twice counts twice), so a barrier may
    come early, never late.
  * Only slices a decision made count: a user's own slices are the user's program.
  * Barriers split XLA fusions, so a chain they cut launches a few more kernels than
    the batching pass priced (one per ``MAX_FUSED_SLICES`` slices).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax import lax

from .. import _compat
from .._analysis import Analysis
from .._compat import JaxprEqn
from .._primitives import ELEMENTWISE, LAYOUT_ONLY, OPTIMIZATION_BARRIER, SLICE
from ._protocol import DecisionKind, EmitFn, Level, LevelResult, Rewrite, decision
from ._splice import EqnOrigins, eqn_origins

# Most slices of batched results one XLA kernel may read (the batching passes' own
# bound on the members of one batch, ``_shared.MAX_BATCH_MEMBERS``, is the same).
MAX_FUSED_SLICES = 32

_CHAINED = ELEMENTWISE | LAYOUT_ONLY


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: one rewrite per equation a barrier follows (see the module
    docstring), and one decision for the level naming them."""
    inner, _ = _compat.open_jaxpr(level.jaxpr)
    eqns = inner.eqns
    origins = eqn_origins(analysis)
    made = sum(1 for eqn in eqns if eqn.primitive.name == SLICE and origins.get(eqn))
    if made < MAX_FUSED_SLICES:  # no chain can read enough of them (most levels)
        return LevelResult()
    barred = _barred(eqns, origins)
    if not barred:
        return LevelResult()
    rewrites = [Rewrite((index,), _emit(eqns[index])) for index in barred]
    return LevelResult(rewrites, [decision(
        level.path, DecisionKind.FUSIONS_BOUNDED, eqns, barred, trips_before=None,
        trips_after=None, unroll=None,
        reason=(f"{len(barred)} XLA fusion barrier(s) on chains reading the {made} member "
                f"results jaxpar sliced out here: no kernel reads more than "
                f"{MAX_FUSED_SLICES} of them (XLA's compile time grows with the slices one "
                "kernel reads; values unchanged)"))])


def _barred(eqns: Sequence[JaxprEqn], origins: EqnOrigins) -> list[int]:
    """Indices of the equations a barrier must follow: where a chain's count of
    slices jaxpar made (``origins`` knows which) reaches ``MAX_FUSED_SLICES`` (counts
    restart after a barrier)."""
    count: dict[Any, int] = {}  # variable -> slices jaxpar made it read since a barrier
    barred: list[int] = []
    only_barriers: dict[Any, bool] = {}  # variable -> whether every reader is a barrier
    for eqn in eqns:
        barrier = eqn.primitive.name == OPTIMIZATION_BARRIER
        for v in eqn.invars:
            if not _compat.is_literal(v):
                only_barriers[v] = only_barriers.get(v, True) and barrier
    for index, eqn in enumerate(eqns):
        name = eqn.primitive.name
        if name == SLICE:
            read = 1 if origins.get(eqn) else 0
        elif name in _CHAINED and len(eqn.outvars) == 1:
            read = sum(count.get(v, 0) for v in eqn.invars if not _compat.is_literal(v))
        else:
            continue
        if not read:
            continue
        out = eqn.outvars[0]
        if read >= MAX_FUSED_SLICES and name != SLICE:
            if not only_barriers.get(out, False):  # not already followed by one
                barred.append(index)
            continue  # a barrier follows: what reads it starts a new count
        count[out] = read
    return barred


def _emit(eqn: JaxprEqn) -> EmitFn:
    def emit(rows: list[list[Any]]) -> list[list[Any]]:
        outs = _compat.bind_eqn(eqn, rows[0])
        return [list(lax.optimization_barrier(tuple(outs)))]
    return emit
