"""Dependency graph over the equations of one (open) jaxpr.

Edges follow variable identity: equation ``j`` depends on ``i`` when it reads
a variable ``i`` writes. Effectful equations are additionally chained in
program order so side effects keep their relative order.

Example::

    graph = build_graph(jaxpr)
    graph.preds[5]      # indices of the equations equation 5 reads from

Sharp edges:
  * The graph is per level: an equation holding nested jaxprs is one node.
    Callers recurse into nested jaxprs themselves.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

from . import _compat


@dataclasses.dataclass(frozen=True, slots=True)
class Graph:
    """Predecessors and successors of each equation, by index."""

    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    # Equations with at least one output among the jaxpr's outputs.
    feeds_output: frozenset[int]
    # Equations whose results are needed (by outputs or by effects).
    live: frozenset[int]

    @property
    def size(self) -> int:
        return len(self.preds)


_CACHE_SIZE = 64
_cache: collections.OrderedDict[int, tuple[Any, Graph]] = collections.OrderedDict()
_lock = threading.Lock()


def build_graph(jaxpr: Any) -> Graph:
    """The dependency graph of an open jaxpr's equations (memoised per jaxpr object).

    Jaxprs are immutable, and the loop passes and the planner ask for the same
    level's graph several times; the cache holds the jaxpr so its id stays unique.
    """
    with _lock:
        hit = _cache.get(id(jaxpr))
        if hit is not None and hit[0] is jaxpr:
            _cache.move_to_end(id(jaxpr))
            return hit[1]
    graph = _build_graph(jaxpr)
    with _lock:
        _cache[id(jaxpr)] = (jaxpr, graph)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return graph


def _build_graph(jaxpr: Any) -> Graph:
    producer: dict[Any, int] = {}
    preds: list[tuple[int, ...]] = []
    succ_lists: list[list[int]] = []
    effectful: list[int] = []
    last_effect: int | None = None
    is_literal, is_drop_var = _compat.is_literal, _compat.is_drop_var
    for index, eqn in enumerate(jaxpr.eqns):
        sources = {producer[v] for v in eqn.invars if not is_literal(v) and v in producer}
        # Most equations have no effects at all; only those with some pay for the filter.
        if eqn.effects and _compat.ordering_effects(eqn):
            effectful.append(index)
            if last_effect is not None:
                sources.add(last_effect)
            last_effect = index
        inputs = tuple(sorted(sources)) if len(sources) > 1 else tuple(sources)
        preds.append(inputs)
        succ_lists.append([])
        for source in inputs:
            succ_lists[source].append(index)
        for v in eqn.outvars:
            if not is_drop_var(v):
                producer[v] = index
    feeds_output = frozenset(producer[v] for v in jaxpr.outvars
                             if not is_literal(v) and v in producer)
    live: set[int] = set(feeds_output)
    live.update(effectful)
    for index in range(len(preds) - 1, -1, -1):
        if index in live:
            live.update(preds[index])
    return Graph(tuple(preds), tuple(map(tuple, succ_lists)), feeds_output, frozenset(live))
