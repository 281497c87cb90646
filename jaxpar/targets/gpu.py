"""The GPU target: streams, CUDA-graph modes chosen per function, the GPU model's figures
(``_model.gpu``: the generic GPU's, or this machine's calibration), and its unroll rule.

A GPU pays a fixed cost per loop trip (the trip-count check, and one launch per kernel of
the body), so a long scan of a tiny body is launch-bound; unrolling by ``k`` lets XLA fuse
``k`` bodies' elementwise work and cuts the trips by ``k``. ``unroll="cost"`` prices each
scan of length ``L`` unrolled by each of ``PRICED_FACTORS`` (1, 2, 4, 8, 16; and ``L`` when
``L <= FULL_UNROLL_LENGTH``), each lowered to the caps (the length, the passes'
``MAX_UNROLLED_EQNS``, the copies the memory budget allows, a factor dividing ``L``) and
less those ``unroll.kept_rolled`` refuses, with the GPU model the plan's estimate uses
(``ScanQuery.unrolled_seconds``), and keeps the fastest (ties: the smaller)."""

from __future__ import annotations

from .._model.gpu import GENERIC_GPU, GPU_PROFILES, SMALLEST_GPU_MEMORY
from . import PlanWords, Target, TargetRow
from .profile import DeviceProfile
from .unroll import (
    FULL_UNROLL_LENGTH,
    ScanQuery,
    UnrollChoice,
    dividing,
    kept_rolled,
    within_budget,
)

# What the GPU runs when an option is "auto"; measured with benchmarks/gpu_suite.py
# (numbers in docs/benchmarks.md). On a GPU every loop trip costs launches and a
# trip-count check, so fewer, fuller trips win. share_common: XLA's CSE cannot see into
# stream regions, so on the GPU equal equations are merged before planning; elsewhere
# XLA's own CSE does it.
ROW = TargetRow("gpu", ("gpu", "cuda", "rocm"), {
    "fuse_scans": True, "batch_scans": True, "batch_branches": True,
    "batch_matmuls": True, "unroll": "cost", "share_common": True,
    "group_collectives": True}, memory_bytes=SMALLEST_GPU_MEMORY)

# The factors ``unroll="cost"`` prices (each lowered to the caps and to one dividing the
# length): a few, so a scan costs the analysis a few pricings of its body's trip, the body
# itself priced once.
PRICED_FACTORS = (1, 2, 4, 8, 16)
# How much cheaper a larger factor must be estimated to be kept over a smaller one (a
# relative margin: equal estimates summed apart may differ in their last bits).
TIE = 1e-9


def fastest_unroll(scan: ScanQuery) -> UnrollChoice:
    """The factor the GPU model estimates cheapest among the allowed ones
    (``allowed_factors``; ties: the smaller), and why."""
    widest = min(max(PRICED_FACTORS), scan.length, scan.most_by_size)
    allowed, rolled = allowed_factors(scan, min(widest, scan.most_copies))
    by_memory = f", and {within_budget(scan)}" if scan.most_copies < widest else ""
    if allowed == [1]:
        return UnrollChoice(1, rolled or ("auto: body cost and length" + by_memory))
    factor, best = 1, float("inf")
    for k in allowed:  # smallest first: a larger factor must be cheaper to be kept
        seconds = scan.unrolled_seconds(k)
        if seconds < best * (1.0 - TIE):
            factor, best = k, seconds
    why = f"auto: the GPU model's fastest of unroll {', '.join(map(str, allowed))}"
    return UnrollChoice(factor, why + (by_memory if factor == allowed[-1] else ""))


def allowed_factors(scan: ScanQuery, cap: int) -> tuple[list[int], str | None]:
    """The factors priced (ascending), and why the largest is refused (``kept_rolled``:
    then so are all but 1), or None: each of ``PRICED_FACTORS`` (and the length, for a
    short scan) lowered to ``cap`` and to a factor dividing the length, less those
    ``kept_rolled`` refuses."""
    length = scan.length
    wanted = set(PRICED_FACTORS) | ({length} if length <= FULL_UNROLL_LENGTH else set())
    factors = sorted({dividing(min(k, max(cap, 1)), length) for k in wanted})
    refusals = {k: kept_rolled(scan, k) for k in factors}
    return [k for k in factors if refusals[k] is None], refusals[factors[-1]]


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
    unroll_rule=fastest_unroll, rank=0, profile_of_gpu=DeviceProfile.for_gpu)
