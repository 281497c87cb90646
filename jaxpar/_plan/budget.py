"""Pipeline stages 2 and 3 (``_pipeline``, every target): the memory budget jaxpar's
program must keep to.

jaxpar's rewrites and CUDA-graph modes can raise a program's temporary memory
(``_memory``). By default the program jaxpar runs may need at most 10% (or 1 MiB,
whichever is more) more temporary bytes than the plain program in the user's mode, as
the memory model estimates both; ``parallel_branches(memory=...)`` states another budget
(``"any"``, or a number of extra bytes). A candidate over budget is not chosen: a mode is
refused, and the fewest kinds of rewrite (``LADDER``: stream sections, unrolling,
batching, loop fusion) are left out that bring the program within the budget. A pass's
row of the pass table names its kind (``_options.PassRow.rung``); ``LADDER`` is made
from the rows.

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

from .._gpu_model import CommandBufferMode
from .._memory import format_bytes
from .._options import PASS_TABLE, PassRow, Rung, Settings

__all__ = ["LADDER", "MemoryFigures", "format_bytes", "ladder", "leave_out",
           "mode_memory_reason", "over_budget"]

MIB = 2**20
STREAMS = "streams"  # the first kind: stream sections (the planner's, not a pass)


def ladder(passes: Sequence[PassRow] = PASS_TABLE) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """What may be left out while jaxpar's program needs more than the budget, the first
    first: stream sections (``STREAMS``), then each ``Rung`` with the passes whose rows
    name it, in table order."""
    return (("stream sections", (STREAMS,)),
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
class MemoryFigures:
    """Estimated temporary memory of one plan against the plain program.

    Attributes:
      plain_bytes: the plain program (the function as traced) in the user's mode.
      jaxpar_bytes: jaxpar's program in the mode it is compiled in.
      allowed_bytes: how many more bytes the budget allows (None: any).
      left_out: the rewrites left out to keep to the budget, with what they would
        have needed, one line each.
    """

    plain_bytes: float
    jaxpar_bytes: float
    allowed_bytes: float | None
    left_out: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.allowed_bytes is None or \
            self.jaxpar_bytes <= self.plain_bytes + self.allowed_bytes

    def line(self) -> str:
        """``memory: est. temporaries A against B for the plain program (budget +C)``."""
        budget = ("no budget" if self.allowed_bytes is None
                  else f"budget +{format_bytes(self.allowed_bytes)}")
        ratio = (f", x{self.jaxpar_bytes / self.plain_bytes:.2f}" if self.plain_bytes > 0
                 else "")
        return (f"memory: est. temporaries {format_bytes(self.jaxpar_bytes)} against "
                f"{format_bytes(self.plain_bytes)} for the plain program ({budget}{ratio})")

    def to_dict(self) -> dict[str, Any]:
        return {"plain_bytes": self.plain_bytes, "jaxpar_bytes": self.jaxpar_bytes,
                "allowed_bytes": self.allowed_bytes, "fits": self.fits,
                "left_out": list(self.left_out)}


def over_budget(plain_bytes: float, ours: float, allowed: float | None,
                what: str) -> str | None:
    """Why ``what`` is over budget (None when it fits)."""
    if allowed is None or ours <= plain_bytes + allowed:
        return None
    return (f"{what} would need est. {format_bytes(ours - plain_bytes)} more temporary "
            f"memory than the plain program (budget +{format_bytes(allowed)})")


def mode_memory_reason(mode: CommandBufferMode, plain_bytes: float, ours: float,
                       allowed: float | None) -> str | None:
    """Why ``mode`` is refused for its memory (None when it fits)."""
    return over_budget(plain_bytes, ours, allowed, f"{mode.value} mode")
