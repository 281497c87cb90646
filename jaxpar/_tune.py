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
  * Under several processes (``jax.process_count() > 1``) every process runs the same
    fixed schedule (no early stop), and process 0's choice is broadcast: SPMD programs
    must all run the same candidate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from ._flags import xla_flags_text

TUNE_DIR_VARIABLE = "JAXPAR_TUNE_DIR"
DECISION_FORMAT = "jaxpar-tune-decision"
DECISION_VERSION = 1


class Candidate(NamedTuple):
    """One program the tuner may run: a label and the options it overrides.

    ``overrides`` None is plain ``jax.jit`` of the original function; a mapping is
    jaxpar with those ``Options`` fields replaced (empty: the options as given).
    """

    label: str
    overrides: Mapping[str, Any] | None


PLAIN = "jax.jit"
MARGIN = 0.03  # a rewrite must be this much faster than plain jax.jit to be chosen
LOSER_MARGIN = 0.25  # this much slower than the best: stop timing it

# The programs the tuner compares, in the order ties are broken (earlier wins). "chosen
# options" is jaxpar with the XLA options its plan chooses per function; "user's mode"
# is jaxpar compiled with the process's own XLA options. Until the plan chooses XLA
# options (issue 19 point 2) the two are one program, and on the CPU target they always
# are: the tuner then compiles and times it once.
CANDIDATES: tuple[Candidate, ...] = (
    Candidate(PLAIN, None),
    Candidate("jaxpar (chosen options)", {}),
    Candidate("jaxpar (user's mode)", {"command_buffers": "keep"}),
    Candidate("jaxpar without stream regions", {"max_streams": 1}),
    Candidate("jaxpar without matmul batching", {"batch_matmuls": False}),
)


@dataclasses.dataclass(frozen=True, slots=True)
class TuneBudget:
    """How long the tuner measures and how it decides.

    Attributes:
      margin: a rewrite must beat plain ``jax.jit`` by more than this fraction (the
        median of its per-round ratios to plain below ``1 - margin``) to be chosen
        (plain wins ties and near-ties).
      loser_margin: after ``min_repeats`` rounds, a candidate whose median ratio is this
        fraction above the best so far, and that was slower than the best in each of the
        last ``min_repeats`` rounds, stops being timed (a clear loser; never chosen).
      min_repeats, max_repeats: timed runs per candidate, after one warm-up run.
      seconds: the timed runs of one candidate aim at about this much wall time
        (between ``min_repeats`` and ``max_repeats`` runs).
    """

    margin: float = MARGIN
    loser_margin: float = LOSER_MARGIN
    min_repeats: int = 5
    max_repeats: int = 50
    seconds: float = 0.5


class Measured(NamedTuple):
    """One candidate's row in the measured table.

    ``median_s`` is None when the candidate was not timed: ``same_as`` names the row
    that is the same program, or the decision was read from disk without its table.
    ``ratio`` is the median of its per-round ratios to plain ``jax.jit`` (what the
    decision compares; None in a decision stored without it).
    """

    label: str
    median_s: float | None
    runs: int
    same_as: str | None = None
    stopped_early: bool = False
    ratio: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Tuning:
    """The tuner's decision for one function at one signature, and how it was reached.

    Attributes:
      chosen: the label of the candidate that runs.
      rows: the measured table, one row per candidate (``CANDIDATES`` order).
      source: ``"measured"`` (in this process), ``"stored"`` (read from ``path``) or
        ``"process 0"`` (broadcast by process 0 under several processes).
      key: the decision's key (a hash of everything that keys it).
      path: the decision's file, or None where it could not be written.
      margin: the noise margin the decision was made with.
    """

    chosen: str
    rows: tuple[Measured, ...]
    source: str
    key: str
    path: str | None = None
    margin: float = MARGIN

    def row(self, label: str) -> Measured:
        for row in self.rows:
            if row.label == label:
                return row
        raise KeyError(f"no candidate {label!r}; the candidates are "
                       f"{[row.label for row in self.rows]}")

    def median_s(self, label: str) -> float | None:
        """The candidate's median, following ``same_as`` to the row that was timed."""
        row = self.row(label)
        return self.row(row.same_as).median_s if row.same_as else row.median_s

    def ratio(self, label: str) -> float | None:
        """The candidate's time over plain ``jax.jit``'s (< 1 is faster): the median of
        the per-round ratios, following ``same_as``; medians' ratio where the row has
        none."""
        row = self.row(label)
        row = self.row(row.same_as) if row.same_as else row
        if row.ratio is not None:
            return row.ratio
        mine, plain = row.median_s, self.median_s(PLAIN)
        return None if mine is None or not plain else mine / plain

    def lines(self) -> list[str]:
        """The table as report lines (``Plan.text`` shows them)."""
        where = f" ({self.path})" if self.source == "stored" and self.path else ""
        out = [f"  tuned: runs {self.chosen!r} ({self.source}{where}; a rewrite must beat "
               f"jax.jit by {self.margin:.0%})"]
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
                "path": self.path, "margin": self.margin,
                "rows": [row._asdict() for row in self.rows]}


def decide(key: str, fields: Mapping[str, Any],
           programs: Callable[[], Sequence[tuple[Candidate, Callable[[], Any] | str]]],
           budget: TuneBudget = TuneBudget()) -> Tuning:
    """The decision for ``key``: the stored one, else measured (and stored).

    Under several processes, process 0's stored choice (or, where it has none, its
    measured one) is what every process runs.

    Args:
      key, fields: from ``decision_key``.
      programs: builds the candidates' programs (``measure``'s argument); called only
        when there is no stored decision.
      budget: as for ``measure``.
    """
    labels = [c.label for c in CANDIDATES]
    stored = load(key)
    index = agree(labels.index(stored.chosen) if stored is not None else -1)
    if index >= 0:
        if stored is not None and stored.chosen == labels[index]:
            return stored
        return Tuning(labels[index], tuple(Measured(label, None, 0) for label in labels),
                      "process 0", key, margin=budget.margin)
    return store(measure(programs(), key, budget), fields)


# --------------------------------------------------------------------------- timing


def _time_call(label: str, run: Callable[[], Any]) -> float:
    """Seconds one run of ``run`` takes, waiting for its results."""
    del label  # the fake timers of the tests read it
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start


# A test replaces this (a private hook) with a deterministic timer that still runs
# ``run``, so the decision logic is tested without wall-clock noise.
_timer: Callable[[str, Callable[[], Any]], float] = _time_call


def measure(programs: Sequence[tuple[Candidate, Callable[[], Any] | str]], key: str,
            budget: TuneBudget = TuneBudget()) -> Tuning:
    """Times the programs and decides.

    Args:
      programs: each candidate with a function running its program, or the label of an
        earlier candidate whose program it is (timed once, shown as ``same_as``). The
        first must be plain ``jax.jit`` (``PLAIN``).
      key: the decision's key (``decision_key``).
      budget: repeats, margins and the time to aim at.

    Returns:
      A ``Tuning`` with source ``"measured"``; under several processes its ``chosen``
      is process 0's.
    """
    if not programs or programs[0][0].label != PLAIN:
        raise ValueError("the first candidate must be plain jax.jit (the baseline)")
    runs = {c.label: program for c, program in programs if not isinstance(program, str)}
    together = jax.process_count() > 1
    for run in runs.values():  # compile, then one warm-up run
        jax.block_until_ready(run())
    first = {label: _timer(label, run) for label, run in runs.items()}
    repeats = budget.min_repeats if together else max(
        budget.min_repeats,
        min(budget.max_repeats, int(budget.seconds / max(first[PLAIN], 1e-9))))
    samples: dict[str, list[float]] = {label: [] for label in runs}
    # Each candidate's time over plain's in the same round: load that drifts between
    # rounds cancels, which it does not in a ratio of two medians.
    ratios: dict[str, list[float]] = {label: [] for label in runs}
    alive = list(runs)
    stopped: set[str] = set()
    for round_ in range(repeats):
        # Rotate the order every round, so drift and load hit all alike.
        shift = round_ % len(alive)
        times = {label: _timer(label, runs[label]) for label in alive[shift:] + alive[:shift]}
        for label, seconds in times.items():
            samples[label].append(seconds)
            ratios[label].append(seconds / max(times[PLAIN], 1e-12))
        if together or round_ + 1 < budget.min_repeats:
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
    medians = {label: statistics.median(times) for label, times in samples.items()}
    paired = {label: statistics.median(values) for label, values in ratios.items()}
    # A candidate stopped as a clear loser is not chosen, whatever later rounds did to
    # the others.
    chosen = choose({label: paired[label] for label in alive}, budget.margin)
    labels = [c.label for c, _ in programs]
    chosen = labels[agree(labels.index(chosen))]
    rows = tuple(
        Measured(c.label, None, 0, same_as=program) if isinstance(program, str)
        else Measured(c.label, medians[c.label], len(samples[c.label]),
                      stopped_early=c.label in stopped, ratio=paired[c.label])
        for c, program in programs)
    return Tuning(chosen, rows, "measured", key, margin=budget.margin)


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


def agree(index: int) -> int:
    """Process 0's ``index`` on every process (the identity in a single process).

    Every process must call it at the same point: it is a collective.
    """
    if jax.process_count() == 1:
        return index
    from jax.experimental import multihost_utils
    return int(multihost_utils.broadcast_one_to_all(np.int32(index)))


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
        return Tuning(chosen, rows, "stored", key, str(path), float(document["margin"]))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(f"jaxpar tuner: ignoring the corrupt decision file {path} ({error}); "
                      "measuring again and replacing it", TuneCacheWarning, stacklevel=3)
        return None


def store(tuning: Tuning, fields: Mapping[str, Any]) -> Tuning:
    """Writes the decision (atomically: a whole file or none) and returns it with its
    path; a directory that cannot be written gives a ``TuneCacheWarning``, not an error."""
    path = decision_path(tuning.key)
    document = {"format": DECISION_FORMAT, "version": DECISION_VERSION, "key": tuning.key,
                "chosen": tuning.chosen, "margin": tuning.margin,
                "rows": [row._asdict() for row in tuning.rows], "keyed_by": dict(fields)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{tuning.key}.",
                                             suffix=".tmp")
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
