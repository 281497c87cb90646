"""Calibrate jaxpar's GPU model on this machine's GPU and write the profile jaxpar loads.

Measures, on ``jax.devices()[0]``, the figures of ``jaxpar._gpu_model.GpuProfile`` that
decide jaxpar's plans and estimates, each as the median of ``--repeats`` runs and as a
slope between two sizes, so that the fixed cost of a call (Python, dispatch) cancels:

* ``launch_s``: per kernel of a loop body of tiny dependent kernels, CUDA graphs off
  (``--xla_gpu_enable_command_buffer=`` as this executable's compile option): what one
  kernel launched on its own costs, ``max(host launch, the device's shortest kernel)``;
* ``graph_node_s``: the same body replayed as a CUDA graph (XLA's default mode captures a
  loop body of at least five kernels): ``max(host cost of a node, shortest kernel)``;
* ``bandwidth``: an elementwise copy (read and write ``n`` float32) at two sizes;
* ``tensor_flops``: square matmuls by element type: ``f32`` at JAX's default precision
  (TF32 tensor cores on Hopper, the figure jaxpar uses for float32 dots), ``bf16``,
  ``f16``; ``f32`` at ``HIGHEST`` precision is recorded among the measurements;
* ``sm_count`` where the device reports it.

The profile is written to ``$JAXPAR_PROFILE_DIR/<device kind>.json`` (default
``~/.cache/jaxpar/profiles``), where ``jaxpar`` looks for it (``_gpu_model.gpu_profile``),
or to ``--out``. Figures it does not measure keep jaxpar's built-in values.

Run::

    python benchmarks/calibrate.py [--repeats 20] [--out PATH]
    JAX_PLATFORMS=cpu python benchmarks/calibrate.py --dry-run --device-kind "NVIDIA H200" \\
        --out /tmp/h200.json      # tiny sizes on the CPU: checks the script, not the GPU

Sharp edges:
  * Timing alone cannot tell a host cost from the device's shortest kernel: for tiny
    kernels each measured figure is the larger of the two.
  * Without a GPU (or with ``--dry-run``) the sizes are tiny and the figures are the
    CPU's; such a profile is only for checking this script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax
import jax.numpy as jnp
from jax import lax

import jaxpar._compiled.schedule as _schedule
from jaxpar import _flags, _gpu_model


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What to run: every figure is a slope between the two sizes of its pair."""

    trips: int = 1000  # loop trips of the launch and graph measurements
    kernels: tuple[int, int] = (8, 24)  # tiny kernels per trip (at least 5: a graph)
    elements: tuple[int, int] = (1 << 24, 1 << 26)  # float32 elements copied
    matmul: int = 8192  # n of the n x n matmuls
    matmuls: tuple[int, int] = (2, 6)  # matmuls per call
    repeats: int = 20


GPU_SIZES = Sizes()
DRY_RUN_SIZES = Sizes(trips=20, elements=(1 << 10, 1 << 12), matmul=32, repeats=3)
MATMUL_TYPES = {"f32": (jnp.float32, None), "f32_highest": (jnp.float32, "highest"),
                "bf16": (jnp.bfloat16, None), "f16": (jnp.float16, None)}


def median_seconds(compiled: Callable[..., Any], args: Sequence[Any], repeats: int) -> float:
    """Median wall time of ``compiled(*args)`` until its result is ready (one warm-up)."""
    jax.block_until_ready(compiled(*args))
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def slope(timed: Sequence[float], work: Sequence[float], name: str) -> dict[str, Any]:
    """Seconds per unit of work between two sizes: ``(t1 - t0) / (w1 - w0)``.

    Where noise hides the difference (a slope <= 0) it falls back to ``t1 / w1``, an upper
    bound that still counts the fixed cost of a call, and says so (``method``).
    """
    per_unit = (timed[1] - timed[0]) / (work[1] - work[0])
    if per_unit > 0:
        return {"per_unit": per_unit, "method": "slope"}
    print(f"warning: {name}: the two sizes took {timed[0]:.3g} s and {timed[1]:.3g} s, "
          "within noise; using the larger size's ratio (an upper bound)", file=sys.stderr)
    return {"per_unit": timed[1] / work[1], "method": "ratio (slope within noise)"}


def _tiny_kernels(count: int, trips: int) -> Callable[[jax.Array], jax.Array]:
    def body(carry: jax.Array, _: Any) -> tuple[jax.Array, None]:
        for _ in range(count):  # the barriers keep XLA from fusing them into one kernel
            carry = lax.optimization_barrier(carry * 1.0001 + 1e-3)
        return carry, None

    return lambda x: lax.scan(body, x, None, length=trips)[0]


def per_kernel_seconds(sizes: Sizes, mode: _gpu_model.CommandBufferMode) -> dict[str, Any]:
    """Seconds per tiny kernel in a loop body, compiled for CUDA-graph ``mode``."""
    options = _flags.flags_as_options(_flags.command_buffer_flags(mode))
    x = jnp.ones((1,), jnp.float32)
    timed, kernels = [], []
    for count in sizes.kernels:
        lowered = jax.jit(_tiny_kernels(count, sizes.trips)).lower(x)
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        loops = _schedule.parse_schedule(compiled.as_text()).while_loops
        kernels.append(loops[0].body_kernels if loops else 0)
        timed.append(median_seconds(compiled, (x,), sizes.repeats))
    # The CPU does not fuse like a GPU: there the operations stand in for kernels.
    counted = kernels[1] > kernels[0]
    work = [sizes.trips * k for k in (kernels if counted else sizes.kernels)]
    found = slope(timed, work, f"kernels ({mode.value} graphs)")
    return {"seconds": found["per_unit"], "method": found["method"], "medians_s": timed,
            "kernels_per_trip": kernels if counted else None, "trips": sizes.trips,
            "mode": mode.value}


def copy_bandwidth(sizes: Sizes) -> dict[str, Any]:
    """Bytes/s of an elementwise copy (each element read and written once)."""
    timed = []
    copy = jax.jit(lambda a: a * 2.0 + 1.0)
    for n in sizes.elements:
        timed.append(median_seconds(copy, (jnp.ones((n,), jnp.float32),), sizes.repeats))
    found = slope(timed, [2 * 4 * n for n in sizes.elements], "copy")
    return {"bytes_per_s": 1.0 / found["per_unit"], "method": found["method"],
            "medians_s": timed, "elements": list(sizes.elements)}


def matmul_flops(sizes: Sizes, dtype: Any, precision: str | None) -> dict[str, Any]:
    """Flop/s of square matmuls of ``dtype`` (a chain, so nothing is computed twice)."""
    n = sizes.matmul
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (n, n), jnp.float32).astype(dtype)
    b = (jax.random.normal(key_b, (n, n), jnp.float32) / n**0.5).astype(dtype)
    timed = []
    for count in sizes.matmuls:
        def chain(a: jax.Array, b: jax.Array, count: int = count) -> jax.Array:
            return lax.fori_loop(0, count, lambda _, c: jnp.matmul(c, b, precision=precision),
                                 a)
        timed.append(median_seconds(jax.jit(chain), (a, b), sizes.repeats))
    found = slope(timed, [2.0 * n**3 * count for count in sizes.matmuls],
                  f"matmul {jnp.dtype(dtype).name} {precision or 'default'}")
    return {"flops_per_s": 1.0 / found["per_unit"], "method": found["method"],
            "medians_s": timed, "n": n, "precision": precision or "default"}


def calibrate(sizes: Sizes, device_kind: str) -> tuple[_gpu_model.GpuProfile, dict[str, Any]]:
    """Measures every figure; returns the profile of ``device_kind`` and the raw figures."""
    base = _gpu_model.builtin_gpu_profile(device_kind)
    launch = per_kernel_seconds(sizes, _gpu_model.CommandBufferMode.OFF)
    graph = per_kernel_seconds(sizes, _gpu_model.CommandBufferMode.LHS)
    bandwidth = copy_bandwidth(sizes)
    matmuls = {name: matmul_flops(sizes, dtype, precision)
               for name, (dtype, precision) in MATMUL_TYPES.items()}
    peaks = dict(base.tensor_flops)
    peaks.update({name: m["flops_per_s"] for name, m in matmuls.items() if name in peaks})
    device = jax.devices()[0]
    sm_count = getattr(device, "core_count", None)
    profile = dataclasses.replace(
        base, device_kind=device_kind, launch_s=launch["seconds"],
        graph_node_s=graph["seconds"], bandwidth=bandwidth["bytes_per_s"],
        tensor_flops=tuple(sorted(peaks.items())),
        sm_count=sm_count if isinstance(sm_count, int) and sm_count > 0 else base.sm_count)
    measurements = {
        "launch": launch, "graph_node": graph, "bandwidth": bandwidth, "matmuls": matmuls,
        "device_kind": device.device_kind, "backend": jax.default_backend(),
        "jax": jax.__version__, "xla_flags": _flags.xla_flags_text(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sizes": dataclasses.asdict(sizes)}
    return profile, measurements


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="where to write the profile (default: "
                        "where jaxpar looks for this device kind)")
    parser.add_argument("--repeats", type=int, default=0, help="runs per median")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes (the default without a GPU)")
    parser.add_argument("--device-kind", default="", help="label the profile with this "
                        "device kind instead of jax.devices()[0].device_kind")
    options = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    sizes = DRY_RUN_SIZES if options.dry_run or not on_gpu else GPU_SIZES

    if options.repeats:
        sizes = dataclasses.replace(sizes, repeats=options.repeats)
    kind = options.device_kind or jax.devices()[0].device_kind
    dry_run = options.dry_run or not on_gpu
    if dry_run and not options.out:
        parser.error("a dry run (no GPU, or --dry-run) needs --out, so that its figures never "
                     "land where jaxpar looks for a GPU's profile")
    profile, measurements = calibrate(sizes, kind)
    out = Path(options.out) if options.out else _gpu_model.profile_path(kind)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_gpu_model.profile_document(profile, measurements), indent=2))
    print(f"{kind}: launch {profile.launch_s * 1e6:.2f} us, graph node "
          f"{profile.graph_node_s * 1e6:.2f} us, bandwidth {profile.bandwidth / 1e12:.2f} TB/s, "
          + ", ".join(f"{name} {m['flops_per_s'] / 1e12:.1f} TFLOP/s"
                      for name, m in measurements["matmuls"].items())
          + f"\nprofile -> {out}" + (" (dry run)" if dry_run else ""))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
