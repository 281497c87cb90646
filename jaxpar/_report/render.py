"""Pictures of a plan: an SVG timeline, an HTML page, a Chrome trace and Graphviz dot.

The timeline is the plan's estimated schedule (``jaxpar._report.timeline``), one per level
(the top level, then each loop body with sections of its own): a lane per stream
(the main stream on top, then stream 1..k, then the collectives), a linear time axis
in estimated microseconds, and every step as a box as wide as its estimated time:
main-stream work too, regions in their stream's lane, collectives groups in theirs.
Loops the passes rewrote are drawn as such: a band per member of a fused or
batched loop, ticks for the trips of an unrolled one, an outlined box per group of
matmuls that ``batch_matmuls`` runs as one batched op (in the step, or in the body of
its loop), spanning the box's height with a dot per member. A legend explains the colours;
the title gives the plan's one estimate (``Plan.estimate``: jax.jit against jaxpar, with
its source) and, for a forced section, the GPU pricing's verdict.
Hovering a box shows its primitives, cost and source lines.

``plan_to_chrome_trace`` writes the same timeline as Chrome trace events (``ph: "X"``),
which Perfetto and TensorBoard open beside a real ``jax.profiler`` trace.

Example::

    plan = jaxpar.inspect(f, target="gpu")(x, y)
    plan.save("plan.html")     # open in a browser
    plan.save("plan.json")     # open in ui.perfetto.dev
    print(plan.to_dot())       # dot -Tsvg

Sharp edges:
  * Times are the cost model's estimates, not measurements. Boxes narrower than
    one pixel are drawn one pixel wide so they stay visible.
"""

from __future__ import annotations

import html
import math
import re
from typing import Any

from .. import targets
from ..passes import UNCHANGED_KINDS, DecisionKind, PassDecision
from .timeline import LevelTimeline, lay_out, plan_estimate
from .types import PlanRecord, Step, loop_decisions, subgraph_decisions

_LANE_HEIGHT = 34
_LABEL_WIDTH = 110
_CHART_WIDTH = 860
_MIN_BOX = 1.0
_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#eeca3b",
           "#9d755d")
_MAIN_COLOR = "#9aa5b1"
_COLLECTIVES_COLOR = "#555555"
# How a rewritten loop is drawn, for the legend.
_LOOP_REWRITES = {
    "fused": "fused loops: one loop runs the bodies side by side (a band each)",
    "batched": "batched loops: one vmapped loop over stacked operands (a dashed band each)",
    "unrolled": "unrolled loop: ticks mark its trips, fewer and longer",
    "batched matmuls": "batched matmuls: same-shaped matmuls of N members run as one "
                       "(a box per group, a dot per member)",
}
_GROUP_COLOR = "#ffd166"
_LOOP_COLOR = "#6b5b95"


_SCOPE = re.compile(r"^\[(?P<scope>[^\]]*)\] ")
_PATH_PART = re.compile(r"^(?P<prim>[A-Za-z_]\w*)#\d+\.(?P<label>.*)$")
_MAX_PLACES = 3


def readable_location(path: str) -> str:
    """A level's place for people: ``""`` at the top, ``in scan body > cond branch 1``
    inside (jaxpar's level paths number equations: ``/scan#19.jaxpr``)."""
    parts = []
    for part in path.strip("/").split("/"):
        match = _PATH_PART.match(part)
        if not match:
            if part:
                parts.append(part)
            continue
        prim, label = match.group("prim"), match.group("label")
        prim = "jit" if prim == "pjit" else prim
        branch = re.fullmatch(r"branches\[(\d+)\]", label)
        if branch:
            parts.append(f"{prim} branch {branch.group(1)}")
        elif prim in ("scan", "while", "jit", "checkpoint", "remat", "custom_jvp_call",
                      "custom_vjp_call", "shard_map"):
            parts.append(f"{prim} body" if prim in ("scan", "while") else prim)
        else:
            parts.append(f"{prim} {label}")
    return f"in {' > '.join(parts)}" if parts else ""


def short_place(source: str) -> str:
    """The short form of a source summary: the layer path where JAX's name stack has one
    (``TwoTowers/query/dense0``), else ``file:line``."""
    match = _SCOPE.match(source)
    if match:
        return match.group("scope")
    if not source:
        return "<unknown>"
    back = " (backward)" if source.endswith(" (backward)") else ""
    return re.sub(r"^(.*:\d+):\d+$", r"\1", source.split(" (")[0]) + back


def short_places(sources: tuple[str, ...] | list[str]) -> str:
    """Up to three distinct short places of source summaries, then how many more."""
    return place_list([short_place(s) for s in sources if s])


def place_list(places: tuple[str, ...] | list[str]) -> str:
    """Up to three distinct places (``Region.places``), then how many more."""
    places = list(dict.fromkeys(p for p in places if p))
    if not places:
        return "<unknown>"
    more = len(places) - _MAX_PLACES
    return ", ".join(places[:_MAX_PLACES]) + (f" (+{more} more)" if more > 0 else "")


def first_clause(text: str, limit: int = 160, clauses: int = 1) -> str:
    """The first clause of a reason (up to ``:`` or ``;`` outside brackets; the first
    ``clauses``, joined by their ``:``), parentheticals dropped, and equations told by kind
    rather than by number (``equations 0 and 9`` -> ``two equations``): a short line names
    places, not jaxpr indices."""
    clause, depth, seen = text, 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(char, 0)
        if depth == 0 and char in ":;" and text[i + 1:i + 2] == " ":
            seen += 1
            if seen == clauses or char == ";":
                clause = text[:i]
                break
    while True:  # innermost first: "(a (b) c)" goes whole
        shorter = re.sub(r" \([^()]*\)", "", clause)
        if shorter == clause:
            break
        clause = shorter
    clause = clause.strip()
    clause = _EQUATION_PAIR.sub("two equations", clause)
    clause = _EQUATION.sub("an equation", clause)
    return clause if len(clause) <= limit else clause[: limit - 3].rstrip() + "..."


_EQUATION_PAIR = re.compile(r"\bequations \d+ and \d+\b")
_EQUATION = re.compile(r"\bequation #?\d+\b")


def saving_text(saving_us: float, done: bool) -> str:
    """A signed estimate in words: ``saves est. 3.1 us per run`` (``done``: the rewrite
    was made; else ``would save``), ``would cost est. 0.4 us per run`` for a loss."""
    amount = f"est. {abs(saving_us):.3g} us per run"
    if saving_us < 0:
        return f"{'costs' if done else 'would cost'} {amount}"
    return f"{'saves' if done else 'would save'} {amount}"


def decision_summary(d: PassDecision) -> str:
    """One short line: kind, what, where in the user's model (``PassDecision.places``,
    else its source lines), and the figure that decided it, in words."""
    where = readable_location(d.location)
    saving = d.saving_us
    if saving is None:
        worth = re.search(r"worth ([+-]?[\d.]+(?:e[+-]?\d+)?) us", d.reason)
        saving = float(worth.group(1)) if worth else None
    trips = ""
    if d.trips_before is not None and d.trips_after is not None:
        trips = f", trips {d.trips_before} -> {d.trips_after}"
    figure = ("" if saving is None
              else f", {saving_text(saving, d.kind not in UNCHANGED_KINDS)}")
    return (f"{d.kind}{' ' + where if where else ''}: {first_clause(d.reason)}{trips} "
            f"(in {_places_of(d)}){figure}")


def _places_of(d: PassDecision) -> str:
    return place_list(d.places) if d.places else short_places(d.sources)


def _parts(d: PassDecision) -> str:
    """What a decision's ``members`` are: the members it joins, or the runs of a sum it
    reduced (``sums reduced``)."""
    return "runs" if d.kind == DecisionKind.SUMS_REDUCED else "members"


def decision_text(d: PassDecision) -> str:
    """One report line: kind, place, primitives, trips and unroll when known, reason, sources
    (member by member, with equation indices, where the decision joins members)."""
    trips = ""
    if d.trips_before is not None or d.trips_after is not None:
        trips = f", trips {d.trips_before} -> {d.trips_after}"
    unroll = f", unroll {d.unroll}" if d.unroll is not None else ""
    depth = f", launch depth {d.depth}" if d.depth is not None else ""
    if d.members:
        where = f"{_parts(d)}: " + "; ".join(
            f"{m}) " + ", ".join(_member_op(d, i) for i in member)
            for m, member in enumerate(d.members, start=1))
    else:
        where = "; ".join(dict.fromkeys(d.sources)) or "<unknown>"
    place = readable_location(d.location)
    return (f"{d.kind}{' ' + place if place else ''} [{', '.join(d.primitives)}{trips}{unroll}"
            f"{depth}]: {d.reason} ({where})")


def _member_op(d: PassDecision, eqn: int) -> str:
    """``dot_general #7 at file:line (function)`` for equation ``eqn`` of decision ``d``."""
    if eqn not in d.eqns:
        return f"#{eqn}"
    k = d.eqns.index(eqn)
    return f"{d.primitives[k]} #{eqn} at {d.sources[k] or '<unknown>'}"


def _escape(text: object) -> str:
    return html.escape(str(text), quote=True)


def _lane_color(lane: str) -> str:
    if lane == "main":
        return _MAIN_COLOR
    if lane == "collectives":
        return _COLLECTIVES_COLOR
    return _COLORS[(int(lane.split()[1]) - 1) % len(_COLORS)]


def _step_label(plan: PlanRecord, step: Step) -> str:
    """Short text for a box: its heaviest primitives, or what the passes did to its loop."""
    if step.loop_rewrites:
        return "⟳ " + ", ".join(dict.fromkeys(plan.decisions[k].kind for k in step.loop_rewrites))
    names = ", ".join(name for name, _ in step.primitives[:2])
    return ("⟳ " + names) if step.kind == "loop" else names


def _step_title(plan: PlanRecord, step: Step, start: float, duration: float) -> str:
    prims = ", ".join(f"{name} x{count}" for name, count in step.primitives)
    where = {"main": "main stream", "collectives": "collectives launched together"}.get(
        step.lane, step.lane)
    lines = [f"{where}: {step.num_eqns} equations, est. {duration:.1f} us "
             f"(from {start:.1f} to {start + duration:.1f} us)", prims]
    if step.section is not None:
        section = plan.sections[step.section]
        lines.append(f"section at {section.location}: " + (
            f"beside {section.overlaps}" if section.overlaps
            else f"scheduling group {section.scheduling_group}"))
    lines += [decision_text(plan.decisions[k]) for k in step.loop_rewrites]
    lines += [decision_text(plan.decisions[k]) for k in step.batched_groups]
    lines += list(step.source_lines)
    return "\n".join(lines)


def _ticks(makespan: float) -> list[float]:
    """Round tick values from 0 to ``makespan``, about six of them."""
    if makespan <= 0:
        return [0.0]
    raw = makespan / 6
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    return [round(k * step, 12) for k in range(int(makespan / step + 1e-9) + 1)]


def _group_label(plan: PlanRecord, k: int) -> str:
    return f"batched matmuls: {len(plan.decisions[k].members)} members"


def _loop_glyphs(plan: PlanRecord, step: Step, x: float, y: float, width: float, height: float,
                 used: set[str], left: float = 0.0) -> str:
    """What the passes did, drawn on the loop's box: bands for fused or batched
    members, ticks for the trips of an unrolled loop; and a box per batched matmul
    group, side by side in launch-depth order right of ``left`` pixels (the box's label)."""
    out = []
    for k in step.loop_rewrites:
        decision = plan.decisions[k]
        used.add(decision.kind)
        marks = []
        if decision.kind in ("fused", "batched"):
            members = len(decision.primitives)
            dash = ' stroke-dasharray="4,3"' if decision.kind == "batched" else ""
            for m in range(1, members):
                band_y = y + height * m / members
                marks.append(f'<line x1="{x:.2f}" y1="{band_y:.1f}" x2="{x + width:.2f}" '
                             f'y2="{band_y:.1f}" stroke="#fff" stroke-width="1.5"{dash}/>')
        elif decision.kind == "unrolled" and decision.trips_after:
            trips = decision.trips_after
            if width / trips >= 2:
                for t in range(1, trips):
                    tick_x = x + width * t / trips
                    marks.append(f'<line x1="{tick_x:.2f}" y1="{y + height - 5:.1f}" '
                                 f'x2="{tick_x:.2f}" y2="{y + height:.1f}" stroke="#fff"/>')
        out.append(f'<g class="loop-rewrite" data-rewrite="{decision.kind}" '
                   f'pointer-events="none">{"".join(marks)}</g>')
    groups = sorted(step.batched_groups,
                    key=lambda k: (plan.decisions[k].depth or 0, plan.decisions[k].eqns))
    left = min(left, width / 2)
    slot = (width - left) / len(groups) if groups else 0.0
    for j, k in enumerate(groups):
        decision = plan.decisions[k]
        used.add(decision.kind)
        members = max(len(decision.members), 1)
        gap = min(2.0, slot / 8)
        gx, gw = x + left + j * slot + gap, max(slot - 2 * gap, _MIN_BOX)
        dot_x = gx + gw - 6 if gw > 40 else gx + gw / 2  # clear of the label
        dots = "".join(
            f'<circle cx="{dot_x:.2f}" cy="{y + height * (m + 0.5) / members:.1f}" '
            f'r="{min(2.5, height / (2 * members)):.1f}" fill="{_GROUP_COLOR}"/>'
            for m in range(members))
        label = _group_label(plan, k)
        text = (f'<text x="{gx + 3:.1f}" y="{y + height - 3:.1f}" font-size="9" fill="#fff" '
                f'pointer-events="none">{_escape(label[:int((gw - 6) / 5)])}</text>'
                if gw > 40 else "")
        out.append(
            f'<g class="loop-rewrite batched-group" data-rewrite="{decision.kind}" '
            f'data-members="{len(decision.members)}" data-depth="{decision.depth}">'
            f"<title>{_escape(label)}\n{_escape(decision_text(decision))}</title>"
            f'<rect class="group-box" x="{gx:.2f}" y="{y + 1:.1f}" width="{gw:.2f}" '
            f'height="{height - 2:.1f}" fill="none" stroke="{_GROUP_COLOR}" '
            f'stroke-width="1.5" rx="2"/>{dots}{text}</g>')
    return "".join(out)


def _level_svg(plan: PlanRecord, level: LevelTimeline, y0: float, patterns_used: set[str]
               ) -> tuple[list[str], float]:
    """The parts of one level's timeline drawn from height ``y0``; returns the new height."""
    parts: list[str] = []
    # The lanes show what may run side by side; the plan's one figure is in the title.
    title = ("top level" if level.location == "/"
             else f"inside {level.location} (one run of this body)")
    scaled = (f", times x{level.scale:.2f} to end at the plan's estimate"
              if abs(level.scale - 1.0) > 1e-3 else "")
    parts.append(
        f'<text class="level-title" x="8" y="{y0 + 14:.0f}" font-size="12" '
        f'font-weight="bold">{_escape(title)}: work as the planner\'s cost model places '
        f"it{_escape(scaled)}</text>")
    scale = _CHART_WIDTH / level.makespan_us if level.makespan_us > 0 else 0.0
    lanes_top = y0 + 22
    lane_y = {lane: lanes_top + i * _LANE_HEIGHT for i, lane in enumerate(level.lanes)}
    total_width = _LABEL_WIDTH + _CHART_WIDTH + 20
    for i, (lane, y) in enumerate(lane_y.items()):
        parts.append(
            f'<g class="lane" data-lane="{_escape(lane)}" data-level="{_escape(level.location)}">'
            f'<rect x="0" y="{y:.0f}" width="{total_width}" height="{_LANE_HEIGHT}" '
            f'fill="{"#f7f7f7" if i % 2 else "#fff"}"/>'
            f'<text x="8" y="{y + 21:.0f}" font-size="12" fill="#222">{_escape(lane)}</text></g>')
    for span in level.spans:
        step = plan.steps[span.step]
        x = _LABEL_WIDTH + span.start_us * scale
        width = max(span.duration_us * scale, _MIN_BOX)
        y = lane_y[span.lane] + 4
        height = _LANE_HEIGHT - 8
        color = _LOOP_COLOR if step.kind == "loop" else _lane_color(span.lane)
        label = _step_label(plan, step)
        banded = any(plan.decisions[k].kind in ("fused", "batched") for k in step.loop_rewrites)
        text = (f'<text x="{x + 3:.1f}" y="{y + (10 if banded else 17):.1f}" font-size="10" '
                'fill="#fff" '
                f'pointer-events="none">{_escape(label[:int(width / 6)])}</text>'
                if width > 24 else "")
        shown = label[:int(width / 6)] if width > 24 else ""
        overlays = _loop_glyphs(plan, step, x, y, width, height, patterns_used,
                                left=6 * len(shown) + 6 if shown else 0.0)
        parts.append(
            f'<g class="span" data-lane="{_escape(span.lane)}" data-kind="{step.kind}" '
            f'data-step="{span.step}" data-start-us="{span.start_us:.6g}" '
            f'data-duration-us="{span.duration_us:.6g}"'
            + (f' data-stream="{span.lane.split()[1]}"' if span.lane.startswith("stream ")
               else "")
            + f"><title>{_escape(_step_title(plan, step, span.start_us, span.duration_us))}"
            f'</title><rect class="box" x="{x:.2f}" y="{y:.1f}" width="{width:.2f}" '
            f'height="{height}" fill="{color}" stroke="#fff" stroke-width="0.5"/>'
            f"{overlays}{text}</g>")
    axis_y = lanes_top + len(level.lanes) * _LANE_HEIGHT
    parts.append(f'<g class="axis" data-level="{_escape(level.location)}">'
                 f'<line x1="{_LABEL_WIDTH}" y1="{axis_y:.0f}" x2="{_LABEL_WIDTH + _CHART_WIDTH}" '
                 f'y2="{axis_y:.0f}" stroke="#333"/>')
    for tick in _ticks(level.makespan_us):
        x = _LABEL_WIDTH + tick * scale
        parts.append(f'<line x1="{x:.1f}" y1="{axis_y:.0f}" x2="{x:.1f}" y2="{axis_y + 4:.0f}" '
                     f'stroke="#333"/><text class="tick" x="{x:.1f}" y="{axis_y + 15:.0f}" '
                     f'font-size="9" text-anchor="middle" fill="#333">{tick:g}</text>')
    parts.append(f'<text x="{_LABEL_WIDTH + _CHART_WIDTH}" y="{axis_y + 27:.0f}" font-size="9" '
                 'text-anchor="end" fill="#333">estimated us</text></g>')
    return parts, axis_y + 36


def _legend(plan: PlanRecord, levels: tuple[LevelTimeline, ...], patterns_used: set[str], y0: float
            ) -> tuple[list[str], float]:
    entries: list[tuple[str, str, str]] = [("main", _MAIN_COLOR, "main-stream work")]
    streams = sorted({lane for level in levels for lane in level.lanes
                      if lane.startswith("stream ")}, key=lambda lane: int(lane.split()[1]))
    entries += [(lane, _lane_color(lane), f"region on {lane}") for lane in streams]
    if any("collectives" in level.lanes for level in levels):
        entries.append(("collectives", _COLLECTIVES_COLOR, "collectives launched together"))
    if any(step.kind == "loop" for step in plan.steps):
        entries.append(("loop", _LOOP_COLOR, "⟳ a loop (scan, while) on the main stream"))
    entries += [(f"rewrite:{kind}", _LOOP_COLOR, text)
                for kind, text in _LOOP_REWRITES.items() if kind in patterns_used]
    parts = ['<g class="legend">']
    for i, (key, fill, text) in enumerate(entries):
        x = 8 + (i % 2) * 490
        y = y0 + (i // 2) * 18
        glyph = ""
        if key == "rewrite:fused":
            glyph = f'<line x1="{x}" y1="{y + 6}" x2="{x + 22}" y2="{y + 6}" stroke="#fff"/>'
        elif key == "rewrite:batched":
            glyph = (f'<line x1="{x}" y1="{y + 6}" x2="{x + 22}" y2="{y + 6}" stroke="#fff" '
                     'stroke-dasharray="4,3"/>')
        elif key == "rewrite:batched matmuls":
            glyph = (f'<rect x="{x + 5}" y="{y + 1}" width="12" height="10" fill="none" '
                     f'stroke="{_GROUP_COLOR}" stroke-width="1.5"/><circle cx="{x + 11}" '
                     f'cy="{y + 4}" r="1.5" fill="{_GROUP_COLOR}"/><circle cx="{x + 11}" '
                     f'cy="{y + 8}" r="1.5" fill="{_GROUP_COLOR}"/>')
        elif key == "rewrite:unrolled":
            glyph = "".join(f'<line x1="{x + t}" y1="{y + 8}" x2="{x + t}" y2="{y + 12}" '
                            'stroke="#fff"/>' for t in (5, 11, 17))
        parts.append(f'<g class="legend-entry" data-key="{_escape(key)}">'
                     f'<rect x="{x}" y="{y}" width="22" height="12" fill="{fill}"/>{glyph}'
                     f'<text x="{x + 28}" y="{y + 10}" font-size="11" fill="#222">'
                     f"{_escape(text)}</text></g>")
    parts.append("</g>")
    return parts, y0 + ((len(entries) + 1) // 2) * 18 + 6


def plan_to_svg(plan: PlanRecord) -> str:
    """The plan's estimated timeline as a standalone ``<svg>`` element."""
    timeline = lay_out(plan)
    title = (f"{plan.function}: planned for {plan.target}, {plan.num_eqns} equations, "
             + (f"{plan.num_streams} streams" if targets.get(plan.target).emits_streams else
                f"{plan.num_regions} independent parts, nothing emitted (no streams off a GPU)"))
    figure = plan_estimate(plan)
    verdicts = [f"forced: the GPU pricing would not emit this section: {why}"
                for why in figure.rejected]
    parts = [f'<text class="estimate" x="8" y="{34 + 14 * i:.0f}" font-size="12" '
             f'fill="{"#222" if i == 0 else "#b00"}">{_escape(line)}</text>'
             for i, line in enumerate([figure.line(), *verdicts])]
    y = 30.0 + 14 * (1 + len(verdicts))
    patterns_used: set[str] = set()
    mode_line = graph_mode_line(plan)
    if mode_line:
        parts.append(f'<text class="mode" x="8" y="{y + 4:.0f}" font-size="12" '
                     f'fill="#205">{_escape(mode_line)}</text>')
        y += 14
    if not plan.sections:
        rest = ("jaxpar's change here is the CUDA-graph mode and the rewrites below"
                if mode_line else "everything stays on the main stream")
        parts.append(f'<text x="8" y="{y + 4:.0f}" font-size="12" fill="#555">no stream '
                     f"sections: {_escape(rest)}</text>")
        y += 14
    for level in timeline.levels:
        level_parts, y = _level_svg(plan, level, y, patterns_used)
        parts += level_parts
    legend, y = _legend(plan, timeline.levels, patterns_used, y)
    parts += legend
    decisions = [
        f"{d.kind}: {', '.join(d.primitives)}"
        + (f", {len(d.members)} {_parts(d)}" if d.members else "")
        + (f", launch depth {d.depth}" if d.depth is not None else "")
        + (f", trips {d.trips_before} → {d.trips_after}"
           if d.trips_before is not None or d.trips_after is not None else "")
        + (f", unroll {d.unroll}" if d.unroll is not None else "")
        for d in (*loop_decisions(plan.decisions), *subgraph_decisions(plan.decisions))]
    for i, line in enumerate(decisions):
        parts.append(f'<text class="loop" x="8" y="{y + 14 * i + 10:.0f}" '
                     f'font-size="11" fill="#333">⟳ {_escape(line)}</text>')
    height = y + 14 * len(decisions) + 16
    width = _LABEL_WIDTH + _CHART_WIDTH + 20
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="jaxpar-plan" '
            f'width="{width}" height="{height:.0f}" font-family="sans-serif">'
            f'<text x="8" y="18" font-size="13" font-weight="bold">{_escape(title)}</text>'
            + "".join(parts) + "</svg>")


def graph_mode_line(plan: PlanRecord) -> str:
    """The CUDA-graph mode jaxpar compiles the function in, where it chose one (else
    empty): ``"CUDA graphs: concurrent_regions (the process: lhs), est. ..."``."""
    mode = plan.mode
    if mode is None or not mode.chosen:
        return ""
    figure = plan_estimate(plan)
    return (f"CUDA graphs: compiled in {mode.mode.value} mode (the process: "
            f"{mode.user_mode.value}); {mode.line(figure.plain_us, figure.jaxpar_us)}")


def plan_to_html(plan: PlanRecord) -> str:
    """A standalone HTML page: the timeline, then the text report."""
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
            f"<title>jaxpar plan: {_escape(plan.function)}</title></head><body>"
            f"{plan_to_svg(plan)}<pre>{_escape(str(plan))}</pre></body></html>")


_COLLECTIVES_TID = 1000


def plan_to_chrome_trace(plan: PlanRecord) -> dict[str, Any]:
    """The estimated timeline as a Chrome trace (``{"traceEvents": [...]}``).

    One process per level (1 = the top level), one thread per lane (0 = the main
    stream, k = stream k, 1000 = collectives); every step is a complete event
    (``ph: "X"``) with ``ts`` and ``dur`` in estimated microseconds.
    """
    events: list[dict[str, Any]] = []
    figure = plan_estimate(plan)
    graphs = (f" ({plan.mode.mode.value} CUDA graphs)" if plan.mode is not None
              and plan.mode.chosen else "")
    for pid, level in enumerate(lay_out(plan).levels, start=1):
        name = (f"top level, {figure.line()}" if level.location == "/"
                else f"inside {level.location}")
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": f"jaxpar estimate: {plan.function}, {name}"}})
        for lane in level.lanes:
            shown = f"{lane}{graphs}" if lane == "main" and level.location == "/" else lane
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": _tid(lane),
                           "args": {"name": shown}})
        for span in level.spans:
            step = plan.steps[span.step]
            events.append({
                "name": _step_label(plan, step) or step.kind, "cat": step.kind, "ph": "X",
                "ts": span.start_us, "dur": span.duration_us, "pid": pid,
                "tid": _tid(span.lane),
                "args": {"location": step.location, "equations": step.num_eqns,
                         "primitives": {n: c for n, c in step.primitives},
                         "source_lines": list(step.source_lines),
                         "loop_rewrites": [decision_text(plan.decisions[k])
                                           for k in step.loop_rewrites],
                         "batched_groups": [decision_text(plan.decisions[k])
                                            for k in step.batched_groups]}})
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"source": "jaxpar.Plan.save: cost-model estimates, not a "
                                    "measurement", "function": plan.function,
                          "target": plan.target, "plain_us": figure.plain_us,
                          "jaxpar_us": figure.jaxpar_us, "estimate": figure.line(),
                          "cuda_graphs": graph_mode_line(plan)}}


def _tid(lane: str) -> int:
    if lane == "main":
        return 0
    if lane == "collectives":
        return _COLLECTIVES_TID
    return int(lane.split()[1])


def plan_to_dot(plan: PlanRecord) -> str:
    """The plan as a Graphviz digraph: sections as clusters, regions as nodes."""
    lines = ["digraph jaxpar_plan {", "  rankdir=LR;", '  node [shape=box, style="rounded,filled", '
             'fontname="sans-serif", fontcolor=white];']
    previous: list[str] = []
    for index, section in enumerate(plan.sections):
        label = (f"beside {section.overlaps}" if section.overlaps
                 else f"group {section.scheduling_group}")
        lines.append(f"  subgraph cluster_{index} {{")
        lines.append(f'    label="{_dot(section.location + " " + label)}";')
        names = []
        for region in section.regions:
            name = f"s{index}_r{region.stream}"
            names.append(name)
            prims = ", ".join(f"{p} x{c}" for p, c in region.primitives[:3])
            color = _COLORS[(region.stream - 1) % len(_COLORS)]
            lines.append(f'    {name} [label="stream {region.stream}\\n{_dot(prims)}\\n'
                         f'{region.cost_us:.1f} us", fillcolor="{color}"];')
        lines.append("  }")
        for before in previous:
            for after in names:
                lines.append(f"  {before} -> {after};")
        previous = names
    lines.append("}")
    return "\n".join(lines)


def _dot(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
