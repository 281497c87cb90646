"""One analysis of one program: its settings, one cost model and the per-call memos.

The loop passes and the planner of one call share an ``Analysis``: every equation is
costed once, every level's dependency graph built once, and the memos die with the
call (nothing module-global keeps a jaxpr alive).

Example::

    analysis = Analysis(Options().resolve("gpu"))
    analysis.costs.eqn_cost(eqn)        # one CostModel per call
    analysis.graph(jaxpr)               # memoised per level object

Sharp edges:
  * Memos key on object identity and hold the object, so ids stay unique; an
    ``Analysis`` must not outlive the call that made it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from . import _compat
from ._cost import CostModel, device_profile
from ._graph import Graph, build_graph
from ._options import Settings
from ._primitives import USER_PLACEMENT
from ._structure import StructuralKeys


class Analysis:
    """Settings, one cost model and identity memos for one call."""

    def __init__(self, settings: Settings):
        if not isinstance(settings, Settings):
            raise TypeError(f"Analysis takes Settings (from Options.resolve), got "
                            f"{type(settings).__name__}")
        self.settings = settings
        self.costs = CostModel(device_profile(settings.target, settings.gpu))
        # Structural keys of jaxprs, equations and parameters, shared by every pass.
        self.structural_keys = StructuralKeys()
        self._graphs: dict[int, tuple[Any, Graph]] = {}
        self._placement: dict[int, tuple[Any, bool]] = {}
        self._memos: dict[str, dict[Any, Any]] = {}
        self._shared_memos: dict[str, dict[Any, Any]] = {}

    def with_settings(self, settings: Settings) -> Analysis:
        """An analysis for other settings of the same program (another CUDA-graph mode to
        plan in) sharing what does not depend on them: the cost model and its memo of
        equation costs, structural keys, graphs, placement and sub-jaxprs, and the
        ``shared_memo``s (what does not depend on the mode). Its ``memo``s are its own."""
        if settings.gpu != self.settings.gpu or settings.target != self.settings.target:
            raise ValueError("with_settings keeps the target and the GPU (the cost model's)")
        other = Analysis.__new__(Analysis)
        other.settings = settings
        other.costs = self.costs
        other.structural_keys = self.structural_keys
        other._graphs, other._placement = self._graphs, self._placement
        other._memos = {}
        other._shared_memos = self._shared_memos
        return other

    @property
    def target(self) -> str:
        return self.settings.target

    def graph(self, jaxpr: Any) -> Graph:
        """The dependency graph of an open jaxpr (or a closed one's inner jaxpr)."""
        inner, _ = _compat.open_jaxpr(jaxpr)
        hit = self._graphs.get(id(inner))
        if hit is not None and hit[0] is inner:
            return hit[1]
        graph = build_graph(inner)
        self._graphs[id(inner)] = (inner, graph)
        return graph

    def subjaxprs(self, eqn: Any) -> tuple[tuple[str, int | None, Any], ...]:
        """``_compat.eqn_subjaxprs(eqn)``, memoised by the parameter dict (rewritten
        levels keep the parameter dicts of the equations they copy)."""
        return self.costs.subjaxprs(eqn)

    def memo(self, name: str) -> dict[Any, Any]:
        """A per-call memo for one pass or stage (the owner keeps identity keys' objects)."""
        return self._memos.setdefault(name, {})

    def shared_memo(self, name: str) -> dict[Any, Any]:
        """A per-call memo shared with every ``with_settings`` analysis of the call: for
        what does not depend on the CUDA-graph mode (the passes' equation keys, the
        results of passes that do not price launches, which rewrite made which
        equation), so that planning the program in another mode reuses it."""
        return self._shared_memos.setdefault(name, {})

    def annotated(self, eqn: Any) -> bool:
        """Whether ``eqn`` is, or (recursively) contains, user-placed code."""
        return eqn_has_placement(eqn, self._placement, self.costs.subjaxprs)


SubjaxprsFn = Callable[[Any], Iterable[tuple[str, int | None, Any]]]


def eqn_has_placement(eqn: Any, memo: dict[int, tuple[Any, bool]],
                      subjaxprs: SubjaxprsFn = _compat.eqn_subjaxprs) -> bool:
    """Whether ``eqn`` is, or (recursively) contains, user-placed code."""
    if eqn.primitive.name in USER_PLACEMENT:
        return True
    if _compat.eqn_frontend_attributes(eqn):
        return True
    return any(jaxpr_has_placement(sub, memo, subjaxprs) for _, _, sub in subjaxprs(eqn))


def jaxpr_has_placement(jaxpr: Any, memo: dict[int, tuple[Any, bool]],
                        subjaxprs: SubjaxprsFn = _compat.eqn_subjaxprs) -> bool:
    """Whether any equation of ``jaxpr`` (recursively) is user-placed."""
    hit = memo.get(id(jaxpr))
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    inner, _ = _compat.open_jaxpr(jaxpr)
    found = any(eqn_has_placement(eqn, memo, subjaxprs) for eqn in inner.eqns)
    memo[id(jaxpr)] = (jaxpr, found)
    return found
