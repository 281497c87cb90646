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
    user placement at any depth, ``custom_jvp`` rules included: ``_shared.merge_refusal``)
    are left alone, with the reason among the decisions.
  * Parameters are compared structurally (``jaxpar._structure``): by value, arrays by
    their bytes, callables by identity, so two different callables never compare equal.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Hashable
from typing import Any

from .. import _compat
from .._analysis import Analysis
from .._compat import JaxprEqn
from .._memo import IdentityMemo
from .._primitives import NEVER_SHARED
from .._structure import StructuralKeys
from ._protocol import DecisionKind, Level, LevelResult, PassDecision, Rewrite, decision
from ._shared import MergeMemo, merge_refusal


def _eqn_key(eqn: JaxprEqn, keys: StructuralKeys, aval_text: dict[Any, str] | None = None
             ) -> Hashable | None:
    """Equal for two equations that compute the same results; None: never share.

    ``aval_text`` memoises ``str(aval)`` by value for one level (equal avals print the
    same; printing is most of the cost of a key).
    """
    if eqn.effects or eqn.primitive.name in NEVER_SHARED:
        return None
    if _compat.has_frontend_attributes(eqn):
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
    buckets: dict[Hashable, list[int]] = {}
    counts = Counter(cheap_keys)
    if len(counts) < len(cheap_keys):  # some bucket holds two or more
        for index, cheap in enumerate(cheap_keys):
            if counts[cheap] > 1:
                buckets.setdefault(cheap, []).append(index)
    classes: dict[Hashable, list[int]] = {}
    aval_text: dict[Any, str] = {}
    # An equation's key is a function of the equation alone (it names its operands by
    # identity): kept across rounds, a rebuilt level keys only the equations it made.
    eqn_keys = IdentityMemo() if eqn_keys is None else eqn_keys
    for bucket in buckets.values():
        for index in bucket:
            eqn = eqns[index]
            if eqn in eqn_keys:
                key = eqn_keys.get(eqn)
            else:
                key = _eqn_key(eqn, keys, aval_text)
                eqn_keys.set(eqn, key)
            if key is not None:
                classes.setdefault(key, []).append(index)
    rewrites: list[Rewrite] = []
    decisions: list[PassDecision] = []
    # In order of each class's first equation, as a single keyed sweep would give.
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
