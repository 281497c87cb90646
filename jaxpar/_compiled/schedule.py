"""Read the schedule of a compiled GPU program from its HLO text.

``parse_schedule`` turns the scheduled HLO that ``jaxpar._compiled.gpu_compile.compile_for_gpu``
returns into frozen dataclasses: per computation, the asynchronous starts and dones in
schedule order (stream-annotated calls, collectives), their stream ids, how many are in
flight at once, kernels between them, and ``while`` loops with their known trip counts.

Example::

    from jaxpar._compiled.gpu_compile import compile_for_gpu
    from jaxpar._compiled.schedule import parse_schedule

    schedule = parse_schedule(compile_for_gpu(lambda a: jnp.tanh(a @ a), x, gpu="h200"))
    schedule.max_async_calls_in_flight  # 0: nothing was stream-annotated

Sharp edges:
    - The text format moves between XLA versions. Seen: jaxlib 0.10.2 prints
      ``call-start(...), to_apply=%c``; jaxlib 0.12.0.1 adds
      ``async_execution_thread="parallel"`` and, for some bodies, prints the region as
      ``async-start(...), calls=%async_computation`` whose root is the ``call``. A
      collective-permute start/done pair with nothing in between is printed as
      start/done with ``"is_sync":true`` on 0.10.2 and as a plain ``collective-permute``
      on 0.12.0.1. ``parse_schedule`` reads all of these.
    - Kernel counts are static and best effort: one per ``fusion`` or ``custom-call``
      instruction, nested loops counted once, ``copy`` and collectives not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import hlo
from .hlo import Computation, Instruction, Module

__all__ = [
    "AsyncEvent",
    "ComputationSchedule",
    "Schedule",
    "WhileLoop",
    "parse_schedule",
]

@dataclass(frozen=True, slots=True)
class AsyncEvent:
    """One asynchronous start or done instruction, in schedule order.

    Attributes:
        index: position of the instruction in its computation (schedule order).
        name: instruction name without ``%``.
        opcode: e.g. ``"call-start"``, ``"async-done"``, ``"collective-permute-start"``,
            ``"send"``, ``"recv-done"``.
        kind: ``"compute"`` (a stream-annotated region or other async computation),
            ``"collective"`` or ``"copy"``.
        phase: ``"start"`` or ``"done"``.
        start: name of the start this event belongs to (its own name for a start).
        collective: for collectives, the operation, e.g. ``"collective-permute"``,
            ``"all-gather"``, ``"collectives-group"``; else ``None``.
        called_computation: the computation a start runs (``to_apply``/``calls``), if any.
        frontend_attributes: ``(key, value)`` pairs, sorted by key.
        stream_annotation: ``_xla_stream_annotation`` value, if any.
        scheduling_group_id: ``_scheduling_group_id`` value, if any.
        collectives_group: ``_collectives_group`` value, if any (often ``""``).
        is_sync: ``collective_backend_config.is_sync`` from the backend config, if present.
    """

    index: int
    name: str
    opcode: str
    kind: str
    phase: str
    start: str
    collective: str | None
    called_computation: str | None
    frontend_attributes: tuple[tuple[str, str], ...]
    stream_annotation: str | None
    scheduling_group_id: str | None
    collectives_group: str | None
    is_sync: bool | None

    @property
    def stream_id(self) -> int | None:
        """The stream annotation as an int, or ``None`` (absent or e.g. ``"collective"``)."""
        if self.stream_annotation is None:
            return None
        try:
            return int(self.stream_annotation)
        except ValueError:
            return None


@dataclass(frozen=True, slots=True)
class WhileLoop:
    """A ``while`` instruction and what the GPU does per iteration.

    Attributes:
        name: instruction name.
        computation: computation holding the ``while``.
        body: body computation name.
        condition: condition computation name.
        known_trip_count: from ``backend_config`` ``"known_trip_count":{"n":...}``; ``None``
            means XLA does not know it, so the GPU copies the predicate to the host and
            waits every iteration.
        body_kernels: kernel launches (``fusion``/``custom-call``) per iteration of the body,
            following nested ``call``/async/``conditional``/``while`` computations once each.
        condition_kernels: the same for the condition.
    """

    name: str
    computation: str
    body: str
    condition: str
    known_trip_count: int | None
    body_kernels: int
    condition_kernels: int


@dataclass(frozen=True, slots=True)
class ComputationSchedule:
    """Asynchronous events of one computation, in schedule order.

    Attributes:
        name: computation name.
        is_entry: whether this is the ENTRY computation.
        execution_thread: ``execution_thread`` printed after the computation, if any.
        instruction_count: number of instructions.
        events: async starts and dones in order (``async-update`` is left out).
        kernels: number of ``fusion``/``custom-call`` instructions directly in it.
        synchronous_collectives: names of collectives not split into start/done.
        max_async_calls_in_flight: most compute regions started and not yet done at once.
        max_collectives_in_flight: most collectives started and not yet done at once;
            starts whose backend config says ``"is_sync":true`` do not count.
        dot_kernels_during_collectives: GEMM-bearing kernels issued while a collective is in
            flight (a ``call-start`` counts the GEMM kernels of its region).
    """

    name: str
    is_entry: bool
    execution_thread: str | None
    instruction_count: int
    events: tuple[AsyncEvent, ...]
    kernels: int
    synchronous_collectives: tuple[str, ...]
    max_async_calls_in_flight: int
    max_collectives_in_flight: int
    dot_kernels_during_collectives: int


@dataclass(frozen=True, slots=True)
class Schedule:
    """The schedule of a compiled HLO module, as ``parse_schedule`` reads it.

    Attributes:
        module_name: the ``HloModule`` name.
        entry: name of the ENTRY computation.
        computations: every non-fused computation, in text order (fusion bodies and
            reducers are left out: they run inside one kernel).
        while_loops: every ``while`` instruction.
        max_async_calls_in_flight: maximum over computations.
        max_collectives_in_flight: maximum over computations.
        stream_ids: integer stream annotations on async starts.
        dot_kernels_during_collectives: sum over computations.
        kernels: kernels one run of ENTRY launches, loop and branch bodies counted once
            (``fusion`` / ``custom-call`` instructions, through calls, loops and branches).
        dot_kernels: the matmul- or convolution-bearing ones among ``kernels``.
    """

    module_name: str
    entry: str
    computations: tuple[ComputationSchedule, ...]
    while_loops: tuple[WhileLoop, ...]
    max_async_calls_in_flight: int
    max_collectives_in_flight: int
    stream_ids: frozenset[int]
    dot_kernels_during_collectives: int
    kernels: int = 0
    dot_kernels: int = 0

    def computation(self, name: str) -> ComputationSchedule:
        """Returns the computation called ``name`` (with or without ``%``)."""
        name = name.lstrip("%")
        for computation in self.computations:
            if computation.name == name:
                return computation
        raise KeyError(
            f"no scheduled computation {name!r}; have {[c.name for c in self.computations]}"
        )

    @property
    def entry_schedule(self) -> ComputationSchedule:
        """The ENTRY computation's schedule."""
        return self.computation(self.entry)

    @property
    def events(self) -> tuple[AsyncEvent, ...]:
        """All async events, computation by computation."""
        return tuple(event for c in self.computations for event in c.events)


def _classify(instruction: Instruction) -> tuple[str, str, str | None] | None:
    """``(kind, phase, collective)`` for async start/done instructions, else ``None``."""
    opcode = instruction.opcode
    if opcode in ("send", "recv"):
        return "collective", "start", opcode
    if opcode in ("send-done", "recv-done"):
        return "collective", "done", opcode.removesuffix("-done")
    if opcode.endswith("-start"):
        base, phase = opcode.removesuffix("-start"), "start"
    elif opcode.endswith("-done"):
        base, phase = opcode.removesuffix("-done"), "done"
    else:
        return None
    if base == "call":
        return "compute", phase, None
    if base == "copy":
        return "copy", phase, None
    if base in hlo.COLLECTIVES:
        return "collective", phase, base
    return "compute", phase, None  # async-start: refined by hlo.async_kind


def _schedule_computation(computation: Computation, module: Module) -> ComputationSchedule:
    events: list[AsyncEvent] = []
    starts: dict[str, AsyncEvent] = {}
    in_flight: dict[str, str] = {}  # start name -> kind
    max_compute = max_collectives = dots_during = kernels = 0
    synchronous: list[str] = []
    for index, instruction in enumerate(computation.instructions):
        if instruction.opcode in hlo.KERNEL_OPCODES:
            kernels += 1
        collectives_now = sum(kind == "collective" for kind in in_flight.values())
        if collectives_now and module.is_dot_kernel(instruction):
            dots_during += 1
        if instruction.opcode in hlo.COLLECTIVES and instruction.opcode not in ("send", "recv"):
            synchronous.append(instruction.name)
        classified = _classify(instruction)
        if classified is None or instruction.opcode == "async-update":
            continue
        kind, phase, collective = classified
        if phase == "done":
            start_name = instruction.operands[0] if instruction.operands else ""
            start_event = starts.get(start_name)
            if start_event is not None:
                kind, collective = start_event.kind, start_event.collective
            in_flight.pop(start_name, None)
        else:
            start_name = instruction.name
            if instruction.opcode == "async-start":
                kind, collective = hlo.async_kind(instruction, module)
        attributes = hlo.frontend_attributes(instruction)
        called = hlo.called(instruction.attributes, "to_apply", "calls")
        if instruction.opcode == "async-start" and called:
            root = module.root(called[0])
            if root is not None and root.opcode == "call":
                inner = hlo.called(root.attributes, "to_apply")
                called = inner or called
                attributes = {**hlo.frontend_attributes(root), **attributes}
        collective_config = hlo.backend_config(instruction).get("collective_backend_config", {})
        is_sync = collective_config.get("is_sync") if isinstance(collective_config, dict) else None
        event = AsyncEvent(
            index=index,
            name=instruction.name,
            opcode=instruction.opcode,
            kind=kind,
            phase=phase,
            start=start_name,
            collective=collective,
            called_computation=called[0] if called and phase == "start" else None,
            frontend_attributes=tuple(sorted(attributes.items())),
            stream_annotation=attributes.get("_xla_stream_annotation"),
            scheduling_group_id=attributes.get("_scheduling_group_id"),
            collectives_group=attributes.get("_collectives_group"),
            is_sync=is_sync if isinstance(is_sync, bool) else None,
        )
        events.append(event)
        if phase == "start":
            starts[start_name] = event
            if event.is_sync is not True:  # XLA runs "is_sync" ones on the compute stream
                in_flight[start_name] = kind
            if kind == "compute" and collectives_now and event.called_computation:
                dots_during += module.count_kernels(event.called_computation, dots_only=True)
        max_compute = max(max_compute, sum(k == "compute" for k in in_flight.values()))
        max_collectives = max(max_collectives, sum(k == "collective" for k in in_flight.values()))
    return ComputationSchedule(
        name=computation.name,
        is_entry=computation.is_entry,
        execution_thread=computation.execution_thread,
        instruction_count=len(computation.instructions),
        events=tuple(events),
        kernels=kernels,
        synchronous_collectives=tuple(synchronous),
        max_async_calls_in_flight=max_compute,
        max_collectives_in_flight=max_collectives,
        dot_kernels_during_collectives=dots_during,
    )


def parse_schedule(hlo_text: str) -> Schedule:
    """Reads the async regions, collectives and loops out of scheduled HLO text.

    Args:
        hlo_text: the text of a scheduled module, e.g. from ``compile_for_gpu`` or an XLA
            ``*after_optimizations.txt`` dump.

    Returns:
        A ``Schedule``. Its computations are ENTRY and everything reachable through
        ``call``/``while``/``conditional``/async instructions, in text order; fused
        computations are left out.

    Raises:
        ValueError: the text holds no ENTRY computation.

    Example:
        >>> schedule = parse_schedule(compile_for_gpu(f, x))
        >>> schedule.max_async_calls_in_flight, sorted(schedule.stream_ids)
        (2, [1, 2])
    """
    module_name, computations = hlo.parse_computations(hlo_text)
    entries = [c.name for c in computations if c.is_entry]
    if not entries:
        raise ValueError("hlo_text holds no ENTRY computation; pass a whole HLO module's text.")
    module = Module(computations)
    control = module.control_computations()
    scheduled = tuple(_schedule_computation(c, module) for c in computations if c.name in control)
    loops = []
    for computation in computations:
        if computation.name not in control:
            continue
        for instruction in computation.instructions:
            if instruction.opcode != "while":
                continue
            body = (hlo.called(instruction.attributes, "body") or ("",))[0]
            condition = (hlo.called(instruction.attributes, "condition") or ("",))[0]
            loops.append(
                WhileLoop(
                    name=instruction.name,
                    computation=computation.name,
                    body=body,
                    condition=condition,
                    known_trip_count=hlo.known_trip_count(instruction),
                    body_kernels=module.count_kernels(body),
                    condition_kernels=module.count_kernels(condition),
                )
            )
    stream_ids = frozenset(
        event.stream_id
        for c in scheduled
        for event in c.events
        if event.phase == "start" and event.stream_id is not None
    )
    return Schedule(
        module_name=module_name,
        entry=entries[0],
        computations=scheduled,
        while_loops=tuple(loops),
        max_async_calls_in_flight=max((c.max_async_calls_in_flight for c in scheduled), default=0),
        max_collectives_in_flight=max((c.max_collectives_in_flight for c in scheduled), default=0),
        stream_ids=stream_ids,
        dot_kernels_during_collectives=sum(c.dot_kernels_during_collectives for c in scheduled),
        kernels=module.count_kernels(entries[0]),
        dot_kernels=module.count_kernels(entries[0], dots_only=True),
    )
