"""Dependency graph over the equations of one (open) jaxpr.

Edges follow variable identity: equation ``j`` depends on ``i`` when it reads
a variable ``i`` writes. Effectful equations are additionally chained in
program order so side effects keep their relative order.

Example::

    graph = build_graph(jaxpr)
    graph.preds[5]      # indices of the equations equation 5 reads from

Emission *units* are typed: an equation (``EqnUnit``), a stream region
(``RegionUnit``), a group of collectives launched together (``CollectivesUnit``) or a
pass's rewrite (``RewriteUnit``). ``contract`` orders a level's units with some
blocks of equations contracted to one unit each; the planner and the passes both
emit in that order. ``DisjointSets`` is the union-find the planner and the passes share.

Sharp edges:
  * The graph is per level: an equation holding nested jaxprs is one node.
    Callers recurse into nested jaxprs themselves.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _compat
from .._compat import JaxprLike


@dataclasses.dataclass(frozen=True, slots=True)
class Graph:
    """Predecessors and successors of each equation, by index."""

    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    # Equations with at least one output among the jaxpr's outputs.
    feeds_output: frozenset[int]
    # Equations whose results are needed (by outputs or by effects).
    live: frozenset[int]
    # Whether some equation has ordering effects (its edges chain them in program order).
    effects: bool = False

    @property
    def size(self) -> int:
        return len(self.preds)


# The classes, not ``_compat.is_literal``/``is_drop_var``: a call per atom costs more than
# the rest of a graph's loop. Literals are unhashable: filtered before lookup.
_LITERAL, _DROP_VAR = _compat.Literal, _compat.DropVar


# Which equation writes each variable of a level (``graph_and_writers``): what
# ``rebuilt_graph`` derives the next level's graph from. Kept beside the graph for one
# call (``Analysis``), never in it: a ``Graph`` holds indices only.
Writers = dict[Any, int]


def reachable(graph: Graph, start: Sequence[int], forward: bool) -> set[int]:
    """Equations reachable from ``start`` following edges one way (``forward``: to
    consumers); a start equation is in it only where another start reaches it."""
    edges = graph.succs if forward else graph.preds
    seen: set[int] = set()
    stack = list(start)
    while stack:
        for j in edges[stack.pop()]:
            if j not in seen:
                seen.add(j)
                stack.append(j)
    return seen


class DisjointSets:
    """Disjoint sets of the positions ``0 .. size - 1`` (union-find), each named by a root.

    ``union(k, into)`` joins ``k``'s set to ``into``'s, whose root stays the root: callers
    that read roots as representatives (the planner's units) choose which one survives.
    """

    __slots__ = ("_parent",)

    def __init__(self, size: int) -> None:
        self._parent = list(range(size))

    def find(self, k: int) -> int:
        """The root of ``k``'s set (halving the path on the way)."""
        parent = self._parent
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def union(self, k: int, into: int) -> bool:
        """Join ``k``'s set to ``into``'s under ``into``'s root; False if already one set."""
        root, target = self.find(k), self.find(into)
        if root == target:
            return False
        self._parent[root] = target
        return True

    def groups(self) -> list[list[int]]:
        """Every set's positions in increasing order, the sets in order of their first
        position."""
        out: dict[int, list[int]] = {}
        for k in range(len(self._parent)):
            out.setdefault(self.find(k), []).append(k)
        return list(out.values())

    def copy(self) -> DisjointSets:
        """The same sets, to be joined further without changing these."""
        new = DisjointSets(0)
        new._parent = list(self._parent)
        return new


def build_graph(jaxpr: JaxprLike) -> Graph:
    """The dependency graph of an open jaxpr's equations.

    Not memoised here: one analysis memoises it per level (``Analysis.graph``), and
    nothing outlives the call.
    """
    return _build_graph(jaxpr)[0]


def graph_and_writers(jaxpr: JaxprLike) -> tuple[Graph, Writers]:
    """``build_graph(jaxpr)`` and which equation writes each variable."""
    return _build_graph(jaxpr)


def _build_graph(jaxpr: JaxprLike) -> tuple[Graph, Writers]:
    producer: Writers = {}
    preds: list[tuple[int, ...]] = []
    effectful: list[int] = []
    last_effect: int | None = None
    for index, eqn in enumerate(jaxpr.eqns):
        inputs = _inputs(eqn.invars, producer)
        # Most equations have no effects at all; only those with some pay for the filter.
        if eqn.effects and _compat.ordering_effects(eqn):
            effectful.append(index)
            if last_effect is not None and last_effect not in inputs:
                inputs = tuple(sorted((*inputs, last_effect)))
            last_effect = index
        preds.append(inputs)
        _write(eqn.outvars, index, producer)
    return _finish(jaxpr, preds, producer, effectful)


def _inputs(invars: Sequence[Any], producer: Mapping[Any, int]) -> tuple[int, ...]:
    """The sorted distinct writers of ``invars`` (level inputs and literals have none)."""
    if len(invars) == 1:  # most equations: no set, no sort
        v = invars[0]
        source = -1 if type(v) is _LITERAL else producer.get(v, -1)
        return () if source < 0 else (source,)
    produced = producer.get
    sources = {produced(v, -1) for v in invars if type(v) is not _LITERAL}
    sources.discard(-1)
    return tuple(sorted(sources)) if len(sources) > 1 else tuple(sources)


def _write(outvars: Sequence[Any], index: int, producer: Writers) -> None:
    for v in outvars:
        if type(v) is not _DROP_VAR:
            producer[v] = index


def _finish(jaxpr: JaxprLike, preds: list[tuple[int, ...]], producer: Writers,
            effectful: Sequence[int]) -> tuple[Graph, Writers]:
    """The graph of ``jaxpr`` from its equations' predecessors: their successors, the
    equations feeding its outputs, and the live ones; and ``producer``."""
    succ_lists: list[list[int]] = [[] for _ in preds]
    for index, inputs in enumerate(preds):
        for source in inputs:
            succ_lists[source].append(index)
    feeds_output = frozenset(producer[v] for v in jaxpr.outvars
                             if type(v) is not _LITERAL and v in producer)
    live: set[int] = set(feeds_output)
    live.update(effectful)
    for index in range(len(preds) - 1, -1, -1):
        if index in live:
            live.update(preds[index])
    return (Graph(tuple(preds), tuple(map(tuple, succ_lists)), feeds_output,
                  frozenset(live), bool(effectful)), producer)


def rebuilt_graph(graph: Graph, writers: Writers, old_eqns: Sequence[Any], jaxpr: JaxprLike,
                  origin: Sequence[int]) -> tuple[Graph, Writers]:
    """The graph and writers of ``jaxpr`` (open), a level rebuilt from one whose
    equations were ``old_eqns``, with graph ``graph`` and writers ``writers``: equation
    ``k`` of ``jaxpr`` is kept from old equation ``origin[k]``, or was emitted by a
    rewrite (``-1``).

    Equal to ``graph_and_writers(jaxpr)``, in proportion to what changed: a kept equation that
    is the same object as before reads the same variables, written by the same kept
    equations (a rewrite renames what its replaced equations wrote, so an equation
    reading one is a new object), so its predecessors are the old ones renumbered; only
    the emitted equations and the changed ones look their inputs up. Where ordering
    effects chain equations (in the old level or an emitted equation), the graph is
    built afresh.
    """
    if graph.effects or len(old_eqns) != graph.size:
        return _build_graph(jaxpr)
    new_of = [-1] * len(old_eqns)
    for index, old in enumerate(origin):
        if old >= 0:
            new_of[old] = index
    producer = {v: new_of[i] for v, i in writers.items() if new_of[i] >= 0}
    eqns = jaxpr.eqns
    for index, eqn in enumerate(eqns):
        if origin[index] < 0:
            _write(eqn.outvars, index, producer)
    old_preds = graph.preds
    preds: list[tuple[int, ...]] = []
    add_pred = preds.append
    for eqn, old in zip(eqns, origin, strict=True):
        if old >= 0 and eqn is old_eqns[old]:
            inputs = old_preds[old]
            if len(inputs) == 1:  # most equations
                source = new_of[inputs[0]]
                if source < 0:  # a writer was replaced: not a kept equation's graph
                    return _build_graph(jaxpr)
                add_pred((source,))
            elif inputs:
                renumbered = [new_of[p] for p in inputs]
                if -1 in renumbered:
                    return _build_graph(jaxpr)
                add_pred(tuple(sorted(renumbered)))
            else:
                add_pred(inputs)
            continue
        if old < 0 and eqn.effects and _compat.ordering_effects(eqn):
            return _build_graph(jaxpr)
        add_pred(_inputs(eqn.invars, producer))
    return _finish(jaxpr, preds, producer, ())


@dataclasses.dataclass(frozen=True, slots=True)
class EqnUnit:
    """One equation of the level, emitted as it is."""

    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class RegionUnit:
    """Region ``region`` of section ``section`` of a level plan: one stream call."""

    section: int
    region: int


@dataclasses.dataclass(frozen=True, slots=True)
class CollectivesUnit:
    """Collective group ``group`` of a level plan, launched together."""

    group: int


@dataclasses.dataclass(frozen=True, slots=True)
class RewriteUnit:
    """Rewrite ``rewrite`` of a pass: its equations replaced together."""

    rewrite: int


Unit = EqnUnit | RegionUnit | CollectivesUnit | RewriteUnit

# ``EqnUnit(i)`` for every i below the largest level ordered so far: units are immutable
# and compared by value, and making a frozen dataclass costs a few microseconds, which
# every order of a level of ten thousand equations paid ten thousand times. Holds ints
# only (no jaxpr), so it may outlive the call.
_EQN_UNITS: list[EqnUnit] = []


def eqn_units(start: int, stop: int) -> tuple[EqnUnit, ...]:
    """``EqnUnit(i)`` for ``start <= i < stop``."""
    if stop > len(_EQN_UNITS):
        _EQN_UNITS.extend(EqnUnit(i) for i in range(len(_EQN_UNITS), stop))
    return tuple(_EQN_UNITS[start:stop])


def _by_first_index(graph: Graph, unit_of: Sequence[int], first: Sequence[int],
                    block_units: Sequence[Unit], units: Sequence[EqnUnit], low: int,
                    high: int) -> tuple[Unit, ...] | None:
    """The span's units in order of their first equation, where that order is
    topological (every edge between two units goes from the one with the smaller first
    index), else None. Kahn's algorithm popping the smallest first index then pops them
    in exactly this order: each unit's predecessors come before it, so the unit next by
    first index is ready when all before it are out, and it is the smallest remaining.
    A rewrite that leaves the level's order alone (the common case) skips the heap."""
    size = graph.size
    preds = graph.preds
    for i in range(low, high):
        target = unit_of[i]
        start = first[target]
        for p in preds[i]:
            if p >= low and unit_of[p] != target and first[unit_of[p]] > start:
                return None
    return tuple([units[i] if unit_of[i] < size else block_units[unit_of[i] - size]
                  for i in range(low, high)
                  if unit_of[i] < size or first[unit_of[i]] == i])


class ContractionCycle(RuntimeError):
    """Contracting the blocks to one unit each makes the level's order cyclic."""


class DependentUnits(RuntimeError):
    """Two units that must be mutually independent depend on each other."""


def contract(graph: Graph, blocks: Sequence[tuple[Unit, Sequence[int]]],
             antichains: Sequence[Sequence[Unit]] = ()) -> tuple[Unit, ...]:
    """Emission order of the level with each block contracted to one unit.

    Kahn's algorithm, the unit holding the smallest original index first
    (deterministic); equations outside every block are ``EqnUnit``s.

    Args:
      graph: the level's dependency graph.
      blocks: ``(unit, equation indices)`` pairs; blocks are disjoint.
      antichains: groups of block units that must not depend on each other, directly
        or through other units (the regions of one section).

    Raises:
      ContractionCycle: a block is not convex, or blocks depend on each other both ways.
      DependentUnits: two units of one antichain depend on each other.
    """
    if not blocks:
        return eqn_units(0, graph.size)  # already topological
    size = graph.size
    # Without antichains only the span of the blocks is ordered: every unit before the
    # first block's first equation is ready, in program order, before any block, and
    # every equation after the last block's last one waits for nothing after it, so the
    # order outside the span is program order (the same order as Kahn's over the whole
    # level, for a fraction of the cost when a rewrite is small).
    low = min(min(eqns) for _, eqns in blocks) if not antichains else 0
    high = max(max(eqns) for _, eqns in blocks) + 1 if not antichains else size
    unit_of: list[int] = list(range(size))  # equation -> unit id (< size: the equation's own)
    block_units: list[Unit] = []  # unit id size + k -> the k-th block's unit
    first: list[int] = list(range(size))
    for unit, eqns in blocks:
        uid = size + len(block_units)
        block_units.append(unit)
        first.append(min(eqns))
        for i in eqns:
            unit_of[i] = uid
    if not antichains:
        units = eqn_units(0, size)
        ordered = _by_first_index(graph, unit_of, first, block_units, units, low, high)
        if ordered is not None:
            return units[:low] + ordered + units[high:]
    live = sorted(set(unit_of[low:high]), key=lambda u: first[u])
    edges, in_degree = _unit_edges(graph, unit_of, size + len(block_units), size, low, high)
    block_index = {unit: size + k for k, unit in enumerate(block_units)}
    bits: dict[int, int] = {}
    for chain in antichains:
        for unit in chain:
            bits.setdefault(_unit_id(block_index, unit), 1 << len(bits))
    ready = [(first[u], u) for u in live if in_degree[u] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    reach: dict[int, int] = {}
    while ready:
        _, uid = heapq.heappop(ready)
        order.append(uid)
        mine = reach.get(uid, 0) | bits.get(uid, 0)
        for target in edges[uid]:
            if mine:
                reach[target] = reach.get(target, 0) | mine
            in_degree[target] -= 1
            if in_degree[target] == 0:
                heapq.heappush(ready, (first[target], target))
    if len(order) != len(live):
        raise ContractionCycle("contracting the blocks makes a cycle")
    units = eqn_units(0, size)
    ordered = tuple([block_units[u - size] if u >= size else units[u] for u in order])
    if low or high < size:
        return units[:low] + ordered + units[high:]
    _check_antichains(antichains, block_index, bits, reach)
    return ordered


def _unit_edges(graph: Graph, unit_of: list[int], count: int, size: int, low: int, high: int
                ) -> tuple[list[list[int]], list[int]]:
    """``contract``'s successor units per unit id (of ``count``), and each one's in-degree,
    over the span ``[low, high)`` of the level's ``size`` equations.

    An equation's predecessors are distinct, so only an edge from or to a block can
    repeat; those are deduplicated through ``block_edges``. (The order of a unit's
    successors does not matter: units pop by first index.)
    """
    in_degree = [0] * count
    edges: list[list[int]] = [[] for _ in range(count)]
    block_edges: set[tuple[int, int]] = set()
    for i in range(low, high):
        target = unit_of[i]
        for p in graph.preds[i]:
            if p < low:
                continue  # emitted before the span
            source = unit_of[p]
            if source == target:
                continue
            if source >= size or target >= size:
                if (source, target) in block_edges:
                    continue
                block_edges.add((source, target))
            edges[source].append(target)
            in_degree[target] += 1
    return edges, in_degree


def _unit_id(block_index: dict[Unit, int], unit: Unit) -> int:
    """``contract``'s id of ``unit``: its block's, or its equation's index."""
    uid = block_index.get(unit)
    if uid is None:
        assert isinstance(unit, EqnUnit), unit
        uid = unit.index
    return uid


def _check_antichains(antichains: Sequence[Sequence[Unit]], block_index: dict[Unit, int],
                      bits: dict[int, int], reach: dict[int, int]) -> None:
    """Raise ``DependentUnits`` where a unit of an antichain reaches another of it
    (``reach``: the ``bits`` of the antichain units each unit id is reached from)."""
    for chain in antichains:
        chain_bits = 0
        for unit in chain:
            chain_bits |= bits[_unit_id(block_index, unit)]
        for unit in chain:
            uid = _unit_id(block_index, unit)
            if reach.get(uid, 0) & chain_bits & ~bits[uid]:
                raise DependentUnits(f"{unit} depends on another unit it must not")
