"""Planning phase 4: a chosen section's regions: hull, balance onto streams, private
neighbours.

Each branch's heavy equations grow into their convex hull (every equation between two
of them); branches are balanced longest-first onto the streams; then each stream's set
takes its private producers (light equations whose every consumer is in it) and
private consumers (light equations reading only its results). The result is frozen
and names slots in balance order; ``RegionSet.region_plans`` numbers the streams.

Example::

    found = build_regions(order, graph, seconds, blocked, branches=((0,), (1,)),
                          taken={}, section_index=0, streams=2, min_seconds=5e-6)
    found.regions.slots      # equations of each stream region, sorted
    found.enclosed           # branches dropped: their hull holds a blocked equation

Sharp edges:
  * ``taken`` (equation -> (section, slot) of earlier sections of the level) is only
    read: absorption never takes an equation that already belongs to a region, and
    only takes light equations before ``order.end``.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping, Sequence

from .._program.graph import Graph
from .heavy import HeavyOrder
from .plans import RegionPlan
from .sections import lpt_balance, overlapped_seconds


@dataclasses.dataclass(frozen=True, slots=True)
class RegionSet:
    """The regions of one candidate section.

    Attributes:
      branches: the kept branches (units each), in the chosen section's order.
      slots: each stream slot's equations, sorted; slots in balance order.
      slot_seconds: each slot's estimated seconds.
      heavy_mask: bits of the kept branches' heavy positions.
    """

    branches: tuple[tuple[int, ...], ...]
    slots: tuple[tuple[int, ...], ...]
    slot_seconds: tuple[float, ...]
    heavy_mask: int

    def region_plans(self) -> tuple[RegionPlan, ...]:
        """Stream ids 1..k, in the order of each slot's first equation."""
        ordered = sorted(range(len(self.slots)), key=lambda s: self.slots[s][0])
        return tuple(RegionPlan(stream=stream, eqns=self.slots[slot],
                                seconds=self.slot_seconds[slot])
                     for stream, slot in enumerate(ordered, start=1))

    def assignment(self, section_index: int) -> dict[int, tuple[int, int]]:
        """Equation -> (section, slot) for every equation of the regions."""
        return {i: (section_index, slot) for slot, eqns in enumerate(self.slots) for i in eqns}


@dataclasses.dataclass(frozen=True, slots=True)
class EnclosedBranch:
    """A branch left out: its hull holds ``blocked``, which must stay in place."""

    eqns: tuple[int, ...]  # the branch's heavy equations
    blocked: int
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class FoundRegions:
    """``regions`` is None when fewer than two branches remain or they hide too little."""

    regions: RegionSet | None
    enclosed: tuple[EnclosedBranch, ...]


def build_regions(order: HeavyOrder, graph: Graph, seconds: Sequence[float],
                  blocked: Mapping[int, str], branches: Sequence[Sequence[int]],
                  taken: Mapping[int, tuple[int, int]], section_index: int, streams: int,
                  min_seconds: float) -> FoundRegions:
    """The regions of one chosen section.

    Args:
      order: the window's heavy order.
      graph: the level's dependency graph.
      seconds: estimated seconds of every equation of the level.
      blocked: equations that must stay in place, with the reason.
      branches: the section's branches, units each (``SectionChoice.branch_sets``).
      taken: equation -> (section, slot) of the level's earlier sections (read only).
      section_index: the index this section would get among the level's sections.
      streams: streams per section.
      min_seconds: the least work the section must hide.
    """
    hulls: list[tuple[tuple[int, ...], list[int]]] = []
    enclosed = []
    for units in branches:
        branch = order.expand(units)
        hull = convex_hull(order, graph, branch)
        bad = [i for i in hull if i in blocked]
        if bad:
            enclosed.append(EnclosedBranch(tuple(order.heavy[k] for k in branch), bad[0],
                                           blocked[bad[0]]))
            continue
        hulls.append((tuple(units), hull))
    if len(hulls) < 2 or overlapped_seconds([b for b, _ in hulls], streams, order.cost,
                                            _first) < min_seconds:
        return FoundRegions(None, tuple(enclosed))
    bins = lpt_balance(hulls, streams, lambda item: order.cost(item[0]),
                       lambda item: item[0][0])
    heavy_mask = 0
    for units, _ in hulls:
        for k in order.expand(units):
            heavy_mask |= 1 << k
    members: list[set[int]] = [set() for _ in bins]
    for slot, group in enumerate(bins):
        for _, hull in group:
            members[slot].update(hull)
    local: dict[int, tuple[int, int]] = {}
    for slot, eqns in enumerate(members):
        for i in eqns:
            local[i] = (section_index, slot)
    absorb_neighbours(order, graph, blocked, members, local, taken, section_index, heavy_mask)
    # Summed in the sets' own order, as the regions were always costed.
    regions = RegionSet(tuple(units for units, _ in hulls),
                        tuple(tuple(sorted(m)) for m in members),
                        tuple(sum(seconds[i] for i in m) for m in members), heavy_mask)
    return FoundRegions(regions, tuple(enclosed))


def _first(units: Sequence[int]) -> int:
    return units[0]


def convex_hull(order: HeavyOrder, graph: Graph, branch: Sequence[int]) -> list[int]:
    """Every equation between two heavy positions of ``branch`` (forward search, pruned)."""
    mask = 0
    for k in branch:
        mask |= 1 << k
    last = order.heavy[branch[-1]]
    found = {order.heavy[k] for k in branch}
    stack = list(found)
    while stack:
        i = stack.pop()
        for s in graph.succs[i]:
            if s <= last and s not in found and order.desc_of(s) & mask:
                found.add(s)
                stack.append(s)
    return sorted(found)


def absorb_neighbours(order: HeavyOrder, graph: Graph, blocked: Mapping[int, str],
                      members: list[set[int]], local: dict[int, tuple[int, int]],
                      taken: Mapping[int, tuple[int, int]], section_index: int,
                      section_mask: int) -> None:
    """Grows ``members`` and ``local`` (equation -> (section, slot) of this section;
    ``taken`` holds earlier sections') by private producers, then private consumers."""
    absorption = _Absorption(order, graph, blocked, members, local, taken, section_index,
                             section_mask)
    absorption.absorb_producers()
    absorption.absorb_consumers()


@dataclasses.dataclass(frozen=True, slots=True)
class _Absorption:
    """``absorb_neighbours``'s arguments, for its two sweeps."""

    order: HeavyOrder
    graph: Graph
    blocked: Mapping[int, str]
    members: list[set[int]]
    local: dict[int, tuple[int, int]]
    taken: Mapping[int, tuple[int, int]]
    section_index: int
    section_mask: int

    def owner_of(self, i: int) -> tuple[int, int] | None:
        return self.local[i] if i in self.local else self.taken.get(i)

    def movable(self, i: int) -> bool:
        return (i not in self.local and i not in self.taken and i not in self.blocked
                and i not in self.order.heavy_set and i in self.graph.live)

    def absorb_producers(self) -> None:
        """Private producers: light equations whose every consumer is in one region.
        Visited from the highest index down, so a candidate's consumers are settled."""
        order, graph, members, local = self.order, self.graph, self.members, self.local
        pending = [-p for slot in members for i in slot for p in graph.preds[i]]
        heapq.heapify(pending)
        seen: set[int] = set()
        while pending:
            i = -heapq.heappop(pending)
            if i in seen:
                continue
            seen.add(i)
            if (not self.movable(i) or i in graph.feeds_output or not graph.succs[i]
                    or order.anc_of(i) & self.section_mask):
                continue
            consumers = {self.owner_of(s) for s in graph.succs[i]}
            if len(consumers) != 1:
                continue
            (consumer,) = consumers
            if consumer is None or consumer[0] != self.section_index:
                continue
            members[consumer[1]].add(i)
            local[i] = consumer
            for p in graph.preds[i]:
                heapq.heappush(pending, -p)

    def absorb_consumers(self) -> None:
        """Private consumers: light equations reading only one region's results,
        visited from the lowest index up so their producers are settled."""
        order, graph, members, local = self.order, self.graph, self.members, self.local
        section_mask = self.section_mask
        pending = [s for slot in members for i in slot for s in graph.succs[i]]
        heapq.heapify(pending)
        seen: set[int] = set()
        while pending:
            i = heapq.heappop(pending)
            if i in seen:
                continue
            seen.add(i)
            if i >= order.end or not self.movable(i) or order.desc_of(i) & section_mask:
                continue
            owners: set[tuple[int, int]] = set()
            for p in graph.preds[i]:
                owner = self.owner_of(p)
                if owner is None:
                    if order.anc_of(p) & section_mask:
                        break
                elif owner[0] == self.section_index:
                    owners.add(owner)
                else:
                    break
            else:
                if len(owners) == 1:
                    (owner,) = owners
                    members[owner[1]].add(i)
                    local[i] = owner
                    for s in graph.succs[i]:
                        heapq.heappush(pending, s)
