"""Group mutually independent collectives so they are launched together.

XLA:GPU runs asynchronous collectives on one communication stream with at most
one in flight, so the forward and backward ``ppermute`` of a bidirectional ring
step serialize (openxla/xla#10640). Putting both in one non-inlined call with
the frontend attributes ``{_collectives_group="", inlineable="false"}`` makes
XLA (``ExplicitCollectivesGroupAsyncWrapper``, jax >= 0.6) launch them as one
asynchronous NCCL group, so both directions are in flight together.

This module is the planner's collectives phase (a level's phases 2 to 4 where it has
groups of collectives): ``group_collectives`` finds which
equations of one open jaxpr level form groups, and ``overlap_collectives`` pairs each
group with the compute that can run while it transfers (one stream region). The level
(``_plan.level``) contracts each group to one unit of its emission order; the emitter
(``jaxpar._emit.emit_collective_group``) launches it.

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

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from .. import _compat, _ops
from .._compat import JaxprEqn, JaxprLike
from .._program import primitives as _primitives
from .._program.graph import Graph, build_graph, reachable
from .._program.primitives import is_collective
from .plans import CollectiveGroup, CollectiveInfo, CollectivePlan, RegionPlan, SectionPlan

__all__ = [
    "COLLECTIVES_GROUP_ATTRIBUTES",
    "CollectiveGroup",
    "CollectiveInfo",
    "CollectivePlan",
    "group_collectives",
    "group_io",
    "overlap_collectives",
    "permutation_shift",
]

#: Frontend attributes of the call XLA turns into one asynchronous NCCL group.
COLLECTIVES_GROUP_ATTRIBUTES: Mapping[str, str] = {"_collectives_group": "",
                                                   "inlineable": "false"}


DEFAULT_GROUPABLE = _primitives.DEFAULT_GROUPABLE


def _axis_tuple(axis_name: Any) -> tuple[Any, ...]:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _eqn_axes(eqn: JaxprEqn) -> tuple[Any, ...]:
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


def group_collectives(jaxpr: JaxprLike, graph: Graph | None = None, *,
                      axis_sizes: Mapping[Any, int] | None = None,
                      groupable: Collection[str] = DEFAULT_GROUPABLE,
                      exclude: Collection[int] = (),
                      max_group_size: int | None = None) -> CollectivePlan:
    """Finds groups of mutually independent collectives at one open jaxpr level.

    Args:
      jaxpr: an open jaxpr (e.g. a ``shard_map`` body or a scan body).
      graph: its dependency graph; default ``_program.graph.build_graph(jaxpr)``.
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
        graph = build_graph(jaxpr)
    eqns = jaxpr.eqns
    excluded = frozenset(exclude)
    candidates = [i for i, eqn in enumerate(eqns)
                  if eqn.primitive.name in groupable and is_collective(eqn)
                  and i in graph.live and i not in excluded
                  and not _compat.ordering_effects(eqn)
                  and not _ops.has_frontend_attributes(eqn)]
    is_candidate = set(candidates)
    # layer[i]: deepest chain of candidates ending at (and including) equation i; read
    # for candidates only, so computed up to the last one.
    depth = [0] * graph.size
    for i in range(candidates[-1] + 1 if candidates else 0):
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
        if not is_collective(eqn) and name not in groupable:
            continue
        axes = _eqn_axes(eqn)
        shift = (permutation_shift(eqn.params["perm"], _axis_size(axes, axis_sizes))
                 if name == _primitives.PPERMUTE and "perm" in eqn.params else None)
        shifts[i] = shift
        report.append(CollectiveInfo(i, name, axes, shift,
                                     depth[i] if i in is_candidate else None, group_of.get(i)))
    groups = tuple(CollectiveGroup(tuple(m), tuple(shifts.get(i) for i in m),
                                   _eqn_axes(eqns[m[0]])) for m in members)
    return CollectivePlan(groups, tuple(report))


def group_io(jaxpr: JaxprLike, group: CollectiveGroup) -> tuple[list[list[Any]], list[list[Any]]]:
    """Per member: its input atoms (vars or literals) and its output vars."""
    eqns = jaxpr.eqns
    return ([list(eqns[i].invars) for i in group.eqns],
            [list(eqns[i].outvars) for i in group.eqns])


def overlap_collectives(graph: Graph, groups: Sequence[CollectiveGroup], heavy: Sequence[int],
                        blocked: Collection[int], seconds: Sequence[float]
                        ) -> tuple[SectionPlan, ...]:
    """For each collectives group, the compute that can run while it transfers.

    The heavy equations independent of the group (neither feeding nor fed by it) and
    not taken by an earlier group, closed to their convex hull plus private
    producers, become one stream region. In a collective matmul that is the step's
    matmuls on the blocks the previous step received. Seen deviceless (8 H200s):
    each group's start, the region's start, then both dones.

    Args:
      graph: the level's dependency graph.
      groups: the level's collective groups (``CollectivePlan.groups``).
      heavy: the level's movable heavy equations, ascending.
      blocked: equations that must stay in place.
      seconds: estimated seconds of every equation of the level.

    Returns:
      One section per group that has such compute; ``SectionPlan.collectives`` is
      the group's index.
    """
    taken: set[int] = set()
    sections = []
    for index, group in enumerate(groups):
        members = set(group.eqns)
        related = members | reachable(graph, group.eqns, True) | reachable(graph, group.eqns, False)
        picked = [i for i in heavy if i not in related and i not in taken]
        if not picked:
            continue
        hull = (reachable(graph, picked, True) & reachable(graph, picked, False)) | set(picked)
        if any(i in blocked or i in taken for i in hull):
            continue
        region = set(hull)
        for i in range(max(region), -1, -1):  # private producers, consumers first
            if (i not in region and i not in blocked and i not in taken and i in graph.live
                    and i not in graph.feeds_output and graph.succs[i]
                    and all(s in region for s in graph.succs[i])):
                region.add(i)
        taken |= region
        eqns = tuple(sorted(region))
        sections.append(SectionPlan(
            group=None, regions=(RegionPlan(1, eqns, sum(seconds[i] for i in eqns)),),
            collectives=index))
    return tuple(sections)


