"""Compile a JAX function for an NVIDIA GPU on a machine without one, and read its schedule.

XLA can compile for a GPU it cannot see: the CUDA PJRT plugin builds a *topology* from a
text description of the card (``jaxpar/targets/<gpu>.txtpb``) and compiles against it.
The result is the optimized, scheduled HLO that XLA:GPU would run, which is what tells
whether stream-annotated regions really overlap (``call-start``/``call-done`` order),
whether loops keep a known trip count, and which collectives stay asynchronous.
``compile_for_gpu`` returns that HLO text; ``parse_schedule`` turns it into frozen
dataclasses.

Example::

    import jax, jax.numpy as jnp
    from jaxpar._deviceless import compile_for_gpu, parse_schedule

    x = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    text = compile_for_gpu(lambda a: jnp.tanh(a @ a), x, gpu="h200")
    schedule = parse_schedule(text)
    schedule.max_async_calls_in_flight  # 0: nothing was stream-annotated

Sharp edges:
    - Needs ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` (or the cuda13 pair) at *exactly*
      the installed jaxlib version; ``plugin_status()`` says which ``pip install`` line fixes
      it. Run with ``JAX_PLATFORMS=cpu`` (or ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``):
      otherwise JAX tries to start the CUDA backend and fails with "Unable to load CUDA".
    - ``jax.jit(f).lower(lowering_platforms=("cuda",)).compile()`` silently compiles for
      the *CPU*. This module never does that, and it checks the result: the compiled
      executable must sit on GPU devices and its kernels must carry GPU backend configs,
      or ``compile_for_gpu`` raises ``RuntimeError``.
    - XLA bugs in the compiler crash the whole Python process (SIGSEGV); nothing here can
      catch that. Seen with jaxlib 0.12.0.1: a stream-annotated call whose body holds a
      ``while`` loop (e.g. a ``lax.scan``) crashes in
      ``NVPTXCompiler::CompileTargetBinary`` (via ``CubinCustomKernelCompiler``); the same
      program compiles on jaxlib 0.10.2. Compile such programs in a subprocess when the
      caller must survive.
    - The text format moves between XLA versions. Seen: jaxlib 0.10.2 prints
      ``call-start(...), to_apply=%c``; jaxlib 0.12.0.1 adds
      ``async_execution_thread="parallel"`` and, for some bodies, prints the region as
      ``async-start(...), calls=%async_computation`` whose root is the ``call``. A
      collective-permute start/done pair with nothing in between is printed as
      start/done with ``"is_sync":true`` on 0.10.2 and as a plain ``collective-permute``
      on 0.12.0.1. ``parse_schedule`` reads all of these.
    - Kernel counts are static and best effort: one per ``fusion`` or ``custom-call``
      instruction, nested loops counted once, ``copy`` and collectives not counted.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "GPU_TARGETS",
    "AsyncEvent",
    "ComputationSchedule",
    "Schedule",
    "WhileLoop",
    "compile_for_gpu",
    "gpu_target_config",
    "make_gpu_mesh",
    "parse_schedule",
    "plugin_status",
]

_TARGETS_DIR = Path(__file__).parent / "targets"

#: GPU names ``compile_for_gpu`` accepts, mapped to their target description file.
GPU_TARGETS: Mapping[str, str] = {"h100": "h100.txtpb", "h200": "h200.txtpb"}

# (plugin distribution, PJRT distribution, module the plugin installs)
_PLUGIN_PACKAGES: tuple[tuple[str, str, str], ...] = (
    ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax_plugins.xla_cuda12"),
    ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax_plugins.xla_cuda13"),
)


# --------------------------------------------------------------------------- plugin


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _module_findable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def plugin_status() -> tuple[bool, str]:
    """Says whether a CUDA PJRT plugin matching the installed jaxlib exactly is installed.

    Nothing is imported: versions come from the installed distributions' metadata.

    Returns:
        ``(True, description)`` when a ``jax-cudaNN-plugin``/``jax-cudaNN-pjrt`` pair with
        jaxlib's exact version is installed and importable, else ``(False, message)`` where
        the message names the ``pip install --no-deps ...`` line that fixes it.

    Example:
        >>> ok, message = plugin_status()
        >>> if not ok:
        ...     print(message)
    """
    jaxlib_version = _distribution_version("jaxlib")
    if jaxlib_version is None:
        return False, "jaxlib is not installed; install jax and jaxlib first."
    fix = (
        f"pip install --no-deps jax-cuda12-plugin=={jaxlib_version} "
        f"jax-cuda12-pjrt=={jaxlib_version}"
    )
    problems = []
    for plugin, pjrt, module in _PLUGIN_PACKAGES:
        plugin_version = _distribution_version(plugin)
        pjrt_version = _distribution_version(pjrt)
        if plugin_version is None and pjrt_version is None:
            continue
        if plugin_version != jaxlib_version or pjrt_version != jaxlib_version:
            problems.append(
                f"{plugin}=={plugin_version} and {pjrt}=={pjrt_version} do not match "
                f"jaxlib=={jaxlib_version}"
            )
            continue
        if not _module_findable(module):
            problems.append(
                f"{plugin}=={plugin_version} is installed but {module} is not importable"
            )
            continue
        return True, f"{plugin}=={plugin_version} and {pjrt}=={pjrt_version} match jaxlib"
    found = "; ".join(problems) if problems else "no CUDA PJRT plugin is installed"
    return False, (
        f"Compiling for a GPU without one needs the CUDA PJRT plugin at exactly the jaxlib "
        f"version ({found}). Fix: {fix}"
    )


def _require_plugin() -> None:
    ok, message = plugin_status()
    if not ok:
        raise RuntimeError(message)


# --------------------------------------------------------------------------- topology


def _check_gpu_name(gpu: str) -> str:
    if not isinstance(gpu, str) or gpu.lower() not in GPU_TARGETS:
        raise ValueError(
            f"gpu={gpu!r} is not a known GPU; use one of {sorted(GPU_TARGETS)} "
            f"(target descriptions live in {_TARGETS_DIR})."
        )
    return gpu.lower()


def _check_devices(devices: int) -> int:
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r} must be an integer >= 1.")
    return devices


def gpu_target_config(gpu: str = "h200") -> str:
    """Returns the ``GpuTargetConfigProto`` text describing ``gpu``.

    Args:
        gpu: one of ``GPU_TARGETS`` (case-insensitive).

    Returns:
        The text-format proto shipped in ``jaxpar/targets/``.

    Raises:
        ValueError: ``gpu`` is not a known GPU.
    """
    return (_TARGETS_DIR / GPU_TARGETS[_check_gpu_name(gpu)]).read_text()


def _device_kind(gpu: str) -> str:
    match = re.search(r'device_description_str:\s*"([^"]*)"', gpu_target_config(gpu))
    return match.group(1) if match else ""


@functools.cache
def _topology(gpu: str, devices: int) -> Any:
    _require_plugin()
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(
            platform="cuda",
            topology=f"1x1x{devices}",  # slices x hosts x devices per host
            target_config=gpu_target_config(gpu),
        )
    except Exception as error:  # the plugin raises plain RuntimeErrors/XlaRuntimeErrors
        raise RuntimeError(
            f"Could not build a deviceless CUDA topology for gpu={gpu!r}, devices={devices}: "
            f"{error}. Run with JAX_PLATFORMS=cpu (or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1) and "
            f"check plugin_status()."
        ) from error


def make_gpu_mesh(gpu: str = "h200", devices: int = 1, axis_names: Sequence[str] = ("x",)) -> Any:
    """Returns a 1-D ``jax.sharding.Mesh`` over ``devices`` deviceless GPUs.

    Build shardings for ``compile_for_gpu`` arguments on this mesh, e.g.
    ``NamedSharding(make_gpu_mesh("h200", 8), PartitionSpec("x"))`` for a ``shard_map``
    program. The topology is cached per ``(gpu, devices)``, so repeated calls return meshes
    over the same devices.

    Args:
        gpu: one of ``GPU_TARGETS``.
        devices: number of GPUs (one host, one slice).
        axis_names: the single mesh axis name, as a one-element sequence.

    Returns:
        A ``jax.sharding.Mesh`` whose devices are compile-only CUDA devices.

    Raises:
        ValueError: unknown ``gpu``, ``devices < 1``, or not exactly one axis name.
        RuntimeError: the CUDA plugin is missing or mismatched (the message has the fix).

    Example:
        >>> mesh = make_gpu_mesh("h200", 8)
        >>> mesh.shape
        {'x': 8}
    """
    gpu = _check_gpu_name(gpu)
    devices = _check_devices(devices)
    names = tuple(axis_names)
    if len(names) != 1 or not all(isinstance(name, str) for name in names):
        raise ValueError(f"axis_names={axis_names!r} must hold exactly one axis name (a str).")
    from jax.experimental import topologies

    return topologies.make_mesh(_topology(gpu, devices), (devices,), names)


# --------------------------------------------------------------------------- compile


def _mesh_is_on_gpu(mesh: Any) -> bool:
    devices = getattr(mesh, "devices", None)
    if devices is None or not hasattr(devices, "flat"):
        return False  # an AbstractMesh has no devices
    return all(getattr(device, "platform", None) == "gpu" for device in devices.flat)


def _place_leaf(leaf: Any, mesh: Any) -> Any:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    try:
        sharding = getattr(leaf, "sharding", None)
    except TypeError:  # a ShapeDtypeStruct holding a bare PartitionSpec wants a context mesh
        with jax.set_mesh(mesh):
            sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and _mesh_is_on_gpu(sharding.mesh):
        spec = sharding.spec  # already on deviceless GPUs; rebuilt below without a context
        mesh = sharding.mesh
    elif isinstance(sharding, NamedSharding):  # e.g. over an AbstractMesh
        spec = sharding.spec
    elif isinstance(sharding, PartitionSpec):
        spec = sharding
    else:
        spec = PartitionSpec()  # arrays on the host's CPU, unsharded structs
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(
            leaf.shape,
            leaf.dtype,
            sharding=NamedSharding(mesh, spec),
            weak_type=leaf.weak_type,
        )
    if isinstance(leaf, (bool, int, float, complex)):
        return jax.ShapeDtypeStruct(
            (),
            jax.dtypes.canonicalize_dtype(type(leaf)),
            sharding=NamedSharding(mesh, spec),
            weak_type=True,
        )
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return jax.ShapeDtypeStruct(
            tuple(np.shape(leaf)), leaf.dtype, sharding=NamedSharding(mesh, spec)
        )
    return leaf  # not an array: let jax.jit raise its own, precise error


_CPU_MARKERS = ('"outer_dimension_partitions"', "__ynn_fusion", "__onednn", "xla_cpu")
_GPU_MARKERS = ('"operation_queue_id"', "__triton", "__cublas", "__cudnn", "__gpu$")
_KERNEL_OPCODE = re.compile(r"\s(fusion|custom-call)\(")


def _check_gpu_text(text: str, device_platforms: Iterable[str]) -> None:
    platforms = set(device_platforms)
    if platforms and platforms != {"gpu"}:
        raise RuntimeError(
            f"compile_for_gpu produced an executable for {sorted(platforms)} devices, not GPUs; "
            f"refusing to return CPU HLO as if it were GPU HLO."
        )
    if any(marker in text for marker in _CPU_MARKERS):
        raise RuntimeError("compile_for_gpu got CPU HLO (CPU backend configs found); refusing it.")
    if _KERNEL_OPCODE.search(text) and not any(marker in text for marker in _GPU_MARKERS):
        raise RuntimeError(
            "compile_for_gpu got HLO with kernels but no XLA:GPU backend configs; "
            "it does not look like GPU HLO."
        )


def compile_for_gpu(
    fn: Callable[..., Any],
    *args: Any,
    gpu: str = "h200",
    devices: int | None = None,
    mesh: Any = None,
    compiler_options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> str:
    """Compiles ``jax.jit(fn)(*args, **kwargs)`` for ``gpu`` without a GPU; returns its HLO.

    Args:
        fn: the function to compile (it is wrapped in ``jax.jit``).
        *args: arrays, ``jax.ShapeDtypeStruct`` s or pytrees of them. Leaves without a GPU
            sharding are placed replicated on the mesh; a ``NamedSharding`` over an
            abstract mesh, or a bare ``PartitionSpec``, is re-bound to the mesh.
        gpu: one of ``GPU_TARGETS`` (``"h100"``, ``"h200"``).
        devices: number of GPUs on a 1-D mesh ``("x",)``; default ``mesh.size`` when
            ``mesh`` is given, else 1.
        mesh: a mesh from ``make_gpu_mesh`` to place unsharded arguments on.
        compiler_options: XLA options for ``.compile(compiler_options=...)``, e.g.
            ``{"xla_gpu_dot_merger_threshold_mb": 0}``.
        **kwargs: keyword arguments of ``fn``, treated like ``args``. ``gpu``, ``devices``,
            ``mesh`` and ``compiler_options`` are taken by this function.

    Returns:
        The compiled, scheduled HLO module text (``Compiled.as_text()``).

    Raises:
        ValueError: unknown ``gpu``; ``devices < 1``; ``mesh`` not on deviceless GPUs of
            this kind or of another size than ``devices``.
        RuntimeError: the CUDA plugin is missing or mismatched (the message has the
            ``pip install`` line), or the result is not GPU HLO.

    Example:
        >>> x = jax.ShapeDtypeStruct((128, 128), jnp.float32)
        >>> text = compile_for_gpu(lambda a: a @ a, x, gpu="h100")
        >>> "ENTRY" in text
        True
    """
    import jax

    gpu = _check_gpu_name(gpu)
    if devices is not None:
        _check_devices(devices)
    _require_plugin()
    if mesh is None:
        mesh = make_gpu_mesh(gpu, 1 if devices is None else devices)
    else:
        if not _mesh_is_on_gpu(mesh):
            raise ValueError(
                f"mesh={mesh!r} is not over deviceless GPUs; build it with make_gpu_mesh()."
            )
        kinds = {device.device_kind for device in mesh.devices.flat}
        if kinds != {_device_kind(gpu)}:
            raise ValueError(
                f"mesh holds {sorted(kinds)} devices but gpu={gpu!r} ({_device_kind(gpu)!r}); "
                f"pass the gpu the mesh was made for."
            )
        if devices is not None and mesh.devices.size != devices:
            raise ValueError(
                f"devices={devices} does not match the mesh's {mesh.devices.size} devices."
            )
    placed_args, placed_kwargs = jax.tree_util.tree_map(
        lambda leaf: _place_leaf(leaf, mesh), (args, kwargs)
    )
    lowered = jax.jit(fn).trace(*placed_args, **placed_kwargs).lower()
    if compiler_options:
        compiled = lowered.compile(compiler_options=dict(compiler_options))
    else:
        compiled = lowered.compile()
    text = compiled.as_text()
    if not isinstance(text, str):
        raise RuntimeError("compile_for_gpu: the compiled executable has no HLO text.")
    platforms: list[str] = []
    for sharding in jax.tree_util.tree_leaves(
        (compiled.input_shardings, compiled.output_shardings)
    ):
        platforms.extend(device.platform for device in getattr(sharding, "device_set", ()))
    _check_gpu_text(text, platforms)
    return text


# --------------------------------------------------------------------------- parse


@dataclass(frozen=True, slots=True)
class AsyncEvent:
    """One asynchronous start or done instruction, in schedule order.

    Attributes:
        index: position of the instruction in its computation (schedule order).
        name: instruction name without ``%``.
        opcode: e.g. ``"call-start"``, ``"async-done"``, ``"collective-permute-start"``,
            ``"send"``, ``"recv-done"``.
        kind: ``"compute"`` (a stream-annotated region or other async computation),
            ``"collective"`` or ``"copy"``.
        phase: ``"start"`` or ``"done"``.
        start: name of the start this event belongs to (its own name for a start).
        collective: for collectives, the operation, e.g. ``"collective-permute"``,
            ``"all-gather"``, ``"collectives-group"``; else ``None``.
        called_computation: the computation a start runs (``to_apply``/``calls``), if any.
        frontend_attributes: ``(key, value)`` pairs, sorted by key.
        stream_annotation: ``_xla_stream_annotation`` value, if any.
        scheduling_group_id: ``_scheduling_group_id`` value, if any.
        collectives_group: ``_collectives_group`` value, if any (often ``""``).
        is_sync: ``collective_backend_config.is_sync`` from the backend config, if present.
    """

    index: int
    name: str
    opcode: str
    kind: str
    phase: str
    start: str
    collective: str | None
    called_computation: str | None
    frontend_attributes: tuple[tuple[str, str], ...]
    stream_annotation: str | None
    scheduling_group_id: str | None
    collectives_group: str | None
    is_sync: bool | None

    @property
    def stream_id(self) -> int | None:
        """The stream annotation as an int, or ``None`` (absent or e.g. ``"collective"``)."""
        if self.stream_annotation is None:
            return None
        try:
            return int(self.stream_annotation)
        except ValueError:
            return None


@dataclass(frozen=True, slots=True)
class WhileLoop:
    """A ``while`` instruction and what the GPU does per iteration.

    Attributes:
        name: instruction name.
        computation: computation holding the ``while``.
        body: body computation name.
        condition: condition computation name.
        known_trip_count: from ``backend_config`` ``"known_trip_count":{"n":...}``; ``None``
            means XLA does not know it, so the GPU copies the predicate to the host and
            waits every iteration.
        body_kernels: kernel launches (``fusion``/``custom-call``) per iteration of the body,
            following nested ``call``/async/``conditional``/``while`` computations once each.
        condition_kernels: the same for the condition.
    """

    name: str
    computation: str
    body: str
    condition: str
    known_trip_count: int | None
    body_kernels: int
    condition_kernels: int


@dataclass(frozen=True, slots=True)
class ComputationSchedule:
    """Asynchronous events of one computation, in schedule order.

    Attributes:
        name: computation name.
        is_entry: whether this is the ENTRY computation.
        execution_thread: ``execution_thread`` printed after the computation, if any.
        instruction_count: number of instructions.
        events: async starts and dones in order (``async-update`` is left out).
        kernels: number of ``fusion``/``custom-call`` instructions directly in it.
        synchronous_collectives: names of collectives not split into start/done.
        max_async_calls_in_flight: most compute regions started and not yet done at once.
        max_collectives_in_flight: most collectives started and not yet done at once;
            starts whose backend config says ``"is_sync":true`` do not count.
        dot_kernels_during_collectives: GEMM-bearing kernels issued while a collective is in
            flight (a ``call-start`` counts the GEMM kernels of its region).
    """

    name: str
    is_entry: bool
    execution_thread: str | None
    instruction_count: int
    events: tuple[AsyncEvent, ...]
    kernels: int
    synchronous_collectives: tuple[str, ...]
    max_async_calls_in_flight: int
    max_collectives_in_flight: int
    dot_kernels_during_collectives: int


@dataclass(frozen=True, slots=True)
class Schedule:
    """The schedule of a compiled HLO module, as ``parse_schedule`` reads it.

    Attributes:
        module_name: the ``HloModule`` name.
        entry: name of the ENTRY computation.
        computations: every non-fused computation, in text order (fusion bodies and
            reducers are left out: they run inside one kernel).
        while_loops: every ``while`` instruction.
        max_async_calls_in_flight: maximum over computations.
        max_collectives_in_flight: maximum over computations.
        stream_ids: integer stream annotations on async starts.
        dot_kernels_during_collectives: sum over computations.
        kernels: kernels one run of ENTRY launches, loop and branch bodies counted once
            (``fusion`` / ``custom-call`` instructions, through calls, loops and branches).
        dot_kernels: the matmul- or convolution-bearing ones among ``kernels``.
    """

    module_name: str
    entry: str
    computations: tuple[ComputationSchedule, ...]
    while_loops: tuple[WhileLoop, ...]
    max_async_calls_in_flight: int
    max_collectives_in_flight: int
    stream_ids: frozenset[int]
    dot_kernels_during_collectives: int
    kernels: int = 0
    dot_kernels: int = 0

    def computation(self, name: str) -> ComputationSchedule:
        """Returns the computation called ``name`` (with or without ``%``)."""
        name = name.lstrip("%")
        for computation in self.computations:
            if computation.name == name:
                return computation
        raise KeyError(
            f"no scheduled computation {name!r}; have {[c.name for c in self.computations]}"
        )

    @property
    def entry_schedule(self) -> ComputationSchedule:
        """The ENTRY computation's schedule."""
        return self.computation(self.entry)

    @property
    def events(self) -> tuple[AsyncEvent, ...]:
        """All async events, computation by computation."""
        return tuple(event for c in self.computations for event in c.events)


@dataclass(frozen=True, slots=True)
class _Instruction:
    name: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str  # the text after the operand list
    shape: str = ""  # the result shape, e.g. ``f32[8,128]{1,0}`` or a parenthesised tuple
    arguments: str = ""  # the text inside the operand list, e.g. ``0`` for ``parameter(0)``


@dataclass(frozen=True, slots=True)
class _Computation:
    name: str
    is_entry: bool
    execution_thread: str | None
    instructions: tuple[_Instruction, ...]


_COMPUTATION_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s+\(.*\{\s*$")
_COMPUTATION_END = re.compile(r'^\}(?:,\s*execution_thread="([^"]*)")?')
_INSTRUCTION_HEAD = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s+=\s+")
_OPERAND_NAME = re.compile(r"%([^\s,()]+)")
_ATTRIBUTE_PAIR = re.compile(r'([\w.$-]+)="((?:[^"\\]|\\.)*)"')

_COLLECTIVES = frozenset(
    {
        "all-gather",
        "all-reduce",
        "all-to-all",
        "collective-broadcast",
        "collective-permute",
        "ragged-all-to-all",
        "reduce-scatter",
        "send",
        "recv",
    }
)
_KERNEL_OPCODES = frozenset({"fusion", "custom-call"})
_GEMM_TARGET = re.compile(r"gemm|matmul|cublas|conv", re.IGNORECASE)


def _skip_balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``; honours quotes."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = [pairs[text[start]]]
    position = start + 1
    in_string = False
    while position < len(text) and stack:
        char = text[position]
        if in_string:
            if char == "\\":
                position += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in pairs:
            stack.append(pairs[char])
        elif char == stack[-1]:
            stack.pop()
        position += 1
    return position


def _parse_instruction(line: str) -> _Instruction | None:
    head = _INSTRUCTION_HEAD.match(line)
    if head is None:
        return None
    position = head.end()
    shape_start = position
    # The shape: a tuple shape is parenthesised and may hold spaces.
    if line.startswith("(", position):
        position = _skip_balanced(line, position)
    else:
        while position < len(line) and not line[position].isspace():
            position = _skip_balanced(line, position) if line[position] in "{[" else position + 1
    shape = line[shape_start:position].strip()
    position += 1
    paren = line.find("(", position)
    if paren < 0:
        return None
    opcode = line[position:paren].strip()
    end = _skip_balanced(line, paren)
    operands = tuple(_OPERAND_NAME.findall(line[paren + 1 : end - 1]))
    return _Instruction(
        head.group(1), opcode, operands, line[end:], shape, line[paren + 1 : end - 1]
    )


def _attribute_group(attributes: str, key: str) -> str | None:
    """The bracketed value of ``key=`` (e.g. ``frontend_attributes={...}``), without brackets."""
    match = re.search(rf"(?:^|[\s,]){re.escape(key)}=", attributes)
    if match is None:
        return None
    start = match.end()
    if start < len(attributes) and attributes[start] in "{(":
        return attributes[start + 1 : _skip_balanced(attributes, start) - 1]
    value = re.match(r'"((?:[^"\\]|\\.)*)"|([^\s,]+)', attributes[start:])
    if value is None:
        return None
    return value.group(1) if value.group(1) is not None else value.group(2)


def _called(attributes: str, *keys: str) -> tuple[str, ...]:
    names: list[str] = []
    for key in keys:
        value = _attribute_group(attributes, key)
        if value:
            names.extend(name.lstrip("%") for name in re.split(r"[\s,]+", value) if name)
    return tuple(names)


def _frontend_attributes(instruction: _Instruction) -> dict[str, str]:
    group = _attribute_group(instruction.attributes, "frontend_attributes")
    return dict(_ATTRIBUTE_PAIR.findall(group)) if group else {}


def _backend_config(instruction: _Instruction) -> dict[str, Any]:
    group = _attribute_group(instruction.attributes, "backend_config")
    if not group:
        return {}
    try:
        parsed = json.loads("{" + group + "}")
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _split_computations(hlo_text: str) -> tuple[str, list[_Computation]]:
    module_name = ""
    computations: list[_Computation] = []
    current: tuple[str, bool, list[_Instruction]] | None = None
    for line in hlo_text.splitlines():
        if line.startswith("HloModule "):
            module_name = line.split()[1].rstrip(",")
            continue
        if current is None:
            header = _COMPUTATION_HEADER.match(line)
            if header:
                current = (header.group(2), bool(header.group(1)), [])
            continue
        end = _COMPUTATION_END.match(line)
        if end:
            name, is_entry, instructions = current
            computations.append(_Computation(name, is_entry, end.group(1), tuple(instructions)))
            current = None
            continue
        instruction = _parse_instruction(line)
        if instruction is not None:
            current[2].append(instruction)
    return module_name, computations


class _Module:
    """Index over parsed computations, for the recursive questions the schedule asks."""

    def __init__(self, computations: Sequence[_Computation]) -> None:
        self.by_name = {c.name: c for c in computations}

    def root(self, name: str | None) -> _Instruction | None:
        computation = self.by_name.get(name or "")
        return computation.instructions[-1] if computation and computation.instructions else None

    def contains_dot(self, name: str, seen: frozenset[str] = frozenset()) -> bool:
        computation = self.by_name.get(name)
        if computation is None or name in seen:
            return False
        for instruction in computation.instructions:
            if instruction.opcode in ("dot", "convolution", "ragged-dot", "scaled-dot"):
                return True
            if self._is_gemm_custom_call(instruction):
                return True
            for callee in _called(instruction.attributes, "calls"):
                if self.contains_dot(callee, seen | {name}):
                    return True
        return False

    @staticmethod
    def _is_gemm_custom_call(instruction: _Instruction) -> bool:
        if instruction.opcode != "custom-call":
            return False
        target = _attribute_group(instruction.attributes, "custom_call_target") or ""
        return bool(_GEMM_TARGET.search(target))

    def is_dot_kernel(self, instruction: _Instruction) -> bool:
        if instruction.opcode == "custom-call":
            return self._is_gemm_custom_call(instruction) or any(
                self.contains_dot(callee)
                for callee in _called(instruction.attributes, "called_computations", "calls")
            )
        if instruction.opcode == "fusion":
            return any(
                self.contains_dot(callee) for callee in _called(instruction.attributes, "calls")
            )
        return False

    def _control_callees(self, instruction: _Instruction) -> tuple[str, ...]:
        """Computations run as separate launches (not fused into one kernel)."""
        if instruction.opcode in ("call", "call-start", "async-start"):
            return _called(instruction.attributes, "to_apply", "calls")
        if instruction.opcode == "while":
            return _called(instruction.attributes, "condition", "body")
        if instruction.opcode == "conditional":
            return _called(
                instruction.attributes,
                "branch_computations",
                "true_computation",
                "false_computation",
            )
        return ()

    def count_kernels(
        self, name: str, dots_only: bool = False, seen: frozenset[str] = frozenset()
    ) -> int:
        computation = self.by_name.get(name)
        if computation is None or name in seen:
            return 0
        total = 0
        for instruction in computation.instructions:
            if instruction.opcode in _KERNEL_OPCODES:
                total += 1 if not dots_only or self.is_dot_kernel(instruction) else 0
            for callee in self._control_callees(instruction):
                total += self.count_kernels(callee, dots_only, seen | {name})
        return total

    def control_computations(self) -> set[str]:
        """ENTRY plus everything reachable through control flow (not fusion bodies)."""
        entries = [c.name for c in self.by_name.values() if c.is_entry]
        reachable: set[str] = set()
        pending = list(entries)
        while pending:
            name = pending.pop()
            if name in reachable or name not in self.by_name:
                continue
            reachable.add(name)
            for instruction in self.by_name[name].instructions:
                pending.extend(self._control_callees(instruction))
        return reachable


def _classify(instruction: _Instruction) -> tuple[str, str, str | None] | None:
    """``(kind, phase, collective)`` for async start/done instructions, else ``None``."""
    opcode = instruction.opcode
    if opcode in ("send", "recv"):
        return "collective", "start", opcode
    if opcode in ("send-done", "recv-done"):
        return "collective", "done", opcode.removesuffix("-done")
    if opcode.endswith("-start"):
        base, phase = opcode.removesuffix("-start"), "start"
    elif opcode.endswith("-done"):
        base, phase = opcode.removesuffix("-done"), "done"
    else:
        return None
    if base == "call":
        return "compute", phase, None
    if base == "copy":
        return "copy", phase, None
    if base in _COLLECTIVES:
        return "collective", phase, base
    return "compute", phase, None  # async-start: refined by _refine_async


def _refine_async(start: _Instruction, module: _Module) -> tuple[str, str | None]:
    attributes = _frontend_attributes(start)
    wrapped = _called(start.attributes, "calls")
    root = module.root(wrapped[0]) if wrapped else None
    if root is not None:
        attributes = {**_frontend_attributes(root), **attributes}
    if "_collectives_group" in attributes:
        return "collective", "collectives-group"
    if root is not None and root.opcode in _COLLECTIVES:
        return "collective", root.opcode
    if root is not None and root.opcode.removesuffix("-start") in _COLLECTIVES:
        return "collective", root.opcode.removesuffix("-start")
    if root is not None and root.opcode == "copy":
        return "copy", None
    return "compute", None


def _schedule_computation(computation: _Computation, module: _Module) -> ComputationSchedule:
    events: list[AsyncEvent] = []
    starts: dict[str, AsyncEvent] = {}
    in_flight: dict[str, str] = {}  # start name -> kind
    max_compute = max_collectives = dots_during = kernels = 0
    synchronous: list[str] = []
    for index, instruction in enumerate(computation.instructions):
        if instruction.opcode in _KERNEL_OPCODES:
            kernels += 1
        collectives_now = sum(kind == "collective" for kind in in_flight.values())
        if collectives_now and module.is_dot_kernel(instruction):
            dots_during += 1
        if instruction.opcode in _COLLECTIVES and instruction.opcode not in ("send", "recv"):
            synchronous.append(instruction.name)
        classified = _classify(instruction)
        if classified is None or instruction.opcode == "async-update":
            continue
        kind, phase, collective = classified
        if phase == "done":
            start_name = instruction.operands[0] if instruction.operands else ""
            start_event = starts.get(start_name)
            if start_event is not None:
                kind, collective = start_event.kind, start_event.collective
            in_flight.pop(start_name, None)
        else:
            start_name = instruction.name
            if instruction.opcode == "async-start":
                kind, collective = _refine_async(instruction, module)
        attributes = _frontend_attributes(instruction)
        called = _called(instruction.attributes, "to_apply", "calls")
        if instruction.opcode == "async-start" and called:
            root = module.root(called[0])
            if root is not None and root.opcode == "call":
                inner = _called(root.attributes, "to_apply")
                called = inner or called
                attributes = {**_frontend_attributes(root), **attributes}
        collective_config = _backend_config(instruction).get("collective_backend_config", {})
        is_sync = collective_config.get("is_sync") if isinstance(collective_config, dict) else None
        event = AsyncEvent(
            index=index,
            name=instruction.name,
            opcode=instruction.opcode,
            kind=kind,
            phase=phase,
            start=start_name,
            collective=collective,
            called_computation=called[0] if called and phase == "start" else None,
            frontend_attributes=tuple(sorted(attributes.items())),
            stream_annotation=attributes.get("_xla_stream_annotation"),
            scheduling_group_id=attributes.get("_scheduling_group_id"),
            collectives_group=attributes.get("_collectives_group"),
            is_sync=is_sync if isinstance(is_sync, bool) else None,
        )
        events.append(event)
        if phase == "start":
            starts[start_name] = event
            if event.is_sync is not True:  # XLA runs "is_sync" ones on the compute stream
                in_flight[start_name] = kind
            if kind == "compute" and collectives_now and event.called_computation:
                dots_during += module.count_kernels(event.called_computation, dots_only=True)
        max_compute = max(max_compute, sum(k == "compute" for k in in_flight.values()))
        max_collectives = max(max_collectives, sum(k == "collective" for k in in_flight.values()))
    return ComputationSchedule(
        name=computation.name,
        is_entry=computation.is_entry,
        execution_thread=computation.execution_thread,
        instruction_count=len(computation.instructions),
        events=tuple(events),
        kernels=kernels,
        synchronous_collectives=tuple(synchronous),
        max_async_calls_in_flight=max_compute,
        max_collectives_in_flight=max_collectives,
        dot_kernels_during_collectives=dots_during,
    )


def _known_trip_count(instruction: _Instruction) -> int | None:
    trip = _backend_config(instruction).get("known_trip_count")
    if isinstance(trip, dict) and "n" in trip:
        try:
            return int(trip["n"])
        except (TypeError, ValueError):
            return None
    return None


def parse_schedule(hlo_text: str) -> Schedule:
    """Reads the async regions, collectives and loops out of scheduled HLO text.

    Args:
        hlo_text: the text of a scheduled module, e.g. from ``compile_for_gpu`` or an XLA
            ``*after_optimizations.txt`` dump.

    Returns:
        A ``Schedule``. Its computations are ENTRY and everything reachable through
        ``call``/``while``/``conditional``/async instructions, in text order; fused
        computations are left out.

    Raises:
        ValueError: the text holds no ENTRY computation.

    Example:
        >>> schedule = parse_schedule(compile_for_gpu(f, x))
        >>> schedule.max_async_calls_in_flight, sorted(schedule.stream_ids)
        (2, [1, 2])
    """
    module_name, computations = _split_computations(hlo_text)
    entries = [c.name for c in computations if c.is_entry]
    if not entries:
        raise ValueError("hlo_text holds no ENTRY computation; pass a whole HLO module's text.")
    module = _Module(computations)
    control = module.control_computations()
    scheduled = tuple(_schedule_computation(c, module) for c in computations if c.name in control)
    loops = []
    for computation in computations:
        if computation.name not in control:
            continue
        for instruction in computation.instructions:
            if instruction.opcode != "while":
                continue
            body = (_called(instruction.attributes, "body") or ("",))[0]
            condition = (_called(instruction.attributes, "condition") or ("",))[0]
            loops.append(
                WhileLoop(
                    name=instruction.name,
                    computation=computation.name,
                    body=body,
                    condition=condition,
                    known_trip_count=_known_trip_count(instruction),
                    body_kernels=module.count_kernels(body),
                    condition_kernels=module.count_kernels(condition),
                )
            )
    stream_ids = frozenset(
        event.stream_id
        for c in scheduled
        for event in c.events
        if event.phase == "start" and event.stream_id is not None
    )
    return Schedule(
        module_name=module_name,
        entry=entries[0],
        computations=scheduled,
        while_loops=tuple(loops),
        max_async_calls_in_flight=max((c.max_async_calls_in_flight for c in scheduled), default=0),
        max_collectives_in_flight=max((c.max_collectives_in_flight for c in scheduled), default=0),
        stream_ids=stream_ids,
        dot_kernels_during_collectives=sum(c.dot_kernels_during_collectives for c in scheduled),
        kernels=module.count_kernels(entries[0]),
        dot_kernels=module.count_kernels(entries[0], dots_only=True),
    )
