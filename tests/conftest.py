"""Test configuration: JAX on the CPU in float32, and hypothesis profiles.

Choose a hypothesis profile with the environment variable `JAXPAR_HYPOTHESIS_PROFILE`:

    JAXPAR_HYPOTHESIS_PROFILE=dev pytest tests/test_parallel_branches_properties.py

- `ci` (default): derandomized, so every run tests the same programs and a failure
  reproduces; 10 examples per property (the feature families a fraction of that, at
  least 4), which draws every program family of `programs.py`.
- `full`: as `ci` with 20 examples per property; the default under `JAXPAR_FULL=1`.
- `dev`: 20 random examples per property, for quick runs while editing.
- `thorough`: 1000 random examples per property, to hunt for bugs.

Tests marked `@pytest.mark.cpu_devices(n)` need `n` CPU devices (shard_map meshes). JAX
reads the device count once, when its backend starts, and in a whole-suite run an earlier
module has started it with one device. Such a test then runs in a fresh pytest process with
enough devices, together with every other such test of the session: one process (one JAX
start-up) for all of them, and each test still passes, fails (with the failure text from that
process) or skips on its own; the times per file below count that process's seconds toward
the file whose test started it. With enough devices here (e.g. a lone `test_shard_map.py`,
which asks for 4 before the backend starts) they run in this process.

`JAXPAR_FULL=1` runs the full matrices the default run samples: the `full` profile here,
and every target and call form of each model in `test_ecosystem.py` (see
`helpers.environment.FULL`).

Compile time: XLA:CPU compiles are most of the suite's time. Unless `JAXPAR_FULL=1` (or
`XLA_FLAGS` already names the flag), XLA compiles with `--xla_backend_optimization_level=0`,
which skips LLVM's optimizations and takes about a third off each XLA:CPU compile, and, on
jaxlib before 0.11 (which still has them), with `--xla_cpu_use_fusion_emitters=false`: XLA:CPU's
older loop emitters instead of its MLIR fusion emitters, which compile the same programs 2-2.5x
faster (jaxlib 0.12 has no such flag and refuses it). What the tests compare is unchanged: both
sides of every comparison are compiled alike, and the HLO XLA schedules for the GPU (the
deviceless compiles) does not depend on either; only the CPU machine code is slower, on
arrays of a few KB.

Sharp edges:
    `JAX_PLATFORMS` is set to `cpu` (unless already set) before anything imports JAX, so
    these tests never pick up an accelerator by accident; set it to run them elsewhere.
    64-bit mode stays off: the tests compare float32 programs.
"""

import importlib.metadata
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from helpers.environment import FULL, hypothesis_profile
from hypothesis import HealthCheck, settings


def _fast_compile_flags() -> list[str]:
    """The XLA:CPU flags that make this jaxlib compile faster (the docstring says which)."""
    flags = ["--xla_backend_optimization_level=0"]
    jaxlib = importlib.metadata.version("jaxlib")
    version = tuple(int(part) for part in re.findall(r"\d+", jaxlib)[:2])
    if version < (0, 11):  # later jaxlibs abort on a flag they do not know
        flags.append("--xla_cpu_use_fusion_emitters=false")
    return flags


if not FULL:
    # Before JAX starts its backend (it reads XLA_FLAGS once); subprocesses inherit it.
    _given = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join(
        [_given, *(flag for flag in _fast_compile_flags() if flag.split("=")[0] not in _given)]
    ).strip()

_SLOW_IS_FINE = [HealthCheck.too_slow, HealthCheck.data_too_large]

for _name, _examples in (("ci", 10), ("full", 20)):
    settings.register_profile(
        _name,
        derandomize=True,
        max_examples=_examples,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=_SLOW_IS_FINE,
    )
settings.register_profile(
    "dev", max_examples=20, deadline=None, suppress_health_check=_SLOW_IS_FINE
)
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, suppress_health_check=_SLOW_IS_FINE
)
settings.load_profile(hypothesis_profile())


# ---- Time per test file ------------------------------------------------------------------------
# At the end of a run, the files that took longest: wall seconds, CPU seconds (this process's
# threads plus the subprocesses it waited for), and the seconds and number of XLA compiles in
# them (JAX's own `/jax/core/compile/backend_compile_duration` events: CPU programs and the
# deviceless GPU ones). On a shared machine the CPU seconds are what to compare: wall time there
# measures the other users too. `JAXPAR_TEST_FILE_TIMES=N` sets how many files are listed
# (default 12; 0 for none).

import jax.monitoring  # noqa: E402  (after XLA_FLAGS is set above)

_FILE_TIMES: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
_COMPILES = [0.0, 0]  # XLA compile seconds and count, since the session began


def _count_compile(event: str, seconds: float, **_: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += seconds
        _COMPILES[1] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


@pytest.fixture(autouse=True)
def _decorations_start_afresh() -> None:
    """A test's decorations share their plans and compiled programs with each other, not
    with an earlier test's (``jaxpar._dispatch.shared``): the plans, jits and warnings a
    test counts are its own, as if it ran alone."""
    from jaxpar._dispatch.shared import forget_shared_states

    forget_shared_states()


@pytest.fixture
def private_decisions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The measuring tuner's decisions in this test's own folder, measuring not turned off
    by the environment (``helpers.measuring.private_tune_dir``; the measuring tests use it
    for every test: ``pytestmark = pytest.mark.usefixtures("private_decisions")``)."""
    from helpers.measuring import private_tune_dir

    return private_tune_dir(tmp_path, monkeypatch)


@pytest.fixture
def manual(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The measuring thread run by hand (``helpers.measuring.ManualWorker``)."""
    from helpers.measuring import manual_worker

    return manual_worker(monkeypatch)


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):  # type: ignore[no-untyped-def]
    wall, cpu, (compile_s, compiles) = time.perf_counter(), _cpu_seconds(), _COMPILES
    try:
        return (yield)
    finally:
        times = _FILE_TIMES[item.location[0]]
        times[0] += time.perf_counter() - wall
        times[1] += _cpu_seconds() - cpu
        times[2] += _COMPILES[0] - compile_s
        times[3] += _COMPILES[1] - compiles


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    shown = int(os.environ.get("JAXPAR_TEST_FILE_TIMES", "12"))
    if shown <= 0 or not _FILE_TIMES:
        return
    rows = sorted(_FILE_TIMES.items(), key=lambda row: -row[1][1])
    total = [sum(t[i] for t in _FILE_TIMES.values()) for i in range(4)]
    terminalreporter.section(f"slowest {min(shown, len(rows))} test files "
                             "(wall s, CPU s, XLA compile s, compiles)")
    for path, (wall, cpu, compile_s, compiles) in rows[:shown]:
        terminalreporter.write_line(
            f"{wall:8.1f} {cpu:8.1f} {compile_s:8.1f} {compiles:6.0f}  {path}")
    terminalreporter.write_line(f"{total[0]:8.1f} {total[1]:8.1f} {total[2]:8.1f} {total[3]:6.0f}  "
                                f"all {len(rows)} files")


# ---- Tests that need more CPU devices than this process has (the docstring says why) -------

_DEVICES_CHILD = "JAXPAR_TESTS_DEVICES_CHILD"  # set in the child: where it writes its outcomes
_DEVICES_RUN = pytest.StashKey[tuple[int, dict[str, dict[str, str]], str]]()
_CHILD_OUTCOMES: dict[str, dict[str, str]] = {}


def pytest_configure(config):  # type: ignore[no-untyped-def]
    config.addinivalue_line(
        "markers", "cpu_devices(count): needs `count` CPU devices; run in a process that has "
        "them when this one has fewer (tests/conftest.py)")


def _devices_wanted(item: pytest.Item) -> int:
    marker = item.get_closest_marker("cpu_devices")
    return int(marker.args[0]) if marker else 0


def _run_device_tests(session: pytest.Session) -> tuple[int, dict[str, dict[str, str]], str]:
    """Runs every test of the session that needs more CPU devices than this process has in
    one fresh pytest process; returns its device count, each test's outcome and its output."""
    have = len(jax.devices("cpu"))
    wanted = {item.nodeid: _devices_wanted(item) for item in session.items
              if _devices_wanted(item) > have}
    count = max(wanted.values())
    with tempfile.TemporaryDirectory() as folder:
        outcomes_path = Path(folder) / "outcomes.json"
        env = {**os.environ, _DEVICES_CHILD: str(outcomes_path), "JAX_PLATFORMS": "cpu",
               "JAX_NUM_CPU_DEVICES": str(count)}
        try:
            child = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *wanted],
                cwd=session.config.rootpath, env=env, capture_output=True, text=True,
                timeout=1800)
            output = f"exit code {child.returncode}:\n{(child.stdout + child.stderr)[-6000:]}"
        except subprocess.TimeoutExpired as timeout:
            output = f"timed out after {timeout.timeout} s"
        outcomes = json.loads(outcomes_path.read_text()) if outcomes_path.exists() else {}
    return count, outcomes, output


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):  # type: ignore[no-untyped-def]
    wanted = _devices_wanted(pyfuncitem)
    have = len(jax.devices("cpu")) if wanted else 0
    if have >= wanted:
        return None  # pytest calls the test here
    if os.environ.get(_DEVICES_CHILD):
        pytest.fail(f"this process was started for the tests that need CPU devices, yet has "
                    f"{have}, not {wanted}", pytrace=False)
    stash = pyfuncitem.session.stash
    if _DEVICES_RUN not in stash:
        stash[_DEVICES_RUN] = _run_device_tests(pyfuncitem.session)
    count, outcomes, output = stash[_DEVICES_RUN]
    outcome = outcomes.get(pyfuncitem.nodeid)
    where = f"in a pytest process with {count} CPU devices (this one has {have})"
    if outcome is None:
        pytest.fail(f"did not run {where}; that process ended with {output}", pytrace=False)
    if outcome["outcome"] == "failed":
        pytest.fail(f"failed ({outcome['when']}) {where}:\n{outcome['text']}", pytrace=False)
    if outcome["outcome"] == "xfailed":
        pytest.xfail(outcome["text"])
    if outcome["outcome"] == "skipped":
        pytest.skip(outcome["text"])
    return True


def pytest_runtest_logreport(report):  # type: ignore[no-untyped-def]
    """In the child process: each test's outcome, its first failing or skipping phase first."""
    if not os.environ.get(_DEVICES_CHILD):
        return
    if _CHILD_OUTCOMES.get(report.nodeid, {"outcome": "passed"})["outcome"] != "passed":
        return  # keep the phase that failed or skipped, not a later teardown
    if hasattr(report, "wasxfail"):
        outcome, text = "xfailed", report.wasxfail
    elif report.skipped:
        outcome = "skipped"
        text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        text = text.removeprefix("Skipped: ")
    else:
        outcome, text = report.outcome, report.longreprtext
    _CHILD_OUTCOMES[report.nodeid] = {"outcome": outcome, "when": report.when, "text": text}


def pytest_sessionfinish(session, exitstatus):  # type: ignore[no-untyped-def]
    if os.environ.get(_DEVICES_CHILD):
        Path(os.environ[_DEVICES_CHILD]).write_text(json.dumps(_CHILD_OUTCOMES))
