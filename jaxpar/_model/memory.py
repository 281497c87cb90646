"""Memory model: the temporary bytes XLA:GPU allocates for a program, in a CUDA-graph mode.

jaxpar's rewrites and modes can raise a program's memory: in the branching CUDA-graph
modes XLA assigns buffers by a dependency ordering, so independent temporaries are
never packed together (``xla/xla.proto``: CONCURRENT "may lead to OOMs"); batching
stacks the members' inputs into new arrays; unrolling keeps more of a loop body alive at
once; stream sections keep their regions' buffers apart. The planner compares the
estimate of jaxpar's program in its mode with the plain program's in the user's
(``_plan.budget``) and keeps nothing that needs more than its budget.

The model of one jaxpr level, in the order of its equations (a program's equations
run in about that order; XLA's scheduler may reorder them):

* a **buffer** is a value XLA writes to memory: the result of an equation launching a
  kernel of its own that cannot take its operands' computation in (a dot, a convolution,
  a collective, a sort, a loop, a call), of elementwise work read by such an equation,
  and of a broadcast a loop holds as its state (written right before the loop). Other
  elementwise work is fused into its reader (no buffer; its reader reads its operands
  instead); shape-only equations (reshape, broadcast, convert...) are views of their
  operand's buffers;
* the level's inputs and outputs are not temporaries (the program's arguments and
  results, or a loop's state, which its caller holds);
* **sequential** orderings (XLA's ``lhs`` and ``serialize`` modes, graphs ``off``): a
  buffer is live from its equation to its last reader; the peak is the most bytes live
  at once, plus what a nested computation needs while it runs (a loop's body, a call's
  body, a ``cond``'s dearest branch), plus a copy of each loop carry; an unrolled scan
  body's copies may each keep all their buffers (XLA's scheduler may interleave them),
  and a factor that does not divide the length copies the scanned inputs;
* ``concurrent`` (a dependency ordering): independent buffers are never packed, so the
  bound is the sum of every buffer of the level and of what its nested computations
  need (a loop body's buffers once per unrolled copy);
* ``concurrent_regions``: XLA's regions of small kernels follow its schedule, which the
  model does not know, so any small kernel's buffer may be kept apart: the sequential
  peak plus every buffer of a kernel that does not fill the GPU (those that do, dots and
  convolutions, run and are packed one after another), nested computations as in
  ``concurrent``;
* the stream sections of a plan (``sections``: groups of equations running on other
  streams at once) keep their buffers live from the section's first equation to its last.

Example::

    model = MemoryModel(CostModel(device_profile("gpu")))
    model.temp_bytes(closed_jaxpr, CommandBufferMode.LHS)

Sharp edges:
  * A model of buffer assignment, not XLA's: it does not know XLA's schedule, its layout
    copies, library workspaces, split-K partial sums or which producers XLA fuses into a
    GEMM. It is meant to compare two programs of the same function (plain and jaxpar's),
    whose errors are alike; ``gpu_preview`` reports what the compile says
    (``memory_analysis()``), and ``benchmarks/gpu_suite.py`` compares the two over the
    GPU suite (``docs/benchmarks.md``).
  * The branching orderings' figures are meant as upper bounds (above the compiles' for
    each program of the GPU suite), far above them for large programs: a mode change is
    then refused for memory it might not have needed. They leave out XLA's split-K
    partial sums (a GEMM XLA splits along its contraction writes up to 64 times its
    result, deviceless H200), which ``concurrent`` mode keeps apart too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

from .. import _compat
from .._compat import JaxprEqn, JaxprLike
from .._memo import IdentityMemo
from .._program import primitives as _primitives
from .cost import CostModel
from .gpu import CommandBufferMode

__all__ = ["MemoryModel", "format_bytes", "split_k_bytes", "stacking_refusal"]


def format_bytes(count: float) -> str:
    """``"1.5 MiB"``, ``"12.0 KiB"``, ``"300 B"``."""
    if not math.isfinite(count):
        return str(count)
    sign = "-" if count < 0 else ""
    count = abs(count)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{sign}{count / size:.1f} {unit}"
    return f"{sign}{count:.0f} B"


def xs_total(eqn: JaxprEqn, info: _compat.ScanInfo) -> float:
    """Bytes of the ``scan`` ``eqn``'s scanned inputs, whole."""
    return float(sum(_compat.aval_nbytes(v.aval)
                     for v in eqn.invars[info.num_consts + info.num_carry:]))


def _trip_bytes(eqn: JaxprEqn, info: _compat.ScanInfo) -> tuple[float, float, float]:
    """Bytes of the ``scan`` ``eqn``'s carries, and of one trip's slice of its scanned
    inputs and of its stacked results."""
    carries = sum(_compat.aval_nbytes(v.aval) for v in eqn.outvars[:info.num_carry])
    xs = sum(_compat.aval_nbytes(v.aval) for v in _compat.open_jaxpr(info.jaxpr)[0].invars[
        info.num_consts + info.num_carry:])
    ys = sum(_compat.aval_nbytes(v.aval) for v in eqn.outvars[info.num_carry:]) \
        / max(info.length, 1)
    return float(carries), float(xs), ys


# XLA:GPU splits a GEMM along its contraction when its result has too few tiles to fill
# the GPU, and writes the partial sums (in float32) before adding them up. Seen in
# deviceless H200 compiles (jaxlib 0.10.2), (m, k, n): (256, 256, 256) split 4 ways,
# (16, 1024, 4096) 4, (128, 4096, 128) 32, (32, 8192, 32) 64; (1024, 1024, 1024),
# (512, 64, 512) and (64, 64, 64) not at all. The bound below covers each: a result of
# fewer than ``SPLIT_K_TILES`` 64 x 64 tiles with a contraction of at least 256 may be
# split up to min(64, k / 64) ways.
SPLIT_K_TILES = 132  # the H100's and H200's streaming multiprocessors


def split_k_bytes(eqn: JaxprEqn) -> float:
    """Bytes of the partial sums XLA may write for the ``dot_general`` ``eqn``."""
    (lhs_contract, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
    lhs = _compat.array_aval(eqn.invars[0]).shape
    out = _compat.array_aval(eqn.outvars[0]).shape
    contracted = math.prod(lhs[d] for d in lhs_contract)
    batch = math.prod(lhs[d] for d in lhs_batch)
    rows = math.prod(n for d, n in enumerate(lhs) if d not in lhs_contract and d not in lhs_batch)
    cols = math.prod(out) // max(batch * rows, 1)  # the GEMM is (rows, k) x (k, cols)
    tiles = batch * -(-rows // 64) * -(-cols // 64)
    if tiles >= SPLIT_K_TILES or contracted < 256:
        return 0.0
    return float(min(64, contracted // 64) * math.prod(out) * 4)


def _transposed_xs(eqn: JaxprEqn, info: _compat.ScanInfo) -> float:
    """Bytes of the ``scan`` ``eqn``'s scanned inputs its body reads transposed: XLA moves
    the transpose of the slice out of the loop, over the whole input (a deviceless H200
    compile of two 1,000-trip cells over 100 x 100 slices: 38 MiB more)."""
    inner = _compat.open_jaxpr(info.jaxpr)[0]
    slices = inner.invars[info.num_consts + info.num_carry:]
    read = {v for e in inner.eqns if e.primitive.name == _primitives.TRANSPOSE
            for v in e.invars if not isinstance(v, _compat.Literal)}
    return float(sum(_compat.aval_nbytes(outer.aval) for outer, v in zip(
        eqn.invars[info.num_consts + info.num_carry:], slices, strict=True) if v in read))


def stacking_refusal(stacked_bytes: float, allowance: float | None) -> str | None:
    """Why a batching rewrite whose stacked copies take ``stacked_bytes`` is over the
    memory budget's ``allowance`` (``Analysis.memory_allowance``; None: any), or None."""
    if allowance is None or stacked_bytes <= allowance:
        return None
    return (f"its stacked copies would need est. {format_bytes(stacked_bytes)} of "
            f"temporary memory more than the plain program (budget +{format_bytes(allowance)})")

# Readers that take their operands' elementwise computation into their own kernel (XLA's
# input fusion): reductions, and everything that launches no kernel of its own.
_FUSING_READERS = frozenset(
    name for name in _primitives.COST_ONE_KERNEL
    if name.startswith(("reduce_", "argmax", "argmin"))) | _primitives.MAY_FUSE_AWAY

# Kernels that fill the GPU: packed one after another even in ``concurrent_regions``.
_SERIAL = _primitives.SERIAL_KERNELS | _primitives.MAY_BRANCH_OR_LOOP

# Views that make more elements than they read: written to memory where a loop holds them.
_EXPANDING = frozenset({_primitives.BROADCAST_IN_DIM, _primitives.IOTA})


def _primitive_name(eqn: JaxprEqn) -> str:
    return str(eqn.primitive.name)


# How XLA orders buffers for assignment in a CUDA-graph mode (``_ordering``).
_SEQUENTIAL, _REGIONS, _CONCURRENT = "sequential", "regions", "dependency"
_LARGEST = "largest buffer"  # the memo's entry for a level's largest buffer (``least_bytes``)


def _ordering(mode: CommandBufferMode | None) -> str:
    if mode is CommandBufferMode.CONCURRENT:
        return _CONCURRENT
    if mode is CommandBufferMode.CONCURRENT_REGIONS:
        return _REGIONS
    return _SEQUENTIAL


@dataclasses.dataclass(frozen=True, slots=True)
class _Need:
    """What one level (or one equation's nested computation) needs: ``peak`` bytes at
    once in its ordering, ``carried`` bytes of loop state copied beside it."""

    peak: float
    carried: float = 0.0

    @property
    def total(self) -> float:
        return self.peak + self.carried


def _materialized(eqns: Sequence[JaxprEqn], kinds: Sequence[str],
                  fuses_operands: Any) -> tuple[set[Any], set[Any]]:
    """Which results of a level XLA writes to memory beyond kernels' and nested
    computations' (decided last reader first): fused work some reader needs in memory
    (``needed``), and broadcasts a loop holds as its state (``expanded``)."""
    literal = _compat.Literal
    needed: set[Any] = set()
    expanded: set[Any] = set()
    for index in range(len(eqns) - 1, -1, -1):
        eqn, kind = eqns[index], kinds[index]
        reads = [v for v in eqn.invars if not isinstance(v, literal)]
        if kind == "view":
            # A view reads its operand's memory where its own readers need it; one that
            # does not expand (a reshape) passes a loop's holding on, too.
            if any(v in needed for v in eqn.outvars):
                needed.update(reads)
            if _primitive_name(eqn) not in _EXPANDING and any(
                    v in expanded for v in eqn.outvars):
                expanded.update(reads)
            continue
        if _primitive_name(eqn) in _primitives.MAY_BRANCH_OR_LOOP:
            # A loop's (or cond's) operands are its state: XLA writes what it reads to
            # memory, a broadcast included (a scan over ``broadcast_to(x, (n, ...))``
            # materialises it, 381 MiB at 10,000 x 100 x 100, deviceless H200).
            expanded.update(reads)
        if kind == "buffer" and not fuses_operands(eqn):
            needed.update(reads)
        elif kind == "fused" and any(v in needed for v in eqn.outvars):
            needed.update(reads)  # materialized itself: its kernel reads its operands
    return needed, expanded


class _Buffers:
    """The buffers of one level: each one's bytes, the equation that makes it and those
    that read it, and what each equation needs while it runs."""

    def __init__(self, count: int):
        self.count = count
        self.size: dict[Any, float] = {}
        self.made_at: dict[Any, int] = {}
        self.read_at: dict[Any, set[int]] = {}
        self.late: set[Any] = set()  # written right before their first reader
        self.transient = [0.0] * count

    def trace(self, jaxpr: Any, kinds: Sequence[str], needed: set[Any], expanded: set[Any],
              transient: Any) -> None:
        """Walks the level: a buffer is live from its equation to its last reader; a
        view or fused work passes its readers on to the buffers it reads."""
        literal = _compat.Literal
        eqns = jaxpr.eqns
        outputs = {v for v in jaxpr.outvars if not isinstance(v, literal)}
        roots: dict[Any, frozenset[Any]] = {}  # the buffers reading v reads
        # A broadcast a loop holds: what a reader other than a loop reads instead of its
        # buffer (it takes the broadcast into its own kernel, reading the operand).
        recomputed: dict[Any, frozenset[Any]] = {}
        made_by: dict[Any, int] = {}  # the equation making v
        empty: frozenset[Any] = frozenset()
        for index, (eqn, kind) in enumerate(zip(eqns, kinds, strict=True)):
            reads: frozenset[Any] = empty
            loop = _primitive_name(eqn) in _primitives.MAY_BRANCH_OR_LOOP
            for v in eqn.invars:
                if not isinstance(v, literal):
                    found = roots.get(v, empty) if loop or v not in recomputed \
                        else recomputed[v]
                    if found:
                        reads = reads | found
            for r in reads:
                self.read_at[r].add(index)
            for v in eqn.outvars:
                made_by[v] = index
            late = kind == "view" and _primitive_name(eqn) in _EXPANDING and any(
                v in expanded for v in eqn.outvars)
            if not (kind == "buffer" or ((kind == "fused" or late) and any(
                    v in needed or v in expanded for v in eqn.outvars))):
                for v in eqn.outvars:  # a view or fused work: its reader reads its reads
                    roots[v] = reads
                continue
            if kind == "buffer":
                self.transient[index] = transient(eqn)
            self._allocate(eqn, index, outputs, roots, recomputed, reads, late)
        for v in jaxpr.outvars:  # an output computed by fused work reads its roots there
            if not isinstance(v, literal) and v in made_by:
                for r in roots.get(v, empty):
                    self.read_at[r].add(made_by[v])

    def _allocate(self, eqn: Any, index: int, outputs: set[Any],
                  roots: dict[Any, frozenset[Any]], recomputed: dict[Any, frozenset[Any]],
                  reads: frozenset[Any], late: bool) -> None:
        """``trace``'s buffers for the results of equation ``index``, which reads the
        buffers ``reads`` (``late``: a broadcast a loop holds)."""
        empty: frozenset[Any] = frozenset()
        for v in eqn.outvars:
            if _compat.is_drop_var(v):
                continue
            if v in outputs:
                roots[v] = empty
                continue
            roots[v] = frozenset((v,))
            self.size[v] = float(_compat.aval_nbytes(v.aval))
            self.made_at[v] = index
            self.read_at[v] = set()
            if late:
                # A broadcast a loop holds is written right before the loop (it reads
                # only its operand, which outlives it: XLA schedules it there).
                self.late.add(v)
                recomputed[v] = reads

    def peak(self, windows: Sequence[tuple[int, int]] = (),
             order: Sequence[int] | None = None) -> float:
        """The most bytes live at once with the equations run in ``order`` (default the
        level's), each buffer made in one of ``windows`` (equations run side by side, in
        the level's order) live across the whole window."""
        position = list(range(self.count))
        if order is not None:
            for at, index in enumerate(order):
                position[index] = at
        begin: dict[Any, int] = {}
        end: dict[Any, int] = {}
        for v, made in self.made_at.items():
            reads = [position[r] for r in self.read_at[v]]
            begin[v] = min(reads) if v in self.late and reads else position[made]
            end[v] = max([begin[v], *reads])
        window_of = {}
        for first, final in windows:
            for index in range(first, final + 1):
                window_of[index] = (first, final)
        if window_of:
            for v, made in self.made_at.items():
                window = window_of.get(made)
                if window is not None:
                    begin[v] = min(begin[v], window[0])
                    end[v] = max(end[v], window[1])
        allocated = [0.0] * (self.count + 1)
        freed = [0.0] * (self.count + 1)
        for v, nbytes in self.size.items():
            allocated[begin[v]] += nbytes
            freed[end[v]] += nbytes
        transient = [0.0] * self.count
        for index, needs in enumerate(self.transient):
            transient[position[index]] = needs
        live = peak = 0.0
        for at in range(self.count):
            live += allocated[at]
            peak = max(peak, live + transient[at])
            live -= freed[at]
        return peak


def _late_order(eqns: Sequence[JaxprEqn], outvars: Sequence[Any]) -> list[int] | None:
    """The level's equations in a depth-first order from its outputs, each made right
    before its first reader (how XLA's DFS memory scheduler orders a program), or None
    where equations with effects must keep the level's order."""
    if any(eqn.effects for eqn in eqns):
        return None
    literal = _compat.Literal
    made_by = {v: index for index, eqn in enumerate(eqns) for v in eqn.outvars}
    order: list[int] = []
    seen: set[int] = set()
    roots = [made_by[v] for v in outvars if not isinstance(v, literal) and v in made_by]
    roots += range(len(eqns))  # what no output reads, where it stood
    for root in roots:
        stack = [(root, False)]
        while stack:
            index, expanded = stack.pop()
            if expanded:
                order.append(index)
                continue
            if index in seen:
                continue
            seen.add(index)
            stack.append((index, True))
            producers = [made_by[v] for v in eqns[index].invars
                         if not isinstance(v, literal) and v in made_by]
            stack.extend((p, False) for p in reversed(producers) if p not in seen)
    return order


class MemoryModel:
    """Temporary bytes of jaxprs, memoised per level and ordering (one per call)."""

    def __init__(self, costs: CostModel, memo: IdentityMemo[Any, Any] | None = None):
        self.costs = costs
        self._memo: IdentityMemo[Any, Any] = IdentityMemo() if memo is None else memo

    def temp_bytes(self, jaxpr: JaxprLike, mode: CommandBufferMode | None,
                   sections: Sequence[Iterable[int]] = ()) -> float:
        """Estimated peak temporary bytes of ``jaxpr`` compiled in ``mode`` (None: off the
        GPU, a sequential ordering), with ``sections`` (top-level equation indices per
        stream section) running beside the rest."""
        inner, _ = _compat.open_jaxpr(jaxpr)
        spans = []
        for section in sections:
            members = sorted(section)
            if members:
                spans.append((members[0], members[-1]))
        return self._level(inner, _ordering(mode), tuple(spans)).total

    def least_bytes(self, jaxpr: JaxprLike) -> float:
        """Temporary bytes any compile of ``jaxpr`` surely holds at some point: its top
        level's largest buffer (a lower bound of ``temp_bytes``, which may overestimate
        a program: it does not know every producer XLA fuses into its reader)."""
        inner, _ = _compat.open_jaxpr(jaxpr)
        found = self._memo.get(inner, extra=_LARGEST)  # the level's buffers, traced before
        if found is not None:
            return found  # type: ignore[no-any-return]
        kinds = [self._kind(eqn) for eqn in inner.eqns]
        needed, expanded = _materialized(inner.eqns, kinds, self._fuses_operands)
        buffers = _Buffers(len(inner.eqns))
        buffers.trace(inner, kinds, needed, expanded, lambda eqn: 0.0)
        return max(buffers.size.values(), default=0.0)

    def unrolled_copy_bytes(self, eqn: JaxprEqn) -> float:
        """Temporary bytes each unrolled copy of the ``scan`` ``eqn``'s body may add: the
        copies are one straight-line body to XLA's scheduler, which may interleave them,
        so a copy keeps every buffer of its body (not only its peak) and its carries.
        (Deviceless H200 compiles, jaxlib 0.10.2, each extra copy: a 256x256 tanh/sin
        body 1.0 MiB, all its buffers and carry 1.0 MiB, its peak 0.75 MiB; the GPU
        suite's GRU 1.25 MiB, all its buffers 1.4 MiB, its peak 0.66 MiB.)"""
        info = _compat.scan_info(eqn)
        carries, xs, ys = _trip_bytes(eqn, info)  # and its slices of the trip's blocks
        return self._nested(info.jaxpr, _CONCURRENT).total + carries + xs + ys

    def _nested(self, jaxpr: JaxprLike, ordering: str) -> _Need:
        return self._memo.lookup(  # type: ignore[no-any-return]
            jaxpr, lambda: self._level(_compat.open_jaxpr(jaxpr)[0], ordering, ()),
            extra=ordering)

    def _transient(self, eqn: JaxprEqn, ordering: str) -> float:
        """Bytes ``eqn`` needs while it runs, beyond its operands and results."""
        name = eqn.primitive.name
        if name == _primitives.DOT_GENERAL:
            return split_k_bytes(eqn)
        if name == _primitives.SCAN:
            info = _compat.scan_info(eqn)
            body = self._nested(info.jaxpr, ordering)
            carries, xs, ys = _trip_bytes(eqn, info)
            copies = max(1, min(info.unroll, info.length))
            hoisted = _transposed_xs(eqn, info)
            # JAX slices a trip's block of inputs at once and writes its block of stacked
            # results at once: both ``copies`` slices deep.
            blocks = copies * (xs + ys)
            if ordering != _SEQUENTIAL:  # a branching mode's body keeps its buffers apart
                return copies * body.total + blocks + carries + hoisted
            # Unrolled copies are one straight-line body to XLA's scheduler, which may
            # interleave them (``unrolled_copy_bytes``). A length the factor does not
            # divide makes JAX slice the scanned inputs apart: a copy of them.
            uneven = xs_total(eqn, info) if info.length % copies else 0.0
            return (body.total + blocks + carries + uneven + hoisted
                    + (copies - 1) * self.unrolled_copy_bytes(eqn))
        if name == _primitives.WHILE:
            body = self._nested(eqn.params["body_jaxpr"], ordering)
            condition = self._nested(eqn.params["cond_jaxpr"], ordering)
            carries = sum(_compat.aval_nbytes(v.aval) for v in eqn.outvars)
            if ordering != _SEQUENTIAL:
                return body.total + condition.total + carries
            return max(body.total, condition.total) + carries
        subs = self.costs.subjaxprs(eqn)
        if not subs:
            return 0.0
        if name.startswith("custom_"):  # the primal computation runs, not the rules
            subs = subs[:1]
        needs = [self._nested(sub, ordering).total for _, _, sub in subs]
        if ordering != _SEQUENTIAL:
            return sum(needs)
        return max(needs)

    def _level(self, jaxpr: Any, ordering: str, spans: tuple[tuple[int, int], ...]) -> _Need:
        eqns = jaxpr.eqns
        kinds = [self._kind(eqn) for eqn in eqns]
        needed, expanded = _materialized(eqns, kinds, self._fuses_operands)
        buffers = _Buffers(len(eqns))
        buffers.trace(jaxpr, kinds, needed, expanded,
                      lambda eqn: self._transient(eqn, ordering))
        # A buffer's bytes do not depend on the ordering: ``least_bytes`` reads them here.
        self._memo.set(jaxpr, max(buffers.size.values(), default=0.0), extra=_LARGEST)
        if ordering == _CONCURRENT:
            return _Need(sum(buffers.size.values()) + sum(buffers.transient))
        # XLA schedules for memory (it keeps the best of its schedulers, a depth-first one
        # among them): the level's order or a depth-first one from its outputs, whichever
        # needs less. (Stream sections keep the level's order: they are emitted so.)
        peak = buffers.peak(spans)
        late = None if spans else _late_order(eqns, jaxpr.outvars)
        if late is not None:
            peak = min(peak, buffers.peak(order=late))
        if ordering == _REGIONS:
            # XLA's regions follow its schedule, which the model does not know: any small
            # kernel's buffer may be kept apart from the others; the kernels that fill
            # the GPU (dots...) run and are packed one after another.
            peak += sum(buffers.size[v] for eqn, kind in zip(eqns, kinds, strict=True)
                        if kind != "view" and eqn.primitive.name not in _SERIAL
                        for v in eqn.outvars if v in buffers.size)
        return _Need(peak)

    def _kind(self, eqn: JaxprEqn) -> str:
        """``"view"`` (shape only), ``"fused"`` (elementwise: fused into its reader) or
        ``"buffer"`` (a kernel's or a nested computation's results)."""
        name = eqn.primitive.name
        if name in _primitives.COST_FREE:
            return "view"
        if self.costs.subjaxprs(eqn):
            return "buffer"
        if name in _primitives.MAY_FUSE_AWAY or not self.costs.launches(eqn):
            return "fused"
        return "buffer"

    @staticmethod
    def _fuses_operands(eqn: JaxprEqn) -> bool:
        return eqn.primitive.name in _FUSING_READERS
