"""``hoist_scan_inputs``: the work of a scan's body that reads no carry runs for all
steps at once, before the loop (``hoist_scan_inputs=True``).

The rewritten program must compute the original's values and gradients (forward and
reverse scans, several inputs, key arrays, nested scans, under ``vmap`` and ``grad``),
run the moved matmul once over every step (one ``dot_general`` of the stacked inputs,
outside the loop, in the lowered text), keep in the loop what reads the carry, leave
alone what must stay (effects, conditionals, collectives, length 0, too many bytes),
report what it moved, and be measured on a TPU (its candidates).
"""

from __future__ import annotations

import importlib
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from pass_checker import all_eqns, check_pass, eqns_of

import jaxpar
from jaxpar import passes, targets
from jaxpar._options import Settings
from jaxpar.targets.candidates import ORDER


def hoist_pass(closed: Any) -> Any:
    return passes.run_pass("hoist_scan_inputs", closed,
                           settings=Settings.of_switches("tpu", hoist_scan_inputs=True))


# A matmul over all steps at once may sum in another order than the loop's small ones.
GRADS = {"rtol": 1e-4, "atol": 5e-5}


def _keys(n: int) -> list[jax.Array]:
    return list(jax.random.split(jax.random.key(3), n))


def _rnn_args(steps: int = 12, batch: int = 4, width: int = 8, inputs: int = 6
              ) -> tuple[jax.Array, ...]:
    k = _keys(4)
    return (jax.random.normal(k[0], (batch, width)),
            jax.random.normal(k[1], (steps, batch, inputs)),
            jax.random.normal(k[2], (width, width)) * 0.3,
            jax.random.normal(k[3], (inputs, width)) * 0.3)


def rnn(h: jax.Array, xs: jax.Array, w: jax.Array, u: jax.Array, reverse: bool = False
        ) -> tuple[jax.Array, jax.Array]:
    def cell(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = jnp.tanh(h @ w + x @ u + 0.1)
        return h, h * 2.0
    return lax.scan(cell, h, xs, reverse=reverse)


def _scan_bodies(jaxpr: Any) -> list[Any]:
    return [e for e in all_eqns(jaxpr) if e.primitive.name == "scan"]


def _dots_in_body(scan: Any) -> int:
    return sum(e.primitive.name == "dot_general" for e in all_eqns(scan.params["jaxpr"]))


# ---------------------------------------------------------------- values and structure


@pytest.mark.parametrize("reverse", [False, True])
def test_an_input_projection_runs_once_before_the_loop(reverse: bool) -> None:
    result = check_pass(hoist_pass, partial(rnn, reverse=reverse), *_rnn_args(), kinds=["hoisted"],
                        grad_tolerance=GRADS)
    top = eqns_of(result.new)
    # The moved matmul is one dot_general of the stacked inputs (steps x batch rows),
    # before the loop; the loop keeps the carry's matmul only.
    first_dot = next(e for e in top if e.primitive.name == "dot_general")
    assert first_dot.outvars[0].aval.shape == (12, 4, 8)
    (scan,) = _scan_bodies(result.new)
    assert _dots_in_body(scan) == 1
    assert scan.params["reverse"] is reverse
    (d,) = result.decisions
    assert d.pass_name == "hoist_scan_inputs" and d.trips_before == d.trips_after == 12
    assert "1 matmul of its body read no carry" in d.reason


def test_work_feeding_the_heavy_op_moves_and_its_consumers_stay() -> None:
    def program(h: jax.Array, xs: jax.Array, w: jax.Array, u: jax.Array) -> Any:
        def cell(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
            scaled = jnp.sin(x) * 0.5                  # moves: it feeds the matmul
            projected = scaled @ u
            return jnp.tanh(h @ w + projected * 2.0), jnp.cos(x)  # the cos stays: cheap
        return lax.scan(cell, h, xs)

    result = check_pass(hoist_pass, program, *_rnn_args(), kinds=["hoisted"], grad_tolerance=GRADS)
    (scan,) = _scan_bodies(result.new)
    body = [e.primitive.name for e in eqns_of(scan.params["jaxpr"])]
    assert "sin" not in body and "cos" in body and body.count("dot_general") == 1


def test_several_inputs_loop_constants_and_outputs_read_from_moved_values() -> None:
    def program(c: jax.Array, xs: jax.Array, ys: jax.Array, w: jax.Array) -> Any:
        wt = w.T * 2.0                                   # loop-invariant, in the body

        def body(c: jax.Array, step: tuple[jax.Array, jax.Array]) -> Any:
            x, y = step
            a = (x + y) @ wt                             # reads two inputs and a constant
            return c * 0.9 + a, (a, y)                   # a moved value is also an output
        return lax.scan(body, c, (xs, ys))

    k = _keys(4)
    args = (jnp.zeros((3, 5)), jax.random.normal(k[0], (7, 3, 5)),
            jax.random.normal(k[1], (7, 3, 5)), jax.random.normal(k[2], (5, 5)))
    check_pass(hoist_pass, program, *args, kinds=["hoisted"], grad_tolerance=GRADS)


def test_random_draws_from_the_step_keys_are_drawn_before_the_loop() -> None:
    # A sampler's step: its momentum drawn from the step's key (blackjax's HMC does).
    def chain(x: jax.Array, keys: jax.Array) -> Any:
        def step(x: jax.Array, key: jax.Array) -> Any:
            k1, k2 = jax.random.split(key)
            p = jax.random.normal(k1, x.shape)
            accept = jax.random.uniform(k2) < 0.7
            proposal = x - 0.1 * x + 0.3 * p
            x = jnp.where(accept, proposal, x)
            return x, x.sum()
        return lax.scan(step, x, keys)

    keys = jax.random.split(jax.random.key(0), 20)
    result = check_pass(hoist_pass, chain, jnp.ones(5), keys, kinds=["hoisted"], grads=False)
    (scan,) = _scan_bodies(result.new)
    body = {e.primitive.name for e in all_eqns(scan.params["jaxpr"])}
    assert not body & {"random_bits", "threefry2x32", "random_split"}


def test_nested_scans_hoist_in_the_inner_body() -> None:
    def program(h: jax.Array, xs: jax.Array, w: jax.Array, u: jax.Array) -> Any:
        def outer(h: jax.Array, _: Any) -> Any:
            return rnn(h, xs, w, u)[0], None
        return lax.scan(outer, h, None, length=3)[0]

    result = check_pass(hoist_pass, program, *_rnn_args(), kinds=["hoisted"], grad_tolerance=GRADS)
    assert result.decisions[0].location != "/"


def test_already_hoisted_and_carry_only_bodies_change_nothing() -> None:
    def carry_only(c: jax.Array, w: jax.Array) -> jax.Array:
        return lax.scan(lambda c, _: (jnp.tanh(c @ w), None), c, None, length=9)[0]

    check_pass(hoist_pass, carry_only, jnp.ones((2, 4)), jnp.eye(4), unchanged=True)

    def cheap(c: jax.Array, xs: jax.Array) -> Any:   # reads inputs, but nothing heavy
        return lax.scan(lambda c, x: (c * 0.5 + jnp.sin(x), None), c, xs)[0]

    check_pass(hoist_pass, cheap, jnp.ones(4), jnp.ones((9, 4)), unchanged=True)


# ---------------------------------------------------------------- what stays in the loop


def test_effects_conditionals_and_empty_loops_stay() -> None:
    def printed(h: jax.Array, xs: jax.Array, w: jax.Array, u: jax.Array) -> Any:
        def cell(h: jax.Array, x: jax.Array) -> Any:
            jax.debug.print("{}", x.sum())
            return jnp.tanh(h @ w + x @ u), None
        return lax.scan(cell, h, xs)[0]

    check_pass(hoist_pass, printed, *_rnn_args(), unchanged=True, values=False)

    def conditional(h: jax.Array, xs: jax.Array, w: jax.Array, u: jax.Array) -> Any:
        def cell(h: jax.Array, x: jax.Array) -> Any:
            p = lax.cond(x.sum() > 0, lambda x: x @ u, lambda x: -(x @ u), x)
            return jnp.tanh(h @ w + p), None
        return lax.scan(cell, h, xs)[0]

    check_pass(hoist_pass, conditional, *_rnn_args(), unchanged=True)
    check_pass(hoist_pass, rnn, *_rnn_args(steps=0), unchanged=True)


def test_a_stack_over_the_allowance_is_left_alone_with_the_figure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module("jaxpar.passes.hoist_scan_inputs")
    monkeypatch.setattr(module, "MAX_HOISTED_BYTES", 1024)
    result = check_pass(hoist_pass, rnn, *_rnn_args(), unchanged=True)
    (d,) = result.decisions
    assert d.kind == "left alone"
    assert "would stack 1.5 KiB over its 12 steps, more than the 1.0 KiB allowed" in d.reason


# ---------------------------------------------------------------- through jaxpar


def _hoisting(fun: Any, **options: Any) -> Any:
    return jaxpar.parallel_branches(fun, hoist_scan_inputs=True, measure=False, **options)


@pytest.mark.parametrize("target", ["cpu", "tpu", "gpu"])
def test_values_and_gradients_equal_jax_jit_on_every_target(target: str) -> None:
    args = _rnn_args()
    got = _hoisting(rnn, target=target)(*args)
    np.testing.assert_allclose(got[1], jax.jit(rnn)(*args)[1], rtol=1e-5, atol=1e-5)

    def loss(f: Any) -> Any:
        return lambda *a: f(*a)[1].sum()
    want = jax.grad(loss(rnn), argnums=(0, 1, 2, 3))(*args)
    grads = jax.grad(loss(_hoisting(rnn, target=target)), argnums=(0, 1, 2, 3))(*args)
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_under_vmap_and_in_the_lowered_text() -> None:
    h, xs, w, u = _rnn_args()
    hs = jnp.stack([h, h + 1.0])
    f = _hoisting(rnn, target="tpu")
    got = jax.vmap(f, in_axes=(0, None, None, None))(hs, xs, w, u)
    want = jax.vmap(rnn, in_axes=(0, None, None, None))(hs, xs, w, u)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    text = jax.jit(f).lower(h, xs, w, u).as_text()
    before_loop = text[:text.index("stablehlo.while")]
    # The moved matmul: all 12 steps' inputs at once, before the loop.
    assert "tensor<12x4x6xf32>, tensor<6x8xf32>) -> tensor<12x4x8xf32>" in before_loop


def test_inspect_names_what_moved() -> None:
    plan = jaxpar.inspect(rnn, hoist_scan_inputs=True, target="tpu")(*_rnn_args())
    line = next(x for x in plan.text().splitlines() if "hoisted:" in x)
    assert "1 matmul of its body read no carry: run for all 12 steps before the loop" in line
    assert "test_hoist_scan_inputs.py" in line
    assert [d.kind for d in plan.decisions if d.pass_name == "hoist_scan_inputs"] == ["hoisted"]


def test_off_by_default_on_every_target_and_measured_on_a_tpu() -> None:
    for target in ("cpu", "gpu", "tpu"):
        plan = jaxpar.inspect(rnn, target=target)(*_rnn_args())
        assert not [d for d in plan.decisions if d.pass_name == "hoist_scan_inputs"]
    tpu = targets.get("tpu")
    assert tpu.candidates["jaxpar, scan inputs hoisted"] == {"hoist_scan_inputs": True}
    assert tpu.candidates["jaxpar, scan inputs hoisted, unrolled by 8"] == {
        "hoist_scan_inputs": True, "unroll": 8}
    assert {"jaxpar, scan inputs hoisted",
            "jaxpar, scan inputs hoisted, unrolled by 8"} <= set(ORDER)


def test_the_one_pass_function_is_made_from_the_row() -> None:
    one_pass = vars(passes)["hoist_scan_inputs"]       # jaxpar.passes.hoist_scan_inputs
    closed = jax.make_jaxpr(rnn)(*_rnn_args())
    new, decisions = one_pass(closed, target="tpu")
    assert [d.kind for d in decisions] == ["hoisted"] and new is not closed
    assert "hoist_scan_inputs" in passes.__all__


def test_a_bad_value_names_the_option() -> None:
    with pytest.raises((TypeError, ValueError), match="hoist_scan_inputs"):
        jaxpar.parallel_branches(rnn, hoist_scan_inputs="yes")(*_rnn_args())
