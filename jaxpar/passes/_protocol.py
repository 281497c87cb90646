"""The pass protocol: what a pass is given, what it returns, and the row the walker runs.

Every pass has one signature, ``run(level: Level, analysis: Analysis) -> LevelResult``,
and is one row of the pass table (``_options.PASS_TABLE``: its option, how it is turned
on, its rung, what it works after); ``passes.PASSES`` binds each row to its module's
``run`` and ``State`` (``Pass.of``). A ``LevelResult`` holds the rewrites the pass
wants (``Rewrite``: some equation indices and a function that emits their
replacement), its ``PassDecision``s (each with a ``DecisionKind``), and what it tells
the walker beside them (``decided_alike``). The splice
(``passes/_splice.py``) applies the rewrites; the walker (``passes/_walk.py``) runs the
rows at every level and stamps each decision with its row's name.

Example::

    def run(level: Level, analysis: Analysis) -> LevelResult:
        found = [i for i, e in enumerate(level.eqns) if e.primitive.name == "sin"]
        return LevelResult([Rewrite((i,), lambda rows: [[jnp.sin(rows[0][0])]])
                            for i in found], [])

    Pass("my_pass", run, lambda settings: True, "what it does")   # run by hand
    Pass.of(PassRow("my_pass", "what it does", option="my_pass"), run)  # as a table row

Sharp edges:
  * Equation indices (``Rewrite.eqns``, ``PassDecision.eqns``) refer to the level as
    the pass saw it; a later pass sees it as the earlier ones rewrote it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from .. import _compat
from .._analysis import Analysis
from .._compat import JaxprEqn, JaxprLike
from .._deprecations import warn_deprecated
from .._options import PassRow, Settings
from .._program.graph import Graph
from .._program.primitives import LOOPS


class DecisionKind(enum.StrEnum):
    """What a pass did with some equations (a ``str``: compares equal to its value)."""

    FUSED = "fused"
    BATCHED = "batched"
    UNROLLED = "unrolled"
    MADE_STATIC = "made static"
    LEFT_ALONE = "left alone"
    HOST_SYNC = "host-sync loop"
    BATCHED_SUBGRAPHS = "batched subgraphs"
    SUBGRAPHS_LEFT_ALONE = "subgraphs left alone"
    BATCHED_MATMULS = "batched matmuls"
    MATMULS_LEFT_ALONE = "matmuls left alone"
    INLINED = "inlined calls"
    FUSIONS_BOUNDED = "fusions bounded"
    SUMS_REDUCED = "sums reduced"
    HOISTED = "hoisted"
    SCANNED_IN_PARALLEL = "scanned in parallel"


# Decisions that only report: the program is left as it was.
UNCHANGED_KINDS = frozenset({DecisionKind.LEFT_ALONE, DecisionKind.HOST_SYNC,
                             DecisionKind.SUBGRAPHS_LEFT_ALONE, DecisionKind.MATMULS_LEFT_ALONE})
# The name scope of a scan ``unroll_scans`` reads by blocks: the scan of blocks is not
# unrolled again, profiles name it, and the report names the user's loop instead.
BLOCK_SCOPE = "jaxpar_blocks"
# The name scope of a ``while`` ``unroll_while_loops`` made: not rewritten again.
WHILE_SCOPE = "jaxpar_while_copies"
# jaxpar's own name scopes: no place in the user's program (the report leaves them out).
JAXPAR_SCOPES = frozenset({BLOCK_SCOPE, WHILE_SCOPE})
# Decisions that make a new loop out of several (so it is never "left alone").
NEW_LOOP_KINDS = frozenset({DecisionKind.FUSED, DecisionKind.BATCHED})
# Decisions of the subgraph and matmul batching passes (``inline_twin_calls``,
# ``batch_branches``, ``batch_matmuls``, ``bound_fusions``); the rest are about loops.
SUBGRAPH_KINDS = (DecisionKind.INLINED, DecisionKind.BATCHED_SUBGRAPHS,
                  DecisionKind.SUBGRAPHS_LEFT_ALONE, DecisionKind.BATCHED_MATMULS,
                  DecisionKind.MATMULS_LEFT_ALONE, DecisionKind.FUSIONS_BOUNDED,
                  DecisionKind.SUMS_REDUCED)


class Product(NamedTuple):
    """An equation of the rewritten program that a decision made, or that holds (in its
    nested jaxprs, or as a rewrite of such an equation) what it made.

    Attributes:
        location: its level's path in the rewritten program (``"/"``, ``"/scan#3.jaxpr"``).
        eqn: its index in that level.
        holds: False for an equation the rewrite emitted (or a later rewrite made of
            one); True for one that holds such equations.
    """

    location: str
    eqn: int
    holds: bool


@dataclasses.dataclass(frozen=True, slots=True)
class PassDecision:
    """What a pass did (or declined to do) with some equations of one level.

    Attributes:
        location: the level, as a path like the planner's (``"/"`` is the top level,
            ``"/scan#3.jaxpr"`` the body of equation 3's scan).
        kind: a ``DecisionKind`` (``"fused"``, ``"batched"``, ``"unrolled"``,
            ``"made static"``, ``"left alone"``, ``"host-sync loop"``, ...).
        eqns: indices of the equations involved, in the level as the pass saw it.
        primitives: their primitive names.
        sources: their user source lines (``file:line (function)``).
        trips_before: loop trips (summed over the loops) before the pass; None if unknown.
        trips_after: loop trips after the pass; None if unknown.
        unroll: the unroll factor of the resulting loop(s), when one applies.
        reason: why, in words.
        members: for the batching passes that join equations of different members (the
            matmul batching pass): per member, its equations in ``eqns``; empty otherwise.
        depth: for the matmul batching pass, the group's launch depth (kernel-launching
            ops on the longest path from the level's inputs, the op itself included).
            ``stage`` is its deprecated name (until 0.3.0).
        saving_us: for the matmul batching pass, the cost model's estimated saving per
            run of the level, in microseconds (launches saved less stacking and
            transposing); at most zero for a group left alone.
        pass_name: the pass that made it (a ``Pass.name``, e.g. ``"fuse_scans"``).
        produced: where the equations its rewrite emitted are in the program the passes
            return (``Product``s, program order); empty for a decision that changed
            nothing, and for one whose equations a later rewrite removed.
        places: where in the user's model its equations are, in the user's words
            (``model.towers[1].linear1``), its equations' order; the report fills it in
            (``jaxpar._report.places``), empty as the passes make it.
    """

    location: str
    kind: DecisionKind
    eqns: tuple[int, ...]
    primitives: tuple[str, ...]
    sources: tuple[str, ...]
    trips_before: int | None
    trips_after: int | None
    unroll: int | None
    reason: str
    members: tuple[tuple[int, ...], ...] = ()
    depth: int | None = None
    saving_us: float | None = None
    pass_name: str = ""
    produced: tuple[Product, ...] = ()
    places: tuple[str, ...] = ()

    @property
    def stage(self) -> int | None:
        """Deprecated: ``depth`` (a launch depth, not a stage of the pipeline)."""
        warn_deprecated("PassDecision.stage")
        return self.depth


def decision(path: str, kind: DecisionKind, eqns: Sequence[JaxprEqn], indices: Sequence[int], *,
             trips_before: int | None, trips_after: int | None, unroll: int | None,
             reason: str, members: Sequence[Sequence[int]] = (), depth: int | None = None,
             saving_us: float | None = None) -> PassDecision:
    """Builds a ``PassDecision`` for equations ``eqns`` at ``indices`` of level ``path``."""
    return PassDecision(
        location=path or "/", kind=kind, eqns=tuple(indices),
        primitives=tuple(eqns[i].primitive.name for i in indices),
        sources=tuple(_compat.source_summary(eqns[i]) for i in indices),
        trips_before=trips_before, trips_after=trips_after, unroll=unroll, reason=reason,
        members=tuple(tuple(m) for m in members), depth=depth, saving_us=saving_us)

# emit(invals of each member equation) -> outvals of each member equation; an outval may
# be None when nothing outside the rewrite reads it.
EmitFn = Callable[[list[list[Any]]], list[list[Any]]]


@dataclasses.dataclass(frozen=True, slots=True)
class Rewrite:
    """Equations (sorted indices) replaced together by what ``emit`` binds.

    ``key``, when given, promises that two rewrites with equal keys emit the same
    equations (up to variable names) when their operands have the same types and the
    same pattern of repeated variables and literals: the level is then traced once per
    key and the other rewrites get copies with fresh variables, whose equations carry
    the source info a trace of their own would give them (an equation made under the
    i-th replaced equation's source info gets the i-th one's of the copy: equal keys
    must list the replaced equations in corresponding orders). At the top level the
    traces are kept for the whole call (``rebuild_level``'s ``traces``), so the promise
    must hold across levels and passes: a key starts with its pass's name, and holds
    no number whose meaning changes within a call.
    """

    eqns: tuple[int, ...]
    emit: EmitFn
    key: Hashable | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Level:
    """One jaxpr level as a pass sees it.

    Attributes:
        jaxpr: the level as found (a closed or open jaxpr); never mutated.
        path: where it is (``""`` the top level, ``"/scan#3.jaxpr"`` a body).
        graph: its dependency graph.
        state: the running pass's own state for the call (what its row's ``state``
            makes, kept by the walker); None for a pass without, or run by hand.
    """

    jaxpr: JaxprLike
    path: str
    graph: Graph
    state: Any = None

    @property
    def eqns(self) -> list[JaxprEqn]:
        inner, _ = _compat.open_jaxpr(self.jaxpr)
        return list(inner.eqns)

    @property
    def in_loop_body(self) -> bool:
        """Whether the level is (inside) the body of a ``scan`` or ``while``: a part of
        ``path`` names a loop equation (``"scan#3"`` in ``"/scan#3.jaxpr"``)."""
        return any(part.split("#", 1)[0] in LOOPS for part in self.path.split("/")
                   if "#" in part)


@dataclasses.dataclass(frozen=True, slots=True)
class LevelResult:
    """What a pass's ``run`` returns for one level.

    Attributes:
        rewrites: the rewrites it wants applied (``Rewrite``s, disjoint equations).
        decisions: what it did or declined to do (``PassDecision``s; the walker stamps
            them with the pass's name).
        decided_alike: for a pass that prices launches (``Pass.prices_launches``): every
            verdict would be the same in a mode pricing launches otherwise (its
            decisions do not say what a launch costs), so the walker may reuse this
            result in every launch pricing (``_plan.modes.ModeSteps``).
    """

    rewrites: list[Rewrite] = dataclasses.field(default_factory=list)
    decisions: list[PassDecision] = dataclasses.field(default_factory=list)
    decided_alike: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Pass:
    """A pass as the walker runs it: its row of the pass table (``Pass.of``) with the
    functions its module gives, or one made by hand.

    Attributes:
        name: the pass's name, stamped on its decisions.
        run: ``run(level, analysis) -> LevelResult``.
        enabled: whether ``settings`` ask for the pass.
        summary: one line for the docs and ``inspect``.
        prices_launches: whether ``run`` prices kernel launches in the CUDA-graph mode
            (``settings.modes.priced``, through ``CostModel.launch_prices``); the
            other passes decide the same in every mode, so planning the program in
            another mode reuses what they did (``_plan.modes.ModeSteps``).
        after: the passes whose rewrites this one works on: run alone, it changes
            nothing (``bound_fusions`` bounds what the batching passes made).
        remembers_search: whether the walker may remember a level this pass searched in
            vain (no rewrite) and not run it there again in the call: the pass finds
            nothing to rewrite on a level it found nothing on before (what it finds is
            a function of the level and the settings), and its decisions there (only
            "left alone" ones) are dropped after a level's first round anyway.
        state: makes the pass's own state for a call (memos of what it found on
            equations and levels), on its first visit; the walker keeps it in the
            call's ``Analysis`` (shared by the analyses of every CUDA-graph mode, so it
            must hold only what does not depend on the mode) and hands it to ``run`` as
            ``Level.state``.
    """

    name: str
    run: Callable[[Level, Analysis], LevelResult]
    enabled: Callable[[Settings], bool]
    summary: str
    prices_launches: bool = False
    after: tuple[str, ...] = ()
    remembers_search: bool = False
    state: Callable[[], Any] | None = None

    @classmethod
    def of(cls, row: PassRow, run: Callable[[Level, Analysis], LevelResult],
           state: Callable[[], Any] | None = None) -> Pass:
        """The pass of ``row`` (``_options.PASS_TABLE``), running ``run`` with ``state``."""
        return cls(row.name, run, row.enabled, row.summary,
                   prices_launches=row.prices_launches, after=row.after,
                   remembers_search=row.remembers_search, state=state)
