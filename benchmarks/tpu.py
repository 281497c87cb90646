"""jaxpar on a TPU, measured: the seed's loops, the GPU suite's programs and the battery's
loops, plain ``jax.jit`` against ``parallel_branches`` (its default target: ``"tpu"`` on a
TPU) against hand-written alternatives, values compared.

Every program's variants are timed in one process, alternated round by round
(``benchmarks/dispatch.py``'s ``measure``: per call in a loop of calls issued back to back
and one wait, and the host's issue time per call), medians and the median of per-round
ratios to plain ``jax.jit``. Parts, each writing ``<out>/tpu-<part>.json`` as it goes:

* ``seeds``: two scans over 100x100 matrices, 10,000 steps: identical bodies (against
  each scan with ``unroll=16``, the seed author's hand ``vmap`` and hand ``vmap`` of a scan
  unrolled by 8) and different bodies, and pairs of our own: crossed operand orders
  (``c @ x`` beside ``x @ c``) and bodies of three matmuls each;
* ``suite``: the 31 programs of ``benchmarks/gpu_suite.py`` at ``--size``;
* ``battery``: the loop programs of ``benchmarks/battery/programs.py`` (size ``m``);
* ``loops``: ``benchmarks/tpu_loops.py``'s loop programs of many shapes, written after the
  profile and its rules (size ``m``);
* ``tune``: ``tune=True`` on four loop programs: the first call's time (measuring
  included) against plain's first call, and the decided program's time per call.

Run (``benchmarks/tpu.sh`` runs it on the chip with the calibration and the dispatch
benchmark)::

    python benchmarks/tpu.py [--parts seeds,suite,battery,loops,tune] [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "battery"))

import dispatch  # noqa: E402
import seed_002  # noqa: E402

import jaxpar  # noqa: E402

BATTERY_LOOPS = ("lstm_uni_grad", "bilstm_fwd", "stacked_gru3", "stacked_bigru2_grad",
                 "scans_identical_8", "scans_different_bodies", "scans_ys_big",
                 "scans_broadcast_inside", "scans_prime_lengths", "scans_nested",
                 "fori_while_loops")


def _two(b1: Callable[..., Any], b2: Callable[..., Any], unroll: int = 1) -> Callable[..., Any]:
    def f(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
        return (lax.scan(b1, a, xs1, unroll=unroll)[0],
                lax.scan(b2, b, xs2, unroll=unroll)[0])
    f.__name__ = f"{b1.__name__}_{b2.__name__}" + (f"_unroll{unroll}" if unroll > 1 else "")
    return f


def _hand_vmap(unroll: int = 1) -> Callable[..., Any]:
    def f(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
        out = jax.vmap(lambda c, xs: lax.scan(seed_002.step, c, xs, unroll=unroll)[0])(
            jnp.stack([a, b]), jnp.stack([xs1, xs2]))
        return out[0], out[1]
    return f


def crossed_a(c: Any, x: Any) -> Any:
    return jnp.tanh(c @ x) * 0.9, None


def crossed_b(c: Any, x: Any) -> Any:
    return jnp.tanh(x @ c) * 0.9, None


def three_a(c: Any, x: Any) -> Any:
    return jnp.tanh(c @ x @ x @ x) * 0.5, None


def three_b(c: Any, x: Any) -> Any:
    return jnp.sin(x @ (x @ c) @ x) * 0.5 + 0.1 * c, None


def seed_programs(steps: int) -> dict[str, tuple[dict[str, Callable[..., Any]], tuple[Any, ...]]]:
    args = seed_002.make_args(100, steps)
    out = {}
    for name, b1, b2 in (("seed identical bodies", seed_002.step, seed_002.step),
                         ("seed different bodies", seed_002.step, seed_002.other_step),
                         ("crossed operand orders", crossed_a, crossed_b),
                         ("three matmuls each", three_a, three_b)):
        fn = _two(b1, b2)
        variants = {"jax.jit": jax.jit(fn), "jaxpar": jaxpar.parallel_branches(fn),
                    "jax.jit, scans unroll=16": jax.jit(_two(b1, b2, 16))}
        if b1 is b2:
            variants["hand vmap (seed test3)"] = jax.jit(_hand_vmap())
            variants["hand vmap, scan unroll=8"] = jax.jit(_hand_vmap(8))
        out[name] = (variants, args)
    return out


def _close(a: Any, b: Any, rtol: float, atol: float) -> tuple[bool, float]:
    worst, ok = 0.0, True
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        if not isinstance(x, jax.Array):
            continue
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.max(np.abs(x - y))) if x.size else 0.0)
        ok &= bool(np.allclose(x, y, rtol=rtol, atol=atol))
    return ok, worst


def run_programs(programs: dict[str, Any], out_path: str, budget: float, rounds: int,
                 rtol: float = 2e-2, atol: float = 2e-2) -> dict[str, Any]:
    """``dispatch.measure`` of each program's variants; values checked against plain."""
    started = time.perf_counter()
    results: dict[str, Any] = {}
    for name, build in programs.items():
        if time.perf_counter() - started > budget:
            results[name] = {"skipped": "time budget"}
            continue
        try:
            variants, args, tolerance = build()
            entry = dispatch.measure(variants, args, 200, rounds)
            base = next(iter(variants))
            want = variants[base](*args)
            entry["values_match"] = {}
            for label, fn in variants.items():
                ok, worst = _close(fn(*args), want, *(tolerance or (rtol, atol)))
                entry["values_match"][label] = ok
                entry["max_abs_diff"][label] = worst
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {error}"[:800],
                             "trace": traceback.format_exc()[-1500:]}
            print(f"  {name}: {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        results[name] = entry
        cells = "  ".join(
            f"{label} {entry['loop_us'][label] / 1e3:8.3f} ms x{entry['loop_ratio'][label]:.3f}"
            + ("" if entry["values_match"][label] else " VALUES DIFFER") for label in variants)
        print(f"  {name:40s} {cells}", flush=True)
        with open(out_path, "w") as handle:
            json.dump(results, handle, indent=1, default=str)
    return results


def _seeds(steps: int) -> dict[str, Callable[[], Any]]:
    return {name: (lambda v=v: (*v, (2e-2, 2e-2))) for name, v in seed_programs(steps).items()}


def _variants(fn: Callable[..., Any], rolled: bool = True) -> dict[str, Callable[..., Any]]:
    """Plain ``jax.jit``, jaxpar's default, and (``rolled``) jaxpar with its loops rolled:
    what reading by blocks adds."""
    variants = {"jax.jit": jax.jit(fn), "jaxpar": jaxpar.parallel_branches(fn)}
    if rolled:
        variants["jaxpar, loops rolled"] = jaxpar.parallel_branches(fn, unroll=None)
    return variants


def _suite(size: str) -> dict[str, Callable[[], Any]]:
    import gpu_suite

    def build(prog: Any) -> Any:
        fn, args = prog.build(size)
        # "loops rolled" only where there is a scan: the block reading's own share.
        variants = _variants(fn, rolled="scan" in str(jax.make_jaxpr(fn)(*args)))
        # The TPU's tolerance: float32 matmuls run at bfloat16 passes by default.
        return variants, args, (max(prog.rtol, 2e-2), max(prog.atol, 2e-2))
    return {name: (lambda p=p: build(p)) for name, p in gpu_suite.PROGRAMS.items()}


def _battery(size: str) -> dict[str, Callable[[], Any]]:
    import programs as battery

    def build(name: str) -> Any:
        fn, args, _ = battery.PROGRAMS[name](size)
        return _variants(fn), args, None
    return {name: (lambda n=name: build(n)) for name in BATTERY_LOOPS}


def _loops(size: str) -> dict[str, Callable[[], Any]]:
    import tpu_loops

    def build(name: str) -> Any:
        fn, args = tpu_loops.PROGRAMS[name](size)
        return _variants(fn), args, None
    return {name: (lambda n=name: build(n)) for name in tpu_loops.PROGRAMS}


def tune_part(steps: int, size: str, out_path: str) -> dict[str, Any]:
    """``tune=True``: the first call (tracing, compiling, measuring the candidates) against
    plain ``jax.jit``'s first call, the decided program, its time per call."""
    import gpu_suite

    os.environ["JAXPAR_TUNE_DIR"] = tempfile.mkdtemp(prefix="jaxpar-tune-")
    args = seed_002.make_args(100, steps)
    cases = {"seed identical bodies": (_two(seed_002.step, seed_002.step), args),
             "seed different bodies": (_two(seed_002.step, seed_002.other_step), args)}
    for name in ("tiny_scan", "bigru"):
        cases[name] = gpu_suite.PROGRAMS[name].build(size)
    results: dict[str, Any] = {}
    for name, (fn, fargs) in cases.items():
        try:
            plain = jax.jit(fn)
            start = time.perf_counter()
            jax.block_until_ready(plain(*fargs))
            plain_first = time.perf_counter() - start
            tuned = jaxpar.parallel_branches(fn, tune=True)
            start = time.perf_counter()
            jax.block_until_ready(tuned(*fargs))
            tuned_first = time.perf_counter() - start
            default = jaxpar.parallel_branches(fn)
            entry = dispatch.measure({"jax.jit": plain, "jaxpar default": default,
                                      "jaxpar tune=True": tuned}, fargs, 200, 5)
            decision = tuned.tuning(*fargs)
            entry.update({"first_call_s": {"jax.jit": plain_first, "jaxpar tune=True": tuned_first},
                          "chosen": None if decision is None else decision.chosen,
                          "table": None if decision is None else str(decision)})
            results[name] = entry
            print(f"  {name:28s} first call jax.jit {plain_first:6.2f} s, tune=True "
                  f"{tuned_first:6.2f} s; chose {entry['chosen']!r}; per call default "
                  f"x{entry['loop_ratio']['jaxpar default']:.3f}, tuned "
                  f"x{entry['loop_ratio']['jaxpar tune=True']:.3f}", flush=True)
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {error}"[:800]}
            print(f"  {name}: {type(error).__name__}: {str(error)[:300]}", flush=True)
        with open(out_path, "w") as handle:
            json.dump(results, handle, indent=1, default=str)
    return results


def summary(results: dict[str, Any]) -> dict[str, Any]:
    rows = [e for e in results.values() if "loop_ratio" in e]
    ratios = [e["loop_ratio"]["jaxpar"] for e in rows if "jaxpar" in e["loop_ratio"]]
    return {"programs": len(rows), "geomean": math.exp(statistics.fmean(map(math.log, ratios)))
            if ratios else None, "worst": max(ratios, default=None),
            "slower_than_3pct": sorted(name for name, e in results.items()
                                       if "loop_ratio" in e and e["loop_ratio"]["jaxpar"] > 1.03),
            "values_differ": sorted(name for name, e in results.items()
                                    if "values_match" in e and not all(e["values_match"].values()))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--parts", default="seeds,suite,battery,loops,tune")
    parser.add_argument("--out", default=".")
    parser.add_argument("--size", default="full", choices=("full", "small"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget", type=float, default=300.0, help="seconds a part")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a dry run")
    parser.add_argument("--only", help="comma-separated program names (of any part); "
                        "a part with none of them is skipped")
    ns = parser.parse_args(argv)
    steps = 64 if ns.quick else 10_000
    size = "small" if ns.quick else ns.size
    battery_size = "s" if ns.quick else "m"
    builders: dict[str, Callable[[], dict[str, Any]]] = {
        "seeds": lambda: _seeds(steps), "suite": lambda: _suite(size),
        "battery": lambda: _battery(battery_size), "loops": lambda: _loops(battery_size)}
    parts = ns.parts.split(",")
    unknown = [part for part in parts if part not in (*builders, "tune")]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; the parts are "
                     f"{', '.join((*builders, 'tune'))}")
    only = set(ns.only.split(",")) if ns.only else None
    if only is not None:
        known = {name for build in builders.values() for name in build()}
        if only - known:
            parser.error(f"--only: no program named {', '.join(sorted(only - known))} (the "
                         f"parts' programs: {', '.join(sorted(known))})")

    def chosen(programs: dict[str, Any]) -> dict[str, Any]:
        if only is None:
            return programs
        return {name: build for name, build in programs.items() if name in only}

    os.makedirs(ns.out, exist_ok=True)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; jaxpar target "
          f"{jaxpar.parallel_branches(lambda x: x).options.resolve_target()}", flush=True)
    everything: dict[str, Any] = {}
    for part in parts:
        started = time.perf_counter()
        path = os.path.join(ns.out, f"tpu-{part}.json")
        programs = chosen(builders[part]()) if part in builders else {}
        if part in builders and not programs:
            continue  # --only names none of this part's programs: its files stay as they are
        print(f"== {part}", flush=True)
        if part in builders:
            results = run_programs(programs, path, ns.budget, ns.rounds)
        else:
            results = tune_part(steps, size, path)
        everything[part] = results
        if part != "tune":
            everything[f"{part} summary"] = summary(results)
            print(f"== {part}: {everything[f'{part} summary']} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    # One summary per results folder: each run adds its parts' (a later run of a part
    # replaces its entry).
    summary_path = os.path.join(ns.out, "tpu-summary.json")
    summaries: dict[str, Any] = {}
    if os.path.exists(summary_path):
        with open(summary_path) as handle:
            summaries = json.load(handle)
    summaries.update({k: v for k, v in everything.items() if k.endswith("summary")})
    with open(summary_path, "w") as handle:
        json.dump(summaries, handle, indent=1, default=str)
    return everything


if __name__ == "__main__":
    main()
