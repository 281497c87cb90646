"""``associative_scans``: a scan whose carries each follow a linear recurrence
(``c = a * c + b``, ``a`` and ``b`` reading no carry) runs as ``lax.associative_scan``.

The rewritten program must compute the original's carries and per-step outputs (forward
and reverse, resets by ``jnp.where``, several carries, no scanned inputs, a state-space
layer's step, outputs reading the carry before and after the update), and gradients;
leave no loop behind; leave alone what is not linear (``tanh``, a matmul of the carry,
two carries mixed, a product of carries, an integer carry, effects, length 1, too many
bytes); report what it did; and be measured on a TPU (its candidate).
"""

from __future__ import annotations

import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from pass_checker import all_eqns, check_pass

import jaxpar
from jaxpar import passes, targets
from jaxpar._options import Settings

# Products of many steps' decays formed in another order: equal within rounding.
VALUES = {"rtol": 2e-5, "atol": 2e-5}
GRADS = {"rtol": 2e-4, "atol": 5e-5}


def associative_pass(closed: Any) -> Any:
    return passes.run_pass("associative_scans", closed,
                           settings=Settings.of_switches("tpu", associative_scans=True))


def _check(program: Any, *args: Any, **checks: Any) -> Any:
    checks.setdefault("tolerance", VALUES)
    checks.setdefault("grad_tolerance", GRADS)
    return check_pass(associative_pass, program, *args, **checks)


def _normal(key: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape)


def ema(c: jax.Array, xs: jax.Array) -> Any:
    return lax.scan(lambda c, x: (c * 0.9 + x, jnp.tanh(c) * 2.0), c, xs)


def gae(rewards: jax.Array, values: jax.Array, done: jax.Array) -> Any:
    def body(g: jax.Array, step: tuple[jax.Array, ...]) -> Any:
        r, v, d = step
        g = r + 0.99 * 0.95 * (1.0 - d) * g - v
        return g, g
    return lax.scan(body, jnp.zeros(rewards.shape[1:]), (rewards, values, done), reverse=True)


def gae_where(g0: jax.Array, rewards: jax.Array, done: jax.Array) -> Any:
    def body(g: jax.Array, step: tuple[jax.Array, ...]) -> Any:
        r, d = step
        g = r + 0.99 * jnp.where(d, 0.0, g)
        return g, g
    return lax.scan(body, g0, (rewards, done), reverse=True)


def selective_scan(h: jax.Array, dt: jax.Array, b: jax.Array, c: jax.Array, x: jax.Array,
                   a: jax.Array) -> Any:
    """Mamba's selective scan step: the state's decay and input read the step's inputs."""
    def step(h: jax.Array, t: tuple[jax.Array, ...]) -> Any:
        d, bt, ct, xt = t
        h = jnp.exp(d[..., None] * a) * h + (d * xt)[..., None] * bt[:, None, :]
        return h, jnp.einsum("bdn,bn->bd", h, ct)
    return lax.scan(step, h, (dt, b, c, x))


def _scans(jaxpr: Any) -> list[Any]:
    return [e for e in all_eqns(jaxpr) if e.primitive.name in ("scan", "while")]


# ---------------------------------------------------------------- values and structure


@pytest.mark.parametrize("length", [2, 3, 100])
def test_a_moving_average_runs_without_a_loop(length: int) -> None:
    result = _check(ema, _normal(0, (4, 5)), _normal(1, (length, 4, 5)),
                    kinds=["scanned in parallel"])
    assert not _scans(result.new)
    (d,) = result.decisions
    assert d.pass_name == "associative_scans" and d.trips_before == length
    assert d.reason.startswith("its carry follows a linear recurrence (c = a * c + b): "
                               "lax.associative_scan runs its")


def test_a_reset_by_where_stays_a_loop_it_drops_what_a_product_would_not() -> None:
    # An infinite carry the reset drops: the loop's values are finite after it, where
    # (0 * inf) would make a composition's NaN. Linear, but left alone.
    done = jnp.zeros((6, 3), bool).at[2].set(True)
    g0 = jnp.array([jnp.inf, 1.0, -jnp.inf])
    _check(gae_where, g0, _normal(50, (6, 3)), done, unchanged=True, grads=False)
    assert np.isfinite(np.asarray(gae_where(g0, _normal(50, (6, 3)), done)[1][:3])).all()


def test_a_reverse_discounted_return_with_resets() -> None:
    done = jax.random.bernoulli(jax.random.key(2), 0.1, (50, 6)).astype(jnp.float32)
    result = _check(gae, _normal(3, (50, 6)), _normal(4, (50, 6)), done,
                    kinds=["scanned in parallel"])
    assert not _scans(result.new)


def gae_next_value(values: jax.Array, rewards: jax.Array, done: jax.Array,
                   last: jax.Array) -> Any:
    """GAE as PPO implementations write it: the carry holds the next step's value, which
    each step replaces by its own (a carry whose update reads no carry)."""
    def body(carry: tuple[jax.Array, jax.Array], t: tuple[jax.Array, ...]) -> Any:
        advantage, next_value = carry
        value, reward, d = t
        delta = reward + 0.99 * next_value * (1 - d) - value
        advantage = delta + 0.99 * 0.95 * (1 - d) * advantage
        return (advantage, value), advantage
    return lax.scan(body, (jnp.zeros_like(last), last), (values, rewards, done), reverse=True)


def test_gae_with_the_next_value_in_the_carry() -> None:
    done = jax.random.bernoulli(jax.random.key(40), 0.1, (60, 5)).astype(jnp.float32)
    result = _check(gae_next_value, _normal(41, (60, 5)), _normal(42, (60, 5)), done,
                    _normal(43, (5,)), kinds=["scanned in parallel"])
    assert not _scans(result.new)


def test_known_carries_in_levels_and_of_any_dtype() -> None:
    def program(c: jax.Array, xs: jax.Array, ks: jax.Array) -> Any:
        def body(carry: tuple[jax.Array, ...], t: tuple[jax.Array, jax.Array]) -> Any:
            c, prev, before = carry
            x, k = t
            # prev: the step's own k (an integer); before: prev's value (two levels).
            return (c * 0.7 + before.astype(c.dtype) * x, k, prev), c
        return lax.scan(body, (c, jnp.int32(1), jnp.int32(2)), (xs, ks))

    result = _check(program, _normal(44, (3,)), _normal(45, (20, 3)),
                    jnp.arange(20, dtype=jnp.int32), kinds=["scanned in parallel"], grads=False)
    assert not _scans(result.new)


def test_a_state_space_layers_selective_scan() -> None:
    args = (jnp.zeros((2, 8, 4)), jax.nn.softplus(_normal(5, (40, 2, 8))),
            _normal(6, (40, 2, 4)), _normal(7, (40, 2, 4)), _normal(8, (40, 2, 8)),
            -jnp.exp(_normal(9, (8, 4))))
    _check(selective_scan, *args, kinds=["scanned in parallel"])


def test_several_carries_constants_no_inputs_and_free_carries() -> None:
    def program(c: jax.Array, d: jax.Array, w: jax.Array) -> Any:
        def body(carry: tuple[jax.Array, ...], _: Any) -> Any:
            c, d, _ = carry
            return (w * c - 0.5, -d / 3.0 + jnp.sin(w), jnp.cos(w)), c + d  # e reads no carry
        return lax.scan(body, (c, d, jnp.zeros(3)), None, length=17)

    _check(program, _normal(10, (3,)), _normal(11, (3,)), jnp.linspace(0.5, 0.9, 3),
           kinds=["scanned in parallel"])


@pytest.mark.parametrize("program", [
    lambda c, xs: lax.scan(lambda c, x: (jnp.tanh(c) + x, None), c, xs),
    lambda c, xs: lax.scan(lambda c, x: (c * c + x, None), c, xs),
    lambda c, xs: lax.scan(lambda c, x: (c @ jnp.ones((4, 4)) + x, None), c, xs),
    lambda c, xs: lax.scan(lambda c, x: ((c[0] + c[1], c[1] * x), None), (c, c), xs),
    lambda c, xs: lax.scan(lambda c, x: (jnp.roll(c, 1) * x, None), c, xs),
    lambda c, xs: lax.scan(lambda c, x: (c / x, None), c, xs),
], ids=["tanh", "square", "matmul", "mixed", "rolled", "divided by an input"])
def test_what_is_not_linear_stays_a_loop(program: Any) -> None:
    _check(program, _normal(12, (4,)), _normal(13, (9, 4)), unchanged=True)


def test_integer_carries_effects_and_one_step_stay() -> None:
    def counted(c: jax.Array, xs: jax.Array) -> Any:
        return lax.scan(lambda c, x: ((c[0] + 1, c[1] * 0.5 + x), None), (jnp.int32(0), c),
                        xs)

    _check(counted, _normal(14, (4,)), _normal(15, (9, 4)), unchanged=True)

    def printed(c: jax.Array, xs: jax.Array) -> Any:
        def body(c: jax.Array, x: jax.Array) -> Any:
            jax.debug.print("{}", x.sum())
            return c * 0.5 + x, None
        return lax.scan(body, c, xs)

    _check(printed, _normal(16, (4,)), _normal(17, (9, 4)), unchanged=True, values=False)
    _check(ema, _normal(18, (4,)), _normal(19, (1, 4)), unchanged=True)


def test_a_stack_over_the_allowance_is_left_alone_with_the_figure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module("jaxpar.passes.associative_scans")
    monkeypatch.setattr(module, "MAX_STACKED_BYTES", 1024)
    result = _check(ema, _normal(20, (4, 5)), _normal(21, (64, 4, 5)), unchanged=True)
    (d,) = result.decisions
    assert d.kind == "left alone"
    assert "but every step's would stack 15.0 KiB, more than the 1.0 KiB allowed" in d.reason


# ---------------------------------------------------------------- through jaxpar


def _associative(fun: Any, **options: Any) -> Any:
    return jaxpar.parallel_branches(fun, associative_scans=True, measure=False, **options)


@pytest.mark.parametrize("target", ["cpu", "tpu", "gpu"])
def test_values_gradients_and_vmap_equal_jax_jit_on_every_target(target: str) -> None:
    args = (_normal(22, (4, 5)), _normal(23, (30, 4, 5)))
    f = _associative(ema, target=target)
    for got, want in zip(f(*args), jax.jit(ema)(*args), strict=True):
        np.testing.assert_allclose(got, want, **VALUES)

    def loss(g: Any) -> Any:
        return lambda c, xs: g(c, xs)[1].sum()
    for got, want in zip(jax.grad(loss(f), argnums=(0, 1))(*args),
                         jax.grad(loss(ema), argnums=(0, 1))(*args), strict=True):
        np.testing.assert_allclose(got, want, **GRADS)
    batched = jnp.stack([args[0], args[0] * 2.0])
    got = jax.vmap(f, in_axes=(0, None))(batched, args[1])[1]
    np.testing.assert_allclose(got, jax.vmap(ema, in_axes=(0, None))(batched, args[1])[1],
                               **VALUES)
    assert "stablehlo.while" not in jax.jit(f).lower(*args).as_text()


def test_inspect_names_what_ran_in_parallel() -> None:
    plan = jaxpar.inspect(ema, associative_scans=True, target="tpu")(
        _normal(24, (4, 5)), _normal(25, (100, 4, 5)))
    line = next(x for x in plan.text().splitlines() if "scanned in parallel:" in x)
    assert "1 scan, 100 trips" in line and "test_associative_scans.py" in line
    assert "lax.associative_scan runs its 100 steps in about 14 rounds" in line


def test_off_by_default_and_measured_on_a_tpu() -> None:
    args = (_normal(26, (4, 5)), _normal(27, (30, 4, 5)))
    for target in ("cpu", "gpu", "tpu"):
        plan = jaxpar.inspect(ema, target=target)(*args)
        assert not [d for d in plan.decisions if d.pass_name == "associative_scans"]
    assert targets.get("tpu").candidates["jaxpar, linear scans associative"] == {
        "associative_scans": True}


def test_the_one_pass_function_and_a_bad_value() -> None:
    one_pass = vars(passes)["associative_scans"]      # jaxpar.passes.associative_scans
    closed = jax.make_jaxpr(ema)(_normal(28, (3,)), _normal(29, (5, 3)))
    new, decisions = one_pass(closed, target="tpu")
    assert [d.kind for d in decisions] == ["scanned in parallel"] and new is not closed
    with pytest.raises((TypeError, ValueError), match="associative_scans"):
        jaxpar.parallel_branches(ema, associative_scans="yes")(jnp.ones(3), jnp.ones((5, 3)))


@pytest.mark.parametrize("reverse", [False, True])
def test_outputs_reading_the_carry_in_and_out(reverse: bool) -> None:
    def program(c: jax.Array, xs: jax.Array) -> Any:
        def body(c: jax.Array, x: jax.Array) -> Any:
            new = 0.8 * c + x
            return new, (c * 2.0, jnp.sin(new))
        return lax.scan(body, c, xs, reverse=reverse)

    _check(program, _normal(30, (3,)), _normal(31, (12, 3)), kinds=["scanned in parallel"])



def test_literal_and_weakly_typed_initial_carries() -> None:
    # ``0.0`` as the initial carry is a literal operand of the scan; a weakly typed one
    # (a Python float made an array) keeps its weak type in the output.
    def literal(rewards: jax.Array, done: jax.Array) -> Any:
        return lax.scan(lambda g, rd: (rd[0] + 0.99 * (1 - rd[1]) * g, g), 0.0,
                        (rewards, done), reverse=True)

    _check(literal, jnp.arange(1.0, 6.0), jnp.zeros(5), kinds=["scanned in parallel"])

    def weak(c: jax.Array) -> Any:
        return lax.scan(lambda c, _: (0.5 * c + 1.0, c), c, None, length=4)

    _check(weak, jnp.asarray(2.0), kinds=["scanned in parallel"])
    got = _associative(weak, target="tpu")(jnp.asarray(2.0))
    np.testing.assert_allclose(got[0], weak(jnp.asarray(2.0))[0])


def test_a_call_reading_a_linear_carry_and_giving_a_free_result_stays() -> None:
    both = jax.jit(lambda c, x: (c * 0.5, x * 2.0))

    def program(c0: jax.Array, xs: jax.Array) -> Any:
        def body(carry: tuple[jax.Array, jax.Array], x: jax.Array) -> Any:
            c, k = carry
            c2, k2 = both(c, x)
            return (c2 + k, k2), c
        return lax.scan(body, (c0, jnp.float32(0)), xs)

    _check(program, jnp.float32(1), jnp.arange(1.0, 6.0), unchanged=True)
