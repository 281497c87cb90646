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
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
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


def _demo_story(title: str, fn: Callable[..., Any], args: Sequence[Any], out: Any) -> bool:
    from . import inspect, parallel_branches

    print(f"\n== {title} ==", file=out)
    print(inspect(fn, target="gpu")(*args), file=out)
    plain = jax.jit(fn)
    rewritten = jax.jit(parallel_branches(fn))
    expected = plain(*args)
    got = rewritten(*args)
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree_util.tree_leaves(expected),
                               jax.tree_util.tree_leaves(got), strict=True))
    print(f"same values as jax.jit: {'yes' if same else 'NO'}", file=out)
    t_plain, t_new = _time_pair(lambda: plain(*args), lambda: rewritten(*args), reps=5)
    print(f"time on {jax.default_backend()}: plain {t_plain * 1e3:.2f} ms, jaxpar "
          f"{t_new * 1e3:.2f} ms (ratio {t_new / t_plain:.3f})", file=out)
    return same


def _seed_two_scans(n: int = 100, steps: int = 1000) -> tuple[Callable[..., Any], list[Any]]:
    def step1(c: Any, x: Any) -> Any:
        return jnp.tanh(c @ x @ x) * 0.5, None

    def step2(c: Any, x: Any) -> Any:
        return jnp.sin(x @ c) + 0.5 * c, None

    def two_scans(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
        return jax.lax.scan(step1, a, xs1)[0], jax.lax.scan(step2, b, xs2)[0]

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    args = [jax.random.normal(keys[0], (n, n)) * 0.1, jax.random.normal(keys[1], (n, n)) * 0.1,
            jax.random.normal(keys[2], (steps, n, n)) * 0.1,
            jax.random.normal(keys[3], (steps, n, n)) * 0.1]
    return two_scans, args


def _inception_block(n: int = 512) -> tuple[Callable[..., Any], list[Any]]:
    def block(x: Any, w1: Any, w2: Any, w3: Any, w4: Any) -> Any:
        branches = [jnp.tanh(jnp.tanh(x @ w) @ w) for w in (w1, w2, w3, w4)]
        return jnp.concatenate(branches, axis=-1)

    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    args = [jax.random.normal(k, (n, n)) * 0.05 for k in keys]
    return block, args


def demo(out: Any = sys.stdout) -> int:
    """Runs the user stories end to end and reports."""
    print(f"jaxpar demo on jax {jax.__version__}, backend {jax.default_backend()}", file=out)
    ok = True
    fn, args = _seed_two_scans()
    ok &= _demo_story("seed 002: two scans with different bodies", fn, args, out)
    fn, args = _inception_block()
    ok &= _demo_story("multi-branch block (four independent matmul chains)", fn, args, out)
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
    plan = inspect(fn, target=ns.target)(*specs)
    if ns.json:
        import json

        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan)
    return 0
