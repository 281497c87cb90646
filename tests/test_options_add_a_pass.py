"""Adding a pass the way ``jaxpar/_options.py``'s docstring says: in a scratch copy of the
package, a module ``jaxpar/passes/shift_sines.py`` and its row in ``PASS_TABLE`` (and
the tpu row's column), no other file touched. The option is then taken by
``parallel_branches`` and ``inspect``, runs on every target, is a CLI flag, an ``Args``
entry and a keyword of the runtime signature, and has its one-pass function; the written
signatures and docs/api.md are what the tests say to paste. A row without its module is
an error naming the file when jaxpar's passes load.

One subprocess does all of it (a fresh interpreter with the copy first on ``sys.path``), and
one more checks the missing module: 17 s of wall time together on this shared 2-core CPU
machine, most of it importing jax and lowering 9 programs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import jaxpar.passes
from jaxpar._options import PassRow

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "jaxpar"

# The pass, as a maintainer writes it (passes/_protocol.py): sin(x) as cos(pi/2 - x), the
# same values to rounding, and a lowered program with cosines and no sines.
PASS_MODULE = '''"""A scratch pass: ``sin(x)`` computed as ``cos(pi/2 - x)``."""

from __future__ import annotations

import math

import jax.numpy as jnp

from .._analysis import Analysis
from ._protocol import Level, LevelResult, Rewrite


def run(level: Level, analysis: Analysis) -> LevelResult:
    return LevelResult([Rewrite((i,), lambda rows: [[jnp.cos(math.pi / 2 - rows[0][0])]])
                        for i, eqn in enumerate(level.eqns) if eqn.primitive.name == "sin"])
'''
ROW = '    PassRow("shift_sines", "sin(x) computed as cos(pi/2 - x)", option="shift_sines"),\n'

# What the subprocess checks and prints (as JSON): each fact the test asserts.
SCRIPT = r'''
import contextlib, inspect, io, json, pathlib, sys
import jax, jax.numpy as jnp
import jaxpar
from jaxpar import _cli
from helpers.table_options import missing_from_docs, missing_from_signatures

def f(x):
    return jnp.sin(x) * 2.0 + 1.0

x = jnp.linspace(-2.0, 2.0, 8)
facts = {"package": jaxpar.__file__, "lowered": {}, "inspected": {}}
for target in ("cpu", "gpu", "tpu"):
    for value in (True, False, "auto"):
        text = jaxpar.parallel_branches(f, target=target, shift_sines=value).lower(x).as_text()
        facts["lowered"][f"{target} {value}"] = [op for op in ("stablehlo.sine", "stablehlo.cosine")
                                                 if op in text]
    plan = jaxpar.inspect(f, target=target, shift_sines=True)(x)
    facts["inspected"][target] = dict(plan.options)["shift_sines"]
shifted = jaxpar.parallel_branches(f, target="cpu", shift_sines=True)
facts["values"] = float(jnp.max(jnp.abs(shifted(x) - jax.jit(f)(x))))
try:
    jaxpar.parallel_branches(f, shift_sines="yes")
except ValueError as error:
    facts["refused"] = str(error)
parameter = inspect.signature(jaxpar.parallel_branches).parameters["shift_sines"]
facts["signature"] = [str(parameter.kind), parameter.default, parameter.annotation]
doc = jaxpar.parallel_branches.__doc__
start = doc.index("      shift_sines:")
facts["docstring"] = doc[start:doc.index("      group_collectives:", start)]
pathlib.Path("program.py").write_text(
    "import jax.numpy as jnp\ndef f(x):\n    return jnp.sin(x) * 2.0 + 1.0\n")
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = _cli.main(["inspect", "program.py:f", "--args", "f32[8]", "--target", "tpu",
                      "--shift-sines", "true", "--json"])
facts["cli"] = [code, json.loads(out.getvalue())["options"]["shift_sines"]]
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    _cli.main(["inspect", "--help"])
facts["cli_help"] = " ".join(out.getvalue().split())
new, _ = jaxpar.passes.shift_sines(jax.make_jaxpr(f)(x))
facts["one_pass"] = [str(new), jaxpar.passes.shift_sines.__doc__,
                     "shift_sines" in jaxpar.passes.__all__]
facts["signatures"] = missing_from_signatures()
facts["docs"] = missing_from_docs(pathlib.Path(sys.argv[1]).read_text())
print(json.dumps(facts))
'''


def _scratch_copy(tmp_path: Path, row: str) -> Path:
    """A copy of the package under ``tmp_path`` with ``row`` added at the end of its pass
    table (a text edit of its ``_options.py``); returns the folder holding it."""
    root = tmp_path / "scratch"
    shutil.copytree(PACKAGE, root / "jaxpar", ignore=shutil.ignore_patterns("__pycache__"))
    options = root / "jaxpar" / "_options.py"
    text = options.read_text()
    start = text.index("PASS_TABLE: tuple[PassRow, ...] = (")
    end = text.index("\n)\n", start) + 1
    options.write_text(text[:end] + row + text[end:])
    return root


def _run(root: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh interpreter with the copy first on ``sys.path`` (then the
    tests' helpers), in the copy's folder."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(root), str(TESTS)])}
    return subprocess.run([sys.executable, "-c", script, *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = _scratch_copy(tmp_path_factory.mktemp("add_a_pass"), ROW)
    (root / "jaxpar" / "passes" / "shift_sines.py").write_text(PASS_MODULE)
    tpu = root / "jaxpar" / "targets" / "tpu.py"
    text, count = re.subn(r'(TargetRow\("tpu", \("tpu",\), \{)', r'\1"shift_sines": True, ',
                          tpu.read_text())
    assert count == 1, "jaxpar/targets/tpu.py's row changed form: update this test's edit"
    tpu.write_text(text)
    done = _run(root, SCRIPT, str(TESTS.parent / "docs" / "api.md"))
    assert done.returncode == 0, done.stderr[-4000:]
    made: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert made["package"].startswith(str(root)), made["package"]  # the copy ran
    return made


def test_the_option_runs_the_pass_on_every_target(facts: dict[str, Any]) -> None:
    cosine, sine = ["stablehlo.cosine"], ["stablehlo.sine"]
    for target in ("cpu", "gpu", "tpu"):
        assert facts["lowered"][f"{target} True"] == cosine, target
        assert facts["lowered"][f"{target} False"] == sine, target
        assert facts["inspected"][target] is True
    # "auto": the tpu row's column turns it on there, and only there.
    assert [facts["lowered"][f"{t} auto"] for t in ("cpu", "gpu", "tpu")] == [sine, sine, cosine]
    assert facts["values"] < 1e-5  # against jax.jit: cos(pi/2 - x) is sin(x) to rounding
    assert facts["refused"] == "shift_sines must be True, False or 'auto', got 'yes'"


def test_the_option_is_in_the_signature_docstring_cli_and_one_pass_function(
        facts: dict[str, Any]) -> None:
    assert facts["signature"] == ["KEYWORD_ONLY", "auto", "Switch"]
    # Its Args entry, made from the row, after the last pass option's.
    assert facts["docstring"] == (
        "      shift_sines: sin(x) computed as cos(pi/2 - x) (the pass ``shift_sines``): True,\n"
        '        False or ``"auto"``; ``"auto"``: on for tpu, off elsewhere.\n')
    assert facts["cli"] == [0, True]
    assert "--shift-sines VALUE sin(x) computed as cos(pi/2 - x) (the pass shift_sines): " \
        "True, False or \"auto\" (default: 'auto')" in facts["cli_help"]
    text, doc, exported = facts["one_pass"]
    assert "cos" in text and "sin" not in text and exported
    assert doc.startswith("Runs the pass ``shift_sines`` (sin(x) computed as cos(pi/2 - x)) "
                          "alone")


def test_the_tests_say_what_to_paste_into_the_signatures_and_docs(
        facts: dict[str, Any]) -> None:
    assert facts["signatures"] == [
        "jaxpar/_api.py, overload 0 of parallel_branches: add the line\n"
        "    shift_sines: Switch = ...,\n"
        "after its parameter associative_scans (the option of the pass shift_sines)",
        "jaxpar/_api.py, overload 1 of parallel_branches: add the line\n"
        "    shift_sines: Switch = ...,\n"
        "after its parameter associative_scans (the option of the pass shift_sines)",
        "jaxpar/_api.py, the definition of parallel_branches: add the line\n"
        '    shift_sines: Switch = "auto",\n'
        "after its parameter associative_scans (the option of the pass shift_sines)",
        "jaxpar/_api.py, InspectOptions: add the line\n"
        "    shift_sines: Switch\n"
        "after its parameter associative_scans (the option of the pass shift_sines)"]
    assert facts["docs"] == [
        'docs/api.md, the heading ### `jaxpar.parallel_branches(...)`: add '
        '`shift_sines="auto", ` after `associative_scans=...`',
        "docs/api.md, under the heading of jaxpar.parallel_branches: add the line\n"
        "- `shift_sines`: sin(x) computed as cos(pi/2 - x) (the pass `shift_sines`).\n"
        "after the entry of `associative_scans`"]


def test_a_row_without_its_module_is_an_error_naming_the_file(tmp_path: Path) -> None:
    root = _scratch_copy(tmp_path, ROW)
    done = _run(root, "import jaxpar; jaxpar.parallel_branches")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "ImportError: jaxpar's pass table (_options.PASS_TABLE) has the row 'shift_sines', "
        "and there is no module jaxpar.passes.shift_sines: add jaxpar/passes/shift_sines.py "
        "defining run(level: Level, analysis: Analysis) -> LevelResult (and State, a class "
        "made once per call, for state of its own); see jaxpar/passes/_protocol.py, or "
        "remove the row")


def test_a_module_without_run_is_an_error_naming_the_row(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    row = PassRow("shift_sines", "a test's pass", option="shift_sines")
    monkeypatch.setitem(sys.modules, "jaxpar.passes.shift_sines",
                        types.ModuleType("jaxpar.passes.shift_sines"))
    with pytest.raises(ImportError, match=r"jaxpar\.passes\.shift_sines has no run\(level, "
                                          r"analysis\) for its row 'shift_sines' .* needs "
                                          r"jaxpar/passes/shift_sines\.py defining run"):
        jaxpar.passes._bind(row)
