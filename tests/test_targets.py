"""jaxpar/targets/: each target's facts, the registry (its error, a new target module
registered and seen where targets are asked), and that code outside targets/ asks the
target object rather than comparing its name."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

from jaxpar import _options, _tune, targets
from jaxpar._tpu_model import TPU_V5E

PACKAGE = Path(__file__).resolve().parent.parent / "jaxpar"
NAME_COMPARISON = re.compile(
    r'[=!]= ?"(gpu|tpu|cpu)"|in \("(gpu|tpu|cpu)"|\.name == "(tpu|gpu|cpu)"')
MAX_NAME_COMPARISONS = 4


def test_the_registered_targets_and_their_facts() -> None:
    assert targets.names() == ("gpu", "cpu", "tpu")
    gpu, cpu, tpu = (targets.get(n) for n in ("gpu", "cpu", "tpu"))
    assert gpu.emits_streams and gpu.compiles_with_xla_options and gpu.sums_sliced_members
    assert not any(t.emits_streams or t.compiles_with_xla_options or t.sums_sliced_members
                   for t in (cpu, tpu))
    assert not cpu.measured_by_default and gpu.measured_by_default and tpu.measured_by_default
    assert gpu.words.dynamic_loop == "host-sync loop"
    assert tpu.words.dynamic_loop == cpu.words.dynamic_loop == "dynamic while loop"
    assert tpu.profile.trip_seconds is not None and tpu.profile.slices_read_kept
    assert cpu.profile.trip_seconds is None and not gpu.profile.slices_read_kept
    assert tpu.profile.peak_flops == TPU_V5E.peak_flops and tpu.memory_bytes == TPU_V5E.hbm_bytes
    assert targets.of_platform("tpu") is tpu and targets.of_platform("metal") is None
    assert _options.TARGETS == targets.rows()
    assert tpu.row.default("unroll", _options.OptionKind.UNROLL) == "cost"


def test_a_gpu_profile_prices_the_gpu_target_only() -> None:
    from jaxpar._gpu_model import GPU_PROFILES
    h100 = next(p for name, p in GPU_PROFILES.items() if "h100" in name)
    assert targets.device_profile("gpu", h100).gpu is h100
    assert targets.device_profile("cpu", h100) is targets.get("cpu").profile


def test_the_tuner_candidates_come_from_the_target_modules() -> None:
    by_label = {c.label: c for c in _tune.CANDIDATES}
    for target in targets.known():
        for label, overrides in target.candidates.items():
            assert target.name in by_label[label].targets, label
            assert by_label[label].overrides == overrides
    assert by_label["jaxpar, while loops by 4"].targets == ("gpu", "tpu")
    assert by_label["jaxpar unrolled by 8"].targets == ("tpu",)
    assert by_label[_tune.PLAIN].targets is None


def test_an_unknown_target_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'gpu', 'cpu', 'tpu', got 'npu'"):
        targets.get("npu")
    with pytest.raises(TypeError, match="TARGET"):
        targets.register(types.SimpleNamespace())


def test_a_new_target_module_is_seen_where_targets_are_asked() -> None:
    row = targets.TargetRow("npu", ("npu",), {"batch_scans": True})
    module = types.SimpleNamespace(TARGET=targets.Target(
        row, platform="npu", profile=targets.get("cpu").profile, emits_streams=True))
    targets.register(module)
    try:
        assert targets.get("npu") is module.TARGET
        assert targets.names()[-1] == "npu" and targets.of_platform("npu") is module.TARGET
        options = _options.Options.for_tables(_options.PASS_TABLE, targets.rows())(target="npu")
        settings = options.resolve(async_limit=2)
        assert settings.target == "npu" and "batch_scans" in settings.passes
        assert "fuse_scans" not in settings.passes
    finally:
        targets.unregister("npu")
    with pytest.raises(ValueError, match="got 'npu'"):
        targets.get("npu")


def test_code_outside_targets_asks_the_target_not_its_name() -> None:
    found = [f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) if "targets" not in path.parts
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if NAME_COMPARISON.search(line)]
    assert len(found) <= MAX_NAME_COMPARISONS, (
        "compare no target's name outside jaxpar/targets/: ask the target object "
        "(targets.get(settings.target).<capability>, a new capability in its Target if "
        "none fits) on these lines:\n" + "\n".join(found))
