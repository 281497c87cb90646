"""Shared machinery of the loop passes: decisions, level rewriting, recursion.

A *level pass* looks at the equations of one jaxpr level and returns the
rewrites it wants (``Rewrite``: some equation indices and a function that emits
their replacement) plus ``LoopDecision``s. ``rebuild_level`` re-traces the level
with those rewrites applied, emitting every rewrite at a point where all its
inputs exist (the order comes from ``_plan.order_units``, which contracts each
rewrite's equations to one unit). ``walk_levels`` runs level passes at every
nesting level, innermost first, through every jaxpr-valued parameter.

Example::

    new_jaxpr, decisions = walk_levels(closed_jaxpr, [static_loops_level])

Sharp edges:
  * Equation indices in a decision refer to the level as the pass saw it: a
    later pass sees the level as the earlier passes rewrote it.
  * A nested open jaxpr (``remat`` bodies up to jax 0.10) whose rewrite would
    capture constants cannot be replaced; it is kept as it was and the
    decisions made inside it are reported as "left alone".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from .. import _compat
from .._graph import Graph, build_graph
from .._interp import Env
from .._plan import RegionPlan, SectionPlan, order_units

KIND_FUSED = "fused"
KIND_BATCHED = "batched"
KIND_UNROLLED = "unrolled"
KIND_MADE_STATIC = "made static"
KIND_LEFT_ALONE = "left alone"
KIND_HOST_SYNC = "host-sync loop"
_UNCHANGED_KINDS = (KIND_LEFT_ALONE, KIND_HOST_SYNC)

# Bound on the rounds of level passes at one level (each productive round removes a loop,
# loop trips, or a unit unroll factor, so real programs settle in a few).
MAX_ROUNDS = 64


@dataclasses.dataclass(frozen=True, slots=True)
class LoopDecision:
    """What a loop pass did (or declined to do) with some loops of one level.

    Attributes:
        location: the level, as a path like the planner's (``"/"`` is the top level,
            ``"/scan#3.jaxpr"`` the body of equation 3's scan).
        kind: ``"fused"``, ``"batched"``, ``"unrolled"``, ``"made static"``,
            ``"left alone"`` or ``"host-sync loop"``.
        eqns: indices of the equations involved, in the level as the pass saw it.
        primitives: their primitive names.
        sources: their user source lines (``file:line (function)``).
        trips_before: loop trips (summed over the loops) before the pass; None if unknown.
        trips_after: loop trips after the pass; None if unknown.
        unroll: the unroll factor of the resulting loop(s), when one applies.
        reason: why, in words.
    """

    location: str
    kind: str
    eqns: tuple[int, ...]
    primitives: tuple[str, ...]
    sources: tuple[str, ...]
    trips_before: int | None
    trips_after: int | None
    unroll: int | None
    reason: str


def decision(path: str, kind: str, eqns: Sequence[Any], indices: Sequence[int], *,
             trips_before: int | None, trips_after: int | None, unroll: int | None,
             reason: str) -> LoopDecision:
    """Builds a ``LoopDecision`` for equations ``eqns`` at ``indices`` of level ``path``."""
    return LoopDecision(
        location=path or "/", kind=kind, eqns=tuple(indices),
        primitives=tuple(eqns[i].primitive.name for i in indices),
        sources=tuple(_compat.source_summary(eqns[i]) for i in indices),
        trips_before=trips_before, trips_after=trips_after, unroll=unroll, reason=reason)


# emit(invals of each member equation) -> outvals of each member equation
EmitFn = Callable[[list[list[Any]]], list[list[Any]]]


@dataclasses.dataclass(frozen=True, slots=True)
class Rewrite:
    """Equations (sorted indices) replaced together by what ``emit`` binds."""

    eqns: tuple[int, ...]
    emit: EmitFn


LevelPass = Callable[[Any, str], tuple[list[Rewrite], list[LoopDecision]]]


def evaluate(jaxpr: Any, *args: Any) -> list[Any]:
    """Evaluates a closed or open jaxpr under the current trace, keeping source info."""
    inner, consts = _compat.open_jaxpr(jaxpr)
    return _evaluate_open(inner, consts, args, {}, None)


def _evaluate_open(inner: Any, consts: Sequence[Any], args: Sequence[Any],
                   params: dict[int, dict[str, Any]],
                   plan: tuple[tuple[tuple[Any, ...], ...], list[Rewrite]] | None
                   ) -> list[Any]:
    env = Env()
    read, write = env.read, env.write
    write(inner.constvars, consts)
    write(inner.invars, args)
    eqns = inner.eqns
    if plan is None:
        units: Sequence[tuple[Any, ...]] = [("eqn", i) for i in range(len(eqns))]
        rewrites: list[Rewrite] = []
    else:
        units, rewrites = plan
    for unit in units:
        if unit[0] == "eqn":
            eqn = eqns[unit[1]]
            write(eqn.outvars, _compat.bind_eqn(eqn, [read(v) for v in eqn.invars],
                                                params.get(unit[1])))
            continue
        rewrite = rewrites[unit[1]]
        outs = rewrite.emit([[read(v) for v in eqns[i].invars] for i in rewrite.eqns])
        for i, values in zip(rewrite.eqns, outs, strict=True):
            write(eqns[i].outvars, values)
    return [read(v) for v in inner.outvars]


def emission_order(graph: Graph, groups: Sequence[Sequence[int]]
                   ) -> tuple[tuple[Any, ...], ...] | None:
    """Emission units with each group contracted, or None if contracting makes a cycle.

    Units are ``("eqn", index)`` or ``("group", group_index)``.
    """
    sections = [SectionPlan(group=k, regions=(RegionPlan(1, tuple(sorted(g)), 0.0),))
                for k, g in enumerate(groups)]
    try:
        order = order_units(graph, sections)
    except RuntimeError:
        return None
    return tuple(("group", u[1]) if u[0] == "region" else u for u in order)


def rebuild_level(jaxpr: Any, rewrites: Sequence[Rewrite],
                  params: dict[int, dict[str, Any]] | None = None) -> Any | None:
    """Re-traces ``jaxpr`` with ``rewrites`` and replaced equation ``params``.

    Returns a jaxpr of the same kind and signature, or None when that is
    impossible (see the module's sharp edges).

    Raises:
        RuntimeError: the rewrites' groups cannot be ordered (a pass bug).
    """
    inner, consts = _compat.open_jaxpr(jaxpr)
    graph = build_graph(inner)
    order = emission_order(graph, [r.eqns for r in rewrites])
    if order is None:
        raise RuntimeError("jaxpar loop pass bug: merged loops depend on each other; "
                           "please report it with the program that triggered it")
    plan = (order, list(rewrites))
    replaced = dict(params or {})

    def run(*args: Any) -> list[Any]:
        return _evaluate_open(inner, consts, args, replaced, plan)

    return _compat.retrace_like(run, jaxpr)


def walk_levels(jaxpr: Any, level_passes: Sequence[LevelPass], path: str = ""
                ) -> tuple[Any, list[LoopDecision]]:
    """Runs ``level_passes`` in order at every nesting level of ``jaxpr``, innermost first.

    A level whose own loops were rewritten is walked again, since the loops the passes
    made (a fused body holding two inner scans) may offer new rewrites; so applying the
    passes a second time changes nothing.

    Returns ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.
    """
    decisions: list[LoopDecision] = []
    current = jaxpr
    for attempt in range(MAX_ROUNDS):
        new, walk_decisions, level_changed = _walk_once(current, level_passes, path)
        decisions.extend(d for d in walk_decisions
                         if attempt == 0 or d.kind not in _UNCHANGED_KINDS)
        current = new
        if not level_changed:
            return current, decisions
    raise RuntimeError(f"jaxpar loop passes did not settle after {MAX_ROUNDS} walks at "
                       f"{path or '/'}; please report it with the program")


def _walk_once(jaxpr: Any, level_passes: Sequence[LevelPass], path: str
               ) -> tuple[Any, list[LoopDecision], bool]:
    inner, _ = _compat.open_jaxpr(jaxpr)
    decisions: list[LoopDecision] = []
    params: dict[int, dict[str, Any]] = {}
    for index, eqn in enumerate(inner.eqns):
        replacements = {}
        for name, item, sub in _compat.eqn_subjaxprs(eqn):
            label = f"{name}[{item}]" if item is not None else name
            sub_path = f"{path}/{eqn.primitive.name}#{index}.{label}"
            new_sub, sub_decisions = walk_levels(sub, level_passes, sub_path)
            decisions.extend(sub_decisions)
            if new_sub is not sub:
                replacements[(name, item)] = new_sub
        if replacements:
            params[index] = _compat.eqn_replace_subjaxprs(eqn, replacements)
    current = jaxpr
    if params:
        rebuilt = rebuild_level(jaxpr, [], params)
        if rebuilt is None:
            return jaxpr, _as_left_alone(decisions, "the enclosing jaxpr cannot take new "
                                                    "constants, so its rewrite was dropped"), False
        current = rebuilt
    # Rounds until nothing changes: fusing scans of unequal lengths leaves remainder scans
    # that may fuse or batch with others, and a second application must change nothing.
    # "Left alone" and "host-sync" notes describe the level as it came in (the first round);
    # later rounds only see loops the passes made.
    changes: list[LoopDecision] = []
    kept: list[LoopDecision] = []
    level_changed = False
    for round_index in range(MAX_ROUNDS):
        changed = False
        for level_pass in level_passes:
            rewrites, level_decisions = level_pass(current, path)
            if round_index > 0:
                level_decisions = [d for d in level_decisions
                                   if d.kind not in _UNCHANGED_KINDS]
            if rewrites:
                rebuilt = rebuild_level(current, rewrites)
                if rebuilt is None:
                    kept.extend(_as_left_alone(
                        level_decisions, "this jaxpr cannot take new constants, so the "
                                         "rewrite was dropped"))
                    continue
                current = rebuilt
                changed = level_changed = True
            changes.extend(d for d in level_decisions if d.kind not in _UNCHANGED_KINDS)
            kept.extend(d for d in level_decisions if d.kind in _UNCHANGED_KINDS)
        if not changed:
            break
    else:
        raise RuntimeError(f"jaxpar loop passes did not settle after {MAX_ROUNDS} rounds at "
                           f"{path or '/'}; please report it with the program")
    decisions.extend(changes)
    decisions.extend(kept)
    return current, decisions, level_changed


def _as_left_alone(decisions: Sequence[LoopDecision], why: str) -> list[LoopDecision]:
    return [d if d.kind in (KIND_LEFT_ALONE, KIND_HOST_SYNC) else dataclasses.replace(
        d, kind=KIND_LEFT_ALONE, trips_after=d.trips_before, reason=f"{d.reason}; but {why}")
        for d in decisions]


def level_eqns(jaxpr: Any) -> list[Any]:
    """The equations of one level."""
    inner, _ = _compat.open_jaxpr(jaxpr)
    return list(inner.eqns)


def loop_candidate(eqn: Any) -> bool:
    """Whether a scan may be merged or re-emitted: no effects, no user placement."""
    return (eqn.primitive.name == "scan" and not eqn.effects
            and not _compat.eqn_frontend_attributes(eqn))
