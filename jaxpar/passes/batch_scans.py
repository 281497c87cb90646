"""Batch independent scans that run the same computation into one ``vmap``ped scan.

Two scans of one level with no path between them in the dependency graph,
whose bodies compute the same thing (compared structurally, parameters and
constants by value: ``_structure``), with the same length, direction, unroll
factor and operand types, and whose body ``vmap`` batches faithfully and cheaply
given the operands they share (``_shared``), become one ``lax.scan`` under
``jax.vmap``: carries, xs and consts are stacked
along a new leading axis (an operand that is the same variable in every member
is shared, not stacked). Each body's ``k`` kernels per trip become ``k`` bigger
kernels, and the two loops one loop: what the seed story's ``test3`` does by hand.

Example::

    def f(a, b, xs1, xs2):
        step = lambda c, x: (c @ x, None)
        return lax.scan(step, a, xs1)[0], lax.scan(step, b, xs2)[0]

    new_jaxpr, decisions = batch_scans(jax.make_jaxpr(f)(*args))
    # one scan whose body holds a dot_general with batch dimensions

Sharp edges:
  * Two bodies that differ only in the order of equations are not recognised.
  * Bodies holding primitives off ``_shared``'s allow-list (``rbg`` random bits,
    host callbacks, a ``custom_vjp``, a ``cond`` or ``while`` whose predicate
    reads a stacked operand) are not batched, and nor are scans on the very same
    operands whose body holds what must not be merged (``_shared.merge_refusal``);
    equal scans refused so are reported as left alone, and ``fuse_scans`` may fuse
    them.
  * Stacking copies the operands once per call; for large xs and few trips that
    copy can cost more than the loop overhead it saves.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax

from .. import _compat
from .._analysis import Analysis
from .._compat import JaxprEqn
from .._structure import StructuralKeys
from ._shared import batch_refusal, body_key, group_independent, static_refusal, vmap_members
from ._walk import (
    DecisionKind,
    Level,
    LevelResult,
    PassDecision,
    Rewrite,
    decision,
    evaluate,
    loop_candidates,
    loop_trips,
)


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: one batched scan per group of independent identical scans."""
    eqns, path = level.eqns, level.path
    candidates = loop_candidates(eqns)
    if len(candidates) < 2:
        return [], []
    structure = analysis.structural_keys
    keys = {i: body_key(eqns[i], structure) for i in candidates}
    refusals = _refusals(eqns, [i for i in candidates if keys[i] is None], structure)
    candidates = [i for i in candidates if keys[i] is not None]

    def compatible(group: list[int], index: int) -> bool:
        if keys[group[0]] != keys[index]:
            return False
        why = batch_refusal(eqns, [*group, index])
        if why is not None:
            refusals.setdefault(keys[index], (why, set()))[1].update((*group, index))
        return why is None

    groups = [g for g in group_independent(level.graph, candidates, compatible)
              if len(g) > 1]
    rewrites: list[Rewrite] = []
    decisions: list[PassDecision] = []
    batched = {i for g in groups for i in g}
    for why, refused in refusals.values():
        left = sorted(refused - batched)
        if len(left) > 1:
            decisions.append(decision(
                path, DecisionKind.LEFT_ALONE, eqns, left, trips_before=None, trips_after=None,
                unroll=None, reason=f"{len(left)} scans run the same body, but vmap would "
                                    f"not batch them faithfully and cheaply: {why}"))
    for group in groups:
        infos = [_compat.scan_info(eqns[i]) for i in group]
        rewrites.append(Rewrite(tuple(group), _batched_emitter([eqns[i] for i in group])))
        decisions.append(decision(
            path, DecisionKind.BATCHED, eqns, group,
            trips_before=sum(loop_trips(info.length, info.unroll) for info in infos),
            trips_after=loop_trips(infos[0].length, infos[0].unroll), unroll=infos[0].unroll,
            reason=f"{len(group)} independent scans run the same body: one vmapped scan with "
                   "stacked operands, so each trip launches the same kernels, batched"))
    return rewrites, decisions


def _refusals(eqns: list[JaxprEqn], refused: list[int], structure: StructuralKeys
              ) -> dict[Hashable, tuple[str, set[int]]]:
    """Scans whose bodies ``vmap`` never batches faithfully, by body (equal scans
    together): the reason and the scans."""
    found: dict[Hashable, tuple[str, set[int]]] = {}
    for i in refused:
        key = (structure.equation(eqns[i]), tuple(v.aval for v in eqns[i].invars))
        why = found[key][0] if key in found else static_refusal(eqns[i]) or ""
        found.setdefault(key, (why, set()))[1].add(i)
    return found


def _batched_emitter(members: list[Any]) -> Any:
    info = _compat.scan_info(members[0])

    def emit(invals: list[list[Any]]) -> list[list[Any]]:
        columns = [[vals[position] for vals in invals] for position in range(len(invals[0]))]
        return vmap_members(lambda *flat: _run_scan(info, flat), columns, len(invals),
                            members[0])

    return emit


def _run_scan(info: Any, operands: Any) -> list[Any]:
    consts = operands[:info.num_consts]
    carry = list(operands[info.num_consts:info.num_consts + info.num_carry])
    xs = list(operands[info.num_consts + info.num_carry:])

    def step(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = evaluate(info.jaxpr, *consts, *c, *x)
        return outs[:info.num_carry], outs[info.num_carry:]

    final, ys = jax.lax.scan(step, carry, xs, length=info.length, reverse=info.reverse,
                             unroll=info.unroll)
    return [*final, *ys]


