"""The TPU target (``jaxpar.targets.tpu``, ``targets.tpu_model``, ``unroll_scans``' block
form), without a TPU: the built-in profile is the chip's calibration, the choices it makes
on the seed's and the suites' loops, the block form's values, and the memory budget's rules
on the TPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.benchmarks import load_benchmark
from jax import lax

import jaxpar
from jaxpar.passes import DecisionKind, unroll_scans
from jaxpar.passes.unroll_scans import read_by_blocks
from jaxpar.targets.tpu import TPU_V5E
from jaxpar.targets.tpu_model import MIN_FACTOR, block_factor

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "docs" / "measurements" / "tpu-v5e-2026-12-06"


def test_the_built_in_profile_is_the_chips_calibration() -> None:
    """The figures jaxpar ships are the ones benchmarks/calibrate_tpu.py derived on the
    chip (its JSON is kept), rounded as written."""
    calibrate = load_benchmark("calibrate_tpu")
    run = json.loads((MEASURED / "calibration.json").read_text())
    assert run["device_kind"] == "TPU v5 lite" and run["platform"] == "tpu"
    derived = calibrate.profile_of(run["measurements"], "TPU v5e", run["date"], run["jax"])
    for name in ("trip_s", "slice_s", "slice_bandwidth", "write_s", "dot_s",
                 "batched_dot_extra_s", "transcendental_s_per_element", "copy_bandwidth",
                 "peak_flops"):
        assert getattr(TPU_V5E, name) == pytest.approx(getattr(derived, name), rel=0.02), name
    assert TPU_V5E.block_ratios == derived.block_ratios
    assert TPU_V5E.measured == derived.measured


def _seed(steps: int = 10_000, n: int = 100) -> Any:
    seed = load_benchmark("seed_002")
    return seed, [jax.ShapeDtypeStruct((n, n), jnp.float32)] * 2 + \
        [jax.ShapeDtypeStruct((steps, n, n), jnp.float32)] * 2


def _loops(plan: Any) -> list[tuple[str, int | None]]:
    return [(d.kind.value, d.unroll) for d in plan.decisions]


def test_the_seeds_two_scans_are_batched_or_read_by_blocks_of_40() -> None:
    seed, specs = _seed()
    identical = jaxpar.inspect(seed.identical_bodies, target="tpu")(*specs)
    assert [kind for kind, _ in _loops(identical)] == ["batched", "unrolled"]
    assert identical.decisions[1].unroll == 40 and identical.decisions[1].trips_after == 250
    different = jaxpar.inspect(seed.different_bodies, target="tpu")(*specs)
    assert _loops(different) == [("unrolled", 40), ("unrolled", 40)]
    assert "measured on TPU v5e" in different.decisions[0].reason
    assert "read by blocks of 40 trips" in different.decisions[0].reason
    # The estimate prices the blocks: faster than plain, by the profile's figures.
    assert different.estimate.ratio < 0.7 and identical.estimate.ratio < 0.7


@pytest.mark.parametrize(("name", "size", "expected"), [
    ("tiny_scan", "full", [("unrolled", 40)]),    # a tiny body: its trips' latency dominates
    ("bigru", "full", [("left alone", 1)] * 2),    # a large body hides it (128x32x256)
    # docs/guide.md ("tune=True" on a TPU): a small bidirectional GRU (16 steps, batch 4,
    # width 32) is read by blocks, the suite's is not.
    ("bigru", "small", [("unrolled", 16)] * 2),
    ("lstm_grad", "full", [("left alone", 1)] * 2),  # 2 MiB of weight gradients carried
    ("attention", "full", []),                     # no loop: jax.jit's program
])
def test_the_suites_loops_as_the_chip_measured_them(name: str, size: str,
                                                    expected: list[Any]) -> None:
    suite = load_benchmark("gpu_suite")
    fn, args = suite.PROGRAMS[name].build(size)
    plan = jaxpar.inspect(fn, target="tpu")(*args)
    assert [d for d in _loops(plan) if d[0] != "made static"] == expected


def test_block_factors_divide_the_length_and_respect_the_limits() -> None:
    def scan_eqn(length: int, width: int = 64) -> Any:
        closed = jax.make_jaxpr(lambda c, xs: lax.scan(
            lambda c, x: (jnp.sin(c) + x, c.sum()), c, xs))(jnp.zeros(width),
                                                          jnp.zeros((length, width)))
        return next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan")

    assert block_factor(scan_eqn(10_000), TPU_V5E).factor == 40
    assert block_factor(scan_eqn(360), TPU_V5E).factor == 40
    chosen = block_factor(scan_eqn(390), TPU_V5E)  # 390 = 2 * 3 * 5 * 13: 39 divides it
    assert chosen.factor == 39 and chosen.blocked
    prime = block_factor(scan_eqn(101), TPU_V5E)  # no divisor: lax.scan's own unroll
    assert prime.factor == 40 and not prime.blocked
    assert block_factor(scan_eqn(6), TPU_V5E).factor == 1  # below MIN_FACTOR
    assert block_factor(scan_eqn(10_000), TPU_V5E, most=4).factor == 1
    assert MIN_FACTOR == 8
    big = block_factor(scan_eqn(100, 2**18), TPU_V5E)  # a 1 MiB carry
    assert big.factor == 1 and "carries 1.0 MiB" in big.reason


@pytest.mark.parametrize("step", ["remainder", "floor division", "nested remainder"])
def test_a_loop_dividing_integers_stays_rolled(step: str) -> None:
    """Integer ``%`` or ``//`` in a body (a nested loop's too) keeps the loop rolled: read by
    blocks such a loop ran x1.11-1.13 slower on the chip; the same loop stepping its
    counter by ``+ 1``, or dividing floats, is read by blocks."""
    def program(step: str) -> Any:
        def advance(k: Any) -> Any:
            if step == "remainder":
                return (k * 3 + 1) % 1000
            if step == "floor division":
                return k // 2 + 7
            if step == "nested remainder":
                return lax.scan(lambda j, _: ((j * 3 + 1) % 1000, None), k, None, length=2)[0]
            if step == "float division":
                return k / 2.0 + 1.0
            return k + 1

        def fn(k: Any, c: Any, w: Any) -> Any:
            def body(carry: Any, _: Any) -> Any:
                k, c = carry
                return (advance(k), jnp.tanh(c @ w + k.astype(jnp.float32) * 1e-4)), None
            return lax.scan(body, (k, c), None, length=3000)[0]
        return fn

    c, w = jnp.ones((32, 32)) * 0.1, jnp.eye(32) * 0.5

    def decision(step: str, k: Any) -> Any:
        closed = jax.make_jaxpr(program(step))(k, c, w)
        return block_factor(next(e for e in closed.jaxpr.eqns
                                 if e.primitive.name == "scan"), TPU_V5E)

    kept = decision(step, jnp.int32(1))
    assert kept.factor == 1 and "divides integers" in kept.reason
    assert decision("add", jnp.int32(1)).factor == 40
    assert decision("float division", jnp.float32(1)).factor == 40
    fn = program(step)
    plan = jaxpar.inspect(fn, target="tpu")(jnp.int32(1), c, w)
    assert not any(d.kind == DecisionKind.UNROLLED for d in plan.decisions)
    np.testing.assert_array_equal(jaxpar.parallel_branches(fn, target="tpu")(jnp.int32(1), c, w)[0],
                                  jax.jit(fn)(jnp.int32(1), c, w)[0])


def _blocks(f: Any, *args: Any) -> Any:
    closed = jax.make_jaxpr(f)(*args)
    new, decisions = unroll_scans(closed, unroll="cost", target="tpu")
    return closed, new, decisions


def test_the_block_form_computes_the_scans_values() -> None:
    def f(c: Any, xs: Any, ys: Any) -> Any:
        a = lax.scan(lambda c, x: (jnp.sin(c) * 0.9 + x, (c.sum(), c * 2)), c, xs)
        b = lax.scan(lambda c, x: (jnp.cos(c) * 0.5 + x[0] - x[1], c[0]), c, (ys, xs),
                     reverse=True)
        return a, b

    args = (jnp.linspace(0.0, 1.0, 8), jnp.linspace(0.0, 1.0, 80 * 8).reshape(80, 8),
            jnp.linspace(0.0, 2.0, 80 * 8).reshape(80, 8))
    closed, new, decisions = _blocks(f, *args)
    assert [(d.kind, d.unroll) for d in decisions] == [(DecisionKind.UNROLLED, 40)] * 2
    scans = [e for e in new.jaxpr.eqns if e.primitive.name == "scan"]
    assert all(read_by_blocks(e) and e.params["length"] == 2 for e in scans)
    want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    got = jax.core.eval_jaxpr(new.jaxpr, new.consts, *args)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # A second run changes nothing: a scan of blocks is not read by blocks again.
    again, more = unroll_scans(new, unroll="cost", target="tpu")
    assert again is new
    assert all(d.kind is DecisionKind.LEFT_ALONE for d in more)


def test_the_tpu_target_keeps_values_gradients_and_vmap() -> None:
    def f(w: Any, xs: Any) -> Any:
        return lax.scan(lambda c, x: (jnp.tanh(c @ w + x), c.sum()), jnp.zeros((4, 16)), xs)

    w = jnp.eye(16) * 0.5
    xs = jnp.linspace(-1.0, 1.0, 80 * 4 * 16).reshape(80, 4, 16)
    g = jaxpar.parallel_branches(f, target="tpu")
    for got, want in ((g(w, xs), jax.jit(f)(w, xs)),
                      (jax.grad(lambda w: g(w, xs)[0].sum())(w),
                       jax.grad(lambda w: f(w, xs)[0].sum())(w)),
                      (jax.vmap(g, (None, 0))(w, jnp.stack([xs, xs * 2])),
                       jax.vmap(f, (None, 0))(w, jnp.stack([xs, xs * 2])))):
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                        strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert "jaxpar_blocks" in g.lower(w, xs).as_text(debug_info=True)


def test_an_explicit_unroll_is_in_the_lowered_program_whatever_the_budget() -> None:
    """``unroll=8`` is the user's: lax.scan's own unroll by 8, in the program, even with a
    budget of no extra byte; an automatic choice is fitted to the budget."""
    seed, specs = _seed(steps=400)
    for memory in ("auto", 0):
        g = jaxpar.parallel_branches(seed.different_bodies, target="tpu", unroll=8,
                                     memory=memory)
        traced = str(jax.make_jaxpr(g)(*specs))
        assert traced.count("unroll=8") == 2, memory
        plan = jaxpar.inspect(g)(*specs)
        assert _loops(plan) == [("unrolled", 8), ("unrolled", 8)]
        if memory == 0:
            assert "kept as you asked (unroll)" in plan.text()
    auto = jaxpar.inspect(seed.different_bodies, target="tpu", memory=0)(*specs)
    assert all(unroll == 1 for _, unroll in _loops(auto))  # fitted: no copy allowed


def test_the_budget_is_a_share_of_the_whole_footprint() -> None:
    """10% of what the plain program holds at its peak (arguments, outputs, temporaries),
    not of its temporaries alone: the seed's 800 MB of inputs allow 80 MB."""
    seed, specs = _seed()
    plan = jaxpar.inspect(seed.different_bodies, target="tpu")(*specs)
    memory = plan.to_dict()["memory"]
    footprint = 2 * 10_000 * 100 * 100 * 4 + 4 * 100 * 100 * 4
    assert memory["allowed_bytes"] == pytest.approx(0.1 * footprint, rel=0.01)
    assert memory["fits"]


def test_the_tuners_candidates_on_a_tpu() -> None:
    from jaxpar._tune import CANDIDATES

    tpu = [c.label for c in CANDIDATES if c.targets is None or "tpu" in c.targets]
    assert tpu == ["jax.jit", "jaxpar (chosen options)", "jaxpar without unrolling",
                   "jaxpar unrolled by 8", "jaxpar unrolled by 16",
                   "jaxpar without scan batching", "jaxpar with scans fused",
                   "jaxpar, while loops by 4", "jaxpar, scan inputs hoisted",
                   "jaxpar, scan inputs hoisted, unrolled by 8",
                   "jaxpar, linear scans associative"]
    gpu = [c.label for c in CANDIDATES if c.targets is None or "gpu" in c.targets]
    assert "jaxpar unrolled by 8" not in gpu and "jaxpar (user's mode)" in gpu
    assert "jaxpar, while loops by 4" in gpu
    # The hoisting and associative candidates: measured on the chip only (no GPU lent).
    assert not {"jaxpar, scan inputs hoisted", "jaxpar, linear scans associative"} & set(gpu)


@pytest.mark.parametrize("name", sorted(load_benchmark("tpu_loops").PROGRAMS))
def test_the_held_out_loop_programs_keep_their_values_on_target_tpu(name: str) -> None:
    """``benchmarks/tpu_loops.py``'s programs (the chip's held-out loops), at their tiny size:
    target ``"tpu"`` computes ``jax.jit``'s values, whatever it decided for each loop."""
    fn, args = load_benchmark("tpu_loops").PROGRAMS[name]("s")
    want = jax.jit(fn)(*args)
    got = jaxpar.parallel_branches(fn, target="tpu")(*args)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
