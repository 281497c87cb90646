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
from ._graph import CollectivesUnit, EqnUnit, RegionUnit
from ._plan import REASON_TOO_CHEAP, LevelPlan
from ._plan.modes import ModeChoice
from ._primitives import LOOPS
from ._render import (
    decision_summary,
    decision_text,
    first_clause,
    plan_to_chrome_trace,
    plan_to_dot,
    plan_to_html,
    plan_to_svg,
    readable_location,
    short_places,
)
from ._timeline import PlanEstimate, plan_estimate
from ._tune import Tuning
from .passes import (
    KIND_BATCHED,
    KIND_BATCHED_MATMULS,
    KIND_FUSED,
    KIND_HOST_SYNC,
    KIND_LEFT_ALONE,
    KIND_MATMULS_LEFT_ALONE,
    KIND_SUBGRAPHS_LEFT_ALONE,
    KIND_UNROLLED,
    SUBGRAPH_KINDS,
    LoopDecision,
)

_MAX_SOURCES = 3
_MAX_PRIMITIVES = 4
_LOOP_PRIMITIVES = LOOPS
# Loop rewrites drawn on the loop they produced; fused and batched loops are new
# loops, so never "left alone".
_DRAWN_LOOP_KINDS = (KIND_FUSED, KIND_BATCHED, KIND_UNROLLED)
_NEW_LOOP_KINDS = frozenset({KIND_FUSED, KIND_BATCHED})
_UNCHANGED = frozenset({KIND_LEFT_ALONE, KIND_HOST_SYNC, KIND_SUBGRAPHS_LEFT_ALONE,
                        KIND_MATMULS_LEFT_ALONE})


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
    # The GPU pricing's verdict (None where nothing priced the section): the device time
    # overlap wins, what the cut costs, and why.
    gain_us: float | None = None
    cut_cost_us: float | None = None
    verdict: str = ""
    pays: bool | None = None  # False: only force_streams kept it

    def to_dict(self) -> dict[str, Any]:
        return {"location": self.location, "scheduling_group": self.scheduling_group,
                "regions": [r.to_dict() for r in self.regions], "overlaps": self.overlaps,
                "gain_us": self.gain_us, "cut_cost_us": self.cut_cost_us,
                "verdict": self.verdict, "pays": self.pays}


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
class Step:
    """One unit of a level's program in emission order: the timeline's building block.

    ``lane`` is ``"main"``, ``"stream K"`` or ``"collectives"``; ``kind`` is ``"main"``
    (a run of equations on the main stream), ``"loop"`` (one scan or while loop on the
    main stream; ``loop_rewrites`` holds the indices in ``Plan.loops`` of what the loop
    passes did to it), ``"region"``
    (a stream region of ``Plan.sections[section]``) or ``"collectives"`` (a group
    launched together). ``after`` holds the indices in ``Plan.steps`` of the steps
    whose results it reads. ``batched_groups`` holds the indices in ``Plan.subgraphs``
    of the batched matmul groups the step runs: in its own equations, or in the body of
    its loop (at any depth) when that body is not drawn as a level of its own.
    """

    location: str
    lane: str
    kind: str
    section: int | None
    num_eqns: int
    primitives: tuple[tuple[str, int], ...]
    cost_us: float
    source_lines: tuple[str, ...]
    after: tuple[int, ...]
    loop_rewrites: tuple[int, ...] = ()
    batched_groups: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"location": self.location, "lane": self.lane, "kind": self.kind,
                "section": self.section, "num_eqns": self.num_eqns,
                "primitives": [list(p) for p in self.primitives], "cost_us": self.cost_us,
                "source_lines": list(self.source_lines), "after": list(self.after),
                "loop_rewrites": list(self.loop_rewrites),
                "batched_groups": list(self.batched_groups)}


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What ``parallel_branches`` does to one function at one signature.

    ``loops`` holds the loop passes' decisions, ``subgraphs`` those of the subgraph
    batching pass (``batched subgraphs`` / ``subgraphs left alone``). ``steps`` is the
    program in emission order (the top level, and every level with sections), from
    which ``save("plan.html")`` and ``save("plan.json")`` draw the estimated timeline.
    ``tuning`` is the tuner's measured table for a function decorated with ``tune=True``
    (``jaxpar._tune.Tuning``), None otherwise.
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
    steps: tuple[Step, ...] = ()
    # The cost model's time of the program as traced (jax.jit's), the CUDA-graph mode
    # sections were priced in, and a compiled estimate gpu_preview attaches.
    plain_cost_us: float | None = None
    priced_in: str | None = None
    compiled_estimate: PlanEstimate | None = None

    @property
    def estimate(self) -> PlanEstimate:
        """The plan's one estimate: jax.jit's time against jaxpar's, and its source.

        The header of ``text()``, the picture's title and ``gpu_preview`` show this
        figure (``jaxpar._timeline.plan_estimate``).
        """
        return plan_estimate(self)
    tuning: Tuning | None = None
    # The CUDA-graph mode the function is compiled in, and why (target "gpu" only).
    mode: ModeChoice | None = None

    @property
    def xla_options(self) -> dict[str, str]:
        """The XLA ``compiler_options`` jaxpar compiles this function with: the CUDA-graph
        mode it chose (``{}``: the process's ``XLA_FLAGS`` apply unchanged)."""
        return self.mode.xla_options if self.mode is not None else {}

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
                "collectives": [c.to_dict() for c in self.collectives],
                "steps": [step.to_dict() for step in self.steps],
                "estimate": {**dataclasses.asdict(self.estimate),
                             "rejected": list(self.estimate.rejected)},
                "tuning": None if self.tuning is None else self.tuning.to_dict(),
                "xla_options": self.xla_options,
                "mode": self.mode.to_dict() if self.mode is not None else None}

    def __str__(self) -> str:
        return self.text()

    def summary(self) -> str:
        """One line: what jaxpar changes in this program (computed, for examples and logs).

        Example: ``"fused: 1 (2 loops -> 1); batched matmuls: 4; no stream regions"``.
        """
        changed: dict[str, list[LoopDecision]] = {}
        for decision in (*self.loops, *self.subgraphs):
            if decision.kind not in _UNCHANGED:
                changed.setdefault(str(decision.kind), []).append(decision)
        parts = []
        for kind, decisions in changed.items():
            loops = sum(len(d.eqns) for d in decisions)
            joined = f" ({loops} loops -> {len(decisions)})" if kind in _NEW_LOOP_KINDS else ""
            parts.append(f"{kind}: {len(decisions)}{joined}")
        if self.num_regions:
            parts.append(f"{self.num_regions} stream regions in {len(self.sections)} sections")
        elif parts:
            parts.append("no stream regions")
        if not parts:
            return (f"nothing: jax.jit's program (nothing here pays on "
                    f"target={self.target})")
        return "; ".join(parts)

    def text(self, verbose: bool = False) -> str:
        """The report as text: one short line per decision, or every detail.

        Args:
          verbose: the long form: each decision's full reasoning, cost figures, source
            lines and the equations of each member (``to_dict()`` has the same).
        """
        lines = [f"jaxpar plan for `{self.function}` (target={self.target}, "
                 f"{self.num_eqns} equations)"]
        if self.target != "gpu":
            how = ("target='auto' on this machine's backend"
                   if dict(self.options).get("target") == "auto" else f"target={self.target!r}")
            lines.append(
                f"  planned for {self.target} ({how}): streams exist only on GPUs, so nothing "
                f"is emitted, and the {self.target} cost model chose what is shown. For the "
                "GPU plan: jaxpar.inspect(f, target='gpu')(...)")
        figure = self.estimate
        lines.append(f"  {figure.line()}")
        if self.mode is not None:
            options = self.xla_options
            shown = (", ".join(f"{k}={v!r}" for k, v in options.items()) if options
                     else "none (the process's XLA_FLAGS)")
            lines.append(f"  XLA options: {shown}: {self.mode.reason}")
        lines.extend(f"  forced: the GPU pricing would not emit this section: {why}"
                     for why in figure.rejected)
        if verbose:
            lines.extend(f"    why: {section.verdict}" for section in self.sections
                         if section.verdict)
        lines += _report_lines(self, verbose)
        if self.tuning is not None:
            lines += self.tuning.lines()
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        """Notebooks: an inline SVG timeline of the streams, then the text report."""
        return f"<div>{plan_to_svg(self)}<pre>{html.escape(str(self))}</pre></div>"

    def to_svg(self) -> str:
        """The timeline as a standalone ``<svg>`` element."""
        return plan_to_svg(self)

    def to_dot(self) -> str:
        """The plan as a Graphviz digraph (sections as clusters, regions as nodes)."""
        return plan_to_dot(self)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the plan to ``path``: an HTML page, or a Chrome trace.

        ``*.html``: a standalone page with the estimated timeline and the report.
        ``*.json``: the estimated timeline in the Chrome trace-event format, which
        Perfetto (ui.perfetto.dev) and TensorBoard open, to hold beside a real
        ``jax.profiler`` trace.

        Raises:
          ValueError: ``path`` ends in neither ``.html``/``.htm`` nor ``.json``.
        """
        name = str(path).lower()
        if name.endswith((".html", ".htm")):
            text = plan_to_html(self)
        elif name.endswith(".json"):
            import json

            text = json.dumps(plan_to_chrome_trace(self))
        else:
            raise ValueError(f"path must end in .html (a standalone page) or .json (a Chrome "
                             f"trace for Perfetto), got {str(path)!r}; use to_svg() or "
                             "to_dot() for other formats")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)


def _where(location: str) -> str:
    place = readable_location(location)
    return f" {place}" if place else ""


def _report_lines(plan: Plan, verbose: bool) -> list[str]:
    """The report below the header: sections, collectives, rewrites, what was left alone.

    Short (the default): one line per decision, naming where in the user's model it is
    and the figure that decided it. Verbose: each decision's full reasoning, cost figures
    and source lines.
    """
    lines = []
    if not plan.sections:
        lines.append("  no parallel sections: nothing independent is worth a stream" if verbose
                     else "  streams: none (nothing independent is worth a stream here)")
    for section in plan.sections:
        if section.overlaps:
            lines.append(f"  section{_where(section.location)}: beside {section.overlaps}")
        else:
            group = f" group={section.scheduling_group}" if verbose else ""
            lines.append(f"  section{group}{_where(section.location)}: "
                         f"{len(section.regions)} concurrent regions")
        for region in section.regions:
            if verbose:
                prims = ", ".join(f"{name} x{count}" for name, count in region.primitives)
                where = "; ".join(region.source_lines) or "<unknown>"
                lines.append(f"    stream {region.stream}: {region.num_eqns} eqns, "
                             f"est. {region.cost_us:.1f} us [{prims}] at {where}")
            else:
                prims = ", ".join(name for name, _ in region.primitives)
                lines.append(f"    stream {region.stream}: {prims} in "
                             f"{short_places(region.source_lines)}, "
                             f"est. {region.cost_us:.1f} us")
    if plan.collectives:
        lines.append("  collectives:")
        for c in plan.collectives:
            beside = ", ".join(f"{name} x{count}" for name, count in c.overlapped_by)
            lines.append(f"    {'grouped' if c.grouped else 'alone'}{_where(c.location)}: "
                         f"{' + '.join(c.primitives)} over {c.axis!r} ({c.directions})"
                         + (f", overlapped by [{beside}]" if beside and verbose else ""))
    describe = decision_text if verbose else decision_summary
    for title, decisions in (("loops", plan.loops), ("subgraphs", plan.subgraphs)):
        if decisions:
            lines.append(f"  {title}:")
            lines.extend(f"    {describe(d)}" for d in decisions)
    if plan.left_alone:
        lines.append("  left alone:")
        for note in plan.left_alone:
            if verbose:
                where = "; ".join(note.source_lines) or "<unknown>"
                lines.append(f"    {note.reason}{_where(note.location)} "
                             f"[{', '.join(note.primitives)}, est. {note.cost_us:.1f} us]: "
                             f"{note.detail} ({where})")
            else:
                lines.append(f"    {note.reason}: {', '.join(note.primitives)} in "
                             f"{short_places(note.source_lines)}: "
                             f"{first_clause(note.detail)}")
    if not verbose and (plan.loops or plan.subgraphs or plan.left_alone):
        lines.append("  (why, in full: print(plan.text(verbose=True)) or plan.to_dict())")
    return lines


def _loop_dict(loop: LoopDecision) -> dict[str, Any]:
    return {"location": loop.location, "kind": str(loop.kind.value), "pass": loop.pass_name,
            "eqns": list(loop.eqns),
            "primitives": list(loop.primitives), "sources": list(loop.sources),
            "trips_before": loop.trips_before, "trips_after": loop.trips_after,
            "unroll": loop.unroll, "reason": loop.reason,
            "members": [list(m) for m in loop.members], "stage": loop.stage,
            "saving_us": loop.saving_us}


def build_report(plan: LevelPlan, function: str, target: str, emitted: bool,
                 options: dict[str, Any], loops: tuple[LoopDecision, ...] = (),
                 plain_us: float | None = None, priced_in: str | None = None,
                 tuning: Tuning | None = None, mode: ModeChoice | None = None) -> Plan:
    """Turns the internal plan tree into the public ``Plan`` report.

    ``loops`` holds every decision of the passes run before planning; those of the
    subgraph batching pass are reported apart, as ``Plan.subgraphs``. ``plain_us`` is
    the cost model's time of the program as traced, ``priced_in`` the CUDA-graph mode
    stream sections were priced in (None: not priced). ``tuning``: the tuner's table,
    for a function decorated with ``tune=True``.
    """
    sections: list[Section] = []
    notes: list[LeftAlone] = []
    collectives: list[Collective] = []
    steps: list[Step] = []
    loop_decisions = tuple(d for d in loops if d.kind not in SUBGRAPH_KINDS)
    subgraph_decisions = tuple(d for d in loops if d.kind in SUBGRAPH_KINDS)
    drawn = {level.path for level in plan.walk()
             if level.path == "/" or level.sections or level.collective_groups}
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
            sections.append(Section(
                level.path, section.group, regions, overlaps,
                gain_us=None if section.gain_seconds is None else section.gain_seconds * 1e6,
                cut_cost_us=None if section.cost_seconds is None else section.cost_seconds * 1e6,
                verdict=section.verdict, pays=section.pays))
        collectives.extend(_collectives(level, eqns, overlapped))
        rewritten = _rewritten_loops(level.path, eqns, loop_decisions)
        if level.path in drawn:
            batched = _batched_groups(level.path, eqns, subgraph_decisions, drawn)
            steps.extend(_steps(level, eqns, first_section, len(steps), rewritten, batched))
        made_here = {i for i, marks in rewritten.items()
                     if any(loop_decisions[k].kind in _NEW_LOOP_KINDS for k in marks)}
        for note in level.notes:
            kept = tuple(i for i in note.eqns if i not in made_here)
            if not kept:  # a loop jaxpar made: reported under "loops", not left alone
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
                source_lines=_sources(eqns, kept, level.seconds)))
    total = sum(plan.seconds) * 1e6
    return Plan(function=function, target=target, emitted=emitted,
                options=tuple(sorted(options.items())), num_eqns=num_eqns,
                total_cost_us=total, sections=tuple(sections), left_alone=tuple(notes),
                loops=loop_decisions, collectives=tuple(collectives),
                subgraphs=subgraph_decisions,
                steps=tuple(steps), plain_cost_us=plain_us, priced_in=priced_in,
                tuning=tuning, mode=mode)


def _rewritten_loops(path: str, eqns: Any, loops: tuple[LoopDecision, ...]
                     ) -> dict[int, tuple[int, ...]]:
    """Loop equations of one level that a loop pass produced or changed: the indices
    of those decisions in ``loops``.

    A decision names the equations as the pass saw them; the loop it leaves carries
    the source line of one of them. Each decision marks one loop equation of its
    level with a matching primitive and source line, and no equation gets the same
    kind twice (scans written in a Python loop share their line).
    """
    marked: dict[int, list[int]] = {}
    loop_eqns = [i for i, eqn in enumerate(eqns) if eqn.primitive.name in _LOOP_PRIMITIVES]
    if not loop_eqns:
        return {}
    sources = {i: _compat.source_summary(eqns[i]) for i in loop_eqns}
    for k, decision in enumerate(loops):
        if decision.location != path or decision.kind not in _DRAWN_LOOP_KINDS:
            continue
        for i in loop_eqns:
            if (eqns[i].primitive.name in decision.primitives
                    and sources[i] in decision.sources
                    and all(loops[j].kind != decision.kind for j in marked.get(i, ()))):
                marked.setdefault(i, []).append(k)
                break
    return {i: tuple(ks) for i, ks in marked.items()}


def _batched_groups(path: str, eqns: Any, decisions: tuple[LoopDecision, ...],
                    drawn: set[str]) -> dict[int, tuple[int, ...]]:
    """Equations of the drawn level ``path`` that run batched matmul groups: the indices
    of those decisions in ``decisions``.

    A group made at this level marks the batched op it left (a matching primitive and
    source line; no equation gets two groups). A group made in a nested level that is
    not drawn marks the equation of this level that holds it (the loop whose body it is),
    when that equation still has the primitive the group's location names.
    """
    marked: dict[int, list[int]] = {}
    summaries: dict[int, str] = {}  # equation index -> its source line, looked up once

    def source(i: int) -> str:
        found = summaries.get(i)
        if found is None:
            found = summaries[i] = _compat.source_summary(eqns[i])
        return found

    for k, d in enumerate(decisions):
        if d.kind != KIND_BATCHED_MATMULS:
            continue
        parts = [p for p in d.location.split("/") if p]
        homes = ["/" + "/".join(parts[:n]) for n in range(len(parts) + 1)]
        home = next((n for n in range(len(parts), -1, -1) if homes[n] in drawn), None)
        if home is None or homes[home] != path:
            continue
        if home == len(parts):  # made here
            for i, eqn in enumerate(eqns):
                if (eqn.primitive.name in d.primitives and i not in marked
                        and source(i) in d.sources):
                    marked[i] = [k]
                    break
            continue
        primitive, _, rest = parts[home].partition("#")
        index = rest.split(".", 1)[0]
        if index.isdigit() and int(index) < len(eqns) \
                and eqns[int(index)].primitive.name == primitive:
            marked.setdefault(int(index), []).append(k)
    return {i: tuple(ks) for i, ks in marked.items()}


def _steps(level: LevelPlan, eqns: Any, first_section: int, offset: int,
           rewritten: dict[int, tuple[int, ...]], batched: dict[int, tuple[int, ...]]
           ) -> list[Step]:
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
            source_lines=_sources(eqns, tuple(members), level.seconds),
            after=tuple(after), loop_rewrites=rewrites,
            batched_groups=tuple(sorted(k for i in members for k in batched.get(i, ())))))
    return out


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
        name = _compat.display_name(eqns[i])
        weight[name] = weight.get(name, 0.0) + seconds[i]
        count[name] += 1
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
