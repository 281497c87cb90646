"""What calling a decorated function costs beside ``jax.jit``'s call, once compiled.

A training loop calls its step thousands of times: every microsecond the decorator adds to
a call is paid on each, and on a TPU (or a GPU running small steps) the host's time to
issue a call is the step's time. For each program below this times, in one process and
alternating the variants so that drift touches them alike:

* **issue**: ``--calls`` calls issued back to back without waiting, per call (the host's
  time to dispatch; JAX returns before the device has run);
* **loop**: the same calls and then one wait, per call (a training loop's time per step:
  the larger of the host's and the device's);

reporting medians over ``--rounds`` rounds and the median of the per-round ratios to
plain ``jax.jit`` of the same function (and to ``nnx.jit`` / ``eqx.filter_jit`` for the
framework programs, which also records whether any call blocked). Programs:

* ``two_arrays``: ``tanh(x @ y) + 1`` on two 16x16 arrays;
* ``optimizer_state``: an identity-like step over 12 layers' parameters and their
  ``optax.adam`` state (74 leaves);
* ``model_200``: a 50-layer model's parameters (200 leaves) and a batch;
* ``python_scalar``: an array and a Python float (traced, as ``jax.jit`` traces it);
* ``static_argnums``: an array and an int named by ``static_argnums``;
* ``static_string``: two arrays, a float and the activation's name as a string (jaxpar
  splits it off itself; ``jax.jit`` takes it with ``static_argnames``);
* ``nnx_mlp``: a Flax NNX MLP and its optimizer, against ``nnx.jit`` (state written back);
* ``equinox_mlp``: an Equinox MLP (its activation a static leaf), against
  ``eqx.filter_jit``;
* ``nnx_heavy``, ``equinox_heavy``: the same with device work that dwarfs the dispatch, so
  a variant that waits for each result shows it (``waits_for_result``: issue time close
  to the loop's);
* with ``--suite full|small``, every program of ``benchmarks/gpu_suite.py`` (their real
  work: on a TPU many run longer than their issue time).

jaxpar runs with its default target (``"auto"``: this machine's backend); ``--targets``
adds others. Values are compared with ``jax.jit``'s (``max_abs_diff``).

Run::

    python benchmarks/dispatch.py [--suite full] [--calls 200] [--rounds 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jaxpar

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

Program = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _two_arrays() -> Program:
    def f(x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.tanh(x @ y) + 1.0

    return f, (jnp.ones((16, 16)), jnp.eye(16)), {}


def _layers(count: int, width: int) -> list[dict[str, jax.Array]]:
    key = jax.random.key(0)
    return [{"w": jax.random.normal(jax.random.fold_in(key, i), (width, width)) * 0.1,
             "b": jnp.zeros(width)} for i in range(count)]


def _optimizer_state() -> Program:
    import optax

    params = _layers(12, 32)
    state = optax.adam(1e-3).init(params)

    def step(params: Any, state: Any, x: jax.Array) -> Any:
        return jax.tree_util.tree_map(lambda a: a + 1, (params, state)), x * 2

    return step, (params, state, jnp.ones((16, 32))), {}


def _model_200() -> Program:
    params = {"layers": _layers(50, 16), "norms": [{"scale": jnp.ones(16), "bias": jnp.zeros(16)}
                                                  for _ in range(50)]}

    def step(params: Any, x: jax.Array) -> Any:
        return jax.tree_util.tree_map(lambda a: a * 0.999, params), x + 1

    return step, (params, jnp.ones((8, 16))), {}


def _python_scalar() -> Program:
    def f(x: jax.Array, scale: float) -> jax.Array:
        return jnp.tanh(x) * scale

    return f, (jnp.ones((16, 16)), 0.5), {}


def _static_argnums() -> Program:
    def f(x: jax.Array, n: int) -> jax.Array:
        for _ in range(n):
            x = jnp.sin(x)
        return x

    return f, (jnp.ones((16, 16)), 3), {"static_argnums": 1}


def _static_string() -> Program:
    def f(x: jax.Array, y: jax.Array, scale: float, activation: str) -> jax.Array:
        return {"tanh": jnp.tanh, "relu": jax.nn.relu}[activation](x @ y) * scale

    return f, (jnp.ones((16, 16)), jnp.eye(16), 0.5, "tanh"), {"jit": {"static_argnums": 3},
                                                              "plain_jaxpar": True}


def _nnx_mlp(heavy: bool = False) -> Program:
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.first = nnx.Linear(32, 32, rngs=rngs)
            self.second = nnx.Linear(32, 32, rngs=rngs)
            self.third = nnx.Linear(32, 32, rngs=rngs)
            self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

        def __call__(self, x: jax.Array) -> jax.Array:
            self.calls.value = self.calls.value + 1  # state the call writes back
            return self.third(jax.nn.relu(self.second(jax.nn.relu(self.first(x)))))

    model = MLP(nnx.Rngs(0))

    def f(model: Any, x: jax.Array, big: jax.Array) -> Any:
        for _ in range(8 if heavy else 0):
            big = jnp.tanh(big @ big)
        return model(x).sum(), big

    return f, (model, jnp.ones((8, 32)), jnp.eye(512 if heavy else 8) * 0.5), {"framework": "nnx"}


def _equinox_mlp(heavy: bool = False) -> Program:
    import equinox as eqx

    model = eqx.nn.MLP(32, 32, 32, 4, key=jax.random.key(0))

    def f(model: Any, x: jax.Array, big: jax.Array) -> Any:
        for _ in range(8 if heavy else 0):  # device work that dwarfs the dispatch
            big = jnp.tanh(big @ big)
        return model(x).sum(), big

    return f, (model, jnp.ones(32), jnp.eye(512 if heavy else 8) * 0.5), {"framework": "equinox"}


PROGRAMS: dict[str, Callable[[], Program]] = {
    "two_arrays": _two_arrays, "optimizer_state": _optimizer_state, "model_200": _model_200,
    "python_scalar": _python_scalar, "static_argnums": _static_argnums,
    "static_string": _static_string, "nnx_mlp": _nnx_mlp, "equinox_mlp": _equinox_mlp,
    "nnx_heavy": lambda: _nnx_mlp(True), "equinox_heavy": lambda: _equinox_mlp(True),
}


def _variants(name: str, program: Program, targets: list[str]) -> dict[str, Callable[..., Any]]:
    fun, _, extra = program
    statics = {k: v for k, v in extra.items() if k in ("static_argnums", "static_argnames")}
    framework = extra.get("framework")
    if framework == "nnx":
        from flax import nnx
        base = {"nnx.jit": nnx.jit(fun)}
    elif framework == "equinox":
        import equinox as eqx
        base = {"eqx.filter_jit": eqx.filter_jit(fun)}
    else:
        base = {"jax.jit": jax.jit(fun, **(extra.get("jit") or statics))}
    out = dict(base)
    out["jaxpar"] = jaxpar.parallel_branches(fun, **statics)
    for target in targets:
        out[f"jaxpar {target}"] = jaxpar.parallel_branches(fun, target=target, **statics)
    return out


def _leaves(tree: Any) -> list[Any]:
    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if isinstance(leaf, jax.Array)]


def _max_diff(a: Any, b: Any) -> float:
    pairs = zip(_leaves(a), _leaves(b), strict=True)
    return max((float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
                for x, y in pairs), default=0.0)


def _round(fn: Callable[..., Any], args: tuple[Any, ...], calls: int) -> tuple[float, float]:
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    issued = time.perf_counter()
    jax.block_until_ready(out)
    done = time.perf_counter()
    return (issued - start) / calls * 1e6, (done - start) / calls * 1e6


def measure(fns: dict[str, Callable[..., Any]], args: tuple[Any, ...], calls: int,
            rounds: int) -> dict[str, Any]:
    """Issue and loop microseconds per call of each variant, alternated round by round."""
    base = next(iter(fns))
    outs = {}
    for variant, fn in fns.items():  # compile and warm up, not timed
        outs[variant] = jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
    # A call's device time decides how many calls a round takes (about 0.2 s a round).
    once = _round(fns[base], args, 3)[1] * 1e-6
    calls = max(5, min(calls, int(0.2 / max(once, 1e-7))))
    issue: dict[str, list[float]] = {v: [] for v in fns}
    loop: dict[str, list[float]] = {v: [] for v in fns}
    for _ in range(rounds):
        for variant, fn in fns.items():
            i, t = _round(fn, args, calls)
            issue[variant].append(i)
            loop[variant].append(t)

    def ratio(samples: dict[str, list[float]], v: str) -> float:
        return statistics.median(a / b for a, b in zip(samples[v], samples[base], strict=True))

    return {"base": base, "calls_per_round": calls, "leaves": len(_leaves(args)),
            "issue_us": {v: statistics.median(s) for v, s in issue.items()},
            "loop_us": {v: statistics.median(s) for v, s in loop.items()},
            "issue_ratio": {v: ratio(issue, v) for v in fns},
            "loop_ratio": {v: ratio(loop, v) for v in fns},
            # A call that waits for its result issues no faster than the loop runs: on a
            # program whose device time dwarfs its dispatch, issue ~ loop means it blocks.
            "waits_for_result": {v: statistics.median(issue[v]) > 0.8 * statistics.median(loop[v])
                                 for v in fns},
            "max_abs_diff": {v: _max_diff(outs[v], outs[base]) for v in fns}}


def _suite(size: str) -> dict[str, Callable[[], Program]]:
    import gpu_suite

    out = {}
    for name, prog in gpu_suite.PROGRAMS.items():
        def build(prog: Any = prog) -> Program:
            fn, args = prog.build(size)
            return fn, args, {}
        out[f"suite:{name}"] = build
    return out


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # flax's .value
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="most calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--suite", choices=("full", "small"), help="add the GPU suite")
    parser.add_argument("--only", help="comma-separated program names")
    parser.add_argument("--targets", default="", help="more jaxpar targets, e.g. cpu,gpu")
    parser.add_argument("--budget", type=float, default=1e9, help="stop after this many s")
    parser.add_argument("--json", help="write the results here")
    ns = parser.parse_args(argv)
    programs = dict(PROGRAMS)
    if ns.suite:
        programs.update(_suite(ns.suite))
    if ns.only:
        programs = {k: v for k, v in programs.items() if k in ns.only.split(",")}
    targets = [t for t in ns.targets.split(",") if t]
    started = time.perf_counter()
    results: dict[str, Any] = {"jax": jax.__version__, "backend": jax.default_backend(),
                               "device": jax.devices()[0].device_kind, "programs": {}}
    print(f"per-call cost on {results['device']} ({results['backend']}), jax {jax.__version__}: "
          f"medians of {ns.rounds} alternated rounds; ratios to the first variant", flush=True)
    for name, build in programs.items():
        if time.perf_counter() - started > ns.budget:
            results["programs"][name] = {"skipped": "time budget"}
            continue
        try:
            program = build()
            entry = measure(_variants(name, program, targets), program[1], ns.calls, ns.rounds)
        except Exception as error:
            results["programs"][name] = {"error": f"{type(error).__name__}: {error}"[:500]}
            print(f"  {name}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        results["programs"][name] = entry
        cells = "  ".join(
            f"{v} issue {entry['issue_us'][v]:8.1f} loop {entry['loop_us'][v]:9.1f} us "
            f"(x{entry['issue_ratio'][v]:.3f}, x{entry['loop_ratio'][v]:.3f})"
            + (" waits" if entry["waits_for_result"][v] and name.endswith("heavy") else "")
            for v in entry["issue_us"])
        print(f"  {name:34s} {entry['leaves']:4d} leaves  {cells}", flush=True)
    rows = [e for e in results["programs"].values() if "issue_ratio" in e]
    for variant in itertools.chain(["jaxpar"], (f"jaxpar {t}" for t in targets)):
        issue = [e["issue_ratio"][variant] for e in rows if variant in e["issue_ratio"]]
        loop = [e["loop_ratio"][variant] for e in rows if variant in e["loop_ratio"]]
        results[f"geomean {variant}"] = {"issue": geomean(issue), "loop": geomean(loop),
                                         "worst loop": max(loop, default=float("nan"))}
        print(f"geomean {variant}: issue x{geomean(issue):.3f}, loop x{geomean(loop):.3f}, "
              f"worst loop x{max(loop, default=float('nan')):.3f} over {len(loop)} programs")
    if ns.json:
        with open(ns.json, "w") as handle:
            json.dump(results, handle, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()
