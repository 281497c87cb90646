"""Compile a JAX function for an NVIDIA GPU on a machine without one.

XLA can compile for a GPU it cannot see: the CUDA PJRT plugin builds a *topology* from a
text description of the card (``jaxpar/_compiled/targets/<gpu>.txtpb``) and compiles against it.
The result is the optimized, scheduled HLO that XLA:GPU would run; ``jaxpar._compiled.schedule``
reads it (stream overlap, loop trip counts, asynchronous collectives).

Example::

    import jax, jax.numpy as jnp
    from jaxpar._compiled.gpu_compile import compile_for_gpu

    x = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    text = compile_for_gpu(lambda a: jnp.tanh(a @ a), x, gpu="h200")

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
    - ``compile_for_gpu`` keeps the HLO of its last ``_CACHE_SIZE`` compiles, keyed by what
      XLA compiles (the lowered module with its source locations, the devices, the compiler
      options, ``XLA_FLAGS``): the same program compiled again, e.g. by ``gpu_preview`` in
      another CUDA-graph mode, is not compiled twice. ``clear_compile_cache()`` empties it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .. import targets
from .._flags import xla_flags_text

__all__ = [
    "GPU_TARGETS",
    "CompiledProgram",
    "clear_compile_cache",
    "compile_for_gpu",
    "compiled_hlo",
    "compiled_program",
    "gpu_target_config",
    "lower_for_gpu",
    "make_gpu_mesh",
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
        f"version ({found}). Fix: {fix}, then run with JAX_PLATFORMS=cpu on a machine "
        f"without a GPU (otherwise the plugin tries to load CUDA in every JAX process and "
        f"prints an 'Unable to load CUDA' traceback)"
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
        The text-format proto shipped in ``jaxpar/_compiled/targets/``.

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
            f"{error}. Run with JAX_PLATFORMS=cpu (or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1), with "
            f"jax-cuda12-plugin and jax-cuda12-pjrt at exactly jaxlib's version (docs/guide.md, "
            f"'Seeing the GPU schedule without a GPU')."
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
    return all(getattr(targets.of_device(getattr(device, "platform", None),
                                         str(getattr(device, "device_kind", ""))),
                       "compiles_with_xla_options", False) for device in devices.flat)


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
    # The type jax.jit traces a value as (``jax.typeof``): a Python scalar weak, a NumPy
    # scalar (``np.float64`` is a ``float`` too) strong and of the canonical dtype, an
    # array weak where it is (``jax.device_put(0.5)``). Another type here would trace
    # another program than ``inspect``'s: a weak scalar made strong drops the
    # ``convert_element_type`` jax.jit keeps, a strong one made weak adds one.
    try:
        aval = jax.typeof(leaf)
    except TypeError:
        return leaf  # not an array: let jax.jit raise its own, precise error
    return jax.ShapeDtypeStruct(
        tuple(np.shape(leaf)),
        aval.dtype,
        sharding=NamedSharding(mesh, spec),
        weak_type=aval.weak_type,
    )


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


# The scheduled HLO of recent compiles, by what XLA compiled (``_compile_key``); a deviceless
# compile takes seconds, its text a few hundred KB at most.
_CACHE_SIZE = 64
_COMPILED: OrderedDict[tuple[Any, ...], CompiledProgram] = OrderedDict()


def clear_compile_cache() -> None:
    """Forgets the HLO ``compile_for_gpu`` kept, so the next compiles run XLA again."""
    _COMPILED.clear()


def _compile_key(lowered: Any, mesh: Any, compiler_options: Mapping[str, Any] | None
                 ) -> tuple[Any, ...]:
    # Locations included: the compiled HLO's metadata names the user's source lines.
    return (lowered.as_text(debug_info=True),
            tuple((device.id, device.device_kind) for device in mesh.devices.flat),
            tuple(sorted((str(k), repr(v)) for k, v in (compiler_options or {}).items())),
            xla_flags_text())


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
            ``pip install`` line), the program holds a host callback (which JAX lowers
            only with a GPU present), or the result is not GPU HLO.

    Example:
        >>> x = jax.ShapeDtypeStruct((128, 128), jnp.float32)
        >>> text = compile_for_gpu(lambda a: a @ a, x, gpu="h100")
        >>> "ENTRY" in text
        True
    """
    return compiled_hlo(
        lower_for_gpu(fn, *args, gpu=gpu, devices=devices, mesh=mesh, **kwargs),
        compiler_options,
    )


class GpuLowering(NamedTuple):
    """A program lowered for deviceless GPUs (``lower_for_gpu``)."""

    lowered: Any  # jax.stages.Lowered
    mesh: Any  # the mesh its arguments were placed on


def lower_for_gpu(
    fn: Callable[..., Any],
    *args: Any,
    gpu: str = "h200",
    devices: int | None = None,
    mesh: Any = None,
    **kwargs: Any,
) -> GpuLowering:
    """``compile_for_gpu`` up to lowering: ``jax.jit(fn)`` traced and lowered for ``gpu``,
    for a caller that reads what the trace did before it compiles (``compiled_hlo``).
    Arguments and errors as ``compile_for_gpu``'s."""
    import jax

    gpu = _check_gpu_name(gpu)
    if devices is not None:
        _check_devices(devices)
    _require_plugin()
    if mesh is None:
        mesh = make_gpu_mesh(gpu, 1 if devices is None else devices)
    else:
        _check_mesh(mesh, gpu, devices)
    placed_args, placed_kwargs = jax.tree_util.tree_map(
        lambda leaf: _place_leaf(leaf, mesh), (args, kwargs)
    )
    traced = jax.jit(fn).trace(*placed_args, **placed_kwargs)
    try:
        lowered = traced.lower()
    except RuntimeError as error:
        if "Unknown backend" not in str(error):
            raise
        # JAX lowers a host callback through the live backend of its platform.
        raise RuntimeError(
            "compile_for_gpu: lowering for the GPU asked for a live GPU backend, which a "
            "deviceless compile does not have; most often the program holds a host callback "
            "(jax.debug.print, jax.debug.callback, io_callback, pure_callback), which JAX "
            "lowers only with a GPU present. Compile the program without its callbacks "
            f"(JAX's error: {error})") from error
    return GpuLowering(lowered, mesh)


class CompiledProgram(NamedTuple):
    """What a deviceless GPU compile says of one program: its scheduled HLO text, and
    the bytes of its buffers from ``Compiled.memory_analysis()`` (temporaries: what XLA
    allocates beyond the arguments and results)."""

    hlo: str
    temp_bytes: int | None  # None: the compile reports no memory figures
    argument_bytes: int | None
    output_bytes: int | None


def compiled_program(lowering: GpuLowering,
                     compiler_options: Mapping[str, Any] | None = None) -> CompiledProgram:
    """Compiles a program from ``lower_for_gpu``; returns its scheduled HLO text and its
    memory figures (from the compile cache when XLA compiled the same program before).

    Raises:
        RuntimeError: the result is not GPU HLO.
    """
    import jax

    lowered, mesh = lowering
    key = _compile_key(lowered, mesh, compiler_options)
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key]
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
    memory = compiled.memory_analysis()
    program = CompiledProgram(
        text, *(None if memory is None else int(getattr(memory, field))
                for field in ("temp_size_in_bytes", "argument_size_in_bytes",
                              "output_size_in_bytes")))
    _COMPILED[key] = program
    while len(_COMPILED) > _CACHE_SIZE:
        _COMPILED.popitem(last=False)
    return program


def compiled_hlo(lowering: GpuLowering,
                 compiler_options: Mapping[str, Any] | None = None) -> str:
    """``compiled_program``'s HLO text.

    Raises:
        RuntimeError: the result is not GPU HLO.
    """
    return compiled_program(lowering, compiler_options).hlo


def _check_mesh(mesh: Any, gpu: str, devices: int | None) -> None:
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
