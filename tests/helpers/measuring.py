"""The measuring tuner driven by a test: its thread run by hand (``ManualWorker``), a
deterministic timer (``fake_timer``) and the names of the programs compiled (``compiles``).

Example::

    worker = ManualWorker()
    monkeypatch.setattr(measuring, "worker", lambda: worker)
    timed = fake_timer(monkeypatch, {"jaxpar (chosen options)": 0.5})
    f(x); worker.run()   # the call, then what it queued on the measuring thread
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import pytest

from jaxpar import _tune
from jaxpar._dispatch import measuring


class ManualWorker:
    """The measuring thread, run by the test: ``run()`` runs what was queued."""

    def __init__(self) -> None:
        self.tasks: list[Any] = []

    def submit(self, task: Any, *args: Any) -> None:
        self.tasks.append(functools.partial(task, *args))

    def run(self) -> int:
        count = 0
        while self.tasks:
            self.tasks.pop(0)()
            count += 1
        return count

    def wait_idle(self, timeout: float | None = None) -> bool:
        return not self.tasks


def fake_timer(monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float]) -> list[str]:
    """Times each candidate as ``seconds.get(label, 1.0)``, still running it."""
    timed: list[str] = []

    def timer(label, run):
        jax.block_until_ready(run())
        timed.append(label)
        return seconds.get(label, 1.0)

    monkeypatch.setattr(_tune, "_timer", timer)
    return timed


def compiles() -> list[str]:
    """Names of the programs compiled from now on (a list the caller reads later)."""
    from jax._src import monitoring

    names: list[str] = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event.endswith("backend_compile_duration"):
            names.append(str(kwargs.get("fun_name", "")))

    monitoring.register_event_duration_secs_listener(listener)
    return names


def private_tune_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Decisions stored under ``tmp_path``; measuring not turned off by the environment."""
    directory = tmp_path / "tune"
    monkeypatch.setenv(_tune.TUNE_DIR_VARIABLE, str(directory))
    monkeypatch.delenv(measuring.MEASURE_VARIABLE, raising=False)
    return directory


def manual_worker(monkeypatch: pytest.MonkeyPatch) -> ManualWorker:
    """A ``ManualWorker`` in place of the measuring thread."""
    worker = ManualWorker()
    monkeypatch.setattr(measuring, "worker", lambda: worker)
    return worker

