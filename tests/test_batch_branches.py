"""Tests of the subgraph batching pass (``jaxpar.passes.batch_branches``; option
and function ``batch_branches``).

Identical independent straight-line subgraphs (ensemble members) become one ``vmap``ped
subgraph. Each rewrite goes through ``check_pass`` (tests/pass_checker.py): structure
(batched ``dot_general``s, stacked and shared inputs), input not mutated, well-formedness,
values, gradients and idempotence; the decisions are checked where the pass must leave
subgraphs alone; and the deviceless H200 compile shows fewer matmul kernels.
"""

from __future__ import annotations

import importlib
import itertools
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.environment import needs_plugin
from jax import lax
from pass_checker import PassResult, assert_matches, check_pass, eqns_of

import jaxpar
from jaxpar import _compat
from jaxpar.passes import DecisionKind, batch_branches

batch_branches_module = importlib.import_module("jaxpar.passes.batch_branches")


# vmap turns the members' matmuls into one batched dot_general: XLA may sum in another order.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def mlp(params: list[tuple[jax.Array, jax.Array]], x: jax.Array) -> jax.Array:
    for w, b in params[:-1]:
        x = jax.nn.gelu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def ensemble(members: list[Any], x: jax.Array) -> jax.Array:
    return jnp.mean(jnp.stack([mlp(p, x) for p in members]), axis=0)


def make_members(widths: tuple[int, ...], features: int = 64, outputs: int = 10
                 ) -> list[Any]:
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 3 * len(widths)))
    members = []
    for width in widths:
        sizes = [features, width, width, outputs]
        members.append([(jax.random.normal(next(keys), (m, n)) / np.sqrt(m), jnp.full(n, 0.1))
                        for m, n in itertools.pairwise(sizes)])
    return members


def ensemble_args(widths: tuple[int, ...] = (128, 128, 128, 128)) -> tuple[Any, jax.Array]:
    return make_members(widths), jax.random.normal(jax.random.PRNGKey(1), (32, 64))


def dots(jaxpr: Any) -> list[Any]:
    return [e for e in eqns_of(jaxpr) if e.primitive.name == "dot_general"]


def batched(dot: Any) -> bool:
    (_, _), (lhs_batch, _) = dot.params["dimension_numbers"]
    return bool(lhs_batch)


batch_for_gpu = partial(batch_branches, target="gpu")


def check(program: Any, *args: Any, **checks: Any) -> PassResult:
    """``check_pass`` of ``batch_branches`` at this file's tolerances."""
    return check_pass(batch_for_gpu, program, *args, tolerance=TOLERANCE,
                      grad_tolerance=GRAD_TOLERANCE, **checks)


def assert_left_alone_once(f: Any, args: tuple[Any, ...], why: str) -> None:
    """The pass changes nothing in ``f`` and says so once, with ``why`` in the reason."""
    result = check(f, *args, unchanged=True, kinds=[DecisionKind.SUBGRAPHS_LEFT_ALONE])
    assert why in result.decisions[0].reason


# --- the pass ---------------------------------------------------------------------------------


def test_ensemble_members_become_one_vmapped_member() -> None:
    def three_batched_matmuls(r: PassResult) -> None:
        assert len(dots(r.closed)) == 12
        # Three batched matmuls instead of twelve; x is shared, so the first one reads it as
        # is.
        assert len(dots(r.new)) == 3 and all(batched(d) for d in dots(r.new)[1:])
        (made,) = r.decisions
        assert len(made.eqns) == 4 and made.primitives == ("add",) * 4
        assert "4 independent subgraphs" in made.reason
        assert "6 stacked and 1 shared" in made.reason
        assert "3 kernel launches instead of 12" in made.reason
        assert any("test_batch_branches.py" in s for s in made.sources)

    check(ensemble, *ensemble_args(), kinds=[DecisionKind.BATCHED_SUBGRAPHS],
          expect=three_batched_matmuls)


def test_members_of_different_widths_are_not_batched() -> None:
    check(ensemble, *ensemble_args((96, 128, 160)), unchanged=True, kinds=[])


def test_only_the_identical_members_are_batched() -> None:
    def three_of_four(r: PassResult) -> None:
        assert "3 independent subgraphs" in r.decisions[0].reason
        assert len(dots(r.new)) == 3 + 3  # the three batched, the odd member's own three

    # The larger grouping (each member with its share of the final stack, 28 equations) is
    # priced first and refused (its stacking costs a kernel per member); the 25 equations
    # before it are batched. The refusal is reported.
    check(ensemble, *ensemble_args((128, 128, 96, 128)),
          kinds=[DecisionKind.BATCHED_SUBGRAPHS, DecisionKind.SUBGRAPHS_LEFT_ALONE],
          expect=three_of_four)


def test_applying_twice_changes_nothing() -> None:
    # check_pass applies the pass to its output: the same object, and here no decision.
    result = check(ensemble, *ensemble_args(), values=False, grads=False)
    assert result.repeat_decisions == ()


def test_shared_intermediate_stays_outside_and_is_read_unstacked() -> None:
    def f(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
        h = jnp.tanh(x @ x)  # read by every member: computed once, passed to all
        return sum(jnp.tanh(jnp.tanh(h @ w) @ w) for w in ws)

    def one_stacked_slot(r: PassResult) -> None:
        assert "4 stacked" not in r.decisions[0].reason  # one weight per member: 1 slot
        assert "1 stacked and 1 shared" in r.decisions[0].reason
        assert len(dots(r.new)) == 1 + 2 and not batched(dots(r.new)[0])

    args = (jnp.eye(64) * 0.5, [jax.random.normal(jax.random.PRNGKey(i), (64, 64)) * 0.1
                                for i in range(4)])
    check(f, *args, kinds=[DecisionKind.BATCHED_SUBGRAPHS], expect=one_stacked_slot)


def test_intermediate_read_outside_the_members_is_returned_too() -> None:
    def f(x: jax.Array, ws: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
        hidden = [jnp.tanh(x @ w) for w in ws]
        outs = [jnp.tanh(jnp.tanh(h @ w) @ w) for h, w in zip(hidden, ws, strict=True)]
        return sum(outs), hidden[1] * 2.0  # a member's intermediate, read outside

    def shared_x_unbatched(r: PassResult) -> None:
        # x is shared, so the first matmul reads it unbatched (vmap moves the batch to the
        # weight's side); the other two are batched.
        assert len(dots(r.new)) == 3 and all(batched(d) for d in dots(r.new)[1:])

    args = (jnp.eye(32) * 0.5, [jax.random.normal(jax.random.PRNGKey(i), (32, 32)) * 0.2
                                for i in range(3)])
    check(f, *args, kinds=[DecisionKind.BATCHED_SUBGRAPHS], expect=shared_x_unbatched)


def test_cost_model_leaves_big_weights_unstacked() -> None:
    # One big matmul per member and a big weight each: stacking the weights copies more
    # bytes than one saved launch is worth.
    def f(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
        return sum(jnp.tanh(jnp.tanh(x @ w) @ w) for w in ws)

    args = (jax.ShapeDtypeStruct((8, 4096), jnp.float32),
            [jax.ShapeDtypeStruct((4096, 4096), jnp.float32)] * 2)
    assert_left_alone_once(f, args, "stacking their differing inputs costs more")


def test_members_at_different_stages_are_left_alone() -> None:
    # Two identical two-matmul chains on level inputs, but one feeds two more matmuls before
    # the output and the other does not: batching would hold the deep one's successors back.
    def f(a: jax.Array, b: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        first = jnp.tanh(jnp.tanh(a @ w) @ w)
        second = jnp.tanh(jnp.tanh(b @ w) @ w)
        return jnp.tanh(jnp.tanh(first @ w) @ w), second

    assert_left_alone_once(f, tuple(jnp.eye(32) * 0.3 for _ in range(3)), "different launch depths")


def test_long_chains_at_different_stages_are_reported_once_within_the_budget() -> None:
    # Every part of these chains is misaligned, so the pass retries ever smaller parts; the
    # alignment budget stops it after a few times the level's size, with one report.
    def f(a: jax.Array, b: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        for _ in range(150):
            a, b = jnp.tanh(a @ w), jnp.tanh(b @ w)
        return a, jnp.tanh(jnp.tanh(b @ w) @ w)

    args = tuple(jax.ShapeDtypeStruct((8, 8), jnp.float32) for _ in range(3))
    visited = []
    original = batch_branches_module._align

    def counting_align(*a: Any) -> Any:
        budget = a[-1]
        before = budget[0]
        try:
            return original(*a)
        finally:
            visited.append(before - budget[0])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batch_branches_module, "_align", counting_align)
        closed = check(f, *args, unchanged=True, kinds=[DecisionKind.SUBGRAPHS_LEFT_ALONE]).closed
    level = len(eqns_of(closed))
    assert sum(visited) <= batch_branches_module._ALIGN_BUDGET_PER_EQN * level + 2 * level


def test_members_inside_a_scan_body_are_batched() -> None:
    def f(h: jax.Array, ws: list[jax.Array]) -> jax.Array:
        def step(c: jax.Array, _: Any) -> tuple[jax.Array, None]:
            return sum(jnp.tanh(jnp.tanh(c @ w) @ w) for w in ws) * 0.25, None
        return lax.scan(step, h, None, length=3)[0]

    args = (jnp.eye(32) * 0.5, [jax.random.normal(jax.random.PRNGKey(i), (32, 32)) * 0.2
                                for i in range(4)])
    def batched_in_the_body(r: PassResult) -> None:
        assert [(d.kind, d.location) for d in r.decisions] == [(DecisionKind.BATCHED_SUBGRAPHS,
                                                                "/scan#0.jaxpr")]
        (scan,) = [e for e in eqns_of(r.new) if e.primitive.name == "scan"]
        body = _compat.scan_info(scan).jaxpr
        assert len(dots(body)) == 2 and batched(dots(body)[1])

    check(f, *args, expect=batched_in_the_body)


def test_effects_and_user_placement_are_never_batched() -> None:
    def f(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
        outs = []
        for w in ws:
            y = jnp.tanh(jnp.tanh(x @ w) @ w)
            jax.debug.print("{}", y[0, 0])  # an effect on every member
            outs.append(y)
        return sum(outs)

    args = (jnp.eye(16), [jnp.eye(16) * 0.5] * 3)
    def prints_stay_in_order(r: PassResult) -> None:
        # The members' matmuls (and the slices the prints read) are batched; the prints are
        # not, and stay three, in their order.
        names = [e.primitive.name for e in eqns_of(r.new)]
        assert sum("debug" in n for n in names) == 3 and len(dots(r.new)) == 2
        assert [e.params for e in eqns_of(r.new) if "debug" in e.primitive.name] == [
            e.params for e in eqns_of(r.closed) if "debug" in e.primitive.name]

    # The values are not compared: the prints would print.
    check(f, *args, kinds=[DecisionKind.BATCHED_SUBGRAPHS], expect=prints_stay_in_order,
          values=False, grads=False)

    def placed(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
        return sum(jaxpar.on_stream(k + 1)(lambda v, w=w: jnp.tanh(jnp.tanh(v @ w) @ w))(x)
                   for k, w in enumerate(ws))

    check(placed, *args, unchanged=True, kinds=[])


def test_contractible_rejects_a_path_that_leaves_and_comes_back() -> None:
    # 0 -> 1 -> 2 and 0 -> 2: {0, 2} cannot be one unit (1 sits between), {0, 1} can.
    graph = batch_branches_module.Graph(preds=((), (0,), (0, 1)), succs=((1, 2), (2,), ()),
                                        feeds_output=frozenset({2}),
                                        live=frozenset({0, 1, 2}))
    assert not batch_branches_module._contractible(graph, {0, 2})
    assert batch_branches_module._contractible(graph, {0, 1})


# --- through parallel_branches -----------------------------------------------------------------


def test_parallel_branches_batches_identical_members_on_gpu_only() -> None:
    args = ensemble_args()
    want = jax.jit(ensemble)(*args)
    # XLA's default CUDA-graph mode (lhs): a concurrent graph overlaps the members instead.
    fast = jaxpar.parallel_branches(ensemble, target="gpu", command_buffers="lhs")
    plan = jaxpar.inspect(fast)(*args)
    assert [d.kind for d in plan.decisions] == [DecisionKind.BATCHED_SUBGRAPHS]
    assert "subgraphs:" in str(plan) and plan.to_dict()["decisions"][0]["kind"] == \
        DecisionKind.BATCHED_SUBGRAPHS
    assert_matches(fast(*args), want, tolerance=TOLERANCE)
    got = jax.grad(lambda m: jnp.sum(fast(m, args[1]) ** 2))(args[0])
    expected = jax.grad(lambda m: jnp.sum(ensemble(m, args[1]) ** 2))(args[0])
    assert_matches(got, expected, tolerance=GRAD_TOLERANCE)
    # vmap over a batch of inputs, and jit around it.
    xs = jnp.stack([args[1], -args[1]])
    assert_matches(jax.jit(jax.vmap(fast, in_axes=(None, 0)))(args[0], xs),
                   jax.vmap(ensemble, in_axes=(None, 0))(args[0], xs), tolerance=TOLERANCE)
    # Off on the CPU by default, and off when asked.
    assert jaxpar.inspect(ensemble, target="cpu")(*args).decisions == ()
    assert jaxpar.inspect(ensemble, target="gpu", batch_branches=False,
                          batch_matmuls=False)(*args).decisions == ()


def test_bad_batch_branches_option_names_it() -> None:
    with pytest.raises(ValueError, match="batch_branches must be True, False or 'auto'"):
        jaxpar.parallel_branches(ensemble, batch_branches="yes")


@needs_plugin
def test_h200_compile_launches_fewer_matmul_kernels() -> None:
    members, x = ensemble_args()
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (members, x))
    # In XLA's default CUDA-graph mode (lhs); in a concurrent graph the members overlap
    # unbatched (tests/test_gpu_guard.py checks that configuration).
    preview = jaxpar.gpu_preview(jaxpar.parallel_branches(ensemble, command_buffers="lhs"),
                                 *specs)
    # Plain: XLA's dot merger joins the four first-layer matmuls (they share x), 9 remain.
    assert preview.plain.matmul_kernels == 9
    assert preview.jaxpar.matmul_kernels == 3
    assert preview.jaxpar.kernels < preview.plain.kernels
    assert "matmul kernels" in str(preview)


def test_numbering_carried_from_an_earlier_round_finds_what_a_fresh_one_finds() -> None:
    """A level rebuilt by one of two rewrites keeps the other group's equations as they
    were (their records' reads unchanged) and renumbers the kept equations below the
    rewritten group (reads changed); literals, an effect and a primitive vmap refuses
    take the slow path. The numbering carried from
    the first round must split the equations into the same classes of equal numbers,
    and give the same rewrites (equations, which keys are equal) and decisions, as a
    fresh numbering."""
    from jaxpar._memo import IdentityMemo
    from jaxpar._model.cost import CostModel
    from jaxpar._program.graph import build_graph
    from jaxpar._program.structure import StructuralKeys
    from jaxpar.passes._protocol import Level
    from jaxpar.passes._splice import rebuild_level
    from jaxpar.targets import device_profile

    def f(xs: list[jax.Array], ys: list[jax.Array], w: jax.Array, v: jax.Array) -> Any:
        a = [jnp.tanh(jnp.tanh(x @ w) * 2.0 @ w) for x in xs]
        b = [jnp.tanh(jnp.tanh(y @ v) @ v) + 1.0 for y in ys]
        jax.debug.print("{}", a[0].sum())
        # Equal while the members are unbatched; reading different members' slices after
        # (so rebuilt), and the tanh of each kept, with its reads renumbered.
        crossed = [jnp.tanh(t) for t in [b[0] @ b[1], b[1] @ b[2], b[2] @ b[0]]]
        c = [jnp.linalg.cholesky(t @ t.T) for t in b]  # never batched: not on the vmap list
        return [t.sum() + 1.0 for t in a], c, crossed

    spec = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    closed = jax.make_jaxpr(f)([spec] * 4, [spec] * 3, spec, spec)
    costs = CostModel(device_profile("gpu"))

    def state() -> dict[str, Any]:
        return {"memo": IdentityMemo(), "keys": StructuralKeys(), "orders": IdentityMemo()}

    def numbered(jaxpr: Any, carried: Any, state: dict[str, Any]) -> Any:
        inner = _compat.open_jaxpr(jaxpr)[0]
        level = Level(jaxpr, "", build_graph(inner))
        keys, _ = batch_branches_module._value_numbers(
            inner, batch_branches_module._producers(inner.eqns), level.graph, state["memo"],
            state["keys"], {}, carried)
        first: dict[int, int] = {}
        classes = [None if k is None else first.setdefault(k, i) for i, k in enumerate(keys)]
        rewrites, decisions, alike = batch_branches_module._batch_level(
            level, costs, state["memo"], state["keys"], state["orders"], None, carried)
        equal = [[r.key == s.key for s in rewrites] for r in rewrites]
        return rewrites, (classes, [r.eqns for r in rewrites], equal, decisions, alike)

    carried, kept = batch_branches_module._Numbering(), state()
    rewrites, _ = numbered(closed, carried, kept)
    assert len(rewrites) == 2  # the xs group and the ys group
    ys_group = max(rewrites, key=lambda r: min(r.eqns))  # traced after the xs members
    rebuilt = rebuild_level(closed, [ys_group])
    assert rebuilt is not None
    old = {id(e) for e in _compat.open_jaxpr(closed)[0].eqns}
    assert sum(id(e) in old for e in _compat.open_jaxpr(rebuilt)[0].eqns) > 10
    _, again = numbered(rebuilt, carried, kept)
    _, fresh = numbered(rebuilt, batch_branches_module._Numbering(), state())
    assert again == fresh
    assert len(again[1]) == 1  # the xs group, still found


def _gru_gates(ws: tuple[jax.Array, ...], xs: jax.Array) -> jax.Array:
    """Flax's ``GRUCell`` shape: three ``h @ w`` of one shape per trip (reset, update,
    candidate), each through its own activation."""
    w_r, w_z, w_n = ws

    def cell(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        r = jax.nn.sigmoid(x + h @ w_r)
        z = jax.nn.sigmoid(x + h @ w_z)
        n = jnp.tanh(x + r * (h @ w_n))
        h = (1 - z) * n + z * h
        return h, h

    return lax.scan(cell, jnp.zeros((xs.shape[1], w_r.shape[0])), xs)[1]


def _gru_gates_args(steps: int = 32, batch: int = 8, width: int = 64) -> Any:
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    ws = tuple(0.2 * jax.random.normal(k, (width, width)) for k in keys[:3])
    return ws, jax.random.normal(keys[3], (steps, batch, width))


def test_one_matmul_per_member_is_left_to_batch_matmuls() -> None:
    """Groups of one matmul per member are ``batch_matmuls``'s to weigh (it orients the
    operands and prices the transposes a vmapped dot may need): this pass leaves them."""
    check_pass(partial(batch_branches, target="gpu"), _gru_gates, *_gru_gates_args(),
               unchanged=True, kinds=[])


@needs_plugin
def test_flax_gru_launches_no_more_than_plain_jit() -> None:
    """Flax's ``nn.RNN(nn.GRUCell)`` under the default plan, compiled deviceless for an
    H200: no more kernel launches than plain ``jax.jit`` (its three ``h @ w`` batched as one
    vmapped matmul here launched 261 against plain's 197)."""
    import flax.linen as nn
    from helpers.benchmarks import hetero_batch_benchmark

    class Model(nn.Module):
        @nn.compact
        def __call__(self, xs: jax.Array) -> jax.Array:
            return nn.RNN(nn.GRUCell(64))(xs)

    xs = jnp.ones((8, 32, 64))
    model = Model()
    params = model.init(jax.random.PRNGKey(0), xs)

    def apply(p: Any, x: jax.Array) -> jax.Array:
        return model.apply(p, x)  # type: ignore[return-value]

    bench = hetero_batch_benchmark()  # its launch counter, from the benchmarks
    plain = bench.count(apply, (params, xs))
    tuned = bench.count(jaxpar.parallel_branches(apply, target="gpu"), (params, xs))
    assert plain["launches"] > 0
    assert tuned["launches"] <= plain["launches"], (tuned, plain)


# --- compile time: many members -----------------------------------------------------------------


def many_members(count: int, consumer: str) -> tuple[Any, tuple[list[Any], list[Any]]]:
    """``count`` members of two matmuls each, their results summed or returned."""
    def f(xs: list[Any], ws: list[Any]) -> Any:
        outs = [jnp.tanh(jnp.tanh(x @ w) @ w) for x, w in zip(xs, ws, strict=True)]
        return sum(outs) if consumer == "sum" else outs
    keys = jax.random.split(jax.random.PRNGKey(3), 2 * count)
    xs = [jax.random.normal(keys[2 * m], (2, 4)) for m in range(count)]
    ws = [jax.random.normal(keys[2 * m + 1], (4, 4)) / 2 for m in range(count)]
    return f, (xs, ws)


def slice_kinds(jaxpr: Any) -> set[Any]:
    """The distinct slices of a jaxpr (what XLA compiles a kernel for each of)."""
    return {(e.invars[0].aval, tuple(e.params["start_indices"]))
            for e in eqns_of(jaxpr) if e.primitive.name == "slice"}


@pytest.mark.parametrize("consumer", ["sum", "outputs"])
def test_many_members_are_batched_in_bounded_batches(consumer: str) -> None:
    """1,000 members: every vmapped batch takes at most MAX_BATCH_MEMBERS of them, so the
    distinct slices and stackings XLA compiles stay bounded (not one per member, which
    took XLA 155 s against plain jax.jit's 4.3 s, deviceless H200). Checked on the jaxpr."""
    limit = importlib.import_module("jaxpar.passes._batch_members").MAX_BATCH_MEMBERS
    f, (xs, ws) = many_members(1000, consumer)
    spec = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (xs, ws))
    closed = jax.make_jaxpr(f)(*spec)
    new, decisions = batch_for_gpu(closed)
    assert len(decisions) == -(-1000 // limit)  # 32 batches of 31 or 32 members
    assert {d.kind for d in decisions} == {DecisionKind.BATCHED_SUBGRAPHS}
    batch_sizes = {d.invars[0].aval.shape[0] for d in dots(new)}
    assert batch_sizes <= {31, 32} and len(dots(new)) == 2 * len(decisions)
    stacks = [e for e in eqns_of(new) if e.primitive.name in ("stack", "concatenate")]
    assert all(len(e.invars) <= limit for e in stacks)
    assert len(slice_kinds(new)) <= 2 * limit  # offsets 0..31 of two batch sizes at most


@pytest.mark.parametrize("consumer", ["sum", "outputs"])
def test_many_members_compute_what_jax_jit_does(consumer: str) -> None:
    """70 members (three batches): the values of plain jax.jit, to float rounding on
    target gpu and exactly on target cpu (which leaves the program as it is)."""
    f, args = many_members(70, consumer)
    result = check(f, *args, grads=False, kinds=[DecisionKind.BATCHED_SUBGRAPHS] * 3)
    assert {d.shape[0] for d in (e.invars[0].aval for e in dots(result.new))} == {23, 24}
    want = jax.jit(f)(*args)
    np.testing.assert_array_equal(
        np.asarray(jax.tree_util.tree_leaves(jaxpar.parallel_branches(f, target="cpu")(*args))),
        np.asarray(jax.tree_util.tree_leaves(want)))


def test_many_single_matmul_members_are_batched_in_bounded_batches() -> None:
    """batch_matmuls likewise: 1,000 members ``tanh(x @ w)`` summed become batched dots
    of at most MAX_BATCH_MEMBERS members (returned as a list, their tails would each be
    a kernel of their own: test_batch_matmuls.test_tails_returned_apart_are_left_alone)."""
    limit = importlib.import_module("jaxpar.passes._batch_members").MAX_BATCH_MEMBERS
    spec = ([jax.ShapeDtypeStruct((8, 16), jnp.float32)] * 1000,
            [jax.ShapeDtypeStruct((16, 16), jnp.float32)] * 1000)
    closed = jax.make_jaxpr(lambda xs, ws: sum(jnp.tanh(x @ w) for x, w in zip(xs, ws, strict=True))
                            )(*spec)
    new, decisions = jaxpar.passes.batch_matmuls(closed, target="gpu")
    assert decisions and all(d.kind == DecisionKind.BATCHED_MATMULS for d in decisions)
    assert {d.invars[0].aval.shape[0] for d in dots(new)} <= {31, 32}
    assert len(slice_kinds(new)) <= 2 * limit
