"""A compiled computation as XLA:GPU runs it: a sequence of thunks (kernels, the start
and done of a stream region, loops, conditionals, calls), with runs of capturable thunks
made CUDA graphs in the assumed mode (``Program.items``).

Example::

    program = Program(module, KernelCosts(module, profile), CommandBufferMode.LHS)
    [item.kind for item in program.items("main", graphs=True)]   # "graph", "kernel", ...

Sharp edges:
  * CUDA-graph capture is read from XLA's source (docs/gpu_evidence.md, section 1.7),
    not seen on a GPU yet: runs of at least ``MIN_GRAPH_SIZE`` capturable thunks; a
    ``while`` is never captured, nor anything inside a region that holds one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .._model.gpu import MIN_GRAPH_SIZE, CommandBufferMode
from . import hlo
from .hlo import Instruction, Module
from .kernels import CAPTURABLE_CUSTOM_CALL, LAUNCHED_OPCODES, KernelCosts


@dataclasses.dataclass(frozen=True, slots=True)
class Item:
    """One step of a computation's thunk sequence."""

    kind: str  # kernel | start | done | while | conditional | call | graph | value
    instruction: Instruction
    callees: tuple[str, ...] = ()
    stream: int = 0
    trips: int | None = None
    members: tuple[Item, ...] = ()  # for "graph": the captured items


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


class Program:
    """Thunk sequences of a module, with CUDA-graph capture decided per sequence."""

    def __init__(self, module: Module, costs: KernelCosts, mode: CommandBufferMode):
        self.module = module
        self.costs = costs
        self.mode = mode
        self._memo: dict[tuple[str, bool], tuple[Item, ...]] = {}
        self._capturable: dict[str, bool] = {}

    def items(self, computation: str, graphs: bool) -> tuple[Item, ...]:
        key = (computation, graphs and self.mode is not CommandBufferMode.OFF)
        if key not in self._memo:
            raw = self._raw_items(computation)
            self._memo[key] = self._capture(raw) if key[1] else raw
        return self._memo[key]

    def _raw_items(self, name: str) -> tuple[Item, ...]:
        computation = self.module.by_name.get(name)
        if computation is None:
            return ()
        items = []
        for instruction in computation.instructions:
            opcode = instruction.opcode
            if opcode in LAUNCHED_OPCODES:
                items.append(Item("kernel", instruction))
            elif _is_compute_start(instruction, self.module):
                region = _region_of(instruction, self.module)
                items.append(Item("start", instruction, (region,) if region else (),
                                   stream=_stream_of(instruction, self.module)))
            elif opcode in ("call-done", "async-done"):
                items.append(Item("done", instruction))
            elif opcode == "while":
                body = hlo.called(instruction.attributes, "body")
                condition = hlo.called(instruction.attributes, "condition")
                items.append(Item("while", instruction, (body[0] if body else "",
                                                          condition[0] if condition else ""),
                                   trips=hlo.known_trip_count(instruction)))
            elif opcode == "conditional":
                branches = hlo.called(instruction.attributes, "branch_computations",
                                               "true_computation", "false_computation")
                items.append(Item("conditional", instruction, branches))
            elif opcode == "call":
                items.append(Item("call", instruction, hlo.called(
                    instruction.attributes, "to_apply")))
            elif (opcode in hlo.COLLECTIVES or opcode.endswith("-start")) \
                    and opcode not in ("send", "recv"):
                items.append(Item("kernel", instruction))  # costed by bytes, in order
            else:
                items.append(Item("value", instruction))
        return tuple(items)

    def capturable(self, computation: str) -> bool:
        """Whether every thunk of ``computation`` (recursively) can live in a CUDA graph."""
        if computation not in self._capturable:
            self._capturable[computation] = False  # recursion guard
            self._capturable[computation] = all(
                self._item_capturable(item) for item in self._raw_items(computation))
        return self._capturable[computation]

    def _item_capturable(self, item: Item) -> bool:
        if item.kind == "kernel":
            opcode = item.instruction.opcode
            if opcode in ("fusion", "copy"):
                return True
            if opcode == "custom-call":
                target = hlo.attribute(item.instruction.attributes,
                                                      "custom_call_target") or ""
                return bool(CAPTURABLE_CUSTOM_CALL.search(target))
            return False  # collectives are not a default command type
        if item.kind in ("start", "conditional", "call"):
            return all(self.capturable(c) for c in item.callees)
        if item.kind == "done":
            return True  # decided with its start
        return item.kind == "value"  # a while is never captured (WHILE is off)

    def _capture(self, items: tuple[Item, ...]) -> tuple[Item, ...]:
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
        captured: list[Item] = []
        cursor = 0
        for lo, hi in _runs(flags):
            thunks = sum(items[k].kind != "value" for k in range(lo, hi))
            if thunks < MIN_GRAPH_SIZE:
                continue
            captured.extend(items[cursor:lo])
            captured.append(Item("graph", items[lo].instruction, members=items[lo:hi]))
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
