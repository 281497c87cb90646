"""Is a small gap between jaxpar's decided call and ``jax.jit`` jaxpar's, or the spread
between two compiles of one program?

For each program named, in one fresh process: jaxpar's default decoration settled (the
device decided), ``jax.jit`` of the function ("jit A") and a second, separately compiled
``jax.jit`` of a wrapper of it ("jit B"), timed in interleaved rounds
(``dispatch.measure``); the ratios are to jit A. Where jaxpar kept ``jax.jit``'s program,
jaxpar's ratio and jit B's show the spread two compiles of the same program have.

Run (on the chip, ``JAXPAR_TUNE_DIR`` fresh)::

    python benchmarks/jit_pair.py --out OUT [--programs matmul_scan_w128_n97,...]
    JAX_PLATFORMS=cpu python benchmarks/jit_pair.py --cpu --out OUT   # tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dispatch
import jax
import measure_tpu
import tpu_loops

import jaxpar

DEFAULT = "matmul_scan_w128_n97,matmul_scan_w32_n2000,int_and_float_carry_n3000"


def pair(name: str, size: str, rounds: int, options: dict[str, Any]) -> dict[str, Any]:
    fn, args = tpu_loops.PROGRAMS[name](size)
    pb = jaxpar.parallel_branches(fn, **options)
    settled = measure_tpu.settle(pb, args)
    a = jax.jit(fn)
    b = jax.jit(lambda *x: fn(*x))  # another function: compiled apart from jit A
    timed = dispatch.measure({"jit A": a, "jit B": b, "jaxpar": pb}, args, 200, rounds)
    return {"chosen": settled["chosen"], "verdict": settled["verdict"],
            "loop_us": timed["loop_us"], "loop_ratio": timed["loop_ratio"],
            "max_abs_diff": measure_tpu.max_abs_diff(a(*args), pb(*args))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--programs", default=DEFAULT)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cpu", action="store_true", help="tiny sizes, measure=True")
    ns = parser.parse_args()
    options = {"measure": True, "target": "tpu"} if ns.cpu else {}
    results = {}
    for name in ns.programs.split(","):
        results[name] = pair(name, "s" if ns.cpu else "m", ns.rounds, options)
        print(name, json.dumps(results[name]), flush=True)
        with open(os.path.join(ns.out, "jitpair.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
