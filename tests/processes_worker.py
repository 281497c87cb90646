"""One process of a real multi-process JAX program, for ``tests/test_processes.py``.

Run as ``python processes_worker.py PROCESS COUNT PORT TUNE_DIR``: it joins the others
under ``jax.distributed.initialize`` on this machine's CPU (4 devices a process, gloo
collectives), runs every case in the same order as the others, and prints one JSON line
``RESULT {...}`` with what each case found (the test compares the processes' lines).
A case that fails records its error and the others still run, in step with the other
processes (every case reaches its collectives on every process, or raises on every one).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
import sys
import traceback
import warnings
from pathlib import Path

PROCESS, COUNT, PORT, TUNE_DIR = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["JAXPAR_TUNE_DIR"] = TUNE_DIR
# After the compile-speed flags the test passes on (tests/test_processes.py's launch).
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{PORT}", num_processes=COUNT, process_id=PROCESS,
                           initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from collective_matmul import AXIS, make_collective_matmul  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpar  # noqa: E402

MESH = Mesh(np.array(jax.devices()), (AXIS,))
RESULTS: dict[str, object] = {}


def case(function):
    """Runs ``function`` as a case: its result, or its error's class and message."""
    try:
        RESULTS[function.__name__] = function()
    except Exception as error:  # recorded for the test to judge
        RESULTS[function.__name__] = {"error": type(error).__name__, "message": str(error),
                                      "trace": traceback.format_exc()[-2000:]}
    return function


def global_array(values: np.ndarray, spec: P) -> jax.Array:
    """``values`` (the same on every process) as a global array sharded by ``spec``."""
    sharding = NamedSharding(MESH, spec)
    return jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])


def local(value: jax.Array) -> list[list[float]]:
    """This process's shards of ``value``, as nested lists (exact floats)."""
    return [np.asarray(shard.data).ravel().tolist() for shard in value.addressable_shards]


def same_shards(got, want, exact: bool) -> bool:
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    for a, b in pairs:
        for x, y in zip(a.addressable_shards, b.addressable_shards, strict=True):
            if exact and not np.array_equal(np.asarray(x.data), np.asarray(y.data)):
                return False
            if not exact and not np.allclose(np.asarray(x.data), np.asarray(y.data),
                                             rtol=2e-5, atol=2e-5):
                return False
    return True


RNG = np.random.default_rng(0)
SIZE = jax.device_count()
X = global_array(RNG.standard_normal((SIZE * 4, 16)).astype(np.float32), P(AXIS, None))
W = global_array(RNG.standard_normal((16, SIZE * 2)).astype(np.float32), P(None, AXIS))


@case
def collective_matmul():
    """The bidirectional collective matmul: values and gradients equal plain jax.jit's."""
    matmul = make_collective_matmul(MESH)

    def loss(x, w):
        return jnp.sum(jnp.tanh(matmul(x, w)))

    want = jax.jit(matmul)(X, W)
    want_grad = jax.jit(jax.grad(loss, argnums=(0, 1)))(X, W)
    out = {}
    for target in ("cpu", "gpu"):
        fast = jaxpar.parallel_branches(matmul, target=target)
        grad = jaxpar.parallel_branches(jax.grad(loss, argnums=(0, 1)), target=target)
        out[target] = {"values": same_shards(fast(X, W), want, exact=target == "cpu"),
                       "grads": same_shards(grad(X, W), want_grad, exact=target == "cpu"),
                       "plan": hashlib.sha256(json.dumps(jaxpar.inspect(fast)(X, W).to_dict(),
                                                         sort_keys=True, default=str).encode()
                                              ).hexdigest()}
    return out


def adam_step(params, batch, moments, step):
    """A data-parallel step: two towers' loss over a batch sharded across processes,
    its gradient (averaged by XLA over the batch's devices), and Adam."""
    def loss(params):
        left = jnp.tanh(batch @ params["a"]) @ params["b"]
        right = jnp.sin(batch @ params["c"]) @ params["d"]
        return jnp.mean((left - right) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    first, second = moments
    first = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, first, grads)
    second = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, second, grads)
    scale = jnp.sqrt(1 - 0.999 ** step) / (1 - 0.9 ** step)
    params = jax.tree.map(lambda p, m, v: p - 1e-2 * scale * m / (jnp.sqrt(v) + 1e-8),
                          params, first, second)
    return params, (first, second), value


def step_inputs():
    params = {name: global_array(RNG.standard_normal((16, 16)).astype(np.float32) * 0.3, P())
              for name in "abcd"}
    zeros = jax.tree.map(jnp.zeros_like, params)
    batch = global_array(RNG.standard_normal((SIZE * 8, 16)).astype(np.float32), P(AXIS))
    return params, batch, (zeros, zeros)


PARAMS, BATCH, MOMENTS = step_inputs()


@case
def data_parallel_step():
    """Three Adam steps equal plain jax.jit's, on both targets."""
    out = {}
    for target in ("cpu", "gpu"):
        fast = jaxpar.parallel_branches(adam_step, target=target)
        plain = jax.jit(adam_step)
        mine, theirs = (PARAMS, MOMENTS), (PARAMS, MOMENTS)
        agree = True
        for step in range(1, 4):
            *mine, value = fast(mine[0], BATCH, mine[1], float(step))
            *theirs, expected = plain(theirs[0], BATCH, theirs[1], float(step))
            agree &= same_shards((mine, value), (theirs, expected), exact=target == "cpu")
        out[target] = agree
    return out


def scanned_steps(params, batch, moments):
    """Four Adam steps in a scan, which ``unroll=4`` unrolls: a program other than
    plain's, so the tuner times two."""
    def body(carry, step):
        params, moments, value = adam_step(*carry[:1], batch, carry[1], step)
        return (params, moments), value

    return lax.scan(body, (params, moments), jnp.arange(1.0, 5.0))


def tuned_step(**budget):
    return jaxpar.parallel_branches(scanned_steps, target="cpu", unroll=4,
                                    tune=jaxpar.TuneBudget(**{"seconds": 0.2, **budget}))


@case
def inspect_before_the_first_call():
    """Process 0 alone inspects a tuned step before any call: local, no collective."""
    if PROCESS == 0:
        plan = jaxpar.inspect(tuned_step())(PARAMS, BATCH, MOMENTS)
        return {"source": plan.tuning.source, "text": plan.text()}
    return {"tuning": "not asked"}


@case
def tuned():
    """The first call tunes together: one choice everywhere, process 0 writes alone."""
    step = tuned_step()
    got = step(PARAMS, BATCH, MOMENTS)
    tuning = step.tuning(PARAMS, BATCH, MOMENTS)
    multihost_utils.sync_global_devices("tuned: files written")
    files = sorted(Path(TUNE_DIR).glob("*.json"))
    mode = [stat.S_IMODE(path.stat().st_mode) for path in files]
    return {"chosen": tuning.chosen, "source": tuning.source, "processes": tuning.processes,
            "path": tuning.path, "files": len(files), "modes": mode,
            "rows": [[row.label, row.ratio, row.runs] for row in tuning.rows],
            "values": same_shards(got, jax.jit(scanned_steps)(PARAMS, BATCH, MOMENTS),
                                  exact=False)}


def measured_loop(c, xs):
    """A scan the TPU plan reads by blocks: a program other than jax.jit's."""
    return lax.scan(lambda c, x: (0.9 * c + 0.1 * jnp.sin(x), c[0]), c, xs)


@case
def measured_together():
    """``measure=True``, with a timer every process reads alike (the plan twice as fast):
    the first call runs jax.jit's program; at the second every process waits for its
    candidates, they decide together and switch before that call runs, so every process
    runs the same program at every call."""
    from jaxpar import _tune

    def timer(label, run):
        jax.block_until_ready(run())
        return 0.5 if label == "jaxpar (chosen options)" else 1.0

    real, _tune._timer = _tune._timer, timer
    try:
        c = global_array(np.linspace(0.0, 1.0, 8, dtype=np.float32), P())
        xs = global_array(np.linspace(-1.0, 1.0, 1600, dtype=np.float32).reshape(200, 8), P())
        step = jaxpar.parallel_branches(measured_loop, target="tpu", measure=True)
        want = jax.jit(measured_loop)(c, xs)
        installed = []
        outs = []
        for _ in range(3):
            outs.append(step(c, xs))
            installed.append(id(step._state.installed))
        tuning = step.tuning(c, xs)
    finally:
        _tune._timer = real
    return {"chosen": tuning.chosen, "source": tuning.source, "processes": tuning.processes,
            "switched_at": [i for i in range(1, 3) if installed[i] != installed[i - 1]],
            "values": all(same_shards(out, want, exact=False) for out in outs)}


@case
def inspect_reads_the_stored_decision():
    """A fresh tuned function on process 0 alone: inspect reads process 0's file."""
    multihost_utils.sync_global_devices("before reading the stored decision")
    out = {"tuning": "not asked"}
    if PROCESS == 0:
        tuning = jaxpar.inspect(tuned_step())(PARAMS, BATCH, MOMENTS).tuning
        out = {"source": tuning.source, "chosen": tuning.chosen}
    return out


@case
def read_only_runs_the_stored_decision():
    """Read-only, and only process 0 has the file (no shared directory): every process
    runs process 0's decision, nobody measures."""
    if PROCESS:
        os.environ["JAXPAR_TUNE_DIR"] = f"{TUNE_DIR}-{PROCESS}"
    try:
        step = tuned_step(read_only=True)
        step(PARAMS, BATCH, MOMENTS)
        tuning = step.tuning(PARAMS, BATCH, MOMENTS)
        return {"source": tuning.source, "chosen": tuning.chosen}
    finally:
        os.environ["JAXPAR_TUNE_DIR"] = TUNE_DIR


def other_flags(function):
    """``function()`` with a CUDA-graph mode in this process's XLA_FLAGS if it is the last
    process (jaxpar reads them at each call); the error's class and message."""
    saved = os.environ["XLA_FLAGS"]
    if PROCESS == COUNT - 1:
        os.environ["XLA_FLAGS"] = saved + " --xla_gpu_enable_command_buffer="
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            function()
        return {"error": None}
    except jaxpar.ProcessMismatchError as error:
        return {"error": type(error).__name__, "message": str(error)}
    finally:
        os.environ["XLA_FLAGS"] = saved


@case
def a_host_with_other_flags_is_refused():
    matmul = make_collective_matmul(MESH)
    return other_flags(lambda: jaxpar.parallel_branches(matmul, target="gpu")(X, W))


@case
def a_tuning_host_with_other_flags_is_refused():
    step = jaxpar.parallel_branches(adam_step, target="gpu", tune=True)
    return other_flags(lambda: step(PARAMS, BATCH, MOMENTS, 1.0))


@case
def a_host_with_another_tune_budget_is_refused():
    """The plans agree, the tuners' budgets do not: the tuner's own exchange refuses."""
    step = tuned_step(seconds=0.3 if PROCESS == COUNT - 1 else 0.2)
    try:
        step(PARAMS, BATCH, MOMENTS)
        return {"error": None}
    except jaxpar.ProcessMismatchError as error:
        return {"error": type(error).__name__, "message": str(error)}


@case
def still_in_step_after_a_refusal():
    """The processes go on together after refusing: a collective still runs."""
    fast = jaxpar.parallel_branches(functools.partial(jnp.sum, axis=0), target="cpu")
    return local(fast(X))


print("RESULT " + json.dumps(RESULTS, default=str), flush=True)
jax.distributed.shutdown()
