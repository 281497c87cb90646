"""Which scans the loop passes may merge or re-emit (``loop_candidates``), how many trips
a scan runs once unrolled (``loop_trips``), and the most equations an unrolled body may
hold (``MAX_UNROLLED_EQNS``).

Example::

    loop_trips(10, 4)  # 3: two trips of four steps, one of the remaining two
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import _ops
from .._analysis import Analysis
from .._compat import JaxprEqn
from .._program.primitives import SCAN

# Most equations an unrolled loop body may hold: ``unroll_scans`` unrolls within it, and
# ``fuse_scans`` keeps a member's unroll factor for the fused scan only within it.
MAX_UNROLLED_EQNS = 512


def loop_trips(length: int, unroll: int) -> int:
    """The trips of a scan of ``length`` steps unrolled by ``unroll``: each trip of
    XLA's loop runs ``unroll`` steps, and the remainder takes one more (what
    ``PassDecision.trips_before``/``trips_after`` count)."""
    return -(-length // max(unroll, 1))


def loop_candidate(eqn: JaxprEqn) -> bool:
    """Whether a scan may be merged or re-emitted: no effects, no user placement."""
    return (eqn.primitive.name == SCAN and not eqn.effects
            and not _ops.has_frontend_attributes(eqn))


def loop_candidates(eqns: Sequence[JaxprEqn]) -> list[int]:
    """The indices of ``eqns`` that are ``loop_candidate`` s (the primitive's name is
    read inline first: the passes ask this of every equation of every level they
    visit, and most are not scans)."""
    return [i for i, e in enumerate(eqns) if e.primitive.name == SCAN and loop_candidate(e)]


def stacked_limit(analysis: Analysis, option: str, most: int) -> float:
    """The most bytes a loop pass that stacks every step's values (``hoist_scan_inputs``,
    ``associative_scans``) may stack for one scan: ``most``, within the memory budget's
    allowance unless the user turned ``option`` on by name."""
    allowance = analysis.allowance_for(option)
    return most if allowance is None else min(most, allowance)
