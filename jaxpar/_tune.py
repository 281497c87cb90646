"""The tuner: measure jaxpar's candidate programs on this device, keep the fastest.

``parallel_branches(f, tune=True)`` compiles each row of ``CANDIDATES`` (plain
``jax.jit`` of ``f``, and jaxpar with some rewrites switched off), times the distinct
ones on the device the call runs on, runs the fastest, and stores the decision on disk
so that a later process compiles only the winner. ``_api`` builds the programs and
calls ``measure``; this module owns the candidate table, the timing, the decision
rule, the decision's key and its file.

Example::

    step = jaxpar.parallel_branches(train_step, tune=True)
    step(params, batch)                       # first call: measures, then runs the winner
    print(jaxpar.inspect(step)(params, batch))  # ... the measured table

Sharp edges:
  * Plain ``jax.jit`` wins ties: a rewrite is chosen only when the median of its
    per-round ratios to plain (both timed in the same round) is more than
    ``TuneBudget.margin`` below 1. Pairing by round cancels load that drifts between
    rounds (another process starting); load that changes within a round does not
    cancel, and the margin absorbs some of it, not all.
  * The decision is keyed by the program's traced jaxpr (its text, addresses removed),
    the arguments' shapes, dtypes and shardings, the static arguments (their ``repr``),
    the options, the device kind and count, jax/jaxlib/jaxpar versions and
    ``XLA_FLAGS``. A static argument whose ``repr`` differs between processes (one
    with an address in it) gives a new key, and so a new measurement, each process.
  * Under several processes, a program whose arguments span every process's devices
    (``_processes.span``) is tuned together, at its first call: the processes exchange
    what keys the decision (a mismatch, such as a host's other ``XLA_FLAGS``, raises
    ``ProcessMismatchError`` on every process), take process 0's stored decision if it
    has one, else exchange the schedule (each candidate's program) and time the same
    number of rounds each; their ratios combine as ``TuneBudget.combine`` says and every
    process computes the same choice. Only process 0 writes the file. These exchanges
    are collectives: only the first real call of a signature enters them, never
    ``inspect`` or ``tuning()``, which read what this process knows or the stored file.
    A program over this process's devices alone is tuned by this process alone.
  * ``TuneBudget(read_only=True)`` (or ``JAXPAR_TUNE_READ_ONLY=1``) never measures: a
    stored decision runs, and without one the plan does (a ``TuneCacheWarning`` says
    so). Copy a decision file into ``$JAXPAR_TUNE_DIR`` to ship it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import statistics
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax

from . import _processes
from ._flags import xla_flags_text
from ._program.primitives import calls_the_host
from .targets.candidates import Candidate as Candidate
from .targets.candidates import declared as declared_candidates

TUNE_DIR_VARIABLE = "JAXPAR_TUNE_DIR"
READ_ONLY_VARIABLE = "JAXPAR_TUNE_READ_ONLY"
FILE_MODE = 0o600  # a decision file's mode (less the umask): its owner reads and writes it
DECISION_FORMAT = "jaxpar-tune-decision"
DECISION_VERSION = 3  # 2: the TPU's candidates; 3: unrolled by 16, scans fused, whiles


PLAIN = "jax.jit"
MARGIN = 0.03  # a rewrite must be this much faster than plain jax.jit to be chosen
LOSER_MARGIN = 0.25  # this much slower than the best: stop timing it

# The programs the tuner compares, in the order ties are broken (earlier wins): plain
# jax.jit, jaxpar with the options as given ("chosen options": the XLA options its plan
# chooses per function), then the rows the targets declare (``targets.candidates``).
CANDIDATES: tuple[Candidate, ...] = (
    Candidate(PLAIN, None),
    Candidate("jaxpar (chosen options)", {}),
    *declared_candidates(),
)
CHOSEN = CANDIDATES[1].label


# How the processes' timings of a program tuned together combine (``TuneBudget.combine``).
COMBINE = ("slowest", "median", "process 0")


@dataclasses.dataclass(frozen=True, slots=True)
class TuneBudget:
    """How long the tuner measures, how it decides and whether it may measure at all
    (``parallel_branches(f, tune=jaxpar.TuneBudget(...))``; ``tune=True`` is the
    default budget).

    Attributes:
      margin: a rewrite must beat plain ``jax.jit`` by more than this fraction (the
        median of its per-round ratios to plain below ``1 - margin``) to be chosen
        (plain wins ties and near-ties).
      loser_margin: after ``min_repeats`` rounds, a candidate whose median ratio is this
        fraction above the best so far, and that was slower than the best in each of the
        last ``min_repeats`` rounds, stops being timed (a clear loser; never chosen). In
        one process only: processes tuning together time every round.
      min_repeats, max_repeats: timing rounds per candidate, after one warm-up run and
        one timed call. A round is k back-to-back calls (dispatched, then waited for
        together, as a loop of calls runs them): k makes a round of a short program
        last about ``ROUND_S`` (5 ms), at most ``ROUND_CALLS`` (8) and 1 GiB of
        outputs held (``ROUND_BYTES``); a program of 5 ms or more is timed a call a
        round.
      seconds: the timed rounds of one candidate aim at about this much wall time
        (between ``min_repeats`` and ``max_repeats`` rounds); processes tuning together
        run the most rounds (and calls a round) any of them aims at.
      combine: how the ratios of processes tuning together combine into the one the
        decision compares: ``"slowest"`` (default; each candidate's largest ratio over
        the processes: a rewrite must pay on every host, as the step waits for the
        slowest), ``"median"``, or ``"process 0"`` (process 0's timings alone).
      read_only: never measure: run the stored decision, or without one the plan as
        without tuning (with a ``TuneCacheWarning``). ``JAXPAR_TUNE_READ_ONLY=1`` in
        the environment does the same for every tuned function.

    Raises:
      ValueError: a figure out of range or an unknown ``combine``, naming it.
    """

    margin: float = MARGIN
    loser_margin: float = LOSER_MARGIN
    min_repeats: int = 5
    max_repeats: int = 50
    seconds: float = 0.5
    combine: str = "slowest"
    read_only: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise ValueError(f"TuneBudget(margin={self.margin!r}): a fraction in [0, 1)")
        if self.loser_margin < 0:
            raise ValueError(f"TuneBudget(loser_margin={self.loser_margin!r}): at least 0")
        if not 1 <= self.min_repeats <= self.max_repeats:
            raise ValueError(f"TuneBudget(min_repeats={self.min_repeats!r}, max_repeats="
                             f"{self.max_repeats!r}): need 1 <= min_repeats <= max_repeats")
        if self.seconds < 0:
            raise ValueError(f"TuneBudget(seconds={self.seconds!r}): at least 0")
        if self.combine not in COMBINE:
            raise ValueError(f"TuneBudget(combine={self.combine!r}): one of {COMBINE}")

    @property
    def reads_only(self) -> bool:
        """``read_only``, or ``JAXPAR_TUNE_READ_ONLY`` set in the environment."""
        return self.read_only or os.environ.get(READ_ONLY_VARIABLE, "").strip().lower() in (
            "1", "true", "yes", "on")


class Measured(NamedTuple):
    """One candidate's row in the measured table.

    ``median_s`` is None when the candidate was not timed: ``same_as`` names the row
    that is the same program, or the decision was read from disk without its table.
    ``ratio`` is the median of its per-round ratios to plain ``jax.jit`` (what the
    decision compares; None in a decision stored without it). ``median_s`` is a call's
    time (a round's over its calls), ``runs`` the calls timed.
    """

    label: str
    median_s: float | None
    runs: int
    same_as: str | None = None
    stopped_early: bool = False
    ratio: float | None = None


# Where a decision came from (``Tuning.source``).
MEASURED = "measured"  # timed by this process alone
STORED = "stored"  # read from this process's decision file
FROM_PROCESS_0 = "process 0"  # process 0's stored decision, or its timings alone
TOGETHER = "all processes"  # timed by every process, combined (``TuneBudget.combine``)
UNMEASURED = "not measured"  # read-only, no stored decision: the plan runs
UNDECIDED = "not decided yet"  # several processes, read before the first call decided


@dataclasses.dataclass(frozen=True, slots=True)
class Tuning:
    """The tuner's decision for one function at one signature, and how it was reached.

    Attributes:
      chosen: the label of the candidate that runs.
      rows: the measured table, one row per candidate (``CANDIDATES`` order); for a
        decision made together, the combined figures.
      source: ``"measured"`` (in this process), ``"stored"`` (read from ``path``),
        ``"process 0"`` (process 0's stored decision, or its timings where
        ``combine="process 0"``), ``"all processes"`` (every process's timings,
        combined), ``"not measured"`` (read-only without a stored decision) or ``"not
        decided yet"`` (``chosen`` empty: read under several processes before the first
        call, which decides together, and with no stored decision).
      key: the decision's key (a hash of everything that keys it).
      path: the decision's file, or None where this process did not write or read one.
      margin: the noise margin the decision was made with.
      processes: how many processes' timings the table combines (1 in one process).
      combine: how they were combined (``TuneBudget.combine``), None for one process.
    """

    chosen: str
    rows: tuple[Measured, ...]
    source: str
    key: str
    path: str | None = None
    margin: float = MARGIN
    processes: int = 1
    combine: str | None = None
    # Why nothing was measured (a decision without timings), and how long this process
    # spent timing the candidates (``measure``: at the call that decided).
    why: str | None = None
    measure_s: float | None = None
    # The calls a timing round made of each candidate, back to back (``round_calls``),
    # and what the build of the candidates says where it stopped before all were built.
    round_calls: int = 1
    built: str | None = None

    def row(self, label: str) -> Measured:
        for row in self.rows:
            if row.label == label:
                return row
        raise KeyError(f"no candidate {label!r}; the candidates are "
                       f"{[row.label for row in self.rows]}")

    def _timed_row(self, label: str) -> Measured:
        """The row of ``label``, or the row that was timed where it is the same program."""
        row = self.row(label)
        return self.row(row.same_as) if row.same_as else row

    def median_s(self, label: str) -> float | None:
        """The candidate's median, following ``same_as`` to the row that was timed."""
        return self._timed_row(label).median_s

    def ratio(self, label: str) -> float | None:
        """The candidate's time over plain ``jax.jit``'s (< 1 is faster): the median of
        the per-round ratios, following ``same_as``; medians' ratio where the row has
        none."""
        row = self._timed_row(label)
        if row.ratio is not None:
            return row.ratio
        mine, plain = row.median_s, self.median_s(PLAIN)
        return None if mine is None or not plain else mine / plain

    def verdict(self) -> str:
        """What was measured, in one line: ``"measured on TPU v5 lite: 1.69x faster than
        jax.jit (x0.59)"``, ``"measured slower: kept jax.jit's program"``, or why nothing
        was measured."""
        if self.why:
            return f"not measured: {self.why}"
        if self.source == "nothing to measure":
            return ("nothing to measure: every candidate compiles to jax.jit's program, "
                    "which runs")
        if self.chosen == "" or all(row.median_s is None and row.ratio is None
                                    for row in self.rows):
            return f"{self.source}: no timings" if self.chosen else f"{self.source}"
        device = jax.devices()[0].device_kind
        ratio = self.ratio(self.chosen)
        if self.chosen == PLAIN:
            return (f"measured on {device}: no rewrite faster: kept jax.jit's program"
                    f"{self._against_kept()}")
        if ratio is None or ratio <= 0:
            return f"measured on {device}: runs {self.chosen!r}"
        return (f"measured on {device}: {1 / ratio:.2f}x faster than jax.jit (x{ratio:.3f}), "
                f"runs {self.chosen!r}")

    def _against_kept(self) -> str:
        """Beside a kept ``jax.jit`` program: what the model's plan measured (the device's
        correction of its estimate for this program) and the best rewrite that was
        eligible, one timed to the end (a clear loser stopped early has a median of
        fewer, earlier rounds; a row that is ``jax.jit``'s own program is no rewrite)."""
        figures = []
        plan = self.ratio(CHOSEN) if any(r.label == CHOSEN for r in self.rows) else None
        if plan is not None and self._timed_row(CHOSEN).label != PLAIN:
            figures.append(f"the model's plan x{plan:.3f}")
        eligible = [self.ratio(row.label) for row in self.rows
                    if self._timed_row(row.label).label != PLAIN
                    and not self._timed_row(row.label).stopped_early]
        best = min((r for r in eligible if r is not None), default=None)
        if best is not None:
            figures.append(f"the best rewrite x{best:.3f}")
        return f" ({'; '.join(figures)})" if figures else ""

    def lines(self) -> list[str]:
        """The table as report lines (``Plan.text`` shows them)."""
        if self.source == UNDECIDED:
            return ["  tuned: not decided yet (several processes: the first call of these "
                    "shapes measures, on every process together; no stored decision "
                    f"{decision_path(self.key)})"]
        where = f" ({self.path})" if self.source == STORED and self.path else ""
        if self.combine is not None and self.processes > 1:
            where += f", {self.processes} processes' timings combined: {self.combine}"
        spent = "" if self.measure_s is None else f"; timing took {self.measure_s:.2f} s"
        if self.round_calls > 1:
            spent += f", rounds of {self.round_calls} back-to-back calls"
        if self.built:
            spent += f"; {self.built}"
        if not self.chosen or self.why:
            return [f"  {self.verdict()}"]
        out = []
        out.append(f"  tuned: runs {self.chosen!r} ({self.source}{where}; a rewrite must "
                   f"beat jax.jit by {self.margin:.0%}{spent})")
        for row in self.rows:
            median = self.median_s(row.label)
            ratio = self.ratio(row.label)
            timed = ("not timed" if median is None
                     else f"{median * 1e3:9.3f} ms  x{ratio:.3f}" if ratio is not None
                     else f"{median * 1e3:9.3f} ms")
            notes = []
            if row.same_as:
                notes.append(f"same program as {row.same_as!r}")
            elif row.runs:
                notes.append(f"{row.runs} runs")
            if row.stopped_early:
                notes.append(f"stopped early: then more than {LOSER_MARGIN:.0%} "
                             "slower than the best")
            mark = "*" if row.label == self.chosen else " "
            out.append(f"   {mark} {row.label:<32} {timed}  ({', '.join(notes)})"
                       if notes else f"   {mark} {row.label:<32} {timed}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "source": self.source, "key": self.key,
                "path": self.path, "margin": self.margin, "processes": self.processes,
                "combine": self.combine, "why": self.why, "measure_s": self.measure_s,
                "round_calls": self.round_calls, "built": self.built,
                "rows": [row._asdict() for row in self.rows]}


class Program(NamedTuple):
    """One candidate's program, as ``measure`` times it.

    Attributes:
      candidate: the row of ``CANDIDATES``.
      run: runs the program (None where ``same_as`` names the candidate whose program
        it is: timed once).
      same_as: that candidate's label, or None.
      digest: what decides the program on jaxpar's side (its settings and XLA options),
        hashed: processes tuning together must have the same.
      failed: why the candidate's program could not be built (``run`` None, not timed),
        or None.
    """

    candidate: Candidate
    run: Callable[[], Any] | None
    same_as: str | None = None
    digest: str = ""
    failed: str | None = None


def decide(key: str, fields: Mapping[str, Any], programs: Callable[[], Sequence[Program]],
           budget: TuneBudget = TuneBudget(), *, together: bool = False,
           what: str = "a tuned function") -> Tuning:
    """The decision for ``key``: the stored one, else measured (and stored).

    Args:
      key, fields: from ``decision_key``.
      programs: builds the candidates' programs (``measure``'s argument); called only
        when there is a decision to measure.
      budget: as for ``measure``; ``budget.reads_only`` never measures.
      together: the program spans every process (``_processes.span``): decide with
        them (``_decide_together``; a collective).
      what: the call, for a mismatch's message.

    Raises:
      ProcessMismatchError: (``together``) the processes' keys or schedules differ.
    """
    stored = load(key)
    if together:
        return _decide_together(key, fields, programs, budget, stored, what)
    if stored is not None:
        return stored
    if budget.reads_only:
        return unmeasured(key, budget)
    return store(measure(programs(), key, budget), fields)


# The decision's fields every process tuning together must share (the rest, such as the
# traced program's text or a static argument's repr, are the user's to differ as under
# jax.jit).
_SHARED_FIELDS = ("options", "candidates", "platform", "device_kind", "device_count",
                  "process_count", "arguments")


def _decide_together(key: str, fields: Mapping[str, Any],
                     programs: Callable[[], Sequence[Program]], budget: TuneBudget,
                     stored: Tuning | None, what: str) -> Tuning:
    """``decide`` for a program that spans every process: process 0's stored decision,
    else every process's timings of one agreed schedule, combined."""
    shared = {name: fields.get(name) for name in _SHARED_FIELDS}
    everyone = _processes.agree(what, {
        "tune": repr(dataclasses.replace(budget, read_only=budget.reads_only)),
        "versions": [str(fields.get(name)) for name in ("jax", "jaxlib", "jaxpar")],
        "xla_flags": program_flags(str(fields.get("xla_flags", ""))),
        "decision": json.dumps(shared, sort_keys=True, default=str),
        "key": key, "stored": None if stored is None else stored.chosen,
    }, compared=("tune", "versions", "xla_flags", "decision"))
    first = jax.process_index() == 0
    chosen = everyone[0]["stored"]
    if chosen is not None:  # process 0's stored decision runs everywhere
        if stored is not None and stored.chosen == chosen:
            return stored
        return untimed(chosen, FROM_PROCESS_0, key, budget)
    if budget.reads_only:
        return unmeasured(key, budget)
    built = programs()
    _processes.agree(what, {"schedule": [[p.candidate.label, p.same_as, p.digest]
                                         for p in built]})
    tuning = measure(built, key, budget, together=True)
    return store(tuning, fields) if first else tuning


# Why a program is not timed, by measuring or by ``tune=True`` (``repeated_by_timing``).
REPEATED_BY_TIMING = ("the program calls the host (callbacks, pure_callback included, "
                      "prints) or has other side effects, which timing would repeat")


def repeated_by_timing(jaxpr: Any) -> bool:
    """Whether timing the traced program ``jaxpr`` would repeat what ``jax.jit`` runs once
    a call: effects, or a host callback at any depth (``calls_the_host``)."""
    return bool(jaxpr.effects) or calls_the_host(jaxpr)


def untimed(chosen: str, source: str, key: str, budget: TuneBudget,
            why: str | None = None) -> Tuning:
    """A decision (or its absence, ``chosen`` empty) without timings of this process:
    every row not timed; ``why``: why nothing was measured."""
    return Tuning(chosen, tuple(Measured(c.label, None, 0) for c in CANDIDATES), source, key,
                  margin=budget.margin, why=why)


def undecided(key: str, budget: TuneBudget) -> Tuning:
    """What a read of a decision not yet made says (``UNDECIDED``)."""
    return untimed("", UNDECIDED, key, budget)


def unmeasured(key: str, budget: TuneBudget, why: str | None = None) -> Tuning:
    """A decision not measured: the plan (``"jaxpar (chosen options)"``) runs, as
    without ``tune``; a ``TuneCacheWarning`` says ``why`` (default: read-only without a
    stored decision)."""
    why = why or (f"read-only and no stored decision {decision_path(key)} (copy a "
                  "decision file there, or let one run measure without read_only)")
    warnings.warn(f"jaxpar tuner: {why}; running the plan unmeasured", TuneCacheWarning,
                  stacklevel=4)
    return untimed(CANDIDATES[1].label, UNMEASURED, key, budget, why=f"{why}; the plan runs")


_HARMLESS_FLAGS = re.compile(r"^--xla_(dump|gpu_dump|log|enable_dumping)")


def program_flags(text: str) -> str:
    """``XLA_FLAGS`` without the flags that only dump or log (the ones that may differ
    between the hosts of one program)."""
    return " ".join(flag for flag in text.split() if not _HARMLESS_FLAGS.match(flag))


# --------------------------------------------------------------------------- timing


def _time_call(label: str, run: Callable[[], Any]) -> float:
    """Seconds one run of ``run`` takes, waiting for its results (a round of
    ``_round``: every call of it dispatched, then all waited for)."""
    del label  # the fake timers of the tests read it
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start


# A test replaces this (a private hook) with a deterministic timer that still runs
# ``run``, so the decision logic is tested without wall-clock noise.
_timer: Callable[[str, Callable[[], Any]], float] = _time_call

# A timing round is k back-to-back calls of a candidate (dispatched one after another,
# then waited for together), as a loop of calls runs them: the next call's dispatch
# overlaps the last one's execution, which a single call waited for does not show. k is
# what makes a round last about ``ROUND_S`` (from the first timed call of jax.jit's
# program), at most ``ROUND_CALLS``; a program of ``ROUND_S`` or more is timed a call a
# round. A round of short calls so lasts at most about 2 * ``ROUND_S``.
# A round's calls' outputs are held until it ends: they take at most ``ROUND_BYTES``
# together (one call a round at least).
ROUND_S = 0.005
ROUND_CALLS = 8
ROUND_BYTES = 1 << 30


def round_calls(first_s: float, out_bytes: int = 0) -> int:
    """The calls a timing round makes of a program whose single call took ``first_s``
    and whose outputs take ``out_bytes``."""
    calls = min(ROUND_CALLS, math.ceil(ROUND_S / max(first_s, 1e-9)))
    return max(1, min(calls, ROUND_BYTES // max(out_bytes, 1)))


def _nbytes(tree: Any) -> int:
    return sum(int(getattr(leaf, "nbytes", 0)) for leaf in jax.tree_util.tree_leaves(tree))


def _round(run: Callable[[], Any], calls: int) -> tuple[Callable[[], Any], int]:
    """One timing round of ``run``: a callable dispatching ``calls`` runs back to back
    and returning their outputs (the timer waits for them all), and how many it makes.
    Their inputs are made now, outside the timing: where ``run`` has ``fresh`` (a
    program donating its arguments consumes them), ``run.fresh(calls)`` gives each run
    its own copies, as many runs as the copies' memory allows."""
    fresh = getattr(run, "fresh", None)
    runs = list(fresh(calls)) if fresh is not None else [run] * calls

    def dispatch() -> list[Any]:
        return [one() for one in runs]

    return dispatch, len(runs)


def _timed_round(label: str, run: Callable[[], Any], calls: int) -> tuple[float, int]:
    """Seconds a call of ``run`` took in one round of ``calls``, and the calls made."""
    dispatch, made = _round(run, calls)
    return _timer(label, dispatch) / made, made


def measure(programs: Sequence[Program], key: str, budget: TuneBudget = TuneBudget(), *,
            together: bool = False) -> Tuning:
    """Times the programs and decides.

    Args:
      programs: each candidate's ``Program``; the first must be plain ``jax.jit``
        (``PLAIN``).
      key: the decision's key (``decision_key``).
      budget: repeats, margins and the time to aim at.
      together: every process times the same schedule now (a collective): the rounds
        are the most any process aims at, no candidate stops early, and the ratios
        combine as ``budget.combine`` says.

    Returns:
      A ``Tuning`` with source ``"measured"`` (``together``: ``"all processes"``, or
      ``"process 0"`` / ``"measured"`` with ``combine="process 0"``).
    """
    if not programs or programs[0].candidate.label != PLAIN:
        raise ValueError("the first candidate must be plain jax.jit (the baseline)")
    runs = {p.candidate.label: p.run for p in programs if p.run is not None}
    # Compile, then one warm-up run; a round holds its calls' outputs until it ends.
    out_bytes = max(_nbytes(jax.block_until_ready(run())) for run in runs.values())
    first = {label: _timed_round(label, run, 1)[0] for label, run in runs.items()}
    # The candidates' fastest first call estimates a call's time (one waited-for call on
    # a loaded host can take milliseconds more than the program).
    calls = round_calls(min(first.values()), out_bytes)
    repeats = max(budget.min_repeats, min(budget.max_repeats, int(
        budget.seconds / max(first[PLAIN] * calls, 1e-9))))
    if together:  # the same schedule on every process (its programs hold collectives)
        repeats, calls = (max(int(r.split()[i]) for r in _processes.gather(
            f"{repeats} {calls}")) for i in (0, 1))
    samples, ratios, stopped, made = _rounds(runs, repeats, calls, budget,
                                             early_stop=not together)
    medians = {label: statistics.median(times) for label, times in samples.items()}
    paired = {label: statistics.median(values) for label, values in ratios.items()}
    source, processes, combine = MEASURED, 1, None
    if together:
        medians, paired = _combined(medians, paired, budget.combine)
        processes, combine = jax.process_count(), budget.combine
        source = TOGETHER if combine != "process 0" else (
            MEASURED if jax.process_index() == 0 else FROM_PROCESS_0)
    # A candidate stopped as a clear loser is not chosen, whatever later rounds did to
    # the others.
    chosen = choose({label: paired[label] for label in runs if label not in stopped},
                    budget.margin)
    rows = tuple(
        Measured(p.candidate.label, None, 0, same_as=p.same_as) if p.run is None
        else Measured(p.candidate.label, medians[p.candidate.label], made[p.candidate.label],
                      stopped_early=p.candidate.label in stopped,
                      ratio=paired[p.candidate.label])
        for p in programs)
    return Tuning(chosen, rows, source, key, margin=budget.margin, processes=processes,
                  combine=combine, round_calls=calls)


def _rounds(runs: Mapping[str, Callable[[], Any]], repeats: int, calls: int,
            budget: TuneBudget, early_stop: bool
            ) -> tuple[dict[str, list[float]], dict[str, list[float]], set[str],
                       dict[str, int]]:
    """``repeats`` rounds of timing, ``calls`` back-to-back calls of each candidate a
    round (``_round``): each candidate's times a call, its per-round ratios to plain's,
    the candidates stopped early as clear losers (``early_stop`` only), and the calls
    timed of each."""
    samples: dict[str, list[float]] = {label: [] for label in runs}
    made = dict.fromkeys(runs, 0)
    # Each candidate's time over plain's in the same round: load that drifts between
    # rounds cancels, which it does not in a ratio of two medians.
    ratios: dict[str, list[float]] = {label: [] for label in runs}
    alive = list(runs)
    stopped: set[str] = set()
    for round_ in range(repeats):
        # Rotate the order every round, so drift and load hit all alike.
        shift = round_ % len(alive)
        timed = {label: _timed_round(label, runs[label], calls)
                 for label in alive[shift:] + alive[:shift]}
        times = {label: seconds for label, (seconds, _) in timed.items()}
        for label, seconds in times.items():
            samples[label].append(seconds)
            made[label] += timed[label][1]
            ratios[label].append(seconds / max(times[PLAIN], 1e-12))
        if not early_stop or round_ + 1 < budget.min_repeats:
            continue
        best = min(alive, key=lambda label: statistics.median(ratios[label]))
        best_ratio = statistics.median(ratios[best])
        recent = budget.min_repeats
        for label in list(alive):
            # A clear loser: its median ratio well above the best's, and slower than the
            # best in every one of the last min_repeats rounds (so a few rounds that
            # load hit, on a busy machine, do not stop a faster program).
            if label != PLAIN and statistics.median(ratios[label]) > best_ratio * (
                    1 + budget.loser_margin) and all(
                    mine > theirs for mine, theirs in zip(
                        samples[label][-recent:], samples[best][-recent:], strict=True)):
                alive.remove(label)
                stopped.add(label)
    return samples, ratios, stopped, made


def _combined(medians: Mapping[str, float], ratios: Mapping[str, float], combine: str
              ) -> tuple[dict[str, float], dict[str, float]]:
    """Every process's medians and ratios, combined as ``combine`` says (a collective;
    every process gets the same figures, so every process chooses the same)."""
    everyone = [json.loads(text) for text in _processes.gather(
        json.dumps({"medians": dict(medians), "ratios": dict(ratios)}))]

    def merged(field: str) -> dict[str, float]:
        columns = {label: [doc[field][label] for doc in everyone] for label in everyone[0][field]}
        if combine == "process 0":
            return {label: values[0] for label, values in columns.items()}
        pick = max if combine == "slowest" else statistics.median
        return {label: float(pick(values)) for label, values in columns.items()}

    return merged("medians"), merged("ratios")


def choose(times: Mapping[str, float], margin: float) -> str:
    """The label to run: the fastest, unless it beats plain ``jax.jit`` by no more than
    ``margin`` (then plain). Ties among rewrites go to the earliest.

    Args:
      times: each candidate's time, or its time relative to plain's (then plain's is
        1); it must hold ``PLAIN``.
      margin: the fraction of plain's time a rewrite must save.
    """
    if PLAIN not in times:
        raise ValueError(f"choose needs plain jax.jit's time ({PLAIN!r}) to compare with; "
                         f"got {sorted(times)}")
    fastest = min(times, key=lambda label: times[label])  # first of equals
    if fastest != PLAIN and times[fastest] >= times[PLAIN] * (1 - margin):
        return PLAIN
    return fastest


# --------------------------------------------------------------------------- the key


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def fingerprint(jaxpr_text: str) -> str:
    """A hash of a program's jaxpr text, with object addresses (which differ between
    processes: ``<function f at 0x7f...>`` in a ``custom_jvp``'s parameters) removed."""
    return hashlib.sha256(_ADDRESS.sub("", jaxpr_text).encode()).hexdigest()


def decision_key(*, program: str, arguments: Sequence[Any], statics: str,
                 options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The key of one decision, and the fields it hashes.

    Args:
      program: ``fingerprint`` of the traced jaxpr.
      arguments: one entry per array argument: shape, dtype and sharding, as strings.
      statics: the static arguments and the arguments' tree structure, as text.
      options: the function's jaxpar options (and what it is planned for).
    """
    devices = jax.devices()
    fields = {
        "format": DECISION_VERSION, "program": program, "arguments": list(arguments),
        "statics": _ADDRESS.sub("", statics),
        "options": {name: repr(value) for name, value in sorted(options.items())},
        "candidates": [[c.label, None if c.overrides is None else sorted(
            (k, repr(v)) for k, v in c.overrides.items())] for c in CANDIDATES],
        "platform": devices[0].platform, "device_kind": devices[0].device_kind,
        "device_count": len(devices), "process_count": jax.process_count(),
        "jax": jax.__version__, "jaxlib": _jaxlib_version(), "xla_flags": xla_flags_text(),
        "jaxpar": _jaxpar_version(),
    }
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32], fields


def versions() -> list[str]:
    """jax's, jaxlib's and jaxpar's versions (what processes of one program must share)."""
    return [jax.__version__, _jaxlib_version(), _jaxpar_version()]


def _jaxlib_version() -> str:
    import jaxlib
    return str(getattr(jaxlib, "__version__", "unknown"))


def _jaxpar_version() -> str:
    from importlib import metadata
    try:
        return metadata.version("jaxpar")
    except metadata.PackageNotFoundError:  # run from a checkout
        return "checkout"


# --------------------------------------------------------------------------- the file


class TuneCacheWarning(UserWarning):
    """A stored tuning decision could not be read or written; the tuner measures anew."""


def tune_dir() -> Path:
    """Where decisions are stored: ``$JAXPAR_TUNE_DIR``, default ``~/.cache/jaxpar/tune``."""
    directory = os.environ.get(TUNE_DIR_VARIABLE, "").strip()
    return Path(directory) if directory else Path.home() / ".cache" / "jaxpar" / "tune"


def decision_path(key: str) -> Path:
    return tune_dir() / f"{key}.json"


def load(key: str) -> Tuning | None:
    """The stored decision for ``key``, or None (none stored, or unreadable: then a
    ``TuneCacheWarning`` names the file and the tuner measures again)."""
    path = decision_path(key)
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        warnings.warn(f"jaxpar tuner: cannot read {path} ({error}); measuring again",
                      TuneCacheWarning, stacklevel=3)
        return None
    try:
        document = json.loads(text)
        if document.get("format") != DECISION_FORMAT or \
                document.get("version") != DECISION_VERSION or document.get("key") != key:
            raise ValueError(f"not a {DECISION_FORMAT} version {DECISION_VERSION} file "
                             f"for key {key}")
        labels = [c.label for c in CANDIDATES]
        rows = tuple(Measured(str(r["label"]), None if r["median_s"] is None
                              else float(r["median_s"]), int(r["runs"]),
                              r.get("same_as"), bool(r.get("stopped_early", False)),
                              None if r.get("ratio") is None else float(r["ratio"]))
                     for r in document["rows"])
        chosen = document["chosen"]
        if chosen not in labels or [row.label for row in rows] != labels:
            raise ValueError(f"its candidates are not this jaxpar's {labels}")
        combine = document.get("combine")
        built = document.get("built")
        return Tuning(chosen, rows, STORED, key, str(path), float(document["margin"]),
                      int(document.get("processes", 1)),
                      None if combine is None else str(combine),
                      round_calls=int(document.get("round_calls", 1)),
                      built=None if built is None else str(built))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(f"jaxpar tuner: ignoring the corrupt decision file {path} ({error}); "
                      "measuring again and replacing it", TuneCacheWarning, stacklevel=3)
        return None


def store(tuning: Tuning, fields: Mapping[str, Any]) -> Tuning:
    """Writes the decision (atomically: a whole file or none; mode ``FILE_MODE`` less the
    umask) and returns it with its path; a directory that cannot be written gives a
    ``TuneCacheWarning``, not an error."""
    path = decision_path(tuning.key)
    document = {"format": DECISION_FORMAT, "version": DECISION_VERSION, "key": tuning.key,
                "chosen": tuning.chosen, "margin": tuning.margin,
                "processes": tuning.processes, "combine": tuning.combine,
                "rows": [row._asdict() for row in tuning.rows], "keyed_by": dict(fields),
                # How it was timed, and a build the deadline stopped (a later process reads
                # the decision and says so).
                "round_calls": tuning.round_calls, "built": tuning.built}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Readable by its owner only (0600): a decision names the program's shapes, the
        # machine and its timings; to share one, copy it (``read_only`` runs read it).
        temporary = str(path.parent / f".{tuning.key}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            with os.fdopen(handle, "w") as file:
                json.dump(document, file, indent=1, default=str)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    except OSError as error:
        warnings.warn(f"jaxpar tuner: cannot store the decision in {path} ({error}); set "
                      f"{TUNE_DIR_VARIABLE} to a writable directory", TuneCacheWarning,
                      stacklevel=3)
        return tuning
    return dataclasses.replace(tuning, path=str(path))
