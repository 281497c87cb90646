"""Every public name is documented, and every example runs."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jaxpar

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", jaxpar.__all__)
def test_public_name_in_api_reference(name):
    api = (ROOT / "docs" / "api.md").read_text()
    assert re.search(rf"`jaxpar\.{re.escape(name)}\b", api), f"jaxpar.{name} is not in docs/api.md"


def test_public_functions_have_docstrings():
    for name in jaxpar.__all__:
        obj = getattr(jaxpar, name)
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), f"jaxpar.{name} has no docstring"


@pytest.mark.parametrize("example", ["two_scans", "inception_block", "ensemble"])
def test_example_main_runs(example):
    spec = importlib.util.spec_from_file_location(example, ROOT / "examples" / f"{example}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()


def test_collective_matmul_example_runs():
    # Needs 8 devices before the backend starts: its own process.
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "collective_matmul.py")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "parallel_branches: matches x @ w" in result.stdout
