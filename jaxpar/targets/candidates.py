"""The programs the targets' measurements time besides plain ``jax.jit`` and the plan
(``_tune.CANDIDATES`` adds those two first): each target module declares the labels it
times and their option overrides (``Target.candidates``); this module holds the labels'
one order, in which ties are broken (earlier wins), and makes a row of each.

"user's mode" is jaxpar compiled with the process's own XLA options (the plan's "chosen
options" choose them per function; on the CPU target the two are one program, compiled
and timed once). On a TPU the rows that make sense there: the plan's loops without their
block reading (rolled), lax.scan's own unroll by 8 or 16 instead, identical scans not
batched, scans fused, while loops by 4, the loops' work that reads no carry run before
them (``hoist_scan_inputs``; with the plan's unrolling, and with lax.scan's by 8), linear
recurrences as ``lax.associative_scan`` (``associative_scans``).

Example::

    declared()   # (Candidate("jaxpar (user's mode)", {...}, ("gpu",)), ...)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from . import known


class Candidate(NamedTuple):
    """One program the tuner may run: a label and the options it overrides.

    ``overrides`` None is plain ``jax.jit`` of the original function; a mapping is
    jaxpar with those ``Options`` fields replaced (empty: the options as given).
    """

    label: str
    overrides: Mapping[str, Any] | None
    # The targets the candidate is a program of its own on (None: every one); elsewhere it
    # is the chosen options' program, not timed again.
    targets: tuple[str, ...] | None = None


# The labels the targets may declare, in the order ties are broken.
ORDER: tuple[str, ...] = (
    "jaxpar (user's mode)", "jaxpar without stream regions", "jaxpar without matmul batching",
    "jaxpar without unrolling", "jaxpar unrolled by 8", "jaxpar unrolled by 16",
    "jaxpar without scan batching", "jaxpar with scans fused", "jaxpar, while loops by 4",
    "jaxpar, scan inputs hoisted", "jaxpar, scan inputs hoisted, unrolled by 8",
    "jaxpar, linear scans associative")


def declared() -> tuple[Candidate, ...]:
    """A row per label of ``ORDER``: the overrides its targets declare (one mapping: a
    label means one program), and those targets.

    Raises:
      ValueError: a label no target declares, or declared with different overrides.
    """
    return tuple(_declared(label) for label in ORDER)


def _declared(label: str) -> Candidate:
    declaring = [t for t in known() if label in t.candidates]
    overrides = {repr(dict(t.candidates[label])) for t in declaring}
    if len(overrides) != 1:
        raise ValueError(f"tuning candidate {label!r}: declared by no target, or with "
                         f"different overrides ({sorted(overrides)}); see jaxpar/targets/")
    return Candidate(label, dict(declaring[0].candidates[label]),
                     tuple(t.name for t in declaring))
