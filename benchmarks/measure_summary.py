"""Markdown tables of ``benchmarks/measure_tpu.py``'s results (the ``measure-*.json`` files
of one or more results folders), as docs/benchmarks.md quotes them.

Run::

    python benchmarks/measure_summary.py docs/measurements/measure-r2 [MORE_DIRS...]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def table(name: str, results: dict[str, Any]) -> list[str]:
    lines = [f"**{name}**", "",
             "| program | per call vs jax.jit | first call vs jax.jit (jax.jit's s) | "
             "calls to decide | timing s | decision |",
             "|---|---|---|---|---|---|"]
    ratios, firsts = [], []
    for program, entry in results.items():
        if "loop_ratio" not in entry:
            lines.append(f"| {program} | {entry.get('error') or entry.get('skipped')} |"
                         " | | | |")
            continue
        first, settle = entry["first_call_s"], entry["settle"]
        ratios.append(entry["loop_ratio"])
        firsts.append(first["ratio"])
        lines.append(f"| {program} | x{entry['loop_ratio']:.3f} | x{first['ratio']:.2f} "
                     f"({first['jax.jit']:.2f}) | {settle['calls']} | "
                     f"{settle['measure_s'] or 0:.2f} | {settle['verdict']} |")
    if ratios:
        lines += ["", f"{len(ratios)} programs: per call geomean x{geomean(ratios):.3f}, "
                      f"worst x{max(ratios):.3f}; first call mean x"
                      f"{sum(firsts) / len(firsts):.3f}, worst x{max(firsts):.2f}."]
    return [*lines, "", *tuned(results)]


def within(default: float, tuned: float) -> str:
    return "yes" if default <= 1.05 * tuned else "no"


def tuned(results: dict[str, Any]) -> list[str]:
    """``--tune``'s figures: per program the default's per call beside ``tune=True``'s, and
    whether the default gets within 5% of a gain ``tune=True`` found."""
    rows = [f"| {program} | x{e['loop_ratio']:.3f} | x{e['tune_loop_ratio']:.3f} | "
            f"{e['tune_chosen']} | {within(e['loop_ratio'], e['tune_loop_ratio'])} |"
            for program, e in results.items() if "tune_loop_ratio" in e]
    if not rows:
        return []
    return ["| program | default per call | tune=True per call | tune=True runs | default "
            "within 5% |", "|---|---|---|---|---|", *rows, ""]


def second(results: dict[str, Any]) -> list[str]:
    firsts = [e["first_call_s"]["ratio"] for e in results.values() if "first_call_s" in e]
    sources = sorted({str(e["settle"]["source"]) for e in results.values() if "settle" in e})
    return [f"**second process**: {len(firsts)} programs, first call mean "
            f"x{sum(firsts) / len(firsts):.3f}, worst x{max(firsts):.2f}; decisions: "
            f"{', '.join(sources)}", ""]


def main(folders: list[str]) -> None:
    for folder in folders:
        for path in sorted(Path(folder).glob("measure-*.json")):
            results = json.loads(path.read_text())
            part = path.stem.removeprefix("measure-")
            lines = second(results) if part == "second" else table(f"{folder}: {part}",
                                                                    results)
            print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
