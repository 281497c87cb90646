"""The TPU model: what a TPU chip's measured figures (a ``TpuProfile``) say of a loop, and
the loop decisions they price. Each TPU target module holds its chip's figures (``tpu.py``:
``TPU_V5E``, measured on a TPU v5e); this module is the code they share.

A TPU core runs one program, one operation after another (JAX's Pallas TPU docs: "TPUs
are sequential machines"; only DMA, MXU and XLU work runs in the background), and a loop's
control stays on the chip (jax#7024). What a loop trip costs beyond its body is therefore
a fixed part: the trip's own control and, above all, fetching each scanned input's slice
and writing each output's, whose latency a small body cannot hide. Measured on a TPU v5e
(``benchmarks/calibrate_tpu.py``; figures and conditions in ``tpu.TPU_V5E``): a trip of a
tiny body with one input and one output costs 1.66 us rolled, 0.66 us read by blocks of 40
(``unroll_scans``' block form); a 100x100 matmul's latency is 0.1 us and a batched one of
8 members costs 0.27 us more.

``block_factor`` decides per ``scan`` whether to read its inputs by blocks and how many
trips a block holds:

* only where the body is small beside the trip's fixed part (``body <= fixed``): a
  larger body hides the slices' latency behind its own work, and unrolling it gained
  nothing on the chip (a bidirectional GRU, x0.98-1.04);
* never where the loop carries large arrays (``LARGE_CARRY_BYTES``): unrolling LSTM
  gradients, which carry 1-2 MiB of weight gradients, made them x1.2-1.8 slower on the
  chip (a precaution: a synthetic 2 MiB accumulator alone did not slow down);
* never where the body divides integers (an integer ``div`` or ``rem``: ``//`` and ``%``
  of integer arrays, and what is built on them, such as ``jax.random.randint`` or an index
  taken modulo a length): a 32x32 matmul loop stepping an ``int32`` counter with
  ``(k * 3 + 1) % 1000`` ran x1.11-1.13 slower read by blocks of 8, 16 or 40, while the
  same loop with ``k + 1`` ran x0.92-0.94 (measured on the chip). A precaution beyond
  what was measured: only that carried counter was timed, and every integer division in
  a body keeps its loop rolled (``jax.jit``'s program, never slower);
* the largest factor up to ``TpuProfile.block_limit`` that divides the length (so no
  input is copied apart), keeps the unrolled body under ``MAX_BLOCK_EQNS`` equations
  (nested loops' bodies counted as many times as they are unrolled: blocks of blocks)
  and the copies within the memory budget; a length with no such divisor is unrolled by
  ``lax.scan``'s own ``unroll``; below ``MIN_FACTOR`` (8) the loop stays rolled (blocks of
  2 and 4 gained little and made gradient loops x1.02-1.04 slower).

Example::

    from jaxpar.targets.tpu import TPU_V5E

    choice = block_factor(scan_eqn, TPU_V5E)
    choice.factor, choice.reason      # 40, "fixed part 1.4 us of a 1.7 us trip: ..."

Sharp edges:
  * The built-in figures are one chip's (v5e, one core, jax 0.10.2): another TPU
    generation without a module of its own is planned with them (the ``tpu`` target covers
    every TPU its platform matches; ``TPU_V5E.measured`` says so in plans), and its module
    (``targets/tpu_v6e.py``, say) declares its own ``TpuProfile`` and ``device_kinds``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import numpy as np

from .. import _compat
from .._compat import JaxprEqn
from .._program import primitives as _primitives


@dataclasses.dataclass(frozen=True, slots=True)
class TpuProfile:
    """Measured figures of one TPU chip (seconds unless named otherwise).

    Attributes:
      chip: the device kind JAX reports.
      measured: where and when the figures were measured, as plans quote it.
      trip_s: one trip of a loop with a tiny body and no scanned inputs, rolled.
      slice_s: reading one scanned input's slice in a rolled trip (a 100x100 float32).
      slice_bandwidth: the bytes per second beyond ``slice_s`` for larger slices.
      write_s: writing one output's slice (``ys``) in a rolled trip.
      dot_s: the latency of one dependent small matmul (n <= 128).
      batched_dot_extra_s: what each further member of a batched small matmul adds.
      transcendental_s_per_element: ``sin``, ``cos`` and the vector unit's other
        polynomial functions, per element.
      block_ratios: a tiny loop's time per trip read by blocks of K trips, over rolled.
      block_limit: the largest block factor chosen (gains flatten beyond it, compiles grow).
      copy_bandwidth: bytes per second of a copy (read and write).
      peak_flops: a large matmul's flops per second (bfloat16, JAX's default precision).
      hbm_bandwidth: the chip's memory bandwidth, bytes per second (its specification).
      hbm_bytes: the chip's memory, bytes (its specification): the memory budget's floor
        is a share of it (``_options.MemoryBudget``).
    """

    chip: str
    measured: str
    trip_s: float
    slice_s: float
    slice_bandwidth: float
    write_s: float
    dot_s: float
    batched_dot_extra_s: float
    transcendental_s_per_element: float
    block_ratios: tuple[tuple[int, float], ...]
    block_limit: int
    copy_bandwidth: float
    peak_flops: float
    hbm_bandwidth: float
    hbm_bytes: float

    def block_ratio(self, factor: int) -> float:
        """The measured fixed-part ratio at ``factor`` (interpolated between the
        factors measured; 1.0 at 1)."""
        points = [(1, 1.0), *self.block_ratios]
        for (k0, r0), (k1, r1) in itertools.pairwise(points):
            if k0 <= factor <= k1:
                return r0 + (r1 - r0) * (factor - k0) / (k1 - k0)
        return points[-1][1]


# Loops carrying more than this many bytes (a gradient's accumulators) stay rolled, a
# precaution: on the chip lax.scan's unroll by 2-8 made LSTM gradients (1-2 MiB of weight
# gradients carried) x1.2-1.8 slower, though a synthetic 2 MiB accumulator alone ran
# faster unrolled (calibration: 1.57 us a trip rolled, 0.75 read by blocks of 8); loops
# carrying up to 80 KiB gained 40-70%.
LARGE_CARRY_BYTES = 512 * 1024
# The smallest factor read by blocks: smaller ones saved little and lost on the chip.
MIN_FACTOR = 8
# What each slice after the first adds to a trip's latency, as a share of ``slice_s`` (an
# assumption: the DMAs of one trip overlap).
_FURTHER_SLICE = 0.15
# At most this many equations in an unrolled body (``passes._loop_candidates.MAX_UNROLLED_EQNS``'s
# role for the block form: compile time grows with the body).
MAX_BLOCK_EQNS = 640
# Elementwise functions the vector unit computes as polynomials (on a TPU v5e a 100x100
# ``sin`` took 0.33 us); ``exp``, ``tanh``, ``logistic``, ``log`` and the square roots run on
# the transcendental unit beside it and cost about nothing (a 100x100 ``tanh`` under 0.04 us).
_VECTOR_POLYNOMIALS = frozenset({"sin", "cos", "tan", "erf", "erf_inv", "erfc", "atan2",
                                 "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh",
                                 "atanh", "lgamma", "digamma", "igamma", "pow", "cbrt"})
# Operations that run as a step of their own (not fused into a neighbour): their latency.
_OWN_STEP = frozenset({_primitives.DOT_GENERAL, _primitives.CONV})


@dataclasses.dataclass(frozen=True, slots=True)
class BlockChoice:
    """``block_factor``'s answer: the factor (1: rolled), whether it is the block form
    (``blocked``; False: ``lax.scan``'s own ``unroll``), the estimated time per trip rolled
    and at the factor, and why."""

    factor: int
    blocked: bool
    rolled_s: float
    chosen_s: float
    reason: str


def body_seconds(eqn: JaxprEqn, profile: TpuProfile) -> float:
    """The estimated time of one trip of the ``scan`` ``eqn``'s body, without its fixed
    part: each matmul's or convolution's latency (``dot_s``, and its flops beyond it at
    ``peak_flops``), each other non-fused operation's (a reduction, a gather: a third of a
    matmul's), the vector unit's polynomial functions by element, and nested loops' bodies
    and fixed parts times their trips. Elementwise work fused beside them is free, as on the
    chip."""
    return _jaxpr_seconds(_compat.scan_info(eqn).jaxpr, profile)


def _jaxpr_seconds(jaxpr: Any, profile: TpuProfile) -> float:
    inner, _ = _compat.open_jaxpr(jaxpr)
    total = 0.0
    for eqn in inner.eqns:
        name = eqn.primitive.name
        if name == _primitives.SCAN:
            info = _compat.scan_info(eqn)
            total += info.length * (_jaxpr_seconds(info.jaxpr, profile)
                                    + fixed_seconds(eqn, profile))
        elif name in _OWN_STEP:
            total += profile.dot_s + _flops(eqn) / profile.peak_flops
        elif name in _primitives.COST_ONE_KERNEL:
            total += profile.dot_s / 3
        elif name in _VECTOR_POLYNOMIALS:
            total += profile.transcendental_s_per_element * sum(
                _compat.aval_size(v.aval) for v in eqn.outvars)
        else:
            nested = [j for _, _, j in _compat.eqn_subjaxprs(eqn)]
            if name == _primitives.COND and nested:
                total += max(_jaxpr_seconds(j, profile) for j in nested)
            else:
                total += sum(_jaxpr_seconds(j, profile) for j in nested)
    return total


def _flops(eqn: JaxprEqn) -> float:
    """A matmul's or convolution's multiply-adds, twice: its outputs times what each
    contracts (the operands' elements over the output's, for a convolution roughly)."""
    out = sum(_compat.aval_size(v.aval) for v in eqn.outvars)
    if eqn.primitive.name == _primitives.DOT_GENERAL:
        (contract, _), _ = eqn.params["dimension_numbers"]
        shape = _compat.array_aval(eqn.invars[0]).shape
        return 2.0 * out * math.prod(shape[d] for d in contract)
    rhs = _compat.aval_size(eqn.invars[1].aval)
    return 2.0 * out * rhs / max(_compat.array_aval(eqn.invars[1]).shape[0], 1)


def fixed_seconds(eqn: JaxprEqn, profile: TpuProfile) -> float:
    """The fixed part of one rolled trip of the ``scan`` ``eqn``: its control, each
    scanned input's slice read and each output's slice written (their latency and their
    bytes)."""
    return fixed_latency(eqn, profile) + _slice_bytes(eqn) / profile.slice_bandwidth


def fixed_latency(eqn: JaxprEqn, profile: TpuProfile) -> float:
    """The part of a trip's fixed part that reading by blocks saves: the trip's control and
    each slice's latency, not the bytes the slices move (those move either way)."""
    info = _compat.scan_info(eqn)
    ins = len(eqn.invars) - info.num_consts - info.num_carry
    outs = len(eqn.outvars) - info.num_carry
    # A trip's slices are fetched (and its outputs written) side by side: one latency
    # each way, and a little more per further slice.
    return (profile.trip_s + (profile.slice_s if ins else 0.0)
            + (profile.write_s if outs else 0.0)
            + _FURTHER_SLICE * profile.slice_s * (max(ins - 1, 0) + max(outs - 1, 0)))


def _slice_bytes(eqn: JaxprEqn) -> float:
    info = _compat.scan_info(eqn)
    carried = info.num_consts + info.num_carry
    moved = [*eqn.invars[carried:], *eqn.outvars[info.num_carry:]]
    return sum(_compat.aval_nbytes(a.aval) for a in moved) / max(info.length, 1)


def carried_bytes(eqn: JaxprEqn) -> float:
    info = _compat.scan_info(eqn)
    return float(sum(_compat.aval_nbytes(a.aval)
                     for a in eqn.invars[info.num_consts:info.num_consts + info.num_carry]))


def block_factor(eqn: JaxprEqn, profile: TpuProfile, most: int | None = None) -> BlockChoice:
    """How the ``scan`` ``eqn`` should run on this TPU (see the module docstring);
    ``most``: the most unrolled copies the memory budget allows."""
    info = _compat.scan_info(eqn)
    length = info.length
    body = body_seconds(eqn, profile) + _slice_bytes(eqn) / profile.slice_bandwidth
    fixed = fixed_latency(eqn, profile)
    rolled = body + fixed
    if length <= 1:
        return BlockChoice(1, False, rolled, rolled, "one trip")
    carried = carried_bytes(eqn)
    if carried > LARGE_CARRY_BYTES:
        return BlockChoice(1, False, rolled, rolled, (
            f"kept rolled: it carries {carried / 2**20:.1f} MiB, which unrolled trips may "
            f"copy (on a TPU v5e unrolling LSTM gradients, which carry 1-2 MiB, made them "
            f"x1.2-1.8 slower)"))
    if divides_integers(info.jaxpr):
        return BlockChoice(1, False, rolled, rolled, (
            "kept rolled: its body divides integers (an integer // or %, as in "
            "jax.random.randint or a modular index): a loop stepping an integer with % ran "
            "x1.11-1.13 slower read by blocks on a TPU v5e"))
    if body > fixed:
        return BlockChoice(1, False, rolled, rolled, (
            f"kept rolled: its body (est. {body * 1e6:.2f} us, with its slices' bytes) hides "
            f"a trip's control and slice latency (est. {fixed * 1e6:.2f} us)"))
    body_eqns = max(unrolled_eqns(info.jaxpr), 1)
    limit = min(profile.block_limit, max(1, MAX_BLOCK_EQNS // body_eqns), length)
    bound = "the unrolled body's size limit"
    if most is not None and most < limit:
        limit, bound = max(most, 1), "the copies the memory budget allows"
    divisors = [k for k in range(2, limit + 1) if length % k == 0]
    if divisors:
        factor, blocked = max(divisors), True
    else:
        factor, blocked = min(limit, length), False
    # Where the best divisor is far below the limit (a length of 2 x prime), lax.scan's
    # own unroll at the limit reads more trips per slice of control.
    if blocked and factor * 4 < limit:
        factor, blocked = limit, False
    if factor < MIN_FACTOR:
        return BlockChoice(1, False, rolled, rolled, (
            f"kept rolled: no factor of {MIN_FACTOR} or more within {bound} (on a TPU v5e "
            "blocks of 2 and 4 made gradient loops x1.02-1.04 slower)"))
    chosen = body + fixed * profile.block_ratio(factor)
    how = (f"read by blocks of {factor} trips" if blocked
           else f"unrolled by {factor} (lax.scan's unroll: {length} has no divisor "
                f"up to {limit})")
    return BlockChoice(factor, blocked, rolled, chosen, (
        f"{how}: a trip's control and slice latency (est. {fixed * 1e6:.2f} us) outweighs "
        f"its body (est. {body * 1e6:.2f} us, with its slices' bytes); est. {rolled * 1e6:.2f} -> "
        f"{chosen * 1e6:.2f} us a trip, {profile.measured}"))


def divides_integers(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (or a jaxpr nested in it) divides integers: a ``div`` or ``rem``
    of an integer result."""
    inner, _ = _compat.open_jaxpr(jaxpr)
    for eqn in inner.eqns:
        if eqn.primitive.name in _primitives.DIVISIONS and any(
                (dtype := getattr(v.aval, "dtype", None)) is not None
                and jax.dtypes.issubdtype(dtype, np.integer)
                for v in eqn.outvars):
            return True
        if any(divides_integers(j) for _, _, j in _compat.eqn_subjaxprs(eqn)):
            return True
    return False


def unrolled_eqns(jaxpr: Any) -> int:
    """The equations of ``jaxpr`` once compiled: those of the jaxprs nested in its equations
    too, a nested scan's body as many times as it is unrolled (a scan already read by
    blocks holds its copies in its body), so that block factors of nested loops do not
    multiply past ``MAX_BLOCK_EQNS``."""
    inner, _ = _compat.open_jaxpr(jaxpr)
    total = 0
    for eqn in inner.eqns:
        copies = max(_compat.scan_info(eqn).unroll, 1) \
            if eqn.primitive.name == _primitives.SCAN else 1
        total += 1 + copies * sum(unrolled_eqns(j) for _, _, j in _compat.eqn_subjaxprs(eqn))
    return total


def as_dict(profile: TpuProfile) -> dict[str, Any]:
    out = dataclasses.asdict(profile)
    out["block_ratios"] = [list(pair) for pair in profile.block_ratios]
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in out.items()}
