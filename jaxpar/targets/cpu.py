"""The CPU target: no streams, nothing measured unless asked, XLA's own choices mostly
best (benchmarks/loops_cpu.py): its loops are left alone unless ``unroll=`` is given, and
``unroll="cost"`` follows the rule of thumb (``unroll.rule_of_thumb``)."""

from __future__ import annotations

from . import Target, TargetRow
from .profile import DeviceProfile
from .unroll import rule_of_thumb

TARGET = Target(
    TargetRow("cpu", ("cpu",)), platform="cpu",
    profile=DeviceProfile("cpu", peak_flops=1.0e11, bandwidth=2.0e10, min_kernel_seconds=1.0e-7),
    measured_by_default=False, unroll_rule=rule_of_thumb, rank=1)
