"""The plan's one estimate, everywhere: a plan has one pair of figures, jax.jit's time in
the user's CUDA-graph mode against jaxpar's as it will run, and every surface shows it.

Parsed from what each surface prints: ``Plan.text()``'s header and its ``XLA options``
line, ``Plan.to_dict()``, the Perfetto (Chrome trace) timeline's end, the SVG picture, and
``gpu_preview``'s text, which puts the compile's pair beside the plan's and says which one
decided. For the demo's collective matmul and the guide's ring example, the planning model
and the deviceless compile agree on direction.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.environment import needs_plugin

import jaxpar
from jaxpar._report.render import plan_to_chrome_trace

ROOT = Path(__file__).resolve().parents[1]
PAIR = re.compile(r"jax\.jit ([\d,.]+) us -> jaxpar ([\d,.]+) us")


def _pairs(text: str) -> list[tuple[float, float]]:
    return [(float(a.replace(",", "")), float(b.replace(",", ""))) for a, b in
            PAIR.findall(text)]


def _close(a: float, b: float, tolerance: float = 0.01) -> bool:
    return abs(a - b) <= tolerance * max(abs(a), abs(b), 1e-9) + 0.05  # printed to 0.1 us


def assert_one_pair(plan: jaxpar.Plan) -> tuple[float, float]:
    """Every surface of ``plan`` shows ``plan.estimate``; returns it (jax.jit, jaxpar)."""
    figure = plan.estimate
    pair = (figure.plain_us, figure.jaxpar_us)
    text = plan.text()
    header = text.splitlines()[1]
    assert _pairs(header), text
    assert all(_close(a, b) for a, b in zip(_pairs(header)[0], pair, strict=True)), text
    options = [line for line in plan.text(verbose=True).splitlines() if "XLA options:" in line]
    for line in options:  # the options line shows the same pair, or no pair at all
        for found in _pairs(line):
            assert all(_close(a, b) for a, b in zip(found, pair, strict=True)), line
    as_dict = plan.to_dict()["estimate"]
    assert (as_dict["plain_us"], as_dict["jaxpar_us"]) == pair
    trace = plan_to_chrome_trace(plan)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    end = max(e["ts"] + e["dur"] for e in spans)
    assert _close(end, figure.jaxpar_us), (end, figure)
    assert (trace["otherData"]["plain_us"], trace["otherData"]["jaxpar_us"]) == pair
    assert _pairs(html.unescape(plan.to_svg()))[0] == _pairs(header)[0]
    return pair


def _specs(*arrays: Any) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(np.shape(a), jnp.float32) for a in arrays]


def _example(name: str) -> Any:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "examples"))


def test_two_scans_every_surface_shows_one_pair() -> None:
    two_scans = _example("two_scans").two_scans
    shapes = [(100, 100), (100, 100), (50, 100, 100), (50, 100, 100)]
    plan = jaxpar.inspect(two_scans, target="gpu")(
        *[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
    plain, fast = assert_one_pair(plan)
    assert fast < plain


def test_ensemble_every_surface_shows_one_pair() -> None:
    ensemble = _example("ensemble")
    members = ensemble.make_members()
    x = jnp.ones((32, 64))
    plan = jaxpar.inspect(ensemble.ensemble, target="gpu")(members, x)
    assert_one_pair(plan)


def test_a_mode_only_change_draws_the_mode_and_its_figure(calibrated_fan: Any) -> None:
    fan, args = calibrated_fan
    plan = jaxpar.inspect(fan, target="gpu")(*args)
    assert plan.mode is not None and plan.mode.chosen and not plan.sections, plan
    plain, fast = assert_one_pair(plan)
    assert fast < plain
    # The short form says what the options are and do, in words (the header has the
    # figure); the long form adds the pair, not jaxpar's program in the other mode.
    options = next(line for line in plan.text().splitlines() if "XLA options:" in line)
    assert not _pairs(options) and "CUDA graphs run in concurrent_regions mode" in options
    options = next(line for line in plan.text(verbose=True).splitlines()
                   if "XLA options:" in line)
    assert _pairs(options), options
    svg = plan.to_svg()
    assert "everything stays on the main stream" not in svg
    assert "CUDA graphs: compiled in concurrent_regions mode" in svg
    threads = [e["args"]["name"] for e in plan_to_chrome_trace(plan)["traceEvents"]
               if e["name"] == "thread_name"]
    assert "main (concurrent_regions CUDA graphs)" in threads


@pytest.fixture
def calibrated_fan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``helpers.programs.fan`` on a GPU whose calibration makes CONCURRENT_REGIONS pay."""
    import dataclasses

    from helpers.benchmarks import CONCURRENCY_PAYS, calibrated_gpu
    from helpers.programs import fan

    from jaxpar._model import gpu as _gpu_model

    profile = dataclasses.replace(calibrated_gpu(tmp_path, **CONCURRENCY_PAYS), name="gpu",
                                  device_kind="")
    monkeypatch.setitem(_gpu_model.GPU_PROFILES, _gpu_model.GENERIC_GPU, profile)  # type: ignore[index]
    return fan, [jax.ShapeDtypeStruct((64 + 8 * n, 64), jnp.float32) for n in range(8)]


@pytest.mark.cpu_devices(8)
def test_collective_matmul_regions_do_not_pay_and_surfaces_agree() -> None:
    """On 8 CPU devices, planned for a GPU: the compute beside each collectives group is
    left on the main stream with the reason (XLA already overlaps it in jax.jit's
    program, and merges the per-step matmuls), and the plan's surfaces show one pair."""
    cm = _example("collective_matmul")
    _, fn, args = cm.story()
    plan = jaxpar.inspect(fn, target="gpu")(*args)
    assert not plan.sections, plan
    assert sum(c.grouped for c in plan.collectives) == 3, plan
    reasons = [n.detail for n in plan.left_alone if n.reason == "does not pay"]
    assert len(reasons) == 3 and all("already overlaps this compute" in r for r in reasons)
    assert any("DotMerger" in r for r in reasons)
    plain, fast = assert_one_pair(plan)
    assert fast < plain
    forced = jaxpar.inspect(fn, target="gpu", force_streams=True)(*args)
    assert forced.sections and all(s.pays is False for s in forced.sections)
    assert len(forced.estimate.rejected) == len(forced.sections)
    assert_one_pair(forced)


def _deviceless_programs() -> dict[str, tuple[Any, tuple[Any, ...], Any]]:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpar._compiled import make_gpu_mesh

    mesh = make_gpu_mesh("h200", 8)

    def spec(shape: tuple[int, ...], partition: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, partition))

    cm = _example("collective_matmul")
    n = 8

    def ring_step(x: jax.Array, w: jax.Array) -> jax.Array:  # docs/guide.md's shard_map
        forward = jax.lax.ppermute(x, "x", [(i, (i + 1) % n) for i in range(n)])
        backward = jax.lax.ppermute(x, "x", [(i, (i - 1) % n) for i in range(n)])
        return jnp.tanh(x @ w) + forward + backward

    def ring(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.shard_map(ring_step, mesh=mesh, in_specs=(P("x"), P()),
                             out_specs=P("x"))(x, w)

    return {"collective matmul": (cm.make_collective_matmul(mesh),
                                  (spec((128, 64), P("x", None)), spec((64, 64), P(None, "x"))),
                                  mesh),
            "ring": (ring, (spec((4096, 1024), P("x")), spec((1024, 1024), P())), mesh)}


@needs_plugin
@pytest.mark.parametrize("name", ["collective matmul", "ring"])
def test_inspect_and_gpu_preview_agree_on_direction(name: str) -> None:
    from jaxpar._compiled.preview import direction

    fn, args, mesh = _deviceless_programs()[name]
    plan = jaxpar.inspect(fn, target="gpu")(*args)
    preview = jaxpar.gpu_preview(fn, *args, mesh=mesh)
    assert preview.plan.estimate == plan.estimate  # the preview shows the plan's one pair
    assert_one_pair(preview.plan)
    assert direction(plan.estimate.ratio) == direction(preview.compiled.ratio) == "faster", (
        plan.estimate, preview.compiled)
    assert preview.decided_by == "planning model" and preview.recommendation == "jaxpar"
    text = str(preview)
    plan_line = next(line for line in text.splitlines() if line.startswith("  plan: "))
    assert _pairs(plan_line) == _pairs(plan.text().splitlines()[1])
    assert "decision: by the planning model" in text
    assert preview.to_dict()["estimate"]["jaxpar_us"] == plan.estimate.jaxpar_us


@needs_plugin
def test_gpu_preview_takes_the_compiles_verdict_where_it_disagrees() -> None:
    """A compile that says jaxpar is slower where the plan says faster decides: the
    preview shows both pairs and recommends plain jax.jit."""
    import dataclasses

    fn, args, mesh = _deviceless_programs()["collective matmul"]
    preview = jaxpar.gpu_preview(fn, *args, mesh=mesh)
    swapped = dataclasses.replace(preview, plain=preview.jaxpar, jaxpar=preview.plain)
    assert swapped.compiled.ratio > 1 > swapped.plan.estimate.ratio
    assert swapped.decided_by == "compile" and swapped.recommendation == "plain"
    text = str(swapped)
    assert "  compile: 1." in text and "slower than jax.jit (estimated): jax.jit" in text
    assert "use plain jax.jit" in text
    assert _pairs(next(line for line in text.splitlines() if line.startswith("  plan: "))) == \
        _pairs(preview.plan.text().splitlines()[1])


# Twin scans whose bodies differ only in what jaxpar cannot merge: a custom_jvp's or
# custom_vjp's rule, a pure_callback's function, a custom_vjp's non-differentiable value.
# Their bodies launch no kernel of their own (elementwise work, a host call), which the
# GPU model once priced at 0 us, and the header's verdict divided by it.
@jax.custom_jvp
def _sin_a(x: Any) -> Any:
    return jnp.sin(x)


_sin_a.defjvp(lambda p, t: (_sin_a(p[0]), jnp.cos(p[0]) * t[0]))


@jax.custom_jvp
def _sin_b(x: Any) -> Any:
    return jnp.sin(x)


_sin_b.defjvp(lambda p, t: (_sin_b(p[0]), 2.0 * jnp.cos(p[0]) * t[0]))


def _tanh_vjp(scale: float) -> Any:
    @jax.custom_vjp
    def tanh(x: Any) -> Any:
        return jnp.tanh(x)

    tanh.defvjp(lambda x: (jnp.tanh(x), x), lambda x, ct: (scale * ct * (1 - jnp.tanh(x) ** 2),))
    return tanh


_tanh_a, _tanh_b = _tanh_vjp(1.0), _tanh_vjp(2.0)


def _scaled(x: Any, k: float) -> Any:
    return x * k


_scaled_vjp = jax.custom_vjp(_scaled, nondiff_argnums=(1,))
_scaled_vjp.defvjp(lambda x, k: (x * k, None), lambda k, _, ct: (ct * k,))


def _callback(fun: Any) -> Any:
    return lambda c: jax.pure_callback(fun, jax.ShapeDtypeStruct(c.shape, c.dtype), c)


def _twin_scans(body_a: Any, body_b: Any) -> Any:
    def twins(a: Any, b: Any, xs: Any) -> Any:
        ya = jax.lax.scan(lambda c, x: (body_a(c) + x, c), a, xs)
        yb = jax.lax.scan(lambda c, x: (body_b(c) + x, c), b, xs)
        return ya, yb
    return twins


TWIN_SCANS = {
    "custom_jvp": _twin_scans(_sin_a, _sin_b),
    "custom_vjp": _twin_scans(_tanh_a, _tanh_b),
    "pure_callback": _twin_scans(_callback(np.sin), _callback(np.cos)),
    "nondiff_value": _twin_scans(lambda c: _scaled_vjp(c, 2.0), lambda c: _scaled_vjp(c, 3.0)),
}


@pytest.mark.parametrize("target", ["gpu", "tpu", "cpu"])
@pytest.mark.parametrize("kind", sorted(TWIN_SCANS))
def test_twin_scans_with_different_rules_or_callbacks_run_and_report(kind: str, target: str
                                                                   ) -> None:
    fun = TWIN_SCANS[kind]
    a = jnp.linspace(-1.0, 1.0, 64).reshape(4, 16)
    b, xs = a[::-1] * 0.5, jnp.linspace(0.0, 1.0, 8 * 64).reshape(8, 4, 16)
    got, want = jaxpar.parallel_branches(fun, target=target)(a, b, xs), jax.jit(fun)(a, b, xs)
    for mine, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)
    plan = jaxpar.inspect(jaxpar.parallel_branches(fun, target=target))(a, b, xs)
    text = plan.text()
    assert plan.summary() and plan.text(verbose=True), text
    figure = plan.estimate
    # Every run launches a kernel at least: neither program is estimated at no time.
    assert figure.plain_us > 0 and figure.jaxpar_us > 0, figure
    assert figure.line() in text
    if target == "gpu":
        assert_one_pair(plan)


def test_a_host_callback_in_a_scan_costs_the_gpu_a_sync_a_trip() -> None:
    fun = TWIN_SCANS["pure_callback"]
    plain = TWIN_SCANS["custom_jvp"]
    a, xs = jnp.ones((4, 16)), jnp.ones((8, 4, 16))
    figure = jaxpar.inspect(jaxpar.parallel_branches(fun, target="gpu"))(a, a, xs).estimate
    without = jaxpar.inspect(jaxpar.parallel_branches(plain, target="gpu"))(a, a, xs).estimate
    # 16 callbacks a run (two scans of 8 trips), each a round trip to the host (10 us
    # nominal sync, _gpu_model.GENERIC_GPU).
    assert figure.jaxpar_us >= without.jaxpar_us + 16 * 10.0, (figure, without)


@pytest.mark.parametrize(("plain_us", "jaxpar_us", "verdict"), [
    (10.0, 0.0, "faster than jax.jit (jaxpar's program is estimated at 0 us)"),
    (0.0, 10.0, "slower than jax.jit (jax.jit's program is estimated at 0 us)"),
    (0.0, 0.0, "as fast as jax.jit"),
    (10.0, 5.0, "2.00x faster than jax.jit"),
    (10.0, 12.5, "1.25x slower than jax.jit"),
])
def test_the_verdict_of_an_estimate_of_0_us_says_which(plain_us: float, jaxpar_us: float,
                                                      verdict: str) -> None:
    from jaxpar._report.types import PlanEstimate

    figure = PlanEstimate(plain_us, jaxpar_us, "a test")
    assert figure.verdict == verdict
    assert figure.line().startswith(f"{verdict} (estimated): jax.jit {plain_us:,.1f} us")
