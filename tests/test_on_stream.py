"""`jaxpar.on_stream`: the manual API puts one function on one stream."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers.lowered import (
    GROUP_ATTRIBUTE,
    STREAM_ATTRIBUTE,
    lower_for_gpu,
    nested_stream_calls,
    stream_calls,
)
from helpers.programs import LOOPS_OFF, two_scans, two_scans_args
from helpers.trees import assert_tree_close, assert_tree_equal

import jaxpar


def layer(x, w):
    return jnp.tanh(x @ w)


def _args():
    return jnp.linspace(-1.0, 1.0, 64).reshape(8, 8), jnp.eye(8) * 0.5


def test_lowers_to_one_annotated_call():
    fn = jaxpar.on_stream(2)(layer)
    calls = stream_calls(lower_for_gpu(fn, *_args()))
    assert len(calls) == 1
    (_, attrs) = calls[0]
    assert attrs[STREAM_ATTRIBUTE] == "2"
    assert attrs["inlineable"] == "false"
    assert GROUP_ATTRIBUTE not in attrs


def test_scheduling_group():
    fn = jaxpar.on_stream(1, scheduling_group=5)(layer)
    (_, attrs), = stream_calls(lower_for_gpu(fn, *_args()))
    assert attrs == {STREAM_ATTRIBUTE: "1", "inlineable": "false", GROUP_ATTRIBUTE: "5"}


def test_values_and_metadata():
    fn = jaxpar.on_stream(3)(layer)
    assert fn.__name__ == "layer"
    assert fn.__wrapped__ is layer
    assert_tree_equal(fn(*_args()), jax.jit(layer)(*_args()))


def test_kwargs_and_pytrees():
    def f(params, *, x, shift=None):
        out = {"y": jnp.tanh(x @ params["w"]) + params["b"]}
        if shift is not None:
            out["z"] = out["y"] + shift
        return out

    fn = jaxpar.on_stream(1)(f)
    x, w = _args()
    params = {"w": w, "b": jnp.float32(1.0)}
    assert_tree_equal(fn(params, x=x), jax.jit(lambda p, x: f(p, x=x))(params, x))
    assert_tree_equal(fn(params, x=x, shift=2.0),
                      jax.jit(lambda p, x: f(p, x=x, shift=2.0))(params, x))
    (_, attrs), = stream_calls(lower_for_gpu(lambda p, x: fn(p, x=x), params, x))
    assert attrs[STREAM_ATTRIBUTE] == "1"


def test_two_calls_overlap_in_one_group():
    fwd = jaxpar.on_stream(1, scheduling_group=1)(layer)
    bwd = jaxpar.on_stream(2, scheduling_group=1)(layer)
    x, w = _args()
    calls = stream_calls(lower_for_gpu(lambda x, w: fwd(x, w) + bwd(w, x), x, w))
    assert sorted(a[STREAM_ATTRIBUTE] for _, a in calls) == ["1", "2"]
    assert {a[GROUP_ATTRIBUTE] for _, a in calls} == {"1"}


def test_composes_with_jit():
    fn = jaxpar.on_stream(2)(layer)
    x, w = _args()
    assert_tree_equal(jax.jit(fn)(x, w), jax.jit(layer)(x, w))
    assert_tree_equal(jax.jit(lambda x, w: fn(x, w) * 2)(x, w), jax.jit(layer)(x, w) * 2)


def test_composes_with_grad():
    fn = jaxpar.on_stream(2)(layer)
    x, w = _args()

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w) ** 2)

    assert_tree_close(jax.grad(loss(fn), argnums=(0, 1))(x, w),
                      jax.grad(loss(layer), argnums=(0, 1))(x, w), 1e-6, 1e-6)
    text = lower_for_gpu(jax.grad(loss(fn)), x, w)
    calls = stream_calls(text)
    # The backward pass gets its own annotated call with the same attributes.
    assert len(calls) >= 2
    assert {a[STREAM_ATTRIBUTE] for _, a in calls} == {"2"}
    assert nested_stream_calls(text) == []


def test_composes_with_vmap():
    fn = jaxpar.on_stream(1)(layer)
    x, w = _args()
    xs = jnp.stack([x, 2 * x, 3 * x])
    assert_tree_equal(jax.vmap(fn, in_axes=(0, None))(xs, w),
                      jax.jit(jax.vmap(layer, in_axes=(0, None)))(xs, w))
    assert len(stream_calls(lower_for_gpu(jax.vmap(fn, in_axes=(0, None)), xs, w))) == 1


def test_inside_parallel_branches_is_left_alone():
    fn = jaxpar.on_stream(4)(layer)

    def program(x, w):
        return fn(x, w) + layer(w, x)

    g = jaxpar.parallel_branches(program, target="gpu", min_cost_us=0.0)
    text = lower_for_gpu(g, *_args())
    assert nested_stream_calls(text) == []
    assert "4" in [a[STREAM_ATTRIBUTE] for _, a in stream_calls(text)]
    assert_tree_close(g(*_args()), jax.jit(program)(*_args()), 1e-6, 1e-6)


# --- nesting -------------------------------------------------------------------------------


def test_on_stream_inside_on_stream_raises():
    inner = jaxpar.on_stream(2)(layer)
    outer = jaxpar.on_stream(1)(lambda x, w: inner(x, w) + 1.0)
    with pytest.raises(ValueError, match="nested stream calls"):
        outer(*_args())
    with pytest.raises(ValueError, match="nested stream calls"):
        jax.jit(outer)(*_args())


def test_on_stream_around_streamed_parallel_branches_raises():
    g = jaxpar.parallel_branches(two_scans, target="gpu", **LOOPS_OFF)
    outer = jaxpar.on_stream(1)(g)
    with pytest.raises(ValueError, match="nested stream calls"):
        outer(*two_scans_args())


def test_on_stream_around_cpu_parallel_branches_is_fine():
    g = jaxpar.parallel_branches(two_scans, target="cpu")
    outer = jaxpar.on_stream(1)(g)
    args = two_scans_args()
    assert_tree_equal(outer(*args), jax.jit(two_scans)(*args))
    assert len(stream_calls(lower_for_gpu(outer, *args))) == 1


# --- bad arguments -------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, True, False, 1.5, "1", None, 2.0])
def test_bad_stream_ids(bad):
    with pytest.raises((TypeError, ValueError),
                       match=r"stream must be an int >= 1|stream must be >= 1"):
        jaxpar.on_stream(bad)


@pytest.mark.parametrize("bad", [0, -3, True, 1.5, "2"])
def test_bad_scheduling_group(bad):
    with pytest.raises((TypeError, ValueError), match="scheduling_group"):
        jaxpar.on_stream(1, scheduling_group=bad)


def test_bad_scheduling_group_error_is_about_groups_not_stream_ids():
    with pytest.raises(ValueError, match="scheduling_group must be >= 1") as error:
        jaxpar.on_stream(1, scheduling_group=0)
    assert "stream id" not in str(error.value)


def test_bad_stream_types():
    with pytest.raises(TypeError, match="stream"):
        jaxpar.on_stream(True)
    with pytest.raises(TypeError, match="stream"):
        jaxpar.on_stream("1")
    with pytest.raises(ValueError, match="stream"):
        jaxpar.on_stream(0)


def test_non_callable():
    # The hint shows on_stream's own call form (it takes no function as first argument).
    with pytest.raises(TypeError, match=r"callable.*call on_stream\(stream\)\(fun\)\."):
        jaxpar.on_stream(1)(42)


def test_function_given_as_the_stream_shows_the_decorator_form():
    with pytest.raises(TypeError, match=r"on_stream takes the stream id.*on_stream\(1\)\(fun\)"):
        jaxpar.on_stream(layer)
    # The function first and the stream after it, as parallel_branches takes them; and a
    # scheduling group given by position.
    for args in ((layer, 1), (1, 2)):
        with pytest.raises(TypeError, match=r"on_stream\(1\)\(fun\).*scheduling_group= by "
                                            r"keyword.*got on_stream\("):
            jaxpar.on_stream(*args)


def test_nesting_detector_sees_hand_built_nesting():
    """The helper the other tests rely on finds a stream call nested in another one."""
    try:  # jax >= 0.11
        from jax.experimental.xla_metadata import xla_metadata_call
    except ImportError:  # jax 0.8 - 0.10
        from jax.experimental.scheduling_groups import xla_metadata_call

    attrs = {STREAM_ATTRIBUTE: "1", "inlineable": "false"}
    inner = xla_metadata_call(layer, **{**attrs, STREAM_ATTRIBUTE: "2"})
    outer = xla_metadata_call(lambda x, w: jax.jit(inner)(x, w) * 2, **attrs)
    text = lower_for_gpu(outer, *_args())
    assert len(stream_calls(text)) == 2
    assert len(nested_stream_calls(text)) == 1
