"""Group mutually independent collectives so they are launched together.

XLA:GPU runs asynchronous collectives on one communication stream with at most
one in flight, so the forward and backward ``ppermute`` of a bidirectional ring
step serialize (openxla/xla#10640). Putting both in one non-inlined call with
the frontend attributes ``{_collectives_group="", inlineable="false"}`` makes
XLA (``ExplicitCollectivesGroupAsyncWrapper``, jax >= 0.6) launch them as one
asynchronous NCCL group, so both directions are in flight together.

This module is the analysis (``group_collectives``: which equations of one open
jaxpr level form groups), a deterministic emission order that contracts each
group to one unit (``order_with_groups``), and the emission of one group
(``emit_collective_group``).

Example::

    inner, _ = _compat.open_jaxpr(shard_map_eqn.params["jaxpr"])
    plan = group_collectives(inner, axis_sizes={"x": 8})
    plan.groups[0]     # CollectiveGroup(eqns=(0, 1), shifts=(1, -1), axis_name=('x',))

Sharp edges:
  * Groups are *layers*: a candidate's layer is one more than the deepest
    candidate it depends on, and a group holds the candidates of one layer and
    one axis. Two members of a layer never depend on each other, and every path
    between two groups goes from a lower layer to a higher one, so contracting
    all groups keeps the program acyclic. The price: a collective whose inputs
    are ready early waits for its layer-mates' inputs.
  * Only ``ppermute`` is grouped by default; other collectives are reported in
    ``CollectivePlan.collectives`` and grouped only when listed in
    ``groupable``.
  * The plan depends only on the jaxpr (equation order, parameters), never on
    dict/set iteration order or the process, so every rank of an SPMD job
    agrees; a disagreement would deadlock NCCL.
"""

from __future__ import annotations

import dataclasses
import heapq
import types
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from .. import _compat
from .._graph import Graph, build_graph

__all__ = [
    "COLLECTIVES_GROUP_ATTRIBUTES",
    "CollectiveGroup",
    "CollectiveInfo",
    "CollectivePlan",
    "emit_collective_group",
    "collective_graph",
    "evaluate_with_groups",
    "group_collectives",
    "group_io",
    "order_with_groups",
    "permutation_shift",
]

#: Frontend attributes of the call XLA turns into one asynchronous NCCL group.
COLLECTIVES_GROUP_ATTRIBUTES: Mapping[str, str] = {"_collectives_group": "",
                                                   "inlineable": "false"}

#: Collectives reported at a level (names as in ``_plan.COLLECTIVE_PRIMITIVES``).
COLLECTIVE_PRIMITIVES = frozenset(
    {"ppermute", "psum", "pmax", "pmin", "all_gather", "all_to_all", "reduce_scatter",
     "psum_scatter", "psum_invariant", "all_gather_invariant", "pbroadcast", "ragged_all_to_all"}
)

DEFAULT_GROUPABLE = frozenset({"ppermute"})


@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveInfo:
    """One collective equation of the level, for reporting.

    ``shift`` is the uniform ring shift of a ``ppermute`` (``+1``, ``-1``, ``k``
    in ``(-size/2, size/2]``) or None for a general permutation or another
    collective. ``layer`` is its depth among the groupable collectives (None
    when not groupable). ``group`` is the index of its group, if any.
    """

    eqn: int
    primitive: str
    axis_name: tuple[Any, ...]
    shift: int | None
    layer: int | None
    group: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveGroup:
    """Mutually independent collectives (equation indices) launched as one group."""

    eqns: tuple[int, ...]
    shifts: tuple[int | None, ...]
    axis_name: tuple[Any, ...]

    @property
    def bidirectional(self) -> bool:
        """Whether the group sends both ways round a ring (a ``+k`` and a ``-k``)."""
        shifts = {s for s in self.shifts if s is not None}
        return any(-s in shifts for s in shifts if s > 0)


@dataclasses.dataclass(frozen=True, slots=True)
class CollectivePlan:
    """Groups and the report of every collective at one level."""

    groups: tuple[CollectiveGroup, ...]
    collectives: tuple[CollectiveInfo, ...]

    @property
    def grouped(self) -> frozenset[int]:
        return frozenset(i for g in self.groups for i in g.eqns)


def _axis_tuple(axis_name: Any) -> tuple[Any, ...]:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _eqn_axes(eqn: Any) -> tuple[Any, ...]:
    params = eqn.params
    for key in ("axis_name", "axes"):
        if key in params:
            return _axis_tuple(params[key])
    return ()


def permutation_shift(perm: Sequence[tuple[int, int]], size: int | None = None) -> int | None:
    """The ring shift of a ``ppermute`` permutation, or None if it is not one.

    Args:
      perm: ``(source, destination)`` pairs, as in the ``perm`` parameter.
      size: the axis size; default ``max index + 1``.

    Returns:
      ``k`` in ``(-size/2, size/2]`` when every source in ``range(size)`` sends
      to ``(source + k) % size``; ``+1`` is a forward ring, ``-1`` a backward one.
      None for any other (partial or general) permutation.

    Example:
      >>> permutation_shift([(0, 1), (1, 2), (2, 0)])
      1
    """
    pairs = [(int(s), int(d)) for s, d in perm]
    if not pairs:
        return None
    if size is None:
        size = 1 + max(max(s, d) for s, d in pairs)
    if len(pairs) != size or {s for s, _ in pairs} != set(range(size)):
        return None
    shifts = {(d - s) % size for s, d in pairs}
    if len(shifts) != 1:
        return None
    (shift,) = shifts
    return shift - size if shift > size / 2 else shift


def _axis_size(axes: tuple[Any, ...], axis_sizes: Mapping[Any, int] | None) -> int | None:
    if not axis_sizes or not all(a in axis_sizes for a in axes):
        return None
    size = 1
    for a in axes:
        size *= int(axis_sizes[a])
    return size


def _ordered_effects(eqn: Any) -> frozenset[Any]:
    # ``NamedAxisEffect`` only says "uses a mesh axis" (psum carries it, ppermute
    # does not); it orders nothing at run time, so it must not chain collectives.
    return frozenset(e for e in eqn.effects if type(e).__name__ != "NamedAxisEffect")


def collective_graph(jaxpr: Any) -> Graph:
    """``build_graph`` with named-axis effects ignored (they impose no order)."""
    view = types.SimpleNamespace(
        outvars=jaxpr.outvars,
        eqns=[types.SimpleNamespace(invars=e.invars, outvars=e.outvars,
                                    effects=_ordered_effects(e)) for e in jaxpr.eqns])
    return build_graph(view)


def group_collectives(jaxpr: Any, graph: Graph | None = None, *,
                      axis_sizes: Mapping[Any, int] | None = None,
                      groupable: Collection[str] = DEFAULT_GROUPABLE,
                      exclude: Collection[int] = (),
                      max_group_size: int | None = None) -> CollectivePlan:
    """Finds groups of mutually independent collectives at one open jaxpr level.

    Args:
      jaxpr: an open jaxpr (e.g. a ``shard_map`` body or a scan body).
      graph: its dependency graph; default ``collective_graph(jaxpr)``, which
        unlike ``_graph.build_graph`` does not chain ``psum``s through their
        ``NamedAxisEffect``.
      axis_sizes: mesh axis name -> size, to compute shifts (e.g.
        ``dict(_compat.shard_map_info(eqn).axis_sizes)``); without it a
        permutation's size is its largest index plus one.
      groupable: primitive names that may be grouped.
      exclude: equation indices that must stay where they are (e.g. inside a
        stream region, or user-annotated).
      max_group_size: split larger layers into chunks of this size (program
        order); None for no limit.

    Returns:
      A ``CollectivePlan``: the groups (two or more members each, in program
      order of their first member) and a report of every collective.

    Raises:
      ValueError: ``max_group_size`` below 2.
    """
    if max_group_size is not None and max_group_size < 2:
        raise ValueError(f"max_group_size must be None or >= 2, got {max_group_size}")
    if graph is None:
        graph = collective_graph(jaxpr)
    eqns = jaxpr.eqns
    excluded = frozenset(exclude)
    candidates = [i for i, eqn in enumerate(eqns)
                  if eqn.primitive.name in groupable and i in graph.live and i not in excluded
                  and not _ordered_effects(eqn) and not _compat.eqn_frontend_attributes(eqn)]
    is_candidate = set(candidates)
    # layer[i]: deepest chain of candidates ending at (and including) equation i.
    depth = [0] * graph.size
    for i in range(graph.size):
        below = max((depth[p] for p in graph.preds[i]), default=0)
        depth[i] = below + (1 if i in is_candidate else 0)
    layers: dict[tuple[int, tuple[Any, ...]], list[int]] = {}
    for i in candidates:  # program order, so each list is sorted
        layers.setdefault((depth[i], _eqn_axes(eqns[i])), []).append(i)
    members: list[list[int]] = []
    for key in sorted(layers, key=lambda k: layers[k][0]):
        layer = layers[key]
        step = max_group_size or len(layer)
        members.extend(chunk for start in range(0, len(layer), step)
                       if len(chunk := layer[start:start + step]) >= 2)
    members.sort(key=lambda m: m[0])
    group_of = {i: g for g, m in enumerate(members) for i in m}
    shifts: dict[int, int | None] = {}
    report = []
    for i, eqn in enumerate(eqns):
        name = eqn.primitive.name
        if name not in COLLECTIVE_PRIMITIVES and name not in groupable:
            continue
        axes = _eqn_axes(eqn)
        shift = (permutation_shift(eqn.params["perm"], _axis_size(axes, axis_sizes))
                 if name == "ppermute" and "perm" in eqn.params else None)
        shifts[i] = shift
        report.append(CollectiveInfo(i, name, axes, shift,
                                     depth[i] if i in is_candidate else None, group_of.get(i)))
    groups = tuple(CollectiveGroup(tuple(m), tuple(shifts.get(i) for i in m),
                                   _eqn_axes(eqns[m[0]])) for m in members)
    return CollectivePlan(groups, tuple(report))


def order_with_groups(graph: Graph, groups: Sequence[CollectiveGroup],
                      regions: Sequence[Sequence[int]] = ()
                      ) -> tuple[tuple[tuple[Any, ...], ...], tuple[int, ...]]:
    """A deterministic emission order with each group (and region) as one unit.

    Units are ``("eqn", i)``, ``("collectives", g)`` (index into ``groups``) and
    ``("region", r)`` (index into ``regions``, e.g. the planner's stream
    regions flattened). Kahn's algorithm, smallest first equation first. If
    contracting the groups together with the regions would create a cycle
    (a region both feeds and reads a group), the last group involved is
    dropped and the order recomputed (at most ``len(groups)`` times).

    Returns:
      ``(order, kept)``: the units, and the indices of the groups that were kept.

    Raises:
      RuntimeError: the regions alone cannot be contracted (a planner bug).
    """
    kept = list(range(len(groups)))
    for _ in range(len(groups) + 1):
        order = _contract(graph, [groups[g].eqns for g in kept], regions)
        if isinstance(order, tuple):
            relabel = {("collectives", k): ("collectives", g) for k, g in enumerate(kept)}
            return tuple(relabel.get(u, u) for u in order), tuple(kept)
        if not kept:
            break
        stuck_groups = [k for k in order if k < len(kept)]
        kept.pop(stuck_groups[-1] if stuck_groups else -1)
    raise RuntimeError("jaxpar: the stream regions of this level cannot be ordered; "
                       "please report it with the program that triggered it")


def _contract(graph: Graph, group_eqns: Sequence[Sequence[int]],
              regions: Sequence[Sequence[int]]) -> tuple[tuple[Any, ...], ...] | list[int]:
    """Kahn's order of the contracted graph, or the indices of stuck groups."""
    unit_of: dict[int, tuple[Any, ...]] = {}
    for g, eqns in enumerate(group_eqns):
        for i in eqns:
            unit_of[i] = ("collectives", g)
    for r, eqns in enumerate(regions):
        for i in eqns:
            unit_of[i] = ("region", r)
    first: dict[tuple[Any, ...], int] = {}
    for i in range(graph.size):
        first.setdefault(unit_of.get(i, ("eqn", i)), i)
    edges: dict[tuple[Any, ...], set[tuple[Any, ...]]] = {u: set() for u in first}
    in_degree = dict.fromkeys(first, 0)
    for i in range(graph.size):
        target = unit_of.get(i, ("eqn", i))
        for p in graph.preds[i]:
            source = unit_of.get(p, ("eqn", p))
            if source != target and target not in edges[source]:
                edges[source].add(target)
                in_degree[target] += 1
    ready = [(first[u], u) for u, d in in_degree.items() if d == 0]
    heapq.heapify(ready)
    order: list[tuple[Any, ...]] = []
    while ready:
        _, unit = heapq.heappop(ready)
        order.append(unit)
        for target in sorted(edges[unit], key=lambda u: first[u]):
            in_degree[target] -= 1
            if in_degree[target] == 0:
                heapq.heappush(ready, (first[target], target))
    if len(order) == len(first):
        return tuple(order)
    return sorted(u[1] for u, d in in_degree.items() if d > 0 and u[0] == "collectives")


def group_io(jaxpr: Any, group: CollectiveGroup) -> tuple[list[list[Any]], list[list[Any]]]:
    """Per member: its input atoms (vars or literals) and its output vars."""
    eqns = jaxpr.eqns
    return ([list(eqns[i].invars) for i in group.eqns],
            [list(eqns[i].outvars) for i in group.eqns])


def emit_collective_group(eqns: Sequence[Any], invals: Sequence[Sequence[Any]],
                          attributes: Mapping[str, str] = COLLECTIVES_GROUP_ATTRIBUTES
                          ) -> list[list[Any]]:
    """Emits ``eqns`` (collectives) as ONE non-inlined call launched as a group.

    Each equation is re-bound with its source info and context inside a
    ``_compat.stream_call`` carrying ``{_collectives_group="",
    inlineable="false"}``. Works under any trace (jit, grad, vmap, inside a
    ``shard_map`` body or a scan body).

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

    call: Callable[..., Any] = _compat.stream_call(body, dict(attributes))
    flat_out = list(call(*[v for vals in invals for v in vals]))
    result, start = [], 0
    for count in out_counts:
        result.append(flat_out[start:start + count])
        start += count
    return result


def evaluate_with_groups(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
                         groups: Sequence[CollectiveGroup],
                         order: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
    """Evaluates one open jaxpr level, emitting each group as one group call.

    The standalone form of what the emitter does for ``("collectives", g)``
    units; equations outside groups are re-bound as they were.

    Args:
      jaxpr: an open jaxpr.
      consts: values of its constvars.
      args: values of its invars.
      groups: groups found by ``group_collectives`` on ``jaxpr``.
      order: units from ``order_with_groups``; computed (and groups that cannot
        be contracted dropped) if omitted.

    Returns:
      The values of the jaxpr's outvars.
    """
    if order is None:
        order, kept = order_with_groups(build_graph(jaxpr), groups)
        if len(kept) != len(groups):
            remap = {("collectives", g): ("collectives", k) for k, g in enumerate(kept)}
            order = tuple(remap.get(u, u) for u in order)
            groups = [groups[g] for g in kept]
    env: dict[Any, Any] = {}

    def read(atom: Any) -> Any:
        return _compat.literal_value(atom) if _compat.is_literal(atom) else env[atom]

    def write(variables: Sequence[Any], values: Sequence[Any]) -> None:
        for var, value in zip(variables, values, strict=True):
            if not _compat.is_drop_var(var):
                env[var] = value

    write(jaxpr.constvars, consts)
    write(jaxpr.invars, args)
    for unit in order:
        if unit[0] == "eqn":
            eqn = jaxpr.eqns[unit[1]]
            write(eqn.outvars, _compat.bind_eqn(eqn, [read(v) for v in eqn.invars]))
        elif unit[0] == "collectives":
            members = [jaxpr.eqns[i] for i in groups[unit[1]].eqns]
            outs = emit_collective_group(members, [[read(v) for v in e.invars] for e in members])
            for eqn, values in zip(members, outs, strict=True):
                write(eqn.outvars, values)
        else:
            raise ValueError(f"evaluate_with_groups: unexpected unit {unit!r}")
    return [read(v) for v in jaxpr.outvars]
