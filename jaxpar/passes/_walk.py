"""The driver of the passes: ``walk_levels`` runs the rows of the pass table at every
nesting level of a jaxpr, innermost first, through every jaxpr-valued parameter, in
rounds until a level settles; it stamps each decision with the name of the row that
made it, and applies each pass's rewrites with the splice (``_splice.rebuild_level``).

The protocol a pass follows (``Level`` in, ``LevelResult`` out, one ``Pass`` row each)
is in ``_protocol``; what the walker does for a row:

* a row that ``remembers_search``: a level the pass searched in vain (no rewrite)
  earlier in the call is not searched again (the ``"searched_in_vain"`` memo, keyed by
  the row's name);
* a row with a ``state``: the state it makes on its first visit is kept for the call
  (shared by every mode) and handed to each run as ``Level.state``;
* a row that ``prices_launches``: its result is shared with the walks of the modes
  that price launches alike, or, where it says so (``LevelResult.decided_alike``), with
  every mode (``_first_step``);
* an exception a pass raises keeps its class and gets a note naming the pass, the
  level's path and the passes run before it at that level;
* with ``JAXPAR_CHECKS=1`` in the environment, every level the walker rebuilds is
  checked with JAX's own jaxpr checker (``_compat.check_jaxpr``), and a malformed one
  raises naming the pass that made it.

Example::

    analysis = Analysis(Options().resolve("gpu"))
    static = [p for p in PASSES if p.name == "make_loops_static"]  # passes/__init__.py
    new_jaxpr, decisions = walk_levels(closed_jaxpr, static, analysis)

Rewrites of a nested level are traced where JAX traced that level
(``_compat.nested_trace_context``): inside a ``shard_map`` body with its mesh axes
bound, since the body's values name them.

Sharp edges:
  * Equation indices in a decision refer to the level as the pass saw it: a
    later pass sees the level as the earlier passes rewrote it. ``produced`` refers
    to the program the walk returns.
  * A nested open jaxpr (``remat`` bodies up to jax 0.10) whose rewrite would
    capture constants cannot be replaced; it is kept as it was and the
    decisions made inside it are reported as "left alone".
  * ``JAXPAR_CHECKS`` is read at every rebuild. Each check reads the whole level,
    nested levels included, so the checks are for tests and bug reports.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from .. import _compat
from .._analysis import Analysis
from .._compat import JaxprLike
from .._cost import launch_pricing
from .._graph import Graph
from .._memo import IdentityMemo
from ._protocol import UNCHANGED_KINDS, DecisionKind, Level, Pass, PassDecision, Rewrite
from ._splice import EqnOrigins, eqn_origins, rebuild_level

# Bound on the rounds of level passes at one level (each productive round removes a loop,
# loop trips, or a unit unroll factor, so real programs settle in a few).
MAX_ROUNDS = 64

# The environment variable that turns on the checks of every rebuilt level.
CHECKS_VARIABLE = "JAXPAR_CHECKS"


def walk_levels(jaxpr: JaxprLike, level_passes: Sequence[Pass], analysis: Analysis,
                path: str = "") -> tuple[Any, list[PassDecision]]:
    """Runs ``level_passes`` in order at every nesting level of ``jaxpr``, innermost first.

    A level whose own loops were rewritten is walked again, since the loops the passes
    made (a fused body holding two inner scans) may offer new rewrites; so applying the
    passes a second time changes nothing.

    Returns ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.
    """
    decisions: list[PassDecision] = []
    current = jaxpr
    for attempt in range(MAX_ROUNDS):
        new, walk_decisions, level_changed = _walk_once(current, level_passes, analysis, path)
        decisions.extend(d for d in walk_decisions
                         if attempt == 0 or d.kind not in UNCHANGED_KINDS)
        current = new
        if not level_changed:
            if not path:  # the top level: where each decision's equations ended up
                decisions = eqn_origins(analysis).with_products(current, decisions)
            return current, decisions
    raise RuntimeError(f"jaxpar's passes did not settle after {MAX_ROUNDS} walks at "
                       f"{path or '/'}; please report it with the program")


def _walk_once(jaxpr: JaxprLike, level_passes: Sequence[Pass], analysis: Analysis, path: str
               ) -> tuple[Any, list[PassDecision], bool]:
    origins = eqn_origins(analysis)
    decisions, params, holds = _walk_nested(jaxpr, level_passes, analysis, path, origins)
    current = jaxpr
    if params:
        rebuilt = rebuild_level(jaxpr, [], params, origins=origins)
        if rebuilt is not None and _checks_on():
            try:
                _check_level(rebuilt)
            except Exception as error:
                _note(error, f"jaxpar: at level {path or '/'!r}, rebuilt with its nested "
                             "levels as the passes rewrote them")
                raise
        if rebuilt is None:
            return jaxpr, _as_left_alone(decisions, "the enclosing jaxpr cannot take new "
                                                    "constants, so its rewrite was dropped"), False
        current = rebuilt
        new_eqns = _compat.open_jaxpr(rebuilt)[0].eqns  # in the same order
        for index, made in holds.items():
            origins.add(new_eqns[index], made)
    # Rounds until nothing changes: fusing scans of unequal lengths leaves remainder scans
    # that may fuse or batch with others, and a second application must change nothing.
    # "Left alone" and "host-sync" notes describe the level as it came in (the first round);
    # later rounds only see loops the passes made.
    changes: list[PassDecision] = []
    kept: list[PassDecision] = []
    level_changed = False
    ran: list[str] = []  # the passes run at this level so far, in order (for errors)
    for round_index in range(MAX_ROUNDS):
        changed = False
        for level_pass in level_passes:
            try:
                step = _rebuilt_step(level_pass, current, path, analysis, origins)
            except Exception as error:
                _note(error, _pass_note(level_pass.name, path, round_index, ran))
                raise
            ran.append(level_pass.name)
            level_decisions = step.decisions
            if round_index > 0:
                level_decisions = [d for d in level_decisions
                                   if d.kind not in UNCHANGED_KINDS]
            if step.rewrites:
                if step.rebuilt is None:
                    kept.extend(_as_left_alone(
                        level_decisions, "this jaxpr cannot take new constants, so the "
                                         "rewrite was dropped"))
                    continue
                current = step.rebuilt
                changed = level_changed = True
            changes.extend(d for d in level_decisions if d.kind not in UNCHANGED_KINDS)
            kept.extend(d for d in level_decisions if d.kind in UNCHANGED_KINDS)
        if not changed:
            break
    else:
        raise RuntimeError(f"jaxpar's passes did not settle after {MAX_ROUNDS} rounds at "
                           f"{path or '/'}; please report it with the program")
    decisions.extend(changes)
    decisions.extend(kept)
    return current, decisions, level_changed


def _walk_nested(jaxpr: JaxprLike, level_passes: Sequence[Pass], analysis: Analysis,
                 path: str, origins: EqnOrigins
                 ) -> tuple[list[PassDecision], dict[int, dict[str, Any]],
                            dict[int, set[tuple[int, bool]]]]:
    """``_walk_once``'s walk of the levels nested in ``jaxpr``'s equations: their
    decisions, the new parameters of the equations holding a rewritten level, and per
    such equation what was made inside it."""
    inner, _ = _compat.open_jaxpr(jaxpr)
    decisions: list[PassDecision] = []
    params: dict[int, dict[str, Any]] = {}
    holds: dict[int, set[tuple[int, bool]]] = {}  # equation -> what was made inside it
    for index, eqn in enumerate(inner.eqns):
        replacements = {}
        for name, item, sub in analysis.subjaxprs(eqn):
            label = f"{name}[{item}]" if item is not None else name
            sub_path = f"{path}/{eqn.primitive.name}#{index}.{label}"
            # Rewrites of a nested level are traced where JAX traced that level (a
            # shard_map body with its mesh axes bound).
            with _compat.nested_trace_context(eqn):
                new_sub, sub_decisions = walk_levels(sub, level_passes, analysis, sub_path)
            decisions.extend(sub_decisions)
            if new_sub is not sub:
                replacements[(name, item)] = new_sub
                holds.setdefault(index, set()).update(
                    (origins.number(d), True) for d in sub_decisions
                    if d.kind not in UNCHANGED_KINDS)
        if replacements:
            params[index] = _compat.eqn_replace_subjaxprs(eqn, replacements)
    return decisions, params, holds


def _rebuilt_step(level_pass: Pass, jaxpr: Any, path: str, analysis: Analysis,
                  origins: EqnOrigins) -> _Step:
    """``level_pass``'s step on the level ``jaxpr`` (``_pass_step``), with the level its
    rewrites make (``rebuilt``; None where the level cannot take them), checked with
    JAX's jaxpr checker when ``JAXPAR_CHECKS`` asks for it."""
    graph = analysis.graph(jaxpr)
    step = _pass_step(level_pass, jaxpr, path, graph, analysis)
    if step.rewrites and step.rebuilt is None:
        step.rebuilt = rebuild_level(
            jaxpr, step.rewrites, graph=graph,
            orders=analysis.shared_memo("emission_order"), origins=origins,
            owners=_owners(step.rewrites, step.decisions, origins),
            traces=None if path else analysis.shared_state("top_level_traces", dict),
            derive_graph=analysis.derive_graph)
        if step.rebuilt is not None and _checks_on():
            _check_level(step.rebuilt)
    return step


def _checks_on() -> bool:
    """Whether ``JAXPAR_CHECKS`` asks for the checks (set, and not ``0``/``false``)."""
    return os.environ.get(CHECKS_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")


def _check_level(jaxpr: JaxprLike) -> None:
    """Checks a rebuilt level with JAX's own jaxpr checker (types, bindings, effects,
    nested jaxprs).

    Raises:
        JAX's ``JaxprTypeError`` (with a note) where the level is malformed.
    """
    try:
        _compat.check_jaxpr(jaxpr)
    except Exception as error:
        _note(error, f"jaxpar: {CHECKS_VARIABLE}=1: a level rebuilt with a pass's rewrites "
                     "is malformed (a jaxpar bug: please report it with the program)")
        raise


def _pass_note(name: str, path: str, round_index: int, ran: Sequence[str]) -> str:
    """The note an exception raised in the pass ``name`` gets: the pass, the level's
    path, and the passes run before it at that level (in this walk of it)."""
    before = ", ".join(ran) if ran else "none"
    return (f"jaxpar: raised in pass {name!r} at level {path or '/'!r} (round "
            f"{round_index + 1}; passes run before it at this level: {before})")


def _note(error: BaseException, note: str) -> None:
    """Adds ``note`` to ``error`` once (the class stays, so ``except ValueError`` still
    catches a pass's ``ValueError``)."""
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)


@dataclasses.dataclass(slots=True)
class _Step:
    """What one pass did to one level (at one path): its rewrites, its decisions
    (stamped with the pass's name) and, once rebuilt, the level they make."""

    level: Any
    rewrites: list[Rewrite]
    decisions: list[PassDecision]
    rebuilt: Any = None


# The ways a mode prices launches (``_cost.launch_pricing``).
_PRICINGS = ("serial", "beside")


def _pass_step(level_pass: Pass, jaxpr: Any, path: str, graph: Graph,
               analysis: Analysis) -> _Step:
    """``level_pass`` run on the level ``jaxpr`` at ``path``, or what it did there in
    another CUDA-graph mode (the ``"pass_steps"`` shared memo).

    The program is analysed again in each mode that prices launches otherwise
    (``_pipeline.analyse``). A pass's first visit of a level in a walk is a
    deterministic function of the level, the path and the settings, so the first visit
    in another mode (the same settings but the mode) gets the same step: its decisions
    (the same objects, so ``EqnOrigins``' records of the equations made hold for both)
    and its rebuilt level. A pass that prices launches is run again in a mode that
    prices them otherwise unless it said it decides alike in both
    (``LevelResult.decided_alike``); where it decides exactly as it did in the other
    pricing (equal decisions, rewrites of the same equations and keys: the same
    groups), it takes the other's step, rebuilt level included, so the walks of the two
    modes share every level from there on. Later visits in a walk run the pass (they
    answer from its own memos, or from the walk's ``searched_in_vain`` for a row that
    ``remembers_search``), but for a visit of a level at a path where the pass,
    visiting it before, changed nothing and reported only what it left alone
    (``_barren``): by the same determinism it would again, and the walk drops such
    reports after a level's first round (and a walk's first), which is the only time
    such a visit can come, so it gets an empty step without running the pass.
    """
    visits = analysis.memo("pass_visits")
    barren = analysis.memo("barren_visits")
    if visits.get(jaxpr, extra=level_pass.name):
        if barren.get(jaxpr, extra=(level_pass.name, path)):
            return _Step(jaxpr, [], [])
        step = _run_step(level_pass, jaxpr, path, graph, analysis)[0]
        if _barren(step):
            barren.set(jaxpr, True, extra=(level_pass.name, path))
        return step
    visits.set(jaxpr, True, extra=level_pass.name)
    step = _first_step(level_pass, jaxpr, path, graph, analysis)
    if _barren(step):
        barren.set(jaxpr, True, extra=(level_pass.name, path))
    return step


def _barren(step: _Step) -> bool:
    """Whether ``step`` changed nothing and reports only what it left alone."""
    return not step.rewrites and all(d.kind in UNCHANGED_KINDS for d in step.decisions)


def _first_step(level_pass: Pass, jaxpr: Any, path: str, graph: Graph,
                analysis: Analysis) -> _Step:
    """``_pass_step`` for the pass's first visit of the level in this walk."""
    steps: IdentityMemo[JaxprLike, _Step] = analysis.shared_memo("pass_steps")
    settings = analysis.settings
    base = (path, level_pass.name, settings.priced_in(None))
    pricing = launch_pricing(settings.modes.priced) if level_pass.prices_launches else None
    hit = steps.get(jaxpr, extra=(*base, pricing))
    if hit is not None:
        if level_pass.remembers_search:  # what the walk remembers of a visit, as if it ran
            remember_search(analysis, level_pass.name, jaxpr, hit.rewrites)
        return hit
    step, alike = _run_step(level_pass, jaxpr, path, graph, analysis)
    if pricing is not None and alike:
        for other in _PRICINGS:
            steps.set(jaxpr, step, extra=(*base, other))
    elif pricing is not None:
        for other in _PRICINGS:
            twin = steps.get(jaxpr, extra=(*base, other))
            if (other != pricing and twin is not None
                    and twin.decisions == step.decisions
                    and [(r.eqns, r.key) for r in twin.rewrites]
                    == [(r.eqns, r.key) for r in step.rewrites]):
                step = twin
                break
    steps.set(jaxpr, step, extra=(*base, pricing))
    return step


def _run_step(level_pass: Pass, jaxpr: Any, path: str, graph: Graph,
              analysis: Analysis) -> tuple[_Step, bool]:
    """The pass run on the level, and whether it said it decides alike in every launch
    pricing (``LevelResult.decided_alike``).

    For a row that ``remembers_search``, a level the pass searched in vain earlier in
    the call (``searched_in_vain``) gets an empty step without running it, and one it
    searches now in vain is remembered."""
    remembers = level_pass.remembers_search
    if remembers and searched_in_vain(analysis, level_pass.name, jaxpr):
        return _Step(jaxpr, [], []), False
    state = (None if level_pass.state is None
             else analysis.shared_state(f"pass_state:{level_pass.name}", level_pass.state))
    result = level_pass.run(Level(jaxpr, path, graph, state), analysis)
    if remembers:
        remember_search(analysis, level_pass.name, jaxpr, result.rewrites)
    return _Step(jaxpr, result.rewrites, [dataclasses.replace(d, pass_name=level_pass.name)
                                          for d in result.decisions]), result.decided_alike


def searched_in_vain(analysis: Analysis, name: str, jaxpr: Any) -> bool:
    """Whether the pass ``name`` searched the level ``jaxpr`` earlier in this walk and
    found nothing to rewrite (``remember_search``), for rows that ``remembers_search``."""
    return bool(analysis.memo("searched_in_vain").get(jaxpr, extra=name))


def remember_search(analysis: Analysis, name: str, jaxpr: Any, rewrites: Sequence[Rewrite]
                    ) -> None:
    """Records that the pass ``name`` searched the level ``jaxpr`` (in vain where
    ``rewrites`` is empty; see ``searched_in_vain``)."""
    if not rewrites:
        analysis.memo("searched_in_vain").set(jaxpr, True, extra=name)


def _owners(rewrites: Sequence[Rewrite], decisions: Sequence[PassDecision],
            origins: EqnOrigins) -> list[set[int]]:
    """Per rewrite, the numbers of the changing decisions about equations it replaces."""
    about: dict[int, list[int]] = {}
    for d in decisions:
        if d.kind not in UNCHANGED_KINDS:
            number = origins.number(d)
            for i in d.eqns:
                about.setdefault(i, []).append(number)
    return [{k for i in r.eqns for k in about.get(i, ())} for r in rewrites]


def _as_left_alone(decisions: Sequence[PassDecision], why: str) -> list[PassDecision]:
    return [d if d.kind in (DecisionKind.LEFT_ALONE, DecisionKind.HOST_SYNC)
            else dataclasses.replace(d, kind=DecisionKind.LEFT_ALONE, trips_after=d.trips_before,
                                     reason=f"{d.reason}; but {why}")
        for d in decisions]


