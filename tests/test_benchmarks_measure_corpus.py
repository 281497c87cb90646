"""``benchmarks/measure_corpus.py``: the corpus builds and traces at its CPU sizes, one
program runs through the harness's code path (first calls, the decision, the steady state)
and matches ``jax.jit``, a program whose library is missing is skipped with a message, and
a program past its time limit loses itself, not the run.

No timing is asserted (CI has no accelerator): only the values and the results' keys. The
ecosystem's libraries (blackjax, diffrax, numpyro, flax) are optional: their programs are
left out where they are not installed; the pure-JAX programs always run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import pytest
from helpers.benchmarks import load_benchmark

corpus = load_benchmark("measure_corpus")
PURE_JAX = {"ppo_cartpole_rollout", "mamba_2_layers"}


def test_the_corpus_builds_and_traces_at_its_cpu_sizes() -> None:
    chip, tiny = corpus.programs(False), corpus.programs(True)
    assert list(chip) == list(tiny)
    assert list(corpus.measure_tpu.PARTS["corpus"](True)) == list(tiny)
    traced = {}
    for name, build in tiny.items():
        try:
            fn, args = build()
        except ImportError:
            continue
        traced[name] = jax.eval_shape(fn, *args)
    assert PURE_JAX <= set(traced)
    assert all(jax.tree_util.tree_leaves(out) for out in traced.values())


def test_a_program_runs_through_the_harness_and_matches_jax_jit(monkeypatch: Any,
                                                                  tmp_path: Path) -> None:
    """The default's first calls, decision, steady state and values, with ``tune=True``
    timed beside it (its decisions in a folder of their own, not the default's)."""
    monkeypatch.setenv("JAXPAR_TUNE_DIR", str(tmp_path))
    entry = corpus.measure_one("mamba_2_layers", cpu=True, measure=True, rounds=1, tune=True)
    assert "error" not in entry, entry.get("trace")
    assert entry["device"] == "cpu" and entry["result_scale"] > 0
    assert entry["max_abs_diff"] <= 1e-4 * entry["result_scale"]
    assert entry["plan_max_abs_diff"] <= 1e-4 * entry["result_scale"]
    assert entry["first_call_s"]["jax.jit"] > 0 and entry["first_call_s"]["jaxpar"] > 0
    assert entry["settle"]["verdict"].startswith(("measured on cpu", "nothing to measure"))
    assert set(entry["loop_us"]) == {"jax.jit", "jaxpar", "jaxpar tune=True"}
    assert entry["loop_ratio"] > 0 and entry["tune_loop_ratio"] > 0
    assert entry["tune_first_call_s"] > 0 and isinstance(entry["tune_chosen"], str)
    assert not Path(os.environ["JAXPAR_TUNE_DIR"]).is_relative_to(tmp_path)


def test_a_program_whose_library_is_missing_is_skipped(monkeypatch: Any) -> None:
    def build() -> Any:
        raise ModuleNotFoundError("No module named 'not_installed'")

    monkeypatch.setattr(corpus, "programs", lambda cpu: {"needs_it": build})
    entry = corpus.measure_one("needs_it", cpu=True, measure=True, rounds=1, tune=False)
    assert entry == {"skipped": "library not installed: No module named 'not_installed'"}


def test_a_program_past_its_limit_is_skipped_and_the_run_goes_on(tmp_path: Path) -> None:
    """A 1-s limit (the program's process is still importing or compiling then); the budget
    of 11 s leaves the next program under the 10 s a program is given at least."""
    results = corpus.run_each(["mamba_2_layers", "ppo_cartpole_rollout"], ["--cpu"],
                              str(tmp_path), limit=1.0, budget=11.0)
    written = json.loads((tmp_path / "measure-corpus.json").read_text())
    assert written == results
    assert written == {"mamba_2_layers": {"skipped": "time limit: over 1 s"},
                       "ppo_cartpole_rollout": {"skipped": "time budget"}}


def test_a_result_written_before_the_limit_stands(monkeypatch: Any) -> None:
    """A program's process that wrote its result and then outlived the limit (on the chip,
    Mamba's: its line printed, then the process slow to exit) keeps its result."""
    def late(command: list[str], timeout: float, check: bool) -> Any:
        path = command[command.index("--result") + 1]
        Path(path).write_text(json.dumps({"loop_ratio": 0.5}))
        raise corpus.subprocess.TimeoutExpired(command, timeout)

    monkeypatch.setattr(corpus.subprocess, "run", late)
    entry = corpus.run_child("mamba_2_layers", ["--cpu"], limit=3.0)
    assert entry == {"loop_ratio": 0.5, "exit": "ended at the time limit (3 s) after its result"}


def test_the_command_line_names_an_unknown_program(monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.setattr("sys.argv", ["measure_corpus.py", "--only", "no_such_program"])
    with pytest.raises(SystemExit):
        corpus.main()
    error = capsys.readouterr().err
    assert "--only: unknown ['no_such_program']" in error and "mamba_2_layers" in error


def test_the_summary_prints_the_corpus_and_its_tune_figures(tmp_path: Path, capsys: Any
                                                            ) -> None:
    """``measure_summary.py`` on a corpus results file: a measured program's row, a skipped
    one's reason, and ``--tune``'s table (the default within 5% of tune=True's or not)."""
    summary = load_benchmark("measure_summary")

    def measured(ratio: float, tuned: float) -> dict[str, Any]:
        return {"first_call_s": {"jax.jit": 2.0, "jaxpar": 2.2, "ratio": 1.1},
                "settle": {"calls": 3, "measure_s": 0.5, "verdict": "measured on cpu: x"},
                "loop_ratio": ratio, "tune_loop_ratio": tuned, "tune_chosen": "jax.jit"}

    results = {"close": measured(0.80, 0.78), "far": measured(0.90, 0.60),
               "missing": {"skipped": "library not installed: No module named 'diffrax'"}}
    (tmp_path / "measure-corpus.json").write_text(json.dumps(results))
    summary.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "| close | x0.800 | x1.10 (2.00) | 3 | 0.50 | measured on cpu: x |" in out
    assert "| missing | library not installed: No module named 'diffrax' |" in out
    assert "| close | x0.800 | x0.780 | jax.jit | yes |" in out
    assert "| far | x0.900 | x0.600 | jax.jit | no |" in out
