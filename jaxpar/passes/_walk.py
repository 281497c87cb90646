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
* a visit that changed nothing and reported only what it left alone is not run again
  at that level and path in the walk (``_known_step``);
* a first visit takes the step a ``StepCache`` has for it, where the caller gives one:
  the CUDA-graph mode search gives the walks of its modes one
  (``_plan.modes.ModeSteps``), which shares each row's steps between the modes, a
  row that ``prices_launches`` only between modes that price launches alike unless it
  says it decides alike (``LevelResult.decided_alike``);
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
from typing import Any, Protocol

from .. import _compat
from .._analysis import Analysis
from .._compat import JaxprLike
from .._options import Settings
from ._protocol import UNCHANGED_KINDS, DecisionKind, Level, Pass, PassDecision, Rewrite
from ._splice import EqnOrigins, Splices, eqn_origins, rebuild_level

# Bound on the rounds of level passes at one level (each productive round removes a loop,
# loop trips, or a unit unroll factor, so real programs settle in a few).
MAX_ROUNDS = 64

# The environment variable that turns on the checks of every rebuilt level.
CHECKS_VARIABLE = "JAXPAR_CHECKS"


def walk_levels(jaxpr: JaxprLike, level_passes: Sequence[Pass], analysis: Analysis,
                path: str = "", steps: StepCache | None = None
                ) -> tuple[Any, list[PassDecision]]:
    """Runs ``level_passes`` in order at every nesting level of ``jaxpr``, innermost first.

    A level whose own loops were rewritten is walked again, since the loops the passes
    made (a fused body holding two inner scans) may offer new rewrites; so applying the
    passes a second time changes nothing. ``steps``: what the passes did on their first
    visits of levels in the walks of other settings, to take instead of running them
    (``StepCache``).

    Returns ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.
    """
    decisions: list[PassDecision] = []
    current = jaxpr
    for attempt in range(MAX_ROUNDS):
        new, walk_decisions, level_changed = _walk_once(current, level_passes, analysis, path,
                                                        steps)
        decisions.extend(d for d in walk_decisions
                         if attempt == 0 or d.kind not in UNCHANGED_KINDS)
        current = new
        if not level_changed:
            if not path:  # the top level: where each decision's equations ended up
                decisions = eqn_origins(analysis).with_products(current, decisions)
            return current, decisions
    raise RuntimeError(f"jaxpar's passes did not settle after {MAX_ROUNDS} walks at "
                       f"{path or '/'}; please report it with the program")


def _walk_once(jaxpr: JaxprLike, level_passes: Sequence[Pass], analysis: Analysis, path: str,
               steps: StepCache | None) -> tuple[Any, list[PassDecision], bool]:
    origins = eqn_origins(analysis)
    decisions, params, holds = _walk_nested(jaxpr, level_passes, analysis, path, origins,
                                            steps)
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
                step = _pass_step(level_pass, current, path, analysis, steps)
                _rebuild(step, path, analysis, origins)
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
                 path: str, origins: EqnOrigins, steps: StepCache | None
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
            if not _compat.is_level(sub):  # a jaxpr its primitive binds itself
                continue
            label = f"{name}[{item}]" if item is not None else name
            sub_path = f"{path}/{eqn.primitive.name}#{index}.{label}"
            # Rewrites of a nested level are traced where JAX traced that level (a
            # shard_map body with its mesh axes bound).
            with _compat.nested_trace_context(eqn):
                new_sub, sub_decisions = walk_levels(sub, level_passes, analysis, sub_path,
                                                     steps)
            decisions.extend(sub_decisions)
            if new_sub is not sub:
                replacements[(name, item)] = new_sub
                holds.setdefault(index, set()).update(
                    (origins.number(d), True) for d in sub_decisions
                    if d.kind not in UNCHANGED_KINDS)
        if replacements:
            params[index] = _compat.eqn_replace_subjaxprs(eqn, replacements)
    return decisions, params, holds


def _rebuild(step: Step, path: str, analysis: Analysis, origins: EqnOrigins) -> None:
    """Sets ``step.rebuilt``: the level its rewrites make (None where the level cannot
    take them), checked with JAX's jaxpr checker when ``JAXPAR_CHECKS`` asks for it;
    nothing where it has no rewrites or was rebuilt before (a step taken from
    ``StepCache``)."""
    if not step.rewrites or step.rebuilt is not None:
        return
    splices = analysis.shared.of(Splices)
    step.rebuilt = rebuild_level(
        step.level, step.rewrites, graph=analysis.graph(step.level),
        orders=analysis.shared.emission_order, origins=origins,
        owners=_owners(step.rewrites, step.decisions, origins),
        traces=None if path else splices.top_level_traces,
        derive_graph=analysis.derive_graph)
    if step.rebuilt is not None and _checks_on():
        _check_level(step.rebuilt)


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
class Step:
    """What one pass did to one level (at one path): its rewrites, its decisions
    (stamped with the pass's name) and, once rebuilt, the level they make."""

    level: Any
    rewrites: list[Rewrite]
    decisions: list[PassDecision]
    rebuilt: Any = None


class StepCache(Protocol):
    """What passes did on their first visits of levels in the walks of a program with
    other settings (another CUDA-graph mode: ``_plan.modes.ModeSteps``), for a walk to
    take instead of running the pass again. A pass's first visit of a level in a walk
    is a deterministic function of the level, the path and the settings."""

    def find(self, level_pass: Pass, jaxpr: Any, path: str, settings: Settings
             ) -> Step | None:
        """The step to take for ``level_pass``'s first visit of ``jaxpr`` at ``path``
        with ``settings``, or None: run the pass (then ``keep`` its step)."""

    def keep(self, level_pass: Pass, jaxpr: Any, path: str, settings: Settings, step: Step,
             alike: bool) -> Step:
        """Keeps the ``step`` the pass's first visit made, and returns the step the walk
        takes (another's equal step, so that the walks share the levels from there);
        ``alike``: the pass said it decides alike in every launch pricing
        (``LevelResult.decided_alike``)."""


def _pass_step(level_pass: Pass, jaxpr: Any, path: str, analysis: Analysis,
               steps: StepCache | None) -> Step:
    """``level_pass`` run on the level ``jaxpr`` at ``path`` (unrebuilt), or what it is
    known to do there without running it (``_known_step``).

    For a row that ``remembers_search``, a level the pass searched in vain earlier in
    the walk (``searched_in_vain``) gets an empty step without running it, and one it
    searches now in vain is remembered. A visit that changed nothing and reported only
    what it left alone is remembered as barren (``_known_step``).
    """
    graph = analysis.graph(jaxpr)
    step, first = _known_step(level_pass, jaxpr, path, analysis, steps)
    if step is None:
        alike = False
        if level_pass.remembers_search and searched_in_vain(analysis, level_pass.name, jaxpr):
            step = Step(jaxpr, [], [])
        else:
            result = level_pass.run(Level(jaxpr, path, graph, _pass_state(level_pass, analysis)),
                                    analysis)
            if level_pass.remembers_search:
                remember_search(analysis, level_pass.name, jaxpr, result.rewrites)
            step = Step(jaxpr, result.rewrites,
                        [dataclasses.replace(d, pass_name=level_pass.name)
                         for d in result.decisions])
            alike = result.decided_alike
        if first and steps is not None:
            step = steps.keep(level_pass, jaxpr, path, analysis.settings, step, alike)
    if _barren(step):
        analysis.memos.barren_visits.set(jaxpr, True, extra=(level_pass.name, path))
    return step


def _known_step(level_pass: Pass, jaxpr: Any, path: str, analysis: Analysis,
                steps: StepCache | None) -> tuple[Step | None, bool]:
    """What ``level_pass``'s visit of ``jaxpr`` at ``path`` gives without running the pass
    (None: run it), and whether it is the pass's first visit of the level in this walk.

    A first visit takes the step ``steps`` has for it. A later visit of a level at a
    path where the pass, visiting it before, changed nothing and reported only what it
    left alone (``_barren``) gets an empty step: by the determinism of a pass's visits
    it would do so again, and the walk drops such reports after a level's first round
    (and a walk's first), which is the only time such a visit can come. Other later
    visits run the pass (which answers from its own memos, or the walk's
    ``searched_in_vain``).
    """
    memos = analysis.memos
    if memos.pass_visits.get(jaxpr, extra=level_pass.name):
        barren = memos.barren_visits.get(jaxpr, extra=(level_pass.name, path))
        return (Step(jaxpr, [], []) if barren else None), False
    memos.pass_visits.set(jaxpr, True, extra=level_pass.name)
    hit = None if steps is None else steps.find(level_pass, jaxpr, path, analysis.settings)
    if hit is not None and level_pass.remembers_search:  # as if the pass ran
        remember_search(analysis, level_pass.name, jaxpr, hit.rewrites)
    return hit, True


def _pass_state(level_pass: Pass, analysis: Analysis) -> Any:
    """The pass's state for the call (``Pass.state``), made on its first visit and kept
    for every mode's walk; None for a pass without one."""
    if level_pass.state is None:
        return None
    states = analysis.shared.pass_states
    found = states.get(level_pass.name)
    if found is None:
        found = states[level_pass.name] = level_pass.state()
    return found


def _barren(step: Step) -> bool:
    """Whether ``step`` changed nothing and reports only what it left alone."""
    return not step.rewrites and all(d.kind in UNCHANGED_KINDS for d in step.decisions)


def searched_in_vain(analysis: Analysis, name: str, jaxpr: Any) -> bool:
    """Whether the pass ``name`` searched the level ``jaxpr`` earlier in this walk and
    found nothing to rewrite (``remember_search``), for rows that ``remembers_search``."""
    return bool(analysis.memos.searched_in_vain.get(jaxpr, extra=name))


def remember_search(analysis: Analysis, name: str, jaxpr: Any, rewrites: Sequence[Rewrite]
                    ) -> None:
    """Records that the pass ``name`` searched the level ``jaxpr`` (in vain where
    ``rewrites`` is empty; see ``searched_in_vain``)."""
    if not rewrites:
        analysis.memos.searched_in_vain.set(jaxpr, True, extra=name)


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


