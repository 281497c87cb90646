"""Calibrate jaxpar's GPU model on this machine's GPU and write the profile jaxpar loads.

Measures, through XLA on ``jax.devices()[0]``, first the four quantities that decide most
plans (``docs/gpu_evidence.md``, section 5), then the older throughput figures. Every
program is compiled by ``jax.jit(fn, compiler_options=command_buffer_options(mode))``
(``jaxpar._flags``), so each executable has its own CUDA-graph mode whatever ``XLA_FLAGS``
says; its kernel count is checked in the compiled HLO. Each program is timed three ways,
its carry donated (the output reuses the input's buffer, so a CUDA graph's addresses stay
put between calls and nothing is re-recorded):

* *return*: median of single calls, from the call to its return without blocking
  (dispatch is asynchronous: this is the host's enqueue, CUDA-graph launches included);
* *blocked*: median of calls until ``block_until_ready`` (host, device and the wait);
* *pipelined*: calls queued back to back, then one wait, per call (the larger of the
  host's and the device's time per call).

Figures are slopes between two sizes (``(t1 - t0) / (k1 - k0)`` over kernel counts), so the
fixed cost of a call (Python, JAX's and PJRT's dispatch) cancels:

1. ``graph_floor_s``: a chain of N (10 and 50) dependent tiny kernels (an optimization
   barrier between them keeps each a kernel of its own) captured as one CUDA graph
   (``lhs`` mode): the blocked slope, less the host's return slope per node
   (``chain_node_s``): device time of one dependent node inside a graph.
2. ``launch_s``: the same chain with graphs ``off``: the blocked slope, i.e. ``max(host
   launch, device floor of a kernel launched alone)``; it bounds ``kernel_floor_s`` from
   above (recorded as ``kernel_floor_upper_bound_s``; ``kernel_floor_s`` itself is not
   measured). The return slope, the host's share alone, is recorded as ``launch_host_s``.
3. Host cost of a graph launch, a 50-node chain against a 50-node fan-out (50
   independent tiny kernels joined by one), each in ``lhs`` and ``concurrent`` mode:
   ``chain_node_s`` is the return slope of the chain in ``lhs`` mode, ``dag_node_s`` that
   of the fan-out in ``concurrent`` mode, ``graph_launch_s`` the chain's return time
   extrapolated to zero nodes less that of a one-kernel program (launched alone, no
   graph) plus one host launch (``launch_host_s``).
4. Eight independent small elementwise fusions (eight chains on 64x64 float32, one and
   four kernels deep) and eight independent 1024^3 bf16 GEMMs (one and four deep), each
   in ``lhs``, ``concurrent`` and ``concurrent_regions`` mode: times, ratios to ``lhs``
   and XLA's temporary bytes (``memory_analysis()``) in ``measurements["concurrency"]``.
   Evidence for the model (how much independent kernels overlap in each mode, at what
   memory), not profile figures.
5. ``bandwidth`` (an elementwise copy at two sizes), ``tensor_flops`` (square matmuls:
   ``f32`` at JAX's default precision, TF32 on Hopper, ``bf16``, ``f16``; ``f32`` at
   ``HIGHEST`` in the measurements only) and ``sm_count`` where the device reports it.
   Skipped when the run has used ``--budget`` seconds by then.

Only the figures measured go into the profile's ``figures`` (a figure whose slope is lost
in noise is left out, with a warning and a note in ``measurements``), so ``gpu_profile``
marks exactly those ``measured`` and narrows their ranges; every other figure keeps
jaxpar's built-in value and range. The profile is written after each stage, so a run
cut short keeps what it measured. With ``--dump-dir DIR`` the graph-mode programs of
stages 1-4 (larger size) are compiled with ``xla_dump_to=DIR/<program>-<mode>``; XLA's
``*thunk_sequence_after_thunk_passes.txt`` there shows the CUDA graphs it formed, and a
summary (per command buffer: its nodes, and its source nodes as the dump prints them)
goes into ``measurements["graphs"]``. XLA writes that file when it builds the
executable, also in a deviceless compile (``tests/test_model_gpu.py`` checks the
programs' graphs that way).

Run::

    python benchmarks/calibrate.py [--out PATH] [--install] [--dump-dir DIR]
    JAX_PLATFORMS=cpu python benchmarks/calibrate.py --dry-run --device-kind "NVIDIA H200" \\
        --out /tmp/h200.json      # tiny sizes on the CPU: checks the script, not the GPU

The profile goes to ``--out`` (default, and with ``--install`` as well: where jaxpar
looks for this device kind, ``$JAXPAR_PROFILE_DIR/<device kind>.json``, default
``~/.cache/jaxpar/profiles``; ``_model.gpu.gpu_profile`` loads it). The sizes are meant
to take about two minutes on an H200, most of it compiling (not yet run on one; the dry
run takes seconds).

Sharp edges:
  * Host figures come from wall time in Python: JAX's dispatch is in every call, and
    only the slopes over node counts cancel it. If the GPU client launches on a thread
    of its own (not the default PJRT client), the return slopes miss the launch: compare
    ``pipelined_s``, which counts it either way.
  * The blocked slope of a graph counts the device and any host cost per node; the
    return slope is subtracted as the host's share, which assumes the device starts the
    graph only once its launch returns.
  * Timing alone cannot tell a host launch from the device's shortest kernel outside
    graphs: ``launch_s`` is the larger of the two.
  * The mode of each executable is a compile option. Whether XLA formed the graphs meant
    (one graph per program, every kernel a node) is for the thunk dumps to show
    (``--dump-dir``). The edges the dump prints between a graph's thunks come from buffer
    conflicts; in ``lhs`` and ``concurrent_regions`` mode the executor adds its own order
    when it builds the graph (``xla/backends/gpu/runtime/command_executor.cc``), which
    the dump seems not to show (inferred: on deviceless jaxlib 0.10.2 compiles eight
    independent GEMMs print as eight source nodes in every mode). So ``sources`` says
    which kernels *could* overlap, the timings say whether they did.
  * Without a GPU (or with ``--dry-run``) the sizes are tiny and the figures are the
    CPU's; such a profile is only for checking this script, and it is never written
    where jaxpar looks unless ``--out`` says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax
import jax.numpy as jnp
from jax import lax

import jaxpar._compiled.schedule as _schedule
from jaxpar import _flags
from jaxpar._model import gpu as _gpu_model
from jaxpar._model.gpu import CommandBufferMode

LHS, CONCURRENT, REGIONS, OFF = (CommandBufferMode.LHS, CommandBufferMode.CONCURRENT,
                                 CommandBufferMode.CONCURRENT_REGIONS, CommandBufferMode.OFF)
CONCURRENCY_MODES = (LHS, CONCURRENT, REGIONS)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What to run: every figure is a slope between the two sizes of its pair."""

    nodes: tuple[int, int] = (10, 50)  # kernels of a chain, independent kernels of a fan-out
    calls: int = 200  # single calls per return-time median
    repeats: int = 30  # calls per blocked median
    queued: int = 100  # calls queued back to back per pipelined sample (5 samples)
    warmup: int = 10
    width: int = 8  # independent chains of the concurrency programs
    depths: tuple[int, int] = (1, 4)  # kernels per chain
    side: int = 64  # side x side float32 per elementwise chain
    gemm: int = 1024  # n of the n x n x n bf16 GEMMs
    elements: tuple[int, int] = (1 << 24, 1 << 26)  # float32 elements copied
    matmul: int = 8192  # n of the n x n matmuls
    matmuls: tuple[int, int] = (2, 6)  # matmuls per call
    matmul_repeats: int = 10


GPU_SIZES = Sizes()
DRY_RUN_SIZES = Sizes(nodes=(3, 6), calls=5, repeats=3, queued=3, warmup=1, side=8, gemm=16,
                      depths=(1, 2), elements=(1 << 10, 1 << 12), matmul=32, matmul_repeats=2)
MATMUL_TYPES = {"f32": (jnp.float32, None), "f32_highest": (jnp.float32, "highest"),
                "bf16": (jnp.bfloat16, None), "f16": (jnp.float16, None)}
THUNK_FILE = "thunk_sequence_after_thunk_passes.txt"
# Seconds of the run after which the throughput stage (5) is skipped.
DEFAULT_BUDGET_S = 200.0


# --------------------------------------------------------------------------- programs
# Each is ``fn(carry, *constants) -> carry`` (the carry donated) with its arguments and
# the kernels a GPU compile should hold; the arithmetic has a fixed point, so values
# stay finite over thousands of calls.


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    fn: Callable[..., Any]
    carry: Any
    constants: tuple[Any, ...]
    kernels: int  # on a GPU: one per barrier-separated step


def _step(x: jax.Array) -> jax.Array:
    return lax.optimization_barrier(x * 0.5 + 0.25)


def chain(n: int) -> Program:
    """``n`` dependent tiny kernels."""
    def fn(x: jax.Array) -> jax.Array:
        for _ in range(n):
            x = _step(x)
        return x
    return Program(f"chain{n}", fn, jnp.ones((1,), jnp.float32), (), n)


def fan_out(n: int) -> Program:
    """``n`` independent tiny kernels of one input, joined by one more."""
    def fn(x: jax.Array) -> jax.Array:
        branches = lax.optimization_barrier([x * (0.5 + 1e-3 * i) + 0.25 for i in range(n)])
        return sum(branches[1:], branches[0]) / n
    return Program(f"fanout{n}", fn, jnp.ones((1,), jnp.float32), (), n + 1)


def elementwise(width: int, depth: int, side: int) -> Program:
    """``width`` independent chains of ``depth`` small elementwise kernels."""
    def fn(xs: list[jax.Array]) -> list[jax.Array]:
        out = []
        for x in xs:
            for _ in range(depth):
                x = lax.optimization_barrier(jnp.tanh(x) * 0.5 + 0.25)
            out.append(x)
        return out
    carry = [jnp.full((side, side), 0.1 * (i + 1), jnp.float32) for i in range(width)]
    return Program(f"elementwise{width}x{depth}", fn, carry, (), width * depth)


def gemms(width: int, depth: int, n: int) -> Program:
    """``width`` independent chains of ``depth`` n^3 bf16 GEMMs (by identity matrices: the
    values stay put, the tensor cores do the full work). Each chain has its own matrix:
    XLA's DotMerger would merge independent dots that share an operand into one."""
    def fn(carry: tuple[list[jax.Array], list[jax.Array]], eyes: list[jax.Array]
           ) -> tuple[list[jax.Array], list[jax.Array]]:
        xs, _ = carry
        out = []
        for x, eye in zip(xs, eyes, strict=True):
            for _ in range(depth):
                x = jnp.matmul(x, eye)
            out.append(x)
        # A GEMM cannot write over its own input: the result goes to a second donated
        # buffer (else XLA adds a copy after each one-GEMM chain), the input passes through.
        return xs, out
    keys = jax.random.split(jax.random.key(0), width)
    xs = [jax.random.normal(key, (n, n), jnp.float32).astype(jnp.bfloat16) for key in keys]
    eyes = [jnp.eye(n, dtype=jnp.bfloat16) for _ in range(width)]
    return Program(f"gemm{width}x{depth}", fn, (xs, [x + 0 for x in xs]), (eyes,),
                   width * depth)


# --------------------------------------------------------------------------- timing


def median_seconds(compiled: Callable[..., Any], args: Sequence[Any], repeats: int) -> float:
    """Median wall time of ``compiled(*args)`` until its result is ready (one warm-up)."""
    jax.block_until_ready(compiled(*args))
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def slope(timed: Sequence[float], work: Sequence[float], name: str) -> dict[str, Any]:
    """Seconds per unit of work between two sizes: ``(t1 - t0) / (w1 - w0)``.

    Where noise hides the difference (a slope <= 0) it falls back to ``t1 / w1``, an upper
    bound that still counts the fixed cost of a call, and says so (``method``).
    """
    per_unit = (timed[1] - timed[0]) / (work[1] - work[0])
    if per_unit > 0:
        return {"per_unit": per_unit, "method": "slope"}
    print(f"warning: {name}: the two sizes took {timed[0]:.3g} s and {timed[1]:.3g} s, "
          "within noise; using the larger size's ratio (an upper bound)", file=sys.stderr)
    return {"per_unit": timed[1] / work[1], "method": "ratio (slope within noise)"}


def _kernels(text: str) -> int:
    return _schedule.parse_schedule(text).kernels


def graph_shapes(directory: Path) -> dict[str, Any]:
    """The CUDA graphs XLA formed, from the last ``*thunk_sequence_after_thunk_passes.txt``
    under ``directory`` (of a ``jit_`` module where there is one, not of a module XLA's
    autotuner compiled): per command buffer its nodes and source nodes (1: a chain)."""
    files = sorted(directory.glob(f"*{THUNK_FILE}"))
    files = [f for f in files if ".jit_" in f.name] or files
    if not files:
        return {"file": None, "note": "no thunk sequence dumped (XLA:GPU writes it)"}
    buffers: list[dict[str, int]] = []
    top_level = 0
    for line in files[-1].read_text().splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            top_level += 1
            if "kCommandBuffer" in line:
                buffers.append({"nodes": 0, "sources": 0})
        elif buffers:
            buffers[-1]["nodes"] += 1
            buffers[-1]["sources"] += "[source" in line
    return {"file": str(files[-1]), "thunks": top_level, "command_buffers": buffers}


@dataclasses.dataclass
class Timer:
    """Compiles and times programs: return, blocked and pipelined time per call."""

    sizes: Sizes
    dump_dir: Path | None = None
    on_gpu: bool = False
    graphs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def compile(self, program: Program, mode: CommandBufferMode, dump: bool = False
                ) -> tuple[Any, int, int | None]:
        options = dict(_flags.command_buffer_options(mode))
        directory = None
        if dump and self.dump_dir is not None and mode is not OFF:
            directory = self.dump_dir / f"{program.name}-{mode.value}"
            options["xla_dump_to"] = str(directory)
        compiled = jax.jit(program.fn, donate_argnums=0, compiler_options=options).lower(
            program.carry, *program.constants).compile()
        kernels = _kernels(compiled.as_text() or "")
        if self.on_gpu and kernels != program.kernels:
            print(f"warning: {program.name} ({mode.value}): XLA compiled {kernels} kernels, "
                  f"not {program.kernels}; the slopes use its count", file=sys.stderr)
        if directory is not None:
            self.graphs[f"{program.name}-{mode.value}"] = graph_shapes(directory)
        # CONCURRENT packs no independent temporaries together: more memory.
        try:
            analysis = compiled.memory_analysis()
        except Exception:  # not every backend or jaxlib reports it
            analysis = None
        temp_bytes = None if analysis is None else int(analysis.temp_size_in_bytes)
        return compiled, kernels, temp_bytes

    def run(self, program: Program, mode: CommandBufferMode, dump: bool = False
            ) -> dict[str, Any]:
        compiled, kernels, temp_bytes = self.compile(program, mode, dump)
        # The CPU does not fuse like a GPU (it fuses the chains whole): there the
        # program's own count stands in.
        counted = kernels if self.on_gpu else program.kernels
        carry = jax.device_put(program.carry)
        constants = jax.device_put(program.constants)
        sizes = self.sizes

        def call(carry: Any) -> Any:
            return compiled(carry, *constants)

        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(sizes.warmup):
                carry = call(carry)
            jax.block_until_ready(carry)
            returned = []
            for _ in range(sizes.calls):
                started = time.perf_counter()
                carry = call(carry)
                returned.append(time.perf_counter() - started)
                jax.block_until_ready(carry)
            blocked = []
            for _ in range(sizes.repeats):
                started = time.perf_counter()
                carry = jax.block_until_ready(call(carry))
                blocked.append(time.perf_counter() - started)
            pipelined = []
            for _ in range(5):
                started = time.perf_counter()
                for _ in range(sizes.queued):
                    carry = call(carry)
                jax.block_until_ready(carry)
                pipelined.append((time.perf_counter() - started) / sizes.queued)
        finally:
            if gc_was_enabled:
                gc.enable()
        return {"program": program.name, "mode": mode.value, "kernels": counted,
                "hlo_kernels": kernels, "temp_bytes": temp_bytes,
                "return_s": statistics.median(returned),
                "blocked_s": statistics.median(blocked),
                "pipelined_s": statistics.median(pipelined)}


def fit(small: dict[str, Any], large: dict[str, Any], key: str) -> dict[str, float]:
    """Seconds per kernel between two programs and the time extrapolated to none."""
    per_kernel = (large[key] - small[key]) / (large["kernels"] - small["kernels"])
    return {"per_kernel_s": per_kernel, "at_zero_s": small[key] - small["kernels"] * per_kernel}


# --------------------------------------------------------------------------- stages


def floors_and_launches(timer: Timer) -> tuple[dict[str, float], dict[str, Any]]:
    """Stages 1-3: the in-graph floor, launches outside graphs, graph launch costs.

    Returns the figures it resolved and everything it timed."""
    lo, hi = timer.sizes.nodes
    runs: dict[str, dict[str, Any]] = {}
    for mode in (LHS, OFF, CONCURRENT):
        for n in (lo, hi):
            runs[f"chain{n}-{mode.value}"] = timer.run(chain(n), mode, dump=n == hi)
    for mode in (LHS, CONCURRENT):
        for n in (lo, hi):
            runs[f"fanout{n}-{mode.value}"] = timer.run(fan_out(n), mode, dump=n == hi)
    runs["one-off"] = timer.run(chain(1), OFF)

    def fitted(program: str, mode: CommandBufferMode, key: str) -> dict[str, float]:
        return fit(runs[f"{program}{lo}-{mode.value}"], runs[f"{program}{hi}-{mode.value}"], key)

    fits = {f"{program}-{mode.value}-{key}": fitted(program, mode, f"{key}_s")
            for program, modes in (("chain", (LHS, OFF, CONCURRENT)),
                                   ("fanout", (LHS, CONCURRENT)))
            for mode in modes for key in ("return", "blocked", "pipelined")}
    launch_host = fits["chain-off-return"]["per_kernel_s"]
    launch = fits["chain-off-blocked"]["per_kernel_s"]
    chain_node = fits["chain-lhs-return"]["per_kernel_s"]
    dag_node = fits["fanout-concurrent-return"]["per_kernel_s"]
    in_graph = fits["chain-lhs-blocked"]["per_kernel_s"]
    # One kernel launched alone costs the same dispatch plus one host launch; take the
    # host's share from the return slope outside graphs (or the blocked one, its bound).
    one_launch = launch_host if launch_host > 0 else launch
    graph_launch = (fits["chain-lhs-return"]["at_zero_s"] - runs["one-off"]["return_s"]
                    + one_launch)
    graph_floor = in_graph - max(chain_node, 0.0)
    derived = {"launch_s": launch, "graph_floor_s": graph_floor, "chain_node_s": chain_node,
               "dag_node_s": dag_node, "graph_launch_s": graph_launch}
    figures, unresolved = {}, {}
    for name, value in derived.items():
        if value > 0 and math.isfinite(value):
            figures[name] = value
        else:
            unresolved[name] = value
            print(f"warning: {name} came out {value * 1e6:.3g} us (lost in noise); not "
                  "recorded as measured, jaxpar keeps its built-in figure", file=sys.stderr)
    measurements = {
        "runs": runs, "fits": fits, "derived": derived, "unresolved": unresolved,
        "launch_host_s": launch_host, "kernel_floor_upper_bound_s": launch,
        "in_graph_blocked_slope_s": in_graph,
        "graph_launch_by_intercepts_s": (fits["chain-lhs-return"]["at_zero_s"]
                                         - fits["chain-off-return"]["at_zero_s"]),
        "method": {
            "launch_s": "blocked slope of the chain, graphs off: max(host launch, "
                        "kernel floor); bounds kernel_floor_s from above",
            "graph_floor_s": "blocked slope of the chain in lhs mode less chain_node_s",
            "chain_node_s": "return slope of the chain in lhs mode",
            "dag_node_s": "return slope of the fan-out in concurrent mode",
            "graph_launch_s": "the chain's return time (lhs) at zero nodes, less the "
                              "one-kernel program's, plus one host launch (launch_host_s)"}}
    return figures, measurements


def concurrency(timer: Timer) -> dict[str, Any]:
    """Stage 4: eight independent elementwise chains and eight independent GEMM chains,
    one and more kernels deep, in each graph mode; ratios to ``lhs``."""
    sizes = timer.sizes
    builders = {"elementwise": lambda depth: elementwise(sizes.width, depth, sizes.side),
                "gemm": lambda depth: gemms(sizes.width, depth, sizes.gemm)}
    result: dict[str, Any] = {}
    for kind, build in builders.items():
        by_mode: dict[str, Any] = {}
        for mode in CONCURRENCY_MODES:
            runs = [timer.run(build(depth), mode, dump=depth == sizes.depths[1])
                    for depth in sizes.depths]
            per_level = {key: (runs[1][key] - runs[0][key]) / (sizes.depths[1] - sizes.depths[0])
                         for key in ("blocked_s", "pipelined_s")}
            by_mode[mode.value] = {"runs": runs, "per_level": per_level}
        base = by_mode[LHS.value]
        for entry in by_mode.values():
            entry["ratio_to_lhs"] = {
                f"depth{depth}_{key}": entry["runs"][i][key] / base["runs"][i][key]
                for i, depth in enumerate(sizes.depths) for key in ("blocked_s", "pipelined_s")}
            entry["ratio_to_lhs"]["per_level_blocked_s"] = (
                entry["per_level"]["blocked_s"] / base["per_level"]["blocked_s"]
                if base["per_level"]["blocked_s"] > 0 else None)
        result[kind] = {"width": sizes.width, "depths": list(sizes.depths),
                        "size": sizes.side if kind == "elementwise" else sizes.gemm,
                        "dtype": "float32" if kind == "elementwise" else "bfloat16",
                        "modes": by_mode}
    return result


def copy_bandwidth(sizes: Sizes) -> dict[str, Any]:
    """Bytes/s of an elementwise copy (each element read and written once)."""
    timed = []
    copy = jax.jit(lambda a: a * 2.0 + 1.0)
    for n in sizes.elements:
        timed.append(median_seconds(copy, (jnp.ones((n,), jnp.float32),), sizes.repeats))
    found = slope(timed, [2 * 4 * n for n in sizes.elements], "copy")
    return {"bytes_per_s": 1.0 / found["per_unit"], "method": found["method"],
            "medians_s": timed, "elements": list(sizes.elements)}


def matmul_flops(sizes: Sizes, dtype: Any, precision: str | None) -> dict[str, Any]:
    """Flop/s of square matmuls of ``dtype`` (a chain, so nothing is computed twice)."""
    n = sizes.matmul
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (n, n), jnp.float32).astype(dtype)
    b = (jax.random.normal(key_b, (n, n), jnp.float32) / n**0.5).astype(dtype)
    timed = []
    for count in sizes.matmuls:
        def matmuls(a: jax.Array, b: jax.Array, count: int = count) -> jax.Array:
            return lax.fori_loop(0, count, lambda _, c: jnp.matmul(c, b, precision=precision),
                                 a)
        timed.append(median_seconds(jax.jit(matmuls), (a, b), sizes.matmul_repeats))
    found = slope(timed, [2.0 * n**3 * count for count in sizes.matmuls],
                  f"matmul {jnp.dtype(dtype).name} {precision or 'default'}")
    return {"flops_per_s": 1.0 / found["per_unit"], "method": found["method"],
            "medians_s": timed, "n": n, "precision": precision or "default"}


def throughput(sizes: Sizes, base: _gpu_model.GpuProfile
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stage 5: copy bandwidth, matmul peaks by type, SM count."""
    bandwidth = copy_bandwidth(sizes)
    matmuls = {name: matmul_flops(sizes, dtype, precision)
               for name, (dtype, precision) in MATMUL_TYPES.items()}
    known = dict(base.tensor_flops)
    figures: dict[str, Any] = {
        "bandwidth": bandwidth["bytes_per_s"],
        "tensor_flops": {name: m["flops_per_s"] for name, m in matmuls.items() if name in known}}
    sm_count = getattr(jax.devices()[0], "core_count", None)
    if isinstance(sm_count, int) and sm_count > 0:
        figures["sm_count"] = sm_count
    return figures, {"bandwidth": bandwidth, "matmuls": matmuls}


# --------------------------------------------------------------------------- profile


def profile_of(base: _gpu_model.GpuProfile, device_kind: str, figures: dict[str, Any]
               ) -> _gpu_model.GpuProfile:
    """``base`` with the measured ``figures`` (``tensor_flops`` merged by type)."""
    changes = dict(figures)
    if "tensor_flops" in changes:
        peaks = dict(base.tensor_flops)
        peaks.update(changes["tensor_flops"])
        changes["tensor_flops"] = tuple(sorted(peaks.items()))
    return dataclasses.replace(base, device_kind=device_kind, **changes)


def document(base: _gpu_model.GpuProfile, device_kind: str, figures: dict[str, Any],
             measurements: dict[str, Any]) -> dict[str, Any]:
    """The profile document with only the measured ``figures`` (so that ``gpu_profile``
    marks exactly those measured)."""
    written = _gpu_model.profile_document(profile_of(base, device_kind, figures), measurements)
    written["figures"] = {name: written["figures"][name] for name in figures}
    if "tensor_flops" in figures:
        written["figures"]["tensor_flops"] = dict(figures["tensor_flops"])
    return written


def _us(value: float) -> str:
    return f"{value * 1e6:8.3f} us"


def report(base: _gpu_model.GpuProfile, figures: dict[str, Any],
           measurements: dict[str, Any]) -> str:
    """Measured figures against the built-in ones, and the concurrency evidence."""
    lines = [f"{'figure':16} {'measured':>12} {'built-in':>12}  built-in range"]
    for name in ("graph_floor_s", "launch_s", "chain_node_s", "dag_node_s",
                 "graph_launch_s"):
        low, high = base.span(name)
        shown = _us(figures[name]) if name in figures else "   (noise)  "
        lines.append(f"{name:16} {shown} {_us(getattr(base, name))}  "
                     f"{low * 1e6:.2f}-{high * 1e6:.2f} us")
    floors = measurements.get("floors", {})
    if floors:
        lines.append(f"{'launch_host_s':16} {_us(floors['launch_host_s'])}  (host share "
                     "of a launch outside graphs; kernel_floor_s <= launch_s)")
        if "launch_s" in figures and base.kernel_floor_s > figures["launch_s"]:
            lines.append(f"note: the built-in kernel_floor_s ({_us(base.kernel_floor_s).strip()})"
                         " is above its measured bound launch_s; calibration does not "
                         "change it")
    if "bandwidth" in figures:
        lines.append(f"{'bandwidth':16} {figures['bandwidth'] / 1e12:9.2f} TB/s "
                     f"{base.bandwidth / 1e12:9.2f} TB/s")
    for name, flops in figures.get("tensor_flops", {}).items():
        lines.append(f"{'tensor ' + name:16} {flops / 1e12:7.1f} TFLOP/s "
                     f"{base.dot_flops(name) / 1e12:7.1f} TFLOP/s")
    for kind, entry in measurements.get("concurrency", {}).items():
        lines.append(f"{entry['width']} independent {kind} chains ({entry['dtype']}, "
                     f"{entry['size']}), blocked time per call by depth "
                     f"{entry['depths']}, ratio to lhs, XLA temporaries (deeper):")
        for mode, by_mode in entry["modes"].items():
            times = ", ".join(_us(run["blocked_s"]).strip() for run in by_mode["runs"])
            ratios = [by_mode["ratio_to_lhs"][f"depth{depth}_blocked_s"]
                      for depth in entry["depths"]]
            temp = by_mode["runs"][-1]["temp_bytes"]
            lines.append(f"  {mode:20} {times}   " + " / ".join(f"x{r:.2f}" for r in ratios)
                         + (f"   temporaries {temp / 2**20:.2f} MiB" if temp is not None
                            else ""))
    for program, shape in measurements.get("graphs", {}).items():
        buffers = shape.get("command_buffers")
        described = ("no thunk dump" if buffers is None else
                     "; ".join(f"graph of {b['nodes']} nodes, {b['sources']} sources"
                               for b in buffers) or "no CUDA graph")
        lines.append(f"  {program:28} {described}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="where to write the profile (default: "
                        "where jaxpar looks for this device kind)")
    parser.add_argument("--install", action="store_true", help="with --out: also write it "
                        "where jaxpar looks for this device kind ($JAXPAR_PROFILE_DIR)")
    parser.add_argument("--dump-dir", default="", help="compile the graph-mode programs "
                        "with xla_dump_to=DIR/<program>-<mode> (XLA's thunk sequences)")
    parser.add_argument("--repeats", type=int, default=0, help="calls per blocked median")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds "
                        "after which the throughput stage (bandwidth, matmuls) is skipped")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes (the default without a GPU)")
    parser.add_argument("--device-kind", default="", help="label the profile with this "
                        "device kind instead of jax.devices()[0].device_kind")
    options = parser.parse_args(argv)
    started = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    dry_run = options.dry_run or not on_gpu
    sizes = DRY_RUN_SIZES if dry_run else GPU_SIZES
    if options.repeats:
        sizes = dataclasses.replace(sizes, repeats=options.repeats)
    kind = options.device_kind or jax.devices()[0].device_kind
    if dry_run and (not options.out or options.install):
        parser.error("a dry run (no GPU, or --dry-run) needs --out and no --install, so "
                     "that its figures never land where jaxpar looks for a GPU's profile")
    outs = [Path(options.out)] if options.out else []
    if options.install or not outs:
        outs.append(_gpu_model.profile_path(kind))
    base = _gpu_model.builtin_gpu_profile(kind)
    device = jax.devices()[0]
    measurements: dict[str, Any] = {
        "device_kind": device.device_kind, "backend": jax.default_backend(),
        "jax": jax.__version__, "xla_flags": _flags.xla_flags_text(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dry_run": dry_run, "sizes": dataclasses.asdict(sizes)}
    figures: dict[str, Any] = {}

    def write(stage: str) -> None:
        measurements["stages_done"] = [*measurements.get("stages_done", []), stage]
        measurements["wall_s"] = time.perf_counter() - started
        text = json.dumps(document(base, kind, figures, measurements), indent=1)
        for out in outs:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
        print(f"[{measurements['wall_s']:6.1f} s] {stage} done", flush=True)

    timer = Timer(sizes, Path(options.dump_dir) if options.dump_dir else None, on_gpu)
    found, measurements["floors"] = floors_and_launches(timer)
    figures.update(found)
    measurements["graphs"] = timer.graphs
    write("floors and launches")
    measurements["concurrency"] = concurrency(timer)
    write("concurrency")
    if time.perf_counter() - started < options.budget:
        found, measured = throughput(sizes, base)
        figures.update(found)
        measurements.update(measured)
        write("throughput")
    else:
        print(f"skipping bandwidth and matmuls: past the {options.budget:.0f} s budget",
              file=sys.stderr)
    print(report(base, figures, measurements))
    print(f"{kind}: profile -> {', '.join(map(str, outs))}" + (" (dry run)" if dry_run else ""))
    return outs[0]


if __name__ == "__main__":
    main(sys.argv[1:])
