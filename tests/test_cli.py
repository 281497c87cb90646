"""``python -m jaxpar``: the demo and the inspect command, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import jaxpar
from jaxpar._cli import load_args, load_function, option_value, parse_arg_specs

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


def test_args_from_a_factory_of_pytrees():
    # inception takes (x, params): a dict of weights, which --args cannot describe.
    result = run("inspect", "examples.inception_block:inception",
                 "--args-from", "examples.inception_block:make_args", "--json",
                 "--force-streams", "true")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["function"] == "inception" and plan["num_streams"] == 2


def test_load_args_wraps_a_single_value_and_names_failures(tmp_path, monkeypatch):
    (tmp_path / "factories_for_cli.py").write_text(
        "import jax\n"
        "def one():\n    return {'w': jax.ShapeDtypeStruct((3,), 'float32')}\n"
        "def broken():\n    raise RuntimeError('no data here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (arg,) = load_args("factories_for_cli:one")
    assert arg["w"].shape == (3,)
    with pytest.raises(ValueError, match=r"factories_for_cli:broken.*RuntimeError: no data here"):
        load_args("factories_for_cli:broken")
    with pytest.raises(ValueError, match="write MODULE:FACTORY"):
        load_args("factories_for_cli")


def test_every_option_of_parallel_branches_is_a_flag():
    import inspect

    result = run("inspect", "--help")
    assert result.returncode == 0
    names = [name for name, p in inspect.signature(jaxpar.parallel_branches).parameters.items()
             if p.kind is p.KEYWORD_ONLY]
    assert names
    for name in names:
        assert f"--{name.replace('_', '-')}" in result.stdout, name


def test_options_reach_the_plan():
    result = run("inspect", "examples.two_scans:two_scans", "--json", "--args",
                 "f32[100,100] f32[100,100] f32[50,100,100] f32[50,100,100]",
                 "--max-streams", "3", "--min-cost-us", "0.5", "--fuse-scans", "false",
                 "--unroll", "none", "--target", "cpu")
    assert result.returncode == 0, result.stderr
    options = json.loads(result.stdout)["options"]
    assert options == {**options, "max_streams": 3, "min_cost_us": 0.5, "fuse_scans": False,
                       "unroll": None, "target": "cpu"}


def test_bad_option_value_is_a_clean_error():
    result = run("inspect", "examples.two_scans:two_scans", "--args", "f32[3]",
                 "--max-streams", "0")
    assert result.returncode == 2 and "max_streams must be >= 1" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("text, value", [("3", 3), ("0.5", 0.5), ("true", True),
                                         ("False", False), ("none", None), ("auto", "auto"),
                                         ("1,2", (1, 2))])
def test_option_values(text, value):
    assert option_value(text) == value and type(option_value(text)) is type(value)


def test_version():
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"jaxpar {jaxpar.__version__} (jax {jax.__version__})"


def test_closed_pipe_ends_without_a_traceback():
    # `python -m jaxpar inspect ... | head -1`: the reader is gone before the plan is
    # written.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxpar", "inspect", "examples.two_scans:two_scans", "--args",
         "f32[100,100] f32[100,100] f32[50,100,100] f32[50,100,100]"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    process.stdout.close()
    _, stderr = process.communicate(timeout=600)
    assert "Traceback" not in stderr.decode() and "BrokenPipeError" not in stderr.decode()
    assert process.returncode == 1


def test_trace_option_writes_a_chrome_trace(tmp_path):
    path = tmp_path / "plan.json"
    result = run("inspect", "examples.two_scans:two_scans", "--args",
                 "f32[100,100] f32[100,100] f32[50,100,100] f32[50,100,100]",
                 "--trace", str(path))
    assert result.returncode == 0, result.stderr
    assert any(e["ph"] == "X" for e in json.loads(path.read_text())["traceEvents"])


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
