"""The text of a compiled HLO module, parsed: computations of instructions, each with its
name, opcode, result shape, operands and attributes, and the questions ``schedule`` and
``estimate`` both ask of them (what an instruction calls, its frontend attributes and
backend config, how many kernels a computation launches, which shapes hold how many bytes).

Example::

    from jaxpar._compiled import hlo

    _, computations = hlo.parse_computations(compile_for_gpu(f, x))
    module = hlo.Module(computations)
    entry = next(c.name for c in computations if c.is_entry)
    module.count_kernels(entry)           # fusions and custom calls one run launches
    hlo.called(module.root(entry).attributes, "to_apply", "calls")

Sharp edges:
    - The text format moves between XLA versions (jaxlib 0.10.2 to 0.12 are read; see
      ``schedule`` for the async syntaxes). Lines that are not instructions are skipped,
      as is an instruction without an operand list.
    - Attribute values are text: ``attribute`` returns a bracketed value without its
      brackets and a quoted one without its quotes; nothing is parsed further.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Instruction:
    """One instruction line: ``%name = shape opcode(arguments), attributes``."""

    name: str  # without ``%``
    opcode: str
    operands: tuple[str, ...]
    attributes: str  # the text after the operand list
    shape: str = ""  # the result shape, e.g. ``f32[8,128]{1,0}`` or a parenthesised tuple
    arguments: str = ""  # the text inside the operand list, e.g. ``0`` for ``parameter(0)``


@dataclass(frozen=True, slots=True)
class Computation:
    """One computation: its instructions in text (for a scheduled module, schedule) order."""

    name: str
    is_entry: bool
    execution_thread: str | None
    instructions: tuple[Instruction, ...]


_COMPUTATION_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s+\(.*\{\s*$")
_COMPUTATION_END = re.compile(r'^\}(?:,\s*execution_thread="([^"]*)")?')
_INSTRUCTION_HEAD = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s+=\s+")
_OPERAND_NAME = re.compile(r"%([^\s,()]+)")
_ATTRIBUTE_PAIR = re.compile(r'([\w.$-]+)="((?:[^"\\]|\\.)*)"')

# Opcodes of the collectives (a ``-start``/``-done`` pair is one of them split in two).
COLLECTIVES = frozenset(
    {
        "all-gather",
        "all-reduce",
        "all-to-all",
        "collective-broadcast",
        "collective-permute",
        "ragged-all-to-all",
        "reduce-scatter",
        "send",
        "recv",
    }
)
# Instructions that launch one kernel each (``Module.count_kernels``).
KERNEL_OPCODES = frozenset({"fusion", "custom-call"})
_GEMM_TARGET = re.compile(r"gemm|matmul|cublas|conv", re.IGNORECASE)


def _skip_balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``; honours quotes."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = [pairs[text[start]]]
    position = start + 1
    in_string = False
    while position < len(text) and stack:
        char = text[position]
        if in_string:
            if char == "\\":
                position += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in pairs:
            stack.append(pairs[char])
        elif char == stack[-1]:
            stack.pop()
        position += 1
    return position


def parse_instruction(line: str) -> Instruction | None:
    """The instruction on ``line``, or None where it holds none."""
    head = _INSTRUCTION_HEAD.match(line)
    if head is None:
        return None
    position = head.end()
    shape_start = position
    # The shape: a tuple shape is parenthesised and may hold spaces.
    if line.startswith("(", position):
        position = _skip_balanced(line, position)
    else:
        while position < len(line) and not line[position].isspace():
            position = _skip_balanced(line, position) if line[position] in "{[" else position + 1
    shape = line[shape_start:position].strip()
    position += 1
    paren = line.find("(", position)
    if paren < 0:
        return None
    opcode = line[position:paren].strip()
    end = _skip_balanced(line, paren)
    operands = tuple(_OPERAND_NAME.findall(line[paren + 1 : end - 1]))
    return Instruction(
        head.group(1), opcode, operands, line[end:], shape, line[paren + 1 : end - 1]
    )


def attribute(attributes: str, key: str) -> str | None:
    """The value of ``key=`` in an instruction's ``attributes`` text: a bracketed one
    (``frontend_attributes={...}``) without its brackets, a quoted one without its quotes;
    None where ``key`` is absent."""
    match = re.search(rf"(?:^|[\s,]){re.escape(key)}=", attributes)
    if match is None:
        return None
    start = match.end()
    if start < len(attributes) and attributes[start] in "{(":
        return attributes[start + 1 : _skip_balanced(attributes, start) - 1]
    value = re.match(r'"((?:[^"\\]|\\.)*)"|([^\s,]+)', attributes[start:])
    if value is None:
        return None
    return value.group(1) if value.group(1) is not None else value.group(2)


def called(attributes: str, *keys: str) -> tuple[str, ...]:
    """The computations named by ``keys`` (``to_apply``, ``calls``, ``body``, ...), without
    ``%``, in the order of ``keys``."""
    names: list[str] = []
    for key in keys:
        value = attribute(attributes, key)
        if value:
            names.extend(name.lstrip("%") for name in re.split(r"[\s,]+", value) if name)
    return tuple(names)


def frontend_attributes(instruction: Instruction) -> dict[str, str]:
    """``frontend_attributes={k="v",...}`` as a dict (empty where there are none)."""
    group = attribute(instruction.attributes, "frontend_attributes")
    return dict(_ATTRIBUTE_PAIR.findall(group)) if group else {}


def backend_config(instruction: Instruction) -> dict[str, Any]:
    """The JSON of ``backend_config={...}`` (empty where absent or not JSON)."""
    group = attribute(instruction.attributes, "backend_config")
    if not group:
        return {}
    try:
        parsed = json.loads("{" + group + "}")
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def parse_computations(hlo_text: str) -> tuple[str, list[Computation]]:
    """The ``HloModule`` name (``""`` where the text has none) and every computation, in
    text order."""
    module_name = ""
    computations: list[Computation] = []
    current: tuple[str, bool, list[Instruction]] | None = None
    for line in hlo_text.splitlines():
        if line.startswith("HloModule "):
            module_name = line.split()[1].rstrip(",")
            continue
        if current is None:
            header = _COMPUTATION_HEADER.match(line)
            if header:
                current = (header.group(2), bool(header.group(1)), [])
            continue
        end = _COMPUTATION_END.match(line)
        if end:
            name, is_entry, instructions = current
            computations.append(Computation(name, is_entry, end.group(1), tuple(instructions)))
            current = None
            continue
        instruction = parse_instruction(line)
        if instruction is not None:
            current[2].append(instruction)
    return module_name, computations


def known_trip_count(instruction: Instruction) -> int | None:
    """A ``while``'s ``backend_config`` ``"known_trip_count":{"n":...}``, or None."""
    trip = backend_config(instruction).get("known_trip_count")
    if isinstance(trip, dict) and "n" in trip:
        try:
            return int(trip["n"])
        except (TypeError, ValueError):
            return None
    return None


class Module:
    """Index over parsed computations, for the recursive questions ``schedule`` and
    ``estimate`` ask (what a computation's root is, whether it holds a matmul, how many
    kernels it launches)."""

    def __init__(self, computations: Sequence[Computation]) -> None:
        self.by_name = {c.name: c for c in computations}

    def root(self, name: str | None) -> Instruction | None:
        """The last instruction of computation ``name``, or None."""
        computation = self.by_name.get(name or "")
        return computation.instructions[-1] if computation and computation.instructions else None

    def contains_dot(self, name: str, seen: frozenset[str] = frozenset()) -> bool:
        """Whether computation ``name`` (or one it ``calls``) holds a matmul or convolution."""
        computation = self.by_name.get(name)
        if computation is None or name in seen:
            return False
        for instruction in computation.instructions:
            if instruction.opcode in ("dot", "convolution", "ragged-dot", "scaled-dot"):
                return True
            if self._is_gemm_custom_call(instruction):
                return True
            for callee in called(instruction.attributes, "calls"):
                if self.contains_dot(callee, seen | {name}):
                    return True
        return False

    @staticmethod
    def _is_gemm_custom_call(instruction: Instruction) -> bool:
        if instruction.opcode != "custom-call":
            return False
        target = attribute(instruction.attributes, "custom_call_target") or ""
        return bool(_GEMM_TARGET.search(target))

    def is_dot_kernel(self, instruction: Instruction) -> bool:
        """Whether a fusion or custom call launches a matmul- or convolution-bearing kernel."""
        if instruction.opcode == "custom-call":
            return self._is_gemm_custom_call(instruction) or any(
                self.contains_dot(callee)
                for callee in called(instruction.attributes, "called_computations", "calls")
            )
        if instruction.opcode == "fusion":
            return any(
                self.contains_dot(callee) for callee in called(instruction.attributes, "calls")
            )
        return False

    def _control_callees(self, instruction: Instruction) -> tuple[str, ...]:
        """Computations run as separate launches (not fused into one kernel)."""
        if instruction.opcode in ("call", "call-start", "async-start"):
            return called(instruction.attributes, "to_apply", "calls")
        if instruction.opcode == "while":
            return called(instruction.attributes, "condition", "body")
        if instruction.opcode == "conditional":
            return called(
                instruction.attributes,
                "branch_computations",
                "true_computation",
                "false_computation",
            )
        return ()

    def count_kernels(
        self, name: str, dots_only: bool = False, seen: frozenset[str] = frozenset()
    ) -> int:
        """Kernels one run of computation ``name`` launches (the matmul-bearing ones with
        ``dots_only``), through calls, loops and branches, their bodies counted once."""
        computation = self.by_name.get(name)
        if computation is None or name in seen:
            return 0
        total = 0
        for instruction in computation.instructions:
            if instruction.opcode in KERNEL_OPCODES:
                total += 1 if not dots_only or self.is_dot_kernel(instruction) else 0
            for callee in self._control_callees(instruction):
                total += self.count_kernels(callee, dots_only, seen | {name})
        return total

    def control_computations(self) -> set[str]:
        """ENTRY plus everything reachable through control flow (not fusion bodies)."""
        entries = [c.name for c in self.by_name.values() if c.is_entry]
        reachable: set[str] = set()
        pending = list(entries)
        while pending:
            name = pending.pop()
            if name in reachable or name not in self.by_name:
                continue
            reachable.add(name)
            for instruction in self.by_name[name].instructions:
                pending.extend(self._control_callees(instruction))
        return reachable


def async_kind(start: Instruction, module: Module) -> tuple[str, str | None]:
    """``(kind, collective)`` of an ``async-start`` by what it wraps: ``"collective"`` with
    the collective's opcode (or ``"collectives-group"``), ``"copy"``, else ``"compute"``."""
    attributes = frontend_attributes(start)
    wrapped = called(start.attributes, "calls")
    root = module.root(wrapped[0]) if wrapped else None
    if root is not None:
        attributes = {**frontend_attributes(root), **attributes}
    if "_collectives_group" in attributes:
        return "collective", "collectives-group"
    if root is not None and root.opcode in COLLECTIVES:
        return "collective", root.opcode
    if root is not None and root.opcode.removesuffix("-start") in COLLECTIVES:
        return "collective", root.opcode.removesuffix("-start")
    if root is not None and root.opcode == "copy":
        return "copy", None
    return "compute", None


# --------------------------------------------------------------------------- shapes

ELEMENT_BYTES = {
    "pred": 1.0, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1.0, "u8": 1.0,
    "s16": 2.0, "u16": 2.0, "f16": 2.0, "bf16": 2.0, "s32": 4.0, "u32": 4.0, "f32": 4.0,
    "s64": 8.0, "u64": 8.0, "f64": 8.0, "c64": 8.0, "c128": 16.0, "token": 0.0,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


def arrays(shape: str) -> list[tuple[str, int]]:
    """``(element type, elements)`` of every array in a (possibly tuple) shape text."""
    found = []
    for kind, sizes in _ARRAY.findall(shape):
        if kind not in ELEMENT_BYTES and not kind.startswith("f8"):
            continue
        found.append((kind, math.prod(int(d) for d in sizes.split(",") if d)))
    return found


def shape_bytes(shape: str) -> float:
    """Bytes of every array in a shape text (an unknown element type at one byte)."""
    return sum(ELEMENT_BYTES.get(t, 1.0) * n for t, n in arrays(shape))


def elements(shape: str) -> int:
    """Elements of the first array in a shape text (0 where there is none)."""
    found = arrays(shape)
    return found[0][1] if found else 0


def dims(shape: str) -> list[int]:
    """Dimensions of the first array in a shape text."""
    match = _ARRAY.search(shape)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def element_type(shape: str) -> str:
    """Element type of the first array in a shape text (``f32`` where there is none)."""
    match = _ARRAY.search(shape)
    return match.group(1) if match else "f32"


def int_list(text: str | None) -> list[int]:
    """Every integer in ``text``, e.g. ``{1,0}`` or a ``parameter``'s ``0``."""
    return [int(v) for v in re.findall(r"-?\d+", text or "")]
