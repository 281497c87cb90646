"""The CPU target: no streams, nothing measured unless asked, XLA's own choices mostly
best (benchmarks/loops_cpu.py)."""

from __future__ import annotations

from . import Target, TargetRow
from .profile import DeviceProfile

TARGET = Target(
    TargetRow("cpu", ("cpu",)), platform="cpu",
    profile=DeviceProfile("cpu", peak_flops=1.0e11, bandwidth=2.0e10, min_kernel_seconds=1.0e-7),
    measured_by_default=False, rank=1)
