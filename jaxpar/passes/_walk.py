"""Shared machinery of the loop passes: decisions, level rewriting, recursion.

A *level pass* looks at the equations of one jaxpr level and returns the
rewrites it wants (``Rewrite``: some equation indices and a function that emits
their replacement) plus ``PassDecision``s. Every pass has one signature,
``run(level: Level, analysis: Analysis) -> (rewrites, decisions)``, and is one row
(``Pass``) of the table in ``passes/__init__.py``. ``rebuild_level`` traces each
rewrite on its own and splices its equations into the level at a point where all its
inputs exist (the order comes from ``_graph.contract``, which contracts each
rewrite's equations to one unit). ``walk_levels`` runs the passes at every nesting
level, innermost first, through every jaxpr-valued parameter, and stamps each
decision with the name of the pass that made it.

Example::

    analysis = Analysis(Options().resolve("gpu"))
    static = [p for p in PASSES if p.name == "make_loops_static"]  # passes/__init__.py
    new_jaxpr, decisions = walk_levels(closed_jaxpr, static, analysis)

Rewrites of a nested level are traced where JAX traced that level
(``_compat.nested_trace_context``): inside a ``shard_map`` body with its mesh axes
bound, since the body's values name them.

Every equation a rewrite emits is recorded as made by the decisions about the
equations it replaces (``EqnOrigins``, one per call in the ``Analysis``); a copy of an
equation, a rewrite of a made equation, and an equation whose nested jaxprs were
rewritten carry those records on. When the walk of the top level ends, each decision
gets ``produced``: where its equations are in the rewritten program (``Product``), read
from the records and not matched by primitive or source line.

Sharp edges:
  * Equation indices in a decision refer to the level as the pass saw it: a
    later pass sees the level as the earlier passes rewrote it. ``produced`` refers
    to the program the walk returns.
  * A rewrite's equations are recorded as a whole: every decision about the equations
    one rewrite replaces (the groups of one ``batch_matmuls`` unit) owns all of them.
  * A nested open jaxpr (``remat`` bodies up to jax 0.10) whose rewrite would
    capture constants cannot be replaced; it is kept as it was and the
    decisions made inside it are reported as "left alone".
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, NamedTuple

from .. import _compat
from .._analysis import Analysis
from .._compat import Atom, JaxprEqn, JaxprLike, Var
from .._cost import launch_pricing
from .._graph import (
    ContractionCycle,
    EqnUnit,
    Graph,
    RewriteUnit,
    Unit,
    build_graph,
    contract,
    eqn_units,
)
from .._interp import Env
from .._memo import IdentityMemo
from .._options import Settings
from .._primitives import LOOPS, SCAN


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


# Decisions that only report: the program is left as it was.
UNCHANGED_KINDS = frozenset({DecisionKind.LEFT_ALONE, DecisionKind.HOST_SYNC,
                             DecisionKind.SUBGRAPHS_LEFT_ALONE, DecisionKind.MATMULS_LEFT_ALONE})
# Decisions that make a new loop out of several (so it is never "left alone").
NEW_LOOP_KINDS = frozenset({DecisionKind.FUSED, DecisionKind.BATCHED})
# Decisions of the subgraph and matmul batching passes (``inline_twin_calls``,
# ``batch_branches``, ``batch_matmuls``, ``bound_fusions``); the rest are about loops.
SUBGRAPH_KINDS = (DecisionKind.INLINED, DecisionKind.BATCHED_SUBGRAPHS,
                  DecisionKind.SUBGRAPHS_LEFT_ALONE, DecisionKind.BATCHED_MATMULS,
                  DecisionKind.MATMULS_LEFT_ALONE, DecisionKind.FUSIONS_BOUNDED)

# Bound on the rounds of level passes at one level (each productive round removes a loop,
# loop trips, or a unit unroll factor, so real programs settle in a few).
MAX_ROUNDS = 64

# Most equations an unrolled loop body may hold: ``unroll_scans`` unrolls within it, and
# ``fuse_scans`` keeps a member's unroll factor for the fused scan only within it.
MAX_UNROLLED_EQNS = 512


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
    """What a loop pass did (or declined to do) with some loops of one level.

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
        stage: for the matmul batching pass, the group's stage (kernel-launching ops on
            the longest path from the level's inputs, the op itself included).
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
    stage: int | None = None
    saving_us: float | None = None
    pass_name: str = ""
    produced: tuple[Product, ...] = ()
    places: tuple[str, ...] = ()


def decision(path: str, kind: DecisionKind, eqns: Sequence[JaxprEqn], indices: Sequence[int], *,
             trips_before: int | None, trips_after: int | None, unroll: int | None,
             reason: str, members: Sequence[Sequence[int]] = (), stage: int | None = None,
             saving_us: float | None = None) -> PassDecision:
    """Builds a ``PassDecision`` for equations ``eqns`` at ``indices`` of level ``path``."""
    return PassDecision(
        location=path or "/", kind=kind, eqns=tuple(indices),
        primitives=tuple(eqns[i].primitive.name for i in indices),
        sources=tuple(_compat.source_summary(eqns[i]) for i in indices),
        trips_before=trips_before, trips_after=trips_after, unroll=unroll, reason=reason,
        members=tuple(tuple(m) for m in members), stage=stage, saving_us=saving_us)


class EqnOrigins:
    """Which decisions made which equations, while the passes rewrite one program.

    One per call (``eqn_origins(analysis)``). Equations are keys by identity (and kept
    alive here, so an identity is never reused); each holds ``(decision number, holds)``
    pairs, ``holds`` as in ``Product``. ``number`` pins a decision for the same reason.
    """

    def __init__(self) -> None:
        self._of: IdentityMemo[JaxprEqn, frozenset[tuple[int, bool]]] = IdentityMemo()
        self._decisions: IdentityMemo[PassDecision, int] = IdentityMemo()

    def number(self, decision: PassDecision) -> int:
        number = id(decision)
        self._decisions.set(decision, number)
        return number

    def get(self, eqn: JaxprEqn) -> frozenset[tuple[int, bool]]:
        return self._of.get(eqn, frozenset())

    def add(self, eqn: JaxprEqn, origins: Iterable[tuple[int, bool]]) -> None:
        new = origins if isinstance(origins, frozenset) else frozenset(origins)
        if new:
            old = self._of.get(eqn)
            self._of.set(eqn, old | new if old else new)

    def copied(self, old: JaxprEqn, new: JaxprEqn) -> None:
        """``new`` replaces ``old`` (new operands or parameters): it keeps its origins."""
        if new is not old:
            self.add(new, self.get(old))

    def emitted(self, body: Sequence[JaxprEqn], replaced: Sequence[JaxprEqn],
                owners: Iterable[int]
                ) -> None:
        """``body`` replaces the equations ``replaced`` for the decisions ``owners``; it
        also carries what ``replaced`` carried (a loop fused, then unrolled, is both)."""
        made = {(k, False) for k in owners}
        inherited: set[tuple[int, bool]] = set()
        for eqn in replaced:
            inherited |= self.get(eqn)
        plain = frozenset(made | {o for o in inherited if not o[1]})
        holding = plain | inherited
        if not holding:
            return
        for eqn in body:
            # Only an equation with nested jaxprs can hold what a decision made inside.
            nested = holding != plain and any(True for _ in _compat.eqn_subjaxprs(eqn))
            self.add(eqn, holding if nested else plain)

    def with_products(self, jaxpr: JaxprLike, decisions: Sequence[PassDecision]
                      ) -> list[PassDecision]:
        """``decisions`` with ``produced`` read from the equations of ``jaxpr``."""
        if not self._of:
            return list(decisions)
        found: dict[int, list[Product]] = {}
        self._collect(jaxpr, "", found)
        numbers = [self._decisions.get(d) for d in decisions]
        return [dataclasses.replace(d, produced=tuple(found[n]))
                if n is not None and n in found else d
                for d, n in zip(decisions, numbers, strict=True)]

    def _collect(self, jaxpr: JaxprLike, path: str, found: dict[int, list[Product]]) -> None:
        inner, _ = _compat.open_jaxpr(jaxpr)
        eqns = inner.eqns
        for index, (eqn, made) in enumerate(zip(eqns, self._of.get_all(eqns), strict=True)):
            if made:
                for number, holds in sorted(made):
                    found.setdefault(number, []).append(Product(path or "/", index, holds))
            # At the top level, only an equation that holds something made carries it in
            # nested jaxprs (``emitted``, ``_walk_once``'s ``holds``). Not below: a
            # rewrite's trace binds the equations of an emitted loop's body afresh, with
            # no records, around nested jaxprs that hold made equations (the remainder
            # of two fused scans whose body's inner scans were rewritten).
            if not path and not any(holds for _, holds in made or ()):
                continue
            for name, item, sub in _compat.eqn_subjaxprs(eqn):
                label = f"{name}[{item}]" if item is not None else name
                self._collect(sub, f"{path}/{eqn.primitive.name}#{index}.{label}", found)


def eqn_origins(analysis: Analysis) -> EqnOrigins:
    """The call's ``EqnOrigins`` (the analysis's ``"eqn_origins"`` shared state: the
    analyses of every CUDA-graph mode share the steps that made the equations)."""
    return analysis.shared_state("eqn_origins", EqnOrigins)


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
    """

    jaxpr: JaxprLike
    path: str
    graph: Graph

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


LevelResult = tuple[list[Rewrite], list[PassDecision]]


@dataclasses.dataclass(frozen=True, slots=True)
class Pass:
    """One row of the pass table.

    Attributes:
        name: the pass's name, stamped on its decisions.
        run: ``run(level, analysis) -> (rewrites, decisions)``.
        enabled: whether ``settings`` ask for the pass.
        summary: one line for the docs and ``inspect``.
        prices_launches: whether ``run`` prices kernel launches in the CUDA-graph mode
            (``settings.command_buffers``, through ``CostModel.launch_prices``); the
            other passes decide the same in every mode, so planning the program in
            another mode reuses what they did (``_pass_step``).
        after: the passes whose rewrites this one works on: run alone, it changes
            nothing (``bound_fusions`` bounds what the batching passes made).
    """

    name: str
    run: Callable[[Level, Analysis], LevelResult]
    enabled: Callable[[Settings], bool]
    summary: str
    prices_launches: bool = False
    after: tuple[str, ...] = ()


def evaluate(jaxpr: JaxprLike, *args: Any) -> list[Any]:
    """Evaluates a closed or open jaxpr under the current trace, keeping source info."""
    inner, consts = _compat.open_jaxpr(jaxpr)
    env = Env()
    env.write(inner.constvars, consts)
    env.write_inputs(inner.invars, args)
    for eqn in inner.eqns:
        env.write(eqn.outvars, _compat.bind_eqn(eqn, env.read_all(eqn.invars)))
    return env.read_all(inner.outvars)


# A graph's last contracted groups and their emission order (``emission_order``).
OrderMemo = IdentityMemo[Graph, tuple[tuple[tuple[int, ...], ...], tuple[Unit, ...] | None]]


def emission_order(graph: Graph, groups: Sequence[Sequence[int]],
                   memo: OrderMemo | None = None) -> tuple[Unit, ...] | None:
    """Emission units with each group contracted (``RewriteUnit(k)`` for ``groups[k]``),
    or None if contracting makes a cycle.

    ``memo`` (an ``Analysis.memo``) keeps the last answer per graph: a pass that checked
    its groups can be ordered, and the rebuild that then orders them, contract once.
    """
    blocks = tuple(tuple(g) for g in groups)
    if memo is not None:
        hit = memo.get(graph)
        if hit is not None and hit[0] == blocks:
            return hit[1]
    try:
        order: tuple[Unit, ...] | None = contract(
            graph, [(RewriteUnit(k), g) for k, g in enumerate(blocks)])
    except ContractionCycle:
        order = None
    if memo is not None:
        memo.set(graph, (blocks, order))
    return order


# ``Analysis.derive_graph``: (old level, new level, per new equation its old index or -1).
DeriveGraph = Callable[[JaxprLike, JaxprLike, Sequence[int]], None]


def rebuild_level(jaxpr: JaxprLike, rewrites: Sequence[Rewrite],
                  params: dict[int, dict[str, Any]] | None = None,
                  graph: Graph | None = None,
                  orders: OrderMemo | None = None,
                  origins: EqnOrigins | None = None,
                  owners: Sequence[Iterable[int]] = (),
                  traces: dict[Hashable, _TracedRewrite] | None = None,
                  derive_graph: DeriveGraph | None = None) -> JaxprLike | None:
    """``jaxpr`` with ``rewrites`` applied and some equations' ``params`` replaced.

    With ``origins``, the equations each rewrite emits are recorded as made by the
    decisions ``owners[k]`` (numbers from ``EqnOrigins.number``) of rewrite ``k``, and
    copied equations keep their records.

    ``traces`` keeps the rewrites traced by key (``Rewrite.key``) and operand pattern
    beyond this call: a rewrite whose key and pattern were traced in an earlier rebuild
    is copied from that trace (see ``Rewrite``). Give it only for levels traced in one
    context (the top level of one call); by default the traces live for this call.

    Only the rewrites are traced (each into a small jaxpr of its own); their equations
    are spliced into the level in an order where every rewrite's inputs exist, and the
    untouched equations are kept as they are. So a rewrite costs in proportion to what
    it emits, not to the size of the level.

    With ``derive_graph`` (``Analysis.derive_graph``), ``derive_graph(jaxpr, new_jaxpr,
    kept_from)`` is told where each new equation came from (its old index, or -1 for
    one a rewrite made), to derive the new level's graph from the old one's.

    Returns a jaxpr of the same kind and signature, or None when that is
    impossible (see the module's sharp edges).

    Raises:
        RuntimeError: the rewrites' groups cannot be ordered, or a rewrite's results do
            not match the equations it replaces (a pass bug).
    """
    inner, _ = _compat.open_jaxpr(jaxpr)
    eqns = inner.eqns
    if rewrites:
        graph = graph if graph is not None else build_graph(inner)
        order = emission_order(graph, [r.eqns for r in rewrites], orders)
        if order is None:
            raise RuntimeError("jaxpar loop pass bug: merged loops depend on each other; "
                               "please report it with the program that triggered it")
    else:
        order = eqn_units(0, len(eqns))
    params = params or {}
    renamed: dict[Any, Any] = {}  # replaced equations' outvars -> the atoms now holding them
    dropped: set[Any] = set()  # replaced equations' outvars their rewrite did not compute
    # ids of every variable a rewrite replaces (literals are unhashable, and their ids
    # never equal a live variable's), and the equations that may read one: the
    # successors of the replaced equations (effect edges add some that read none).
    # Every other equation is kept as it is, without looking at its operands.
    rewritten = {i for r in rewrites for i in r.eqns}
    replaced = {id(v) for i in rewritten for v in eqns[i].outvars}
    readers = ({s for i in rewritten for s in graph.succs[i]} - rewritten
               if graph is not None else set())

    def atom(v: Atom) -> Atom:
        if _compat.is_literal(v):
            return v
        if v in dropped:
            raise RuntimeError(f"jaxpar pass bug: a rewrite dropped {v}, which is read "
                               "outside it; please report it with the program")
        return renamed.get(v, v)

    new_eqns: list[JaxprEqn] = []
    new_constvars: list[Var] = []
    new_consts: list[Any] = []
    traced: dict[Hashable, _TracedRewrite] = {} if traces is None else traces
    keep = new_eqns.append
    kept_from: list[int] = []  # per new equation: its old index, or -1 (emitted)
    came_from = kept_from.append
    for unit in order:
        if type(unit) is EqnUnit:
            index = unit.index
            eqn = eqns[index]
            came_from(index)
            if not params and index not in readers:
                keep(eqn)  # the same equation: its origins stay its own
                continue
            new_params = params.get(index)
            if index not in readers or replaced.isdisjoint(map(id, eqn.invars)):
                new_eqn = eqn if new_params is None else _compat.replace_eqn(
                    eqn, params=new_params)
            else:
                new_eqn = _compat.replace_eqn(eqn, invars=[atom(v) for v in eqn.invars],
                                              params=new_params)
            if origins is not None:
                origins.copied(eqn, new_eqn)
            keep(new_eqn)
            continue
        assert isinstance(unit, RewriteUnit)
        rewrite = rewrites[unit.rewrite]
        members = [eqns[i] for i in rewrite.eqns]
        operands = [[atom(v) for v in m.invars] for m in members]
        out_counts = [len(m.outvars) for m in members]
        cache_key = None if rewrite.key is None else (rewrite.key, _pattern(operands))
        hit = traced.get(cache_key) if cache_key is not None else None
        if hit is None:
            hit = _trace_rewrite(rewrite, operands)
            if cache_key is not None:
                hit = traced[cache_key] = hit.with_sources(members)
            constvars, body, flat_outs = hit.splice(operands, fresh=False)
        else:
            constvars, body, flat_outs = hit.splice(operands, fresh=True, members=members)
        new_constvars += constvars
        new_consts += hit.consts
        new_eqns += body
        kept_from += [-1] * len(body)
        if origins is not None:
            origins.emitted(body, members, owners[unit.rewrite] if owners else ())
        outs, start = [], 0
        for count in out_counts:
            outs.append(flat_outs[start:start + count])
            start += count
        for member, values in zip(members, outs, strict=True):
            for var, value in zip(member.outvars, values, strict=True):
                if value is None:
                    dropped.add(var)
                    continue
                if value.aval != var.aval:
                    raise RuntimeError(
                        f"jaxpar pass bug: the rewrite of {member.primitive.name} returns "
                        f"{value.aval} where it replaces {var.aval}; please report it with "
                        "the program that triggered it")
                if not _compat.is_drop_var(var):
                    renamed[var] = value
    rebuilt = _compat.splice_jaxpr(jaxpr, new_eqns, [atom(v) for v in inner.outvars],
                                   new_constvars, new_consts)
    if rebuilt is not None and derive_graph is not None:
        derive_graph(jaxpr, rebuilt, kept_from)
    return rebuilt


def _distinct_atoms(operands: list[list[Any]]) -> list[Any]:
    """One entry per distinct variable, in first-use order: passes recognise shared
    operands by identity, so each becomes one argument of the traced rewrite."""
    return list(dict.fromkeys(a for row in operands for a in row if not _compat.is_literal(a)))


def _pattern(operands: list[list[Any]]) -> Hashable:
    """The operands' types, which of them repeat, and the literal values."""
    first: dict[Any, int] = {}
    out = []
    for row in operands:
        cells = []
        for a in row:
            if _compat.is_literal(a):
                value = _compat.literal_value(a)
                try:
                    hash(value)
                except TypeError:
                    value = ("id", id(a))  # an unhashable literal: never shared
                cells.append(("lit", a.aval, value))
            else:
                cells.append(("var", a.aval, first.setdefault(a, len(first))))
        out.append(tuple(cells))
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class _TracedRewrite:
    """A rewrite traced once: its small jaxpr and which results it computed."""

    jaxpr: JaxprLike  # open
    consts: list[Any]
    computed: list[bool]  # per flat result of the member equations: not None
    # The source info of each member equation it was traced for, and per equation of
    # the small jaxpr the member whose traceback it carries (None: none of them).
    sources: tuple[Any, ...] = ()
    made_under: tuple[int | None, ...] = ()

    def with_sources(self, members: Sequence[JaxprEqn]) -> _TracedRewrite:
        """This trace, remembering under which of ``members`` each equation was made."""
        infos = tuple(m.source_info for m in members)
        owner: IdentityMemo[Any, int] = IdentityMemo()  # a traceback -> its first member
        for j in range(len(infos) - 1, -1, -1):
            owner.set(infos[j].traceback, j)
        return dataclasses.replace(self, sources=infos, made_under=tuple(
            owner.get(e.source_info.traceback) for e in self.jaxpr.eqns))

    def splice(self, operands: list[list[Any]], fresh: bool,
               members: Sequence[JaxprEqn] = ()) -> tuple[list[Any], list[Any], list[Any]]:
        """``(constvars, eqns, flat results)`` reading ``operands``' atoms.

        With ``fresh``, every variable the small jaxpr defines is renamed, so one trace
        can be spliced into a level several times, for the member equations
        ``members``: an equation made under a member's source info gets the source info
        a trace under the corresponding one of ``members`` gives it
        (``_compat.rebased_source``); one made under none keeps its own (jaxpar's code
        under the same call, as that trace would give).
        """
        small = self.jaxpr
        bound: dict[Any, Any] = dict(zip(small.invars, _distinct_atoms(operands), strict=True))
        constvars = list(small.constvars)
        if fresh:
            constvars = [_compat.fresh_var(v) for v in constvars]
            bound.update(zip(small.constvars, constvars, strict=True))

        def atom(v: Atom) -> Atom:
            return v if _compat.is_literal(v) else bound.get(v, v)

        body = []
        under = self.made_under if fresh and members else ()
        for k, eqn in enumerate(small.eqns):
            invars = [atom(v) for v in eqn.invars]
            outvars = source = None
            if fresh:
                outvars = [_compat.fresh_var(v) for v in eqn.outvars]
                bound.update(zip(eqn.outvars, outvars, strict=True))
                j = under[k] if under else None
                if j is not None:
                    source = _compat.rebased_source(eqn.source_info, self.sources[j],
                                                    members[j].source_info)
            body.append(_compat.replace_eqn(eqn, invars=invars, outvars=outvars,
                                            source_info=source))
        results = iter(small.outvars)
        flat_outs = [atom(next(results)) if done else None for done in self.computed]
        return constvars, body, flat_outs


def _trace_rewrite(rewrite: Rewrite, operands: list[list[Any]]) -> _TracedRewrite:
    """Traces ``rewrite.emit`` on ``operands`` (atoms of the level, per member equation).

    Literals are passed to ``emit`` as values, each distinct variable as one argument.
    """
    traced = _distinct_atoms(operands)
    computed: list[bool] = []  # per flat result: did emit compute it (not None)?

    def run(*args: Any) -> list[Any]:
        value = dict(zip(traced, args, strict=True))
        rows = [[_compat.literal_value(a) if _compat.is_literal(a) else value[a]
                 for a in row] for row in operands]
        flat = [v for row in rewrite.emit(rows) for v in row]
        computed.extend(v is not None for v in flat)
        return [v for v in flat if v is not None]

    small, consts = _compat.open_jaxpr(
        _compat.make_closed_jaxpr(run, [a.aval for a in traced]))
    return _TracedRewrite(small, list(consts), computed)


def walk_levels(jaxpr: JaxprLike, level_passes: Sequence[Pass], analysis: Analysis,
                path: str = "") -> tuple[Any, list[PassDecision]]:
    """Runs ``level_passes`` in order at every nesting level of ``jaxpr``, innermost first.

    A level whose own loops were rewritten is walked again, since the loops the passes
    made (a fused body holding two inner scans) may offer new rewrites; so applying the
    passes a second time changes nothing.

    Returns ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.
    """
    decisions: list[PassDecision] = []
    current = jaxpr
    for attempt in range(MAX_ROUNDS):
        new, walk_decisions, level_changed = _walk_once(current, level_passes, analysis, path)
        decisions.extend(d for d in walk_decisions
                         if attempt == 0 or d.kind not in UNCHANGED_KINDS)
        current = new
        if not level_changed:
            if not path:  # the top level: where each decision's equations ended up
                decisions = eqn_origins(analysis).with_products(current, decisions)
            return current, decisions
    raise RuntimeError(f"jaxpar loop passes did not settle after {MAX_ROUNDS} walks at "
                       f"{path or '/'}; please report it with the program")


def _walk_once(jaxpr: JaxprLike, level_passes: Sequence[Pass], analysis: Analysis, path: str
               ) -> tuple[Any, list[PassDecision], bool]:
    inner, _ = _compat.open_jaxpr(jaxpr)
    origins = eqn_origins(analysis)
    decisions: list[PassDecision] = []
    params: dict[int, dict[str, Any]] = {}
    holds: dict[int, set[tuple[int, bool]]] = {}  # equation -> what was made inside it
    for index, eqn in enumerate(inner.eqns):
        replacements = {}
        for name, item, sub in analysis.subjaxprs(eqn):
            label = f"{name}[{item}]" if item is not None else name
            sub_path = f"{path}/{eqn.primitive.name}#{index}.{label}"
            # Rewrites of a nested level are traced where JAX traced that level (a
            # shard_map body with its mesh axes bound).
            with _compat.nested_trace_context(eqn):
                new_sub, sub_decisions = walk_levels(sub, level_passes, analysis, sub_path)
            decisions.extend(sub_decisions)
            if new_sub is not sub:
                replacements[(name, item)] = new_sub
                holds.setdefault(index, set()).update(
                    (origins.number(d), True) for d in sub_decisions
                    if d.kind not in UNCHANGED_KINDS)
        if replacements:
            params[index] = _compat.eqn_replace_subjaxprs(eqn, replacements)
    current = jaxpr
    if params:
        rebuilt = rebuild_level(jaxpr, [], params, origins=origins)
        if rebuilt is None:
            return jaxpr, _as_left_alone(decisions, "the enclosing jaxpr cannot take new "
                                                    "constants, so its rewrite was dropped"), False
        current = rebuilt
        new_eqns = _compat.open_jaxpr(rebuilt)[0].eqns  # in the same order
        for index, made in holds.items():
            origins.add(new_eqns[index], made)
    # Rounds until nothing changes: fusing scans of unequal lengths leaves remainder scans
    # that may fuse or batch with others, and a second application must change nothing.
    # "Left alone" and "host-sync" notes describe the level as it came in (the first round);
    # later rounds only see loops the passes made.
    changes: list[PassDecision] = []
    kept: list[PassDecision] = []
    level_changed = False
    for round_index in range(MAX_ROUNDS):
        changed = False
        for level_pass in level_passes:
            graph = analysis.graph(current)
            step = _pass_step(level_pass, current, path, graph, analysis)
            rewrites, level_decisions = step.rewrites, step.decisions
            if round_index > 0:
                level_decisions = [d for d in level_decisions
                                   if d.kind not in UNCHANGED_KINDS]
            if rewrites:
                rebuilt = step.rebuilt
                if rebuilt is None:
                    rebuilt = step.rebuilt = rebuild_level(
                        current, rewrites, graph=graph,
                        orders=analysis.shared_memo("emission_order"), origins=origins,
                        owners=_owners(rewrites, level_decisions, origins),
                        traces=None if path else analysis.shared_state("top_level_traces",
                                                                       dict),
                        derive_graph=analysis.derive_graph)
                if rebuilt is None:
                    kept.extend(_as_left_alone(
                        level_decisions, "this jaxpr cannot take new constants, so the "
                                         "rewrite was dropped"))
                    continue
                current = rebuilt
                changed = level_changed = True
            changes.extend(d for d in level_decisions if d.kind not in UNCHANGED_KINDS)
            kept.extend(d for d in level_decisions if d.kind in UNCHANGED_KINDS)
        if not changed:
            break
    else:
        raise RuntimeError(f"jaxpar loop passes did not settle after {MAX_ROUNDS} rounds at "
                           f"{path or '/'}; please report it with the program")
    decisions.extend(changes)
    decisions.extend(kept)
    return current, decisions, level_changed


@dataclasses.dataclass(slots=True)
class _Step:
    """What one pass did to one level (at one path): its rewrites, its decisions
    (stamped with the pass's name) and, once rebuilt, the level they make."""

    level: Any
    rewrites: list[Rewrite]
    decisions: list[PassDecision]
    rebuilt: Any = None


# The ways a mode prices launches (``_cost.launch_pricing``).
_PRICINGS = ("serial", "beside")


def _pass_step(level_pass: Pass, jaxpr: Any, path: str, graph: Graph,
               analysis: Analysis) -> _Step:
    """``level_pass`` run on the level ``jaxpr`` at ``path``, or what it did there in
    another CUDA-graph mode (the ``"pass_steps"`` shared memo).

    The program is analysed again in each mode that prices launches otherwise
    (``_api._analyse_priced``). A pass's first visit of a level in a walk is a
    deterministic function of the level, the path and the settings, so the first visit
    in another mode (the same settings but the mode) gets the same step: its decisions
    (the same objects, so ``EqnOrigins``' records of the equations made hold for both)
    and its rebuilt level. A pass that prices launches is run again in a mode that
    prices them otherwise unless it said it decides alike in both (``decided_alike``);
    where it decides exactly as it did in the other pricing (equal decisions, rewrites
    of the same equations and keys: the same groups), it takes the other's step, rebuilt
    level included, so the walks of the two modes share every level from there on.
    Later visits in a walk run the pass (they answer from its own memos,
    ``searched_in_vain``), but for a visit of a level at a path where the pass, visiting
    it before, changed nothing and reported only what it left alone (``_barren``): by
    the same determinism it would again, and the walk drops such reports after a
    level's first round (and a walk's first), which is the only time such a visit can
    come, so it gets an empty step without running the pass.
    """
    visits = analysis.memo("pass_visits")
    barren = analysis.memo("barren_visits")
    if visits.get(jaxpr, extra=level_pass.name):
        if barren.get(jaxpr, extra=(level_pass.name, path)):
            return _Step(jaxpr, [], [])
        step = _run_step(level_pass, jaxpr, path, graph, analysis)[0]
        if _barren(step):
            barren.set(jaxpr, True, extra=(level_pass.name, path))
        return step
    visits.set(jaxpr, True, extra=level_pass.name)
    step = _first_step(level_pass, jaxpr, path, graph, analysis)
    if _barren(step):
        barren.set(jaxpr, True, extra=(level_pass.name, path))
    return step


def _barren(step: _Step) -> bool:
    """Whether ``step`` changed nothing and reports only what it left alone."""
    return not step.rewrites and all(d.kind in UNCHANGED_KINDS for d in step.decisions)


def _first_step(level_pass: Pass, jaxpr: Any, path: str, graph: Graph,
                analysis: Analysis) -> _Step:
    """``_pass_step`` for the pass's first visit of the level in this walk."""
    steps: IdentityMemo[JaxprLike, _Step] = analysis.shared_memo("pass_steps")
    settings = analysis.settings
    base = (path, level_pass.name, dataclasses.replace(settings, command_buffers=None))
    pricing = launch_pricing(settings.command_buffers) if level_pass.prices_launches else None
    hit = steps.get(jaxpr, extra=(*base, pricing))
    if hit is not None:
        # What the pass remembers of its visit (``searched_in_vain``), as if it ran.
        remember_search(analysis, level_pass.name, jaxpr, hit.rewrites)
        return hit
    step, alike = _run_step(level_pass, jaxpr, path, graph, analysis)
    if pricing is not None and alike:
        for other in _PRICINGS:
            steps.set(jaxpr, step, extra=(*base, other))
    elif pricing is not None:
        for other in _PRICINGS:
            twin = steps.get(jaxpr, extra=(*base, other))
            if (other != pricing and twin is not None
                    and twin.decisions == step.decisions
                    and [(r.eqns, r.key) for r in twin.rewrites]
                    == [(r.eqns, r.key) for r in step.rewrites]):
                step = twin
                break
    steps.set(jaxpr, step, extra=(*base, pricing))
    return step


def _run_step(level_pass: Pass, jaxpr: Any, path: str, graph: Graph,
              analysis: Analysis) -> tuple[_Step, bool]:
    """The pass run on the level, and whether it said it decides alike in every launch
    pricing (``decided_alike``)."""
    rewrites, decisions = level_pass.run(Level(jaxpr, path, graph), analysis)
    told = analysis.memo("decided_alike")
    alike = bool(told.get(jaxpr, extra=path))
    if alike:
        told.set(jaxpr, False, extra=path)
    return _Step(jaxpr, rewrites, [dataclasses.replace(d, pass_name=level_pass.name)
                                   for d in decisions]), alike


def searched_in_vain(analysis: Analysis, name: str, jaxpr: Any) -> bool:
    """Whether the pass ``name`` searched the level ``jaxpr`` earlier in this walk and
    found nothing to rewrite (``remember_search``): a pass that answers ``([], [])``
    then is not searched again (``_pass_step`` keeps this memo as the pass would)."""
    return bool(analysis.memo("searched_in_vain").get(jaxpr, extra=name))


def remember_search(analysis: Analysis, name: str, jaxpr: Any, rewrites: Sequence[Rewrite]
                    ) -> None:
    """Records that the pass ``name`` searched the level ``jaxpr`` (in vain where
    ``rewrites`` is empty; see ``searched_in_vain``)."""
    if not rewrites:
        analysis.memo("searched_in_vain").set(jaxpr, True, extra=name)


def decided_alike(analysis: Analysis, level: Level) -> None:
    """Tells the walk that what the pass that prices launches (``Pass.prices_launches``)
    now running returns for ``level`` holds in every launch pricing: each of its verdicts
    would be the same in a mode pricing launches otherwise (its decisions do not say
    what a launch costs)."""
    analysis.memo("decided_alike").set(level.jaxpr, True, extra=level.path)


def _owners(rewrites: Sequence[Rewrite], decisions: Sequence[PassDecision],
            origins: EqnOrigins) -> list[set[int]]:
    """Per rewrite, the numbers of the changing decisions about equations it replaces."""
    about: dict[int, list[int]] = {}
    for d in decisions:
        if d.kind not in UNCHANGED_KINDS:
            number = origins.number(d)
            for i in d.eqns:
                about.setdefault(i, []).append(number)
    return [{k for i in r.eqns for k in about.get(i, ())} for r in rewrites]


def _as_left_alone(decisions: Sequence[PassDecision], why: str) -> list[PassDecision]:
    return [d if d.kind in (DecisionKind.LEFT_ALONE, DecisionKind.HOST_SYNC)
            else dataclasses.replace(d, kind=DecisionKind.LEFT_ALONE, trips_after=d.trips_before,
                                     reason=f"{d.reason}; but {why}")
        for d in decisions]


def loop_trips(length: int, unroll: int) -> int:
    """The trips of a scan of ``length`` steps unrolled by ``unroll``: each trip of
    XLA's loop runs ``unroll`` steps, and the remainder takes one more (what
    ``PassDecision.trips_before``/``trips_after`` count)."""
    return -(-length // max(unroll, 1))


def loop_candidate(eqn: JaxprEqn) -> bool:
    """Whether a scan may be merged or re-emitted: no effects, no user placement."""
    return (eqn.primitive.name == SCAN and not eqn.effects
            and not _compat.has_frontend_attributes(eqn))


def loop_candidates(eqns: Sequence[JaxprEqn]) -> list[int]:
    """The indices of ``eqns`` that are ``loop_candidate`` s (the primitive's name is
    read inline first: the passes ask this of every equation of every level they
    visit, and most are not scans)."""
    return [i for i, e in enumerate(eqns) if e.primitive.name == SCAN and loop_candidate(e)]
