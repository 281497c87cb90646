"""``python -m jaxpar``: the demo and the inspect command, run as a user would."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from helpers.programs import chain

import jaxpar
from jaxpar._cli import load_args, load_function, option_value, parse_arg_specs

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "jaxpar", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.fixture
def examples_importable(monkeypatch):
    """``examples.*`` importable by the in-process CLI, as from the repository root."""
    monkeypatch.setattr(sys, "path", [str(ROOT), *sys.path])


def test_inspect_command_prints_and_saves_the_plan(tmp_path, capsys, examples_importable):
    # The real entry point once (`python -m jaxpar`; also the demo's and the closed pipe's
    # test); the rest of this file in-process (`_cli`), which runs the same main() without a
    # JAX start-up each.
    page = tmp_path / "plan.html"
    result = run("inspect", "examples.two_scans:two_scans", "--args",
                 "f32[100,100] f32[100,100] f32[50,100,100] f32[50,100,100]",
                 "--html", str(page))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("jaxpar plan for `two_scans` (target=gpu")
    assert "fused" in result.stdout and page.read_text().startswith("<!DOCTYPE html>")
    code, _, err = _cli(capsys, "inspect", "examples.inception_block:inception", "--args",
                        "f32[8,28,28,64] f32[1,1,64,64] f32[1,1,64,96] f32[1,1,64,16] "
                        "f32[1,1,64,32] f32[3,3,96,128] f32[5,5,16,32]", "--html", str(page))
    # inception takes (x, params): a dict cannot be given as flat shapes.
    assert code == 2 and "does not take --args" in err
    assert "Traceback" not in err
    code, out, err = _cli(capsys, "inspect", "examples.two_scans:two_scans", "--json",
                          "--args", "f32[100,100] f32[100,100] f32[50,100,100] f32[50,100,100]")
    assert code == 0, err
    assert json.loads(out)["function"] == "two_scans"


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


def test_args_from_a_factory_of_pytrees(capsys, examples_importable):
    # inception takes (x, params): a dict of weights, which --args cannot describe.
    code, out, err = _cli(capsys, "inspect", "examples.inception_block:inception",
                          "--args-from", "examples.inception_block:make_args", "--json",
                          "--force-streams", "true")
    assert code == 0, err
    plan = json.loads(out)
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


def test_every_option_of_parallel_branches_is_a_flag_with_a_line_of_help(capsys):
    import inspect

    from jaxpar._cli import option_help

    code, out, _ = _cli(capsys, "inspect", "--help")
    assert code == 0
    names = [name for name, p in inspect.signature(jaxpar.parallel_branches).parameters.items()
             if p.kind is p.KEYWORD_ONLY]
    assert names
    helps = option_help()
    flat = " ".join(out.split())
    for name in names:
        flag = f"--{name.replace('_', '-')}"
        assert flag in out, name
        # Help from parallel_branches's docstring (its Args entry), not only a default.
        what = helps.get(name, "")
        assert len(what) > 10 and "``" not in what, (name, what)
        assert f"{flag} VALUE {what} (default: " in flat or \
            f"{flag} [VALUE] {what} (default: " in flat, (name, flat)
        assert what.count("(") == what.count(")"), what
    assert helps["max_streams"].startswith("most regions (and so streams) per parallel section")
    assert "--verbose" in out and "full reasoning" in flat


def test_verbose_prints_every_reason_in_full(capsys, examples_importable):
    given = ("inspect", "examples.two_scans:two_scans", "--args",
             "f32[64,64] f32[64,64] f32[100,64,64] f32[100,64,64]")
    code, short, err = _cli(capsys, *given)
    assert code == 0, err
    code, verbose, err = _cli(capsys, *given, "--verbose")
    assert code == 0, err
    plan = jaxpar.inspect(jaxpar.parallel_branches(
        load_function("examples.two_scans:two_scans")), target="gpu")(
        *parse_arg_specs("f32[64,64] f32[64,64] f32[100,64,64] f32[100,64,64]"))
    assert verbose.rstrip("\n") == plan.text(verbose=True)
    assert short.rstrip("\n") == plan.text()
    assert "python -m jaxpar inspect --verbose" in short
    assert "left alone:" in verbose and "XLA options:" in verbose


def test_options_reach_the_plan(capsys, examples_importable):
    code, out, err = _cli(capsys, "inspect", "examples.two_scans:two_scans", "--json",
                          "--args", "f32[100,100] f32[100,100] f32[50,100,100] f32[50,100,100]",
                          "--max-streams", "3", "--min-cost-us", "0.5", "--fuse-scans", "false",
                          "--unroll", "none", "--target", "cpu")
    assert code == 0, err
    options = json.loads(out)["options"]
    assert options == {**options, "max_streams": 3, "min_cost_us": 0.5, "fuse_scans": False,
                       "unroll": None, "target": "cpu"}


def test_bad_option_value_is_a_clean_error(capsys, examples_importable):
    code, _, err = _cli(capsys, "inspect", "examples.two_scans:two_scans", "--args", "f32[3]",
                        "--max-streams", "0")
    assert code == 2 and "max_streams must be >= 1" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("text, value", [("3", 3), ("0.5", 0.5), ("true", True),
                                         ("False", False), ("none", None), ("auto", "auto"),
                                         ("1,2", (1, 2))])
def test_option_values(text, value):
    assert option_value(text) == value and type(option_value(text)) is type(value)


def test_version(capsys):
    code, out, _ = _cli(capsys, "--version")
    assert code == 0
    assert out.strip() == f"jaxpar {jaxpar.__version__} (jax {jax.__version__})"


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


def test_trace_option_writes_a_chrome_trace(tmp_path, capsys, examples_importable):
    path = tmp_path / "plan.json"
    code, _, err = _cli(capsys, "inspect", "examples.two_scans:two_scans", "--args",
                        "f32[100,100] f32[100,100] f32[50,100,100] f32[50,100,100]",
                        "--trace", str(path))
    assert code == 0, err
    assert any(e["ph"] == "X" for e in json.loads(path.read_text())["traceEvents"])


def test_bad_path_is_a_clean_command_line_error(capsys):
    code, _, err = _cli(capsys, "inspect", "nope:f", "--args", "f32[3]")
    assert code == 2 and "cannot import module 'nope'" in err
    assert "Traceback" not in err


def test_demo_runs_end_to_end():
    result = run("demo")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for story in ("two scans with different bodies", "multi-branch",
                  "bidirectional collective matmul"):
        assert story in out
    assert out.count("same values as jax.jit: yes") == 3
    assert "all results equal the plain versions" in out
    # The intro promises what the stories print here: timings only where the programs
    # differ (never on this CPU), the preview only with the plugin.
    intro = out.splitlines()[1]
    assert intro.startswith("Each story prints jaxpar's GPU plan")
    assert "on a CPU it does not" in intro
    assert ("the GPU preview: a deviceless H200 compile" in intro) == (
        "GPU preview for `" in out)
    # Without the plugin, why is said once (the intro), not once per story.
    assert out.count("GPU preview skipped") + out.count("no GPU preview (") <= 1, out
    # Every story states its timing honestly: on the CPU the stories compile to jax.jit's
    # program, so no ratio (which would be noise) is printed.
    timings = [line for line in out.splitlines() if line.startswith(("on this", "time on"))]
    assert len(timings) == 3
    assert all("same compiled program as jax.jit" in line or "middle half of" in line
               for line in timings)
    # One pair per story: the plan's header (inspect's figures) is the preview's "plan:"
    # line, the compile's pair is beside it, and the preview says which one decided. The
    # collective matmul is previewed too (rebuilt on a deviceless mesh), and agrees.
    pair = r"\(estimated\): jax\.jit ([\d,.]+) us -> jaxpar ([\d,.]+) us"
    headers = re.findall(r"^  [\w. ]+ " + pair + r" per run, from jaxpar's GPU planning model",
                         out, re.M)
    plans = re.findall(r"^  plan: [\w. ]+ " + pair, out, re.M)
    assert len(headers) == 3, out
    from jaxpar._compiled import plugin_status

    assert len(plans) == (3 if plugin_status()[0] else 0)
    if plugin_status()[0]:
        assert plans == headers
        assert out.count("decision: by the planning model") == 3, out
        assert "make_gpu_mesh('h200', 8)" not in out


def test_timing_report_shows_noise_or_says_there_is_nothing_to_time():
    from jaxpar._cli import timing_report

    x = jax.numpy.linspace(0.0, 1.0, 64)
    same = timing_report(jax.jit(chain), jax.jit(jaxpar.parallel_branches(
        chain, target="cpu")), (jax.numpy.ones((8, 8)),))
    assert "same compiled program as jax.jit" in same and "middle half" not in same
    other = timing_report(jax.jit(jax.numpy.sin), jax.jit(jax.numpy.cos), (x,), rounds=4)
    assert "middle half of 4 rounds" in other
    assert any(word in other for word in ("within the noise", "faster", "slower"))


# The rough edges of the command line, called in-process (no JAX start-up each).
_TWO_CHAINS = ("import jax.numpy as jnp\n"
               "def f(a, b):\n"
               "    return jnp.tanh(a @ a) @ a, jnp.sin(b @ b) @ b\n")
_SPECS = "f32[16,16] f32[16,16]"


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from jaxpar._cli import main

    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("form", ["{dir}/two_chains.py:f", "two_chains.py:f",
                                  "./two_chains.py:f"])
def test_a_file_path_names_the_function(tmp_path, monkeypatch, capsys, form):
    (tmp_path / "two_chains.py").write_text(_TWO_CHAINS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code, out, err = _cli(capsys, "inspect", form.format(dir=tmp_path), "--args", _SPECS)
    assert code == 0, err
    assert out.startswith("jaxpar plan for `f` (target=gpu")


def test_a_missing_file_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError,
                       match=re.escape("cannot import 'nope.py' from 'nope.py:f': no such file")):
        load_function("nope.py:f")


def test_force_streams_alone_means_true(tmp_path, monkeypatch, capsys):
    (tmp_path / "two_chains.py").write_text(_TWO_CHAINS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    plans = {}
    for flag in (["--force-streams"], ["--force-streams", "true"], ["--force-streams", "false"],
                 []):
        code, out, err = _cli(capsys, "inspect", "two_chains.py:f", "--args", _SPECS,
                              "--json", *flag)
        assert code == 0, err
        plans[" ".join(flag)] = json.loads(out)["options"]["force_streams"]
    assert plans == {"--force-streams": True, "--force-streams true": True,
                     "--force-streams false": False, "": False}
    code, _, err = _cli(capsys, "inspect", "two_chains.py:f", "--args", _SPECS,
                        "--force-streams", "maybe")
    assert code == 2 and "expected true or false, got 'maybe'" in err


@pytest.mark.parametrize("flag, name, message", [
    ("--html", "missing/plan.html", "folder '{dir}/missing' does not exist; create it first"),
    ("--html", "plan.svg", "the file name must end in .html or .htm"),
    ("--trace", "plan.html", "the file name must end in .json"),
])
def test_output_paths_are_checked_before_the_analysis(tmp_path, monkeypatch, capsys, flag,
                                                      name, message):
    (tmp_path / "two_chains.py").write_text(_TWO_CHAINS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code, out, err = _cli(capsys, "inspect", "two_chains.py:f", "--args", _SPECS, flag,
                          str(tmp_path / name))
    assert code == 2 and out == ""  # no plan printed before the refusal
    assert f"{flag} {tmp_path / name}: {message.format(dir=tmp_path)}" in err
    assert "Traceback" not in err


def test_help_is_plain_text(capsys):
    code, out, _ = _cli(capsys, "--help")
    assert code == 0
    assert "``" not in out and "::" not in out
    # It leads with what jaxpar does by default: loops and members, then streams.
    # For a GPU or a TPU, as the README and pyproject.toml say, and what each gets.
    assert ("jaxpar: rewrites a JAX program for a GPU or a TPU. By default, for a GPU it "
            "fuses, batches and unrolls independent loops and batches independent members"
            ) in " ".join(out.split())
    assert ("For a TPU it batches independent scans with identical bodies and reads small "
            "loops by blocks.") in " ".join(out.split())
    assert "./model.py:step" in out


def test_xla_flags_refuses_what_is_not_a_plan():
    with pytest.raises(TypeError, match=r"takes the Plan of your program .* got a str"):
        jaxpar.xla_flags(plan="x")


# --- help without jax: importing jax takes seconds, more with the CUDA plugin ------------


_PROBE = """
import runpy, sys
sys.argv = ["jaxpar", *sys.argv[1:]]
try:
    runpy.run_module("jaxpar", run_name="__main__")
except SystemExit:
    pass
print("JAX IMPORTED" if "jax" in sys.modules else "NO JAX", file=sys.stderr)
"""


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_do_not_import_jax(flag):
    done = subprocess.run([sys.executable, "-c", _PROBE, flag], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.stderr.strip().endswith("NO JAX"), done.stderr
    assert ("{demo,inspect}" in done.stdout) if flag == "--help" else (
        f"jax {jax.__version__}" in done.stdout), done.stdout


def test_inspect_help_lists_every_option_flag():
    done = run("inspect", "--help", timeout=120)
    assert done.returncode == 0, done.stderr
    for flag in ("--max-streams", "--unroll", "--force-streams", "--target"):
        assert flag in done.stdout


def test_import_jaxpar_is_lazy_and_every_public_name_resolves():
    probe = ("import sys, jaxpar; before = 'jax' in sys.modules; "
             "names = [getattr(jaxpar, n) for n in jaxpar.__all__]; "
             "print(before, 'jax' in sys.modules, set(jaxpar.__all__) <= set(dir(jaxpar)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.stdout.split() == ["False", "True", "True"], done.stderr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        jaxpar.nope  # noqa: B018


# --- options in full only: argparse's abbreviations (allow_abbrev) are off ----------------


@pytest.mark.parametrize("argv, wrong, meant", [
    (("inspect", "examples.two_scans:two_scans", "--args", "f32[3]", "--unrol", "4"),
     "--unrol", "--unroll"),
    (("inspect", "examples.two_scans:two_scans", "--args", "f32[3]", "--unrol=4"),
     "--unrol", "--unroll"),
    (("inspect", "examples.two_scans:two_scans", "--args", "f32[3]", "--max-stream", "2"),
     "--max-stream", "--max-streams"),
    # Misspelt, a required option is named as misspelt, not as missing.
    (("inspect", "examples.two_scans:two_scans", "--arg", "f32[3]"), "--arg", "--args"),
    (("inspect", "--verbos", "examples.two_scans:two_scans", "--args", "f32[3]"),
     "--verbos", "--verbose"),
    (("--versio",), "--versio", "--version"),
])
def test_an_abbreviated_or_misspelt_option_is_refused_with_the_closest(capsys, argv, wrong,
                                                                        meant):
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == ""  # refused before anything ran
    assert f"error: unknown option {wrong} (did you mean '{meant}'?)" in err, err
    assert "not abbreviated" in err and "Traceback" not in err


def test_an_option_nothing_resembles_is_refused_without_a_guess(capsys):
    code, _, err = _cli(capsys, "inspect", "examples.two_scans:two_scans", "--args", "f32[3]",
                        "--zzzz")
    assert code == 2 and "error: unknown option --zzzz; options are taken in full" in err


def test_options_in_full_and_values_that_look_like_options_still_parse(capsys,
                                                                      examples_importable):
    # Options in full parse as before, "=" forms too, and what follows "--" is no option.
    code, out, err = _cli(capsys, "inspect", "--json", "--unroll=4", "--target", "cpu",
                          "--args", "f32[100,100] f32[100,100] f32[50,100,100] f32[50,100,100]",
                          "--", "examples.two_scans:two_scans")
    assert code == 0, err
    assert json.loads(out)["options"]["unroll"] == 4
    # A negative number is a value, not an option: it reaches the option's own check.
    code, _, err = _cli(capsys, "inspect", "examples.two_scans:two_scans", "--args", "f32[3]",
                        "--min-cost-us", "-1")
    assert code == 2 and "min_cost_us must be a finite number >= 0" in err, err


def test_inspect_help_says_the_file_is_imported_and_its_top_level_code_runs(capsys, tmp_path,
                                                                           monkeypatch):
    code, out, _ = _cli(capsys, "inspect", "--help")
    flat = " ".join(out.split())
    assert code == 0
    assert ("The module or file is imported: its top-level code runs, as under `python -m`"
            in flat), flat
    # What the help says: a file's top-level code runs; its main guard does not.
    (tmp_path / "script.py").write_text(_TWO_CHAINS + """
print("TOP LEVEL RAN")
if __name__ == "__main__":
    print("MAIN RAN")
""")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code, out, err = _cli(capsys, "inspect", "script.py:f", "--args", _SPECS)
    assert code == 0, err
    assert "TOP LEVEL RAN" in out and "MAIN RAN" not in out
