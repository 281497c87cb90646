"""Batch independent scans that run the same computation into one ``vmap``ped scan.

Two scans of one level with no path between them in the dependency graph,
whose bodies compute the same thing (compared structurally, parameters and
constants by value: ``_program.structure``), with the same length, direction, unroll
factor and operand types, and whose body ``vmap`` batches faithfully and cheaply
given the operands they share (``_batchable``), become one ``lax.scan`` whose body runs
the members' body under ``jax.vmap``: carries and consts are stacked once along a new
leading axis (an operand that is the same variable in every member is shared, not
stacked), and each member's scanned inputs are scanned as they are, each trip stacking
its slices, so no stacked copy of inputs the user passed apart (or broadcast) is ever
made. Each body's ``k`` kernels per trip become ``k`` bigger kernels, and the two loops
one loop: what a hand-written ``jax.vmap`` over the scan does. A group whose stacked copies
(consts, carries, results) would need more than the memory budget allows
(``Analysis.memory_allowance``) is left alone.

Example::

    def f(a, b, xs1, xs2):
        step = lambda c, x: (c @ x, None)
        return lax.scan(step, a, xs1)[0], lax.scan(step, b, xs2)[0]

    new_jaxpr, decisions = batch_scans(jax.make_jaxpr(f)(*args))
    # one scan whose body holds a dot_general with batch dimensions

Sharp edges:
  * Two bodies that differ only in the order of equations are not recognised.
  * Bodies holding primitives off ``_batchable``'s allow-list (``rbg`` random bits,
    host callbacks, a ``custom_vjp``, a ``cond`` or ``while`` whose predicate
    reads a stacked operand) are not batched, and nor are scans on the very same
    operands whose body holds what must not be merged (``_batchable.merge_refusal``);
    equal scans refused so are reported as left alone, and ``fuse_scans`` may fuse
    them.
  * Stacking copies the consts and carries once per call, and each trip's slices of the
    scanned inputs: for large slices and few trips that copying can cost more than the
    loop overhead it saves.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp

from .. import _compat
from .._analysis import Analysis
from .._compat import JaxprEqn
from .._model.memory import stacking_refusal
from .._program.structure import StructuralKeys
from ._batch_members import batch_refusal, body_key, shared_column, stack_columns
from ._batchable import static_refusal
from ._level_graph import group_independent
from ._loop_candidates import loop_candidates, loop_trips
from ._protocol import DecisionKind, Level, LevelResult, PassDecision, Rewrite, decision
from ._splice import evaluate


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: one batched scan per group of independent identical scans."""
    eqns, path = level.eqns, level.path
    candidates = loop_candidates(eqns)
    if len(candidates) < 2:
        return LevelResult()
    structure = analysis.structural_keys
    keys = {i: body_key(eqns[i], structure) for i in candidates}
    refusals = _refusals(eqns, [i for i in candidates if keys[i] is None], structure)
    candidates = [i for i in candidates if keys[i] is not None]

    def compatible(group: list[int], index: int) -> bool:
        if keys[group[0]] != keys[index]:
            return False
        why = batch_refusal(eqns, [*group, index])
        if why is not None:
            refusals.setdefault(keys[index], (why, set()))[1].update((*group, index))
        return why is None

    groups = [g for g in group_independent(level.graph, candidates, compatible)
              if len(g) > 1]
    rewrites: list[Rewrite] = []
    decisions: list[PassDecision] = []
    batched = {i for g in groups for i in g}
    for why, refused in refusals.values():
        left = sorted(refused - batched)
        if len(left) > 1:
            decisions.append(decision(
                path, DecisionKind.LEFT_ALONE, eqns, left, trips_before=None, trips_after=None,
                unroll=None, reason=f"{len(left)} scans run the same body, but vmap would "
                                    f"not batch them faithfully and cheaply: {why}"))
    for group in groups:
        infos = [_compat.scan_info(eqns[i]) for i in group]
        too_big = stacking_refusal(_stacked_bytes([eqns[i] for i in group], infos[0]),
                                   analysis.allowance_for("batch_scans"))
        if too_big is not None:
            decisions.append(decision(
                path, DecisionKind.LEFT_ALONE, eqns, group, trips_before=None,
                trips_after=None, unroll=None,
                reason=f"{len(group)} scans run the same body, but batching them: "
                       f"{too_big}"))
            continue
        rewrites.append(Rewrite(tuple(group), _batched_emitter([eqns[i] for i in group])))
        decisions.append(decision(
            path, DecisionKind.BATCHED, eqns, group,
            trips_before=sum(loop_trips(info.length, info.unroll) for info in infos),
            trips_after=loop_trips(infos[0].length, infos[0].unroll), unroll=infos[0].unroll,
            reason=f"{len(group)} independent scans run the same body: one vmapped scan with "
                   "stacked operands, so each trip launches the same kernels, batched"))
    return LevelResult(rewrites, decisions)


def _stacked_bytes(members: list[JaxprEqn], info: Any) -> float:
    """Bytes of what the batched scan stacks (``_batched_emitter``): the consts the
    members do not share and the carries, once; each trip's slices of the scanned inputs
    (small); and the scan's stacked results, before each member's is sliced out."""
    count = len(members)
    carried = info.num_consts + info.num_carry
    total = 0.0
    for position, atom in enumerate(members[0].invars[:carried]):
        column = [m.invars[position] for m in members]
        if position >= info.num_consts or not shared_column(column):
            total += count * _compat.aval_nbytes(atom.aval)
    total += count * sum(_compat.aval_nbytes(v.aval) for v in members[0].outvars)
    return total


def _refusals(eqns: list[JaxprEqn], refused: list[int], structure: StructuralKeys
              ) -> dict[Hashable, tuple[str, set[int]]]:
    """Scans whose bodies ``vmap`` never batches faithfully, by body (equal scans
    together): the reason and the scans."""
    found: dict[Hashable, tuple[str, set[int]]] = {}
    for i in refused:
        key = (structure.equation(eqns[i]), tuple(v.aval for v in eqns[i].invars))
        why = found[key][0] if key in found else static_refusal(eqns[i]) or ""
        found.setdefault(key, (why, set()))[1].add(i)
    return found


def _batched_emitter(members: list[Any]) -> Any:
    info = _compat.scan_info(members[0])
    count = len(members)
    carried = info.num_consts + info.num_carry

    def emit(invals: list[list[Any]]) -> list[list[Any]]:
        columns = [[vals[position] for vals in invals] for position in range(len(invals[0]))]
        consts, carry, xs = columns[:info.num_consts], columns[info.num_consts:carried], \
            columns[carried:]
        # Consts are stacked once (or passed once, where every member reads the same);
        # carries are stacked (they part ways after a trip). The scanned inputs are not
        # stacked: each member's are scanned as they are, and the trip stacks its slices
        # (no stacked copy of what the user passed apart, or broadcast).
        const_values, const_axes = stack_columns(consts)
        init = [jnp.stack([jnp.asarray(v) for v in column]) for column in carry]
        scanned = [column[:1] if shared_column(column) else column for column in xs]
        flat_xs = [v for column in scanned for v in column]

        def step(state: list[Any], slices: list[Any]) -> tuple[list[Any], list[Any]]:
            trip, start = [], 0
            for column in scanned:
                part = slices[start:start + len(column)]
                start += len(column)
                trip.append(part[0] if len(part) == 1 else jnp.stack(part))
            outs = jax.vmap(
                lambda *flat: evaluate(info.jaxpr, *flat),
                in_axes=(*const_axes, *[0] * len(state),
                         *[None if len(column) == 1 else 0 for column in scanned]),
            )(*const_values, *state, *trip)
            return list(outs[:info.num_carry]), list(outs[info.num_carry:])

        with _compat.eqn_context(members[0]):
            final, ys = jax.lax.scan(step, init, flat_xs, length=info.length,
                                     reverse=info.reverse, unroll=info.unroll)
            return [[*(c[m] for c in final), *(y[:, m] for y in ys)] for m in range(count)]

    return emit
