"""Planning one level: the phases in order, the notes, recursion and emission order.

For one level of a jaxpr (nested jaxprs get plans of their own), the phases of
docs/design.md ("Planning"):

1. Effectful, collective and already-annotated equations never move (``blocked``);
   the others that launch a kernel of their own are *heavy* (``heavy.heavy_order``:
   masks, units), per window of ``MAX_HEAVY`` heavy equations.
2. and 3. ``sections.decompose`` and ``sections.choose_sections`` (the series-parallel
   tree and the dynamic programme).
4. ``regions.build_regions`` (hull, balance, private neighbours).
   A level with collectives groups (``collectives.group_collectives``) takes, in
   place of phases 2 to 4, the compute that overlaps each group's transfers
   (``collectives.overlap_collectives``).
5. For the GPU, ``pricing.price_regions`` (``price_collective_section`` for a
   collectives group's section).
6. ``order_units`` contracts regions and groups to one unit each and checks that
   regions are convex and those of one section independent.
7. Equations outside regions with nested jaxprs get plans of their own.

Example::

    analysis = Analysis(Options().resolve("gpu"))   # one per call: settings, costs, memos
    level = plan_jaxpr(closed_jaxpr, analysis)
    for section in level.sections: ...

Sharp edges:
  * Heavy equations are decomposed in windows of ``MAX_HEAVY`` (program order),
    bounding the quadratic steps; parallelism across a window boundary is lost.
  * The plan depends only on the jaxpr and the options (no dict or set
    iteration order leaks in), so every host of an SPMD job agrees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _compat
from .._analysis import Analysis
from .._compat import Jaxpr, JaxprEqn, JaxprLike
from .._memo import IdentityMemo
from .._options import Settings
from .._program.graph import (
    CollectivesUnit,
    ContractionCycle,
    DependentUnits,
    EqnUnit,
    Graph,
    RegionUnit,
    Unit,
    build_graph,
    contract,
)
from .._program.primitives import is_collective
from .collectives import CollectivePlan, group_collectives, overlap_collectives
from .heavy import HeavyOrder, heavy_order
from .plans import (
    MAX_HEAVY,
    REASON_ANNOTATED,
    REASON_COLLECTIVE,
    REASON_DEPENDENT,
    REASON_EFFECTFUL,
    REASON_NO_GAIN,
    REASON_OPAQUE,
    REASON_SYMBOLIC,
    REASON_TOO_CHEAP,
    RECURSIVE_PRIMITIVES,
    CollectiveGroup,
    LevelPlan,
    Note,
    SectionPlan,
)
from .pricing import price_collective_section, price_regions
from .regions import build_regions
from .sections import SectionChoice, choose_sections, decompose

_NestedPlans = tuple[tuple[int, tuple[tuple[tuple[str, int | None], LevelPlan], ...]], ...]


def plan_jaxpr(jaxpr: JaxprLike, analysis: Analysis, path: str = "") -> LevelPlan:
    """Plans one jaxpr level and, recursively, the jaxprs nested in it.

    Sections are numbered (their ``_scheduling_group_id``) from 1 in planning order:
    a level's own sections first, then those of the jaxprs nested in it.
    """
    plan, _ = _plan_level(jaxpr, analysis, path, {}, 1)
    return plan


def symbolic_plan(jaxpr: JaxprLike, dimensions: Sequence[str]) -> LevelPlan:
    """The plan of a program whose sizes ``dimensions`` are symbolic (``jax.export``'s
    shape polymorphism): every equation as it is, nothing priced. The cost model, the
    memory model and the passes need sizes; a representative size would decide
    for programs the user never runs, so the program runs as ``jax.jit`` runs it."""
    inner, _ = _compat.open_jaxpr(jaxpr)
    count = len(inner.eqns)
    sizes = ", ".join(dimensions)
    note = Note(tuple(range(count)), REASON_SYMBOLIC,
                f"its sizes {sizes} are symbolic, so it runs as jax.jit runs it; jaxpar "
                "prices and rewrites programs of known sizes (trace, call or export it with "
                "concrete shapes for a plan)")
    return LevelPlan("/", jaxpr, build_graph(inner), (0.0,) * count, (), (note,) if count else (),
                     (), tuple(EqnUnit(i) for i in range(count)))


def _plan_level(jaxpr: JaxprLike, analysis: Analysis, path: str, axis_sizes: Mapping[Any, int],
                first_group: int) -> tuple[LevelPlan, int]:
    """``plan_jaxpr`` of one level inside the mesh axes ``axis_sizes`` of the enclosing
    ``shard_map`` bodies, numbering its sections from ``first_group``; returns the plan
    and the next free group number."""
    inner, _ = _compat.open_jaxpr(jaxpr)
    eqns = inner.eqns
    graph = analysis.graph(inner)
    basis = _level_basis(inner, graph, analysis, axis_sizes)
    seconds, blocked, heavy = basis.seconds, basis.blocked, list(basis.heavy)
    notes: list[Note] = list(basis.notes)
    sections: list[SectionPlan] = []
    collective_plan = basis.collective_plan
    groups = collective_plan.groups if analysis.settings.group_collectives else ()
    if groups:
        grouped = {i for g in groups for i in g.eqns}
        notes = [n for n in notes if not (n.reason == REASON_COLLECTIVE and n.eqns[0] in grouped)]
        sections = _priced_collective_sections(
            inner, graph, overlap_collectives(graph, groups, heavy, blocked, seconds),
            analysis, notes)
    elif collective_plan.collectives and len(heavy) >= 2:
        # Stream regions spanning several steps would only fit around the collectives;
        # on the main stream XLA's scheduler overlaps each matmul with a transfer.
        notes.append(Note(tuple(heavy), REASON_COLLECTIVE,
                          "this level communicates: its compute stays on the main stream so "
                          "XLA can overlap it with the collectives"))
    elif len(heavy) >= 2:
        _plan_windows(inner, graph, heavy, seconds, blocked, analysis, first_group, sections,
                      notes)
    elif len(heavy) == 1:
        notes.append(Note((heavy[0],), REASON_DEPENDENT,
                          "the only heavy equation at this level: nothing to overlap with"))
    next_group = first_group + sum(s.group is not None for s in sections)
    nested, next_group = _plan_nested(eqns, sections, seconds, blocked, analysis, path, notes,
                                      axis_sizes, next_group)
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
                     nested, order, tuple(groups), collective_plan.collectives), next_group


@dataclasses.dataclass(frozen=True, slots=True)
class _LevelBasis:
    """What the plan of one level starts from, the same in every CUDA-graph mode (the
    modes' analyses share it, ``PlanMemos.level_basis``).

    Attributes:
      seconds: estimated seconds of each equation.
      blocked: the equations that never move, with the reason (``_blocked``; read only).
      heavy: the movable live equations launching a kernel of their own, ascending.
      notes: a note for each heavy equation that is blocked.
      collective_plan: the level's collectives (``group_collectives``).
    """

    seconds: tuple[float, ...]
    blocked: Mapping[int, str]
    heavy: tuple[int, ...]
    notes: tuple[Note, ...]
    collective_plan: CollectivePlan


# The sections chosen per window of a level (``_windows``).
_Windows = tuple[tuple[HeavyOrder, SectionChoice, tuple[Note, ...]], ...]


@dataclasses.dataclass(slots=True)
class PlanMemos:
    """What the plans of one call's program in every CUDA-graph mode share
    (``analysis.shared.of(PlanMemos)``); all written here."""

    # Each level's basis, by its mesh axes (extra) (``_level_basis``).
    level_basis: IdentityMemo[Jaxpr, _LevelBasis] = dataclasses.field(
        default_factory=IdentityMemo)
    # Why each equation must stay where it is; empty: it may move (``_blocked``).
    blocked_reason: IdentityMemo[JaxprEqn, str] = dataclasses.field(default_factory=IdentityMemo)
    # Each level's windows, by heavy equations and settings (extra) (``_windows``).
    windows: IdentityMemo[Jaxpr, _Windows] = dataclasses.field(default_factory=IdentityMemo)


def _level_basis(inner: Jaxpr, graph: Graph, analysis: Analysis,
                 axis_sizes: Mapping[Any, int]) -> _LevelBasis:
    """``_LevelBasis`` of the level ``inner`` inside the mesh axes ``axis_sizes``,
    remembered for the analyses of every mode of the call."""
    return analysis.shared.of(PlanMemos).level_basis.lookup(
        inner, lambda: _new_level_basis(inner, graph, analysis, axis_sizes),
        extra=tuple(axis_sizes.items()))


def _new_level_basis(inner: Jaxpr, graph: Graph, analysis: Analysis,
                     axis_sizes: Mapping[Any, int]) -> _LevelBasis:
    eqns = inner.eqns
    costs = [analysis.costs.eqn_cost(eqn) for eqn in eqns]
    seconds = tuple(analysis.costs.seconds(cost) for cost in costs)
    blocked = _blocked(eqns, analysis)
    notes = []
    # Heavy: launches a kernel of its own (fused elementwise work never does).
    heavy = [i for i in range(len(eqns)) if i in graph.live and costs[i].kernels > 0]
    for i in heavy:
        if i in blocked:
            notes.append(Note((i,), blocked[i], _blocked_detail(blocked[i], eqns[i])))
    collective_plan = group_collectives(
        inner, graph, axis_sizes=dict(axis_sizes),
        exclude={i for i, r in blocked.items() if r != REASON_COLLECTIVE})
    return _LevelBasis(seconds, blocked, tuple(i for i in heavy if i not in blocked),
                       tuple(notes), collective_plan)


def _blocked(eqns: Sequence[JaxprEqn], analysis: Analysis) -> dict[int, str]:
    """Equations that must stay where they are, with the reason (each equation's reason
    remembered for the call: the levels planned in each mode share most equations)."""
    reasons = analysis.shared.of(PlanMemos).blocked_reason
    blocked: dict[int, str] = {}
    for index, eqn in enumerate(eqns):
        reason = reasons.get(eqn)
        if reason is None:
            reason = _blocked_reason(eqn, analysis)
            reasons.set(eqn, reason)
        if reason:
            blocked[index] = reason
    return blocked


def _blocked_reason(eqn: JaxprEqn, analysis: Analysis) -> str:
    """Why ``eqn`` must stay where it is; empty if it may move."""
    if analysis.annotated(eqn):
        return REASON_ANNOTATED
    if eqn.effects and _compat.ordering_effects(eqn):
        return REASON_EFFECTFUL
    if is_collective(eqn):
        return REASON_COLLECTIVE
    return ""


def _blocked_detail(reason: str, eqn: JaxprEqn) -> str:
    name = eqn.primitive.name
    if reason == REASON_ANNOTATED:
        return f"`{name}` carries user placement (stream/compute/metadata); never wrapped or nested"
    if reason == REASON_EFFECTFUL:
        return f"`{name}` has side effects, which keep their order on the main stream"
    return f"`{name}` is a collective; collectives are grouped, not moved to compute streams"


def _plan_windows(jaxpr: Jaxpr, graph: Graph, heavy: list[int], seconds: tuple[float, ...],
                  blocked: Mapping[int, str], analysis: Analysis, first_group: int,
                  sections: list[SectionPlan], notes: list[Note]) -> None:
    """Sections of one level, in windows of ``MAX_HEAVY`` heavy equations (program order)
    that bound the quadratic steps; parallelism across a window boundary is given up.
    The sections (appended to ``sections``) are numbered from ``first_group``."""
    region_of: dict[int, tuple[int, int]] = {}  # shared by the windows of the level
    for order, choice, declined in _windows(jaxpr, graph, heavy, seconds, analysis):
        window_notes = list(declined)
        for branches in choice.branch_sets:
            section = _build_section(jaxpr, graph, order, seconds, blocked, branches,
                                     region_of, len(sections), first_group + len(sections),
                                     analysis, window_notes)
            if section is not None:
                sections.append(section)
        explained = {i for note in window_notes for i in note.eqns}
        dependent = tuple(i for i in order.heavy if i not in region_of and i not in explained)
        if dependent:
            window_notes.append(Note(dependent, REASON_DEPENDENT,
                                     "on the critical path: everything heavy beside it depends "
                                     "on it or feeds it"))
        notes.extend(window_notes)


def _windows(jaxpr: Jaxpr, graph: Graph, heavy: Sequence[int], seconds: tuple[float, ...],
             analysis: Analysis) -> _Windows:
    """Per window of ``MAX_HEAVY`` heavy equations (two or more), its ``HeavyOrder``, the
    sections chosen and the notes of the branches declined: the same in every CUDA-graph
    mode (only the pricing of the regions differs), so remembered for the analyses of
    every mode of the call."""
    settings = analysis.settings
    return analysis.shared.of(PlanMemos).windows.lookup(
        jaxpr, lambda: _new_windows(graph, heavy, seconds, settings),
        extra=(tuple(heavy), settings.min_seconds, settings.streams_per_section))


def _new_windows(graph: Graph, heavy: Sequence[int], seconds: tuple[float, ...],
                 settings: Settings
                 ) -> _Windows:
    windows = []
    for start in range(0, len(heavy), MAX_HEAVY):
        window = heavy[start:start + MAX_HEAVY]
        if len(window) < 2:
            continue
        end = heavy[start + MAX_HEAVY] if start + MAX_HEAVY < len(heavy) else graph.size
        order = heavy_order(graph, window, seconds, settings.min_seconds, end)
        choice = choose_sections(decompose(order), settings.streams_per_section,
                                 settings.min_seconds)
        windows.append((order, choice, tuple(_declined_notes(order, choice))))
    return tuple(windows)


def _declined_notes(order: HeavyOrder, choice: SectionChoice) -> list[Note]:
    notes = []
    for declined in choice.declined:
        eqns = order.eqns(declined.positions)
        if declined.one_stream:
            notes.append(Note(
                eqns, REASON_DEPENDENT,
                "independent branches, but only one stream is allowed (max_streams or "
                "--xla_gpu_experimental_parallel_async_compute_limit is 1)"))
        else:
            notes.append(Note(
                eqns, REASON_TOO_CHEAP,
                f"running it beside the branches independent of it would hide est. "
                f"{declined.overlap * 1e6:.1f} us (the branch itself: est. "
                f"{declined.cost * 1e6:.1f} us); the work that could overlap is below "
                "min_cost_us"))
    return notes


def _build_section(jaxpr: Jaxpr, graph: Graph, order: HeavyOrder, seconds: tuple[float, ...],
                   blocked: Mapping[int, str], branches: Sequence[Sequence[int]],
                   region_of: dict[int, tuple[int, int]], section_index: int, group: int,
                   analysis: Analysis, notes: list[Note]) -> SectionPlan | None:
    """One chosen section (scheduling group ``group``): its regions, priced for the GPU;
    records them in ``region_of``."""
    settings = analysis.settings
    found = build_regions(order, graph, seconds, blocked, branches, region_of, section_index,
                          settings.streams_per_section, settings.min_seconds)
    for branch in found.enclosed:
        notes.append(Note(branch.eqns, branch.reason,
                          f"the branch encloses equation {branch.blocked} ({branch.reason}), "
                          "which must stay in place"))
    regions = found.regions
    if regions is None:
        return None
    assignment = regions.assignment(section_index)
    region_of.update(assignment)
    if settings.modes.priced is None:
        return SectionPlan(group=group, regions=regions.region_plans())
    verdict = price_regions(jaxpr, graph, order, regions, analysis.costs,
                            mode=settings.modes.priced, min_seconds=settings.min_seconds,
                            keys=analysis.structural_keys)
    # force_streams keeps a section the pricing rejects, with the verdict for the report.
    if not verdict.pays and not settings.force_streams:
        for i in assignment:
            del region_of[i]
        heavy_members = [i for units in regions.branches for i in order.eqns(units)]
        notes.append(Note(tuple(sorted(heavy_members)), REASON_NO_GAIN, verdict.reason))
        return None
    return SectionPlan(group=group, regions=regions.region_plans(),
                       gain_seconds=verdict.gain_seconds, cost_seconds=verdict.cost_seconds,
                       verdict=verdict.reason, pays=verdict.pays)


def _priced_collective_sections(jaxpr: Jaxpr, graph: Graph, found: Sequence[SectionPlan],
                                analysis: Analysis, notes: list[Note]) -> list[SectionPlan]:
    """The collectives sections ``found`` at the GPU pricing's verdict (every one, as it
    is, off a GPU): one that does not pay is dropped, with a note, unless
    ``force_streams`` keeps it (with its verdict, for the report and the estimate)."""
    settings = analysis.settings
    if settings.modes.priced is None:
        return list(found)
    kept = []
    for section in found:
        region = section.regions[0].eqns
        verdict = price_collective_section(jaxpr, graph, region, analysis.costs,
                                           mode=settings.modes.priced)
        if verdict.pays or settings.force_streams:
            kept.append(dataclasses.replace(
                section, gain_seconds=verdict.gain_seconds, cost_seconds=verdict.cost_seconds,
                verdict=verdict.reason, pays=verdict.pays))
        else:
            heavy = tuple(i for i in region if analysis.costs.eqn_cost(jaxpr.eqns[i]).kernels > 0)
            notes.append(Note(heavy or tuple(region), REASON_NO_GAIN, verdict.reason))
    return kept


def _plan_nested(eqns: Sequence[JaxprEqn], sections: Sequence[SectionPlan],
                 seconds: tuple[float, ...], blocked: Mapping[int, str], analysis: Analysis,
                 path: str, notes: list[Note], axis_sizes: Mapping[Any, int], next_group: int
                 ) -> tuple[_NestedPlans, int]:
    """Plans of the jaxprs nested in equations outside regions (appends opaque notes),
    their sections numbered from ``next_group``; and the next free group number."""
    in_region = {i for s in sections for r in s.regions for i in r.eqns}
    nested: list[tuple[int, tuple[tuple[tuple[str, int | None], LevelPlan], ...]]] = []
    for index, eqn in enumerate(eqns):
        if index in in_region or (index in blocked and blocked[index] != REASON_EFFECTFUL):
            continue
        if eqn.primitive.name not in RECURSIVE_PRIMITIVES:
            if seconds[index] >= analysis.settings.min_seconds \
                    and analysis.subjaxprs(eqn):
                notes.append(Note((index,), REASON_OPAQUE,
                                  f"`{eqn.primitive.name}` bodies are not rewritten"))
            continue
        subs = []
        inner_axes = axis_sizes
        if _compat.is_shard_map(eqn):
            inner_axes = {**axis_sizes, **dict(_compat.shard_map_info(eqn).axis_sizes)}
        for name, item, sub in _compat.eqn_subjaxprs(eqn):
            label = f"{name}[{item}]" if item is not None else name
            sub_plan, next_group = _plan_level(
                sub, analysis, f"{path}/{eqn.primitive.name}#{index}.{label}", inner_axes,
                next_group)
            # Kept for the report even when it changes nothing; the emitter skips those.
            if sub_plan.changes_anything or any(
                    n.reason != REASON_DEPENDENT for level in sub_plan.walk() for n in level.notes):
                subs.append(((name, item), sub_plan))
        if subs:
            nested.append((index, tuple(subs)))
    return tuple(nested), next_group


class _GroupCycle(Exception):
    """Contracting the collective groups together with the regions makes a cycle."""


def order_units(graph: Graph, sections: list[SectionPlan] | tuple[SectionPlan, ...],
                groups: Sequence[CollectiveGroup] = ()) -> tuple[Unit, ...]:
    """Emission order with each region and each collective group contracted to one unit
    (``_program.graph.contract``; the regions of a section must stay mutually independent).

    Raises ``RuntimeError`` if a region is not convex or two regions of one section
    depend on each other: both are planner bugs, and emitting would reorder
    computation. Raises ``_GroupCycle`` when only the collective groups are to blame
    (the caller drops them).
    """
    blocks: list[tuple[Unit, Sequence[int]]] = []
    antichains: list[list[Unit]] = []
    for s, section in enumerate(sections):
        chain: list[Unit] = []
        for r, region in enumerate(section.regions):
            unit = RegionUnit(s, r)
            blocks.append((unit, region.eqns))
            chain.append(unit)
        antichains.append(chain)
    for g, group in enumerate(groups):
        blocks.append((CollectivesUnit(g), group.eqns))
    try:
        return contract(graph, blocks, antichains)
    except ContractionCycle:
        if groups:
            raise _GroupCycle from None
        raise RuntimeError("jaxpar planner bug: a region is not convex; please report it "
                           "with the program that triggered it") from None
    except DependentUnits:
        raise RuntimeError("jaxpar planner bug: regions of one section depend on "
                           "each other; please report it with the program") from None
