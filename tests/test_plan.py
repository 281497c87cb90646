"""Planner behaviour on program shapes that stress the series-parallel decomposition."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers.programs import cnn_args, cnn_loss, run_optimized, two_tower_cnn
from helpers.trees import assert_tree_close, assert_tree_equal

import jaxpar

# These tests are about the decomposition: sections are forced past the GPU pricing
# (jaxpar/_plan/pricing.py, tested in tests/test_plan_pricing.py).
GPU = {"target": "gpu", "force_streams": True}


def test_forward_towers_share_one_section():
    plan = jaxpar.inspect(two_tower_cnn, **GPU)(*cnn_args())
    assert len(plan.sections) == 1
    convs = sorted(dict(r.primitives)["conv_general_dilated"] for r in plan.sections[0].regions)
    assert convs == [2, 3]


@pytest.mark.parametrize("transform", [jax.grad, jax.value_and_grad])
def test_backward_pass_gets_forward_and_backward_sections(transform):
    # The gradient program is not series-parallel (weight flips and weight gradients
    # hang off the chain); cheap loose ends are attached so both tower pairs are found.
    args = cnn_args()
    fn = transform(cnn_loss)
    plan = jaxpar.inspect(fn, **GPU)(*args)
    assert len(plan.sections) == 2
    assert all(len(s.regions) == 2 for s in plan.sections)
    fast = jaxpar.parallel_branches(fn, **GPU)
    assert_tree_close(run_optimized(fast, *args), jax.jit(fn)(*args), rtol=1e-5, atol=1e-6)


def heavy(x, w):
    return jnp.tanh(x @ w)


def test_cheap_branches_are_balanced_onto_streams():
    # Four branches each below min_cost_us, but two streams' worth together.
    def f(x, w1, w2, w3, w4):
        return sum(heavy(heavy(x, w), w) for w in (w1, w2, w3, w4))

    args = [jnp.ones((256, 256)) * 0.01] * 5
    plan = jaxpar.inspect(f, **GPU, min_cost_us=5.0, batch_branches=False,
                          batch_matmuls=False)(*args)
    assert len(plan.sections) == 1 and len(plan.sections[0].regions) == 2
    assert all(r.cost_us >= 5.0 for r in plan.sections[0].regions)
    # Raise the bar above what the overlap can hide: every branch is reported.
    plan = jaxpar.inspect(f, **GPU, min_cost_us=50.0, batch_branches=False,
                          batch_matmuls=False)(*args)
    assert plan.sections == ()
    assert sum(note.reason == "too cheap" for note in plan.left_alone) == 4


def test_n_shaped_dependencies_keep_valid_parallelism():
    # a -> c, b -> c, b -> d: not series-parallel.
    def f(x, y, w):
        a, b = heavy(heavy(x, w), w), heavy(heavy(y, w), w)
        c = heavy(heavy(a + b, w), w)
        d = heavy(heavy(b, w), w)
        return c, d

    args = [jnp.ones((512, 512)) * 0.01] * 3
    plan = jaxpar.inspect(f, **GPU)(*args)
    assert plan.num_streams == 2
    fast = jaxpar.parallel_branches(f, **GPU)
    assert_tree_close(fast(*args), jax.jit(f)(*args))


def test_async_limit_from_xla_flags_caps_streams(monkeypatch):
    def f(x, w1, w2, w3, w4):
        return sum(heavy(heavy(x, w), w) for w in (w1, w2, w3, w4))

    args = [jnp.ones((512, 512)) * 0.01] * 5
    # Identical branches: no batching.
    streams = {**GPU, "batch_branches": False, "batch_matmuls": False}
    assert jaxpar.inspect(f, **streams)(*args).num_streams == 2
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_experimental_parallel_async_compute_limit=4")
    plan = jaxpar.inspect(f, **streams)(*args)
    assert plan.num_streams == 4
    fast = jaxpar.parallel_branches(f, **streams)
    assert_tree_equal(fast(*args), jaxpar.parallel_branches(f, target="cpu")(*args))
