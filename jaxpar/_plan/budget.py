"""Pipeline stages 2 and 3 (``_pipeline``, every target): the memory budget jaxpar's
program must keep to.

jaxpar's rewrites and CUDA-graph modes can raise a program's temporary memory
(``_model.memory``). By default the program jaxpar runs may need at most 10% (or 1 MiB,
whichever is more) more temporary bytes than the plain program in the user's mode, as
the memory model estimates both; ``parallel_branches(memory=...)`` states another budget
(``"any"``, or a number of extra bytes). A candidate over budget is not chosen: a mode is
refused, and the fewest kinds of rewrite (``LADDER``: stream sections, unrolling,
batching, loop fusion) are left out that bring the program within the budget. A pass's
row of the pass table names its kind (``_options.PassRow.rung``); ``LADDER`` is made
from the rows.

What was left out is kept as data (``LeftOut``: the kinds, the figure that decided it,
and the rewrites the passes had made of them), so the report can show each refusal
where the rewrite would have been; its words come from here only.

Example::

    allowed = settings.memory.allowed(plain_bytes)   # _options.MemoryBudget: 10% or 1 MiB
    figures = MemoryFigures(plain_bytes, ours, allowed)
    figures.fits, figures.line()
    leave_out(settings, LADDER[1:3])   # the settings without unrolling and batching

Sharp edges:
  * Both figures are the memory model's, not XLA's (``gpu_preview`` shows what the
    compile says, ``Compiled.memory_analysis()``): a budget is kept as the model sees it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from .._model.gpu import CommandBufferMode
from .._model.memory import format_bytes
from .._options import PASS_TABLE, PassRow, Rung, Settings
from ..passes import PassDecision

__all__ = ["LADDER", "STREAM_SECTIONS", "LeftOut", "MemoryFigures", "format_bytes", "ladder",
           "leave_out", "left_out_for_memory", "left_out_for_time", "mode_memory_reason",
           "over_budget"]

MIB = 2**20
STREAMS = "streams"  # the first kind: stream sections (the planner's, not a pass)
STREAM_SECTIONS = "stream sections"  # its name in LADDER, and the report's


def ladder(passes: Sequence[PassRow] = PASS_TABLE) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """What may be left out while jaxpar's program needs more than the budget, the first
    first: stream sections (``STREAMS``), then each ``Rung`` with the passes whose rows
    name it, in table order."""
    return ((STREAM_SECTIONS, (STREAMS,)),
            *((rung.value, tuple(row.name for row in passes if row.rung is rung))
              for rung in Rung))


# The fewest kinds that bring the program within the budget are left out.
LADDER = ladder()


def leave_out(settings: Settings, kinds: Iterable[tuple[str, tuple[str, ...]]]) -> Settings:
    """``settings`` without the kinds of rewrite ``kinds`` (steps of ``LADDER``); the same
    object when they leave out nothing."""
    names = {name for _, names in kinds for name in names}
    planned = settings.without(names - {STREAMS})
    if STREAMS in names and planned.streams_per_section != 1:
        planned = dataclasses.replace(planned, streams_per_section=1)
    return planned


@dataclasses.dataclass(frozen=True, slots=True)
class LeftOut:
    """Kinds of rewrite left out of jaxpar's program, and why.

    Attributes:
      kinds: the kinds left out (``LADDER``'s names: ``"stream sections"``, ``"loop
        fusion"``, ...; ``"loop batching"`` for batched scans alone).
      why: the figure that decided it, in words (``left_out_for_memory``,
        ``left_out_for_time``).
      decisions: the rewrites the passes had made of those kinds before they were left
        out (as the passes made them, on the program with them); empty for stream
        sections, which are the planner's.
      memory: True where the memory budget left them out; False where jaxpar's program
        is estimated no slower without them.
    """

    kinds: tuple[str, ...]
    why: str
    decisions: tuple[PassDecision, ...] = ()
    memory: bool = True

    @property
    def rewrites(self) -> str:
        """The kinds in words: ``"batching and loop fusion"``, ``"every rewrite"``."""
        if len(self.kinds) == len(LADDER) and set(self.kinds) == {k for k, _ in LADDER}:
            return "every rewrite"
        return " and ".join(self.kinds)

    def line(self) -> str:
        """``loop fusion left out: <why>``."""
        return f"{self.rewrites} left out: {self.why}"

    def to_dict(self) -> dict[str, Any]:
        return {"kinds": list(self.kinds), "why": self.why, "memory": self.memory,
                "decisions": [d.kind.value for d in self.decisions]}


def left_out_for_memory(kinds: tuple[str, ...], plain_bytes: float, needed_bytes: float,
                        allowed: float, decisions: tuple[PassDecision, ...] = ()) -> LeftOut:
    """``kinds`` left out because jaxpar's program with them (``needed_bytes`` of
    temporaries) needed more than ``allowed`` beyond the plain program's ``plain_bytes``."""
    item = LeftOut(kinds, "", decisions, memory=True)
    why = (f"with {item.rewrites}, jaxpar's program would need est. "
           f"{format_bytes(needed_bytes - plain_bytes)} more temporary memory than jax.jit's; "
           f"the memory budget allows {format_bytes(allowed)} more (memory=... sets another)")
    return dataclasses.replace(item, why=why)


def left_out_for_time(kinds: tuple[str, ...], with_seconds: float, without_seconds: float,
                      decisions: tuple[PassDecision, ...] = ()) -> LeftOut:
    """``kinds`` left out because the model estimates jaxpar's program no slower without
    them (``without_seconds`` per run against ``with_seconds``): a rewrite must pay."""
    item = LeftOut(kinds, "", decisions, memory=False)
    if f"{without_seconds * 1e6:,.1f}" == f"{with_seconds * 1e6:,.1f}":
        why = (f"jaxpar's program is estimated no faster with {item.rewrites}: "
               f"{without_seconds * 1e6:,.1f} us per run either way")
    else:
        why = (f"jaxpar's program is estimated faster without {item.rewrites}: "
               f"{without_seconds * 1e6:,.1f} us per run against {with_seconds * 1e6:,.1f} "
               "us with it")
    return dataclasses.replace(item, why=why)


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryFigures:
    """Estimated temporary memory of one plan against the plain program.

    Attributes:
      plain_bytes: the plain program (the function as traced) in the user's mode.
      jaxpar_bytes: jaxpar's program in the mode it is compiled in.
      allowed_bytes: how many more bytes the budget allows (None: any).
      left_out: the kinds of rewrite left out of jaxpar's program (``LeftOut``): to keep
        to the budget, or where its program is estimated no slower without them.
      kept: why the program stays over the budget: the rewrites the user asked for by
        name are kept, and what they cost (empty otherwise).
    """

    plain_bytes: float
    jaxpar_bytes: float
    allowed_bytes: float | None
    left_out: tuple[LeftOut, ...] = ()
    kept: str = ""

    @property
    def fits(self) -> bool:
        return self.allowed_bytes is None or \
            self.jaxpar_bytes <= self.plain_bytes + self.allowed_bytes

    @property
    def over_bytes(self) -> float:
        """How far jaxpar's program is over the budget (0 where it fits)."""
        if self.allowed_bytes is None:
            return 0.0
        return max(0.0, self.jaxpar_bytes - self.plain_bytes - self.allowed_bytes)

    def line(self) -> str:
        """``memory: fits the budget: est. A of temporaries against B for jax.jit's
        program (the budget allows C more)``, or ``over the budget by D``."""
        figures = (f"est. {format_bytes(self.jaxpar_bytes)} of temporaries against "
                   f"{format_bytes(self.plain_bytes)} for jax.jit's program")
        if self.allowed_bytes is None:
            return f"memory: {figures} (memory='any': no budget)"
        budget = f"the budget allows {format_bytes(self.allowed_bytes)} more"
        if self.fits:
            return f"memory: fits the budget: {figures} ({budget})"
        return (f"memory: over the budget by {format_bytes(self.over_bytes)}: {figures} "
                f"({budget})" + (f"; {self.kept}" if self.kept else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"plain_bytes": self.plain_bytes, "jaxpar_bytes": self.jaxpar_bytes,
                "allowed_bytes": self.allowed_bytes, "fits": self.fits,
                "left_out": [item.line() for item in self.left_out],
                "left_out_records": [item.to_dict() for item in self.left_out],
                "kept": self.kept}


def over_budget(plain_bytes: float, ours: float, allowed: float | None,
                what: str) -> str | None:
    """Why ``what`` is over budget (None when it fits)."""
    if allowed is None or ours <= plain_bytes + allowed:
        return None
    return (f"{what} would need est. {format_bytes(ours - plain_bytes)} more temporary "
            f"memory than jax.jit's program; the memory budget allows "
            f"{format_bytes(allowed)} more")


def mode_memory_reason(mode: CommandBufferMode, plain_bytes: float, ours: float,
                       allowed: float | None) -> str | None:
    """Why ``mode`` is refused for its memory (None when it fits)."""
    return over_budget(plain_bytes, ours, allowed, f"{mode.value} mode")
