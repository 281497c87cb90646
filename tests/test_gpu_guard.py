"""Guard (issue 11): jaxpar must never make a program worse on the GPU.

A few programs of ``benchmarks/gpu_suite.py`` at their small size, compiled deviceless for an
H200 plain and with ``parallel_branches(target="gpu")``. Each fails on what the issue forbids:
more kernel launches per run without a stream region that really overlaps other work, an
estimated slowdown above 1% (``jaxpar._estimate``, XLA's default CUDA-graph mode), a compile
error, or different values on the CPU.

The last tests pin the XLA behaviour the planner has to work with (docs/design.md, "When
XLA overlaps stream regions"): if a jaxlib changes it, they say so.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from helpers import load_benchmark
from jax import lax

from jaxpar import _deviceless
from jaxpar._compat import stream_call
from jaxpar._estimate import estimate_hlo

PLUGIN_OK, PLUGIN_MESSAGE = _deviceless.plugin_status()
pytestmark = pytest.mark.skipif(not PLUGIN_OK, reason=PLUGIN_MESSAGE)



suite = load_benchmark("gpu_suite")

# Programs of every kind the planner once made worse (before sections were priced:
# jaxpar/_price.py), and kinds it makes better.
GUARDED = [
    "inception_block",
    "moe_4_experts",
    "moe_4_experts_grad",
    "seed_002_identical_scans",
    "seed_002_two_scans",
    "optax_adamw_step",
    "gptj_parallel_block_grad",
    "attention",
    "slogdet_inv",
    "siamese_grad",
]


@pytest.mark.parametrize("name", GUARDED)
def test_jaxpar_is_never_worse_on_the_gpu(name: str) -> None:
    result = suite.evaluate(name, size="small")
    assert suite.guard_failures(result) == [], result.get("verdict")


def test_guard_catches_each_kind_of_regression() -> None:
    ok = {"compile": "ok", "values": "equal", "launches": [10, 10], "overlapping_regions": 0,
          "time_ratio": {"lhs": 1.0}, "verdict": ""}
    assert suite.guard_failures(ok) == []
    assert suite.guard_failures({**ok, "launches": [10, 11]}) == [
        "more launches (10 -> 11) without real overlap"]
    assert suite.guard_failures({**ok, "launches": [10, 11], "overlapping_regions": 1}) == []
    assert "estimated slowdown" in suite.guard_failures({**ok, "time_ratio": {"lhs": 1.02}})[0]
    assert suite.guard_failures({**ok, "values": "DIFFER (max abs diff 1)"}) == [
        "values: DIFFER (max abs diff 1)"]
    assert suite.guard_failures({"compile": "crash (exit -11): "}) == [
        "compile: crash (exit -11): "]


# --------------------------------------------------------------------------- XLA's rule

_X = jax.ShapeDtypeStruct((256, 256), jnp.float32)


def _chain(x: jax.Array, w: jax.Array) -> jax.Array:
    for _ in range(3):
        x = jnp.tanh(x @ w)
    return x


def _packed(x: jax.Array, w: jax.Array) -> jax.Array:
    h = _chain(x, w)
    return jnp.concatenate([h.ravel(), h.T.ravel()])


def _region(fn: Any, stream: int) -> Any:
    return stream_call(fn, {"_xla_stream_annotation": str(stream), "inlineable": "false",
                            "_scheduling_group_id": "1"})


def _two_regions(barrier: bool) -> Any:
    def f(a: jax.Array, b: jax.Array, w: jax.Array) -> jax.Array:
        pa, pb = _region(_packed, 1)(a, w), _region(_packed, 2)(b, w)
        if barrier:
            pa, pb = lax.optimization_barrier((pa, pb))
        n = pa.shape[0] // 2
        return jnp.sin(pa[:n]).sum() + jnp.cos(pb[n:]).sum() + pa[n:].sum() + pb[:n].sum()
    return f


def _overlaps(fn: Any) -> list[bool]:
    return [r.overlaps for r in estimate_hlo(_deviceless.compile_for_gpu(fn, _X, _X, _X)).regions]


def test_xla_serialises_regions_whose_outputs_are_consumed_apart() -> None:
    # Same group id, yet start right before done: each call-done feeds its own slices.
    assert _overlaps(_two_regions(barrier=False)) == [False, False]


def test_xla_overlaps_regions_joined_right_after_their_dones() -> None:
    assert _overlaps(_two_regions(barrier=True)) == [True, True]
