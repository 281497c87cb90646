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
  the fewest operand columns need a stack of their own (``orient``): ``x @ W`` beside
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
  kernel (``choose``). A group that reads another group's
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

The pass is this module (the driver and its decisions) and five private ones, one
subject each: ``_matmul_forms`` (how an op reads in a group's form), ``_matmul_groups``
(grouping), ``_matmul_orientation``, ``_matmul_pricing`` and ``_matmul_emission``.

Sharp edges:
  * Equations with effects, user placement (``on_stream``, XLA metadata) or
    collectives are never batched; nor are matmuls with an ``out_sharding``
    swapped.
  * Results agree with the unbatched program to float rounding: XLA may pick a
    different algorithm for a batched matmul.
  * Stacks of a scan body's inputs are built inside the body, every trip; XLA
    fuses them with the slicing of ``xs``.
  * Members are oriented (``orient``) only where a level has at most 32 square matrix
    products that read the same either way; beyond that they run as written.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import _compat, _ops
from .._analysis import Analysis
from .._compat import JaxprEqn
from .._model.cost import ENDS, CostModel
from .._model.gpu import CommandBufferMode
from .._program.graph import Graph
from .._program.primitives import BATCHED_MATMULS, TRANSPOSE, is_collective
from .._program.structure import StructuralKeys
from ._batch_members import MAX_BATCH_MEMBERS, stacked_width
from ._level_graph import launch_depths
from ._matmul_emission import emitter, needed_members, rewrite_key, rewrite_units
from ._matmul_forms import Column, is_shared
from ._matmul_groups import Carried, Group, form_groups, launches_unbatched
from ._matmul_orientation import orient
from ._matmul_pricing import Price, chained_columns, choose
from ._protocol import DecisionKind, Level, LevelResult, PassDecision, Rewrite, decision

# The heavy ops this pass batches: one kernel each, whose batched form is one kernel.
BATCHED_PRIMITIVES = BATCHED_MATMULS


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
            and not _ops.has_frontend_attributes(eqn))


def _batch_level(level: Level, costs: CostModel, mode: CommandBufferMode | None,
                 carried: Carried | None = None,
                 structure: StructuralKeys | None = None, allowance: float | None = None
                 ) -> tuple[list[Rewrite], list[PassDecision]]:
    inner, _ = _compat.open_jaxpr(level.jaxpr)
    eqns, path = inner.eqns, level.path
    graph = level.graph
    carried = Carried() if carried is None else carried
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
    accepted, rejected, priced = choose(eqns, graph, groups, launches, costs, level_outputs,
                                         prices, allowance, loop_inputs,
                                         program_outputs=not path)
    decisions = [_left_alone(path, eqns, g, launches[g], priced[g]) for g in rejected]
    if not accepted:
        return [], decisions
    units = rewrite_units(eqns, graph, accepted)
    structure = StructuralKeys() if structure is None else structure
    rewrites = []
    for unit in units:
        order = tuple(sorted(i for g in unit for i in g.members))
        needed = needed_members(eqns, order, graph, level_outputs)
        rewrites.append(Rewrite(order, emitter(eqns, unit, order, needed),
                                rewrite_key(eqns, unit, order, needed, structure)))
    chained = chained_columns(eqns, accepted)
    taken = [_batched(path, eqns, g, launches[g], chained, priced[g])
             for unit in units for g in unit]
    return rewrites, taken + decisions


# --------------------------------------------------------------------------- grouping


def _groups(eqns: Sequence[JaxprEqn], graph: Graph, costs: CostModel, carried: Carried
            ) -> tuple[list[Group], dict[Group, int]]:
    """The level's groups worth a look (in depth order, oriented) and the kernels each
    launches unbatched: a function of the level alone (the CUDA-graph mode only prices
    them), so ``Carried.groups`` keeps it for the other modes."""
    # The primitive first: most equations are not heavy ops, and a call each costs more.
    candidates = [i for i, e in enumerate(eqns)
                  if e.primitive.name in BATCHED_PRIMITIVES and _batchable(e)]
    if len(candidates) < 2:
        return [], {}
    candidates = [i for i in candidates if i in graph.live]
    # A transpose XLA folds into the matmul reading it (or fuses): it adds no launch depth.
    depth = launch_depths(graph, [costs.launches(e) and e.primitive.name != TRANSPOSE
                            for e in eqns])
    groups = [g for g in form_groups(eqns, candidates, depth, carried)  # not batches of batches
              if len(g.members) * stacked_width(eqns, graph, g.members) <= MAX_BATCH_MEMBERS]
    if not groups:
        return [], {}
    groups.sort(key=lambda g: (g.depth, g.members))
    groups = orient(eqns, groups)
    launches = {g: launches_unbatched(eqns, g) for g in groups}
    groups = [g for g in groups if launches[g] > 1]  # else XLA's DotMerger does it already
    return groups, launches


# --------------------------------------------------------------------------- reports


def _describe(eqns: Sequence[JaxprEqn], group: Group) -> str:
    eqn = eqns[group.members[0]]
    shapes = " x ".join(str(v.aval.str_short()) for v in eqn.invars)
    return f"{len(group.members)} independent {eqn.primitive.name}s of {shapes} at launch " \
           f"depth {group.depth} ({group.depth - 1} kernel-launching ops before each, no path " \
           "between them)"


def _price_text(price: Price) -> str:
    return (f"cost model: saves {price.saved * 1e6:.3g} us of launches, stacking, slicing "
            f"and transposing cost {price.cost * 1e6:.3g} us, worth {price.worth * 1e6:+.3g} us "
            "per run of this level")


def _batched(path: str, eqns: Sequence[JaxprEqn], group: Group, launches: int,
             chained: set[Column], price: Price) -> PassDecision:
    columns = group.columns(eqns)
    shared = sum(1 for c in columns if is_shared(c) and not _compat.is_literal(c[0]))
    reused = sum(1 for c in columns if not is_shared(c) and c in chained)
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


def _left_alone(path: str, eqns: Sequence[JaxprEqn], group: Group, launches: int, price: Price
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
State = Carried
