"""What calling a decorated function costs beyond ``jax.jit``'s call, once compiled.

A training loop calls its step thousands of times: every microsecond the decorator adds
to a call is paid on each. For each call shape below this times, in one process, the
call of ``jax.jit(f)``, of ``eqx.filter_jit(f)``, of ``parallel_branches(f,
target="cpu")`` and of ``parallel_branches(f, target="gpu")`` (on this CPU the GPU
rewrite runs too, and its calls run the jit carrying the plan's XLA options),
alternating them, and reports per-call microseconds (the minimum over ``--repeats``
rounds of ``--calls`` calls each) and the ratios to ``jax.jit`` and to
``eqx.filter_jit`` measured beside them:

* ``two_arrays``: ``tanh(x @ y) + 1`` on two 16x16 arrays;
* ``optimizer_state``: an identity-like step over 12 layers' parameters and their
  ``optax.adam`` state (74 leaves), the shape of a training step's arguments;
* ``python_scalar``: a step taking an array and a Python float (traced, as jax.jit
  traces it; static under ``eqx.filter_jit``);
* ``mixed``: two arrays, a Python float and a string naming the activation (a static
  leaf: ``jax.jit`` takes it with ``static_argnames``, jaxpar and ``eqx.filter_jit``
  as it comes).

The work in each program is tiny on purpose: the figures are the dispatch, not the math.

Run::

    JAX_PLATFORMS=cpu python benchmarks/dispatch.py [--calls 300] [--repeats 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jaxpar

Program = tuple[Callable[..., Any], tuple[Any, ...], tuple[str, ...]]


def _two_arrays() -> Program:
    def f(x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.tanh(x @ y) + 1.0

    return f, (jnp.ones((16, 16)), jnp.eye(16)), ()


def _optimizer_state() -> Program:
    widths = [32] * 13
    key = jax.random.key(0)
    params = [{"w": jax.random.normal(key, (a, b)) * 0.1, "b": jnp.zeros(b)}
              for a, b in itertools.pairwise(widths)]
    state = optax.adam(1e-3).init(params)

    def step(params: Any, state: Any, x: jax.Array) -> Any:
        return jax.tree_util.tree_map(lambda a: a + 1, (params, state)), x * 2

    return step, (params, state, jnp.ones((16, 32))), ()


def _python_scalar() -> Program:
    def f(x: jax.Array, scale: float) -> jax.Array:
        return jnp.tanh(x) * scale

    return f, (jnp.ones((16, 16)), 0.5), ()


def _mixed() -> Program:
    def f(x: jax.Array, y: jax.Array, scale: float, activation: str) -> jax.Array:
        return {"tanh": jnp.tanh, "relu": jax.nn.relu}[activation](x @ y) * scale

    return f, (jnp.ones((16, 16)), jnp.eye(16), 0.5, "tanh"), ("activation",)


PROGRAMS: dict[str, Callable[[], Program]] = {
    "two_arrays": _two_arrays, "optimizer_state": _optimizer_state,
    "python_scalar": _python_scalar, "mixed": _mixed,
}
VARIANTS = ("jax.jit", "eqx.filter_jit", "pb cpu", "pb gpu")


def _per_call_us(fn: Callable[..., Any], args: tuple[Any, ...], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e6


def measure(name: str, calls: int, repeats: int) -> dict[str, Any]:
    fun, args, static_argnames = PROGRAMS[name]()
    fns = {"jax.jit": jax.jit(fun, static_argnames=static_argnames or None),
           "eqx.filter_jit": eqx.filter_jit(fun),
           "pb cpu": jaxpar.parallel_branches(fun, target="cpu"),
           "pb gpu": jaxpar.parallel_branches(fun, target="gpu")}
    outs = {variant: jax.block_until_ready(fn(*args))  # compiles; not timed
            for variant, fn in fns.items()}
    # The same numbers, or the timing compares different programs.
    diff = {variant: max((float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(outs["jax.jit"]),
        strict=True)), default=0.0) for variant, out in outs.items()}
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(repeats):  # alternated, so load shifts touch every variant alike
        for variant, fn in fns.items():
            samples[variant].append(_per_call_us(fn, args, calls))
    best = {v: min(s) for v, s in samples.items()}
    return {"leaves": len(jax.tree_util.tree_leaves(args)), "max_abs_diff": diff,
            "us_per_call": best,
            "ratio_vs_jit": {v: best[v] / best["jax.jit"] for v in VARIANTS},
            "ratio_vs_filter_jit": {v: best[v] / best["eqx.filter_jit"] for v in VARIANTS},
            "overhead_us": {v: best[v] - best["jax.jit"] for v in VARIANTS},
            "samples": samples}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per timed round")
    parser.add_argument("--repeats", type=int, default=7, help="rounds per variant")
    parser.add_argument("--json", help="write the results here")
    ns = parser.parse_args(argv)
    results: dict[str, Any] = {"jax": jax.__version__, "load_1min_start": os.getloadavg()[0],
                               "programs": {}}
    print(f"per-call cost, jax {jax.__version__}, load {os.getloadavg()[0]:.2f} "
          f"(min of {ns.repeats} rounds of {ns.calls} calls)")
    ratios = [(v, base) for base in ("jit", "eqx") for v in VARIANTS[2:]]
    print(f"  {'program':16s} {'leaves':>6s} " + " ".join(f"{v:>14s} us" for v in VARIANTS)
          + " " + " ".join(f"{v + ' x ' + base:>13s}" for v, base in ratios))
    for name in PROGRAMS:
        entry = measure(name, ns.calls, ns.repeats)
        results["programs"][name] = entry
        us = entry["us_per_call"]
        against = {"jit": entry["ratio_vs_jit"], "eqx": entry["ratio_vs_filter_jit"]}
        print(f"  {name:16s} {entry['leaves']:6d} "
              + " ".join(f"{us[v]:17.1f}" for v in VARIANTS) + " "
              + " ".join(f"{against[base][v]:13.2f}" for v, base in ratios), flush=True)
    results["load_1min_end"] = os.getloadavg()[0]
    if ns.json:
        with open(ns.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
