"""A behaviour fingerprint of jaxpar: what it decides and emits for a fixed set of programs.

For each program (the GPU suite at its small size, the overhead benchmark's synthetic
programs at about 1k and 2k equations, and random programs drawn by ``tests/programs.py``
under a derandomized hypothesis profile) and each target (``"gpu"``, ``"tpu"``, ``"cpu"``;
``--targets`` picks others), it records

* ``jaxpar.inspect(f, target=...)(*args).to_dict()`` (the plan and every decision), and
* ``jax.jit(jaxpar.parallel_branches(f, target=...)).lower(*args).as_text()``,

as one JSON file. A change meant to leave behaviour alone (a speed-up) is checked by
writing the fingerprint before and after and comparing the files byte for byte::

    JAX_PLATFORMS=cpu python benchmarks/fingerprint.py --out before.json
    ... change ...
    JAX_PLATFORMS=cpu python benchmarks/fingerprint.py --out after.json --compare before.json

``--compare`` prints the entries that differ and exits 1 if any does. Slow (minutes on two
cores); not part of the test suite.

Sharp edges:
  * The lowered text names source locations; run both sides from the same checkout path,
    or the locations of jaxpar's own lines may differ where a rewrite emits them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax

import jaxpar

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

TARGETS = ("gpu", "tpu", "cpu")


def suite_programs() -> Iterator[tuple[str, Callable[..., Any], tuple[Any, ...]]]:
    import gpu_suite

    for name, entry in gpu_suite.PROGRAMS.items():
        fn, args = entry.build("small")
        yield f"suite/{name}", fn, tuple(args)


def overhead_programs() -> Iterator[tuple[str, Callable[..., Any], tuple[Any, ...]]]:
    import overhead

    for size in (1000, 2000):
        yield f"overhead/{size}", overhead.build_program(size), overhead.program_args()


def random_programs(count: int) -> Iterator[tuple[str, Callable[..., Any], tuple[Any, ...]]]:
    import programs
    from hypothesis import HealthCheck, given, settings

    strategies = {"dag": programs.program_specs(), "scan": programs.scan_program_specs(),
                  "loop": programs.loop_program_specs(),
                  "feature": programs.feature_program_specs()}
    for label, strategy in strategies.items():
        specs: list[Any] = []

        @settings(derandomize=True, max_examples=count, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def collect(spec: Any) -> None:
            specs.append(spec)  # noqa: B023 (run before the loop moves on)

        collect()
        for k, spec in enumerate(specs[:count]):
            program = programs.build_program(spec)
            yield f"random/{label}/{k}", program.fn, program.args


def fingerprint(fn: Callable[..., Any], args: tuple[Any, ...],
                targets: tuple[str, ...] = TARGETS) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for target in targets:
        try:
            out[f"inspect_{target}"] = jaxpar.inspect(fn, target=target)(*args).to_dict()
        except Exception as error:  # a refusal is behaviour too
            out[f"inspect_{target}"] = f"error: {type(error).__name__}: {error}"
        try:
            lowered = jax.jit(jaxpar.parallel_branches(fn, target=target)).lower(*args)
            out[f"lowered_{target}"] = lowered.as_text()
        except Exception as error:
            out[f"lowered_{target}"] = f"error: {type(error).__name__}: {error}"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", required=True, help="write the fingerprint here (JSON)")
    parser.add_argument("--compare", help="a fingerprint to compare with; exit 1 if they differ")
    parser.add_argument("--random", type=int, default=25,
                        help="random programs per strategy (default 25)")
    parser.add_argument("--only", default="", help="a substring of the program names to keep")
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help=f"comma-separated targets (default {','.join(TARGETS)})")
    ns = parser.parse_args(argv)
    targets = tuple(t for t in ns.targets.split(",") if t)
    result: dict[str, Any] = {}
    sources = [suite_programs(), overhead_programs()]
    if ns.random > 0:
        sources.append(random_programs(ns.random))
    for source in sources:
        for name, fn, args in source:
            if ns.only not in name:
                continue
            result[name] = fingerprint(fn, args, targets)
            print(name, flush=True)
    with open(ns.out, "w") as handle:
        json.dump(result, handle, indent=1, sort_keys=True, default=str)
    if not ns.compare:
        return 0
    with open(ns.compare) as handle:
        before = json.load(handle)
    after = json.loads(json.dumps(result, sort_keys=True, default=str))
    differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    for name in differ:
        fields = [f for f in targets for f in (f"inspect_{f}", f"lowered_{f}")
                  if (before.get(name) or {}).get(f) != (after.get(name) or {}).get(f)]
        print(f"DIFFERS: {name} {fields}")
    print(f"{len(after)} programs, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
