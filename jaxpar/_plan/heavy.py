"""Planning phase 1: the heavy equations of one window, their reachability masks and units.

Heavy positions ``0..n-1`` number a window's heavy equations in program order. Bit
``k`` of an equation's ancestor (descendant) mask says heavy position ``k`` reaches
(is reached from) it. Cheap heavy sources and sinks with a single heavy neighbour
join that neighbour's *unit*; the series-parallel decomposition runs over units.

Example::

    order = heavy_order(graph, heavy=[3, 7, 9], seconds=seconds, min_seconds=5e-6,
                        end=graph.size)
    order.units, order.unit_anc[order.units[0]], order.expand([0])

Sharp edges:
  * Ancestor masks are stored only from the first heavy equation to ``end`` (the next
    window's first heavy equation), descendant masks only up to the last heavy
    equation; outside those ranges a mask is 0, which is exact (no heavy ancestor
    before the first heavy equation, no heavy descendant after the last one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from .._program.graph import DisjointSets, Graph


@dataclasses.dataclass(frozen=True, slots=True)
class HeavyOrder:
    """The reachability order of one window's heavy equations, grouped into units.

    Attributes:
      heavy: the equation index of each heavy position.
      seconds: the estimated time of each heavy position.
      lo, hi, end: first and last heavy equation, and where the window's light
        equations end (nothing from ``end`` on is ever absorbed).
      anc, desc: ancestor masks of equations ``lo..end-1`` and descendant masks of
        equations ``lo..hi`` (use ``anc_of``/``desc_of``).
      heavy_anc, heavy_desc: the same masks by heavy position.
      units: the heavy positions that represent a unit, ascending.
      members: by heavy position, the positions of its unit (empty if not a unit).
      unit_anc, unit_desc: by heavy position, the unit's ancestor/descendant masks
        over unit representatives (0 if not a unit).
    """

    heavy: tuple[int, ...]
    seconds: tuple[float, ...]
    lo: int
    hi: int
    end: int
    anc: tuple[int, ...]
    desc: tuple[int, ...]
    heavy_anc: tuple[int, ...]
    heavy_desc: tuple[int, ...]
    heavy_set: frozenset[int]
    units: tuple[int, ...]
    members: tuple[tuple[int, ...], ...]
    unit_anc: tuple[int, ...]
    unit_desc: tuple[int, ...]

    def anc_of(self, eqn: int) -> int:
        """Heavy positions (bits) that ``eqn`` depends on, itself included."""
        k = eqn - self.lo
        return self.anc[k] if 0 <= k < len(self.anc) else 0

    def desc_of(self, eqn: int) -> int:
        """Heavy positions (bits) that depend on ``eqn``, itself included."""
        k = eqn - self.lo
        return self.desc[k] if 0 <= k < len(self.desc) else 0

    def expand(self, units: Iterable[int]) -> list[int]:
        """Heavy positions of the given units, sorted."""
        return sorted(k for u in units for k in self.members[u])

    def cost(self, units: Iterable[int]) -> float:
        """Estimated seconds of the given units' heavy equations."""
        return sum(self.seconds[k] for k in self.expand(units))

    def eqns(self, units: Iterable[int]) -> tuple[int, ...]:
        """Equation indices of the given units' heavy equations, in program order."""
        return tuple(self.heavy[k] for k in self.expand(units))


def heavy_order(graph: Graph, heavy: Sequence[int], seconds: Sequence[float],
                min_seconds: float, end: int) -> HeavyOrder:
    """Masks and units of the heavy equations ``heavy`` (ascending, two or more).

    Args:
      graph: the level's dependency graph.
      heavy: the window's heavy equations, ascending.
      seconds: estimated seconds of every equation of the level.
      min_seconds: below this a heavy source or sink may join its neighbour's unit.
      end: where the next window starts (``graph.size`` for the last window).
    """
    bit = {eqn: k for k, eqn in enumerate(heavy)}
    lo, hi = heavy[0], heavy[-1]
    anc = [0] * (end - lo)
    for i in range(lo, end):
        mask = 0
        for p in graph.preds[i]:
            if p >= lo:
                mask |= anc[p - lo]
        if i in bit:
            mask |= 1 << bit[i]
        anc[i - lo] = mask
    desc = [0] * (hi - lo + 1)
    for i in range(hi, lo - 1, -1):
        mask = 0
        for s in graph.succs[i]:
            if s <= hi:
                mask |= desc[s - lo]
        if i in bit:
            mask |= 1 << bit[i]
        desc[i - lo] = mask
    heavy_anc = tuple(anc[eqn - lo] for eqn in heavy)
    heavy_desc = tuple(desc[eqn - lo] for eqn in heavy)
    heavy_seconds = tuple(seconds[eqn] for eqn in heavy)
    roots = attach_loose_ends(heavy_anc, heavy_desc,
                              [s < min_seconds for s in heavy_seconds])
    count = len(heavy)
    members: list[list[int]] = [[] for _ in range(count)]
    for k, root in enumerate(roots):
        members[root].append(k)
    units = tuple(k for k in range(count) if members[k])
    unit_anc, unit_desc = [0] * count, [0] * count
    moved_mask = 0  # most positions are their own unit: only attached ones are remapped
    for k, root in enumerate(roots):
        if root != k:
            moved_mask |= 1 << k

    def to_units(mask: int) -> int:
        out = mask & ~moved_mask
        moved = mask & moved_mask
        while moved:
            low = moved & -moved
            out |= 1 << roots[low.bit_length() - 1]
            moved ^= low
        return out

    for u in units:
        unit_anc[u] = to_units(_or(heavy_anc, members[u]))
        unit_desc[u] = to_units(_or(heavy_desc, members[u]))
    return HeavyOrder(tuple(heavy), heavy_seconds, lo, hi, end, tuple(anc), tuple(desc),
                      heavy_anc, heavy_desc, frozenset(heavy), units,
                      tuple(tuple(m) for m in members), tuple(unit_anc), tuple(unit_desc))


def attach_loose_ends(heavy_anc: Sequence[int], heavy_desc: Sequence[int],
                      cheap: Sequence[bool]) -> list[int]:
    """The unit (a representative position) of every heavy position.

    A cheap source feeding one heavy equation (a weight ``rev`` or transpose in a
    backward pass) or a cheap sink hanging off one (a weight gradient) is unordered
    with most of the program, which breaks every series cut although it cannot be
    worth a stream by itself. It joins its neighbour's unit.
    """
    count = len(heavy_anc)
    units = DisjointSets(count)

    def only(mask: int, related: Sequence[int]) -> int | None:
        """The single element of ``mask`` minimal (or maximal) w.r.t. ``related``."""
        found = None
        rest = mask
        while rest:
            low = rest & -rest
            k = low.bit_length() - 1
            rest ^= low
            if related[k] & mask == low:
                if found is not None:
                    return None
                found = k
        return found

    for k in range(count):
        own = 1 << k
        if not cheap[k]:
            continue
        if heavy_anc[k] == own:  # a source: attach to its only first successor
            target = only(heavy_desc[k] & ~own, heavy_anc)
        elif heavy_desc[k] == own:  # a sink: attach to its only last predecessor
            target = only(heavy_anc[k] & ~own, heavy_desc)
        else:
            continue
        if target is not None:
            units.union(k, target)  # k is still its own root: target's root represents both
    return [units.find(k) for k in range(count)]


def _or(masks: Sequence[int], positions: Iterable[int]) -> int:
    out = 0
    for k in positions:
        out |= masks[k]
    return out
