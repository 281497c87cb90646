"""Batch same-shaped matmuls and convolutions of independent, different members.

``batch_scans`` and ``batch_branches`` batch members that run the *same*
computation. This pass batches members that differ: the two halves of a fused
scan body with different step functions (seed 002), the branches of a
multi-branch block, the experts of a mixture, the towers of a model. Wherever
independent equations of one level run a heavy op of the same shape -- a
``dot_general`` or ``conv_general_dilated`` with equal operand types, dimension
numbers and other parameters -- at the same *stage*, they run as one op under
``jax.vmap`` over stacked operands, and each member's result is sliced back out.
The members' light work (activations, scalings, residual adds) stays theirs:
XLA fuses it into the neighbouring kernels, including the stacking copies.

* *Stage*: the most kernel-launching equations on a path from the level's inputs
  to the op, itself included. Two heavy ops at one stage cannot depend on each
  other (a path between them would add one), so any set of them can run as one;
  and contracting every group at once never makes a cycle (paths between groups
  only climb stages).
* *Operand order*: a ``dot_general`` also matches with its operands swapped
  (``c @ x`` against ``x.T @ c.T``): it is emitted in the group's form and its
  result transposed back, which XLA folds into the consumer.
* *Chains*: a batched op whose operand is, member by member, the result of
  another batched op reads that op's stacked result directly (one rewrite holds
  both), so a chain ``X @ X @ X`` stays stacked from one matmul to the next.
  An operand column stacked once serves every op of the rewrite that reads it.
* *Cost*: the target's cost model decides. A group saves one kernel launch per
  member (less the ones XLA's ``DotMerger`` already saves: members sharing an
  operand); every operand column that is neither shared nor already stacked
  costs a stacking copy (a launch and its bytes). Groups are dropped, the least
  worth first, until each one pays for the stacks only it needs.

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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import _compat
from .._analysis import Analysis
from .._cost import CostModel
from .._graph import Graph
from .._primitives import BATCHED_MATMULS, DOT_GENERAL, TRANSPOSE, is_collective
from ._shared import stage_depths
from ._walk import (
    KIND_BATCHED_MATMULS,
    KIND_MATMULS_LEFT_ALONE,
    Level,
    LevelResult,
    LoopDecision,
    Rewrite,
    decision,
    emission_order,
)

# The heavy ops this pass batches: one kernel each, whose batched form is one kernel.
BATCHED_PRIMITIVES = BATCHED_MATMULS

# A column of operands, one atom per member (in the group's form).
_Column = tuple[Any, ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Group:
    """Same-shaped heavy ops of one stage, run as one batched op.

    ``members`` are equation indices (sorted); ``swapped[m]`` says member ``m`` is a
    ``dot_general`` emitted with its operands swapped (its result is transposed back).
    """

    members: tuple[int, ...]
    swapped: tuple[bool, ...]
    stage: int
    params: Any  # the group's form: parameters of an unswapped member

    def columns(self, eqns: Sequence[Any]) -> list[_Column]:
        """Per operand position of the group's form, the members' atoms."""
        rows = [_operands(eqns[i], s) for i, s in zip(self.members, self.swapped, strict=True)]
        return [tuple(row[p] for row in rows) for p in range(len(rows[0]))]

    def outputs(self, eqns: Sequence[Any]) -> _Column:
        return tuple(eqns[i].outvars[0] for i in self.members)


def _operands(eqn: Any, swapped: bool) -> list[Any]:
    return list(eqn.invars[::-1] if swapped else eqn.invars)


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: batched ops for same-shaped heavy ops of one stage.

    The analysis's ``"batch_matmuls"`` memo remembers levels found to offer nothing
    (jaxprs are immutable and the passes see the same ones round after round).
    """
    memo = analysis.memo("batch_matmuls")
    jaxpr = level.jaxpr
    seen = memo.get(id(jaxpr))
    if seen is not None and seen is jaxpr:
        return [], []
    rewrites, decisions = _batch_level(level, analysis.costs)
    if not rewrites:
        memo[id(jaxpr)] = jaxpr
    return rewrites, decisions


def _batchable(eqn: Any) -> bool:
    return (eqn.primitive.name in BATCHED_PRIMITIVES and not eqn.effects
            and not is_collective(eqn)
            and not _compat.eqn_frontend_attributes(eqn))


def _batch_level(level: Level, costs: CostModel) -> tuple[list[Rewrite], list[LoopDecision]]:
    inner, _ = _compat.open_jaxpr(level.jaxpr)
    eqns, path = inner.eqns, level.path
    candidates = [i for i, e in enumerate(eqns) if _batchable(e)]
    if len(candidates) < 2:
        return [], []
    graph = level.graph
    candidates = [i for i in candidates if i in graph.live]
    # A transpose XLA folds into the matmul reading it (or fuses): it starts no stage.
    stage = stage_depths(graph, [costs.launches(e) and e.primitive.name != TRANSPOSE
                            for e in eqns])
    groups = _group(eqns, candidates, stage)
    if not groups:
        return [], []
    groups.sort(key=lambda g: (g.stage, g.members))
    launches = {g: _launches_unbatched(eqns, g) for g in groups}
    groups = [g for g in groups if launches[g] > 1]  # else XLA's DotMerger does it already
    if not groups:
        return [], []
    accepted, rejected, priced = _choose(eqns, groups, launches, costs)
    decisions = [_left_alone(path, eqns, g, launches[g], priced[g]) for g in rejected]
    if not accepted:
        return [], decisions
    units = _units(eqns, graph, accepted)
    level_outputs = {v for v in inner.outvars if not _compat.is_literal(v)}
    rewrites = [Rewrite(tuple(sorted(i for g in unit for i in g.members)),
                        _emitter(eqns, unit, graph, level_outputs)) for unit in units]
    chained = _chained_columns(eqns, accepted)
    taken = [_batched(path, eqns, g, launches[g], chained, priced[g])
             for unit in units for g in unit]
    return rewrites, taken + decisions


# --------------------------------------------------------------------------- grouping


def _hashable(value: Any) -> Hashable:
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value


def _group(eqns: Sequence[Any], candidates: list[int], stage: list[int]) -> list[_Group]:
    """Same-shaped heavy ops of one stage. A class of ``dot_general``s whose swapped form
    is another class's form joins the larger one (the smaller one swapped), so operands
    are swapped only where that is what makes the members match."""
    classes: dict[Hashable, list[int]] = {}
    swapped_keys: dict[Hashable, Hashable] = {}
    # form -> its swapped form (None: not swappable); the swapped form depends only on
    # the form, and most forms recur over many stages.
    swapped_forms: dict[Hashable, Hashable | None] = {}
    for index in candidates:
        eqn = eqns[index]
        form = _form_key(eqn.primitive.name, [v.aval for v in eqn.invars],
                         [v.aval for v in eqn.outvars], eqn.params)
        key: Hashable = (form, stage[index])
        classes.setdefault(key, []).append(index)
        if key not in swapped_keys:
            if form in swapped_forms:
                swapped_form = swapped_forms[form]
            else:
                swapped = _swapped_params(eqn)
                swapped_form = None
                if swapped is not None:
                    lhs, rhs = eqn.invars
                    swapped_form = _form_key(eqn.primitive.name, [rhs.aval, lhs.aval],
                                             [_transposed_aval(eqn)], swapped)
                swapped_forms[form] = swapped_form
            if swapped_form is not None:
                swapped_keys[key] = (swapped_form, stage[index])
    joined: dict[Hashable, list[tuple[int, bool]]] = {
        key: [(i, False) for i in found] for key, found in classes.items()}
    for key in list(joined):  # first-seen order: deterministic
        partner = swapped_keys.get(key)
        if key not in joined or partner is None or partner == key or partner not in joined:
            continue
        big, small = ((key, partner) if len(joined[key]) >= len(joined[partner])
                      else (partner, key))
        joined[big] += [(i, True) for i, _ in joined.pop(small)]
    groups = []
    for found in joined.values():
        if len(found) < 2:
            continue
        found.sort()
        plain = next(i for i, swapped in found if not swapped)
        groups.append(_Group(tuple(i for i, _ in found), tuple(s for _, s in found),
                             stage[plain], dict(eqns[plain].params)))
    return groups


def _form_key(name: str, avals: Sequence[Any], outs: Sequence[Any], params: Any) -> Hashable:
    return (name, tuple(avals), tuple(outs),
            tuple((k, _hashable(v)) for k, v in sorted(params.items())))


def _swapped_params(eqn: Any) -> dict[str, Any] | None:
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


def _swap_permutation(eqn: Any) -> tuple[int, ...]:
    """How to transpose a swapped ``dot_general``'s result into the original's layout."""
    (lhs_contract, rhs_contract), (lhs_batch, _) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    batch = len(lhs_batch)
    lhs_free = lhs.aval.ndim - len(lhs_contract) - batch
    rhs_free = rhs.aval.ndim - len(rhs_contract) - batch
    return (*range(batch), *range(batch + rhs_free, batch + rhs_free + lhs_free),
            *range(batch, batch + rhs_free))


def _transposed_aval(eqn: Any) -> Any:
    """The result type of ``eqn`` with its operands swapped."""
    out = eqn.outvars[0].aval
    permutation = _swap_permutation(eqn)
    inverse = [0] * len(permutation)
    for new, old in enumerate(permutation):
        inverse[old] = new
    return out.update(shape=tuple(out.shape[inverse[d]] for d in range(out.ndim)))


def _launches_unbatched(eqns: Sequence[Any], group: _Group) -> int:
    """Kernels the members launch as they are: XLA's ``DotMerger`` already merges
    matmuls that share an operand, so members linked by shared operands count once."""
    parent = list(range(len(group.members)))

    def find(m: int) -> int:
        while parent[m] != m:
            parent[m] = parent[parent[m]]
            m = parent[m]
        return m

    if group.members and eqns[group.members[0]].primitive.name == DOT_GENERAL:
        for column in group.columns(eqns):
            first: dict[Any, int] = {}
            for m, atom in enumerate(column):
                if _compat.is_literal(atom):
                    continue
                if atom in first:
                    parent[find(m)] = find(first[atom])
                else:
                    first[atom] = m
    return len({find(m) for m in range(len(group.members))})


# --------------------------------------------------------------------------- cost


def _shared(column: _Column) -> bool:
    return all(a is column[0] for a in column[1:])


def _stack_bytes(column: _Column) -> float:
    return 2.0 * sum(_compat.aval_nbytes(a.aval) for a in column)


@dataclasses.dataclass(frozen=True, slots=True)
class _Price:
    """The cost model's view of one group, in seconds per run of the level."""

    saved: float  # launches saved (and the stacking its chained readers are spared)
    cost: float  # stacking kernel, stacking and transposing bytes

    @property
    def worth(self) -> float:
        return self.saved - self.cost


def _choose(eqns: Sequence[Any], groups: list[_Group], launches: dict[_Group, int],
            costs: CostModel) -> tuple[list[_Group], list[_Group], dict[_Group, _Price]]:
    """The groups worth batching, the rest, and each one's price (a dropped group's as
    it was when dropped), by the launches they save.

    A group saves ``launches - 1`` kernel launches. Its operand columns that are neither
    shared by all members nor already stacked (by an earlier group of the rewrite, or as
    the result of another batched op) are stacked, in one fused kernel per group (XLA
    fuses sibling concatenations and their elementwise producers). That kernel is new
    only when no stacked value comes from elementwise work: such work launched a kernel
    of its own before (a matmul does not fuse it), and the stacking kernel takes its
    place. Groups are dropped, least worth first, until each one wins at least half a
    launch more than it costs.
    """
    profile = costs.profile
    launch = profile.min_kernel_seconds
    # Where the model cannot tell, leave the program alone: a group must win at least half
    # a launch more than it costs (a siamese network's backward pass, priced +0.69 us,
    # launched one kernel more once compiled).
    margin = launch / 2
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    cost_of = costs.eqn_cost

    def elementwise(atom: Any) -> bool:
        source = producer.get(atom)
        if source is None:
            return False
        cost = cost_of(eqns[source])
        return cost.kernels == 0 and cost.flops > 0

    columns = {g: g.columns(eqns) for g in groups}
    outputs = {g: g.outputs(eqns) for g in groups}
    transposes = {g: sum(2.0 * _compat.aval_nbytes(eqns[i].outvars[0].aval)
                         for i, s in zip(g.members, g.swapped, strict=True) if s)
                  for g in groups}
    accepted = list(groups)  # in stage order
    priced: dict[_Group, _Price] = {}
    for _ in range(len(groups) + 1):
        produced = {outputs[g] for g in accepted if not any(g.swapped)}
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
        for g in accepted:
            new = [c for c in dict.fromkeys(columns[g]) if first_user.get(c) is g]
            saved = (launches[g] - 1) * launch
            cost = transposes[g] / profile.bandwidth
            if new and not any(elementwise(a) for c in new for a in c):
                cost += launch
            cost += sum(_stack_bytes(c) for c in new if users[c] == 1) / profile.bandwidth
            if chained.get(outputs[g]):
                saved += launch  # its readers would otherwise stack its results
            priced[g] = _Price(saved, cost)
        if all(priced[g].worth > margin for g in accepted):
            break
        accepted = [g for g in accepted if priced[g].worth > margin]
    else:  # pragma: no cover - each round removes a group or stops
        raise RuntimeError("jaxpar batch_matmuls: choosing groups did not settle; please "
                           "report it with the program")
    kept = set(accepted)
    return accepted, [g for g in groups if g not in kept], priced


def _chained_columns(eqns: Sequence[Any], accepted: list[_Group]) -> set[_Column]:
    return {g.outputs(eqns) for g in accepted if not any(g.swapped)}


# --------------------------------------------------------------------------- rewrites


def _units(eqns: Sequence[Any], graph: Graph, accepted: list[_Group]) -> list[list[_Group]]:
    """Accepted groups joined into rewrites: a group reading another's stacked result
    joins its rewrite, where contracting the two into one unit makes no cycle."""
    index = {g: k for k, g in enumerate(accepted)}
    produced = {g.outputs(eqns): g for g in accepted if not any(g.swapped)}
    parent = list(range(len(accepted)))

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def members(units: dict[int, list[_Group]]) -> list[list[int]]:
        return [[i for g in unit for i in g.members] for unit in units.values()]

    def units_of() -> dict[int, list[_Group]]:
        out: dict[int, list[_Group]] = {}
        for k, g in enumerate(accepted):
            out.setdefault(find(k), []).append(g)
        return out

    for g in accepted:  # stage order: each source is placed before its readers
        for column in g.columns(eqns):
            source = produced.get(column)
            if source is None or _shared(column):
                continue
            a, b = find(index[source]), find(index[g])
            if a == b:
                continue
            saved = list(parent)
            parent[b] = a
            if emission_order(graph, members(units_of())) is None:
                parent[:] = saved  # a path leaves the pair and comes back: keep them apart
    return [sorted(unit, key=lambda g: (g.stage, g.members)) for unit in units_of().values()]


def _emitter(eqns: Sequence[Any], unit: list[_Group], graph: Graph, level_outputs: set[Any]
             ) -> Any:
    order = sorted(i for g in unit for i in g.members)
    position = {i: k for k, i in enumerate(order)}
    inside = set(order)
    made_by: dict[Any, tuple[_Group, int]] = {}
    for g in unit:
        for m, i in enumerate(g.members):
            made_by[eqns[i].outvars[0]] = (g, m)
    needed = {i for i in order if eqns[i].outvars[0] in level_outputs
              or any(s not in inside for s in graph.succs[i])}
    templates = {g: eqns[g.members[g.swapped.index(False)]] for g in unit}

    def emit(invals: list[list[Any]]) -> list[list[Any] | None]:
        env: dict[Any, Any] = {}
        for i in order:
            for atom, given in zip(eqns[i].invars, invals[position[i]], strict=True):
                if not _compat.is_literal(atom) and atom not in made_by:
                    env[atom] = given
        stacked: dict[_Column, Any] = {}  # column of atoms -> their stacked value
        results: dict[_Group, Any] = {}
        sliced: dict[Any, Any] = {}

        def value(atom: Any) -> Any:
            if _compat.is_literal(atom):
                return _compat.literal_value(atom)
            if atom in env:
                return env[atom]
            if atom not in sliced:
                group, m = made_by[atom]
                eqn = eqns[group.members[m]]
                with _compat.eqn_context(eqn):
                    out = lax.index_in_dim(results[group], m, keepdims=False)
                    if group.swapped[m]:
                        out = lax.transpose(out, _swap_permutation(eqn))
                sliced[atom] = out
            return sliced[atom]

        for g in unit:
            template = templates[g]
            operands: list[Any] = []
            axes: list[int | None] = []
            with _compat.eqn_context(eqns[g.members[-1]]):
                for column in g.columns(eqns):
                    if _shared(column) and not _compat.is_literal(column[0]):
                        operands.append(value(column[0]))
                        axes.append(None)
                        continue
                    if column not in stacked:
                        stacked[column] = jnp.stack([jnp.asarray(value(a)) for a in column])
                    operands.append(stacked[column])
                    axes.append(0)

                def one(*ops: Any, template: Any = template, params: Any = g.params) -> Any:
                    return _compat.bind_eqn(template, ops, params)[0]

                results[g] = jax.vmap(one, in_axes=tuple(axes))(*operands)
            if not any(g.swapped):
                stacked[g.outputs(eqns)] = results[g]
        return [[value(eqns[i].outvars[0]) if i in needed else None] for i in order]

    return emit


# --------------------------------------------------------------------------- reports


def _describe(eqns: Sequence[Any], group: _Group) -> str:
    eqn = eqns[group.members[0]]
    shapes = " x ".join(str(v.aval.str_short()) for v in eqn.invars)
    return f"{len(group.members)} independent {eqn.primitive.name}s of {shapes} at stage " \
           f"{group.stage} ({group.stage - 1} kernel-launching ops before each, no path " \
           "between them)"


def _price_text(price: _Price) -> str:
    return (f"cost model: saves {price.saved * 1e6:.3g} us of launches, stacking and "
            f"transposing cost {price.cost * 1e6:.3g} us, worth {price.worth * 1e6:+.3g} us "
            "per run of this level")


def _batched(path: str, eqns: Sequence[Any], group: _Group, launches: int,
             chained: set[_Column], price: _Price) -> LoopDecision:
    columns = group.columns(eqns)
    shared = sum(1 for c in columns if _shared(c) and not _compat.is_literal(c[0]))
    reused = sum(1 for c in columns if not _shared(c) and c in chained)
    stacked = len(columns) - shared - reused
    swapped = sum(group.swapped)
    reason = (f"{_describe(eqns, group)}: one batched op over {stacked} stacked, {shared} "
              f"shared and {reused} already-stacked operands; {launches} kernel launches -> 1"
              + (f"; {swapped} with operands swapped, results transposed back"
                 if swapped else "") + f"; {_price_text(price)}")
    return decision(path, KIND_BATCHED_MATMULS, eqns, list(group.members), trips_before=None,
                    trips_after=None, unroll=None, reason=reason,
                    members=[(i,) for i in group.members], stage=group.stage,
                    saving_us=price.worth * 1e6)


def _left_alone(path: str, eqns: Sequence[Any], group: _Group, launches: int, price: _Price
                ) -> LoopDecision:
    why = ("stacking their operands costs more than the" if price.worth <= 0 else
           "the cost model cannot tell it pays: batching wins less than half a launch more "
           "than stacking their operands costs, against the")
    reason = (f"{_describe(eqns, group)}, but {why} {launches - 1} kernel launches batching "
              f"would save; {_price_text(price)}")
    return decision(path, KIND_MATMULS_LEFT_ALONE, eqns, list(group.members),
                    trips_before=None, trips_after=None, unroll=None, reason=reason,
                    members=[(i,) for i in group.members], stage=group.stage,
                    saving_us=price.worth * 1e6)
