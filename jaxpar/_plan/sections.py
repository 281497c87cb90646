"""Planning phases 2 and 3: the series-parallel tree of a window's units, and the sections
it affords.

``decompose`` splits the units' reachability order into a tree: the comparability
graph's connected components are parallel branches; a cut that every earlier node
reaches every later node across is a series split. ``choose_sections`` is a dynamic
programme over that tree: a parallel node becomes a section when balancing its
branches onto the streams hides more work than the best sections inside them.

Example::

    tree = parallel(series(leaf(0, 2e-5), leaf(1, 1e-5)), leaf(2, 3e-5))
    choice = choose_sections(tree, streams=2, min_seconds=5e-6)
    choice.branch_sets   # (((0, 1), (2,)),): one section, two branches

Sharp edges:
  * An order that is not series-parallel (an "N") is cut where the fewest pairs are
    unordered across the cut: valid, since only parallel nodes become sections, at
    the price of some parallelism.
  * ``choose_sections`` reads only ``kind``, ``positions``, ``children`` and
    ``cost``, so hand-built trees (``leaf``/``series``/``parallel``) test it alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeVar

from .heavy import HeavyOrder

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True, slots=True)
class SPNode:
    """A node of the series-parallel tree over units (heavy positions).

    ``positions`` are the node's units in ascending order; ``cost`` the estimated
    seconds of all their heavy equations.
    """

    kind: str  # "leaf", "series" or "parallel"
    positions: tuple[int, ...]
    children: tuple[SPNode, ...]
    cost: float


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    """An ``SPNode`` valued by the dynamic programme.

    ``benefit`` is the work (seconds) the subtree's chosen sections hide;
    ``as_section`` whether this node itself becomes a section.
    """

    node: SPNode
    benefit: float
    as_section: bool
    children: tuple[Choice, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Declined:
    """A parallel node (``one_stream``) or branch whose overlap was not worth a section."""

    positions: tuple[int, ...]
    cost: float
    one_stream: bool
    # What running the parallel node's branches side by side would hide (below the least
    # a section must hide, or no section was worth it).
    overlap: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class SectionChoice:
    """The sections chosen over one tree: each a tuple of branches (units each)."""

    tree: Choice
    branch_sets: tuple[tuple[tuple[int, ...], ...], ...]
    declined: tuple[Declined, ...]


def leaf(position: int, cost: float) -> SPNode:
    """A one-unit leaf (for hand-built trees)."""
    return SPNode("leaf", (position,), (), cost)


def series(*children: SPNode) -> SPNode:
    """Children that run one after another (for hand-built trees)."""
    return _join("series", children)


def parallel(*children: SPNode) -> SPNode:
    """Mutually independent children (for hand-built trees)."""
    return _join("parallel", children)


def _join(kind: str, children: Sequence[SPNode]) -> SPNode:
    positions = tuple(sorted(p for c in children for p in c.positions))
    return SPNode(kind, positions, tuple(children), sum(c.cost for c in children))


def lpt_balance(items: Sequence[_T], streams: int, cost: Callable[[_T], float],
                first: Callable[[_T], int]) -> list[list[_T]]:
    """Longest-processing-time-first onto ``min(streams, len(items))`` bins.

    Ties go to the item with the smaller ``first`` position, then the lower bin.
    """
    slots = min(streams, len(items))
    order = sorted(items, key=lambda it: (-cost(it), first(it)))
    bins: list[list[_T]] = [[] for _ in range(slots)]
    loads = [0.0] * slots
    for item in order:
        slot = min(range(slots), key=lambda s: (loads[s], s))
        bins[slot].append(item)
        loads[slot] += cost(item)
    return bins


def overlapped_seconds(items: Sequence[_T], streams: int, cost: Callable[[_T], float],
                       first: Callable[[_T], int]) -> float:
    """Work balanced onto the lightest stream: what running in parallel can hide."""
    loads = [sum(cost(item) for item in group)
             for group in lpt_balance(items, streams, cost, first)]
    return min(loads) if len(loads) >= 2 else 0.0


def choose_sections(tree: SPNode, streams: int, min_seconds: float) -> SectionChoice:
    """Dynamic programme: the sections (and declined branches) of ``tree``.

    Args:
      tree: a series-parallel tree (``decompose`` or hand-built).
      streams: streams per section; below 2 nothing becomes a section.
      min_seconds: the least work a section must hide.
    """
    valued = _value(tree, streams, min_seconds)
    branch_sets: list[tuple[tuple[int, ...], ...]] = []
    declined: list[Declined] = []
    _collect(valued, streams, branch_sets, declined)
    return SectionChoice(valued, tuple(branch_sets), tuple(declined))


def _value(node: SPNode, streams: int, min_seconds: float) -> Choice:
    if node.kind == "leaf":
        return Choice(node, 0.0, False, ())
    children = tuple(_value(c, streams, min_seconds) for c in node.children)
    inner = sum(c.benefit for c in children)
    if node.kind == "series":
        return Choice(node, inner, False, children)
    here = 0.0
    if streams >= 2:
        here = overlapped_seconds([c.node for c in children], streams,
                                  _node_cost, _node_first)
        if here < min_seconds:
            here = 0.0
    # A section here, or the best sections inside the branches.
    as_section = here > 0.0 and here >= inner
    return Choice(node, max(here, inner), as_section, children)


def _node_cost(node: SPNode) -> float:
    return node.cost


def _node_first(node: SPNode) -> int:
    return node.positions[0]


def _collect(choice: Choice, streams: int, branch_sets: list[tuple[tuple[int, ...], ...]],
             declined: list[Declined]) -> None:
    node = choice.node
    if choice.as_section:
        branch_sets.append(tuple(c.positions for c in node.children))
        return
    if node.kind == "parallel" and choice.benefit == 0.0:
        if streams < 2:
            declined.append(Declined(node.positions, node.cost, True))
            return
        overlap = overlapped_seconds(node.children, streams, _node_cost, _node_first)
        declined.extend(Declined(c.positions, c.cost, False, overlap) for c in node.children)
        return
    for child in choice.children:
        _collect(child, streams, branch_sets, declined)


def decompose(order: HeavyOrder) -> SPNode:
    """The series-parallel tree of ``order``'s units."""
    return _decompose(order, list(order.units))


def _decompose(order: HeavyOrder, positions: list[int]) -> SPNode:
    cost = order.cost(positions)
    if len(positions) < 2:
        return SPNode("leaf", tuple(positions), (), cost)
    components = _components(order, positions)
    if len(components) == 1:
        return SPNode("series", tuple(positions),
                      tuple(_decompose(order, p) for p in _series_parts(order, positions)), cost)
    return SPNode("parallel", tuple(positions),
                  tuple(_decompose(order, c) for c in components), cost)


def _components(order: HeavyOrder, positions: list[int]) -> list[list[int]]:
    """Connected components of the comparability graph on ``positions``.

    A breadth-first search over bit masks: each unit is expanded once, by the
    units it reaches or is reached from.
    """
    unit_anc, unit_desc = order.unit_anc, order.unit_desc
    remaining = 0
    for k in positions:
        remaining |= 1 << k
    components = []
    while remaining:
        seed = remaining & -remaining
        component = frontier = seed
        while frontier:
            grown = 0
            while frontier:
                low = frontier & -frontier
                k = low.bit_length() - 1
                frontier ^= low
                grown |= unit_anc[k] | unit_desc[k]
            frontier = grown & remaining & ~component
            component |= frontier
        remaining &= ~component
        members = []
        while component:
            low = component & -component
            members.append(low.bit_length() - 1)
            component ^= low
        components.append(members)
    return components  # ordered by smallest member: seeds are taken lowest first


def _series_parts(order: HeavyOrder, positions: list[int]) -> list[list[int]]:
    """Splits at every cut that all earlier nodes reach all later nodes across.

    Where there is no such cut (the order is not series-parallel here), splits at
    the cut leaving the fewest earlier nodes unordered with some later node.
    Linear in ``positions`` (suffix intersections of the masks).
    """
    count = len(positions)
    reached_by_all = [0] * (count + 1)  # AND of the ancestor masks of positions[c:]
    reached_by_all[count] = -1
    for c in range(count - 1, -1, -1):
        reached_by_all[c] = reached_by_all[c + 1] & order.unit_anc[positions[c]]
    cuts = []
    best: tuple[int, int] | None = None
    prefix = 0
    for cut in range(1, count):
        prefix |= 1 << positions[cut - 1]
        unordered = (prefix & ~reached_by_all[cut]).bit_count()
        if unordered == 0:
            cuts.append(cut)
        elif best is None or unordered < best[0]:
            best = (unordered, cut)
    if not cuts and best is not None:
        cuts = [best[1]]
    parts, start = [], 0
    for cut in [*cuts, count]:
        parts.append(positions[start:cut])
        start = cut
    return parts
