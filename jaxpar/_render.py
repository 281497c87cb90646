"""Pictures of a plan: an inline SVG timeline, an HTML page and Graphviz dot.

The timeline has one lane per stream (the main stream on top, then stream 1..k,
then a lane for collectives). Each parallel section is a column; its regions
are boxes in their stream's lane, as wide as their estimated cost (square-root
scaled, so small regions stay visible); collectives groups are boxes in the
collectives lane with arrows for their directions. Arrows between columns are
the order the sections run in. Hovering a box shows its primitives, cost and
source lines. Loop decisions are listed under the lanes.

Example::

    plan = jaxpar.inspect(f, target="gpu")(x, y)
    plan.save("plan.html")     # open in a browser
    print(plan.to_dot())       # dot -Tsvg

Sharp edges:
  * Only what the plan records is drawn: equations left on the main stream are
    summarised, not drawn one by one.
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._inspect import Plan, Region, Section

_LANE_HEIGHT = 44
_LABEL_WIDTH = 110
_COLUMN_GAP = 36
_MIN_BOX = 46
_MAX_BOX = 260
_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#eeca3b",
           "#9d755d")


def _escape(text: object) -> str:
    return html.escape(str(text), quote=True)


def _width(cost_us: float, largest: float) -> float:
    if largest <= 0:
        return float(_MIN_BOX)
    return _MIN_BOX + (_MAX_BOX - _MIN_BOX) * math.sqrt(max(cost_us, 0.0) / largest)


def _region_title(section: Section, region: Region) -> str:
    prims = ", ".join(f"{name} x{count}" for name, count in region.primitives)
    lines = [f"stream {region.stream}: {region.num_eqns} equations, est. {region.cost_us:.1f} us",
             f"at {section.location}" + (f", beside {section.overlaps}" if section.overlaps
                                         else f", scheduling group {section.scheduling_group}"),
             prims, *region.source_lines]
    return "\n".join(lines)


def plan_to_svg(plan: Plan) -> str:
    """The plan as a standalone ``<svg>`` element."""
    streams = sorted({r.stream for s in plan.sections for r in s.regions})
    lanes = ["main", *[f"stream {k}" for k in streams]]
    has_collectives = any(c.grouped for c in plan.collectives)
    if has_collectives:
        lanes.append("collectives")
    lane_y = {name: 30 + i * _LANE_HEIGHT for i, name in enumerate(lanes)}
    largest = max((r.cost_us for s in plan.sections for r in s.regions), default=1.0)
    parts: list[str] = []
    x = float(_LABEL_WIDTH)
    columns: list[tuple[float, float]] = []
    for index, section in enumerate(plan.sections):
        width = max(_width(r.cost_us, largest) for r in section.regions)
        columns.append((x, x + width))
        parts.append(f'<g class="section" data-section="{index}">')
        tag = "beside collectives" if section.overlaps else f"group {section.scheduling_group}"
        parts.append(f'<text x="{x:.1f}" y="{lane_y["main"] + 10}" font-size="9" fill="#666">'
                     f"{_escape(tag)} at {_escape(section.location)[:int(width / 5)]}</text>")
        for region in section.regions:
            y = lane_y[f"stream {region.stream}"]
            w = _width(region.cost_us, largest)
            color = _COLORS[(region.stream - 1) % len(_COLORS)]
            prims = ", ".join(name for name, _ in region.primitives[:2])
            parts.append(
                f'<g class="region" data-stream="{region.stream}" data-section="{index}">'
                f"<title>{_escape(_region_title(section, region))}</title>"
                f'<rect x="{x:.1f}" y="{y + 6}" width="{w:.1f}" height="{_LANE_HEIGHT - 12}" '
                f'rx="5" fill="{color}" fill-opacity="0.85"/>'
                f'<text x="{x + 5:.1f}" y="{y + 22}" font-size="11" fill="#fff">'
                f"{_escape(prims)[:int(w / 6.5)]}</text>"
                f'<text x="{x + 5:.1f}" y="{y + 34}" font-size="9" fill="#fff">'
                f"{region.cost_us:.1f} us</text></g>")
        if section.overlaps and has_collectives:
            y = lane_y["collectives"]
            arrows = " ".join(arrow for word, arrow in (("forward", "→"), ("backward", "←"),
                                                        ("general", "↔"))
                              if word in section.overlaps)
            parts.append(
                f'<g class="collective" data-section="{index}">'
                f"<title>{_escape(section.overlaps)}</title>"
                f'<rect x="{x:.1f}" y="{y + 6}" width="{width:.1f}" height="{_LANE_HEIGHT - 12}" '
                f'rx="5" fill="#888" fill-opacity="0.7"/>'
                f'<text x="{x + 5:.1f}" y="{y + 26}" font-size="12" fill="#fff">'
                f"{_escape(arrows)} transfer</text></g>")
        parts.append("</g>")
        x += width + _COLUMN_GAP
    if not plan.sections:
        parts.append(f'<text x="{_LABEL_WIDTH}" y="{lane_y["main"] + 26}" font-size="12" '
                     'fill="#555">no parallel sections: everything stays on the main stream'
                     "</text>")
    main_y = lane_y["main"]
    for index, (start, end) in enumerate(columns):
        parts.append(f'<rect class="sync" x="{start:.1f}" y="{main_y + 14}" '
                     f'width="{end - start:.1f}" height="16" fill="#ddd"/>')
        if index + 1 < len(columns):
            nxt = columns[index + 1][0]
            parts.append(f'<line class="dependency" x1="{end + 2:.1f}" y1="{main_y + 22}" '
                         f'x2="{nxt - 4:.1f}" y2="{main_y + 22}" stroke="#555" '
                         'marker-end="url(#arrow)"/>')
    total_width = max(x, _LABEL_WIDTH + 300) + 20
    y_after = 30 + len(lanes) * _LANE_HEIGHT + 10
    loop_lines = [
        f"{d.kind}: {', '.join(d.primitives)}"
        + (f", trips {d.trips_before} → {d.trips_after}"
           if d.trips_before is not None or d.trips_after is not None else "")
        + (f", unroll {d.unroll}" if d.unroll is not None else "")
        for d in (*plan.loops, *plan.subgraphs)]
    for i, line in enumerate(loop_lines):
        parts.append(f'<text class="loop" x="{_LABEL_WIDTH}" y="{y_after + 14 * i + 10}" '
                     f'font-size="11" fill="#333">⟳ {_escape(line)}</text>')
    height = y_after + 14 * len(loop_lines) + 20
    lane_parts = []
    for name, y in lane_y.items():
        lane_parts.append(
            f'<g class="lane" data-lane="{_escape(name)}">'
            f'<rect x="0" y="{y}" width="{total_width:.0f}" height="{_LANE_HEIGHT}" '
            f'fill="{"#f7f7f7" if list(lane_y).index(name) % 2 else "#fff"}"/>'
            f'<text x="8" y="{y + 26}" font-size="12" fill="#222">{_escape(name)}</text></g>')
    title = (f"{plan.function} — target {plan.target}, {plan.num_eqns} equations, "
             f"{plan.num_streams} streams")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="jaxpar-plan" '
            f'width="{total_width:.0f}" height="{height:.0f}" font-family="sans-serif">'
            '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" '
            'markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/>'
            "</marker></defs>"
            f'<text x="8" y="18" font-size="13" font-weight="bold">{_escape(title)}</text>'
            + "".join(lane_parts) + "".join(parts) + "</svg>")


def plan_to_html(plan: Plan) -> str:
    """A standalone HTML page: the timeline, then the text report."""
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
            f"<title>jaxpar plan: {_escape(plan.function)}</title></head><body>"
            f"{plan_to_svg(plan)}<pre>{_escape(str(plan))}</pre></body></html>")


def plan_to_dot(plan: Plan) -> str:
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
