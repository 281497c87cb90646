"""Every public name is documented, and every example and every code block of the docs runs.

The python blocks of README.md and docs/*.md run in order, each file in a folder of its
own, and **each block on its own**: a fresh namespace per block, as a reader pasting that
one block would run it, unless it is marked as continuing the one above (its text says
so too):

    <!-- doc-test: continues the block above -->

They run as on a plain install (`pip install -e .`): a block may import (and make JAX or
jaxpar import) nothing that only the test extras or the ecosystem packages provide
(`pyproject.toml`'s `test` extra, `tests/requirements-ecosystem.txt`: flax, equinox,
optax, flatbuffers, hypothesis, pytest), unless it says which it needs:

    <!-- doc-test: needs flax, optax -->

and then it is skipped, saying so, where they are not installed. The files share one
process, started with 4 CPU devices, so JAX starts once; a block that must start a fresh
process (it sets `XLA_FLAGS` before JAX starts) says so and runs in one of its own:

    <!-- doc-test: own process (sets XLA_FLAGS before JAX starts) -->

A block may be skipped only with a visible reason (a GPU it needs):

    <!-- doc-test: skip (needs a GPU) -->

and a block may ask for the CUDA PJRT plugin (gpu_preview's deviceless compiles):

    <!-- doc-test: needs the CUDA plugin -->

which runs where the plugin is installed and is skipped, saying so, elsewhere. Several
marks stand on consecutive lines above a block. Shell blocks are not run.

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
import tomllib
from pathlib import Path

import jax
import pytest
from helpers.benchmarks import load_benchmark
from helpers.table_options import missing_from_docs

import jaxpar

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", jaxpar.__all__)
def test_public_name_in_api_reference(name):
    api = (ROOT / "docs" / "api.md").read_text()
    assert re.search(rf"`jaxpar\.{re.escape(name)}\b", api), f"jaxpar.{name} is not in docs/api.md"


@pytest.mark.parametrize("name", jaxpar.__all__)
def test_public_name_has_a_heading_of_its_own(name):
    # ParallelBranches's methods once sat under ProcessMismatchError, and TuneCacheWarning
    # had no heading: each name's text is under its own heading, and names only itself.
    api = (ROOT / "docs" / "api.md").read_text()
    sections = re.split(r"^### ", api, flags=re.M)
    own = [part for part in sections if re.match(rf"`jaxpar\.{re.escape(name)}\b", part)]
    assert len(own) == 1, f"docs/api.md has {len(own)} headings for jaxpar.{name}"
    for part in sections[1:]:  # no other heading says what it is ("`jaxpar.X`: a ...")
        if not part.startswith(f"`jaxpar.{name}"):
            assert not re.search(rf"`jaxpar\.{re.escape(name)}`: ", part), (name, part[:80])


def test_parallel_branches_methods_are_under_its_heading():
    api = (ROOT / "docs" / "api.md").read_text()
    section = re.split(r"^### ", api.split("### `jaxpar.ParallelBranches`", 1)[1],
                       maxsplit=1, flags=re.M)[0]
    for method in ("trace(*args)", "lower(*args)", "eval_shape(*args)", "clear_cache()",
                   "tuning(*args, **kwargs)"):
        assert method in section, method


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
    added = [f"add `{p}` after `{actual[actual.index(p) - 1]}`" for p in actual
             if p not in documented and actual.index(p) > 0]
    assert documented == actual, (
        f"docs/api.md's heading for {name} lists {documented}, the code takes {actual}"
        + "".join(f"; {a}" for a in added))


def test_api_reference_documents_every_pass_table_option():
    # A pass added to the table is an option of parallel_branches: its heading and an
    # entry under it, as the message says.
    missing = missing_from_docs((ROOT / "docs" / "api.md").read_text())
    assert not missing, "\n\n".join(missing)


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


def _rounded_range(cell: str) -> tuple[float, float] | None:
    """The values a figure as written (``24.93``, ``11,055``, ``x1.003``) may stand for."""
    match = re.fullmatch(r"x?(\d[\d,]*(?:\.(\d+))?)", cell.strip().strip("*"))
    if not match:
        return None
    value = float(match.group(1).replace(",", ""))
    half = 0.5 * 10.0 ** -len(match.group(2) or "")
    return value - half, value + half


def _unexplained_ratios(text: str) -> list[str]:
    """Rows of markdown tables whose ratio (``xR`` under a ``ratio`` or ``<word> x``
    header) is not the quotient of the two timings before it (``... ms``/``us``/``s``
    headers of the same quantity) and whose header does not say it is a median of
    per-round or per-pair ratios."""
    problems, header = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None or set(line) <= set("|-: "):
            header = header or cells
            continue
        for j in range(2, min(len(cells), len(header))):
            plain, ours, ratio = header[j - 2], header[j - 1], header[j]
            quantity = ratio.split(" ")[0]
            if not (re.search(r"\b(ms|us|s)\b", plain) and re.search(r"\b(ms|us|s)\b", ours)
                    and (quantity == "ratio" or (ratio.split(" ")[1:2] == ["x"]
                                                 and quantity in ours))):
                continue
            a, b, r = (_rounded_range(c) for c in cells[j - 2:j + 1])
            if a is None or b is None or r is None or not cells[j].startswith(("x", "**x")):
                continue
            low, high = b[0] / a[1], b[1] / max(a[0], 1e-12)
            if (r[1] < low or r[0] > high) and "median of per-" not in ratio:
                problems.append(f"line {number}: {cells[0]}: {cells[j - 2]} -> {cells[j - 1]} "
                                f"is not {cells[j]} ({ratio!r})")
    return problems


def test_a_ratio_beside_two_timings_is_their_quotient_or_says_what_it_is():
    # The CPU suite's table listed 24.93 -> 27.25 ms as x1.003: its ratios are medians of
    # per-pair ratios (benchmarks/run.py), which the header now says. The archive of
    # older runs is held to the same rule.
    for name in ("benchmarks.md", "benchmarks-history.md"):
        text = (ROOT / "docs" / name).read_text()
        assert _unexplained_ratios(text) == [], name
    made_up = ("| workload | plain ms | jaxpar ms | ratio |\n|---|---|---|---|\n"
               "| inception | 24.93 | 27.25 | x1.003 |\n| chain | 0.08 | 0.13 | x1.71 |\n")
    assert [p.split(":")[1].strip() for p in _unexplained_ratios(made_up)] == ["inception"]
    said = made_up.replace("| ratio |", "| ratio (median of per-pair ratios) |")
    assert _unexplained_ratios(said) == []


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
                   r"|needs (?P<needs>[a-z_]+(?:, [a-z_]+)*)"
                   r"|(?P<continues>continues the block above)"
                   r"|(?P<own>own process \([^)]+\))"
                   r"|(?P<printed>printed by the block above)) -->\s*$")


def _requirement_names(lines: list[str]) -> list[str]:
    """Distribution names of requirement lines (``flax==0.12.8; python_version < ...``)."""
    names = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(re.split(r"[\s<>=!~;\[]", line, maxsplit=1)[0].lower())
    return names


def extra_modules() -> frozenset[str]:
    """Top-level modules a plain install (``pip install -e .``) lacks: those of the test
    extras and the ecosystem packages the tests install."""
    import tomllib
    from importlib.metadata import packages_distributions

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(_requirement_names(project["optional-dependencies"]["test"]))
    wanted |= set(_requirement_names(
        (ROOT / "tests" / "requirements-ecosystem.txt").read_text().splitlines()))
    wanted -= {"ruff", "mypy"}  # tools, not modules a block could import
    by_module = packages_distributions()
    modules = {module for module, dists in by_module.items()
               if {d.lower() for d in dists} & wanted}
    # Names of packages not installed here still count (a block that imports them fails).
    return frozenset(modules | {name.replace("-", "_") for name in wanted})


# Runs the blocks of each file in a folder of its own, each block in a fresh namespace
# unless it continues the one above; imports of what a plain install lacks fail unless the
# block names them. Reports, per file, the first failure by block, and what each block
# printed (for the quoted outputs).
_RUNNER = """
import builtins, contextlib, importlib.abc, io, json, os, sys, traceback
given = json.load(sys.stdin)
blocked, allowed = frozenset(given["blocked"]), set()
real_import = builtins.__import__

def refuse(name):
    top = name.split(".")[0]
    if top in blocked and top not in allowed:
        raise ModuleNotFoundError(
            f"No module named {top!r}: a plain install (pip install -e .) lacks it; the "
            "block must not need it, or say so (<!-- doc-test: needs " + top + " -->)",
            name=top)

class PlainInstall(importlib.abc.MetaPathFinder):  # what JAX or jaxpar import for a block
    def find_spec(self, name, path=None, target=None):
        refuse(name)
        return None

def guarded_import(name, *args, **kwargs):  # the block's own imports, cached or not
    if len(args) < 4 or args[3] == 0:
        refuse(name)
    return real_import(name, *args, **kwargs)

sys.meta_path.insert(0, PlainInstall())
guarded = dict(vars(builtins), __import__=guarded_import)
results, printed = {}, {}
for name, (folder, blocks) in given["files"].items():
    os.chdir(folder)
    os.environ["JAXPAR_TUNE_DIR"] = os.path.join(folder, "tune")
    namespace = None
    results[name], printed[name] = "", {}
    for block in blocks:
        if namespace is None or not block["continues"]:
            namespace = {"__name__": "__main__", "__builtins__": guarded}
        allowed.clear()
        allowed.update(block["needs"])
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


def _marks_above(text: str, start: int) -> list[re.Match[str]]:
    """The doc-test marks on the consecutive comment lines right above offset ``start``."""
    marks = []
    for line in reversed(text[:start].rstrip("\n").split("\n")):
        mark = _MARK.search(line)
        if not mark:
            break
        marks.append(mark)
    return marks


def doc_blocks(name: str) -> list[dict]:
    """The python blocks of one file: code, first line, and the doc-test marks above it."""
    text = (ROOT / name).read_text()
    blocks = []
    for match in _FENCE.finditer(text):
        if match.group(1) != "python":
            continue
        marks = _marks_above(text, match.start())
        line = text.count("\n", 0, match.start()) + 2  # the block's first code line
        # Offset so tracebacks point at the line in the Markdown file.
        code = "\n" * (line - 1) + match.group(2)
        needs = [need.strip() for m in marks if m.group("needs")
                 for need in m.group("needs").split(",")]
        blocks.append({"file": name, "line": line, "code": code,
                       "skip": next((m.group("reason") for m in marks if m.group("reason")),
                                    None),
                       "needs_plugin": any("CUDA plugin" in m.group(0) for m in marks),
                       "needs": needs,
                       "continues": any(m.group("continues") for m in marks),
                       "own_process": any(m.group("own") for m in marks)})
    return blocks


def test_doc_files_are_found_and_marks_are_well_formed():
    assert "docs/guide.md" in DOC_FILES and "docs/quickstart.md" in DOC_FILES
    assert any(block["continues"] for block in doc_blocks("docs/guide.md"))
    for name in DOC_FILES:
        for line in (ROOT / name).read_text().splitlines():
            if "doc-test:" in line:
                assert _MARK.search(line), f"{name}: malformed doc-test mark {line!r}"


def _blocks_to_run(name: str) -> tuple[list[dict], list[str]]:
    """The blocks of one file this machine runs in the shared process, and the skipped ones
    with their reasons (``own process`` blocks run apart, ``_own_process_blocks``)."""
    from importlib.util import find_spec

    from jaxpar._compiled import plugin_status

    plugin, why = plugin_status()
    blocks, skipped = [], []
    for block in doc_blocks(name):
        missing = [need for need in block["needs"] if find_spec(need) is None]
        if block["skip"]:
            skipped.append(f"{name}:{block['line']}: {block['skip']}")
        elif block["needs_plugin"] and not plugin:
            skipped.append(f"{name}:{block['line']}: needs the CUDA plugin ({why})")
        elif missing:
            skipped.append(f"{name}:{block['line']}: needs {', '.join(missing)} "
                           "(not installed here)")
        elif not block["own_process"]:
            blocks.append(block)
    return blocks, skipped


_RUNS: dict[tuple[str, ...], tuple[dict[str, str], dict[str, dict[str, str]], str]] = {}


def _run_blocks(files: dict[str, tuple[str, list[dict]]], cwd: Path
                ) -> tuple[dict[str, str], dict[str, dict[str, str]], str]:
    """Runs ``files``' blocks (name -> (folder, blocks)) in one fresh process; returns each
    file's failure ("" when its blocks ran), what each block printed and the output."""
    # Four CPU devices, so the guide's shard_map ring has neighbours.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "JAX_NUM_CPU_DEVICES": "4"}
    given = {"files": files, "blocked": sorted(extra_modules())}
    result = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(given),
                            capture_output=True, text=True, timeout=1800, cwd=cwd, env=env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS=")]
    results = json.loads(lines[-1][len("RESULTS="):]) if lines else {}
    return (results.get("failures", {}), results.get("printed", {}),
            f"exit code {result.returncode}: {result.stderr[-4000:]}")


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
        _RUNS[names] = _run_blocks(files, folder)
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
    for block in doc_blocks(name):  # those that start a process of their own
        if not block["own_process"] or block["skip"]:
            continue
        folder = tmp_path_factory.mktemp("own_process")
        alone = {name: (str(folder), [dict(block, continues=False)])}
        failed, _, output = _run_blocks(alone, folder)
        assert failed.get(name) == "", failed.get(name, output)[-4000:]
    skipped = _blocks_to_run(name)[1]
    if skipped:
        print("skipped doc blocks (with their reasons):", *skipped, sep="\n  ")


def test_only_a_gpu_skips_a_doc_block():
    # Every block runs here (in the shared process or its own) but those that need a GPU.
    for name in DOC_FILES:
        for block in doc_blocks(name):
            assert block["skip"] is None or block["skip"].startswith("needs a GPU"), (
                f"{name}:{block['line']}: skipped ({block['skip']}); run it, or it needs a GPU")


def test_a_block_that_needs_what_a_plain_install_lacks_fails(tmp_path):
    modules = extra_modules()
    assert {"flax", "equinox", "optax", "flatbuffers"} <= modules
    assert not {"jax", "jaxlib", "numpy", "jaxpar"} & modules
    blocks = [
        {"file": "x.md", "line": 1, "code": "import optax\n", "needs": [], "continues": False},
        {"file": "y.md", "line": 1, "code": "import math\nx = 1\n", "needs": [],
         "continues": False},
        {"file": "y.md", "line": 5, "code": "x\n", "needs": [], "continues": False},
        {"file": "z.md", "line": 1, "code": "x = 2\n", "needs": [], "continues": False},
        {"file": "z.md", "line": 3, "code": "assert x == 2\n", "needs": [],
         "continues": True},
        # What JAX imports for a block counts too: serializing an export needs flatbuffers
        # (the guide's export block once did).
        {"file": "w.md", "line": 1, "code": (
            "import jax, jax.numpy as jnp\nfrom jax import export\n"
            "export.export(jax.jit(jnp.sin))(jnp.ones(2)).serialize()\n"),
         "needs": [], "continues": False},
    ]
    files = {}
    for name in ("x.md", "y.md", "z.md", "w.md"):
        (tmp_path / name).mkdir()
        files[name] = (str(tmp_path / name), [b for b in blocks if b["file"] == name])
    failures, _, output = _run_blocks(files, tmp_path)
    assert "a plain install (pip install -e .) lacks it" in failures["x.md"], output
    assert "NameError" in failures["y.md"]  # a fresh namespace per block
    assert failures["z.md"] == ""  # unless it continues the block above
    assert "No module named 'flatbuffers': a plain install" in failures["w.md"], failures


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


def test_every_summary_of_what_jaxpar_does_names_both_accelerators():
    # --help and docs/api.md once said "for a GPU" where the README says GPU or TPU; the
    # TPU target acts (tests/test_targets_tpu_model.py), and the CPU target changes nothing.
    api = (ROOT / "docs" / "api.md").read_text()
    entry = api.split("### `jaxpar.parallel_branches(", 1)[1].split("Options (", 1)[0]
    summaries = {
        "README.md": (ROOT / "README.md").read_text().split("\n\n", 2)[1],
        "pyproject.toml": tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "description"],
        "docs/api.md": entry,
        "parallel_branches.__doc__": jaxpar.parallel_branches.__doc__.split("\n\n", 1)[0],
    }
    for where, text in summaries.items():
        assert "for a GPU or a TPU" in " ".join(text.split()), where
    assert "For a TPU: independent scans with identical bodies batched and small loops read" \
        in " ".join(entry.split())


def test_the_readme_opens_with_the_two_set_up_commands():
    # A newcomer once read about 190 lines of behaviour before the install command, and a
    # GPU-preview set-up used .venv/bin/python before the Quick start created .venv.
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"^```(\w*)\n(.*?)^```", readme, re.M | re.S)
    assert first and first.group(1) == "bash", "the README's first code block is not the set-up"
    assert readme[:first.start()].count("\n") < 25, "the set-up commands are not at the top"
    commands = first.group(2).splitlines()
    assert commands == [
        "git clone <this repository> jaxpar && cd jaxpar",
        "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python -m jaxpar demo",
        "bash scripts/test.sh",
    ]
    assert ".venv/" not in readme[:first.start()]
    # The test command the README gives is what CI runs.
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_test_commands_counts_come_from_the_script_itself():
    # The README once said 2,782 tests in 9 min 12 s, the script's header 2,544 in 9 min
    # 51 s, and the run printed 2,917 passed (and left out its skipped): the counts are what
    # the script's summary line prints, and both quote that line's form; measurements live
    # in docs/benchmarks.md only, with their dates.
    script = (ROOT / "scripts" / "test.sh").read_text()
    readme = (ROOT / "README.md").read_text()
    echo = re.search(r'^echo "summary: (.*)"$', script, re.M)
    assert echo, "scripts/test.sh prints no summary line"
    form = re.sub(r"\$\w+", "X", echo.group(1))
    assert form == "X passed, X skipped, X failed; ruff and mypy: X"
    for text in (readme, script):
        quoted = re.search(r"summary: (N passed, M skipped, 0 failed; ruff and mypy: clean)",
                           text)
        assert quoted, "the summary line's form is not quoted"
        assert re.sub(r"\b[NM0]\b|clean", "X", quoted.group(1)) == form
        assert not re.search(r"\b\d[\d,]* (?:tests|passed)\b", text)
        assert not re.search(r"\b\d+ min \d+ s\b", text)
    assert "system-wide" in readme and "JAXPAR_TEST_BROWSER=0" in readme
    assert "JAXPAR_TEST_BROWSER" in script
