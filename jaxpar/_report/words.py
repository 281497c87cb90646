"""The short report's words: what jaxpar did to each loop, what it refused and why, and
what it left alone, in terms a JAX user knows.

Each line says what was done (``fused``, ``unrolled by 4``), to what (per loop: ``2 scans
of 100 trips each``), where in the user's program (``_report.places``, else the source
line) and, for a refusal, the figure that decided it. ``plan.text(verbose=True)`` keeps
the passes' own reasoning in full (``render.decision_text``).

Example::

    loop_line(decision)        # "unrolled by 4: 100 trips -> 25 (in model.py:7), ..."
    refused_line(decision, left_out)
    left_alone_lines(plan.left_alone)

Sharp edges:
  * The reasons the passes give are prose; the few phrases read here (``auto: body cost
    and length``, ``: unroll by``, ``mixed directions``) are the unroll and fusion passes'
    own, and an unknown reason falls back to its first clause.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from .._plan import REASON_SYMBOLIC, REASON_TOO_CHEAP
from .._plan.budget import STREAM_SECTIONS, LeftOut
from ..passes import DecisionKind, PassDecision
from .render import decision_summary, first_clause, place_list, readable_location, short_places
from .types import LeftAlone

# What a refused rewrite of each kind would have done, as "not <verb>".
_NOT_DONE = {DecisionKind.FUSED: "not fused", DecisionKind.BATCHED: "not batched",
             DecisionKind.UNROLLED: "not unrolled",
             DecisionKind.BATCHED_MATMULS: "matmuls not batched",
             DecisionKind.BATCHED_SUBGRAPHS: "subgraphs not batched"}
# A pass's loops it left alone, as "not <verb>".
_LEFT_BY_PASS = {"fuse_scans": "not fused", "batch_scans": "not batched",
                 "unroll_scans": "kept rolled", "hoist_scan_inputs": "not hoisted",
                 "associative_scans": "kept sequential"}
_SHOWN_LEFT_ALONE = 3
_BUDGET_FIGURE = re.compile(r"\(\+([\d.]+ \w+)\)")


def _at(level_path: str, places: str) -> str:
    """``(in model.py:7)``, or ``(in scan body at model.py:7)`` inside a loop body."""
    level = readable_location(level_path)
    return f"({level} at {places})" if level else f"(in {places})"


def _where(d: PassDecision) -> str:
    """Where a decision is in the user's program: for loops it joined, the members' own
    lines (the scans as written); otherwise the places of what it made
    (``_report.places``: the modules whose parameters it reads), else its lines."""
    if d.kind in (DecisionKind.FUSED, DecisionKind.BATCHED) or not d.places:
        return _at(d.location, short_places(d.sources))
    return _at(d.location, place_list(d.places))


def loops_text(d: PassDecision, done: bool = True) -> str:
    """``2 scans of 100 trips each -> one scan of 100 trips``, ``100 trips -> 25``: the
    trips of each loop before and after (a fused loop's trips are counted once, not
    summed over its members); ``done=False``: what it would have made."""
    n = len(d.eqns)
    before, after = d.trips_before, d.trips_after
    noun = "scans" if all(p == "scan" for p in d.primitives) else "loops"
    if before is None or after is None:
        return f"{n} {noun}" if n > 1 else "1 loop"
    if n == 1:
        return (f"{_trips(before)} -> {after}" if done
                else f"{_trips(before)} (would be {after})")
    # Equal loops only where the joined loop makes as many trips as each (unequal lengths
    # are chained segments).
    each = (f"of {_trips(before // n)} each" if before == n * after
            else f"({_trips(before)} in all)")
    made = f"one scan of {_trips(after)}"
    return f"{n} {noun} {each} -> {made}" if done else f"{n} {noun} {each} (would be {made})"


def _trips(count: int) -> str:
    return f"{count} trip{'' if count == 1 else 's'}"


def _plain_figures(text: str) -> str:
    """``(+1.0 MiB)`` -> ``(1.0 MiB more)``: a figure says what it is."""
    return _BUDGET_FIGURE.sub(r"(\1 more than jax.jit's)", text)


def _unroll_why(reason: str) -> str:
    """What chose an unroll factor, or kept a scan rolled, from the unroll pass's reason."""
    kept = ": factor stays" in reason
    why = reason.rsplit(": unroll by", 1)[0].rsplit(": factor stays", 1)[0]
    copies = re.search(r"at most (\d+) copies of the body within the memory budget", why)
    fastest = re.match(r"auto: the GPU model's fastest of (unroll \d+(?:, \d+)*)", why)
    chose = ("unroll='auto' chose it from the body's cost and the loop's length"
             if fastest is None else
             f"unroll='auto' chose it as the GPU model's fastest of {fastest.group(1)}")
    if copies is not None:
        most = int(copies.group(1))
        body = f"{most} cop{'y' if most == 1 else 'ies'} of the body"
        why = (f"only {body} {'fits' if most == 1 else 'fit'} the memory budget" if kept else
               f"{chose}, within the {body} the memory budget allows")
    elif fastest is not None:
        why = (f"the GPU model estimates it fastest rolled, of {fastest.group(1)}" if kept
               else chose)
    elif why.startswith("auto: body cost and length"):
        why = "no factor pays for this body and length" if kept else chose
    elif why.startswith("auto: "):
        why = why[len("auto: "):]
        if kept:  # the line already says "kept rolled"
            why = why.removeprefix("kept rolled: ")
    elif re.match(r"unroll=\d+ requested", why):
        why = f"as {why.split()[0]} asks"
    return _plain_figures(first_clause(why, limit=200))


def loop_line(d: PassDecision) -> str:
    """One line for a decision about loops (``Plan.decisions`` of a loop kind)."""
    if d.kind == DecisionKind.FUSED:
        mixed = ", forward and reverse" if "mixed directions" in d.reason else ""
        return (f"fused: {loops_text(d)}, running their bodies side by side{mixed} "
                f"{_where(d)}")
    if d.kind == DecisionKind.BATCHED:
        return (f"batched: {loops_text(d)}, one vmapped scan running their common body "
                f"{_where(d)}")
    if d.kind == DecisionKind.UNROLLED:
        return (f"unrolled by {d.unroll}: {loops_text(d)} {_where(d)}; "
                f"{_unroll_why(d.reason)}")
    if d.kind == DecisionKind.SCANNED_IN_PARALLEL:
        return (f"scanned in parallel: 1 scan, {_trips(d.trips_before or 0)} {_where(d)}: "
                f"{first_clause(d.reason, limit=200, clauses=2)}")
    if d.kind == DecisionKind.HOISTED:
        return f"hoisted: {first_clause(d.reason, limit=200, clauses=2)} {_where(d)}"
    if d.kind == DecisionKind.LEFT_ALONE and d.pass_name in _LEFT_BY_PASS:
        verb = _LEFT_BY_PASS[d.pass_name]
        why = (_unroll_why(d.reason) if d.pass_name == "unroll_scans"
               else _plain_figures(first_clause(
                   re.sub(r"^\d+ scans run", "they run", d.reason), clauses=2)))
        trips = f", {_trips(d.trips_before)}" if d.trips_before is not None else ""
        count = f"{len(d.eqns)} scans" if len(d.eqns) > 1 else "1 scan"
        return f"{verb}: {count}{trips} {_where(d)}: {why}"
    return decision_summary(d)


def refused_line(d: PassDecision, left_out: LeftOut) -> str:
    """A rewrite the passes made and jaxpar then left out (``LeftOut``), where it would
    have been: what it would have done and the figure that decided against it."""
    verb = _NOT_DONE.get(d.kind, f"{d.kind} left out")
    if d.kind == DecisionKind.UNROLLED:
        verb, what = f"{verb} by {d.unroll}", loops_text(d, done=False)
    elif d.kind in (DecisionKind.FUSED, DecisionKind.BATCHED):
        mixed = ", forward and reverse" if "mixed directions" in d.reason else ""
        what = loops_text(d, done=False) + mixed
    else:
        what = f"{len(d.members) or len(d.eqns)} members"
    return f"{verb}: {what} {_where(d)}: {left_out.why}"


def refused_in(left_out: Sequence[LeftOut], kinds: Sequence[DecisionKind]
               ) -> list[tuple[PassDecision, LeftOut]]:
    """The refused rewrites of ``kinds``, with what refused them."""
    return [(d, item) for item in left_out for d in item.decisions if d.kind in kinds]


def sections_left_out(left_out: Sequence[LeftOut]) -> LeftOut | None:
    """The refusal that left the stream sections out, if one did."""
    return next((item for item in left_out if STREAM_SECTIONS in item.kinds), None)


def left_alone_lines(notes: Sequence[LeftAlone], min_cost_us: object = None) -> list[str]:
    """What was left alone, named: the heaviest few with their reasons, then how many
    more and of which reasons (every one: ``plan.text(verbose=True)``)."""
    shown = sorted((n for n in notes if n.reason != REASON_SYMBOLIC),
                   key=lambda n: -n.cost_us)
    if not shown:
        return []
    lines = [f"  left alone ({len(shown)}), the heaviest first:"]
    for note in shown[:_SHOWN_LEFT_ALONE]:
        places = place_list(note.places) if note.places else short_places(note.source_lines)
        why = _plain_figures(first_clause(note.detail))
        if note.reason == REASON_TOO_CHEAP and min_cost_us is not None:
            why += f", below min_cost_us={min_cost_us}"
        lines.append(f"    {note.reason}: {', '.join(note.primitives[:3])} "
                     f"{_at(note.location, places)}: {why}")
    rest = shown[_SHOWN_LEFT_ALONE:]
    if rest:
        reasons = Counter(note.reason for note in rest)
        counts = ", ".join(f"{n} {reason}" for reason, n in reasons.most_common())
        lines.append(f"    and {len(rest)} more ({counts})")
    return lines
