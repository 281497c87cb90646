"""Share common subexpressions before planning, as XLA would have.

XLA's CSE computes ``lu(s)`` once when ``slogdet(s)`` and ``inv(s)`` both need it.
Once the planner put the two in different stream regions, each region would run
its own: a stream call is opaque to XLA's CSE. So equations that compute the same
thing (same primitive, parameters equal by value, same operands) are merged here,
before planning: the first one stays, the others read its results.

Equal work in different nested calls (``slogdet``'s ``lu`` inside its ``custom_jvp``
and ``lu_factor``'s) cannot be merged without changing the calls; the planner's
pricing (``_plan.pricing``) refuses a cut between such twins instead.

Example::

    new_jaxpr, _ = share_common(jax.make_jaxpr(f)(s))

Sharp edges:
  * Equations with effects, callbacks, and equations holding nested jaxprs that are
    not the very same object are never merged (their identity may matter).
  * The merge happens before the user differentiates the program, so twins holding
    anything whose differentiation rule or effect would see the merge (a ``custom_vjp``,
    whose backward rule would get the twins' cotangents summed; effects, host calls or
    user placement at any depth, ``custom_jvp`` rules included: ``_batchable.merge_refusal``)
    are left alone, with the reason among the decisions.
  * Parameters are compared structurally (``jaxpar._program.structure``): by value, arrays by
    their bytes, callables by identity, so two different callables never compare equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, cast

from .. import _compat, _ops
from .._analysis import Analysis
from .._compat import JaxprEqn
from .._memo import IdentityMemo
from .._program.primitives import NEVER_SHARED
from .._program.structure import StructuralKeys
from ._batchable import MergeMemo, merge_refusal
from ._protocol import DecisionKind, Level, LevelResult, PassDecision, Rewrite, decision


def _eqn_key(eqn: JaxprEqn, keys: StructuralKeys, aval_text: dict[Any, str] | None = None
             ) -> Hashable | None:
    """Equal for two equations that compute the same results; None: never share.

    ``aval_text`` memoises ``str(aval)`` by value for one level (equal avals print the
    same; printing is most of the cost of a key).
    """
    if eqn.effects or eqn.primitive.name in NEVER_SHARED:
        return None
    if _ops.has_frontend_attributes(eqn):
        return None
    text = {} if aval_text is None else aval_text

    def aval_str(aval: Any) -> str:
        printed = text.get(aval)
        if printed is None:
            printed = text[aval] = str(aval)
        return printed

    operands = tuple(("lit", aval_str(a.aval), repr(_compat.literal_value(a)))
                     if _compat.is_literal(a) else ("var", id(a)) for a in eqn.invars)
    return (keys.equation(eqn), operands, tuple(aval_str(v.aval) for v in eqn.outvars))


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: one rewrite per class of equal equations (more than one member).

    A level found to have nothing to share is not searched again (the row
    ``remembers_search``): the pass is a function of the level alone, and later rounds
    see the same level objects again. Equation keys, their buckets and merge refusals
    are kept in the pass's ``State`` (its row's; functions of the equation alone).
    """
    own: State = level.state if level.state is not None else State()
    rewrites, decisions = _share_level(level, analysis.structural_keys, own.merges,
                                       own.keys, own.buckets)
    return LevelResult(rewrites, decisions)


@dataclasses.dataclass(slots=True)
class State:
    """The pass's state for a call (its row's ``state``, shared by every mode): per
    equation its key and bucket, and the merge refusals (functions of the equation)."""

    merges: MergeMemo = dataclasses.field(default_factory=IdentityMemo)
    keys: IdentityMemo[JaxprEqn, Hashable | None] = dataclasses.field(
        default_factory=IdentityMemo)
    buckets: IdentityMemo[JaxprEqn, Hashable] = dataclasses.field(default_factory=IdentityMemo)


def _share_level(level: Level, keys: StructuralKeys,
                 merges: MergeMemo,
                 eqn_keys: IdentityMemo[JaxprEqn, Hashable | None] | None = None,
                 eqn_buckets: IdentityMemo[JaxprEqn, Hashable] | None = None
                 ) -> tuple[list[Rewrite], list[PassDecision]]:
    inner, _ = _compat.open_jaxpr(level.jaxpr)
    eqns = inner.eqns
    # Equal equations read the same variables (and literals at the same places) with the
    # same primitive: bucket by that first, and key only buckets of two or more (in most
    # levels nearly every equation is alone in its bucket). A bucket is a function of the
    # equation alone (the ids of its operands stay unique while the memo keeps it, and
    # with it its operands, alive): kept across rounds, a rebuilt level finds the buckets
    # of the equations it kept.
    eqn_buckets = IdentityMemo() if eqn_buckets is None else eqn_buckets
    literal = _compat.Literal
    cheap_keys = eqn_buckets.get_all(eqns)
    made: list[tuple[JaxprEqn, Hashable]] = []
    for index, cheap in enumerate(cheap_keys):
        if cheap is None:
            eqn = eqns[index]
            cheap_keys[index] = cheap = (
                eqn.primitive, len(eqn.outvars),
                tuple([None if isinstance(a, literal) else id(a) for a in eqn.invars]))
            made.append((eqn, cheap))
    eqn_buckets.set_all(made)
    if len(set(cheap_keys)) == len(cheap_keys):  # no two alike (most levels)
        return [], []
    # An equation's key is a function of the equation alone (it names its operands by
    # identity): kept across rounds, a rebuilt level keys only the equations it made.
    eqn_keys = IdentityMemo() if eqn_keys is None else eqn_keys
    classes = _classes(eqns, cheap_keys, _Keys(keys, eqn_keys), merges)
    rewrites: list[Rewrite] = []
    decisions: list[PassDecision] = []
    # In order of each class's first equation, as a single keyed sweep gives them.
    for members in sorted(classes.values(), key=lambda m: m[0]):
        if len(members) < 2:
            continue
        first = eqns[members[0]]
        count = len(members)
        why = merge_refusal(first, merges)  # the same for every member: they are equal
        if why is not None:
            decisions.append(decision(
                level.path, DecisionKind.LEFT_ALONE, eqns, members, trips_before=None,
                trips_after=None, unroll=None,
                reason=f"{count} equal equations computed once each, not shared: {why}"))
            continue

        def emit(invals: list[list[Any]], eqn: JaxprEqn = first, count: int = count
                 ) -> list[list[Any]]:
            outs = _compat.bind_eqn(eqn, invals[0])
            return [list(outs) for _ in range(count)]

        rewrites.append(Rewrite(tuple(members), emit))
    return rewrites, decisions


class _Keys:
    """Equations' keys for one level, memoised per equation (``_eqn_key``)."""

    def __init__(self, keys: StructuralKeys, memo: IdentityMemo[JaxprEqn, Hashable | None]):
        self.keys, self.memo = keys, memo
        self.aval_text: dict[Any, str] = {}

    def of(self, eqn: JaxprEqn) -> Hashable | None:
        if eqn in self.memo:
            return self.memo.get(eqn)
        key = _eqn_key(eqn, self.keys, self.aval_text)
        self.memo.set(eqn, key)
        return key


def _classes(eqns: Sequence[JaxprEqn], cheap_keys: Sequence[Hashable], keys: _Keys,
             merges: MergeMemo) -> dict[Hashable, list[int]]:
    """The classes of equal equations, found in one sweep in program order (value
    numbering): an equation reading what a merged twin computes reads, once merged, what
    the class's first member computes, so a chain computed twice is one class per link,
    not one link per round. Twins a merge refusal keeps apart stay apart for their
    readers too."""
    canon: dict[Any, Any] = {}  # a merged twin's result -> the first member's
    # The ids of those twins' results (alive in ``eqns`` for the sweep): an equation
    # whose bucket key names none of them keeps its memoised key as it is.
    merged: set[int] = set()
    first_of: dict[Hashable, int] = {}  # canonical bucket key -> its first equation
    classes: dict[Hashable, list[int]] = {}
    for index, eqn in enumerate(eqns):
        cheap = cheap_keys[index]
        if merged and not merged.isdisjoint(cast(tuple[Any, int, tuple[Any, ...]], cheap)[2]):
            cheap = _canonical_cheap(eqn, canon)
        other = first_of.setdefault(cheap, index)
        if other == index:
            continue
        key = _canonical_key(keys.of(eqn), eqn, canon)
        if key is None:
            continue
        members = classes.get(key)
        if members is None:
            if _canonical_key(keys.of(eqns[other]), eqns[other], canon) != key:
                classes[key] = [index]  # alike operands, not equal (another parameter)
                continue
            members = classes[key] = [other]
        members.append(index)
        if merge_refusal(eqns[members[0]], merges) is None:
            canon.update(zip(eqn.outvars, eqns[members[0]].outvars, strict=True))
            merged.update(map(id, eqn.outvars))
    return classes


def _canonical_cheap(eqn: JaxprEqn, canon: dict[Any, Any]) -> Hashable:
    """``eqn``'s bucket key (primitive, results, operand ids), reading merged twins'
    results as their first member's."""
    return (eqn.primitive, len(eqn.outvars),
            tuple([None if _compat.is_literal(a) else id(canon.get(a, a))
                   for a in eqn.invars]))


def _canonical_key(key: Hashable | None, eqn: JaxprEqn, canon: dict[Any, Any]
                   ) -> Hashable | None:
    """``eqn``'s ``_eqn_key``, reading merged twins' results as their first member's."""
    if key is None or not canon:
        return key
    equation, operands, outs = cast(tuple[Any, tuple[tuple[Any, ...], ...], Any], key)
    return equation, tuple([op if op[0] != "var" else ("var", id(canon.get(a, a)))
                            for op, a in zip(operands, eqn.invars, strict=True)]), outs
