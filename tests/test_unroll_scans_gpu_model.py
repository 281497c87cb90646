"""``unroll="auto"`` on target gpu: each scan's factor is the one the GPU model that
prices the plan estimates fastest (``targets/gpu.fastest_unroll``), within the caps
(the length, ``MAX_UNROLLED_EQNS``, the memory budget, a factor dividing the length), so
the default plan is estimated no slower than any explicit factor those caps allow."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from helpers.programs import seed_002
from jax import lax
from pass_checker import assert_same_outputs

import jaxpar
from jaxpar import _compat
from jaxpar._model.cost import CostModel
from jaxpar._model.gpu import CommandBufferMode
from jaxpar._model.gpu_levels import LevelModel
from jaxpar._plan.gpu_time import estimate_plain_seconds
from jaxpar.passes import unroll_scans
from jaxpar.passes._loop_candidates import MAX_UNROLLED_EQNS
from jaxpar.targets import device_profile

EXPLICIT = (1, 2, 4, 8, 16)


def _gru_cell(params: Any, h: jax.Array, x: jax.Array) -> jax.Array:
    wz, uz, wr, ur, wh, uh = params
    z = jax.nn.sigmoid(x @ wz + h @ uz)
    r = jax.nn.sigmoid(x @ wr + h @ ur)
    return (1 - z) * h + z * jnp.tanh(x @ wh + (r * h) @ uh)


def bidirectional_gru(forward: Any, backward: Any, h0: jax.Array, xs: jax.Array) -> Any:
    ys = lax.scan(lambda h, x: (_gru_cell(forward, h, x),) * 2, h0, xs)[1]
    back = lax.scan(lambda h, x: (_gru_cell(backward, h, x),) * 2, h0, xs, reverse=True)[1]
    return ys, back


def gru_args(steps: int, batch: int = 32, width: int = 128, features: int = 64
             ) -> tuple[Any, ...]:
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 13))

    def cell() -> tuple[jax.Array, ...]:
        return tuple(jax.random.normal(next(keys), (features if i % 2 == 0 else width, width))
                     * 0.1 for i in range(6))

    return (cell(), cell(), jnp.zeros((batch, width)),
            jax.random.normal(next(keys), (steps, batch, features)))


def lstm(w: jax.Array, u: jax.Array, state: Any, xs: jax.Array) -> Any:
    def step(carry: Any, x: jax.Array) -> Any:
        h, c = carry
        i, f, g, o = jnp.split(x @ w + h @ u, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    return lax.scan(step, state, xs)


def lstm_args() -> tuple[Any, ...]:
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    state = (jnp.zeros((16, 64)), jnp.zeros((16, 64)))
    return (jax.random.normal(k[0], (32, 256)) * 0.1, jax.random.normal(k[1], (64, 256)) * 0.1,
            state, jax.random.normal(k[2], (400, 16, 32)))


def seed_args(n: int = 100, steps: int = 1000) -> tuple[jax.Array, ...]:
    k = jax.random.split(jax.random.PRNGKey(2), 4)
    return (jax.random.normal(k[0], (n, n)) / n, jax.random.normal(k[1], (n, n)) / n,
            jax.random.normal(k[2], (steps, n, n)) / n, jax.random.normal(k[3], (steps, n, n)) / n)


def tiny(x: jax.Array) -> jax.Array:
    return lax.scan(lambda c, _: (jnp.sin(c) + 0.5 * c, None), x, None, length=12)[0]


PROGRAMS: dict[str, tuple[Callable[..., Any], Callable[[], tuple[Any, ...]]]] = {
    "bidirectional GRU, 64 steps": (bidirectional_gru, lambda: gru_args(64)),
    "bidirectional GRU, 500 steps": (bidirectional_gru, lambda: gru_args(500)),
    "bidirectional GRU, 2000 steps": (bidirectional_gru, lambda: gru_args(2000)),
    "LSTM": (lstm, lstm_args),
    "seed_002": (seed_002, seed_args),
    "tiny scan": (tiny, lambda: (jnp.arange(4.0),)),
}


def _scans(fn: Callable[..., Any], args: tuple[Any, ...]) -> list[_compat.ScanInfo]:
    inner, _ = _compat.open_jaxpr(jax.make_jaxpr(fn)(*args))
    return [_compat.scan_info(e) for e in inner.eqns if e.primitive.name == "scan"]


def _capped(k: int, scans: list[_compat.ScanInfo]) -> bool:
    """Whether ``unroll=k`` breaks a cap of ``unroll="auto"`` in some scan: more trips than
    the length, more equations than ``MAX_UNROLLED_EQNS``, a factor not dividing it."""
    return any(k > s.length or s.length % k
               or k * len(_compat.open_jaxpr(s.jaxpr)[0].eqns) > MAX_UNROLLED_EQNS
               for s in scans)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_default_plan_is_estimated_no_slower_than_any_allowed_factor(name: str) -> None:
    fn, make_args = PROGRAMS[name]
    args = make_args()
    default = jaxpar.inspect(fn, target="gpu")(*args)
    compared = []
    for k in EXPLICIT:
        if _capped(k, _scans(fn, args)):
            continue
        explicit = jaxpar.inspect(fn, target="gpu", unroll=k)(*args)
        if not explicit.memory.fits:  # over the memory budget: a cap of "auto"
            continue
        compared.append(k)
        assert default.estimate.jaxpar_us <= explicit.estimate.jaxpar_us * (1 + 1e-9), (
            k, default.text(), explicit.text())
    assert compared  # the test compared the default with some factor
    assert_same_outputs(jaxpar.parallel_branches(fn, target="gpu"), jax.jit(fn), args)


def test_the_issue_s_bidirectional_gru_unrolls_by_the_model_s_fastest_factor() -> None:
    """2,000 steps: the rule of thumb picked 2 (39,000 us in the model), where 4 is
    35,100 us and 16 32,175 us."""
    plan = jaxpar.inspect(bidirectional_gru, target="gpu")(*gru_args(2000))
    unrolled = [d for d in plan.decisions if d.pass_name == "unroll_scans"]
    assert [d.unroll for d in unrolled] == [16, 16]
    assert "unroll='auto' chose it as the GPU model's fastest of unroll 1, 2, 4, 8, 16" \
        in plan.text()
    by_four = jaxpar.inspect(bidirectional_gru, target="gpu", unroll=4)(*gru_args(2000))
    assert plan.estimate.jaxpar_us < by_four.estimate.jaxpar_us


def test_a_factor_dividing_the_length_is_priced_for_each_candidate() -> None:
    """500 steps: 8 and 16 do not divide it, so 5 and 10 are priced in their place."""
    plan = jaxpar.inspect(bidirectional_gru, target="gpu")(*gru_args(500))
    assert {d.unroll for d in plan.decisions if d.pass_name == "unroll_scans"} == {10}
    assert "fastest of unroll 1, 2, 4, 5, 10" in plan.text()


def test_the_pass_prices_a_factor_as_the_plan_s_estimate_does() -> None:
    """``LevelModel.scan`` of a scan at factor ``k`` is the time the plan's model gives
    the program with that scan unrolled by ``k``, less the program's other work."""
    closed = jax.make_jaxpr(lstm)(*lstm_args())
    costs = CostModel(device_profile("gpu"))
    mode = CommandBufferMode.LHS
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    model = LevelModel(costs, mode)
    rolled = estimate_plain_seconds(closed, costs, mode)
    for k in (2, 8):
        unrolled, _ = unroll_scans(closed, unroll=k, target="gpu")
        difference = estimate_plain_seconds(unrolled, costs, mode) - rolled
        assert difference == pytest.approx(
            model.scan(eqn, k).seconds - model.scan(eqn).seconds, rel=1e-9)


def test_explicit_factors_are_never_overridden() -> None:
    plan = jaxpar.inspect(bidirectional_gru, target="gpu", unroll=2)(*gru_args(2000))
    assert {d.unroll for d in plan.decisions if d.pass_name == "unroll_scans"} == {2}

    def chosen(h0: jax.Array, xs: jax.Array) -> jax.Array:
        return lax.scan(lambda h, x: (jnp.tanh(h * x), None), h0, xs, unroll=3)[0]

    kept = jaxpar.inspect(chosen, target="gpu")(jnp.ones(8), jnp.ones((300, 8)))
    (left,) = [d for d in kept.decisions if d.pass_name == "unroll_scans"]
    assert left.unroll == 3 and "already chosen" in left.reason


def test_without_a_gpu_model_the_rule_of_thumb_decides() -> None:
    """Target cpu with ``unroll="cost"``: no GPU model prices the scan; the rule
    (ceil(8 / kernels per trip)) still does."""
    plan = jaxpar.inspect(lstm, target="cpu", unroll="cost")(*lstm_args())
    (d,) = [d for d in plan.decisions if d.pass_name == "unroll_scans"]
    assert "body cost and length" in d.reason


def test_a_factor_the_memory_budget_caps_is_said_with_the_copies_it_allows() -> None:
    """docs/quickstart.md's two scans at 100 x 100, 200 steps: fused, 16 copies of the
    body exceed the memory budget, 13 fit; the line lists the factors priced (once) and
    then the cap (the words once read "of unroll 1, 2, 4, 8, 10, , within")."""
    def two_scans(a: jax.Array, b: jax.Array, xs: jax.Array) -> tuple[jax.Array, jax.Array]:
        return (lax.scan(lambda c, x: (jnp.tanh(c @ x), None), a, xs)[0],
                lax.scan(lambda c, x: (jnp.sin(x @ c) + c, None), b, xs)[0])

    square = jax.ShapeDtypeStruct((100, 100), jnp.float32)
    plan = jaxpar.inspect(two_scans, target="gpu")(
        square, square, jax.ShapeDtypeStruct((200, 100, 100), jnp.float32))
    (unrolled,) = [line for line in plan.text().splitlines() if "unrolled by" in line]
    assert unrolled.endswith("unroll='auto' chose it as the GPU model's fastest of unroll "
                             "1, 2, 4, 8, 10, within the 13 copies of the body the memory "
                             "budget allows"), unrolled
