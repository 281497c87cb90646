"""Memory model: the temporary bytes XLA:GPU allocates for a program, in a CUDA-graph mode.

jaxpar's rewrites and modes can raise a program's memory: a ``concurrent`` CUDA graph
makes XLA assign buffers by a dependency ordering, so independent temporaries are never
packed together (``xla/xla.proto``: the mode "may lead to OOMs"); batching stacks the
members' inputs into new arrays; unrolling keeps more of a loop body alive at once. The
planner compares the estimate of jaxpar's program in its mode with the plain program's in
the user's (``_plan.memory``) and keeps nothing that needs more than its budget.

The model of one jaxpr level, in the order of its equations (a program's equations
run in about that order; XLA's scheduler may reorder them):

* a **buffer** is a value XLA writes to memory: the result of an equation launching a
  kernel of its own that cannot take its operands' computation in (a dot, a convolution,
  a collective, a sort, a loop, a call), and of elementwise work read by such an equation.
  Elementwise work read only by other elementwise work or by a reduction is fused into
  its reader (no buffer; its reader reads its operands instead). Shape-only equations
  (reshape, broadcast, convert...) are views: they read their operand's buffers;
* the level's inputs and outputs are not temporaries (the program's arguments and
  results, or a loop's state, which its caller holds);
* **sequential** orderings (XLA's ``lhs`` and ``serialize`` modes, graphs ``off``): a
  buffer is live from its equation to its last reader; the peak is the most bytes live
  at once, plus what a nested computation needs while it runs (a loop's body, a call's
  body, a ``cond``'s dearest branch), plus a copy of each loop carry;
* **concurrent_regions**: kernels that XLA may run concurrently (small ones: no dot,
  convolution, library call or loop, at most ``CONCURRENT_REGION_BYTES`` read and written) form
  regions of consecutive equations, and the buffers of a region live from its first
  equation to its last (XLA's ``ConcurrentRegionsHloOrdering`` packs none of them
  together);
* **concurrent**: independent buffers are never packed, so the bound is the sum of every
  buffer of the level and of what its nested computations need (a loop body's buffers
  once per unrolled copy);
* the stream sections of a plan (``sections``: groups of equations running on other
  streams at once) keep their buffers live from the section's first equation to its last.

Example::

    model = MemoryModel(CostModel(device_profile("gpu")))
    model.temp_bytes(closed_jaxpr, CommandBufferMode.LHS)

Sharp edges:
  * A model of buffer assignment, not XLA's: it does not know XLA's schedule, its layout
    copies, library workspaces or which producers XLA fuses into a GEMM. It is meant to
    compare two programs of the same function (plain and jaxpar's), whose errors are
    alike; ``gpu_preview`` reports what the compile says (``memory_analysis()``).
  * ``concurrent`` is an upper bound (XLA may still pack buffers whose lifetimes are
    ordered by dependencies).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

from . import _compat, _primitives
from ._compat import JaxprEqn, JaxprLike
from ._cost import CostModel
from ._gpu_model import CONCURRENT_REGION_BYTES, CommandBufferMode
from ._memo import IdentityMemo

__all__ = ["MemoryModel", "format_bytes", "stacking_refusal"]


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

# How XLA orders buffers for assignment in a CUDA-graph mode (``_ordering``).
_SEQUENTIAL, _REGIONS, _CONCURRENT = "sequential", "regions", "dependency"


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

    def unrolled_copy_bytes(self, eqn: JaxprEqn) -> float:
        """Temporary bytes each unrolled copy of the ``scan`` ``eqn``'s body may add
        (its buffers and its carries), in a sequential ordering."""
        info = _compat.scan_info(eqn)
        carries = sum(_compat.aval_nbytes(v.aval) for v in eqn.outvars[:info.num_carry])
        return self._nested(info.jaxpr, _SEQUENTIAL).total + carries

    def _nested(self, jaxpr: JaxprLike, ordering: str) -> _Need:
        return self._memo.lookup(  # type: ignore[no-any-return]
            jaxpr, lambda: self._level(_compat.open_jaxpr(jaxpr)[0], ordering, ()),
            extra=ordering)

    def _transient(self, eqn: JaxprEqn, ordering: str) -> float:
        """Bytes ``eqn`` needs while it runs, beyond its operands and results."""
        name = eqn.primitive.name
        if name == _primitives.SCAN:
            info = _compat.scan_info(eqn)
            body = self._nested(info.jaxpr, ordering)
            carries = sum(_compat.aval_nbytes(v.aval)
                          for v in eqn.outvars[:info.num_carry])
            xs = sum(_compat.aval_nbytes(v.aval)
                     for v in _compat.open_jaxpr(info.jaxpr)[0].invars[
                         info.num_consts + info.num_carry:])
            copies = max(1, min(info.unroll, info.length))
            if ordering == _CONCURRENT:
                return copies * (body.total + xs) + carries
            # Unrolled copies are one straight-line body to XLA's scheduler, which may
            # interleave them: each copy may keep its buffers and carries (deviceless H200
            # compiles of two fused 256x256 scans: 1.3 MB plain, 2.6 MB unrolled twice,
            # 3.1 MB four times).
            return body.total + xs + carries + (copies - 1) * (body.total + carries)
        if name == _primitives.WHILE:
            body = self._nested(eqn.params["body_jaxpr"], ordering)
            condition = self._nested(eqn.params["cond_jaxpr"], ordering)
            carries = sum(_compat.aval_nbytes(v.aval) for v in eqn.outvars)
            if ordering == _CONCURRENT:
                return body.total + condition.total + carries
            return max(body.total, condition.total) + carries
        subs = self.costs.subjaxprs(eqn)
        if not subs:
            return 0.0
        if name.startswith("custom_"):  # the primal computation runs, not the rules
            subs = subs[:1]
        needs = [self._nested(sub, ordering).total for _, _, sub in subs]
        if ordering == _CONCURRENT:
            return sum(needs)
        return max(needs)

    def _level(self, jaxpr: Any, ordering: str, spans: tuple[tuple[int, int], ...]) -> _Need:
        eqns = jaxpr.eqns
        literal = _compat.Literal
        count = len(eqns)
        # Which results are buffers: kernels' and nested computations' results, and
        # fusible results some reader needs in memory (decided last reader first).
        needed: set[Any] = set()
        buffer_of_eqn: list[bool] = []
        for eqn in eqns:
            kind = self._kind(eqn)
            buffer_of_eqn.append(kind == "buffer")
        for index in range(count - 1, -1, -1):
            eqn = eqns[index]
            kind = self._kind(eqn)
            if kind == "view":
                # A view reads its operand's memory where its own readers need it.
                if any(v in needed for v in eqn.outvars):
                    needed.update(v for v in eqn.invars if not isinstance(v, literal))
                continue
            if kind == "buffer" and not self._fuses_operands(eqn):
                needed.update(v for v in eqn.invars if not isinstance(v, literal))
            elif kind == "fused" and any(v in needed for v in eqn.outvars):
                # Materialized itself; its operands are read by its kernel.
                needed.update(v for v in eqn.invars if not isinstance(v, literal))
        outputs = {v for v in jaxpr.outvars if not isinstance(v, literal)}
        # roots[v]: the buffers reading v reads (v itself for a buffer).
        roots: dict[Any, frozenset[Any]] = {}
        size: dict[Any, float] = {}
        defined_at: dict[Any, int] = {}
        last: dict[Any, int] = {}
        transient = [0.0] * count
        empty: frozenset[Any] = frozenset()
        for index, eqn in enumerate(eqns):
            kind = self._kind(eqn)
            reads: frozenset[Any] = empty
            for v in eqn.invars:
                if not isinstance(v, literal):
                    found = roots.get(v, empty)
                    if found:
                        reads = reads | found
            for r in reads:
                last[r] = index
            if kind == "buffer" or (kind == "fused" and
                                    any(v in needed for v in eqn.outvars)):
                transient[index] = self._transient(eqn, ordering) if kind == "buffer" else 0.0
                for v in eqn.outvars:
                    if _compat.is_drop_var(v):
                        continue
                    if v in outputs:
                        roots[v] = empty
                        continue
                    roots[v] = frozenset((v,))
                    size[v] = float(_compat.aval_nbytes(v.aval))
                    defined_at[v] = last[v] = index
            else:  # a view or fused elementwise work: its reader reads its operands
                for v in eqn.outvars:
                    roots[v] = reads
        for v in jaxpr.outvars:  # an output computed by fused work reads its roots last
            if not isinstance(v, literal):
                for r in roots.get(v, empty):
                    last[r] = max(last.get(r, 0), defined_at.get(r, 0))
        if ordering == _CONCURRENT:
            return _Need(sum(size.values()) + sum(transient))
        begin = dict(defined_at)
        end = dict(last)
        windows = list(spans)
        if ordering == _REGIONS:
            windows += self._regions(eqns)
        if windows:
            window_of = {}
            for first, final in windows:
                for index in range(first, final + 1):
                    window_of[index] = (first, final)
            for v, at in defined_at.items():
                window = window_of.get(at)
                if window is not None:
                    begin[v] = min(begin[v], window[0])
                    end[v] = max(end[v], window[1])
        allocated = [0.0] * (count + 1)
        freed = [0.0] * (count + 1)
        for v, nbytes in size.items():
            allocated[begin[v]] += nbytes
            freed[end[v]] += nbytes
        live = peak = 0.0
        for index in range(count):
            live += allocated[index]
            peak = max(peak, live + transient[index])
            live -= freed[index]
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

    def _small(self, eqn: JaxprEqn) -> bool:
        """Whether ``eqn`` launches only kernels XLA may run concurrently: none that fills
        the GPU (``_primitives.SERIAL_KERNELS``), no loop or cond; a call by its body."""
        name = eqn.primitive.name
        if name in _primitives.SERIAL_KERNELS or name in _primitives.MAY_BRANCH_OR_LOOP:
            return False
        return all(self._memo.lookup(sub, lambda sub=sub: all(
            self._small(inner) for inner in _compat.open_jaxpr(sub)[0].eqns), extra="small")
            for _, _, sub in self.costs.subjaxprs(eqn))

    @staticmethod
    def _fuses_operands(eqn: JaxprEqn) -> bool:
        return eqn.primitive.name in _FUSING_READERS

    def _regions(self, eqns: Sequence[JaxprEqn]) -> list[tuple[int, int]]:
        """Runs of consecutive small kernels XLA's ``CONCURRENT_REGIONS`` ordering keeps
        apart (see the module docstring), as ``(first, last)`` equation indices."""
        found: list[tuple[int, int]] = []
        start = previous = -1
        for index, eqn in enumerate(eqns):
            kind = self._kind(eqn)
            if kind != "buffer":
                continue  # views and fused work join whatever kernel reads them
            small = (self._small(eqn)
                     and self.costs.eqn_cost(eqn).bytes <= CONCURRENT_REGION_BYTES)
            if small:
                if start < 0:
                    start = index
                previous = index
            else:
                if start >= 0 and previous > start:
                    found.append((start, previous))
                start = -1
        if start >= 0 and previous > start:
            found.append((start, previous))
        return found
