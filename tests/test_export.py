"""Symbolic shapes (``jax.export``'s shape polymorphism): a decorated function traces,
lowers, exports, serializes and runs on every target, with jax.jit's values, and its plan
says why nothing was rewritten."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.environment import fraction_of_examples, needs_plugin
from hypothesis import event, given
from hypothesis import strategies as st
from jax import export, lax
from programs import feature_programs, programs, scan_programs, stacked_batch

import jaxpar
from jaxpar._plan import REASON_SYMBOLIC

TARGETS = ["cpu", "gpu"]


def branches_and_scan(a: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two independent matmul chains, and a scan over the symbolic leading axis."""
    left = jnp.tanh(a @ w) @ w
    right = jnp.sin(a @ w.T) @ w.T
    carry, ys = lax.scan(lambda c, x: (c + jnp.tanh(x @ w), c), jnp.zeros(w.shape[1]), a)
    return left + right, carry + ys.sum(0)


def _specs(batch: str = "b") -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    return (jax.ShapeDtypeStruct(export.symbolic_shape(f"{batch}, 8"), jnp.float32),
            jax.ShapeDtypeStruct((8, 8), jnp.float32))


def _args(batch: int) -> tuple[jax.Array, jax.Array]:
    keys = jax.random.split(jax.random.PRNGKey(batch), 2)
    return (jax.random.normal(keys[0], (batch, 8)), jax.random.normal(keys[1], (8, 8)) / 3)


@pytest.mark.parametrize("target", TARGETS)
def test_export_serializes_and_runs_like_jax_jit(target: str) -> None:
    decorated = jaxpar.parallel_branches(branches_and_scan, target=target)
    exported = export.export(jax.jit(decorated))(*_specs())
    reference = export.export(jax.jit(branches_and_scan))(*_specs())
    restored = export.deserialize(exported.serialize())
    assert str(restored.in_avals[0].shape) == "(b, 8)"
    for batch in (1, 5, 12):
        args = _args(batch)
        got, want = restored.call(*args), reference.call(*args)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("target", TARGETS)
def test_eval_shape_trace_and_lower_with_symbolic_sizes(target: str) -> None:
    decorated = jaxpar.parallel_branches(branches_and_scan, target=target)
    specs = _specs()
    shapes = decorated.eval_shape(*specs)
    assert [str(s.shape) for s in shapes] == ["(b, 8)", "(8,)"]
    assert "b" in decorated.trace(*specs).jaxpr.pretty_print()
    assert "stablehlo" in decorated.lower(*specs).as_text()
    # Inside an outer export, under grad and vmap too.
    loss = jax.grad(lambda a, w: decorated(a, w)[0].sum(), argnums=1)
    exported = export.export(jax.jit(jax.vmap(loss, in_axes=(0, None))))(
        jax.ShapeDtypeStruct(export.symbolic_shape("n, b, 8"), jnp.float32), specs[1])
    a, w = _args(4)
    stacked = jnp.stack([a, 2 * a])
    want = jax.vmap(jax.grad(lambda a, w: branches_and_scan(a, w)[0].sum(), argnums=1),
                    in_axes=(0, None))(stacked, w)
    np.testing.assert_allclose(exported.call(stacked, w), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("target", TARGETS)
def test_inspect_says_the_sizes_are_symbolic(target: str) -> None:
    plan = jaxpar.inspect(branches_and_scan, target=target)(*_specs())
    assert not plan.sections and not plan.decisions
    (note,) = plan.left_alone
    assert note.reason == REASON_SYMBOLIC
    assert "sizes b are symbolic" in note.detail
    text = plan.text()
    assert "symbolic shapes" in text and "runs as jax.jit runs it" in text
    assert plan.to_dict()["left_alone"][0]["reason"] == REASON_SYMBOLIC


def test_concrete_calls_after_a_symbolic_trace_are_still_planned() -> None:
    """A symbolic signature does not stand for the concrete ones: a call with concrete
    shapes is planned as usual (the two matmul chains batched or on streams, or a reason)."""
    decorated = jaxpar.parallel_branches(branches_and_scan, target="gpu")
    decorated.eval_shape(*_specs())
    plan = jaxpar.inspect(decorated)(*_args(16))
    assert all(n.reason != REASON_SYMBOLIC for n in plan.left_alone)
    got = decorated(*_args(16))
    want = jax.jit(branches_and_scan)(*_args(16))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@needs_plugin
def test_gpu_preview_names_the_symbolic_sizes() -> None:
    """A deviceless compile needs known sizes (as jax.jit's compile does): a clear error."""
    with pytest.raises(ValueError, match="sizes b are symbolic"):
        jaxpar.gpu_preview(jaxpar.parallel_branches(branches_and_scan), *_specs())


# Random programs (``tests/programs.py``) with a symbolic batch axis: ``vmap`` of the
# program over ``b``, exported through jaxpar and through jax.jit alike.
@fraction_of_examples(0.5)
@given(program=st.one_of(programs(), scan_programs(), feature_programs()),
       options=st.sampled_from([{"target": "gpu"}, {"target": "cpu"},
                                {"target": "gpu", "min_cost_us": 0.0, "force_streams": True}]))
def test_random_programs_export_with_a_symbolic_batch_like_jax_jit(program, options) -> None:
    batched = jax.vmap(program.fn)
    (b,) = export.symbolic_shape("b")  # one scope for every argument's shape
    specs = [jax.ShapeDtypeStruct((b, *arg.shape), arg.dtype) for arg in program.args]
    try:
        reference = export.export(jax.jit(batched))(*specs)
    except Exception as error:
        event(f"jax.jit refuses: {type(error).__name__}")
        with pytest.raises(type(error)):
            export.export(jax.jit(jaxpar.parallel_branches(batched, **options)))(*specs)
        return
    exported = export.export(jax.jit(jaxpar.parallel_branches(batched, **options)))(*specs)
    restored = export.deserialize(exported.serialize())
    event("exported")
    args = stacked_batch(program.args)
    got, want = restored.call(*args), reference.call(*args)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
