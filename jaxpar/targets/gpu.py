"""The GPU target: streams, CUDA-graph modes chosen per function, the GPU model's figures
(``_gpu_model``: the generic GPU's, or this machine's calibration)."""

from __future__ import annotations

from .._gpu_model import GENERIC_GPU, GPU_PROFILES, SMALLEST_GPU_MEMORY
from . import PlanWords, Target, TargetRow
from .profile import DeviceProfile

# What the GPU runs when an option is "auto"; measured with benchmarks/gpu_suite.py
# (numbers in docs/benchmarks.md). On a GPU every loop trip costs launches and a
# trip-count check, so fewer, fuller trips win. share_common: XLA's CSE cannot see into
# stream regions, so on the GPU equal equations are merged before planning; elsewhere
# XLA's own CSE does it.
ROW = TargetRow("gpu", ("gpu", "cuda", "rocm"), {
    "fuse_scans": True, "batch_scans": True, "batch_branches": True,
    "batch_matmuls": True, "unroll": "cost", "share_common": True,
    "group_collectives": True}, memory_bytes=SMALLEST_GPU_MEMORY)

TARGET = Target(
    ROW, platform="gpu", profile=DeviceProfile.for_gpu(GPU_PROFILES[GENERIC_GPU]),
    emits_streams=True, compiles_with_xla_options=True, sums_sliced_members=True,
    words=PlanWords(dynamic_loop="host-sync loop",
                    static_loop_gain=", so it runs without host syncs"),
    candidates={
        "jaxpar (user's mode)": {"command_buffers": "keep"},
        "jaxpar without stream regions": {"max_streams": 1},
        "jaxpar without matmul batching": {"batch_matmuls": False},
        "jaxpar, while loops by 4": {"unroll_while": 4},
    },
    rank=0, profile_of_gpu=DeviceProfile.for_gpu)
