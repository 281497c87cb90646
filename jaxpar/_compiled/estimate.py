"""Estimated GPU time of a compiled program, replayed from XLA:GPU's schedule.

``estimate_hlo`` reads the scheduled HLO that ``jaxpar._compiled.gpu_compile.compile_for_gpu``
returns and replays it on a model of one GPU: a host thread that enqueues kernels,
CUDA streams that run them in order, and the GPU's roofline throughput shared by all
streams. It counts kernel launches per run (loop bodies times their trip counts),
host syncs (``conditional``, ``while`` without a known trip count) and the
stream-annotated regions that really run beside other work. ``verdict`` compares
two estimates in one line. (A plan's own figure before anything is compiled is
``jaxpar._report.timeline.plan_estimate``'s, shown by ``inspect``; ``gpu_preview`` gives its plan
this module's figure instead.) The steps below are three modules: ``kernels`` (kernel
time), ``thunks`` (the thunk sequence and CUDA-graph capture) and ``replay`` (host,
streams, device, loops); this one holds the public figures and ``verdict``.

Example::

    from jaxpar._compiled.gpu_compile import compile_for_gpu
    from jaxpar._compiled.estimate import estimate_hlo, verdict

    plain = estimate_hlo(compile_for_gpu(f, *args))
    fast = estimate_hlo(compile_for_gpu(jaxpar.parallel_branches(f, target="gpu"), *args))
    print(verdict(plain, fast))   # "faster by 12% (est. 412 us -> 362 us): ..."

The model, step by step (every figure is the GPU model's, ``jaxpar._model.gpu``, with
its source there; a calibration profile measured on the GPU replaces them):

* **Kernel time.** Each ``fusion``, ``custom-call`` and ``copy`` is one launch. Its
  work is a roofline, ``max(flops / peak, bytes / bandwidth)``: flops of the dots and
  convolutions inside (2 per multiply-add) at the tensor-core peak of their element
  type, other flops (one per element of every other instruction) at the FP32 peak;
  bytes of the operands read (only the slice a ``dynamic-slice``/``slice``/``gather``
  takes of a parameter; nothing for the buffer a ``dynamic-update-slice`` updates in
  place) plus the result written. A kernel lasts at least ``kernel_floor_s`` launched
  alone, ``graph_floor_s`` inside a CUDA graph.
* **Host.** Without CUDA graphs the host thread pays ``launch_s`` per kernel, and a
  kernel starts when both the host has enqueued it and its stream is free.
  ``call-start`` makes the region's stream wait for everything enqueued on the caller's
  stream, then the *same* host thread enqueues the whole region, then goes on;
  ``call-done`` makes the caller's stream wait for the region (``async_thunk.cc``,
  docs/xla.md, "Stream-annotated calls"). Each costs ``event_s`` on the host.
* **Host syncs.** A ``conditional`` that is not in a CUDA graph, and every trip of a
  ``while`` without ``known_trip_count``, copy a predicate to the host and block it
  until its stream is idle, plus ``sync_s`` (``while_thunk.cc``/``conditional_thunk.cc``,
  docs/xla.md, "Loops, trip counts, unrolling and fusion"). An unknown trip count is
  taken as ``unknown_trips`` (default 1) and flagged.
* **Sharing the GPU.** Kernels on different streams overlap, but the roofline work of
  all of them goes through one device: ``end = max(start + duration, max(start,
  device_free) + work)``. Overlap therefore hides kernel floors and launch latency,
  never the work itself. On one stream this is exactly the serial sum.
* **Loops.** A ``while`` with ``known_trip_count`` replays its body that many times from
  a host loop with no condition (``WhileThunk``). The replay runs three trips and
  extrapolates the steady per-trip step to the rest, so 10,000 trips cost three.
* **CUDA graphs** (``command_buffers``), after docs/gpu_evidence.md,
  section 1.7 (**inferred from XLA's source, not seen on a GPU yet**):
  runs of at least 5 consecutive capturable thunks (fusions, cuBLAS/cuDNN/Triton custom
  calls, copies, conditionals whose branches are capturable, stream regions whose
  kernels all are, plain calls) in ENTRY, in ``while`` bodies and in conditional branches
  become one graph launch (``graph_launch_s`` plus ``node_s`` per kernel on the host:
  ``chain_node_s`` for a chain, ``dag_node_s`` for a branching graph). A
  ``while`` is never captured (WHILE is not a default command type), nor is anything
  inside a stream region that holds one (the conversion pass does not recurse into
  it). Modes (``_model.gpu.CommandBufferMode``):

  - ``"lhs"`` (XLA's default ``xla_gpu_command_buffer_scheduling_mode=LHS``): the
    graph is one serial chain, **regions inlined into it included**, so a captured
    region's overlap is lost (open XLA PR #48900 describes exactly this).
  - ``"concurrent"`` (``=CONCURRENT``): graph nodes depend only on the data they read,
    so independent kernels (annotated or not) overlap inside a graph, at most
    ``hardware_queues`` at once; a kernel that fills the GPU or calls a library (a dot
    or convolution inside, a custom call, more than ``CONCURRENT_REGION_BYTES``) overlaps
    nothing (no public evidence that overlapping them pays).
  - ``"concurrent_regions"`` (``=CONCURRENT_REGIONS``): the same, as XLA defines it:
    only small kernels run concurrently, the rest serially.
  - ``"serialize"`` (``=SERIALIZE``): a serial chain, as ``"lhs"``.
  - ``"off"`` (``--xla_gpu_enable_command_buffer=``): every kernel is launched alone.

What it does not model: wave quantisation and the efficiency of small GEMMs (the
roofline is a lower bound, so small kernels look cheaper than they are), L2 reuse,
collectives across devices (costed by bytes, on the caller's stream), graph updates
when argument addresses change, and cuSOLVER internals (costed by bytes).

The figures (peaks by element type, bandwidth, ``launch_s``, ``graph_launch_s``,
``chain_node_s``, ``dag_node_s``, ``kernel_floor_s``, ``graph_floor_s``, ``sync_s``,
``event_s``, ``hardware_queues``) and their sources are in
``jaxpar._model.gpu`` (``GPU_PROFILES``), shared with the planner's cost model and the
pricing of stream sections.

Sharp edges:
  * An estimate, not a measurement: good for comparing two compiles of one program
    (plain against jaxpar), not for predicting wall time. The CUDA-graph behaviour
    is read from XLA's source; the first GPU run must confirm it (docs/gpu_evidence.md,
    section 5).
  * Reads the HLO text format of jaxlib 0.10.2 to 0.12 (see ``schedule``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from .._model.gpu import CommandBufferMode, GpuProfile, gpu_profile
from . import hlo
from .hlo import Module
from .kernels import KernelCosts
from .replay import Replay
from .thunks import Item, Program

__all__ = [
    "Estimate",
    "RegionFigures",
    "estimate_hlo",
    "verdict",
]


# --------------------------------------------------------------------------- replay


@dataclasses.dataclass(frozen=True, slots=True)
class RegionFigures:
    """One stream-annotated region (``call-start``/``call-done``) of a compiled program.

    Attributes:
        name: the ``call-start`` instruction.
        computation: where the start sits.
        stream: the ``_xla_stream_annotation`` value plus one (0 is the main stream).
        scheduling_group: ``_scheduling_group_id``, if any.
        kernels: kernels one execution of the region launches (its loops multiplied).
        kernels_beside: kernels scheduled between its start and its done in the caller
            (other regions' kernels included): work that can run beside it.
        host_blocking: instructions inside the region that block the host thread
            (``conditional``, ``while`` without a known trip count).
        capturable: every thunk inside can live in a CUDA graph; in the default LHS
            mode such a region, when captured, is chained serially (overlap lost).
    """

    name: str
    computation: str
    stream: int
    scheduling_group: str | None
    kernels: int
    kernels_beside: int
    host_blocking: tuple[str, ...]
    capturable: bool

    @property
    def overlaps(self) -> bool:
        """In flight beside other work, with nothing inside that blocks the host."""
        return self.kernels > 0 and self.kernels_beside > 0 and not self.host_blocking

    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                "host_blocking": list(self.host_blocking), "overlaps": self.overlaps}


@dataclasses.dataclass(frozen=True, slots=True)
class Estimate:
    """What one compiled program costs on the modelled GPU, per run.

    Attributes:
        seconds: estimated GPU time of one run (host enqueue, device, syncs).
        launches: kernels launched per run, loop bodies times their trips.
        graph_launches: CUDA-graph launches per run (0 with ``command_buffers="off"``).
        host_syncs: times per run the host blocks on the device.
        unknown_trip_loops: ``while`` loops without a known trip count (each costed as
            ``unknown_trips`` trips).
        device_seconds: sum of kernel durations (one stream, no launch cost).
        regions: the stream-annotated regions.
        command_buffers: the CUDA-graph mode assumed.
        gpu: the profile's name.
        concurrent_kernels: kernels per run that a ``CONCURRENT``-mode graph starts
            while another of its kernels still runs (parallel graph nodes); 0 in the
            other modes.
    """

    seconds: float
    launches: int
    graph_launches: int
    host_syncs: int
    unknown_trip_loops: int
    device_seconds: float
    regions: tuple[RegionFigures, ...]
    command_buffers: str
    gpu: str
    concurrent_kernels: int = 0

    @property
    def overlapping_regions(self) -> int:
        return sum(region.overlaps for region in self.regions)

    @property
    def kept_overlaps(self) -> int:
        """Overlapping regions that keep their overlap in this mode: all with graphs off
        or concurrent, the ones no graph captures in ``lhs``/``serialize`` (a captured
        region is chained serially there)."""
        serial = self.command_buffers in (CommandBufferMode.LHS.value,
                                          CommandBufferMode.SERIALIZE.value)
        return sum(r.overlaps and not (serial and r.capturable) for r in self.regions)

    @property
    def runs_concurrently(self) -> bool:
        """Real concurrency: parallel graph nodes, or regions that keep their overlap."""
        return self.concurrent_kernels > 0 or self.kept_overlaps > 0

    @property
    def microseconds(self) -> float:
        return self.seconds * 1e6

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "launches": self.launches,
                "graph_launches": self.graph_launches, "host_syncs": self.host_syncs,
                "unknown_trip_loops": self.unknown_trip_loops,
                "device_seconds": self.device_seconds,
                "overlapping_regions": self.overlapping_regions,
                "regions": [r.to_dict() for r in self.regions],
                "command_buffers": self.command_buffers, "gpu": self.gpu,
                "concurrent_kernels": self.concurrent_kernels,
                "kept_overlaps": self.kept_overlaps}


# --------------------------------------------------------------------------- regions


def _regions(module: Module, program: Program, entry: str) -> tuple[RegionFigures, ...]:
    found = []
    for name in sorted(module.control_computations()):
        computation = module.by_name[name]
        items = program.items(name, False)
        spans = {}
        for k, item in enumerate(items):
            if item.kind == "start":
                spans[k] = next((j for j in range(k + 1, len(items)) if items[j].kind == "done"
                                 and items[j].instruction.operands[:1]
                                 == (item.instruction.name,)), len(items))
        for k, done in spans.items():
            item = items[k]
            # Work beside it: kernels scheduled between its start and done (other regions
            # started there included), and regions started before it and still in flight.
            beside = sum(_kernels(program, items[j:j + 1]) for j in range(k + 1, done))
            beside += sum(_kernels(program, items[j:j + 1]) for j, other in spans.items()
                          if j < k < other)
            attributes = hlo.frontend_attributes(item.instruction)
            found.append(RegionFigures(
                name=item.instruction.name, computation=computation.name, stream=item.stream,
                scheduling_group=attributes.get("_scheduling_group_id"),
                kernels=sum(_kernels(program, program.items(c, False)) for c in item.callees),
                kernels_beside=beside,
                host_blocking=tuple(b for c in item.callees
                                    for b in _host_blocking(program, c, frozenset())),
                capturable=all(program.capturable(c) for c in item.callees)))
    return tuple(found)


def _kernels(program: Program, items: Iterable[Item]) -> int:
    """Kernels per execution of ``items``, loops multiplied (an unknown trip count as 1)."""
    total = 0
    for item in items:
        if item.kind == "kernel":
            total += 1
        elif item.kind in ("start", "call"):
            total += sum(_kernels(program, program.items(c, False)) for c in item.callees)
        elif item.kind == "conditional":
            total += max((_kernels(program, program.items(c, False)) for c in item.callees),
                         default=0)
        elif item.kind == "while":
            body, condition = item.callees
            per_trip = _kernels(program, program.items(body, False))
            if item.trips is None:
                per_trip += _kernels(program, program.items(condition, False))
            total += per_trip * (item.trips if item.trips is not None else 1)
    return total


def _host_blocking(program: Program, computation: str, seen: frozenset[str]) -> list[str]:
    if computation in seen:
        return []
    found = []
    for item in program.items(computation, False):
        if item.kind == "conditional" or (item.kind == "while" and item.trips is None):
            found.append(item.instruction.name)
        for callee in item.callees:
            found.extend(_host_blocking(program, callee, seen | {computation}))
    return found


# --------------------------------------------------------------------------- public


def estimate_hlo(hlo_text: str, gpu: str | GpuProfile = "h200",
                 command_buffers: CommandBufferMode | str = CommandBufferMode.LHS,
                 unknown_trips: int = 1) -> Estimate:
    """Estimates one run of a compiled, scheduled HLO module on a GPU.

    Args:
        hlo_text: scheduled HLO text, e.g. from ``compile_for_gpu`` or an XLA
            ``*after_optimizations.txt`` dump.
        gpu: ``"h200"``, ``"h100"``, a device kind or a ``GpuProfile``
            (``_model.gpu.gpu_profile``: a calibration profile replaces the built-in figures).
        command_buffers: CUDA-graph mode assumed, a ``CommandBufferMode`` or its name:
            ``"lhs"`` (XLA's default), ``"concurrent"``, ``"serialize"`` or ``"off"`` (see
            the module docstring).
        unknown_trips: trips assumed for a ``while`` without a known trip count.

    Returns:
        An ``Estimate``.

    Raises:
        ValueError: no ENTRY computation, unknown ``gpu`` or mode, ``unknown_trips < 1``.
        GpuProfileError: the calibration profile of ``gpu`` is malformed.

    Example:
        >>> estimate_hlo(compile_for_gpu(f, x)).launches
        12
    """
    profile = gpu_profile(gpu)
    mode = CommandBufferMode.parse(command_buffers)
    if isinstance(unknown_trips, bool) or not isinstance(unknown_trips, int) \
            or unknown_trips < 1:
        raise ValueError(f"unknown_trips={unknown_trips!r} must be an integer >= 1.")
    _, computations = hlo.parse_computations(hlo_text)
    entries = [c.name for c in computations if c.is_entry]
    if not entries:
        raise ValueError("hlo_text holds no ENTRY computation; pass a whole HLO module's text.")
    module = Module(computations)
    program = Program(module, KernelCosts(module, profile), mode)
    replay = Replay(program, profile, unknown_trips)
    replay.sequence(entries[0], 0, graphs=True)
    finish = max(replay.clock["host"], *replay.streams.ends.values())
    return Estimate(
        seconds=finish, launches=round(replay.clock["launches"]),
        graph_launches=round(replay.clock["graph_launches"]),
        concurrent_kernels=round(replay.clock["concurrent_kernels"]),
        host_syncs=round(replay.clock["host_syncs"]),
        unknown_trip_loops=len(replay.unknown_loops),
        device_seconds=replay.device.busy,
        regions=_regions(module, program, entries[0]), command_buffers=mode.value,
        gpu=profile.name)


def verdict(plain: Estimate, jaxpar: Estimate, tolerance: float = 0.01) -> str:
    """One line: is the jaxpar program faster, slower or the same, by how much, and why.

    Args:
        plain: estimate of plain ``jax.jit``.
        jaxpar: estimate of the rewritten program.
        tolerance: relative difference below which both count as the same.
    """
    ratio = jaxpar.seconds / plain.seconds if plain.seconds > 0 else 1.0
    if ratio < 1 - tolerance:
        head = f"faster by {(1 - ratio) * 100:.0f}%"
    elif ratio > 1 + tolerance:
        head = f"slower by {(ratio - 1) * 100:.0f}%"
    else:
        head = "about the same"
    reasons = []
    if jaxpar.launches != plain.launches:
        reasons.append(f"launches {plain.launches:,} -> {jaxpar.launches:,}")
    if jaxpar.regions:
        overlapping = jaxpar.overlapping_regions
        reasons.append(f"{overlapping} of {len(jaxpar.regions)} stream regions overlap other "
                       "work")
        blocked = sum(bool(r.host_blocking) for r in jaxpar.regions)
        if blocked:
            reasons.append(f"{blocked} hold host syncs")
        if jaxpar.command_buffers == CommandBufferMode.LHS.value:
            lost = sum(r.overlaps and r.capturable for r in jaxpar.regions)
            if lost:
                reasons.append(f"{lost} lose it in LHS CUDA graphs")
    if jaxpar.concurrent_kernels:
        reasons.append(f"{jaxpar.concurrent_kernels:,} kernels run as parallel graph nodes")
    if jaxpar.host_syncs != plain.host_syncs:
        reasons.append(f"host syncs {plain.host_syncs:,} -> {jaxpar.host_syncs:,}")
    if jaxpar.unknown_trip_loops or plain.unknown_trip_loops:
        reasons.append("unknown trip counts taken as 1")
    why = "; ".join(reasons) or "same launches, no stream regions"
    return (f"{head} (est. {plain.microseconds:,.1f} us -> {jaxpar.microseconds:,.1f} us, "
            f"x{ratio:.3f}, {jaxpar.command_buffers} graphs): {why}")
