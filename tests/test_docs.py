"""Every public name is documented, and every example and every code block of the docs runs.

The python blocks of README.md and docs/*.md run in order, sharing one namespace per file
(as a reader pasting them into one session would), each file in a folder of its own. The
files share one process, started with 4 CPU devices, so JAX starts once: no block may
change the process for the files after it (a block that sets `XLA_FLAGS` is skipped, see
below). A block may be skipped only with a visible reason, written as a comment line just
above it:

    <!-- doc-test: skip (needs a GPU) -->

and a block may ask for the CUDA PJRT plugin (gpu_preview's deviceless compiles):

    <!-- doc-test: needs the CUDA plugin -->

which runs where the plugin is installed and is skipped, saying so, elsewhere.
Shell blocks are not run.

What a block prints, where the docs quote it, is checked against what it prints now, so
the figures of the docs cannot drift from the code's. Two forms are checked:

* a fence without a language, marked as what the python block above it printed:

      <!-- doc-test: printed by the block above -->

  Its lines must appear, in order, among the lines the block printed (a `...` line leaves
  lines out). Source places (`file.py:13`, `docs/guide.md:412`) match any place.
* comment lines right after a one-line `print(...)` in a python block: their text, lines
  joined, must appear in what the block printed.
"""

from __future__ import annotations

import importlib.util
import inspect as pyinspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from helpers.benchmarks import load_benchmark

import jaxpar

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", jaxpar.__all__)
def test_public_name_in_api_reference(name):
    api = (ROOT / "docs" / "api.md").read_text()
    assert re.search(rf"`jaxpar\.{re.escape(name)}\b", api), f"jaxpar.{name} is not in docs/api.md"


def _public_functions() -> list[str]:
    return [name for name in jaxpar.__all__ if pyinspect.isfunction(getattr(jaxpar, name))]


@pytest.mark.parametrize("name", _public_functions())
def test_api_reference_has_one_signature_with_every_parameter(name):
    # One heading per function, and it names every parameter the code takes (an option
    # added to the code and not to docs/api.md fails here).
    api = (ROOT / "docs" / "api.md").read_text()
    headings = re.findall(rf"^### `jaxpar\.{re.escape(name)}\((.*)\)`$", api, re.M)
    assert len(headings) == 1, f"docs/api.md has {len(headings)} signature headings for {name}"
    # Named parameters, in order (``*args``/``**options`` are shown where they carry
    # arguments, and some exist only to refuse misuse with a clear error).
    documented = [part.strip().split("=")[0] for part in headings[0].split(",")]
    documented = [part for part in documented if part and not part.startswith("*")]
    variadic = (pyinspect.Parameter.VAR_POSITIONAL, pyinspect.Parameter.VAR_KEYWORD)
    actual = [p.name for p in pyinspect.signature(getattr(jaxpar, name)).parameters.values()
              if p.kind not in variadic]
    assert documented == actual, (
        f"docs/api.md's heading for {name} lists {documented}, the code takes {actual}")


def test_benchmarks_plan_table_matches_the_code():
    # Every row of the generated table in docs/benchmarks.md is what the current code
    # plans (plans only: cheap); refresh with `python benchmarks/docs_tables.py`.
    tables = load_benchmark("docs_tables")
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    written = text.split(tables.BEGIN, 1)[1].split(tables.END, 1)[0].strip().splitlines()
    assert written[:2] == tables.HEADER.splitlines()
    rows = {row.split("|")[1].strip(): row for row in written[2:]}
    assert sorted(rows) == sorted(tables.suite.WORKLOADS), "run benchmarks/docs_tables.py"
    for name, row in rows.items():
        assert row == tables.plan_row(name), (
            f"docs/benchmarks.md's row for {name} is stale: run python "
            "benchmarks/docs_tables.py")


def test_plan_picture_shows_what_the_code_plans():
    # docs/plan.png carries the figures of its title as text; they are what the code
    # plans now. Redraw with `python benchmarks/docs_tables.py --picture`.
    tables = load_benchmark("docs_tables")
    caption = tables.read_caption((ROOT / "docs" / "plan.png").read_bytes())
    assert caption is not None, "docs/plan.png has no caption: run docs_tables.py --picture"
    drawn_with = caption.splitlines()[0]
    if drawn_with != f"drawn with jax {jax.__version__}":
        # The forced plan's pricing differs between jax versions; one lane checks it.
        pytest.skip(f"docs/plan.png was {drawn_with}; this run has jax {jax.__version__}")
    assert caption == tables.picture_caption(tables.picture_plan()), (
        "docs/plan.png is stale: run python benchmarks/docs_tables.py --picture")
    header = b"\x89PNG\r\n\x1a\n" + (13).to_bytes(4, "big") + b"IHDR" + bytes(17)
    png = tables.with_caption(header, "a\nb")
    assert tables.read_caption(png) == "a\nb"


def test_public_functions_have_docstrings():
    for name in jaxpar.__all__:
        obj = getattr(jaxpar, name)
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), f"jaxpar.{name} has no docstring"


@pytest.mark.parametrize("example", ["two_scans", "inception_block", "ensemble"])
def test_example_main_runs(example, capsys):
    spec = importlib.util.spec_from_file_location(example, ROOT / "examples" / f"{example}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    out = capsys.readouterr().out
    # What an example says jaxpar did is computed from its plan, never written by hand.
    assert "what jaxpar changed" in out
    assert not re.search(r"\d+ streams\b|run concurrently|on their own streams", out)


def test_collective_matmul_example_runs():
    # Needs 8 devices before the backend starts: its own process.
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "collective_matmul.py")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "parallel_branches: matches x @ w" in result.stdout


DOC_FILES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
_MARK = re.compile(r"<!-- doc-test: (skip \((?P<reason>[^)]+)\)|needs the CUDA plugin"
                   r"|(?P<printed>printed by the block above)) -->\s*$")

# Runs the blocks of each file in a namespace and folder of its own; reports, per file, the
# first failure by block, and what each block printed (for the quoted outputs).
_RUNNER = """
import contextlib, io, json, os, sys, traceback
results, printed = {}, {}
for name, (folder, blocks) in json.load(sys.stdin).items():
    os.chdir(folder)
    namespace = {"__name__": "__main__"}
    results[name], printed[name] = "", {}
    for block in blocks:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(block["code"], block["file"], "exec"), namespace)
        except BaseException:
            results[name] = (f"block at {block['file']}:{block['line']} failed:\\n"
                             + traceback.format_exc())
            break
        finally:
            printed[name][str(block["line"])] = out.getvalue()
print("RESULTS=" + json.dumps({"failures": results, "printed": printed}))
"""


def doc_blocks(name: str) -> list[dict]:
    """The python blocks of one file: code, first line, and the doc-test mark above it."""
    text = (ROOT / name).read_text()
    blocks = []
    for match in _FENCE.finditer(text):
        if match.group(1) != "python":
            continue
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        line = text.count("\n", 0, match.start()) + 2  # the block's first code line
        # Offset so tracebacks point at the line in the Markdown file.
        code = "\n" * (line - 1) + match.group(2)
        blocks.append({"file": name, "line": line, "code": code,
                       "skip": mark.group("reason") if mark and mark.group("reason") else None,
                       "needs_plugin": bool(mark and "CUDA plugin" in mark.group(0))})
    return blocks


def test_doc_files_are_found_and_marks_are_well_formed():
    assert "docs/guide.md" in DOC_FILES and "docs/quickstart.md" in DOC_FILES
    for name in DOC_FILES:
        for line in (ROOT / name).read_text().splitlines():
            if "doc-test:" in line:
                assert _MARK.search(line), f"{name}: malformed doc-test mark {line!r}"


def _blocks_to_run(name: str) -> tuple[list[dict], list[str]]:
    """The blocks of one file this machine runs, and the skipped ones with their reasons."""
    from jaxpar._compiled import plugin_status

    plugin, why = plugin_status()
    blocks, skipped = [], []
    for block in doc_blocks(name):
        if block["skip"]:
            skipped.append(f"{name}:{block['line']}: {block['skip']}")
        elif block["needs_plugin"] and not plugin:
            skipped.append(f"{name}:{block['line']}: needs the CUDA plugin ({why})")
        else:
            blocks.append(block)
    return blocks, skipped


_RUNS: dict[tuple[str, ...], tuple[dict[str, str], dict[str, dict[str, str]], str]] = {}


def _run_doc_files(names: tuple[str, ...], folder: Path
                   ) -> tuple[dict[str, str], dict[str, dict[str, str]], str]:
    """Runs the blocks of `names` in one process (once per session); returns each file's
    failure ("" when its blocks ran), what each block printed (by file, then by the
    block's first line) and the process's output."""
    if names not in _RUNS:
        files = {}
        for name in names:
            (folder / name).mkdir(parents=True)
            files[name] = (str(folder / name), _blocks_to_run(name)[0])
        # Four CPU devices, so the guide's shard_map ring has neighbours.
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
               "JAX_NUM_CPU_DEVICES": "4"}
        result = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(files),
                                capture_output=True, text=True, timeout=1800, cwd=folder,
                                env=env)
        lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS=")]
        results = json.loads(lines[-1][len("RESULTS="):]) if lines else {}
        _RUNS[names] = (results.get("failures", {}), results.get("printed", {}),
                        f"exit code {result.returncode}: {result.stderr[-4000:]}")
    return _RUNS[names]


def _doc_test_names(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """Every file this session runs blocks of, in one process: the first test to ask starts
    it (both tests below share it)."""
    names = tuple(item.callspec.params["name"] for item in request.session.items
                  if getattr(item, "originalname", "") in _DOC_TESTS)
    return tuple(dict.fromkeys(names))


@pytest.mark.parametrize("name", [n for n in DOC_FILES if doc_blocks(n)])
def test_doc_code_blocks_run(name, request, tmp_path_factory):
    failures, _, output = _run_doc_files(_doc_test_names(request),
                                         tmp_path_factory.mktemp("doc_blocks"))
    assert name in failures, f"the blocks of {name} did not run; the process ended with {output}"
    assert failures[name] == "", failures[name][-4000:]
    skipped = _blocks_to_run(name)[1]
    if skipped:
        print("skipped doc blocks (with their reasons):", *skipped, sep="\n  ")


_PLACE = re.compile(r"[\w./<>-]+\.(?:py|md):\d+(?::\d+)?")


def _normalised(text: str) -> str:
    """Source places made alike (the docs name a script, the doc test a Markdown file)."""
    return _PLACE.sub("FILE:LINE", text)


def quoted_outputs(name: str) -> list[dict]:
    """What `name` says its python blocks print: per quote, the block's first line, the
    quote's line, its form ("lines" for a marked fence, "text" for comments after a
    print) and its text."""
    text = (ROOT / name).read_text()
    quotes: list[dict] = []
    last_block = None
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 2
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        if match.group(1) == "python":
            last_block = line
            code = match.group(2).splitlines()
            for i, code_line in enumerate(code):
                if not (code_line.startswith("print(") and code_line.rstrip().endswith(")")):
                    continue
                comments = []
                for following in code[i + 1:]:
                    if not following.startswith("# "):
                        break
                    comments.append(following[2:])
                if comments:
                    quotes.append({"block": line, "line": line + i + 1, "form": "text",
                                   "text": " ".join(comments)})
        elif mark and mark.group("printed"):
            assert match.group(1) == "" and last_block is not None, (
                f"{name}:{line}: a quoted output is a fence without a language after a "
                "python block")
            quotes.append({"block": last_block, "line": line, "form": "lines",
                           "text": match.group(2)})
    return quotes


def quote_problem(quote: dict, printed: str) -> str:
    """Why `printed` (what the block printed now) does not hold `quote`; "" when it does."""
    if quote["form"] == "text":
        want = " ".join(_normalised(quote["text"]).split())
        have = " ".join(_normalised(printed).split())
        return "" if want in have else f"quoted: {want}"
    have_lines = [line.rstrip() for line in _normalised(printed).splitlines()]
    position = 0
    for want in (line.rstrip() for line in _normalised(quote["text"]).splitlines()):
        if want.strip() == "...":
            continue
        try:
            position = have_lines.index(want, position) + 1
        except ValueError:
            return f"quoted line not printed (in order): {want!r}"
    return ""


_DOC_TESTS = ("test_doc_code_blocks_run", "test_doc_quoted_outputs_are_what_the_code_prints")


@pytest.mark.parametrize("name", [n for n in DOC_FILES if quoted_outputs(n)])
def test_doc_quoted_outputs_are_what_the_code_prints(name, request, tmp_path_factory):
    # Plans, estimates, launch counts and memory figures quoted in the docs are what the
    # blocks print now: rewrite the quote when the code's figures change.
    _, printed, output = _run_doc_files(_doc_test_names(request),
                                        tmp_path_factory.mktemp("doc_blocks"))
    assert name in printed, f"the blocks of {name} did not run; the process ended with {output}"
    ran = {block["line"] for block in _blocks_to_run(name)[0]}
    problems, unchecked = [], []
    for quote in quoted_outputs(name):
        if quote["block"] not in ran:
            unchecked.append(f"{name}:{quote['line']} (its block is not run here)")
            continue
        got = printed[name].get(str(quote["block"]))
        assert got is not None, f"{name}: the block at line {quote['block']} did not run"
        problem = quote_problem(quote, got)
        if problem:
            problems.append(f"{name}:{quote['line']}: {problem}\nthe block printed:\n{got}")
    assert not problems, "\n\n".join(problems)
    if unchecked:
        print("quoted outputs not checked:", *unchecked, sep="\n  ")


def test_quote_checks_find_a_stale_figure():
    lines = {"form": "lines", "text": "plan for `f` (in a.py:3)\n...\n  est. 650.0 us\n"}
    printed = "plan for `f` (in docs/x.md:40)\n  memory\n  est. 650.0 us\n"
    assert quote_problem(lines, printed) == ""
    assert "650.0" in quote_problem(lines, printed.replace("650.0", "945.0"))
    text = {"form": "text", "text": "kept lhs: x1.756 at the pessimistic end"}
    assert quote_problem(text, "kept lhs: x1.756 at the\npessimistic end\n") == ""
    assert quote_problem(text, "kept lhs: x1.700 at the pessimistic end") != ""
