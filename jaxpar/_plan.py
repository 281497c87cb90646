"""Planning: which equations run together on which CUDA stream.

For one level of a jaxpr (nested jaxprs get plans of their own):

1. Equations that launch a kernel of their own are *heavy* (fused elementwise
   work never does). Effectful, collective and already-annotated equations
   never move.
2. The heavy equations form a partial order (reachability). Like Nimble's
   stream assignment we look for the widest antichains, but through a
   series-parallel decomposition: the comparability graph's connected
   components are parallel branches; a cut that every earlier node reaches
   every later node through is a series split. Non-series-parallel orders
   peel off their first node and continue (valid, slightly less parallel).
3. A parallel node whose branches each cost at least ``min_cost_us`` becomes a
   *section*; the branches are balanced (longest processing time first) onto
   ``min(max_streams, async limit)`` streams, ids 1..k, one scheduling group
   per section.
4. Each stream's heavy set grows into a region: its convex hull (every
   equation between two of its members), then private producers (equations
   feeding only that region) and private consumers (light equations reading
   only that region's results). Regions are convex and mutually independent
   by construction; ``order_units`` checks both and fails loudly otherwise.

Example::

    level = plan_jaxpr(closed_jaxpr, PlanContext(options, target="gpu"))
    for section in level.sections: ...

Sharp edges:
  * Heavy equations are decomposed in windows of ``MAX_HEAVY`` (program order),
    bounding the quadratic steps; parallelism across a window boundary is lost.
  * The plan depends only on the jaxpr and the options (no dict or set
    iteration order leaks in), so every host of an SPMD job agrees.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from . import _compat
from ._cost import DEVICE_PROFILES, CostModel
from ._graph import Graph, build_graph
from ._options import Options
from ._price import command_buffer_mode, price_section

if TYPE_CHECKING:
    from .passes.collectives import CollectiveGroup, CollectiveInfo

MAX_HEAVY = 256

COLLECTIVE_PRIMITIVES = frozenset(
    {"ppermute", "psum", "pmax", "pmin", "all_gather", "all_to_all", "reduce_scatter",
     "psum_scatter", "psum_invariant", "all_gather_invariant", "pbroadcast", "ragged_all_to_all"}
)

# Primitives whose nested jaxprs we re-emit with a plan of their own. Others
# with nested jaxprs (shard_map, pallas_call, custom_transpose, ...) stay opaque.
RECURSIVE_PRIMITIVES = frozenset(
    {"jit", "pjit", "closed_call", "eval_jaxpr", "core_call", "remat2", "checkpoint", "scan",
     "while", "cond", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
     "shard_map"}
)

REASON_TOO_CHEAP = "too cheap"
REASON_DEPENDENT = "dependent"
REASON_EFFECTFUL = "effectful"
REASON_ANNOTATED = "already annotated"
REASON_COLLECTIVE = "collective"
REASON_OPAQUE = "opaque"
REASON_NO_GAIN = "does not pay"


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
    jaxpr: Any  # the Jaxpr/ClosedJaxpr as found in the program
    graph: Graph
    seconds: tuple[float, ...]
    sections: tuple[SectionPlan, ...]
    notes: tuple[Note, ...]
    nested: tuple[tuple[int, tuple[tuple[tuple[str, int | None], LevelPlan], ...]], ...]
    # Emission order: ("eqn", index), ("region", section, region) or
    # ("collectives", group) units.
    order: tuple[tuple[Any, ...], ...]
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


def async_compute_limit() -> int:
    """XLA's cap on annotated async calls in flight (default 2), from XLA_FLAGS."""
    match = re.search(r"--xla_gpu_experimental_parallel_async_compute_limit=(\d+)",
                      os.environ.get("XLA_FLAGS", ""))
    return max(int(match.group(1)), 1) if match else 2


class PlanContext:
    """Options, cost model and the scheduling-group counter for one plan."""

    def __init__(self, options: Options, target: str):
        self.options = options
        self.target = target
        self.costs = CostModel(DEVICE_PROFILES[target])
        self.streams_per_section = min(options.max_streams, async_compute_limit())
        # Sections are priced against the compiled GPU program (``_price``) unless the
        # user forces them; other targets emit no streams, so their plans only show
        # the independence.
        self.command_buffers = (command_buffer_mode()
                                if target == "gpu" and not options.force_streams else None)
        self.min_seconds = options.min_cost_us * 1e-6
        self._next_group = 1
        self._placement_memo: dict[int, tuple[Any, bool]] = {}
        self.group_collectives = (options.group_collectives if options.group_collectives != "auto"
                                  else target == "gpu")
        # Mesh axis sizes of the enclosing shard_map, while planning its body.
        self.axis_sizes: dict[Any, int] = {}

    def new_group(self) -> int:
        group = self._next_group
        self._next_group += 1
        return group

    def eqn_annotated(self, eqn: Any) -> bool:
        return eqn_has_placement(eqn, self._placement_memo)


def eqn_has_placement(eqn: Any, memo: dict[int, tuple[Any, bool]]) -> bool:
    """Whether ``eqn`` is, or (recursively) contains, user-placed code."""
    if eqn.primitive.name in _compat.USER_PLACEMENT_PRIMITIVES:
        return True
    if _compat.eqn_frontend_attributes(eqn):
        return True
    return any(jaxpr_has_placement(sub, memo) for _, _, sub in _compat.eqn_subjaxprs(eqn))


def jaxpr_has_placement(jaxpr: Any, memo: dict[int, tuple[Any, bool]]) -> bool:
    """Whether any equation of ``jaxpr`` (recursively) is user-placed."""
    hit = memo.get(id(jaxpr))
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    inner, _ = _compat.open_jaxpr(jaxpr)
    found = any(eqn_has_placement(eqn, memo) for eqn in inner.eqns)
    memo[id(jaxpr)] = (jaxpr, found)
    return found


def plan_jaxpr(jaxpr: Any, ctx: PlanContext, path: str = "") -> LevelPlan:
    """Plans one jaxpr level and, recursively, the jaxprs nested in it."""
    inner, _ = _compat.open_jaxpr(jaxpr)
    eqns = inner.eqns
    graph = build_graph(inner)
    costs = [ctx.costs.eqn_cost(eqn) for eqn in eqns]
    seconds = tuple(ctx.costs.seconds(cost) for cost in costs)
    kernels = [cost.kernels for cost in costs]
    blocked: dict[int, str] = {}
    for index, eqn in enumerate(eqns):
        if ctx.eqn_annotated(eqn):
            blocked[index] = REASON_ANNOTATED
        elif _compat.ordering_effects(eqn):
            blocked[index] = REASON_EFFECTFUL
        elif eqn.primitive.name in COLLECTIVE_PRIMITIVES:
            blocked[index] = REASON_COLLECTIVE
    notes: list[Note] = []
    # Heavy: launches a kernel of its own (fused elementwise work never does).
    heavy = [i for i in range(len(eqns)) if i in graph.live and kernels[i] > 0]
    for i in heavy:
        if i in blocked:
            notes.append(Note((i,), blocked[i], _blocked_detail(blocked[i], eqns[i])))
    heavy = [i for i in heavy if i not in blocked]
    sections: list[SectionPlan] = []
    # Late import: the passes package builds on this module.
    from .passes.collectives import group_collectives

    collective_plan = group_collectives(
        inner, graph, axis_sizes=ctx.axis_sizes,
        exclude={i for i, r in blocked.items() if r != REASON_COLLECTIVE})
    groups = collective_plan.groups if ctx.group_collectives else ()
    if groups:
        grouped = {i for g in groups for i in g.eqns}
        notes = [n for n in notes if not (n.reason == REASON_COLLECTIVE and n.eqns[0] in grouped)]
        sections = _overlap_collectives(graph, groups, heavy, blocked, seconds, ctx)
    elif collective_plan.collectives and len(heavy) >= 2:
        # Stream regions spanning several steps would only fit around the collectives;
        # on the main stream XLA's scheduler overlaps each matmul with a transfer.
        notes.append(Note(tuple(heavy), REASON_COLLECTIVE,
                          "this level communicates: its compute stays on the main stream so "
                          "XLA can overlap it with the collectives"))
    elif len(heavy) >= 2:
        # Windows of MAX_HEAVY heavy equations in program order bound the quadratic
        # steps; parallelism across a window boundary is given up.
        region_of: dict[int, tuple[int, int]] = {}
        for start in range(0, len(heavy), MAX_HEAVY):
            window = heavy[start:start + MAX_HEAVY]
            if len(window) < 2:
                continue
            end = heavy[start + MAX_HEAVY] if start + MAX_HEAVY < len(heavy) else graph.size
            finder = _SectionFinder(inner, graph, window, seconds, blocked, ctx, region_of,
                                    len(sections), end)
            more, more_notes = finder.run()
            sections.extend(more)
            notes.extend(more_notes)
    elif len(heavy) == 1:
        notes.append(Note((heavy[0],), REASON_DEPENDENT,
                          "the only heavy equation at this level: nothing to overlap with"))
    in_region = {i for s in sections for r in s.regions for i in r.eqns}
    nested: list[tuple[int, tuple[tuple[tuple[str, int | None], LevelPlan], ...]]] = []
    for index, eqn in enumerate(eqns):
        if index in in_region or (index in blocked and blocked[index] != REASON_EFFECTFUL):
            continue
        if eqn.primitive.name not in RECURSIVE_PRIMITIVES:
            if any(True for _ in _compat.eqn_subjaxprs(eqn)) and seconds[index] >= ctx.min_seconds:
                notes.append(Note((index,), REASON_OPAQUE,
                                  f"`{eqn.primitive.name}` bodies are not rewritten"))
            continue
        subs = []
        outer_axes = ctx.axis_sizes
        if _compat.is_shard_map(eqn):
            ctx.axis_sizes = {**outer_axes, **dict(_compat.shard_map_info(eqn).axis_sizes)}
        for name, item, sub in _compat.eqn_subjaxprs(eqn):
            label = f"{name}[{item}]" if item is not None else name
            sub_plan = plan_jaxpr(sub, ctx, f"{path}/{eqn.primitive.name}#{index}.{label}")
            # Kept for the report even when it changes nothing; the emitter skips those.
            if sub_plan.changes_anything or any(
                    n.reason != REASON_DEPENDENT for level in sub_plan.walk() for n in level.notes):
                subs.append(((name, item), sub_plan))
        ctx.axis_sizes = outer_axes
        if subs:
            nested.append((index, tuple(subs)))
    try:
        order = order_units(graph, sections, groups)
    except _GroupCycle:
        notes.append(Note(tuple(i for g in groups for i in g.eqns), REASON_COLLECTIVE,
                          "not grouped: launching these together would reorder them around "
                          "a stream region"))
        groups = ()
        sections = [s for s in sections if s.collectives is None]
        order = order_units(graph, sections)
    return LevelPlan(path or "/", jaxpr, graph, seconds, tuple(sections), tuple(notes),
                     tuple(nested), order, tuple(groups), collective_plan.collectives)


def _closure(graph: Graph, start: Sequence[int], forward: bool) -> set[int]:
    """Equations reachable from ``start`` (excluded), following edges one way."""
    edges = graph.succs if forward else graph.preds
    seen: set[int] = set()
    stack = list(start)
    while stack:
        for j in edges[stack.pop()]:
            if j not in seen:
                seen.add(j)
                stack.append(j)
    return seen


def _overlap_collectives(graph: Graph, groups: Sequence[CollectiveGroup], heavy: list[int],
                         blocked: dict[int, str], seconds: tuple[float, ...],
                         ctx: PlanContext) -> list[SectionPlan]:
    """For each collectives group, the compute that can run while it transfers.

    The heavy equations independent of the group (neither feeding nor fed by it) and
    not taken by an earlier group, closed to their convex hull plus private
    producers, become one stream region. In a collective matmul that is the step's
    matmuls on the blocks the previous step received. Seen deviceless (8 H200s):
    each group's start, the region's start, then both dones.
    """
    taken: set[int] = set()
    sections = []
    for index, group in enumerate(groups):
        members = set(group.eqns)
        related = members | _closure(graph, group.eqns, True) | _closure(graph, group.eqns, False)
        picked = [i for i in heavy if i not in related and i not in taken]
        if not picked:
            continue
        hull = (_closure(graph, picked, True) & _closure(graph, picked, False)) | set(picked)
        if any(i in blocked or i in taken for i in hull):
            continue
        region = set(hull)
        for i in range(max(region), -1, -1):  # private producers, consumers first
            if (i not in region and i not in blocked and i not in taken and i in graph.live
                    and i not in graph.feeds_output and graph.succs[i]
                    and all(s in region for s in graph.succs[i])):
                region.add(i)
        taken |= region
        eqns = tuple(sorted(region))
        sections.append(SectionPlan(
            group=None, regions=(RegionPlan(1, eqns, sum(seconds[i] for i in eqns)),),
            collectives=index))
    return sections


def _blocked_detail(reason: str, eqn: Any) -> str:
    name = eqn.primitive.name
    if reason == REASON_ANNOTATED:
        return f"`{name}` carries user placement (stream/compute/metadata); never wrapped or nested"
    if reason == REASON_EFFECTFUL:
        return f"`{name}` has side effects, which keep their order on the main stream"
    return f"`{name}` is a collective; collectives are grouped, not moved to compute streams"


@dataclasses.dataclass(frozen=True, slots=True)
class _Node:
    """A node of the series-parallel tree over heavy positions."""

    kind: str  # "leaf", "series" or "parallel"
    positions: list[int]
    children: tuple[_Node, ...]
    benefit: float  # seconds of work this subtree can hide by overlapping
    as_section: bool


class _RangeMasks:
    """Per-equation bit masks stored for ``[lo, lo + len(values))``, zero outside."""

    __slots__ = ("lo", "values")

    def __init__(self, lo: int, values: list[int]):
        self.lo = lo
        self.values = values

    def __getitem__(self, i: int) -> int:
        k = i - self.lo
        return self.values[k] if 0 <= k < len(self.values) else 0


_Hull = tuple[list[int], list[int]]  # (heavy positions of a branch, its hull equations)
_T = TypeVar("_T")


class _SectionFinder:
    """Series-parallel decomposition of the heavy equations of one level."""

    def __init__(self, jaxpr: Any, graph: Graph, heavy: list[int], seconds: tuple[float, ...],
                 blocked: dict[int, str], ctx: PlanContext,
                 region_of: dict[int, tuple[int, int]], first_section: int, end: int):
        self.jaxpr = jaxpr
        self.graph = graph
        self.heavy = heavy
        self.seconds = seconds
        self.blocked = blocked
        self.ctx = ctx
        self.region_of = region_of  # shared by the windows of one level
        self.first_section = first_section
        self.bit = {eqn: k for k, eqn in enumerate(heavy)}
        # Masks over heavy positions, computed only from the first heavy equation (none
        # before it has heavy ancestors) to ``end`` (where the next window starts;
        # equations from there on are never absorbed), and for descendants only up to
        # the last heavy equation (none after it has heavy descendants).
        self.lo, self.hi, self.end = heavy[0], heavy[-1], end
        lo, hi = self.lo, self.hi
        anc = [0] * (end - lo)
        for i in range(lo, end):
            mask = 0
            for p in graph.preds[i]:
                if p >= lo:
                    mask |= anc[p - lo]
            if i in self.bit:
                mask |= 1 << self.bit[i]
            anc[i - lo] = mask
        desc = [0] * (hi - lo + 1)
        for i in range(hi, lo - 1, -1):
            mask = 0
            for s in graph.succs[i]:
                if s <= hi:
                    mask |= desc[s - lo]
            if i in self.bit:
                mask |= 1 << self.bit[i]
            desc[i - lo] = mask
        self.anc = _RangeMasks(lo, anc)
        self.desc = _RangeMasks(lo, desc)
        # Heavy-to-heavy ancestry, indexed by heavy position.
        self.heavy_anc = [self.anc[eqn] for eqn in heavy]
        self.heavy_desc = [self.desc[eqn] for eqn in heavy]
        self.notes: list[Note] = []
        self._attach_loose_ends()

    def _attach_loose_ends(self) -> None:
        """Groups cheap heavy sources and sinks with their only neighbour.

        A cheap source feeding one heavy equation (a weight ``rev`` or transpose in a
        backward pass) or a cheap sink hanging off one (a weight gradient) is
        unordered with most of the program, which breaks every series cut although
        it cannot be worth a stream by itself. It becomes part of its neighbour's
        unit; decomposition then runs over units (``self.members``/``self.unit_anc``).
        """
        count = len(self.heavy)
        rep = list(range(count))

        def find(k: int) -> int:
            while rep[k] != k:
                k = rep[k]
            return k

        def only(mask: int, related: list[int]) -> int | None:
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
            cheap = self.seconds[self.heavy[k]] < self.ctx.min_seconds
            own = 1 << k
            if not cheap:
                continue
            if self.heavy_anc[k] == own:  # a source: attach to its only first successor
                target = only(self.heavy_desc[k] & ~own, self.heavy_anc)
            elif self.heavy_desc[k] == own:  # a sink: attach to its only last predecessor
                target = only(self.heavy_anc[k] & ~own, self.heavy_desc)
            else:
                continue
            if target is not None and find(target) != k:
                rep[k] = find(target)
        roots = [find(k) for k in range(count)]
        self.members: dict[int, list[int]] = {}
        for k, root in enumerate(roots):
            self.members.setdefault(root, []).append(k)
        self.units = sorted(self.members)

        # Most positions are their own unit: only the attached ones need remapping.
        moved_mask = 0
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

        self.unit_anc = {u: to_units(self._or(self.heavy_anc, self.members[u]))
                         for u in self.units}
        self.unit_desc = {u: to_units(self._or(self.heavy_desc, self.members[u]))
                          for u in self.units}

    @staticmethod
    def _or(masks: list[int], positions: list[int]) -> int:
        out = 0
        for k in positions:
            out |= masks[k]
        return out

    def _expand(self, units: list[int]) -> list[int]:
        """Heavy positions of the given units, sorted."""
        return sorted(k for u in units for k in self.members[u])

    def run(self) -> tuple[list[SectionPlan], list[Note]]:
        tree = self._decompose(list(self.units))
        branch_sets: list[list[list[int]]] = []
        self._choose(tree, branch_sets)
        sections: list[SectionPlan] = []
        region_of = self.region_of
        for branches in branch_sets:
            section = self._build_section(branches, region_of,
                                          self.first_section + len(sections))
            if section is not None:
                sections.append(section)
        explained = {i for note in self.notes for i in note.eqns}
        dependent = tuple(i for i in self.heavy if i not in region_of and i not in explained)
        if dependent:
            self.notes.append(Note(dependent, REASON_DEPENDENT,
                                   "on the critical path: everything heavy beside it depends "
                                   "on it or feeds it"))
        return sections, self.notes

    def _decompose(self, positions: list[int]) -> _Node:
        """The series-parallel tree of ``positions``, with the time each node can hide."""
        if len(positions) < 2:
            return _Node("leaf", positions, (), 0.0, False)
        components = self._components(positions)
        if len(components) == 1:
            children = tuple(self._decompose(p) for p in self._series_parts(positions))
            return _Node("series", positions, children, sum(c.benefit for c in children), False)
        children = tuple(self._decompose(c) for c in components)
        inner = sum(c.benefit for c in children)
        here = 0.0
        if self.ctx.streams_per_section >= 2:
            here = self._overlapped_seconds(components)
            if here < self.ctx.min_seconds:
                here = 0.0
        # Dynamic programming: a section here, or the best sections inside the branches.
        as_section = here > 0.0 and here >= inner
        return _Node("parallel", positions, children, max(here, inner), as_section)

    def _choose(self, node: _Node, branch_sets: list[list[list[int]]]) -> None:
        if node.as_section:
            branch_sets.append([c.positions for c in node.children])
            return
        if node.kind == "parallel" and node.benefit == 0.0:
            if self.ctx.streams_per_section < 2:
                self.notes.append(Note(
                    tuple(self.heavy[k] for k in self._expand(node.positions)), REASON_DEPENDENT,
                    "independent branches, but only one stream is allowed (max_streams or "
                    "--xla_gpu_experimental_parallel_async_compute_limit is 1)"))
                return
            for child in node.children:
                self.notes.append(Note(
                    tuple(self.heavy[k] for k in self._expand(child.positions)), REASON_TOO_CHEAP,
                    f"independent branch of est. {self._cost(child.positions) * 1e6:.1f} us; "
                    "the work that could overlap is below min_cost_us"))
            return
        for child in node.children:
            self._choose(child, branch_sets)

    def _cost(self, positions: list[int]) -> float:
        return sum(self.seconds[self.heavy[k]] for k in self._expand(positions))

    def _overlapped_seconds(self, branches: list[list[int]]) -> float:
        """Work balanced onto the lightest stream: what running in parallel can hide."""
        loads = [sum(self._cost(b) for b in group) for group in self._balance(branches)]
        return min(loads) if len(loads) >= 2 else 0.0

    def _components(self, positions: list[int]) -> list[list[int]]:
        """Connected components of the comparability graph on ``positions``.

        A breadth-first search over bit masks: each unit is expanded once, by the
        units it reaches or is reached from.
        """
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
                    grown |= self.unit_anc[k] | self.unit_desc[k]
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

    def _series_parts(self, positions: list[int]) -> list[list[int]]:
        """Splits at every cut that all earlier nodes reach all later nodes across.

        Where there is no such cut (the order is not series-parallel here), splits at
        the cut leaving the fewest earlier nodes unordered with some later node: still
        valid, since only parallel nodes become sections, and it keeps most of the
        parallelism. Linear in ``positions`` (suffix intersections of the masks).
        """
        count = len(positions)
        reached_by_all = [0] * (count + 1)  # AND of the ancestor masks of positions[c:]
        reached_by_all[count] = -1
        for c in range(count - 1, -1, -1):
            reached_by_all[c] = reached_by_all[c + 1] & self.unit_anc[positions[c]]
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

    def _build_section(self, branches: list[list[int]],
                       region_of: dict[int, tuple[int, int]],
                       section_index: int) -> SectionPlan | None:
        hulls = []
        for units in branches:
            branch = self._expand(units)
            hull = self._hull(branch)
            bad = [i for i in hull if i in self.blocked]
            if bad:
                reason = self.blocked[bad[0]]
                self.notes.append(Note(tuple(self.heavy[k] for k in branch), reason,
                                       f"the branch encloses equation {bad[0]} ({reason}), "
                                       "which must stay in place"))
                continue
            hulls.append((units, hull))
        if len(hulls) < 2 or self._overlapped_seconds([b for b, _ in hulls]) < self.ctx.min_seconds:
            return None
        bins = self._balance(hulls)
        bit_mask = 0
        for units, _ in hulls:
            for k in self._expand(units):
                bit_mask |= 1 << k
        members: list[set[int]] = [set() for _ in bins]
        for slot, group in enumerate(bins):
            for _, hull in group:
                members[slot].update(hull)
        for slot, eqns in enumerate(members):
            for i in eqns:
                region_of[i] = (section_index, slot)
        self._absorb_neighbours(members, region_of, section_index, bit_mask)
        if self.ctx.command_buffers is not None:
            independent_dots = [
                self.heavy[k] for k in range(len(self.heavy))
                if not (1 << k) & bit_mask and not self.heavy_anc[k] & bit_mask
                and not self.heavy_desc[k] & bit_mask]
            verdict = price_section(
                self.jaxpr, self.graph, [sorted(m) for m in members], self.ctx.costs,
                mode=self.ctx.command_buffers, min_gain_seconds=self.ctx.min_seconds,
                independent_dots=independent_dots)
            if not verdict.pays:
                for eqns in members:
                    for i in eqns:
                        del region_of[i]
                heavy_members = [self.heavy[k] for units, _ in hulls for k in self._expand(units)]
                self.notes.append(Note(tuple(sorted(heavy_members)), REASON_NO_GAIN,
                                       verdict.reason))
                return None
        ordered = sorted(range(len(members)), key=lambda s: min(members[s]))
        regions = tuple(
            RegionPlan(stream=stream, eqns=tuple(sorted(members[slot])),
                       seconds=sum(self.seconds[i] for i in members[slot]))
            for stream, slot in enumerate(ordered, start=1))
        return SectionPlan(group=self.ctx.new_group(), regions=regions)

    def _hull(self, branch: list[int]) -> list[int]:
        """Every equation between two members of ``branch`` (forward search, pruned)."""
        mask = 0
        for k in branch:
            mask |= 1 << k
        last = self.heavy[branch[-1]]
        found = {self.heavy[k] for k in branch}
        stack = list(found)
        while stack:
            i = stack.pop()
            for s in self.graph.succs[i]:
                if s <= last and s not in found and self.desc[s] & mask:
                    found.add(s)
                    stack.append(s)
        return sorted(found)

    def _balance(self, items: list[_T]) -> list[list[_T]]:
        """Longest-processing-time-first onto ``min(streams, len(items))`` bins.

        ``items`` are branches (lists of heavy positions) or ``(branch, hull)`` pairs.
        """
        def branch(item: Any) -> list[int]:
            return item[0] if isinstance(item, tuple) else item

        slots = min(self.ctx.streams_per_section, len(items))
        order = sorted(items, key=lambda it: (-self._cost(branch(it)), branch(it)[0]))
        bins: list[list[_T]] = [[] for _ in range(slots)]
        loads = [0.0] * slots
        for item in order:
            slot = min(range(slots), key=lambda s: (loads[s], s))
            bins[slot].append(item)
            loads[slot] += self._cost(branch(item))
        return bins

    def _absorb_neighbours(self, members: list[set[int]],
                           region_of: dict[int, tuple[int, int]], section_index: int,
                           section_mask: int) -> None:
        """Grows regions by private producers, then private consumers (worklists)."""
        graph = self.graph

        def movable(i: int) -> bool:
            return (i not in region_of and i not in self.blocked and i not in self.bit
                    and i in graph.live)

        # Private producers: light equations whose every consumer is in one region.
        # Visited from the highest index down, so a candidate's consumers are settled.
        pending = [-p for slot in members for i in slot for p in graph.preds[i]]
        heapq.heapify(pending)
        seen: set[int] = set()
        while pending:
            i = -heapq.heappop(pending)
            if i in seen:
                continue
            seen.add(i)
            if (not movable(i) or i in graph.feeds_output or not graph.succs[i]
                    or self.anc[i] & section_mask):
                continue
            consumers = {region_of.get(s) for s in graph.succs[i]}
            if len(consumers) != 1:
                continue
            (consumer,) = consumers
            if consumer is None or consumer[0] != section_index:
                continue
            members[consumer[1]].add(i)
            region_of[i] = consumer
            for p in graph.preds[i]:
                heapq.heappush(pending, -p)
        # Private consumers: light equations reading only one region's results,
        # visited from the lowest index up so their producers are settled.
        pending = [s for slot in members for i in slot for s in graph.succs[i]]
        heapq.heapify(pending)
        seen.clear()
        while pending:
            i = heapq.heappop(pending)
            if i in seen:
                continue
            seen.add(i)
            if i >= self.end or not movable(i) or self.desc[i] & section_mask:
                continue
            owners: set[tuple[int, int]] = set()
            for p in graph.preds[i]:
                owner = region_of.get(p)
                if owner is None:
                    if self.anc[p] & section_mask:
                        break
                elif owner[0] == section_index:
                    owners.add(owner)
                else:
                    break
            else:
                if len(owners) == 1:
                    (owner,) = owners
                    members[owner[1]].add(i)
                    region_of[i] = owner
                    for s in graph.succs[i]:
                        heapq.heappush(pending, s)


class _GroupCycle(Exception):
    """Contracting the collective groups together with the regions makes a cycle."""


def order_units(graph: Graph, sections: list[SectionPlan] | tuple[SectionPlan, ...],
                groups: Sequence[CollectiveGroup] = ()) -> tuple[tuple[Any, ...], ...]:
    """Emission order with each region and each collective group contracted to one unit.

    Kahn's algorithm, smallest original index first (deterministic). Raises if a
    region is not convex or two regions of one section depend on each other: both
    are planner bugs, and emitting would reorder computation. Raises ``_GroupCycle``
    when only the collective groups are to blame (the caller drops them).
    """
    # Units are ints: equation ``i`` on its own is unit ``i``; contracted units (the
    # collective groups, then the regions in section order) follow from ``size``. The
    # heap orders units by (first index, kind, number), as the labels would sort
    # ("collectives" < "eqn" < "region"), so the order does not depend on the numbering.
    size = graph.size
    labels: list[tuple[Any, ...]] = []
    firsts: list[int] = []
    unit_of = list(range(size))
    contracted_of: dict[int, int] = {}  # equation -> contracted unit, before groups overwrite
    region_units: list[tuple[int, int, int]] = []  # (unit, section, region)
    for g, group in enumerate(groups):
        labels.append(("collectives", g))
        firsts.append(group.eqns[0])
    for s, section in enumerate(sections):
        for r, region in enumerate(section.regions):
            unit = size + len(labels)
            labels.append(("region", s, r))
            firsts.append(region.eqns[0])
            region_units.append((unit, s, r))
            for i in region.eqns:
                contracted_of[i] = unit
    for g, group in enumerate(groups):
        for i in group.eqns:
            contracted_of[i] = size + g
    for i, unit in contracted_of.items():
        if i < size:
            unit_of[i] = unit
    total = size + len(labels)
    rank = [1] * size + [0] * len(groups) + [2] * (len(labels) - len(groups))
    first = list(range(size)) + firsts
    present = bytearray(total)
    for unit in unit_of:
        present[unit] = 1
    in_degree = [0] * total
    edges: list[list[int]] = [[] for _ in range(total)]
    seen_edges: set[tuple[int, int]] = set()  # only edges touching a contracted unit repeat
    for i in range(size):
        target = unit_of[i]
        for p in graph.preds[i]:
            source = unit_of[p]
            if source == target:
                continue
            if source >= size or target >= size:
                if (source, target) in seen_edges:
                    continue
                seen_edges.add((source, target))
            edges[source].append(target)
            in_degree[target] += 1
    ready = [(first[u], rank[u], u) for u in range(total) if present[u] and in_degree[u] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    reach = [0] * total
    region_bits = [0] * total
    for k, (unit, _, _) in enumerate(region_units):
        region_bits[unit] = 1 << k
    while ready:
        _, _, unit = heapq.heappop(ready)
        order.append(unit)
        mine = reach[unit] | region_bits[unit]
        for target in edges[unit]:
            if mine:
                reach[target] |= mine
            in_degree[target] -= 1
            if in_degree[target] == 0:
                heapq.heappush(ready, (first[target], rank[target], target))
    if len(order) != sum(present):
        if groups:
            raise _GroupCycle
        raise RuntimeError("jaxpar planner bug: a region is not convex; please report it "
                           "with the program that triggered it")
    section_bits: dict[int, int] = {}
    for unit, s, _ in region_units:
        section_bits[s] = section_bits.get(s, 0) | region_bits[unit]
    for unit, s, _ in region_units:
        if reach[unit] & section_bits[s] & ~region_bits[unit]:
            raise RuntimeError("jaxpar planner bug: regions of one section depend on "
                               "each other; please report it with the program")
    return tuple(("eqn", u) if u < size else labels[u - size] for u in order)
