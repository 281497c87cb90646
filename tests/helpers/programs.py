"""The small hand-written programs the tests share, their arguments, and the options that
make them stream.

Example::

    from helpers.programs import FOUR_BRANCHES_OPTIONS, four_branches, four_branches_args

    g = jaxpar.parallel_branches(four_branches, **FOUR_BRANCHES_OPTIONS)
    g(*four_branches_args())

Sharp edges:
    The programs are sized to run in milliseconds on a CPU. With the default
    `min_cost_us=5` the GPU cost model judges each 256x256 chain of `four_branches`
    (~4.8 us) too cheap for a stream of its own, so tests that want streams from it pass
    `FOUR_BRANCHES_OPTIONS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

# Loop and batching rewrites off: the two scans stay two loops, so streams are what is tested.
# The sections are forced: the GPU pricing (jaxpar/_plan/pricing.py) would leave small loops out of
# stream regions under XLA's default CUDA-graph mode.
LOOPS_OFF: dict[str, Any] = {"fuse_scans": False, "batch_scans": False,
                             "batch_branches": False, "batch_matmuls": False, "unroll": None,
                             "force_streams": True}

# Options under which four_branches is worth streams on the GPU cost model (see Sharp edges).
# Its four chains are identical, so by default the GPU target batches them into one vmapped
# chain instead (tests/test_batch_branches.py); tests of streams turn that off.
# The GPU pricing (jaxpar/_plan/pricing.py) refuses these sections under XLA's default CUDA-graph
# mode; tests of stream emission force them.
FOUR_BRANCHES_OPTIONS: dict[str, Any] = {"target": "gpu", "min_cost_us": 2.0,
                                         "batch_branches": False, "batch_matmuls": False,
                                         "force_streams": True}

_SCAN_LENGTH = 20
_SCAN_SIZE = 100
_CHAIN_SIZE = 256


def run_optimized(fn: Callable[..., Any], *args: Any) -> Any:
    """``jax.jit(fn)(*args)``, compiled at XLA's default optimization level.

    The suite compiles at ``--xla_backend_optimization_level=0`` (``conftest.py``), which
    XLA:CPU pays for with convolutions inside non-inlined calls: a forced stream region
    around the towers of a small CNN runs about 10x slower there (22 s against 2 s for the
    gradient of ``cnn_loss`` at ``cnn_args``). Tests that run such a program use this.
    """
    compiled = jax.jit(fn).lower(*args).compile(
        compiler_options={"xla_backend_optimization_level": 2})
    return compiled(*args)


def _scan_xs() -> jax.Array:
    return 0.01 * jnp.cos(jnp.arange(_SCAN_LENGTH * _SCAN_SIZE * _SCAN_SIZE, dtype=jnp.float32)
                          ).reshape(_SCAN_LENGTH, _SCAN_SIZE, _SCAN_SIZE)


def two_scans(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two independent `lax.scan`s with *different* bodies over 100x100 matrices, 20 steps."""
    xs = _scan_xs()

    def step_tanh(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        new = jnp.tanh(carry @ x + carry)
        return new, new[0]

    def step_sin(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        return jnp.sin(x @ carry) + 0.5 * carry, None

    first, _ = lax.scan(step_tanh, a, xs)
    second, _ = lax.scan(step_sin, b, xs)
    return first, second


def two_scans_args(seed: int = 2) -> tuple[jax.Array, jax.Array]:
    key_a, key_b = jax.random.split(jax.random.key(seed))
    shape = (_SCAN_SIZE, _SCAN_SIZE)
    return jax.random.normal(key_a, shape), jax.random.normal(key_b, shape)


def chain(x: jax.Array) -> jax.Array:
    """Two dependent matmuls with `tanh`: one branch of `four_branches`."""
    return jnp.tanh(jnp.tanh(x @ x) @ x)


def four_branches(a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array) -> jax.Array:
    """Four independent chains of two 256x256 matmuls + tanh, summed."""
    return chain(a) + chain(b) + chain(c) + chain(d)


def four_branches_args(seed: int = 4) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(seed), 4)
    return tuple(0.05 * jax.random.normal(k, (_CHAIN_SIZE, _CHAIN_SIZE)) for k in keys)


def pure_chain(x: jax.Array) -> jax.Array:
    """Nothing independent: every matmul needs the one before."""
    for _ in range(4):
        x = jnp.tanh(x @ x)
    return x


def pure_chain_args(seed: int = 7) -> tuple[jax.Array]:
    return (0.05 * jax.random.normal(jax.random.key(seed), (_CHAIN_SIZE, _CHAIN_SIZE)),)


def seed_002_step_tanh(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return jnp.tanh(carry @ x @ x) * 0.5, None


def seed_002_step_sin(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return jnp.sin(x @ carry) + 0.5 * carry, None


def seed_002(a: jax.Array, b: jax.Array, xs1: jax.Array, xs2: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    """The two-scan program as its user wrote it: two independent scans with different
    bodies, each over its own stack of matrices (``seed_002_specs`` for the user's
    10,000-step shapes)."""
    return (lax.scan(seed_002_step_tanh, a, xs1)[0],
            lax.scan(seed_002_step_sin, b, xs2)[0])


def seed_002_specs(n: int = 100, steps: int = 10_000) -> tuple[jax.ShapeDtypeStruct, ...]:
    matrix = jax.ShapeDtypeStruct((n, n), jnp.float32)
    stack = jax.ShapeDtypeStruct((steps, n, n), jnp.float32)
    return matrix, matrix, stack, stack


def _deepened(h: jax.Array) -> jax.Array:
    """Eight residual sine steps: elementwise work after a cell's recurrence."""
    for _ in range(8):
        h = h + 0.5 * jnp.sin(h)
    return h


def deep_birnn(rnn: dict[str, jax.Array], xs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two independent RNN scans, forward and reverse (issue 45's user program, heads
    left out), each cell deep in elementwise work (28 equations a body): apart, each is
    unrolled by 10 of its 100 trips; fused, the body's 56 equations exceed
    ``MAX_UNROLLED_EQNS`` at 10 copies and unroll="auto" unrolls it by 5 only, which the
    GPU model rates slower (``deep_birnn_args`` for values)."""
    h0 = jnp.zeros((xs.shape[1], rnn["fw_U"].shape[0]), xs.dtype)

    def forward(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = _deepened(jnp.tanh(x @ rnn["fw_W"] + h @ rnn["fw_U"]))
        return h, h

    def backward(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = _deepened(jnp.tanh(x @ rnn["bw_W"] + h @ rnn["bw_U"]))
        return h, h

    return lax.scan(forward, h0, xs)[1], lax.scan(backward, h0, xs, reverse=True)[1]


def deep_birnn_args() -> tuple[dict[str, jax.Array], jax.Array]:
    keys = jax.random.split(jax.random.key(3), 5)
    shapes = {"fw_W": (32, 64), "fw_U": (64, 64), "bw_W": (32, 64), "bw_U": (64, 64)}
    rnn = {name: jax.random.normal(key, shape) * 0.1
           for key, (name, shape) in zip(keys, shapes.items(), strict=False)}
    return rnn, jax.random.normal(keys[4], (100, 64, 32))


def four_matmul_branches(x: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array,
                         w4: jax.Array) -> jax.Array:
    """Four chains of two 512x512 matmuls on a shared input, summed."""
    return sum(jnp.tanh(jnp.tanh(x @ w) @ w) for w in (w1, w2, w3, w4))


def four_matmul_branches_args() -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    return tuple(jax.random.normal(k, (512, 512)) * 0.04 for k in keys)


def _conv(x: jax.Array, w: jax.Array) -> jax.Array:
    return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def two_tower_cnn(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """A stem, then two convolution towers (two and three deep) joined by a dense head."""
    x = jax.nn.relu(_conv(x, p["stem"]))
    b = jax.nn.relu(_conv(jax.nn.relu(_conv(x, p["b1"])), p["b3"]))
    c = jax.nn.relu(_conv(jax.nn.relu(_conv(jax.nn.relu(_conv(x, p["c1"])), p["c3a"])),
                          p["c3b"]))
    return jnp.mean(jnp.concatenate([b, c], -1), axis=(1, 2)) @ p["head"]


def cnn_loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jnp.mean(two_tower_cnn(p, x) ** 2)


def cnn_args() -> tuple[dict[str, jax.Array], jax.Array]:
    shapes = {"stem": (3, 3, 3, 64), "b1": (1, 1, 64, 64), "b3": (3, 3, 64, 64),
              "c1": (1, 1, 64, 64), "c3a": (3, 3, 64, 64), "c3b": (3, 3, 64, 64),
              "head": (128, 10)}
    keys = jax.random.split(jax.random.PRNGKey(0), len(shapes) + 1)
    p = {name: jax.random.normal(k, shape) * 0.05
         for k, (name, shape) in zip(keys, sorted(shapes.items()), strict=False)}
    return p, jax.random.normal(keys[-1], (8, 32, 32, 3))



def fan(*xs: jax.Array) -> jax.Array:
    """Eight independent chains of small, latency-bound kernels (cumulative sums and a
    reduction), of different heights so that nothing batches them: what XLA's
    ``CONCURRENT_REGIONS`` mode runs as parallel graph nodes."""
    outs = []
    for x in xs:
        for _ in range(3):
            x = jnp.cumsum(x, axis=0) * 0.5
        outs.append(x.sum())
    return sum(outs)


def fan_args() -> tuple[jax.Array, ...]:
    """``fan``'s eight arguments, of heights 64 to 120."""
    keys = jax.random.split(jax.random.PRNGKey(3), 8)
    return tuple(jax.random.normal(k, (64 + 8 * n, 64)) / 8 for n, k in enumerate(keys))
