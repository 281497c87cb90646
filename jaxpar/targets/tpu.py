"""The TPU target (a v5e, measured: ``_tpu_model.TPU_V5E``): a rolled trip's fixed part
and slices priced (``_tpu_model.fixed_seconds``), loops read by blocks by cost.

Its unroll rule (``by_blocks``): a scan whose body is small beside a trip's fixed part
(its control, reading each scanned input's slice, writing each output's) and which carries
no large arrays is read by blocks of ``K`` trips (``_tpu_model.block_factor``): one scan
over ``L / K`` blocks whose body runs ``K`` trips on static slices of the block, so each
input is fetched once a block; ``K`` divides ``L``. On a TPU v5e that made a tiny body's
loop x0.36 of rolled, where ``lax.scan(..., unroll=32)`` gave x0.72."""

from __future__ import annotations

from .._compat import JaxprEqn
from .._tpu_model import TPU_V5E, block_factor, fixed_seconds
from . import Target, TargetRow
from .profile import DeviceProfile
from .unroll import ScanQuery, UnrollChoice

# Measured on a TPU v5e (benchmarks/tpu.sh, docs/benchmarks.md): batching identical
# scans and reading small loops by blocks pay; fusing different loops, batching
# members and matmuls did not (x0.99-1.25 with the GPU's pass set), so they are off.
ROW = TargetRow("tpu", ("tpu",), {"batch_scans": True, "unroll": "cost"},
                memory_bytes=TPU_V5E.hbm_bytes)


def trip_seconds(eqn: JaxprEqn) -> float:
    """A rolled trip's fixed part on a TPU v5e: its control, its slices."""
    return fixed_seconds(eqn, TPU_V5E)


def by_blocks(scan: ScanQuery) -> UnrollChoice:
    """How a TPU v5e should run the scan, by its measured figures (``block_factor``),
    within the copies the memory budget allows."""
    choice = block_factor(scan.eqn, TPU_V5E, scan.most_copies)
    return UnrollChoice(choice.factor, f"auto: {choice.reason}", blocked=choice.blocked)


TARGET = Target(
    ROW, platform="tpu",
    # A small matmul's latency is the floor.
    profile=DeviceProfile("tpu", peak_flops=TPU_V5E.peak_flops,
                          bandwidth=TPU_V5E.hbm_bandwidth, min_kernel_seconds=TPU_V5E.dot_s,
                          trip_seconds=trip_seconds, slices_read_kept=True),
    # The plan's loops without their block reading (rolled), lax.scan's own unroll by 8
    # instead, and identical scans not batched.
    candidates={
        "jaxpar without unrolling": {"unroll": None},
        "jaxpar unrolled by 8": {"unroll": 8},
        "jaxpar unrolled by 16": {"unroll": 16},
        "jaxpar without scan batching": {"batch_scans": False},
        "jaxpar with scans fused": {"fuse_scans": True},
        "jaxpar, while loops by 4": {"unroll_while": 4},
    },
    unroll_rule=by_blocks, rank=2)
