"""``jaxpar._model.gpu``: one definition of every GPU figure and of the command-buffer modes,
``XLA_FLAGS`` read in one module, and calibration profiles (``benchmarks/calibrate.py``).

The first tests read jaxpar's source with ``ast``: a GPU figure (a number bound to a name
such as ``launch_s`` or ``peak_flops``, or any rate of a billion or more), a command-buffer
mode's name as a string, or an ``XLA_FLAGS`` access anywhere but in its one module fails
them; the scanners are themselves tested on stray constants.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers.benchmarks import load_benchmark
from helpers.environment import needs_plugin

import jaxpar
import jaxpar._compiled.estimate as _estimate
import jaxpar._compiled.gpu_compile as _gpu_compile
from jaxpar import _flags
from jaxpar._analysis import Analysis
from jaxpar._api import ParallelBranches
from jaxpar._model import gpu as _gpu_model
from jaxpar._model.gpu import GPU_PROFILES, CommandBufferMode, GpuProfileError, gpu_profile
from jaxpar._options import Options

PACKAGE = Path(jaxpar.__file__).resolve().parent
MODEL = "_model/gpu.py"
FLAGS = "_flags.py"

# Words that make a name a GPU figure's (split at underscores and case changes).
FIGURE_WORDS = frozenset({"launch", "latency", "bandwidth", "peak", "flops", "tflops", "sm",
                          "sms", "graph", "node", "floor", "sync", "event", "hbm", "clock"})
# The one place non-GPU device figures may stay (``_model.cost.DEVICE_PROFILES``).
NON_GPU_PROFILES = frozenset({"tpu", "cpu"})
MODE_NAMES = frozenset(m.value for m in CommandBufferMode) | frozenset(
    m.xla_scheduling_mode.lower() for m in CommandBufferMode if m.xla_scheduling_mode)


def _words(name: str) -> set[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return {w.lower() for w in re.split(r"[_\W]+", spaced) if w}


def _numbers(node: ast.AST) -> list[float]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, (int, float)) and not isinstance(n.value, bool)
            and n.value not in (0, 1)]


def _non_gpu_profile(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("DeviceProfile")
            and bool(node.args) and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in NON_GPU_PROFILES)


def figure_definitions(source: str) -> list[str]:
    """Numbers in ``source`` that define a GPU figure, as ``line: what``."""
    tree = ast.parse(source)
    allowed = {id(n) for call in ast.walk(tree) if _non_gpu_profile(call)
               for n in ast.walk(call)}
    found = []

    def bound(name: str, value: ast.AST | None, line: int) -> None:
        # "flops" alone counts work (2 per multiply-add), it is no rate.
        if value is not None and id(value) not in allowed and name != "flops" \
                and _words(name) & FIGURE_WORDS and _numbers(value):
            found.append(f"{line}: {name} = {ast.unparse(value)}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, (ast.Name, ast.Attribute)):
                        bound(leaf.id if isinstance(leaf, ast.Name) else leaf.attr,
                              node.value, node.lineno)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            bound(node.target.id, node.value, node.lineno)
        elif isinstance(node, ast.keyword) and node.arg:
            bound(node.arg, node.value, node.value.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            positional = [*arguments.posonlyargs, *arguments.args]
            pairs = [*zip(positional[len(positional) - len(arguments.defaults):],
                          arguments.defaults, strict=True),
                     *((a, d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults,
                                              strict=True) if d is not None)]
            for argument, default in pairs:
                bound(argument.arg, default, node.lineno)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    bound(key.value, value, value.lineno)
        if isinstance(node, ast.Constant) and isinstance(node.value, float) \
                and abs(node.value) >= 1e9 and id(node) not in allowed:
            found.append(f"{node.lineno}: a rate {node.value:g}")
    return sorted(set(found))


def mode_definitions(source: str) -> list[str]:
    """Command-buffer modes defined in ``source``: their names as strings, or an enum."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.lower() in MODE_NAMES:
            found.append(f"{node.lineno}: {node.value!r}")
        if isinstance(node, ast.ClassDef) and any("Enum" in ast.unparse(b) for b in node.bases):
            members = {t.id.lower() for s in node.body if isinstance(s, ast.Assign)
                       for t in s.targets if isinstance(t, ast.Name)}
            if members & MODE_NAMES:
                found.append(f"{node.lineno}: enum {node.name}")
    return found


def xla_flags_accesses(source: str) -> list[str]:
    """Reads or writes of ``XLA_FLAGS`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Subscript, ast.Call)):
            text = ast.unparse(node)
            if re.search(r"environ|getenv|putenv|unsetenv", text) and "XLA_FLAGS" in text:
                found.append(f"{node.lineno}: {text}")
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and node.value.value == "XLA_FLAGS":
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _sources(*skip: str) -> dict[str, str]:
    return {str(path.relative_to(PACKAGE.parent)): path.read_text()
            for path in sorted(PACKAGE.rglob("*.py"))
            if path.relative_to(PACKAGE).as_posix() not in skip}


def test_one_definition_of_every_gpu_figure() -> None:
    # The TPU's model and measured figures are its target's (jaxpar/targets/tpu_model.py,
    # jaxpar/targets/tpu.py).
    sources = _sources(MODEL, "targets/tpu_model.py", "targets/tpu.py")
    found = {name: hits for name, source in sources.items()
             if (hits := figure_definitions(source))}
    assert found == {}, "GPU figures belong in jaxpar/_model/gpu.py"


def test_one_definition_of_the_command_buffer_modes() -> None:
    found = {name: hits for name, source in _sources(MODEL).items()
             if (hits := mode_definitions(source))}
    assert found == {}, "use jaxpar._model.gpu.CommandBufferMode"


def test_xla_flags_is_read_and_written_in_one_module() -> None:
    found = {name: hits for name, source in _sources(FLAGS).items()
             if (hits := xla_flags_accesses(source))}
    assert found == {}, "read XLA_FLAGS through jaxpar._flags"
    assert xla_flags_accesses((PACKAGE / FLAGS).read_text())  # it is there, and found


@pytest.mark.parametrize("stray", [
    "LAUNCH_SECONDS = 5.0e-6\n",
    "class P:\n    graph_node_s: float = 0.6e-6\n",
    "profile = Profile('gpu', peak_flops=4.0e14)\n",
    "def price(x, launch_us=5.0):\n    return x\n",
    "FIGURES = {'bandwidth': 3.35e12}\n",
    "self.sm_count = 132\n",
    "TABLE = (('bf16', 989.5e12),)\n",
])
def test_the_figure_scanner_finds_a_stray_figure(stray: str) -> None:
    assert figure_definitions(stray)


def test_the_figure_scanner_allows_what_is_no_gpu_figure() -> None:
    assert figure_definitions(
        "x = DeviceProfile('cpu', peak_flops=1.0e11, bandwidth=2.0e10)\n"
        "launches = 0\nmin_seconds = 5e-6\nus = seconds * 1e6\n") == []
    assert figure_definitions("x = DeviceProfile('gpu', peak_flops=4.0e14)\n")


@pytest.mark.parametrize("stray", [
    "MODE_OFF = 'off'\n",
    "if mode == 'lhs':\n    pass\n",
    "FLAG = {'CONCURRENT': 1}\n",
    "import enum\nclass Graphs(enum.Enum):\n    LHS = 1\n    OFF = 2\n",
])
def test_the_mode_scanner_finds_a_stray_mode(stray: str) -> None:
    assert mode_definitions(stray)


@pytest.mark.parametrize("stray", [
    "import os\nflags = os.environ.get('XLA_FLAGS', '')\n",
    "import os\nos.environ['XLA_FLAGS'] = '--x'\n",
    "VARIABLE = 'XLA_FLAGS'\n",
])
def test_the_flags_scanner_finds_a_stray_access(stray: str) -> None:
    assert xla_flags_accesses(stray)


# --------------------------------------------------------------------------- the model


@pytest.mark.parametrize("name", sorted(_gpu_compile.GPU_TARGETS))
def test_the_compile_targets_agree_with_the_model(name: str) -> None:
    text = _gpu_compile.gpu_target_config(name)
    profile = GPU_PROFILES[name]
    assert f"core_count: {profile.sm_count}\n" in text
    assert f"memory_bandwidth: {round(profile.bandwidth)}\n" in text
    assert f'device_description_str: "{profile.device_kind}"' in text


def test_modes_parse_and_spell_as_xla_flags() -> None:
    assert CommandBufferMode.parse("concurrent") is CommandBufferMode.CONCURRENT
    with pytest.raises(ValueError, match=r"command_buffers='fast'.*'lhs', 'concurrent'"):
        CommandBufferMode.parse("fast")
    from jaxpar._flags import command_buffer_flags, command_buffer_mode
    for mode in CommandBufferMode:
        assert command_buffer_mode(" ".join(command_buffer_flags(mode))) is mode


def test_unknown_gpu_names_are_errors_and_device_kinds_are_not() -> None:
    with pytest.raises(ValueError, match="gpu='a100' has no profile"):
        gpu_profile("a100")
    assert gpu_profile("NVIDIA H200") == GPU_PROFILES["h200"]
    other = gpu_profile("NVIDIA A100-SXM4-80GB")  # starts from the generic figures
    assert dataclasses.replace(other, name="gpu", device_kind="") == GPU_PROFILES["gpu"]


def test_the_planner_prices_with_the_gpu_it_is_given() -> None:
    def two_chains(a, wa, b, wb):
        return jnp.tanh(jnp.tanh(a @ wa) @ wa), jnp.sin(jnp.sin(b @ wb) @ wb)

    args = [jax.ShapeDtypeStruct((1024, 1024), jnp.float32)] * 4
    slow_host = dataclasses.replace(GPU_PROFILES["h200"], launch_s=100e-6)
    settings = Options().resolve("gpu", command_buffers="off", gpu=slow_host)
    assert Analysis(settings).costs.profile.gpu is slow_host
    sections = {}
    for name, profile in (("h200", GPU_PROFILES["h200"]), ("slow host", slow_host)):
        # (The sections' regions keep their temporaries side by side: more memory than
        # the default budget allows. The pricing is what is checked here.)
        fn = ParallelBranches(two_chains, Options.create(target="gpu", memory="any"),
                              command_buffers=CommandBufferMode.OFF, gpu=profile)
        sections[name] = len(jaxpar.inspect(fn)(*args).sections)
    # Launched one by one from one host thread, slow launches leave nothing to overlap.
    assert sections == {"h200": 1, "slow host": 0}


# --------------------------------------------------------------------------- calibration

calibrate = load_benchmark("calibrate")
KIND = GPU_PROFILES["h200"].device_kind


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(_gpu_model.PROFILE_DIR_VARIABLE, str(tmp_path))
    return tmp_path


HOST_FIGURES = ("launch_s", "graph_floor_s", "chain_node_s", "dag_node_s", "graph_launch_s")


def _assert_measured(loaded: _gpu_model.GpuProfile, figures: dict) -> None:
    """Every figure of a calibration file is in the loaded profile, finite; those with a
    built-in range are marked measured and their range narrowed around the value."""
    ranged = {name for name, _, _ in GPU_PROFILES["h200"].ranges}
    for name, value in figures.items():
        if name == "tensor_flops":
            for element_type, flops in value.items():
                assert loaded.dot_flops(element_type) == flops > 0
            continue
        assert getattr(loaded, name) == value and math.isfinite(value), name
        if name in ranged:
            assert name in loaded.measured, name
            assert loaded.span(name) == pytest.approx(
                (value * (1 - _gpu_model.MEASURED_SPREAD),
                 value * (1 + _gpu_model.MEASURED_SPREAD))), name
    assert loaded.measured == frozenset(figures) & ranged


def test_calibration_writes_a_profile_the_model_loads(profile_dir: Path, tmp_path: Path
                                                      ) -> None:
    text = _estimate_text()
    before = _estimate.estimate_hlo(text, gpu="h200")
    dump = tmp_path / "dump"
    out = calibrate.main(["--dry-run", "--repeats", "1", "--device-kind", KIND,
                          "--dump-dir", str(dump), "--out", str(_gpu_model.profile_path(KIND))])
    assert out == profile_dir / "nvidia_h200.json"
    document = json.loads(out.read_text())
    assert document["version"] == _gpu_model.PROFILE_VERSION
    assert document["device_kind"] == KIND
    measurements = document["measurements"]
    assert measurements["stages_done"] == ["floors and launches", "concurrency", "throughput"]
    # Only what was measured is written: each host figure is a figure or, lost in the
    # CPU's noise, an unresolved measurement; nothing else of the built-in profile.
    figures = document["figures"]
    floors = measurements["floors"]
    for name in HOST_FIGURES:
        assert (name in figures) != (name in floors["unresolved"]), name
    assert set(figures) <= set(HOST_FIGURES) | {"bandwidth", "tensor_flops", "sm_count"}
    assert set(figures["tensor_flops"]) == {"f32", "bf16", "f16"}
    for kind in ("elementwise", "gemm"):
        modes = measurements["concurrency"][kind]["modes"]
        assert set(modes) == {"lhs", "concurrent", "concurrent_regions"}
        assert modes["lhs"]["ratio_to_lhs"]["depth1_blocked_s"] == 1.0
    # The graph-mode programs were compiled with XLA's dumps on (the CPU writes no thunk
    # sequence, XLA:GPU does: test_calibration_programs_compile_to_the_graphs_meant).
    assert {p.name for p in dump.iterdir()} >= {"chain6-lhs", "fanout6-concurrent",
                                                "gemm8x2-concurrent_regions"}
    assert set(measurements["graphs"]) >= {"chain6-lhs", "elementwise8x2-concurrent"}

    loaded = gpu_profile("h200")
    assert loaded.source == str(out) and loaded.name == "h200"
    _assert_measured(loaded, figures)
    built_in = GPU_PROFILES["h200"]
    assert loaded.dot_flops("f64") == built_in.dot_flops("f64")  # not measured: kept
    assert loaded.sync_s == built_in.sync_s and "sync_s" not in loaded.measured
    # What the model returns changes what jaxpar estimates (here: a CPU's figures).
    after = _estimate.estimate_hlo(text, gpu="h200")
    assert after.seconds != before.seconds and after.launches == before.launches
    assert Options().resolve("gpu", gpu=KIND).gpu == loaded


class _LinearTimer:
    """Times the calibration programs by a known model of the GPU, so that the figures
    ``floors_and_launches`` derives can be checked exactly."""

    dispatch, host_launch, kernel_floor = 10e-6, 2.5e-6, 1.5e-6
    graph_launch, chain_node, dag_node, graph_floor = 4e-6, 0.1e-6, 0.6e-6, 1.2e-6

    def __init__(self) -> None:
        self.sizes = calibrate.DRY_RUN_SIZES
        self.graphs: dict = {}

    def run(self, program, mode: CommandBufferMode, dump: bool = False) -> dict:
        kernels = program.kernels
        if mode is CommandBufferMode.OFF:
            returned = self.dispatch + kernels * self.host_launch
            device = kernels * max(self.host_launch, self.kernel_floor)
            blocked = self.dispatch + device
        else:
            returned = self.dispatch + self.graph_launch + kernels * (
                self.dag_node if mode.branching else self.chain_node)
            blocked = returned + kernels * self.graph_floor
        return {"program": program.name, "mode": mode.value, "kernels": kernels,
                "hlo_kernels": kernels, "return_s": returned, "blocked_s": blocked,
                "pipelined_s": blocked}


def test_the_figures_derived_from_the_timings(profile_dir: Path) -> None:
    timer = _LinearTimer()
    figures, measurements = calibrate.floors_and_launches(timer)
    assert figures == pytest.approx({
        "launch_s": timer.host_launch, "graph_floor_s": timer.graph_floor,
        "chain_node_s": timer.chain_node, "dag_node_s": timer.dag_node,
        "graph_launch_s": timer.graph_launch})
    assert measurements["launch_host_s"] == pytest.approx(timer.host_launch)
    assert measurements["kernel_floor_upper_bound_s"] == figures["launch_s"]
    assert not measurements["unresolved"]
    # Written and loaded back: exactly these are measured, their ranges narrowed.
    document = calibrate.document(GPU_PROFILES["h200"], KIND, figures, measurements)
    assert document["figures"] == figures
    _write(profile_dir, document)
    _assert_measured(gpu_profile("h200"), figures)


def test_a_figure_lost_in_noise_is_left_out(profile_dir: Path) -> None:
    timer = _LinearTimer()
    timer.chain_node = -0.05e-6  # the chain's return time falls with its length: noise
    figures, measurements = calibrate.floors_and_launches(timer)
    assert "chain_node_s" not in figures and "chain_node_s" in measurements["unresolved"]
    # graph_floor_s then takes the blocked slope whole (no host share to subtract).
    assert figures["graph_floor_s"] == pytest.approx(timer.graph_floor + timer.chain_node)
    _write(profile_dir, calibrate.document(GPU_PROFILES["h200"], KIND, figures, measurements))
    loaded = gpu_profile("h200")
    _assert_measured(loaded, figures)
    assert loaded.chain_node_s == GPU_PROFILES["h200"].chain_node_s
    assert loaded.span("chain_node_s") == GPU_PROFILES["h200"].span("chain_node_s")


def test_a_dry_run_must_not_write_where_jaxpar_looks(profile_dir: Path) -> None:
    for argv in (["--dry-run", "--device-kind", KIND],
                 ["--dry-run", "--device-kind", KIND, "--install", "--out",
                  str(profile_dir / "elsewhere.json")]):
        with pytest.raises(SystemExit):
            calibrate.main(argv)
    assert not list(profile_dir.iterdir())


@needs_plugin
def test_calibration_programs_compile_to_the_graphs_meant(tmp_path: Path) -> None:
    """Compiled deviceless for an H200 as calibrate.py compiles them (carry donated, the
    mode a compile option): one kernel per step, no copies, one CUDA graph holding them
    all, its independent kernels printed as parallel sources where buffers allow."""
    mesh = _gpu_compile.make_gpu_mesh("h200", 1)
    cases = [(calibrate.chain(6), "lhs", 1), (calibrate.fan_out(6), "concurrent", 6),
             (calibrate.gemms(8, 2, 64), "concurrent", 8),
             (calibrate.elementwise(8, 2, 8), "concurrent_regions", 8)]
    for program, mode, sources in cases:
        args = jax.tree_util.tree_map(
            lambda a: _gpu_compile._place_leaf(jax.ShapeDtypeStruct(a.shape, a.dtype), mesh),
            (program.carry, *program.constants))
        directory = tmp_path / f"{program.name}-{mode}"
        options = {**_flags.command_buffer_options(mode), "xla_dump_to": str(directory)}
        text = jax.jit(program.fn, donate_argnums=0).trace(*args).lower().compile(
            compiler_options=options).as_text()
        assert calibrate._kernels(text) == program.kernels, program.name
        assert " copy(" not in text, program.name
        shape = calibrate.graph_shapes(directory)
        assert shape["command_buffers"] == [{"nodes": program.kernels, "sources": sources}], \
            (program.name, shape)


def _write(profile_dir: Path, document: object) -> Path:
    path = _gpu_model.profile_path(KIND)
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    assert path.parent == profile_dir
    return path


def _document(**figures: object) -> dict:
    return {**_gpu_model.profile_document(GPU_PROFILES["h200"]), "figures": figures}


@pytest.mark.parametrize(("document", "message"), [
    ("{not json", "not a readable JSON"),
    ({"format": "other"}, "not a jaxpar-gpu-profile version 2"),
    ({**_document(), "device_kind": "NVIDIA H100 80GB HBM3"}, "measured on 'NVIDIA H100"),
    (_document(launch_us=3.0), r"unknown figures \['launch_us'\]"),
    (_document(launch_s=-1.0), "'launch_s' must be a finite number > 0"),
    (_document(tensor_flops={"bf16": "fast"}), "'tensor_flops.bf16' must be"),
    (_document(tensor_flops=[1.0]), "'tensor_flops' must be an object"),
])
def test_a_malformed_profile_is_a_clear_error(profile_dir: Path, document: object,
                                              message: str) -> None:
    path = _write(profile_dir, document)
    with pytest.raises(GpuProfileError, match=message) as raised:
        gpu_profile("h200")
    assert str(path) in str(raised.value)


def test_a_rewritten_profile_is_read_again(profile_dir: Path) -> None:
    _write(profile_dir, _document(launch_s=3e-6))
    assert gpu_profile("h200").launch_s == 3e-6
    path = _write(profile_dir, _document(launch_s=4e-6, sm_count=100))
    path.touch()
    assert gpu_profile("h200").launch_s == 4e-6 and gpu_profile("h200").sm_count == 100


def _estimate_text() -> str:
    return """HloModule m, is_scheduled=true

%fused (p0: f32[1024,1024]) -> f32[1024,1024] {
  %p0 = f32[1024,1024]{1,0} parameter(0)
  ROOT %t = f32[1024,1024]{1,0} tanh(%p0)
}

ENTRY %main (a: f32[1024,1024]) -> f32[1024,1024] {
  %a = f32[1024,1024]{1,0} parameter(0)
  %f1 = f32[1024,1024]{1,0} fusion(%a), kind=kLoop, calls=%fused
  ROOT %f2 = f32[1024,1024]{1,0} fusion(%f1), kind=kLoop, calls=%fused
}
"""
