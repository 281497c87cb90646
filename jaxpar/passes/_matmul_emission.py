"""Emitting ``batch_matmuls``' rewrites: accepted groups joined into units (one rewrite
each, ``rewrite_units``), a unit's key for sharing one trace (``rewrite_key``), and the
function that binds each group as one batched op over stacked operands (``emitter``).

Example::

    for unit in rewrite_units(eqns, graph, accepted):
        order = tuple(sorted(i for g in unit for i in g.members))
        emit = emitter(eqns, unit, order, needed_members(eqns, order, graph, outputs))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import _compat
from .._compat import Atom, JaxprEqn
from .._program.graph import DisjointSets, Graph
from .._program.structure import StructuralKeys
from ._matmul_forms import Column, Transposed, is_shared, swap_permutation
from ._matmul_groups import Group
from ._protocol import EmitFn
from ._splice import emission_order


def rewrite_units(eqns: Sequence[JaxprEqn], graph: Graph, accepted: list[Group]
                  ) -> list[list[Group]]:
    """Accepted groups joined into rewrites: a group reading another's stacked result
    joins its rewrite, where contracting the two into one unit makes no cycle."""
    index = {g: k for k, g in enumerate(accepted)}
    produced = {g.outputs(eqns): g for g in accepted if g.chainable(eqns)}
    joined = DisjointSets(len(accepted))

    def members(sets: DisjointSets) -> list[list[int]]:
        return [[i for k in unit for i in accepted[k].members] for unit in sets.groups()]

    for g in accepted:  # depth order: each source is placed before its readers
        for column in g.columns(eqns):
            source = produced.get(column)
            if source is None or is_shared(column):
                continue
            trial = joined.copy()
            if not trial.union(index[g], index[source]):
                continue
            if emission_order(graph, members(trial)) is not None:
                joined = trial  # else a path leaves the pair and comes back: keep them apart
    return [sorted((accepted[k] for k in unit), key=lambda g: (g.depth, g.members))
            for unit in joined.groups()]


def needed_members(eqns: Sequence[JaxprEqn], order: Sequence[int], graph: Graph,
            level_outputs: set[Any]) -> frozenset[int]:
    """The members of a rewrite (``order``) whose result is read outside it."""
    inside = set(order)
    return frozenset(i for i in order if eqns[i].outvars[0] in level_outputs
                     or any(s not in inside for s in graph.succs[i]))


def rewrite_key(eqns: Sequence[JaxprEqn], unit: list[Group], order: Sequence[int],
                 needed: frozenset[int], structure: StructuralKeys) -> Hashable:
    """Equal for two units whose emitters trace to the same equations (``Rewrite.key``),
    given operands of the same types and pattern.

    What ``emitter`` reads of the level, with equation indices made relative to the
    unit (positions in ``order``): per group, its members and how each reads (swapped,
    operands transposed: with the member's equation, that fixes its reading, and the
    first member's reading is the group's form); per member, its primitive, parameters
    and context (``StructuralKeys.equation``: by value, arrays by their bytes), which
    member of the unit made each of its operands (a chain: read from the stacked
    result, not from the operand given), and whether its result is needed. The
    operands' atoms (which columns are shared, stacked once, literal) are the pattern
    ``rebuild_level`` adds to the key.
    """
    position = {i: k for k, i in enumerate(order)}
    made = {eqns[i].outvars[0]: k for k, i in enumerate(order)}
    members = tuple(
        (structure.equation(eqns[i]),
         tuple(None if _compat.is_literal(a) else made.get(a) for a in eqns[i].invars),
         i in needed) for i in order)
    groups = tuple((tuple(position[i] for i in g.members),
                    tuple((r.swapped, r.transposed) for r in g.readings)) for g in unit)
    return ("batch_matmuls", groups, members)


def emitter(eqns: Sequence[JaxprEqn], unit: list[Group], order: Sequence[int],
             needed: frozenset[int]) -> EmitFn:
    position = {i: k for k, i in enumerate(order)}
    made_by: dict[Any, tuple[Group, int]] = {}
    for g in unit:
        for m, i in enumerate(g.members):
            made_by[eqns[i].outvars[0]] = (g, m)
    templates = {g: eqns[g.members[0]] for g in unit}

    def emit(invals: list[list[Any]]) -> list[list[Any]]:
        env: dict[Any, Any] = {}
        for i in order:
            for atom, given in zip(eqns[i].invars, invals[position[i]], strict=True):
                if not _compat.is_literal(atom) and atom not in made_by:
                    env[atom] = given
        emission = _Emission(eqns, made_by, env)
        for g in unit:
            emission.batch(g, templates[g])
        return [[emission.value(eqns[i].outvars[0]) if i in needed else None] for i in order]

    return emit


@dataclasses.dataclass(slots=True)
class _Emission:
    """One trace of ``emitter``'s function: the level's values given (``env``), the
    stacked columns, each group's batched result and the member results sliced out."""

    eqns: Sequence[JaxprEqn]
    made_by: dict[Any, tuple[Group, int]]
    env: dict[Any, Any]
    stacked: dict[Column, Any] = dataclasses.field(default_factory=dict)  # atoms -> stack
    results: dict[Group, Any] = dataclasses.field(default_factory=dict)
    sliced: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def value(self, atom: Atom) -> Any:
        if isinstance(atom, Transposed):
            return lax.transpose(self.value(atom.atom), (1, 0))
        if _compat.is_literal(atom):
            return _compat.literal_value(atom)
        if atom in self.env:
            return self.env[atom]
        if atom not in self.sliced:
            group, m = self.made_by[atom]
            eqn = self.eqns[group.members[m]]
            with _compat.eqn_context(eqn):
                out = lax.index_in_dim(self.results[group], m, keepdims=False)
                if group.swapped[m]:
                    out = lax.transpose(out, swap_permutation(eqn))
            self.sliced[atom] = out
        return self.sliced[atom]

    def batch(self, g: Group, template: JaxprEqn) -> None:
        """Bind group ``g`` as one op over its stacked operands (``template`` is its
        first member)."""
        eqns, stacked = self.eqns, self.stacked
        operands: list[Any] = []
        axes: list[int | None] = []
        with _compat.eqn_context(eqns[g.members[-1]]):
            for column in g.columns(eqns):
                if is_shared(column) and not _compat.is_literal(column[0]):
                    operands.append(self.value(column[0]))
                    axes.append(None)
                    continue
                if column not in stacked:
                    stacked[column] = jnp.stack([jnp.asarray(self.value(a)) for a in column])
                operands.append(stacked[column])
                axes.append(0)

            def one(*ops: Any, template: Any = template, params: Any = g.params) -> Any:
                return _compat.bind_eqn(template, ops, params)[0]

            self.results[g] = jax.vmap(one, in_axes=tuple(axes))(*operands)
        if g.chainable(eqns):
            stacked[g.outputs(eqns)] = self.results[g]
