"""Times the loop passes on this machine's CPU: jit(original) vs jit(rewritten).

Programs (the seed-002 shapes):
  * different: two independent scans over 100x100 matrices, different bodies (fusion);
  * identical: two independent scans with the same body (batching);
  * tiny: one long scan of a tiny elementwise body (unrolling).

Run::

    JAX_PLATFORMS=cpu python benchmarks/loops_cpu.py [--steps 1000] [--repeats 7]

Prints the median wall time of each variant and its ratio to the original.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
from jax import lax

from jaxpar.passes import apply_loop_passes


def body_matmuls(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    y = x @ x @ x
    return carry + 1e-3 * y, None


def body_tanh(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return 0.5 * carry + 0.5 * jnp.tanh(x @ carry), None


def different(c1: jax.Array, c2: jax.Array, xs1: jax.Array, xs2: jax.Array) -> Any:
    return lax.scan(body_matmuls, c1, xs1)[0], lax.scan(body_tanh, c2, xs2)[0]


def identical(c1: jax.Array, c2: jax.Array, xs1: jax.Array, xs2: jax.Array) -> Any:
    return lax.scan(body_matmuls, c1, xs1)[0], lax.scan(body_matmuls, c2, xs2)[0]


def tiny(c: jax.Array, xs: jax.Array) -> Any:
    def step(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        carry = 0.99 * carry + 0.01 * jnp.sin(x)
        return carry, carry[0]
    return lax.scan(step, c, xs)


def timed(fn: Callable[..., Any], args: tuple[Any, ...], repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


VARIANTS: dict[str, dict[str, Any]] = {
    "fuse": {"fuse": True, "batch": False, "unroll": None},
    "batch": {"fuse": False, "batch": True, "unroll": None},
    "unroll=auto": {"fuse": False, "batch": False, "unroll": "auto"},
    "unroll=4": {"fuse": False, "batch": False, "unroll": 4},
    "gpu defaults": {"fuse": True, "batch": True, "unroll": "auto"},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--tiny-steps", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=7)
    options = parser.parse_args()
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    n, m = 100, options.steps
    mats = (jax.random.normal(keys[0], (n, n)) / n, jax.random.normal(keys[1], (n, n)) / n,
            jax.random.normal(keys[2], (m, n, n)) / n, jax.random.normal(keys[3], (m, n, n)) / n)
    programs = {
        f"different bodies 2x(100x100, {m} steps)": (different, mats),
        f"identical bodies 2x(100x100, {m} steps)": (identical, mats),
        f"tiny body (16,), {options.tiny_steps} steps": (
            tiny, (jnp.ones((16,)), jax.random.normal(keys[0], (options.tiny_steps, 16)))),
    }
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs")
    for name, (fn, args) in programs.items():
        closed = jax.make_jaxpr(fn)(*args)
        base = timed(jax.jit(fn), args, options.repeats)
        print(f"\n{name}\n  original            {base * 1e3:9.2f} ms")
        for label, settings in VARIANTS.items():
            new, decisions = apply_loop_passes(closed, **settings, target="cpu")
            if new is closed:
                print(f"  {label:<18}  (unchanged)")
                continue
            t = timed(jax.jit(jex_core.jaxpr_as_fun(new)), args, options.repeats)
            kinds = ",".join(sorted({d.kind for d in decisions if d.kind != "left alone"}))
            print(f"  {label:<18}  {t * 1e3:9.2f} ms  x{t / base:5.2f}  [{kinds}]")


if __name__ == "__main__":
    main()
