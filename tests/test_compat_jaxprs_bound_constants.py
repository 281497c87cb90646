"""A primitive that keeps an open jaxpr among its parameters and binds that jaxpr's
constants itself, as equinox's primitives do (lineax's ``linear_solve`` holds the
closure-converted operator in its static parameters and passes the closure's values as
operands; optimistix's Newton and Levenberg-Marquardt, and diffrax's implicit solvers and
root-finding events, call it). jaxpar raised in ``make_loops_static`` on jax 0.10.2 (the
jaxpr's constvars had no values), under every option, ``inspect`` included."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

import jaxpar

apply_p = Primitive("apply_closure_converted")
apply_p.multiple_results = True


def _impl(*operands: Any, static: tuple[Any, ...]) -> list[Any]:
    jaxpr, count = static
    consts, args = operands[:count], operands[count:]
    return jax.core.eval_jaxpr(jaxpr, list(consts), *args)


apply_p.def_impl(_impl)
apply_p.def_abstract_eval(lambda *operands, static: [v.aval for v in static[0].outvars])
mlir.register_lowering(apply_p, mlir.lower_fun(_impl, multiple_results=True))


def _apply(fn: Any, x: jax.Array) -> jax.Array:
    """``fn(x)`` through ``apply_p``, the closure's values as operands (equinox's
    ``filter_closure_convert`` and ``filter_primitive_bind``)."""
    closed = jax.make_jaxpr(fn)(x)
    out, = apply_p.bind(*closed.consts, x, static=(closed.jaxpr, len(closed.consts)))
    return out


def program(a: jax.Array, b: jax.Array) -> jax.Array:
    def step(carry: jax.Array, _: Any) -> tuple[jax.Array, None]:
        # The operator closes over a traced value of the loop: a constvar of the jaxpr in
        # the parameters, bound by the equation's operands.
        return _apply(lambda v: jnp.tanh(a * carry) * v + v, b) * 0.5 + carry, None
    left = jax.lax.scan(step, a, None, length=6)[0]
    right = _apply(lambda v: jnp.sin(b) @ v * v, a)
    return left + right


ARGS = (jnp.linspace(0.5, 2.0, 8), jnp.linspace(-1.0, 1.0, 8))


def test_the_primitive_holds_a_jaxpr_whose_constants_it_binds() -> None:
    eqns = jax.make_jaxpr(program)(*ARGS).jaxpr.eqns
    held = [e.params["static"][0] for e in eqns if e.primitive is apply_p]
    assert held and all(j.constvars for j in held)  # what made jaxpar raise


@pytest.mark.parametrize("options", [{}, {"target": "tpu", "measure": False},
                                     {"target": "gpu"},
                                     {"target": "tpu", "measure": False, "unroll": 4,
                                      "hoist_scan_inputs": True}])
def test_such_a_program_runs_and_equals_jax_jit(options: dict[str, Any]) -> None:
    want = jax.jit(program)(*ARGS)
    decorated = jaxpar.parallel_branches(program, **options)
    np.testing.assert_allclose(decorated(*ARGS), want, rtol=1e-6)
    planned = {k: v for k, v in options.items() if k != "measure"}  # inspect runs nothing
    report = jaxpar.inspect(program, **planned)(*ARGS)
    assert report.text(verbose=True).startswith("jaxpar plan for `program`")


HOST_CALLS: list[int] = []


def _host(v: np.ndarray) -> np.ndarray:
    HOST_CALLS.append(1)
    return np.asarray(v, np.float32) * 0.5


def with_callback_inside(a: jax.Array, n: jax.Array) -> jax.Array:
    """A ``while`` whose body calls the host inside the primitive's held jaxpr: read, not
    opened, the jaxpr still tells the passes and the measuring thread what it holds."""
    def body(state: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        i, x = state
        y = _apply(lambda v: jax.pure_callback(_host, jax.ShapeDtypeStruct(v.shape, v.dtype),
                                               v * a), x)
        return i + 1, jnp.tanh(y + x)
    return jax.lax.while_loop(lambda s: s[0] < n, body, (jnp.int32(0), a))[1]


@pytest.mark.parametrize("options", [{"target": "tpu", "measure": False, "unroll_while": 4},
                                     {"target": "tpu", "measure": True}])
def test_a_callback_in_such_a_jaxpr_runs_as_often_as_under_jax_jit(options: dict[str, Any]
                                                                    ) -> None:
    from jaxpar._dispatch import measuring

    args = (ARGS[0], jnp.int32(5))
    HOST_CALLS.clear()
    want = jax.jit(with_callback_inside)(*args)
    assert len(HOST_CALLS) == 5
    decorated = jaxpar.parallel_branches(with_callback_inside, **options)
    for _ in range(4):  # measuring decides at a later call, on its thread
        HOST_CALLS.clear()
        np.testing.assert_allclose(decorated(*args), want, rtol=1e-6)
        measuring.wait_idle()
        # Copies past the loop's stop, or candidates timed, would call it more often.
        assert len(HOST_CALLS) == 5
