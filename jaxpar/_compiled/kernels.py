"""Kernel costs of a compiled HLO module (``estimate``'s first step): each launched
kernel's roofline work (tensor-core seconds, other flops, bytes read and written) and
whether it fills the GPU (``serial``). Figures are the GPU model's (``_model.gpu``).

Example::

    costs = KernelCosts(module, gpu_profile("h200"))
    costs.kernel(instruction, computation).work(costs.profile)   # seconds

Sharp edges:
  * Bytes read count only the slice a ``dynamic-slice``/``slice``/``gather`` takes of a
    fusion's parameter, and nothing for the buffer a ``dynamic-update-slice`` updates in
    place; a library call without a known target is costed by bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re

from .._model.gpu import CONCURRENT_REGION_BYTES, GpuProfile
from . import hlo
from .hlo import Computation, Instruction, Module


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
CAPTURABLE_CUSTOM_CALL = re.compile(r"cublas|cudnn|triton|gemm", re.IGNORECASE)
LAUNCHED_OPCODES = frozenset({"fusion", "custom-call", "copy"})


class KernelCosts:
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
        if CAPTURABLE_CUSTOM_CALL.search(target) and operands:
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
