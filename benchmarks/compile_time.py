"""Compile time of many identical members: plain ``jax.jit`` against jaxpar.

A function of ``n`` independent members ``tanh(x_i @ w_i)`` (8x16 @ 16x16, float32),
their results returned as a list, summed, or stacked with ``jnp.stack``, is lowered and
compiled as plain ``jax.jit`` and as ``parallel_branches(target="gpu")`` (which batches
the members), for the CPU and, where the CUDA PJRT plugin is installed, deviceless for
an H200. Per row: seconds to trace and lower (jaxpar's passes run in the trace), seconds
XLA takes to compile (the fastest of ``--repeats``), and jaxpar's compile time over
plain's, measured in the same run, variants interleaved.

Usage::

    JAX_PLATFORMS=cpu python benchmarks/compile_time.py            # 10, 100, 1000 members
    JAX_PLATFORMS=cpu python benchmarks/compile_time.py --quick    # 4 and 40, CPU only

Why it matters: XLA compiles each distinct kernel once. A thousand identical members
compile about one kernel's worth; batched, their stacking and the slices of their
results were a thousand distinct kernels (155 s against 4.3 s for plain ``jax.jit``
before the fix). The batching passes now batch at most ``MAX_BATCH_MEMBERS`` members
at a time (``jaxpar.passes._batch_members.member_chunks``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import jaxpar
from jaxpar._compiled.gpu_compile import lower_for_gpu, plugin_status

ROWS, WIDTH = 8, 16
FORMS = ("list", "sum", "stack")


def members(form: str) -> Callable[[list[Any], list[Any]], Any]:
    """The function of ``len(xs)`` members ``tanh(x_i @ w_i)``, consumed as ``form``."""
    def f(xs: list[Any], ws: list[Any]) -> Any:
        outs = [jnp.tanh(x @ w) for x, w in zip(xs, ws, strict=True)]
        if form == "sum":
            return sum(outs)
        if form == "stack":
            return jnp.stack(outs)
        return outs
    return f


def arguments(count: int) -> tuple[list[Any], list[Any]]:
    return ([jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32)] * count,
            [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * count)


def lower(fn: Callable[..., Any], args: Sequence[Any], backend: str) -> Any:
    if backend == "gpu":
        return lower_for_gpu(fn, *args, gpu="h200").lowered
    return jax.jit(fn).lower(*args)


def measure(fn: Callable[..., Any], args: Sequence[Any], backend: str, repeats: int
            ) -> dict[str, float]:
    """Seconds to trace and lower (the first time) and to compile (the fastest)."""
    start = time.perf_counter()
    lowered = lower(fn, args, backend)
    lowering = time.perf_counter() - start
    compiles = []
    for repeat in range(repeats):
        if repeat:
            lowered = lower(fn, args, backend)
        jax.clear_caches()  # else a repeat is JAX's in-memory cache hit, not a compile
        start = time.perf_counter()
        lowered.compile()
        compiles.append(time.perf_counter() - start)
    return {"lower_s": lowering, "compile_s": min(compiles)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="4 and 40 members, CPU only (seconds, for the tests)")
    parser.add_argument("--counts", help="comma-separated member counts (default 10,100,1000)")
    parser.add_argument("--forms", default=",".join(FORMS), help="comma-separated: list,sum,stack")
    parser.add_argument("--backends", help="comma-separated: cpu,gpu (default: cpu, and gpu "
                                           "where the CUDA plugin is installed)")
    parser.add_argument("--repeats", type=int, default=1, help="compiles per variant")
    parser.add_argument("--target", default="gpu",
                        help="jaxpar's target (default gpu; cpu, the CPU's default, batches "
                             "nothing)")
    parser.add_argument("--json", help="write the results here")
    ns = parser.parse_args(argv)
    counts = ([int(c) for c in ns.counts.split(",")] if ns.counts
              else [4, 40] if ns.quick else [10, 100, 1000])
    forms = ns.forms.split(",")
    if ns.backends:
        backends = ns.backends.split(",")
    else:
        backends = ["cpu"] if ns.quick or not plugin_status()[0] else ["cpu", "gpu"]
    results: dict[str, Any] = {"jax": jax.__version__, "target": ns.target, "rows": []}
    print(f"compile time, plain jax.jit vs jaxpar target={ns.target}, jax {jax.__version__}; "
          f"members tanh(x @ w), {ROWS}x{WIDTH} @ {WIDTH}x{WIDTH} float32")
    print(f"{'backend':8s} {'form':6s} {'members':>7s} {'lower plain':>12s} "
          f"{'lower jaxpar':>13s} {'compile plain':>14s} {'compile jaxpar':>15s} {'ratio':>7s}")
    for backend in backends:
        for count in counts:
            for form in forms:
                fn, args = members(form), arguments(count)
                plain = measure(fn, args, backend, ns.repeats)
                batched = measure(jaxpar.parallel_branches(fn, target=ns.target), args, backend,
                                  ns.repeats)
                ratio = batched["compile_s"] / plain["compile_s"]
                results["rows"].append({"backend": backend, "form": form, "members": count,
                                        "plain": plain, "jaxpar": batched, "ratio": ratio})
                print(f"{backend:8s} {form:6s} {count:7d} {plain['lower_s']:11.2f}s "
                      f"{batched['lower_s']:12.2f}s {plain['compile_s']:13.2f}s "
                      f"{batched['compile_s']:14.2f}s {ratio:6.2f}x", flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
