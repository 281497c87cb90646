"""Two scans with different bodies side by side: plain jax.jit, jaxpar, and the hand-vmapped
identical-body version.

Runs the user's two scans (100x100 matrices, 10,000 steps; ``--quick``: 1,000) on this
machine's CPU, interleaving the variants so drift hits all alike, and reports medians and
the median of per-pair ratios against plain ``jax.jit``. Then compiles each variant
deviceless for an H200 (when the CUDA PJRT plugin is installed) and reports the loops XLA
keeps, their trip counts and the kernels per trip.

Run::

    JAX_PLATFORMS=cpu python benchmarks/seed_002.py [--quick] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from jax import lax

import jaxpar
from jaxpar._compiled import compile_for_gpu, parse_schedule, plugin_status


def step(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return jnp.tanh(carry @ x @ x) * 0.5, None


def other_step(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return jnp.sin(x @ carry) + 0.5 * carry, None


def different_bodies(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
    return lax.scan(step, a, xs1)[0], lax.scan(other_step, b, xs2)[0]


def identical_bodies(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
    return lax.scan(step, a, xs1)[0], lax.scan(step, b, xs2)[0]


def hand_vmapped(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
    """The seed author's test3: one vmapped scan over stacked inputs."""
    out = jax.vmap(lambda c, xs: lax.scan(step, c, xs)[0])(jnp.stack([a, b]),
                                                         jnp.stack([xs1, xs2]))
    return out[0], out[1]


def make_args(n: int, steps: int) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    return (jax.random.normal(keys[0], (n, n)) / n, jax.random.normal(keys[1], (n, n)) / n,
            jax.random.normal(keys[2], (steps, n, n)) / n,
            jax.random.normal(keys[3], (steps, n, n)) / n)


def time_interleaved(variants: dict[str, Callable[[], Any]], repeats: int
                     ) -> dict[str, list[float]]:
    for run in variants.values():
        jax.block_until_ready(run())  # compile and warm up
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append(time.perf_counter() - start)
    return times


def gpu_figures(fn: Callable[..., Any], args: tuple[Any, ...]) -> dict[str, Any]:
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    schedule = parse_schedule(compile_for_gpu(fn, *specs, gpu="h200"))
    return {"loops": len(schedule.while_loops),
            "trips": [loop.known_trip_count for loop in schedule.while_loops],
            "kernels_per_trip": [loop.body_kernels for loop in schedule.while_loops],
            "async_calls_in_flight": schedule.max_async_calls_in_flight}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 steps instead of 10,000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    ns = parser.parse_args(argv)
    steps = 1_000 if ns.quick else 10_000
    args = make_args(100, steps)
    programs = {
        "different bodies": different_bodies,
        "identical bodies": identical_bodies,
    }
    results: dict[str, Any] = {"steps": steps, "jax": jax.__version__,
                               "backend": jax.default_backend(), "programs": {}}
    print(f"two scans with different bodies over 100x100, {steps} steps, jax {jax.__version__}, "
          f"{jax.default_backend()}, median of {ns.repeats}")
    for name, fn in programs.items():
        variants: dict[str, Callable[..., Any]] = {
            "plain": jax.jit(fn),
            "jaxpar (gpu options)": jax.jit(jaxpar.parallel_branches(fn, target="gpu")),
            "jaxpar (cpu options)": jax.jit(jaxpar.parallel_branches(fn, target="cpu")),
        }
        if name == "identical bodies":
            variants["hand vmap (seed test3)"] = jax.jit(hand_vmapped)
        times = time_interleaved({k: (lambda f=f: f(*args)) for k, f in variants.items()},
                                 ns.repeats)
        entry: dict[str, Any] = {}
        print(f"\n{name}:")
        for variant, samples in times.items():
            ratios = [t / p for t, p in zip(samples, times["plain"], strict=True)]
            entry[variant] = {"median_s": statistics.median(samples),
                              "ratio_vs_plain": statistics.median(ratios)}
            print(f"  {variant:24s} {statistics.median(samples) * 1e3:9.1f} ms   "
                  f"x{statistics.median(ratios):.3f}")
        ok, message = plugin_status()
        if ok:
            print("  deviceless H200 compile:")
            for variant in ("plain", "jaxpar (gpu options)"):
                fn_for_gpu = fn if variant == "plain" else jaxpar.parallel_branches(
                    fn, target="gpu")
                figures = gpu_figures(fn_for_gpu, args)
                entry[variant]["h200"] = figures
                print(f"    {variant:22s} loops {figures['loops']}, trips {figures['trips']}, "
                      f"kernels/trip {figures['kernels_per_trip']}")
        else:
            print(f"  (no deviceless GPU figures: {message})")
        results["programs"][name] = entry
    if ns.json:
        with open(ns.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
