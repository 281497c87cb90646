"""Estimated GPU time of a compiled program, replayed from XLA:GPU's schedule.

``estimate_hlo`` reads the scheduled HLO that ``jaxpar._compiled.gpu_compile.compile_for_gpu``
returns and replays it on a model of one GPU: a host thread that enqueues kernels,
CUDA streams that run them in order, and the GPU's roofline throughput shared by all
streams. It counts kernel launches per run (loop bodies times their trip counts),
host syncs (``conditional``, ``while`` without a known trip count) and the
stream-annotated regions that really run beside other work. ``verdict`` compares
two estimates in one line. (A plan's own figure before anything is compiled is
``jaxpar._report.timeline.plan_estimate``'s, shown by ``inspect``; ``gpu_preview`` gives its plan
this module's figure instead.)

Example::

    from jaxpar._compiled.gpu_compile import compile_for_gpu
    from jaxpar._compiled.estimate import estimate_hlo, verdict

    plain = estimate_hlo(compile_for_gpu(f, *args))
    fast = estimate_hlo(compile_for_gpu(jaxpar.parallel_branches(f, target="gpu"), *args))
    print(verdict(plain, fast))   # "faster by 12% (est. 412 us -> 362 us): ..."

The model, step by step (every figure is the GPU model's, ``jaxpar._gpu_model``, with
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
  it). Modes (``_gpu_model.CommandBufferMode``):

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
``jaxpar._gpu_model`` (``GPU_PROFILES``), shared with the planner's cost model and the
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
import heapq
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .._gpu_model import (
    CONCURRENT_REGION_BYTES,
    MIN_GRAPH_SIZE,
    CommandBufferMode,
    GpuProfile,
    gpu_profile,
)
from . import hlo
from .hlo import Computation, Instruction, Module

__all__ = [
    "Estimate",
    "RegionFigures",
    "estimate_hlo",
    "verdict",
]


# --------------------------------------------------------------------------- kernel cost


@dataclasses.dataclass(frozen=True, slots=True)
class KernelCost:
    """Work of one launched kernel; ``serial``: a library call, a kernel holding a dot or
    a convolution, or one moving more than ``CONCURRENT_REGION_BYTES`` (XLA's
    ``CONCURRENT_REGIONS`` rule: such kernels fill the GPU, and nothing overlaps them
    in the model of either branching mode)."""

    tensor_seconds: float
    vector_flops: float
    bytes: float
    serial: bool = False

    def work(self, profile: GpuProfile) -> float:
        compute = self.tensor_seconds + self.vector_flops / profile.vector_flops
        return max(compute, self.bytes / profile.bandwidth)

    def duration(self, profile: GpuProfile, graphs: bool = False) -> float:
        return max(self.work(profile), profile.floor_s(graphs))


_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
_FREE_OPCODES = frozenset({"parameter", "constant", "bitcast", "get-tuple-element", "tuple",
                           "reshape", "broadcast", "iota", "after-all", "partition-id",
                           "replica-id", "opt-barrier", "add-dependency"})
_CAPTURABLE_CUSTOM_CALL = re.compile(r"cublas|cudnn|triton|gemm", re.IGNORECASE)
_LAUNCHED_OPCODES = frozenset({"fusion", "custom-call", "copy"})


class _Costs:
    """Kernel costs of one module, memoised per instruction name."""

    def __init__(self, module: Module, profile: GpuProfile):
        self.module = module
        self.profile = profile
        self._shapes: dict[str, dict[str, str]] = {}
        self._memo: dict[str, KernelCost] = {}

    def shapes(self, computation: str) -> dict[str, str]:
        if computation not in self._shapes:
            found = self.module.by_name.get(computation)
            self._shapes[computation] = {i.name: i.shape for i in found.instructions} \
                if found else {}
        return self._shapes[computation]

    def kernel(self, instruction: Instruction, computation: str) -> KernelCost:
        cost = self._memo.get(instruction.name)
        if cost is None:
            cost = self._kernel(instruction, computation)
            self._memo[instruction.name] = cost
        return cost

    def _kernel(self, instruction: Instruction, computation: str) -> KernelCost:
        shapes = self.shapes(computation)
        if instruction.opcode == "fusion":
            called = hlo.called(instruction.attributes, "calls")
            if called and called[0] in self.module.by_name:
                return self._fusion(called[0])
        read = sum(hlo.shape_bytes(shapes.get(o, "")) for o in instruction.operands)
        written = hlo.shape_bytes(instruction.shape)
        tensor = 0.0
        if instruction.opcode == "custom-call":
            tensor = self._custom_call_seconds(instruction, shapes)
            arrays = hlo.arrays(instruction.shape)
            if tensor and len(arrays) > 1:  # (result, workspace): the workspace is scratch
                written = hlo.ELEMENT_BYTES.get(arrays[0][0], 4.0) * arrays[0][1]
        return KernelCost(tensor, 0.0, read + written,
                          serial=instruction.opcode == "custom-call"
                          or read + written > CONCURRENT_REGION_BYTES)

    def _custom_call_seconds(self, instruction: Instruction, shapes: dict[str, str]) -> float:
        target = hlo.attribute(instruction.attributes, "custom_call_target") or ""
        operands = [shapes.get(o, "") for o in instruction.operands]
        out = instruction.shape
        if "cudnn" in target.lower() and "conv" in target.lower() and len(operands) > 1:
            return self._conv_seconds(instruction.attributes, operands[1], out)
        if _CAPTURABLE_CUSTOM_CALL.search(target) and operands:
            config = hlo.backend_config(instruction).get("gemm_backend_config", {})
            numbers = config.get("dot_dimension_numbers", {}) if isinstance(config, dict) else {}
            contracting = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
            lhs = hlo.dims(operands[0])
            size = math.prod(lhs[d] for d in contracting if d < len(lhs)) if contracting else 1
            flops = 2.0 * hlo.elements(out) * size
            return flops / self.profile.dot_flops(hlo.element_type(operands[0]))
        return 0.0

    def _conv_seconds(self, attributes: str, rhs_shape: str, out: str) -> float:
        labels = hlo.attribute(attributes, "dim_labels") or ""
        rhs = hlo.dims(rhs_shape)
        parts = labels.split("->")[0].split("_")
        out_feature = parts[1].find("o") if len(parts) == 2 else 0
        per_output = math.prod(rhs) / max(rhs[out_feature] if 0 <= out_feature < len(rhs)
                                          else 1, 1)
        flops = 2.0 * hlo.elements(out) * per_output
        return flops / self.profile.dot_flops(hlo.element_type(rhs_shape))

    def _fusion(self, name: str) -> KernelCost:
        computation = self.module.by_name[name]
        shapes = self.shapes(name)
        users: dict[str, list[Instruction]] = {}
        for instruction in computation.instructions:
            for operand in instruction.operands:
                users.setdefault(operand, []).append(instruction)
        tensor, vector = self._fusion_work(computation, shapes)
        read = 0.0
        in_place: set[str] = set()
        root = computation.instructions[-1] if computation.instructions else None
        outputs = [root] if root is not None else []
        if root is not None and root.opcode == "tuple":
            by_name = {i.name: i for i in computation.instructions}
            outputs = [by_name[o] for o in root.operands if o in by_name]
        written = 0.0
        for output in outputs:
            if output.opcode == "dynamic-update-slice" and len(output.operands) > 1:
                in_place.add(output.operands[0])
                written += hlo.shape_bytes(shapes.get(output.operands[1], ""))
            else:
                written += hlo.shape_bytes(output.shape)
        for instruction in computation.instructions:
            if instruction.opcode != "parameter":
                continue
            uses = users.get(instruction.name, [])
            if instruction.name in in_place and len(uses) == 1:
                continue
            if uses and all(u.opcode in _SLICING and u.operands[0] == instruction.name
                            for u in uses):
                read += sum(hlo.shape_bytes(u.shape) for u in uses)
            else:
                read += hlo.shape_bytes(instruction.shape)
        return KernelCost(tensor, vector, read + written,
                          serial=tensor > 0 or read + written > CONCURRENT_REGION_BYTES)


    def _fusion_work(self, computation: Computation, shapes: dict[str, str]
                     ) -> tuple[float, float]:
        """A fusion's matmul and convolution seconds (its nested fusions' included) and
        its vector flops."""
        tensor = vector = 0.0
        for instruction in computation.instructions:
            opcode = instruction.opcode
            if opcode in ("dot", "ragged-dot", "scaled-dot") and instruction.operands:
                lhs = hlo.dims(shapes.get(instruction.operands[0], ""))
                contracting = hlo.int_list(hlo.attribute(
                    instruction.attributes, "lhs_contracting_dims"))
                size = math.prod(lhs[d] for d in contracting if d < len(lhs))
                flops = 2.0 * hlo.elements(instruction.shape) * size
                tensor += flops / self.profile.dot_flops(
                    hlo.element_type(shapes.get(instruction.operands[0], "")))
            elif opcode == "convolution" and len(instruction.operands) > 1:
                tensor += self._conv_seconds(instruction.attributes,
                                             shapes.get(instruction.operands[1], ""),
                                             instruction.shape)
            elif opcode == "fusion":  # nested fusions (Triton): count their work too
                inner = hlo.called(instruction.attributes, "calls")
                if inner and inner[0] in self.module.by_name:
                    nested = self._fusion(inner[0])
                    tensor += nested.tensor_seconds
                    vector += nested.vector_flops
            elif opcode not in _FREE_OPCODES:
                vector += hlo.elements(instruction.shape)
        return tensor, vector


# --------------------------------------------------------------------------- thunk items


@dataclasses.dataclass(frozen=True, slots=True)
class _Item:
    """One step of a computation's thunk sequence."""

    kind: str  # kernel | start | done | while | conditional | call | graph | value
    instruction: Instruction
    callees: tuple[str, ...] = ()
    stream: int = 0
    trips: int | None = None
    members: tuple[_Item, ...] = ()  # for "graph": the captured items


def _region_of(instruction: Instruction, module: Module) -> str | None:
    called = hlo.called(instruction.attributes, "to_apply", "calls")
    if not called:
        return None
    if instruction.opcode == "async-start":
        root = module.root(called[0])
        if root is not None and root.opcode == "call":
            inner = hlo.called(root.attributes, "to_apply")
            return inner[0] if inner else called[0]
    return called[0]


def _stream_of(instruction: Instruction, module: Module) -> int:
    attributes = hlo.frontend_attributes(instruction)
    if instruction.opcode == "async-start":
        called = hlo.called(instruction.attributes, "calls")
        root = module.root(called[0]) if called else None
        if root is not None:
            attributes = {**hlo.frontend_attributes(root), **attributes}
    try:
        return 1 + int(attributes.get("_xla_stream_annotation", ""))
    except ValueError:
        return 1000  # unannotated async compute: a stream of XLA's own pool


def _is_compute_start(instruction: Instruction, module: Module) -> bool:
    if instruction.opcode == "call-start":
        return True
    if instruction.opcode != "async-start":
        return False
    kind, _ = hlo.async_kind(instruction, module)
    return kind == "compute"


class _Program:
    """Thunk sequences of a module, with CUDA-graph capture decided per sequence."""

    def __init__(self, module: Module, costs: _Costs, mode: CommandBufferMode):
        self.module = module
        self.costs = costs
        self.mode = mode
        self._memo: dict[tuple[str, bool], tuple[_Item, ...]] = {}
        self._capturable: dict[str, bool] = {}

    def items(self, computation: str, graphs: bool) -> tuple[_Item, ...]:
        key = (computation, graphs and self.mode is not CommandBufferMode.OFF)
        if key not in self._memo:
            raw = self._raw_items(computation)
            self._memo[key] = self._capture(raw) if key[1] else raw
        return self._memo[key]

    def _raw_items(self, name: str) -> tuple[_Item, ...]:
        computation = self.module.by_name.get(name)
        if computation is None:
            return ()
        items = []
        for instruction in computation.instructions:
            opcode = instruction.opcode
            if opcode in _LAUNCHED_OPCODES:
                items.append(_Item("kernel", instruction))
            elif _is_compute_start(instruction, self.module):
                region = _region_of(instruction, self.module)
                items.append(_Item("start", instruction, (region,) if region else (),
                                   stream=_stream_of(instruction, self.module)))
            elif opcode in ("call-done", "async-done"):
                items.append(_Item("done", instruction))
            elif opcode == "while":
                body = hlo.called(instruction.attributes, "body")
                condition = hlo.called(instruction.attributes, "condition")
                items.append(_Item("while", instruction, (body[0] if body else "",
                                                          condition[0] if condition else ""),
                                   trips=hlo.known_trip_count(instruction)))
            elif opcode == "conditional":
                branches = hlo.called(instruction.attributes, "branch_computations",
                                               "true_computation", "false_computation")
                items.append(_Item("conditional", instruction, branches))
            elif opcode == "call":
                items.append(_Item("call", instruction, hlo.called(
                    instruction.attributes, "to_apply")))
            elif (opcode in hlo.COLLECTIVES or opcode.endswith("-start")) \
                    and opcode not in ("send", "recv"):
                items.append(_Item("kernel", instruction))  # costed by bytes, in order
            else:
                items.append(_Item("value", instruction))
        return tuple(items)

    def capturable(self, computation: str) -> bool:
        """Whether every thunk of ``computation`` (recursively) can live in a CUDA graph."""
        if computation not in self._capturable:
            self._capturable[computation] = False  # recursion guard
            self._capturable[computation] = all(
                self._item_capturable(item) for item in self._raw_items(computation))
        return self._capturable[computation]

    def _item_capturable(self, item: _Item) -> bool:
        if item.kind == "kernel":
            opcode = item.instruction.opcode
            if opcode in ("fusion", "copy"):
                return True
            if opcode == "custom-call":
                target = hlo.attribute(item.instruction.attributes,
                                                      "custom_call_target") or ""
                return bool(_CAPTURABLE_CUSTOM_CALL.search(target))
            return False  # collectives are not a default command type
        if item.kind in ("start", "conditional", "call"):
            return all(self.capturable(c) for c in item.callees)
        if item.kind == "done":
            return True  # decided with its start
        return item.kind == "value"  # a while is never captured (WHILE is off)

    def _capture(self, items: tuple[_Item, ...]) -> tuple[_Item, ...]:
        flags = [self._item_capturable(item) for item in items]
        position = {item.instruction.name: k for k, item in enumerate(items)}
        for _ in range(len(items) + 1):  # a region is captured only with its whole span
            changed = False
            runs = _runs(flags)
            run_of = {k: r for r, (lo, hi) in enumerate(runs) for k in range(lo, hi)}
            for k, item in enumerate(items):
                if item.kind != "done" or not item.instruction.operands:
                    continue
                start = position.get(item.instruction.operands[0])
                if start is None:
                    continue
                same = flags[k] and flags[start] and run_of.get(k) == run_of.get(start)
                if not same and (flags[k] or flags[start]):
                    flags[k] = flags[start] = False
                    changed = True
            if not changed:
                break
        captured: list[_Item] = []
        cursor = 0
        for lo, hi in _runs(flags):
            thunks = sum(items[k].kind != "value" for k in range(lo, hi))
            if thunks < MIN_GRAPH_SIZE:
                continue
            captured.extend(items[cursor:lo])
            captured.append(_Item("graph", items[lo].instruction, members=items[lo:hi]))
            cursor = hi
        captured.extend(items[cursor:])
        return tuple(captured)


def _runs(flags: Sequence[bool]) -> list[tuple[int, int]]:
    runs, start = [], None
    for k, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = k
        elif not flag and start is not None:
            runs.append((start, k))
            start = None
    return runs


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


_COUNTERS = ("host", "device_free", "launches", "graph_launches", "host_syncs",
             "device_seconds", "concurrent_kernels")


class _Replay:
    """Replays thunk sequences on the host/stream/device model."""

    def __init__(self, program: _Program, profile: GpuProfile, unknown_trips: int):
        self.program = program
        self.profile = profile
        self.unknown_trips = unknown_trips
        self.clock = dict.fromkeys(_COUNTERS, 0.0)
        self.streams: dict[int, float] = {0: 0.0}
        self.ready: dict[str, float] = {}
        self.region_stream: dict[str, int] = {}
        self.unknown_loops: set[str] = set()

    # -- the device
    def _run(self, start: float, cost: KernelCost, graphs: bool = False) -> float:
        work = cost.work(self.profile)
        duration = max(work, self.profile.floor_s(graphs))
        begin_work = max(start, self.clock["device_free"])
        self.clock["device_free"] = begin_work + work
        self.clock["device_seconds"] += duration
        return max(start + duration, begin_work + work)

    def _operands_ready(self, instruction: Instruction) -> float:
        return max((self.ready.get(o, 0.0) for o in instruction.operands), default=0.0)

    # -- sequences on streams, one kernel launched at a time
    def sequence(self, computation: str, stream: int, graphs: bool) -> None:
        for item in self.program.items(computation, graphs):
            self.item(item, computation, stream, graphs)

    def item(self, item: _Item, computation: str, stream: int, graphs: bool) -> None:
        instruction = item.instruction
        kind = item.kind
        if kind == "value":
            self.ready[instruction.name] = self._operands_ready(instruction)
        elif kind == "kernel":
            self.clock["host"] += self.profile.launch_s
            self.clock["launches"] += 1
            begin = max(self.clock["host"], self.streams.setdefault(stream, 0.0))
            end = self._run(begin, self.program.costs.kernel(instruction, computation))
            self.streams[stream] = self.ready[instruction.name] = end
        elif kind == "start":
            self.clock["host"] += self.profile.event_s
            side = item.stream
            self.region_stream[instruction.name] = side
            self.streams[side] = max(self.streams.get(side, 0.0),
                                     self.streams.setdefault(stream, 0.0))
            for callee in item.callees:
                self.sequence(callee, side, graphs=False)  # never captured inside
            self.ready[instruction.name] = self.streams[side]
        elif kind == "done":
            self.clock["host"] += self.profile.event_s
            side = self.region_stream.get(instruction.operands[0] if instruction.operands
                                          else "", stream)
            self.streams[stream] = max(self.streams.setdefault(stream, 0.0),
                                       self.streams.get(side, 0.0))
            self.ready[instruction.name] = self.streams[stream]
        elif kind == "call":
            for callee in item.callees:
                self.sequence(callee, stream, graphs)
            self.ready[instruction.name] = self.streams.setdefault(stream, 0.0)
        elif kind == "conditional":
            self._sync(stream)
            branch = self._dearest(item.callees)
            if branch:
                self.sequence(branch, stream, graphs)
            self.ready[instruction.name] = self.streams[stream]
        elif kind == "while":
            self._while(item, stream, graphs)
        elif kind == "graph":
            self._graph(item, computation, stream)

    def _sync(self, stream: int) -> None:
        self.clock["host"] = max(self.clock["host"], self.streams.setdefault(stream, 0.0)) \
            + self.profile.sync_s
        self.clock["host_syncs"] += 1

    def _dearest(self, branches: Iterable[str]) -> str | None:
        return _dearest(self.program, self.profile, branches)

    def _state(self) -> dict[Any, float]:
        return {**self.clock, **{("stream", k): v for k, v in self.streams.items()}}

    def _set_state(self, state: Mapping[Any, float]) -> None:
        for key, value in state.items():
            if isinstance(key, tuple):
                self.streams[key[1]] = value
            else:
                self.clock[key] = value

    def _while(self, item: _Item, stream: int, graphs: bool) -> None:
        body, condition = item.callees
        known = item.trips is not None
        trips = item.trips if item.trips is not None else self.unknown_trips
        if not known:
            self.unknown_loops.add(item.instruction.name)

        def trip() -> None:
            if not known:
                self.sequence(condition, stream, graphs)
                self._sync(stream)
            self.sequence(body, stream, graphs)

        states = [self._state()]
        replayed = 0
        while replayed < min(trips, 3):
            trip()
            replayed += 1
            states.append(self._state())
        if trips > replayed:
            last, before = states[-1], states[-2]
            step = {key: last[key] - before.get(key, 0.0) for key in last}
            self._set_state({key: last[key] + step[key] * (trips - replayed) for key in last})
        if not known:  # the last condition, which says stop
            self.sequence(condition, stream, graphs)
            self._sync(stream)
        self.ready[item.instruction.name] = self.streams.setdefault(stream, 0.0)

    # -- one CUDA graph
    def _graph(self, item: _Item, computation: str, stream: int) -> None:
        nodes: list[tuple[Instruction, str, tuple[str, ...]]] = []
        self._flatten(item.members, computation, nodes, {})
        kernels = sum(instruction.opcode != "__value__" for instruction, _, _ in nodes)
        mode = self.program.mode
        self.clock["host"] += self.profile.graph_launch_s + self.profile.node_s(mode) * kernels
        self.clock["graph_launches"] += 1
        self.clock["launches"] += kernels
        begin = max(self.clock["host"], self.streams.setdefault(stream, 0.0))
        branching = mode.branching
        queues = max(1, self.profile.hardware_queues)
        ready: dict[str, float] = {}
        end = chain = barrier = begin
        in_flight: list[float] = []  # small nodes still running beside others
        for instruction, where, inputs in nodes:
            if instruction.opcode == "__value__":
                ready[instruction.name] = max((ready.get(i, begin) for i in inputs),
                                              default=begin)
                continue
            cost = self.program.costs.kernel(instruction, where)
            if branching and not cost.serial:
                start = max([barrier, *(ready.get(i, begin) for i in inputs)])
                while in_flight and in_flight[0] <= start:
                    heapq.heappop(in_flight)
                if len(in_flight) >= queues:  # every hardware queue busy
                    start = max(start, heapq.heappop(in_flight))
            else:  # a chain, or a kernel that fills the GPU: after everything before
                start = end if branching else chain
            if branching and start < end:  # beside a node still running
                self.clock["concurrent_kernels"] += 1
            finish = self._run(start, cost, graphs=True)
            ready[instruction.name] = chain = finish
            if branching and not cost.serial:
                heapq.heappush(in_flight, finish)
            else:
                barrier = finish
                in_flight.clear()
            end = max(end, finish)
        self.streams[stream] = end

    def _flatten(self, items: Sequence[_Item], computation: str,
                 nodes: list[tuple[Instruction, str, tuple[str, ...]]],
                 params: dict[str, tuple[str, ...]]) -> None:
        """Kernel nodes of captured items, each with the values it waits for."""

        def inputs(instruction: Instruction) -> tuple[str, ...]:
            found: list[str] = []
            for operand in instruction.operands:
                found.extend(params.get(operand, (operand,)))
            return tuple(found)

        def value(name: str, waits: tuple[str, ...]) -> None:
            nodes.append((Instruction(name, "__value__", (), ""), computation, waits))

        for item in items:
            instruction = item.instruction
            if item.kind == "kernel":
                nodes.append((instruction, computation, inputs(instruction)))
            elif item.kind in ("start", "call", "conditional"):
                callees = item.callees
                args = list(instruction.operands)
                if item.kind == "conditional":
                    branch = self._dearest(callees)
                    callees = (branch,) if branch else ()
                    index = list(item.callees).index(branch) if branch else 0
                    args = args[index + 1:index + 2]
                for callee in callees:
                    inner = {p.name: inputs(Instruction("", "", tuple(args[k:k + 1]), ""))
                             for k, p in _parameters(self.program.module, callee)}
                    self._flatten(self.program.items(callee, False), callee, nodes, inner)
                    root = self.program.module.root(callee)
                    value(instruction.name, (root.name,) if root else ())
            elif item.kind == "done":
                value(instruction.name, inputs(instruction))
            elif item.kind == "value":
                if instruction.opcode == "parameter" and instruction.name in params:
                    value(instruction.name, params[instruction.name])
                else:
                    value(instruction.name, inputs(instruction))


def _dearest(program: _Program, profile: GpuProfile, branches: Iterable[str]) -> str | None:
    """The branch whose kernels, launched one by one, take longest."""
    def serial(name: str) -> float:
        return sum(profile.launch_s + program.costs.kernel(i.instruction, name)
                   .duration(profile) for i in program.items(name, False) if i.kind == "kernel")
    return max(branches, key=serial, default=None)


def _parameters(module: Module, computation: str) -> list[tuple[int, Instruction]]:
    found = module.by_name.get(computation)
    if found is None:
        return []
    return [(int(hlo.int_list(i.arguments)[0]) if hlo.int_list(i.arguments) else 0, i)
            for i in found.instructions if i.opcode == "parameter"]


# --------------------------------------------------------------------------- regions


def _regions(module: Module, program: _Program, entry: str) -> tuple[RegionFigures, ...]:
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


def _kernels(program: _Program, items: Iterable[_Item]) -> int:
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


def _host_blocking(program: _Program, computation: str, seen: frozenset[str]) -> list[str]:
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
            (``_gpu_model.gpu_profile``: a calibration profile replaces the built-in figures).
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
    program = _Program(module, _Costs(module, profile), mode)
    replay = _Replay(program, profile, unknown_trips)
    replay.sequence(entries[0], 0, graphs=True)
    finish = max(replay.clock["host"], *replay.streams.values())
    return Estimate(
        seconds=finish, launches=round(replay.clock["launches"]),
        graph_launches=round(replay.clock["graph_launches"]),
        concurrent_kernels=round(replay.clock["concurrent_kernels"]),
        host_syncs=round(replay.clock["host_syncs"]),
        unknown_trip_loops=len(replay.unknown_loops),
        device_seconds=replay.clock["device_seconds"],
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
