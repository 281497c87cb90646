"""The user stories (seed programs), checked down to the compiled GPU schedule.

The two-scan program (two scans with different bodies) must become two stream-annotated
calls, one per loop, in one scheduling group, and XLA:GPU (compiled deviceless for an H200)
must have both in flight at once. A four-branch block gets at least two streams; a pure
chain gets none.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.environment import needs_plugin
from helpers.lowered import function_bodies, lower_for_gpu, stream_calls
from helpers.programs import LOOPS_OFF, four_matmul_branches, four_matmul_branches_args, seed_002
from helpers.trees import assert_tree_close, assert_tree_equal

import jaxpar
import jaxpar._compiled.preview as _preview
from jaxpar._compiled import compile_for_gpu, parse_schedule

# XLA in these jaxlibs kills the process (SIGSEGV) compiling a stream-annotated loop
# deviceless; tests/test_compiled.py checks that schedule from XLA's dump in a child.
crashes_on_annotated_loops = pytest.mark.skipif(
    jax.lib.__version__ in _preview._CRASHES_ON_ANNOTATED_LOOPS,
    reason=f"XLA in jaxlib {jax.lib.__version__} segfaults compiling annotated loops")

# Stream tests force their sections past the GPU pricing (jaxpar/_plan/pricing.py), which refuses
# them under XLA's default CUDA-graph mode (LOOPS_OFF, from helpers.programs, forces them
# too); tests/test_plan_pricing.py covers that choice.
# The four branches are identical, so by default the GPU target batches them into one vmapped
# chain (tests/test_batch_branches.py); here streams are what is tested.
STREAMS = {"target": "gpu", "batch_branches": False, "batch_matmuls": False,
           "force_streams": True}


def seed_002_args(steps=20):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    return (jax.random.normal(keys[0], (100, 100)) * 0.1,
            jax.random.normal(keys[1], (100, 100)) * 0.1,
            jax.random.normal(keys[2], (steps, 100, 100)) * 0.1,
            jax.random.normal(keys[3], (steps, 100, 100)) * 0.1)


def pure_chain(x, w):
    for _ in range(6):
        x = jnp.tanh(x @ w)
    return x


def test_two_scans_lower_to_two_annotated_loops_in_one_group():
    args = seed_002_args()
    fast = jaxpar.parallel_branches(seed_002, target="gpu", **LOOPS_OFF)
    assert_tree_equal(fast(*args), jax.jit(seed_002)(*args))
    text = lower_for_gpu(fast, *args)
    calls = stream_calls(text)
    assert sorted(attrs["_xla_stream_annotation"] for _, attrs in calls) == ["1", "2"]
    assert len({attrs["_scheduling_group_id"] for _, attrs in calls}) == 1  # one shared group
    assert all(attrs["inlineable"] == "false" for _, attrs in calls)
    bodies = function_bodies(text)
    for callee, _ in calls:  # one loop per call
        assert sum("stablehlo.while" in line for line in bodies[callee]) == 1


def test_two_scans_gradients_match():
    args = seed_002_args(steps=5)
    fast = jaxpar.parallel_branches(seed_002, target="gpu", **LOOPS_OFF)

    def loss(fn):
        return lambda a, b: sum(jnp.sum(o) for o in fn(a, b, *args[2:]))

    assert_tree_close(jax.grad(loss(fast), argnums=(0, 1))(*args[:2]),
                      jax.grad(loss(seed_002), argnums=(0, 1))(*args[:2]), rtol=1e-5, atol=1e-6)


@needs_plugin
@crashes_on_annotated_loops
def test_two_scans_both_loops_in_flight_on_h200():
    fast = jaxpar.parallel_branches(seed_002, target="gpu", **LOOPS_OFF)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in seed_002_args()]
    schedule = parse_schedule(compile_for_gpu(fast, *specs, gpu="h200"))
    events = [(e.phase, e.name) for e in schedule.entry_schedule.events if e.kind == "compute"]
    phases = [phase for phase, _ in events]
    assert phases == ["start", "start", "done", "done"], events
    assert schedule.max_async_calls_in_flight == 2
    assert schedule.stream_ids == frozenset({1, 2})
    assert all(loop.known_trip_count == 20 for loop in schedule.while_loops)
    assert len(schedule.while_loops) == 2


@needs_plugin
def test_unannotated_two_scans_run_loops_back_to_back_on_h200():
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in seed_002_args()]
    schedule = parse_schedule(compile_for_gpu(seed_002, *specs, gpu="h200"))
    assert schedule.max_async_calls_in_flight == 0
    assert len(schedule.while_loops) == 2


def test_four_branches_get_at_least_two_streams():
    args = four_matmul_branches_args()
    fast = jaxpar.parallel_branches(four_matmul_branches, **STREAMS)
    plan = jaxpar.inspect(fast)(*args)
    assert plan.num_streams >= 2
    assert len(plan.sections) == 1
    regions = plan.sections[0].regions
    assert all(dict(r.primitives).get("dot_general", 0) >= 2 for r in regions)
    calls = stream_calls(lower_for_gpu(fast, *args))
    assert len({attrs["_xla_stream_annotation"] for _, attrs in calls}) >= 2
    # On the CPU the regions are calls: at the tests' -O0 (conftest) XLA:CPU compiles
    # their bodies apart, a few elements an ulp off (bit-exact with JAXPAR_FULL=1).
    assert_tree_close(fast(*args), jax.jit(four_matmul_branches)(*args), rtol=1e-6, atol=1e-7)


@needs_plugin
def test_four_branches_overlap_on_h200():
    fast = jaxpar.parallel_branches(four_matmul_branches, **STREAMS)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in four_matmul_branches_args()]
    schedule = parse_schedule(compile_for_gpu(fast, *specs, gpu="h200"))
    assert schedule.max_async_calls_in_flight == 2


def test_pure_chain_gets_no_streams():
    x = jnp.ones((512, 512)) * 0.01
    fast = jaxpar.parallel_branches(pure_chain, target="gpu")
    plan = jaxpar.inspect(fast)(x, x)
    assert plan.sections == ()
    assert any(note.reason == "dependent" for note in plan.left_alone)
    assert stream_calls(lower_for_gpu(fast, x, x)) == []
    np.testing.assert_array_equal(fast(x, x), jax.jit(pure_chain)(x, x))


def test_lowered_stream_ids_are_positive_integers():
    text = lower_for_gpu(jaxpar.parallel_branches(four_matmul_branches, **STREAMS),
                         *four_matmul_branches_args())
    ids = re.findall(r'_xla_stream_annotation = "([^"]*)"', text)
    assert ids and all(i.isdigit() and int(i) >= 1 for i in ids)

