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
  least ``MIN_GRAPH_SIZE`` kernels is one graph launch per trip); a ``scan`` runs as XLA
  runs it: ``length // unroll`` trips of ``unroll`` bodies, each trip with one kernel
  bumping the counter and one slicing each distinct scanned input per body, then the
  left-over bodies once (so fusing scans and unrolling them save kernels and launches
  here, as in the compiled program); a ``cond`` costs its dearest branch; other calls
  their body;
* the other nodes of the level form one graph when at least ``MIN_GRAPH_SIZE`` of their
  kernels are ones XLA cannot fuse away (not ``_primitives.MAY_FUSE_AWAY``: a
  concatenate may join a GEMM's prologue) and graphs are on (host: one graph launch plus a node
  each), else each is launched alone (host: ``launch_s`` each); in ``CONCURRENT`` mode a
  node starts when its inputs are ready, in the other modes after the one before;
* the regions of the stream sections the plan kept (priced in that mode by ``_plan.pricing``)
  are lanes of their own: a region's node waits only for its inputs and its lane, and
  each region costs the host a start and a done event (``event_s``); a section the
  pricing would not emit (``force_streams``) is taken at its verdict: its regions on the
  main stream, plus its cut's cost;
* one run of the program: its first kernel waits for its launch (a graph's, when the top
  level is one graph), then the longer of the device's and the host's time.

Example::

    choice = choose_mode({mode: plan_in(mode) for mode in candidates}, user_mode, costs)
    choice.mode, choice.xla_options, choice.reason

Sharp edges:
  * A model of the compiled program before it is compiled: ``gpu_preview`` judges the
    compiled one (``_compiled.estimate``), and the first GPU run must confirm both. It does not
    know which elementwise work XLA cannot fuse into a neighbour (a relu after a cuDNN
    convolution is a kernel of its own), so it counts fewer kernels than XLA launches
    there.
  * Graphs ``OFF`` is a candidate only for a plan whose stream regions hold loops (their
    overlap survives only outside graphs): a short chain's kernels start sooner launched
    one by one than after a graph's launch, in this model and in ``_compiled.estimate``,
    but that host-side figure is not measured yet (``_gpu_model``), and a mode change
    for it is not worth the risk.
  * ``CONCURRENT`` mode makes XLA give independent values distinct buffers: more
    memory (the proto's warning: "may lead to OOMs"). Not priced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _compat
from .._compat import JaxprEqn, JaxprLike
from .._cost import CostModel, known_while_trip_count
from .._flags import command_buffer_options
from .._gpu_model import MIN_GRAPH_SIZE, CommandBufferMode, GpuProfile
from .._memo import IdentityMemo
from .._primitives import COND, MAY_FUSE_AWAY, MAY_HOLD_LOOPS, SCAN, WHILE
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
    captured: float = 0.0  # of those, the ones a CUDA graph may capture (not in regions)
    alone: float = 0.0  # seconds of loops and conds in the level, run outside graphs
    lead: float = 0.0  # host time before the first kernel can start (its launch, a graph's)
    sure: float = 0.0  # of the captured ones, those XLA cannot fuse away (``MAY_FUSE_AWAY``)

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

# One equation of a level as the model sees it: (equation, duration, work, kernels, sure
# kernels, its span if it runs alone outside graphs); see ``_Model._entry``.
_Entry = tuple[JaxprEqn, float, float, float, float, "_Span | None"]


class _Model:
    def __init__(self, costs: CostModel, mode: CommandBufferMode,
                 lanes: Mapping[int, int] | None = None,
                 memo: IdentityMemo[Any, Any] | None = None):
        gpu = costs.profile.gpu
        if gpu is None:
            raise ValueError("the CUDA-graph mode is chosen for a GPU; the cost model is for "
                             f"{costs.profile.name!r}")
        self.gpu: GpuProfile = gpu
        self.costs = costs
        self.mode = mode
        # Top-level equation -> its stream region (a lane beside the main stream).
        self.lanes = dict(lanes or {})
        # Shared by the estimates of one call (``memo``): a nested level's span by its
        # jaxpr and the mode, and an equation's ``_Entry`` where it is the same in every mode.
        self._memo: IdentityMemo[Any, Any] = IdentityMemo() if memo is None else memo

    def jaxpr(self, jaxpr: JaxprLike, top: bool = False) -> _Span:
        if top:  # its lanes are the plan's: never remembered
            return self._level(_compat.open_jaxpr(jaxpr)[0].eqns, self.lanes)
        return self._memo.lookup(  # type: ignore[no-any-return]
            jaxpr, lambda: self._level(_compat.open_jaxpr(jaxpr)[0].eqns, {}), extra=self.mode)

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
        also bumping the counter and slicing every distinct scanned input a kernel reads
        once per body (one kernel each), then the ``length % unroll`` left-over bodies
        once."""
        info = _compat.scan_info(eqn)
        body = self.jaxpr(info.jaxpr)
        unroll = max(1, min(info.unroll, info.length))
        trips, left = divmod(info.length, unroll)
        # A slice read only by elementwise work fuses into it; one read by a kernel of its
        # own (a dot) is a kernel.
        inner = _compat.open_jaxpr(info.jaxpr)[0]
        sliced = {id(v) for e in inner.eqns if self.costs.launches(e) for v in e.invars}
        xs = {id(outer) for outer, v in zip(eqn.invars[info.num_consts + info.num_carry:],
                                            inner.invars[info.num_consts + info.num_carry:],
                                            strict=True)
              if not _compat.is_literal(outer) and id(v) in sliced}
        if trips <= 1 and not left:  # one trip: XLA inlines the loop into its caller
            return self._repeated(body, info.length, 0.0)
        per_trip = self._repeated(body, unroll, 1.0 + unroll * len(xs))
        rest = self._repeated(body, left, 0.0) if left else _Span(0.0, 0.0, 0.0)
        return _Span(trips * per_trip.seconds + rest.seconds, 0.0,
                     trips * per_trip.work + rest.work)

    def _repeated(self, body: _Span, times: int, extra_kernels: float) -> _Span:
        """``times`` copies of a level one after the other, plus ``extra_kernels`` tiny
        kernels, as one launch sequence: one graph if they are enough to form one."""
        captured = body.captured * times + extra_kernels
        sure = body.sure * times + extra_kernels
        graphs = self.mode is not CommandBufferMode.OFF and sure >= MIN_GRAPH_SIZE
        host = (self.gpu.graph_launch_s + self.gpu.graph_node_s * captured if graphs
                else self.gpu.launch_s * captured)
        host += body.alone * times  # a body's level has no stream regions
        return _Span(body.device * times + extra_kernels * self.gpu.kernel_floor_s,
                     host, body.work * times, body.kernels * times + extra_kernels,
                     captured, body.alone * times, sure=sure)

    def _entry(self, eqn: JaxprEqn) -> _Entry:
        """``eqn``'s ``_Entry`` in this mode: a loop or cond (``alone``), a call (its
        body's), or a kernel of its own, the same in every mode (remembered in the memo);
        zeros for a free equation."""
        if eqn.primitive.name in _ALONE:
            alone = self._alone(eqn)
            if alone is not None:
                return eqn, alone.seconds, alone.work, 0.0, 0.0, alone
        subs = self.costs.subjaxprs(eqn)
        if subs:
            body = self.jaxpr(subs[0][2])
            if body.device > 0:
                return eqn, body.device, body.work, body.kernels, body.sure, None
            return eqn, 0.0, 0.0, 0.0, 0.0, None
        cost = self.costs.eqn_cost(eqn)
        if cost.kernels <= 0:
            entry: _Entry = (eqn, 0.0, 0.0, 0.0, 0.0, None)
        else:
            work = max(cost.flops / self.costs.profile.peak_flops,
                       cost.bytes / self.gpu.bandwidth)
            sure = 0.0 if eqn.primitive.name in MAY_FUSE_AWAY else cost.kernels
            entry = (eqn, max(work, cost.kernels * self.gpu.kernel_floor_s), work,
                     cost.kernels, sure, None)
        self._memo.set(eqn, entry)
        return entry

    def _level(self, eqns: Sequence[JaxprEqn], lanes: Mapping[int, int]) -> _Span:
        concurrent = self.mode is CommandBufferMode.CONCURRENT
        ready: dict[Any, float] = {}
        lane_end: dict[int, float] = {}
        floor = end = device_free = work_total = alone_seconds = 0.0
        remembered = self._memo.get
        planned = [remembered(eqn) or self._entry(eqn) for eqn in eqns]
        # Free and alone entries add zeros: the sums are those of the capturable nodes.
        kernels = sum(entry[3] for entry in planned)
        sure = sum(entry[4] for entry in planned)
        in_lanes = [index for index in sorted(lanes) if index < len(planned)]
        in_regions = sum(planned[index][3] for index in in_lanes)
        sure_captured = sure - sum(planned[index][4] for index in in_lanes)
        captured = kernels - in_regions
        # A graph only where XLA surely captures MIN_GRAPH_SIZE kernels: the kernels it
        # may fuse away (a concatenate into a GEMM's prologue) do not make one, so no mode
        # is chosen for a graph the compiled program does not have (three matmuls of
        # rolled operands: 6 kernels here, 3 launches once compiled).
        graphs = self.mode is not CommandBufferMode.OFF and sure_captured >= MIN_GRAPH_SIZE
        after_floor = concurrent and graphs
        literal = _compat.Literal
        ready_get = ready.get
        for index, (eqn, duration, work, _, _, alone) in enumerate(planned):
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
                finish = floor = start + duration
                device_free = max(device_free, finish)
                alone_seconds += duration
            elif duration > 0:
                start = max(floor, inputs) if after_floor else max(end, inputs)
                begin_work = max(start, device_free)
                device_free = begin_work + work
                finish = max(start + duration, begin_work + work)
            else:
                finish = inputs
            work_total += work
            if finish > end:
                end = finish
            for v in eqn.outvars:
                ready[v] = finish
        # A region's kernels are launched one by one (captured ones are refused by the
        # pricing in the graph modes); each region adds a start and a done event.
        host = self.gpu.launch_s * in_regions + 2 * self.gpu.event_s * len(set(lanes.values()))
        if graphs:
            lead = self.gpu.graph_launch_s + self.gpu.graph_node_s * captured
            host += lead
        else:
            lead = self.gpu.launch_s if captured > 0 else 0.0
            host += self.gpu.launch_s * captured
        return _Span(end, host + alone_seconds, work_total, kernels, captured, alone_seconds,
                     lead, sure_captured)


def estimate_plain_seconds(jaxpr: JaxprLike, costs: CostModel, mode: CommandBufferMode,
                           memo: IdentityMemo[Any, Any] | None = None) -> float:
    """Estimated seconds per run of ``jaxpr`` as ``jax.jit`` compiles it, in ``mode``
    (``memo``: as for ``estimate_seconds``)."""
    return _Model(costs, mode, memo=memo).jaxpr(jaxpr, top=True).run_seconds


def estimate_seconds(plan: LevelPlan, costs: CostModel, mode: CommandBufferMode,
                     memo: IdentityMemo[Any, Any] | None = None) -> float:
    """Estimated seconds per run of ``plan``'s program compiled in ``mode``.

    A section the GPU pricing would not emit (kept by ``force_streams``) is taken at its
    verdict: its regions run as if on the main stream, plus the cost of its cut.
    ``memo``, one per call, shared by the estimates of its plans in every mode and of the
    plain program (``Analysis.shared_memo``), remembers what they share: each
    equation's kernel time and work, and each nested level's span in each mode. It must
    be used with one cost model only.
    """
    lanes = {i: (s, r) for s, section in enumerate(plan.sections) if section.pays is not False
             for r, region in enumerate(section.regions) for i in region.eqns}
    numbered = {key: n for n, key in enumerate(dict.fromkeys(lanes.values()))}
    model = _Model(costs, mode, {i: numbered[key] for i, key in lanes.items()}, memo)
    forced = sum(section.cost_seconds or 0.0 for section in plan.sections
                 if section.pays is False)
    return model.jaxpr(plan.jaxpr, top=True).run_seconds + forced


def regions_hold_loops(plan: LevelPlan) -> bool:
    """Whether a stream region ``plan`` emits holds a loop (directly or in a call): only
    then may graphs ``OFF`` pay (see the module's sharp edges)."""
    eqns = _compat.open_jaxpr(plan.jaxpr)[0].eqns
    return any(eqns[i].primitive.name in MAY_HOLD_LOOPS for section in plan.sections
               if section.pays is not False for region in section.regions for i in region.eqns)


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
              explicit: bool, seconds: float | None = None,
              forced: bool = False) -> ModeChoice:
    """No choice: the option's ``mode`` (``explicit``) or the process's; ``seconds`` its
    estimate; ``forced``: ``force_streams`` is on (it plans in the process's mode too)."""
    user = user_mode or mode
    why = ("set in XLA_FLAGS, command_buffers='keep', or force_streams=True" if forced
           else "set in XLA_FLAGS, or command_buffers='keep'")
    reason = (f"compiled in {mode.value} mode, as the command_buffers option says"
              if explicit else f"kept the process's {mode.value} mode ({why})")
    return ModeChoice(mode, user, ((mode, seconds),) if seconds is not None else (),
                      explicit, reason)
