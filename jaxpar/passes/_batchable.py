"""What the batching passes may put under ``vmap``: which equations batch faithfully and
cheaply (an allow-list of primitive families, checked recursively), and which may be
computed once for several members (``merge_refusal``).

``batch_scans`` and ``batch_branches`` run several members as one ``vmap``ped
computation. That is only right where ``vmap`` maps each primitive *faithfully*
(member ``m`` of the batched result is what the member computed alone) and
*cheaply* (the batched form does the members' work, not more). This module says
where that holds (``_batch_members.vmap_members`` emits the batched computation).

Why an allow-list, not a deny-list: a primitive's batching rule is whatever its
author wrote, and the ones that are not faithful or cheap are not marked. Some
known ones: ``random_bits`` on ``rbg``/``unsafe_rbg`` keys draws different numbers
for a batch of keys than for each key alone; ``rng_bit_generator`` likewise;
``pure_callback`` without a ``vmap_method`` raises; a ``cond`` whose predicate
differs per member becomes a ``select`` that runs every branch for every member,
and a ``while`` whose predicate differs runs every member to the longest trip
count. A deny-list would have to know every such rule, including those of
primitives added by JAX releases and libraries after it was written; an
allow-list of the families whose rules are plain batch dimensions (elementwise
and structural ops, reductions, ``dot_general``/``conv``, sorting, FFT,
threefry random bits) errs on the side of leaving code unbatched, which costs
speed, never correctness. Primitives holding jaxprs (``jit``, ``remat``,
``custom_jvp_call``, ``scan``, ``cond``, ``while``) are
allowed when everything inside them is, checked recursively with the batched
operands followed through: a ``cond``'s index and a ``while``'s predicate must
not depend on a stacked operand (members sharing them, the same variable in
every member, are fine: ``vmap`` then keeps one predicate).

Differentiating the batched program runs the members' custom rules under the
same ``vmap``: a ``custom_jvp``'s rule is checked like its primal (its jaxpr comes
from the call's own memoised thunk), a ``custom_vjp`` is refused (its backward
rule is an opaque Python function). Host callbacks are refused whatever
``vmap_method`` they declare: the program never vmapped them, and a callback may
be right only for the shapes it was written for.

An equation that reads no stacked value runs once, outside the batch, for every
member: a merge, like ``share_common``'s, made before the user differentiates the
program. ``merge_refusal`` says when that is not faithful (an effect, a host call,
a ``custom_vjp`` anywhere inside), and the checker refuses such members.

Example::

    equation_refusal(scan_eqn, batched=[True, False, True])  # None: faithful and cheap

Sharp edges:
  * ``sharding_constraint``, collectives, linear-algebra decompositions and
    custom primitives are not on the list: members using them are left alone. A
    ``psum``/``pmax``/``pmin`` over positional axes only (a ``vmap`` axis name) is a
    local reduction, and is.
  * An equation none of whose inputs is batched runs once, unbatched, so the list
    does not apply to it (``merge_refusal`` does).
  * Checking a ``custom_jvp`` rule traces it (once per call: JAX memoises the
    thunk and differentiation reuses it), so a Python ``print`` in a rule shows
    during the analysis. Rules are followed two deep (a rule often calls its own
    primal, relu's for one); deeper ones count as their primal, which only third
    and higher derivatives would run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import _compat
from .._compat import Atom, JaxprEqn, JaxprLike
from .._memo import IdentityMemo
from .._program import primitives as _primitives

# Families whose batching rule adds a batch dimension and nothing else.
FAITHFUL_PRIMITIVES: frozenset[str] = _primitives.BATCH_FAITHFUL

# A rule looks at one equation and which of its inputs are batched; it returns its
# ``Faithfulness``: why batching it is not faithful or cheap (None: it is) and which
# results are batched.
Faithfulness = tuple[str | None, list[bool]]
BatchingRule = Callable[["_Checker", Any, list[bool]], Faithfulness]
batching_rules: dict[str, BatchingRule] = {}


def _register(*names: str) -> Callable[[BatchingRule], BatchingRule]:
    def decorate(rule: BatchingRule) -> BatchingRule:
        for name in names:
            batching_rules[name] = rule
        return rule
    return decorate


def equation_refusal(eqn: JaxprEqn, batched: Sequence[bool]) -> str | None:
    """Why ``vmap`` of ``eqn`` over its batched operands would not be faithful and cheap.

    Args:
        eqn: an equation.
        batched: per operand, whether it is stacked (differs per member).

    Returns:
        None when batching is faithful and cheap; else the reason, naming the
        primitive and its source line.
    """
    return _Checker().eqn(eqn, list(batched))[0]


def equations_refusal(eqns: Sequence[JaxprEqn], batched: Mapping[Any, bool]) -> str | None:
    """``equation_refusal`` for equations of one level run in order under one ``vmap``;
    ``batched`` says which variables they read from outside are stacked (others: not)."""
    return _Checker().walk(eqns, dict(batched))[0]


def static_refusal(eqn: JaxprEqn) -> str | None:
    """Why ``eqn`` could never be batched, whatever its operands, or None: a primitive
    off the list anywhere inside it (``cond`` indexes and ``while`` predicates are
    judged later, with the members' operands)."""
    return _Checker(static=True).eqn(eqn, [True] * len(eqn.invars))[0]


def refusal_reads_operand_types(eqn: JaxprEqn) -> bool:
    """Whether ``static_refusal(eqn)`` reads the types of ``eqn``'s operands and results
    (the random primitives: their key types); for every other equation it depends only
    on the primitive, the parameters (nested jaxprs included) and the operand count."""
    return batching_rules.get(eqn.primitive.name) is _random_rule


class _Checker:
    """Walks equations following which values are batched; memoises nested jaxprs.

    ``static``: judge only the primitives (every value may be batched, but conds and
    whiles are not refused for their predicates).
    """

    def __init__(self, static: bool = False) -> None:
        self.static = static
        # By jaxpr, with which inputs are batched and the rule depth.
        self._memo: IdentityMemo[_compat.Jaxpr, Faithfulness] = IdentityMemo()
        self._merges: MergeMemo = IdentityMemo()
        self.rule_depth = 0  # custom_jvp rules being checked, one inside the other

    def jaxpr(self, inner: _compat.Jaxpr, batched: list[bool]) -> Faithfulness:
        extra = (tuple(batched), self.rule_depth)
        hit = self._memo.get(inner, extra=extra)
        if hit is not None:
            return hit
        flags: dict[Atom, bool] = dict(zip(inner.invars, batched, strict=True))
        flags.update((v, False) for v in inner.constvars)
        why, flags = self.walk(inner.eqns, flags)
        verdict = (why, [False if _compat.is_literal(v) else flags.get(v, False)
                         for v in inner.outvars])
        self._memo.set(inner, verdict, extra=extra)
        return verdict

    def walk(self, eqns: Sequence[JaxprEqn], flags: dict[Atom, bool]
             ) -> tuple[str | None, dict[Atom, bool]]:
        for eqn in eqns:
            ins = [False if _compat.is_literal(a) else flags.get(a, False) for a in eqn.invars]
            why, outs = self.eqn(eqn, ins)
            if why is not None:
                return why, flags
            flags.update(zip(eqn.outvars, outs, strict=True))
        return None, flags

    def eqn(self, eqn: JaxprEqn, batched: list[bool]) -> Faithfulness:
        if not any(batched):
            # vmap runs it once, outside the batch, for every member: as if merged.
            why = merge_refusal(eqn, self._merges)
            if why is not None:
                return (f"it reads no per-member value, so the batched form would run it "
                        f"once for all members, but {why}"), []
            return None, [False] * len(eqn.outvars)
        name = eqn.primitive.name
        if name in _primitives.HOST_CALLBACKS:
            return (f"`{name}`{_where(eqn)} calls the host, written for the shapes it is "
                    "called with; the program never vmaps it, so jaxpar does not either "
                    "(whatever its vmap_method says)"), []
        if name not in FAITHFUL_PRIMITIVES:
            return (f"`{name}`{_where(eqn)} is not known to batch "
                    "faithfully and cheaply under vmap"), []
        if self.static and name in _DYNAMIC:
            return _static_rule(self, eqn, batched)
        return batching_rules.get(name, _elementwise_rule)(self, eqn, batched)


_DYNAMIC = _primitives.BATCH_DYNAMIC

# How deep custom_jvp rules are checked: a rule often calls its own primal (relu's rule
# holds relu's custom_jvp_call, whose rule holds another...), so the chain never ends.
# Two levels cover first and second derivatives; rules deeper down count as their
# primal (a sharp edge for third and higher derivatives).
RULE_DEPTH = 2


def _elementwise_rule(checker: _Checker, eqn: JaxprEqn, batched: list[bool]) -> Faithfulness:
    """A plain batch dimension: every result is batched; nested jaxprs checked."""
    for _, _, sub in _compat.eqn_subjaxprs(eqn):
        inner, _ = _compat.open_jaxpr(sub)
        sub_batched = (batched if len(inner.invars) == len(batched)
                       else [True] * len(inner.invars))
        why, _ = checker.jaxpr(inner, list(sub_batched))
        if why is not None:
            return why, []
    return None, [True] * len(eqn.outvars)


def _static_rule(checker: _Checker, eqn: JaxprEqn, batched: list[bool]) -> Faithfulness:
    """Conds, whiles and scans before their operands are known: only their bodies'
    primitives are checked (every input batched, predicates not)."""
    for _, _, sub in _compat.eqn_subjaxprs(eqn):
        inner, _ = _compat.open_jaxpr(sub)
        why, _ = checker.jaxpr(inner, [True] * len(inner.invars))
        if why is not None:
            return why, []
    return None, [True] * len(eqn.outvars)


@_register(_primitives.CUSTOM_VJP_CALL)
def _custom_vjp_rule(checker: _Checker, eqn: JaxprEqn, batched: list[bool]) -> Faithfulness:
    return (f"`{eqn.primitive.name}`{_where(eqn)} is a custom_vjp: differentiating the "
            "batched program would run its backward rule, an opaque Python function "
            "jaxpar cannot check, under a vmap the program never had"), []


@_register(_primitives.CUSTOM_JVP_CALL)
def _custom_jvp_rule(checker: _Checker, eqn: JaxprEqn, batched: list[bool]) -> Faithfulness:
    """The primal jaxpr, and the jvp rule that differentiating the batched program runs
    under the same vmap (a tangent is batched where its primal is)."""
    why, outs = _elementwise_rule(checker, eqn, batched)
    if why is not None or checker.rule_depth >= RULE_DEPTH:
        return why, outs
    found = _compat.custom_jvp_rule(eqn)
    if found is None:
        return (f"the jvp rule of `{eqn.primitive.name}`{_where(eqn)} cannot be inspected, "
                "and differentiating the batched program would run it under vmap"), []
    rule, num_consts = found
    primals = batched[num_consts:]
    checker.rule_depth += 1
    try:
        why, _ = checker.jaxpr(_compat.open_jaxpr(rule)[0], primals + primals)
    finally:
        checker.rule_depth -= 1
    if why is not None:
        return (f"differentiating the batched program would run the jvp rule of "
                f"`{eqn.primitive.name}`{_where(eqn)} under vmap: {why}"), []
    return None, outs


@_register(*sorted(_primitives.AXES_REDUCTIONS))
def _local_reduction_rule(checker: _Checker, eqn: JaxprEqn, batched: list[bool]) -> Faithfulness:
    if _primitives.is_collective(eqn):
        return (f"`{eqn.primitive.name}`{_where(eqn)} communicates over a named axis"), []
    return None, [True] * len(eqn.outvars)


@_register(*sorted(_primitives.BATCH_KEYED_RANDOM))
def _random_rule(checker: _Checker, eqn: JaxprEqn, batched: list[bool]) -> Faithfulness:
    for atom in [*eqn.invars, *eqn.outvars]:
        impl = _compat.prng_impl_name(atom.aval)
        if impl is not None and impl != "threefry2x32":
            return (f"`{eqn.primitive.name}`{_where(eqn)} uses {impl} "
                    "keys, whose random bits differ under vmap"), []
    return None, [True] * len(eqn.outvars)


@_register(_primitives.COND)
def _cond_rule(checker: _Checker, eqn: JaxprEqn, batched: list[bool]) -> Faithfulness:
    if batched[0]:
        return (f"the `cond`{_where(eqn)} takes a different branch per "
                "member: batched, every member would run every branch"), []
    outs = [False] * len(eqn.outvars)
    for branch in eqn.params["branches"]:
        inner, _ = _compat.open_jaxpr(branch)
        why, branch_outs = checker.jaxpr(inner, batched[1:])
        if why is not None:
            return why, []
        outs = [a or b for a, b in zip(outs, branch_outs, strict=True)]
    return None, outs


@_register(_primitives.WHILE)
def _while_rule(checker: _Checker, eqn: JaxprEqn, batched: list[bool]) -> Faithfulness:
    info = _compat.while_info(eqn)
    cond_consts = batched[:info.cond_nconsts]
    body_consts = batched[info.cond_nconsts:info.cond_nconsts + info.body_nconsts]
    carry = batched[info.cond_nconsts + info.body_nconsts:]
    body, _ = _compat.open_jaxpr(info.body_jaxpr)
    cond, _ = _compat.open_jaxpr(info.cond_jaxpr)
    for _ in range(len(carry) + 1):  # each round batches one more carry, or stops
        why, outs = checker.jaxpr(body, body_consts + carry)
        if why is not None:
            return why, []
        grown = [a or b for a, b in zip(carry, outs, strict=True)]
        if grown == carry:
            break
        carry = grown
    why, (predicate,) = checker.jaxpr(cond, cond_consts + carry)
    if why is not None:
        return why, []
    if predicate:
        return (f"the `while`{_where(eqn)} ends at a different trip per "
                "member: batched, every member would run to the longest"), []
    return None, carry


@_register(_primitives.SCAN)
def _scan_rule(checker: _Checker, eqn: JaxprEqn, batched: list[bool]) -> Faithfulness:
    info = _compat.scan_info(eqn)
    body, _ = _compat.open_jaxpr(info.jaxpr)
    consts = batched[:info.num_consts]
    carry = batched[info.num_consts:info.num_consts + info.num_carry]
    xs = batched[info.num_consts + info.num_carry:]
    for _ in range(len(carry) + 1):
        why, outs = checker.jaxpr(body, consts + carry + xs)
        if why is not None:
            return why, []
        grown = [a or b for a, b in zip(carry, outs[:info.num_carry], strict=True)]
        if grown == carry:
            return None, [*carry, *outs[info.num_carry:]]
        carry = grown
    raise RuntimeError("jaxpar: batched carries of a scan did not settle; please report it")


# Why a nested jaxpr may not be merged (None: it may), by jaxpr and rule depth.
MergeMemo = IdentityMemo[JaxprLike, str | None]


def merge_refusal(eqn: JaxprEqn, memo: MergeMemo | None = None) -> str | None:
    """Why computing ``eqn`` once where copies of it ran on the same operands would not
    be faithful, or None.

    Merging twins (``share_common``) or running an equation that reads no per-member
    value once under ``vmap`` is what XLA's CSE does to a forward pass, but it happens
    before the program is differentiated, so every rule that differentiation runs sees
    the copies' cotangents summed, and every effect happens once. That is faithful
    only where nothing inside (nested jaxprs and ``custom_jvp`` rules included) has
    effects, calls the host, draws stateful random numbers or is user-placed
    (``RUN_EVERY_CALL``), or is a ``custom_vjp`` (its backward rule is an opaque
    function, which may clip its cotangent, print or call back).

    ``memo`` (by jaxpr identity and rule depth) spares walking a nested jaxpr twice.
    """
    return _merge_refusal(eqn, IdentityMemo() if memo is None else memo, 0)


def _merge_refusal(eqn: JaxprEqn, memo: MergeMemo, depth: int) -> str | None:
    name = eqn.primitive.name
    if eqn.effects:
        return f"`{name}`{_where(eqn)} has effects, which would happen once, not once per copy"
    if name in _primitives.RUN_EVERY_CALL:
        return (f"`{name}`{_where(eqn)} must run once per call (a host call, fresh random "
                "numbers or user placement)")
    if name == _primitives.CUSTOM_VJP_CALL:
        return (f"`{name}`{_where(eqn)} is a custom_vjp: its backward rule (an opaque "
                "function that may clip, print or call back) would see the copies' "
                "cotangents summed")
    for _, _, sub in _compat.eqn_subjaxprs(eqn):
        why = _jaxpr_merge_refusal(sub, memo, depth)
        if why is not None:
            return why
    if name == _primitives.CUSTOM_JVP_CALL and depth < RULE_DEPTH:
        found = _compat.custom_jvp_rule(eqn)
        if found is None:
            return f"the jvp rule of `{name}`{_where(eqn)} cannot be inspected"
        why = _jaxpr_merge_refusal(found[0], memo, depth + 1)
        if why is not None:
            return f"in the jvp rule of `{name}`{_where(eqn)}, {why}"
    return None


def _jaxpr_merge_refusal(jaxpr: JaxprLike, memo: MergeMemo, depth: int) -> str | None:
    return memo.lookup(jaxpr, lambda: _first_merge_refusal(jaxpr, memo, depth), extra=depth)


def _first_merge_refusal(jaxpr: JaxprLike, memo: MergeMemo, depth: int) -> str | None:
    inner, _ = _compat.open_jaxpr(jaxpr)
    for eqn in inner.eqns:
        why = _merge_refusal(eqn, memo, depth)
        if why is not None:
            return why
    return None


def _where(eqn: JaxprEqn) -> str:
    source = _compat.source_summary(eqn)
    return f" at {source}" if source and source != "<unknown>" else ""

