"""Pipeline stage 4 (``_pipeline``, target ``"gpu"``): the CUDA-graph mode a function is
compiled in.

XLA:GPU runs captured kernels as CUDA graphs (command buffers). In its default ``LHS``
mode a graph is one serial chain; in ``CONCURRENT_REGIONS`` mode runs of small,
latency-bound kernels are parallel graph nodes (dots, convolutions and library calls
stay serial); in ``CONCURRENT`` mode every independent kernel is; with graphs ``OFF``
every kernel is launched alone, but stream regions holding loops keep their overlap.
Which is faster depends on the program, so XLA keeps ``LHS`` as the process-wide
default. jaxpar may choose per function: ``gpu_time.estimate_seconds`` prices a planned program
in a mode with the GPU model (``_model.gpu``, through the cost model), and
``choose_mode`` keeps a candidate only if it beats the user's mode by ``MIN_GAIN`` at
the nominal figures **and** at the end of every uncertain figure's range that favours
the user's mode (``pessimistic``), and if its temporary memory stays within the
budget (``_model.memory``, ``_plan.budget``); the choice becomes that function's
``compiler_options`` (``_flags.command_buffer_options``).

The GPU's host-side figures and kernel floors are third-party measurements, none on a
Hopper GPU by this project (``docs/gpu_evidence.md``), so with the built-in figures the
pessimistic end decides: a branching graph's host cost per node (up to 1 us) is then more
than the floor it hides (down to 0.6 us), and no mode change pays. A calibration measured
on the GPU (``benchmarks/calibrate.py``) narrows the ranges. (``tune=True`` times the
plan's choice against the process's mode, not other modes.)

How a planned program is priced in a mode (the model, on the one GPU simulator) is
``_plan.gpu_time``'s. In that model ``CONCURRENT`` is never faster than
``CONCURRENT_REGIONS`` (both overlap only small kernels) and needs more memory, so
jaxpar's candidates are ``LHS``, ``CONCURRENT_REGIONS`` and, for plans whose stream
regions hold loops, ``OFF``; ``command_buffers="concurrent"`` compiles a function in
``CONCURRENT`` all the same.

The walks of the program in the candidate modes share the passes' steps
(``ModeSteps``).

Example::

    choice = choose_mode(estimates, user_mode, corners)
    choice.mode, choice.xla_options, choice.reason

Sharp edges:
  * The estimates it compares are a model of the compiled program before it is compiled
    (``_plan.gpu_time``): ``gpu_preview`` judges the compiled one, and the first GPU run
    must confirm both.
  * Graphs ``OFF`` is a candidate only for a plan whose stream regions hold loops (their
    overlap survives only outside graphs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _compat
from .._flags import command_buffer_options
from .._memo import IdentityMemo
from .._model.cost import launch_pricing
from .._model.gpu import CommandBufferMode, GpuProfile
from .._options import Settings
from .._program.primitives import MAY_HOLD_LOOPS
from ..passes import Pass
from ..passes._walk import Step
from .plans import LevelPlan

# The least estimated gain over the user's mode that makes jaxpar change it, at the
# nominal figures and at the pessimistic end of every uncertain figure's range.
MIN_GAIN = 0.05

# The modes jaxpar chooses among besides the user's (SERIALIZE never beats LHS, and
# CONCURRENT never beats CONCURRENT_REGIONS in this model: see the module docstring).
CANDIDATES = (CommandBufferMode.LHS, CommandBufferMode.CONCURRENT_REGIONS,
              CommandBufferMode.OFF)

# Each uncertain figure (``GpuProfile.ranges``) at the end that favours a serial-graph
# mode (XLA's default LHS) over the candidate, and so makes the candidate's gain the
# least. A figure that costs the same in both modes sits at its high end: it adds to both
# estimates alike and so brings their ratio nearest to one.
_BRANCHING_AGAINST = {
    "graph_floor_s": "low",  # the floor a branching graph hides
    "dag_node_s": "high", "chain_node_s": "low",  # its host cost per node, and LHS's
    "launch_s": "high", "graph_launch_s": "high", "kernel_floor_s": "high",
    "sync_s": "high", "event_s": "high",
}
PESSIMISTIC: Mapping[CommandBufferMode, Mapping[str, str]] = {
    CommandBufferMode.CONCURRENT: _BRANCHING_AGAINST,
    CommandBufferMode.CONCURRENT_REGIONS: _BRANCHING_AGAINST,
    # Graphs off: every kernel launched alone, against a chain graph.
    CommandBufferMode.OFF: {
        "launch_s": "high", "kernel_floor_s": "high", "graph_floor_s": "low",
        "graph_launch_s": "low", "chain_node_s": "low", "dag_node_s": "low",
        "sync_s": "high", "event_s": "high"},
}


def pessimistic(gpu: GpuProfile, candidate: CommandBufferMode) -> GpuProfile:
    """``gpu`` with every uncertain figure at the end that favours XLA's default mode over
    ``candidate`` (the candidate's gain is then the least)."""
    ends = PESSIMISTIC.get(candidate, {})
    return gpu.at({f: e for f, e in ends.items() if f in dict.fromkeys(
        name for name, _, _ in gpu.ranges)})


def optimistic(gpu: GpuProfile, candidate: CommandBufferMode) -> GpuProfile:
    """``gpu`` with every uncertain figure at the other end (the candidate's gain most)."""
    ends = PESSIMISTIC.get(candidate, {})
    flip = {"low": "high", "high": "low"}
    return gpu.at({f: flip[e] for f, e in ends.items() if f in dict.fromkeys(
        name for name, _, _ in gpu.ranges)})


@dataclasses.dataclass(frozen=True, slots=True)
class ModeEnds:
    """One candidate mode's estimate against the user's mode at both ends of the GPU
    model's ranges: ``pessimistic`` (every uncertain figure where it favours the user's
    mode) and ``optimistic``; each a ``(candidate seconds, user's mode seconds)`` pair."""

    mode: CommandBufferMode
    pessimistic: tuple[float, float]
    optimistic: tuple[float, float]

    @staticmethod
    def _ratio(pair: tuple[float, float]) -> float:
        return pair[0] / pair[1] if pair[1] > 0 else 1.0

    @property
    def pessimistic_ratio(self) -> float:
        return self._ratio(self.pessimistic)

    @property
    def optimistic_ratio(self) -> float:
        return self._ratio(self.optimistic)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode.value,
                "pessimistic_us": [s * 1e6 for s in self.pessimistic],
                "optimistic_us": [s * 1e6 for s in self.optimistic],
                "pessimistic_ratio": self.pessimistic_ratio,
                "optimistic_ratio": self.optimistic_ratio}


@dataclasses.dataclass(frozen=True, slots=True)
class ModeChoice:
    """The CUDA-graph mode chosen for one function, and why.

    Attributes:
      mode: the mode the function is compiled in.
      user_mode: the mode the user's program runs in (the process's).
      estimates: estimated seconds per run in each mode considered, ``(mode, s)`` pairs,
        the user's first (the GPU model's nominal figures).
      chosen: whether jaxpar sets ``mode`` (False: the user's, or the option's, is kept).
      reason: one line for ``inspect`` and ``gpu_preview``.
      plain_seconds: the same model's estimate of the plain program (the function as
        traced, before jaxpar's rewrites) in the user's mode.
      ends: each candidate's estimate against the user's mode at both ends of the
        model's ranges (``ModeEnds``).
      measured: whether the GPU's figures were measured on it (a calibration profile);
        False: every choice is "estimated, not measured on a GPU".
    """

    mode: CommandBufferMode
    user_mode: CommandBufferMode
    estimates: tuple[tuple[CommandBufferMode, float], ...]
    chosen: bool
    reason: str
    plain_seconds: float | None = None
    ends: tuple[ModeEnds, ...] = ()
    measured: bool = False
    why: str = ""  # a chosen mode: what it does for this program, without figures

    def line(self, plain_us: float, jaxpar_us: float) -> str:
        """The reason with the plan's one pair of figures (``Plan.estimate``): for a chosen
        mode, jaxpar's time against jax.jit's (not against jaxpar's program in the user's
        mode, which ``reason`` compares, and which follows in brackets); else ``reason``."""
        base = self.estimate(self.user_mode)
        if not (self.chosen and self.why and plain_us > 0):
            return self.reason
        found = self.ends_of(self.mode)
        own = (f"; jaxpar's program in the process's {self.user_mode.value} mode "
               f"{base * 1e6:.1f} us" if base is not None else "")
        if found is not None:
            own += (f", x{found.pessimistic_ratio:.3f} to x{found.optimistic_ratio:.3f} of "
                    "it over the model's ranges")
        label = "" if self.measured else "; estimated, not measured on a GPU"
        return (f"compiled in {self.mode.value} mode: {self.why}; est. jax.jit "
                f"{plain_us:,.1f} us -> jaxpar {jaxpar_us:,.1f} us "
                f"(x{jaxpar_us / plain_us:.3f}, the plan's estimate{own}){label}")

    @property
    def xla_options(self) -> dict[str, str]:
        """The ``compiler_options`` of the function's compile (empty: the process's)."""
        return command_buffer_options(self.mode) if self.chosen else {}

    def estimate(self, mode: CommandBufferMode) -> float | None:
        return dict(self.estimates).get(mode)

    def ends_of(self, mode: CommandBufferMode) -> ModeEnds | None:
        return next((e for e in self.ends if e.mode is mode), None)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "user_mode": self.user_mode.value,
                "chosen": self.chosen, "xla_options": self.xla_options,
                "estimated_us": {m.value: s * 1e6 for m, s in self.estimates},
                "plain_estimated_us": (self.plain_seconds * 1e6
                                       if self.plain_seconds is not None else None),
                "ends": [e.to_dict() for e in self.ends], "measured": self.measured,
                "reason": self.reason}


def regions_hold_loops(plan: LevelPlan) -> bool:
    """Whether a stream region ``plan`` emits holds a loop (directly or in a call): only
    then may graphs ``OFF`` pay (see the module's sharp edges)."""
    eqns = _compat.open_jaxpr(plan.jaxpr)[0].eqns
    return any(eqns[i].primitive.name in MAY_HOLD_LOOPS for section in plan.sections
               if section.pays is not False for region in section.regions for i in region.eqns)


def choose_mode(estimates: Mapping[CommandBufferMode, float], user_mode: CommandBufferMode,
                ends: Sequence[ModeEnds] = (), refused: Mapping[CommandBufferMode, str] = (
                    {}), measured: bool = False) -> ModeChoice:
    """The fastest mode of ``estimates`` if it beats ``user_mode``'s by ``MIN_GAIN`` at the
    nominal figures and at the pessimistic end of its ``ends`` (a candidate without
    ``ends`` is judged at the nominal figures only), and ``refused`` gives no reason
    against it (its memory, ``_plan.budget``)."""
    base = estimates[user_mode]
    ordered = ((user_mode, base), *((m, s) for m, s in estimates.items() if m is not user_mode))
    by_mode = {e.mode: e for e in ends}
    label = "" if measured else "; estimated, not measured on a GPU"

    def holds(mode: CommandBufferMode, seconds: float) -> bool:
        if base <= 0 or seconds > base * (1 - MIN_GAIN) or mode in refused:
            return False
        found = by_mode.get(mode)
        return found is None or found.pessimistic_ratio <= 1 - MIN_GAIN

    winners = [(m, s) for m, s in ordered[1:] if holds(m, s)]
    if not winners:
        best, best_seconds = min(ordered, key=lambda pair: pair[1])
        gain = (1 - best_seconds / base) * 100 if base > 0 else 0.0
        reason = f"kept the process's {user_mode.value} mode: "
        found = by_mode.get(best)
        if best is user_mode or gain < MIN_GAIN * 100:
            reason += (f"no mode is estimated {MIN_GAIN:.0%} faster (best {best.value}, "
                       f"{gain:.1f}%)")
        elif best in refused:
            reason += f"{best.value} is estimated {gain:.1f}% faster, but {refused[best]}"
        elif found is not None:
            reason += (f"{best.value} is estimated {gain:.1f}% faster with the GPU model's "
                       f"nominal figures, x{found.pessimistic_ratio:.3f} at the pessimistic "
                       f"end of their ranges (x{found.optimistic_ratio:.3f} at the "
                       "optimistic end)")
        return ModeChoice(user_mode, user_mode, ordered, False, reason + label, ends=tuple(ends),
                          measured=measured)
    best, best_seconds = min(winners, key=lambda pair: pair[1])
    why = ("its small independent kernels run as parallel CUDA-graph nodes"
           if best.branching else
           "its stream regions hold loops, which keep their overlap outside graphs"
           if best is CommandBufferMode.OFF else "its graphs run as one chain")
    found = by_mode.get(best)
    span = (f", x{found.pessimistic_ratio:.3f} to x{found.optimistic_ratio:.3f} over the "
            "model's ranges" if found is not None else "")
    reason = (f"compiled in {best.value} mode: {why}; est. {best_seconds * 1e6:.1f} us "
              f"against {base * 1e6:.1f} us in the process's {user_mode.value} mode "
              f"(x{best_seconds / base:.3f}{span})")
    return ModeChoice(best, user_mode, ordered, True, reason + label, ends=tuple(ends),
                      measured=measured, why=why)


def kept_mode(mode: CommandBufferMode, user_mode: CommandBufferMode | None,
              explicit: bool, seconds: float | None = None,
              forced: bool = False, measured: bool = False) -> ModeChoice:
    """No choice: the option's ``mode`` (``explicit``) or the process's; ``seconds`` its
    estimate; ``forced``: ``force_streams`` is on (it plans in the process's mode too)."""
    user = user_mode or mode
    why = ("set in XLA_FLAGS, command_buffers='keep', or force_streams=True" if forced
           else "set in XLA_FLAGS, or command_buffers='keep'")
    reason = (f"compiled in {mode.value} mode, as the command_buffers option says"
              if explicit else f"kept the process's {mode.value} mode ({why})")
    return ModeChoice(mode, user, ((mode, seconds),) if seconds is not None else (),
                      explicit, reason, measured=measured)


# The ways a mode prices launches (``_model.cost.launch_pricing``).
_PRICINGS = ("serial", "beside")


class ModeSteps:
    """What each pass did on its first visit of each level in the walks of the program
    in the candidate modes (the ``steps`` the mode search gives ``passes.run_passes``,
    a ``passes._walk.StepCache``), one per call.

    The program is walked again in each mode that prices launches otherwise
    (``_pipeline._choose_mode``). A pass's first visit of a level in a walk is a
    deterministic function of the level, the path and the settings, so the first visit
    in another mode (the same settings but the mode) gets the same step: its decisions
    (the same objects, so ``EqnOrigins``' records of the equations made hold for both)
    and its rebuilt level. A pass that prices launches is run again in a mode that
    prices them otherwise unless it said it decides alike in both
    (``LevelResult.decided_alike``); where it decides exactly as it did in the other
    pricing (equal decisions, rewrites of the same equations and keys: the same
    groups), it takes the other's step, rebuilt level included, so the walks of the two
    modes share every level from there on.
    """

    def __init__(self) -> None:
        self._steps: IdentityMemo[Any, Step] = IdentityMemo()

    def find(self, level_pass: Pass, jaxpr: Any, path: str, settings: Settings
             ) -> Step | None:
        base, pricing = _step_key(level_pass, path, settings)
        return self._steps.get(jaxpr, extra=(*base, pricing))

    def keep(self, level_pass: Pass, jaxpr: Any, path: str, settings: Settings, step: Step,
             alike: bool) -> Step:
        base, pricing = _step_key(level_pass, path, settings)
        if pricing is not None and alike:
            for other in _PRICINGS:
                self._steps.set(jaxpr, step, extra=(*base, other))
        elif pricing is not None:
            for other in _PRICINGS:
                twin = self._steps.get(jaxpr, extra=(*base, other))
                if other != pricing and twin is not None and _same_step(twin, step):
                    step = twin
                    break
        self._steps.set(jaxpr, step, extra=(*base, pricing))
        return step


def _step_key(level_pass: Pass, path: str, settings: Settings
              ) -> tuple[tuple[str, str, Settings], str | None]:
    """``ModeSteps``' key of a pass's first visit at ``path``, less the level: the path,
    the pass and the settings but the mode; and the mode's launch pricing for a pass that
    prices launches (None for the others, which decide alike in every mode)."""
    pricing = launch_pricing(settings.modes.priced) if level_pass.prices_launches else None
    return (path, level_pass.name, settings.priced_in(None)), pricing


def _same_step(one: Step, other: Step) -> bool:
    """Whether two steps decide alike: equal decisions, rewrites of the same equations
    with the same keys (the same groups)."""
    return (one.decisions == other.decisions
            and [(r.eqns, r.key) for r in one.rewrites]
            == [(r.eqns, r.key) for r in other.rewrites])
