"""Many hosts for real: local processes under ``jax.distributed.initialize`` on the CPU
(4 devices each, gloo collectives) run ``processes_worker.py``'s cases together, and
each process's findings are compared here. Every launch has a timeout, so a hang fails
the test. Two processes by default; four too under ``JAXPAR_FULL=1``.

Also, in this process: ``_processes``'s comparison and message, and the tuner's
combination of processes' timings (with the exchange replaced by given texts).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers.environment import FULL

import jaxpar
from jaxpar import _processes, _tune

WORKER = Path(__file__).resolve().parent / "processes_worker.py"
TIMEOUT_S = 240  # a hang fails here, well before CI's limit


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def launch(count: int, tune_dir: Path) -> list[dict]:
    """Runs the worker in ``count`` processes; each one's results, in process order."""
    port = str(free_port())
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    # Only the suite's compile-speed flags (tests/conftest.py; none under JAXPAR_FULL=1)
    # reach the workers, which add their device count: every process compiles alike, and
    # XLA:CPU's compiles are most of their time.
    fast = ("--xla_backend_optimization_level=", "--xla_cpu_use_fusion_emitters=")
    env["XLA_FLAGS"] = " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split()
                                if flag.startswith(fast))
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(count), port,
                               str(tune_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(count)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"{count} processes did not finish within {TIMEOUT_S} s: a hang")
    results = []
    for i, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"process {i} failed:\n{output[-4000:]}"
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return results


@pytest.fixture(scope="module", params=[2, 4] if FULL else [2])
def together(request, tmp_path_factory) -> tuple[int, list[dict], Path]:
    tune_dir = tmp_path_factory.mktemp(f"tune{request.param}")
    return request.param, launch(request.param, tune_dir), tune_dir


def test_no_case_failed_on_any_process(together):
    count, results, _ = together
    unexpected = {f"process {i}: {name}": value["trace"] for i, result in enumerate(results)
                  for name, value in result.items()
                  if isinstance(value, dict) and "trace" in value}
    assert unexpected == {}
    assert len(results) == count


def test_collective_matmul_and_its_gradient_equal_jax_jit(together):
    _, results, _ = together
    for result in results:
        for target in ("cpu", "gpu"):  # exact on "cpu", tight tolerances on "gpu"
            assert result["collective_matmul"][target]["values"] is True
            assert result["collective_matmul"][target]["grads"] is True
    # Every process planned the same.
    assert len({json.dumps(r["collective_matmul"], sort_keys=True) for r in results}) == 1


def test_data_parallel_adam_steps_equal_jax_jit(together):
    _, results, _ = together
    assert all(r["data_parallel_step"] == {"cpu": True, "gpu": True} for r in results)


def test_inspect_on_process_0_alone_before_the_first_call_is_local(together):
    _, results, _ = together
    seen = results[0]["inspect_before_the_first_call"]
    assert seen["source"] == _tune.UNDECIDED
    assert "not decided yet" in seen["text"]
    assert all(r["inspect_before_the_first_call"] == {"tuning": "not asked"}
               for r in results[1:])


def test_the_first_call_tunes_together(together):
    count, results, tune_dir = together
    decisions = [r["tuned"] for r in results]
    assert len({d["chosen"] for d in decisions}) == 1
    assert all(d["source"] == _tune.TOGETHER and d["processes"] == count for d in decisions)
    # One combined table everywhere, with two programs timed the same number of rounds.
    assert len({json.dumps(d["rows"]) for d in decisions}) == 1
    timed = [row for row in decisions[0]["rows"] if row[2]]
    assert len(timed) >= 2 and len({row[2] for row in timed}) == 1
    assert all(d["values"] for d in decisions)
    # Only process 0 wrote, one file, readable as a file the user creates.
    assert decisions[0]["path"] is not None
    assert all(d["path"] is None for d in decisions[1:])
    assert all(d["files"] == 1 for d in decisions)
    umask = os.umask(0)
    os.umask(umask)
    assert decisions[0]["modes"] == [_tune.FILE_MODE & ~umask]
    # This decision's file and the measuring case's (process 0 writes each once).
    assert len(list(tune_dir.glob("*.json"))) == 2


def test_measuring_decides_together_at_the_second_call(together):
    count, results, _ = together
    found = [result["measured_together"] for result in results]
    assert all(entry.get("values") for entry in found), found
    assert {entry["chosen"] for entry in found} == {"jaxpar (chosen options)"}
    assert {entry["source"] for entry in found} == {_tune.TOGETHER}
    assert {entry["processes"] for entry in found} == {count}
    # Every process switched at the second call, before it ran: the same program each call.
    assert all(entry["switched_at"] == [1] for entry in found), found


def test_a_stored_decision_is_read_locally_and_shipped_read_only(together):
    _, results, _ = together
    chosen = results[0]["tuned"]["chosen"]
    assert results[0]["inspect_reads_the_stored_decision"] == {"source": "stored",
                                                                "chosen": chosen}
    # The other processes read their own (empty) directories: process 0's decision.
    assert results[0]["read_only_runs_the_stored_decision"] == {"source": "stored",
                                                                 "chosen": chosen}
    assert all(r["read_only_runs_the_stored_decision"] == {"source": "process 0",
                                                           "chosen": chosen}
               for r in results[1:])


@pytest.mark.parametrize("name", ["a_host_with_other_flags_is_refused",
                                  "a_tuning_host_with_other_flags_is_refused"])
def test_a_host_with_other_xla_flags_is_refused_on_every_process(together, name):
    _, results, _ = together
    for result in results:
        assert result[name]["error"] == "ProcessMismatchError"
        message = result[name]["message"]
        assert "xla_flags" in message and "--xla_gpu_enable_command_buffer=" in message
        assert "start every process with the same XLA_FLAGS" in message
    # And they go on together.
    assert len({json.dumps(r["still_in_step_after_a_refusal"]) for r in results}) == 1


def test_a_host_with_another_tune_budget_is_refused_by_the_tuner(together):
    _, results, _ = together
    for result in results:
        refused = result["a_host_with_another_tune_budget_is_refused"]
        assert refused["error"] == "ProcessMismatchError"
        assert "tune:" in refused["message"] and "seconds=0.3" in refused["message"]
        assert "the same tune= budget" in refused["message"]


# --------------------------------------------------------------------------- in-process


def exchange(monkeypatch, *others: dict) -> None:
    """``_processes.gather`` returning this process's text and then ``others``'."""
    texts = [json.dumps(other) for other in others]
    monkeypatch.setattr(_processes, "gather", lambda text: [text, *texts])


def test_agree_names_each_field_that_differs_and_its_remedy(monkeypatch):
    exchange(monkeypatch, {"xla_flags": "--xla_gpu_enable_command_buffer=", "same": 1,
                           "ignored": 2})
    with pytest.raises(jaxpar.ProcessMismatchError) as error:
        _processes.agree("f(f32[8])", {"xla_flags": "", "same": 1, "ignored": 3},
                         compared=("xla_flags", "same"))
    message = str(error.value)
    assert "f(f32[8])" in message and "process 1: '--xla_gpu_enable_command_buffer='" in message
    assert "start every process with the same XLA_FLAGS" in message
    assert "same:" not in message and "ignored" not in message


def test_agree_returns_everyones_fields_when_they_match(monkeypatch):
    exchange(monkeypatch, {"a": 1, "b": "x"})
    assert _processes.agree("f", {"a": 1, "b": "y"}, compared=("a",)) == [
        {"a": 1, "b": "y"}, {"a": 1, "b": "x"}]


def test_one_process_spans_only_itself():
    assert _processes.span([jax.numpy.ones(3), np.ones(2), 1.0]) == _processes.LOCAL


@pytest.mark.parametrize(("combine", "ratio"), [("slowest", 1.2), ("median", 0.95),
                                                ("process 0", 0.9)])
def test_processes_timings_combine_as_the_budget_says(monkeypatch, combine, ratio):
    exchange(monkeypatch, {"medians": {"a": 2.0}, "ratios": {"a": 1.2}},
             {"medians": {"a": 1.0}, "ratios": {"a": 0.95}})
    medians, ratios = _tune._combined({"a": 1.5}, {"a": 0.9}, combine)
    assert ratios == {"a": ratio}
    assert medians["a"] == {"slowest": 2.0, "median": 1.5, "process 0": 1.5}[combine]


def test_program_flags_leave_out_dump_and_log_flags():
    assert _tune.program_flags("--xla_dump_to=/tmp/a --xla_gpu_enable_command_buffer= "
                               "--xla_dump_hlo_as_text") == "--xla_gpu_enable_command_buffer="
