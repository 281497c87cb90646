"""One analysis of one program: its settings, one cost model and the per-call memos.

The passes and the planner of one call share an ``Analysis``: every equation is
costed once, every level's dependency graph built once, and the memos die with the
call (nothing module-global keeps a jaxpr alive).

The memos are named fields, typed by what they hold: ``analysis.memos`` (``Memos``) are
the analysis's own (what depends on its settings), ``analysis.shared`` (``SharedMemos``)
those every ``with_settings`` analysis of the call shares; a stage above this module
keeps memos typed by its own classes in ``analysis.shared.of(ItsMemos)``.

Example::

    analysis = Analysis(Options().resolve("gpu"))
    analysis.costs.eqn_cost(eqn)        # one CostModel per call
    analysis.graph(jaxpr)               # memoised per level object
    analysis.memos.pass_visits.get(level, extra="fuse_scans")

Sharp edges:
  * Memos key on object identity and hold the object (``_memo.IdentityMemo``), so ids
    stay unique; an ``Analysis`` must not outlive the call that made it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

from . import _compat, _ops
from ._compat import JaxprEqn, JaxprLike
from ._memo import IdentityMemo
from ._model.cost import CostModel
from ._options import Settings
from ._program.graph import Graph, Unit, Writers, graph_and_writers, rebuilt_graph
from ._program.primitives import USER_PLACEMENT
from ._program.structure import StructuralKeys
from .targets import device_profile

_S = TypeVar("_S")

# A graph's last contracted groups and their emission order (``passes._splice.emission_order``).
OrderMemo = IdentityMemo[Graph, tuple[tuple[tuple[int, ...], ...], tuple[Unit, ...] | None]]


@dataclasses.dataclass(slots=True)
class Memos:
    """The memos of one analysis: what depends on its settings (one walk of the passes
    in one CUDA-graph mode). All are the walker's (``passes/_walk.py``)."""

    # Whether a pass visited a level in this walk (extra: the pass's name).
    pass_visits: IdentityMemo[JaxprLike, bool] = dataclasses.field(default_factory=IdentityMemo)
    # Whether a pass's visit of a level changed nothing and reported only what it left
    # alone (extra: the pass's name and the level's path).
    barren_visits: IdentityMemo[JaxprLike, bool] = dataclasses.field(default_factory=IdentityMemo)
    # Whether a pass that ``remembers_search`` searched a level in vain (extra: its name).
    searched_in_vain: IdentityMemo[JaxprLike, bool] = dataclasses.field(
        default_factory=IdentityMemo)


@dataclasses.dataclass(slots=True)
class SharedMemos:
    """The memos every ``with_settings`` analysis of a call shares: what does not depend on
    the CUDA-graph mode, so that planning the program in another mode reuses it."""

    # The memory model's temporary bytes per level and ordering, and largest buffers
    # (``_model.memory.MemoryModel``): the pipeline's memory budget and ``unroll_scans``.
    memory: IdentityMemo[Any, Any] = dataclasses.field(default_factory=IdentityMemo)
    # What the GPU model's estimates of every mode and of the plain program share
    # (``_plan.gpu_time``): the pipeline's mode search and ``unroll_scans``.
    mode_estimates: IdentityMemo[Any, Any] = dataclasses.field(default_factory=IdentityMemo)
    # Each graph's last emission order of rewrite groups (``passes._splice``): the
    # walker's rebuilds and ``batch_branches``.
    emission_order: OrderMemo = dataclasses.field(default_factory=IdentityMemo)
    # Each pass's own state for the call, by its name (``Pass.state``): the walker's.
    pass_states: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The memos of stages above this module, typed by their own classes (``of``).
    _stages: dict[type[Any], Any] = dataclasses.field(default_factory=dict)

    def of(self, kind: type[_S]) -> _S:
        """The call's one ``kind()``, made on first use: the memos of a stage whose types
        this module cannot import (``_plan.level.PlanMemos``, ``passes._splice.Splices``)."""
        found = self._stages.get(kind)
        if found is None:
            found = self._stages[kind] = kind()
        return cast(_S, found)


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
        self.memos = Memos()
        # What the analyses of every CUDA-graph mode of the call share (``with_settings``).
        self.shared = SharedMemos()

    def with_settings(self, settings: Settings) -> Analysis:
        """An analysis for other settings of the same program (another CUDA-graph mode to
        plan in) sharing what does not depend on them: the cost model and its memo of
        equation costs, structural keys, graphs, placement and sub-jaxprs, and the
        ``shared`` memos (what does not depend on the mode). Its ``memos`` are its own."""
        if settings.gpu != self.settings.gpu or settings.target != self.settings.target:
            raise ValueError("with_settings keeps the target and the GPU (the cost model's)")
        other = Analysis.__new__(Analysis)
        other.settings = settings
        other.costs = self.costs
        other.memory_allowance = self.memory_allowance
        other.structural_keys = self.structural_keys
        other._graphs, other._placement = self._graphs, self._placement
        other._writers = self._writers
        other.memos = Memos()
        other.shared = self.shared
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
        derived from ``old``'s (``_program.graph.rebuilt_graph``), so that the next pass need not
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

    def annotated(self, eqn: JaxprEqn) -> bool:
        """Whether ``eqn`` is, or (recursively) contains, user-placed code."""
        return eqn_has_placement(eqn, self._placement, self.costs.subjaxprs)


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
