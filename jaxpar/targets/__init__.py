"""jaxpar's targets, each a thing: a module per target (``cpu.py``, ``gpu.py``, ``tpu.py``)
defines its ``TARGET``, a ``Target`` holding every fact jaxpar knows of it: the backends
that mean it, its option defaults (its ``TargetRow``), its cost profile and measured
figures, what its programs can do (the capabilities code asks instead of comparing
names), its unroll rule (how ``unroll="cost"`` picks a scan's factor: ``unroll.py``), the
words its plans use and the candidates its measurement times.

Every module of this package that defines ``TARGET`` is registered when the package is
imported (``pkgutil``): a new chip is one module and its tests. Elsewhere code asks the
target object (``get(settings.target).emits_streams``), never its name.

Which target a device is (``target="auto"``: ``of_this_machine``; any device:
``of_device``): the most specific registered target of its platform, one whose
``device_kinds`` patterns match the device's kind (the longest pattern matched wins),
else the platform's fallback (a target declaring no kinds, else the first by ``rank``).
A TPU v6e is the ``tpu`` target's (the v5e's figures, and its plans say so:
``fallback_note``) until a module declaring ``device_kinds=("TPU v6 lite",)`` is
registered.

Example::

    from jaxpar import targets

    targets.get("tpu").profile.peak_flops
    [t.name for t in targets.known()]  # ["gpu", "cpu", "tpu"]
    targets.of_device("tpu", "TPU v5 lite").name  # "tpu"

Sharp edges:
  * ``register`` is for tests and plug-ins: ``_tune.CANDIDATES`` and ``_options.TARGETS``
    (the ``Target`` type's names) are read from the registry when those modules are
    imported; a target registered later is known to ``get``, ``known`` and
    ``of_device``, and ``Options`` (``target=`` of ``parallel_branches`` and ``inspect``)
    accepts its name: they read the registry at each call.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

import jax

from .._model.gpu import GpuProfile
from .._spelling import did_you_mean
from .profile import DeviceProfile
from .unroll import UnrollRule, rule_of_thumb

CPU_MEMORY_BYTES = float(16 * 2**30)


@dataclasses.dataclass(frozen=True)
class TargetRow:
    """One row of the target table (``_options.TARGETS``): a target's option defaults.

    Attributes:
      name: the target (``target=`` of ``parallel_branches``).
      backends: ``jax.default_backend()`` names that mean it for ``target="auto"``.
      defaults: the value of each option (a column) when it is ``"auto"``: the pass
        options, ``group_collectives``, and a pass that only the target turns on under
        its own name (``share_common``); a column left out is off (``False``, ``None``).
      memory_bytes: the device's memory, which scales the memory budget's floor
        (``memory_floor``); on target ``"gpu"`` the GPU profile's figure instead.
    """

    name: str
    backends: tuple[str, ...]
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    memory_bytes: float = CPU_MEMORY_BYTES

    def default(self, column: str, kind: Any = None) -> Any:
        """The column's value; left out, the ``kind``'s off value (an ``OptionKind``;
        None: a switch, off is ``False``)."""
        return self.defaults.get(column, False if kind is None else kind.off)


@dataclasses.dataclass(frozen=True)
class PlanWords:
    """The words a target's plans use where they differ between targets.

    Attributes:
      dynamic_loop: a ``while`` loop whose trip count XLA does not know.
      static_loop_gain: what making such a loop a scan gains (appended to the decision's
        reason; empty where nothing is said).
    """

    dynamic_loop: str = "dynamic while loop"
    static_loop_gain: str = ""


@dataclasses.dataclass(frozen=True)
class Target:
    """Everything jaxpar knows of one target.

    Attributes:
      row: its option defaults, backends and memory (``TargetRow``); ``name``,
        ``backends`` and ``memory_bytes`` read it.
      platform: the ``platform`` of its devices (``jax.Device.platform``,
        ``jax.default_backend()``).
      device_kinds: the ``jax.Device.device_kind`` values it covers, as patterns
        (``fnmatch``, case-insensitive: ``"TPU v6*"``); empty: any device of its platform.
        ``of_device`` picks the target whose pattern matches the device most specifically.
      figures_of: the chip its figures were measured on (``"TPU v5e"``), which plans name
        where the target stands in for a device kind it does not cover (``fallback_note``);
        empty: figures not tied to one chip.
      profile: its cost profile (``_model.cost.DeviceProfile``); on a GPU, the generic GPU's.
      emits_streams: independent work is emitted on streams (elsewhere a section's parts
        run one after another, and plans say so).
      compiles_with_xla_options: a plan chooses XLA options per function (CUDA-graph modes),
        priced with the GPU model (``Settings.gpu``); the function is lowered and compiled
        with them.
      measured_by_default: ``measure="auto"`` times candidates where the call runs on
        this target's device.
      sums_sliced_members: ``bound_fusions`` replaces sums over members jaxpar sliced out
        by one reduction (a GPU's kernels each cost a launch; XLA fuses them elsewhere).
      unroll_rule: how ``unroll="cost"`` picks each scan's factor (``unroll.UnrollRule``:
        ``passes/unroll_scans`` asks it); default the rule of thumb.
      words: the words its plans use (``PlanWords``).
      candidates: the programs its measurement times besides plain ``jax.jit`` and the
        chosen options: label -> the ``Options`` fields each overrides
        (``_tune.CANDIDATES`` orders them).
      rank: where it is listed (``known``): lower first.
    """

    row: TargetRow
    platform: str
    profile: DeviceProfile
    device_kinds: tuple[str, ...] = ()
    figures_of: str = ""
    emits_streams: bool = False
    compiles_with_xla_options: bool = False
    measured_by_default: bool = True
    sums_sliced_members: bool = False
    unroll_rule: UnrollRule = rule_of_thumb
    words: PlanWords = PlanWords()
    candidates: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    rank: int = 100
    # The cost profile for a given GPU (``Settings.gpu``) where the target has one.
    profile_of_gpu: Callable[[GpuProfile], DeviceProfile] | None = None

    @property
    def name(self) -> str:
        return self.row.name

    @property
    def backends(self) -> tuple[str, ...]:
        return self.row.backends

    @property
    def memory_bytes(self) -> float:
        return self.row.memory_bytes

    def on_platform(self, platform: str | None) -> bool:
        """Whether devices of ``platform`` (``jax.Device.platform`` or a backend name) are
        its."""
        return platform == self.platform or platform in self.backends

    def kind_match(self, device_kind: str) -> int:
        """How specifically it covers ``device_kind``: the length of the longest of its
        ``device_kinds`` patterns that matches (case-insensitive), 0 for none."""
        kind = device_kind.lower()
        return max((len(p) for p in self.device_kinds if fnmatch.fnmatchcase(kind, p.lower())),
                   default=0)

    def cost_profile(self, gpu: GpuProfile | None = None) -> DeviceProfile:
        """Its cost profile; with ``gpu`` on a target priced by the GPU model, that GPU's."""
        if gpu is not None and self.profile_of_gpu is not None:
            return self.profile_of_gpu(gpu)
        return self.profile


_REGISTRY: dict[str, Target] = {}


def register(module: Any) -> Target:
    """Registers the ``TARGET`` of ``module`` (a module of this package, or any object with
    a ``TARGET`` attribute) and returns it; registering a name again replaces it.

    Raises:
      TypeError: ``module`` has no ``TARGET`` that is a ``Target``.
    """
    target = getattr(module, "TARGET", None)
    if not isinstance(target, Target):
        raise TypeError(f"a target module defines TARGET = Target(...); {module!r} has "
                        f"{type(target).__name__}")
    _REGISTRY[target.name] = target
    of_device.cache_clear()
    return target


def unregister(name: str) -> None:
    """Forgets the target ``name`` (tests registering a target of their own)."""
    _REGISTRY.pop(name, None)
    of_device.cache_clear()


def known() -> tuple[Target, ...]:
    """Every registered target, by ``rank`` (then name)."""
    return tuple(sorted(_REGISTRY.values(), key=lambda t: (t.rank, t.name)))


def names() -> tuple[str, ...]:
    return tuple(t.name for t in known())


def rows() -> tuple[TargetRow, ...]:
    """The target table (``_options.TARGETS``): each known target's ``TargetRow``."""
    return tuple(t.row for t in known())


def get(name: str) -> Target:
    """The target ``name``.

    Raises:
      ValueError: no target of that name, naming the known ones.
    """
    found = _REGISTRY.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"target must be one of {', '.join(map(repr, names()))}, "
                         f"got {name!r}{did_you_mean(str(name), names())} (a new target is "
                         f"a module of jaxpar/targets defining TARGET)")
    return found


def graph_modes(name: str) -> bool:
    """Whether the target ``name`` compiles with XLA options its plan chose (False for a
    name no module declares: a row of a table made for a test, ``Options.for_tables``)."""
    found = _REGISTRY.get(name)
    return found is not None and found.compiles_with_xla_options


def of_platform(platform: str | None) -> Target | None:
    """The target whose devices have ``platform`` (``jax.Device.platform``), whatever their
    kind: the platform's fallback (``of_device``); None if none."""
    return of_device(platform, "")


@functools.lru_cache(maxsize=16)
def of_device(platform: str | None, device_kind: str) -> Target | None:
    """The most specific registered target of a device of ``platform`` and
    ``device_kind`` (``jax.Device``'s): among the targets of its platform, the one whose
    ``device_kinds`` match it most specifically (``Target.kind_match``; ties: ``rank``),
    else the platform's fallback (one declaring no kinds, else the first by ``rank``);
    None if no target has the platform."""
    on = [t for t in known() if t.on_platform(platform)]
    if not on:
        return None
    best = max(on, key=lambda t: t.kind_match(device_kind))
    if best.kind_match(device_kind):
        return best  # max keeps the first (lowest rank) of equal matches
    return next((t for t in on if not t.device_kinds), on[0])


@functools.cache
def local_device() -> tuple[str, str]:
    """This process's first device: its ``platform`` and ``device_kind`` (a process's
    devices do not change once its backend started)."""
    device = jax.devices()[0]
    return device.platform, device.device_kind


def of_this_machine() -> Target | None:
    """The target of this machine's first device (``of_device``): what ``target="auto"``
    means."""
    return of_device(*local_device())


def fallback_note(name: str) -> str | None:
    """What a plan for the target ``name`` says where this machine's device is one the
    target only stands in for (its kind not among its ``device_kinds``: a TPU v6e planned
    with the v5e's figures), or None. Never raises (a report must not break a call)."""
    try:
        target = _REGISTRY.get(name)
        platform, kind = local_device()
        if target is None or not target.device_kinds or not target.on_platform(platform) \
                or target.kind_match(kind):
            return None
    except Exception:
        return None
    figures = f"{target.figures_of}'s figures" if target.figures_of else "its figures"
    return (f"this {kind} is planned with target {name!r}, {figures}: no target module "
            f"covers its device kind (a new chip is one module of jaxpar/targets/ declaring "
            f"device_kinds)")


def device_profile(target: str, gpu: GpuProfile | None = None) -> DeviceProfile:
    """The cost profile of ``target``; on ``"gpu"``, of ``gpu`` (default the generic one)."""
    return get(target).cost_profile(gpu)


def _register_package() -> None:
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            if hasattr(module, "TARGET"):
                register(module)


_register_package()
