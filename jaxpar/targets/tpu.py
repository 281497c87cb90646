"""The TPU target: a TPU v5e's measured figures (``TPU_V5E``), a rolled trip's fixed part
and slices priced with them (``tpu_model.fixed_seconds``), loops read by blocks by cost.

It covers the TPU v5e by its device kinds (``device_kinds``) and is the fallback for a
TPU no other target module covers: ``target="auto"`` on a TPU v6e without a module of its
own plans with the v5e's figures, and its plans say so.

Its unroll rule (``by_blocks``): a scan whose body is small beside a trip's fixed part
(its control, reading each scanned input's slice, writing each output's) and which carries
no large arrays is read by blocks of ``K`` trips (``tpu_model.block_factor``): one scan
over ``L / K`` blocks whose body runs ``K`` trips on static slices of the block, so each
input is fetched once a block; ``K`` divides ``L``. On a TPU v5e that made a tiny body's
loop x0.36 of rolled, where ``lax.scan(..., unroll=32)`` gave x0.72."""

from __future__ import annotations

from .._compat import JaxprEqn
from . import Target, TargetRow
from .profile import DeviceProfile
from .tpu_model import TpuProfile, block_factor, fixed_seconds
from .unroll import ScanQuery, UnrollChoice

# Measured on one TPU v5e chip (JAX reports "TPU v5 lite"), jax 0.10.2, 2026-12-06, by
# benchmarks/calibrate_tpu.py in benchmarks/tpu.sh (medians of 5 calls of 4,000 trips;
# the run's JSON: docs/measurements/tpu-v5e-2026-12-06/calibration.json). block_ratios: a
# scan of a 64-element carry with one scanned input and one output, its time per trip read
# by blocks of K over rolled.
TPU_V5E = TpuProfile(
    chip="TPU v5e",
    measured="measured on TPU v5e (jax 0.10.2, 2026-12-06)",
    trip_s=0.191e-6,
    slice_s=0.657e-6,
    slice_bandwidth=0.795e12,
    write_s=1.285e-6,
    dot_s=0.098e-6,
    batched_dot_extra_s=0.023e-6,
    transcendental_s_per_element=3.74e-11,
    block_ratios=((2, 0.546), (8, 0.46), (16, 0.448), (25, 0.419), (40, 0.399), (80, 0.402)),
    block_limit=40,
    copy_bandwidth=0.355e12,
    peak_flops=1.63e14,
    hbm_bandwidth=8.19e11,
    hbm_bytes=16 * 2**30,  # 16 GiB of HBM2 (Cloud TPU v5e specification)
)

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
    ROW, platform="tpu", device_kinds=("TPU v5 lite", "TPU v5e"), figures_of=TPU_V5E.chip,
    # A small matmul's latency is the floor.
    profile=DeviceProfile("tpu", peak_flops=TPU_V5E.peak_flops,
                          bandwidth=TPU_V5E.hbm_bandwidth, min_kernel_seconds=TPU_V5E.dot_s,
                          trip_seconds=trip_seconds, slices_read_kept=True),
    # The plan's loops without their block reading (rolled), lax.scan's own unroll by 8
    # instead, identical scans not batched, the loops' work that reads no carry run
    # before them (with the plan's unrolling, and with lax.scan's by 8), and linear
    # recurrences as lax.associative_scan.
    candidates={
        "jaxpar without unrolling": {"unroll": None},
        "jaxpar unrolled by 8": {"unroll": 8},
        "jaxpar unrolled by 16": {"unroll": 16},
        "jaxpar without scan batching": {"batch_scans": False},
        "jaxpar with scans fused": {"fuse_scans": True},
        "jaxpar, while loops by 4": {"unroll_while": 4},
        "jaxpar, scan inputs hoisted": {"hoist_scan_inputs": True},
        "jaxpar, scan inputs hoisted, unrolled by 8": {"hoist_scan_inputs": True, "unroll": 8},
        "jaxpar, linear scans associative": {"associative_scans": True},
    },
    unroll_rule=by_blocks, rank=2)
