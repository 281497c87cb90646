"""Batch independent scans that run the same computation into one ``vmap``ped scan.

Two scans of one level with no path between them in the dependency graph,
whose bodies are the same jaxpr up to variable names (same ``str``, same
constants), with the same length, direction, unroll factor and operand types,
become one ``lax.scan`` under ``jax.vmap``: carries, xs and consts are stacked
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
  * Bodies are compared by their printed jaxpr and their constants' values, so two
    bodies that differ only in the order of equations are not recognised.
  * Stacking copies the operands once per call; for large xs and few trips that
    copy can cost more than the loop overhead it saves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _compat
from .._graph import build_graph
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


def const_fingerprint(value: Any) -> Hashable:
    try:
        array = np.asarray(value)
    except Exception:  # tracers or extended dtypes: compare by identity
        return ("id", id(value))
    return (array.shape, str(array.dtype), hashlib.sha1(array.tobytes()).hexdigest())


def body_key(eqn: Any) -> Hashable:
    """Equal for two scans exactly when they run the same computation on same-typed operands."""
    info = _compat.scan_info(eqn)
    _, consts = _compat.open_jaxpr(info.jaxpr)
    return (str(info.jaxpr), tuple(const_fingerprint(c) for c in consts), info.length,
            info.reverse, info.unroll, info.num_consts, info.num_carry,
            tuple((str(v.aval), getattr(v.aval, "weak_type", False)) for v in eqn.invars))


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
    keys = {i: body_key(eqns[i]) for i in candidates}
    groups = [g for g in group_independent(jaxpr, candidates,
                                           lambda g, i: keys[g[0]] == keys[i]) if len(g) > 1]
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


def vmap_members(fn: Callable[..., Sequence[Any]], columns: list[list[Any]], count: int,
                 context: Any) -> list[list[Any]]:
    """Runs ``fn`` once for ``count`` members, batched: what batching passes emit.

    ``columns`` holds, per operand of ``fn``, the members' values. A column whose values
    are all the same object is passed once, unbatched (a shared operand); the others are
    stacked along a new leading axis and ``fn`` runs under ``jax.vmap``. New equations
    get ``context``'s (an equation's) source info. Returns, per member, ``fn``'s results.
    """
    operands: list[Any] = []
    in_axes: list[int | None] = []
    for column in columns:
        if all(v is column[0] for v in column[1:]):
            operands.append(column[0])
            in_axes.append(None)
        else:
            operands.append(jnp.stack([jnp.asarray(v) for v in column]))
            in_axes.append(0)
    with _compat.eqn_context(context):
        if any(axis == 0 for axis in in_axes):
            outs = jax.vmap(fn, in_axes=tuple(in_axes))(*operands)
            return [[lax.index_in_dim(out, m, keepdims=False) for out in outs]
                    for m in range(count)]
        shared = list(fn(*operands))  # the very same computation, repeated
    return [shared] * count


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
