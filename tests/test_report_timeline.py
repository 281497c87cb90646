"""One estimate per plan (``jaxpar._report.timeline``): the text header, the
picture's title and ``gpu_preview`` show the same figure for the same program and CUDA-graph
mode, say where it comes from, count the loop rewrites, and draw a forced section with the GPU
pricing's verdict.

``inspect`` shows the planner's model (``Plan.estimate``); ``gpu_preview`` attaches its
compiled estimate to the plan it returns, so that plan's header and picture show the
preview's own figures. The planner's model counts what the loop rewrites save (launches
per trip, unrolled trips, graphs per trip, stacking kernels) without a compile; it agrees
with the compile on the direction for the programs below, and on the size where it knows
the kernels XLA makes (loops, batched matmuls).
"""

from __future__ import annotations

import html
import re

import jax
import jax.numpy as jnp
import pytest
from helpers.environment import needs_plugin
from jax import lax

import jaxpar
from jaxpar import _compat

f32 = jnp.float32


def two_scans(a, b, xs):
    first, _ = lax.scan(lambda c, x: (jnp.tanh(c @ x @ x) * 0.5, None), a, xs)
    second, _ = lax.scan(lambda c, x: (jnp.sin(x @ c) + 0.5 * c, None), b, xs)
    return first, second


def two_scans_args():
    return (jax.ShapeDtypeStruct((64, 64), f32),) * 2 + (jax.ShapeDtypeStruct((100, 64, 64), f32),)


def two_rnns(p, xs):
    h0 = jnp.zeros((xs.shape[1], p["fh"].shape[0]), xs.dtype)

    def fwd(h, x):
        h = jnp.tanh(x @ p["fx"] + h @ p["fh"])
        return h, h

    def bwd(h, x):
        h = jnp.tanh(x @ p["bx"] + h @ p["bh"])
        return h, h

    return lax.scan(fwd, h0, xs)[1] + lax.scan(bwd, h0, xs, reverse=True)[1]


def two_rnns_args():
    shapes = {"fx": (32, 64), "fh": (64, 64), "bx": (32, 64), "bh": (64, 64)}
    return ({k: jax.ShapeDtypeStruct(s, f32) for k, s in shapes.items()},
            jax.ShapeDtypeStruct((200, 16, 32), f32))


def towers(ws, xs):
    outs = []
    for (w1, w2), x in zip(ws, xs, strict=True):
        outs.append(jnp.tanh(jnp.tanh(x @ w1) @ w2))
    return jnp.concatenate(outs, -1)


def towers_args():
    spec = jax.ShapeDtypeStruct
    return ([(spec((64, 128), f32), spec((128, 64), f32)) for _ in range(3)],
            [spec((16, 64), f32) for _ in range(3)])


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def inception(x, p):
    b1 = jax.nn.relu(_conv(x, p["a"]))
    b3 = jax.nn.relu(_conv(jax.nn.relu(_conv(x, p["b"])), p["c"]))
    b5 = jax.nn.relu(_conv(jax.nn.relu(_conv(x, p["e"])), p["f"]))
    pool = lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")
    bp = jax.nn.relu(_conv(pool, p["d"]))
    return jnp.concatenate([b1, b3, b5, bp], axis=-1)


def inception_args():
    shapes = {"a": (1, 1, 64, 64), "b": (1, 1, 64, 96), "c": (3, 3, 96, 128),
              "d": (1, 1, 64, 32), "e": (1, 1, 64, 16), "f": (5, 5, 16, 32)}
    return (jax.ShapeDtypeStruct((8, 28, 28, 64), f32),
            {k: jax.ShapeDtypeStruct(s, f32) for k, s in shapes.items()})


PROGRAMS = {"two_scans": (two_scans, two_scans_args), "two_rnns": (two_rnns, two_rnns_args),
            "towers": (towers, towers_args), "inception": (inception, inception_args)}


def _shown_everywhere(plan: jaxpar.Plan) -> None:
    """The plan's estimate is the header's figure and the picture's title, and no other
    total (no second 'critical path' or 'x shorter') competes with it."""
    line = plan.estimate.line()
    text = plan.text()
    assert text.splitlines()[1].strip() == line
    svg = plan.to_svg()
    assert line in html.unescape(svg)
    for stale in (r"critical path \d", r"x shorter", r"estimated serial"):
        assert not re.search(stale, text) and not re.search(stale, svg)
    for why in plan.estimate.rejected:
        assert why in text and why in html.unescape(svg)


@pytest.fixture(autouse=True)
def _lhs_graphs(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # XLA's default mode: lhs


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_header_and_picture_show_the_plans_one_estimate(name):
    fn, args = PROGRAMS[name]
    plan = jaxpar.inspect(fn, target="gpu")(*args())
    _shown_everywhere(plan)
    if plan.mode is not None and plan.mode.chosen:  # compiled in another CUDA-graph mode
        assert (f"jaxpar's program with CUDA graphs in {plan.mode.mode.value} mode, "
                "jax.jit's in the process's lhs") in plan.estimate.source
    else:
        assert "CUDA graphs" not in plan.estimate.source
    assert plan.estimate.source.startswith("jaxpar's GPU planning model (public figures, "
                                           "not measured on a GPU")
    kept = jaxpar.inspect(fn, target="gpu", command_buffers="keep")(*args())
    _shown_everywhere(kept)
    assert kept.estimate.source == ("jaxpar's GPU planning model (public figures, not "
                                    "measured on a GPU); not a compile or a run")


@pytest.mark.parametrize("name", ["two_scans", "two_rnns"])
def test_loop_rewrites_are_counted_without_a_compile(name):
    # No stream section: the whole gain is the loop rewrites' (fused, unrolled scans:
    # fewer counter and slicing kernels, one graph launch per trip), counted by the
    # planner's own model.
    # A fixed unroll factor: with unroll="auto" the fused body (twice the kernels) is
    # unrolled half as far, and the model rates these two scans faster apart (jaxpar
    # then leaves the fusion out: test_plan_budget's slower-joins test).
    fn, args = PROGRAMS[name]
    plan = jaxpar.inspect(fn, target="gpu", unroll=4)(*args())
    assert plan.sections == () and {"fused", "unrolled"} <= {d.kind for d in plan.decisions}
    assert plan.estimate.ratio < 0.8, plan.estimate.line()
    assert "gpu_preview" not in plan.estimate.source
    _shown_everywhere(plan)
    off = jaxpar.inspect(fn, target="gpu", fuse_scans=False, unroll=None)(*args())
    assert all(d.kind not in ("fused", "unrolled") for d in off.decisions)
    assert off.estimate.ratio == pytest.approx(1.0)
    assert off.estimate.plain_us == pytest.approx(plan.estimate.plain_us)


def test_forced_plan_is_drawn_with_the_pricings_verdict():
    fn, args = PROGRAMS["inception"]
    # In the user's lhs mode (the mode jaxpar would choose is another test's).
    default = jaxpar.inspect(fn, target="gpu", command_buffers="keep")(*args())
    forced = jaxpar.inspect(fn, target="gpu", force_streams=True, command_buffers="keep")(*args())
    assert default.sections == () and forced.num_regions >= 2
    # Under lhs graphs the pricing rejects the section: it wins nothing and the cut costs.
    section = forced.sections[0]
    # (The cut's cost is what packing a region's results adds: nothing on jax >= 0.11,
    # whose XLA overlaps a call returning a tuple.)
    assert section.gain_us == 0.0 and section.cut_cost_us is not None and section.pays is False
    assert (section.cut_cost_us > 0.0) == _compat.PACK_MULTI_RESULT_CALLS
    assert forced.estimate.rejected == (
        f"{len(section.regions)} regions win est. 0.0 us of overlap and the cut costs "
        f"est. {section.cut_cost_us:.1f} us",)
    assert "LHS mode chain a captured region serially" in section.verdict
    assert section.verdict in forced.text(verbose=True)
    assert forced.estimate.jaxpar_us == pytest.approx(
        default.estimate.jaxpar_us + section.cut_cost_us)
    assert default.estimate.ratio == pytest.approx(1.0)
    assert forced.estimate.ratio >= 1.0 and (forced.estimate.ratio > 1.0) == (
        section.cut_cost_us > 0.0)
    _shown_everywhere(forced)
    assert "forced: the GPU pricing would not emit this section" in forced.text()


def _direction(ratio: float) -> int:
    return 0 if abs(ratio - 1.0) < 0.02 else (1 if ratio > 1.0 else -1)


@needs_plugin
@pytest.mark.parametrize("name, options", [
    ("two_scans", {}), ("two_rnns", {}), ("towers", {}), ("inception", {}),
    ("inception", {"force_streams": True})])
def test_gpu_preview_shows_the_same_figure_as_its_plan(name, options):
    fn, args = PROGRAMS[name]
    # The preview's plan keeps inspect's pair; the compile's is beside it.
    preview = jaxpar.gpu_preview(fn, *args(), **options)
    figure = preview.compiled
    assert (figure.plain_us, figure.jaxpar_us) == (preview.plain.estimated_us,
                                                   preview.jaxpar.estimated_us)
    assert figure.ratio == pytest.approx(preview.time_ratio)
    chosen = preview.jaxpar_command_buffers.value
    assert ("deviceless H200 compile (lhs graphs)" if chosen == "lhs" else
            f"deviceless H200 compile (jaxpar in {chosen} graphs, plain in lhs)") in figure.source
    _shown_everywhere(preview.plan)
    assert preview.plan.estimate.line() in str(preview)
    assert f"{figure.plain_us:,.1f} us -> {figure.jaxpar_us:,.1f} us" in preview.verdict
    # The planner's own figure, without a compile, points the same way as the compile's;
    # where it knows the kernels XLA makes (loops, batched matmuls) it is within 15% of
    # the compile's ratio (XLA fuses some elementwise work after a GEMM into it and
    # launches other as a kernel of its own: two_scans' second body adds one a body).
    # (inception: XLA launches each convolution's relu as a kernel of its own, which the
    # planner's model fuses away: only the direction is checked.)
    planned = jaxpar.inspect(fn, target="gpu", **options)(*args()).estimate
    assert "not a compile" in planned.source and "compile (" in figure.source
    assert _direction(planned.ratio) == _direction(preview.time_ratio), (
        planned.line(), preview.verdict)
    if name in ("two_scans", "two_rnns", "towers"):
        assert figure.jaxpar_us < figure.plain_us  # the rewrites' launches, counted
        assert planned.ratio == pytest.approx(preview.time_ratio, rel=0.15), (
            planned.line(), figure.line())


@needs_plugin
def test_graphs_off_forced_plan_and_preview_agree(monkeypatch):
    # With CUDA graphs off in XLA_FLAGS the forced plan was once drawn 2x shorter
    # while gpu_preview said x1.000. Now the pricing's verdict (no net gain worth a
    # stream) and the compile (not faster) agree, and the plan says it is forced.
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    fn, args = PROGRAMS["inception"]
    plan = jaxpar.inspect(fn, target="gpu", force_streams=True)(*args())
    assert plan.priced_in == "off" and plan.num_regions >= 2 and plan.estimate.rejected
    assert plan.estimate.ratio > 0.98  # no longer drawn as a near-2x gain
    preview = jaxpar.gpu_preview(fn, *args(), force_streams=True)
    assert preview.command_buffers.value == "off" and preview.time_ratio > 0.98
    _shown_everywhere(preview.plan)


@pytest.mark.parametrize("name", ["two_scans", "towers"])
def test_a_plan_that_emits_nothing_estimates_its_program_run_serially(name):
    # target="cpu" emits no stream: the sections the planner drew do not overlap, so the
    # estimate must not promise their critical path (it showed x0.544 for two scans whose
    # program is jax.jit's).
    fn, args = PROGRAMS[name]
    plan = jaxpar.inspect(fn, target="cpu", min_cost_us=0.0)(*args())
    assert not plan.emitted and plan.sections
    assert plan.estimate.ratio == pytest.approx(1.0), plan.estimate.line()
    assert plan.estimate.line() in plan.text() and plan.estimate.line() in html.unescape(
        plan.to_svg())
