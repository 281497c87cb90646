"""A target's cost profile (``DeviceProfile``): the figures ``_model.cost.CostModel`` prices an
equation with; each target module declares its own (``jaxpar.targets``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .._compat import JaxprEqn
from .._model.gpu import GpuProfile


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceProfile:
    """Rough throughput figures of one device kind (``gpu``: the GPU model's, kept there)."""

    name: str
    peak_flops: float  # dense matmul flop/s
    bandwidth: float  # HBM bytes/s
    min_kernel_seconds: float  # shortest a launched kernel takes on the device
    gpu: GpuProfile | None = None  # the GPU model these figures come from, on a GPU
    # A rolled scan trip's fixed part (its control, its slices), where the device has one
    # measured (the TPU's: ``jaxpar.targets.tpu``); None: none priced.
    trip_seconds: Callable[[JaxprEqn], float] | None = None
    # A slice reads what it keeps (not its whole operand): a trip of a scan read by blocks
    # slices its block (the TPU's).
    slices_read_kept: bool = False

    @classmethod
    def for_gpu(cls, gpu: GpuProfile) -> DeviceProfile:
        """The cost model's view of a GPU: float32 dots at the tensor-core peak (JAX's
        default precision), HBM bandwidth, the kernel floor."""
        return cls("gpu", peak_flops=gpu.dot_flops("f32"), bandwidth=gpu.bandwidth,
                   min_kernel_seconds=gpu.kernel_floor_s, gpu=gpu)
