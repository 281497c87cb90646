"""The ``python -m jaxpar`` command.

Example::

    python -m jaxpar demo
    python -m jaxpar inspect examples.two_scans:two_scans \
        --args "f32[100,100] f32[100,100] f32[50,100,100] f32[50,100,100]"

Sharp edges:
  * ``demo`` times on the machine at hand; on a CPU the stream annotations are
    not emitted (target "auto" resolves to "cpu"), so expect ratios near 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
           "i8": "int8", "i32": "int32", "i64": "int64", "u8": "uint8", "u32": "uint32",
           "bool": "bool", "pred": "bool"}


def parse_arg_specs(text: str) -> list[jax.ShapeDtypeStruct]:
    """Parses ``"f32[100,100] i32[]"`` into ShapeDtypeStructs."""
    specs = []
    for token in text.split():
        match = re.fullmatch(r"([a-z]+\d*)\[([\d,\s]*)\]", token)
        if not match or match.group(1) not in _DTYPES:
            raise ValueError(
                f"bad --args entry {token!r}: write DTYPE[DIMS], e.g. f32[100,100] or i32[] "
                f"(dtypes: {', '.join(sorted(_DTYPES))})")
        dims = tuple(int(d) for d in match.group(2).replace(" ", "").split(",") if d)
        specs.append(jax.ShapeDtypeStruct(dims, _DTYPES[match.group(1)]))
    return specs


def load_function(path: str) -> Callable[..., Any]:
    """Imports ``package.module:function`` (attributes may be dotted)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"bad function path {path!r}: write MODULE:FUNCTION, "
                         "e.g. examples.two_scans:two_scans")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import module {module_name!r} from {path!r}: {error}. "
                         "Run from the directory that contains it, or install it.") from error
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{path!r} is a {type(obj).__name__}, not a function")
    return obj


def _time_pair(plain: Callable[[], Any], rewritten: Callable[[], Any],
               reps: int) -> tuple[float, float]:
    jax.block_until_ready(plain())
    jax.block_until_ready(rewritten())
    a, b = [], []
    for _ in range(reps):  # interleaved so drift hits both alike
        start = time.perf_counter()
        jax.block_until_ready(plain())
        a.append(time.perf_counter() - start)
        start = time.perf_counter()
        jax.block_until_ready(rewritten())
        b.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def _same(expected: Any, got: Any) -> bool:
    return all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
               for a, b in zip(jax.tree_util.tree_leaves(expected),
                               jax.tree_util.tree_leaves(got), strict=True))


def _demo_story(title: str, fn: Callable[..., Any], args: Sequence[Any], out: Any) -> bool:
    from . import gpu_preview, inspect, parallel_branches
    from ._deviceless import plugin_status

    print(f"\n== {title} ==", file=out)
    print(inspect(fn, target="gpu")(*args), file=out)
    plain = jax.jit(fn)
    here = jax.jit(parallel_branches(fn))  # target "auto": this machine's backend
    for_gpu = jax.jit(parallel_branches(fn, target="gpu"))
    expected = plain(*args)
    same = _same(expected, here(*args)) and _same(expected, for_gpu(*args))
    print(f"same values as jax.jit: {'yes' if same else 'NO'}", file=out)
    t_plain, t_new = _time_pair(lambda: plain(*args), lambda: here(*args), reps=5)
    print(f"time on {jax.default_backend()}: plain {t_plain * 1e3:.2f} ms, jaxpar "
          f"{t_new * 1e3:.2f} ms (ratio {t_new / t_plain:.3f})", file=out)
    ok, why = plugin_status()
    if not ok:
        print(f"(GPU preview skipped: {why})", file=out)
        return same
    specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    if any(len(leaf.sharding.device_set) > 1 for leaf in jax.tree_util.tree_leaves(args)
           if hasattr(leaf, "sharding")):
        print("(GPU preview of multi-device programs: see benchmarks/run.py)", file=out)
        return same
    try:
        print(gpu_preview(fn, *specs, gpu="h200"), file=out)
    except RuntimeError as error:
        print(f"(GPU preview skipped: {error})", file=out)
    return same


def _load_examples() -> list[Any]:
    """The example scripts of a source checkout, which hold the user stories."""
    import importlib.util
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "examples"
    modules = []
    for name in ("two_scans", "inception_block", "collective_matmul"):
        path = folder / f"{name}.py"
        if not path.exists():
            raise FileNotFoundError(
                f"{path} not found: `python -m jaxpar demo` runs the examples of a source "
                "checkout; install with `pip install -e .` from the repository")
        spec = importlib.util.spec_from_file_location(f"jaxpar_demo_{name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules.append(module)
    return modules


def demo(out: Any = sys.stdout) -> int:
    """Runs the user stories end to end and reports."""
    try:  # eight fake CPU devices for the collective story, before the backend starts
        platforms = os.environ.get("JAX_PLATFORMS", "")
        if not platforms or "cpu" in platforms:
            jax.config.update("jax_num_cpu_devices", 8)
    except RuntimeError:
        pass
    print(f"jaxpar demo on jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{len(jax.devices())} devices", file=out)
    ok = True
    for module in _load_examples():
        story = module.story()
        if story is None:
            print(f"\n(skipped {module.__name__}: needs 8 devices)", file=out)
            continue
        title, fn, args = story
        ok &= _demo_story(title, fn, args, out)
    print("\nall results equal the plain versions" if ok else "\nMISMATCH", file=out)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxpar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the user stories: plans, equality checks, timings")
    insp = sub.add_parser("inspect", help="print the plan of MODULE:FUNCTION")
    insp.add_argument("function", help="MODULE:FUNCTION, e.g. examples.two_scans:two_scans")
    insp.add_argument("--args", required=True, help='argument shapes, e.g. "f32[100,100] i32[]"')
    insp.add_argument("--target", default="gpu", choices=["auto", "gpu", "cpu", "tpu"])
    insp.add_argument("--json", action="store_true", help="print the plan as JSON")
    insp.add_argument("--html", metavar="PATH", help="also save the plan picture to PATH")
    ns = parser.parse_args(argv)
    if ns.command == "demo":
        return demo()
    from . import inspect

    sys.path.insert(0, "")
    try:
        fn = load_function(ns.function)
        specs = parse_arg_specs(ns.args)
    except ValueError as error:
        parser.error(str(error))
    from ._trace import TraceError

    try:
        plan = inspect(fn, target=ns.target)(*specs)
    except (TraceError, TypeError) as error:
        parser.error(f"{ns.function} does not take --args {ns.args!r}: {error}")
    if ns.json:
        import json

        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan)
    if ns.html:
        plan.save(ns.html)
        print(f"saved {ns.html}", file=sys.stderr)
    return 0
