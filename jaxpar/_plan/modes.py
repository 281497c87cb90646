"""Stage 6 (target ``"gpu"``): the CUDA-graph mode a function is compiled in.

XLA:GPU runs captured kernels as CUDA graphs (command buffers). In its default ``LHS``
mode a graph is one serial chain; in ``CONCURRENT`` mode graph edges come from buffer
conflicts only, so independent kernels overlap (XLA_CONCURRENCY.md 1.3); with graphs
``OFF`` every kernel is launched alone, but stream regions holding loops keep their
overlap (1.5). Which is faster depends on the program, so XLA keeps ``LHS`` as the
process-wide default. jaxpar chooses per function: ``estimate_seconds`` prices a
planned program in a mode with the GPU model (``_gpu_model``, through the cost model),
and ``choose_mode`` keeps the fastest candidate if it beats the user's mode by
``MIN_GAIN``; the choice becomes that function's ``compiler_options``
(``_flags.command_buffer_options``).

The model of one jaxpr level, in a mode:

* every equation launching kernels is a node: its roofline work (flops at peak or bytes
  at bandwidth, whichever is longer), at least a kernel floor per kernel; the work of
  every node goes through the one device (overlap hides kernel floors, never work), as
  in ``jaxpar._compiled.estimate``, which judges the compiled program the same way;
* a loop (``scan``, ``while``) is never captured (WHILE is no default command type): it
  runs alone on the stream, its body priced per trip in the same mode (a body of at
  least ``MIN_GRAPH_SIZE`` kernels is one graph launch per trip); a ``cond`` costs its
  dearest branch; other calls their body;
* the other nodes of the level form one graph when there are at least
  ``MIN_GRAPH_SIZE`` of them and graphs are on (host: one graph launch plus a node
  each), else each is launched alone (host: ``launch_s`` each); in ``CONCURRENT`` mode a
  node starts when its inputs are ready, in the other modes after the one before;
* the regions of the stream sections the plan kept (priced in that mode by ``_plan.pricing``)
  are lanes of their own: a region's node waits only for its inputs and its lane, and
  each region costs the host a start and a done event (``event_s``).

Example::

    choice = choose_mode({mode: plan_in(mode) for mode in candidates}, user_mode, costs)
    choice.mode, choice.xla_options, choice.reason

Sharp edges:
  * A model of the compiled program before it is compiled: ``gpu_preview`` judges the
    compiled one (``_compiled.estimate``), and the first GPU run must confirm both.
  * ``CONCURRENT`` mode makes XLA give independent values distinct buffers: more
    memory (the proto's warning: "may lead to OOMs"). Not priced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .. import _compat
from .._cost import CostModel, known_while_trip_count
from .._flags import command_buffer_options
from .._gpu_model import MIN_GRAPH_SIZE, CommandBufferMode, GpuProfile
from .._primitives import COND, SCAN, WHILE
from .plans import LevelPlan

# The least estimated gain over the user's mode that makes jaxpar change it.
MIN_GAIN = 0.05

# The modes jaxpar chooses among besides the user's (SERIALIZE never beats LHS).
CANDIDATES = (CommandBufferMode.LHS, CommandBufferMode.CONCURRENT, CommandBufferMode.OFF)


@dataclasses.dataclass(frozen=True, slots=True)
class ModeChoice:
    """The CUDA-graph mode chosen for one function, and why.

    Attributes:
      mode: the mode the function is compiled in.
      user_mode: the mode the user's program runs in (the process's).
      estimates: estimated seconds per run in each mode considered, ``(mode, s)`` pairs,
        the user's first.
      chosen: whether jaxpar sets ``mode`` (False: the user's, or the option's, is kept).
      reason: one line for ``inspect`` and ``gpu_preview``.
      plain_seconds: the same model's estimate of the plain program (the function as
        traced, before jaxpar's rewrites) in the user's mode.
    """

    mode: CommandBufferMode
    user_mode: CommandBufferMode
    estimates: tuple[tuple[CommandBufferMode, float], ...]
    chosen: bool
    reason: str
    plain_seconds: float | None = None

    def against_plain(self) -> str:
        """``est. A us in <mode> mode against B us for the plain program in <user's> (xR)``."""
        seconds = self.estimate(self.mode)
        if seconds is None or not self.plain_seconds:
            return ""
        return (f"est. {seconds * 1e6:.1f} us in {self.mode.value} mode against "
                f"{self.plain_seconds * 1e6:.1f} us for the plain program in the user's "
                f"{self.user_mode.value} mode (x{seconds / self.plain_seconds:.3f})")

    @property
    def xla_options(self) -> dict[str, str]:
        """The ``compiler_options`` of the function's compile (empty: the process's)."""
        return command_buffer_options(self.mode) if self.chosen else {}

    def estimate(self, mode: CommandBufferMode) -> float | None:
        return dict(self.estimates).get(mode)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "user_mode": self.user_mode.value,
                "chosen": self.chosen, "xla_options": self.xla_options,
                "estimated_us": {m.value: s * 1e6 for m, s in self.estimates},
                "plain_estimated_us": (self.plain_seconds * 1e6
                                       if self.plain_seconds is not None else None),
                "reason": self.reason}


@dataclasses.dataclass(frozen=True, slots=True)
class _Span:
    """One level's (or one node's) time: on the device, on the host, and its work."""

    device: float
    host: float
    work: float
    kernels: float = 0.0  # launched outside loops (a call's count in its caller's graph)

    @property
    def seconds(self) -> float:
        return max(self.device, self.host)


class _Model:
    def __init__(self, costs: CostModel, mode: CommandBufferMode,
                 lanes: Mapping[int, int] | None = None):
        gpu = costs.profile.gpu
        if gpu is None:
            raise ValueError("the CUDA-graph mode is chosen for a GPU; the cost model is for "
                             f"{costs.profile.name!r}")
        self.gpu: GpuProfile = gpu
        self.costs = costs
        self.mode = mode
        # Top-level equation -> its stream region (a lane beside the main stream).
        self.lanes = dict(lanes or {})
        self._memo: dict[int, tuple[Any, _Span]] = {}

    def jaxpr(self, jaxpr: Any, top: bool = False) -> _Span:
        hit = self._memo.get(id(jaxpr))
        if hit is not None and hit[0] is jaxpr and not top:
            return hit[1]
        span = self._level(_compat.open_jaxpr(jaxpr)[0].eqns, self.lanes if top else {})
        self._memo[id(jaxpr)] = (jaxpr, span)
        return span

    def _alone(self, eqn: Any) -> _Span | None:
        """A loop or cond: runs outside any graph, with its own host cost inside."""
        name = eqn.primitive.name
        if name == SCAN:
            body = self.jaxpr(eqn.params["jaxpr"])
            trips = _compat.scan_length(eqn)
        elif name == WHILE:
            body = self.jaxpr(eqn.params["body_jaxpr"])
            condition = self.jaxpr(eqn.params["cond_jaxpr"])
            found = known_while_trip_count(eqn)
            trips = 1 if found is None else found
            if found is None:  # the predicate goes to the host every trip
                body = _Span(body.device + condition.device + self.gpu.sync_s,
                             body.host + condition.host + self.gpu.sync_s,
                             body.work + condition.work)
        elif name == COND:
            branches = [self.jaxpr(b) for b in eqn.params["branches"]]
            dearest = max(branches, key=lambda s: s.seconds, default=_Span(0.0, 0.0, 0.0))
            return _Span(dearest.seconds + self.gpu.sync_s, 0.0, dearest.work)
        else:
            return None
        return _Span(trips * body.seconds, 0.0, trips * body.work)

    def _node(self, eqn: Any) -> tuple[float, float, float] | None:
        """(duration, work, kernels) of a graph-capturable equation, None if it is free."""
        subs = [sub for _, _, sub in _compat.eqn_subjaxprs(eqn)]
        if subs:
            body = self.jaxpr(subs[0])
            return (body.device, body.work, body.kernels) if body.device > 0 else None
        cost = self.costs.eqn_cost(eqn)
        if cost.kernels <= 0:
            return None
        work = max(cost.flops / self.costs.profile.peak_flops, cost.bytes / self.gpu.bandwidth)
        return max(work, cost.kernels * self.gpu.kernel_floor_s), work, cost.kernels

    def _level(self, eqns: Any, lanes: Mapping[int, int]) -> _Span:
        concurrent = self.mode is CommandBufferMode.CONCURRENT
        ready: dict[Any, float] = {}
        lane_end: dict[int, float] = {}
        floor = end = device_free = work_total = alone_seconds = 0.0
        kernels = 0.0
        planned: list[tuple[Any, float, float, float, _Span | None]] = []
        for eqn in eqns:
            alone = self._alone(eqn)
            if alone is not None:
                planned.append((eqn, alone.seconds, alone.work, 0.0, alone))
                continue
            node = self._node(eqn)
            planned.append((eqn, *node, None) if node else (eqn, 0.0, 0.0, 0.0, None))
            if node:
                kernels += node[2]
        in_regions = sum(node[3] for index, node in enumerate(planned) if index in lanes)
        captured = kernels - in_regions
        graphs = self.mode is not CommandBufferMode.OFF and captured >= MIN_GRAPH_SIZE
        for index, (eqn, duration, work, _, alone) in enumerate(planned):
            inputs = max((ready.get(v, 0.0) for v in eqn.invars
                          if not _compat.is_literal(v)), default=0.0)
            lane = lanes.get(index)
            if lane is not None:  # in a stream region: after its inputs and its lane
                start = max(lane_end.get(lane, 0.0), inputs)
                begin_work = max(start, device_free)
                device_free = begin_work + work
                finish = lane_end[lane] = max(start + duration, begin_work + work)
                if alone is not None:
                    alone_seconds += duration
            elif alone is not None:  # on the stream after everything before it
                start = max(end, inputs)
                finish = floor = start + duration
                device_free = max(device_free, finish)
                alone_seconds += duration
            elif duration > 0:
                start = max(floor, inputs) if concurrent and graphs else max(end, inputs)
                begin_work = max(start, device_free)
                device_free = begin_work + work
                finish = max(start + duration, begin_work + work)
            else:
                finish = inputs
            work_total += work
            end = max(end, finish)
            for v in eqn.outvars:
                ready[v] = finish
        # A region's kernels are launched one by one (captured ones are refused by the
        # pricing in the graph modes); each region adds a start and a done event.
        host = self.gpu.launch_s * in_regions + 2 * self.gpu.event_s * len(set(lanes.values()))
        if graphs:
            host += self.gpu.graph_launch_s + self.gpu.graph_node_s * captured
        else:
            host += self.gpu.launch_s * captured
        return _Span(end, host + alone_seconds, work_total, kernels)


def estimate_plain_seconds(jaxpr: Any, costs: CostModel, mode: CommandBufferMode) -> float:
    """Estimated seconds per run of ``jaxpr`` as ``jax.jit`` compiles it, in ``mode``."""
    return _Model(costs, mode).jaxpr(jaxpr, top=True).seconds


def estimate_seconds(plan: LevelPlan, costs: CostModel, mode: CommandBufferMode) -> float:
    """Estimated seconds per run of ``plan``'s program compiled in ``mode``."""
    lanes = {i: (s, r) for s, section in enumerate(plan.sections)
             for r, region in enumerate(section.regions) for i in region.eqns}
    numbered = {key: n for n, key in enumerate(dict.fromkeys(lanes.values()))}
    model = _Model(costs, mode, {i: numbered[key] for i, key in lanes.items()})
    return model.jaxpr(plan.jaxpr, top=True).seconds


def choose_mode(estimates: Mapping[CommandBufferMode, float], user_mode: CommandBufferMode
                ) -> ModeChoice:
    """The fastest mode of ``estimates`` if it beats ``user_mode``'s by ``MIN_GAIN``."""
    base = estimates[user_mode]
    ordered = ((user_mode, base), *((m, s) for m, s in estimates.items() if m is not user_mode))
    best, best_seconds = min(ordered, key=lambda pair: pair[1])
    if best is user_mode or base <= 0 or best_seconds > base * (1 - MIN_GAIN):
        gain = (1 - best_seconds / base) * 100 if base > 0 else 0.0
        reason = (f"kept the process's {user_mode.value} mode: no mode is estimated "
                  f"{MIN_GAIN:.0%} faster (best {best.value}, {gain:.1f}%)")
        return ModeChoice(user_mode, user_mode, ordered, False, reason)
    why = ("its independent kernels run as parallel CUDA-graph nodes"
           if best is CommandBufferMode.CONCURRENT else
           "its stream regions hold loops, which keep their overlap outside graphs"
           if best is CommandBufferMode.OFF else "its graphs run as one chain")
    reason = (f"compiled in {best.value} mode: {why}; est. {best_seconds * 1e6:.1f} us "
              f"against {base * 1e6:.1f} us in the process's {user_mode.value} mode "
              f"(x{best_seconds / base:.3f})")
    return ModeChoice(best, user_mode, ordered, True, reason)


def kept_mode(mode: CommandBufferMode, user_mode: CommandBufferMode | None,
              explicit: bool, seconds: float | None = None) -> ModeChoice:
    """No choice: the option's ``mode`` (``explicit``) or the process's; ``seconds`` its
    estimate."""
    user = user_mode or mode
    reason = (f"compiled in {mode.value} mode, as the command_buffers option says"
              if explicit else f"kept the process's {mode.value} mode (set in XLA_FLAGS, or "
              "command_buffers='keep')")
    return ModeChoice(mode, user, ((mode, seconds),) if seconds is not None else (),
                      explicit, reason)
