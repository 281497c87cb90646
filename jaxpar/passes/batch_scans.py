"""Batch independent scans that run the same computation into one ``vmap``ped scan.

Two scans of one level with no path between them in the dependency graph,
whose bodies compute the same thing (compared structurally, parameters and
constants by value: ``_structure``), with the same length, direction, unroll
factor and operand types, and whose body ``vmap`` batches faithfully and cheaply
given the operands they share (``_batching``), become one ``lax.scan`` under
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
  * Bodies holding primitives off ``_batching``'s allow-list (``rbg`` random bits,
    callbacks without a ``vmap_method``, a ``cond`` or ``while`` whose predicate
    reads a stacked operand) are not batched; ``fuse_scans`` may fuse them.
  * Stacking copies the operands once per call; for large xs and few trips that
    copy can cost more than the loop overhead it saves.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from .. import _compat
from .._graph import build_graph
from .._structure import StructuralKeys
from ._batching import equation_refusal, shared_column, static_refusal, vmap_members
from ._walk import (
    KIND_BATCHED,
    LoopDecision,
    Rewrite,
    decision,
    emission_order,
    evaluate,
    level_eqns,
    loop_candidate,
    walk_levels,
)


def body_key(eqn: Any, keys: StructuralKeys) -> Hashable | None:
    """Equal for two scans exactly when they run the same computation on same-typed
    operands (compared structurally: ``_structure``); None for a scan that can never be
    batched (``_batching.static_refusal``)."""
    if static_refusal(eqn) is not None:
        return None
    return (keys.equation(eqn),
            tuple((v.aval, getattr(v.aval, "weak_type", False)) for v in eqn.invars))


def batch_refusal(eqns: Sequence[Any], group: Sequence[int]) -> str | None:
    """Why the scans ``group`` (same ``body_key``) cannot run as one vmapped scan, or None:
    what ``vmap`` would make of them, given which operands they share."""
    columns = [[_operand(eqns[m].invars[position]) for m in group]
               for position in range(len(eqns[group[0]].invars))]
    return equation_refusal(eqns[group[0]], [not shared_column(c) for c in columns])


def _operand(atom: Any) -> Any:
    """What the emitter receives for ``atom`` (see ``_walk._trace_rewrite``)."""
    return _compat.literal_value(atom) if _compat.is_literal(atom) else atom


def independent(ancestors: dict[int, tuple[int, int]], i: int, j: int) -> bool:
    """Whether neither candidate reaches the other (``ancestors`` from ``ancestor_masks``)."""
    bit_i, mask_i = ancestors[i]
    bit_j, mask_j = ancestors[j]
    return not mask_i & bit_j and not mask_j & bit_i


def ancestor_masks(jaxpr: Any, tracked: list[int]) -> tuple[Any, dict[int, tuple[int, int]]]:
    """The level's graph and, per tracked equation, ``(its bit, its tracked ancestors)``.

    Only tracked equations get bits (by their rank among ``tracked``), so the masks
    stay as wide as the candidates (a few loops), not the level.
    """
    inner, _ = _compat.open_jaxpr(jaxpr)
    graph = build_graph(inner)
    bit = {eqn: 1 << rank for rank, eqn in enumerate(tracked)}
    masks = [0] * graph.size
    for i in range(graph.size):
        mask = 0
        for p in graph.preds[i]:
            mask |= masks[p] | bit.get(p, 0)
        masks[i] = mask
    return graph, {i: (bit[i], masks[i]) for i in tracked}


def group_independent(jaxpr: Any, candidates: list[int],
                      compatible: Callable[[list[int], int], bool],
                      prefer: Callable[[list[int], int], Any] | None = None
                      ) -> list[list[int]]:
    """Greedy groups of mutually independent candidates.

    ``compatible(group, index)`` says whether ``index`` may join ``group``;
    ``prefer(group, index)`` ranks the groups to try first. Every group can be
    contracted to one unit, together with all the others, without making a cycle.
    """
    graph, ancestors = ancestor_masks(jaxpr, candidates)
    groups: list[list[int]] = []
    for index in candidates:
        options = [g for g in groups if compatible(g, index)
                   and all(independent(ancestors, m, index) for m in g)]
        if prefer is not None:
            options.sort(key=lambda g: prefer(g, index))
        placed = False
        for group in options:
            group.append(index)
            if emission_order(graph, [g for g in groups if len(g) > 1]) is not None:
                placed = True
                break
            group.pop()
        if not placed:
            groups.append([index])
    return [sorted(g) for g in groups]


def batch_scans_level(jaxpr: Any, path: str) -> tuple[list[Rewrite], list[LoopDecision]]:
    """The level pass: one batched scan per group of independent identical scans."""
    eqns = level_eqns(jaxpr)
    candidates = [i for i, e in enumerate(eqns) if loop_candidate(e)]
    if len(candidates) < 2:
        return [], []
    structure = StructuralKeys()
    keys = {i: body_key(eqns[i], structure) for i in candidates}
    candidates = [i for i in candidates if keys[i] is not None]

    def compatible(group: list[int], index: int) -> bool:
        return keys[group[0]] == keys[index] and batch_refusal(eqns, [*group, index]) is None

    groups = [g for g in group_independent(jaxpr, candidates, compatible) if len(g) > 1]
    rewrites, decisions = [], []
    for group in groups:
        length = _compat.scan_info(eqns[group[0]]).length
        rewrites.append(Rewrite(tuple(group), _batched_emitter([eqns[i] for i in group])))
        decisions.append(decision(
            path, KIND_BATCHED, eqns, group, trips_before=length * len(group),
            trips_after=length, unroll=_compat.scan_info(eqns[group[0]]).unroll,
            reason=f"{len(group)} independent scans run the same body: one vmapped scan with "
                   "stacked operands, so each trip launches the same kernels, batched"))
    return rewrites, decisions


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


def batch_scans(jaxpr: Any) -> tuple[Any, tuple[LoopDecision, ...]]:
    """Batches independent identical scans at every level of ``jaxpr``.

    Args:
        jaxpr: a closed jaxpr (as from ``jax.make_jaxpr``); never mutated.

    Returns:
        ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.
    """
    new, decisions = walk_levels(jaxpr, [batch_scans_level])
    return new, tuple(decisions)
