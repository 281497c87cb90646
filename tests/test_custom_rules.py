"""Merges and batches never change what a custom rule or an effect sees.

``share_common`` merges twin equations, and a batching pass runs members under a ``vmap``
(``vmap_members``): both happen before the user differentiates the emitted program. A
``custom_vjp`` backward rule of merged twins would see their cotangents summed (gradient
clipping is not linear), an effect in a rule would happen once, and a rule run under a
``vmap`` the user never wrote may raise (a ``pure_callback`` without a ``vmap_method``) or
draw other random bits (``rbg`` keys). A host callback is only right for the shapes it was
written for, whatever ``vmap_method`` it declares. Each test compares values, gradients and
effects with ``jax.jit`` of the original on both targets, and checks the decision and its
reason; the relu tests are the positive control (a ``custom_jvp`` with a clean rule is still
batched).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from pass_checker import assert_matches

import jaxpar
from jaxpar.passes import DecisionKind

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
# Each option set takes another path: the default pricing, forced streams (regions
# everywhere), and on the CPU target the batching passes switched on by hand.
GPU_OPTIONS = [{}, {"force_streams": True, "min_cost_us": 0.0}]
CPU_BATCHING = {"batch_scans": True, "batch_branches": True}


@jax.custom_vjp
def clip_gradient(x: jax.Array) -> jax.Array:
    return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))
clip_helper = jax.jit(lambda x: clip_gradient(x))


def grads(fn: Callable[..., Any], *args: Any) -> Any:
    return jax.grad(lambda *a: sum(jnp.sum(leaf) for leaf in jax.tree.leaves(fn(*a))),
                    argnums=tuple(range(len(args))))(*args)


def assert_like_jit(fn: Callable[..., Any], args: tuple[Any, ...], target: str,
                    **options: Any) -> None:
    """Values and gradients of ``parallel_branches(fn)`` equal ``jax.jit(fn)``'s."""
    pb = jaxpar.parallel_branches(fn, target=target, **options)
    assert_matches(pb(*args), jax.jit(fn)(*args), tolerance=TOLERANCE)
    assert_matches(grads(pb, *args), grads(jax.jit(fn), *args), tolerance=TOLERANCE)


def decisions(fn: Callable[..., Any], args: tuple[Any, ...], target: str,
              **options: Any) -> list[Any]:
    plan = jaxpar.inspect(fn, target=target, **options)(*args)
    return list(plan.decisions)


def targets() -> list[tuple[str, dict[str, Any]]]:
    """The GPU target as it prices and forced, and the CPU target with batching on (its
    defaults neither share nor batch)."""
    return [*[("gpu", o) for o in GPU_OPTIONS], ("cpu", CPU_BATCHING)]


# --- mechanism 1: merges before autodiff ----------------------------------------------------


def twin_clips(x: jax.Array) -> jax.Array:
    return jnp.sum(clip_helper(x) * 3.0) + jnp.sum(clip_helper(x) * 0.5)


@pytest.mark.parametrize(("target", "options"), [*targets(), ("cpu", {})])
def test_clipping_twins_behind_jit_are_not_merged(target: str, options: dict[str, Any]) -> None:
    x = jnp.arange(4.0)
    pb = jaxpar.parallel_branches(twin_clips, target=target, **options)
    # jit: each twin's backward rule clips its own cotangent (3.0 -> 1.0, 0.5 stays).
    np.testing.assert_allclose(jax.grad(pb)(x), [1.5] * 4)
    assert_like_jit(twin_clips, (x,), target, **options)


def test_unshared_twins_carry_the_reason() -> None:
    found = decisions(twin_clips, (jnp.arange(4.0),), "gpu")
    notes = [d for d in found if d.pass_name == "share_common"]
    assert [d.kind for d in notes] == [DecisionKind.LEFT_ALONE], found
    assert "custom_vjp" in notes[0].reason and "summed" in notes[0].reason, notes[0].reason
    assert len(notes[0].eqns) == 2


def test_clean_twins_are_still_merged() -> None:
    """Positive control: the same program without the custom rule is shared."""
    helper = jax.jit(lambda x: jnp.sin(x) * 2.0)

    def f(x: jax.Array) -> jax.Array:
        return jnp.sum(helper(x) * 3.0) + jnp.sum(helper(x) * 0.5)

    x = jnp.arange(4.0)
    assert not [d for d in decisions(f, (x,), "gpu") if d.pass_name == "share_common"]
    closed = jaxpar.passes.share_common(jax.make_jaxpr(f)(x))[0]
    assert sum(e.primitive.name in ("jit", "pjit") for e in closed.jaxpr.eqns) == 1
    assert_like_jit(f, (x,), "gpu")


def printing_bwd_program(seen: list[float]) -> Callable[..., Any]:
    @jax.custom_vjp
    def loud(x: jax.Array) -> jax.Array:
        return jnp.sin(x)

    def bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
        jax.debug.callback(lambda v: seen.append(float(np.sum(v))), g)
        return (g * jnp.cos(x),)

    loud.defvjp(lambda x: (jnp.sin(x), x), bwd)
    helper = jax.checkpoint(lambda x: loud(x) * 2.0)

    def f(x: jax.Array) -> jax.Array:
        return jnp.sum(helper(x) * 3.0) + jnp.sum(helper(x) * 0.5)

    return f


@pytest.mark.parametrize(("target", "options"), targets())
def test_printing_backward_rule_under_checkpoint_runs_once_per_twin(
        target: str, options: dict[str, Any]) -> None:
    x = jnp.linspace(0.1, 0.8, 4)
    got: list[float] = []
    want: list[float] = []
    g_pb = jax.grad(jaxpar.parallel_branches(printing_bwd_program(got), target=target,
                                             **options))(x)
    g_jit = jax.grad(jax.jit(printing_bwd_program(want)))(x)
    jax.effects_barrier()
    assert_matches(g_pb, g_jit, tolerance=TOLERANCE)
    assert len(want) == 2 and sorted(got) == pytest.approx(sorted(want)), (got, want)


def test_printing_jvp_rule_twins_are_not_merged() -> None:
    """A custom_jvp whose rule has an effect: merged twins would run it once."""
    seen: list[float] = []

    @jax.custom_jvp
    def loud(x: jax.Array) -> jax.Array:
        return jnp.sin(x)

    @loud.defjvp
    def _(primals: Any, tangents: Any) -> Any:
        jax.debug.callback(lambda v: seen.append(float(np.sum(v))), tangents[0])
        return jnp.sin(primals[0]), jnp.cos(primals[0]) * tangents[0]

    helper = jax.jit(lambda x: loud(x) * 2.0)

    def f(x: jax.Array) -> jax.Array:
        return jnp.sum(helper(x) * 3.0) + jnp.sum(helper(x) * 0.5)

    def forward_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
        return lambda v: jax.jvp(fn, (v,), (jnp.ones_like(v),))

    x = jnp.linspace(0.1, 0.8, 4)
    pb = jaxpar.parallel_branches(f, target="gpu")
    # jax.jit runs the rule's callback once per twin under jvp (grad drops it).
    for transform, calls in ((forward_mode, 2), (jax.grad, 0)):
        seen.clear()
        got = transform(pb)(x)
        jax.effects_barrier()
        count = len(seen)
        seen.clear()
        want = transform(jax.jit(f))(x)
        jax.effects_barrier()
        assert count == len(seen) == calls, (count, len(seen))
        assert_matches(got, want, tolerance=TOLERANCE)
    notes = [d for d in decisions(f, (x,), "gpu") if d.pass_name == "share_common"]
    assert notes and "jvp rule" in notes[0].reason, notes


def clip_step(c: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    c = clip_helper(jnp.sin(c) + x)
    return c, c * 2.0


def two_clipping_scans(a: jax.Array, xs: jax.Array) -> Any:
    # The same operands: batched, the two scans would be one scan, run once.
    return lax.scan(clip_step, a, xs)[0] * 3.0, lax.scan(clip_step, a, xs)[1] * 0.25


@pytest.mark.parametrize(("target", "options"), targets())
def test_scans_sharing_a_clipping_step_keep_their_gradients(
        target: str, options: dict[str, Any]) -> None:
    args = (jnp.linspace(0.1, 0.9, 8), jnp.linspace(-1.0, 1.0, 40).reshape(5, 8))
    assert_like_jit(two_clipping_scans, args, target, **options)


def test_scans_sharing_a_clipping_step_say_why_they_are_not_batched() -> None:
    args = (jnp.linspace(0.1, 0.9, 8), jnp.linspace(-1.0, 1.0, 40).reshape(5, 8))
    found = decisions(two_clipping_scans, args, "cpu", **CPU_BATCHING)
    assert DecisionKind.BATCHED not in [d.kind for d in found]
    notes = [d for d in found if d.pass_name == "batch_scans"]
    assert notes and notes[0].kind == DecisionKind.LEFT_ALONE, found
    assert "custom_vjp" in notes[0].reason, found


# --- mechanism 3: custom rules under a vmap the user never wrote ----------------------------


@jax.custom_vjp
def host_tanh(x: jax.Array) -> jax.Array:
    return jnp.tanh(x)


def _host_tanh_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    d = jax.pure_callback(lambda t: (1 - np.tanh(t) ** 2).astype(np.float32),
                          jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return (g * d,)


host_tanh.defvjp(lambda x: (jnp.tanh(x), x), _host_tanh_bwd)
host_helper = jax.jit(host_tanh)


def host_members(x: jax.Array, w0: jax.Array, w1: jax.Array, w2: jax.Array,
                 w3: jax.Array) -> jax.Array:
    return sum(jnp.sum(host_helper(jnp.tanh(x @ w) @ w)) for w in (w0, w1, w2, w3))


def member_args() -> tuple[jax.Array, ...]:
    ws = [jax.random.normal(jax.random.key(i), (8, 8)) * 0.3 for i in range(4)]
    return (jnp.ones((4, 8)), *ws)


@pytest.mark.parametrize(("target", "options"), targets())
def test_custom_vjp_with_a_host_callback_in_batched_members(
        target: str, options: dict[str, Any]) -> None:
    assert_like_jit(host_members, member_args(), target, **options)


def test_custom_vjp_members_say_why() -> None:
    found = decisions(host_members, member_args(), "gpu")
    reasons = [d.reason for d in found if "custom_vjp" in d.reason]
    assert reasons, found


def host_tanh_step(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return host_helper(c * x), None


@pytest.mark.parametrize(("target", "options"), targets())
def test_custom_vjp_with_a_host_callback_in_batched_scans(
        target: str, options: dict[str, Any]) -> None:
    def f(a: jax.Array, b: jax.Array, xs: jax.Array) -> Any:
        return lax.scan(host_tanh_step, a, xs)[0], lax.scan(host_tanh_step, b, xs)[0]

    args = (jnp.linspace(0.1, 0.9, 8), jnp.linspace(0.9, 0.1, 8),
            jnp.linspace(-1.0, 1.0, 40).reshape(5, 8))
    assert_like_jit(f, args, target, **options)


def _centre(v: np.ndarray) -> np.ndarray:
    """Right only for the shape it was written for: it subtracts the mean of what it gets."""
    return (v - v.mean()).astype(v.dtype)


def centred(y: jax.Array) -> jax.Array:
    return jax.pure_callback(_centre, jax.ShapeDtypeStruct(y.shape, y.dtype), y,
                             vmap_method="expand_dims")


def centred_members(x: jax.Array, ws: list[jax.Array]) -> list[jax.Array]:
    return [centred(jnp.tanh(jnp.tanh(x @ w) @ w)) for w in ws]


@pytest.mark.parametrize(("target", "options"), targets())
def test_callbacks_with_a_vmap_method_are_not_batched(target: str,
                                                      options: dict[str, Any]) -> None:
    x = jnp.eye(8) * 0.5
    ws = [jnp.eye(8) * (0.1 + 0.2 * k) + 0.01 * k for k in range(4)]
    pb = jaxpar.parallel_branches(centred_members, target=target, **options)
    assert_matches(pb(x, ws), jax.jit(centred_members)(x, ws), tolerance=TOLERANCE)
    if target == "gpu" and not options:
        found = decisions(centred_members, (x, ws), "gpu")
        # The matmuls before the callbacks are still batched; the callbacks are not.
        assert DecisionKind.BATCHED_SUBGRAPHS in [d.kind for d in found], found
        plan_program = jaxpar.passes.batch_branches(jax.make_jaxpr(centred_members)(x, ws))[0]
        callbacks = [e for e in plan_program.jaxpr.eqns if e.primitive.name == "pure_callback"]
        assert len(callbacks) == 4


@jax.custom_jvp
def noisy_sin(x: jax.Array) -> jax.Array:
    return jnp.sin(x)


@noisy_sin.defjvp
def _noisy_sin_jvp(primals: Any, tangents: Any) -> Any:
    (x,), (t,) = primals, tangents
    # A draw from an rbg key that depends on the primal: rbg bits differ under vmap.
    seed = lax.convert_element_type(jnp.floor(jnp.sum(x) * 7.0), jnp.uint32)
    key = jax.random.fold_in(jax.random.key(0, impl="rbg"), seed)
    noise = jax.random.uniform(key, x.shape)
    return jnp.sin(x), jnp.cos(x) * t * (1.0 + noise)


# Traced once (jit caches it), so every member holds the same rule and compares equal.
noisy_helper = jax.jit(noisy_sin)


def noisy_members(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
    return sum(jnp.sum(noisy_helper(jnp.tanh(x @ w) @ w)) for w in ws)


@pytest.mark.parametrize(("target", "options"), targets())
def test_rbg_draws_in_a_jvp_rule_are_not_batched(target: str, options: dict[str, Any]) -> None:
    x = jnp.eye(8) * 0.5
    ws = [jnp.eye(8) * (0.1 + 0.2 * k) + 0.01 * k for k in range(3)]
    assert_like_jit(noisy_members, (x, ws), target, **options)


def relu_members(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
    # Stacked: members' tails returned apart would each be a kernel once batched
    # (test_batch_matmuls.test_tails_returned_apart_are_left_alone).
    return jnp.stack([jax.nn.relu(jax.nn.relu(x @ w) @ w) for w in ws])


@pytest.mark.parametrize(("target", "options"), targets())
def test_relu_members_are_still_batched(target: str, options: dict[str, Any]) -> None:
    x = jnp.eye(16) * 0.5 - 0.1
    ws = [jnp.eye(16) * (0.1 + 0.2 * k) - 0.02 * k for k in range(4)]
    assert_like_jit(relu_members, (x, ws), target, **options)
    if target == "gpu" and not options:
        # In XLA's default CUDA-graph mode (lhs), where each saved launch is worth a kernel
        # launch; in a concurrent graph the members already overlap and stay apart.
        # One matmul per member is batch_matmuls's (batch_branches leaves it to it).
        found = decisions(relu_members, (x, ws), "gpu", command_buffers="lhs")
        batched = [d for d in found if d.kind in (DecisionKind.BATCHED_SUBGRAPHS,
                                                  DecisionKind.BATCHED_MATMULS)]
        assert batched and all(len(d.eqns) == 4 for d in batched), found


def test_relu_rule_is_checked_not_refused() -> None:
    from jaxpar.passes import _batchable

    closed = jax.make_jaxpr(jax.nn.relu)(jnp.ones(4))
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "custom_jvp_call"]
    assert _batchable.equation_refusal(eqn, [True]) is None
    assert _batchable.merge_refusal(eqn) is None
    closed = jax.make_jaxpr(noisy_sin)(jnp.ones(4))
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "custom_jvp_call"]
    assert "rbg" in (_batchable.equation_refusal(eqn, [True]) or "")
