"""Bound what one XLA kernel reads of batched members' results (compile time).

The batching passes stack members and slice each member's results back out of the
stacked result. XLA fuses elementwise work with the slices it reads, and the slices
of one stacked array are one parameter of the fusion, so XLA's limit on a fusion's
operands never splits such a kernel: the sum of a thousand members' results
(``sum(outs)``) became one kernel reading a thousand slices at a thousand offsets,
which XLA compiled about five times slower than plain ``jax.jit`` compiles the
unbatched program, whose chain reads a parameter per member and is split at XLA's
operand limit (``benchmarks/compile_time.py``).

On target ``"gpu"``, whose values agree with ``jax.jit``'s to float rounding (the
guide's "Same values"), a sum first becomes a reduction: where a chain of ``add`` equations
reads the slices of one stacked array one by one (``((acc + m0) + m1) + ...``), the
run is replaced by ``acc + reduce_sum(stacked[lo:hi], 0)``, one kernel that reads the
stacked array once and no slice at all. That is the sum in another order (integers:
the same value; floats: a reordered sum's rounding), and XLA compiles it as fast as
the unbatched sum. Other dtypes (half precision, whose reductions XLA accumulates in
float32), weak-typed sums (of Python scalars) and other targets keep the chain and get
barriers.

Then this pass follows elementwise chains (``_program.primitives.ELEMENTWISE``, and the layout
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

    # batch_matmuls batches the matmuls; on target "gpu" this pass then sums each
    # batch of members with one reduction; elsewhere it puts a barrier on the sum
    # after every 32 of the members' slices it has added.
    new_jaxpr, decisions = run_passes(jax.make_jaxpr(ensemble)(xs, ws), target="gpu")

Sharp edges:
  * Counts add up along a chain (a value read twice counts twice), so a barrier may
    come early, never late.
  * Only slices a decision made count: a user's own slices are the user's program.
  * A run is reduced only where its slices are read by nothing else, cover
    consecutive members of one stacked array, and are at least
    ``MIN_REDUCED_MEMBERS``: a reduction ends an XLA fusion, which a short sum, fused
    with what reads it, would pay for with a launch.
  * Like the barriers, reductions are made only on a level where jaxpar sliced at
    least ``MAX_FUSED_SLICES`` members' results out.
  * Barriers split XLA fusions, so a chain they cut launches a few more kernels than
    the batching pass priced (one per ``MAX_FUSED_SLICES`` slices).
  * A reduced float sum differs from the chain beyond rounding only where the order
    shows: the reduction starts from +0.0, so members that are all -0.0 sum to +0.0
    (the chain: -0.0), and partial sums overflow to inf (or not) at other places.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax import lax

from .. import _compat, targets
from .._analysis import Analysis
from .._compat import JaxprEqn
from .._program.primitives import (
    ADD,
    ELEMENTWISE,
    LAYOUT_ONLY,
    OPTIMIZATION_BARRIER,
    SLICE,
    SQUEEZE,
)
from ._protocol import DecisionKind, EmitFn, Level, LevelResult, Rewrite, decision
from ._splice import EqnOrigins, eqn_origins

# Most slices of batched results one XLA kernel may read (the batching passes' own
# bound on the members of one batch, ``_batch_members.MAX_BATCH_MEMBERS``, is the same).
MAX_FUSED_SLICES = 32
# Fewest members a sum's run must add for a reduction to replace it. A reduction ends
# an XLA fusion (its result is a kernel's root), so a short run, which XLA fuses with
# what reads the sum, would cost a launch; a long one costs a kernel either way.
MIN_REDUCED_MEMBERS = MAX_FUSED_SLICES // 2

_CHAINED = ELEMENTWISE | LAYOUT_ONLY
# Dtypes whose sums are reduced on target "gpu": integers (any order gives the same
# value) and the float types whose rounding the target's promise covers.
_REDUCED_KINDS = "iu"
_REDUCED_FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float64),
                             np.dtype(np.complex64), np.dtype(np.complex128)})


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: on target ``"gpu"`` one rewrite per run of a sum over a stacked
    array's slices, then one per equation a barrier follows (see the module
    docstring), and a decision for each kind naming them."""
    inner, _ = _compat.open_jaxpr(level.jaxpr)
    eqns = inner.eqns
    origins = eqn_origins(analysis)
    made = sum(1 for eqn in eqns if eqn.primitive.name == SLICE and origins.get(eqn))
    if made < MAX_FUSED_SLICES:  # no chain can read enough of them (most levels)
        return LevelResult()
    runs = (_summed_runs(eqns, inner.outvars, origins)
            if targets.get(analysis.settings.target).sums_sliced_members else [])
    reduced = {i for r in runs for i in r.eqns}
    barred = _barred(eqns, origins, reduced)
    rewrites = [Rewrite(r.eqns, r.emit(eqns)) for r in runs]
    rewrites += [Rewrite((index,), _emit(eqns[index])) for index in barred]
    decisions = []
    if runs:
        members = sum(len(r.members) for r in runs)
        decisions.append(decision(
            level.path, DecisionKind.SUMS_REDUCED, eqns, sorted(reduced), trips_before=None,
            trips_after=None, unroll=None, members=[r.eqns for r in runs],
            reason=(f"{len(runs)} sum(s) over {members} member results jaxpar sliced out "
                    "here became one reduction over each stacked array (no slice left to "
                    "compile; a reordered sum: integers exact, floats to float rounding)")))
    if barred:
        decisions.append(decision(
            level.path, DecisionKind.FUSIONS_BOUNDED, eqns, barred, trips_before=None,
            trips_after=None, unroll=None,
            reason=(f"{len(barred)} XLA fusion barrier(s) on chains reading the {made} member "
                    f"results jaxpar sliced out here: no kernel reads more than "
                    f"{MAX_FUSED_SLICES} of them (XLA's compile time grows with the slices one "
                    "kernel reads; values unchanged)")))
    return LevelResult(rewrites, decisions)


@dataclasses.dataclass
class _Run:
    """Adds reading one stacked array's slices one by one: ``adds[0]`` reads the chain
    so far (``acc``, its operand ``acc_at``; None when its two operands are both
    members), each later add the one before; ``members[k]`` is ``(row, slice, squeeze)``
    for the member each add reads."""

    stacked: Any
    adds: list[int]
    members: list[tuple[int, int, int]]
    acc_at: int | None

    @property
    def eqns(self) -> tuple[int, ...]:
        return tuple(sorted(self.adds + [i for m in self.members for i in m[1:]]))

    def emit(self, eqns: Sequence[JaxprEqn]) -> EmitFn:
        order = self.eqns
        first = eqns[self.adds[0]]
        first_row, stacked_row = order.index(self.adds[0]), order.index(self.members[0][1])
        rows_of = sorted(m[0] for m in self.members)
        lo, hi = rows_of[0], rows_of[-1] + 1
        size = _compat.array_aval(eqns[self.members[0][1]].invars[0]).shape[0]
        acc_at, last = self.acc_at, order.index(self.adds[-1])

        def emit(rows: list[list[Any]]) -> list[list[Any]]:
            part = rows[stacked_row][0]
            if (lo, hi) != (0, size):
                part = lax.slice_in_dim(part, lo, hi, axis=0)
            total = lax.reduce(part, np.zeros((), part.dtype), lax.add, (0,))
            if acc_at is not None:
                invals = list(rows[first_row])
                invals[1 - acc_at] = total
                (total,) = _compat.bind_eqn(first, invals)
            return [[total] if k == last else [None] for k in range(len(order))]
        return emit


def _summed_runs(eqns: Sequence[JaxprEqn], outvars: Sequence[Any],
                 origins: EqnOrigins) -> list[_Run]:
    """The runs of adds a reduction replaces: each add reads a member (the squeezed
    one-row slice, made by jaxpar, of a stacked array, read by that add alone) and the
    run so far; a run's members are at least ``MIN_REDUCED_MEMBERS`` consecutive rows
    of its array."""
    readers: dict[Any, int] = {}
    for eqn in eqns:
        for v in eqn.invars:
            if not _compat.is_literal(v):
                readers[v] = readers.get(v, 0) + 1
    for v in outvars:
        if not _compat.is_literal(v):
            readers[v] = readers.get(v, 0) + 2  # read outside the level: never internal
    slices: dict[Any, tuple[int, int]] = {}  # slice outvar -> (row, slice index)
    members: dict[Any, tuple[Any, int, int, int]] = {}  # member -> (stacked, row, ...)
    runs: dict[Any, _Run] = {}  # a run's last add's outvar -> the run
    for index, eqn in enumerate(eqns):
        name = eqn.primitive.name
        if name == SLICE and origins.get(eqn):
            row = _member_row(eqn)
            if row is not None and readers.get(eqn.outvars[0]) == 1:
                slices[eqn.outvars[0]] = (row, index)
        elif name == SQUEEZE and eqn.params["dimensions"] == (0,) \
                and eqn.invars[0] in slices and readers.get(eqn.outvars[0]) == 1:
            row, at = slices[eqn.invars[0]]
            members[eqn.outvars[0]] = (eqns[at].invars[0], row, at, index)
        elif name == ADD and _reducible(eqn):
            _extend(runs, eqn, index, members, readers)
    # Each run is held once, under its last add's result (``_extend`` moves it on).
    found = [r for r in runs.values() if len(r.members) >= MIN_REDUCED_MEMBERS]
    return [r for r in found if _consecutive(r)]


def _member_row(eqn: JaxprEqn) -> int | None:
    """The row a slice takes out of its operand's leading axis, whole otherwise."""
    shape = _compat.array_aval(eqn.invars[0]).shape
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params["strides"]
    if not shape or (strides is not None and any(s != 1 for s in strides)):
        return None
    if limit[0] != start[0] + 1 or tuple(start[1:]) != (0,) * (len(shape) - 1) \
            or tuple(limit[1:]) != tuple(shape[1:]):
        return None
    return int(start[0])


def _reducible(eqn: JaxprEqn) -> bool:
    aval = _compat.array_aval(eqn.outvars[0])
    dtype = aval.dtype
    return isinstance(dtype, np.dtype) and not getattr(aval, "weak_type", False) and (
        dtype.kind in _REDUCED_KINDS or dtype in _REDUCED_FLOATS)


def _extend(runs: dict[Any, _Run], eqn: JaxprEqn, index: int,
            members: dict[Any, tuple[Any, int, int, int]], readers: dict[Any, int]) -> None:
    """Adds ``eqn`` (an ``add``) to the run it continues, or starts one with it."""
    x, y = eqn.invars
    aval = _compat.array_aval(eqn.outvars[0])
    for acc_at, acc, member in ((0, x, y), (1, y, x)):
        found = None if _compat.is_literal(member) else members.get(member)
        if found is None or _compat.array_aval(found[0]).shape[1:] != aval.shape:
            continue
        stacked, row, at, squeeze = found
        run = None if _compat.is_literal(acc) else runs.get(acc)
        if run is not None and run.stacked is stacked and readers.get(acc) == 1 \
                and all(m[0] != row for m in run.members):
            del runs[acc]
        else:  # a new run; with two members of one array, the first is its start
            first = None if _compat.is_literal(acc) else members.get(acc)
            run = _Run(stacked, [], [], acc_at)
            if first is not None and first[0] is stacked and first[1] != row \
                    and _compat.array_aval(first[0]).shape[1:] == aval.shape:
                run.members.append(first[1:])
                run.acc_at = None
        run.adds.append(index)
        run.members.append((row, at, squeeze))
        runs[eqn.outvars[0]] = run
        return


def _consecutive(run: _Run) -> bool:
    rows = sorted(m[0] for m in run.members)
    return rows == list(range(rows[0], rows[0] + len(rows)))


def _barred(eqns: Sequence[JaxprEqn], origins: EqnOrigins, reduced: set[int]) -> list[int]:
    """Indices of the equations a barrier must follow: where a chain's count of
    slices jaxpar made (``origins`` knows which) reaches ``MAX_FUSED_SLICES`` (counts
    restart after a barrier). Slices a reduction replaces (``reduced``) count nothing."""
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
            read = 1 if origins.get(eqn) and index not in reduced else 0
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
