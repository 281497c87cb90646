"""The estimated timeline of a plan: when each step starts and ends, per level.

A list schedule over ``Plan.steps``: in emission order, each step starts once the
steps it reads from have finished and its lane (the main stream, a stream, the
collectives) is free. Durations come from one function, ``step_duration_us``, which
reads the plan's cost estimates (``jaxpar._cost``); a better device estimate plugs in
there, or is passed to ``estimate`` as ``duration_us``.

Example::

    timeline = estimate(plan)
    top = timeline.levels[0]
    top.serial_us, top.makespan_us      # one stream vs. the critical path
    [(span.lane, span.start_us, span.duration_us) for span in top.spans]

Sharp edges:
  * It is the cost model's picture, good for seeing what overlaps what; not a
    prediction of wall time. A nested level (a loop body with sections of its own)
    is one run of that body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._inspect import Plan, Step


def step_duration_us(plan: Plan, step: Step) -> float:
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
    makespan_us: float  # with the streams: the critical path of the schedule


@dataclasses.dataclass(frozen=True, slots=True)
class Timeline:
    levels: tuple[LevelTimeline, ...]  # the top level first


def estimate(plan: Plan, duration_us: Callable[[Plan, Step], float] = step_duration_us
             ) -> Timeline:
    """Schedules ``plan.steps`` level by level (see the module docstring)."""
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
