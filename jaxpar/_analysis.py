"""One analysis of one program: its settings, one cost model and the per-call memos.

The passes and the planner of one call share an ``Analysis``: every equation is
costed once, every level's dependency graph built once, and the memos die with the
call (nothing module-global keeps a jaxpr alive).

Example::

    analysis = Analysis(Options().resolve("gpu"))
    analysis.costs.eqn_cost(eqn)        # one CostModel per call
    analysis.graph(jaxpr)               # memoised per level object

Sharp edges:
  * Memos key on object identity and hold the object (``_memo.IdentityMemo``), so ids
    stay unique; an ``Analysis`` must not outlive the call that made it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from . import _compat, _ops
from ._compat import JaxprEqn, JaxprLike
from ._cost import CostModel
from ._graph import Graph, Writers, graph_and_writers, rebuilt_graph
from ._memo import IdentityMemo
from ._options import Settings
from ._primitives import USER_PLACEMENT
from ._structure import StructuralKeys
from .targets import device_profile

_T = TypeVar("_T")


class Analysis:
    """Settings, one cost model and identity memos for one call."""

    def __init__(self, settings: Settings):
        if not isinstance(settings, Settings):
            raise TypeError(f"Analysis takes Settings (from Options.resolve), got "
                            f"{type(settings).__name__}")
        self.settings = settings
        self.costs = CostModel(device_profile(settings.target, settings.gpu))
        # How many more temporary bytes than the plain program jaxpar's may need (the
        # memory budget's allowance, ``_plan.budget``), for the passes that stack copies;
        # None: no budget, or not known yet.
        self.memory_allowance: float | None = None
        # Structural keys of jaxprs, equations and parameters, shared by every pass.
        self.structural_keys = StructuralKeys()
        self._graphs: IdentityMemo[_compat.Jaxpr, Graph] = IdentityMemo()
        self._writers: IdentityMemo[_compat.Jaxpr, Writers] = IdentityMemo()
        self._placement: IdentityMemo[JaxprLike, bool] = IdentityMemo()
        self._memos: dict[str, IdentityMemo[Any, Any]] = {}
        self._state: dict[str, object] = {}
        # What the analyses of every CUDA-graph mode of the call share (``with_settings``).
        self._shared_memos: dict[str, IdentityMemo[Any, Any]] = {}
        self._shared_state: dict[str, object] = {}

    def with_settings(self, settings: Settings) -> Analysis:
        """An analysis for other settings of the same program (another CUDA-graph mode to
        plan in) sharing what does not depend on them: the cost model and its memo of
        equation costs, structural keys, graphs, placement and sub-jaxprs, and the
        ``shared_memo``s and ``shared_state`` (what does not depend on the mode). Its
        ``memo``s and ``state`` are its own."""
        if settings.gpu != self.settings.gpu or settings.target != self.settings.target:
            raise ValueError("with_settings keeps the target and the GPU (the cost model's)")
        other = Analysis.__new__(Analysis)
        other.settings = settings
        other.costs = self.costs
        other.memory_allowance = self.memory_allowance
        other.structural_keys = self.structural_keys
        other._graphs, other._placement = self._graphs, self._placement
        other._writers = self._writers
        other._memos, other._state = {}, {}
        other._shared_memos, other._shared_state = self._shared_memos, self._shared_state
        return other

    @property
    def target(self) -> str:
        return self.settings.target

    def allowance_for(self, option: str) -> float | None:
        """``memory_allowance`` for the rewrite the option ``option`` turns on: None (any)
        where the user turned it on by name, which the budget never leaves out."""
        return None if option in self.settings.explicit else self.memory_allowance

    def graph(self, jaxpr: JaxprLike) -> Graph:
        """The dependency graph of an open jaxpr (or a closed one's inner jaxpr)."""
        inner, _ = _compat.open_jaxpr(jaxpr)
        graph = self._graphs.get(inner)
        if graph is None:
            graph, writers = graph_and_writers(inner)
            self._graphs.set(inner, graph)
            self._writers.set(inner, writers)
        return graph

    def derive_graph(self, old: JaxprLike, new: JaxprLike, kept_from: Sequence[int]) -> None:
        """Records the graph of ``new``, a level ``rebuild_level`` made of ``old``
        (equation ``k`` kept from ``old``'s equation ``kept_from[k]``, or made: -1),
        derived from ``old``'s (``_graph.rebuilt_graph``), so that the next pass need not
        build it afresh. Nothing, when ``old``'s graph was never asked for."""
        old_inner, _ = _compat.open_jaxpr(old)
        graph, writers = self._graphs.get(old_inner), self._writers.get(old_inner)
        if graph is None or writers is None:
            return
        new_inner, _ = _compat.open_jaxpr(new)
        graph, writers = rebuilt_graph(graph, writers, old_inner.eqns, new_inner, kept_from)
        self._graphs.set(new_inner, graph)
        self._writers.set(new_inner, writers)

    def subjaxprs(self, eqn: JaxprEqn) -> tuple[tuple[str, int | None, JaxprLike], ...]:
        """``_compat.eqn_subjaxprs(eqn)``, memoised by the parameter dict (rewritten
        levels keep the parameter dicts of the equations they copy)."""
        return self.costs.subjaxprs(eqn)

    def memo(self, name: str) -> IdentityMemo[Any, Any]:
        """A per-call identity memo for one pass or stage."""
        return _made(self._memos, name, IdentityMemo)

    def state(self, name: str, make: Callable[[], _T]) -> _T:
        """A per-call object for one pass or stage, ``make()`` on first use."""
        return _made(self._state, name, make)

    def shared_memo(self, name: str) -> IdentityMemo[Any, Any]:
        """A per-call identity memo shared with every ``with_settings`` analysis of the
        call: for what does not depend on the CUDA-graph mode (the passes' equation keys,
        the results of passes that do not price launches), so that planning the program
        in another mode reuses it."""
        return _made(self._shared_memos, name, IdentityMemo)

    def shared_state(self, name: str, make: Callable[[], _T]) -> _T:
        """``state`` shared with every ``with_settings`` analysis of the call (which
        rewrite made which equation, value numbers carried across rounds)."""
        return _made(self._shared_state, name, make)

    def annotated(self, eqn: JaxprEqn) -> bool:
        """Whether ``eqn`` is, or (recursively) contains, user-placed code."""
        return eqn_has_placement(eqn, self._placement, self.costs.subjaxprs)


def _made(table: dict[str, Any], name: str, make: Callable[[], _T]) -> _T:
    """``table[name]``, made by ``make()`` on first use."""
    found = table.get(name)
    if found is None:
        found = table[name] = make()
    return found  # type: ignore[no-any-return]


SubjaxprsFn = Callable[[JaxprEqn], Iterable[tuple[str, int | None, JaxprLike]]]


def eqn_has_placement(eqn: JaxprEqn, memo: IdentityMemo[JaxprLike, bool],
                      subjaxprs: SubjaxprsFn = _compat.eqn_subjaxprs) -> bool:
    """Whether ``eqn`` is, or (recursively) contains, user-placed code."""
    if eqn.primitive.name in USER_PLACEMENT:
        return True
    if _ops.has_frontend_attributes(eqn):
        return True
    return any(jaxpr_has_placement(sub, memo, subjaxprs) for _, _, sub in subjaxprs(eqn))


def jaxpr_has_placement(jaxpr: JaxprLike, memo: IdentityMemo[JaxprLike, bool] | None = None,
                        subjaxprs: SubjaxprsFn = _compat.eqn_subjaxprs) -> bool:
    """Whether any equation of ``jaxpr`` (recursively) is user-placed."""
    memo = IdentityMemo() if memo is None else memo
    found = memo.get(jaxpr)
    if found is None:
        inner, _ = _compat.open_jaxpr(jaxpr)
        found = any(eqn_has_placement(eqn, memo, subjaxprs) for eqn in inner.eqns)
        memo.set(jaxpr, found)
    return found
