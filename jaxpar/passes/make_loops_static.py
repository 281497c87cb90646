"""Turn counting ``while`` loops with constant bounds into static scans.

XLA knows the trip count of a ``scan`` but not of a ``fori_loop`` whose bounds
are traced values, so on a GPU every iteration of such a loop copies its
predicate to the host and blocks (``WhileThunk``). When the bounds are in fact
constants in the jaxpr (``lax.fori_loop(jnp.int32(0), jnp.int32(7), ...)``), the
``while`` becomes a ``scan`` with the same trip count that runs the same body on
the same carries, so the values are identical. The trip count is the one the
``while`` runs, computed in the counter's integer dtype (``_program.loops.static_trip_count``);
a loop where that is not provable (a float counter, a counter that would wrap
around) stays a ``while``. Other ``while`` loops are reported as host-sync loops
with the reason and a hint.

Example::

    new_jaxpr, decisions = make_loops_static(closed_jaxpr)
    [d.kind for d in decisions]        # ["made static"] or ["host-sync loop"]

Sharp edges:
  * Only counting loops are recognised: one ``counter < upper`` condition and a constant
    step (every ``fori_loop`` layout; see ``_program.loops``).
  * A loop with a non-positive step, or whose counter would step past its dtype's
    largest value, runs as wrap-around decides; it is left alone.
"""

from __future__ import annotations

from typing import Any

import jax

from .. import _compat, targets
from .._analysis import Analysis
from .._compat import JaxprEqn
from .._program.loops import static_trip_count
from .._program.primitives import WHILE
from ._protocol import DecisionKind, EmitFn, Level, LevelResult, PassDecision, Rewrite, decision
from ._splice import evaluate

_KNOWN_WHEN_TRACING = ("if the trip count is known when tracing, pass Python int bounds to "
                       "fori_loop or use lax.scan")
HOST_SYNC_HINT = ("XLA cannot see this loop's trip count, so on a GPU every iteration waits "
                  f"for the host; {_KNOWN_WHEN_TRACING}")
# What a loop without a static trip count costs, per target: only a GPU's loop control
# waits for the host; a TPU's stays on the chip, a CPU's runs on the host already.
DYNAMIC_LOOP_HINTS = {
    "gpu": HOST_SYNC_HINT,
    "tpu": ("a TPU keeps the loop's control on the chip (no host sync), but XLA can neither "
            f"unroll it nor read it by blocks without its trip count; {_KNOWN_WHEN_TRACING}"),
    "cpu": ("on a CPU the loop's control runs on the host with its body (no sync), but XLA "
            f"cannot unroll it without its trip count; {_KNOWN_WHEN_TRACING}"),
}


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: rewrites for every static ``while`` of one level."""
    eqns, path = level.eqns, level.path
    rewrites: list[Rewrite] = []
    decisions: list[PassDecision] = []
    inner, consts = _compat.open_jaxpr(level.jaxpr)
    constants = dict(zip(inner.constvars, consts, strict=True))
    for index, eqn in enumerate(eqns):
        if eqn.primitive.name != WHILE:
            continue
        count = static_trip_count(eqn, constants)
        trips = count.trips if not eqn.effects else None
        if trips is None:
            reason = ("the loop has side effects" if eqn.effects
                      else f"no static trip count: {count.reason}") + "; " + (
                          DYNAMIC_LOOP_HINTS.get(analysis.settings.target, HOST_SYNC_HINT))
            decisions.append(decision(path, DecisionKind.HOST_SYNC, eqns, [index],
                                      trips_before=None, trips_after=None, unroll=None,
                                      reason=reason))
            continue
        rewrites.append(Rewrite((index,), _static_scan_emitter(eqn, trips)))
        decisions.append(decision(
            path, DecisionKind.MADE_STATIC, eqns, [index], trips_before=trips, trips_after=trips,
            unroll=1, reason=f"counting loop with constant bounds ({count.reason}): now a scan "
                             "whose trip count XLA knows"
                             + targets.get(analysis.settings.target).words.static_loop_gain))
    return LevelResult(rewrites, decisions)


def _static_scan_emitter(eqn: JaxprEqn, trips: int) -> EmitFn:
    info = _compat.while_info(eqn)

    def emit(invals: list[list[Any]]) -> list[list[Any]]:
        (operands,) = invals
        start = info.cond_nconsts
        body_consts = operands[start:start + info.body_nconsts]
        init = operands[start + info.body_nconsts:]

        def step(carry: list[Any], _: Any) -> tuple[list[Any], None]:
            return evaluate(info.body_jaxpr, *body_consts, *carry), None

        with _compat.eqn_context(eqn):
            final, _ = jax.lax.scan(step, list(init), None, length=trips)
        return [list(final)]

    return emit
