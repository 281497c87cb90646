"""Deviceless GPU compilation and schedule parsing (`jaxpar._compiled`).

Compiles for H200s on this CPU-only machine through the CUDA PJRT plugin; every test that
compiles is skipped, with the `pip install` line, when the plugin is missing.

Sharp edges:
    jaxlib 0.12.0.1 segfaults compiling a stream-annotated call whose body holds a `while`
    (seen; 0.10.2 is fine). The annotated-scan test therefore compiles in a subprocess and,
    on a known-bad jaxlib, checks the schedule XLA dumped just before it crashed, then
    xfails naming the crash.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import pytest
from helpers.environment import needs_plugin
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import jaxpar
from jaxpar._compiled import (
    GPU_TARGETS,
    compile_for_gpu,
    gpu_target_config,
    make_gpu_mesh,
    parse_schedule,
)

# jaxlib versions whose XLA crashes (SIGSEGV) compiling a stream-annotated call holding a
# while loop, deviceless for sm_90.
_JAXLIB_CRASHES_ON_ANNOTATED_LOOPS = frozenset({"0.12.0.1"})

MATRIX = jax.ShapeDtypeStruct((100, 100), jnp.float32)


def _tanh_step(carry, _):
    return jnp.tanh(carry @ carry), None


def _sin_step(carry, _):
    return jnp.sin(carry @ carry.T) + 1.0, None


def _scan_tanh(a):
    return lax.scan(_tanh_step, a, None, length=10)[0]


def _scan_sin(b):
    return lax.scan(_sin_step, b, None, length=10)[0]


# The annotated program, as a script for a child interpreter (see the module's sharp edges).
_ANNOTATED_SCANS_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    from jax import lax
    try:
        from jax.experimental.xla_metadata import xla_metadata_call
    except ImportError:
        from jax.experimental.scheduling_groups import xla_metadata_call
    from jaxpar._compiled import compile_for_gpu

    def tanh_step(c, _):
        return jnp.tanh(c @ c), None

    def sin_step(c, _):
        return jnp.sin(c @ c.T) + 1.0, None

    def program(a, b):
        first = xla_metadata_call(
            lambda x: lax.scan(tanh_step, x, None, length=10)[0],
            _xla_stream_annotation="1", inlineable="false", _scheduling_group_id="1")(a)
        second = xla_metadata_call(
            lambda x: lax.scan(sin_step, x, None, length=10)[0],
            _xla_stream_annotation="2", inlineable="false", _scheduling_group_id="1")(b)
        return first, second

    matrix = jax.ShapeDtypeStruct((100, 100), jnp.float32)
    sys.stdout.write(compile_for_gpu(program, matrix, matrix, gpu="h200"))
    """
)


def _assert_annotated_scans_overlap(text: str) -> None:
    schedule = parse_schedule(text)
    entry = schedule.entry_schedule
    compute = [event for event in entry.events if event.kind == "compute"]
    phases = [event.phase for event in compute]
    assert phases == ["start", "start", "done", "done"], [e.name for e in compute]
    assert schedule.max_async_calls_in_flight == 2
    assert schedule.stream_ids == frozenset({1, 2})
    assert {event.scheduling_group_id for event in compute} == {"1"}
    assert len(schedule.while_loops) == 2
    assert all(loop.known_trip_count == 10 for loop in schedule.while_loops)
    assert all(loop.body_kernels >= 1 for loop in schedule.while_loops)
    # Each loop runs inside its own region, not in ENTRY.
    regions = {event.called_computation for event in compute if event.phase == "start"}
    assert {loop.computation for loop in schedule.while_loops} == regions


@needs_plugin
def test_annotated_scans_overlap_on_two_streams():
    jaxlib_version = importlib.metadata.version("jaxlib")
    with tempfile.TemporaryDirectory() as dump_dir:
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir}".strip()
        child = subprocess.run(
            [sys.executable, "-c", _ANNOTATED_SCANS_SCRIPT],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        if child.returncode == 0:
            _assert_annotated_scans_overlap(child.stdout)
            return
        if child.returncode > 0 or jaxlib_version not in _JAXLIB_CRASHES_ON_ANNOTATED_LOOPS:
            pytest.fail(f"compile failed (rc={child.returncode}):\n{child.stderr[-4000:]}")
        dumps = glob.glob(os.path.join(dump_dir, "*gpu_after_optimizations.txt"))
        assert dumps, "XLA crashed before dumping the optimized module"
        with open(dumps[0]) as dumped:
            _assert_annotated_scans_overlap(dumped.read())
    pytest.xfail(
        f"jaxlib {jaxlib_version}: the schedule is right (checked from XLA's dump), but XLA "
        f"crashes (signal {-child.returncode}) compiling a stream-annotated call holding a "
        f"while loop"
    )


@needs_plugin
def test_plain_scans_have_no_async_calls():
    text = compile_for_gpu(lambda a, b: (_scan_tanh(a), _scan_sin(b)), MATRIX, MATRIX)
    schedule = parse_schedule(text)
    assert schedule.max_async_calls_in_flight == 0
    assert schedule.stream_ids == frozenset()
    assert not schedule.events
    assert len(schedule.while_loops) == 2
    assert {loop.computation for loop in schedule.while_loops} == {schedule.entry}
    assert all(loop.known_trip_count == 10 for loop in schedule.while_loops)


@needs_plugin
def test_annotated_calls_without_loops_overlap():
    try:
        from jax.experimental.xla_metadata import xla_metadata_call
    except ImportError:
        from jax.experimental.scheduling_groups import xla_metadata_call

    def program(a, b):
        first = xla_metadata_call(
            lambda x: jnp.tanh(x @ x),
            _xla_stream_annotation="1",
            inlineable="false",
            _scheduling_group_id="1",
        )(a)
        second = xla_metadata_call(
            lambda x: jnp.sin(x @ x.T),
            _xla_stream_annotation="2",
            inlineable="false",
            _scheduling_group_id="1",
        )(b)
        return first, second

    schedule = parse_schedule(compile_for_gpu(program, MATRIX, MATRIX, gpu="h100"))
    assert schedule.max_async_calls_in_flight == 2
    assert schedule.stream_ids == frozenset({1, 2})
    assert [e.opcode for e in schedule.entry_schedule.events] == [
        "call-start",
        "call-start",
        "call-done",
        "call-done",
    ]


def _bidirectional_ring(axis_size):
    forward = [(i, (i + 1) % axis_size) for i in range(axis_size)]
    backward = [(i, (i - 1) % axis_size) for i in range(axis_size)]

    def body(a, c):
        right = lax.ppermute(a, "x", forward)
        left = lax.ppermute(a, "x", backward)
        local = jnp.tanh(c @ c) @ c  # independent work the permutes can hide behind
        return (right + left + local,)

    return body


@needs_plugin
def test_bidirectional_ppermute_on_eight_gpus():
    mesh = make_gpu_mesh("h200", 8)
    program = jax.shard_map(
        _bidirectional_ring(8),
        mesh=mesh,
        in_specs=(PartitionSpec("x"), PartitionSpec("x")),
        out_specs=(PartitionSpec("x"),),
    )
    block = jax.ShapeDtypeStruct(
        (8 * 512, 512), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("x"))
    )
    schedule = parse_schedule(compile_for_gpu(program, block, block, gpu="h200", mesh=mesh))
    entry = schedule.entry_schedule
    starts = [e for e in entry.events if e.phase == "start" and e.kind == "collective"]
    assert starts and all(e.collective == "collective-permute" for e in starts)
    assert all(e.opcode == "collective-permute-start" for e in starts)
    # Both directions are there: async starts, or (XLA >= 0.12) one made synchronous.
    assert len(starts) + len(entry.synchronous_collectives) == 2
    # XLA's default keeps one collective in flight (docs/xla.md, "Collectives and their streams").
    assert schedule.max_collectives_in_flight == 1
    assert schedule.dot_kernels_during_collectives >= 1


@needs_plugin
def test_abstract_specs_bind_to_the_mesh():
    mesh = make_gpu_mesh("h200", 8)
    program = jax.shard_map(
        lambda a: (lax.psum(a, "x"),),
        mesh=mesh,
        in_specs=(PartitionSpec("x"),),
        out_specs=(PartitionSpec(),),
    )
    # An unsharded struct lands replicated; a bare PartitionSpec is bound to the mesh.
    sharded = jax.ShapeDtypeStruct((8 * 16, 16), jnp.float32, sharding=PartitionSpec("x"))
    text = compile_for_gpu(program, sharded, mesh=mesh)
    assert "all-reduce" in text
    assert make_gpu_mesh("h200", 8).devices.tolist() == mesh.devices.tolist()  # cached


@needs_plugin
def test_the_same_program_is_compiled_once(monkeypatch):
    from jaxpar._compiled import gpu_compile

    compiles = []
    compile_lowered = jax.stages.Lowered.compile

    def counted(self, *args, **kwargs):
        compiles.append(1)
        return compile_lowered(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
    gpu_compile.clear_compile_cache()
    text = compile_for_gpu(_scan_tanh, MATRIX)
    # Traced and lowered again (jax.jit's own cache holds no executable across lowerings),
    # yet the same module: XLA's text, not another compile.
    assert compile_for_gpu(_scan_tanh, MATRIX) == text and len(compiles) == 1
    # What XLA compiles differently is compiled again: options, devices, GPU, the program.
    options = {"xla_gpu_enable_command_buffer": ""}
    compile_for_gpu(_scan_tanh, MATRIX, compiler_options=options)
    compile_for_gpu(_scan_tanh, MATRIX, gpu="h100")
    compile_for_gpu(_scan_tanh, jax.ShapeDtypeStruct((64, 64), jnp.float32))
    assert len(compiles) == 4
    # Source locations are part of the key: the executable's metadata names the user's lines.
    def moved(a):  # the same operations, on another line
        return lax.scan(_tanh_step, a, None, length=10)[0]

    moved.__name__ = moved.__qualname__ = _scan_tanh.__name__
    compile_for_gpu(moved, MATRIX)
    assert len(compiles) == 5
    gpu_compile.clear_compile_cache()
    assert compile_for_gpu(_scan_tanh, MATRIX) == text and len(compiles) == 6


# Hand-written HLO in both async syntaxes: jaxlib 0.10.2's call-start and 0.12.0.1's
# async-start wrapping a call.
_HLO_BOTH_ASYNC_SYNTAXES = textwrap.dedent(
    """\
        HloModule m, is_scheduled=true

        %body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
          %p = (s32[], f32[4]{0}) parameter(0)
          %f = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused
          ROOT %t = (s32[], f32[4]{0}) tuple(%p, %f)
        }, execution_thread="parallel"

        %cond (p.1: (s32[], f32[4])) -> pred[] {
          %p.1 = (s32[], f32[4]{0}) parameter(0)
          ROOT %c = pred[] fusion(%p.1), kind=kLoop, calls=%fused_compare
        }, execution_thread="parallel"

        %region (a: f32[4]) -> f32[4] {
          %a = f32[4]{0} parameter(0)
          %w = (s32[], f32[4]{0}) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
          ROOT %g = f32[4]{0} get-tuple-element(%w), index=1
        }, execution_thread="parallel"

        %async_computation (b: f32[4]) -> f32[4] {
          %b = f32[4]{0} parameter(0)
          ROOT %call = f32[4]{0} call(%b), to_apply=%region, frontend_attributes={inlineable="false"}
        }, execution_thread="parallel"

        %other (d: f32[4]) -> f32[4] {
          ROOT %d = f32[4]{0} parameter(0)
        }

        ENTRY %main (x: f32[4]) -> (f32[4], f32[4]) {
          %x = f32[4]{0} parameter(0)
          %call-start = ((f32[4]{0}), f32[4]{0}) async-start(%x), async_execution_thread="parallel", calls=%async_computation, frontend_attributes={_scheduling_group_id="1",_xla_stream_annotation="1",inlineable="false"}
          %call-start.1 = ((f32[4]{0}), f32[4]{0}) call-start(%x), async_execution_thread="parallel", to_apply=%other, frontend_attributes={_scheduling_group_id="1",_xla_stream_annotation="2",inlineable="false"}
          %call-done = f32[4]{0} async-done(%call-start), frontend_attributes={_xla_stream_annotation="1"}
          %call-done.1 = f32[4]{0} call-done(%call-start.1)
          %w.2 = (s32[], f32[4]{0}) while(%x), condition=%cond, body=%body
          ROOT %r = (f32[4]{0}, f32[4]{0}) tuple(%call-done, %call-done.1)
        }
        """  # noqa: E501
)


def test_parse_schedule_reads_both_async_call_syntaxes():
    text = _HLO_BOTH_ASYNC_SYNTAXES
    schedule = parse_schedule(text)
    assert schedule.module_name == "m"
    assert schedule.entry == "main"
    assert schedule.max_async_calls_in_flight == 2
    assert schedule.stream_ids == frozenset({1, 2})
    first = schedule.entry_schedule.events[0]
    assert (first.kind, first.called_computation, first.scheduling_group_id) == (
        "compute",
        "region",
        "1",
    )
    assert schedule.computation("async_computation").execution_thread == "parallel"
    loops = {loop.name: loop for loop in schedule.while_loops}
    assert loops["w"].known_trip_count == 7
    assert loops["w.2"].known_trip_count is None  # the host waits every iteration
    assert (loops["w"].body_kernels, loops["w"].condition_kernels) == (1, 1)


def test_parse_schedule_rejects_text_without_entry():
    with pytest.raises(ValueError, match="ENTRY"):
        parse_schedule("HloModule m\n")


def test_unknown_gpu_is_a_value_error():
    with pytest.raises(ValueError, match="gpu='a100'"):
        compile_for_gpu(jnp.sin, MATRIX, gpu="a100")
    with pytest.raises(ValueError, match="gpu="):
        gpu_target_config("v100")


def test_devices_below_one_is_a_value_error():
    with pytest.raises(ValueError, match="devices=0"):
        compile_for_gpu(jnp.sin, MATRIX, devices=0)
    with pytest.raises(ValueError, match="devices=-2"):
        make_gpu_mesh("h200", -2)


def test_targets_ship_with_the_package():
    assert set(GPU_TARGETS) == {"h100", "h200"}
    assert 'device_description_str: "NVIDIA H200"' in gpu_target_config("h200")
    assert "memory_bandwidth: 3350000000000" in gpu_target_config("H100")


def test_missing_plugin_names_the_pip_line(monkeypatch):
    import jaxpar._compiled.gpu_compile as deviceless

    real_version = importlib.metadata.version

    def no_plugin(name):
        if "cuda" in name:
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(deviceless.importlib.metadata, "version", no_plugin)
    ok, message = deviceless.plugin_status()
    jaxlib_version = real_version("jaxlib")
    assert not ok
    expected = (
        f"pip install --no-deps jax-cuda12-plugin=={jaxlib_version} "
        f"jax-cuda12-pjrt=={jaxlib_version}"
    )
    assert expected in message
    with pytest.raises(RuntimeError, match="pip install --no-deps"):
        deviceless.compile_for_gpu(jnp.sin, MATRIX)


def test_mismatched_plugin_is_reported(monkeypatch):
    import jaxpar._compiled.gpu_compile as deviceless

    real_version = importlib.metadata.version
    monkeypatch.setattr(
        deviceless.importlib.metadata,
        "version",
        lambda name: "0.0.1" if "cuda12" in name else real_version(name),
    )
    ok, message = deviceless.plugin_status()
    assert not ok
    assert "jax-cuda12-plugin==0.0.1" in message and "do not match" in message


@needs_plugin
def test_mesh_of_another_gpu_is_rejected():
    mesh = make_gpu_mesh("h200", 2)
    with pytest.raises(ValueError, match="gpu='h100'"):
        compile_for_gpu(jnp.sin, MATRIX, gpu="h100", mesh=mesh)
    with pytest.raises(ValueError, match="devices=4"):
        compile_for_gpu(jnp.sin, MATRIX, devices=4, mesh=mesh)


@needs_plugin
def test_host_callback_is_named_not_an_unknown_backend():
    # JAX lowers a host callback through a live GPU backend: deviceless, it said only
    # "Unknown backend: 'gpu' requested".
    def logged(a):
        jax.debug.callback(lambda v: None, a.sum())
        return a @ a

    with pytest.raises(RuntimeError, match=r"host callback \(jax.debug.print"):
        compile_for_gpu(logged, MATRIX)
    with pytest.raises(RuntimeError, match=r"host callback"):
        jaxpar.gpu_preview(logged, MATRIX)


def test_cpu_hlo_is_refused():
    from jaxpar._compiled.gpu_compile import _check_gpu_text

    cpu_text = jax.jit(lambda a: jnp.tanh(a @ a)).lower(MATRIX).compile().as_text()
    with pytest.raises(RuntimeError, match="CPU"):
        _check_gpu_text(cpu_text, ["cpu"])
    with pytest.raises(RuntimeError, match="CPU"):
        _check_gpu_text(cpu_text, [])
