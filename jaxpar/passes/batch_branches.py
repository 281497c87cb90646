"""Batch identical independent subgraphs (ensemble members) into one ``vmap``ped subgraph.

The pass behind the ``batch_branches`` option and ``jaxpar.passes.batch_branches``
(the public name predates this module's: what it batches are subgraphs, whether or
not they were written as branches).

``batch_scans`` merges loops that run the same body; this pass does the same for
straight-line code. Two or more subgraphs of one level that compute the same
thing on same-typed inputs, with no path between them -- the members of an
ensemble, the heads of a multi-head block written out one by one -- become one
computation under ``jax.vmap``: every input in which the members differ is
stacked along a new leading axis, an input they share is passed once, and each
member's results are sliced back out. Each member's ``k`` kernels become ``k``
batched kernels.

How the subgraphs are found:

1. *Value numbering*: each equation gets a structural key -- its primitive, its
   parameters (``_program.structure``), its result types and the keys of its inputs, where a
   level input counts by its type only. Equations ``vmap`` never batches faithfully
   (``_batchable.static_refusal``) get none. Two equations with equal keys compute the same
   function of same-typed level inputs, and neither can depend on the other.
2. *Alignment*: starting from a class of equal-keyed equations (latest first, so
   the largest subgraphs are tried first), the pass walks the members' inputs in
   lockstep. Where all members read the very same variable, it is a shared
   input; where they read different equations' results, those equations join the
   subgraphs (one more aligned row); anything else is a stacked input.
3. *Checks*: the union of the subgraphs must be contractible to one unit (no path
   leaves it and comes back), and no stacked input may be produced inside it.
   ``vmap`` must batch the members faithfully and cheaply given which inputs are
   stacked (no ``cond`` index or ``while`` predicate read from a stacked input). The
   members must sit at the same launch depth and height: aligned equations have the
   same number of kernel-launching equations before them and after them. (Batching
   the weight flips of three layers of a backward pass would hold the later
   layers' work back and tie layers together that the stream planner overlaps.)
   And the cost model of the target must say the batched form is cheaper: stacking
   copies every differing input once per call, which for large weights can cost
   more than the kernel launches it saves. Launches are priced in the CUDA-graph mode
   the function is compiled in (``CostModel.launch_prices``): in a ``concurrent``
   graph the members already run side by side, so one saved is worth its graph node
   only. Subgraphs of two or more kernels left
   alone for either reason are reported (the largest only, not each of their parts).

Example::

    def ensemble(params, x):          # params: four members of the same shapes
        return [mlp(p, x) for p in params]

    new_jaxpr, decisions = batch_branches(jax.make_jaxpr(ensemble)(params, x), target="gpu")
    # three dot_generals with a batch dimension instead of twelve

Sharp edges:
  * Equations with effects, user placement (``on_stream``, XLA metadata) or
    collectives are never batched.
  * Equations are compared structurally (``_program.structure``): parameters and constants
    by value, nested jaxprs equation by equation, functions by identity. Two
    members that differ only in the order of their equations are not recognised.
  * Only what ``vmap`` batches faithfully and cheaply is batched (``_batchable``):
    members drawing ``rbg`` random bits, calling the host (whatever ``vmap_method``
    a callback declares), holding a ``custom_vjp`` or a ``custom_jvp`` whose rule
    fails the same test, or branching on a per-member predicate are left alone;
    equal equations refused so are reported (the first of each chain).
  * Results agree with the unbatched program to float rounding: XLA may pick a
    different algorithm for a batched matmul.
  * Members of one matmul (or convolution) each are left to ``batch_matmuls``, which
    orients their operands and prices the transposes a vmapped dot may need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

from .. import _compat, _ops
from .._analysis import Analysis, OrderMemo
from .._compat import Jaxpr, JaxprEqn, Primitive
from .._memo import IdentityMemo
from .._model.cost import ENDS, ZERO, Cost, CostModel, LaunchPrices
from .._model.gpu import CommandBufferMode
from .._model.memory import stacking_refusal
from .._program.graph import Graph
from .._program.primitives import BATCHED_MATMULS, COLLECTIVE, is_collective
from .._program.structure import StructuralKeys, literal_key
from ._batch_members import (
    MAX_BATCH_MEMBERS,
    member_chunks,
    shared_column,
    stacked_width,
    vmap_members,
)
from ._batchable import equations_refusal, refusal_reads_operand_types, static_refusal
from ._level_graph import launch_depths
from ._protocol import DecisionKind, EmitFn, Level, LevelResult, PassDecision, Rewrite, decision
from ._splice import emission_order

# Equations the lockstep walks may visit per equation of the level, over all their tries.
_ALIGN_BUDGET_PER_EQN = 8

# Where an aligned row reads from: a literal, a stacked-or-shared input slot, or another row.
_Source = tuple[str, Any] | tuple[str, int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class _Group:
    """Aligned subgraphs: ``rows[t][m]`` is member ``m``'s equation at template row ``t``."""

    rows: tuple[tuple[int, ...], ...]  # in topological order of member 0
    wiring: tuple[tuple[_Source, ...], ...]  # per row, per input
    slots: tuple[tuple[int, int], ...]  # per input slot: (row, input position) it is read at
    outputs: tuple[tuple[int, int], ...]  # (row, result position) needed outside the group
    eqns: tuple[int, ...]  # every row's equations, in level order

    @property
    def members(self) -> int:
        return len(self.rows[0])


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: one vmapped subgraph per group of identical independent subgraphs.

    A level found to offer nothing is not searched again (the row
    ``remembers_search``: jaxprs and equations are immutable, and the passes see the
    same ones round after round); the pass's ``State`` (its row's, shared by every
    mode) keeps equations' parameter keys and each equation's record (``_Numbering``),
    so a level rebuilt by a rewrite checks and hashes only the equations the rewrite
    made, in this mode or another; those it kept are renumbered
    from their inputs' numbers where a rewrite upstream changed them, and keep whether
    they launch a kernel. Where every verdict would be the same in a mode pricing
    launches otherwise, the result says so (``LevelResult.decided_alike``).
    """
    own: State = level.state if level.state is not None else State()
    rewrites, decisions, alike = _batch_level(
        level, analysis.costs, own.params,
        analysis.structural_keys, analysis.shared.emission_order,
        analysis.settings.modes.priced, own.values, analysis.allowance_for("batch_branches"))
    return LevelResult(rewrites, decisions, decided_alike=alike)


@dataclasses.dataclass(slots=True)
class State:
    """The pass's state for a call (its row's ``state``, shared by every mode).

    Attributes:
        params: per parameter dict (or equation), its structural key and vmap verdict
            (``_ParamKeys``' memo).
        values: each equation's record (``_Numbering``).
    """

    params: IdentityMemo[Any, Any] = dataclasses.field(default_factory=IdentityMemo)
    values: _Numbering = dataclasses.field(default_factory=lambda: _Numbering())


# Per parameter dict (or equation): its structural key, the primitive, context and operand
# count it was keyed with, and why vmap does not batch it (None: it does).
_OwnerMemo = IdentityMemo[object, tuple[Hashable, Primitive, Any, int, str | None]]


class _Numbering:
    """Value numbers kept across the rounds and levels of one call (``_value_numbers``).

    ``eqns`` holds, per equation ``vmap`` may batch, a record (a list, updated in place):
    ``[read, key, operation, params, outs, costs, heavy]`` -- the input numbers it read
    at its last numbering and the number that gave it; the number of what it computes
    from them, ``intern[("op", params, outs)]``, with its parameter key and result types
    (functions of the equation alone); and whether it launches a kernel under the cost
    model ``costs`` (None until asked). Its number is always
    ``intern[(operation, read)]``: equal for equal operations on equal inputs.
    """

    __slots__ = ("eqns", "intern")

    def __init__(self) -> None:
        self.intern: dict[Hashable, int] = {}
        self.eqns: IdentityMemo[JaxprEqn, list[Any]] = IdentityMemo()


def _batch_level(level: Level, costs: CostModel,
                 memo: _OwnerMemo, structure: StructuralKeys,
                 orders: OrderMemo, mode: CommandBufferMode | None = None,
                 carried: _Numbering | None = None, allowance: float | None = None
                 ) -> tuple[list[Rewrite], list[PassDecision], bool]:
    """The rewrites and decisions, and whether every verdict would be the same in a mode
    pricing launches otherwise (``CostModel.launch_prices``). A group is batched only
    where it pays at both ends of the GPU model's ranges (``_model.cost.ENDS``) and its stacked
    copies fit the memory budget's ``allowance``."""
    inner, _ = _compat.open_jaxpr(level.jaxpr)
    eqns, path = inner.eqns, level.path
    if len(eqns) < 2:
        return [], [], True
    graph = level.graph
    carried = _Numbering() if carried is None else carried
    producer = _producers(eqns)
    refused: dict[Hashable, tuple[str, list[int]]] = {}
    keys, records = _value_numbers(inner, producer, graph, memo, structure, refused, carried)
    decisions: list[PassDecision] = [
        decision(path, DecisionKind.SUBGRAPHS_LEFT_ALONE, eqns, members, trips_before=None,
                 trips_after=None, unroll=None,
                 reason=f"{len(members)} identical independent equations, but vmap would "
                        f"not batch them faithfully and cheaply: {why}")
        for why, members in refused.values() if len(members) > 1]
    classes: dict[int, list[int]] = {}
    for index, key in enumerate(keys):
        if key is not None:
            classes.setdefault(key, []).append(index)
    candidates = sorted((m for m in classes.values() if len(m) > 1), key=lambda m: -m[-1])
    if not candidates:
        return [], decisions, True
    # Only the equations of candidate groups are costed; the depths need only which
    # equations launch a kernel.
    heavy = _heavy(eqns, records, costs)
    prices = [costs.launch_prices(eqns, mode, level.in_loop_body, end) for end in ENDS]
    other_mode = (CommandBufferMode.LHS if mode is CommandBufferMode.CONCURRENT
                  else CommandBufferMode.CONCURRENT)
    other_prices = [costs.launch_prices(eqns, other_mode, level.in_loop_body, end)
                    for end in ENDS]
    alike = True
    depth, height = _depths_and_heights(graph, heavy)
    claimed: set[int] = set()
    reported: set[int] = set()  # equations of subgraphs already reported as left alone
    level_outputs = {v for v in inner.outvars if not _compat.is_literal(v)}
    groups: list[_Group] = []
    member_kernels: dict[tuple[int, ...], int] = {}  # per accepted group (by its equations)
    # Rejected subgraphs are tried again from their inner equations (a part may pay where
    # the whole does not); the budget keeps that near-linear in the level's size.
    budget = [_ALIGN_BUDGET_PER_EQN * len(eqns)]
    for roots in _chunks(candidates, claimed):
        if len(roots) < 2:
            continue
        if budget[0] <= 0:
            break
        group = _align(eqns, roots, producer, claimed, graph, level_outputs, budget)
        if group is None or not _contractible(graph, set(group.eqns)):
            continue
        if group.members * stacked_width(eqns, graph, group.eqns) > MAX_BATCH_MEMBERS:
            continue  # batches of batches: more distinct slices than XLA compiles quickly
        member_cost = sum((costs.eqn_cost(eqns[row[0]]) for row in group.rows), ZERO)
        if member_cost.kernels < 1:
            continue  # nothing launched: XLA fuses it anyway
        if len(group.rows) == 1 and eqns[group.rows[0][0]].primitive.name in BATCHED_MATMULS:
            # One matmul per member is ``batch_matmuls``'s to weigh: it orients the
            # operands and prices the transposes a vmapped dot may need (a GRU cell's
            # three ``h @ w`` batched here launched one kernel more a trip, deviceless H200).
            continue
        why, same = _refusal(eqns, group, member_cost, depth, height, heavy, graph,
                             level_outputs, costs, prices, other_prices, allowance)
        if not same:
            alike = False
        if why is not None:
            # Reported when worth a line: members launching a kernel or two are not.
            if member_cost.kernels >= 2 and not set(group.eqns) <= reported:
                reported.update(group.eqns)
                decisions.append(decision(
                    path, DecisionKind.SUBGRAPHS_LEFT_ALONE, eqns, list(group.rows[-1]),
                    trips_before=None, trips_after=None, unroll=None,
                    reason=f"{group.members} identical independent subgraphs of "
                           f"{len(group.rows)} equations, but {why}"))
            continue
        claimed.update(group.eqns)
        groups.append(group)
        member_kernels[group.eqns] = int(member_cost.kernels)
    groups = _orderable(graph, groups, orders)
    rewrites, taken = _rewrites(path, eqns, groups, records, carried, member_kernels)
    return rewrites, taken + decisions, alike


def _refusal(eqns: Sequence[JaxprEqn], group: _Group, member_cost: Cost,
             depth: Sequence[int], height: Sequence[int], heavy: list[bool], graph: Graph,
             level_outputs: set[Any], costs: CostModel,
             prices: list[LaunchPrices], other_prices: list[LaunchPrices],
             allowance: float | None
             ) -> tuple[str | None, bool]:
    """Why ``_batch_level`` leaves ``group`` alone (None: it batches it), and whether
    that verdict would be the same at the other mode's launch prices (``other_prices``;
    ``prices``: this mode's)."""
    same = True
    why = _vmap_refusal(eqns, group)
    if why is not None:
        why = f"vmap would not batch them faithfully and cheaply: {why}"
    elif any(len({depth[i] for i in row}) > 1 or len({height[i] for i in row}) > 1
             for row in group.rows):
        why = ("they sit at different launch depths of the program (different numbers "
               "of kernels before or after them), so batching would hold the earlier "
               "ones back or join layers the planner can overlap")
    else:
        before, after, stacked = _before_after(eqns, group, member_cost, heavy, graph,
                                               level_outputs)
        # In a concurrent graph the members' launches run side by side: one
        # member's are in series with the rest, the others' beside them.
        beside = member_cost.kernels * (group.members - 1)
        loses = _loses(before, after, beside, costs, prices)
        if other_prices != prices and loses != _loses(before, after, beside, costs,
                                                      other_prices):
            same = False
        if loses:
            why = (f"stacking their differing inputs costs more than the "
                   f"{int(member_cost.kernels) * (group.members - 1)} kernel launches "
                   "batching would save (at one end of the GPU model's ranges)")
        else:
            why = stacking_refusal(stacked, allowance)
    return why, same


def _rewrites(path: str, eqns: Sequence[JaxprEqn], groups: list[_Group],
              records: list[list[Any] | None], carried: _Numbering,
              member_kernels: dict[tuple[int, ...], int]
              ) -> tuple[list[Rewrite], list[PassDecision]]:
    """``_batch_level``'s rewrites of the accepted ``groups``, and their decisions."""
    rewrites, taken = [], []
    for group in groups:
        rewrites.append(Rewrite(group.eqns, _emitter(eqns, group),
                                _rewrite_key(eqns, records, carried.intern, group)))
        kernels = member_kernels[group.eqns]
        stacked = sum(1 for slot in group.slots if not _shared_column(eqns, group, slot))
        taken.append(decision(
            path, DecisionKind.BATCHED_SUBGRAPHS, eqns, list(group.rows[-1]), trips_before=None,
            trips_after=None, unroll=None,
            reason=f"{group.members} independent subgraphs compute the same "
                   f"{len(group.rows)} equations: one vmapped subgraph over {stacked} stacked "
                   f"and {len(group.slots) - stacked} shared inputs, {kernels} kernel "
                   f"launches instead of {kernels * group.members}"))
    return rewrites, taken


def _chunks(candidates: list[list[int]], claimed: set[int]) -> Iterator[list[int]]:
    """Per class of equal-keyed equations, its unclaimed members in batches of at most
    ``MAX_BATCH_MEMBERS`` (``member_chunks``: what keeps XLA's compile time near plain
    ``jax.jit``'s however many members there are)."""
    for members in candidates:
        yield from member_chunks([m for m in members if m not in claimed])


def _rewrite_key(eqns: Sequence[JaxprEqn], records: list[list[Any] | None],
                 intern: dict[Hashable, int], group: _Group) -> Hashable | None:
    """Equal for two groups whose emitters trace to the same equations (``Rewrite.key``):
    same rows, wiring, slots and outputs, and the same layout of their equations in the
    level's order."""
    try:
        hash(group.wiring)
    except TypeError:  # an unhashable literal
        return None
    place = {i: (t, m) for t, row in enumerate(group.rows) for m, i in enumerate(row)}
    local_keys = tuple(_local_key(eqns[row[0]], records[row[0]], intern)  # type: ignore[arg-type]
                       for row in group.rows)
    return ("batch_branches", local_keys, group.wiring,
            group.slots, group.outputs, tuple(place[i] for i in group.eqns))


def _heavy(eqns: Sequence[JaxprEqn], records: list[list[Any] | None], costs: CostModel
           ) -> list[bool]:
    """Per equation, whether it launches a kernel (``CostModel.launches``), kept in the
    equations' records for ``costs``: a function of the equation alone there."""
    launches = costs.launches
    heavy: list[bool] = []
    for eqn, record in zip(eqns, records, strict=True):
        if record is None:
            heavy.append(launches(eqn))
        elif record[5] is costs:
            heavy.append(record[6])
        else:
            record[5] = costs
            record[6] = found = launches(eqn)
            heavy.append(found)
    return heavy


def _producers(eqns: Sequence[JaxprEqn]) -> dict[Any, tuple[int, int]]:
    producer = {}
    drop_var = _compat.DropVar
    for index, eqn in enumerate(eqns):
        outvars = eqn.outvars
        if len(outvars) == 1:  # most equations
            if not isinstance(outvars[0], drop_var):
                producer[outvars[0]] = (index, 0)
            continue
        for position, v in enumerate(outvars):
            if not isinstance(v, drop_var):
                producer[v] = (index, position)
    return producer


def _value_numbers(inner: Jaxpr, producer: dict[Any, tuple[int, int]], graph: Graph,
                   memo: _OwnerMemo, structure: StructuralKeys,
                   refused: dict[Hashable, tuple[str, list[int]]],
                   carried: _Numbering | None = None
                   ) -> tuple[list[int | None], list[list[Any] | None]]:
    """Structural keys per equation (interned to ints); None: never batched.

    Returns ``(keys, records)``: ``keys`` cover the equation and everything it reads
    from (equal keys: the same computation of same-typed level inputs); ``records`` the
    equations' records in ``carried`` (``_Numbering``; None where the key is), from which
    ``_local_key`` numbers the equation itself. Equal equations ``vmap`` would not batch
    faithfully (the first of each chain) are added to ``refused``: key -> (why, their
    indices).

    ``carried`` (kept across the rounds and levels of one call) holds the interning and
    each numbered equation's record. An equation with a record was found batchable
    before: that (no effects, no user placement, no refusal, not a collective) and its
    parameter key and result types are functions of the equation alone, so it is not
    checked or hashed again; only its inputs' numbers are read, and it is numbered
    afresh only when they changed (a rewrite upstream). Equations of a ``COLLECTIVE``
    primitive get no record: whether one is a collective depends on the call's
    ``local_axes``, so they are judged on every visit. Only equality of numbers
    matters, never their values.
    """
    carried = _Numbering() if carried is None else carried
    intern, records = carried.intern, carried.eqns
    keys: list[int | None] = []
    kept: list[list[Any] | None] = []
    refused_eqns: set[int] = set()
    # Hoisted: this runs once per equation of every level, every round.
    live = graph.live
    setdefault = intern.setdefault
    eqns = inner.eqns
    found = records.get_all(eqns)
    made: list[tuple[JaxprEqn, list[Any]]] = []  # new records
    has_frontend_attributes, collectives = _ops.has_frontend_attributes, COLLECTIVE
    by_params_of: dict[Primitive, bool] = {}  # refusal_reads_operand_types, per primitive
    # What reading each variable adds to a reader's key: ``(number of its producer, its
    # position)``, or ``("in", number of its type)`` for a level input (so numbering an
    # equation hashes no type: equal numbers, equal types). A variable not found here (a
    # literal, or the result of an equation never batched) is read by ``_read_slowly``.
    read_of: dict[Any, Hashable] = {
        v: ("in", setdefault(("in", v.aval), len(intern)))
        for v in [*inner.constvars, *inner.invars]}
    read_get = read_of.get

    for index, eqn in enumerate(eqns):
        if index not in live:
            keys.append(None)
            kept.append(None)
            continue
        record = found[index]
        if record is None and (eqn.effects or (eqn.primitive.name in collectives
                                               and is_collective(eqn))
                               or has_frontend_attributes(eqn)):  # never batched
            keys.append(None)
            kept.append(None)
            continue
        try:
            read: tuple[Hashable, ...] | None = tuple(map(read_get, eqn.invars))
        except TypeError:  # a literal: unhashable
            read = None
        if read is None or None in read:
            read = _read_slowly(eqn, producer, keys, intern)
        if read is not None:
            if record is not None:
                if record[0] != read:  # a rewrite upstream: numbered afresh
                    record[0] = read
                    record[1] = setdefault((record[2], read), len(intern))
                key = record[1]
                outvars = eqn.outvars
                if len(outvars) == 1:  # most equations
                    read_of[outvars[0]] = (key, 0)
                else:
                    read_of.update((v, (key, position)) for position, v in enumerate(outvars))
                keys.append(key)
                kept.append(record)
                continue
            hit = _memo_entry(eqn, memo, structure, by_params_of)
            params = hit[0]
            outvars = eqn.outvars
            outs = ((outvars[0].aval,) if len(outvars) == 1  # most equations
                    else tuple([v.aval for v in outvars]))
            if hit[4] is None:
                operation = setdefault(("op", params, outs), len(intern))
                key = setdefault((operation, read), len(intern))
                record = [read, key, operation, params, outs, None, None]
                if eqn.primitive.name not in collectives:
                    made.append((eqn, record))
                if len(outvars) == 1:
                    read_of[outvars[0]] = (key, 0)
                else:
                    read_of.update((v, (key, position)) for position, v in enumerate(outvars))
                keys.append(key)
                kept.append(record)
                continue
            # Equal members stop here; said once per chain (its first refused equation).
            refused_eqns.add(index)
            if not any(p in refused_eqns for p in graph.preds[index]):
                refused.setdefault(("refused", params, read, outs),
                                   (hit[4], []))[1].append(index)
        keys.append(None)
        kept.append(None)
    records.set_all(made)
    return keys, kept


def _read_slowly(eqn: JaxprEqn, producer: dict[Any, tuple[int, int]],
                 keys: list[int | None], intern: dict[Hashable, int]
                 ) -> tuple[Hashable, ...] | None:
    """What ``eqn`` reads (``_value_numbers``, given the ``keys`` so far), or None when
    it reads an equation never batched."""
    literal, setdefault = _compat.Literal, intern.setdefault
    inputs: list[Hashable] = []
    for v in eqn.invars:
        if isinstance(v, literal):
            inputs.append(("lit", v.aval, literal_key(_compat.literal_value(v))))
            continue
        source = producer.get(v)
        if source is None:
            inputs.append(("in", setdefault(("in", v.aval), len(intern))))
            continue
        source_key = keys[source[0]]
        if source_key is None:
            return None
        inputs.append((source_key, source[1]))
    return tuple(inputs)


def _memo_entry(eqn: JaxprEqn, memo: _OwnerMemo, structure: StructuralKeys,
                by_params_of: dict[Primitive, bool]
                ) -> tuple[Hashable, Primitive, Any, int, str | None]:
    """``eqn``'s entry in ``memo``: its parameter key, primitive, context, operand
    count and why vmap does not batch it faithfully and cheaply (None: it does).

    Keyed by the parameter dict when all the key reads is the primitive, the
    parameters, the context and the operand count: rebuilt levels keep the parameter
    dicts of the equations they copy, not the equations."""
    primitive = eqn.primitive
    by_params = by_params_of.get(primitive)
    if by_params is None:
        by_params = by_params_of[primitive] = not refusal_reads_operand_types(eqn)
    owner = eqn.params if by_params else eqn
    hit = memo.get(owner)
    if (hit is None
            or (by_params and (hit[1] is not primitive or hit[2] is not eqn.ctx
                               or hit[3] != len(eqn.invars)))):
        # The last entry: why vmap does not batch it faithfully and cheaply,
        # here or in a nested jaxpr (None: it does).
        hit = (structure.equation(eqn), primitive, eqn.ctx, len(eqn.invars),
               static_refusal(eqn))
        memo.set(owner, hit)
    return hit


def _local_key(eqn: JaxprEqn, record: list[Any], intern: dict[Hashable, int]) -> int:
    """The number of ``eqn`` itself (primitive, parameters, operand and result types),
    from its ``_value_numbers`` record; in the same interning as the value numbers."""
    return intern.setdefault(("local", record[3], tuple([v.aval for v in eqn.invars]),
                              record[4]), len(intern))


def _vmap_refusal(eqns: Sequence[JaxprEqn], group: _Group) -> str | None:
    """Why ``vmap`` of member 0's equations over the stacked slots would not compute
    each member faithfully and cheaply (a ``cond`` on a per-member predicate), or None."""
    stacked: dict[Any, bool] = {}
    for slot in group.slots:
        row, position = slot
        atom = eqns[group.rows[row][0]].invars[position]
        stacked[atom] = stacked.get(atom, False) or not _shared_column(eqns, group, slot)
    return equations_refusal([eqns[row[0]] for row in group.rows], stacked)


def _align(eqns: Sequence[JaxprEqn], roots: list[int], producer: dict[Any, tuple[int, int]],
           claimed: set[int], graph: Graph, level_outputs: set[Any],
           budget: list[int]) -> _Group | None:
    """Walks the members' inputs in lockstep from ``roots``; None if they do not align.

    Every equation visited is taken off ``budget[0]``; None when it runs out.
    """
    count = len(roots)
    row_of: dict[int, int] = {}  # equation -> its row
    rows: list[tuple[int, ...]] = []
    literal, get = _compat.Literal, producer.get

    def add_row(row: tuple[int, ...]) -> None:
        for i in row:
            row_of[i] = len(rows)
        rows.append(row)
        budget[0] -= len(row)

    add_row(tuple(roots))
    pending = [0]
    while pending:
        if budget[0] < 0:
            return None
        row = rows[pending.pop()]
        operands = [eqns[i].invars for i in row]
        for position, first in enumerate(operands[0]):
            if isinstance(first, literal):
                continue
            atoms = [invars[position] for invars in operands]
            if len(set(map(id, atoms))) == 1:
                continue  # the very same variable in every member: shared
            sources = [get(a) for a in atoms]
            if None in sources:
                continue  # a level input: a stacked slot
            found = tuple([s[0] for s in sources])  # type: ignore[index]
            if len(set(found)) < count or not claimed.isdisjoint(found):
                continue  # produced outside the group, or shared by some members
            if row_of.keys().isdisjoint(found):
                add_row(found)
                pending.append(len(rows) - 1)
            else:
                known = row_of.get(found[0])
                if known is None or rows[known] != found:
                    return None  # the members pair these equations differently
    return _template(eqns, rows, row_of, producer, graph, level_outputs)


def _template(eqns: Sequence[JaxprEqn], rows: list[tuple[int, ...]], row_of: dict[int, int],
              producer: dict[Any, tuple[int, int]], graph: Graph, level_outputs: set[Any]
              ) -> _Group | None:
    """Orders the rows, wires them, and finds the slots and the outputs."""
    order = sorted(range(len(rows)), key=[row[0] for row in rows].__getitem__)
    renumber = {old: new for new, old in enumerate(order)}
    rows = [rows[t] for t in order]
    members = row_of.keys()
    literal, drop_var, get, succs = _compat.Literal, _compat.DropVar, producer.get, graph.succs
    wiring: list[tuple[_Source, ...]] = []
    slots: list[tuple[int, int]] = []
    slot_of: dict[tuple[Any, ...], int] = {}
    for t, row in enumerate(rows):
        sources: list[_Source] = []
        operands = [eqns[i].invars for i in row]
        for position, atom in enumerate(operands[0]):
            if isinstance(atom, literal):
                sources.append(("lit", _compat.literal_value(atom)))
                continue
            column = tuple([invars[position] for invars in operands])
            inside = [s for s in [get(a) for a in column] if s is not None and s[0] in members]
            if inside:
                source, out = inside[0]
                wired = ("row", renumber[row_of[source]], out)
                if len(inside) != len(column) or inside != [(i, out) for i in rows[wired[1]]]:
                    return None  # a stacked input produced inside the group: a cycle
                sources.append(wired)
                continue
            if column not in slot_of:
                slot_of[column] = len(slots)
                slots.append((t, position))
            sources.append(("slot", slot_of[column]))
        wiring.append(tuple(sources))
    outputs = []
    for t, row in enumerate(rows):
        # Needed outside: a level output, or read by an equation outside the group (judged
        # per equation: for a multi-result equation that may keep a result nobody reads).
        read_outside = not members >= set().union(*[succs[i] for i in row])
        results_of = [eqns[i].outvars for i in row]
        for out in range(len(results_of[0])):
            results = [outvars[out] for outvars in results_of]
            if read_outside:
                needed = any([not isinstance(v, drop_var) for v in results])
            else:
                needed = not level_outputs.isdisjoint(results) and any(
                    [not isinstance(v, drop_var) and v in level_outputs for v in results])
            if needed:
                outputs.append((t, out))
    rows_ = tuple(rows)
    return _Group(rows_, tuple(wiring), tuple(slots), tuple(outputs),
                  tuple(sorted([i for row in rows_ for i in row])))


def _depths_and_heights(graph: Graph, heavy: list[bool]) -> tuple[list[int], list[int]]:
    """Per equation: most kernel-launching equations on a path from the inputs to it
    (``depth``) and from it to the outputs (``height``), itself included."""
    size = graph.size
    depth = launch_depths(graph, heavy)
    height = [0] * size
    succs = graph.succs
    for i in range(size - 1, -1, -1):
        after = succs[i]
        height[i] = heavy[i] + (0 if not after else height[after[0]] if len(after) == 1
                                else max([height[s] for s in after]))
    return depth, height


def _contractible(graph: Graph, members: set[int]) -> bool:
    """Whether no path leaves ``members`` and comes back (searching up to the last member)."""
    last = max(members)
    frontier = [s for i in members for s in graph.succs[i] if s not in members and s < last]
    seen: set[int] = set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        for succ in graph.succs[node]:
            if succ in members:
                return False
            if succ < last and succ not in seen:
                frontier.append(succ)
    return True


def _orderable(graph: Graph, groups: list[_Group], orders: OrderMemo) -> list[_Group]:
    """The groups, less any that would make a cycle with the earlier ones when contracted."""
    if not groups or emission_order(graph, [g.eqns for g in groups], orders) is not None:
        return groups
    kept: list[_Group] = []
    for group in groups:
        if emission_order(graph, [g.eqns for g in [*kept, group]], orders) is not None:
            kept.append(group)
    return kept


def _shared_column(eqns: Sequence[JaxprEqn], group: _Group, slot: tuple[int, int]) -> bool:
    row, position = slot
    return shared_column([eqns[i].invars[position] for i in group.rows[row]])


def _before_after(eqns: Sequence[JaxprEqn], group: _Group, member: Cost, heavy: Sequence[bool],
                  graph: Graph, level_outputs: set[Any]) -> tuple[Cost, Cost, float]:
    """Modelled cost of the members as they are, and batched (with stacking and slicing),
    and the bytes of the stacked copies (the stacked inputs and the batched results, on
    top of what the members use).

    A stacked input is one more kernel when a kernel-launching equation (a matmul) reads
    it; stacking an input only elementwise work reads fuses into that work. Likewise a
    member's result sliced out of the batched one is a kernel of its own when it leaves
    the level or a kernel-launching equation outside the group reads it (the same rule
    as ``batch_matmuls``'s).
    """
    count = group.members
    before = member.scale(count)
    after = Cost(flops=before.flops, bytes=before.bytes, kernels=member.kernels)
    stacked = 0.0
    launched = {source[1] for row, sources in zip(group.rows, group.wiring, strict=True)
                if heavy[row[0]] for source in sources if source[0] == "slot"}
    for index, slot in enumerate(group.slots):
        if not _shared_column(eqns, group, slot):
            row, position = slot
            nbytes = _compat.aval_nbytes(eqns[group.rows[row][0]].invars[position].aval)
            after = after + Cost(bytes=2.0 * count * nbytes,
                                 kernels=1.0 if index in launched else 0.0)
            stacked += count * nbytes
    inside = set(group.eqns)
    for row, out in group.outputs:
        nbytes = _compat.aval_nbytes(eqns[group.rows[row][0]].outvars[out].aval)
        sliced = sum(eqns[i].outvars[out] in level_outputs
                     or any(heavy[r] and r not in inside
                            and any(a is eqns[i].outvars[out] for a in eqns[r].invars)
                            for r in graph.succs[i])
                     for i in group.rows[row])
        after = after + Cost(bytes=2.0 * count * nbytes, kernels=float(sliced))
        stacked += count * nbytes
    return before, after, stacked


def _loses(before: Cost, after: Cost, beside: float, costs: CostModel,
           ends: Sequence[LaunchPrices]) -> bool:
    """Whether batching (``after``) is no cheaper than the members as they are
    (``before``) at some end of the GPU model's ranges (``ends``: their prices)."""
    return any(_seconds(after, costs, p) >= _seconds(before, costs, p, beside) for p in ends)


def _seconds(cost: Cost, costs: CostModel, prices: LaunchPrices, beside: float = 0.0
             ) -> float:
    """``cost`` in seconds with its launches priced in the function's mode: ``beside`` of
    them run beside the rest (the other members'), the others in series, as
    ``LaunchPrices`` says; ``cost.seconds`` in a serial chain."""
    profile = costs.profile
    return (cost.flops / profile.peak_flops + cost.bytes / profile.bandwidth
            + (cost.kernels - beside) * prices.serial + beside * prices.beside)


def _emitter(eqns: Sequence[JaxprEqn], group: _Group) -> EmitFn:
    template = [eqns[row[0]] for row in group.rows]
    position_of = {eqn: k for k, eqn in enumerate(group.eqns)}
    row_of = {i: t for t, row in enumerate(group.rows) for i in row}
    wanted = set(group.outputs)

    def one(*slot_values: Any) -> list[Any]:
        results: list[list[Any]] = []
        for eqn, sources in zip(template, group.wiring, strict=True):
            invals = [source[1] if source[0] == "lit" else slot_values[source[1]]
                      if source[0] == "slot" else results[source[1]][source[2]]  # type: ignore[misc]
                      for source in sources]
            results.append(_compat.bind_eqn(eqn, invals))
        return [results[row][out] for row, out in group.outputs]

    def emit(invals: list[list[Any]]) -> list[list[Any]]:
        columns = [[invals[position_of[i]][position] for i in group.rows[row]]
                   for row, position in group.slots]
        per_member = vmap_members(one, columns, group.members, template[-1])
        value = {}
        for k, (row, out) in enumerate(group.outputs):
            for m, i in enumerate(group.rows[row]):
                value[(i, out)] = per_member[m][k]
        # Results nobody outside the group reads are not computed separately: None.
        return [[value[(i, out)] if (row_of[i], out) in wanted else None
                 for out in range(len(eqns[i].outvars))] for i in group.eqns]

    return emit
