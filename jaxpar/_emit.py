"""Emission: evaluate a planned jaxpr, one stream call per region.

The rewritten program is produced by *evaluating* the original jaxpr with an
interpreter (like ``jax.core.eval_jaxpr``) under whatever trace is current:
plain equations are re-bound as they were, each region becomes one
``_ops.stream_region_p`` equation, lowered as an ``xla_metadata_call``
carrying ``_xla_stream_annotation``, ``inlineable="false"`` and
``_scheduling_group_id``, and equations with planned nested jaxprs are
re-bound with those jaxprs re-traced through the same interpreter. Because it
is an interpreter, the result composes with ``jit``, ``grad`` and ``vmap`` the
way any JAX code does.

Example::

    emitter = Emitter(level_plan, emit_streams=True)
    outputs = emitter.run(consts, *args)

Sharp edges:
  * Regions are never nested: nested jaxprs inside a region are bound as they
    were, and the planner never plans inside a region.
  * Scheduling-group ids are drawn per emitted section, process-wide, never
    taken from the plan: XLA rejects a group whose members are connected
    through work outside it ("annotation groups with gaps"), which two
    emissions of one plan in one program would otherwise be.
  * Each region is one equation of jaxpar's own ``_ops.stream_region_p``,
    lowered as the ``xla_metadata_call`` above; its JVP emits a forward region
    and a linear region with scheduling groups of their own, its transpose a
    region again (``_ops.stream_region``'s rules).
  * A scan with ``unroll > 1`` whose body has regions is unrolled here, one
    evaluation (and so one set of groups) per copy (see ``unrolled_scan``).
  * The program's constants a region reads (up to ``CLOSED_OVER_BYTES``) stay in its
    body, as ``jax.jit`` keeps them in its program: passed into the non-inlined call,
    they made XLA shard some of its results otherwise than ``jax.jit`` does.

A collectives group is ONE non-inlined call XLA launches as a group
(``emit_collective_group``): it carries ``{_collectives_group="", inlineable="false"}``
(``COLLECTIVES_GROUP_ATTRIBUTES``), which XLA's ``ExplicitCollectivesGroupAsyncWrapper``
needs (jax >= 0.6). It is a ``stream_region_p`` equation too (a ``CollectivesGroup``), so
its derivatives are groups with the same attributes.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat, _ops
from ._compat import JaxprEqn
from ._memo import IdentityMemo
from ._plan import LevelPlan
from ._plan.collectives import COLLECTIVES_GROUP_ATTRIBUTES
from ._program.graph import CollectivesUnit, EqnUnit, RegionUnit
from ._program.interp import Env
from ._program.primitives import SCAN

STREAM_ATTRIBUTE = "_xla_stream_annotation"
GROUP_ATTRIBUTE = "_scheduling_group_id"


def stream_attributes(stream: int, group: int | None) -> dict[str, str]:
    """The frontend attributes that put one call on CUDA stream ``stream``."""
    attrs = {STREAM_ATTRIBUTE: str(stream), "inlineable": "false"}
    if group is not None:
        attrs[GROUP_ATTRIBUTE] = str(group)
    return attrs


_GROUP_IDS = itertools.count(1)
_GROUP_LOCK = threading.Lock()


class GroupIds:
    """The scheduling group of one emitted section, and the groups derived from it.

    Every emission draws a fresh id, so two emissions of one plan in one program
    (a function called twice, each copy of an unrolled body) never share a group.
    Differentiating a section's regions derives one new group per role
    (``"forward"``, ``"linear"``) shared by all the section's regions, so the
    derived regions still overlap each other but never share a group with the
    regions they were derived from (the backward pass runs after the loss, which
    would connect the two through main-stream work). A ``fixed`` group (the user's
    own, from ``on_stream``) is its own derived group: JAX's ``xla_metadata_call``
    gives the derived calls the user's attributes too.
    """

    def __init__(self, derive: bool = True, fixed: int | None = None) -> None:
        if fixed is None:
            with _GROUP_LOCK:
                self.id = next(_GROUP_IDS)
        else:
            self.id = fixed
        self._fixed = fixed is not None
        self._derive = derive
        self._derived: dict[str, GroupIds] = {}

    def __repr__(self) -> str:  # shown in the ``region`` parameter of printed jaxprs
        return f"GroupIds(id={self.id})"

    def derived(self, role: str) -> GroupIds | None:
        """The group of the regions derived in ``role``; None: they get no group."""
        if self._fixed:
            return self
        if not self._derive:
            return None
        with _GROUP_LOCK:
            hit = self._derived.get(role)
        if hit is None:
            fresh = GroupIds()
            with _GROUP_LOCK:
                hit = self._derived.setdefault(role, fresh)
        return hit


@dataclasses.dataclass(frozen=True)
class Region:
    """What a stream region's equation carries (``_ops.stream_region_p``'s ``region``).

    Compares by value: the stream and the group object (by identity).
    """

    stream: int
    group: GroupIds | None
    # Several same-dtype results travel as one array where XLA would not overlap a call
    # returning a tuple (``_compat.PACK_MULTI_RESULT_CALLS``).
    packs_results: ClassVar[bool] = True

    @property
    def attributes(self) -> tuple[tuple[str, str], ...]:
        group = self.group.id if self.group is not None else None
        return tuple(stream_attributes(self.stream, group).items())

    def derived(self, role: str) -> Region:
        """The region a derivative computation of this one runs as (see ``GroupIds``)."""
        return Region(self.stream, self.group.derived(role) if self.group is not None else None)


@dataclasses.dataclass(frozen=True)
class CollectivesGroup:
    """What a collectives group's equation carries (``_ops.stream_region_p``'s
    ``region``): the call's frontend attributes (``COLLECTIVES_GROUP_ATTRIBUTES``).

    The derivatives of a group of collectives are collectives again (a ``ppermute``'s
    tangent is a ``ppermute``, its transpose the inverse one), launched as a group too.
    """

    attributes: tuple[tuple[str, str], ...]
    # The group's call holds the collectives alone: XLA groups a call's collectives
    # only when nothing else (a concatenation of the results) is in it.
    packs_results: ClassVar[bool] = False

    def derived(self, role: str) -> CollectivesGroup:
        del role
        return self


def region_call(body: Callable[..., Sequence[Any]], stream: int,
                group: GroupIds | None) -> Callable[..., tuple[Any, ...]]:
    """``body`` as one stream region: a ``_ops.stream_region_p`` equation.

    It lowers to one non-inlined call with the stream's attributes, and every JAX
    transformation has a rule for it (``_compat``). Its derivatives are regions
    again, on the same stream (the JVP and transpose rules of ``_ops.stream_region``).
    """
    region = Region(stream, group)
    return lambda *args: tuple(_ops.bind_stream_region(body, args, region))


class Emitter:
    """Evaluates a ``LevelPlan`` tree; caches per-level derived data."""

    def __init__(self, plan: LevelPlan, emit_streams: bool):
        self.plan = plan
        self.emit_streams = emit_streams
        # By level object, with the section and region: (in vars, out vars).
        self._region_io: IdentityMemo[LevelPlan, tuple[list[Any], list[Any]]] = IdentityMemo()
        # Inside the copies of a scan unrolled by ``unrolled_scan`` (see ``_copy_runner``).
        self._unrolling = 0
        self._readers: IdentityMemo[LevelPlan, dict[Any, list[int]]] = IdentityMemo()

    def run(self, consts: Sequence[Any], *args: Any, emit_streams: bool = True) -> list[Any]:
        if not (self.emit_streams and emit_streams):
            return _compat.stage_jaxpr(self.plan.jaxpr, *args)
        return self._evaluate(self.plan, consts, args)

    def _evaluate(self, level: LevelPlan, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        inner, _ = _compat.open_jaxpr(level.jaxpr)
        env = Env()
        read, write = env.read, env.write
        write(inner.constvars, consts)
        constvars = frozenset(inner.constvars)
        env.write_inputs(inner.invars, args)
        nested = {index: subs for index, subs in level.nested
                  if any(sub.changes_anything for _, sub in subs)}
        eqns = inner.eqns
        groups: dict[int, GroupIds | None] = {}  # fresh per evaluation (see GroupIds)
        stage = _compat.EqnStager()
        for unit in level.order:
            if isinstance(unit, EqnUnit):
                index = unit.index
                eqn = eqns[index]
                invals = [read(v) for v in eqn.invars]
                if index in nested and _compat.is_shard_map(eqn):
                    # Collectives in the body need the mesh axes bound: re-emit
                    # through shard_map itself rather than re-tracing the body alone.
                    ((_, body_plan),) = nested[index]
                    _, body_consts = _compat.open_jaxpr(body_plan.jaxpr)
                    outs = _compat.rebind_shard_map(
                        eqn, self._sub_runner(body_plan, body_consts), invals)
                elif index in nested and (unrolled := _unrolled_body(eqn, nested[index])):
                    _, body_consts = _compat.open_jaxpr(unrolled.jaxpr)
                    outs = unrolled_scan(_compat.scan_info(eqn),
                                         self._copy_runner(unrolled, body_consts), invals)
                else:
                    params = (self._nested_params(level, index, nested[index])
                              if index in nested else None)
                    outs = (stage(eqn, invals) if params is None
                            else _compat.bind_eqn(eqn, invals, params))
                write(eqn.outvars, outs)
                continue
            if isinstance(unit, CollectivesUnit):
                members = [eqns[i] for i in level.collective_groups[unit.group].eqns]
                results = emit_collective_group(
                    members, [[read(v) for v in eqn.invars] for eqn in members])
                for eqn, outs in zip(members, results, strict=True):
                    write(eqn.outvars, outs)
                continue
            assert isinstance(unit, RegionUnit)
            s, r = unit.section, unit.region
            section = level.sections[s]
            region = section.regions[r]
            in_vars, out_vars = self._io(level, s, r)
            if s not in groups:
                groups[s] = (GroupIds(derive=not self._unrolling)
                             if section.group is not None else None)
            # The program's constants a region reads stay in its body (see
            # ``_ops.bind_stream_region``); the other inputs are its operands.
            constants = {v: value for v, value in zip(in_vars, env.read_all(in_vars), strict=True)
                         if v in constvars and _closed_over(value)}
            operands = [v for v in in_vars if v not in constants]
            body = _region_body([eqns[i] for i in region.eqns], operands, out_vars, constants)
            call = region_call(body, region.stream, groups[s])
            write(out_vars, list(call(*env.read_all(operands))))
        return [read(v) for v in inner.outvars]

    def _io(self, level: LevelPlan, s: int, r: int) -> tuple[list[Any], list[Any]]:
        hit = self._region_io.get(level, extra=(s, r))
        if hit is None:
            readers = self._readers.get(level)
            if readers is None:
                readers = _readers(level)
                self._readers.set(level, readers)
            hit = region_io(level, level.sections[s].regions[r].eqns, readers)
            self._region_io.set(level, hit, extra=(s, r))
        return hit

    def _nested_params(self, level: LevelPlan, index: int,
                       subs: tuple[tuple[tuple[str, int | None], LevelPlan], ...]
                       ) -> dict[str, Any] | None:
        # Re-traced on every evaluation, never cached: each trace draws fresh
        # scheduling groups (a nested jaxpr XLA inlines, such as a ``jit``, would
        # otherwise repeat its groups in every copy of the program that calls it).
        inner, _ = _compat.open_jaxpr(level.jaxpr)
        eqn = inner.eqns[index]
        replacements = {}
        for slot, sub in subs:
            if not sub.changes_anything:
                continue
            _, sub_consts = _compat.open_jaxpr(sub.jaxpr)
            new = _compat.retrace_like(self._sub_runner(sub, sub_consts), sub.jaxpr)
            if new is not None:
                replacements[slot] = new
        return _compat.eqn_replace_subjaxprs(eqn, replacements) if replacements else None

    def _copy_runner(self, sub: LevelPlan, consts: list[Any]) -> Callable[..., list[Any]]:
        """Evaluates one unrolled copy of a scan body.

        The regions derived from a copy's regions by differentiation get no
        scheduling group: in the backward pass of unrolled copies XLA fuses the
        cotangent sums of neighbouring copies into multi-output fusions, which
        connect one copy's backward regions to each other through main-stream work
        (the gap error, seen deviceless for a fully unrolled two-chain body on
        jaxlib 0.10.2). Ungrouped, they keep their streams and the latency-hiding
        scheduler may still overlap them with other work.
        """
        def run(*args: Any) -> list[Any]:
            self._unrolling += 1
            try:
                return self._evaluate(sub, consts, args)
            finally:
                self._unrolling -= 1
        return run

    def _sub_runner(self, sub: LevelPlan, consts: list[Any]) -> Callable[..., list[Any]]:
        def run(*args: Any) -> list[Any]:
            return self._evaluate(sub, consts, args)
        return run


def _unrolled_body(eqn: JaxprEqn, subs: tuple[tuple[tuple[str, int | None], LevelPlan], ...]
                   ) -> LevelPlan | None:
    """The body plan of a scan that XLA would see unrolled with regions inside, else None.

    ``lax.scan(unroll=k)`` lowers its body ``k`` times from one jaxpr, so every copy
    would carry the same scheduling groups, and the carry between copies connects
    them through main-stream work: XLA:GPU rejects that ("annotation groups with
    gaps"). Such a scan is unrolled by ``unrolled_scan`` instead.
    """
    if eqn.primitive.name != SCAN or len(subs) != 1:
        return None
    (_, body), = subs
    info = _compat.scan_info(eqn)
    if min(info.unroll, info.length) < 2 or not any(lv.sections for lv in body.walk()):
        return None
    return body


def unrolled_scan(info: _compat.ScanInfo, body: Callable[..., Sequence[Any]],
                  operands: Sequence[Any]) -> list[Any]:
    """``scan`` with ``info``'s parameters, unrolled by calling ``body`` once per copy.

    Computes what the scan computes (same trips, same order, ``reverse`` included);
    the loop left over runs ``length // unroll`` trips of ``unroll`` copies, and the
    ``length % unroll`` remaining steps run after it (before it, reversed) without a
    loop, as ``lax.scan`` itself does. ``body`` takes consts, carry and one step's
    xs, and returns carry then one step's ys.
    """
    nc, nk = info.num_consts, info.num_carry
    consts, carry, xs = list(operands[:nc]), list(operands[nc:nc + nk]), list(operands[nc + nk:])
    length, k = info.length, min(info.unroll, info.length)
    trips, rem = divmod(length, k)

    def block(carry: list[Any], xs_block: Sequence[Any], count: int
              ) -> tuple[list[Any], list[Any]]:
        steps: list[Sequence[Any]] = [()] * count
        for j in (range(count - 1, -1, -1) if info.reverse else range(count)):
            outs = list(body(*consts, *carry, *[x[j] for x in xs_block]))
            carry, steps[j] = outs[:nk], outs[nk:]
        return carry, [jnp.stack(column) for column in zip(*steps, strict=True)]

    main = (rem, length) if info.reverse else (0, trips * k)
    tail = (0, rem) if info.reverse else (trips * k, length)
    main_xs = [x[main[0]:main[1]] for x in xs]
    if trips >= 2:
        def step(c: list[Any], xb: list[Any]) -> tuple[list[Any], list[Any]]:
            return block(c, xb, k)

        carry, ys_main = lax.scan(step, carry, [x.reshape(trips, k, *x.shape[1:])
                                                for x in main_xs],
                                  length=trips, reverse=info.reverse)
        ys_main = [y.reshape(trips * k, *y.shape[2:]) for y in ys_main]
    else:
        carry, ys_main = block(carry, main_xs, trips * k)
    if not rem:
        return [*carry, *ys_main]
    carry, ys_tail = block(carry, [x[tail[0]:tail[1]] for x in xs], rem)
    pieces = zip(ys_tail, ys_main, strict=True) if info.reverse else zip(
        ys_main, ys_tail, strict=True)
    return [*carry, *(jnp.concatenate(pair) for pair in pieces)]


_OUTPUT = -1  # stands for "read by the jaxpr's outputs" in ``_readers``


def _readers(level: LevelPlan) -> dict[Any, list[int]]:
    """For each variable of the level, the equations reading it (``_OUTPUT``: the outputs)."""
    inner, _ = _compat.open_jaxpr(level.jaxpr)
    readers: dict[Any, list[int]] = {}
    for i, eqn in enumerate(inner.eqns):
        for v in eqn.invars:
            if not _compat.is_literal(v):
                readers.setdefault(v, []).append(i)
    for v in inner.outvars:
        if not _compat.is_literal(v):
            readers.setdefault(v, []).append(_OUTPUT)
    return readers


def region_io(level: LevelPlan, region_eqns: Sequence[int],
              readers: dict[Any, list[int]]) -> tuple[list[Any], list[Any]]:
    """Variables a region reads from outside, and those it must return."""
    inner, _ = _compat.open_jaxpr(level.jaxpr)
    eqns = inner.eqns
    members = set(region_eqns)
    defined: set[Any] = set()
    inputs: dict[Any, None] = {}
    for i in region_eqns:
        for v in eqns[i].invars:
            if not _compat.is_literal(v) and v not in defined:
                inputs.setdefault(v, None)
        defined.update(v for v in eqns[i].outvars if not _compat.is_drop_var(v))
    outputs = [v for i in region_eqns for v in eqns[i].outvars
               if not _compat.is_drop_var(v)
               and any(r not in members for r in readers.get(v, ()))]
    return list(inputs), outputs


# The program's constants up to this size that a region reads stay in its body; larger
# ones stay operands, so that the program does not hold a large constant twice.
CLOSED_OVER_BYTES = 1 << 20


def _closed_over(value: Any) -> bool:
    """Whether a region keeps ``value`` (a program constant) in its body."""
    return (not _compat.is_tracer(value) and isinstance(value, (jax.Array, np.ndarray))
            and _compat.aval_nbytes(jax.typeof(value)) <= CLOSED_OVER_BYTES)


def _region_body(eqns: list[JaxprEqn], in_vars: list[Any], out_vars: list[Any],
                 constants: Mapping[Any, Any] | None = None) -> Callable[..., Any]:
    def body(*values: Any) -> tuple[Any, ...]:
        env = Env()
        if constants:
            env.write(list(constants), list(constants.values()))
        env.write(in_vars, values)
        env.bind(eqns)
        return tuple(env.read_all(out_vars))
    return body


def emit_collective_group(eqns: Sequence[JaxprEqn], invals: Sequence[Sequence[Any]],
                          attributes: Mapping[str, str] = COLLECTIVES_GROUP_ATTRIBUTES
                          ) -> list[list[Any]]:
    """Emits ``eqns`` (collectives) as ONE non-inlined call launched as a group.

    Each equation is re-bound with its source info and context inside one
    ``_ops.stream_region_p`` equation (a ``CollectivesGroup``) that lowers to a call
    carrying ``{_collectives_group="", inlineable="false"}``. Works under any trace
    (jit, grad, vmap, inside a ``shard_map`` body or a scan body); its derivatives are
    groups again.

    Args:
      eqns: the group's equations, e.g. ``[jaxpr.eqns[i] for i in group.eqns]``.
      invals: for each equation, the values of its invars.
      attributes: the call's frontend attributes.

    Returns:
      For each equation, the values of its outvars.

    Raises:
      ValueError: ``eqns`` and ``invals`` differ in length.
    """
    if len(eqns) != len(invals):
        raise ValueError(f"emit_collective_group: {len(eqns)} equations but "
                         f"{len(invals)} input lists")
    counts = [len(v) for v in invals]
    out_counts = [len(e.outvars) for e in eqns]

    def body(*flat: Any) -> tuple[Any, ...]:
        outs: list[Any] = []
        start = 0
        for eqn, count in zip(eqns, counts, strict=True):
            outs.extend(_compat.bind_eqn(eqn, flat[start:start + count]))
            start += count
        return tuple(outs)

    # One equation of jaxpar's region primitive, not a bare ``xla_metadata_call``: JAX
    # differentiates that by its body whole, one call taking primals and tangents
    # together, whose primal results reverse mode's partial evaluation then cannot
    # know (jax.grad of a decorated shard_map body raised "Linearization failed to
    # produce known values"). A region's JVP is a forward and a linear group.
    region = CollectivesGroup(tuple(attributes.items()))
    flat_out = _ops.bind_stream_region(body, [v for vals in invals for v in vals], region)
    result, start = [], 0
    for count in out_counts:
        result.append(flat_out[start:start + count])
        start += count
    return result
