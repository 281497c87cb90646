"""Orienting ``batch_matmuls``' groups: each member that reads the same either way (a
square matrix product, ``x @ W`` or ``(W.T @ x.T).T``) turned so that the fewest operand
columns need a stack of their own (``orient``).

Example::

    groups = orient(eqns, groups)   # in depth order; some members now read swapped
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .. import _compat
from .._compat import JaxprEqn
from .._program.graph import DisjointSets
from ._matmul_forms import Column, is_shared
from ._matmul_groups import Group


def orient(eqns: Sequence[JaxprEqn], groups: list[Group]) -> list[Group]:
    """Groups (in depth order) with each member that reads the same either way
    (``Group.alternatives``) oriented so that the fewest operand columns need a stack
    of their own: a column all members share, or one an earlier group stacked or
    produced, costs nothing (``x @ W`` beside ``W @ x`` chained over three matmuls
    stays stacked only with the second member read transposed throughout).

    Members chained to each other (one reads the other's result) turn together: every
    combination of such chains is tried where there are at most ``_MAX_EXHAUSTIVE``,
    then single members are turned while that helps (bounded).

    A try is scored by the operand columns needing a stack of their own, then the reads
    transposed or swapped. A move turns the members of one group or chain, so each
    group's part of the score (its columns, reads turned and stacked result) is kept by
    the members turned in it, and a try reads the others' parts back.
    """
    free = [(g, m) for g, group in enumerate(groups)
            for m, alternative in enumerate(group.alternatives) if alternative is not None]
    if not free or len(free) > _MAX_ORIENTED:
        return groups  # the search grows with the square of the members: keep them as written
    chains = _chains(eqns, groups, free)
    orientations = _Orientations(eqns, groups)
    score = orientations.score
    best: frozenset[tuple[int, int]] = frozenset()
    best_score = score(best)
    if len(chains) <= _MAX_EXHAUSTIVE:
        for mask in range(1, 1 << len(chains)):
            turned = frozenset(x for c, chain in enumerate(chains) if mask >> c & 1
                               for x in chain)
            found = score(turned)
            if found < best_score:
                best, best_score = turned, found
    for _ in range(len(free) + 1):  # each round turns one member or stops
        moves = [best ^ frozenset(chain) for chain in chains] + [best ^ {x} for x in free]
        scored = [(score(turned), k) for k, turned in enumerate(moves)]
        found, k = min(scored)
        if found >= best_score:
            break
        best, best_score = moves[k], found
    return orientations.build(best)


@dataclasses.dataclass(slots=True)
class _Orientations:
    """``orient``'s tries: the groups with some members turned, and their scores (each
    group's part kept by the members turned in it)."""

    eqns: Sequence[JaxprEqn]
    groups: list[Group]
    parts: dict[tuple[int, frozenset[int]], tuple[tuple[Column, ...], int, Column | None]] = (
        dataclasses.field(default_factory=dict))

    def turned_group(self, g: int, members: frozenset[int]) -> Group:
        group = self.groups[g]
        if not members:
            return group
        readings, alternatives = list(group.readings), list(group.alternatives)
        for m, alternative in enumerate(group.alternatives):
            if m in members and alternative is not None:
                readings[m], alternatives[m] = alternative, readings[m]
        return dataclasses.replace(group, readings=tuple(readings),
                                   alternatives=tuple(alternatives))

    def turned_in(self, turned: frozenset[tuple[int, int]]) -> list[frozenset[int]]:
        members: list[set[int]] = [set() for _ in self.groups]
        for g, m in turned:
            members[g].add(m)
        return [frozenset(found) for found in members]

    def build(self, turned: frozenset[tuple[int, int]]) -> list[Group]:
        return [self.turned_group(g, members) for g, members in enumerate(self.turned_in(turned))]

    def part(self, g: int, members: frozenset[int]
             ) -> tuple[tuple[Column, ...], int, Column | None]:
        """Group ``g`` with ``members`` turned: its distinct operand columns, its reads
        transposed or swapped, and its stacked result where others may read it."""
        found = self.parts.get((g, members))
        if found is None:
            group = self.turned_group(g, members)
            found = self.parts[(g, members)] = (
                tuple(dict.fromkeys(group.columns(self.eqns))),
                sum(r.swapped + sum(r.transposed) for r in group.readings),
                group.outputs(self.eqns) if group.chainable(self.eqns) else None)
        return found

    def score(self, turned: frozenset[tuple[int, int]]) -> tuple[int, int]:
        stacked: set[Column] = set()
        new = reads_turned = 0
        for g, members in enumerate(self.turned_in(turned)):
            columns, turns, output = self.part(g, members)
            for column in columns:
                if is_shared(column) or column in stacked:
                    continue
                stacked.add(column)
                new += 1
            reads_turned += turns
            if output is not None:
                stacked.add(output)
        return new, reads_turned


# Chain combinations ``orient`` tries exhaustively (2 ** this many at most), and the
# most members it orients at one level.
_MAX_EXHAUSTIVE = 8
_MAX_ORIENTED = 32


def _chains(eqns: Sequence[JaxprEqn], groups: list[Group], free: list[tuple[int, int]]
            ) -> list[list[tuple[int, int]]]:
    """The free members joined where one reads another's result, in first-seen order."""
    index = {x: k for k, x in enumerate(free)}
    chains = DisjointSets(len(free))
    made = {eqns[groups[g].members[m]].outvars[0]: (g, m) for g, m in free}
    for x in free:
        g, m = x
        for atom in eqns[groups[g].members[m]].invars:
            source = made.get(atom) if not _compat.is_literal(atom) else None
            if source is not None:
                chains.union(index[x], index[source])
    return [[free[k] for k in chain] for chain in chains.groups()]
