"""The tuner on the CPU (issue 19 point 3): ``parallel_branches(f, tune=True)`` vs ``jax.jit``.

Three parts, each with the figure that decides it:

1. Do no harm: every workload of ``benchmarks/run.py`` (size ``quick`` by default). The
   first concrete call of ``tuned = parallel_branches(fn, tune=True)`` measures the
   candidates and chooses; then ``plain = jax.jit(fn)``, ``jax.jit(tuned)`` and ``tuned``
   called directly run interleaved (the order rotates every repetition). Reported: the
   choice, how many distinct programs were timed, and each variant's median against
   plain's (median of per-repetition ratios). Target: ``jax.jit(tuned)`` within 2% of
   plain. (A direct call also pays jaxpar's Python dispatch, which is not the tuner's.)
   Timings of identical programs differ by several percent on a busy machine, so each
   workload also reports whether ``jax.jit(tuned)`` compiles to the same instructions
   as plain (``same HLO``: the compiled HLO's instructions with names, metadata and
   order set aside), which is what "no harm" means when plain is chosen.
2. A rewrite that is faster on the CPU: four independent scans of a tiny body (16
   floats, 10,000 steps) with ``fuse_scans=True`` (one loop instead of four). Target: the
   tuner chooses the rewrite, and the tuned program beats plain.
3. A second process: a fresh interpreter builds the same function, calls it once with
   ``jax_log_compiles`` on and counts the compiles. Target: the stored decision is
   used (``source == "stored"``) and exactly one program is compiled.

Decisions go to a fresh temporary ``JAXPAR_TUNE_DIR`` (``--tune-dir`` to keep them).

Run::

    JAX_PLATFORMS=cpu python benchmarks/tune_cpu.py [--size quick] [--repeats 15]
        [--workloads a,b] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import run as suite
from jax import lax

import jaxpar

REWRITE_OPTIONS: dict[str, Any] = {"target": "cpu", "fuse_scans": True}
WITHIN = 0.02  # do no harm: jax.jit(tuned) within 2% of plain


def _tiny_step(i: int) -> Callable[..., Any]:
    def step(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        return (0.99 - 0.01 * i) * carry + 0.01 * jnp.sin(x + i), None
    return step


TINY_STEPS = [_tiny_step(i) for i in range(4)]


def four_tiny_scans(carries: list[jax.Array], xss: list[jax.Array]) -> list[jax.Array]:
    """Four independent scans of a tiny body: loop overhead, which fusing them shares."""
    return [lax.scan(step, c, xs)[0] for step, c, xs in zip(TINY_STEPS, carries, xss,
                                                            strict=True)]


def four_tiny_args(steps: int = 10_000, width: int = 16) -> tuple[Any, ...]:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    return ([jnp.ones((width,))] * 4, [jax.random.normal(k, (steps, width)) for k in keys])


def instructions(text: str) -> list[str]:
    """A compiled HLO module's instructions without names, metadata, debug tables or
    order: equal for two programs that compute the same way."""
    lines = []
    for line in text.splitlines():
        if re.match(r"^(\d+ |FileNames|FunctionNames|FileLocations|StackFrames|HloModule)",
                    line):
            continue
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        line = re.sub(r"[\w.\-]+(?=: )", "", re.sub(r"%[\w.\-]+", "%", line))
        lines.append(line)
    return sorted(lines)


def same_program(a: Callable[..., Any], b: Callable[..., Any], args: tuple[Any, ...]
                 ) -> bool:
    compiled = [instructions(jax.jit(f).lower(*args).compile().as_text()) for f in (a, b)]
    return compiled[0] == compiled[1]


def interleaved(variants: Mapping[str, Callable[[], Any]], repeats: int
                ) -> dict[str, list[float]]:
    """Per-variant wall times (s) over ``repeats`` rounds, the order rotated each round
    (``run.py``'s timing, first calls apart)."""
    return suite.time_interleaved(variants, repeats)[0]


def ratios(times: Mapping[str, list[float]]) -> dict[str, dict[str, float]]:
    plain = times["plain"]
    return {name: {"median_ms": statistics.median(samples) * 1e3,
                   "ratio": statistics.median(t / p for t, p in zip(samples, plain,
                                                                    strict=True))}
            for name, samples in times.items()}


def tune_workload(fn: Callable[..., Any], args: tuple[Any, ...], repeats: int,
                  **options: Any) -> dict[str, Any]:
    tuned = jaxpar.parallel_branches(fn, tune=True, **options)
    start = time.perf_counter()
    jax.block_until_ready(tuned(*args))  # measures the candidates, then runs the winner
    tune_s = time.perf_counter() - start
    tuning = tuned.tuning(*args)
    assert tuning is not None
    plain, jitted = jax.jit(fn), jax.jit(tuned)
    times = interleaved({"plain": lambda: plain(*args), "jit(tuned)": lambda: jitted(*args),
                         "tuned": lambda: tuned(*args)}, repeats)
    timed = sum(1 for row in tuning.rows if row.median_s is not None)
    return {"chosen": tuning.chosen, "source": tuning.source, "programs_timed": timed,
            "tune_s": tune_s, "table": tuning.lines(), "variants": ratios(times),
            "same_hlo": same_program(fn, tuned, args)}


def second_process(tune_dir: str, size: str) -> dict[str, Any]:
    env = {**os.environ, "JAXPAR_TUNE_DIR": tune_dir, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, __file__, "--child", "--size", size], env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the second process failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("CHILD "))
    return dict(json.loads(line.split(" ", 1)[1]))


def child(size: str) -> None:
    """The second process: the same function and arguments, one call, compiles counted."""
    del size
    args = jax.block_until_ready(four_tiny_args())  # their compiles are not counted
    compiles: list[str] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Compiling "):
                compiles.append(record.getMessage().split(" with ")[0])

    logging.getLogger("jax").addHandler(Count())
    jax.config.update("jax_log_compiles", True)
    tuned = jaxpar.parallel_branches(four_tiny_scans, tune=True, **REWRITE_OPTIONS)
    start = time.perf_counter()
    jax.block_until_ready(tuned(*args))
    first_call_s = time.perf_counter() - start
    tuning = tuned.tuning(*args)
    assert tuning is not None
    print("CHILD " + json.dumps({"source": tuning.source, "chosen": tuning.chosen,
                                 "compiles": compiles, "first_call_s": first_call_s}))


def _times(ratio: float) -> str:
    return f"x{ratio:.3f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="quick", choices=suite.SIZES)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--workloads", help=f"subset of {', '.join(suite.WORKLOADS)}")
    parser.add_argument("--tune-dir", help="keep the decisions here (default: a temporary "
                        "directory)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        child(ns.size)
        return {}
    names = ns.workloads.split(",") if ns.workloads else list(suite.WORKLOADS)
    unknown = [name for name in names if name not in suite.WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; have {list(suite.WORKLOADS)}")
    temporary = None if ns.tune_dir else tempfile.TemporaryDirectory(prefix="jaxpar-tune-")
    tune_dir = ns.tune_dir or temporary.name  # type: ignore[union-attr]
    os.environ["JAXPAR_TUNE_DIR"] = tune_dir
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs, "
          f"size {ns.size}, {ns.repeats} repeats, decisions in {tune_dir}")
    results: dict[str, Any] = {"size": ns.size, "repeats": ns.repeats, "do_no_harm": {}}

    print("\n1. do no harm: median vs plain jax.jit (median of per-repetition ratios)")
    print(f"  {'workload':<20} {'chosen':<24} {'timed':>5} {'plain ms':>9} "
          f"{'jit(tuned)':>10} {'tuned':>7}  same HLO  within 2%")
    for name in names:
        workload = suite.WORKLOADS[name]
        entry = tune_workload(workload.fn, workload.args(ns.size), ns.repeats)
        variants = entry["variants"]
        entry["within"] = variants["jit(tuned)"]["ratio"] <= 1 + WITHIN
        results["do_no_harm"][name] = entry
        print(f"  {name:<20} {entry['chosen']:<24} {entry['programs_timed']:>5} "
              f"{variants['plain']['median_ms']:9.2f} "
              f"{_times(variants['jit(tuned)']['ratio']):>10} "
              f"{_times(variants['tuned']['ratio']):>7}  "
              f"{'yes' if entry['same_hlo'] else 'no':>8}  "
              f"{'yes' if entry['within'] else 'NO'}")
    within = [entry["within"] for entry in results["do_no_harm"].values()]
    same = [entry["same_hlo"] for entry in results["do_no_harm"].values()]
    print(f"  within 2%: {sum(within)} of {len(within)}; same HLO as plain: {sum(same)} of "
          f"{len(same)}")

    print(f"\n2. a rewrite faster on the CPU: four_tiny_scans, {REWRITE_OPTIONS}")
    entry = tune_workload(four_tiny_scans, four_tiny_args(), ns.repeats, **REWRITE_OPTIONS)
    results["rewrite"] = entry
    print("\n".join(entry["table"]))
    print(f"  then, interleaved: jit(tuned) x{entry['variants']['jit(tuned)']['ratio']:.3f}, "
          f"tuned x{entry['variants']['tuned']['ratio']:.3f} of plain "
          f"({entry['variants']['plain']['median_ms']:.1f} ms); tuning took "
          f"{entry['tune_s']:.1f} s")

    print("\n3. a second process, same function and arguments")
    reuse = second_process(tune_dir, ns.size)
    results["second_process"] = reuse
    print(f"  decision {reuse['source']} ({reuse['chosen']!r}); compiles: "
          f"{len(reuse['compiles'])} {reuse['compiles']}; first call "
          f"{reuse['first_call_s']:.2f} s")
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1, default=str))
    if temporary is not None:
        temporary.cleanup()
    return results


if __name__ == "__main__":
    main()
