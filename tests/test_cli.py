"""``python -m jaxpar``: the demo and the inspect command, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpar._cli import load_function, parse_arg_specs

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "jaxpar", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def test_inspect_command_prints_and_saves_the_plan(tmp_path):
    page = tmp_path / "plan.html"
    result = run("inspect", "examples.inception_block:inception", "--args",
                 "f32[8,28,28,64] f32[1,1,64,64] f32[1,1,64,96] f32[1,1,64,16] "
                 "f32[1,1,64,32] f32[3,3,96,128] f32[5,5,16,32]", "--html", str(page))
    # inception takes (x, params): a dict cannot be given as flat shapes.
    assert result.returncode == 2 and "does not take --args" in result.stderr
    assert "Traceback" not in result.stderr
    result = run("inspect", "examples.two_scans:two_scans", "--args",
                 "f32[100,100] f32[100,100] f32[50,100,100] f32[50,100,100]",
                 "--html", str(page))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("jaxpar plan for `two_scans` (target=gpu")
    assert "fused" in result.stdout and page.read_text().startswith("<!DOCTYPE html>")
    result = run("inspect", "examples.two_scans:two_scans", "--json", "--args",
                 "f32[100,100] f32[100,100] f32[50,100,100] f32[50,100,100]")
    assert json.loads(result.stdout)["function"] == "two_scans"


@pytest.mark.parametrize("path, message", [
    ("examples.two_scans", "write MODULE:FUNCTION"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("examples.two_scans:nope", "has no attribute 'nope'"),
])
def test_bad_function_paths(path, message):
    with pytest.raises(ValueError, match=message):
        load_function(path)


@pytest.mark.parametrize("spec, message", [
    ("f32[3,x]", "bad --args entry 'f32\\[3,x\\]'"),
    ("q8[3]", "bad --args entry"),
    ("f32", "write DTYPE\\[DIMS\\]"),
])
def test_bad_shape_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_arg_specs(spec)


def test_shape_specs():
    a, b = parse_arg_specs("f32[100,100] i32[]")
    assert (a.shape, str(a.dtype), b.shape, str(b.dtype)) == ((100, 100), "float32", (), "int32")


def test_bad_path_is_a_clean_command_line_error():
    result = run("inspect", "nope:f", "--args", "f32[3]")
    assert result.returncode == 2 and "cannot import module 'nope'" in result.stderr
    assert "Traceback" not in result.stderr


def test_demo_runs_end_to_end():
    result = run("demo")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for story in ("seed 002", "multi-branch", "seed 000"):
        assert story in out
    assert out.count("same values as jax.jit: yes") == 3
    assert "all results equal the plain versions" in out
