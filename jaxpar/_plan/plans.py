"""The planner's results: frozen plans of one level, its sections, regions and notes.

Everything here is indices and numbers, except ``LevelPlan.jaxpr`` (the live level,
which the emitter evaluates) and ``LevelPlan.graph``.

Example::

    level = plan_jaxpr(closed_jaxpr, Analysis(Options().resolve("gpu")))
    for section in level.sections:
        for region in section.regions: region.stream, region.eqns
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from .._compat import JaxprLike
from .._program.graph import Graph, Unit
from .._program.primitives import COLLECTIVE, RECURSIVE

# Heavy equations are decomposed in windows of this many (program order).
MAX_HEAVY = 256

# Primitives whose nested jaxprs get a plan of their own; others with nested jaxprs
# (pallas_call, custom_transpose, ...) stay opaque.
RECURSIVE_PRIMITIVES = RECURSIVE
COLLECTIVE_PRIMITIVES = COLLECTIVE

REASON_TOO_CHEAP = "too cheap"
REASON_DEPENDENT = "dependent"
REASON_EFFECTFUL = "effectful"
REASON_ANNOTATED = "already annotated"
REASON_COLLECTIVE = "collective"
REASON_OPAQUE = "opaque"
REASON_NO_GAIN = "does not pay"
REASON_SYMBOLIC = "symbolic shapes"


@dataclasses.dataclass(frozen=True, slots=True)
class RegionPlan:
    """Equations (indices into the level's jaxpr) that become one stream call."""

    stream: int
    eqns: tuple[int, ...]
    seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class SectionPlan:
    """Mutually independent regions meant to overlap; one scheduling group.

    A section built around a collectives group (``collectives`` is its index in
    ``LevelPlan.collective_groups``) holds the compute that overlaps the group's
    transfers, and carries no scheduling group: XLA crashed compiling a
    ``_scheduling_group_id`` on collectives-group calls (jaxlib 0.10.2, deviceless).
    """

    group: int | None
    regions: tuple[RegionPlan, ...]
    collectives: int | None = None
    # The GPU pricing's verdict (``jaxpar._plan.pricing``): what overlap wins, what the cut costs,
    # and why; None where nothing priced it (other targets, collectives sections).
    gain_seconds: float | None = None
    cost_seconds: float | None = None
    verdict: str = ""
    pays: bool | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Note:
    """An equation (or set) deliberately left where it is, and why."""

    eqns: tuple[int, ...]
    reason: str
    detail: str


@dataclasses.dataclass(frozen=True)
class LevelPlan:
    """The plan for one jaxpr level; ``nested`` holds plans of inner jaxprs.

    Holds the live jaxpr so the emitter can evaluate it; everything else is
    indices and numbers.
    """

    path: str
    jaxpr: JaxprLike  # the Jaxpr/ClosedJaxpr as found in the program
    graph: Graph
    seconds: tuple[float, ...]
    sections: tuple[SectionPlan, ...]
    notes: tuple[Note, ...]
    nested: tuple[tuple[int, tuple[tuple[tuple[str, int | None], LevelPlan], ...]], ...]
    # Emission order: EqnUnit, RegionUnit or CollectivesUnit.
    order: tuple[Unit, ...]
    # Independent collectives launched together, and every collective of the level.
    collective_groups: tuple[CollectiveGroup, ...] = ()
    collectives: tuple[CollectiveInfo, ...] = ()

    @property
    def changes_anything(self) -> bool:
        return bool(self.sections) or bool(self.collective_groups) or any(
            sub.changes_anything for _, subs in self.nested for _, sub in subs)

    def walk(self) -> Iterator[LevelPlan]:
        yield self
        for _, subs in self.nested:
            for _, sub in subs:
                yield from sub.walk()


# The collectives phase's results (``_plan.collectives`` computes them).
@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveInfo:
    """One collective equation of the level, for reporting.

    ``shift`` is the uniform ring shift of a ``ppermute`` (``+1``, ``-1``, ``k``
    in ``(-size/2, size/2]``) or None for a general permutation or another
    collective. ``layer`` is its depth among the groupable collectives (None
    when not groupable). ``group`` is the index of its group, if any.
    """

    eqn: int
    primitive: str
    axis_name: tuple[Any, ...]
    shift: int | None
    layer: int | None
    group: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveGroup:
    """Mutually independent collectives (equation indices) launched as one group."""

    eqns: tuple[int, ...]
    shifts: tuple[int | None, ...]
    axis_name: tuple[Any, ...]

    @property
    def bidirectional(self) -> bool:
        """Whether the group sends both ways round a ring (a ``+k`` and a ``-k``)."""
        shifts = {s for s in self.shifts if s is not None}
        return any(-s in shifts for s in shifts if s > 0)


@dataclasses.dataclass(frozen=True, slots=True)
class CollectivePlan:
    """Groups and the report of every collective at one level."""

    groups: tuple[CollectiveGroup, ...]
    collectives: tuple[CollectiveInfo, ...]

    @property
    def grouped(self) -> frozenset[int]:
        return frozenset(i for g in self.groups for i in g.eqns)
