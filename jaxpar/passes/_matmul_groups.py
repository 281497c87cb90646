"""Grouping for ``batch_matmuls``: heavy ops of one form at one launch depth as
``Group``s (``form_groups``), the kernels they launch unbatched (XLA's ``DotMerger``
already merges some), and what the pass keeps across the rounds, levels and modes of a
call (``Carried``).

Example::

    groups = form_groups(eqns, candidates, launch_depth, carried)
    [launches_unbatched(eqns, g) for g in groups]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

from .. import _compat
from .._compat import JaxprEqn, JaxprLike
from .._memo import IdentityMemo
from .._program.graph import DisjointSets
from .._program.primitives import DOT_GENERAL
from ._batch_members import member_chunks
from ._matmul_forms import Column, Reading, Transposed, readings_of


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Group:
    """Same-shaped heavy ops of one launch depth, run as one batched op.

    ``members`` are equation indices (sorted); ``readings[m]`` says how member ``m``
    runs in the group's form; ``alternatives[m]`` is its other reading of the same form,
    where it has one (a square matrix product reads as ``x @ w`` and as ``(w.T @ x.T).T``).
    """

    members: tuple[int, ...]
    readings: tuple[Reading, ...]
    alternatives: tuple[Reading | None, ...]
    depth: int  # launch depth
    params: Any  # the group's form: parameters of its members' readings

    @property
    def swapped(self) -> tuple[bool, ...]:
        return tuple(r.swapped for r in self.readings)

    def columns(self, eqns: Sequence[JaxprEqn]) -> list[Column]:
        """Per operand position of the group's form, the members' reads."""
        rows = [r.reads(eqns[i]) for i, r in zip(self.members, self.readings, strict=True)]
        return [tuple(row[p] for row in rows) for p in range(len(rows[0]))]

    def outputs(self, eqns: Sequence[JaxprEqn]) -> Column:
        """The members' results as the batched op leaves them, stacked."""
        return tuple(r.output(eqns[i]) for i, r in zip(self.members, self.readings, strict=True))

    def chainable(self, eqns: Sequence[JaxprEqn]) -> bool:
        """Whether its stacked result can stand for a column another group reads."""
        return not any(isinstance(o, tuple) and not isinstance(o, Transposed)
                       for o in self.outputs(eqns))


def form_groups(eqns: Sequence[JaxprEqn], candidates: list[int], depth: list[int],
           known: Carried | None = None) -> list[Group]:
    """Same-shaped heavy ops of one launch depth. A class whose swapped form is another class's
    form joins the larger one (the smaller one swapped), so operands are swapped only
    where that is what makes the members match; members that read the same either way
    are oriented afterwards (``orient``). ``known``: readings kept across calls."""
    classes: dict[Hashable, list[int]] = {}
    swapped_keys: dict[Hashable, Hashable] = {}
    readings: dict[int, list[Reading]] = {}
    known = Carried() if known is None else known
    for index in candidates:
        options = readings[index] = known.readings(eqns[index])
        key: Hashable = (options[0].form, depth[index])
        classes.setdefault(key, []).append(index)
        if len(options) > 1 and options[1].form != options[0].form:
            swapped_keys.setdefault(key, (options[1].form, depth[index]))
    joined: dict[Hashable, list[tuple[int, int]]] = {
        key: [(i, 0) for i in found] for key, found in classes.items()}
    for key in list(joined):  # first-seen order: deterministic
        partner = swapped_keys.get(key)
        if key not in joined or partner is None or partner == key or partner not in joined:
            continue
        big, small = ((key, partner) if len(joined[key]) >= len(joined[partner])
                      else (partner, key))
        joined[big] += [(i, 1) for i, _ in joined.pop(small)]
    groups = []
    for joined_class in joined.values():
        # In batches of at most ``MAX_BATCH_MEMBERS``: XLA compiles every distinct
        # stacking and slice once (``_batch_members.member_chunks``).
        for found in member_chunks(sorted(joined_class)):
            if len(found) < 2:
                continue
            groups.append(_class_group(found, readings, depth))
    return groups


def _class_group(found: list[tuple[int, int]], readings: dict[int, list[Reading]],
                 depth: list[int]) -> Group:
    """The group of ``found``: (equation, which reading) pairs of one class, sorted."""
    chosen = tuple(readings[i][r] for i, r in found)
    alternatives = tuple(
        readings[i][1 - r] if len(readings[i]) > 1
        and readings[i][1 - r].form == readings[i][r].form else None for i, r in found)
    return Group(tuple(i for i, _ in found), chosen, alternatives,
                  depth[found[0][0]], chosen[0].params)


class Carried:
    """What the pass keeps across the rounds, levels and modes of one call: each heavy
    equation's readings (``readings_of``), and each level's groups
    (``batch_matmuls._groups``, by the level's identity: jaxprs are immutable).

    ``readings_of`` reads only the primitive, the parameters and the operand and result
    types. A rebuilt level copies an equation whose operands a rewrite renamed with its
    parameter dict and results kept, and each new operand has the type of the one it
    stands for (``rebuild_level`` checks), so the copy's readings are looked up by its
    parameter dict and reused where the primitive and the types are the same: what
    ``readings_of`` would compute again.

    Forms are numbered (``forms``: equal forms, equal numbers), so grouping hashes an
    int per equation instead of types and parameters.
    """

    __slots__ = ("by_eqn", "by_params", "forms", "groups")

    def __init__(self) -> None:
        self.by_eqn: IdentityMemo[JaxprEqn, list[Reading]] = IdentityMemo()
        self.by_params: IdentityMemo[
            dict[str, Any], tuple[Any, tuple[Any, ...], tuple[Any, ...], list[Reading]]
        ] = IdentityMemo()
        self.forms: dict[Hashable, int] = {}
        self.groups: IdentityMemo[JaxprLike, tuple[list[Group], dict[Group, int]]] = (
            IdentityMemo())

    def readings(self, eqn: JaxprEqn) -> list[Reading]:
        found = self.by_eqn.get(eqn)
        if found is not None:
            return found
        ins = tuple([v.aval for v in eqn.invars])
        outs = tuple([v.aval for v in eqn.outvars])
        entry = self.by_params.get(eqn.params)
        if (entry is not None and entry[0] is eqn.primitive and entry[1] == ins
                and entry[2] == outs):
            found = entry[3]
        else:
            number = self.forms.setdefault
            found = [Reading(number(r.form, len(self.forms)), r.swapped, r.transposed, r.params)
                     for r in readings_of(eqn)]
            self.by_params.set(eqn.params, (eqn.primitive, ins, outs, found))
        self.by_eqn.set(eqn, found)
        return found


def launches_unbatched(eqns: Sequence[JaxprEqn], group: Group) -> int:
    """Kernels the members launch as they are: XLA's ``DotMerger`` already merges
    matmuls that share an operand, so members linked by shared operands count once."""
    merged = DisjointSets(len(group.members))
    if group.members and eqns[group.members[0]].primitive.name == DOT_GENERAL:
        for position in range(2):  # as written: what DotMerger sees
            column = [eqns[i].invars[position] for i in group.members]
            first: dict[Any, int] = {}
            for m, atom in enumerate(column):
                if _compat.is_literal(atom):
                    continue
                if atom in first:
                    merged.union(m, first[atom])
                else:
                    first[atom] = m
    return len(merged.groups())
