"""Choose an unroll factor for every static scan.

A GPU pays a fixed cost per loop trip (the trip-count check, and one launch per
kernel of the body), so a long scan of a tiny body is launch-bound; unrolling
by ``k`` lets XLA fuse ``k`` bodies' elementwise work and cuts the trips by
``k``. The scan's ``unroll`` parameter is changed and nothing else: the trip
count stays known to XLA (no ``while`` without a trip count is ever made).

``unroll="auto"`` on target ``"gpu"`` prices each scan of length ``L`` unrolled by each of
``PRICED_FACTORS`` (1, 2, 4, 8, 16; and ``L`` when ``L <= FULL_UNROLL_LENGTH``), each lowered
to the caps below, with the GPU model the plan's estimate uses (``_gpu_levels.LevelModel``
in the CUDA-graph mode the passes price in), and keeps the fastest (ties: the smaller).
Where no GPU model prices it (``unroll="cost"`` on another target), a rule of thumb for a
body of ``E`` equations and ``K`` kernels per trip (``_cost.CostModel``) decides instead:

* ``L <= FULL_UNROLL_LENGTH`` and ``L * E <= MAX_UNROLLED_EQNS``: unroll fully;
* otherwise ``k = ceil(KERNELS_PER_TRIP / max(K, 1))``.

The caps, of either:

* ``k * E <= MAX_UNROLLED_EQNS`` and ``k <= L``;
* kept rolled where its copies may cost more kernels than its trips save: with ``P``
  loop-invariant operands of the body's kernels computed in the body
  (``CostModel.invariant_prologues``: a weight's slice read by a dot, which XLA computes
  once for the rolled loop and not always for unrolled copies) and ``T`` tiny kernels a
  trip adds (``CostModel.scan_trip_kernels``), ``k`` copies pay only while
  ``P < (1 - 1/k) * T``;
* a scan whose unroll factor is already not 1 was chosen by someone (the user,
  or an earlier run of this pass) and is left alone;
* at most as many copies as three quarters of the memory budget allow
  (``Analysis.memory_allowance``, ``UNROLL_SHARE``): XLA's scheduler may interleave
  unrolled copies, each keeping its buffers and carries alive
  (``_memory.MemoryModel.unrolled_copy_bytes``);
* a factor that divides ``L`` (the largest at most the one above): for another, JAX
  slices the scanned inputs apart, copying them all.

On target ``"tpu"``, ``unroll="auto"`` is priced with the TPU's measured figures instead
(``_tpu_model.block_factor``): a scan whose body is small beside a trip's fixed part (its
control, reading each scanned input's slice, writing each output's) and which carries no
large arrays is read by blocks of ``K`` trips: one scan over ``L / K`` blocks whose body
runs ``K`` trips on static slices of the block, so each input is fetched once a block
(``_block_emitter``); ``K`` divides ``L``. On a TPU v5e that made a tiny body's loop
x0.36 of rolled, where ``lax.scan(..., unroll=32)`` gave x0.72.

``unroll=k`` sets every scan's factor to ``min(k, L)`` (``lax.scan``'s own ``unroll``, on
every target); ``unroll=None`` leaves every scan alone.

Example::

    new_jaxpr, decisions = unroll_scans(closed_jaxpr, unroll="auto", target="gpu")

Sharp edges:
  * ``E`` counts the body's own equations; nested loops inside count once.
  * The GPU model prices a scan alone, in the program the passes have made so far: a later
    join (or the memory budget, ``_plan.budget``) may still change what runs.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from .. import _compat
from .._analysis import Analysis
from .._compat import JaxprEqn
from .._cost import CostModel
from .._gpu_levels import LevelModel
from .._gpu_model import CommandBufferMode
from .._memory import MemoryModel, format_bytes
from .._options import UNROLL_BY_COST
from .._tpu_model import TPU_V5E, block_factor
from ._protocol import BLOCK_SCOPE, DecisionKind, EmitFn, Level, LevelResult, Rewrite, decision
from ._shared import MAX_UNROLLED_EQNS, loop_candidates, loop_trips
from ._splice import evaluate

KERNELS_PER_TRIP = 8
FULL_UNROLL_LENGTH = 8
# The factors ``unroll="cost"`` prices with the GPU model (each lowered to the caps and to
# one dividing the length): a few, so a scan costs the analysis a few pricings of its
# body's trip, the body itself priced once.
PRICED_FACTORS = (1, 2, 4, 8, 16)
# How much cheaper a larger factor must be estimated to be kept over a smaller one (a
# relative margin: equal estimates summed apart may differ in their last bits).
TIE = 1e-9
# The share of the memory budget an automatic unroll factor's copies may take.
UNROLL_SHARE = 0.75


def auto_unroll_factor(info: _compat.ScanInfo, costs: CostModel) -> int:
    """The unroll factor the rule of thumb picks for one scan from its body's cost and
    length, where no GPU model prices it (see the module docstring; ``_kept_rolled`` and
    the memory budget may lower it)."""
    length = info.length
    if length <= 1:
        return 1
    body_eqns = _body_eqns(info)
    if length <= FULL_UNROLL_LENGTH and length * body_eqns <= MAX_UNROLLED_EQNS:
        return length
    kernels = costs.jaxpr_cost(info.jaxpr).kernels
    factor = -(-KERNELS_PER_TRIP // max(round(kernels), 1))
    factor = min(factor, MAX_UNROLLED_EQNS // body_eqns, length)
    return max(factor, 1)


def _body_eqns(info: _compat.ScanInfo) -> int:
    inner, _ = _compat.open_jaxpr(info.jaxpr)
    return max(len(inner.eqns), 1)


def _dividing(factor: int, length: int) -> int:
    """The largest factor at most ``factor`` that divides ``length``: for another, JAX
    slices the scanned inputs apart, a copy of them all (deviceless H200: 10,000 trips
    unrolled by 3 copied two 381 MiB inputs)."""
    return max(k for k in range(1, max(factor, 1) + 1) if k == 1 or length % k == 0)


def _cost_factor(eqn: JaxprEqn, analysis: Analysis) -> tuple[int, str]:
    """The factor ``unroll="cost"`` picks for the ``scan`` ``eqn`` off the TPU, and why:
    the one the GPU model (``_gpu_levels``) estimates cheapest among the allowed ones
    (``_allowed_factors``; ties: the smaller), else, where no GPU model prices it, the
    rule of thumb (``_rule_factor``)."""
    info = _compat.scan_info(eqn)
    costs = analysis.costs
    most = _most_copies(eqn, analysis)
    budget = format_bytes(analysis.memory_allowance or 0.0)
    within = f"at most {most} copies of the body within the memory budget (+{budget})"
    if costs.profile.gpu is None:
        return _rule_factor(eqn, info, costs, most, within)
    widest = min(max(PRICED_FACTORS), info.length, MAX_UNROLLED_EQNS // _body_eqns(info))
    allowed, rolled = _allowed_factors(eqn, info, costs, min(widest, most))
    by_memory = f", and {within}" if most < widest else ""
    if allowed == [1]:
        return 1, rolled or ("auto: body cost and length" + by_memory)
    model = LevelModel(costs, analysis.settings.modes.priced or CommandBufferMode.LHS,
                       memo=analysis.shared.mode_estimates)
    factor, best = 1, math.inf
    for k in allowed:  # smallest first: a larger factor must be cheaper to be kept
        seconds = model.scan(eqn, k).seconds
        if seconds < best * (1.0 - TIE):
            factor, best = k, seconds
    why = f"auto: the GPU model's fastest of unroll {', '.join(map(str, allowed))}"
    return factor, why + (by_memory if factor == allowed[-1] else "")


def _allowed_factors(eqn: JaxprEqn, info: _compat.ScanInfo, costs: CostModel, cap: int
                     ) -> tuple[list[int], str | None]:
    """The factors ``unroll="cost"`` prices for the ``scan`` ``eqn`` (ascending), and why
    the largest is refused (``_kept_rolled``: then so are all but 1), or None: each of
    ``PRICED_FACTORS`` (and the length, for a short scan) lowered to ``cap`` (the
    length, ``MAX_UNROLLED_EQNS`` equations, the copies the memory budget allows) and to
    a factor dividing the length, less those ``_kept_rolled`` refuses."""
    length = info.length
    wanted = set(PRICED_FACTORS) | ({length} if length <= FULL_UNROLL_LENGTH else set())
    factors = sorted({_dividing(min(k, max(cap, 1)), length) for k in wanted})
    refusals = {k: _kept_rolled(eqn, k, costs) for k in factors}
    return [k for k in factors if refusals[k] is None], refusals[factors[-1]]


def _rule_factor(eqn: JaxprEqn, info: _compat.ScanInfo, costs: CostModel, most: int,
                 within: str) -> tuple[int, str]:
    """The rule of thumb's factor (``auto_unroll_factor``), kept rolled (``_kept_rolled``),
    within ``most`` copies and lowered to one dividing the length, and why."""
    factor = auto_unroll_factor(info, costs)
    why = "auto: body cost and length"
    rolled = _kept_rolled(eqn, factor, costs)
    if rolled is not None:
        factor, why = 1, rolled
    if most < factor:
        factor, why = most, f"auto: body cost and length, and {within}"
    return _dividing(factor, info.length), why


def _kept_rolled(eqn: JaxprEqn, factor: int, costs: CostModel) -> str | None:
    """Why ``factor`` copies of the ``scan`` ``eqn``'s body would cost more kernels than
    its saved trips, or None: rolled, a run launches ``L * (K + T)`` kernels; unrolled,
    at worst ``L * (K + P) + (L / k) * T`` (``P`` its invariant prologues, ``T`` a trip's
    own kernels; see the module docstring). Since ``1 - 1/k`` grows with ``k``, no smaller
    factor pays where ``factor`` does not."""
    prologues = costs.invariant_prologues(eqn)
    if factor <= 1 or not prologues:
        return None
    trip = costs.scan_trip_kernels(eqn)
    if prologues < (1.0 - 1.0 / factor) * trip:
        return None
    return (f"auto: kept rolled: its {factor} copies may each recompute {prologues} "
            f"loop-invariant operand(s) of its kernels (a weight's slice or transpose) "
            f"that the rolled loop computes once, more kernels than the "
            f"{(1.0 - 1.0 / factor) * trip:g} a trip's bookkeeping saves per copy")


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: new ``unroll`` parameters for the scans of one level
    (``settings.unroll``: a factor, or ``"cost"`` for one per scan from the cost model)."""
    unroll = analysis.settings.unroll
    if unroll is None:
        return LevelResult()
    eqns, path = level.eqns, level.path
    rewrites, decisions = [], []
    for index in loop_candidates(eqns):
        eqn = eqns[index]
        info = _compat.scan_info(eqn)
        blocked = False
        if unroll == UNROLL_BY_COST:
            if info.unroll != 1 or read_by_blocks(eqn):
                chosen = info.unroll if info.unroll != 1 else "reading by blocks"
                decisions.append(decision(
                    path, DecisionKind.LEFT_ALONE, eqns, [index],
                    trips_before=loop_trips(info.length, info.unroll),
                    trips_after=loop_trips(info.length, info.unroll), unroll=info.unroll,
                    reason=f"unroll={chosen} was already chosen" if info.unroll != 1
                    else "already read by blocks"))
                continue
        if unroll == UNROLL_BY_COST and analysis.settings.target == "tpu":
            choice = block_factor(eqn, TPU_V5E, _most_copies(eqn, analysis))
            factor, blocked, why = choice.factor, choice.blocked, f"auto: {choice.reason}"
        elif unroll == UNROLL_BY_COST:
            factor, why = _cost_factor(eqn, analysis)
        else:
            factor = max(1, min(int(unroll), info.length))
            why = f"unroll={unroll} requested"
        trips = loop_trips(info.length, factor)
        if factor == info.unroll:
            decisions.append(decision(
                path, DecisionKind.LEFT_ALONE, eqns, [index], trips_before=trips,
                trips_after=trips, unroll=factor, reason=f"{why}: factor stays {factor}"))
            continue
        rewrites.append(Rewrite((index,), _block_emitter(eqn, factor) if blocked
                                else _unroll_emitter(eqn, factor)))
        decisions.append(decision(
            path, DecisionKind.UNROLLED, eqns, [index],
            trips_before=loop_trips(info.length, info.unroll), trips_after=trips,
            unroll=factor, reason=f"{why}: unroll by {factor}"))
    return LevelResult(rewrites, decisions)


def _most_copies(eqn: JaxprEqn, analysis: Analysis) -> int:
    """The most unrolled copies of the ``scan`` ``eqn``'s body the memory budget allows
    (``Analysis.memory_allowance``): each copy may keep its buffers and carries alive
    (``_memory.MemoryModel.unrolled_copy_bytes``)."""
    allowance = analysis.memory_allowance
    if allowance is None:
        return _compat.scan_info(eqn).length
    each = MemoryModel(analysis.costs, analysis.shared.memory).unrolled_copy_bytes(eqn)
    # The copies may take three quarters of the budget: what XLA's scheduler keeps of them
    # is among the model's least certain figures (deviceless H200: two stacks of scans
    # unrolled by 8, 3.5 MiB more once compiled, 3.1 MiB by the model; the seed's fused
    # scans unrolled by 2, 0.3 MiB once compiled, 0.55 MiB by the model).
    most = 1 + int(UNROLL_SHARE * allowance // each) if each > 0 else 0
    return max(1, most) if each > 0 else _compat.scan_info(eqn).length


def _unroll_emitter(eqn: JaxprEqn, factor: int) -> EmitFn:
    params = _compat.scan_params_with_unroll(eqn, factor)

    def emit(invals: list[list[Any]]) -> list[list[Any]]:
        (operands,) = invals
        return [_compat.bind_eqn(eqn, operands, params)]

    return emit


def read_by_blocks(eqn: JaxprEqn) -> bool:
    """Whether the ``scan`` ``eqn`` is a scan of blocks ``_block_emitter`` made."""
    try:
        return BLOCK_SCOPE in str(eqn.source_info.name_stack)
    except Exception:  # a source info without a name stack
        return False


def _block_emitter(eqn: JaxprEqn, factor: int) -> EmitFn:
    """The ``scan`` ``eqn`` read by blocks of ``factor`` trips (``factor`` divides its
    length): one scan over the blocks, each scanned input reshaped to
    ``[length / factor, factor, ...]`` (no copy), whose body runs ``factor`` trips of the
    original body on static slices of its block and stacks their outputs; ``reverse``
    runs the blocks and the trips in each from the last."""
    info = _compat.scan_info(eqn)
    carried = info.num_consts + info.num_carry
    blocks = info.length // factor

    def emit(invals: list[list[Any]]) -> list[list[Any]]:
        (operands,) = invals
        consts, init = operands[:info.num_consts], operands[info.num_consts:carried]

        def block(carry: list[Any], block_xs: list[Any]) -> tuple[list[Any], list[Any]]:
            outs_by_trip: dict[int, list[Any]] = {}
            trips = range(factor - 1, -1, -1) if info.reverse else range(factor)
            for j in trips:
                outs = evaluate(info.jaxpr, *consts, *carry, *(x[j] for x in block_xs))
                carry, outs_by_trip[j] = list(outs[:info.num_carry]), outs[info.num_carry:]
            ys = [jnp.stack([outs_by_trip[j][k] for j in range(factor)])
                  for k in range(len(eqn.outvars) - info.num_carry)]
            return carry, ys

        # The reshapes too carry the scan's source line: the plan names the user's loop.
        with _compat.eqn_context(eqn):
            xs = [jnp.reshape(x, (blocks, factor, *x.shape[1:])) for x in operands[carried:]]
            with jax.named_scope(BLOCK_SCOPE):
                final, ys = jax.lax.scan(block, list(init), xs, length=blocks,
                                         reverse=info.reverse)
            return [[*final, *(jnp.reshape(y, (info.length, *y.shape[2:])) for y in ys)]]

    return emit
