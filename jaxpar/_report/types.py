"""The report's types: what a plan holds, below everything that builds or draws it.

``Region``, ``Section``, ``Collective``, ``LeftAlone`` and ``Step`` are the parts of a
plan; ``PlanEstimate`` is its one figure; ``PlanRecord`` holds a plan's fields (the
public ``jaxpar.Plan`` in ``plan.py`` adds the text, the pictures and the estimate).
Numbers and strings only, so a plan is cheap to keep, compare and serialise.

Example::

    plan = jaxpar.inspect(f, target="gpu")(x, y)
    [r.stream for s in plan.sections for r in s.regions]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from .._deprecations import warn_deprecated
from .._plan.budget import MemoryFigures
from .._plan.modes import ModeChoice
from .._tune import Tuning
from ..passes import SUBGRAPH_KINDS, PassDecision


@dataclasses.dataclass(frozen=True, slots=True)
class Region:
    """One annotated call: equations that run together on one stream."""

    stream: int
    num_eqns: int
    primitives: tuple[tuple[str, int], ...]
    cost_us: float
    source_lines: tuple[str, ...]
    eqn_indices: tuple[int, ...]
    # Where in the user's model its equations are (``_report.places``), heaviest first:
    # ``model.towers[1].linear1``, ``TwoTowers/query/dense0``, ``model.py:12``.
    places: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"stream": self.stream, "num_eqns": self.num_eqns,
                "primitives": [list(p) for p in self.primitives], "cost_us": self.cost_us,
                "source_lines": list(self.source_lines), "eqn_indices": list(self.eqn_indices),
                "places": list(self.places)}


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
        """The ``ppermute`` s' directions (empty when there is none: a ``psum``...)."""
        return directions_text(self.shifts, self.primitives)

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
    places: tuple[str, ...] = ()  # as ``Region.places``

    def to_dict(self) -> dict[str, Any]:
        return {"location": self.location, "reason": self.reason, "detail": self.detail,
                "primitives": list(self.primitives), "cost_us": self.cost_us,
                "source_lines": list(self.source_lines), "places": list(self.places)}


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One unit of a level's program in emission order: the timeline's building block.

    ``lane`` is ``"main"``, ``"stream K"`` or ``"collectives"``; ``kind`` is ``"main"``
    (a run of equations on the main stream), ``"loop"`` (one scan or while loop on the
    main stream; ``loop_rewrites`` holds the indices in ``Plan.decisions`` of what the
    passes did to it), ``"region"``
    (a stream region of ``Plan.sections[section]``) or ``"collectives"`` (a group
    launched together). ``after`` holds the indices in ``Plan.steps`` of the steps
    whose results it reads. ``batched_groups`` holds the indices in ``Plan.decisions``
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
class PlanEstimate:
    """One run of the program as ``jax.jit`` compiles it and as jaxpar does, in us.

    ``source`` says where the figures come from: jaxpar's planning model (a plan's one
    pair, ``Plan.estimate``) or a deviceless compile (``GpuPreview.compiled``).
    ``rejected`` sums up, per stream section the GPU pricing would not have emitted
    (``force_streams``), its gain and cost; the pricing's reasoning is
    ``Section.verdict``.
    """

    plain_us: float
    jaxpar_us: float
    source: str
    rejected: tuple[str, ...] = ()

    @property
    def ratio(self) -> float:
        """jaxpar's time over jax.jit's (< 1: jaxpar expected faster): 0 where jaxpar's is
        estimated at 0 us, ``inf`` where only jax.jit's is, 1 where both are."""
        if self.plain_us > 0:
            return max(self.jaxpar_us, 0.0) / self.plain_us
        return math.inf if self.jaxpar_us > 0 else 1.0

    @property
    def verdict(self) -> str:
        """``"3.20x faster than jax.jit"``, ``"1.12x slower than jax.jit"``, or ``"as
        fast as jax.jit"`` within half a percent; where one estimate is 0 us, which (no
        ratio of it is a figure worth printing)."""
        ratio = self.ratio
        if abs(ratio - 1.0) < 0.005:
            return "as fast as jax.jit"
        if ratio <= 0.0:
            return "faster than jax.jit (jaxpar's program is estimated at 0 us)"
        if math.isinf(ratio):
            return "slower than jax.jit (jax.jit's program is estimated at 0 us)"
        if ratio < 1.0:
            return f"{1.0 / ratio:.2f}x faster than jax.jit"
        return f"{ratio:.2f}x slower than jax.jit"

    def line(self) -> str:
        """``"1.20x faster than jax.jit (estimated): jax.jit 480.2 us -> jaxpar 400.4 us
        per run, from ..."``."""
        return (f"{self.verdict} (estimated): jax.jit {self.plain_us:,.1f} us -> jaxpar "
                f"{self.jaxpar_us:,.1f} us per run, from {self.source}")


@dataclasses.dataclass(frozen=True, slots=True)
class PlanRecord:
    """The fields of a ``Plan``: what the renderers and the timeline read.

    ``jaxpar.Plan`` adds the text, the pictures and the one estimate.

    ``decisions`` holds every decision of the passes, in the order they made them
    (``loops`` and ``subgraphs``, deprecated, split it by kind). ``steps`` is the
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
    decisions: tuple[PassDecision, ...] = ()
    collectives: tuple[Collective, ...] = ()
    steps: tuple[Step, ...] = ()
    # The cost model's time of the program as traced (jax.jit's), and the CUDA-graph mode
    # sections were priced in.
    plain_cost_us: float | None = None
    priced_in: str | None = None

    tuning: Tuning | None = None
    # The CUDA-graph mode the function is compiled in, and why (target "gpu" only).
    mode: ModeChoice | None = None
    # The memory model's temporary bytes of this plan against the plain program's, and
    # the rewrites left out to keep to the budget (``_plan.budget``).
    memory: MemoryFigures | None = None

    @property
    def xla_options(self) -> dict[str, str]:
        """The XLA ``compiler_options`` jaxpar compiles this function with: the CUDA-graph
        mode it chose (``{}``: the process's ``XLA_FLAGS`` apply unchanged)."""
        return self.mode.xla_options if self.mode is not None else {}

    @property
    def loops(self) -> tuple[PassDecision, ...]:
        """Deprecated: ``decisions`` but those of the subgraph kinds (``loop_decisions``)."""
        warn_deprecated("Plan.loops")
        return loop_decisions(self.decisions)

    @property
    def subgraphs(self) -> tuple[PassDecision, ...]:
        """Deprecated: ``decisions`` of the subgraph kinds (``subgraph_decisions``)."""
        warn_deprecated("Plan.subgraphs")
        return subgraph_decisions(self.decisions)

    @property
    def num_streams(self) -> int:
        """Distinct stream ids used anywhere in the program."""
        return len({r.stream for s in self.sections for r in s.regions})

    @property
    def num_regions(self) -> int:
        return sum(len(s.regions) for s in self.sections)


def loop_decisions(decisions: Sequence[PassDecision]) -> tuple[PassDecision, ...]:
    """The decisions not of a subgraph kind (``passes.SUBGRAPH_KINDS``): what the
    deprecated ``Plan.loops`` holds, and the report's ``loops:`` lines."""
    return tuple(d for d in decisions if d.kind not in SUBGRAPH_KINDS)


def subgraph_decisions(decisions: Sequence[PassDecision]) -> tuple[PassDecision, ...]:
    """The decisions of a subgraph kind: the deprecated ``Plan.subgraphs``, the report's
    ``subgraphs:`` lines."""
    return tuple(d for d in decisions if d.kind in SUBGRAPH_KINDS)



def directions_text(shifts: Any, primitives: Sequence[str]) -> str:
    """``(1, -1)`` -> ``"forward, backward"``; other shifts by value, None as general (a
    ``ppermute`` whose permutation is no ring shift). Only the ``ppermute`` s among
    ``primitives`` (one per shift) are named: a reduction or gather has no direction
    (empty when none is a ``ppermute``)."""
    def name(shift: int | None) -> str:
        if shift is None:
            return "general"
        return {1: "forward", -1: "backward"}.get(shift, f"shift {shift:+d}")

    return ", ".join(name(s) for s, p in zip(shifts, primitives, strict=True)
                     if p == "ppermute")
