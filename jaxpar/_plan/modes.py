"""Pipeline stage 4 (``_pipeline``, target ``"gpu"``): the CUDA-graph mode a function is
compiled in.

XLA:GPU runs captured kernels as CUDA graphs (command buffers). In its default ``LHS``
mode a graph is one serial chain; in ``CONCURRENT_REGIONS`` mode runs of small,
latency-bound kernels are parallel graph nodes (dots, convolutions and library calls
stay serial); in ``CONCURRENT`` mode every independent kernel is; with graphs ``OFF``
every kernel is launched alone, but stream regions holding loops keep their overlap.
Which is faster depends on the program, so XLA keeps ``LHS`` as the process-wide
default. jaxpar may choose per function: ``estimate_seconds`` prices a planned program
in a mode with the GPU model (``_gpu_model``, through the cost model), and
``choose_mode`` keeps a candidate only if it beats the user's mode by ``MIN_GAIN`` at
the nominal figures **and** at the end of every uncertain figure's range that favours
the user's mode (``pessimistic``), and if its temporary memory stays within the
budget (``_memory``, ``_plan.budget``); the choice becomes that function's
``compiler_options`` (``_flags.command_buffer_options``).

The GPU's host-side figures and kernel floors are third-party measurements, none on a
Hopper GPU by this project (``docs/gpu_evidence.md``), so with the built-in figures the
pessimistic end decides: a branching graph's host cost per node (up to 1 us) is then more
than the floor it hides (down to 0.6 us), and no mode change pays. A calibration measured
on the GPU (``benchmarks/calibrate.py``) narrows the ranges. (``tune=True`` times the
plan's choice against the process's mode, not other modes.)

The model of one jaxpr level, in a mode:

* every equation launching kernels is a node: its roofline work (flops at peak or bytes
  at bandwidth, whichever is longer), at least a kernel floor per kernel (a graph's
  ``graph_floor_s`` inside a CUDA graph, ``kernel_floor_s`` launched alone); the work of
  every node goes through the one device (overlap hides kernel floors, never work), as
  in ``jaxpar._compiled.estimate``, which judges the compiled program the same way;
* a loop (``scan``, ``while``) is never captured (WHILE is no default command type): it
  runs alone on the stream, its body priced per trip in the same mode (a body of at
  least ``MIN_GRAPH_SIZE`` kernels is one graph launch per trip); a ``scan`` runs as XLA
  runs it: ``length // unroll`` trips of ``unroll`` bodies, each trip with one kernel
  bumping the counter, one slicing each distinct scanned input and one writing each
  stacked result (for the trip's bodies at once), then the left-over bodies once (so
  fusing scans and unrolling them save kernels and launches here, as in the compiled
  program); a ``cond`` costs its dearest branch; other calls
  their body;
* the other nodes of the level form one graph when at least ``MIN_GRAPH_SIZE`` of their
  kernels are ones XLA cannot fuse away (not ``_primitives.MAY_FUSE_AWAY``: a
  concatenate may join a GEMM's prologue) and graphs are on (host: one graph launch plus
  a node each, ``GpuProfile.node_s``: about nothing for a chain, up to a microsecond for
  a branching graph), else each is launched alone (host: ``launch_s`` each); in the
  branching modes a small node starts when its inputs are ready, at most
  ``hardware_queues`` at once, while a dot, a convolution, a library call or a
  collective (``_memory.SERIAL``) starts after everything before it and holds back
  everything after it (they fill the GPU: XLA's own ``CONCURRENT_REGIONS`` rule, with
  no public evidence that overlapping them pays); in the other modes a node starts after
  the one before;
* the regions of the stream sections the plan kept (priced in that mode by ``_plan.pricing``)
  are lanes of their own: a region's node waits only for its inputs and its lane, and
  each region costs the host a start and a done event (``event_s``); a section the
  pricing would not emit (``force_streams``) is taken at its verdict: its regions on the
  main stream, plus its cut's cost;
* one run of the program: its first kernel waits for its launch (a graph's, when the top
  level is one graph), then the longer of the device's and the host's time.

In this model ``CONCURRENT`` is never faster than ``CONCURRENT_REGIONS`` (both overlap
only small kernels) and needs more memory, so jaxpar's candidates are ``LHS``,
``CONCURRENT_REGIONS`` and, for plans whose stream regions hold loops, ``OFF``;
``command_buffers="concurrent"`` compiles a function in ``CONCURRENT`` all the same.

Example::

    choice = choose_mode(estimates, user_mode, corners)
    choice.mode, choice.xla_options, choice.reason

Sharp edges:
  * A model of the compiled program before it is compiled: ``gpu_preview`` judges the
    compiled one (``_compiled.estimate``), and the first GPU run must confirm both. It does not
    know which elementwise work XLA cannot fuse into a neighbour (a relu after a cuDNN
    convolution is a kernel of its own), so it counts fewer kernels than XLA launches
    there, nor how long a kernel that under-fills the GPU runs (its roofline is a lower
    bound): the gain of overlapping such kernels, the evidence's best case, is beyond it.
  * Graphs ``OFF`` is a candidate only for a plan whose stream regions hold loops (their
    overlap survives only outside graphs).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _compat
from .._compat import JaxprEqn, JaxprLike
from .._cost import CostModel, known_while_trip_count
from .._flags import command_buffer_options
from .._gpu_model import MIN_GRAPH_SIZE, CommandBufferMode, GpuProfile
from .._memo import IdentityMemo
from .._primitives import COND, MAY_FUSE_AWAY, MAY_HOLD_LOOPS, SCAN, SERIAL_KERNELS, WHILE
from .plans import LevelPlan

# The least estimated gain over the user's mode that makes jaxpar change it, at the
# nominal figures and at the pessimistic end of every uncertain figure's range.
MIN_GAIN = 0.05

# The modes jaxpar chooses among besides the user's (SERIALIZE never beats LHS, and
# CONCURRENT never beats CONCURRENT_REGIONS in this model: see the module docstring).
CANDIDATES = (CommandBufferMode.LHS, CommandBufferMode.CONCURRENT_REGIONS,
              CommandBufferMode.OFF)

# Each uncertain figure (``GpuProfile.ranges``) at the end that favours a serial-graph
# mode (XLA's default LHS) over the candidate, and so makes the candidate's gain the
# least. A figure that costs the same in both modes sits at its high end: it adds to both
# estimates alike and so brings their ratio nearest to one.
_BRANCHING_AGAINST = {
    "graph_floor_s": "low",  # the floor a branching graph hides
    "dag_node_s": "high", "chain_node_s": "low",  # its host cost per node, and LHS's
    "launch_s": "high", "graph_launch_s": "high", "kernel_floor_s": "high",
    "sync_s": "high", "event_s": "high",
}
PESSIMISTIC: Mapping[CommandBufferMode, Mapping[str, str]] = {
    CommandBufferMode.CONCURRENT: _BRANCHING_AGAINST,
    CommandBufferMode.CONCURRENT_REGIONS: _BRANCHING_AGAINST,
    # Graphs off: every kernel launched alone, against a chain graph.
    CommandBufferMode.OFF: {
        "launch_s": "high", "kernel_floor_s": "high", "graph_floor_s": "low",
        "graph_launch_s": "low", "chain_node_s": "low", "dag_node_s": "low",
        "sync_s": "high", "event_s": "high"},
}


def pessimistic(gpu: GpuProfile, candidate: CommandBufferMode) -> GpuProfile:
    """``gpu`` with every uncertain figure at the end that favours XLA's default mode over
    ``candidate`` (the candidate's gain is then the least)."""
    ends = PESSIMISTIC.get(candidate, {})
    return gpu.at({f: e for f, e in ends.items() if f in dict.fromkeys(
        name for name, _, _ in gpu.ranges)})


def optimistic(gpu: GpuProfile, candidate: CommandBufferMode) -> GpuProfile:
    """``gpu`` with every uncertain figure at the other end (the candidate's gain most)."""
    ends = PESSIMISTIC.get(candidate, {})
    flip = {"low": "high", "high": "low"}
    return gpu.at({f: flip[e] for f, e in ends.items() if f in dict.fromkeys(
        name for name, _, _ in gpu.ranges)})


@dataclasses.dataclass(frozen=True, slots=True)
class ModeEnds:
    """One candidate mode's estimate against the user's mode at both ends of the GPU
    model's ranges: ``pessimistic`` (every uncertain figure where it favours the user's
    mode) and ``optimistic``; each a ``(candidate seconds, user's mode seconds)`` pair."""

    mode: CommandBufferMode
    pessimistic: tuple[float, float]
    optimistic: tuple[float, float]

    @staticmethod
    def _ratio(pair: tuple[float, float]) -> float:
        return pair[0] / pair[1] if pair[1] > 0 else 1.0

    @property
    def pessimistic_ratio(self) -> float:
        return self._ratio(self.pessimistic)

    @property
    def optimistic_ratio(self) -> float:
        return self._ratio(self.optimistic)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode.value,
                "pessimistic_us": [s * 1e6 for s in self.pessimistic],
                "optimistic_us": [s * 1e6 for s in self.optimistic],
                "pessimistic_ratio": self.pessimistic_ratio,
                "optimistic_ratio": self.optimistic_ratio}


@dataclasses.dataclass(frozen=True, slots=True)
class ModeChoice:
    """The CUDA-graph mode chosen for one function, and why.

    Attributes:
      mode: the mode the function is compiled in.
      user_mode: the mode the user's program runs in (the process's).
      estimates: estimated seconds per run in each mode considered, ``(mode, s)`` pairs,
        the user's first (the GPU model's nominal figures).
      chosen: whether jaxpar sets ``mode`` (False: the user's, or the option's, is kept).
      reason: one line for ``inspect`` and ``gpu_preview``.
      plain_seconds: the same model's estimate of the plain program (the function as
        traced, before jaxpar's rewrites) in the user's mode.
      ends: each candidate's estimate against the user's mode at both ends of the
        model's ranges (``ModeEnds``).
      measured: whether the GPU's figures were measured on it (a calibration profile);
        False: every choice is "estimated, not measured on a GPU".
    """

    mode: CommandBufferMode
    user_mode: CommandBufferMode
    estimates: tuple[tuple[CommandBufferMode, float], ...]
    chosen: bool
    reason: str
    plain_seconds: float | None = None
    ends: tuple[ModeEnds, ...] = ()
    measured: bool = False
    why: str = ""  # a chosen mode: what it does for this program, without figures

    def line(self, plain_us: float, jaxpar_us: float) -> str:
        """The reason with the plan's one pair of figures (``Plan.estimate``): for a chosen
        mode, jaxpar's time against jax.jit's (not against jaxpar's program in the user's
        mode, which ``reason`` compares, and which follows in brackets); else ``reason``."""
        base = self.estimate(self.user_mode)
        if not (self.chosen and self.why and plain_us > 0):
            return self.reason
        found = self.ends_of(self.mode)
        own = (f"; jaxpar's program in the process's {self.user_mode.value} mode "
               f"{base * 1e6:.1f} us" if base is not None else "")
        if found is not None:
            own += (f", x{found.pessimistic_ratio:.3f} to x{found.optimistic_ratio:.3f} of "
                    "it over the model's ranges")
        label = "" if self.measured else "; estimated, not measured on a GPU"
        return (f"compiled in {self.mode.value} mode: {self.why}; est. jax.jit "
                f"{plain_us:,.1f} us -> jaxpar {jaxpar_us:,.1f} us "
                f"(x{jaxpar_us / plain_us:.3f}, the plan's estimate{own}){label}")

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

    def ends_of(self, mode: CommandBufferMode) -> ModeEnds | None:
        return next((e for e in self.ends if e.mode is mode), None)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "user_mode": self.user_mode.value,
                "chosen": self.chosen, "xla_options": self.xla_options,
                "estimated_us": {m.value: s * 1e6 for m, s in self.estimates},
                "plain_estimated_us": (self.plain_seconds * 1e6
                                       if self.plain_seconds is not None else None),
                "ends": [e.to_dict() for e in self.ends], "measured": self.measured,
                "reason": self.reason}


@dataclasses.dataclass(frozen=True, slots=True)
class _Span:
    """One level's (or one node's) time: on the device, on the host, and its work."""

    device: float
    host: float
    work: float
    kernels: float = 0.0  # launched outside loops (a call's count in its caller's graph)
    captured: float = 0.0  # of those, the ones a CUDA graph may capture (not in regions)
    alone: float = 0.0  # seconds of loops and conds in the level, run outside graphs
    lead: float = 0.0  # host time before the first kernel can start (its launch, a graph's)
    sure: float = 0.0  # of the captured ones, those XLA cannot fuse away (``MAY_FUSE_AWAY``)
    serial: bool = False  # holds a kernel that fills the GPU, or a loop or cond

    @property
    def seconds(self) -> float:
        return max(self.device, self.host)

    @property
    def run_seconds(self) -> float:
        """One run of a level on its own: its kernels wait for their first launch. (A
        loop's trips overlap one trip's launch with the trip before: ``seconds``.)"""
        return max(self.device + self.lead, self.host)


# The primitives ``_Model._alone`` runs outside graphs.
_ALONE = frozenset((SCAN, WHILE, COND))

# One equation of a level as the model sees it, the same in every mode and at every end
# of the figures: (equation, work, kernels, sure kernels, serial, its span if it runs
# alone outside graphs, a call's device time); see ``_Model._entry``.
_Entry = tuple[JaxprEqn, float, float, float, bool, "_Span | None", float]


class _Model:
    def __init__(self, costs: CostModel, mode: CommandBufferMode,
                 lanes: Mapping[int, int] | None = None,
                 memo: IdentityMemo[Any, Any] | None = None,
                 gpu: GpuProfile | None = None):
        profile_gpu = costs.profile.gpu
        if profile_gpu is None:
            raise ValueError("the CUDA-graph mode is chosen for a GPU; the cost model is for "
                             f"{costs.profile.name!r}")
        # ``gpu``: the figures at one end of their ranges (default the cost model's own).
        self.gpu: GpuProfile = profile_gpu if gpu is None else gpu
        self.costs = costs
        self.mode = mode
        # Top-level equation -> its stream region (a lane beside the main stream).
        self.lanes = dict(lanes or {})
        # Shared by the estimates of one call (``memo``): a nested level's span by its
        # jaxpr, the mode and the figures, and an equation's ``_Entry`` where it is the
        # same in every mode and at every end.
        self._memo: IdentityMemo[Any, Any] = IdentityMemo() if memo is None else memo

    def jaxpr(self, jaxpr: JaxprLike, top: bool = False, graphs: bool | None = None
              ) -> _Span:
        """The span of a level; ``graphs``: whether it runs in a CUDA graph (a loop body
        repeated by unrolling may, where it alone would not), default as it would alone."""
        if top:  # its lanes are the plan's: never remembered
            return self._level(_compat.open_jaxpr(jaxpr)[0].eqns, self.lanes)
        return self._memo.lookup(  # type: ignore[no-any-return]
            jaxpr, lambda: self._level(_compat.open_jaxpr(jaxpr)[0].eqns, {}, graphs),
            extra=(self.mode, self.gpu, graphs))

    def _alone(self, eqn: JaxprEqn) -> _Span | None:
        """A loop or cond: runs outside any graph, with its own host cost inside."""
        name = eqn.primitive.name
        if name == SCAN:
            return self._scan(eqn)
        if name == WHILE:
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

    def _scan(self, eqn: JaxprEqn) -> _Span:
        """A scan as XLA runs it: ``length // unroll`` trips of ``unroll`` bodies, each trip
        also bumping the counter, slicing every distinct scanned input a kernel reads and
        writing every stacked result (one kernel each, for the trip's bodies at once),
        then the ``length % unroll`` left-over bodies once."""
        info = _compat.scan_info(eqn)
        body = self.jaxpr(info.jaxpr)
        unroll = max(1, min(info.unroll, info.length))
        trips, left = divmod(info.length, unroll)
        if trips <= 1 and not left:  # one trip: XLA inlines the loop into its caller
            return self._repeated(info.jaxpr, body, info.length, 0.0)
        # JAX slices a trip's ``unroll`` bodies' inputs at once, and writes their stacked
        # results at once.
        per_trip = self._repeated(info.jaxpr, body, unroll,
                                  self.costs.scan_trip_kernels(eqn))
        rest = (self._repeated(info.jaxpr, body, left, 0.0) if left
                else _Span(0.0, 0.0, 0.0))
        return _Span(trips * per_trip.seconds + rest.seconds, 0.0,
                     trips * per_trip.work + rest.work)

    def _repeated(self, jaxpr: JaxprLike, body: _Span, times: int, extra_kernels: float
                  ) -> _Span:
        """``times`` copies of the level ``jaxpr`` (span ``body`` alone) one after the
        other, plus ``extra_kernels`` tiny kernels, as one launch sequence: one graph if
        they are enough to form one (its kernels then at a graph's floor)."""
        captured = body.captured * times + extra_kernels
        sure = body.sure * times + extra_kernels
        graphs = self.mode is not CommandBufferMode.OFF and sure >= MIN_GRAPH_SIZE
        if graphs != (self.mode is not CommandBufferMode.OFF and body.sure >= MIN_GRAPH_SIZE):
            body = self.jaxpr(jaxpr, graphs=graphs)
        host = (self.gpu.graph_launch_s + self.gpu.node_s(self.mode) * captured if graphs
                else self.gpu.launch_s * captured)
        host += body.alone * times  # a body's level has no stream regions
        return _Span(body.device * times + extra_kernels * self.gpu.floor_s(graphs),
                     host, body.work * times, body.kernels * times + extra_kernels,
                     captured, body.alone * times, sure=sure)

    def _entry(self, eqn: JaxprEqn) -> _Entry:
        """``eqn``'s ``_Entry``: a loop or cond (``alone``, for this mode and these
        figures), a call (its body's device time), or a kernel of its own, the same in
        every mode and at every end (remembered in the memo); zeros for a free
        equation."""
        if eqn.primitive.name in _ALONE:
            alone = self._alone(eqn)
            if alone is not None:
                return eqn, alone.work, 0.0, 0.0, True, alone, alone.seconds
        subs = self.costs.subjaxprs(eqn)
        if subs:
            # A call: XLA inlines its body into the caller, whose graph and floor its
            # kernels then share; a node of that many kernels, which runs beside others
            # like it unless it holds one that fills the GPU.
            body = self.jaxpr(subs[0][2])
            if body.alone > 0:  # it holds a loop or a cond: timed as it runs
                return eqn, body.work, body.kernels, body.sure, True, None, body.device
            return eqn, body.work, body.kernels, body.sure, body.serial, None, 0.0
        cost = self.costs.eqn_cost(eqn)
        if cost.kernels <= 0:
            entry: _Entry = (eqn, 0.0, 0.0, 0.0, False, None, 0.0)
        else:
            work = max(cost.flops / self.costs.profile.peak_flops,
                       cost.bytes / self.gpu.bandwidth)
            sure = 0.0 if eqn.primitive.name in MAY_FUSE_AWAY else cost.kernels
            entry = (eqn, work, cost.kernels, sure, eqn.primitive.name in SERIAL_KERNELS,
                     None, 0.0)
        self._memo.set(eqn, entry)
        return entry

    def _level(self, eqns: Sequence[JaxprEqn], lanes: Mapping[int, int],
               in_graph: bool | None = None) -> _Span:
        remembered = self._memo.get
        planned = [remembered(eqn) or self._entry(eqn) for eqn in eqns]
        # Free and alone entries add zeros: the sums are those of the capturable nodes.
        kernels = sum(entry[2] for entry in planned)
        sure = sum(entry[3] for entry in planned)
        in_lanes = [index for index in sorted(lanes) if index < len(planned)]
        in_regions = sum(planned[index][2] for index in in_lanes)
        sure_captured = sure - sum(planned[index][3] for index in in_lanes)
        captured = kernels - in_regions
        # A graph only where XLA surely captures MIN_GRAPH_SIZE kernels: the kernels it
        # may fuse away (a concatenate into a GEMM's prologue) do not make one, so no mode
        # is chosen for a graph the compiled program does not have (three matmuls of
        # rolled operands: 6 kernels here, 3 launches once compiled).
        graphs = self.mode is not CommandBufferMode.OFF and sure_captured >= MIN_GRAPH_SIZE
        timed = graphs if in_graph is None else in_graph
        end, alone_seconds, work_total = _timeline(self.gpu, planned, lanes, timed,
                                                   timed and self.mode.branching)
        # A region's kernels are launched one by one (captured ones are refused by the
        # pricing in the graph modes); each region adds a start and a done event.
        host = self.gpu.launch_s * in_regions + 2 * self.gpu.event_s * len(set(lanes.values()))
        if graphs:
            lead = self.gpu.graph_launch_s + self.gpu.node_s(self.mode) * captured
            host += lead
        else:
            lead = self.gpu.launch_s if captured > 0 else 0.0
            host += self.gpu.launch_s * captured
        serial = any(entry[4] for entry in planned)
        return _Span(end, host + alone_seconds, work_total, kernels, captured, alone_seconds,
                     lead, sure_captured, serial)

def _timeline(gpu: GpuProfile, planned: Sequence[_Entry], lanes: Mapping[int, int],
              graphs: bool, branching: bool) -> tuple[float, float, float]:
    """When the level's last node finishes on the device, the seconds of its loops
    and conds, and its work: nodes in order, each after its inputs and (serial modes,
    serial kernels) everything before it."""
    floor_each = gpu.floor_s(graphs)
    queues = max(1, gpu.hardware_queues)
    ready: dict[Any, float] = {}
    lane_end: dict[int, float] = {}
    barrier = end = device_free = work_total = alone_seconds = 0.0
    in_flight: list[float] = []  # finish times of the small nodes running beside others
    literal = _compat.Literal
    ready_get = ready.get
    for index, (eqn, work, kernels, _, serial, alone, device) in enumerate(planned):
        duration = device if (alone is not None or device) else max(
            work, kernels * floor_each)
        inputs = 0.0  # finish times are never negative
        for v in eqn.invars:
            if not isinstance(v, literal):
                at = ready_get(v)
                if at is not None and at > inputs:
                    inputs = at
        lane = lanes.get(index) if lanes else None
        if lane is not None:  # in a stream region: after its inputs and its lane
            start = max(lane_end.get(lane, 0.0), inputs)
            begin_work = max(start, device_free)
            device_free = begin_work + work
            finish = lane_end[lane] = max(start + duration, begin_work + work)
            if alone is not None:
                alone_seconds += duration
        elif alone is not None:  # on the stream after everything before it
            start = max(end, inputs)
            finish = barrier = start + duration
            device_free = max(device_free, finish)
            alone_seconds += duration
        elif duration > 0:
            if branching and not serial:
                start = max(barrier, inputs)
                while in_flight and in_flight[0] <= start:
                    heapq.heappop(in_flight)
                if len(in_flight) >= queues:  # every hardware queue busy
                    start = max(start, heapq.heappop(in_flight))
            else:  # a serial mode, or a kernel that fills the GPU
                start = max(end, inputs)
            begin_work = max(start, device_free)
            device_free = begin_work + work
            finish = max(start + duration, begin_work + work)
            if branching and not serial:
                heapq.heappush(in_flight, finish)
            else:
                barrier = finish
                in_flight.clear()
        else:
            finish = inputs
        work_total += work
        if finish > end:
            end = finish
        for v in eqn.outvars:
            ready[v] = finish
    return end, alone_seconds, work_total


def estimate_plain_seconds(jaxpr: JaxprLike, costs: CostModel, mode: CommandBufferMode,
                           memo: IdentityMemo[Any, Any] | None = None,
                           gpu: GpuProfile | None = None) -> float:
    """Estimated seconds per run of ``jaxpr`` as ``jax.jit`` compiles it, in ``mode``
    (``memo``: as for ``estimate_seconds``; ``gpu``: the figures, default the cost
    model's)."""
    return _Model(costs, mode, memo=memo, gpu=gpu).jaxpr(jaxpr, top=True).run_seconds


def estimate_seconds(plan: LevelPlan, costs: CostModel, mode: CommandBufferMode,
                     memo: IdentityMemo[Any, Any] | None = None,
                     gpu: GpuProfile | None = None) -> float:
    """Estimated seconds per run of ``plan``'s program compiled in ``mode``.

    A section the GPU pricing would not emit (kept by ``force_streams``) is taken at its
    verdict: its regions run as if on the main stream, plus the cost of its cut.
    ``memo``, one per call, shared by the estimates of its plans in every mode and of the
    plain program (``Analysis.shared_memo``), remembers what they share: each
    equation's kernel time and work, and each nested level's span in each mode. It must
    be used with one cost model only. ``gpu``: the GPU's figures, default the cost
    model's (``pessimistic`` and ``optimistic`` give the ends of their ranges).
    """
    lanes = {i: (s, r) for s, section in enumerate(plan.sections) if section.pays is not False
             for r, region in enumerate(section.regions) for i in region.eqns}
    numbered = {key: n for n, key in enumerate(dict.fromkeys(lanes.values()))}
    model = _Model(costs, mode, {i: numbered[key] for i, key in lanes.items()}, memo, gpu)
    forced = sum(section.cost_seconds or 0.0 for section in plan.sections
                 if section.pays is False)
    return model.jaxpr(plan.jaxpr, top=True).run_seconds + forced - _grouped_seconds(
        plan, model.gpu)


def _grouped_seconds(plan: LevelPlan, gpu: GpuProfile) -> float:
    """What launching each collectives group as one NCCL group saves: its members are
    launched once (one call, not one launch each), as the compiled schedule counts them.
    (Their transfers side by side are not credited: the model does not serialise
    collectives in jax.jit's program either.) Each level counts once (a group in a loop
    body, once a run, not once a trip)."""
    return sum(gpu.launch_s * (len(group.eqns) - 1) for level in plan.walk()
               for group in level.collective_groups)


def regions_hold_loops(plan: LevelPlan) -> bool:
    """Whether a stream region ``plan`` emits holds a loop (directly or in a call): only
    then may graphs ``OFF`` pay (see the module's sharp edges)."""
    eqns = _compat.open_jaxpr(plan.jaxpr)[0].eqns
    return any(eqns[i].primitive.name in MAY_HOLD_LOOPS for section in plan.sections
               if section.pays is not False for region in section.regions for i in region.eqns)


def choose_mode(estimates: Mapping[CommandBufferMode, float], user_mode: CommandBufferMode,
                ends: Sequence[ModeEnds] = (), refused: Mapping[CommandBufferMode, str] = (
                    {}), measured: bool = False) -> ModeChoice:
    """The fastest mode of ``estimates`` if it beats ``user_mode``'s by ``MIN_GAIN`` at the
    nominal figures and at the pessimistic end of its ``ends`` (a candidate without
    ``ends`` is judged at the nominal figures only), and ``refused`` gives no reason
    against it (its memory, ``_plan.budget``)."""
    base = estimates[user_mode]
    ordered = ((user_mode, base), *((m, s) for m, s in estimates.items() if m is not user_mode))
    by_mode = {e.mode: e for e in ends}
    label = "" if measured else "; estimated, not measured on a GPU"

    def holds(mode: CommandBufferMode, seconds: float) -> bool:
        if base <= 0 or seconds > base * (1 - MIN_GAIN) or mode in refused:
            return False
        found = by_mode.get(mode)
        return found is None or found.pessimistic_ratio <= 1 - MIN_GAIN

    winners = [(m, s) for m, s in ordered[1:] if holds(m, s)]
    if not winners:
        best, best_seconds = min(ordered, key=lambda pair: pair[1])
        gain = (1 - best_seconds / base) * 100 if base > 0 else 0.0
        reason = f"kept the process's {user_mode.value} mode: "
        found = by_mode.get(best)
        if best is user_mode or gain < MIN_GAIN * 100:
            reason += (f"no mode is estimated {MIN_GAIN:.0%} faster (best {best.value}, "
                       f"{gain:.1f}%)")
        elif best in refused:
            reason += f"{best.value} is estimated {gain:.1f}% faster, but {refused[best]}"
        elif found is not None:
            reason += (f"{best.value} is estimated {gain:.1f}% faster with the GPU model's "
                       f"nominal figures, x{found.pessimistic_ratio:.3f} at the pessimistic "
                       f"end of their ranges (x{found.optimistic_ratio:.3f} at the "
                       "optimistic end)")
        return ModeChoice(user_mode, user_mode, ordered, False, reason + label, ends=tuple(ends),
                          measured=measured)
    best, best_seconds = min(winners, key=lambda pair: pair[1])
    why = ("its small independent kernels run as parallel CUDA-graph nodes"
           if best.branching else
           "its stream regions hold loops, which keep their overlap outside graphs"
           if best is CommandBufferMode.OFF else "its graphs run as one chain")
    found = by_mode.get(best)
    span = (f", x{found.pessimistic_ratio:.3f} to x{found.optimistic_ratio:.3f} over the "
            "model's ranges" if found is not None else "")
    reason = (f"compiled in {best.value} mode: {why}; est. {best_seconds * 1e6:.1f} us "
              f"against {base * 1e6:.1f} us in the process's {user_mode.value} mode "
              f"(x{best_seconds / base:.3f}{span})")
    return ModeChoice(best, user_mode, ordered, True, reason + label, ends=tuple(ends),
                      measured=measured, why=why)


def kept_mode(mode: CommandBufferMode, user_mode: CommandBufferMode | None,
              explicit: bool, seconds: float | None = None,
              forced: bool = False, measured: bool = False) -> ModeChoice:
    """No choice: the option's ``mode`` (``explicit``) or the process's; ``seconds`` its
    estimate; ``forced``: ``force_streams`` is on (it plans in the process's mode too)."""
    user = user_mode or mode
    why = ("set in XLA_FLAGS, command_buffers='keep', or force_streams=True" if forced
           else "set in XLA_FLAGS, or command_buffers='keep'")
    reason = (f"compiled in {mode.value} mode, as the command_buffers option says"
              if explicit else f"kept the process's {mode.value} mode ({why})")
    return ModeChoice(mode, user, ((mode, seconds),) if seconds is not None else (),
                      explicit, reason, measured=measured)
