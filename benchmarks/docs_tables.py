"""Regenerates the figures of the docs that come from plans, in place, with one command.

* ``docs/benchmarks.md``: the table between ``<!-- docs_tables: plans begin -->`` and
  ``<!-- docs_tables: plans end -->``: for each workload of ``benchmarks/run.py`` (quick
  size, shapes only, nothing run), what jaxpar's GPU plan does by default and with
  ``force_streams=True``. ``tests/test_docs.py`` fails when a row disagrees with the code.
* ``--picture``: ``docs/plan.png``, a forced plan (the README says so), drawn with the
  GPU pricing's verdict, through headless Chromium. The PNG carries its plan's figures as
  text (a ``tEXt`` chunk, ``picture_caption``), so ``tests/test_docs.py`` fails when the
  picture's figures are no longer what the code plans.

Run::

    JAX_PLATFORMS=cpu python benchmarks/docs_tables.py [--picture] [--check]

``--check`` writes nothing and exits 1 when the table is stale.
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import run as suite  # benchmarks/run.py

import jaxpar

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- docs_tables: plans begin -->"
END = "<!-- docs_tables: plans end -->"
HEADER = ("| workload (quick size) | jaxpar's rewrites, target=\"gpu\" | stream regions "
          "| forced: regions, pricing's verdict |\n|---|---|---|---|")


def plan_row(name: str) -> str:
    """One table row, computed from the current code (plans only: cheap, deterministic)."""
    workload = suite.WORKLOADS[name]
    specs = workload.arg_specs("quick")
    plan = jaxpar.inspect(workload.fn, target="gpu")(*specs)
    forced = jaxpar.inspect(workload.fn, target="gpu", force_streams=True)(*specs)
    verdict = ("rejected" if forced.estimate.rejected else "pays") if forced.num_regions else "-"
    return (f"| {name} | {plan.summary()} | {plan.num_regions} "
            f"| {forced.num_regions}, {verdict} |")


def plan_table() -> str:
    return "\n".join([HEADER, *(plan_row(name) for name in suite.WORKLOADS)])


def replace_table(text: str, table: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{BENCHMARKS_MD}: the markers {BEGIN} / {END} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def inception_loss(params: Any, x: Any) -> Any:
    import inception_block

    return jnp.mean(inception_block.inception(x, params) ** 2)


def picture_plan() -> jaxpar.Plan:
    """The README's picture: an inception block's forward and backward pass, forced."""
    import inception_block

    x, params = inception_block.make_args()
    return jaxpar.inspect(jax.value_and_grad(inception_loss), target="gpu",
                          force_streams=True)(params, x)


PICTURE_KEY = "jaxpar plan"


def picture_caption(plan: jaxpar.Plan) -> str:
    """The figures the picture's title shows: function, size, estimate, forced verdicts."""
    figure = plan.estimate
    return "\n".join([f"drawn with jax {jax.__version__}",
                      f"{plan.function}: {plan.num_eqns} equations, {plan.num_streams} streams",
                      figure.line(), *(f"forced: {why}" for why in figure.rejected)])


def with_caption(png: bytes, caption: str) -> bytes:
    """``png`` with ``caption`` in a ``tEXt`` chunk (keyword ``PICTURE_KEY``) after IHDR."""
    data = PICTURE_KEY.encode("latin-1") + b"\0" + caption.encode("ascii")
    chunk = (struct.pack(">I", len(data)) + b"tEXt" + data
             + struct.pack(">I", zlib.crc32(b"tEXt" + data)))
    end_of_header = 8 + 4 + 4 + 13 + 4  # signature, then IHDR's length, type, data, CRC
    return png[:end_of_header] + chunk + png[end_of_header:]


def read_caption(png: bytes) -> str | None:
    """The ``tEXt`` caption ``with_caption`` wrote, or None."""
    position = 8
    while position + 8 <= len(png):
        length, kind = struct.unpack(">I4s", png[position:position + 8])
        data = png[position + 8:position + 8 + length]
        if kind == b"tEXt" and data.startswith(PICTURE_KEY.encode("latin-1") + b"\0"):
            return data.split(b"\0", 1)[1].decode("ascii")
        position += 12 + length
    return None


def draw_picture(path: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("--picture needs headless Chromium (apt-get install chromium)")
    plan = picture_plan()
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "plan.html"
        page.write_text("<!DOCTYPE html><html><body style=\"margin:0\">"
                        f"{plan.to_svg()}</body></html>")
        height = int(plan.to_svg().split('height="', 1)[1].split('"', 1)[0]) + 8
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                        "--hide-scrollbars", f"--screenshot={path}",
                        f"--window-size=1000,{height}", page.as_uri()],
                       check=True, capture_output=True, timeout=120)
    path.write_bytes(with_caption(path.read_bytes(), picture_caption(plan)))
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--picture", action="store_true", help="also redraw docs/plan.png")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    text = BENCHMARKS_MD.read_text()
    new = replace_table(text, plan_table())
    if args.check:
        print("docs/benchmarks.md is up to date" if new == text else
              "docs/benchmarks.md is stale: run python benchmarks/docs_tables.py")
        return 0 if new == text else 1
    if new != text:
        BENCHMARKS_MD.write_text(new)
        print(f"updated {BENCHMARKS_MD}")
    if args.picture:
        draw_picture(ROOT / "docs" / "plan.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
