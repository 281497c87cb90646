"""The GPU model's time of a jaxpr's levels in a CUDA-graph mode, before anything is
compiled (``LevelModel``): the one timing model that ``_plan.gpu_time`` prices planned
programs by (what ``_plan.modes`` chooses the mode by) and ``passes.unroll_scans`` prices
a scan's unroll factors by, so the factor it picks is the one the plan's estimate finds
cheapest. It runs each level on the one GPU simulator (``_model.gpu_simulator``), which the
compiled program's replay (``_compiled.replay``) runs too; the host's time is summed
beside the device's (``_model.gpu_simulator`` says why the two model the host apart).

The model of one jaxpr level, in a mode:

* every equation launching kernels is a node: its roofline work (flops at peak or bytes
  at bandwidth, whichever is longer), at least a kernel floor per kernel (a graph's
  ``graph_floor_s`` inside a CUDA graph, ``kernel_floor_s`` launched alone); the work of
  every node goes through the one device (overlap hides kernel floors, never work): the
  device, the streams and the node order below are ``_model.gpu_simulator``'s, the GPU simulator
  that ``jaxpar._compiled.estimate`` runs the compiled program on too (why the host is
  modelled apart in each: ``_model.gpu_simulator``'s docstring);
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
  kernels are ones XLA cannot fuse away (not ``_program.primitives.MAY_FUSE_AWAY``: a
  concatenate may join a GEMM's prologue) and graphs are on (host: one graph launch plus
  a node each, ``GpuProfile.node_s``: about nothing for a chain, up to a microsecond for
  a branching graph), else each is launched alone (host: ``launch_s`` each); in the
  branching modes a small node starts when its inputs are ready, at most
  ``hardware_queues`` at once, while a dot, a convolution, a library call or a
  collective (``_model.memory.SERIAL``) starts after everything before it and holds back
  everything after it (they fill the GPU: XLA's own ``CONCURRENT_REGIONS`` rule, with
  no public evidence that overlapping them pays); in the other modes a node starts after
  the one before;
* equations given lanes (``lanes``: the plan's stream regions) run on streams of their own:
  a lane's node waits only for its inputs and its lane, and each lane costs the host a
  start and a done event (``event_s``);
* one run of the top level: its first kernel waits for its launch (a graph's, when the top
  level is one graph), then the longer of the device's and the host's time.

Example::

    model = LevelModel(costs, CommandBufferMode.LHS)
    model.jaxpr(closed_jaxpr, top=True).run_seconds   # one run of the program
    model.scan(scan_eqn, unroll=4).seconds            # one run of a scan, unrolled by 4

Sharp edges:
  * A model of the compiled program before it is compiled: ``gpu_preview`` judges the
    compiled one (``_compiled.estimate``), and the first GPU run must confirm both. It does not
    know which elementwise work XLA cannot fuse into a neighbour (a relu after a cuDNN
    convolution is a kernel of its own), so it counts fewer kernels than XLA launches
    there, nor how long a kernel that under-fills the GPU runs (its roofline is a lower
    bound): the gain of overlapping such kernels, the evidence's best case, is beyond it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _compat
from .._compat import JaxprEqn, JaxprLike
from .._memo import IdentityMemo
from .._program.primitives import COND, HOST_CALLBACKS, MAY_FUSE_AWAY, SCAN, SERIAL_KERNELS, WHILE
from .cost import CostModel, known_while_trip_count
from .gpu import MIN_GRAPH_SIZE, CommandBufferMode, GpuProfile
from .gpu_simulator import Device, LaunchSequence, Streams


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
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
    # A call's body without a kernel: the roofline of its elementwise work, which fuses
    # into a kernel of its caller's level (one of its own where that level has none).
    loose: float = 0.0

    @property
    def seconds(self) -> float:
        return max(self.device, self.host)

    @property
    def run_seconds(self) -> float:
        """One run of a level on its own: its kernels wait for their first launch. (A
        loop's trips overlap one trip's launch with the trip before: ``seconds``.)"""
        return max(self.device + self.lead, self.host)


# The primitives ``LevelModel._alone`` runs outside graphs.
_ALONE = frozenset((SCAN, WHILE, COND))

# One equation of a level as the model sees it, the same in every mode and at every end
# of the figures: (equation, work, kernels, sure kernels, serial, its span if it runs
# alone outside graphs, a call's device time, its loose work: elementwise work that fuses
# into a neighbouring kernel); see ``LevelModel._entry``.
_Entry = tuple[JaxprEqn, float, float, float, bool, "Span | None", float, float]


class LevelModel:
    """The GPU model in one CUDA-graph mode at one set of figures (see the module
    docstring); ``memo`` may be shared by the models of one call and one cost model."""

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

    def jaxpr(self, jaxpr: JaxprLike, top: bool = False, graphs: bool | None = None,
              call: bool = False) -> Span:
        """The span of a level; ``graphs``: whether it runs in a CUDA graph (a loop body
        repeated by unrolling may, where it alone would not), default as it would alone;
        ``call``: a call's body, inlined into its caller's level (else a launch sequence of
        its own: the program, a loop's trip, a branch)."""
        if top:  # its lanes are the plan's: never remembered
            return self._level(_compat.open_jaxpr(jaxpr)[0].eqns, self.lanes)
        return self._memo.lookup(  # type: ignore[no-any-return]
            jaxpr, lambda: self._level(_compat.open_jaxpr(jaxpr)[0].eqns, {}, graphs, call),
            extra=(self.mode, self.gpu, graphs, call))

    def _alone(self, eqn: JaxprEqn) -> Span | None:
        """A loop or cond: runs outside any graph, with its own host cost inside."""
        name = eqn.primitive.name
        if name == SCAN:
            return self.scan(eqn)
        if name == WHILE:
            body = self.jaxpr(eqn.params["body_jaxpr"])
            condition = self.jaxpr(eqn.params["cond_jaxpr"])
            found = known_while_trip_count(eqn)
            trips = 1 if found is None else found
            if found is None:  # the predicate goes to the host every trip
                body = Span(body.device + condition.device + self.gpu.sync_s,
                             body.host + condition.host + self.gpu.sync_s,
                             body.work + condition.work)
        elif name == COND:
            branches = [self.jaxpr(b) for b in eqn.params["branches"]]
            dearest = max(branches, key=lambda s: s.seconds, default=Span(0.0, 0.0, 0.0))
            return Span(dearest.seconds + self.gpu.sync_s, 0.0, dearest.work)
        else:
            return None
        return Span(trips * body.seconds, 0.0, trips * body.work)

    def scan(self, eqn: JaxprEqn, unroll: int | None = None) -> Span:
        """The ``scan`` ``eqn`` as XLA runs it, unrolled by ``unroll`` (default its own
        factor): ``length // unroll`` trips of ``unroll`` bodies, each trip also bumping
        the counter, slicing every distinct scanned input a kernel reads and writing every
        stacked result (one kernel each, for the trip's bodies at once), then the
        ``length % unroll`` left-over bodies once."""
        info = _compat.scan_info(eqn)
        body = self.jaxpr(info.jaxpr)
        unroll = max(1, min(info.unroll if unroll is None else unroll, info.length))
        trips, left = divmod(info.length, unroll)
        if trips <= 1 and not left:  # one trip: XLA inlines the loop into its caller
            return self._repeated(info.jaxpr, body, info.length, 0.0)
        # JAX slices a trip's ``unroll`` bodies' inputs at once, and writes their stacked
        # results at once.
        per_trip = self._repeated(info.jaxpr, body, unroll,
                                  self.costs.scan_trip_kernels(eqn))
        rest = (self._repeated(info.jaxpr, body, left, 0.0) if left
                else Span(0.0, 0.0, 0.0))
        return Span(trips * per_trip.seconds + rest.seconds, 0.0,
                     trips * per_trip.work + rest.work)

    def _repeated(self, jaxpr: JaxprLike, body: Span, times: int, extra_kernels: float
                  ) -> Span:
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
        return Span(body.device * times + extra_kernels * self.gpu.floor_s(graphs),
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
                return eqn, alone.work, 0.0, 0.0, True, alone, alone.seconds, 0.0
        subs = self.costs.subjaxprs(eqn)
        if subs:
            # A call: XLA inlines its body into the caller, whose graph and floor its
            # kernels then share; a node of that many kernels, which runs beside others
            # like it unless it holds one that fills the GPU.
            body = self.jaxpr(subs[0][2], call=True)
            if body.alone > 0:  # it holds a loop or a cond: timed as it runs
                return (eqn, body.work, body.kernels, body.sure, True, None, body.device,
                        body.loose)
            return (eqn, body.work, body.kernels, body.sure, body.serial, None, 0.0,
                    body.loose)
        cost = self.costs.eqn_cost(eqn)
        work = max(cost.flops / self.costs.profile.peak_flops,
                   cost.bytes / self.gpu.bandwidth)
        if cost.kernels <= 0:  # elementwise: fuses into a neighbouring kernel
            entry: _Entry = (eqn, 0.0, 0.0, 0.0, False, None, 0.0, work)
        else:
            sure = 0.0 if eqn.primitive.name in MAY_FUSE_AWAY else cost.kernels
            entry = (eqn, work, cost.kernels, sure, eqn.primitive.name in SERIAL_KERNELS,
                     None, 0.0, 0.0)
            if eqn.primitive.name in HOST_CALLBACKS:
                # The device waits for the host's answer: a sync at this end of the
                # figures, so not remembered across ends.
                return (eqn, work, cost.kernels, cost.kernels, True, None,
                        max(work, cost.kernels * self.gpu.kernel_floor_s) + self.gpu.sync_s,
                        0.0)
        self._memo.set(eqn, entry)
        return entry

    def _level(self, eqns: Sequence[JaxprEqn], lanes: Mapping[int, int],
               in_graph: bool | None = None, call: bool = False) -> Span:
        remembered = self._memo.get
        planned = [remembered(eqn) or self._entry(eqn) for eqn in eqns]
        # Free and alone entries add zeros: the sums are those of the capturable nodes.
        kernels = sum(entry[2] for entry in planned)
        loose = sum(entry[7] for entry in planned) if kernels <= 0 else 0.0
        if loose > 0 and not call:
            # Elementwise work with no kernel of its level to fuse into is a kernel of its
            # own (XLA's loop fusion): a scan body of only ``sin`` and ``add`` still runs one
            # kernel a trip, and a program of them one kernel, never no time at all.
            planned = _fused_kernel(planned, loose)
            kernels, loose = 1.0, 0.0
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
        return Span(end, host + alone_seconds, work_total, kernels, captured, alone_seconds,
                     lead, sure_captured, serial, loose)


def _fused_kernel(planned: Sequence[_Entry], loose: float) -> list[_Entry]:
    """``planned`` (a level without a kernel) with its last equation of loose work made
    the one fused kernel of all of it (``loose`` seconds of work; it reads that equation's
    inputs)."""
    last = max(i for i, entry in enumerate(planned) if entry[7] > 0)
    eqn, _, _, _, _, alone, device_s, _ = planned[last]
    fused: _Entry = (eqn, loose, 1.0, 1.0, False, alone, device_s, 0.0)
    return [*planned[:last], fused, *planned[last + 1:]]


def _timeline(gpu: GpuProfile, planned: Sequence[_Entry], lanes: Mapping[int, int],
              graphs: bool, branching: bool) -> tuple[float, float, float]:
    """When the level's last node finishes on the device, the seconds of its loops
    and conds, and its work: nodes in order on the one GPU simulator (``_model.gpu_simulator``),
    each after its inputs and (serial modes, serial kernels) everything before it; a
    region's nodes on its own stream."""
    floor_each = gpu.floor_s(graphs)
    device, streams = Device(), Streams()
    sequence = LaunchSequence(branching, gpu.hardware_queues)
    work_total = alone_seconds = 0.0
    ready: dict[Any, float] = {}
    literal = _compat.Literal
    ready_get = ready.get
    for index, (eqn, work, kernels, _, serial, alone, device_s, _) in enumerate(planned):
        duration = device_s if (alone is not None or device_s) else max(
            work, kernels * floor_each)
        inputs = 0.0  # finish times are never negative
        for v in eqn.invars:
            if not isinstance(v, literal):
                at = ready_get(v)
                if at is not None and at > inputs:
                    inputs = at
        lane = lanes.get(index) if lanes else None
        if lane is not None:  # in a stream region: after its inputs and its lane
            finish = streams.run(device, lane, inputs, work, duration)
            sequence.reached(finish)
            if alone is not None:
                alone_seconds += duration
        elif alone is not None:  # on the stream after everything before it
            finish = sequence.alone(inputs, duration)
            device.hold(finish)
            alone_seconds += duration
        elif duration > 0:
            start = sequence.start(inputs, serial)
            finish = device.run(start, work, duration)
            sequence.finished(finish, serial)
        else:
            finish = inputs
            sequence.reached(finish)
        work_total += work
        for v in eqn.outvars:
            ready[v] = finish
    return sequence.end, alone_seconds, work_total
