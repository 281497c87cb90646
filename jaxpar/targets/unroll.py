"""A target's unroll rule: how ``unroll="cost"`` picks one scan's unroll factor there.

``passes/unroll_scans`` asks the target (``Target.unroll_rule``) for each static scan,
handing it a ``ScanQuery``: the scan, the caps the pass keeps on every target (the
copies the memory budget allows, those whose unrolled body stays within
``MAX_UNROLLED_EQNS`` equations) and the cost model's figures for it, the GPU model's
estimate of it unrolled among them. The rule answers an ``UnrollChoice``: the factor, the
block form or not, and why. Each target module holds its rule (``gpu.py``: the GPU
model's fastest; ``tpu.py``: blocks by the chip's measured figures); this module holds the
rule of thumb a target without one of its own uses (``rule_of_thumb``, the CPU's) and the
caps the rules share (``kept_rolled``, ``dividing``).

The rule of thumb, for a scan of length ``L`` whose body has ``E`` equations and ``K``
kernels per trip (``_model.cost.CostModel``):

* ``L <= FULL_UNROLL_LENGTH`` and ``L * E <= MAX_UNROLLED_EQNS``: unroll fully;
* otherwise ``k = ceil(KERNELS_PER_TRIP / max(K, 1))``, at most ``MAX_UNROLLED_EQNS / E``
  and ``L``;
* kept rolled where its copies may cost more kernels than its trips save (``kept_rolled``);
* within the copies the memory budget allows, and lowered to a factor dividing ``L``
  (``dividing``).

Example::

    def my_rule(scan: ScanQuery) -> UnrollChoice:
        factor = dividing(min(8, scan.most_by_size, scan.most_copies), scan.length)
        return UnrollChoice(factor, "auto: my chip's rule")

    Target(row, platform="npu", profile=..., unroll_rule=my_rule)

Sharp edges:
  * A rule sees one scan at a time, in the program the passes have made so far; a scan
    someone already unrolled, or one already read by blocks, never reaches it.
  * ``ScanQuery.unrolled_seconds`` is the GPU model's estimate (``_model.gpu_levels``); only a
    target priced by the GPU model (its profile has ``gpu``) may ask for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from .. import _compat
from .._compat import JaxprEqn

KERNELS_PER_TRIP = 8
FULL_UNROLL_LENGTH = 8


class ScanQuery(Protocol):
    """What an unroll rule may ask of one static scan (``passes/unroll_scans`` answers).

    Attributes:
      eqn: the ``scan`` equation.
      info: its parameters (``_compat.scan_info``).
      length: its trip count.
      body_eqns: its body's own equations (nested loops count once), at least 1.
      most_copies: the most unrolled copies of its body the memory budget allows.
      most_by_size: the most copies whose unrolled body stays within the passes'
        ``MAX_UNROLLED_EQNS`` equations (``MAX_UNROLLED_EQNS // body_eqns``).
      memory_budget: the memory budget's allowance, as plans write it (``+1.5 MiB``'s
        number).
    """

    eqn: JaxprEqn
    info: _compat.ScanInfo
    length: int
    body_eqns: int
    most_copies: int
    most_by_size: int
    memory_budget: str

    def body_kernels(self) -> float:
        """The kernels of one trip of its body (``CostModel.jaxpr_cost``)."""
        ...

    def invariant_prologues(self) -> int:
        """Loop-invariant operands of its body's kernels computed in the body
        (``CostModel.invariant_prologues``)."""
        ...

    def trip_kernels(self) -> float:
        """The tiny kernels a trip adds (``CostModel.scan_trip_kernels``)."""
        ...

    def unrolled_seconds(self, factor: int) -> float:
        """The GPU model's estimate of the scan unrolled by ``factor`` (``LevelModel.scan``,
        in the CUDA-graph mode the passes price in)."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class UnrollChoice:
    """A rule's answer: the factor (1: rolled), whether the scan is read by blocks of
    ``factor`` trips (``blocked``; False: ``lax.scan``'s own ``unroll``), and why (the
    decision's reason, before ``": unroll by k"``)."""

    factor: int
    why: str
    blocked: bool = False


UnrollRule = Callable[[ScanQuery], UnrollChoice]


def within_budget(scan: ScanQuery) -> str:
    """How the memory budget bounds the copies, as a reason says it."""
    return (f"at most {scan.most_copies} copies of the body within the memory budget "
            f"(+{scan.memory_budget})")


def dividing(factor: int, length: int) -> int:
    """The largest factor at most ``factor`` that divides ``length``: for another, JAX
    slices the scanned inputs apart, a copy of them all (deviceless H200: 10,000 trips
    unrolled by 3 copied two 381 MiB inputs)."""
    return max(k for k in range(1, max(factor, 1) + 1) if k == 1 or length % k == 0)


def kept_rolled(scan: ScanQuery, factor: int) -> str | None:
    """Why ``factor`` copies of the scan's body would cost more kernels than its saved
    trips, or None: rolled, a run launches ``L * (K + T)`` kernels; unrolled, at worst
    ``L * (K + P) + (L / k) * T`` (``P`` its invariant prologues: a weight's slice read by a
    dot, which XLA computes once for the rolled loop and not always for unrolled copies;
    ``T`` a trip's own kernels), so ``k`` copies pay only while ``P < (1 - 1/k) * T``. Since
    ``1 - 1/k`` grows with ``k``, no smaller factor pays where ``factor`` does not."""
    if factor <= 1:
        return None
    prologues = scan.invariant_prologues()
    if not prologues:
        return None
    trip = scan.trip_kernels()
    if prologues < (1.0 - 1.0 / factor) * trip:
        return None
    return (f"auto: kept rolled: its {factor} copies may each recompute {prologues} "
            f"loop-invariant operand(s) of its kernels (a weight's slice or transpose) "
            f"that the rolled loop computes once, more kernels than the "
            f"{(1.0 - 1.0 / factor) * trip:g} a trip's bookkeeping saves per copy")


def thumb_factor(scan: ScanQuery) -> int:
    """The factor the rule of thumb picks from the body's cost and the length, before
    ``kept_rolled`` and the memory budget (see the module docstring)."""
    length = scan.length
    if length <= 1:
        return 1
    if length <= FULL_UNROLL_LENGTH and length <= scan.most_by_size:
        return length
    factor = -(-KERNELS_PER_TRIP // max(round(scan.body_kernels()), 1))
    return max(min(factor, scan.most_by_size, length), 1)


def rule_of_thumb(scan: ScanQuery) -> UnrollChoice:
    """The rule of a target without a model of its loops (the CPU's): ``thumb_factor``,
    kept rolled (``kept_rolled``), within the copies the memory budget allows and lowered
    to a factor dividing the length."""
    factor = thumb_factor(scan)
    why = "auto: body cost and length"
    rolled = kept_rolled(scan, factor)
    if rolled is not None:
        factor, why = 1, rolled
    if scan.most_copies < factor:
        factor, why = scan.most_copies, f"auto: body cost and length, and {within_budget(scan)}"
    return UnrollChoice(dividing(factor, scan.length), why)
