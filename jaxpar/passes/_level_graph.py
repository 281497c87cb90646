"""Walks over one level's dependency graph that the passes share: whether two candidates
are independent (``ancestor_masks``, ``independent``), greedy groups of independent
candidates that can each become one unit (``group_independent``), the launch depth the
batching passes align members by (``launch_depths``), and which member results leave
through an elementwise tail of their own (``private_tails_leave``).

Example::

    groups = group_independent(graph, scans, compatible=lambda group, i: True)
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from .. import _compat
from .._compat import JaxprEqn
from .._program.graph import Graph
from ._splice import emission_order


def independent(ancestors: dict[int, tuple[int, int]], i: int, j: int) -> bool:
    """Whether neither candidate reaches the other (``ancestors`` from ``ancestor_masks``)."""
    bit_i, mask_i = ancestors[i]
    bit_j, mask_j = ancestors[j]
    return not mask_i & bit_j and not mask_j & bit_i


def ancestor_masks(graph: Graph, tracked: list[int]) -> dict[int, tuple[int, int]]:
    """Per tracked equation, ``(its bit, its tracked ancestors)``.

    Only tracked equations get bits (by their rank among ``tracked``), so the masks
    stay as wide as the candidates (a few loops), not the level.
    """
    bit = {eqn: 1 << rank for rank, eqn in enumerate(tracked)}
    masks = [0] * graph.size
    for i in range(graph.size):
        mask = 0
        for p in graph.preds[i]:
            mask |= masks[p] | bit.get(p, 0)
        masks[i] = mask
    return {i: (bit[i], masks[i]) for i in tracked}


def group_independent(graph: Graph, candidates: list[int],
                      compatible: Callable[[list[int], int], bool],
                      prefer: Callable[[list[int], int], Any] | None = None
                      ) -> list[list[int]]:
    """Greedy groups of mutually independent candidates.

    ``compatible(group, index)`` says whether ``index`` may join ``group``;
    ``prefer(group, index)`` ranks the groups to try first. Every group can be
    contracted to one unit, together with all the others, without making a cycle.
    """
    ancestors = ancestor_masks(graph, candidates)
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


def launch_depths(graph: Graph, heavy: Sequence[bool]) -> list[int]:
    """Per equation: most kernel-launching (``heavy``) equations on a path from the
    level's inputs to it, itself included: the *launch depth* the batching passes
    align members by."""
    depth = [0] * graph.size
    for i, preds in enumerate(graph.preds):  # most equations have one predecessor
        depth[i] = heavy[i] + (0 if not preds else depth[preds[0]] if len(preds) == 1
                               else max([depth[p] for p in preds]))
    return depth


_MERGED = object()  # a value computed from more than one member's results


def private_tails_leave(eqns: Sequence[JaxprEqn], graph: Graph, results: Mapping[Any, int],
                        launches: Callable[[int], bool], outputs: Collection[Any]
                        ) -> set[Any]:
    """The member results (``results``: variable -> the equation writing it) whose
    elementwise tail, computed from that member's result alone, is one of ``outputs``.

    Unbatched, XLA:GPU fuses such a tail into the member's matmul (a Triton GEMM's
    epilogue: 100 members ``tanh(x @ w)`` returned apart compile to 100 kernels); batched,
    each is a kernel of its own, reading its slice of the batched result (112 kernels).
    The walk follows elementwise equations (not ``launches``) forward from each result
    and stops where a value mixes several members' results (a sum of the members is
    made once for them all).
    """
    origin: dict[Any, Any] = {v: v for v in results}
    leaving = {v for v in results if v in outputs}
    heap = sorted({r for i in results.values() for r in graph.succs[i]})
    seen = set(heap)
    while heap:
        j = heapq.heappop(heap)
        eqn = eqns[j]
        if launches(j):
            continue
        keys = {origin[v] for v in eqn.invars if not _compat.is_literal(v) and v in origin}
        if not keys:
            continue  # an effect edge
        key = keys.pop() if len(keys) == 1 else _MERGED
        for out in eqn.outvars:
            if not _compat.is_drop_var(out):
                origin[out] = key
                if key is not _MERGED and out in outputs:
                    leaving.add(key)
        if key is _MERGED:
            continue
        for r in graph.succs[j]:
            if r not in seen:
                seen.add(r)
                heapq.heappush(heap, r)
    return leaving
