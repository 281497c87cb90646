"""Test configuration: JAX on the CPU in float32, and hypothesis profiles.

Choose a hypothesis profile with the environment variable `JAXPAR_HYPOTHESIS_PROFILE`:

    JAXPAR_HYPOTHESIS_PROFILE=dev pytest tests/test_properties.py

- `ci` (default): derandomized, so every run tests the same programs and a failure
  reproduces; 10 examples per property (the feature families a fraction of that, at
  least 4), which draws every program family of `programs.py`.
- `full`: as `ci` with 20 examples per property; the default under `JAXPAR_FULL=1`.
- `dev`: 20 random examples per property, for quick runs while editing.
- `thorough`: 1000 random examples per property, to hunt for bugs.

`JAXPAR_FULL=1` runs the full matrices the default run samples: the `full` profile here,
and every target and call form of each model in `test_ecosystem.py` (see `helpers.FULL`).

Compile time: unless `JAXPAR_FULL=1` (or `XLA_FLAGS` already names the level), XLA compiles
with `--xla_backend_optimization_level=0`, which skips LLVM's optimizations and takes about a
third off each XLA:CPU compile, most of the suite's time. What the tests compare is unchanged:
both sides of every comparison are compiled alike, and the HLO XLA schedules (the deviceless
GPU compiles included) is the same; only the machine code is slower, on arrays of a few KB.

Sharp edges:
    `JAX_PLATFORMS` is set to `cpu` (unless already set) before anything imports JAX, so
    these tests never pick up an accelerator by accident; set it to run them elsewhere.
    64-bit mode stays off: the tests compare float32 programs.
"""

import os
import resource
import time
from collections import defaultdict

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from helpers import FULL, hypothesis_profile
from hypothesis import HealthCheck, settings

_OPT_LEVEL = "--xla_backend_optimization_level"
if not FULL and _OPT_LEVEL not in os.environ.get("XLA_FLAGS", ""):
    # Before JAX starts its backend (it reads XLA_FLAGS once); subprocesses inherit it.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_OPT_LEVEL}=0".strip()

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
# At the end of a run, the files that took longest: wall seconds and CPU seconds (this process's
# threads plus the subprocesses it waited for). On a shared machine the CPU seconds are what to
# compare: wall time there measures the other users too. `JAXPAR_TEST_FILE_TIMES=N` sets how
# many files are listed (default 12; 0 for none).

_FILE_TIMES: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):  # type: ignore[no-untyped-def]
    wall, cpu = time.perf_counter(), _cpu_seconds()
    try:
        return (yield)
    finally:
        times = _FILE_TIMES[item.location[0]]
        times[0] += time.perf_counter() - wall
        times[1] += _cpu_seconds() - cpu


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    shown = int(os.environ.get("JAXPAR_TEST_FILE_TIMES", "12"))
    if shown <= 0 or not _FILE_TIMES:
        return
    rows = sorted(_FILE_TIMES.items(), key=lambda row: -row[1][1])
    total_wall = sum(t[0] for t in _FILE_TIMES.values())
    total_cpu = sum(t[1] for t in _FILE_TIMES.values())
    terminalreporter.section(f"slowest {min(shown, len(rows))} test files (wall s, CPU s)")
    for path, (wall, cpu) in rows[:shown]:
        terminalreporter.write_line(f"{wall:8.1f} {cpu:8.1f}  {path}")
    terminalreporter.write_line(f"{total_wall:8.1f} {total_cpu:8.1f}  all {len(rows)} files")
