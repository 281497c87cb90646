"""jaxpar/targets/: each target's facts, the registry (its error, a new target module
registered and seen where targets are asked), and that code outside targets/ asks the
target object rather than comparing its name."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxpar
from jaxpar import _options, _tune, targets
from jaxpar._analysis import Analysis
from jaxpar.passes import DecisionKind, run_passes
from jaxpar.targets.tpu import TPU_V5E

PACKAGE = Path(__file__).resolve().parent.parent / "jaxpar"
NAME_COMPARISON = re.compile(
    r'[=!]= ?"(gpu|tpu|cpu)"|in \("(gpu|tpu|cpu)"|\.name == "(tpu|gpu|cpu)"')
MAX_NAME_COMPARISONS = 2


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
    from jaxpar._model.gpu import GPU_PROFILES
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


# A TPU v6e as its module in jaxpar/targets/ would declare it: the TPU's facts with figures
# of its own (here a larger block limit and the v6e's peak and memory, assumptions for the
# test), the device kinds it covers and its own unroll rule.
NEW_CHIP_MODULE = """
import dataclasses

from jaxpar.targets import tpu
from jaxpar.targets.profile import DeviceProfile
from jaxpar.targets.tpu_model import block_factor, fixed_seconds
from jaxpar.targets.unroll import ScanQuery, UnrollChoice

TPU_V6E = dataclasses.replace(tpu.TPU_V5E, chip="TPU v6e", measured="assumed for a v6e",
                              block_limit=80, peak_flops=9.18e14, hbm_bytes=32 * 2**30)


def trip_seconds(eqn):
    return fixed_seconds(eqn, TPU_V6E)


def by_blocks(scan: ScanQuery) -> UnrollChoice:
    choice = block_factor(scan.eqn, TPU_V6E, scan.most_copies)
    return UnrollChoice(choice.factor, f"auto: v6e: {choice.reason}", blocked=choice.blocked)


TARGET = dataclasses.replace(
    tpu.TARGET,
    row=dataclasses.replace(tpu.ROW, name="tpu_v6e", backends=(),
                            memory_bytes=TPU_V6E.hbm_bytes),
    device_kinds=("TPU v6 lite", "TPU v6e"), figures_of=TPU_V6E.chip,
    profile=DeviceProfile("tpu_v6e", peak_flops=TPU_V6E.peak_flops,
                          bandwidth=TPU_V6E.hbm_bandwidth, min_kernel_seconds=TPU_V6E.dot_s,
                          trip_seconds=trip_seconds, slices_read_kept=True),
    unroll_rule=by_blocks, rank=3)
"""


def _tiny_loop(c: Any, xs: Any) -> Any:
    return lax.scan(lambda c, x: (jnp.sin(c) + x, c.sum()), c, xs)


TINY_ARGS = (jnp.linspace(0.0, 1.0, 64), jnp.ones((10_000, 64)) * 0.01)


def _unroll_decisions(target: str, closed: Any) -> tuple[Any, list[Any]]:
    options = _options.Options.for_tables(_options.PASS_TABLE, targets.rows())(target=target)
    new, decisions = run_passes(closed, ["unroll_scans"],
                                analysis=Analysis(options.resolve(async_limit=2)))
    return new, [d for d in decisions if d.kind == DecisionKind.UNROLLED]


def _assert_same_as_jit(fn: Any, got: Any) -> None:
    expected = jax.jit(_tiny_loop)(*TINY_ARGS)
    for want, have in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-6)


@pytest.fixture
def v6e_module(tmp_path: Path) -> Iterator[Any]:
    """The new chip's module, written to a file, imported and registered (then forgotten)."""
    path = tmp_path / "tpu_v6e.py"
    path.write_text(textwrap.dedent(NEW_CHIP_MODULE))
    spec = importlib.util.spec_from_file_location("tpu_v6e", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    targets.register(module)
    yield module
    targets.unregister("tpu_v6e")


def _on_device(monkeypatch: pytest.MonkeyPatch, platform: str, kind: str) -> None:
    """This machine's first device, as ``targets`` reads it, made a ``kind`` of ``platform``."""
    monkeypatch.setattr(targets, "local_device", lambda: (platform, kind))


def test_a_new_chip_is_one_module_and_the_passes_use_its_rule(v6e_module: Any) -> None:
    closed = jax.make_jaxpr(_tiny_loop)(*TINY_ARGS)
    assert targets.get("tpu_v6e") is v6e_module.TARGET
    new, [v6e] = _unroll_decisions("tpu_v6e", closed)
    _, [v5e] = _unroll_decisions("tpu", closed)
    # Its rule, not the TPU's: blocks of 80 trips (its limit) where the v5e reads 40.
    assert (v5e.unroll, v6e.unroll) == (40, 80)
    assert v6e.reason.startswith("auto: v6e: read by blocks of 80 trips")
    assert "assumed for a v6e" in v6e.reason and "measured on TPU v5e" in v5e.reason
    _assert_same_as_jit(_tiny_loop, jax.jit(jex_core.jaxpr_as_fun(new))(*TINY_ARGS))


def test_auto_is_the_most_specific_target_of_the_device(
        v6e_module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device of its kind the new chip's module wins ``target="auto"``, and plans use
    its figures and its rule; its name is a valid ``target=`` once registered."""
    _on_device(monkeypatch, "tpu", "TPU v6 lite")
    assert _options.Options().resolve_target() == "tpu_v6e"
    settings = _options.Options().resolve(async_limit=2)
    assert settings.target == "tpu_v6e" and settings.memory is not None
    assert settings.memory.extra_bytes == _options.memory_floor(32 * 2**30)
    plan = jaxpar.inspect(_tiny_loop)(*TINY_ARGS)
    text = plan.text(verbose=True)
    assert plan.target == "tpu_v6e" and "(target=tpu_v6e," in text
    assert "auto: v6e: read by blocks of 80 trips" in text and "assumed for a v6e" in text
    assert "planned with target" not in text  # its kind is covered: nothing stands in
    _assert_same_as_jit(_tiny_loop, jax.jit(jaxpar.parallel_branches(_tiny_loop))(*TINY_ARGS))
    # Named, on any machine: its program reads the loop by blocks of 80 trips.
    named = jax.jit(jaxpar.parallel_branches(_tiny_loop, target="tpu_v6e"))
    _assert_same_as_jit(_tiny_loop, named(*TINY_ARGS))
    assert "tensor<125x80x64xf32>" in named.lower(*TINY_ARGS).as_text()
    assert jaxpar.inspect(_tiny_loop, target="tpu_v6e")(*TINY_ARGS).target == "tpu_v6e"
    # A v5e is still the tpu target's; so is a TPU no module covers, whose plans say so.
    _on_device(monkeypatch, "tpu", "TPU v5 lite")
    assert _options.Options().resolve_target() == "tpu"
    assert "planned with target" not in str(jaxpar.inspect(_tiny_loop)(*TINY_ARGS))
    _on_device(monkeypatch, "tpu", "TPU v7x")
    assert _options.Options().resolve_target() == "tpu"
    assert ("this TPU v7x is planned with target 'tpu', TPU v5e's figures: no target module "
            "covers its device kind") in str(jaxpar.inspect(_tiny_loop)(*TINY_ARGS))


def test_which_target_a_device_is() -> None:
    gpu, cpu, tpu = (targets.get(n) for n in ("gpu", "cpu", "tpu"))
    assert targets.of_device("tpu", "TPU v5 lite") is tpu
    assert targets.of_device("tpu", "tpu V5E") is tpu  # kinds match whatever their case
    assert targets.of_device("tpu", "TPU v6 lite") is tpu  # the fallback
    assert targets.of_device("gpu", "NVIDIA H200") is gpu
    assert targets.of_device("cuda", "NVIDIA H100 80GB HBM3") is gpu  # a backend's name
    assert targets.of_device("cpu", "cpu") is cpu and targets.of_device("metal", "M3") is None
    assert tpu.kind_match("TPU v5 lite") == len("TPU v5 lite") and not tpu.kind_match("TPU v4")
    # The most specific pattern wins, whatever the rank; a target of no kinds is the
    # platform's fallback before any that declares kinds.
    row = targets.TargetRow("tpu_v6", (), {"batch_scans": True})
    wide = targets.Target(row, platform="tpu", profile=tpu.profile, device_kinds=("TPU v6*",),
                          rank=5)
    narrow = dataclasses.replace(wide, row=dataclasses.replace(row, name="tpu_v6_lite"),
                                 device_kinds=("TPU v6 lite",), rank=6)
    for target in (wide, narrow):
        targets.register(types.SimpleNamespace(TARGET=target))
    try:
        assert targets.of_device("tpu", "TPU v6 lite") is narrow
        assert targets.of_device("tpu", "TPU v6e") is wide
        assert targets.of_device("tpu", "TPU v7x") is tpu
    finally:
        targets.unregister("tpu_v6")
        targets.unregister("tpu_v6_lite")
    assert targets.of_device("tpu", "TPU v6 lite") is tpu  # the registry read again


def test_a_target_registered_at_runtime_is_a_valid_target_argument() -> None:
    row = targets.TargetRow("npu", ("npu",), {"batch_scans": True})
    module = types.SimpleNamespace(TARGET=targets.Target(
        row, platform="npu", profile=targets.get("cpu").profile))
    with pytest.raises(ValueError, match=r"'cpu', 'tpu', got 'npu' \(did you mean 'tpu'\?\)$"):
        jaxpar.inspect(_tiny_loop, target="npu")
    targets.register(module)
    try:
        assert jaxpar.inspect(_tiny_loop, target="npu")(*TINY_ARGS).target == "npu"
        _assert_same_as_jit(_tiny_loop, jaxpar.parallel_branches(_tiny_loop, target="npu")(
            *TINY_ARGS))
        with pytest.raises(ValueError, match=r"'tpu', 'npu', got 'npv' \(did you mean 'npu'\?\)"):
            jaxpar.parallel_branches(_tiny_loop, target="npv")
    finally:
        targets.unregister("npu")
    with pytest.raises(ValueError, match="got 'npu'"):
        _options.Options.create(target="npu")


def test_a_target_without_a_rule_of_its_own_unrolls_by_the_rule_of_thumb() -> None:
    """The CPU's rule and the default one: a short scan of a small body fully unrolled."""
    row = targets.TargetRow("npu", ("npu",), {"unroll": "cost"})
    module = types.SimpleNamespace(TARGET=targets.Target(
        row, platform="npu", profile=targets.get("cpu").profile))
    closed = jax.make_jaxpr(_tiny_loop)(jnp.zeros(4), jnp.zeros((6, 4)))
    targets.register(module)
    try:
        _, [decision] = _unroll_decisions("npu", closed)
    finally:
        targets.unregister("npu")
    assert module.TARGET.unroll_rule is targets.get("cpu").unroll_rule
    assert (decision.unroll, decision.reason) == (6, "auto: body cost and length: unroll by 6")
