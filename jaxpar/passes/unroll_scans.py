"""Choose an unroll factor for every static scan.

``unroll="cost"`` asks the target (``targets.Target.unroll_rule``, its module's rule) for
each static scan's factor, handing it the scan (``_Scan``, a ``targets.unroll.ScanQuery``)
with the caps this pass keeps on every target:

* ``k * E <= MAX_UNROLLED_EQNS`` (``E`` the body's own equations) and ``k <= L``;
* at most as many copies as three quarters of the memory budget allow
  (``Analysis.memory_allowance``, ``UNROLL_SHARE``): XLA's scheduler may interleave
  unrolled copies, each keeping its buffers and carries alive
  (``_model.memory.MemoryModel.unrolled_copy_bytes``);
* a scan whose unroll factor is already not 1 was chosen by someone (the user, or an
  earlier run of this pass), and a scan already read by blocks, are left alone.

The rules (``jaxpar/targets/``): on target ``"gpu"`` the GPU model's fastest of a few
factors (``targets/gpu.py``); on ``"tpu"`` blocks of trips by the chip's measured figures
(``targets/tpu.py``): the answer may be the block form, one scan over ``L / K`` blocks
whose body runs ``K`` trips on static slices of the block (``_block_emitter``); elsewhere
a rule of thumb from the body's cost and length (``targets/unroll.py``). The scan's
``unroll`` parameter (or its block form) is changed and nothing else: the trip count stays
known to XLA (no ``while`` without a trip count is ever made).

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

from typing import Any

import jax
import jax.numpy as jnp

from .. import _compat, targets
from .._analysis import Analysis
from .._compat import JaxprEqn
from .._model.gpu import CommandBufferMode
from .._model.gpu_levels import LevelModel
from .._model.memory import MemoryModel, format_bytes
from .._options import UNROLL_BY_COST
from ._loop_candidates import MAX_UNROLLED_EQNS, loop_candidates, loop_trips
from ._protocol import BLOCK_SCOPE, DecisionKind, EmitFn, Level, LevelResult, Rewrite, decision
from ._splice import evaluate

# The share of the memory budget an automatic unroll factor's copies may take.
UNROLL_SHARE = 0.75


class _Scan:
    """One static scan as a target's unroll rule sees it (``targets.unroll.ScanQuery``):
    the caps of this pass and the cost model's figures, the GPU model's priced on demand."""

    def __init__(self, eqn: JaxprEqn, analysis: Analysis):
        self.eqn, self._analysis = eqn, analysis
        self.info = _compat.scan_info(eqn)
        self.length = self.info.length
        self.body_eqns = max(len(_compat.open_jaxpr(self.info.jaxpr)[0].eqns), 1)
        self.most_copies = _most_copies(eqn, analysis)
        self.most_by_size = MAX_UNROLLED_EQNS // self.body_eqns
        self.memory_budget = format_bytes(analysis.memory_allowance or 0.0)
        self._model: LevelModel | None = None

    def body_kernels(self) -> float:
        return self._analysis.costs.jaxpr_cost(self.info.jaxpr).kernels

    def invariant_prologues(self) -> int:
        return self._analysis.costs.invariant_prologues(self.eqn)

    def trip_kernels(self) -> float:
        return self._analysis.costs.scan_trip_kernels(self.eqn)

    def unrolled_seconds(self, factor: int) -> float:
        if self._model is None:
            analysis = self._analysis
            self._model = LevelModel(
                analysis.costs, analysis.settings.modes.priced or CommandBufferMode.LHS,
                memo=analysis.shared.mode_estimates)
        return self._model.scan(self.eqn, factor).seconds


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
            choice = targets.get(analysis.settings.target).unroll_rule(_Scan(eqn, analysis))
            factor, blocked, why = choice.factor, choice.blocked, choice.why
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
    (``_model.memory.MemoryModel.unrolled_copy_bytes``)."""
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
