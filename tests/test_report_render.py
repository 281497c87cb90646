"""``jaxpar._report.render``, the plan's pictures: the SVG timeline, HTML page, Chrome trace
and dot, and the saved page rendered in Chromium.

The browser test renders the saved HTML in headless Chromium (Debian's `chromium`, which
`scripts/test.sh` installs) and reads back, from the rendered page, the on-screen position
and size of every lane and every box of the timeline. Without Chromium it skips, except
under CI, where it fails: there the browser is part of the set-up.
"""

from __future__ import annotations

import html
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import pytest
from helpers.benchmarks import hetero_batch_benchmark, seed_002_small_args
from helpers.programs import cnn_args, cnn_loss
from jax import lax

import jaxpar
from jaxpar._report.render import plan_to_chrome_trace
from jaxpar._report.timeline import lay_out

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Appended to a copy of the page: measures what the browser actually drew.
_MEASURE = """<script>
window.addEventListener("load", () => {
  const boxes = (sel, inner) => [...document.querySelectorAll(sel)].map((el) => {
    const r = (inner ? el.querySelector(inner) : el).getBoundingClientRect();
    return {lane: el.dataset.lane || null, kind: el.dataset.kind || null,
            level: el.dataset.level || null,
            start: el.dataset.startUs === undefined ? null : Number(el.dataset.startUs),
            duration: el.dataset.durationUs === undefined ? null
                      : Number(el.dataset.durationUs),
            x: r.left, y: r.top, width: r.width, height: r.height};
  });
  const out = document.createElement("pre");
  out.id = "measured";
  out.textContent = JSON.stringify({
    lanes: boxes("g.lane"), spans: boxes("g.span", "rect.box"),
    ticks: [...document.querySelectorAll("text.tick")].map((t) => t.textContent),
    legend: [...document.querySelectorAll("g.legend-entry")].map((g) => g.dataset.key),
    rewrites: [...document.querySelectorAll("g.loop-rewrite")].map((g) => g.dataset.rewrite),
    groups: [...document.querySelectorAll("g.batched-group")].map((g) => {
      const r = g.querySelector("rect.group-box").getBoundingClientRect();
      return {members: Number(g.dataset.members), dots: g.querySelectorAll("circle").length,
              x: r.left, y: r.top, width: r.width, height: r.height};
    }),
    picture: (() => {
      const r = document.querySelector("svg.jaxpar-plan").getBoundingClientRect();
      return {x: r.left, y: r.top, width: r.width, height: r.height};
    })(),
  });
  document.body.appendChild(out);
});
</script>"""


def grad_plan():
    # Forced past the GPU pricing: the picture of a plan with sections is what is tested.
    return jaxpar.inspect(jax.value_and_grad(cnn_loss), target="gpu",
                          force_streams=True)(*cnn_args())


def two_scans(a, b, xs):
    first, _ = lax.scan(lambda c, x: (jax.numpy.tanh(c @ x), None), a, xs)
    second, _ = lax.scan(lambda c, x: (jax.numpy.sin(x @ c) + c, None), b, xs)
    return first, second


def two_scans_args():
    return (jax.ShapeDtypeStruct((100, 100), "float32"),) * 2 + (
        jax.ShapeDtypeStruct((64, 100, 100), "float32"),)


def test_svg_draws_every_step_of_the_top_level_on_its_lane():
    plan = grad_plan()
    svg = plan.to_svg()
    lanes = re.findall(r'class="lane" data-lane="([^"]+)"', svg)
    assert lanes == ["main", *[f"stream {k}" for k in range(1, plan.num_streams + 1)]]
    spans = re.findall(r'class="span" data-lane="([^"]+)" data-kind="([a-z]+)"', svg)
    assert len(spans) == len(plan.steps)
    assert sum(kind == "region" for _, kind in spans) == plan.num_regions
    assert {lane for lane, kind in spans if kind == "main"} == {"main"}  # main-stream work too
    assert svg.count("<title>") == len(plan.steps)  # hover text on every box
    assert "conv_general_dilated" in svg
    # The plan's one estimate is the title's figure, as in the text header.
    assert plan.estimate.line() in html.unescape(svg)
    assert plan.estimate.line() in plan.text()
    for key in ("main", "stream 1", "stream 2"):
        assert f'data-key="{key}"' in svg  # the legend


def test_timeline_schedules_regions_side_by_side_and_dependents_after():
    plan = grad_plan()
    (top,) = lay_out(plan).levels
    by_step = {span.step: span for span in top.spans}
    for index, step in enumerate(plan.steps):
        for before in step.after:  # nothing starts before what it reads has finished
            assert by_step[index].start_us >= by_step[before].end_us - 1e-9
    for section_index in range(len(plan.sections)):
        regions = [by_step[k] for k, step in enumerate(plan.steps)
                   if step.kind == "region" and step.section == section_index]
        assert len(regions) == 2
        assert max(r.start_us for r in regions) < min(r.end_us for r in regions)  # overlap
    # Scaled to end at the plan's estimate (its header), the steps' proportions kept.
    assert top.serial_us == pytest.approx(plan.total_cost_us * top.scale)
    assert top.makespan_us == pytest.approx(plan.estimate.jaxpar_us)
    assert top.makespan_us < top.serial_us


def test_timeline_time_source_is_one_function():
    plan = grad_plan()
    doubled = lay_out(plan, duration_us=lambda p, step: 2 * step.cost_us, fit=False)
    assert doubled.levels[0].makespan_us == pytest.approx(
        2 * lay_out(plan, fit=False).levels[0].makespan_us)


def test_fused_and_unrolled_loops_are_drawn():
    plan = jaxpar.inspect(two_scans, target="gpu")(*two_scans_args())
    kinds = {d.kind for d in plan.decisions}
    assert {"fused", "unrolled"} <= kinds, str(plan)
    (loop,) = [s for s in plan.steps if s.kind == "loop"]
    assert {plan.decisions[k].kind for k in loop.loop_rewrites} == {"fused", "unrolled"}
    svg = plan.to_svg()
    assert 'data-rewrite="fused"' in svg and 'data-rewrite="unrolled"' in svg
    assert 'data-key="rewrite:fused"' in svg and 'data-key="rewrite:unrolled"' in svg


def seed_002_plan():
    bench = hetero_batch_benchmark()
    return jaxpar.inspect(bench.seed_002, target="gpu")(*seed_002_small_args())


def test_batched_matmul_groups_are_drawn_on_their_loop():
    """Two scans with different bodies: the fused loop's box holds a box per batched
    matmul group, labelled with its member count, and the legend explains it."""
    plan = seed_002_plan()
    groups = [k for k, d in enumerate(plan.decisions) if d.kind == "batched matmuls"]
    assert len(groups) == 4, str(plan)
    (loop,) = [s for s in plan.steps if s.kind == "loop"]
    assert loop.batched_groups == tuple(groups)
    svg = plan.to_svg()
    drawn = re.findall(r'<g class="loop-rewrite batched-group" data-rewrite="batched matmuls" '
                       r'data-members="(\d+)" data-depth="(\d+)">', svg)
    assert sorted(drawn) == sorted(("2", str(plan.decisions[k].depth)) for k in groups)
    assert svg.count("batched matmuls: 2 members</text>") == len(groups)
    assert 'data-key="rewrite:batched matmuls"' in svg
    trace = plan_to_chrome_trace(plan)
    (event,) = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(event["args"]["batched_groups"]) == len(groups)


def test_chrome_trace_has_complete_events_for_every_step(tmp_path):
    plan = grad_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(plan.steps)
    for event in complete:
        assert isinstance(event["name"], str) and event["name"]
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0
        assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in complete} <= set(names)  # every lane is named
    assert sorted(set(names.values())) == ["main", "stream 1", "stream 2"]
    (top,) = lay_out(plan).levels
    assert max(e["ts"] + e["dur"] for e in complete) == pytest.approx(top.makespan_us)


def test_html_repr_save_and_dot(tmp_path):
    plan = grad_plan()
    assert plan._repr_html_().startswith("<div><svg")
    path = tmp_path / "plan.html"
    plan.save(path)
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "jaxpar plan for" in page
    dot = plan.to_dot()
    assert dot.startswith("digraph") and dot.count("subgraph cluster_") == len(plan.sections)
    with pytest.raises(ValueError, match=r"\.html.*\.json"):
        plan.save(tmp_path / "plan.svg")


def test_plan_without_sections_renders():
    plan = jaxpar.inspect(lambda x: x * 2, target="gpu")(jax.numpy.ones(3))
    assert "no stream sections: everything stays on the main stream" in plan.to_svg()


def _render(page: Path) -> dict:
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=2000",
             "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    match = re.search(r'<pre id="measured">(.*?)</pre>', result.stdout, re.S)
    assert match, f"nothing measured; chromium said: {result.stderr[-1500:]}"
    return json.loads(match.group(1).replace("&quot;", '"'))


def _browser_measure(plan, tmp_path) -> dict:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; scripts/test.sh installs it")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    path = tmp_path / "plan.html"
    plan.save(path)
    measured_page = tmp_path / "measured.html"
    measured_page.write_text(path.read_text().replace("</body>", _MEASURE + "</body>"))
    return _render(measured_page)


def test_browser_draws_a_linear_timeline(tmp_path):
    plan = grad_plan()
    drawn = _browser_measure(plan, tmp_path)
    assert [lane["lane"] for lane in drawn["lanes"]] == [
        "main", *[f"stream {k}" for k in range(1, plan.num_streams + 1)]]
    assert all(lane["width"] > 100 and lane["height"] > 20 for lane in drawn["lanes"])
    spans = drawn["spans"]
    assert len(spans) == len(plan.steps)
    assert sorted({s["lane"] for s in spans if s["kind"] == "region"}) == ["stream 1",
                                                                          "stream 2"]
    assert any(s["kind"] == "main" for s in spans)
    lane_top = {lane["lane"]: (lane["y"], lane["y"] + lane["height"]) for lane in drawn["lanes"]}
    for s in spans:  # each box inside its lane
        top, bottom = lane_top[s["lane"]]
        assert top <= s["y"] and s["y"] + s["height"] <= bottom + 0.5
    # Linear: pixels per microsecond and the origin are the same for every visible box.
    wide = [s for s in spans if s["width"] > 4]
    scales = [s["width"] / s["duration"] for s in wide]
    assert max(scales) == pytest.approx(min(scales), rel=0.02)
    origins = [s["x"] - s["start"] * scales[0] for s in wide]
    assert max(origins) - min(origins) < 1.5
    assert drawn["ticks"][0] == "0" and len(drawn["ticks"]) >= 3
    assert {"main", "stream 1", "stream 2"} <= set(drawn["legend"])


def test_browser_draws_loop_rewrites(tmp_path):
    plan = jaxpar.inspect(two_scans, target="gpu")(*two_scans_args())
    drawn = _browser_measure(plan, tmp_path)
    assert {"fused", "unrolled"} <= set(drawn["rewrites"])
    assert {"rewrite:fused", "rewrite:unrolled", "loop"} <= set(drawn["legend"])
    (loop,) = [s for s in drawn["spans"] if s["kind"] == "loop"]
    assert loop["width"] > 800  # the only step: the whole time axis


def test_browser_draws_batched_matmul_groups_inside_the_picture(tmp_path):
    plan = seed_002_plan()
    drawn = _browser_measure(plan, tmp_path)
    groups, picture = drawn["groups"], drawn["picture"]
    assert len(groups) == 4 and "rewrite:batched matmuls" in drawn["legend"]
    (loop,) = [s for s in drawn["spans"] if s["kind"] == "loop"]
    for group in groups:
        assert group["members"] == group["dots"] == 2
        assert group["width"] > 40 and group["height"] > 15
        # Inside the loop's box, which is inside the picture.
        assert loop["x"] - 0.5 <= group["x"] and \
            group["x"] + group["width"] <= loop["x"] + loop["width"] + 0.5
        assert loop["y"] - 0.5 <= group["y"] and \
            group["y"] + group["height"] <= loop["y"] + loop["height"] + 0.5
        assert picture["x"] <= group["x"] and \
            group["x"] + group["width"] <= picture["x"] + picture["width"]
        assert picture["y"] <= group["y"] and \
            group["y"] + group["height"] <= picture["y"] + picture["height"]
    # Side by side in launch-depth order, not overlapping.
    lefts = [g["x"] for g in groups]
    assert lefts == sorted(lefts)
    assert all(a["x"] + a["width"] <= b["x"] + 0.5 for a, b in itertools.pairwise(groups))
