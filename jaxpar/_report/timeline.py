"""The estimated timeline of a plan: when each step starts and ends, per level.

Steps laid out on their lanes in emission order (``Plan.steps``; a *timeline*, not
the compiled *schedule*, see docs/design.md's glossary): each step starts once the
steps it reads from have finished and its lane (the main stream, a stream, the
collectives) is free. Durations come from one function, ``step_duration_us``, which
reads the plan's costs (``jaxpar._model.cost``); a better device model plugs in
there, or is passed to ``lay_out`` as ``duration_us``.

Example::

    timeline = lay_out(plan)
    top = timeline.levels[0]
    top.makespan_us                     # == plan.estimate.jaxpar_us: the header's figure
    top.serial_us                       # one stream, at the same scale
    [(span.lane, span.start_us, span.duration_us) for span in top.spans]

``plan_estimate(plan)`` is the one figure a plan shows (its header, the picture's title
and ``gpu_preview``'s plan): jax.jit's program against jaxpar's, loop rewrites and the
GPU pricing's verdict on every stream section included, and where the figure comes from.

Sharp edges:
  * It is the cost model's picture, good for seeing what overlaps what; not a
    prediction of wall time. A nested level (a loop body with sections of its own)
    is one run of that body.
  * The top level's step times are scaled (``LevelTimeline.scale``) so it ends at the
    plan's estimate: the steps' own costs leave out launches, CUDA graphs and loop trips
    as XLA runs them, which the estimate counts; the proportions are the steps'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .types import PlanEstimate, PlanRecord, Step


def step_duration_us(plan: PlanRecord, step: Step) -> float:
    """The timeline's time source: the estimated device time of ``step``, in us."""
    del plan  # the plan's own estimates; a better model may need the whole plan
    return max(step.cost_us, 0.0)


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """``Plan.steps[step]`` placed in time."""

    step: int
    lane: str
    start_us: float
    duration_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


@dataclasses.dataclass(frozen=True, slots=True)
class LevelTimeline:
    """The spans of one level, with its serial time and critical path."""

    location: str
    lanes: tuple[str, ...]  # "main", "stream 1", ..., "collectives" when used
    spans: tuple[Span, ...]
    serial_us: float  # every step one after the other
    makespan_us: float  # with the streams: the critical path of the timeline
    # The factor the steps' times were scaled by to end at the plan's estimate (1: not).
    scale: float = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class Timeline:
    levels: tuple[LevelTimeline, ...]  # the top level first


def plan_estimate(plan: PlanRecord) -> PlanEstimate:
    """The plan's one estimate (see the module docstring).

    On a GPU, the figures the
    CUDA-graph mode was chosen by (``_plan.modes``): the rewritten program (loop and
    batching rewrites included: launches per trip, unrolled trips, graphs, stacking
    kernels) in jaxpar's mode against the traced one in the user's, each stream section
    at the GPU pricing's verdict. Otherwise (other targets), from the planner's cost
    model: jax.jit's program is the traced program's equations one after another;
    jaxpar's is the rewritten program's with each top-level stream section's overlap and
    cut cost as the pricing judged them, or the timeline's critical path; where nothing is
    emitted (``target="cpu"``/``"tpu"``), its equations one after another too.
    """
    rejected = tuple(
        f"{len(s.regions)} regions win est. {s.gain_us:.1f} us of overlap and the cut costs "
        f"est. {s.cut_cost_us or 0.0:.1f} us"
        for s in plan.sections if s.pays is False)
    mode = plan.mode
    seconds = mode.estimate(mode.mode) if mode is not None else None
    if mode is not None and seconds is not None and mode.plain_seconds:
        # On a GPU, the figure the CUDA-graph mode was chosen by (``_plan.modes``): the
        # rewritten program in jaxpar's mode against the plain one in the user's, loops
        # as XLA runs them (trips, unrolling, counter and slicing kernels, graphs).
        figures = ("figures calibrated on this GPU" if mode.measured
                   else "public figures, not measured on a GPU")
        graphs = (f"; jaxpar's program with CUDA graphs in {mode.mode.value} mode, "
                  f"jax.jit's in the process's {mode.user_mode.value}"
                  if mode.mode is not mode.user_mode else "")
        source = f"jaxpar's GPU planning model ({figures}{graphs}); not a compile or a run"
        return PlanEstimate(mode.plain_seconds * 1e6, seconds * 1e6, source, rejected)
    levels = lay_out(plan, fit=False).levels if plan.steps else ()
    serial = levels[0].serial_us if levels else plan.total_cost_us
    makespan = levels[0].makespan_us if levels else serial
    top = [s for s in plan.sections if s.location == "/"]
    priced = [s for s in top if s.gain_us is not None]
    if not plan.emitted:
        # Off a GPU nothing is emitted on a stream: the sections the planner drew do not
        # overlap, and the rewritten program runs its equations one after another.
        fast = serial
    elif top and len(priced) == len(top):
        fast = serial - sum(s.gain_us or 0.0 for s in priced) + sum(
            s.cut_cost_us or 0.0 for s in priced)
    else:
        fast = makespan + sum(s.cut_cost_us or 0.0 for s in priced)
    plain = serial if plan.plain_cost_us is None else plan.plain_cost_us
    source = ("jaxpar's GPU planning model; not a compile or a run" if plan.priced_in
              else f"jaxpar's {plan.target} cost model; not a compile or a run")
    return PlanEstimate(plain, fast, source, rejected)


def lay_out(plan: PlanRecord, duration_us: Callable[[PlanRecord, Step], float] = step_duration_us,
            fit: bool = True) -> Timeline:
    """Lays ``plan.steps`` out level by level (see the module docstring).

    ``fit``: the top level's times scaled so that it ends at the plan's one estimate
    (``plan_estimate(plan).jaxpar_us``), which also counts what its steps do not (launches,
    CUDA graphs, loop trips as XLA runs them, each section at its pricing's verdict): the
    picture's length is then the header's figure. Nested levels keep the steps' times.
    """
    timeline = _laid_out(plan, duration_us)
    if not fit or not timeline.levels or timeline.levels[0].location != "/":
        return timeline
    top = timeline.levels[0]
    target = plan_estimate(plan).jaxpar_us
    if top.makespan_us <= 0 or target <= 0:
        return timeline
    factor = target / top.makespan_us
    spans = tuple(dataclasses.replace(span, start_us=span.start_us * factor,
                                      duration_us=span.duration_us * factor)
                  for span in top.spans)
    scaled = dataclasses.replace(top, spans=spans, serial_us=top.serial_us * factor,
                                 makespan_us=target, scale=factor)
    return Timeline((scaled, *timeline.levels[1:]))


def _laid_out(plan: PlanRecord, duration_us: Callable[[PlanRecord, Step], float]) -> Timeline:
    """``lay_out`` with the steps' own times."""
    by_level: dict[str, list[int]] = {}
    for index, step in enumerate(plan.steps):
        by_level.setdefault(step.location, []).append(index)
    levels = []
    for location, indices in by_level.items():
        finish: dict[int, float] = {}
        lane_free: dict[str, float] = {}
        spans = []
        for index in indices:
            step = plan.steps[index]
            start = max([finish.get(k, 0.0) for k in step.after]
                        + [lane_free.get(step.lane, 0.0)])
            span = Span(index, step.lane, start, duration_us(plan, step))
            finish[index] = lane_free[step.lane] = span.end_us
            spans.append(span)
        used = {span.lane for span in spans}
        streams = sorted((lane for lane in used if lane.startswith("stream ")),
                         key=lambda lane: int(lane.split()[1]))
        lanes = ("main", *streams, *(("collectives",) if "collectives" in used else ()))
        levels.append(LevelTimeline(
            location, lanes, tuple(spans), serial_us=sum(s.duration_us for s in spans),
            makespan_us=max((s.end_us for s in spans), default=0.0)))
    return Timeline(tuple(levels))
