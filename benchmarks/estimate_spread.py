"""The planner's figure against the compile's, per program of the GPU suite.

For each program of ``benchmarks/gpu_suite.py``: ``jaxpar.inspect(f, target="gpu")``'s
``Plan.estimate`` (jaxpar's planning model, nothing compiled) and ``gpu_preview``'s
(deviceless H200 compiles of plain ``jax.jit`` and of jaxpar, ``jaxpar._compiled.estimate``),
as ratios jaxpar / plain, and how far apart they are (``rel``: planned ratio over compiled
ratio, minus one). Needs the CUDA plugin for the compiles; shapes only, nothing runs.

Run::

    JAX_PLATFORMS=cpu python benchmarks/estimate_spread.py [--size small|full] [NAME ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_suite

import jaxpar


def spread_row(name: str, size: str) -> str:
    """One line: the planned and the compiled ratio of program ``name``."""
    fn, args = gpu_suite.PROGRAMS[name].build(size)
    specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
    start = time.perf_counter()
    planned = jaxpar.inspect(fn, target="gpu")(*specs).estimate
    preview = jaxpar.gpu_preview(fn, *specs)
    compiled = preview.plan.estimate
    rel = planned.ratio / compiled.ratio - 1.0 if compiled.ratio > 0 else float("nan")
    return (f"| {name} | {preview.jaxpar_command_buffers.value} | x{planned.ratio:.3f} "
            f"| x{compiled.ratio:.3f} | {rel:+.1%} | {time.perf_counter() - start:.0f} s |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="programs (default: the whole suite)")
    parser.add_argument("--size", choices=("small", "full"), default="small")
    options = parser.parse_args(argv)
    print("| program | chosen mode | planned ratio | compiled ratio | rel | time |")
    print("|---|---|---|---|---|---|")
    for name in options.names or list(gpu_suite.PROGRAMS):
        try:
            print(spread_row(name, options.size), flush=True)
        except Exception as error:  # one program's failure is a row, not the end
            print(f"| {name} | error: {type(error).__name__}: {str(error)[:120]} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
