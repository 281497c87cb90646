"""Batch same-shaped matmuls and convolutions of independent, different members.

``batch_scans`` and ``batch_branches`` batch members that run the *same*
computation. This pass batches members that differ: the two halves of a fused
scan body with different step functions (two scans of different bodies), the branches of a
multi-branch block, the experts of a mixture, the towers of a model. Wherever
independent equations of one level run a heavy op of the same shape -- a
``dot_general`` or ``conv_general_dilated`` with equal operand types, dimension
numbers and other parameters -- at the same *launch depth*, they run as one op under
``jax.vmap`` over stacked operands, and each member's result is sliced back out.
The members' light work (activations, scalings, residual adds) stays theirs:
XLA fuses it into the neighbouring kernels, including the stacking copies.

* *Launch depth*: the most kernel-launching equations on a path from the level's
  inputs to the op, itself included. Two heavy ops at one depth cannot depend on each
  other (a path between them would add one), so any set of them can run as one;
  and contracting every group at once never makes a cycle (paths between groups
  only climb in depth).
* *Operand order*: a ``dot_general`` also matches with its operands swapped
  (``c @ x`` against ``x.T @ c.T``): it is emitted in the group's form and its
  result transposed back, which XLA folds into the consumer. A 2-D matrix product
  reads in one form, ``lhs [m, k] @ rhs [k, n]``, with each operand transposed where
  its contracting axis is not the form's (folded into its stacking copy), so ``x @ W``
  and ``W @ x`` of square matrices match either way; each member is oriented so that
  the fewest operand columns need a stack of their own (``_orient``): ``x @ W`` beside
  ``W @ x`` over three matmuls runs the second member transposed throughout, and its
  chain and its ``x`` column stay stacked.
* *Chains*: a batched op whose operand is, member by member, the result of
  another batched op reads that op's stacked result directly (one rewrite holds
  both), so a chain ``X @ X @ X`` stays stacked from one matmul to the next.
  An operand column stacked once serves every op of the rewrite that reads it.
* *Cost*: the target's cost model decides. A group saves one kernel launch per
  member (less the ones XLA's ``DotMerger`` already saves: members sharing an
  operand); every operand column that is neither shared nor already stacked
  costs a stacking copy (a launch and its bytes), and every member result that
  leaves the level or feeds a matmul, a reduction or a loop costs a slicing
  kernel (``_choose``). A group that reads another group's
  stacked result also spares that result being sliced apart for it (a launch), and
  the producer is spared stacking it. Groups are dropped, the least worth first,
  until each one pays for the stacks only it needs. Launches are priced in the
  CUDA-graph mode the function is compiled in (``Settings.modes.priced``): in a
  ``concurrent`` graph the members already run side by side, so a saved launch is
  worth its graph node only, and most groups there are left alone.

Example::

    def two_steps(a, b, x):            # different bodies, same matmul shapes
        return jnp.tanh(a @ x) @ x, jnp.sin(x @ b) @ b

    new_jaxpr, decisions = batch_matmuls(jax.make_jaxpr(two_steps)(a, b, x), target="gpu")
    # two dot_generals with a batch dimension instead of four

Sharp edges:
  * Equations with effects, user placement (``on_stream``, XLA metadata) or
    collectives are never batched; nor are matmuls with an ``out_sharding``
    swapped.
  * Results agree with the unbatched program to float rounding: XLA may pick a
    different algorithm for a batched matmul.
  * Stacks of a scan body's inputs are built inside the body, every trip; XLA
    fuses them with the slicing of ``xs``.
  * Members are oriented (``_orient``) only where a level has at most 32 square matrix
    products that read the same either way; beyond that they run as written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import _compat
from .._analysis import Analysis
from .._compat import Atom, JaxprEqn, JaxprLike, ShapedArray
from .._cost import ENDS, CostModel, LaunchPrices, launch_prices
from .._gpu_model import CommandBufferMode
from .._graph import DisjointSets, Graph
from .._memo import IdentityMemo
from .._memory import stacking_refusal
from .._primitives import BATCHED_MATMULS, DOT_GENERAL, TRANSPOSE, is_collective
from .._structure import StructuralKeys
from ._protocol import DecisionKind, EmitFn, Level, LevelResult, PassDecision, Rewrite, decision
from ._shared import (
    MAX_BATCH_MEMBERS,
    launch_depths,
    member_chunks,
    private_tails_leave,
    stacked_width,
)
from ._splice import emission_order

# The heavy ops this pass batches: one kernel each, whose batched form is one kernel.
BATCHED_PRIMITIVES = BATCHED_MATMULS

# A column of operands, one atom per member (in the group's form).
_Column = tuple[Any, ...]


class _Transposed(NamedTuple):
    """A 2-D value read with its two axes swapped (in a column: a member's operand, or a
    flipped member's result as the batched op leaves it)."""

    atom: Atom

    @property
    def aval(self) -> Any:  # the bytes are what the cost model reads
        return self.atom.aval


def _atom(read: Any) -> Any:
    return read.atom if isinstance(read, _Transposed) else read


@dataclasses.dataclass(frozen=True, slots=True)
class _Reading:
    """How one heavy op runs in a group's form: ``swapped`` operands (its result
    transposed back) and, per operand position of the form, whether the operand is read
    transposed (a 2-D matrix product only: folded into its stacking copy)."""

    form: Hashable
    swapped: bool
    transposed: tuple[bool, ...]
    params: Any

    def reads(self, eqn: JaxprEqn) -> tuple[Any, ...]:
        operands = eqn.invars[::-1] if self.swapped else eqn.invars
        return tuple(_Transposed(a) if t else a
                     for a, t in zip(operands, self.transposed, strict=True))

    def output(self, eqn: JaxprEqn) -> Any:
        out = eqn.outvars[0]
        if not self.swapped:
            return out
        # A swapped 2-D product leaves its result transposed; other layouts never match.
        return _Transposed(out) if _compat.array_aval(out).ndim == 2 else ("permuted", out)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Group:
    """Same-shaped heavy ops of one launch depth, run as one batched op.

    ``members`` are equation indices (sorted); ``readings[m]`` says how member ``m``
    runs in the group's form; ``alternatives[m]`` is its other reading of the same form,
    where it has one (a square matrix product reads as ``x @ w`` and as ``(w.T @ x.T).T``).
    """

    members: tuple[int, ...]
    readings: tuple[_Reading, ...]
    alternatives: tuple[_Reading | None, ...]
    depth: int  # launch depth
    params: Any  # the group's form: parameters of its members' readings

    @property
    def swapped(self) -> tuple[bool, ...]:
        return tuple(r.swapped for r in self.readings)

    def columns(self, eqns: Sequence[JaxprEqn]) -> list[_Column]:
        """Per operand position of the group's form, the members' reads."""
        rows = [r.reads(eqns[i]) for i, r in zip(self.members, self.readings, strict=True)]
        return [tuple(row[p] for row in rows) for p in range(len(rows[0]))]

    def outputs(self, eqns: Sequence[JaxprEqn]) -> _Column:
        """The members' results as the batched op leaves them, stacked."""
        return tuple(r.output(eqns[i]) for i, r in zip(self.members, self.readings, strict=True))

    def chainable(self, eqns: Sequence[JaxprEqn]) -> bool:
        """Whether its stacked result can stand for a column another group reads."""
        return not any(isinstance(o, tuple) and not isinstance(o, _Transposed)
                       for o in self.outputs(eqns))


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: batched ops for same-shaped heavy ops of one launch depth.

    A level found to offer nothing is not searched again (the row
    ``remembers_search``: jaxprs are immutable and the passes see the same ones round
    after round); the pass's state (``State``, its row's) keeps each heavy equation's
    readings and each level's groups, for the later rounds and the other modes.
    """
    carried = level.state if level.state is not None else State()
    rewrites, decisions = _batch_level(level, analysis.costs, analysis.settings.modes.priced,
                                       carried, analysis.structural_keys,
                                       analysis.allowance_for("batch_matmuls"))
    return LevelResult(rewrites, decisions)


def _batchable(eqn: JaxprEqn) -> bool:
    return (eqn.primitive.name in BATCHED_PRIMITIVES and not eqn.effects
            and not is_collective(eqn)
            and not _compat.has_frontend_attributes(eqn))


def _batch_level(level: Level, costs: CostModel, mode: CommandBufferMode | None,
                 carried: _Carried | None = None,
                 structure: StructuralKeys | None = None, allowance: float | None = None
                 ) -> tuple[list[Rewrite], list[PassDecision]]:
    inner, _ = _compat.open_jaxpr(level.jaxpr)
    eqns, path = inner.eqns, level.path
    graph = level.graph
    carried = _Carried() if carried is None else carried
    found = carried.groups.get(level.jaxpr)
    if found is None:
        found = _groups(eqns, graph, costs, carried)
        carried.groups.set(level.jaxpr, found)
    groups, launches = found
    if not groups:
        return [], []
    level_outputs = {v for v in inner.outvars if not _compat.is_literal(v)}
    # Dots and convolutions fill the GPU: none overlaps another in any mode, so a member's
    # launch saved is worth its floor in a branching graph too.
    prices = [costs.launch_prices(eqns, mode, level.in_loop_body, end, serial_kernels=True)
              for end in ENDS]
    # In a loop body, what the body reads from its loop (a scanned input's slice) XLA
    # transposes whole, outside the loop, when the body reads it transposed.
    loop_inputs = frozenset(inner.invars) if level.in_loop_body else frozenset()
    accepted, rejected, priced = _choose(eqns, graph, groups, launches, costs, level_outputs,
                                         prices, allowance, loop_inputs,
                                         program_outputs=not path)
    decisions = [_left_alone(path, eqns, g, launches[g], priced[g]) for g in rejected]
    if not accepted:
        return [], decisions
    units = _units(eqns, graph, accepted)
    structure = StructuralKeys() if structure is None else structure
    rewrites = []
    for unit in units:
        order = tuple(sorted(i for g in unit for i in g.members))
        needed = _needed(eqns, order, graph, level_outputs)
        rewrites.append(Rewrite(order, _emitter(eqns, unit, order, needed),
                                _rewrite_key(eqns, unit, order, needed, structure)))
    chained = _chained_columns(eqns, accepted)
    taken = [_batched(path, eqns, g, launches[g], chained, priced[g])
             for unit in units for g in unit]
    return rewrites, taken + decisions


# --------------------------------------------------------------------------- grouping


def _groups(eqns: Sequence[JaxprEqn], graph: Graph, costs: CostModel, carried: _Carried
            ) -> tuple[list[_Group], dict[_Group, int]]:
    """The level's groups worth a look (in depth order, oriented) and the kernels each
    launches unbatched: a function of the level alone (the CUDA-graph mode only prices
    them), so ``_Carried.groups`` keeps it for the other modes."""
    # The primitive first: most equations are not heavy ops, and a call each costs more.
    candidates = [i for i, e in enumerate(eqns)
                  if e.primitive.name in BATCHED_PRIMITIVES and _batchable(e)]
    if len(candidates) < 2:
        return [], {}
    candidates = [i for i in candidates if i in graph.live]
    # A transpose XLA folds into the matmul reading it (or fuses): it adds no launch depth.
    depth = launch_depths(graph, [costs.launches(e) and e.primitive.name != TRANSPOSE
                            for e in eqns])
    groups = [g for g in _group(eqns, candidates, depth, carried)  # not batches of batches
              if len(g.members) * stacked_width(eqns, graph, g.members) <= MAX_BATCH_MEMBERS]
    if not groups:
        return [], {}
    groups.sort(key=lambda g: (g.depth, g.members))
    groups = _orient(eqns, groups)
    launches = {g: _launches_unbatched(eqns, g) for g in groups}
    groups = [g for g in groups if launches[g] > 1]  # else XLA's DotMerger does it already
    return groups, launches


def _hashable(value: Any) -> Hashable:
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value


def _group(eqns: Sequence[JaxprEqn], candidates: list[int], depth: list[int],
           known: _Carried | None = None) -> list[_Group]:
    """Same-shaped heavy ops of one launch depth. A class whose swapped form is another class's
    form joins the larger one (the smaller one swapped), so operands are swapped only
    where that is what makes the members match; members that read the same either way
    are oriented afterwards (``_orient``). ``known``: readings kept across calls."""
    classes: dict[Hashable, list[int]] = {}
    swapped_keys: dict[Hashable, Hashable] = {}
    readings: dict[int, list[_Reading]] = {}
    known = _Carried() if known is None else known
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
        # stacking and slice once (``_shared.member_chunks``).
        for found in member_chunks(sorted(joined_class)):
            if len(found) < 2:
                continue
            groups.append(_class_group(found, readings, depth))
    return groups


def _class_group(found: list[tuple[int, int]], readings: dict[int, list[_Reading]],
                 depth: list[int]) -> _Group:
    """The group of ``found``: (equation, which reading) pairs of one class, sorted."""
    chosen = tuple(readings[i][r] for i, r in found)
    alternatives = tuple(
        readings[i][1 - r] if len(readings[i]) > 1
        and readings[i][1 - r].form == readings[i][r].form else None for i, r in found)
    return _Group(tuple(i for i, _ in found), chosen, alternatives,
                  depth[found[0][0]], chosen[0].params)


class _Carried:
    """What the pass keeps across the rounds, levels and modes of one call: each heavy
    equation's readings (``_readings``), and each level's groups (``_groups``, by the
    level's identity: jaxprs are immutable).

    ``_readings`` reads only the primitive, the parameters and the operand and result
    types. A rebuilt level copies an equation whose operands a rewrite renamed with its
    parameter dict and results kept, and each new operand has the type of the one it
    stands for (``rebuild_level`` checks), so the copy's readings are looked up by its
    parameter dict and reused where the primitive and the types are the same: what
    ``_readings`` would compute again.

    Forms are numbered (``forms``: equal forms, equal numbers), so grouping hashes an
    int per equation instead of types and parameters.
    """

    __slots__ = ("by_eqn", "by_params", "forms", "groups")

    def __init__(self) -> None:
        self.by_eqn: IdentityMemo[JaxprEqn, list[_Reading]] = IdentityMemo()
        self.by_params: IdentityMemo[
            dict[str, Any], tuple[Any, tuple[Any, ...], tuple[Any, ...], list[_Reading]]
        ] = IdentityMemo()
        self.forms: dict[Hashable, int] = {}
        self.groups: IdentityMemo[JaxprLike, tuple[list[_Group], dict[_Group, int]]] = (
            IdentityMemo())

    def readings(self, eqn: JaxprEqn) -> list[_Reading]:
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
            found = [_Reading(number(r.form, len(self.forms)), r.swapped, r.transposed, r.params)
                     for r in _readings(eqn)]
            self.by_params.set(eqn.params, (eqn.primitive, ins, outs, found))
        self.by_eqn.set(eqn, found)
        return found


# A matrix product in the form the batched op runs it: lhs [m, k] @ rhs [k, n].
_MATRIX_PRODUCT = (((1,), (0,)), ((), ()))


def _matrix_product(eqn: JaxprEqn) -> tuple[int, int] | None:
    """The contracting dimensions of a plain 2-D ``dot_general`` (one each, no batch
    dimensions, no ``out_sharding``), or None."""
    if eqn.primitive.name != DOT_GENERAL or eqn.params.get("out_sharding") is not None:
        return None
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    if (lhs_batch or rhs_batch or len(lhs_contract) != 1 or len(rhs_contract) != 1
            or _compat.array_aval(lhs).ndim != 2 or _compat.array_aval(rhs).ndim != 2):
        return None
    return int(lhs_contract[0]), int(rhs_contract[0])


def _transposed_2d(aval: Any, transposed: bool) -> Any:
    return aval.update(shape=aval.shape[::-1]) if transposed else aval


def _readings(eqn: JaxprEqn) -> list[_Reading]:
    """How ``eqn`` can run in a group: as written, then with its operands swapped.

    A 2-D matrix product reads in the form ``lhs [m, k] @ rhs [k, n]`` both ways, each
    operand transposed where its contracting axis is not the form's (``x @ W`` and
    ``W @ x`` of square matrices then have one form, read ``(x, W)`` and
    ``(W.T, x.T)``); other ``dot_general``s read their operands as they are.
    """
    name, outs = eqn.primitive.name, [v.aval for v in eqn.outvars]
    contract = _matrix_product(eqn)
    if contract is not None:
        found = []
        for swapped in (False, True):
            order = (1, 0) if swapped else (0, 1)
            # The form contracts the lhs's axis 1 and the rhs's axis 0.
            transposed = tuple(contract[q] != 1 - p for p, q in enumerate(order))
            avals = [_transposed_2d(eqn.invars[q].aval, t)
                     for q, t in zip(order, transposed, strict=True)]
            params = dict(eqn.params)
            params["dimension_numbers"] = _MATRIX_PRODUCT
            precision = params.get("precision")
            if swapped and isinstance(precision, tuple) and len(precision) == 2:
                params["precision"] = precision[::-1]
            form = _form_key(name, avals, [_transposed_2d(outs[0], swapped)], params)
            found.append(_Reading(form, swapped, transposed, params))
        return found
    params = dict(eqn.params)
    found = [_Reading(_form_key(name, [v.aval for v in eqn.invars], outs, params), False,
                      (False,) * len(eqn.invars), params)]
    swapped_params = _swapped_params(eqn)
    if swapped_params is not None:
        lhs, rhs = eqn.invars
        found.append(_Reading(_form_key(name, [rhs.aval, lhs.aval], [_transposed_aval(eqn)],
                                        swapped_params), True, (False, False), swapped_params))
    return found


def _orient(eqns: Sequence[JaxprEqn], groups: list[_Group]) -> list[_Group]:
    """Groups (in depth order) with each member that reads the same either way
    (``_Group.alternatives``) oriented so that the fewest operand columns need a stack
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
    """``_orient``'s tries: the groups with some members turned, and their scores (each
    group's part kept by the members turned in it)."""

    eqns: Sequence[JaxprEqn]
    groups: list[_Group]
    parts: dict[tuple[int, frozenset[int]], tuple[tuple[_Column, ...], int, _Column | None]] = (
        dataclasses.field(default_factory=dict))

    def turned_group(self, g: int, members: frozenset[int]) -> _Group:
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

    def build(self, turned: frozenset[tuple[int, int]]) -> list[_Group]:
        return [self.turned_group(g, members) for g, members in enumerate(self.turned_in(turned))]

    def part(self, g: int, members: frozenset[int]
             ) -> tuple[tuple[_Column, ...], int, _Column | None]:
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
        stacked: set[_Column] = set()
        new = reads_turned = 0
        for g, members in enumerate(self.turned_in(turned)):
            columns, turns, output = self.part(g, members)
            for column in columns:
                if _shared(column) or column in stacked:
                    continue
                stacked.add(column)
                new += 1
            reads_turned += turns
            if output is not None:
                stacked.add(output)
        return new, reads_turned


# Chain combinations ``_orient`` tries exhaustively (2 ** this many at most), and the
# most members it orients at one level.
_MAX_EXHAUSTIVE = 8
_MAX_ORIENTED = 32


def _chains(eqns: Sequence[JaxprEqn], groups: list[_Group], free: list[tuple[int, int]]
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


def _form_key(name: str, avals: Sequence[Any], outs: Sequence[Any], params: Any) -> Hashable:
    return (name, tuple(avals), tuple(outs),
            tuple((k, _hashable(v)) for k, v in sorted(params.items())))


def _swapped_params(eqn: JaxprEqn) -> dict[str, Any] | None:
    """A ``dot_general``'s parameters with its operands swapped, or None."""
    if eqn.primitive.name != DOT_GENERAL or eqn.params.get("out_sharding") is not None:
        return None
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    params = dict(eqn.params)
    params["dimension_numbers"] = ((rhs_contract, lhs_contract), (rhs_batch, lhs_batch))
    precision = params.get("precision")
    if isinstance(precision, tuple) and len(precision) == 2:
        params["precision"] = precision[::-1]
    return params


def _swap_permutation(eqn: JaxprEqn) -> tuple[int, ...]:
    """How to transpose a swapped ``dot_general``'s result into the original's layout."""
    (lhs_contract, rhs_contract), (lhs_batch, _) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    batch = len(lhs_batch)
    lhs_free = _compat.array_aval(lhs).ndim - len(lhs_contract) - batch
    rhs_free = _compat.array_aval(rhs).ndim - len(rhs_contract) - batch
    return (*range(batch), *range(batch + rhs_free, batch + rhs_free + lhs_free),
            *range(batch, batch + rhs_free))


def _transposed_aval(eqn: JaxprEqn) -> ShapedArray:
    """The result type of ``eqn`` with its operands swapped."""
    out = _compat.array_aval(eqn.outvars[0])
    permutation = _swap_permutation(eqn)
    inverse = [0] * len(permutation)
    for new, old in enumerate(permutation):
        inverse[old] = new
    return out.update(shape=tuple(out.shape[inverse[d]] for d in range(out.ndim)))


def _launches_unbatched(eqns: Sequence[JaxprEqn], group: _Group) -> int:
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


# --------------------------------------------------------------------------- cost


def _shared(column: _Column) -> bool:
    """Every member reads the very same value (the same atom, transposed or not)."""
    first = column[0]
    if isinstance(first, _Transposed):
        return all(isinstance(a, _Transposed) and a.atom is first.atom for a in column[1:])
    return all(a is first for a in column[1:])


def _stack_bytes(column: _Column) -> float:
    return 2.0 * sum(_compat.aval_nbytes(a.aval) for a in column)


# What one round of ``_choose`` knows of its accepted groups: each unshared column's first
# user and user count, the stacked results other groups read, the columns made by a
# batched op, and the batched equations.
_Round = tuple[dict[Any, Any], dict[Any, int], dict[Any, int], set[Any], set[int]]


@dataclasses.dataclass(frozen=True, slots=True)
class _Price:
    """The cost model's view of one group, in seconds per run of the level."""

    saved: float  # launches saved (and the stacking its chained readers are spared)
    cost: float  # stacking kernel, stacking and transposing bytes
    memory: str | None = None  # why its stacked copies are over the memory budget

    @property
    def worth(self) -> float:
        return self.saved - self.cost


def _choose(eqns: Sequence[JaxprEqn], graph: Graph, groups: list[_Group],
            launches: dict[_Group, int], costs: CostModel,
            level_outputs: set[Any] | frozenset[Any] = frozenset(),
            prices: LaunchPrices | Sequence[LaunchPrices] | None = None,
            allowance: float | None = None, loop_inputs: frozenset[Any] = frozenset(),
            program_outputs: bool = False
            ) -> tuple[list[_Group], list[_Group], dict[_Group, _Price]]:
    """The groups worth batching, the rest, and each one's price (a dropped group's as
    it was when dropped), by the kernels they save and the kernels they add.

    A group saves ``launches - 1`` kernel launches. Its operand columns that are neither
    shared by all members nor already stacked (by an earlier group of the rewrite, or as
    the result of another batched op) are stacked, in one fused kernel per group. That
    kernel takes the place of an elementwise producer's only where a stacked value is
    made by elementwise work that nothing but batched ops reads; otherwise it is a kernel
    more (the optimizer of two models trained in one step stacked activations its
    backward pass also read, priced at 0 us: 28 -> 32 launches). Each member result that
    leaves the level, or that an equation launching a kernel outside the rewrite reads (a
    matmul, a reduction, a loop), is sliced out of the batched result by a kernel of its
    own; slices that only elementwise work reads fuse into it (``sin(a) @ b`` beside
    ``cos(sin(c) @ d) @ b``, both results leaving: 5 -> 6 launches once compiled). At the
    top level, a matmul whose elementwise tail, computed from its result alone, is
    returned counts the same (``_shared.private_tails_leave``): unbatched, XLA fuses the
    tail into the matmul's Triton GEMM; batched, the tail of each slice is a kernel of
    its own (ten ``tanh(x @ w)`` returned apart: 10 launches plain, 13 batched). A
    group whose stacked result another accepted group reads, and that reader, each count
    a launch more: dropping either one slices the result apart or stacks it again. Groups
    are dropped, least worth first, until each one wins at least half a launch more than
    it costs.

    Launches are priced by the one GPU model in the mode the function is compiled in
    (``prices``, ``CostModel.launch_prices``; default a serial chain's): a member's
    launch saved is worth ``prices.beside`` (its kernel floor in a serial chain, only its
    graph node in a ``concurrent`` graph, where the members already overlap), a stacking
    or slicing kernel added costs ``prices.serial``. Given several ``prices`` (the ends
    of the GPU model's ranges, ``_cost.ENDS``), a group must pay at each; its price is
    the one at the end where it pays least. A group whose stacked copies (its stacked
    operands and its batched result) need more than ``allowance`` bytes (the memory
    budget's) is left alone, and so is one in a loop body that reads one of
    ``loop_inputs`` (what the body reads from its loop) transposed: XLA moves the
    transpose of a scanned input's slice out of the loop, over the whole input (a
    deviceless H200 compile of two 1,000-trip cells of 100 x 100: 38 MiB, against 0.3
    MiB plain).

    Only the groups' operands and results are looked at (their producers and readers,
    through ``graph``), so a visit costs in proportion to the groups, not the level.
    """
    if prices is None:
        prices = launch_prices(costs.profile, None, 0.0)
    ends = [prices] if isinstance(prices, LaunchPrices) else list(prices)
    pricing = _Pricing(eqns, graph, costs, level_outputs, launches,
                       {eqns[i].outvars[0]: i for g in groups for i in g.members})
    # Matmuls' elementwise tails returned apart (the program's outputs): see
    # ``_shared.private_tails_leave``. A convolution's tail stays a kernel of its own
    # either way (cuDNN takes no such epilogue), and a loop body's carries are not
    # returned apart.
    pricing.tails_leave = private_tails_leave(
        eqns, graph, {v: i for v, i in pricing.made_at.items()
                      if eqns[i].primitive.name == DOT_GENERAL},
        pricing.launches_kernel, level_outputs) if program_outputs else set()
    columns = pricing.columns = {g: g.columns(eqns) for g in groups}
    outputs = pricing.outputs = {g: g.outputs(eqns) for g in groups}
    pricing.transposes = {g: sum(2.0 * _compat.aval_nbytes(eqns[i].outvars[0].aval)
                                 for i, s in zip(g.members, g.swapped, strict=True) if s)
                          for g in groups}
    accepted, priced = _refuse_over_budget(eqns, groups, columns, allowance, loop_inputs)
    batched: set[int] = set()
    for _ in range(len(groups) + 1):
        batched.clear()
        batched.update(i for g in accepted for i in g.members)
        produced = {outputs[g] for g in accepted if g.chainable(eqns)}
        first_user, users, chained = _column_users(accepted, columns, produced)
        pays: dict[_Group, bool] = {}
        least: dict[_Group, float] = {}
        for g in accepted:
            for end in ends:
                price = pricing.price_of(g, end.serial, end.beside,
                                         (first_user, users, chained, produced, batched))
                # Where the model cannot tell, leave the program alone: a group must win
                # at least half a launch more than it costs (a siamese network's backward
                # pass, priced +0.69 us, launched one kernel more once compiled).
                slack = price.worth - end.serial / 2
                if g not in least or slack < least[g]:
                    priced[g], least[g] = price, slack
                pays[g] = pays.get(g, True) and slack > 0
        if all(pays.values()):
            break
        accepted = [g for g in accepted if pays[g]]
    else:  # pragma: no cover - each round removes a group or stops
        raise RuntimeError("jaxpar batch_matmuls: choosing groups did not settle; please "
                           "report it with the program")
    kept = set(accepted)
    return accepted, [g for g in groups if g not in kept], priced


def _refuse_over_budget(eqns: Sequence[JaxprEqn], groups: list[_Group],
                        columns: dict[_Group, list[_Column]], allowance: float | None,
                        loop_inputs: frozenset[Any]
                        ) -> tuple[list[_Group], dict[_Group, _Price]]:
    """``_choose``'s first step: the groups (in depth order) whose stacked copies fit
    ``allowance`` and that read no loop input transposed, and the others' refusals."""
    priced: dict[_Group, _Price] = {}
    accepted = []  # in depth order
    for g in groups:
        stacked = sum(_stack_bytes(c) / 2 for c in dict.fromkeys(columns[g])
                      if not _shared(c)) + sum(
            _compat.aval_nbytes(eqns[i].outvars[0].aval) for i in g.members)
        refusal = stacking_refusal(stacked, allowance)
        if refusal is None and allowance is not None and any(
                isinstance(read, _Transposed) and read.atom in loop_inputs
                for column in columns[g] for read in column):
            refusal = ("it would read an input of the loop transposed, which XLA transposes "
                       "whole, outside the loop: a copy of the whole input")
        if refusal is None:
            accepted.append(g)
        else:
            priced[g] = _Price(0.0, 0.0, refusal)
    return accepted, priced


def _column_users(accepted: list[_Group], columns: dict[_Group, list[_Column]],
                  produced: set[Any]
                  ) -> tuple[dict[_Column, _Group], dict[_Column, int], dict[_Column, int]]:
    """Each unshared operand column's first user and user count among ``accepted``, and
    how many of them read each stacked result of another group (``produced``)."""
    first_user: dict[_Column, _Group] = {}
    users: dict[_Column, int] = {}
    chained: dict[_Column, int] = {}
    for g in accepted:
        for column in dict.fromkeys(columns[g]):
            if _shared(column):
                continue
            if column in produced:
                chained[column] = chained.get(column, 0) + 1
                continue
            first_user.setdefault(column, g)
            users[column] = users.get(column, 0) + 1
    return first_user, users, chained


@dataclasses.dataclass(slots=True)
class _Pricing:
    """What ``_choose`` prices a group by: the level, the groups' operand columns,
    results and transposes, and the kernels each equation launches (looked up once)."""

    eqns: Sequence[JaxprEqn]
    graph: Graph
    costs: CostModel
    level_outputs: set[Any] | frozenset[Any]
    launches: dict[_Group, int]
    made_at: dict[Any, int]
    launching: dict[int, bool] = dataclasses.field(default_factory=dict)
    tails_leave: set[Any] = dataclasses.field(default_factory=set)
    columns: dict[_Group, list[_Column]] = dataclasses.field(default_factory=dict)
    outputs: dict[_Group, _Column] = dataclasses.field(default_factory=dict)
    transposes: dict[_Group, float] = dataclasses.field(default_factory=dict)

    def producer(self, atom: Any, reader: int) -> int | None:
        """The equation making ``atom``, which equation ``reader`` reads (None: an input
        of the level, or a literal)."""
        for p in self.graph.preds[reader]:
            if any(v is atom for v in self.eqns[p].outvars):
                return p
        return None

    def readers(self, atom: Any, source: int) -> list[int]:
        """The equations reading ``atom``, made by equation ``source``."""
        return [r for r in self.graph.succs[source]
                if any(a is atom for a in self.eqns[r].invars)]

    def launches_kernel(self, index: int) -> bool:
        found = self.launching.get(index)
        if found is None:
            found = self.launching[index] = self.costs.launches(self.eqns[index])
        return found

    def replaces_producer(self, read: Any, reader: int, batched: set[int]) -> bool:
        """Whether stacking ``read`` (an operand of equation ``reader``) takes the place
        of its producer's kernel: elementwise work that nothing but the batched ops
        (``batched``) reads."""
        atom = _atom(read)
        if _compat.is_literal(atom) or atom in self.level_outputs:
            return False
        source = self.producer(atom, reader)
        if source is None:
            return False
        cost = self.costs.eqn_cost(self.eqns[source])
        return (cost.kernels == 0 and cost.flops > 0
                and all(r in batched for r in self.readers(atom, source)))

    def price_of(self, g: _Group, launch: float, beside: float, rounds: _Round) -> _Price:
        """``g``'s price with a launch at ``launch`` (a member's at ``beside``), given
        the groups accepted this round (``rounds``)."""
        first_user, users, chained, produced, batched = rounds
        columns, outputs, eqns = self.columns, self.outputs, self.eqns
        bandwidth = self.costs.profile.bandwidth
        new = [c for c in dict.fromkeys(columns[g]) if first_user.get(c) is g]
        saved = (self.launches[g] - 1) * beside
        cost = self.transposes[g] / bandwidth
        if new and not any(self.replaces_producer(a, i, batched) for c in new
                           for a, i in zip(c, g.members, strict=True)):
            cost += launch
        cost += sum(_stack_bytes(c) for c in new if users[c] == 1) / bandwidth
        read_chained = chained.get(outputs[g], 0) if outputs[g] in produced else 0
        sliced = sum(out in self.level_outputs or out in self.tails_leave or any(
            self.launches_kernel(r) and not (read_chained and r in batched)
            for r in self.readers(out, self.made_at[out]))
            for out in (eqns[i].outvars[0] for i in g.members))
        cost += sliced * launch
        if read_chained:
            saved += launch  # its readers would otherwise stack its results
        if any(c in produced for c in columns[g] if not _shared(c)):
            # Its producer's result would otherwise be sliced apart for it: a chained
            # reader's worth, like its producer's, counts the link (crossed_pair's third
            # matmuls, left alone without it, launched three kernels more per trip).
            saved += launch
        return _Price(saved, cost)


def _chained_columns(eqns: Sequence[JaxprEqn], accepted: list[_Group]) -> set[_Column]:
    return {g.outputs(eqns) for g in accepted if g.chainable(eqns)}


# --------------------------------------------------------------------------- rewrites


def _units(eqns: Sequence[JaxprEqn], graph: Graph, accepted: list[_Group]) -> list[list[_Group]]:
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
            if source is None or _shared(column):
                continue
            trial = joined.copy()
            if not trial.union(index[g], index[source]):
                continue
            if emission_order(graph, members(trial)) is not None:
                joined = trial  # else a path leaves the pair and comes back: keep them apart
    return [sorted((accepted[k] for k in unit), key=lambda g: (g.depth, g.members))
            for unit in joined.groups()]


def _needed(eqns: Sequence[JaxprEqn], order: Sequence[int], graph: Graph,
            level_outputs: set[Any]) -> frozenset[int]:
    """The members of a rewrite (``order``) whose result is read outside it."""
    inside = set(order)
    return frozenset(i for i in order if eqns[i].outvars[0] in level_outputs
                     or any(s not in inside for s in graph.succs[i]))


def _rewrite_key(eqns: Sequence[JaxprEqn], unit: list[_Group], order: Sequence[int],
                 needed: frozenset[int], structure: StructuralKeys) -> Hashable:
    """Equal for two units whose emitters trace to the same equations (``Rewrite.key``),
    given operands of the same types and pattern.

    What ``_emitter`` reads of the level, with equation indices made relative to the
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


def _emitter(eqns: Sequence[JaxprEqn], unit: list[_Group], order: Sequence[int],
             needed: frozenset[int]) -> EmitFn:
    position = {i: k for k, i in enumerate(order)}
    made_by: dict[Any, tuple[_Group, int]] = {}
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
    """One trace of ``_emitter``'s function: the level's values given (``env``), the
    stacked columns, each group's batched result and the member results sliced out."""

    eqns: Sequence[JaxprEqn]
    made_by: dict[Any, tuple[_Group, int]]
    env: dict[Any, Any]
    stacked: dict[_Column, Any] = dataclasses.field(default_factory=dict)  # atoms -> stack
    results: dict[_Group, Any] = dataclasses.field(default_factory=dict)
    sliced: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def value(self, atom: Atom) -> Any:
        if isinstance(atom, _Transposed):
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
                    out = lax.transpose(out, _swap_permutation(eqn))
            self.sliced[atom] = out
        return self.sliced[atom]

    def batch(self, g: _Group, template: JaxprEqn) -> None:
        """Bind group ``g`` as one op over its stacked operands (``template`` is its
        first member)."""
        eqns, stacked = self.eqns, self.stacked
        operands: list[Any] = []
        axes: list[int | None] = []
        with _compat.eqn_context(eqns[g.members[-1]]):
            for column in g.columns(eqns):
                if _shared(column) and not _compat.is_literal(column[0]):
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


# --------------------------------------------------------------------------- reports


def _describe(eqns: Sequence[JaxprEqn], group: _Group) -> str:
    eqn = eqns[group.members[0]]
    shapes = " x ".join(str(v.aval.str_short()) for v in eqn.invars)
    return f"{len(group.members)} independent {eqn.primitive.name}s of {shapes} at launch " \
           f"depth {group.depth} ({group.depth - 1} kernel-launching ops before each, no path " \
           "between them)"


def _price_text(price: _Price) -> str:
    return (f"cost model: saves {price.saved * 1e6:.3g} us of launches, stacking, slicing "
            f"and transposing cost {price.cost * 1e6:.3g} us, worth {price.worth * 1e6:+.3g} us "
            "per run of this level")


def _batched(path: str, eqns: Sequence[JaxprEqn], group: _Group, launches: int,
             chained: set[_Column], price: _Price) -> PassDecision:
    columns = group.columns(eqns)
    shared = sum(1 for c in columns if _shared(c) and not _compat.is_literal(c[0]))
    reused = sum(1 for c in columns if not _shared(c) and c in chained)
    stacked = len(columns) - shared - reused
    swapped = sum(group.swapped)
    transposed = sum(sum(r.transposed) for r in group.readings)
    reason = (f"{_describe(eqns, group)}: one batched op over {stacked} stacked, {shared} "
              f"shared and {reused} already-stacked operands; {launches} kernel launches -> 1"
              + (f"; {swapped} with operands swapped, results transposed back"
                 if swapped else "")
              + (f"; {transposed} operands read transposed (in their stacking copy)"
                 if transposed else "") + f"; {_price_text(price)}")
    return decision(path, DecisionKind.BATCHED_MATMULS, eqns, list(group.members),
                    trips_before=None, trips_after=None, unroll=None, reason=reason,
                    members=[(i,) for i in group.members], depth=group.depth,
                    saving_us=price.worth * 1e6)


def _left_alone(path: str, eqns: Sequence[JaxprEqn], group: _Group, launches: int, price: _Price
                ) -> PassDecision:
    saves = f"{launches - 1} kernel launch{'es' * (launches > 2)}"
    why = (f"would save {saves}, but {price.memory}" if price.memory is not None else
           f"would save {saves} but add at least as much in stacking and slicing kernels"
           if price.worth <= 0 else
           f"would save {saves}, less than half a launch more than its stacking and slicing "
           "kernels cost at one end of the GPU model's ranges: the cost model cannot tell "
           "it pays")
    reason = f"batching {why}: {_describe(eqns, group)}; {_price_text(price)}"
    return decision(path, DecisionKind.MATMULS_LEFT_ALONE, eqns, list(group.members),
                    trips_before=None, trips_after=None, unroll=None, reason=reason,
                    members=[(i,) for i in group.members], depth=group.depth,
                    saving_us=price.worth * 1e6)


# The pass's state for a call (its row's ``state``, shared by every mode).
State = _Carried
