"""Times the loop and batching passes on this machine's CPU: jit(original) vs jit(rewritten).

Programs (the seed-002 shapes, and an ensemble):
  * different: two independent scans over 100x100 matrices, different bodies (fusion);
  * identical: two independent scans with the same body (batching);
  * tiny: one long scan of a tiny elementwise body (unrolling);
  * ensemble: four identical 3-layer MLPs on one input (``batch_branches``, decided with the
    GPU cost model so that the rewrite happens and its CPU cost is what is measured).

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

from jaxpar.passes import apply_passes


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


def mlp_ensemble(members: Any, x: jax.Array) -> jax.Array:
    outs = []
    for layers in members:
        h = x
        for w, b in layers:
            h = jnp.tanh(h @ w + b)
        outs.append(h)
    return sum(outs)


def ensemble_args(width: int, batch: int, members: int = 4) -> tuple[Any, jax.Array]:
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 3 * members + 1))
    params = [[(jax.random.normal(next(keys), (width, width)) / width ** 0.5,
                jnp.zeros((width,))) for _ in range(3)] for _ in range(members)]
    return params, jax.random.normal(next(keys), (batch, width))


OFF = {"fuse_scans": False, "batch_scans": False, "unroll": None, "batch_branches": False,
       "target": "cpu"}
VARIANTS: dict[str, dict[str, Any]] = {
    "fuse": {**OFF, "fuse_scans": True},
    "batch": {**OFF, "batch_scans": True},
    "unroll=cost": {**OFF, "unroll": "cost"},
    "unroll=4": {**OFF, "unroll": 4},
    "batch_branches": {**OFF, "batch_branches": True, "target": "gpu"},
    "gpu defaults": {"fuse_scans": True, "batch_scans": True, "unroll": "auto",
                     "batch_branches": True, "target": "gpu"},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--tiny-steps", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--width", type=int, default=256, help="ensemble members' width")
    parser.add_argument("--batch", type=int, default=128, help="ensemble batch")
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
        f"ensemble 4x(3 layers {options.width}), batch {options.batch}": (
            mlp_ensemble, ensemble_args(options.width, options.batch)),
    }
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs")
    for name, (fn, args) in programs.items():
        closed = jax.make_jaxpr(fn)(*args)
        leaves = jax.tree.leaves(args)
        base = timed(jax.jit(fn), args, options.repeats)
        print(f"\n{name}\n  original            {base * 1e3:9.2f} ms")
        for label, settings in VARIANTS.items():
            new, decisions = apply_passes(closed, **settings)
            if new is closed:
                print(f"  {label:<18}  (unchanged)")
                continue
            t = timed(jax.jit(jex_core.jaxpr_as_fun(new)), leaves, options.repeats)
            kinds = ",".join(sorted({d.kind for d in decisions if d.kind != "left alone"}))
            print(f"  {label:<18}  {t * 1e3:9.2f} ms  x{t / base:5.2f}  [{kinds}]")


if __name__ == "__main__":
    main()
