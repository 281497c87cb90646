"""Tests of the loop passes (jaxpar.passes): fusion, batching, unrolling, static loops.

Each rewrite goes through ``check_pass`` (tests/pass_checker.py): the input is not mutated,
the new jaxpr is well formed, it has the intended structure (the ``expect`` predicates
here), it computes the same values and gradients as the program, and the pass applied to
its output changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.environment import needs_plugin
from jax import lax
from pass_checker import (
    PassResult,
    as_function,
    assert_matches,
    assert_same_outputs,
    check_pass,
    eqns_of,
    kinds,
    primitives,
    scalar_loss,
)

import jaxpar
from jaxpar import _compat
from jaxpar._model.cost import CostModel
from jaxpar.passes import (
    apply_passes,
    batch_scans,
    fuse_scans,
    make_loops_static,
    pass_defaults,
    unroll_scans,
)
from jaxpar.passes._loop_candidates import MAX_UNROLLED_EQNS
from jaxpar.targets import device_profile

ALL_ON = {"fuse_scans": True, "batch_scans": True, "unroll": None, "target": "gpu"}


# --- helpers -------------------------------------------------------------------------------

# Values within 1e-6: fusing and batching only reorder loops; XLA may fuse differently.
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}


def scans(jaxpr: Any) -> list[Any]:
    return [e for e in eqns_of(jaxpr) if e.primitive.name == "scan"]


def check(pass_fn: Callable[..., Any], program: Any, *args: Any, **checks: Any) -> PassResult:
    """``check_pass`` at this file's value tolerance, unless ``checks`` names another."""
    return check_pass(pass_fn, program, *args, **{"tolerance": TOLERANCE, **checks})


def loop_passes(**options: Any) -> Callable[[Any], Any]:
    return partial(apply_passes, **options)


# Unrolling changes how XLA fuses the body, so float32 rounding differs over 1000 trips; the
# float32 gradients themselves are off by up to ~1e-3 relative from float64 (checked with x64;
# in float64 the two agree to 1e-13).
LONG_SCAN_GRAD_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}


# --- programs --------------------------------------------------------------------------------


def body_matmuls(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return carry + 1e-2 * (x @ x @ x), jnp.sum(carry)


def body_tanh(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return 0.5 * carry + 0.5 * jnp.tanh(x @ carry), None


def seed_args(n: int = 100, steps: int = 200, steps2: int | None = None) -> tuple[jax.Array, ...]:
    k = jax.random.split(jax.random.PRNGKey(2), 4)
    return (jax.random.normal(k[0], (n, n)) / n, jax.random.normal(k[1], (n, n)) / n,
            jax.random.normal(k[2], (steps, n, n)) / n,
            jax.random.normal(k[3], (steps2 or steps, n, n)) / n)


def seed_different(c1: jax.Array, c2: jax.Array, xs1: jax.Array, xs2: jax.Array) -> Any:
    return lax.scan(body_matmuls, c1, xs1), lax.scan(body_tanh, c2, xs2)[0]


def seed_identical(c1: jax.Array, c2: jax.Array, xs1: jax.Array, xs2: jax.Array) -> Any:
    return lax.scan(body_matmuls, c1, xs1), lax.scan(body_matmuls, c2, xs2)


def bidirectional(h: jax.Array, _: jax.Array, xs: jax.Array, __: jax.Array) -> Any:
    forward = lax.scan(body_tanh, h, xs)[0]
    backward = lax.scan(body_matmuls, h, xs, reverse=True)
    return forward, backward


# --- fusion ----------------------------------------------------------------------------------


def test_seed_002_different_bodies_fuse_into_one_scan() -> None:
    def fused_once(r: PassResult) -> None:
        assert len(scans(r.closed)) == 2 and len(scans(r.new)) == 1
        assert r.decisions[0].trips_before == 400 and r.decisions[0].trips_after == 200
        assert all("test_loop_passes.py" in s for s in r.decisions[0].sources)

    check(fuse_scans, seed_different, *seed_args(), kinds=["fused"], expect=fused_once)


def test_fused_values_are_exact() -> None:
    check(fuse_scans, seed_different, *seed_args(n=16, steps=50), exact=True, jit=True,
          grads=False)


def test_bidirectional_rnn_fuses_forward_and_reverse() -> None:
    def one_scan_with_rev(r: PassResult) -> None:
        assert len(scans(r.new)) == 1 and "rev" in primitives(r.new)
        assert "mixed directions" in r.decisions[0].reason

    check(fuse_scans, bidirectional, *seed_args(n=16, steps=30), expect=one_scan_with_rev)


@pytest.mark.parametrize("lengths", [(7, 10), (10, 7), (70, 100)])
@pytest.mark.parametrize("directions", [(False, False), (True, False), (False, True),
                                        (True, True)])
def test_unequal_lengths_fuse_the_common_prefix(lengths: tuple[int, int],
                                                directions: tuple[bool, bool]) -> None:
    n = 8
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    args = (jax.random.normal(k[0], (n, n)) / n, jax.random.normal(k[1], (n, n)) / n,
            jax.random.normal(k[2], (lengths[0], n, n)),
            jax.random.normal(k[3], (lengths[1], n, n)))

    def f(c1: jax.Array, c2: jax.Array, xs1: jax.Array, xs2: jax.Array) -> Any:
        return (lax.scan(body_matmuls, c1, xs1, reverse=directions[0]),
                lax.scan(body_matmuls, c2, xs2, reverse=directions[1])
                if lengths[0] == lengths[1] else
                lax.scan(lambda c, x: (c * 0.9 + jnp.sin(x), c[0]), c2, xs2,
                         reverse=directions[1]))

    def prefix_and_rest(r: PassResult) -> None:
        lengths_after = sorted(_compat.scan_info(e).length for e in scans(r.new))
        short, long = sorted(lengths)
        assert lengths_after == [long - short, short]
        assert "concatenate" in primitives(r.new)

    check(fuse_scans, f, *args, kinds=["fused"], expect=prefix_and_rest)


def test_three_scans_fuse_into_one() -> None:
    def f(a: jax.Array, b: jax.Array, xs: jax.Array, ys: jax.Array) -> Any:
        return (lax.scan(body_matmuls, a, xs), lax.scan(body_tanh, b, ys)[0],
                lax.scan(lambda c, x: (c * jnp.cos(x), None), a + b, xs, reverse=True)[0])

    def one_of_three(r: PassResult) -> None:
        assert len(scans(r.new)) == 1 and len(r.decisions[0].eqns) == 3

    check(fuse_scans, f, *seed_args(n=8, steps=12), expect=one_of_three)


def test_fused_scan_keeps_the_largest_member_unroll() -> None:
    # unroll=2 beside unroll=3 ran 6 + 4 trips; fused at unroll 1 it ran 12 (a deviceless
    # H200 compile with unroll=None: 90 -> 138 launches, est. x1.51; at unroll 3: 74).
    def f(c1: jax.Array, c2: jax.Array, xs1: jax.Array, xs2: jax.Array) -> Any:
        return (lax.scan(body_tanh, c1, xs1, reverse=True, unroll=2)[0],
                lax.scan(body_matmuls, c2, xs2, unroll=3))

    def unrolled_by_three(r: PassResult) -> None:
        (fused,) = scans(r.new)
        assert _compat.scan_info(fused).unroll == 3
        # Trips counted with the unroll factors: 6 + 4 before, 4 after (not 24 -> 12).
        d = r.decisions[0]
        assert (d.unroll, d.trips_before, d.trips_after) == (3, 10, 4)

    check(fuse_scans, f, *seed_args(n=8, steps=12), kinds=["fused"], expect=unrolled_by_three)


def test_trips_count_the_unroll_factors() -> None:
    """Every loop decision counts trips as XLA's loop runs them: ``ceil(length / unroll)``
    (a remainder is one more), for scans the user unrolled too."""
    def batched(c1: jax.Array, c2: jax.Array, xs1: jax.Array, xs2: jax.Array) -> Any:
        return (lax.scan(body_matmuls, c1, xs1, unroll=4),
                lax.scan(body_matmuls, c2, xs2, unroll=4))

    _, decisions = batch_scans(jax.make_jaxpr(batched)(*seed_args(n=8, steps=10)))
    assert [(d.kind, d.trips_before, d.trips_after) for d in decisions] == [
        ("batched", 6, 3)]
    # Fused over unequal lengths: a segment of 5 steps and one of 3, at unroll 2.
    def unequal(c1: jax.Array, c2: jax.Array, xs1: jax.Array, xs2: jax.Array) -> Any:
        return (lax.scan(body_tanh, c1, xs1, unroll=2)[0],
                lax.scan(body_matmuls, c2, xs2, unroll=2))

    _, decisions = fuse_scans(jax.make_jaxpr(unequal)(*seed_args(n=8, steps=5, steps2=8)))
    assert [(d.kind, d.trips_before, d.trips_after) for d in decisions] == [
        ("fused", 3 + 4, 3 + 2)]
    # A factor the user chose, left alone by unroll="cost".
    _, decisions = unroll_scans(jax.make_jaxpr(
        lambda c, xs: lax.scan(body_tanh, c, xs, unroll=4)[0])(*seed_args(n=8, steps=10)[::2]),
        unroll="cost")
    assert [(d.kind, d.trips_before, d.trips_after, d.unroll) for d in decisions] == [
        ("left alone", 3, 3, 4)]


def test_fused_scan_never_unrolls_a_heavy_member_past_the_cap() -> None:
    # A light scan unrolled fully (200 steps) beside a rolled body of 8 matmuls: the fused
    # body at unroll 200 would hold thousands of equations (XLA:CPU compiled it in 41 s,
    # against 0.5 s for jax.jit); the factor falls back to the largest that fits, here 1.
    def heavy(c: jax.Array, x: jax.Array) -> Any:
        for _ in range(8):
            c = jnp.tanh(c @ c + x)
        return c, None

    def f(a: jax.Array, xs: jax.Array, b: jax.Array, ys: jax.Array) -> Any:
        return (lax.scan(lambda c, x: (c + x, None), a, xs, unroll=True)[0],
                lax.scan(heavy, b, ys)[0])

    def within_the_cap(r: PassResult) -> None:
        (fused,) = scans(r.new)
        info = _compat.scan_info(fused)
        body = len(_compat.open_jaxpr(info.jaxpr)[0].eqns)
        assert info.unroll == 1 and r.decisions[0].unroll == 1
        assert body * 200 > MAX_UNROLLED_EQNS  # the members' largest factor would not fit

    args = (jnp.full((4, 4), 0.01), jnp.full((200, 4, 4), 0.01),
            jnp.full((4, 4), 0.01), jnp.full((200, 4, 4), 0.01))
    check(fuse_scans, f, *args, kinds=["fused"], expect=within_the_cap)


def test_three_scans_of_three_lengths() -> None:
    k = jax.random.split(jax.random.PRNGKey(3), 3)
    xs = [jax.random.normal(k[i], (length, 4)) for i, length in enumerate((3, 9, 6))]

    def f(a: jax.Array, x1: jax.Array, x2: jax.Array, x3: jax.Array) -> Any:
        step = lambda c, x: (jnp.tanh(c + x), c * 2)
        return (lax.scan(step, a, x1), lax.scan(lambda c, x: (c * jnp.sin(x), c), a, x2,
                                                reverse=True),
                lax.scan(lambda c, x: (c - x, c + 1), a, x3))

    def three_of_three(r: PassResult) -> None:
        assert sorted(_compat.scan_info(e).length for e in scans(r.new)) == [3, 3, 3]

    check(fuse_scans, f, jnp.ones((4,)), *xs, expect=three_of_three)


def test_dependent_scans_are_not_fused() -> None:
    def f(a: jax.Array, b: jax.Array, xs: jax.Array, ys: jax.Array) -> Any:
        first, _ = lax.scan(body_tanh, a, xs)
        return lax.scan(body_tanh, first + b, ys)[0]

    check(loop_passes(**ALL_ON), f, *seed_args(n=8, steps=10), unchanged=True,
          expect=lambda r: set(kinds(r.decisions)) == {"left alone"})


def test_fusion_keeps_a_cycle_free_order() -> None:
    # s1 -> s3 and s2 -> s4: fusing {s1, s2} and {s3, s4} is fine; {s1, s4} with {s2, s3} not.
    def f(a: jax.Array, xs: jax.Array) -> Any:
        s1 = lax.scan(body_tanh, a, xs)[0]
        s2 = lax.scan(lambda c, x: (c * jnp.sin(x), None), a, xs)[0]
        s3 = lax.scan(body_tanh, s1, xs)[0]
        s4 = lax.scan(lambda c, x: (c + jnp.cos(x), None), s2, xs)[0]
        return s3, s4

    args = (jnp.ones((4, 4)), jax.random.normal(jax.random.PRNGKey(1), (5, 4, 4)))
    check(fuse_scans, f, *args, expect=lambda r: len(scans(r.new)) == 2)


def test_identical_bodies_are_left_for_batching() -> None:
    check(partial(fuse_scans, leave_identical=True), seed_identical, *seed_args(n=8, steps=10),
          unchanged=True, expect=lambda r: set(kinds(r.decisions)) == {"left alone"})


# --- batching --------------------------------------------------------------------------------


def _has_batched_dot(jaxpr: Any) -> bool:
    for eqn in eqns_of(jaxpr):
        if eqn.primitive.name == "dot_general":
            (_, (lhs_batch, _)) = eqn.params["dimension_numbers"]
            if lhs_batch:
                return True
        if any(_has_batched_dot(sub) for _, _, sub in _compat.eqn_subjaxprs(eqn)):
            return True
    return False


def test_seed_002_identical_bodies_become_one_vmapped_scan() -> None:
    def one_batched_scan(r: PassResult) -> None:
        assert len(scans(r.new)) == 1
        assert _has_batched_dot(_compat.scan_info(scans(r.new)[0]).jaxpr)

    check(loop_passes(**ALL_ON), seed_identical, *seed_args(), kinds=["batched"],
          expect=one_batched_scan)


def test_batching_shares_common_operands() -> None:
    xs = jax.random.normal(jax.random.PRNGKey(5), (6, 4, 4))

    def f(a: jax.Array, b: jax.Array, xs: jax.Array) -> Any:
        return lax.scan(body_matmuls, a, xs), lax.scan(body_matmuls, b, xs)

    def shared_xs(r: PassResult) -> None:
        assert len(scans(r.new)) == 1
        # xs is shared: it is not stacked, so the scan reads it unbatched.
        assert any(v.aval.shape == (6, 4, 4) for v in scans(r.new)[0].invars)

    check(batch_scans, f, jnp.ones((4, 4)), jnp.eye(4), xs, expect=shared_xs)


def test_batching_stacks_no_scanned_input() -> None:
    """The members' scanned inputs are scanned as they are, each trip stacking its slices:
    no stacked copy of inputs passed apart is made (carries, which part ways, are)."""
    def no_stacked_xs(r: PassResult) -> None:
        (scan,) = scans(r.new)
        shapes = [v.aval.shape for v in scan.invars]
        # Two members' 6 x 8 x 8 inputs, each scanned as it is; one stacked carry.
        assert shapes.count((6, 8, 8)) == 2 and (2, 6, 8, 8) not in shapes
        assert (2, 8, 8) in shapes
        made = [e for e in _compat.open_jaxpr(r.new)[0].eqns if e.primitive.name != "scan"]
        assert all(v.aval.shape != (2, 6, 8, 8) for e in made for v in e.outvars)

    check(batch_scans, seed_identical, *seed_args(n=8, steps=6), kinds=["batched"],
          expect=no_stacked_xs)


def test_batching_inside_jit_and_scan_bodies() -> None:
    args = seed_args(n=8, steps=6)

    @jax.jit
    def inner(c1: jax.Array, c2: jax.Array, xs1: jax.Array, xs2: jax.Array) -> Any:
        return seed_identical(c1, c2, xs1, xs2)

    def f(c1: jax.Array, c2: jax.Array, xs1: jax.Array, xs2: jax.Array) -> Any:
        def outer(c: jax.Array, _: Any) -> tuple[jax.Array, jax.Array]:
            (a, _), (b, _) = inner(c, c2, xs1, xs2)
            return a + b, jnp.sum(a)
        return lax.scan(outer, c1, None, length=3)

    def batched_in_the_nested_jit(r: PassResult) -> None:
        assert [d.location for d in r.decisions if d.kind == "batched"] == [
            "/scan#0.jaxpr/" + primitives(_compat.scan_info(scans(r.closed)[0]).jaxpr)[0]
            + "#0.jaxpr"]

    check(loop_passes(**ALL_ON), f, *args, counts={"scan": 2},
          expect=batched_in_the_nested_jit)


# --- unrolling -------------------------------------------------------------------------------


def tiny(c: jax.Array, xs: jax.Array) -> Any:
    return lax.scan(lambda carry, x: (0.99 * carry + jnp.sin(x), carry[0]), c, xs)


@pytest.mark.parametrize(("unroll", "length", "expected"), [
    # Elementwise body: the GPU model's fastest of 1, 2, 4, 8 and 16 lowered to 10, the
    # largest factor at most 16 dividing 1000 (the rule of thumb's 8 never asked the model).
    ("auto", 1000, 10),
    ("auto", 6, 6),         # short scan of a small body: fully unrolled
    (4, 1000, 4),
    (50, 6, 6),             # never more than the length
])
def test_unroll_factor(unroll: Any, length: int, expected: int) -> None:
    def unrolled_by_expected(r: PassResult) -> None:
        (scan,) = scans(r.new)
        assert _compat.scan_info(scan).unroll == expected
        assert r.decisions[0].kind == "unrolled" and r.decisions[0].unroll == expected
        assert r.decisions[0].trips_after == -(-length // expected)

    # Inputs of 0.01 keep the carry near 1: with ones it grows to ~84, where float32 steps
    # of 1e-5 over 1000 trips make sin(carry)'s gradient differ by whatever order XLA
    # happens to fuse the two programs in (a few % on some elements), rewrite or not. The
    # values too: unrolled by 10, XLA's fused copies round the carry apart by 2e-6 after
    # 170 trips of 1000.
    check(partial(unroll_scans, unroll=unroll), tiny, jnp.ones((4,)),
          jnp.full((length, 4), 0.01), tolerance={"rtol": 1e-5, "atol": 1e-5},
          grad_tolerance=LONG_SCAN_GRAD_TOLERANCE, expect=unrolled_by_expected)


def test_unroll_auto_respects_heavy_bodies_and_user_choice() -> None:
    args = seed_args(n=16, steps=100)
    # The GPU model prices 1, 2, 4, 8 and 16, each lowered to the largest factor dividing
    # 100 (JAX would copy the scanned inputs apart for another): 1, 2, 4, 5, 10; tiny
    # matmuls are launch-bound, so the most copies win. (The former rule of thumb,
    # ceil(8 / 3 kernels per trip) = 3 lowered to 2, never asked the model.)
    check(partial(unroll_scans, unroll="auto"), lambda c, xs: lax.scan(body_matmuls, c, xs),
          args[0], args[2], values=False, grads=False,
          expect=lambda r: _compat.scan_info(scans(r.new)[0]).unroll == 10)
    odd = seed_args(n=16, steps=99)  # 99's divisors up to 16: 1, 3, 9, 11
    check(partial(unroll_scans, unroll="auto"), lambda c, xs: lax.scan(body_matmuls, c, xs),
          odd[0], odd[2], values=False, grads=False,
          expect=lambda r: _compat.scan_info(scans(r.new)[0]).unroll == 11)
    check(partial(unroll_scans, unroll="auto"),
          lambda c, xs: lax.scan(body_matmuls, c, xs, unroll=2), args[0], args[2],
          unchanged=True, kinds=["left alone"])


def _gru_cell(wx: jax.Array, wh: jax.Array, h: jax.Array, x: jax.Array) -> Any:
    """A GRU cell that slices its gate weights inside the body (as written in the wild)."""
    n = h.shape[-1]
    zr = jax.nn.sigmoid(x @ wx[:, :2 * n] + h @ wh[:, :2 * n])
    z, r = jnp.split(zr, 2, -1)
    c = jnp.tanh(x @ wx[:, 2 * n:] + (r * h) @ wh[:, 2 * n:])
    h = (1 - z) * c + z * h
    return h, h


def _gru_stack(params: list[tuple[jax.Array, jax.Array]], xs: jax.Array) -> jax.Array:
    for wx, wh in params:
        h0 = jnp.zeros((xs.shape[1], wh.shape[0]), xs.dtype)
        _, xs = lax.scan(partial(_gru_cell, wx, wh), h0, xs)
    return xs


def _gru_args(layers: int = 3, steps: int = 16, batch: int = 4, width: int = 32) -> Any:
    keys = jax.random.split(jax.random.PRNGKey(31), 2 * layers + 1)
    params = [(0.2 * jax.random.normal(keys[2 * k], (width, 3 * width)),
               0.2 * jax.random.normal(keys[2 * k + 1], (width, 3 * width)))
              for k in range(layers)]
    return params, jax.random.normal(keys[-1], (steps, batch, width))


def test_unroll_auto_keeps_rolled_a_body_that_slices_its_weights() -> None:
    """The GRU body computes four weight slices read by dots from loop-invariant values:
    unrolled, each copy may recompute them (deviceless H200: 17 kernels a trip by 2
    against 7 rolled), more than the three bookkeeping kernels a trip saves, so auto
    keeps it rolled and says why. The same cell given its slices from outside unrolls."""
    params, xs = _gru_args(layers=1, steps=64)
    costs = CostModel(device_profile("gpu"))
    closed = jax.make_jaxpr(_gru_stack)(params, xs)
    (scan,) = scans(closed)
    assert costs.invariant_prologues(scan) == 4
    assert costs.scan_trip_kernels(scan) == 3.0  # counter, x's slice, y's write
    result = check(partial(unroll_scans, unroll="auto"), _gru_stack, params, xs,
                   unchanged=True, kinds=["left alone"])
    assert "kept rolled" in result.decisions[0].reason
    assert "4 loop-invariant operand(s)" in result.decisions[0].reason

    def pre_sliced(ws: tuple[jax.Array, ...], xs: jax.Array) -> jax.Array:
        wxa, wha, wxb, whb = ws

        def cell(h: jax.Array, x: jax.Array) -> Any:
            zr = jax.nn.sigmoid(x @ wxa + h @ wha)
            z, r = jnp.split(zr, 2, -1)
            h = (1 - z) * jnp.tanh(x @ wxb + (r * h) @ whb) + z * h
            return h, h

        return lax.scan(cell, jnp.zeros((xs.shape[1], wha.shape[0])), xs)[1]

    (wx, wh), = params
    n = wh.shape[0]
    ws = (wx[:, :2 * n], wh[:, :2 * n], wx[:, 2 * n:], wh[:, 2 * n:])
    (plain,) = scans(jax.make_jaxpr(pre_sliced)(ws, xs))
    assert costs.invariant_prologues(plain) == 0
    # A slice cast before its dot is one prologue (the cast passes it on); a weight read
    # as it is, cast or not, is none.
    cast = scans(jax.make_jaxpr(lambda w, sq, xs: lax.scan(
        lambda h, x: (jnp.tanh(h @ w[:, :n].astype(jnp.bfloat16).astype(jnp.float32)
                               + x @ sq.astype(jnp.float16).astype(jnp.float32)), None),
        xs[0], xs))(wh, ws[1][:, :n], xs))
    assert costs.invariant_prologues(cast[0]) == 1
    check(partial(unroll_scans, unroll="auto"), pre_sliced, ws, xs,
          grad_tolerance=LONG_SCAN_GRAD_TOLERANCE,
          expect=lambda r: _compat.scan_info(scans(r.new)[0]).unroll > 1)


@needs_plugin
def test_gru_stack_never_launches_more_than_plain_jit() -> None:
    """The default plan of a three-layer GRU stack whose cells slice their weights, compiled
    deviceless for an H200: no more kernel launches per run than plain ``jax.jit`` (it
    once launched 413 against 341, its scans unrolled by 2)."""
    from helpers.benchmarks import hetero_batch_benchmark

    bench = hetero_batch_benchmark()  # its launch counter, from the benchmarks
    params, xs = _gru_args()
    plain = bench.count(_gru_stack, (params, xs))
    tuned = bench.count(jaxpar.parallel_branches(_gru_stack, target="gpu"), (params, xs))
    assert plain["launches"] > 0
    assert tuned["launches"] <= plain["launches"], (tuned, plain)


def test_unroll_none_leaves_scans_alone() -> None:
    check(partial(unroll_scans, unroll=None), tiny, jnp.ones((4,)), jnp.ones((100, 4)),
          unchanged=True, kinds=[])


def test_unroll_rejects_bad_values() -> None:
    closed = jax.make_jaxpr(tiny)(jnp.ones((4,)), jnp.ones((10, 4)))
    with pytest.raises(ValueError, match="unroll"):
        apply_passes(closed, fuse_scans=False, batch_scans=False, unroll=0, target="gpu")
    with pytest.raises(ValueError, match="target"):
        apply_passes(closed, fuse_scans=False, batch_scans=False, unroll=None, target="abacus")


# --- static loops ----------------------------------------------------------------------------


def test_static_fori_loop_becomes_a_scan() -> None:
    def f(x: jax.Array) -> jax.Array:
        return lax.fori_loop(jnp.int32(0), jnp.int32(7), lambda i, c: jnp.sin(c) + i, x)

    def while_became_a_scan(r: PassResult) -> None:
        assert "while" in primitives(r.closed)
        assert "while" not in primitives(r.new) and len(scans(r.new)) == 1
        assert _compat.scan_info(scans(r.new)[0]).length == 7
        assert r.decisions[0].trips_after == 7

    args = (jnp.linspace(0.0, 1.0, 5),)
    # The while cannot be reverse-differentiated, so there are no gradients to compare.
    new = check(make_loops_static, f, *args, kinds=["made static"], exact=True, grads=False,
                expect=while_became_a_scan).new
    np.testing.assert_array_equal(np.asarray(as_function(new)(*args)[0]), np.asarray(f(*args)))
    # The while could not be reverse-differentiated; the scan can.
    jax.grad(lambda x: jnp.sum(as_function(new)(x)[0]))(*args)


def test_empty_static_fori_loop() -> None:
    def f(x: jax.Array) -> jax.Array:
        return lax.fori_loop(jnp.int32(5), jnp.int32(2), lambda i, c: c * 2.0, x)

    new = check(make_loops_static, f, jnp.ones(3), exact=True, grads=False).new
    np.testing.assert_array_equal(np.asarray(as_function(new)(jnp.ones(3))[0]), np.ones(3))


def test_traced_bound_while_is_reported() -> None:
    def f(n: jax.Array, x: jax.Array) -> jax.Array:
        return lax.fori_loop(0, n, lambda i, c: c * 2.0, x)

    (report,) = check(loop_passes(**pass_defaults("gpu"), target="gpu"), f, 3, jnp.ones(2),
                      unchanged=True).decisions
    assert report.kind == "host-sync loop" and report.trips_before is None
    assert "Python int bounds" in report.reason and "test_loop_passes.py" in report.sources[0]


def _counting_while(dtype: Any, lower: int, upper: int, step: int) -> Callable[..., Any]:
    """``while c[0] < c[1]: c[0] += step`` in ``dtype``, adding 1 to ``x`` per trip."""
    def f(x: jax.Array) -> jax.Array:
        return lax.while_loop(
            lambda c: c[0] < c[1],
            lambda c: (c[0] + jnp.asarray(step, dtype), c[1], c[2] + 1.0),
            (jnp.asarray(lower, dtype), jnp.asarray(upper, dtype), x))[2]
    return f


def _fori(dtype: Any, lower: int, upper: int) -> Callable[..., Any]:
    def f(x: jax.Array) -> jax.Array:
        return lax.fori_loop(jnp.asarray(lower, dtype), jnp.asarray(upper, dtype),
                             lambda i, c: c + 1.0, x)
    return f


def _float_counter(x: jax.Array) -> jax.Array:  # 0, 1.5, ..., 9: 7 trips
    return lax.while_loop(lambda c: c[0] < c[1], lambda c: (c[0] + 1.5, c[1], c[2] + 1.0),
                          (0.0, 10.0, x))[2]


def _counter_second_upper_literal(x: jax.Array) -> jax.Array:  # a weakly typed counter
    return lax.while_loop(lambda c: c[1] < 9, lambda c: (c[0] + 1.0, c[1] + 2), (x, 0))[0]


_CLOSED_UPPER = jnp.int32(10)
_CLOSED_STEP = jnp.int32(3)


def _closed_over_bounds(x: jax.Array) -> jax.Array:
    return lax.while_loop(lambda c: c[0] < _CLOSED_UPPER,
                          lambda c: (c[0] + _CLOSED_STEP, c[1] + 1.0), (jnp.int32(-2), x))[1]


def _upper_moves(x: jax.Array) -> jax.Array:  # the body lowers the bound: 5 trips, not 10
    return lax.while_loop(lambda c: c[0] < c[1], lambda c: (c[0] + 1, c[1] - 1, c[2] + 1.0),
                          (jnp.int32(0), jnp.int32(10), x))[2]


# (program, made static?): every program ends under jax.jit, and its result is x + trips.
_COUNTING_LOOPS = [
    (_fori(jnp.int32, 0, 7), True),
    (_fori(jnp.uint8, 3, 200), True),
    (_fori(jnp.int16, -300, -5), True),
    (_fori(jnp.int8, -128, 127), True),
    (_counting_while(jnp.int32, -10, -3, 2), True),
    (_counting_while(jnp.int8, 0, 127, 127), True),      # the last step lands on 127
    (_counting_while(jnp.uint8, 0, 250, 10), True),      # ... and on 250
    (_counting_while(jnp.int8, 0, 120, 100), False),     # 100 + 100 wraps to -56: 15 trips
    (_counting_while(jnp.uint8, 0, 251, 10), False),     # 250 + 10 wraps to 4: 51 trips
    (_counting_while(jnp.int32, 5, 2, 1), True),         # empty
    (_float_counter, False),
    (_counter_second_upper_literal, True),
    (_closed_over_bounds, True),
    (_upper_moves, False),
]


@pytest.mark.parametrize(("program", "static"), _COUNTING_LOOPS,
                         ids=[f"case{k}" for k in range(len(_COUNTING_LOOPS))])
def test_counting_while_is_made_static_only_when_its_trip_count_is_proven(
        program: Callable[..., Any], static: bool) -> None:
    x = jnp.zeros(2)
    want = jax.jit(program)(x)

    def static_when_proven(r: PassResult) -> None:
        (report,) = r.decisions
        if static:
            assert report.kind == "made static" and "while" not in primitives(r.new)
            assert report.trips_after == int(want[0])  # the while's own trip count
        else:
            assert report.kind == "host-sync loop"
            assert "no static trip count" in report.reason

    # Values against jax.jit of the program (below), where XLA runs the while itself.
    new = check(make_loops_static, program, x, unchanged=not static, values=False,
                grads=False, expect=static_when_proven).new
    assert_matches(as_function(new)(x)[0], want, exact=True)


def test_overflowing_and_endless_counters_are_left_alone() -> None:
    """Loops whose trip count wrap-around decides (too long to run here)."""
    largest = int(np.iinfo(np.int64).max)
    with jax.enable_x64(True):
        cases = {
            _counting_while(jnp.int8, -128, 127, 2): "past 127",      # 126 + 2 wraps
            _counting_while(jnp.int32, 5, 10, -1): "steps by -1",
            _counting_while(jnp.int64, largest - 9, largest, 4): "past",
        }
        for program, why in cases.items():
            (report,) = check(make_loops_static, program, jnp.zeros(2),
                              unchanged=True).decisions
            assert report.kind == "host-sync loop", why
            assert why in report.reason
        # int64 up to one below the largest value: made static, 2 trips.
        program = _counting_while(jnp.int64, largest - 9, largest - 1, 4)
        result = check(make_loops_static, program, jnp.zeros(2), values=False, grads=False,
                       kinds=["made static"])
        assert result.decisions[0].trips_after == 2
        assert_matches(as_function(result.new)(jnp.zeros(2))[0], jax.jit(program)(jnp.zeros(2)),
                       exact=True)
        # fori_loop over jnp.int64 bounds.
        program = _fori(jnp.int64, 0, 7)
        result = check(make_loops_static, program, jnp.zeros(2), kinds=["made static"],
                       values=False, grads=False)
        assert "i64" in str(result.closed)
        assert result.decisions[0].trips_after == 7


@pytest.mark.parametrize("program", [_float_counter, _counting_while(jnp.int8, 0, 120, 100)])
def test_untrusted_counting_loops_end_to_end(program: Callable[..., Any]) -> None:
    x = jnp.ones(2)
    for target in ("cpu", "gpu"):
        assert_same_outputs(jaxpar.parallel_branches(program, target=target),
                            jax.jit(program), (x,), exact=True)


# --- the whole pipeline ----------------------------------------------------------------------


def test_pass_defaults() -> None:
    assert pass_defaults("gpu") == {"fuse_scans": True, "batch_scans": True, "batch_branches": True,
                                    "batch_matmuls": True, "unroll": "cost",
                                    "unroll_while": None, "share_common": True,
                                    "hoist_scan_inputs": False, "associative_scans": False}
    assert pass_defaults("cpu") == {"fuse_scans": False, "batch_scans": False,
                                    "batch_branches": False, "batch_matmuls": False,
                                    "unroll": None, "unroll_while": None, "share_common": False,
                                    "hoist_scan_inputs": False, "associative_scans": False}
    # What a TPU v5e measured paying: identical scans batched, small loops read by blocks.
    assert pass_defaults("tpu") == {"fuse_scans": False, "batch_scans": True,
                                    "batch_branches": False, "batch_matmuls": False,
                                    "unroll": "cost", "unroll_while": None,
                                    "share_common": False, "hoist_scan_inputs": False,
                                    "associative_scans": False}
    with pytest.raises(ValueError):
        pass_defaults("abacus")


@pytest.mark.parametrize("program", [seed_different, seed_identical, bidirectional])
@pytest.mark.parametrize("unroll", [None, "auto", 3])
def test_idempotent(program: Callable[..., Any], unroll: Any) -> None:
    # check_pass applies the passes to their output again: the same object comes back.
    check(loop_passes(fuse_scans=True, batch_scans=True, unroll=unroll, target="gpu"), program,
          *seed_args(n=8, steps=9, steps2=9), values=False, grads=False)


def test_input_is_not_mutated() -> None:
    # check_pass compares the input's text before and after the passes.
    result = check(loop_passes(fuse_scans=True, batch_scans=True, unroll="auto", target="gpu"),
                   seed_different, *seed_args(n=8, steps=9), values=False, grads=False)
    assert result.new is not result.closed


def test_nested_levels_cond_remat_custom_jvp() -> None:
    args = seed_args(n=8, steps=5)

    @jax.custom_jvp
    def smooth(x: jax.Array) -> jax.Array:
        return jnp.tanh(x)

    smooth.defjvp(lambda primals, tangents: (smooth(primals[0]),
                                             tangents[0] * (1 - jnp.tanh(primals[0]) ** 2)))

    def f(c1: jax.Array, c2: jax.Array, xs1: jax.Array, xs2: jax.Array) -> Any:
        def two(c1: jax.Array, c2: jax.Array) -> jax.Array:
            (a, _), b = seed_different(c1, c2, xs1, xs2)
            return smooth(a + b)
        branch = lax.cond(jnp.sum(c1) > 0, two, lambda a, b: a - b, c1, c2)
        return jax.checkpoint(two)(branch, c2)

    def fused_below_the_top(r: PassResult) -> None:
        fused = [d for d in r.decisions if d.kind == "fused"]
        assert len(fused) == 2 and all(d.location != "/" for d in fused)

    check(loop_passes(**pass_defaults("gpu"), target="gpu"), f, *args,
          expect=fused_below_the_top)


def test_rewritten_program_composes_with_jit_vmap_grad() -> None:
    args = seed_args(n=8, steps=7, steps2=5)
    closed = jax.make_jaxpr(seed_different)(*args)
    new, _ = apply_passes(closed, **pass_defaults("gpu"), target="gpu")
    fn, ref = jex_core.jaxpr_as_fun(new), jex_core.jaxpr_as_fun(closed)
    assert_matches(jax.jit(fn)(*args), ref(*args), tolerance=TOLERANCE)
    batched = tuple(jnp.stack([a, 0.5 * a]) for a in args)
    assert_matches(jax.vmap(fn)(*batched), jax.vmap(ref)(*batched),
                   tolerance={"rtol": 1e-5, "atol": 1e-6})
    assert_matches(jax.jit(jax.grad(scalar_loss(fn), (0, 1)))(*args),
                   jax.grad(scalar_loss(ref), (0, 1))(*args),
                   tolerance={"rtol": 1e-5, "atol": 1e-6})
