"""The report ``jaxpar.inspect`` returns: what went where, and why.

Built from the internal plan tree; holds only numbers and strings, so it is
cheap to keep, compare and serialise.

Example::

    plan = jaxpar.inspect(f, target="gpu")(x, y)
    print(plan)                  # a readable table
    plan.num_streams             # 2
    json.dumps(plan.to_dict())

Sharp edges:
  * Costs are model estimates (see ``jaxpar._cost``), good for ranking, not
    for predicting wall time.
"""

from __future__ import annotations

import dataclasses
import html
import os
from collections import Counter
from typing import Any

from . import _compat
from ._plan import LevelPlan
from .passes import SUBGRAPH_KINDS, LoopDecision

_MAX_SOURCES = 3
_MAX_PRIMITIVES = 4


@dataclasses.dataclass(frozen=True, slots=True)
class Region:
    """One annotated call: equations that run together on one stream."""

    stream: int
    num_eqns: int
    primitives: tuple[tuple[str, int], ...]
    cost_us: float
    source_lines: tuple[str, ...]
    eqn_indices: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"stream": self.stream, "num_eqns": self.num_eqns,
                "primitives": [list(p) for p in self.primitives], "cost_us": self.cost_us,
                "source_lines": list(self.source_lines), "eqn_indices": list(self.eqn_indices)}


@dataclasses.dataclass(frozen=True, slots=True)
class Section:
    """Regions meant to overlap: one scheduling group.

    ``overlaps`` names the collectives group the regions run beside (their
    ``scheduling_group`` is then None), or is empty.
    """

    location: str
    scheduling_group: int | None
    regions: tuple[Region, ...]
    overlaps: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"location": self.location, "scheduling_group": self.scheduling_group,
                "regions": [r.to_dict() for r in self.regions], "overlaps": self.overlaps}


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    """One collective, or a group of them launched together (``grouped``)."""

    location: str
    primitives: tuple[str, ...]
    axis: str
    shifts: tuple[int | None, ...]  # ring shift of each ppermute: +1, -1, k; None: general
    grouped: bool
    overlapped_by: tuple[tuple[str, int], ...]  # compute running beside it (name, count)
    source_lines: tuple[str, ...]

    @property
    def directions(self) -> str:
        return _directions(self.shifts)

    def to_dict(self) -> dict[str, Any]:
        return {"location": self.location, "primitives": list(self.primitives),
                "axis": self.axis, "shifts": list(self.shifts), "directions": self.directions,
                "grouped": self.grouped, "overlapped_by": [list(o) for o in self.overlapped_by],
                "source_lines": list(self.source_lines)}


@dataclasses.dataclass(frozen=True, slots=True)
class LeftAlone:
    """Equations jaxpar deliberately did not move, with the reason."""

    location: str
    reason: str
    detail: str
    primitives: tuple[str, ...]
    cost_us: float
    source_lines: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"location": self.location, "reason": self.reason, "detail": self.detail,
                "primitives": list(self.primitives), "cost_us": self.cost_us,
                "source_lines": list(self.source_lines)}


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What ``parallel_branches`` does to one function at one signature.

    ``loops`` holds the loop passes' decisions, ``subgraphs`` those of the subgraph
    batching pass (``batched subgraphs`` / ``subgraphs left alone``).
    """

    function: str
    target: str
    emitted: bool
    options: tuple[tuple[str, Any], ...]
    num_eqns: int
    total_cost_us: float
    sections: tuple[Section, ...]
    left_alone: tuple[LeftAlone, ...]
    loops: tuple[LoopDecision, ...] = ()
    collectives: tuple[Collective, ...] = ()
    subgraphs: tuple[LoopDecision, ...] = ()

    @property
    def num_streams(self) -> int:
        """Distinct stream ids used anywhere in the program."""
        return len({r.stream for s in self.sections for r in s.regions})

    @property
    def num_regions(self) -> int:
        return sum(len(s.regions) for s in self.sections)

    def to_dict(self) -> dict[str, Any]:
        return {"function": self.function, "target": self.target, "emitted": self.emitted,
                "options": dict(self.options), "num_eqns": self.num_eqns,
                "total_cost_us": self.total_cost_us, "num_streams": self.num_streams,
                "sections": [s.to_dict() for s in self.sections],
                "left_alone": [n.to_dict() for n in self.left_alone],
                "loops": [_loop_dict(d) for d in self.loops],
                "subgraphs": [_loop_dict(d) for d in self.subgraphs],
                "collectives": [c.to_dict() for c in self.collectives]}

    def __str__(self) -> str:
        lines = [f"jaxpar plan for `{self.function}` (target={self.target}, "
                 f"{self.num_eqns} equations, est. {self.total_cost_us:.1f} us)"]
        if not self.emitted and self.sections:
            lines.append("  note: stream annotations are only emitted for target='gpu'; "
                         "this is what would run concurrently on a GPU")
        if not self.sections:
            lines.append("  no parallel sections: nothing independent is worth a stream")
        for section in self.sections:
            if section.overlaps:
                lines.append(f"  section at {section.location}: beside {section.overlaps}")
            else:
                lines.append(f"  section group={section.scheduling_group} at "
                             f"{section.location}: {len(section.regions)} concurrent regions")
            for region in section.regions:
                prims = ", ".join(f"{name} x{count}" for name, count in region.primitives)
                where = "; ".join(region.source_lines) or "<unknown>"
                lines.append(f"    stream {region.stream}: {region.num_eqns} eqns, "
                             f"est. {region.cost_us:.1f} us [{prims}] at {where}")
        if self.collectives:
            lines.append("  collectives:")
            for c in self.collectives:
                beside = ", ".join(f"{name} x{count}" for name, count in c.overlapped_by)
                lines.append(f"    {'grouped' if c.grouped else 'alone'} at {c.location}: "
                             f"{' + '.join(c.primitives)} over {c.axis!r} ({c.directions})"
                             + (f", overlapped by [{beside}]" if beside else ""))
        for title, decisions in (("loops", self.loops), ("subgraphs", self.subgraphs)):
            if decisions:
                lines.append(f"  {title}:")
                lines.extend(f"    {_decision_text(d)}" for d in decisions)
        if self.left_alone:
            lines.append("  left alone:")
            for note in self.left_alone:
                prims = ", ".join(note.primitives)
                where = "; ".join(note.source_lines) or "<unknown>"
                lines.append(f"    {note.reason} at {note.location} [{prims}, "
                             f"est. {note.cost_us:.1f} us]: {note.detail} ({where})")
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        """Notebooks: an inline SVG timeline of the streams, then the text report."""
        from ._render import plan_to_svg

        return f"<div>{plan_to_svg(self)}<pre>{html.escape(str(self))}</pre></div>"

    def to_svg(self) -> str:
        """The timeline as a standalone ``<svg>`` element."""
        from ._render import plan_to_svg

        return plan_to_svg(self)

    def to_dot(self) -> str:
        """The plan as a Graphviz digraph (sections as clusters, regions as nodes)."""
        from ._render import plan_to_dot

        return plan_to_dot(self)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes a standalone HTML page (timeline and report) to ``path``.

        Raises:
          ValueError: ``path`` does not end in ``.html`` or ``.htm``.
        """
        from ._render import plan_to_html

        if not str(path).lower().endswith((".html", ".htm")):
            raise ValueError(f"path must end in .html (a standalone page), got {str(path)!r}; "
                             "use to_svg() or to_dot() for other formats")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(plan_to_html(self))


def _decision_text(d: LoopDecision) -> str:
    """One report line: kind, place, primitives, trips and unroll when known, reason, sources."""
    trips = ""
    if d.trips_before is not None or d.trips_after is not None:
        trips = f", trips {d.trips_before} -> {d.trips_after}"
    unroll = f", unroll {d.unroll}" if d.unroll is not None else ""
    where = "; ".join(dict.fromkeys(d.sources)) or "<unknown>"
    return (f"{d.kind} at {d.location} [{', '.join(d.primitives)}{trips}{unroll}]: "
            f"{d.reason} ({where})")


def _loop_dict(loop: LoopDecision) -> dict[str, Any]:
    return {"location": loop.location, "kind": loop.kind, "eqns": list(loop.eqns),
            "primitives": list(loop.primitives), "sources": list(loop.sources),
            "trips_before": loop.trips_before, "trips_after": loop.trips_after,
            "unroll": loop.unroll, "reason": loop.reason}


def build_report(plan: LevelPlan, function: str, target: str, emitted: bool,
                 options: dict[str, Any], loops: tuple[LoopDecision, ...] = ()) -> Plan:
    """Turns the internal plan tree into the public ``Plan`` report.

    ``loops`` holds every decision of the passes run before planning; those of the
    subgraph batching pass are reported apart, as ``Plan.subgraphs``.
    """
    sections: list[Section] = []
    notes: list[LeftAlone] = []
    collectives: list[Collective] = []
    num_eqns = 0
    for level in plan.walk():
        inner, _ = _compat.open_jaxpr(level.jaxpr)
        eqns = inner.eqns
        num_eqns += len(eqns)
        overlapped: dict[int, tuple[tuple[str, int], ...]] = {}
        for section in level.sections:
            regions = tuple(
                Region(stream=r.stream, num_eqns=len(r.eqns),
                       primitives=_top_primitives(eqns, r.eqns, level.seconds),
                       cost_us=r.seconds * 1e6, source_lines=_sources(eqns, r.eqns, level.seconds),
                       eqn_indices=r.eqns)
                for r in section.regions)
            overlaps = ""
            if section.collectives is not None:
                group = level.collective_groups[section.collectives]
                names = " + ".join(eqns[i].primitive.name for i in group.eqns)
                overlaps = (f"collectives group: {names} over {_axis_text(group.axis_name)!r} "
                            f"({_directions(group.shifts)})")
                overlapped[section.collectives] = regions[0].primitives
            sections.append(Section(level.path, section.group, regions, overlaps))
        collectives.extend(_collectives(level, eqns, overlapped))
        for note in level.notes:
            notes.append(LeftAlone(
                location=level.path, reason=note.reason, detail=note.detail,
                primitives=tuple(dict.fromkeys(eqns[i].primitive.name for i in note.eqns)),
                cost_us=sum(level.seconds[i] for i in note.eqns) * 1e6,
                source_lines=_sources(eqns, note.eqns, level.seconds)))
    total = sum(plan.seconds) * 1e6
    return Plan(function=function, target=target, emitted=emitted,
                options=tuple(sorted(options.items())), num_eqns=num_eqns,
                total_cost_us=total, sections=tuple(sections), left_alone=tuple(notes),
                loops=tuple(d for d in loops if d.kind not in SUBGRAPH_KINDS),
                collectives=tuple(collectives),
                subgraphs=tuple(d for d in loops if d.kind in SUBGRAPH_KINDS))


def _collectives(level: LevelPlan, eqns: Any,
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


def _directions(shifts: Any) -> str:
    """``(1, -1)`` -> ``"forward, backward"``; other shifts by value, None as general."""
    def name(shift: int | None) -> str:
        if shift is None:
            return "general"
        return {1: "forward", -1: "backward"}.get(shift, f"shift {shift:+d}")

    return ", ".join(name(s) for s in shifts)


def _axis_text(axes: Any) -> str:
    return ",".join(map(str, axes)) if isinstance(axes, tuple) else str(axes)


def _top_primitives(eqns: Any, indices: tuple[int, ...], seconds: tuple[float, ...]
                    ) -> tuple[tuple[str, int], ...]:
    weight: dict[str, float] = {}
    count: Counter[str] = Counter()
    for i in indices:
        name = eqns[i].primitive.name
        weight[name] = weight.get(name, 0.0) + seconds[i]
        count[eqns[i].primitive.name] += 1
    ranked = sorted(count, key=lambda name: (-weight[name], -count[name], name))
    return tuple((name, count[name]) for name in ranked[:_MAX_PRIMITIVES])


def _sources(eqns: Any, indices: tuple[int, ...], seconds: tuple[float, ...]) -> tuple[str, ...]:
    ranked = sorted(indices, key=lambda i: (-seconds[i], i))
    found: dict[str, None] = {}
    for i in ranked:
        found.setdefault(_compat.source_summary(eqns[i]), None)
        if len(found) >= _MAX_SOURCES:
            break
    return tuple(found)
