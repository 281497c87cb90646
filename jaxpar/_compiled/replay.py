"""The replay of a compiled program's thunk sequences on the GPU model (``estimate``'s
engine): a host thread that enqueues kernels in XLA's order, and the one GPU simulator
jaxpar has (``_model.gpu_simulator``: the device shared by CUDA streams that run kernels in
order, and the node order of a CUDA graph), plus host syncs and loops replayed trip by
trip (three trips, the rest extrapolated). ``estimate`` says what each step models and
where its figures come from; ``_model.gpu_simulator`` says why the host is modelled here and
not there (the planner, ``_plan.modes``, runs the same simulator on a jaxpr).

Example::

    replay = Replay(program, profile, unknown_trips=1)
    replay.sequence(entry, 0, graphs=True)
    max(replay.clock["host"], *replay.streams.ends.values())   # seconds per run
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .._model.gpu import GpuProfile
from .._model.gpu_simulator import Device, LaunchSequence, Streams
from . import hlo
from .hlo import Instruction, Module
from .kernels import KernelCost
from .thunks import Item, Program

_COUNTERS = ("host", "launches", "graph_launches", "host_syncs", "concurrent_kernels")


class Replay:
    """Replays thunk sequences on the host/stream/device model."""

    def __init__(self, program: Program, profile: GpuProfile, unknown_trips: int):
        self.program = program
        self.profile = profile
        self.unknown_trips = unknown_trips
        self.clock = dict.fromkeys(_COUNTERS, 0.0)
        self.device = Device()
        self.streams = Streams({0: 0.0})
        self.ready: dict[str, float] = {}
        self.region_stream: dict[str, int] = {}
        self.unknown_loops: set[str] = set()

    # -- a kernel's work and floor
    def _figures(self, cost: KernelCost, graphs: bool = False) -> tuple[float, float]:
        work = cost.work(self.profile)
        return work, max(work, self.profile.floor_s(graphs))

    def _operands_ready(self, instruction: Instruction) -> float:
        return max((self.ready.get(o, 0.0) for o in instruction.operands), default=0.0)

    # -- sequences on streams, one kernel launched at a time
    def sequence(self, computation: str, stream: int, graphs: bool) -> None:
        for item in self.program.items(computation, graphs):
            self.item(item, computation, stream, graphs)

    def item(self, item: Item, computation: str, stream: int, graphs: bool) -> None:
        instruction = item.instruction
        kind = item.kind
        if kind == "value":
            self.ready[instruction.name] = self._operands_ready(instruction)
        elif kind == "kernel":
            self.clock["host"] += self.profile.launch_s
            self.clock["launches"] += 1
            work, duration = self._figures(self.program.costs.kernel(instruction, computation))
            self.ready[instruction.name] = self.streams.run(
                self.device, stream, self.clock["host"], work, duration)
        elif kind == "start":
            self.clock["host"] += self.profile.event_s
            side = item.stream
            self.region_stream[instruction.name] = side
            self.streams.wait(side, stream)
            for callee in item.callees:
                self.sequence(callee, side, graphs=False)  # never captured inside
            self.ready[instruction.name] = self.streams.ends[side]
        elif kind == "done":
            self.clock["host"] += self.profile.event_s
            side = self.region_stream.get(instruction.operands[0] if instruction.operands
                                          else "", stream)
            self.ready[instruction.name] = self.streams.wait(stream, side)
        elif kind == "call":
            for callee in item.callees:
                self.sequence(callee, stream, graphs)
            self.ready[instruction.name] = self.streams.at(stream)
        elif kind == "conditional":
            self._sync(stream)
            branch = self._dearest(item.callees)
            if branch:
                self.sequence(branch, stream, graphs)
            self.ready[instruction.name] = self.streams.ends[stream]
        elif kind == "while":
            self._while(item, stream, graphs)
        elif kind == "graph":
            self._graph(item, computation, stream)

    def _sync(self, stream: int) -> None:
        self.clock["host"] = max(self.clock["host"], self.streams.at(stream)) \
            + self.profile.sync_s
        self.clock["host_syncs"] += 1

    def _dearest(self, branches: Iterable[str]) -> str | None:
        return _dearest(self.program, self.profile, branches)

    def _state(self) -> dict[Any, float]:
        return {**self.clock, "device_free": self.device.free,
                "device_seconds": self.device.busy,
                **{("stream", k): v for k, v in self.streams.ends.items()}}

    def _set_state(self, state: Mapping[Any, float]) -> None:
        for key, value in state.items():
            if isinstance(key, tuple):
                self.streams.ends[key[1]] = value
            elif key == "device_free":
                self.device.free = value
            elif key == "device_seconds":
                self.device.busy = value
            else:
                self.clock[key] = value

    def _while(self, item: Item, stream: int, graphs: bool) -> None:
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
        self.ready[item.instruction.name] = self.streams.at(stream)

    # -- one CUDA graph
    def _graph(self, item: Item, computation: str, stream: int) -> None:
        nodes: list[tuple[Instruction, str, tuple[str, ...]]] = []
        self._flatten(item.members, computation, nodes, {})
        kernels = sum(instruction.opcode != "__value__" for instruction, _, _ in nodes)
        mode = self.program.mode
        self.clock["host"] += self.profile.graph_launch_s + self.profile.node_s(mode) * kernels
        self.clock["graph_launches"] += 1
        self.clock["launches"] += kernels
        begin = max(self.clock["host"], self.streams.at(stream))
        branching = mode.branching
        sequence = LaunchSequence(branching, self.profile.hardware_queues, begin)
        ready: dict[str, float] = {}
        for instruction, where, inputs in nodes:
            at = max((ready.get(i, begin) for i in inputs), default=begin)
            if instruction.opcode == "__value__":
                ready[instruction.name] = at
                continue
            cost = self.program.costs.kernel(instruction, where)
            start = sequence.start(at, cost.serial)
            if branching and start < sequence.end:  # beside a node still running
                self.clock["concurrent_kernels"] += 1
            work, duration = self._figures(cost, graphs=True)
            finish = ready[instruction.name] = self.device.run(start, work, duration)
            sequence.finished(finish, cost.serial)
        self.streams.ends[stream] = sequence.end

    def _flatten(self, items: Sequence[Item], computation: str,
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


def _dearest(program: Program, profile: GpuProfile, branches: Iterable[str]) -> str | None:
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
