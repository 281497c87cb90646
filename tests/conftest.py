"""Test configuration: JAX on the CPU in float32, and hypothesis profiles.

Choose a hypothesis profile with the environment variable `JAXPAR_HYPOTHESIS_PROFILE`:

    JAXPAR_HYPOTHESIS_PROFILE=dev pytest tests/test_parallel_branches_properties.py

- `ci` (default): derandomized, so every run tests the same programs and a failure
  reproduces; 10 examples per property (the feature families a fraction of that, at
  least 4), which draws every program family of `programs.py`.
- `full`: as `ci` with 20 examples per property; the default under `JAXPAR_FULL=1`.
- `dev`: 20 random examples per property, for quick runs while editing.
- `thorough`: 1000 random examples per property, to hunt for bugs.

`JAXPAR_FULL=1` runs the full matrices the default run samples: the `full` profile here,
and every target and call form of each model in `test_ecosystem.py` (see `helpers.FULL`).

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
import os
import re
import resource
import time
from collections import defaultdict

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from helpers import FULL, hypothesis_profile
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
