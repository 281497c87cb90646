"""Snapshot of what jaxpar decides and emits, to diff before and after a refactoring.

For a fixed set of programs (the GPU suite at small size, the examples, the tests'
hand-written programs and property programs drawn derandomized from
``tests/programs.py``) and both targets ``"gpu"`` and ``"cpu"``, it records:

* ``plan``: ``jaxpar.inspect(f, target=...)(*args).to_dict()``;
* ``jaxpr``: the rewritten program, ``jax.make_jaxpr(parallel_branches(f))``;
* ``lowered``: ``jax.jit(parallel_branches(f)).trace(...).lower(...)`` for CUDA
  (target ``"gpu"``) or the CPU, as text.

Run::

    JAX_PLATFORMS=cpu python benchmarks/plan_snapshot.py --out before.json
    JAX_PLATFORMS=cpu python benchmarks/plan_snapshot.py --out after.json
    python benchmarks/plan_snapshot.py --compare before.json after.json

``--compare`` prints every program whose plan, jaxpr or lowered text differs (with the
first differing keys of the plan) and exits non-zero when any does.

Sharp edges:
  * Both snapshots must come from the same checkout path and JAX version: source lines
    and lowered locations are part of what is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _folder in (_ROOT, os.path.join(_ROOT, "tests"), os.path.join(_ROOT, "examples"),
                os.path.join(_ROOT, "benchmarks")):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)

import jax  # noqa: E402

import jaxpar  # noqa: E402

Entry = tuple[str, Callable[..., Any], tuple[Any, ...]]
# Property programs drawn per strategy (derandomized, so every run draws the same).
_DRAWS = {"programs": 16, "scan_programs": 16, "loop_programs": 8, "feature_programs": 8}


def _suite() -> Iterator[Entry]:
    import gpu_suite

    for name, program in gpu_suite.PROGRAMS.items():
        fn, args = program.build("small")
        yield f"suite/{name}", fn, tuple(args)


def _examples() -> Iterator[Entry]:
    import ensemble
    import inception_block
    import numpy as np
    import two_scans

    x = jax.numpy.asarray(np.random.default_rng(1).standard_normal((64, 64), np.float32))
    yield "examples/ensemble_widths", ensemble.ensemble, (ensemble.make_members(), x)
    yield ("examples/ensemble_same", ensemble.ensemble,
           (ensemble.make_members(widths=(128,) * 4), x))
    yield "examples/two_scans", two_scans.two_scans, tuple(two_scans.make_args())
    yield ("examples/inception_block", inception_block.inception,
           (inception_block.make_input(), inception_block.make_params()))


def _hand_written() -> Iterator[Entry]:
    from helpers import benchmarks as loaded
    from helpers import programs as hand_written

    yield "helpers/two_scans", hand_written.two_scans, hand_written.two_scans_args()
    yield "helpers/four_branches", hand_written.four_branches, hand_written.four_branches_args()
    yield "helpers/pure_chain", hand_written.pure_chain, hand_written.pure_chain_args()
    yield "helpers/seed_002_small", hand_written.seed_002, loaded.seed_002_small_args()
    yield ("helpers/four_matmul_branches", hand_written.four_matmul_branches,
           hand_written.four_matmul_branches_args())
    yield "helpers/cnn_loss_grad", jax.grad(hand_written.cnn_loss), hand_written.cnn_args()


def _drawn() -> Iterator[Entry]:
    import programs
    from hypothesis import HealthCheck, Phase, given, settings

    for strategy_name, count in _DRAWS.items():
        drawn: list[Any] = []

        @settings(derandomize=True, max_examples=count, database=None, deadline=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(getattr(programs, strategy_name)())
        def collect(program: Any) -> None:
            drawn.append(program)  # noqa: B023 (run at once, in this iteration)

        collect()
        for k, program in enumerate(drawn):
            yield f"{strategy_name}/{k}", program.fn, tuple(program.args)


def _record(fn: Callable[..., Any], args: tuple[Any, ...], target: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        out["plan"] = jaxpar.inspect(fn, target=target)(*args).to_dict()
    except Exception as error:  # recorded: a failure is part of the snapshot
        out["plan"] = f"error: {type(error).__name__}: {error}"
    try:
        fast = jaxpar.parallel_branches(fn, target=target)
        out["jaxpr"] = str(jax.make_jaxpr(fast)(*args))
        platform = "cuda" if target == "gpu" else "cpu"
        out["lowered"] = jax.jit(fast).trace(*args).lower(
            lowering_platforms=(platform,)).as_text()
    except Exception as error:
        out.setdefault("jaxpr", None)
        out["lowered"] = f"error: {type(error).__name__}: {error}"
    return out


def snapshot(groups: list[str]) -> dict[str, Any]:
    """Every program of ``groups`` (``suite``, ``examples``, ``helpers``, ``drawn``)."""
    makers = {"suite": _suite, "examples": _examples, "helpers": _hand_written,
              "drawn": _drawn}
    result: dict[str, Any] = {}
    for group in groups:
        for name, fn, args in makers[group]():
            start = time.perf_counter()
            for target in ("gpu", "cpu"):
                result[f"{name}@{target}"] = _record(fn, args, target)
            print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return result


def _first_differences(a: Any, b: Any, path: str = "", limit: int = 5) -> list[str]:
    if type(a) is not type(b):
        return [f"{path}: {a!r:.120} != {b!r:.120}"]
    if isinstance(a, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                out.append(f"{path}/{key}: only in {'after' if key in b else 'before'}")
            else:
                out += _first_differences(a[key], b[key], f"{path}/{key}", limit)
            if len(out) >= limit:
                break
        return out[:limit]
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)} items"]
        out = []
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            out += _first_differences(x, y, f"{path}[{k}]", limit)
            if len(out) >= limit:
                break
        return out[:limit]
    return [] if a == b else [f"{path}: {a!r:.120} != {b!r:.120}"]


def compare(before: dict[str, Any], after: dict[str, Any]) -> int:
    """Prints the differences; returns how many entries differ."""
    differing = 0
    for key in sorted(set(before) | set(after)):
        if key not in before or key not in after:
            print(f"{key}: only in {'after' if key in after else 'before'}")
            differing += 1
            continue
        diffs = []
        for part in ("plan", "jaxpr", "lowered"):
            if before[key].get(part) != after[key].get(part):
                diffs.append(part)
        if diffs:
            differing += 1
            print(f"{key}: {', '.join(diffs)} differ")
            if "plan" in diffs:
                for line in _first_differences(before[key]["plan"], after[key]["plan"]):
                    print(f"    {line}")
    print(f"{len(set(before) | set(after))} entries, {differing} differ")
    return differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the snapshot to this JSON file")
    parser.add_argument("--groups", default="suite,examples,helpers,drawn")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        with open(args.compare[0]) as f:
            before = json.load(f)
        with open(args.compare[1]) as f:
            after = json.load(f)
        sys.exit(1 if compare(before, after) else 0)
    result = snapshot(args.groups.split(","))
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
