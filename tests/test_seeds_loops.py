"""The loop rewrites on the two-scan program, checked down to the compiled H200 loops.

Plain: two `while` loops of 10,000 trips each. jaxpar with target="gpu" and default
options: the two loops fused into one and unrolled by the GPU model's fastest factor (16:
625 trips); without unrolling, one fused loop of 10,000 trips. Identical bodies: one loop
running a batched matmul.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from helpers.environment import needs_plugin
from helpers.programs import seed_002, seed_002_specs, seed_002_step_sin, seed_002_step_tanh
from jax import lax
from pass_checker import assert_same_gradients, assert_same_outputs, sum_loss

import jaxpar
from jaxpar._compiled import compile_for_gpu, parse_schedule
from jaxpar.passes import SUBGRAPH_KINDS


def seed_002_identical(a, b, xs1, xs2):
    return lax.scan(seed_002_step_tanh, a, xs1)[0], lax.scan(seed_002_step_tanh, b, xs2)[0]


def values(n, steps, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(keys[0], (n, n)) / n, jax.random.normal(keys[1], (n, n)) / n,
            jax.random.normal(keys[2], (steps, n, n)) / n,
            jax.random.normal(keys[3], (steps, n, n)) / n)


def total_trips(schedule):
    return sum(loop.known_trip_count for loop in schedule.while_loops)


@needs_plugin
def test_plain_two_scans_are_two_loops_of_10000_trips():
    schedule = parse_schedule(compile_for_gpu(seed_002, *seed_002_specs()))
    assert sorted(loop.known_trip_count for loop in schedule.while_loops) == [10_000, 10_000]


@needs_plugin
def test_default_gpu_options_run_the_loops_the_plan_says_with_fewer_trips():
    # By default the two scans are fused and the fused scan unrolled by the factor the GPU
    # model rates fastest (16, as far as each scan apart would be). The plan says so; the
    # compiled loop is the plan's.
    fast = jaxpar.parallel_branches(seed_002, target="gpu")
    schedule = parse_schedule(compile_for_gpu(fast, *seed_002_specs()))
    plan = jaxpar.inspect(fast)(*seed_002_specs())
    loops = [d for d in plan.decisions if d.kind not in SUBGRAPH_KINDS]
    assert [d.kind for d in loops] == ["fused", "unrolled"]
    assert loops[1].unroll == 16 and loops[1].trips_after == 625
    assert plan.memory is not None and not plan.memory.left_out
    assert [loop.known_trip_count for loop in schedule.while_loops] == [loops[1].trips_after]
    assert total_trips(schedule) <= 10_000  # plain: 20,000
    # Without unrolling, fused: one loop of 10,000 trips.
    fused = jaxpar.parallel_branches(seed_002, target="gpu", unroll=None)
    schedule = parse_schedule(compile_for_gpu(fused, *seed_002_specs()))
    assert [loop.known_trip_count for loop in schedule.while_loops] == [10_000]
    decisions = jaxpar.inspect(fused)(*seed_002_specs()).decisions
    assert decisions[0].kind == "fused"
    assert decisions[0].trips_before == 20_000 and decisions[0].trips_after == 10_000


@needs_plugin
def test_identical_bodies_become_one_loop_with_a_batched_matmul():
    fast = jaxpar.parallel_branches(seed_002_identical, target="gpu")
    text = compile_for_gpu(fast, *seed_002_specs())
    schedule = parse_schedule(text)
    assert len(schedule.while_loops) == 1
    assert schedule.while_loops[0].known_trip_count <= 10_000
    # The batched matmul: a dot over both members at once (leading batch dimension 2).
    assert re.search(r"= f32\[2,(?:\d+,)*100,100\]\{[\d,]*\} dot\(.*lhs_batch_dims=\{0", text)
    assert next(d.kind for d in jaxpar.inspect(fast)(*seed_002_specs()).decisions) == "batched"


def test_default_gpu_options_same_values_and_gradients():
    args = values(16, 300)
    fast = jaxpar.parallel_branches(seed_002, target="gpu")
    assert_same_outputs(fast, jax.jit(seed_002), args, tolerance={"rtol": 1e-6, "atol": 1e-6})
    assert_same_gradients(fast, seed_002, args, tolerance={"rtol": 1e-4, "atol": 1e-6},
                          argnums=(0, 1, 2, 3), loss=sum_loss)


def forward_backward(h1, h2, xs, w1, w2):
    forward = lax.scan(lambda h, x: (jnp.tanh(h @ w1 + x), h), h1, xs)
    backward = lax.scan(lambda h, x: (jnp.sin(x @ w2) * 0.5 + 0.5 * h, h.sum()), h2, xs,
                        reverse=True)
    return forward, backward


def test_forward_and_reverse_scans_with_different_bodies():
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    args = (jax.random.normal(keys[0], (4, 16)), jax.random.normal(keys[1], (4, 16)),
            jax.random.normal(keys[2], (50, 4, 16)), jax.random.normal(keys[3], (16, 16)) / 4,
            jax.random.normal(keys[4], (16, 16)) / 4)
    # Without unrolling, which the model rates faster apart here (test_pipeline).
    fast = jaxpar.parallel_branches(forward_backward, target="gpu", unroll=None)
    assert next(d.kind for d in jaxpar.inspect(fast)(*args).decisions) == "fused"
    assert_same_outputs(fast, jax.jit(forward_backward), args,
                        tolerance={"rtol": 1e-6, "atol": 1e-6})
    assert_same_gradients(fast, forward_backward, args, tolerance={"rtol": 1e-5, "atol": 1e-6},
                          argnums=(0, 1, 3, 4), loss=sum_loss)


def unequal(a, b, xs1, xs2):
    return lax.scan(seed_002_step_tanh, a, xs1)[0], lax.scan(seed_002_step_sin, b, xs2)[0]


def test_scans_of_7000_and_10000_steps():
    keys = jax.random.split(jax.random.PRNGKey(2), 4)
    args = (jax.random.normal(keys[0], (4, 4)) / 4, jax.random.normal(keys[1], (4, 4)) / 4,
            jax.random.normal(keys[2], (7_000, 4, 4)) / 4,
            jax.random.normal(keys[3], (10_000, 4, 4)) / 4)
    fast = jaxpar.parallel_branches(unequal, target="gpu", unroll=None)
    plan = jaxpar.inspect(fast)(*args)
    fused = [d for d in plan.decisions if d.kind == "fused"]
    assert fused and fused[0].trips_before == 17_000
    assert_same_outputs(fast, jax.jit(unequal), args, tolerance={"rtol": 1e-6, "atol": 1e-6})
    assert_same_gradients(fast, unequal, args, tolerance={"rtol": 1e-4, "atol": 1e-6},
                          argnums=(0, 1), loss=sum_loss)
