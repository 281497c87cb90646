"""bound_fusions: barriers on chains over batched members' results (issue 32, compile time).

What it must do: after the batching passes slice members' results out, no elementwise
chain reads more than ``MAX_FUSED_SLICES`` of those slices between barriers; values and
derivatives are those of the batched program without barriers, bit for bit; a user's
own slices are never touched; a second run changes nothing; the plan reports it.
"""

from __future__ import annotations

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from helpers import needs_plugin

import jaxpar
from jaxpar.passes import DecisionKind, bound_fusions, run_passes
from jaxpar.passes.bound_fusions import MAX_FUSED_SLICES

MEMBERS = 80  # three batches of the batching passes, 80 slices into one sum


def _summed(xs, ws):
    return sum(jnp.tanh(x @ w) for x, w in zip(xs, ws, strict=True))


def _listed(xs, ws):
    return [jnp.tanh(x @ w) for x, w in zip(xs, ws, strict=True)]


def _args(count=MEMBERS):
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * count)
    xs = [jax.random.normal(k, (4, 8)) for k in keys[:count]]
    ws = [jax.random.normal(k, (8, 8)) * 0.3 for k in keys[count:]]
    return xs, ws


def _barriers(closed):
    return sum(e.primitive.name == "optimization_barrier" for e in closed.jaxpr.eqns)


def _most_slices_between_barriers(closed):
    """The most slices any value has read through elementwise work since a barrier
    (the program's own code slices nothing, so every slice is the passes')."""
    count, most = {}, 0
    for eqn in closed.jaxpr.eqns:
        name = eqn.primitive.name
        if name == "slice":
            read = 1
        elif name in ("optimization_barrier", "dot_general", "concatenate", "stack"):
            continue
        else:
            read = sum(count.get(v, 0) for v in eqn.invars
                       if not isinstance(v, jax.extend.core.Literal))
        for v in eqn.outvars:
            count[v] = read
        most = max(most, read)
    return most


def test_a_sum_over_many_members_reads_at_most_the_bound_between_barriers():
    closed = jax.make_jaxpr(_summed)(*_args())
    unbounded, _ = run_passes(closed, ["batch_branches", "batch_matmuls"], target="gpu")
    assert _barriers(unbounded) == 0
    assert _most_slices_between_barriers(unbounded) == MEMBERS  # the chain it bounds
    bounded, decisions = bound_fusions(closed)
    assert 0 < _barriers(bounded) <= MEMBERS // MAX_FUSED_SLICES + 1
    assert _most_slices_between_barriers(bounded) <= MAX_FUSED_SLICES
    made = [d for d in decisions if d.kind == DecisionKind.FUSIONS_BOUNDED]
    assert len(made) == 1 and made[0].pass_name == "bound_fusions"
    assert f"{MEMBERS} member results" in made[0].reason
    # A barrier is the identity: the same numbers as the batched program without one.
    run = lambda c: jax.jit(jax.extend.core.jaxpr_as_fun(c))(*jax.tree.leaves(_args()))[0]
    np.testing.assert_array_equal(np.asarray(run(bounded)), np.asarray(run(unbounded)))


def test_a_second_run_changes_nothing():
    bounded, _ = bound_fusions(jax.make_jaxpr(_summed)(*_args()))
    again, decisions = bound_fusions(bounded)
    assert again is bounded
    assert not [d for d in decisions if d.kind == DecisionKind.FUSIONS_BOUNDED]


def test_results_returned_apart_and_few_members_get_no_barrier():
    for fn, count in ((_listed, MEMBERS), (_summed, MAX_FUSED_SLICES - 2)):
        bounded, decisions = bound_fusions(jax.make_jaxpr(fn)(*_args(count)))
        assert _barriers(bounded) == 0, fn.__name__
        assert not [d for d in decisions if d.kind == DecisionKind.FUSIONS_BOUNDED]


def test_a_users_own_slices_are_left_alone():
    def own(y):
        return sum(y[i] for i in range(MEMBERS))

    closed = jax.make_jaxpr(own)(jnp.ones((MEMBERS, 4, 8)))
    bounded, decisions = bound_fusions(closed)
    assert bounded is closed and decisions == ()


def test_the_decorated_function_keeps_values_gradients_and_vmap():
    xs, ws = _args()
    fn = jaxpar.parallel_branches(_summed, target="gpu")
    tol = {"rtol": 1e-5, "atol": 1e-5}
    np.testing.assert_allclose(fn(xs, ws), jax.jit(_summed)(xs, ws), **tol)
    loss = lambda f: lambda xs, ws: f(xs, ws).sum()
    got = jax.grad(loss(fn), argnums=1)(xs, ws)
    want = jax.grad(loss(_summed), argnums=1)(xs, ws)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **tol)
    stacked = [jnp.stack([x, x * 0.5]) for x in xs]
    np.testing.assert_allclose(jax.vmap(fn, in_axes=(0, None))(stacked, ws),
                               jax.vmap(_summed, in_axes=(0, None))(stacked, ws), **tol)
    text = jax.jit(fn).lower(xs, ws).as_text()
    assert text.count("optimization_barrier") >= MEMBERS // MAX_FUSED_SLICES


def test_inspect_reports_the_barriers():
    plan = jaxpar.inspect(_summed, target="gpu")(*_args())
    assert any(d.kind == DecisionKind.FUSIONS_BOUNDED for d in plan.decisions)
    assert "fusions bounded" in plan.text(verbose=True)


@needs_plugin
def test_no_compiled_gpu_kernel_reads_more_than_the_bound():
    # Deviceless H200: each fusion of the sum reads at most MAX_FUSED_SLICES slices
    # (without the pass, one fusion read all of them).
    from jaxpar._compiled import compile_for_gpu

    xs, ws = _args()
    hlo = compile_for_gpu(jaxpar.parallel_branches(_summed, target="gpu"), xs, ws)
    bodies = re.split(r"\n(?=%?\S+ \{|\S+ \(.*\) -> .* \{)", hlo)
    slices = [body.count(" slice(") for body in bodies if "fused" in body.split("\n", 1)[0]]
    assert slices and max(slices) <= MAX_FUSED_SLICES
    assert sum(slices) >= MEMBERS - MEMBERS // MAX_FUSED_SLICES - 1
