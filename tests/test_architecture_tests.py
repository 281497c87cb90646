"""The test suite's own layout: test modules share code only through helper modules.

A test module that imports another runs (or at least imports, with its module-level set-up)
that module's programs, and couples two files that should change on their own. Shared
programs live in tests/helpers.py, the pass checker in tests/pass_checker.py, and the
random-program strategies in tests/programs.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    """Top-level names of the absolute imports anywhere in ``path`` (functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_modules_import_no_test_module() -> None:
    modules = sorted(TESTS.glob("*.py"))
    test_modules = {p.stem for p in modules if p.stem.startswith("test_")}
    assert len(test_modules) > 10  # the glob sees the suite
    offenders = {p.name: sorted(imported_modules(p) & test_modules) for p in modules}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "test_example.py"
    module.write_text("def test_a():\n    from test_other import f\n    import test_third.x\n")
    assert {"test_other", "test_third"} <= imported_modules(module)


def test_one_skip_mark_for_tests_that_need_the_cuda_plugin() -> None:
    """``helpers.needs_plugin`` is the one mark; no test module builds its own."""
    own = re.compile(r"skipif\(\s*not\s+(_?PLUGIN_OK|[\w.]*plugin_status\(\)\[0\])")
    offenders = sorted(p.name for p in TESTS.glob("test_*.py") if own.search(p.read_text()))
    assert offenders == []
