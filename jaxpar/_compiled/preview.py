"""``gpu_preview``: what XLA:GPU will do with a program, seen from a machine without a GPU.

Compiles the function twice deviceless for an H100 or H200 (plain ``jax.jit``
and with ``parallel_branches``) through the CUDA PJRT plugin, and reports what
the compiled schedules say: stream-annotated regions in flight together, the
stream ids, loops and their trip counts (a loop without one syncs with the host
every trip), kernels per loop trip, and collectives in flight together. Then it
estimates one run of each on the GPU (``jaxpar._compiled.estimate``): kernel launches per
run (loop bodies times trips), regions that really overlap other work, host
syncs, an estimated time, and a one-line verdict.

Example::

    preview = jaxpar.gpu_preview(f, a, b, xs, gpu="h200")
    print(preview)                  # plain vs jaxpar, side by side
    preview.jaxpar.async_in_flight  # 2
    preview.jaxpar.hlo              # the compiled HLO text
    preview.verdict                 # "slower by 16% (est. 28.8 us -> 33.3 us, ...): ..."
    preview.time_ratio              # 1.156: jaxpar / plain estimated time

Sharp edges:
  * Needs ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` at exactly jaxlib's
    version; the error names the ``pip install`` line.
  * The schedule is XLA's static plan (the latency-hiding scheduler with its
    analytical cost model), not a measurement; the time is a model of it, with
    CUDA-graph behaviour read from XLA's source (see ``jaxpar._compiled.estimate``). It judges
    the plain program in the CUDA-graph mode ``XLA_FLAGS`` sets (XLA's default ``lhs``
    without one), or in ``command_buffers`` when given, and jaxpar in the mode its plan
    chose for the function (compiled with the plan's ``xla_options``); the header
    names both. The GPU's figures are ``jaxpar._model.gpu``'s, or its calibration
    profile's when one exists (``benchmarks/calibrate.py``).
  * jaxlib 0.12.0.1 crashed the whole process (SIGSEGV in the PTX compiler)
    compiling a stream-annotated call holding a loop, deviceless, on our CPU
    machines; ``gpu_preview`` refuses that combination instead of crashing
    (``allow_known_crashes=True`` tries anyway).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from .. import _compat
from .._api import ParallelBranches, array_function
from .._flags import command_buffer_mode, command_buffer_options
from .._model.gpu import CommandBufferMode, GpuProfile, gpu_profile
from .._model.memory import format_bytes
from .._options import Options
from .._plan import LevelPlan
from .._program.primitives import MAY_HOLD_LOOPS
from .._report.plan import Plan
from .._report.timeline import PlanEstimate
from .._report.types import loop_decisions, subgraph_decisions
from .._spelling import check_known
from .._trace import StaticArgs
from ..passes import DecisionKind
from . import gpu_compile
from .estimate import Estimate, RegionFigures, estimate_hlo, verdict
from .schedule import parse_schedule

# jaxlib versions whose XLA crashed compiling stream-annotated loops deviceless.
_CRASHES_ON_ANNOTATED_LOOPS = frozenset({"0.12.0.1"})


@dataclasses.dataclass(frozen=True, slots=True)
class LoopFigures:
    """One ``while`` loop of a compiled program."""

    name: str
    known_trip_count: int | None  # None: the host syncs every trip
    kernels_per_trip: int


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduleFigures:
    """What one compiled program's schedule shows."""

    async_in_flight: int
    stream_ids: tuple[int, ...]
    loops: tuple[LoopFigures, ...]
    collectives_in_flight: int
    matmuls_during_collectives: int
    hlo: str = dataclasses.field(repr=False)
    kernels: int = 0  # launched by one run, loop bodies counted once
    matmul_kernels: int = 0  # the matmul- or convolution-bearing ones among them
    estimate: Estimate | None = dataclasses.field(default=None, repr=False)
    # Estimated microseconds per run under each CUDA-graph mode, ("lhs", 12.3), ...
    estimated_us_by_mode: tuple[tuple[str, float], ...] = ()
    # Temporary bytes the compile allocates (``Compiled.memory_analysis()``), in the mode
    # the program was compiled for (buffer assignment depends on it).
    temp_bytes: int | None = None

    @property
    def launches(self) -> int:
        """Kernels launched per run: loop bodies times their trip counts."""
        return self.estimate.launches if self.estimate else self.kernels

    @property
    def regions(self) -> tuple[RegionFigures, ...]:
        return self.estimate.regions if self.estimate else ()

    @property
    def overlapping_regions(self) -> int:
        """Regions in flight beside other work with no host-blocking op inside."""
        return self.estimate.overlapping_regions if self.estimate else 0

    @property
    def host_syncs(self) -> int:
        return self.estimate.host_syncs if self.estimate else 0

    @property
    def concurrent_kernels(self) -> int:
        """Kernels run as parallel CUDA-graph nodes beside others (``concurrent`` mode)."""
        return self.estimate.concurrent_kernels if self.estimate else 0

    @property
    def runs_concurrently(self) -> bool:
        """Real concurrency in the mode judged: parallel graph nodes, or stream regions
        that keep their overlap."""
        return bool(self.estimate and self.estimate.runs_concurrently)

    @property
    def estimated_us(self) -> float:
        return self.estimate.microseconds if self.estimate else 0.0

    @property
    def total_trips(self) -> int | None:
        """Trips over all loops (nested loops counted once); None if any is unknown."""
        if any(loop.known_trip_count is None for loop in self.loops):
            return None
        return sum(loop.known_trip_count or 0 for loop in self.loops)

    @property
    def host_sync_loops(self) -> int:
        return sum(loop.known_trip_count is None for loop in self.loops)

    def to_dict(self) -> dict[str, Any]:
        return {"async_in_flight": self.async_in_flight, "stream_ids": list(self.stream_ids),
                "loops": [dataclasses.asdict(loop) for loop in self.loops],
                "total_trips": self.total_trips, "host_sync_loops": self.host_sync_loops,
                "collectives_in_flight": self.collectives_in_flight,
                "matmuls_during_collectives": self.matmuls_during_collectives,
                "kernels": self.kernels, "matmul_kernels": self.matmul_kernels,
                "launches": self.launches, "overlapping_regions": self.overlapping_regions,
                "host_syncs": self.host_syncs, "estimated_us": self.estimated_us,
                "concurrent_kernels": self.concurrent_kernels,
                "runs_concurrently": self.runs_concurrently,
                "estimated_us_by_mode": dict(self.estimated_us_by_mode),
                "temp_bytes": self.temp_bytes,
                "estimate": self.estimate.to_dict() if self.estimate else None}


@dataclasses.dataclass(frozen=True, slots=True)
class GpuPreview:
    """Plain ``jax.jit`` against ``parallel_branches``, compiled for one GPU kind."""

    gpu: str
    devices: int
    plain: ScheduleFigures
    jaxpar: ScheduleFigures
    plan: Plan
    # The CUDA-graph mode judged in (and planned for), and where it came from:
    # "XLA_FLAGS" (the process's mode) or "argument" (gpu_preview's command_buffers).
    command_buffers: CommandBufferMode = CommandBufferMode.LHS
    mode_source: str = "XLA_FLAGS"
    # The mode jaxpar compiled its program in (its plan's choice; ``command_buffers``
    # when it kept the user's), and the XLA options that set it.
    jaxpar_command_buffers: CommandBufferMode = CommandBufferMode.LHS
    xla_options: tuple[tuple[str, str], ...] = ()

    @property
    def compiled(self) -> PlanEstimate:
        """The compile's pair of figures: plain ``jax.jit`` in the user's mode against
        jaxpar in its chosen mode, from the deviceless compiles (``Plan.estimate`` is the
        planning model's pair, the one ``inspect`` shows)."""
        chosen, mode = self.jaxpar_command_buffers, self.command_buffers
        source = (f"gpu_preview's deviceless {self.gpu.upper()} compile (jaxpar in "
                  f"{chosen.value} graphs, plain in {mode.value})" if chosen is not mode else
                  f"gpu_preview's deviceless {self.gpu.upper()} compile ({mode.value} graphs)")
        return PlanEstimate(self.plain.estimated_us, self.jaxpar.estimated_us, source)

    @property
    def decided_by(self) -> str:
        """``"planning model"`` where the compile agrees with the plan on direction
        (faster, slower or the same within 1%), else ``"compile"``: its verdict wins."""
        agree = direction(self.plan.estimate.ratio) == direction(self.compiled.ratio)
        return "planning model" if agree else "compile"

    @property
    def recommendation(self) -> str:
        """``"plain"`` where the decision's figures say jaxpar's program is slower than
        ``jax.jit``'s (then use ``jax.jit`` for this function), else ``"jaxpar"``."""
        figure = self.plan.estimate if self.decided_by == "planning model" else self.compiled
        return "plain" if direction(figure.ratio) == "slower" else "jaxpar"

    @property
    def decision(self) -> str:
        """One line: which pair of figures decides, and what it recommends."""
        model, compiled = direction(self.plan.estimate.ratio), direction(self.compiled.ratio)
        if self.decided_by == "planning model":
            line = (f"decision: by the planning model (the plan's figures); the compile "
                    f"agrees: {model}")
        else:
            line = (f"decision: by the compile, which disagrees with the planning model "
                    f"(the plan's figures say {model}, the compile {compiled})")
        if self.recommendation == "plain":
            return (f"{line}: use plain jax.jit for this function (jaxpar's program is "
                    "estimated slower)")
        return f"{line}: use jaxpar's program"

    @property
    def time_ratio(self) -> float:
        """Estimated jaxpar time over plain time (< 1: jaxpar expected faster)."""
        plain, fast = self.plain.estimated_us, self.jaxpar.estimated_us
        return fast / plain if plain > 0 else 1.0

    @property
    def memory_line(self) -> str:
        """``memory: temporaries A against B for plain jit (compile); the plan estimated
        C against D``: what the compiles' ``memory_analysis()`` says, beside the memory
        model's estimate the plan was made with."""
        plain, ours = self.plain.temp_bytes, self.jaxpar.temp_bytes
        if plain is None or ours is None:
            return "memory: not reported by this compile"
        ratio = f" (x{ours / plain:.2f})" if plain > 0 else ""
        line = (f"memory: temporaries {format_bytes(ours)} against {format_bytes(plain)} "
                f"for plain jit{ratio}, from the compiles' memory_analysis()")
        model = self.plan.memory
        if model is not None:
            line += (f"; the plan estimated {format_bytes(model.jaxpar_bytes)} against "
                     f"{format_bytes(model.plain_bytes)}")
        return line

    @property
    def verdict(self) -> str:
        """One line: faster, slower or the same, by how much, and why.

        When jaxpar is estimated slower, or launches more kernels without a region that
        overlaps other work, the line names the rewrites that may be responsible: the
        batching rewrites the plan applied (they add stacking, slicing and transposing
        kernels), with the extra kernels and the estimated time they cost.
        """
        plain, fast = self.plain.estimate, self.jaxpar.estimate
        if plain is None or fast is None:
            return "no estimate"
        line = verdict(plain, fast)
        slower = fast.seconds > plain.seconds * (1 + _VERDICT_TOLERANCE)
        extra = fast.launches > plain.launches and not fast.overlapping_regions
        if not (slower or extra):
            return line
        responsible = _batching_rewrites(self.plan)
        if not responsible:
            return line
        added = max(fast.launches - plain.launches, 0)
        cost = (f", est. {(fast.seconds - plain.seconds) * 1e6:+,.1f} us"
                if fast.seconds > plain.seconds else "")
        kernels = (f" and {added} kernel{'s' * (added != 1)} more than they save"
                   if added else "")
        return f"{line}; responsible: {'; '.join(responsible)}{kernels} (stacking, " \
               f"slicing or transposing){cost}"

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "devices": self.devices,
                "command_buffers": self.command_buffers.value, "mode_source": self.mode_source,
                "jaxpar_command_buffers": self.jaxpar_command_buffers.value,
                "xla_options": dict(self.xla_options),
                "plain": self.plain.to_dict(),
                "jaxpar": self.jaxpar.to_dict(), "plan": self.plan.to_dict(),
                "time_ratio": self.time_ratio, "verdict": self.verdict,
                "estimate": dataclasses.asdict(self.plan.estimate) | {
                    "rejected": list(self.plan.estimate.rejected)},
                "compiled_estimate": dataclasses.asdict(self.compiled) | {"rejected": []},
                "decided_by": self.decided_by, "recommendation": self.recommendation,
                "decision": self.decision,
                "memory": self.memory_line}

    def __str__(self) -> str:
        rows = [
            ("stream regions in flight", "async_in_flight"),
            ("stream ids", "stream_ids"),
            ("loops", "loops"),
            ("loop trips (total)", "total_trips"),
            ("kernels per trip", "kernels_per_trip"),
            ("kernels (loop bodies once)", "kernels"),
            ("launches per run", "launches"),
            ("matmul kernels", "matmul_kernels"),
            ("host-sync loops", "host_sync_loops"),
            ("host syncs per run", "host_syncs"),
            ("regions overlapping work", "overlapping_regions"),
            ("parallel graph nodes", "concurrent_kernels"),
            ("est. time (us)", "estimated_us"),
            ("temporary memory", "temp_bytes"),
            ("collectives in flight", "collectives_in_flight"),
            ("matmuls during collectives", "matmuls_during_collectives"),
        ]

        def cell(figures: ScheduleFigures, key: str) -> str:
            if key == "loops":
                return str(len(figures.loops))
            if key == "kernels_per_trip":
                return ", ".join(str(loop.kernels_per_trip) for loop in figures.loops) or "-"
            if key == "stream_ids":
                return ", ".join(map(str, figures.stream_ids)) or "-"
            value = getattr(figures, key)
            if key == "estimated_us":
                return f"{value:,.1f}"
            if key == "temp_bytes" and value is not None:
                return format_bytes(value)
            return "unknown" if value is None else str(value)

        width = max(len(label) for label, _ in rows)
        options = ", ".join(f"{k}={v!r}" for k, v in self.xla_options) or "none"
        lines = [f"GPU preview for `{self.plan.function}` on {self.devices} x {self.gpu.upper()} "
                 f"(deviceless compile; CUDA graphs: {self.command_buffers.value}, from "
                 f"{self.mode_source})",
                 f"  plain jit in the user's {self.command_buffers.value} mode; jaxpar in "
                 f"{self.jaxpar_command_buffers.value} mode (XLA options: {options})"]
        figure = self.plan.estimate
        if self.plan.mode is not None:
            lines.append(f"  why: {self.plan.mode.line(figure.plain_us, figure.jaxpar_us)}")
        lines.append(f"  plan: {figure.line()}")
        compiled = self.compiled
        if abs(compiled.ratio - figure.ratio) > _VERDICT_TOLERANCE * figure.ratio:
            lines.append(f"  compile: {compiled.line()}")
        lines.append(f"  {self.decision}")
        lines.append(f"  {'':{width}}  {'plain jit':>12}  {'jaxpar':>12}")
        for label, key in rows:
            lines.append(f"  {label:{width}}  {cell(self.plain, key):>12}  "
                         f"{cell(self.jaxpar, key):>12}")
        lines.append(f"  verdict: {self.verdict}")
        lines.append(f"  {self.memory_line}")
        return "\n".join(lines)


def _figures(program: gpu_compile.CompiledProgram, gpu: GpuProfile, mode: CommandBufferMode
             ) -> ScheduleFigures:
    hlo = program.hlo
    schedule = parse_schedule(hlo)
    loops = tuple(LoopFigures(loop.name, loop.known_trip_count, loop.body_kernels)
                  for loop in schedule.while_loops)
    by_mode = {each: estimate_hlo(hlo, gpu=gpu, command_buffers=each)
               for each in CommandBufferMode}
    return ScheduleFigures(schedule.max_async_calls_in_flight, tuple(sorted(schedule.stream_ids)),
                           loops, schedule.max_collectives_in_flight,
                           schedule.dot_kernels_during_collectives, hlo, schedule.kernels,
                           schedule.dot_kernels, by_mode[mode],
                           tuple((each.value, e.microseconds) for each, e in by_mode.items()),
                           program.temp_bytes)


def gpu_preview(fn: Callable[..., Any], *args: Any, gpu: str = "h200", devices: int = 1,
                mesh: Any = None, allow_known_crashes: bool = False,
                command_buffers: CommandBufferMode | str | None = None,
                kwargs: Mapping[str, Any] | None = None,
                static_argnums: int | Iterable[int] | None = None,
                static_argnames: str | Iterable[str] | None = None,
                **options: Any) -> GpuPreview:
    """Compiles ``fn`` with and without jaxpar for a GPU, deviceless, and compares.

    Args:
      fn: the function (undecorated, or decorated with ``parallel_branches``, whose
        options and static arguments are then the starting point).
      *args: ``fn``'s positional arguments, as ``parallel_branches(fn)`` takes them:
        arrays or ``jax.ShapeDtypeStruct`` s (with shardings on ``mesh`` for several
        devices), pytrees, Equinox modules, Flax NNX objects, static values.
      gpu: ``"h200"`` or ``"h100"`` (target descriptions shipped with jaxpar).
      devices: GPUs on a 1-D mesh ``("x",)`` when ``mesh`` is not given.
      mesh: a mesh from ``jaxpar.make_gpu_mesh`` for sharded arguments.
      allow_known_crashes: compile even where this jaxlib is known to crash.
      command_buffers: the user's CUDA-graph mode, in which the plain program is judged:
        ``"lhs"`` (XLA's default), ``"concurrent"``, ``"concurrent_regions"``,
        ``"serialize"`` or ``"off"`` (or a ``CommandBufferMode``); default the mode
        ``XLA_FLAGS`` sets, as a program of this process would run. Given here, it counts
        as set by the user, so jaxpar keeps it (as it keeps a mode set in ``XLA_FLAGS``);
        otherwise jaxpar compiles in the mode
        its plan chose (``plan.xla_options``, ``jaxpar_command_buffers``) and is judged in
        that mode. Every mode's time is in ``estimated_us_by_mode``.
      kwargs: ``fn``'s keyword arguments, like ``args``.
      static_argnums, static_argnames: as for ``parallel_branches``; the static
        arguments are bound for both compiles.
      **options: ``parallel_branches`` options; ``target`` is always ``"gpu"``.

    Returns:
      A ``GpuPreview``: ``plain`` and ``jaxpar`` schedule figures (with the HLO
      text and the estimate), the jaxpar ``plan``, ``time_ratio`` and ``verdict``.

    Raises:
      RuntimeError: the CUDA PJRT plugin is missing or does not match jaxlib (the
        message has the exact ``pip install`` line), or this jaxlib is known to
        crash on the program.
      ValueError: unknown ``gpu``, ``command_buffers`` or ``devices < 1``; bad options; a
        malformed calibration profile for ``gpu`` (``GpuProfileError``); symbolic sizes.
      TypeError: an unknown option (with the closest valid name).
    """
    # Options.names() holds command_buffers, which gpu_preview takes as its own argument.
    check_known(options, (*Options.names(), "gpu", "devices", "mesh", "allow_known_crashes",
                          "kwargs", "static_argnums", "static_argnames"))
    if command_buffers is None:
        mode, source = command_buffer_mode(), "XLA_FLAGS"
    else:
        mode, source = CommandBufferMode.parse(command_buffers), "argument"
    ok, message = gpu_compile.plugin_status()
    if not ok:
        raise RuntimeError(f"gpu_preview needs the CUDA PJRT plugin: {message}")
    if isinstance(fn, ParallelBranches):
        options = {**fn.options.to_dict(), **options}
        if static_argnums is None and static_argnames is None:
            static_argnums, static_argnames = fn.static_argnums, fn.static_argnames
        fn = fn.__wrapped__
    options["target"] = "gpu"
    gpu_compile.gpu_target_config(gpu)  # an unknown GPU name fails here, before planning
    profile = gpu_profile(gpu)
    statics = StaticArgs.resolve(fn, static_argnums, static_argnames)
    fn_kwargs = dict(kwargs or {})
    # Planned for the GPU, whatever this machine has, from the user's mode: an argument
    # here counts as set explicitly (kept), as a mode in XLA_FLAGS would.
    planned_mode = None if command_buffers is None else mode
    compile_options = {"gpu": gpu, "mesh": mesh} if mesh is not None else {
        "gpu": gpu, "devices": devices}
    # Both programs over the array leaves alone, static values bound (eqx.filter_jit's and
    # nnx.jit's splits included), so plain jax.jit compiles what parallel_branches runs.
    # jaxpar's is lowered first: its trace is the one analysis of the function, and the
    # plan reported is the one compiled.
    with array_function(fn, args, fn_kwargs, statics, "gpu_preview") as (flat, leaves):
        symbolic = _compat.symbolic_sizes(leaves)
        if symbolic:
            raise ValueError(
                f"gpu_preview compiles programs of known sizes; the arguments' sizes "
                f"{', '.join(symbolic)} are symbolic. Pass jax.ShapeDtypeStruct(s) or arrays "
                "with the sizes to preview (jax.jit cannot compile symbolic sizes either; "
                "jax.export lowers them)")
        rewritten = ParallelBranches(flat, Options.create(**options),
                                     command_buffers=planned_mode, gpu=profile)
        with rewritten._options_applied():  # compiled below with the plan's options
            lowered = gpu_compile.lower_for_gpu(rewritten, *leaves, **compile_options)
    plan, level_plan = rewritten._analysed_report()
    if (not allow_known_crashes and jax.lib.__version__ in _CRASHES_ON_ANNOTATED_LOOPS
            and _regions_hold_loops(level_plan)):
        raise RuntimeError(
            f"gpu_preview: XLA in jaxlib {jax.lib.__version__} crashed the process (SIGSEGV "
            "in its PTX compiler) compiling a stream-annotated region holding a loop, "
            "deviceless; this plan has such regions. Preview with jaxlib 0.10.2, or pass "
            "allow_known_crashes=True to try anyway.")
    chosen = plan.mode.mode if plan.mode is not None else mode
    # Compiled as jaxpar's own jit would: with the XLA options its plan chose; plain in
    # the user's mode (the mode decides buffer assignment, so the memory figures).
    fast = _figures(gpu_compile.compiled_program(lowered, plan.xla_options), profile, chosen)
    with array_function(fn, args, fn_kwargs, statics, "gpu_preview") as (flat, leaves):
        plain_lowered = gpu_compile.lower_for_gpu(flat, *leaves, **compile_options)
    plain = _figures(gpu_compile.compiled_program(plain_lowered, command_buffer_options(mode)),
                     profile, mode)
    count = mesh.devices.size if mesh is not None else devices
    # The plan keeps its one pair of figures (``inspect``'s); the compile's pair is shown
    # beside it (``GpuPreview.compiled``), and decides where the two disagree.
    return GpuPreview(gpu, count, plain, fast, plan, mode, source, chosen,
                      tuple(sorted(plan.xla_options.items())))


# Relative difference below which the verdict calls both programs the same
# (``estimate.verdict``'s default).
_VERDICT_TOLERANCE = 0.01


def direction(ratio: float) -> str:
    """``"faster"``, ``"slower"`` or ``"the same"``: a jaxpar/plain time ratio's direction,
    the same within ``_VERDICT_TOLERANCE``."""
    if ratio < 1 - _VERDICT_TOLERANCE:
        return "faster"
    return "slower" if ratio > 1 + _VERDICT_TOLERANCE else "the same"
_BATCHING_KINDS = (DecisionKind.BATCHED_MATMULS, DecisionKind.BATCHED_SUBGRAPHS,
                   DecisionKind.BATCHED)


def _batching_rewrites(plan: Plan) -> list[str]:
    """The plan's applied batching rewrites, one phrase per kind and place: what they
    joined and the user's first source line."""
    found: dict[tuple[str, str], list[Any]] = {}
    for d in (*subgraph_decisions(plan.decisions), *loop_decisions(plan.decisions)):
        if d.kind in _BATCHING_KINDS:
            found.setdefault((str(d.kind), d.location), []).append(d)
    phrases = []
    for (kind, location), decisions in found.items():
        ops = sum(len(d.members) or len(d.eqns) for d in decisions)
        where = decisions[0].sources[0] if decisions[0].sources else ""
        phrases.append(f"{kind} in {location} ({len(decisions)} "
                       f"group{'s' * (len(decisions) != 1)}, {ops} ops"
                       + (f", first at {where}" if where else "") + ")")
    return phrases


def _regions_hold_loops(plan: LevelPlan) -> bool:
    """Whether a stream region, at any level, has an equation that may hold a loop
    (a loop, or a call whose body may hold one)."""
    for level in plan.walk():
        eqns = _compat.open_jaxpr(level.jaxpr)[0].eqns
        if any(eqns[i].primitive.name in MAY_HOLD_LOOPS for section in level.sections
               for region in section.regions for i in region.eqns):
            return True
    return False
