"""Time to the first executable: trace, lower and compile a 12-layer transformer
training step (or another program of the GPU suite, or ``overhead_10k``: the
9,996-equation program of ``benchmarks/overhead.py``) for a deviceless H200, plain
``jax.jit`` against jaxpar.

Each measurement runs in a fresh process (a first executable: no warm tracing caches,
no compiled executables, jaxpar's in-process memos empty), plain and jaxpar
alternating, ``--repeats`` times; the table gives each one's median and jaxpar's over
plain's. jaxpar's process also reports its stages: jaxpar's analysis (``CallState.prepare``:
its trace of the function, the passes, the plan, the mode and memory model), the rest
of the trace and lowering, and XLA's compile.

Usage::

    JAX_PLATFORMS=cpu python benchmarks/first_executable.py --repeats 5
    JAX_PLATFORMS=cpu python benchmarks/first_executable.py --size small --repeats 1
    JAX_PLATFORMS=cpu python benchmarks/first_executable.py --program overhead_10k

Needs the CUDA PJRT plugin (``jaxpar._compiled.gpu_compile.plugin_status``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def measure_once(which: str, size: str, program: str) -> dict[str, float]:
    """In this process: seconds to trace and lower, and to compile, ``which``."""
    sys.path.insert(0, HERE)
    import gpu_suite
    import jax

    import jaxpar
    from jaxpar import _dispatch
    from jaxpar._compiled.gpu_compile import lower_for_gpu

    if program == "overhead_10k":
        import overhead
        fn, args = overhead.build_program(10_000), overhead.program_args()
    else:
        fn, args = gpu_suite.PROGRAMS[program].build(size)
    args = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    analysis = [0.0]
    prepare = _dispatch.CallState.prepare

    def timed_prepare(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return prepare(*a, **k)
        finally:
            analysis[0] += time.perf_counter() - start

    _dispatch.CallState.prepare = timed_prepare  # type: ignore[method-assign]
    function = jaxpar.parallel_branches(fn, target="gpu") if which == "jaxpar" else fn
    start = time.perf_counter()
    lowered = lower_for_gpu(function, *args, gpu="h200").lowered
    lowered_at = time.perf_counter()
    lowered.compile()
    done = time.perf_counter()
    return {"total_s": done - start, "lower_s": lowered_at - start,
            "analysis_s": analysis[0], "compile_s": done - lowered_at}


def _in_subprocess(which: str, size: str, program: str) -> dict[str, float]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(HERE),
                                                      env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, __file__, "--child", which, "--size", size,
                          "--program", program], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", default="full", choices=("full", "small"))
    parser.add_argument("--program", default="transformer_train_step",
                        help="a program of benchmarks/gpu_suite.py, or overhead_10k")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", choices=("plain", "jaxpar"), help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        print(json.dumps(measure_once(ns.child, ns.size, ns.program)))
        return {}
    rows: dict[str, list[dict[str, float]]] = {"plain": [], "jaxpar": []}
    for repeat in range(ns.repeats):
        for which in ("plain", "jaxpar") if repeat % 2 == 0 else ("jaxpar", "plain"):
            row = _in_subprocess(which, ns.size, ns.program)
            rows[which].append(row)
            print(f"{repeat} {which:6s} " + " ".join(f"{k} {v:6.2f}"
                                                    for k, v in row.items()), flush=True)
    medians = {which: {k: statistics.median(r[k] for r in entries) for k in entries[0]}
               for which, entries in rows.items()}
    ratio = medians["jaxpar"]["total_s"] / medians["plain"]["total_s"]
    print(f"medians of {ns.repeats}: plain {medians['plain']['total_s']:.2f} s, jaxpar "
          f"{medians['jaxpar']['total_s']:.2f} s (analysis "
          f"{medians['jaxpar']['analysis_s']:.2f} s, compile "
          f"{medians['jaxpar']['compile_s']:.2f} s against {medians['plain']['compile_s']:.2f}"
          f" s): x{ratio:.3f}")
    result = {"rows": rows, "medians": medians, "ratio": ratio}
    if ns.json:
        with open(ns.json, "w") as file:
            json.dump(result, file, indent=1)
    return result


if __name__ == "__main__":
    main()
