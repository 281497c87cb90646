"""The one GPU model: every figure of each GPU kind, and XLA's command-buffer modes.

Everything in jaxpar that prices GPU work reads its figures here: the cost model of the
planner (``_model.cost.device_profile``), the pricing of stream sections (``_plan.pricing``), the
estimate of compiled programs (``_compiled.estimate``) and ``gpu_preview``. No other module
defines a GPU figure or a command-buffer mode (``tests/test_model_gpu.py`` fails if one
does).

A calibration profile measured on a real GPU (``benchmarks/calibrate.py``) replaces the
built-in figures for that device kind: ``gpu_profile`` loads
``$JAXPAR_PROFILE_DIR/<device kind>.json`` (default directory
``~/.cache/jaxpar/profiles``; the device kind lower-cased, every run of other characters
than letters and digits an underscore: ``nvidia_h200.json``).

Example::

    profile = gpu_profile("h200")          # built-in H200 figures, or the calibrated ones
    profile.launch_s, profile.dot_flops("bf16")
    mode = CommandBufferMode.parse("concurrent")

Sharp edges:
  * The built-in host-side figures (launch, graph node, sync, event) are third-party
    measurements or assumptions, not yet measured on an H100/H200; calibrate to replace
    them (``benchmarks/calibrate.py``).
  * A calibration file changes plans. Under multi-process SPMD every process must plan
    alike: give every host the same file (``JAXPAR_PROFILE_DIR`` on a shared disk).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

__all__ = [
    "GENERIC_GPU",
    "GPU_PROFILES",
    "CONCURRENT_REGION_BYTES",
    "MIN_GRAPH_SIZE",
    "PROFILE_DIR_VARIABLE",
    "CommandBufferMode",
    "GpuProfile",
    "GpuProfileError",
    "builtin_gpu_profile",
    "gpu_profile",
    "local_gpu_kind",
    "local_gpu_profile",
    "local_profile_stamp",
    "profile_document",
    "profile_path",
]


class CommandBufferMode(enum.Enum):
    """How XLA:GPU turns runs of thunks into CUDA graphs (command buffers).

    ``LHS`` is XLA's default (``xla_gpu_command_buffer_scheduling_mode=LHS``): a graph is
    one serial chain, captured stream regions included. ``CONCURRENT``: graph edges come
    from buffer conflicts only, so independent kernels overlap inside a graph, and buffer
    assignment follows a dependency ordering (independent temporaries are never packed
    together: more memory). ``CONCURRENT_REGIONS`` (jax >= 0.10): only small,
    latency-bound kernels run concurrently (no dot, convolution, library call, fusion
    of more than 100 instructions or kernel moving more than 20 MB), in runs of such
    kernels; everything else is serial, and buffers are packed except within a run.
    ``SERIALIZE``: one serial chain too. ``OFF`` (``--xla_gpu_enable_command_buffer=``
    empty): every kernel is launched alone.

    Sources (``docs/xla.md``, ``docs/gpu_evidence.md``): ``xla/xla.proto`` (the modes;
    CONCURRENT "may lead to OOMs and less predictable performance"),
    ``xla/service/gpu/gpu_hlo_ordering.cc`` (what CONCURRENT_REGIONS lets overlap), a public
    measurement of 75 independent tiny kernels (4.8x faster in CONCURRENT, 2.2x the peak
    memory, RTX 5090).
    """

    LHS = "lhs"
    CONCURRENT = "concurrent"
    CONCURRENT_REGIONS = "concurrent_regions"
    SERIALIZE = "serialize"
    OFF = "off"

    @classmethod
    def parse(cls, value: CommandBufferMode | str, argument: str = "command_buffers"
              ) -> CommandBufferMode:
        """``value`` as a mode (a member or its lower-case name).

        Raises:
          ValueError: naming ``argument`` and the valid modes.
        """
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{argument}={value!r} is not a CUDA-graph mode; use one of "
                             f"{[mode.value for mode in cls]}") from None

    @classmethod
    def from_xla_scheduling_mode(cls, name: str) -> CommandBufferMode:
        """The mode of ``--xla_gpu_command_buffer_scheduling_mode=<name>`` (a name XLA may
        add later counts as its default, ``LHS``)."""
        by_name = {mode.xla_scheduling_mode: mode for mode in cls
                   if mode.xla_scheduling_mode is not None}
        return by_name.get(name.upper(), cls.LHS)

    @property
    def xla_scheduling_mode(self) -> str | None:
        """The value of ``xla_gpu_command_buffer_scheduling_mode`` (None for ``OFF``)."""
        return None if self is CommandBufferMode.OFF else self.value.upper()

    @property
    def branching(self) -> bool:
        """Whether its CUDA graphs branch (independent kernels as parallel nodes), or are
        one chain."""
        return self in (CommandBufferMode.CONCURRENT, CommandBufferMode.CONCURRENT_REGIONS)


# Consecutive capturable thunks XLA needs to form a CUDA graph (the default of
# ``xla_gpu_graph_min_graph_size``).
MIN_GRAPH_SIZE = 5

# The most bytes a kernel may read and write and still run concurrently in
# ``CONCURRENT_REGIONS`` mode (``kMaxBytesForConcurrentExecution`` in
# ``xla/service/gpu/gpu_hlo_ordering.cc``: more "may increase memory usage and lead to
# OOMs").
CONCURRENT_REGION_BYTES = 20_000_000


# The smallest data-centre GPU's memory (16 GB: T4, V100 16GB, A2), a profile's unless it
# names its own: a memory budget scaled by it never asks more than that smaller GPU has.
SMALLEST_GPU_MEMORY = 16e9


@dataclasses.dataclass(frozen=True, slots=True)
class GpuProfile:
    """The figures of one GPU kind (built-in sources in the comments of ``_H200``).

    The host-side and kernel-floor figures are uncertain (none was measured on a Hopper
    GPU by this project): each has a ``(low, high)`` range in ``ranges``, and a choice
    jaxpar makes from this model alone must win at every end of them (``at``). A figure
    a calibration measured on the GPU (``measured``) keeps a narrow range around it.

    Attributes:
      name: ``"h200"``, ``"h100"``, ``"gpu"`` (the generic default) or a device kind's
        file name for a calibrated kind jaxpar has no figures for.
      device_kind: ``jax.Device.device_kind`` of this GPU (``""`` for the generic one).
      sm_count: streaming multiprocessors.
      bandwidth: HBM bytes/s.
      vector_flops: FP32 non-tensor flop/s (elementwise work).
      tensor_flops: dot/convolution flop/s by XLA element type, as ``(type, flop/s)``
        pairs; ``"f32"`` is JAX's default precision (TF32 tensor cores on Hopper).
      launch_s: host cost of launching one kernel outside a CUDA graph.
      graph_launch_s: host cost of launching one CUDA graph.
      chain_node_s: host cost of each kernel node of a straight-line graph (``lhs``,
        ``serialize``: drivers launch those in about constant time).
      dag_node_s: host cost of each kernel node of a branching graph (``concurrent``,
        ``concurrent_regions``).
      kernel_floor_s: shortest a kernel launched on its own takes on the device.
      graph_floor_s: shortest a dependent kernel inside a CUDA graph takes on the device
        (launch and teardown between two graph nodes).
      sync_s: a predicate copied to the host plus a stream synchronise.
      event_s: one event record or stream wait on the host.
      hardware_queues: kernels that can run concurrently from independent streams or
        graph branches (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default).
      memory_bytes: the device's memory (its datasheet's capacity): the memory budget's
        floor is a share of it (``_options.MemoryBudget``).
      ranges: ``(figure, low, high)`` of every uncertain figure.
      measured: the figures a calibration measured on this GPU (empty: none, every
        figure is a public third-party figure or an assumption).
      source: where the figures come from (``"built-in"`` or a calibration file).
    """

    name: str
    device_kind: str
    sm_count: int
    bandwidth: float
    vector_flops: float
    tensor_flops: tuple[tuple[str, float], ...]
    launch_s: float
    graph_launch_s: float
    chain_node_s: float
    dag_node_s: float
    kernel_floor_s: float
    graph_floor_s: float
    sync_s: float
    event_s: float
    hardware_queues: int = 8
    memory_bytes: float = 16e9  # SMALLEST_GPU_MEMORY (a slots class keeps no default)
    ranges: tuple[tuple[str, float, float], ...] = ()
    measured: frozenset[str] = frozenset()
    source: str = "built-in"

    def dot_flops(self, element_type: str) -> float:
        """Tensor-core flop/s of a dot or convolution on ``element_type`` (default f32's)."""
        peaks = dict(self.tensor_flops)
        return peaks.get(element_type, peaks["f32"])

    def node_s(self, mode: CommandBufferMode) -> float:
        """Host cost of each kernel node of a graph run in ``mode``."""
        return self.dag_node_s if mode.branching else self.chain_node_s

    def floor_s(self, graphs: bool) -> float:
        """Shortest a kernel takes on the device: inside a CUDA graph, or launched alone."""
        return self.graph_floor_s if graphs else self.kernel_floor_s

    def span(self, figure: str) -> tuple[float, float]:
        """``(low, high)`` of ``figure`` (its value twice when it has no range)."""
        for name, low, high in self.ranges:
            if name == figure:
                return low, high
        value = float(getattr(self, figure))
        return value, value

    def at(self, ends: Mapping[str, str]) -> GpuProfile:
        """This profile with each figure of ``ends`` at its ``"low"`` or ``"high"`` end.

        Raises:
          ValueError: a figure without a range, or an end that is neither.
        """
        uncertain = {name for name, _, _ in self.ranges}
        changes: dict[str, Any] = {}
        for figure, end in ends.items():
            if figure not in uncertain or end not in ("low", "high"):
                raise ValueError(f"{figure}={end!r}: the uncertain figures are "
                                 f"{sorted(uncertain)}, each at 'low' or 'high'")
            low, high = self.span(figure)
            changes[figure] = low if end == "low" else high
        return dataclasses.replace(self, **changes)

    @property
    def calibrated(self) -> bool:
        """Whether a calibration on this GPU measured the figures plans depend on."""
        return bool(self.measured)


# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM5) and H200 Tensor Core GPU datasheet
# (H200 SXM), dense figures (half the "with sparsity" ones): FP64 tensor 67 TFLOP/s, TF32
# tensor 494.5, BF16/FP16 tensor 989.5, FP8/INT8 tensor 1979. XLA:GPU runs float32 dots
# at JAX's default precision on TF32 tensor cores on Hopper, so "f32" is the TF32 peak.
_HOPPER_TENSOR_FLOPS = (
    ("f64", 67e12), ("c128", 67e12), ("f32", 494.5e12), ("c64", 494.5e12),
    ("bf16", 989.5e12), ("f16", 989.5e12), ("s8", 1979e12), ("u8", 1979e12),
    ("f8e4m3fn", 1979e12), ("f8e5m2", 1979e12),
)

# The host-side and floor figures below are public third-party measurements, none on
# an H100 or H200 host by this project; docs/gpu_evidence.md gives each source (L1-L10,
# X1-X2, C1-C4 there) with the GPU it was measured on. Their ranges span that evidence.
_H200 = GpuProfile(
    name="h200", device_kind="NVIDIA H200",
    sm_count=132,  # H200 datasheet; core_count in jaxpar/_compiled/targets/h200.txtpb
    bandwidth=4.8e12,  # HBM3e, H200 datasheet; memory_bandwidth in targets/h200.txtpb
    vector_flops=67e12,  # FP32 (non-tensor), datasheet
    tensor_flops=_HOPPER_TENSOR_FLOPS,
    # Host enqueue of one kernel: 8.05 us per lax.scan trip of 3 tiny kernels on a Tesla
    # T4, jax 0.8.1 (L1, QuantEcon lecture-python-programming #437/#440, XLA's loop
    # overhead included); 2.62-2.81 us async enqueue on an RTX 5070 Ti laptop, WSL2 (L2,
    # ahrefs/ocannl #488); "2.6 us at the minimum" (L7); 4-6 us claimed (L9). A Hopper
    # host may be faster.
    launch_s=2.7e-6,
    # Host cost of one graph launch: a one-node graph launches no slower than one kernel
    # (L8, B200); straight-line graphs launch in constant time (L6, NVIDIA). Plausibly
    # 2-5 us for a small graph; 6.3 us was this model's earlier, scaled figure.
    graph_launch_s=3.0e-6,
    # Per node of a straight-line graph (LHS, SERIALIZE): about constant launch time on
    # current drivers (L6); up to this model's earlier 0.25 us.
    chain_node_s=0.1e-6,
    # Per node of a branching graph (CONCURRENT, CONCURRENT_REGIONS): 0.91-0.98 us per
    # node of cudaGraphLaunch for large captured graphs on Blackwell (L4, sglang #29960).
    dag_node_s=0.5e-6,
    # Device floor of a kernel launched alone: "a tiny kernel still takes about 2 us";
    # outside graphs a dependent chain runs at the host's launch rate anyway.
    kernel_floor_s=2.0e-6,
    # Device time between two dependent kernels inside a CUDA graph: about 1.3 us on an
    # H100 (L3, Hazy Research, batch-1 Llama decode); 0.58 us per node of a chain graph
    # on sm_120 (L2); this model's earlier 2.0 us as the high end.
    graph_floor_s=1.3e-6,
    # Assumptions, no public measurement at hand: one small device-to-host copy plus a
    # stream synchronise; one cudaEventRecord / cudaStreamWaitEvent call (a stream wait on
    # a value takes ~150 ns, L7).
    sync_s=10.0e-6,
    event_s=1.0e-6,
    # Only 8 streams ran concurrently by default (NVIDIA/cutlass #354, RTX 3090).
    hardware_queues=8,
    memory_bytes=141e9,  # HBM3e, H200 datasheet ("141GB")
    ranges=(("launch_s", 2.0e-6, 5.0e-6), ("graph_launch_s", 2.0e-6, 6.3e-6),
            ("chain_node_s", 0.0, 0.25e-6), ("dag_node_s", 0.25e-6, 1.0e-6),
            ("kernel_floor_s", 1.3e-6, 2.7e-6), ("graph_floor_s", 0.6e-6, 2.0e-6),
            ("sync_s", 5.0e-6, 20.0e-6), ("event_s", 0.15e-6, 1.0e-6)),
)

#: Built-in profiles by the names ``compile_for_gpu`` and ``gpu_preview`` accept, and the
#: generic ``"gpu"`` the planner uses when it plans away from a GPU.
GPU_PROFILES: Mapping[str, GpuProfile] = {
    "h200": _H200,
    # H100 SXM5: HBM3 3.35 TB/s and 80 GB (datasheet; memory_bandwidth in
    # targets/h100.txtpb), 132 SMs; the same Hopper compute and host figures.
    "h100": dataclasses.replace(_H200, name="h100", device_kind="NVIDIA H100 80GB HBM3",
                                bandwidth=3.35e12, memory_bytes=80e9),
    # Planning away from a GPU (gpu_preview's and the deviceless compiles' default GPU):
    # the H200's speeds, the smallest data-centre GPU's memory (the field's default).
    "gpu": dataclasses.replace(_H200, name="gpu", device_kind="",
                               memory_bytes=SMALLEST_GPU_MEMORY),
}
GENERIC_GPU = "gpu"

_BY_DEVICE_KIND = {p.device_kind: p for p in GPU_PROFILES.values() if p.device_kind}

# --------------------------------------------------------------------------- calibration

PROFILE_DIR_VARIABLE = "JAXPAR_PROFILE_DIR"
PROFILE_FORMAT = "jaxpar-gpu-profile"
PROFILE_VERSION = 2
# What a calibration file may set (GpuProfile fields; tensor_flops as an object).
CALIBRATED = ("sm_count", "bandwidth", "vector_flops", "tensor_flops", "launch_s",
              "graph_launch_s", "chain_node_s", "dag_node_s", "kernel_floor_s",
              "graph_floor_s", "sync_s", "event_s", "hardware_queues")
# Figures a calibration may measure as zero (a host cost per graph node).
_MAY_BE_ZERO = frozenset({"chain_node_s", "dag_node_s"})
# A measured figure's range: timing noise and what one measurement cannot tell apart.
MEASURED_SPREAD = 0.2
# Version 1 files named the in-graph kernel figure ``graph_node_s`` (it was measured as
# a dependent kernel's time inside a graph, the device floor ``graph_floor_s`` is now).
_VERSION_1_NAMES = {"graph_node_s": "graph_floor_s"}


class GpuProfileError(ValueError):
    """A calibration profile file is malformed."""


def _file_name(device_kind: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_")
    return f"{slug or 'gpu'}.json"


def profile_path(device_kind: str) -> Path:
    """Where the calibration profile of ``device_kind`` is looked up (and written)."""
    directory = os.environ.get(PROFILE_DIR_VARIABLE, "").strip()
    base = Path(directory) if directory else Path.home() / ".cache" / "jaxpar" / "profiles"
    return base / _file_name(device_kind)


def profile_document(profile: GpuProfile, measurements: Mapping[str, Any] | None = None
                     ) -> dict[str, Any]:
    """The JSON document of a calibration profile (what ``gpu_profile`` loads back)."""
    figures = {name: getattr(profile, name) for name in CALIBRATED}
    figures["tensor_flops"] = dict(profile.tensor_flops)
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION,
            "device_kind": profile.device_kind, "figures": figures,
            "measurements": dict(measurements or {})}


def _positive(path: Path, name: str, value: Any) -> float:
    zero = name in _MAY_BE_ZERO
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise GpuProfileError(f"{path}: figure {name!r} must be a finite number "
                              f"{'>= 0' if zero else '> 0'}, got {value!r}; re-run "
                              "benchmarks/calibrate.py on this GPU or delete the file")
    return float(value)


def _calibrated(path: Path, base: GpuProfile, device_kind: str) -> GpuProfile:
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise GpuProfileError(f"{path}: not a readable JSON calibration profile ({error}); "
                              "re-run benchmarks/calibrate.py on this GPU or delete the "
                              "file") from None
    if not isinstance(document, dict) or document.get("format") != PROFILE_FORMAT \
            or document.get("version") not in (1, PROFILE_VERSION):
        raise GpuProfileError(f"{path}: not a {PROFILE_FORMAT} version {PROFILE_VERSION} "
                              "file (the 'format' and 'version' keys); re-run "
                              "benchmarks/calibrate.py on this GPU or delete the file")
    if document.get("device_kind") != device_kind:
        raise GpuProfileError(f"{path}: measured on {document.get('device_kind')!r}, not on "
                              f"{device_kind!r}; calibrate on a {device_kind} or delete the "
                              "file")
    figures = document.get("figures")
    if not isinstance(figures, dict):
        raise GpuProfileError(f"{path}: 'figures' must be an object of GPU figures")
    if document["version"] == 1:
        figures = {_VERSION_1_NAMES.get(name, name): value for name, value in figures.items()}
    unknown = sorted(set(figures) - set(CALIBRATED))
    if unknown:
        raise GpuProfileError(f"{path}: unknown figures {unknown}; valid ones are "
                              f"{list(CALIBRATED)}")
    changes: dict[str, Any] = {}
    for name, value in figures.items():
        if name == "tensor_flops":
            if not isinstance(value, dict):
                raise GpuProfileError(f"{path}: 'tensor_flops' must be an object of flop/s "
                                      "by element type, e.g. {\"bf16\": 9.8e14}")
            peaks = dict(base.tensor_flops)
            peaks.update({str(k): _positive(path, f"tensor_flops.{k}", v)
                          for k, v in value.items()})
            changes[name] = tuple(sorted(peaks.items()))
        elif name in ("sm_count", "hardware_queues"):
            changes[name] = round(_positive(path, name, value))
        else:
            changes[name] = _positive(path, name, value)
    # A measured figure keeps a narrow range around its value; the others keep theirs.
    ranges = tuple((figure, changes[figure] * (1 - MEASURED_SPREAD),
                    changes[figure] * (1 + MEASURED_SPREAD)) if figure in changes
                   else (figure, low, high) for figure, low, high in base.ranges)
    measured = frozenset(changes) & {figure for figure, _, _ in base.ranges}
    name = base.name if base.device_kind else _file_name(device_kind).removesuffix(".json")
    return dataclasses.replace(base, **changes, name=name, device_kind=device_kind,
                               ranges=ranges, measured=measured, source=str(path))


def builtin_gpu_profile(device_kind: str) -> GpuProfile:
    """jaxpar's own figures for ``device_kind`` (the generic ``"gpu"`` ones for a kind it
    has none for), whatever calibration file exists."""
    return _BY_DEVICE_KIND.get(device_kind, GPU_PROFILES[GENERIC_GPU])


@functools.lru_cache(maxsize=32)
def _load(path: Path, stamp: tuple[int, int], base: GpuProfile, device_kind: str
          ) -> GpuProfile:
    del stamp  # only keys the cache: a rewritten file is read again
    return _calibrated(path, base, device_kind)


def gpu_profile(gpu: str | GpuProfile = "h200") -> GpuProfile:
    """The figures of a GPU: built-in, replaced by its calibration file where one exists.

    Args:
      gpu: a built-in name (``"h200"``, ``"h100"``, ``"gpu"``), a ``jax.Device``'s
        ``device_kind`` (``"NVIDIA H200"``; a kind without built-in figures starts from
        the generic ``"gpu"`` ones), or a ``GpuProfile`` (returned as it is).

    Returns:
      A ``GpuProfile``; ``source`` names the calibration file when one was loaded.

    Raises:
      ValueError: ``gpu`` is neither a built-in name nor a device kind.
      GpuProfileError: the calibration file for that kind is malformed.
    """
    if isinstance(gpu, GpuProfile):
        return gpu
    if not isinstance(gpu, str) or not gpu.strip():
        raise ValueError(f"gpu={gpu!r} has no profile; use one of {sorted(GPU_PROFILES)}, a "
                         "jax.Device's device_kind, or a GpuProfile")
    base = GPU_PROFILES.get(gpu.lower())
    if base is not None:
        kind = base.device_kind
    else:
        kind = gpu
        if kind not in _BY_DEVICE_KIND and kind.isalnum():
            # A bare word that is no built-in name is a typo more likely than a kind.
            raise ValueError(f"gpu={gpu!r} has no profile; use one of "
                             f"{sorted(GPU_PROFILES)}, a jax.Device's device_kind, or a "
                             "GpuProfile")
        base = builtin_gpu_profile(kind)
    if not kind:
        return base
    path = profile_path(kind)
    try:
        stat = path.stat()
    except OSError:
        return base
    return _load(path, (stat.st_mtime_ns, stat.st_size), base, kind)


@functools.cache
def local_gpu_kind() -> str | None:
    """The device kind whose calibration file ``local_gpu_profile`` reads, None without
    a GPU (a process's backend does not change once started)."""
    if jax.default_backend() != "gpu":
        return None
    kind = jax.devices()[0].device_kind
    base = GPU_PROFILES.get(kind.lower())
    return (base.device_kind if base is not None else kind) or None


@functools.lru_cache(maxsize=8)
def _profile_file(directory: str, device_kind: str) -> str:
    del directory  # keys the cache: profile_path reads it
    return str(profile_path(device_kind))


def local_profile_stamp() -> tuple[int, int] | None:
    """What ``local_gpu_profile`` reads from the file system: the ``(mtime, size)`` of
    this machine's GPU's calibration file; None without one, or without a GPU. A
    decorated function compares it at each call (a calibration written meanwhile
    changes its settings, as it changes ``local_gpu_profile``)."""
    kind = local_gpu_kind()
    if kind is None:
        return None
    try:
        stat = os.stat(_profile_file(os.environ.get(PROFILE_DIR_VARIABLE, ""), kind))
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def local_gpu_profile() -> GpuProfile:
    """The profile of this machine's first GPU, or the generic ``"gpu"`` one without a GPU."""
    if jax.default_backend() == "gpu":
        return gpu_profile(jax.devices()[0].device_kind)
    return GPU_PROFILES[GENERIC_GPU]
