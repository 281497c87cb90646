"""Measuring by default, measured: per program, the first call (fresh caches) of plain
``jax.jit`` against ``parallel_branches`` (its default ``measure="auto"``), the calls until
the device decided and what the timing cost, the steady state per call (interleaved
rounds, medians of per-round ratios: ``dispatch.measure``), the decision, and a second
process's first call with the decisions on disk.

Parts (each writes ``<out>/measure-<part>.json`` as it goes):

* ``ecosystem``: blackjax HMC (8 chains by ``vmap``, one chain) and HMC beside MALA, a
  bidirectional GRU of 2,000 steps (the programs the model got wrong);
* ``seeds``: seed 002's pairs of scans (``benchmarks/tpu.py``);
* ``loops``: ``benchmarks/tpu_loops.py``'s held-out loop programs;
* ``suite``: ``benchmarks/gpu_suite.py``'s 31 programs;
* ``unchanged``: programs where nothing pays (a plain MLP, optax training steps, a
  transformer step): what measuring costs where jaxpar changes nothing;
* ``--first N``: only the first calls, N of each variant, interleaved (jax.jit first in
  odd samples, jaxpar first in even ones), fresh caches each; the median ratio of the
  pairs and their spread, and how many times each variant traced the function;
* ``corpus``: ``benchmarks/measure_corpus.py``'s loop programs from the ecosystem (blackjax,
  diffrax, numpyro, flax, PPO, Mamba); that script also runs them one process each, under
  a time limit per program;
* ``--second``: run after the first process ended (one process holds the chip), the same
  parts' first calls with the first process's decisions on disk (``JAXPAR_TUNE_DIR``).

Run (on the chip; ``--cpu`` runs tiny sizes with ``measure=True`` on this machine)::

    export JAXPAR_TUNE_DIR=DIR/decisions
    python benchmarks/measure_tpu.py --parts ecosystem,seeds --out DIR [--cpu]
    python benchmarks/measure_tpu.py --parts ecosystem,seeds --out DIR --second
    python benchmarks/measure_tpu.py --parts unchanged --first 7 [--cpu --target tpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "battery"))

import dispatch  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar._dispatch import measuring, shared  # noqa: E402

Program = tuple[Callable[..., Any], tuple[Any, ...]]
OPTIONS: dict[str, Any] = {}  # jaxpar's options beside measure (--target)


# ----------------------------------------------------------------------- programs


def bigru(steps: int, batch: int = 32, width: int = 128, inputs: int = 64) -> Program:
    """A bidirectional GRU, stacked outputs (the program the model said was 1.95x
    faster read by blocks and that ran 2.26x slower)."""
    keys = jax.random.split(jax.random.key(0), 8)

    def cell_params(k: Any) -> dict[str, Any]:
        a, b = jax.random.split(k)
        return {"wx": jax.random.normal(a, (inputs, 3 * width)) * 0.1,
                "wh": jax.random.normal(b, (width, 3 * width)) * 0.1}

    params = (cell_params(keys[0]), cell_params(keys[1]))
    xs = jax.random.normal(keys[2], (steps, batch, inputs))
    h0 = jnp.zeros((batch, width))

    def cell(p: Any, h: Any, x: Any) -> Any:
        gx, gh = x @ p["wx"], h @ p["wh"]
        r = jax.nn.sigmoid(gx[:, :width] + gh[:, :width])
        z = jax.nn.sigmoid(gx[:, width:2 * width] + gh[:, width:2 * width])
        n = jnp.tanh(gx[:, 2 * width:] + r * gh[:, 2 * width:])
        h = (1 - z) * n + z * h
        return h, h

    def f(params: Any, h0: Any, xs: Any) -> Any:
        _, fwd = lax.scan(lambda h, x: cell(params[0], h, x), h0, xs)
        _, bwd = lax.scan(lambda h, x: cell(params[1], h, x), h0, xs, reverse=True)
        return jnp.concatenate([fwd, bwd], axis=-1)

    return f, (params, h0, xs)


def _logistic(features: int = 10, rows: int = 256) -> tuple[Callable[[Any], Any], Any]:
    x = jax.random.normal(jax.random.key(1), (rows, features))
    w_true = jax.random.normal(jax.random.key(2), (features,))
    y = (x @ w_true > 0).astype(jnp.float32)

    def logdensity(w: Any) -> Any:
        logits = x @ w
        return jnp.sum(y * logits - jnp.logaddexp(0.0, logits)) - 0.5 * jnp.sum(w * w)

    return logdensity, jnp.zeros((features,))


def hmc_chains(steps: int, chains: int) -> Program:
    """blackjax HMC on a logistic regression: ``chains`` chains by ``vmap`` (or one)."""
    import blackjax

    logdensity, w0 = _logistic()
    kernel = blackjax.hmc(logdensity, step_size=0.05, inverse_mass_matrix=jnp.ones(10),
                          num_integration_steps=10)

    def one(key: Any, position: Any) -> Any:
        state = kernel.init(position)

        def step(state: Any, key: Any) -> Any:
            state, _ = kernel.step(key, state)
            return state, state.position

        return lax.scan(step, state, jax.random.split(key, steps))[1]

    if chains == 1:
        return one, (jax.random.key(3), w0)
    return (jax.vmap(one), (jax.random.split(jax.random.key(3), chains),
                            jnp.zeros((chains, 10))))


def hmc_and_mala(steps: int) -> Program:
    """blackjax HMC and MALA chains in one function."""
    import blackjax

    logdensity, w0 = _logistic()
    hmc = blackjax.hmc(logdensity, step_size=0.05, inverse_mass_matrix=jnp.ones(10),
                       num_integration_steps=10)
    mala = blackjax.mala(logdensity, step_size=0.01)

    def chain(kernel: Any, key: Any) -> Any:
        def step(state: Any, key: Any) -> Any:
            state, _ = kernel.step(key, state)
            return state, state.position
        return lax.scan(step, kernel.init(w0), jax.random.split(key, steps))[1]

    def f(key: Any) -> Any:
        a, b = jax.random.split(key)
        return chain(hmc, a), chain(mala, b)

    return f, (jax.random.key(4),)


def ecosystem(cpu: bool) -> dict[str, Callable[[], Program]]:
    steps = 20 if cpu else 1000
    return {"bigru_2000": lambda: bigru(40 if cpu else 2000),
            "blackjax_hmc_8_chains": lambda: hmc_chains(steps, 8),
            "blackjax_hmc_1_chain": lambda: hmc_chains(steps, 1),
            "blackjax_hmc_and_mala": lambda: hmc_and_mala(steps)}


def seeds(cpu: bool) -> dict[str, Callable[[], Program]]:
    import tpu

    out = {}
    for name, (variants, args) in tpu.seed_programs(50 if cpu else 10000).items():
        fn = variants["jax.jit"].__wrapped__
        out[name] = lambda fn=fn, args=args: (fn, args)
    return out


def loops(cpu: bool) -> dict[str, Callable[[], Program]]:
    import tpu_loops

    size = "s" if cpu else "m"
    return {name: (lambda b=b: b(size)) for name, b in tpu_loops.PROGRAMS.items()}


def suite(cpu: bool) -> dict[str, Callable[[], Program]]:
    import gpu_suite

    size = "small" if cpu else "full"  # as benchmarks/tpu.py's --size
    return {name: (lambda p=p: p.build(size)) for name, p in gpu_suite.PROGRAMS.items()}


def plain_mlp(cpu: bool) -> Program:
    """A plain MLP's forward pass (nothing for jaxpar to rewrite)."""
    widths = (64, 128, 128, 10) if cpu else (1024, 4096, 4096, 1000)
    keys = jax.random.split(jax.random.key(5), len(widths))
    params = [jax.random.normal(k, (i, o)) / i ** 0.5
              for k, i, o in zip(keys, widths, widths[1:], strict=False)]

    def mlp(params: Any, x: Any) -> Any:
        for w in params[:-1]:
            x = jax.nn.relu(x @ w)
        return x @ params[-1]

    return mlp, (params, jax.random.normal(keys[-1], (32 if cpu else 256, widths[0])))


UNCHANGED = ("optax_two_branch_step", "optax_adamw_step", "three_towers",
             "wmt_transformer_step")


def unchanged(cpu: bool) -> dict[str, Callable[[], Program]]:
    out = {"plain_mlp": lambda: plain_mlp(cpu)}
    programs = suite(cpu)
    out.update((name, programs[name]) for name in UNCHANGED)
    return out


def corpus(cpu: bool) -> dict[str, Callable[[], Program]]:
    import measure_corpus

    return measure_corpus.programs(cpu)


PARTS = {"ecosystem": ecosystem, "seeds": seeds, "loops": loops, "suite": suite,
         "unchanged": unchanged, "corpus": corpus}


# ----------------------------------------------------------------------- measuring


def _timed(fn: Callable[..., Any], args: tuple[Any, ...]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def first_calls(fn: Callable[..., Any], args: tuple[Any, ...], measure: Any) -> dict[str, float]:
    """Fresh caches (``jax.clear_caches``) before each first call, in the order jax.jit,
    jaxpar, jaxpar, jax.jit (what one warms for the next cancels); the means. The
    candidates that build in the background after jaxpar's first call are not counted
    (waited for before the next)."""
    times: dict[str, list[float]] = {"jax.jit": [], "jaxpar": []}
    for variant in ("jax.jit", "jaxpar", "jaxpar", "jax.jit"):
        measuring.wait_idle()
        jax.clear_caches()
        shared.forget_shared_states()  # a decoration of its own, as a fresh process makes
        fun = jax.jit(fn) if variant == "jax.jit" else jaxpar.parallel_branches(
            fn, measure=measure, **OPTIONS)
        times[variant].append(_timed(fun, args))
    measuring.wait_idle()
    plain, ours = (sum(t) / len(t) for t in (times["jax.jit"], times["jaxpar"]))
    return {"jax.jit": plain, "jaxpar": ours, "ratio": ours / plain}


def _counting(fn: Callable[..., Any], counts: list[int]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[0] += 1  # one Python call of the function: one trace
        return fn(*args, **kwargs)
    counted.__name__ = getattr(fn, "__name__", "fn")
    return counted


def first_calls_only(fn: Callable[..., Any], args: tuple[Any, ...], measure: Any,
                     samples: int) -> dict[str, Any]:
    """``samples`` first calls of each variant, fresh caches each, the pair's order
    alternating; the median ratio of the pairs, their spread and the traces per call."""
    times: dict[str, list[float]] = {"jax.jit": [], "jaxpar": []}
    traces: dict[str, int] = {}
    counts = [0]
    counted = _counting(fn, counts)
    for sample in range(samples):
        order = ("jax.jit", "jaxpar") if sample % 2 == 0 else ("jaxpar", "jax.jit")
        for variant in order:
            measuring.wait_idle()
            jax.clear_caches()
            shared.forget_shared_states()
            fun = jax.jit(counted) if variant == "jax.jit" else jaxpar.parallel_branches(
                counted, measure=measure, **OPTIONS)
            counts[0] = 0
            times[variant].append(_timed(fun, args))
            traces[variant] = counts[0]
    measuring.wait_idle()
    ratios = [ours / plain for ours, plain in zip(times["jaxpar"], times["jax.jit"],
                                                  strict=True)]
    return {"jax.jit": statistics.median(times["jax.jit"]),
            "jaxpar": statistics.median(times["jaxpar"]),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "traces": traces, "samples": times}


def part_programs(part: str, cpu: bool, only: str) -> dict[str, Callable[[], Program]]:
    """The part's programs, those named in ``only`` (``--only``, comma-separated) where
    it names any."""
    programs = PARTS[part](cpu)
    names = only.split(",") if only else None
    return {k: v for k, v in programs.items() if names is None or k in names}


def first_only(parts: list[str], only: str, out: str, cpu: bool, measure: Any,
               samples: int) -> None:
    """``--first``: each program's first calls only (``first_calls_only``)."""
    results: dict[str, Any] = {}
    for part in parts:
        for program, build in part_programs(part, cpu, only).items():
            try:
                fn, args = build()
                entry = results[program] = first_calls_only(fn, args, measure, samples)
                print(f"  {program:34s} first x{entry['ratio']:.2f} (x{entry['ratio_min']:.2f}-"
                      f"x{entry['ratio_max']:.2f}; jax.jit {entry['jax.jit']:.2f} s, jaxpar "
                      f"{entry['jaxpar']:.2f} s), traces {entry['traces']}", flush=True)
            except Exception as error:
                results[program] = {"error": f"{type(error).__name__}: {error}"[:800]}
                print(f"  {program}: {type(error).__name__}: {str(error)[:300]}", flush=True)
            with open(os.path.join(out, "measure-first.json"), "w") as handle:
                json.dump(results, handle, indent=1, default=str)
    ratios = [entry["ratio"] for entry in results.values() if "ratio" in entry]
    if ratios:
        print(f"{len(ratios)} programs: first call median ratios mean "
              f"x{statistics.mean(ratios):.3f}, worst x{max(ratios):.2f}", flush=True)


def settle(pb: Any, args: tuple[Any, ...], limit: int = 60) -> dict[str, Any]:
    """Calls until the device decided (no build pending, the C++ dispatch installed)."""
    start = time.perf_counter()
    calls = 0
    while calls < limit:
        jax.block_until_ready(pb(*args))
        calls += 1
        measuring.wait_idle()
        tuner = pb._tuner
        if tuner is None or (not tuner.pending and pb._state.boundary is None):
            break
    tuning = pb.tuning(*args)
    return {"calls": calls, "seconds": time.perf_counter() - start,
            "chosen": None if tuning is None else tuning.chosen,
            "verdict": None if tuning is None else tuning.verdict(),
            "measure_s": None if tuning is None else tuning.measure_s,
            "source": None if tuning is None else tuning.source,
            # Each candidate's timed ratio to jax.jit (None: not timed; "= label": the
            # same program as that one).
            "candidates": {} if tuning is None else {
                row.label: (f"= {row.same_as}" if row.same_as else row.ratio)
                for row in tuning.rows}}


def max_abs_diff(want: Any, got: Any) -> float:
    """The largest elementwise difference between two results' array leaves."""
    return max((float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
                for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got),
                                strict=True) if hasattr(a, "shape") and a.size), default=0.0)


def tuned_first_call(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, float]:
    """``tune=True`` on ``fn`` with a decisions folder of its own (the default's decision
    on disk would be read back, not measured): the function and its first call's time."""
    os.environ["JAXPAR_TUNE_DIR"] = tempfile.mkdtemp(prefix="jaxpar-tune-")
    shared.forget_shared_states()
    tuned = jaxpar.parallel_branches(fn, tune=True, **OPTIONS)
    return tuned, _timed(tuned, args)


def measure_program(fn: Callable[..., Any], args: tuple[Any, ...], measure: Any, rounds: int,
                    tune: bool = False) -> dict[str, Any]:
    """One program's first calls, the calls until the device decided, the steady state
    against jax.jit (with ``tune=True`` beside them where ``tune``) and the values."""
    started = time.perf_counter()
    entry: dict[str, Any] = {"first_call_s": first_calls(fn, args, measure)}
    _progress("first calls", started)
    plain = jax.jit(fn)
    shared.forget_shared_states()
    pb = jaxpar.parallel_branches(fn, measure=measure, **OPTIONS)
    entry["settle"] = settle(pb, args)
    _progress(f"decided in {entry['settle']['calls']} calls", started)
    variants = {"jax.jit": plain, "jaxpar": pb}
    if tune:
        variants["jaxpar tune=True"], entry["tune_first_call_s"] = tuned_first_call(fn, args)
    timed = dispatch.measure(variants, args, 200, rounds)
    entry["loop_ratio"] = timed["loop_ratio"]["jaxpar"]
    entry["loop_us"] = timed["loop_us"]
    if tune:
        tuning = variants["jaxpar tune=True"].tuning(*args)
        entry["tune_loop_ratio"] = timed["loop_ratio"]["jaxpar tune=True"]
        entry["tune_chosen"] = None if tuning is None else tuning.chosen
    _progress("steady state timed", started)
    entry["max_abs_diff"] = max_abs_diff(plain(*args), pb(*args))
    return entry


def _progress(stage: str, started: float) -> None:
    """A stage's end on stderr, so that a program cut off by its time limit shows how far
    it got (NUTS on the chip)."""
    print(f"    .. {stage} at {time.perf_counter() - started:.1f} s", file=sys.stderr,
          flush=True)


def describe(program: str, entry: dict[str, Any]) -> str:
    tuned = (f", tune=True x{entry['tune_loop_ratio']:.3f}" if "tune_loop_ratio" in entry
             else "")
    return (f"  {program:34s} first x{entry['first_call_s']['ratio']:.2f} "
            f"({entry['first_call_s']['jax.jit']:.2f} s), settled in "
            f"{entry['settle']['calls']} calls ({entry['settle']['measure_s'] or 0:.2f} s "
            f"timing), per call x{entry['loop_ratio']:.3f}{tuned}: {entry['settle']['verdict']}")


def failure(error: Exception) -> dict[str, str]:
    return {"error": f"{type(error).__name__}: {error}"[:800],
            "trace": traceback.format_exc()[-2000:]}


def run_part(name: str, programs: dict[str, Callable[[], Program]], out: str, measure: Any,
             rounds: int, budget: float, tune: bool = False) -> dict[str, Any]:
    started = time.perf_counter()
    results: dict[str, Any] = {}
    path = os.path.join(out, f"measure-{name}.json")
    for program, build in programs.items():
        if time.perf_counter() - started > budget:
            results[program] = {"skipped": "time budget"}
            continue
        try:
            fn, args = build()
            results[program] = measure_program(fn, args, measure, rounds, tune)
            print(describe(program, results[program]), flush=True)
        except Exception as error:
            results[program] = failure(error)
            print(f"  {program}: {type(error).__name__}: {str(error)[:300]}", flush=True)
        with open(path, "w") as handle:
            json.dump(results, handle, indent=1, default=str)
    return results


def second(parts: list[str], out: str, cpu: bool, measure: Any, only: str = "") -> None:
    """In the second process: each program's first call and the calls until it runs the
    stored decision (none measured again); ``only`` as ``--only``."""
    results: dict[str, Any] = {}
    for part in parts:
        for program, build in part_programs(part, cpu, only).items():
            try:
                fn, args = build()
                first = first_calls(fn, args, measure)
                shared.forget_shared_states()
                pb = jaxpar.parallel_branches(fn, measure=measure, **OPTIONS)
                settled = settle(pb, args)
                results[program] = {"first_call_s": first, "settle": settled}
                print(f"  {program:34s} second process: first x{first['ratio']:.2f}, "
                      f"{settled['source']}", flush=True)
            except Exception as error:
                results[program] = failure(error)
            with open(os.path.join(out, "measure-second.json"), "w") as handle:
                json.dump(results, handle, indent=1, default=str)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--parts", default="ecosystem,seeds")
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="measure-"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget", type=float, default=240.0)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated program names")
    parser.add_argument("--target", default=None,
                        help="jaxpar's target (default: its own, 'auto'); --cpu --target tpu "
                             "measures the TPU's candidates on this CPU")
    parser.add_argument("--second", action="store_true")
    parser.add_argument("--first", type=int, default=0, metavar="N",
                        help="first calls only, N samples of each variant, interleaved")
    parser.add_argument("--tune", action="store_true",
                        help="also time tune=True beside the default (its candidates compile)")
    ns = parser.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    os.environ.setdefault("JAXPAR_TUNE_DIR", os.path.join(ns.out, "decisions"))
    measure: Any = True if ns.cpu else "auto"
    if ns.target:
        OPTIONS["target"] = ns.target
    parts = ns.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {unknown}; the parts are {sorted(PARTS)}")
    print(f"devices: {jax.devices()}; measure={measure!r}; options {OPTIONS}", flush=True)
    if ns.first:
        first_only(parts, ns.only, ns.out, ns.cpu, measure, ns.first)
        return
    if ns.second:
        second(parts, ns.out, ns.cpu, measure, ns.only)
        return
    for part in parts:
        print(f"--- {part}", flush=True)
        run_part(part, part_programs(part, ns.cpu, ns.only), ns.out, measure, ns.rounds,
                 ns.budget, ns.tune)


if __name__ == "__main__":
    main()
