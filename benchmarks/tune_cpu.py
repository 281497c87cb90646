"""The tuner on the CPU: ``parallel_branches(f, tune=True)`` vs ``jax.jit``.

Three parts, each with the figure that decides it:

1. Do no harm: every workload of ``benchmarks/run.py`` (size ``quick`` by default). The
   first concrete call of ``tuned = parallel_branches(fn, tune=True)`` measures the
   candidates and chooses; then ``plain = jax.jit(fn)``, ``jax.jit(tuned)`` and ``tuned``
   called directly run interleaved (the order rotates every round) for about
   ``--seconds`` each workload. Reported per variant: the median of the per-round ratios
   to plain, with their interquartile range, on two clocks: wall time, and the process's
   CPU time (all its threads), which other processes' load disturbs far less. Target:
   ``jax.jit(tuned)`` within 2% of plain (median ratio <= 1.02). (A direct call also pays
   jaxpar's Python dispatch, which is not the tuner's.) Each workload also says whether
   ``jax.jit(tuned)`` compiles to the same instructions as plain (``same HLO``: the
   compiled HLO's instructions with names, metadata and order set aside).
2. Rewrites on the CPU, where the tuner's choice matters: one short scan whose body
   XLA:CPU runs as a loop of memory-bound trips, with ``unroll=8``. At 8 steps of 2**18
   floats the unrolled scan is one fusion (xs read once, the carry never written back
   between steps): the rewrite is faster and the tuner must choose it. At 256 steps of
   2**14 floats the same option made the program slower with jax 0.10.2 (and faster
   with jax 0.12). Reported: the tuner's table and choice, then plain, the untuned
   rewrite and ``jax.jit(tuned)`` interleaved, ratios as in part 1, and whether the
   choice is the program that was faster afterwards on both clocks.
3. A second process: a fresh interpreter builds the first rewrite workload, calls it
   once with ``jax_log_compiles`` on and counts the compiles. Target: the stored
   decision is used (``source == "stored"``) and exactly one program is compiled.

Decisions go to a fresh temporary ``JAXPAR_TUNE_DIR`` (``--tune-dir`` to keep them).
About 2-3 minutes on two busy CPU cores.

Run::

    JAX_PLATFORMS=cpu python benchmarks/tune_cpu.py [--size quick] [--seconds 4]
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
from jaxpar._tune import MARGIN, PLAIN

WITHIN = 0.02  # do no harm: jax.jit(tuned) within 2% of plain
CLOCKS = ("wall", "cpu")


def _step(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return 0.9 * carry + x * x, None


def short_scan(carry: jax.Array, xs: jax.Array) -> jax.Array:
    """One scan of an elementwise body: XLA:CPU runs it as a loop, one memory-bound pass
    over the carry each trip; unrolled, the trips fuse into fewer passes."""
    return lax.scan(_step, carry, xs)[0]


def short_scan_args(steps: int, width: int) -> tuple[Any, ...]:
    return jnp.ones((width,)), jax.random.normal(jax.random.PRNGKey(0), (steps, width))


# The rewrite workloads: name -> (function, argument builder's arguments). The options
# are the same; the shapes (and the XLA version) decide which program is faster.
REWRITE_OPTIONS: dict[str, Any] = {"target": "cpu", "unroll": 8}
REWRITES: dict[str, tuple[Callable[..., Any], dict[str, int]]] = {
    "short_scan 8 x 2**18": (short_scan, {"steps": 8, "width": 1 << 18}),
    "short_scan 256 x 2**14": (short_scan, {"steps": 256, "width": 1 << 14}),
}
REUSED = "short_scan 8 x 2**18"  # what the second process calls


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


def interleaved(variants: Mapping[str, Callable[[], Any]], seconds: float,
                min_rounds: int = 9, max_rounds: int = 400
                ) -> dict[str, dict[str, list[float]]]:
    """Per clock (``wall``, ``cpu``), per variant, the times (s) of each round; every
    variant once a round, the order rotated each round so that drift and load hit all
    alike; rounds until ``seconds`` have passed (at least ``min_rounds``). Each variant
    runs twice first (compile, warm-up)."""
    for run in variants.values():
        jax.block_until_ready(run())
        jax.block_until_ready(run())
    names = list(variants)
    samples: dict[str, dict[str, list[float]]] = {clock: {name: [] for name in names}
                                                  for clock in CLOCKS}
    start = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds
                                   or time.perf_counter() - start < seconds):
        shift = rounds % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(variants[name]())
            samples["cpu"][name].append(time.process_time() - cpu)
            samples["wall"][name].append(time.perf_counter() - wall)
        rounds += 1
    return samples


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[round(q * (len(ordered) - 1))]


def ratio_summary(samples: list[float], plain: list[float]) -> dict[str, float]:
    """The per-round ratios to plain: median, interquartile range, and a 95% confidence
    interval of the median (distribution-free: the order statistics around it)."""
    ordered = sorted(t / p for t, p in zip(samples, plain, strict=True))
    n = len(ordered)
    half = 0.98 * n ** 0.5
    low, high = max(int(n / 2 - half), 0), min(int(n / 2 + half + 1), n - 1)
    return {"median_ms": statistics.median(samples) * 1e3,
            "ratio": statistics.median(ordered), "q25": _quantile(ordered, 0.25),
            "q75": _quantile(ordered, 0.75), "ci_low": ordered[low],
            "ci_high": ordered[high]}


def summaries(samples: Mapping[str, Mapping[str, list[float]]]
              ) -> dict[str, dict[str, dict[str, float]]]:
    """``[clock][variant]`` -> ``ratio_summary`` against ``plain``."""
    return {clock: {name: ratio_summary(times, by_name["plain"])
                    for name, times in by_name.items()}
            for clock, by_name in samples.items()}


def _first_call(fn: Callable[..., Any], args: tuple[Any, ...], **options: Any
                ) -> tuple[Any, float]:
    tuned = jaxpar.parallel_branches(fn, tune=True, **options)
    start = time.perf_counter()
    jax.block_until_ready(tuned(*args))  # measures the candidates, then runs the winner
    return tuned, time.perf_counter() - start


def _tuning_fields(tuned: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    tuning = tuned.tuning(*args)
    assert tuning is not None
    return {"chosen": tuning.chosen, "source": tuning.source,
            "programs_timed": sum(1 for row in tuning.rows if row.median_s is not None),
            "tuner_ratios": {row.label: tuning.ratio(row.label) for row in tuning.rows},
            "table": tuning.lines()}


def tune_workload(fn: Callable[..., Any], args: tuple[Any, ...], seconds: float,
                  **options: Any) -> dict[str, Any]:
    """Part 1: the tuner's choice, then plain, ``jax.jit(tuned)`` and ``tuned`` timed."""
    tuned, tune_s = _first_call(fn, args, **options)
    plain, jitted = jax.jit(fn), jax.jit(tuned)
    samples = interleaved({"plain": lambda: plain(*args), "jit(tuned)": lambda: jitted(*args),
                           "tuned": lambda: tuned(*args)}, seconds)
    return {**_tuning_fields(tuned, args), "tune_s": tune_s,
            "rounds": len(samples["wall"]["plain"]), "clocks": summaries(samples),
            "same_hlo": same_program(fn, tuned, args)}


def rewrite_workload(fn: Callable[..., Any], args: tuple[Any, ...], seconds: float,
                     **options: Any) -> dict[str, Any]:
    """Part 2: the tuner's choice, then plain, the rewrite untuned and ``jax.jit(tuned)``
    timed, and whether the choice was the faster program."""
    tuned, tune_s = _first_call(fn, args, **options)
    plain, rewrite = jax.jit(fn), jax.jit(jaxpar.parallel_branches(fn, **options))
    jitted = jax.jit(tuned)
    samples = interleaved({"plain": lambda: plain(*args), "rewrite": lambda: rewrite(*args),
                           "jit(tuned)": lambda: jitted(*args)}, seconds)
    entry = {**_tuning_fields(tuned, args), "tune_s": tune_s,
             "rounds": len(samples["wall"]["plain"]), "clocks": summaries(samples)}
    # The faster program afterwards, by both clocks: the rewrite where its median ratio is
    # below plain's by the tuner's margin, plain where it is not.
    faster = {clock: "jaxpar (chosen options)"
              if entry["clocks"][clock]["rewrite"]["ratio"] < 1 - MARGIN else "jax.jit"
              for clock in CLOCKS}
    entry["faster_afterwards"] = faster
    # Right: the tuner ran the program that was faster afterwards by both clocks; None
    # where the clocks disagree (the load decided).
    entry["right"] = (entry["chosen"] == faster["cpu"]
                      if faster["cpu"] == faster["wall"] else None)
    return entry


def second_process(tune_dir: str) -> dict[str, Any]:
    env = {**os.environ, "JAXPAR_TUNE_DIR": tune_dir, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, __file__, "--child"], env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the second process failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("CHILD "))
    return dict(json.loads(line.split(" ", 1)[1]))


def child() -> None:
    """The second process: the same function and arguments, one call, compiles counted."""
    fn, sizes = REWRITES[REUSED]
    args = jax.block_until_ready(short_scan_args(**sizes))  # their compiles not counted
    compiles: list[str] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Compiling "):
                compiles.append(record.getMessage().split(" with ")[0])

    logging.getLogger("jax").addHandler(Count())
    jax.config.update("jax_log_compiles", True)
    tuned = jaxpar.parallel_branches(fn, tune=True, **REWRITE_OPTIONS)
    start = time.perf_counter()
    jax.block_until_ready(tuned(*args))
    first_call_s = time.perf_counter() - start
    tuning = tuned.tuning(*args)
    assert tuning is not None
    print("CHILD " + json.dumps({"source": tuning.source, "chosen": tuning.chosen,
                                 "compiles": compiles, "first_call_s": first_call_s}))


def _ratio(entry: Mapping[str, float]) -> str:
    return f"x{entry['ratio']:.3f} [{entry['q25']:.2f}-{entry['q75']:.2f}]"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="quick", choices=suite.SIZES)
    parser.add_argument("--seconds", type=float, default=4.0,
                        help="timing per workload, after the tuner's (default 4)")
    parser.add_argument("--workloads", help=f"subset of {', '.join(suite.WORKLOADS)}")
    parser.add_argument("--tune-dir", help="keep the decisions here (default: a temporary "
                        "directory)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        child()
        return {}
    names = ns.workloads.split(",") if ns.workloads else list(suite.WORKLOADS)
    unknown = [name for name in names if name not in suite.WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; have {list(suite.WORKLOADS)}")
    temporary = None if ns.tune_dir else tempfile.TemporaryDirectory(prefix="jaxpar-tune-")
    tune_dir = ns.tune_dir or temporary.name  # type: ignore[union-attr]
    os.environ["JAXPAR_TUNE_DIR"] = tune_dir
    began = time.perf_counter()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs, "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}, size {ns.size}, "
          f"{ns.seconds:g} s a workload, decisions in {tune_dir}")
    results: dict[str, Any] = {"size": ns.size, "seconds": ns.seconds,
                               "load_before": os.getloadavg(), "do_no_harm": {}}

    print("\n1. do no harm: median of per-round ratios to plain jax.jit [interquartile "
          "range], wall time and CPU time")
    print(f"  {'workload':<18} {'chosen':<8} {'timed':>5} {'rounds':>6} {'plain ms':>8}  "
          f"{'jit(tuned) wall':<22} {'jit(tuned) cpu':<22} {'tuned cpu':<22} same HLO")
    for name in names:
        workload = suite.WORKLOADS[name]
        entry = tune_workload(workload.fn, workload.args(ns.size), ns.seconds)
        wall, cpu = entry["clocks"]["wall"], entry["clocks"]["cpu"]
        entry["within"] = {clock: entry["clocks"][clock]["jit(tuned)"]["ratio"] <= 1 + WITHIN
                           for clock in CLOCKS}
        results["do_no_harm"][name] = entry
        chosen = "jax.jit" if entry["chosen"] == PLAIN else entry["chosen"]
        print(f"  {name:<18} {chosen:<8} {entry['programs_timed']:>5} "
              f"{entry['rounds']:>6} {wall['plain']['median_ms']:8.2f}  "
              f"{_ratio(wall['jit(tuned)']):<22} {_ratio(cpu['jit(tuned)']):<22} "
              f"{_ratio(cpu['tuned']):<22} {'yes' if entry['same_hlo'] else 'no'}")
    harm = results["do_no_harm"].values()
    for clock in CLOCKS:
        ratios = [entry["clocks"][clock]["jit(tuned)"]["ratio"] for entry in harm]
        print(f"  {clock}: jit(tuned) within 2% of plain on "
              f"{sum(entry['within'][clock] for entry in harm)} of {len(ratios)} "
              f"(median ratio over the workloads x{statistics.median(ratios):.3f}, "
              f"range x{min(ratios):.3f}-x{max(ratios):.3f})")
    print(f"  same HLO as plain: {sum(entry['same_hlo'] for entry in harm)} of "
          f"{len(results['do_no_harm'])}")

    print(f"\n2. rewrites on the CPU: short_scan with {REWRITE_OPTIONS}")
    results["rewrites"] = {}
    for name, (fn, sizes) in REWRITES.items():
        entry = rewrite_workload(fn, short_scan_args(**sizes), ns.seconds,
                                 **REWRITE_OPTIONS)
        results["rewrites"][name] = entry
        clocks = entry["clocks"]
        print(f"  {name}: the tuner (took {entry['tune_s']:.1f} s):")
        print("\n".join(f"  {line}" for line in entry["table"]))
        print(f"    then {entry['rounds']} rounds interleaved, plain "
              f"{clocks['wall']['plain']['median_ms']:.2f} ms: rewrite wall "
              f"{_ratio(clocks['wall']['rewrite'])} cpu {_ratio(clocks['cpu']['rewrite'])}; "
              f"jit(tuned) wall {_ratio(clocks['wall']['jit(tuned)'])} cpu "
              f"{_ratio(clocks['cpu']['jit(tuned)'])}")
        verdict = {True: "right", False: "WRONG", None: "the clocks disagree"}[entry["right"]]
        print(f"    chose {entry['chosen']!r}; the faster afterwards (wall, cpu): "
              f"{entry['faster_afterwards']['wall']!r}, "
              f"{entry['faster_afterwards']['cpu']!r}: {verdict}")

    print(f"\n3. a second process, {REUSED} with the same options")
    reuse = second_process(tune_dir)
    results["second_process"] = reuse
    print(f"  decision {reuse['source']} ({reuse['chosen']!r}); compiles: "
          f"{len(reuse['compiles'])} {reuse['compiles']}; first call "
          f"{reuse['first_call_s']:.2f} s")
    results["load_after"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - began
    print(f"\nload average after: {' '.join(f'{v:.1f}' for v in os.getloadavg())}; took "
          f"{results['elapsed_s']:.0f} s")
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1, default=str))
    if temporary is not None:
        temporary.cleanup()
    return results


if __name__ == "__main__":
    main()
