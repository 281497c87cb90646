"""inline_twin_calls: independent nested ``jit`` calls of one signature are inlined, so
the batching passes batch what they run (TD3's twin critics behind ``jax.jit``).

Checked: the rewritten jaxpr (no ``jit`` left, batched matmuls), values and gradients
against ``jax.jit`` of the original, calls that keep their boundary, and, with the CUDA
PJRT plugin, launches per run on the deviceless H200 compile equal to the inlined
program's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from helpers.environment import needs_plugin
from pass_checker import assert_same_gradients, assert_same_outputs, check_pass

import jaxpar
from jaxpar.passes import DecisionKind, run_passes

VALUE_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def critic(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    h = jax.nn.relu(h @ p["w2"] + p["b2"])
    return h @ p["w3"]


jitted_critic = jax.jit(critic)  # what RL code writes: qf.apply = jax.jit(qf.apply)
renamed_critic = jax.jit(lambda p, x: critic(p, x))  # another name, traced apart


def twin_critics(p1: Any, p2: Any, x: jax.Array) -> jax.Array:
    return jnp.minimum(jitted_critic(p1, x), jitted_critic(p2, x)).sum()


def twin_critics_inlined(p1: Any, p2: Any, x: jax.Array) -> jax.Array:
    return jnp.minimum(critic(p1, x), critic(p2, x)).sum()


def renamed_twins(p1: Any, p2: Any, x: jax.Array) -> jax.Array:
    return jnp.minimum(jitted_critic(p1, x), renamed_critic(p2, x)).sum()


def _params(seed: int, d: int = 8, h: int = 16) -> dict[str, jax.Array]:
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {"w1": jax.random.normal(k[0], (d, h)) / d ** 0.5, "b1": jnp.full(h, 0.1),
            "w2": jax.random.normal(k[1], (h, h)) / h ** 0.5, "b2": jnp.full(h, -0.1),
            "w3": jax.random.normal(k[2], (h, 1)) / h ** 0.5}


ARGS = (_params(0), _params(1), jax.random.normal(jax.random.PRNGKey(2), (4, 8)))


def _top_calls(jaxpr: Any) -> int:
    """``jit`` equations at the top level (relu's own ``jit`` sits inside)."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    return sum(e.primitive.name == "jit" for e in inner.eqns)


def _passes(fn: Any, *args: Any) -> tuple[Any, Any]:
    result = check_pass(lambda closed: run_passes(closed, target="gpu"), fn, *args,
                        tolerance=VALUE_TOLERANCE, grad_tolerance=GRAD_TOLERANCE)
    return result.new, result.decisions


@pytest.mark.parametrize("fn", [twin_critics, renamed_twins])
def test_twin_jit_calls_are_inlined_and_their_matmuls_batched(fn: Any) -> None:
    assert _top_calls(jax.make_jaxpr(fn)(*ARGS)) == 2
    new, decisions = _passes(fn, *ARGS)
    assert _top_calls(new) == 0
    inlined = [d for d in decisions if d.kind == DecisionKind.INLINED]
    assert len(inlined) == 1 and inlined[0].primitives == ("jit", "jit")
    assert inlined[0].pass_name == "inline_twin_calls"
    assert sum(d.kind == DecisionKind.BATCHED_MATMULS for d in decisions) == 2  # layers 2 and 3


@pytest.mark.parametrize("fn", [twin_critics, renamed_twins])
def test_values_and_gradients_match_jit(fn: Any) -> None:
    rewritten = jaxpar.parallel_branches(fn, target="gpu")
    assert_same_outputs(rewritten, fn, ARGS, tolerance=VALUE_TOLERANCE, jit=True)
    assert_same_gradients(rewritten, fn, ARGS, tolerance=GRAD_TOLERANCE, jit=True)


def test_inspect_names_the_inlined_calls() -> None:
    plan = jaxpar.inspect(twin_critics, target="gpu")(*ARGS)
    assert "inlined calls: 2 independent `jit` calls" in str(plan)
    assert "`critic`" in plan.text(verbose=True)


def test_calls_without_an_independent_twin_keep_their_boundary() -> None:
    def single(p: Any, x: jax.Array) -> jax.Array:
        return jitted_critic(p, x).sum()

    square = jax.jit(lambda x, w: jnp.tanh(x @ w))

    def chained(x: jax.Array, w: jax.Array) -> jax.Array:  # the second reads the first
        return square(square(x, w), w).sum()

    w = jax.random.normal(jax.random.PRNGKey(3), (8, 8))
    for fn, args in [(single, (ARGS[0], ARGS[2])), (chained, (ARGS[2], w))]:
        closed = jax.make_jaxpr(fn)(*args)
        new, decisions = run_passes(closed, target="gpu")
        assert _top_calls(new) == _top_calls(closed) > 0
        assert not [d for d in decisions if d.kind == DecisionKind.INLINED]


def test_off_without_the_batching_passes() -> None:
    closed = jax.make_jaxpr(twin_critics)(*ARGS)
    new, _ = run_passes(closed, target="gpu", batch_branches=False, batch_matmuls=False)
    assert _top_calls(new) == 2


@needs_plugin
def test_twin_critics_behind_jit_launch_as_few_kernels_as_inlined() -> None:
    args = (_params(0, 32, 64), _params(1, 32, 64), jnp.ones((16, 32)))
    # In XLA's default CUDA-graph mode (lhs), where batching saves launches.
    preview_jit = jaxpar.gpu_preview(
        jaxpar.parallel_branches(twin_critics, command_buffers="lhs"), *args, gpu="h200")
    preview_inlined = jaxpar.gpu_preview(
        jaxpar.parallel_branches(twin_critics_inlined, command_buffers="lhs"), *args, gpu="h200")
    assert preview_inlined.jaxpar.launches < preview_inlined.plain.launches
    assert preview_jit.plain.launches == preview_inlined.plain.launches
    assert preview_jit.jaxpar.launches == preview_inlined.jaxpar.launches
