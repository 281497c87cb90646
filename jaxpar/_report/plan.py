"""The report ``jaxpar.inspect`` returns: what went where, and why.

Built from the internal plan tree; holds only numbers and strings, so it is
cheap to keep, compare and serialise.

Example::

    plan = jaxpar.inspect(f, target="gpu")(x, y)
    print(plan)                  # a readable table
    plan.num_streams             # 2
    json.dumps(plan.to_dict())

Sharp edges:
  * Costs are model estimates (see ``jaxpar._model.cost``), good for ranking, not
    for predicting wall time.
"""

from __future__ import annotations

import dataclasses
import html
import os
import re
from typing import Any

from .. import targets
from .._options import DISABLE_VARIABLE, disabled_by_environment
from .._plan import REASON_SYMBOLIC
from ..passes import NEW_LOOP_KINDS, SUBGRAPH_KINDS, UNCHANGED_KINDS, DecisionKind, PassDecision
from .render import (
    decision_text,
    first_clause,
    place_list,
    plan_to_chrome_trace,
    plan_to_dot,
    plan_to_html,
    plan_to_svg,
    readable_location,
    short_places,
)
from .timeline import plan_estimate
from .types import PlanEstimate, PlanRecord, loop_decisions, subgraph_decisions
from .words import left_alone_lines, loop_line, refused_in, refused_line, sections_left_out

# The refused rewrites shown under ``loops:`` and under ``subgraphs:``.
_SUBGRAPH_REFUSALS = tuple(SUBGRAPH_KINDS)
_LOOP_REFUSALS = tuple(kind for kind in DecisionKind if kind not in SUBGRAPH_KINDS)


@dataclasses.dataclass(frozen=True, slots=True)
class Plan(PlanRecord):
    """What ``parallel_branches`` does to one function at one signature.

    The fields are ``PlanRecord``'s; ``estimate`` is the one figure the header, the
    picture and ``gpu_preview`` show."""

    @property
    def estimate(self) -> PlanEstimate:
        """The plan's one estimate: jax.jit's time against jaxpar's, and its source.

        The header of ``text()``, the picture's title and ``gpu_preview`` show this
        figure (``jaxpar._report.timeline.plan_estimate``).
        """
        return plan_estimate(self)

    def to_dict(self) -> dict[str, Any]:
        return {"function": self.function, "target": self.target, "emitted": self.emitted,
                "options": dict(self.options), "num_eqns": self.num_eqns,
                "total_cost_us": self.total_cost_us, "num_streams": self.num_streams,
                "sections": [s.to_dict() for s in self.sections],
                "left_alone": [n.to_dict() for n in self.left_alone],
                "decisions": [_decision_dict(d) for d in self.decisions],
                # Deprecated (_deprecations.DEPRECATIONS: 0.3.0 drops them): "decisions" by kind.
                "loops": [_decision_dict(d) for d in loop_decisions(self.decisions)],
                "subgraphs": [_decision_dict(d) for d in subgraph_decisions(self.decisions)],
                "collectives": [c.to_dict() for c in self.collectives],
                "steps": [step.to_dict() for step in self.steps],
                "estimate": {**dataclasses.asdict(self.estimate),
                             "rejected": list(self.estimate.rejected)},
                "tuning": None if self.tuning is None else self.tuning.to_dict(),
                "xla_options": self.xla_options,
                "mode": self.mode.to_dict() if self.mode is not None else None,
                "memory": self.memory.to_dict() if self.memory is not None else None}

    def __str__(self) -> str:
        return self.text()

    def summary(self) -> str:
        """One line: what jaxpar changes in this program (computed, for examples and logs).

        Example: ``"fused: 1 (2 loops -> 1); batched matmuls: 4; no stream regions"``.
        """
        changed: dict[str, list[PassDecision]] = {}
        for decision in (*loop_decisions(self.decisions),
                         *subgraph_decisions(self.decisions)):
            if decision.kind not in UNCHANGED_KINDS:
                changed.setdefault(str(decision.kind), []).append(decision)
        parts = []
        for kind, decisions in changed.items():
            loops = sum(len(d.eqns) for d in decisions)
            joined = f" ({loops} loops -> {len(decisions)})" if kind in NEW_LOOP_KINDS else ""
            parts.append(f"{kind}: {len(decisions)}{joined}")
        if self.num_regions and targets.get(self.target).emits_streams:
            parts.append(f"{self.num_regions} stream regions in {len(self.sections)} sections")
        elif self.num_regions:
            # Off a GPU nothing runs on a stream (``text()``'s header says so).
            sections = len(self.sections)
            parts.append(f"no stream regions ({self.num_regions} independent parts in "
                         f"{sections} section{'' if sections == 1 else 's'} run one after "
                         f"another on {self.target})")
        elif parts:
            parts.append("no stream regions")
        if self.mode is not None and self.mode.chosen:
            parts.append(f"compiled with {self.mode.mode.value} CUDA graphs (the process: "
                         f"{self.mode.user_mode.value})")
        if not parts:
            return (f"nothing: jax.jit's program (nothing here pays on "
                    f"target={self.target})")
        return "; ".join(parts)

    def text(self, verbose: bool = False) -> str:
        """The report as text: one short line per decision, or every detail.

        The short form answers, in order: how much faster or slower than ``jax.jit`` (an
        estimate, and from what), whether the memory fits, the XLA options where jaxpar
        sets any, what was done to each loop and to independent members and what was
        refused there and why, the stream sections, and the heaviest of what was left
        alone.

        Args:
          verbose: the long form: each decision's full reasoning, cost figures, source
            lines and the equations of each member (``to_dict()`` has the same).
        """
        lines = [f"jaxpar plan for `{self.function}` (target={self.target}, "
                 f"{self.num_eqns} equations)"]
        fallback = targets.fallback_note(self.target)
        if fallback is not None:
            lines.append(f"  {fallback}")
        if disabled_by_environment():
            lines.append(f"  {DISABLE_VARIABLE} is set: calls run plain jax.jit of the "
                         "function, not this plan (unset it to run the plan)")
        if not targets.get(self.target).emits_streams:
            how = ("target='auto' on this machine's backend"
                   if dict(self.options).get("target") == "auto" else f"target={self.target!r}")
            lines.append(
                f"  planned for {self.target} ({how}): streams exist only on GPUs, so nothing "
                f"is emitted; a section here is independent work the {self.target} cost model "
                "found, and its parts run one after another. For the GPU plan: "
                "jaxpar.inspect(f, target='gpu')(...)")
        figure = self.estimate
        if any(note.reason == REASON_SYMBOLIC for note in self.left_alone):
            lines.append("  no estimate: the program's sizes are symbolic")
        else:
            lines.append(f"  {figure.line()}")
        if self.tuning is not None and self.tuning.chosen:
            # What the device said of the same program, beside the model's word for it.
            lines.append(f"  {self.tuning.verdict()}")
        lines.extend(_mode_lines(self, verbose))
        if self.memory is not None:
            lines.append(f"  {self.memory.line()}")
            if verbose:
                lines.extend(f"    {item.line()}" for item in self.memory.left_out)
        lines.extend(f"  forced: the GPU pricing would not emit this section: {why}"
                     for why in figure.rejected)
        if verbose:
            lines.extend(f"    why: {section.verdict}" for section in self.sections
                         if section.verdict)
        report = _report_lines(self, verbose)
        lines += (report if targets.get(self.target).emits_streams
                  else _off_gpu_wording(report, self.target))
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


def _in(places: tuple[str, ...]) -> str:
    return f" in {place_list(places)}" if places else ""


def _places(places: tuple[str, ...], sources: tuple[str, ...]) -> str:
    """The places of a row for people: its ``places``, else its short source lines."""
    return place_list(places) if places else short_places(sources)


# Off a GPU a section is work that could run side by side, not streams: nothing is emitted.
_SECTION_LINE = re.compile(r"^(  section\b.*: )(\d+) concurrent regions$")
_STREAM_LINE = re.compile(r"^(    )stream (\d+): ")
# Only a GPU's loop control waits for the host (``make_loops_static.DYNAMIC_LOOP_HINTS``).
_HOST_SYNC_LINE = re.compile(r"^(    )host-sync loop\b")


def _off_gpu_wording(lines: list[str], target: str) -> list[str]:
    """``_report_lines`` for a target without streams: a section's regions are its
    independent parts, not streams (kept apart from ``_report_lines``, which words the
    GPU plan)."""
    worded = []
    for line in lines:
        line = _SECTION_LINE.sub(rf"\g<1>\g<2> independent parts (work that could run side "
                                 rf"by side; no streams on {target})", line)
        line = _HOST_SYNC_LINE.sub(rf"\g<1>{targets.get(target).words.dynamic_loop}", line)
        worded.append(_STREAM_LINE.sub(r"\g<1>part \g<2>: ", line))
    return worded


def _mode_lines(plan: Plan, verbose: bool) -> list[str]:
    """The XLA options line: in the short form only where jaxpar compiles the function
    with options of its own (a CUDA-graph mode other than the process's); the long form
    always, with the model's reasoning."""
    mode = plan.mode
    if mode is None:
        return []
    options = plan.xla_options
    shown = (", ".join(f"{k}={v!r}" for k, v in options.items()) if options
             else "none (the process's XLA_FLAGS)")
    if verbose:
        figure = plan.estimate
        return [f"  XLA options: {shown}: {mode.line(figure.plain_us, figure.jaxpar_us)}"]
    if not mode.chosen:
        return []
    why = mode.why or "as the command_buffers option says"
    return [f"  XLA options: {shown}: this function's CUDA graphs run in {mode.mode.value} "
            f"mode (the process's: {mode.user_mode.value}): {why}"]


def _report_lines(plan: Plan, verbose: bool) -> list[str]:
    """The report below the header: the rewrites of loops and members (with what was
    refused there), sections, collectives, what was left alone.

    Short (the default): one line per decision, naming where in the user's model it is
    and the figure that decided it. Verbose: each decision's full reasoning, cost figures
    and source lines.
    """
    left_out = plan.memory.left_out if plan.memory is not None else ()
    describe = decision_text if verbose else loop_line
    lines: list[str] = []
    for title, decisions, kinds in (
            ("loops", loop_decisions(plan.decisions), _LOOP_REFUSALS),
            ("subgraphs", subgraph_decisions(plan.decisions), _SUBGRAPH_REFUSALS)):
        refused = refused_in(left_out, kinds)
        if decisions or refused:
            lines.append(f"  {title}:")
            lines.extend(f"    {describe(d)}" for d in decisions)
            lines.extend(f"    {refused_line(d, item)}" for d, item in refused)
    lines += _section_lines(plan, verbose)
    if plan.collectives:
        lines.append("  collectives:")
        for c in plan.collectives:
            beside = ", ".join(f"{name} x{count}" for name, count in c.overlapped_by)
            lines.append(f"    {'grouped' if c.grouped else 'alone'}{_where(c.location)}: "
                         f"{' + '.join(c.primitives)} over {c.axis!r}"
                         + (f" ({c.directions})" if c.directions else "")
                         + (f", overlapped by [{beside}]" if beside and verbose else ""))
    if plan.left_alone and verbose:
        lines.append("  left alone:")
        for note in plan.left_alone:
            where = "; ".join(note.source_lines) or "<unknown>"
            lines.append(f"    {note.reason}{_where(note.location)} "
                         f"[{', '.join(note.primitives)}, est. {note.cost_us:.1f} us]: "
                         f"{note.detail} ({_in(note.places).strip()}{'; ' if note.places else ''}"
                         f"{where})")
    elif plan.left_alone:
        # Sizes JAX only knows symbolically leave the whole program alone: said in full.
        for note in plan.left_alone:
            if note.reason == REASON_SYMBOLIC:
                lines.append(f"  left alone: {note.reason}: {first_clause(note.detail)}")
        lines += left_alone_lines(plan.left_alone, dict(plan.options).get("min_cost_us"))
    if not verbose and (plan.decisions or plan.left_alone or left_out):
        lines.append("  (every reason in full: print(plan.text(verbose=True)), or "
                     "python -m jaxpar inspect --verbose)")
    return lines


def _section_lines(plan: Plan, verbose: bool) -> list[str]:
    """``_report_lines``' stream sections and their regions (and, where the memory budget
    left them out, why)."""
    lines = []
    refused = sections_left_out(plan.memory.left_out) if plan.memory is not None else None
    if not plan.sections:
        if refused is not None:
            lines.append(f"  streams: none: stream sections left out: {refused.why}")
        else:
            lines.append("  no parallel sections: nothing independent is worth a stream"
                         if verbose else
                         "  streams: none (nothing independent is worth a stream here)")
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
                             f"est. {region.cost_us:.1f} us [{prims}]{_in(region.places)} "
                             f"at {where}")
            else:
                prims = ", ".join(name for name, _ in region.primitives)
                lines.append(f"    stream {region.stream}: {prims} in "
                             f"{_places(region.places, region.source_lines)}, "
                             f"est. {region.cost_us:.1f} us")
    return lines


def _decision_dict(decision: PassDecision) -> dict[str, Any]:
    return {"location": decision.location, "kind": str(decision.kind.value),
            "pass": decision.pass_name, "eqns": list(decision.eqns),
            "primitives": list(decision.primitives), "sources": list(decision.sources),
            "trips_before": decision.trips_before, "trips_after": decision.trips_after,
            "unroll": decision.unroll, "reason": decision.reason,
            "members": [list(m) for m in decision.members], "depth": decision.depth,
            "stage": decision.depth,  # deprecated: "depth" (0.3.0 drops it)
            "saving_us": decision.saving_us, "places": list(decision.places)}
