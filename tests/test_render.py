"""The plan's pictures: SVG/HTML/dot structure, and the saved page rendered in Chromium.

The browser test renders the saved HTML in headless Chromium (Debian's `chromium`, which
`scripts/test.sh` installs) and reads back, from the rendered page, the on-screen size of
every stream lane and every region box. Without Chromium it skips, except under CI, where
it fails: there the browser is part of the set-up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import pytest
from test_plan import cnn_args, cnn_loss

import jaxpar

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Appended to a copy of the page: measures what the browser actually drew.
_MEASURE = """<script>
window.addEventListener("load", () => {
  const boxes = (sel) => [...document.querySelectorAll(sel)].map((el) => {
    const r = el.getBoundingClientRect();
    return {stream: el.dataset.stream || null, lane: el.dataset.lane || null,
            width: r.width, height: r.height};
  });
  const out = document.createElement("pre");
  out.id = "measured";
  out.textContent = JSON.stringify({lanes: boxes("g.lane"), regions: boxes("g.region")});
  document.body.appendChild(out);
});
</script>"""


def grad_plan():
    return jaxpar.inspect(jax.value_and_grad(cnn_loss), target="gpu")(*cnn_args())


def test_svg_has_a_lane_per_stream_and_a_box_per_region():
    plan = grad_plan()
    svg = plan.to_svg()
    lanes = re.findall(r'class="lane" data-lane="([^"]+)"', svg)
    assert lanes == ["main", *[f"stream {k}" for k in range(1, plan.num_streams + 1)]]
    assert len(re.findall(r'class="region"', svg)) == plan.num_regions
    assert svg.count("<title>") == plan.num_regions  # hover text on every box
    assert "conv_general_dilated" in svg


def test_html_repr_save_and_dot(tmp_path):
    plan = grad_plan()
    assert plan._repr_html_().startswith("<div><svg")
    path = tmp_path / "plan.html"
    plan.save(path)
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "jaxpar plan for" in page
    dot = plan.to_dot()
    assert dot.startswith("digraph") and dot.count("subgraph cluster_") == len(plan.sections)
    with pytest.raises(ValueError, match=r"\.html"):
        plan.save(tmp_path / "plan.svg")


def test_plan_without_sections_renders():
    plan = jaxpar.inspect(lambda x: x * 2, target="gpu")(jax.numpy.ones(3))
    assert "no parallel sections" in plan.to_svg()


def _render(page: Path) -> dict:
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=2000",
             "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    match = re.search(r'<pre id="measured">(.*?)</pre>', result.stdout, re.S)
    assert match, f"nothing measured; chromium said: {result.stderr[-1500:]}"
    return json.loads(match.group(1).replace("&quot;", '"'))


def test_browser_draws_every_lane_and_region(tmp_path):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; scripts/test.sh installs it")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    plan = grad_plan()
    path = tmp_path / "plan.html"
    plan.save(path)
    measured_page = tmp_path / "measured.html"
    measured_page.write_text(path.read_text().replace("</body>", _MEASURE + "</body>"))
    drawn = _render(measured_page)
    assert [lane["lane"] for lane in drawn["lanes"]] == [
        "main", *[f"stream {k}" for k in range(1, plan.num_streams + 1)]]
    assert all(lane["width"] > 100 and lane["height"] > 20 for lane in drawn["lanes"])
    assert len(drawn["regions"]) == plan.num_regions
    assert all(box["width"] >= 40 and box["height"] > 20 for box in drawn["regions"])
    assert sorted({box["stream"] for box in drawn["regions"]}) == ["1", "2"]
