"""A corpus of loop programs from the ecosystem, measured as ``measure_tpu.py`` measures:
each program is a user's function decorated the default way (``parallel_branches``,
``measure`` on), timed against ``jax.jit`` (first calls with fresh caches, the calls
until the device decided, the steady state), with ``tune=True`` beside it on ``--tune``.

The programs (a library that is not installed skips its programs with a message):

* blackjax: HMC on a logistic regression, one chain and 8 chains (``vmap``), HMC and MALA
  chains in one function, NUTS (its ``while_loop`` of tree doublings);
* diffrax: a neural ODE (Tsit5, an MLP vector field), adaptive steps saved at t1 and at
  100 times (``vmap`` over initial conditions), and fixed steps;
* numpyro: NUTS on a logistic regression with warmup adaptation, its ``hmc`` kernel
  functions stepped by ``lax.scan`` in one jitted function;
* pure JAX: a PPO rollout (a CartPole written in ``jnp``, a policy MLP, 16 environments,
  then GAE by a reverse scan) and a Mamba-style selective-scan layer stack;
* flax: a bidirectional GRU (``nn.Bidirectional``) and an LSTM language model's training
  step (``nn.RNN``, grad, optax adam).

Each program runs in a process of its own under a time limit (``--limit``; a compile that
runs past it loses that program, not the run) and its result is written to
``<out>/measure-corpus.json`` as soon as it is measured. ``measure_tpu.py --parts corpus``
runs the same programs in one process.

Run::

    python benchmarks/measure_corpus.py --out DIR [--tune] [--limit 80] [--budget 450]
    JAX_PLATFORMS=cpu python benchmarks/measure_corpus.py --cpu --target tpu --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import measure_tpu
from measure_tpu import Program

import jaxpar

# ----------------------------------------------------------------------- samplers


def blackjax_nuts(steps: int) -> Program:
    """blackjax NUTS, one chain on the logistic regression."""
    import blackjax

    logdensity, w0 = measure_tpu._logistic()
    kernel = blackjax.nuts(logdensity, step_size=0.1, inverse_mass_matrix=jnp.ones(10))

    def f(key: Any, position: Any) -> Any:
        def step(state: Any, key: Any) -> Any:
            state, info = kernel.step(key, state)
            return state, (state.position, info.num_integration_steps)
        return lax.scan(step, kernel.init(position), jax.random.split(key, steps))[1]

    return f, (jax.random.key(7), w0)


def numpyro_nuts(steps: int, rows: int) -> Program:
    """numpyro NUTS with step size and mass matrix adapted over the first half."""
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer.hmc import hmc
    from numpyro.infer.util import initialize_model

    x = jax.random.normal(jax.random.key(1), (rows, 10))
    y = (x @ jax.random.normal(jax.random.key(2), (10,)) > 0).astype(jnp.float32)

    def model(x: Any, y: Any) -> None:
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([10]).to_event(1))
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)

    info = initialize_model(jax.random.PRNGKey(5), model, model_args=(x, y))
    init_kernel, sample_kernel = hmc(info.potential_fn, algo="NUTS")
    state = init_kernel(info.param_info, num_warmup=steps // 2, step_size=0.1,
                        rng_key=jax.random.PRNGKey(6))

    def f(state: Any) -> Any:
        def step(state: Any, _: Any) -> Any:
            state = sample_kernel(state)
            return state, (state.z, state.num_steps)
        return lax.scan(step, state, None, length=steps)[1]

    return f, (state,)


# ----------------------------------------------------------------------- ODE solves


def _mlp(key: Any, sizes: tuple[int, ...]) -> list[tuple[Any, Any]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [(jax.random.normal(k, (a, b)) / jnp.sqrt(a), jnp.zeros(b))
            for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)]


def _apply_mlp(params: list[tuple[Any, Any]], x: Any) -> Any:
    for w, b in params[:-1]:
        x = jnp.tanh(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def diffrax_solve(batch: int, width: int, save: str, steps: int | None = None) -> Program:
    """A neural ODE, Tsit5: adaptive steps (PID controller) or ``steps`` fixed ones;
    ``save`` "t1" solves the batch as one state, "ts" solves each initial condition by
    ``vmap`` and saves 100 times."""
    import diffrax

    dim = 8
    params = _mlp(jax.random.key(8), (dim, width, width, dim))
    y0 = jax.random.normal(jax.random.key(9), (batch, dim))

    def field(t: Any, y: Any, params: Any) -> Any:
        return jnp.tanh(_apply_mlp(params, y)) - 0.1 * y

    controller: Any = (diffrax.ConstantStepSize() if steps else
                       diffrax.PIDController(rtol=1e-5, atol=1e-5))
    saveat = (diffrax.SaveAt(t1=True) if save == "t1" else
              diffrax.SaveAt(ts=jnp.linspace(0.0, 5.0, 100)))

    def solve(params: Any, y0: Any) -> Any:
        return diffrax.diffeqsolve(
            diffrax.ODETerm(field), diffrax.Tsit5(), 0.0, 5.0, 5.0 / steps if steps else 0.05,
            y0, args=params, saveat=saveat, stepsize_controller=controller,
            max_steps=4096).ys

    if save == "t1":
        return solve, (params, y0)
    return jax.vmap(solve, in_axes=(None, 0)), (params, y0)


# ----------------------------------------------------------------------- RL rollouts


def _cartpole_step(state: Any, action: Any) -> tuple[Any, Any, Any]:
    """CartPole's physics (gym's constants), one Euler step; resets a fallen pole."""
    x, x_dot, theta, theta_dot = state
    force = jnp.where(action == 1, 10.0, -10.0)
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    temp = (force + 0.05 * theta_dot ** 2 * sin) / 1.1
    theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos ** 2 / 1.1))
    x_acc = temp - 0.05 * theta_acc * cos / 1.1
    new = jnp.stack([x + 0.02 * x_dot, x_dot + 0.02 * x_acc, theta + 0.02 * theta_dot,
                     theta_dot + 0.02 * theta_acc])
    done = (jnp.abs(new[0]) > 2.4) | (jnp.abs(new[2]) > 0.2095)
    return jnp.where(done, jnp.zeros(4), new), jnp.float32(1.0), done


def ppo_rollout(envs: int, steps: int, width: int) -> Program:
    """A PPO rollout: ``envs`` CartPoles by ``vmap`` stepped ``steps`` times by a policy
    and value MLP sampling actions, then GAE over the trajectory by a reverse scan."""
    params = {"policy": _mlp(jax.random.key(10), (4, width, width, 2)),
              "value": _mlp(jax.random.key(11), (4, width, width, 1))}
    states = jax.random.uniform(jax.random.key(12), (envs, 4), minval=-0.05, maxval=0.05)

    def f(params: Any, states: Any, key: Any) -> Any:
        def step(states: Any, key: Any) -> Any:
            logits = _apply_mlp(params["policy"], states)
            actions = jax.random.categorical(key, logits)
            value = _apply_mlp(params["value"], states)[:, 0]
            new, reward, done = jax.vmap(_cartpole_step)(states, actions)
            logp = jax.nn.log_softmax(logits)[jnp.arange(envs), actions]
            return new, (states, actions, logp, value, reward, done)

        last, traj = lax.scan(step, states, jax.random.split(key, steps))
        _, _, _, values, rewards, dones = traj
        last_value = _apply_mlp(params["value"], last)[:, 0]

        def gae(carry: Any, t: Any) -> Any:
            advantage, next_value = carry
            value, reward, done = t
            delta = reward + 0.99 * next_value * (1 - done) - value
            advantage = delta + 0.99 * 0.95 * (1 - done) * advantage
            return (advantage, value), advantage

        _, advantages = lax.scan(gae, (jnp.zeros(envs), last_value),
                                 (values, rewards, dones), reverse=True)
        return traj, advantages, advantages + values

    return f, (params, states, jax.random.key(13))


# ----------------------------------------------------------------------- sequence layers


def mamba(layers: int, batch: int, length: int, width: int, state: int = 16) -> Program:
    """A stack of Mamba-style layers (minimal Mamba: input projection, a selective scan
    with input-dependent step, gate, output projection; no convolution), residual."""
    inner, rank = 2 * width, max(1, width // 16)

    def layer_params(key: Any) -> dict[str, Any]:
        k = jax.random.split(key, 4)
        return {"in": jax.random.normal(k[0], (width, 2 * inner)) / jnp.sqrt(width),
                "x": jax.random.normal(k[1], (inner, rank + 2 * state)) / jnp.sqrt(inner),
                "dt": jax.random.normal(k[2], (rank, inner)) / jnp.sqrt(rank),
                "a_log": jnp.log(jnp.tile(jnp.arange(1.0, state + 1), (inner, 1))),
                "d": jnp.ones(inner),
                "out": jax.random.normal(k[3], (inner, width)) / jnp.sqrt(inner)}

    params = [layer_params(k) for k in jax.random.split(jax.random.key(14), layers)]
    u = jax.random.normal(jax.random.key(15), (length, batch, width))

    def layer(p: dict[str, Any], u: Any) -> Any:
        x, z = jnp.split(u @ p["in"], 2, axis=-1)
        x = jax.nn.silu(x)
        dt, b, c = jnp.split(x @ p["x"], [rank, rank + state], axis=-1)
        delta = jax.nn.softplus(dt @ p["dt"])
        a = -jnp.exp(p["a_log"])

        def step(h: Any, t: Any) -> Any:
            d, b, c, x = t
            h = jnp.exp(d[..., None] * a) * h + (d * x)[..., None] * b[:, None, :]
            return h, jnp.einsum("bdn,bn->bd", h, c)

        _, y = lax.scan(step, jnp.zeros((batch, inner, state)), (delta, b, c, x))
        return (y + x * p["d"]) * jax.nn.silu(z) @ p["out"]

    def f(params: Any, u: Any) -> Any:
        for p in params:
            u = u + layer(p, u)
        return u

    return f, (params, u)


def flax_bigru(batch: int, length: int, width: int) -> Program:
    """flax.linen's bidirectional GRU (``nn.Bidirectional`` of two ``nn.RNN``)."""
    import flax.linen as nn

    model = nn.Bidirectional(nn.RNN(nn.GRUCell(width)), nn.RNN(nn.GRUCell(width)))
    x = jax.random.normal(jax.random.key(16), (batch, length, 64))
    params = model.init(jax.random.key(17), x)
    return model.apply, (params, x)


def flax_lstm_lm_step(batch: int, length: int, width: int, vocab: int = 512) -> Program:
    """One training step of an LSTM language model: embedding, ``nn.RNN`` of an LSTM
    cell, a vocabulary head, cross-entropy, grad, optax adam."""
    import flax.linen as nn
    import optax

    class LanguageModel(nn.Module):
        @nn.compact
        def __call__(self, tokens: Any) -> Any:
            x = nn.Embed(vocab, width)(tokens)
            x = nn.RNN(nn.OptimizedLSTMCell(width))(x)
            return nn.Dense(vocab)(x)

    model, optimizer = LanguageModel(), optax.adam(1e-3)
    tokens = jax.random.randint(jax.random.key(18), (batch, length + 1), 0, vocab)
    params = model.init(jax.random.key(19), tokens[:, :-1])

    def step(params: Any, opt_state: Any, tokens: Any) -> Any:
        def loss(params: Any) -> Any:
            logits = model.apply(params, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, tokens[:, 1:]).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, (params, optimizer.init(params), tokens)


# ----------------------------------------------------------------------- the corpus


def programs(cpu: bool) -> dict[str, Callable[[], Program]]:
    """The corpus at the chip's sizes (jax.jit's call 1-50 ms on a TPU v5e), or tiny ones
    for this machine's CPU (``cpu``)."""
    steps = 20 if cpu else 1000

    def size(tiny: int, chip: int) -> int:
        return tiny if cpu else chip

    return {
        "blackjax_hmc_1_chain": lambda: measure_tpu.hmc_chains(steps, 1),
        "blackjax_hmc_and_mala": lambda: measure_tpu.hmc_and_mala(steps),
        "blackjax_nuts": lambda: blackjax_nuts(size(10, 300)),
        "numpyro_nuts": lambda: numpyro_nuts(size(10, 400), size(64, 256)),
        "diffrax_tsit5_adaptive_t1": lambda: diffrax_solve(size(4, 256), size(8, 128), "t1"),
        "diffrax_tsit5_adaptive_ts": lambda: diffrax_solve(size(2, 16), size(8, 64), "ts"),
        "diffrax_tsit5_fixed_1000": lambda: diffrax_solve(size(4, 256), size(8, 128), "t1",
                                                          size(20, 1000)),
        "ppo_cartpole_rollout": lambda: ppo_rollout(size(4, 64), size(16, 1000),
                                                    size(8, 64)),
        "mamba_2_layers": lambda: mamba(2, size(2, 8), size(16, 1024), size(8, 128)),
        "flax_bigru": lambda: flax_bigru(size(2, 32), size(16, 1000), size(8, 128)),
        "flax_lstm_lm_step": lambda: flax_lstm_lm_step(size(2, 32), size(12, 200),
                                                       size(8, 256), size(16, 512)),
        # Last: its candidates compiled for 196 s on the chip in r1 (unrolled HMC bodies).
        "blackjax_hmc_8_chains": lambda: measure_tpu.hmc_chains(steps, 8),
    }


MISSING_LIBRARY = "library not installed"


def measure_one(name: str, cpu: bool, measure: Any, rounds: int, tune: bool) -> dict[str, Any]:
    """One program's entry (``measure_tpu.measure_program``), its error, or why it was
    skipped (a library it needs is not installed)."""
    try:
        fn, args = programs(cpu)[name]()
    except ImportError as error:
        return {"skipped": f"{MISSING_LIBRARY}: {error}"}
    try:
        entry = measure_tpu.measure_program(fn, args, measure, rounds, tune)
    except Exception as error:
        return measure_tpu.failure(error)
    want = jax.jit(fn)(*args)
    scale = max(float(jnp.max(jnp.abs(jnp.asarray(leaf, jnp.float32))))
                for leaf in jax.tree_util.tree_leaves(want)
                if hasattr(leaf, "shape") and leaf.size)
    # The model's plan alone (measure=False): the rewrites, where measuring kept jax.jit's.
    plan = jaxpar.parallel_branches(fn, measure=False, **measure_tpu.OPTIONS)
    return {**entry, "result_scale": scale, "device": jax.devices()[0].device_kind,
            "plan_max_abs_diff": measure_tpu.max_abs_diff(want, plan(*args))}


def run_each(names: list[str], argv: list[str], out: str, limit: float,
             budget: float) -> dict[str, Any]:
    """Each program in a process of its own (``--one``), at most ``limit`` seconds each and
    ``budget`` in all; the results file rewritten after each."""
    started = time.perf_counter()
    results: dict[str, Any] = {}
    path = os.path.join(out, "measure-corpus.json")
    for name in names:
        left = budget - (time.perf_counter() - started)
        if left < 10:
            results[name] = {"skipped": "time budget"}
        else:
            results[name] = run_child(name, argv, min(limit, left))
            if "skipped" in results[name] or "error" in results[name]:
                print(f"  {name}: {results[name].get('skipped') or results[name]['error']}",
                      flush=True)
        with open(path, "w") as handle:
            json.dump(results, handle, indent=1, default=str)
    return results


def run_child(name: str, argv: list[str], limit: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        result = os.path.join(scratch, "result.json")
        command = [sys.executable, os.path.abspath(__file__), *argv, "--one", name,
                   "--result", result]
        try:
            done = subprocess.run(command, timeout=limit, check=False)
        except subprocess.TimeoutExpired:
            if not os.path.exists(result):
                return {"skipped": f"time limit: over {limit:.0f} s"}
            # Measured and written, then slow to exit (a compile under way on jaxpar's
            # measuring thread, the runtime's shutdown): the result stands.
            with open(result) as handle:
                return {**json.load(handle),
                        "exit": f"ended at the time limit ({limit:.0f} s) after its result"}
        if not os.path.exists(result):
            return {"error": f"the program's process exited with {done.returncode} and "
                             "wrote no result"}
        with open(result) as handle:
            entry: dict[str, Any] = json.load(handle)
        return entry


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="measure-corpus-"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--limit", type=float, default=80.0, help="seconds per program")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds in all")
    parser.add_argument("--cpu", action="store_true", help="tiny sizes, measure=True")
    parser.add_argument("--only", default="", help="comma-separated program names")
    parser.add_argument("--target", default=None, help="jaxpar's target (as measure_tpu.py)")
    parser.add_argument("--tune", action="store_true", help="also time tune=True")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    names = list(programs(ns.cpu))
    chosen = [n for n in ns.only.split(",") if n] or names
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"--only: unknown {unknown}; the programs are {names}")
    if ns.target:
        measure_tpu.OPTIONS["target"] = ns.target
    if ns.one is not None:
        entry = measure_one(ns.one, ns.cpu, True if ns.cpu else "auto", ns.rounds, ns.tune)
        if "loop_ratio" in entry:
            print(measure_tpu.describe(ns.one, entry), flush=True)
        with open(ns.result, "w") as handle:
            json.dump(entry, handle, default=str)
        return
    os.makedirs(ns.out, exist_ok=True)
    # A ``timeout`` around this script ends the program's process too (subprocess.run
    # kills its child on the exception).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ.setdefault("JAXPAR_TUNE_DIR", tempfile.mkdtemp(prefix="jaxpar-decisions-"))
    # No jax backend in this process: one process holds the chip, and each program's holds it.
    print(f"options {measure_tpu.OPTIONS}; out {ns.out}", flush=True)
    argv = [*(["--cpu"] if ns.cpu else []), *(["--tune"] if ns.tune else []),
            *(["--target", ns.target] if ns.target else []), "--rounds", str(ns.rounds)]
    run_each(chosen, argv, ns.out, ns.limit, ns.budget)


if __name__ == "__main__":
    main()
