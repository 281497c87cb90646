"""bound_fusions: what XLA compiles of chains over batched members' results.

What it must do: after the batching passes slice members' results out, on target
"gpu" a sum over consecutive members of one batch is one reduction over the stacked
array (values to float rounding, integers exact, half precision and other targets left
to barriers); elsewhere no elementwise chain reads more than ``MAX_FUSED_SLICES`` of
those slices between barriers, with values and derivatives those of the batched
program without barriers, bit for bit; a user's own slices are never touched; a second
run changes nothing; the plan reports it.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.environment import needs_plugin

import jaxpar
from jaxpar.passes import DecisionKind, bound_fusions, run_passes
from jaxpar.passes.bound_fusions import MAX_FUSED_SLICES, MIN_REDUCED_MEMBERS

MEMBERS = 80  # three batches of the batching passes, 80 slices into one sum


def _summed(xs, ws):
    return sum(jnp.tanh(x @ w) for x, w in zip(xs, ws, strict=True))


def _maxed(xs, ws):  # a chain no reduction replaces: barriers on every target
    return functools.reduce(jnp.maximum, [jnp.tanh(x @ w) for x, w in zip(xs, ws, strict=True)])


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


@pytest.mark.parametrize("fn, target", [(_summed, "cpu"), (_maxed, "gpu")])
def test_a_chain_over_many_members_reads_at_most_the_bound_between_barriers(fn, target):
    closed = jax.make_jaxpr(fn)(*_args())
    unbounded, _ = run_passes(closed, ["batch_branches", "batch_matmuls"], target=target,
                              batch_branches=True, batch_matmuls=True)
    assert _barriers(unbounded) == 0
    assert _most_slices_between_barriers(unbounded) == MEMBERS  # the chain it bounds
    bounded, decisions = bound_fusions(closed, target=target)
    assert 0 < _barriers(bounded) <= MEMBERS // MAX_FUSED_SLICES + 1
    assert _most_slices_between_barriers(bounded) <= MAX_FUSED_SLICES
    made = [d for d in decisions if d.kind == DecisionKind.FUSIONS_BOUNDED]
    assert len(made) == 1 and made[0].pass_name == "bound_fusions"
    assert f"{MEMBERS} member results" in made[0].reason
    assert not [d for d in decisions if d.kind == DecisionKind.SUMS_REDUCED]
    # A barrier is the identity: the same numbers as the batched program without one.
    np.testing.assert_array_equal(_run(bounded), _run(unbounded))


def _run(closed, args=None):
    leaves = jax.tree.leaves(_args() if args is None else args)
    return np.asarray(jax.jit(jax.extend.core.jaxpr_as_fun(closed))(*leaves)[0])


def _count(closed, primitive):
    return sum(e.primitive.name == primitive for e in closed.jaxpr.eqns)


def test_a_sum_over_batched_members_is_one_reduction_per_batch_on_gpu():
    closed = jax.make_jaxpr(_summed)(*_args())
    unbounded, batched = run_passes(closed, ["batch_branches", "batch_matmuls"], target="gpu")
    batches = len([d for d in batched if d.kind == DecisionKind.BATCHED_SUBGRAPHS])
    assert batches == 3  # 80 members in batches of at most MAX_FUSED_SLICES
    reduced, decisions = bound_fusions(closed)
    assert _count(reduced, "slice") == 0 and _barriers(reduced) == 0
    assert _count(reduced, "reduce_sum") == batches
    made = [d for d in decisions if d.kind == DecisionKind.SUMS_REDUCED]
    assert len(made) == 1 and made[0].pass_name == "bound_fusions"
    assert len(made[0].members) == batches and f"{MEMBERS} member results" in made[0].reason
    # A reordered float32 sum: float rounding from the batched program and jax.jit's.
    np.testing.assert_allclose(_run(reduced), _run(unbounded), rtol=1e-5, atol=1e-5)
    want = jax.jit(_summed)(*_args())
    np.testing.assert_allclose(_run(reduced), want, rtol=1e-5, atol=1e-5)


def test_an_integer_sum_is_reduced_and_exact():
    def summed(xs, ws):
        return sum(x @ w + 3 for x, w in zip(xs, ws, strict=True))

    xs = [jnp.full((4, 8), i % 7 - 3, jnp.int32) for i in range(MEMBERS)]
    ws = [jnp.full((8, 8), i % 5 - 2, jnp.int32) for i in range(MEMBERS)]
    reduced, decisions = bound_fusions(jax.make_jaxpr(summed)(xs, ws))
    assert any(d.kind == DecisionKind.SUMS_REDUCED for d in decisions)
    got = _run(reduced, (xs, ws))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, jax.jit(summed)(xs, ws))


def test_half_precision_and_the_cpu_target_keep_the_chain():
    xs, ws = _args()
    half = ([x.astype(jnp.bfloat16) for x in xs], [w.astype(jnp.bfloat16) for w in ws])
    for args, target in ((half, "gpu"), ((xs, ws), "cpu")):
        closed = jax.make_jaxpr(_summed)(*args)
        unbounded, _ = run_passes(closed, ["batch_branches", "batch_matmuls"], target=target,
                                  batch_branches=True, batch_matmuls=True)
        bounded, decisions = bound_fusions(closed, target=target)
        assert not [d for d in decisions if d.kind == DecisionKind.SUMS_REDUCED], target
        assert _count(bounded, "reduce_sum") == 0 and _barriers(bounded) > 0
        np.testing.assert_array_equal(_run(bounded, args), _run(unbounded, args))


def test_a_partial_sum_read_elsewhere_ends_a_run_and_short_runs_are_left():
    def two_sums(xs, ws):
        outs = [jnp.tanh(x @ w) for x, w in zip(xs, ws, strict=True)]
        head = outs[0] + outs[1] + outs[2]  # read below and returned: a run of 3
        return sum(outs[3:], head), head, outs[5] * 2  # outs[5] read twice: left out

    args = _args()
    reduced, decisions = bound_fusions(jax.make_jaxpr(two_sums)(*args))
    made = [d for d in decisions if d.kind == DecisionKind.SUMS_REDUCED]
    # Runs: rows 0-2 (head) and 3-4 are shorter than MIN_REDUCED_MEMBERS and stay
    # adds; rows 6-26 of the first batch and the two other batches are reduced.
    assert len(made) == 1 and [len(m) for m in made[0].members] == [3 * 21, 3 * 27, 3 * 26]
    leaves = jax.tree.leaves(args)
    got = jax.jit(jax.extend.core.jaxpr_as_fun(reduced))(*leaves)
    for g, w in zip(got, jax.jit(two_sums)(*args), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    rows = [e.outvars[0].aval.shape[0] for e in reduced.jaxpr.eqns if e.primitive.name == "slice"]
    assert sorted(rows) == [1] * 6 + [21]


def test_members_summed_in_reverse_are_reduced_and_every_other_one_is_not():
    def reversed_sum(xs, ws):
        return sum(reversed([jnp.tanh(x @ w) for x, w in zip(xs, ws, strict=True)]))

    def evens(xs, ws):  # rows 0, 2, 4, ... of each batch: no consecutive run
        outs = [jnp.tanh(x @ w) for x, w in zip(xs, ws, strict=True)]
        return sum(outs[::2]), outs[1::2]

    args = _args()
    for fn, runs in ((reversed_sum, 3), (evens, 0)):
        reduced, decisions = bound_fusions(jax.make_jaxpr(fn)(*args))
        made = [d for d in decisions if d.kind == DecisionKind.SUMS_REDUCED]
        assert sum(len(d.members) for d in made) == runs, fn.__name__
        got = jax.jit(jax.extend.core.jaxpr_as_fun(reduced))(*jax.tree.leaves(args))
        for g, w in zip(got, jax.tree.leaves(jax.jit(fn)(*args)), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_a_second_run_changes_nothing():
    for fn, target in ((_summed, "cpu"), (_summed, "gpu"), (_maxed, "gpu")):
        bounded, _ = bound_fusions(jax.make_jaxpr(fn)(*_args()), target=target)
        again, decisions = bound_fusions(bounded, target=target)
        assert again is bounded
        assert not [d for d in decisions if d.kind in (DecisionKind.FUSIONS_BOUNDED,
                                                       DecisionKind.SUMS_REDUCED)]


def test_results_returned_apart_and_few_members_get_no_barrier():
    for fn, count in ((_listed, MEMBERS), (_maxed, MAX_FUSED_SLICES - 2)):
        bounded, decisions = bound_fusions(jax.make_jaxpr(fn)(*_args(count)))
        assert _barriers(bounded) == 0, fn.__name__
        assert not [d for d in decisions if d.kind == DecisionKind.FUSIONS_BOUNDED]


def test_a_users_own_slices_are_left_alone():
    def own(y):
        return sum(y[i] for i in range(MEMBERS))

    closed = jax.make_jaxpr(own)(jnp.ones((MEMBERS, 4, 8)))
    for target in ("gpu", "cpu"):
        bounded, decisions = bound_fusions(closed, target=target)
        assert bounded is closed and decisions == ()


@pytest.mark.parametrize("body", [_summed, _maxed])
def test_the_decorated_function_keeps_values_gradients_and_vmap(body):
    xs, ws = _args()
    fn = jaxpar.parallel_branches(body, target="gpu")
    tol = {"rtol": 1e-5, "atol": 1e-5}
    np.testing.assert_allclose(fn(xs, ws), jax.jit(body)(xs, ws), **tol)
    loss = lambda f: lambda xs, ws: f(xs, ws).sum()
    got = jax.grad(loss(fn), argnums=1)(xs, ws)
    want = jax.grad(loss(body), argnums=1)(xs, ws)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **tol)
    stacked = [jnp.stack([x, x * 0.5]) for x in xs]
    np.testing.assert_allclose(jax.vmap(fn, in_axes=(0, None))(stacked, ws),
                               jax.vmap(body, in_axes=(0, None))(stacked, ws), **tol)
    text = jax.jit(fn).lower(xs, ws).as_text()
    if body is _maxed:
        assert text.count("optimization_barrier") >= MEMBERS // MAX_FUSED_SLICES
    else:
        assert "optimization_barrier" not in text and "stablehlo.reduce" in text


@pytest.mark.parametrize("body, kind", [(_summed, DecisionKind.SUMS_REDUCED),
                                        (_maxed, DecisionKind.FUSIONS_BOUNDED)])
def test_inspect_reports_what_it_did(body, kind):
    plan = jaxpar.inspect(body, target="gpu")(*_args())
    assert any(d.kind == kind for d in plan.decisions)
    assert str(kind) in plan.text(verbose=True)
    if kind == DecisionKind.SUMS_REDUCED:  # its members are the runs it reduced
        line = next(x for x in plan.text(verbose=True).splitlines() if str(kind) in x)
        assert "(runs: 1) " in line and "; 3) " in line and "members:" not in line


@needs_plugin
def test_no_compiled_gpu_kernel_reads_more_than_the_bound():
    # Deviceless H200: each fusion of the max chain reads at most MAX_FUSED_SLICES slices
    # (without the pass, one fusion read all of them).
    from jaxpar._compiled import compile_for_gpu

    xs, ws = _args()
    hlo = compile_for_gpu(jaxpar.parallel_branches(_maxed, target="gpu"), xs, ws)
    bodies = re.split(r"\n(?=%?\S+ \{|\S+ \(.*\) -> .* \{)", hlo)
    slices = [body.count(" slice(") for body in bodies if "fused" in body.split("\n", 1)[0]]
    assert slices and max(slices) <= MAX_FUSED_SLICES
    assert sum(slices) >= MEMBERS - MEMBERS // MAX_FUSED_SLICES - 1


@needs_plugin
def test_the_compiled_gpu_sum_reads_no_slice():
    # Deviceless H200: the sum of 80 members is three reductions over the stacked
    # results, and XLA compiles no slice of them.
    from jaxpar._compiled import compile_for_gpu

    xs, ws = _args()
    hlo = compile_for_gpu(jaxpar.parallel_branches(_summed, target="gpu"), xs, ws)
    assert " slice(" not in hlo and " reduce(" in hlo


def test_short_sums_stay_adds_xla_fuses_with_their_readers():
    def quads(xs, ws):  # twenty sums of four members each, each scaled after
        outs = [jnp.tanh(x @ w) for x, w in zip(xs, ws, strict=True)]
        return [sum(outs[i:i + 4]) * 0.5 for i in range(0, MEMBERS, 4)]

    closed = jax.make_jaxpr(quads)(*_args())
    bounded, decisions = bound_fusions(closed)
    assert 4 < MIN_REDUCED_MEMBERS
    assert not [d for d in decisions if d.kind == DecisionKind.SUMS_REDUCED]
    assert _count(bounded, "reduce_sum") == 0
    unbounded, _ = run_passes(closed, ["batch_branches", "batch_matmuls"], target="gpu")
    np.testing.assert_array_equal(_run(bounded), _run(unbounded))


def test_reduced_sums_pass_jaxs_checker(monkeypatch):
    # JAXPAR_CHECKS=1: every level a pass rebuilds goes through JAX's jaxpr checker.
    from jaxpar.passes._walk import CHECKS_VARIABLE

    monkeypatch.setenv(CHECKS_VARIABLE, "1")
    for fn in (_summed, _maxed):
        rewritten, decisions = bound_fusions(jax.make_jaxpr(fn)(*_args()))
        assert rewritten.jaxpr.eqns and decisions
    jax.extend.core.check_jaxpr(rewritten.jaxpr)
