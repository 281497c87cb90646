"""The splice: a level with some rewrites applied (``rebuild_level``), and the records
of which decisions made which equations (``EqnOrigins``).

``rebuild_level`` traces each rewrite (``_protocol.Rewrite``) on its own and splices
its equations into the level at a point where all its inputs exist (the order comes
from ``_program.graph.contract``, which contracts each rewrite's equations to one unit); the
untouched equations are kept as they are.

Example::

    new_level = rebuild_level(level.jaxpr, result.rewrites, graph=level.graph)

Every equation a rewrite emits is recorded as made by the decisions about the
equations it replaces (``EqnOrigins``, one per call in the ``Analysis``); a copy of an
equation, a rewrite of a made equation, and an equation whose nested jaxprs were
rewritten carry those records on. When the walk of the top level ends, each decision
gets ``produced``: where its equations are in the rewritten program (``Product``), read
from the records and not matched by primitive or source line.

Sharp edges:
  * A rewrite's equations are recorded as a whole: every decision about the equations
    one rewrite replaces (the groups of one ``batch_matmuls`` unit) owns all of them.
  * A nested open jaxpr (``remat`` bodies up to jax 0.10) whose rewrite would
    capture constants cannot be replaced: ``rebuild_level`` returns None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from .. import _compat
from .._analysis import Analysis, OrderMemo
from .._compat import Atom, JaxprEqn, JaxprLike, Var
from .._memo import IdentityMemo
from .._program.graph import (
    ContractionCycle,
    EqnUnit,
    Graph,
    RewriteUnit,
    Unit,
    build_graph,
    contract,
    eqn_units,
)
from .._program.interp import Env
from ._protocol import PassDecision, Product, Rewrite


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


@dataclasses.dataclass(slots=True)
class Splices:
    """What the rebuilds of one call's program keep for the call, in every CUDA-graph
    mode's walk (``analysis.shared.of(Splices)``)."""

    # Which decisions made which equations (``eqn_origins``): the walker's rebuilds.
    origins: EqnOrigins = dataclasses.field(default_factory=EqnOrigins)
    # The top level's rewrites traced, by key and operand pattern (``rebuild_level``'s
    # ``traces``): the walker's rebuilds of top levels.
    top_level_traces: dict[Hashable, _TracedRewrite] = dataclasses.field(default_factory=dict)


def eqn_origins(analysis: Analysis) -> EqnOrigins:
    """The call's ``EqnOrigins`` (``Splices.origins``: the analyses of every CUDA-graph
    mode share the steps that made the equations)."""
    return analysis.shared.of(Splices).origins

def evaluate(jaxpr: JaxprLike, *args: Any) -> list[Any]:
    """Evaluates a closed or open jaxpr under the current trace, keeping source info."""
    inner, consts = _compat.open_jaxpr(jaxpr)
    env = Env()
    env.write(inner.constvars, consts)
    env.write_inputs(inner.invars, args)
    env.bind(inner.eqns)
    return env.read_all(inner.outvars)


def emission_order(graph: Graph, groups: Sequence[Sequence[int]],
                   memo: OrderMemo | None = None) -> tuple[Unit, ...] | None:
    """Emission units with each group contracted (``RewriteUnit(k)`` for ``groups[k]``),
    or None if contracting makes a cycle.

    ``memo`` (``SharedMemos.emission_order``) keeps the last answer per graph: a pass that checked
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
            raise RuntimeError("jaxpar pass bug: merged loops depend on each other; "
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
        hit, (constvars, body, flat_outs) = _traced(rewrite, members, operands, traced)
        new_constvars += constvars
        new_consts += hit.consts
        new_eqns += body
        kept_from += [-1] * len(body)
        if origins is not None:
            origins.emitted(body, members, owners[unit.rewrite] if owners else ())
        _take_results(members, out_counts, flat_outs, renamed, dropped)
    rebuilt = _compat.splice_jaxpr(jaxpr, new_eqns, [atom(v) for v in inner.outvars],
                                   new_constvars, new_consts)
    if rebuilt is not None and derive_graph is not None:
        derive_graph(jaxpr, rebuilt, kept_from)
    return rebuilt


def _traced(rewrite: Rewrite, members: list[JaxprEqn], operands: list[list[Any]],
            traced: dict[Hashable, _TracedRewrite]
            ) -> tuple[_TracedRewrite, tuple[list[Any], list[Any], list[Any]]]:
    """``rebuild_level``'s trace of ``rewrite`` (copied from ``traced`` where its key and
    operand pattern were traced before), and its splice (constvars, equations, results)."""
    cache_key = None if rewrite.key is None else (rewrite.key, _pattern(operands))
    hit = traced.get(cache_key) if cache_key is not None else None
    if hit is None:
        hit = _trace_rewrite(rewrite, operands)
        if cache_key is not None:
            hit = traced[cache_key] = hit.with_sources(members)
        return hit, hit.splice(operands, fresh=False)
    return hit, hit.splice(operands, fresh=True, members=members)


def _take_results(members: list[JaxprEqn], out_counts: list[int], flat_outs: Sequence[Any],
                  renamed: dict[Any, Any], dropped: set[Any]) -> None:
    """Record which atoms now hold the replaced ``members``' results (``renamed``), and
    which results their rewrite did not compute (``dropped``)."""
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

