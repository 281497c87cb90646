"""Builds the public ``Plan`` from the planner's tree and the passes' decisions.

Example::

    report = build_report(level_plan, "f", "gpu", emitted=True, options={})
    report.sections[0].regions[0].stream

Decisions reach the equations they made through ``PassDecision.produced``, which the
passes recorded as they rewrote (``passes._walk.EqnOrigins``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

from .. import _compat
from .._compat import JaxprEqn
from .._plan import REASON_TOO_CHEAP, LevelPlan
from .._plan.budget import MemoryFigures
from .._plan.modes import ModeChoice
from .._program.graph import CollectivesUnit, EqnUnit, RegionUnit
from .._program.primitives import LOOPS
from .._tune import Tuning
from ..passes import NEW_LOOP_KINDS, DecisionKind, PassDecision
from .places import Places
from .plan import Plan
from .types import Collective, LeftAlone, Region, Section, Step, directions_text

_MAX_SOURCES = 3
_MAX_PRIMITIVES = 4
_LOOP_PRIMITIVES = LOOPS
# Loop rewrites drawn on the loop they produced.
_DRAWN_LOOP_KINDS = (DecisionKind.FUSED, DecisionKind.BATCHED, DecisionKind.UNROLLED)


def build_report(plan: LevelPlan, function: str, target: str, emitted: bool,
                 options: dict[str, Any], decisions: tuple[PassDecision, ...] = (),
                 plain_us: float | None = None, priced_in: str | None = None,
                 tuning: Tuning | None = None, mode: ModeChoice | None = None,
                 memory: MemoryFigures | None = None) -> Plan:
    """Turns the internal plan tree into the public ``Plan`` report.

    ``decisions`` holds every decision of the passes run before planning, in the order
    they made them (``Plan.decisions``). ``plain_us`` is
    the cost model's time of the program as traced, ``priced_in`` the CUDA-graph mode
    stream sections were priced in (None: not priced). ``tuning``: the tuner's table,
    for a function decorated with ``tune=True``. ``memory``: the memory model's figures
    of the plan against the plain program.
    """
    sections: list[Section] = []
    notes: list[LeftAlone] = []
    collectives: list[Collective] = []
    steps: list[Step] = []
    drawn = {level.path for level in plan.walk()
             if level.path == "/" or level.sections or level.collective_groups}
    batched = _batched_groups({level.path: _compat.open_jaxpr(level.jaxpr)[0].eqns
                               for level in plan.walk() if level.path in drawn},
                              decisions)
    summaries = _SourceSummaries()
    places = Places(plan)
    num_eqns = 0
    for level in plan.walk():
        inner, _ = _compat.open_jaxpr(level.jaxpr)
        eqns = inner.eqns
        num_eqns += len(eqns)
        first_section = len(sections)
        overlapped: dict[int, tuple[tuple[str, int], ...]] = {}
        for section in level.sections:
            regions = tuple(
                Region(stream=r.stream, num_eqns=len(r.eqns),
                       primitives=_top_primitives(eqns, r.eqns, level.seconds),
                       cost_us=r.seconds * 1e6,
                       source_lines=_sources(eqns, r.eqns, level.seconds, summaries),
                       eqn_indices=r.eqns,
                       places=places.ranked(eqns, r.eqns, level.seconds))
                for r in section.regions)
            overlaps = ""
            if section.collectives is not None:
                group = level.collective_groups[section.collectives]
                prims = [eqns[i].primitive.name for i in group.eqns]
                directions = directions_text(group.shifts, prims)
                overlaps = (f"collectives group: {' + '.join(prims)} over "
                            f"{_axis_text(group.axis_name)!r}"
                            + (f" ({directions})" if directions else ""))
                overlapped[section.collectives] = regions[0].primitives
            sections.append(Section(
                level.path, section.group, regions, overlaps,
                gain_us=None if section.gain_seconds is None else section.gain_seconds * 1e6,
                cut_cost_us=None if section.cost_seconds is None else section.cost_seconds * 1e6,
                verdict=section.verdict, pays=section.pays))
        collectives.extend(_collectives(level, eqns, overlapped))
        rewritten = _rewritten_loops(level.path, eqns, decisions)
        if level.path in drawn:
            steps.extend(_steps(level, eqns, first_section, len(steps), rewritten,
                                batched.get(level.path, {}), summaries))
        made_here = {i for i, marks in rewritten.items()
                     if any(decisions[k].kind in NEW_LOOP_KINDS for k in marks)}
        for note in level.notes:
            kept = tuple(i for i in note.eqns if i not in made_here)
            if not kept:  # a loop jaxpar made: reported as a decision, not left alone
                continue
            detail = note.detail
            if note.reason == REASON_TOO_CHEAP:
                detail += (f" (min_cost_us={options.get('min_cost_us')} us; pass a smaller "
                           "min_cost_us to parallel_branches or inspect to give branches "
                           "this cheap a stream)")
            notes.append(LeftAlone(
                location=level.path, reason=note.reason, detail=detail,
                primitives=tuple(dict.fromkeys(eqns[i].primitive.name for i in kept)),
                cost_us=sum(level.seconds[i] for i in kept) * 1e6,
                source_lines=_sources(eqns, kept, level.seconds, summaries),
                places=places.ranked(eqns, kept, level.seconds)))
    placed = tuple(_placed(d, places) for d in decisions)
    total = sum(plan.seconds) * 1e6
    return Plan(function=function, target=target, emitted=emitted,
                options=tuple(sorted(options.items())), num_eqns=num_eqns,
                total_cost_us=total, sections=tuple(sections), left_alone=tuple(notes),
                decisions=placed, collectives=tuple(collectives),
                steps=tuple(steps), plain_cost_us=plain_us, priced_in=priced_in,
                tuning=tuning, mode=mode, memory=memory)


def _placed(decision: PassDecision, places: Places) -> PassDecision:
    """``decision`` with its ``places``: of the equations its rewrite made, else of its
    own equations where the planned program still holds them (the same primitives at
    the same indices of its level); unchanged where neither is found."""
    found: list[str] = []
    made = [p for p in decision.produced if not p.holds]
    if made:
        for place in made:
            eqns = places.level_eqns(place.location)
            if eqns is not None and place.eqn < len(eqns):
                found.extend(places.ranked(eqns, (place.eqn,)))
    else:
        eqns = places.level_eqns(decision.location)
        if eqns is not None and all(
                i < len(eqns) and eqns[i].primitive.name == name
                for i, name in zip(decision.eqns, decision.primitives, strict=True)):
            found.extend(places.ranked(eqns, decision.eqns))
    if not found:
        return decision
    return dataclasses.replace(decision, places=tuple(dict.fromkeys(found)))


def _rewritten_loops(path: str, eqns: Sequence[JaxprEqn], decisions: tuple[PassDecision, ...]
                     ) -> dict[int, tuple[int, ...]]:
    """Loop equations of one level that a pass produced or changed: the indices
    of those decisions in ``decisions``, read from each decision's ``produced``."""
    marked: dict[int, list[int]] = {}
    for k, decision in enumerate(decisions):
        if decision.kind not in _DRAWN_LOOP_KINDS:
            continue
        for place in decision.produced:
            if (place.location == path and not place.holds
                    and eqns[place.eqn].primitive.name in _LOOP_PRIMITIVES):
                marked.setdefault(place.eqn, []).append(k)
    return {i: tuple(ks) for i, ks in marked.items()}


def _batched_groups(levels: dict[str, Any], decisions: tuple[PassDecision, ...]
                    ) -> dict[str, dict[int, tuple[int, ...]]]:
    """Per drawn level (``levels``: path -> equations), its equations that run batched
    matmul groups: the indices of those decisions in ``decisions``.

    A group is drawn at the deepest drawn level among its places (``produced``): on the
    batched op it made when that level is drawn, else on the equation of a drawn level
    that holds it (a loop whose body it is in).
    """
    marked: dict[str, dict[int, set[int]]] = {}
    for k, d in enumerate(decisions):
        if d.kind != DecisionKind.BATCHED_MATMULS:
            continue
        places = [p for p in d.produced if p.location in levels and (
            p.holds or levels[p.location][p.eqn].primitive.name in d.primitives)]
        if not places:
            continue
        depth = max(_depth(p.location) for p in places)
        for place in places:
            if _depth(place.location) == depth:
                marked.setdefault(place.location, {}).setdefault(place.eqn, set()).add(k)
    return {path: {i: tuple(sorted(ks)) for i, ks in by_eqn.items()}
            for path, by_eqn in marked.items()}


def _depth(location: str) -> int:
    return location.rstrip("/").count("/")


def _steps(level: LevelPlan, eqns: Sequence[JaxprEqn], first_section: int, offset: int,
           rewritten: dict[int, tuple[int, ...]], batched: dict[int, tuple[int, ...]],
           summaries: _SourceSummaries) -> list[Step]:
    """The level's emission order as steps; runs of main-stream equations merged.

    ``offset`` is the index of the first step in ``Plan.steps``, ``first_section``
    that of the level's first section in ``Plan.sections``.
    """
    # (lane or "loop", section, equations, loop decisions)
    units: list[tuple[str, int | None, list[int], tuple[int, ...]]] = []
    for unit in level.order:
        if isinstance(unit, RegionUnit):
            region = level.sections[unit.section].regions[unit.region]
            units.append((f"stream {region.stream}", first_section + unit.section,
                          list(region.eqns), ()))
        elif isinstance(unit, CollectivesUnit):
            beside = next((first_section + k for k, sec in enumerate(level.sections)
                           if sec.collectives == unit.group), None)
            units.append(("collectives", beside,
                          list(level.collective_groups[unit.group].eqns), ()))
        else:
            assert isinstance(unit, EqnUnit)
            i = unit.index
            if eqns[i].primitive.name in _LOOP_PRIMITIVES:
                units.append(("loop", None, [i], rewritten.get(i, ())))
            elif units and units[-1][0] == "main":
                units[-1][2].append(i)
            else:
                units.append(("main", None, [i], ()))
    step_of = {i: k for k, unit in enumerate(units) for i in unit[2]}
    out = []
    for k, (lane, section, members, rewrites) in enumerate(units):
        after = sorted({offset + step_of[p] for i in members for p in level.graph.preds[i]
                        if step_of[p] != k})
        kind = {"loop": "loop", "main": "main", "collectives": "collectives"}.get(lane, "region")
        out.append(Step(
            location=level.path, lane="main" if lane == "loop" else lane, kind=kind,
            section=section, num_eqns=len(members),
            primitives=_top_primitives(eqns, tuple(members), level.seconds),
            cost_us=sum(level.seconds[i] for i in members) * 1e6,
            source_lines=_sources(eqns, tuple(members), level.seconds, summaries),
            after=tuple(after), loop_rewrites=rewrites,
            batched_groups=tuple(sorted(k for i in members for k in batched.get(i, ())))))
    return out


def _collectives(level: LevelPlan, eqns: Sequence[JaxprEqn],
                 overlapped: dict[int, tuple[tuple[str, int], ...]]) -> list[Collective]:
    """Report entries for one level: each group, then each collective left alone."""
    info = {c.eqn: c for c in level.collectives}
    grouped = {i: g for g, group in enumerate(level.collective_groups) for i in group.eqns}
    out = []
    for g, group in enumerate(level.collective_groups):
        members = [info[i] for i in group.eqns if i in info]
        out.append(Collective(
            level.path, tuple(eqns[i].primitive.name for i in group.eqns),
            _axis_text(members[0].axis_name if members else ()),
            tuple(group.shifts), True, overlapped.get(g, ()),
            tuple(dict.fromkeys(_compat.source_summary(eqns[i]) for i in group.eqns))))
    for c in level.collectives:
        if c.eqn not in grouped:
            out.append(Collective(level.path, (c.primitive,), _axis_text(c.axis_name),
                                  (c.shift,), False, (),
                                  (_compat.source_summary(eqns[c.eqn]),)))
    return out


def _axis_text(axes: Any) -> str:
    return ",".join(map(str, axes)) if isinstance(axes, tuple) else str(axes)


def _top_primitives(eqns: Sequence[JaxprEqn], indices: tuple[int, ...], seconds: tuple[float, ...]
                    ) -> tuple[tuple[str, int], ...]:
    weight: dict[str, float] = {}
    count: Counter[str] = Counter()
    for i in indices:
        name = _compat.display_name(eqns[i])
        weight[name] = weight.get(name, 0.0) + seconds[i]
        count[name] += 1
    ranked = sorted(count, key=lambda name: (-weight[name], -count[name], name))
    return tuple((name, count[name]) for name in ranked[:_MAX_PRIMITIVES])


class _SourceSummaries:
    """``_compat.source_summary`` of the equations of one report, made once per source
    (``_compat.source_key``): the equations a loop made on one line share theirs, and a
    step of a thousand equations looks for its first few distinct lines among them."""

    __slots__ = ("_found",)

    def __init__(self) -> None:
        self._found: dict[Hashable, str] = {}

    def __call__(self, eqn: JaxprEqn) -> str:
        try:
            key = _compat.source_key(eqn)
        except Exception:  # no source information, or one that cannot be a key
            return _compat.source_summary(eqn)
        summary = self._found.get(key)
        if summary is None:
            summary = self._found[key] = _compat.source_summary(eqn)
        return summary


def _sources(eqns: Sequence[JaxprEqn], indices: tuple[int, ...], seconds: tuple[float, ...],
             summaries: _SourceSummaries) -> tuple[str, ...]:
    ranked = sorted(indices, key=lambda i: (-seconds[i], i))
    found: dict[str, None] = {}
    for i in ranked:
        found.setdefault(summaries(eqns[i]), None)
        if len(found) >= _MAX_SOURCES:
            break
    return tuple(found)
