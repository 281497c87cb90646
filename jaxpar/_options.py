"""Options of ``parallel_branches`` and ``inspect``, validated in one place.

Example::

    options = Options.create(max_streams=2, target="gpu")
    settings = options.resolve()   # Settings for "gpu": nothing "auto" left

Sharp edges:
  * ``"auto"`` for the pass and collective switches means "the default for the
    target", decided when the function is traced, not when it is decorated.
    ``Options.resolve`` is the only place that reads it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple

import jax

from ._flags import (
    async_compute_limit,
    command_buffer_mode,
    command_buffer_mode_set,
    xla_flags_text,
)
from ._gpu_model import CommandBufferMode, GpuProfile, gpu_profile, local_gpu_profile

Target = Literal["auto", "gpu", "cpu", "tpu"]
Switch = bool | Literal["auto"]
Unroll = int | Literal["auto", "cost"] | None

TARGETS = ("auto", "gpu", "cpu", "tpu")
# ``command_buffers``: choose per function, keep the process's mode, or one mode.
COMMAND_BUFFER_CHOICES = ("auto", "keep", *(mode.value for mode in CommandBufferMode))
_BACKEND_TARGETS = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "cpu": "cpu", "tpu": "tpu"}

# What each target runs when an option is "auto"; measured with benchmarks/loops_cpu.py
# and benchmarks/gpu_suite.py (numbers in docs/benchmarks.md). On a GPU every loop trip
# costs launches and a trip-count check, so fewer, fuller trips win. share_common: XLA's
# CSE cannot see into stream regions, so on the GPU equal equations are merged before
# planning; elsewhere XLA's own CSE does it.
TARGET_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpu": {"fuse_scans": True, "batch_scans": True, "batch_branches": True,
            "batch_matmuls": True, "unroll": "cost", "share_common": True,
            "group_collectives": True},
    "cpu": {"fuse_scans": False, "batch_scans": False, "batch_branches": False,
            "batch_matmuls": False, "unroll": None, "share_common": False,
            "group_collectives": False},
    # Measured on a TPU v5e (benchmarks/tpu.sh, docs/benchmarks.md): batching identical
    # scans and reading small loops by blocks pay; fusing different loops, batching
    # members and matmuls did not (x0.99-1.25), so they are off.
    "tpu": {"fuse_scans": False, "batch_scans": True, "batch_branches": False,
            "batch_matmuls": False, "unroll": "cost", "share_common": False,
            "group_collectives": False},
}


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryBudget:
    """How many more bytes than the plain program jaxpar's program may need at its peak
    (``_plan.budget``): the more of ``fraction`` of the plain program's footprint (its
    arguments, outputs and temporaries) and ``extra_bytes``."""

    fraction: float = 0.10
    extra_bytes: float = float(2**20)

    def allowed(self, plain_bytes: float) -> float:
        return max(self.fraction * plain_bytes, self.extra_bytes)


# The default budget: 10% of the plain program's footprint or 1 MiB, whichever is more.
DEFAULT_BUDGET = MemoryBudget()


class ResolveInputs(NamedTuple):
    """What ``Options.resolve`` read: the target, ``XLA_FLAGS``' async compute limit and
    CUDA-graph mode (the user's), the GPU profile (target ``"gpu"``), and the mode planned
    in, compiled in (a mode named by the options) and whether jaxpar chooses one."""

    target: str
    async_limit: int
    user_mode: CommandBufferMode
    profile: GpuProfile | None
    mode: CommandBufferMode
    compile_mode: CommandBufferMode | None
    choose: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    """Validated options; hashable, so they can key the rewrite cache."""

    max_streams: int = 4
    target: str = "auto"
    min_cost_us: float = 5.0
    fuse_scans: Switch = "auto"
    batch_scans: Switch = "auto"
    batch_branches: Switch = "auto"
    batch_matmuls: Switch = "auto"
    unroll: Unroll = "auto"
    group_collectives: Switch = "auto"
    force_streams: bool = False
    command_buffers: str = "auto"
    memory: str | float = "auto"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def create(cls, **kwargs: Any) -> Options:
        check_known(kwargs, cls.names())
        if isinstance(kwargs.get("command_buffers"), CommandBufferMode):
            kwargs["command_buffers"] = kwargs["command_buffers"].value
        options = cls(**kwargs)
        options.validate()
        return options

    def validate(self) -> None:
        if isinstance(self.max_streams, bool) or not isinstance(self.max_streams, int):
            raise TypeError(f"max_streams must be an int >= 1, got {self.max_streams!r}")
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}; use 1 to keep "
                             "everything on one stream")
        check_target(self.target)
        if (isinstance(self.min_cost_us, bool) or not isinstance(self.min_cost_us, (int, float))
                or not math.isfinite(self.min_cost_us) or self.min_cost_us < 0):
            raise ValueError(f"min_cost_us must be a finite number >= 0 (microseconds), "
                             f"got {self.min_cost_us!r}")
        for name in ("fuse_scans", "batch_scans", "batch_branches", "batch_matmuls",
                     "group_collectives"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or value == "auto"):
                raise ValueError(f"{name} must be True, False or 'auto', got {value!r}")
        if not isinstance(self.force_streams, bool):
            raise TypeError(f"force_streams must be True or False, got {self.force_streams!r}")
        unroll_setting(self.unroll, "gpu")
        memory_budget(self.memory)
        if not isinstance(self.command_buffers, str) \
                or self.command_buffers not in COMMAND_BUFFER_CHOICES:
            raise ValueError(
                f"command_buffers must be one of {', '.join(map(repr, COMMAND_BUFFER_CHOICES))}, "
                f"got {self.command_buffers!r}: 'auto' lets jaxpar choose XLA's CUDA-graph mode "
                "for this function (unless XLA_FLAGS sets one), 'keep' keeps the process's "
                "mode, a mode name compiles this function in that mode")

    def resolve_target(self, target: str | None = None) -> str:
        target = check_target(self.target if target is None else target)
        if target != "auto":
            return target
        return _BACKEND_TARGETS.get(jax.default_backend(), "cpu")

    def resolve(self, target: str | None = None, async_limit: int | None = None,
                command_buffers: CommandBufferMode | str | None = None,
                gpu: GpuProfile | str | None = None) -> Settings:
        """The settings of one analysis: every ``"auto"`` read here, and only here.

        Args:
          target: the target to plan for; default ``self.target`` (``"auto"`` is this
            machine's default backend).
          async_limit: XLA's cap on async calls in flight; default from ``XLA_FLAGS``
            (``_flags.async_compute_limit()``).
          command_buffers: the user's CUDA-graph mode (a ``CommandBufferMode`` or its name),
            kept like a mode ``XLA_FLAGS`` sets; default from ``XLA_FLAGS``
            (``_flags.command_buffer_mode()``). The ``command_buffers`` option decides
            whether jaxpar plans in it, chooses another, or compiles in a given one.
          gpu: the GPU to plan for on target ``"gpu"`` (a ``GpuProfile`` or a name
            ``_gpu_model.gpu_profile`` takes); default this machine's GPU, or the generic
            ``"gpu"`` profile without one (``_gpu_model.local_gpu_profile()``).
        """
        return self.settings_from(self.resolve_inputs(target, async_limit, command_buffers,
                                                      gpu))

    def resolve_inputs(self, target: str | None = None, async_limit: int | None = None,
                       command_buffers: CommandBufferMode | str | None = None,
                       gpu: GpuProfile | str | None = None) -> ResolveInputs:
        """What ``resolve`` reads from its arguments and the process (the target,
        ``XLA_FLAGS``, the GPU profile), checked: ``settings_from`` of it is ``resolve``'s
        answer. A decorated function reads it on every call and builds its settings once
        per distinct value (``ParallelBranches``)."""
        target = self.resolve_target(target)
        flags = xla_flags_text()
        limit = async_compute_limit(flags) if async_limit is None else async_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"async_limit must be an int >= 1, got {limit!r}")
        user_mode = (command_buffer_mode(flags) if command_buffers is None
                     else CommandBufferMode.parse(command_buffers))
        profile = None
        mode, compile_mode, choose = user_mode, None, False
        if target == "gpu":
            profile = local_gpu_profile() if gpu is None else gpu_profile(gpu)
            if self.command_buffers not in ("auto", "keep"):
                mode = compile_mode = CommandBufferMode.parse(self.command_buffers)
            else:
                # A mode the user set (XLA_FLAGS, or the caller's argument) is kept.
                explicit = command_buffers is not None or command_buffer_mode_set(flags)
                choose = (self.command_buffers == "auto" and not explicit
                          and not self.force_streams)
        return ResolveInputs(target, limit, user_mode, profile, mode, compile_mode, choose)

    def settings_from(self, inputs: ResolveInputs) -> Settings:
        """The ``Settings`` of these options for ``inputs`` (``resolve_inputs``)."""
        target, limit, user_mode, profile, mode, compile_mode, choose = inputs
        defaults = TARGET_DEFAULTS[target]

        def switch(name: str) -> bool:
            value = getattr(self, name)
            return bool(defaults[name]) if value == "auto" else bool(value)

        unroll = unroll_setting(self.unroll, target)
        # The rewrites the user asked for by name (not "auto"): the memory budget never
        # leaves them out (``_plan.budget``).
        explicit = frozenset(name for name in _SWITCHES if getattr(self, name) is True) | (
            frozenset({"unroll"}) if self.unroll not in ("auto", "cost", None) else frozenset())
        return Settings(
            target=target, max_streams=self.max_streams,
            streams_per_section=min(self.max_streams, limit),
            min_seconds=self.min_cost_us * 1e-6,
            fuse_scans=switch("fuse_scans"), batch_scans=switch("batch_scans"),
            batch_branches=switch("batch_branches"), batch_matmuls=switch("batch_matmuls"),
            unroll=unroll, share_common=bool(defaults["share_common"]),
            group_collectives=switch("group_collectives"),
            force_streams=self.force_streams,
            # Sections are priced against the compiled GPU program (force_streams keeps
            # those the pricing rejects, with its verdict); other targets emit no streams,
            # so their plans only show independence.
            gpu=profile,
            modes=ModePolicy(priced=mode, choose=choose, user=user_mode,
                             compile=compile_mode) if target == "gpu" else ModePolicy(),
            memory=memory_budget(self.memory), explicit=explicit)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


UnrollSetting = int | Literal["cost"] | None
UNROLL_BY_COST: Literal["cost"] = "cost"  # Settings.unroll: a factor per scan from the cost model


@dataclasses.dataclass(frozen=True, slots=True)
class ModePolicy:
    """The CUDA-graph mode policy of one analysis: which of XLA's modes (``_gpu_model.
    CommandBufferMode``) the plan is priced in, chosen among, compared with and compiled in.

    Off the GPU it is ``ModePolicy()``: nothing priced, nothing chosen. Hashable, as part
    of ``Settings`` (the rewrite cache's key).

    Attributes:
      priced: the mode stream sections and the batching passes' launches are priced in
        (the user's mode, the one the ``command_buffers`` option names, or the candidate
        being planned); None: priced in none (targets other than ``"gpu"``).
      choose: plan in each mode jaxpar can choose and keep the one the GPU model estimates
        fastest (``_plan.modes``); ``priced`` is then the user's mode, the one to beat.
      user: the mode the user's program runs in without jaxpar (the process's, from
        ``XLA_FLAGS``, or ``Options.resolve``'s argument); None off the GPU.
      compile: the mode the ``command_buffers`` option sets for this function's compile;
        None keeps the process's.
    """

    priced: CommandBufferMode | None = None
    choose: bool = False
    user: CommandBufferMode | None = None
    compile: CommandBufferMode | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """What one analysis runs with: ``Options`` resolved for a target and XLA's flags.

    Hashable (it keys the rewrite cache); nothing in it is ``"auto"``.

    Attributes:
      target: ``"gpu"``, ``"cpu"`` or ``"tpu"``.
      max_streams: the user's cap on streams per section.
      streams_per_section: ``min(max_streams, XLA's async compute limit)``.
      min_seconds: ``min_cost_us`` in seconds.
      fuse_scans, batch_scans, batch_branches, batch_matmuls, share_common: the passes
        to run.
      unroll: a fixed unroll factor, ``"cost"`` (a factor per scan from the cost
        model) or None (leave unroll factors alone).
      group_collectives: launch independent collectives together.
      force_streams: keep stream sections the GPU pricing rejects (priced all the same,
        so the report shows the verdict).
      gpu: the GPU's figures (``_gpu_model``) on target ``"gpu"``; None elsewhere.
      modes: the CUDA-graph mode policy (``ModePolicy``): the mode sections and launches
        are priced in, whether jaxpar chooses one, the user's, the one compiled in.
      memory: how many more temporary bytes than the plain program jaxpar's program may
        need (``_plan.budget``); None: any.
      explicit: the rewrites the user turned on by name (``batch_scans=True``, an
        ``unroll`` factor): kept whatever the memory budget says, with their cost shown.
    """

    target: str
    max_streams: int = 4
    streams_per_section: int = 2
    min_seconds: float = 5e-6
    fuse_scans: bool = False
    batch_scans: bool = False
    batch_branches: bool = False
    batch_matmuls: bool = False
    unroll: UnrollSetting = None
    share_common: bool = False
    group_collectives: bool = False
    force_streams: bool = False
    gpu: GpuProfile | None = None
    modes: ModePolicy = ModePolicy()
    memory: MemoryBudget | None = DEFAULT_BUDGET
    explicit: frozenset[str] = frozenset()

    def priced_in(self, mode: CommandBufferMode | None) -> Settings:
        """These settings with sections and launches priced in ``mode`` (a candidate
        mode, or None: priced in none)."""
        return dataclasses.replace(self, modes=dataclasses.replace(self.modes, priced=mode))

    def pass_switches(self) -> dict[str, Any]:
        """The keyword arguments of ``passes.apply_passes`` (its public names)."""
        return {"fuse_scans": self.fuse_scans, "batch_scans": self.batch_scans,
                "batch_branches": self.batch_branches, "batch_matmuls": self.batch_matmuls,
                "unroll": self.unroll,
                "share_common": self.share_common}


_SWITCHES = ("fuse_scans", "batch_scans", "batch_branches", "batch_matmuls")


def memory_budget(memory: Any) -> MemoryBudget | None:
    """The ``Settings.memory`` of a ``memory`` argument: ``"auto"`` (the default budget:
    10% or 1 MiB more than the plain program, whichever is more), ``"any"`` (no budget)
    or a number of bytes jaxpar's program may need beyond the plain program's.

    Raises:
      ValueError: none of those.
    """
    if memory == "auto":
        return DEFAULT_BUDGET
    if memory == "any":
        return None
    if isinstance(memory, (int, float)) and not isinstance(memory, bool) \
            and math.isfinite(memory) and memory >= 0:
        return MemoryBudget(fraction=0.0, extra_bytes=float(memory))
    raise ValueError(f"memory must be 'auto' (at most 10% or 1 MiB more temporary memory "
                     f"than the plain program), 'any' (no budget) or a number of bytes >= 0 "
                     f"jaxpar may add, got {memory!r}")


def unroll_setting(unroll: Any, target: str, api: str = "unroll") -> UnrollSetting:
    """The ``Settings.unroll`` of an ``unroll`` argument, on ``target``.

    ``"auto"`` means the target's default everywhere (``parallel_branches``, the passes):
    ``"cost"`` on GPUs, None elsewhere. ``"cost"`` is a factor per scan from the target's
    cost model; an int >= 1 a fixed factor; None leaves every scan alone.

    Raises:
      ValueError: none of those.
    """
    if unroll is None or (isinstance(unroll, int) and not isinstance(unroll, bool)
                          and unroll >= 1):
        return unroll
    if unroll == "auto":
        default: UnrollSetting = TARGET_DEFAULTS[target]["unroll"]
        return default
    if unroll == UNROLL_BY_COST:
        return UNROLL_BY_COST
    raise ValueError(f"{api} must be 'auto' (the target's default), 'cost' (a factor per "
                     f"scan from the cost model), None (leave scans alone) or an int >= 1, "
                     f"got {unroll!r}")


def check_target(target: Any, concrete: bool = False) -> str:
    """``target`` if it is one jaxpar knows (``concrete``: not ``"auto"``).

    Raises:
      ValueError: naming the valid targets.
    """
    valid = tuple(TARGET_DEFAULTS) if concrete else TARGETS
    if not isinstance(target, str) or target not in valid:
        raise ValueError(f"target must be one of {', '.join(map(repr, valid))}, "
                         f"got {target!r}")
    return target


def pass_defaults(target: str) -> dict[str, Any]:
    """The pass settings jaxpar uses by default on ``target``.

    Args:
        target: ``"gpu"``, ``"cpu"`` or ``"tpu"``.

    Returns:
        ``{"fuse_scans": bool, "batch_scans": bool, "batch_branches": bool, "batch_matmuls": bool,
        "unroll": "cost" | int | None, "share_common": bool}``, ready to pass to
        ``apply_passes(closed, **pass_defaults(target), target=target)``.

    Raises:
        ValueError: unknown ``target``.
    """
    check_target(target, concrete=True)
    return Options().resolve(target, async_limit=2,
                             command_buffers=CommandBufferMode.LHS).pass_switches()


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'max_streams'?)`` for a misspelled name, or ``""``."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


DISABLE_VARIABLE = "JAXPAR_DISABLE"


def disabled_by_environment() -> bool:
    """Whether ``JAXPAR_DISABLE`` is set (``1``, ``true``, ``yes`` or ``on``): decorated
    functions then run as plain ``jax.jit`` of the original function."""
    return os.environ.get(DISABLE_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def check_known(given: Iterable[str], valid: Iterable[str], api: str = "jaxpar") -> None:
    """Raises ``TypeError`` for names in ``given`` that are not in ``valid``, suggesting the
    closest valid name; every entry point that takes options uses it.

    Raises:
      TypeError: an unknown name, e.g. ``unknown jaxpar option 'max_stream' (did you
        mean 'max_streams'?); valid options are: ...``.
    """
    valid = list(valid)
    unknown = sorted(set(given) - set(valid))
    if unknown:
        named = ", ".join(repr(name) + did_you_mean(name, valid) for name in unknown)
        raise TypeError(f"unknown {api} option(s) {named}; valid options are: "
                        f"{', '.join(valid)}")
