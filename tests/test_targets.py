"""jaxpar/targets/: each target's facts, the registry (its error, a new target module
registered and seen where targets are asked), and that code outside targets/ asks the
target object rather than comparing its name."""

from __future__ import annotations

import importlib.util
import re
import textwrap
import types
from pathlib import Path
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxpar import _options, _tune, targets
from jaxpar._analysis import Analysis
from jaxpar.passes import DecisionKind, run_passes
from jaxpar.targets.tpu import TPU_V5E

PACKAGE = Path(__file__).resolve().parent.parent / "jaxpar"
NAME_COMPARISON = re.compile(
    r'[=!]= ?"(gpu|tpu|cpu)"|in \("(gpu|tpu|cpu)"|\.name == "(tpu|gpu|cpu)"')
MAX_NAME_COMPARISONS = 3


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


# A TPU v6e as its module in jaxpar/targets/ would declare it: the TPU's facts with figures
# of its own (here a larger block limit, an assumption for the test) and its own unroll rule.
NEW_CHIP_MODULE = """
import dataclasses

from jaxpar.targets import tpu
from jaxpar.targets.tpu import TPU_V5E
from jaxpar.targets.tpu_model import block_factor
from jaxpar.targets.unroll import ScanQuery, UnrollChoice

TPU_V6E = dataclasses.replace(TPU_V5E, chip="TPU v6e", measured="assumed for a v6e",
                              block_limit=80)


def by_blocks(scan: ScanQuery) -> UnrollChoice:
    choice = block_factor(scan.eqn, TPU_V6E, scan.most_copies)
    return UnrollChoice(choice.factor, f"auto: v6e: {choice.reason}", blocked=choice.blocked)


TARGET = dataclasses.replace(
    tpu.TARGET, row=dataclasses.replace(tpu.ROW, name="tpu_v6e", backends=()),
    unroll_rule=by_blocks, rank=3)
"""


def _tiny_loop(c: Any, xs: Any) -> Any:
    return lax.scan(lambda c, x: (jnp.sin(c) + x, c.sum()), c, xs)


def _unroll_decisions(target: str, closed: Any) -> tuple[Any, list[Any]]:
    options = _options.Options.for_tables(_options.PASS_TABLE, targets.rows())(target=target)
    new, decisions = run_passes(closed, ["unroll_scans"],
                                analysis=Analysis(options.resolve(async_limit=2)))
    return new, [d for d in decisions if d.kind == DecisionKind.UNROLLED]


def test_a_new_chip_is_one_module_and_the_passes_use_its_rule(tmp_path: Path) -> None:
    path = tmp_path / "tpu_v6e.py"
    path.write_text(textwrap.dedent(NEW_CHIP_MODULE))
    spec = importlib.util.spec_from_file_location("tpu_v6e", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = (jnp.linspace(0.0, 1.0, 64), jnp.ones((10_000, 64)) * 0.01)
    closed = jax.make_jaxpr(_tiny_loop)(*args)
    targets.register(module)
    try:
        assert targets.get("tpu_v6e") is module.TARGET
        new, [v6e] = _unroll_decisions("tpu_v6e", closed)
    finally:
        targets.unregister("tpu_v6e")
    _, [v5e] = _unroll_decisions("tpu", closed)
    # Its rule, not the TPU's: blocks of 80 trips (its limit) where the v5e reads 40.
    assert (v5e.unroll, v6e.unroll) == (40, 80)
    assert v6e.reason.startswith("auto: v6e: read by blocks of 80 trips")
    assert "assumed for a v6e" in v6e.reason and "measured on TPU v5e" in v5e.reason
    expected = jax.jit(_tiny_loop)(*args)
    got = jax.jit(jex_core.jaxpr_as_fun(new))(*args)
    for want, have in zip(jax.tree.leaves(expected), got, strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-6)


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
