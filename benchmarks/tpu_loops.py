"""Loop programs of many shapes, for checking the TPU target's decisions on the chip:
written after the profile (``jaxpar/targets/tpu.py``) and its rules were fixed. One of them,
``int_and_float_carry_n3000``, then prompted a rule (loops that divide integers stay
rolled); the other 19 were used for nothing but checking.

Each builder takes a size (``"s"``: tiny, for a dry run on the CPU; ``"m"``: the chip's)
and returns ``(fn, args)``. They vary what the profile weighs: the body's work against a
trip's latency (matmul widths 8 to 1024, elementwise-only bodies), the bytes a trip
slices and writes, the carry's size, the trip count (short, prime, long), the direction,
nesting, integer carries, loops under ``vmap`` and ``grad``, ``fori_loop`` and a
``while_loop`` of unknown trip count, and pairs of independent loops whose bodies differ
in size. ``benchmarks/tpu.py --parts loops`` times each against ``jax.jit``.

Example::

    import tpu_loops
    fn, args = tpu_loops.PROGRAMS["matmul_scan_w128_n1000"]("m")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Builder = Callable[[str], tuple[Callable[..., Any], tuple[Any, ...]]]
PROGRAMS: dict[str, Builder] = {}


def _normal(key: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32)


def _steps(size: str, steps: int) -> int:
    return min(steps, 16) if size == "s" else steps


def _width(size: str, width: int) -> int:
    return min(width, 16) if size == "s" else width


def _matmul_scan(width: int, steps: int) -> Builder:
    def build(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        d, n = _width(size, width), _steps(size, steps)

        def fn(c: jax.Array, w: jax.Array) -> jax.Array:
            return lax.scan(lambda c, _: (jnp.tanh(c @ w), None), c, None, length=n)[0]
        return fn, (_normal(0, (d, d)), _normal(1, (d, d), 1 / d ** 0.5))
    return build


for _w, _n in ((8, 5000), (32, 2000), (128, 1000), (128, 97), (512, 500), (1024, 200)):
    PROGRAMS[f"matmul_scan_w{_w}_n{_n}"] = _matmul_scan(_w, _n)


def _elementwise_scan(shape: tuple[int, ...], steps: int) -> Builder:
    def build(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        n = _steps(size, steps)
        s = tuple(_width(size, d) for d in shape)

        def fn(c: jax.Array, xs: jax.Array) -> tuple[jax.Array, jax.Array]:
            def body(c: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
                c = 0.99 * c + jnp.sin(x) * jnp.cos(c)
                return c, c.sum()
            return lax.scan(body, c, xs)
        return fn, (_normal(2, s), _normal(3, (n, *s)))
    return build


PROGRAMS["elementwise_vector_n3000"] = _elementwise_scan((1024,), 3000)
PROGRAMS["elementwise_256sq_n1000"] = _elementwise_scan((256, 256), 1000)


def _rnn_with_inputs(width: int, steps: int, reverse: bool = False) -> Builder:
    def build(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        d, n = _width(size, width), _steps(size, steps)

        def fn(h: jax.Array, xs: jax.Array, w: jax.Array, u: jax.Array) -> tuple[Any, Any]:
            def cell(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
                h = jnp.tanh(x @ w + h @ u)
                return h, h
            return lax.scan(cell, h, xs, reverse=reverse)
        return fn, (_normal(4, (8, d)), _normal(5, (n, 8, d)), _normal(6, (d, d), d ** -0.5),
                    _normal(7, (d, d), d ** -0.5))
    return build


PROGRAMS["rnn_inputs_w64_n2000"] = _rnn_with_inputs(64, 2000)
PROGRAMS["rnn_inputs_w256_n1000_reverse"] = _rnn_with_inputs(256, 1000, reverse=True)


def _big_carry(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    n, d = _steps(size, 1000), _width(size, 64)
    rows = 16 if size == "s" else 8192  # a 2 MiB accumulator beside a small matmul

    def fn(acc: jax.Array, c: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(carry: tuple[jax.Array, jax.Array], _: Any) -> tuple[Any, None]:
            acc, c = carry
            c = jnp.tanh(c @ w)
            return (acc + c.sum() * 1e-3, c), None
        return lax.scan(body, (acc, c), None, length=n)[0]
    return fn, (jnp.zeros((rows, 64), jnp.float32), _normal(8, (d, d)),
                _normal(9, (d, d), d ** -0.5))


PROGRAMS["big_carry_2mib_n1000"] = _big_carry


def _fori(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    n, d = _steps(size, 2000), _width(size, 128)

    def fn(c: jax.Array, w: jax.Array) -> jax.Array:
        return lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ w + i * 1e-3), c)
    return fn, (_normal(10, (d, d)), _normal(11, (d, d), d ** -0.5))


PROGRAMS["fori_matmul_n2000"] = _fori


def _while_unknown(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    d = _width(size, 128)

    def fn(c: jax.Array, w: jax.Array) -> jax.Array:
        def cond(state: tuple[jax.Array, jax.Array]) -> jax.Array:
            i, c = state
            return (i < 3000) & (jnp.abs(c).sum() > -1.0)
        def body(state: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            i, c = state
            return i + 1, jnp.tanh(c @ w)
        return lax.while_loop(cond, body, (jnp.int32(0), c))[1]
    return fn, (_normal(12, (d, d)), _normal(13, (d, d), d ** -0.5))


PROGRAMS["while_unknown_trips"] = _while_unknown


def _nested(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    outer, inner, d = _steps(size, 60), _steps(size, 60), _width(size, 64)

    def fn(c: jax.Array, w: jax.Array) -> jax.Array:
        def outer_body(c: jax.Array, _: Any) -> tuple[jax.Array, None]:
            c = lax.scan(lambda c, _: (jnp.tanh(c @ w), None), c, None, length=inner)[0]
            return c * 0.5, None
        return lax.scan(outer_body, c, None, length=outer)[0]
    return fn, (_normal(14, (d, d)), _normal(15, (d, d), d ** -0.5))


PROGRAMS["nested_60x60"] = _nested


def _int_and_float(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    n, d = _steps(size, 3000), _width(size, 32)

    def fn(c: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(carry: tuple[jax.Array, jax.Array], _: Any) -> tuple[Any, None]:
            k, c = carry
            return ((k * 3 + 1) % 1000, jnp.tanh(c @ w + k.astype(jnp.float32) * 1e-4)), None
        k, c = lax.scan(body, (jnp.int32(1), c), None, length=n)[0]
        return k, c
    return fn, (_normal(16, (d, d)), _normal(17, (d, d), d ** -0.5))


PROGRAMS["int_and_float_carry_n3000"] = _int_and_float


def _vmapped(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    n, d = _steps(size, 1000), _width(size, 64)

    def one(c: jax.Array, w: jax.Array) -> jax.Array:
        return lax.scan(lambda c, _: (jnp.tanh(c @ w), None), c, None, length=n)[0]
    return jax.vmap(one), (_normal(18, (8, d, d)), _normal(19, (8, d, d), d ** -0.5))


PROGRAMS["vmap8_scan_n1000"] = _vmapped


def _grad_lstm(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    n, d = _steps(size, 300), _width(size, 128)

    def loss(w: jax.Array, xs: jax.Array) -> jax.Array:
        def cell(carry: tuple[jax.Array, jax.Array], x: jax.Array) -> tuple[Any, jax.Array]:
            h, c = carry
            gates = jnp.concatenate([x, h], -1) @ w
            i, f, g, o = jnp.split(gates, 4, -1)
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            h = jax.nn.sigmoid(o) * jnp.tanh(c)
            return (h, c), h
        zeros = jnp.zeros((16, d), jnp.float32)
        return lax.scan(cell, (zeros, zeros), xs)[1].sum()
    return jax.grad(loss), (_normal(20, (2 * d, 4 * d), (2 * d) ** -0.5),
                            _normal(21, (n, 16, d)))


PROGRAMS["grad_lstm_w128_n300"] = _grad_lstm


def _unequal_pair(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    n = _steps(size, 2000)
    small, big = _width(size, 32), _width(size, 512)

    def fn(a: jax.Array, wa: jax.Array, b: jax.Array, wb: jax.Array) -> tuple[Any, Any]:
        ra = lax.scan(lambda c, _: (jnp.tanh(c @ wa), None), a, None, length=n)[0]
        rb = lax.scan(lambda c, _: (jnp.sin(c @ wb), None), b, None, length=n)[0]
        return ra, rb
    return fn, (_normal(22, (small, small)), _normal(23, (small, small), small ** -0.5),
                _normal(24, (big, big)), _normal(25, (big, big), big ** -0.5))


PROGRAMS["pair_w32_and_w512_n2000"] = _unequal_pair


def _three_same(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    n, d = _steps(size, 3000), _width(size, 64)

    def fn(c: jax.Array, ws: jax.Array) -> tuple[Any, ...]:
        return tuple(lax.scan(lambda c, _, w=ws[k]: (jnp.tanh(c @ w), None), c * (k + 1), None,
                              length=n)[0] for k in range(3))
    return fn, (_normal(26, (d, d)), _normal(27, (3, d, d), d ** -0.5))


PROGRAMS["three_identical_w64_n3000"] = _three_same


def _ys_heavy(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    n, d = _steps(size, 1000), _width(size, 256)

    def fn(c: jax.Array, xs: jax.Array) -> tuple[jax.Array, jax.Array]:
        return lax.scan(lambda c, x: (c * 0.9 + x, jnp.tanh(c) * 2.0), c, xs)
    return fn, (_normal(28, (d, d)), _normal(29, (n, d, d)))


PROGRAMS["ys_heavy_w256_n1000"] = _ys_heavy


# ------------------------------------------------------- while loops of unknown trips
# Written with the selected copies of ``unroll_while_loops`` (2026-12-06), not held out:
# loops whose end depends on a float or a tolerance, as ODE integrators and iterative
# solvers written by hand run them.


def _while_euler(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    t1, d = (0.16 if size == "s" else 10.0), _width(size, 128)

    def fn(y: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(state: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            t, y = state
            return t + 0.01, y + 0.01 * (jnp.sin(y) * a - 0.5 * y)
        return lax.while_loop(lambda s: s[0] < t1, body, (jnp.float32(0.0), y))
    return fn, (_normal(30, (8, d)), _normal(31, (8, d)))


PROGRAMS["while_euler_to_t1"] = _while_euler


def _while_rk4_mlp(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    t1, d = (0.08 if size == "s" else 5.0), _width(size, 64)

    def fn(y: jax.Array, w1: jax.Array, w2: jax.Array) -> tuple[jax.Array, jax.Array]:
        def field(y: jax.Array) -> jax.Array:
            return jnp.tanh(jnp.tanh(y @ w1) @ w2) - 0.1 * y

        def body(state: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            t, y = state
            h = 0.01
            k1 = field(y)
            k2 = field(y + 0.5 * h * k1)
            k3 = field(y + 0.5 * h * k2)
            k4 = field(y + h * k3)
            return t + h, y + h / 6.0 * (k1 + 2.0 * k2 + 2.0 * k3 + k4)
        return lax.while_loop(lambda s: s[0] < t1, body, (jnp.float32(0.0), y))
    return fn, (_normal(32, (16, d)), _normal(33, (d, d), d ** -0.5),
                _normal(34, (d, d), d ** -0.5))


PROGRAMS["while_rk4_mlp_to_t1"] = _while_rk4_mlp


def _while_newton(size: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    n = 64 if size == "s" else 4096

    def fn(a: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(state: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            i, x = state
            return i + 1, x - (x * x * x - a) / (3.0 * x * x)

        def go(state: tuple[jax.Array, jax.Array]) -> jax.Array:
            i, x = state
            return (jnp.max(jnp.abs(x * x * x - a) / a) > 1e-6) & (i < 200)
        return lax.while_loop(go, body, (jnp.int32(0), a + 1.0))
    return fn, (jnp.abs(_normal(35, (n,))) * 1e3 + 1.0,)


PROGRAMS["while_newton_cube_roots"] = _while_newton
