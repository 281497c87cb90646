"""bound_fusions, adversarially: the sums users write over many members' results.

What it must do: on target "gpu", after the batching passes slice members' results out
of their stacked arrays, a sum over 16 or more consecutive members of one stacked array
becomes one reduction; whatever the sum looks like in the user's code (``sum``,
``functools.reduce``, a loop with other work in between, a literal or an array to start
from, the member on the left, a range crossing batches, batches summed out of order,
members that are scalars, have a leading dimension of one or are pytrees, sums inside
``scan``/``cond``/``remat`` bodies), the decorated function computes ``jax.jit``'s values
(float32 to float rounding, integers exactly, complex and float64 too) and gradients, keeps
dtypes, shapes and weak types, and composes with ``vmap``/``jit``/``grad``; sums it must not
reduce (subtractions, short runs, members read elsewhere, weak-typed chains) keep their
values; nothing crashes (PRNG-key members included).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.passes import DecisionKind

MEMBERS = 40  # two batches of 20: every sum over all members crosses a batch boundary
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _args(count=MEMBERS, dtype=jnp.float32, rows=4):
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * count)
    xs = [jax.random.normal(k, (rows, 8)).astype(dtype) for k in keys[:count]]
    ws = [(jax.random.normal(k, (8, 8)) * 0.3).astype(dtype) for k in keys[count:]]
    return xs, ws


def _outs(xs, ws):
    return [jnp.tanh(x @ w) for x, w in zip(xs, ws, strict=True)]


def _reduces(fn, args):
    plan = jaxpar.inspect(fn, target="gpu")(*args)
    return any(d.kind == DecisionKind.SUMS_REDUCED for d in plan.decisions)


def _out_avals(fn, args):
    return [(a.shape, a.dtype, a.weak_type) for a in jax.make_jaxpr(fn)(*args).out_avals]


def _assert_close(got, want, **tol):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, **(tol or TOL))


def _check(fn, args, *, reduced, grad=True, **tol):
    """``fn`` decorated for the GPU: reduced (or not) as said, ``jax.jit``'s values,
    output types (weak types too) and, with ``grad``, gradients by every argument."""
    decorated = jaxpar.parallel_branches(fn, target="gpu")
    assert _reduces(fn, args) == reduced
    assert _out_avals(decorated, args) == _out_avals(fn, args)
    _assert_close(decorated(*args), jax.jit(fn)(*args), **tol)
    if grad:
        def loss(f):
            return lambda *a: sum(jnp.sum(jnp.real(leaf)) for leaf in jax.tree.leaves(f(*a)))
        argnums = tuple(range(len(args)))
        _assert_close(jax.grad(loss(decorated), argnums)(*args),
                      jax.grad(loss(fn), argnums)(*args), **tol)


def _reduced_with_add(xs, ws):
    return functools.reduce(operator.add, _outs(xs, ws))


def _loop_with_other_work(xs, ws):  # the mean of a sum built in a loop doing more
    acc, side = jnp.zeros((4, 8)), 0.0
    for i, o in enumerate(_outs(xs, ws)):
        acc = acc + o
        side = side + jnp.sin(xs[i]).sum()
    return acc / len(xs), side


def _from_a_literal(xs, ws):
    return sum(_outs(xs, ws), 5.0)


def _member_on_the_left_from_an_array(xs, ws):
    acc = jnp.full((4, 8), 3.0)
    for o in _outs(xs, ws):
        acc = o + acc
    return acc


def _range_across_batches(xs, ws):  # rows 11-19 of one batch and 0-18 of the next
    outs = _outs(xs, ws)
    return sum(outs[11:39]), outs[:11], outs[39:]


def _batches_in_reverse(xs, ws):
    outs = _outs(xs, ws)
    return sum(outs[20:] + outs[:20])


@pytest.mark.parametrize("fn", [_reduced_with_add, _loop_with_other_work, _from_a_literal,
                                _member_on_the_left_from_an_array, _range_across_batches,
                                _batches_in_reverse])
def test_sums_users_write_are_reduced_with_jits_values_and_gradients(fn):
    _check(fn, _args(), reduced=True)


def _subtracted_now_and_then(xs, ws):
    acc = jnp.ones((4, 8))
    for i, o in enumerate(_outs(xs, ws)):
        acc = acc - o if i % 3 == 0 else acc + o
    return acc


def _partial_sums_returned(xs, ws):  # a partial sum read every 10 members: runs of 10
    outs, parts = _outs(xs, ws), []
    acc = outs[0]
    for i, o in enumerate(outs[1:]):
        acc = acc + o
        if i % 10 == 9:
            parts.append(acc)
    return acc, parts


def _members_read_twice(xs, ws):
    outs = _outs(xs, ws)
    return sum(outs), [o * 2 for o in outs[::2]]


@pytest.mark.parametrize("fn", [_subtracted_now_and_then, _partial_sums_returned,
                                _members_read_twice])
def test_sums_that_are_not_runs_keep_their_adds_and_values(fn):
    _check(fn, _args(), reduced=False)


def test_integer_sums_are_exact_where_they_wrap():
    def summed(xs, ws):  # int32 wraps around: any order gives the same bits
        return sum((x @ w) * 100_000_000 for x, w in zip(xs, ws, strict=True))

    def small(xs, ws):
        return functools.reduce(operator.add, [x @ w + 3 for x, w in zip(xs, ws, strict=True)])

    ints = ([jnp.full((4, 8), i % 7 - 3, jnp.int32) for i in range(MEMBERS)],
            [jnp.full((8, 8), i % 5 - 2, jnp.int32) for i in range(MEMBERS)])
    uint8 = jax.tree.map(lambda a: a.astype(jnp.uint8), ints)
    for fn, args in ((summed, ints), (small, uint8)):
        _check(fn, args, reduced=True, grad=False, rtol=0, atol=0)


def test_complex_and_float64_sums():
    def waves(xs, ws):
        return sum(jnp.exp(1j * (x @ w)) for x, w in zip(xs, ws, strict=True))

    _check(waves, _args(), reduced=True)
    with jax.enable_x64(True):
        _check(_reduced_with_add, _args(dtype=jnp.float64), reduced=True, rtol=1e-12,
               atol=1e-12)


def test_weak_typed_members_keep_their_weak_type():
    def member(x, w):  # Python floats broadcast: a weak-typed float32 result
        return jnp.tanh(jnp.broadcast_to(x, (4, 8)) @ jnp.broadcast_to(w, (8, 8)))

    def weak(xs, ws):
        return sum(member(x, w) for x, w in zip(xs, ws, strict=True))

    def strong(xs, ws):
        return sum((member(x, w) for x, w in zip(xs, ws, strict=True)), jnp.zeros((4, 8)))

    floats = ([i / MEMBERS for i in range(MEMBERS)], [0.5 + i / MEMBERS for i in range(MEMBERS)])
    assert _out_avals(weak, floats)[0][2]  # what the decorated function must keep
    _check(weak, floats, reduced=False)  # a weak chain stays adds
    _check(strong, floats, reduced=True)


@pytest.mark.parametrize("shape", ["scalar", "leading one"])
def test_scalar_members_and_members_with_a_leading_one(shape):
    if shape == "scalar":
        def fn(xs, ws):
            return sum((jnp.tanh(x @ w).sum() for x, w in zip(xs, ws, strict=True)), 1.0)
        args = _args()
    else:
        fn, args = _reduced_with_add, _args(rows=1)
    _check(fn, args, reduced=True)


def test_pytree_members_sum_each_leaf():
    def member(x, w):
        h = x @ w
        return {"act": jnp.tanh(h), "energy": jnp.sin(h).sum()}

    def ensemble(xs, ws):
        return jax.tree.map(lambda *leaves: sum(leaves),
                            *[member(x, w) for x, w in zip(xs, ws, strict=True)])

    _check(ensemble, _args(), reduced=True)


def _in_scan(xs, ws):
    def body(carry, scale):
        total = sum(jnp.tanh((x + carry) @ w) for x, w in zip(xs, ws, strict=True))
        return carry * 0.5 + 0.1 * scale * total, total
    return jax.lax.scan(body, jnp.zeros((4, 8)), jnp.arange(3.0))


def _in_cond(xs, ws):
    return jax.lax.cond(xs[0][0, 0] > -10.0, lambda: sum(_outs(xs, ws)),
                        lambda: sum(_outs(ws, ws))[:4] * 2.0)


def _in_remat(xs, ws):
    return jax.checkpoint(lambda xs, ws: jnp.sin(sum(_outs(xs, ws))))(xs, ws)


@pytest.mark.parametrize("fn", [_in_scan, _in_cond, _in_remat])
def test_sums_in_nested_bodies(fn):
    _check(fn, _args(), reduced=True)


def test_the_decorated_sum_composes_with_vmap_jit_and_grad():
    xs, ws = _args()
    decorated = jaxpar.parallel_branches(_reduced_with_add, target="gpu")
    batched = [jnp.stack([x, -x, x * 0.5]) for x in xs]
    _assert_close(jax.vmap(decorated, in_axes=(0, None))(batched, ws),
                  jax.vmap(_reduced_with_add, in_axes=(0, None))(batched, ws))

    def grads(f):
        return jax.jit(jax.vmap(jax.grad(lambda xs, ws: f(xs, ws).sum(), argnums=1),
                                in_axes=(0, None)))(batched, ws)

    _assert_close(grads(decorated), grads(_reduced_with_add))


def test_prng_key_members_do_not_crash():
    def noisy(keys, ws):
        outs = [jnp.tanh(jax.random.normal(k, (4, 8)) @ w) for k, w in zip(keys, ws, strict=True)]
        return sum(outs), [jax.random.split(k)[0] for k in keys]

    keys, ws = list(jax.random.split(jax.random.key(1), MEMBERS)), _args()[1]
    got, got_keys = jaxpar.parallel_branches(noisy, target="gpu")(keys, ws)
    want, want_keys = jax.jit(noisy)(keys, ws)
    np.testing.assert_allclose(got, want, **TOL)
    for g, w in zip(got_keys, want_keys, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(jax.random.key_data(g), jax.random.key_data(w))


@pytest.mark.cpu_devices(4)
def test_a_reduced_sum_inside_a_shard_map_body():
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("x",))

    def sharded(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))

    xs, ws = _args(rows=16)  # 4 rows a device
    decorated = jaxpar.parallel_branches(_reduced_with_add, target="gpu")
    _assert_close(sharded(decorated)(xs, ws), sharded(_reduced_with_add)(xs, ws))
    text = sharded(decorated).lower(xs, ws).as_text()
    assert "stablehlo.reduce" in text


def test_the_same_sum_computed_twice_over_many_members():
    # share_common merges the second sum's chain into the first in one sweep (it merged a
    # link a round, and 80 links never settled in the walker's 64 rounds).
    def twice(xs, ws):
        outs = _outs(xs, ws)
        return sum(outs) + sum(outs)

    args = _args(80)
    got = jaxpar.parallel_branches(twice, target="gpu")(*args)
    np.testing.assert_allclose(got, jax.jit(twice)(*args), **TOL)


@pytest.mark.xfail(strict=True, reason=(
    "the reduction starts from +0.0 (XLA's reduce_sum), the chain from the first member: "
    "where every member is -0.0 the chain's sum is -0.0 and the reduced sum +0.0"))
def test_a_sum_of_negative_zeros_keeps_its_sign():
    def angles(xs, ws):  # every member masked off: tanh(negative) * 0.0 is -0.0
        total = functools.reduce(operator.add, [jnp.tanh(x @ w) * 0.0
                                                for x, w in zip(xs, ws, strict=True)])
        return jnp.arctan2(total, -1.0)  # -pi for -0.0, pi for +0.0

    xs, ws = _args()
    args = ([-jnp.abs(x) - 0.1 for x in xs], [jnp.abs(w) + 0.1 for w in ws])
    assert _reduces(angles, args)
    np.testing.assert_allclose(jaxpar.parallel_branches(angles, target="gpu")(*args),
                               jax.jit(angles)(*args), **TOL)
