"""``jaxpar.gpu_preview`` (``jaxpar._compiled.preview``) on the seed-002 and multi-branch
programs (deviceless H200)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from helpers.environment import PLUGIN_MESSAGE, PLUGIN_OK, needs_plugin
from helpers.programs import (
    LOOPS_OFF,
    deep_birnn,
    deep_birnn_args,
    four_matmul_branches,
    four_matmul_branches_args,
    seed_002,
    seed_002_specs,
)

import jaxpar
import jaxpar._compiled.gpu_compile as _gpu_compile
import jaxpar._compiled.preview as _preview
from jaxpar._model.gpu import CommandBufferMode


def branch_specs():
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in four_matmul_branches_args()]


@needs_plugin
def test_two_scans_preview_shows_fewer_loop_trips():
    preview = jaxpar.gpu_preview(seed_002, *seed_002_specs(), gpu="h200")
    assert preview.plain.total_trips == 20_000 and len(preview.plain.loops) == 2
    # Fused and unrolled by the GPU model's fastest factor (16: 625 trips).
    assert len(preview.jaxpar.loops) == 1 and preview.jaxpar.total_trips == 625
    assert preview.jaxpar.host_sync_loops == 0
    assert "ENTRY" in preview.jaxpar.hlo
    text = str(preview)
    assert "loop trips (total)" in text and "20000" in text
    json.dumps(preview.to_dict())
    # Launches per run: loop bodies times their trips, not bodies once.
    for figures in (preview.plain, preview.jaxpar):
        per_run = sum(loop.kernels_per_trip * loop.known_trip_count for loop in figures.loops)
        assert figures.launches >= per_run > figures.kernels
    assert preview.plain.launches > 100_000
    assert preview.plain.host_syncs == preview.jaxpar.host_syncs == 0
    assert preview.plain.estimated_us > 0 and preview.jaxpar.estimated_us > 0
    assert set(dict(preview.plain.estimated_us_by_mode)) == {
        "lhs", "concurrent", "concurrent_regions", "serialize", "off"}
    assert preview.time_ratio == preview.jaxpar.estimated_us / preview.plain.estimated_us
    assert preview.verdict in text and "launches per run" in text


@needs_plugin
def test_the_compile_agrees_that_the_unjoined_scans_are_faster(monkeypatch):
    """Two RNN scans with deep cells fused and unrolled by 5 (the fused body's 56
    equations cap the factor) against each unrolled by 10 alone: jaxpar's model rates the
    second faster and runs it (``_pipeline._without_slower_joins``); the deviceless
    compile's estimate agrees (640 against 721 us, 484 against 545 launches)."""
    from jaxpar import _pipeline

    specs = jax.eval_shape(deep_birnn_args)
    chosen = jaxpar.gpu_preview(deep_birnn, *specs, gpu="h200")
    assert "fused" not in {d.kind for d in chosen.plan.decisions}
    assert chosen.plan.memory is not None and not chosen.plan.memory.left_out[0].memory
    monkeypatch.setattr(_pipeline, "_without_slower_joins", lambda chosen, *_: chosen)
    fused = jaxpar.gpu_preview(deep_birnn, *specs, gpu="h200")
    assert "fused" in {d.kind for d in fused.plan.decisions}
    assert chosen.plan.estimate.jaxpar_us < fused.plan.estimate.jaxpar_us
    assert chosen.jaxpar.estimated_us < fused.jaxpar.estimated_us
    assert chosen.jaxpar.launches < fused.jaxpar.launches


@needs_plugin
def test_two_scans_with_loops_off_preview_two_streams():
    if jax.lib.__version__ in _preview._CRASHES_ON_ANNOTATED_LOOPS:
        with pytest.raises(RuntimeError, match="crashed the process"):
            jaxpar.gpu_preview(seed_002, *seed_002_specs(steps=100), **LOOPS_OFF)
        return
    preview = jaxpar.gpu_preview(seed_002, *seed_002_specs(steps=100), **LOOPS_OFF)
    assert preview.jaxpar.async_in_flight == 2
    assert preview.jaxpar.stream_ids == (1, 2)
    assert preview.plain.async_in_flight == 0


@needs_plugin
def test_multi_branch_preview_and_decorated_input():
    fast = jaxpar.parallel_branches(four_matmul_branches, max_streams=2, batch_branches=False,
                                    batch_matmuls=False, force_streams=True)
    preview = jaxpar.gpu_preview(fast, *branch_specs(), gpu="h100")
    assert preview.gpu == "h100" and preview.plan.target == "gpu"
    assert preview.jaxpar.async_in_flight == 2 and preview.jaxpar.stream_ids == (1, 2)
    assert preview.plain.async_in_flight == 0 and preview.plain.stream_ids == ()


def test_missing_plugin_names_the_pip_line(monkeypatch):
    monkeypatch.setattr(_gpu_compile, "plugin_status", lambda: (
        False, "pip install --no-deps jax-cuda12-plugin==9.9 jax-cuda12-pjrt==9.9"))
    with pytest.raises(RuntimeError, match=r"pip install --no-deps jax-cuda12-plugin==9\.9"):
        jaxpar.gpu_preview(four_matmul_branches, *branch_specs())


@needs_plugin
def test_known_crashing_jaxlib_is_refused_not_crashed(monkeypatch):
    monkeypatch.setattr(_preview, "_CRASHES_ON_ANNOTATED_LOOPS", frozenset({jax.lib.__version__}))
    with pytest.raises(RuntimeError, match="allow_known_crashes"):
        jaxpar.gpu_preview(seed_002, *seed_002_specs(steps=10), **LOOPS_OFF)
    # Regions without loops are fine on such a jaxlib.
    preview = jaxpar.gpu_preview(four_matmul_branches, *branch_specs(), batch_branches=False,
                                 batch_matmuls=False, force_streams=True)
    assert preview.jaxpar.async_in_flight == 2


def test_bad_command_buffers_mode_is_an_error():
    with pytest.raises(ValueError, match="command_buffers"):
        jaxpar.gpu_preview(lambda x: x @ x, jnp.ones((4, 4)), command_buffers="fast")


def test_unknown_option_lists_each_valid_option_once():
    with pytest.raises(TypeError, match=r"did you mean 'max_streams'") as error:
        jaxpar.gpu_preview(lambda x: x @ x, jnp.ones((4, 4)), max_stream=2)
    listed = str(error.value).split("valid options are: ")[1].split(", ")
    assert "command_buffers" in listed
    assert len(listed) == len(set(listed)), listed


def test_bad_gpu_name_is_an_error():
    if not PLUGIN_OK:
        pytest.skip(PLUGIN_MESSAGE)
    with pytest.raises(ValueError, match="gpu"):
        jaxpar.gpu_preview(lambda x: x @ x, jnp.ones((4, 4)), gpu="a100")


def two_chains(a, wa, b, wb):
    """Two independent matmul chains: a section pays with CUDA graphs off, not in LHS
    (its regions' temporaries then live side by side: 4 -> 8 MiB once compiled, so the
    default memory budget leaves it out; these tests are about the mode, so ``ANY``)."""
    return jnp.tanh(jnp.tanh(a @ wa) @ wa), jnp.sin(jnp.sin(b @ wb) @ wb)


TWO_CHAINS = [jax.ShapeDtypeStruct((1024, 1024), jnp.float32)] * 4
ANY = {"memory": "any"}


@needs_plugin
def test_preview_judges_and_plans_in_the_mode_xla_flags_sets(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    default = jaxpar.gpu_preview(two_chains, *TWO_CHAINS, **ANY)
    assert default.command_buffers is CommandBufferMode.LHS
    assert default.jaxpar.estimate.command_buffers == "lhs" and not default.plan.sections
    assert "CUDA graphs: lhs, from XLA_FLAGS" in str(default)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    off = jaxpar.gpu_preview(two_chains, *TWO_CHAINS, **ANY)
    assert off.command_buffers is CommandBufferMode.OFF and off.mode_source == "XLA_FLAGS"
    assert off.jaxpar.estimate.command_buffers == "off" and "off graphs" in off.verdict
    assert len(off.plan.sections) == 1 and off.jaxpar.async_in_flight == 2
    assert off.plain.estimated_us == dict(default.plain.estimated_us_by_mode)["off"]
    assert "CUDA graphs: off, from XLA_FLAGS" in str(off)
    assert off.to_dict()["command_buffers"] == "off"


@needs_plugin
def test_preview_shows_the_compiles_memory_beside_the_plans(monkeypatch):
    # The section's regions keep their temporaries side by side: the compile's
    # memory_analysis() shows it, and so does the plan's memory model; within a budget of
    # 1 MiB the plan leaves the section out, and the compile shows plain's memory (the
    # default budget on an H200, 33 MiB, allows the section's 16 MiB).
    monkeypatch.setenv("XLA_FLAGS", "")
    kept = jaxpar.gpu_preview(two_chains, *TWO_CHAINS, command_buffers="off", **ANY)
    assert kept.plan.sections and kept.plan.memory is not None
    assert kept.jaxpar.temp_bytes > 1.5 * kept.plain.temp_bytes > 0
    assert kept.plan.memory.jaxpar_bytes > 1.5 * kept.plan.memory.plain_bytes
    text = str(kept)
    assert "temporary memory" in text and kept.memory_line in text
    assert "from the compiles' memory_analysis(); the plan estimated" in kept.memory_line
    safe = jaxpar.gpu_preview(two_chains, *TWO_CHAINS, command_buffers="off", memory=2**20)
    assert not safe.plan.sections
    assert safe.jaxpar.temp_bytes == safe.plain.temp_bytes
    assert safe.plan.memory is not None and safe.plan.memory.left_out
    assert "stream sections left out" in safe.plan.memory.left_out[0].line()
    assert safe.to_dict()["jaxpar"]["temp_bytes"] == safe.jaxpar.temp_bytes


@needs_plugin
def test_an_explicit_mode_wins_over_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    off = jaxpar.gpu_preview(two_chains, *TWO_CHAINS, command_buffers="off", **ANY)
    assert off.command_buffers is CommandBufferMode.OFF and off.mode_source == "argument"
    assert len(off.plan.sections) == 1 and "off graphs" in off.verdict
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    lhs = jaxpar.gpu_preview(two_chains, *TWO_CHAINS, command_buffers=CommandBufferMode.LHS,
                             **ANY)
    assert lhs.command_buffers is CommandBufferMode.LHS and not lhs.plan.sections
    assert "CUDA graphs: lhs, from argument" in str(lhs)


@needs_plugin
def test_preview_traces_and_analyses_the_function_once(monkeypatch):
    """One jaxpar analysis (its report and its compile share it) and one trace each for
    the plain and the jaxpar program."""
    import jaxpar._pipeline as pipeline

    analyses = []
    real = pipeline.analyse
    monkeypatch.setattr(pipeline, "analyse",
                        lambda *a, **k: analyses.append(1) or real(*a, **k))
    traces = []

    def counted(*args):
        traces.append(1)
        return four_matmul_branches(*args)

    preview = jaxpar.gpu_preview(counted, *branch_specs(), batch_branches=False,
                                 batch_matmuls=False, force_streams=True)
    assert len(analyses) == 1
    assert len(traces) == 2  # plain jax.jit's trace and jaxpar's
    assert preview.jaxpar.async_in_flight == 2 and preview.plan.num_regions == 2


def region_with_a_small_loop(x, w):
    """Five kinds of heavy work and a tiny scan: the scan is not among the region's four
    dearest primitives."""
    y = jnp.tanh(x @ w)
    y = y + jnp.sort(y, axis=0) + jnp.cumsum(y, axis=1) + jnp.max(y, axis=0) \
        + jnp.sum(y, axis=1, keepdims=True) + jnp.argmax(y, axis=0).astype(y.dtype)
    carry, _ = jax.lax.scan(lambda c, _: (c * 2.0, None), y[0, :2], None, length=2)
    return y + carry.sum()


def test_crash_guard_reads_every_equation_of_the_regions():
    from jaxpar._api import ParallelBranches
    from jaxpar._options import Options

    def f(a, wa, b, wb):
        return region_with_a_small_loop(a, wa), region_with_a_small_loop(b, wb)

    specs = [jax.ShapeDtypeStruct((512, 512), jnp.float32)] * 4
    fast = ParallelBranches(f, Options.create(target="gpu", **LOOPS_OFF))
    jax.make_jaxpr(fast)(*specs)
    plan, level = fast._analysed_report()
    regions = [r for s in plan.sections for r in s.regions]
    assert len(regions) == 2
    # The report lists each region's four dearest primitives; the scan is not among them.
    assert not any(name == "scan" for r in regions for name, _ in r.primitives)
    assert _preview._regions_hold_loops(level)


def _scaled_step(x, w, gamma, tau):
    y = jnp.tanh(x @ w) * gamma
    return y + tau * x, (x @ w).sum() * gamma


_X = jnp.ones((8, 8))


@needs_plugin
@pytest.mark.parametrize("case", ["python scalars", "numpy scalars", "weak arrays",
                                  "shape structs"])
def test_preview_plans_the_program_inspect_plans(case):
    # gpu_preview traces each argument as jax.jit does (jax.typeof): a Python scalar weak,
    # np.float64 (a float subclass) strong, a weak array weak. It made np.float64 weak and
    # weak arrays strong, so its plan had one equation more or fewer than inspect's (an RL
    # step: 582 against 581).
    import numpy as np

    weak = jax.device_put(0.5)
    assert weak.weak_type
    args = {"python scalars": (_X, _X, 0.99, 2),
            "numpy scalars": (_X, _X, np.float64(0.99), np.float32(0.5)),
            "weak arrays": (_X, _X, weak, weak),
            "shape structs": (jax.ShapeDtypeStruct((8, 8), jnp.float32), _X,
                              jax.ShapeDtypeStruct((), jnp.float32, weak_type=True),
                              np.float64(0.5))}[case]
    planned = jaxpar.inspect(_scaled_step, target="gpu")(*args)
    preview = jaxpar.gpu_preview(_scaled_step, *args)
    assert preview.plan.num_eqns == planned.num_eqns
    assert preview.plan.estimate == planned.estimate
