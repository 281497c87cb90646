"""Recognising loop shapes in jaxprs: ``while`` loops with a static trip count.

``fori_loop`` with Python-int bounds already becomes a ``scan``; with array
bounds it becomes a ``while`` whose trip count XLA cannot see, so every
iteration copies the predicate to the host. This module recognises the
``while`` shapes ``fori_loop`` (and hand-written counting loops) produce and,
where the bounds are in fact constants, computes the trip count exactly as the
``while`` would run it: in the counter's dtype, wrap-around included.

Recognised: a condition computed by ``lt counter upper``, where ``counter`` is an
integer (signed or unsigned, any width) scalar carry that the body advances by
``add counter step`` and nothing else, ``upper`` a literal, a constant of the
condition or a carry the body passes through unchanged, and the initial counter,
``upper`` and ``step`` constants (literals in the jaxpr, the loop's operands or the
enclosing level's closed-over arrays). Same-dtype casts, which only drop a weak
type, are looked through. That covers every layout of ``fori_loop`` on jax
0.10.2-0.12 (carry ``(i, upper, *xs)``, any integer dtype, ``int64`` under x64) and
``while_loop(lambda c: c[k] < n, ...)`` with ``n`` a literal or closed over.

Example::

    static_trip_count(eqn)   # TripCount(trips=7, reason=...) for
                             # fori_loop(jnp.int32(0), jnp.int32(7), ...)

Sharp edges:
  * A loop whose counter would step past its dtype's largest value (int8 from 0
    to 120 by 100: the step to 200 wraps to -56, and the ``while`` goes on) has
    no static trip count here, nor has one with a non-positive step: their trip
    counts are what wrap-around makes them, and they are left as ``while`` loops.
  * Float counters are never trusted (rounding decides the trip count).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _compat
from .._compat import Atom, JaxprEqn, JaxprLike
from .primitives import ADD, CONVERT_ELEMENT_TYPE, LESS_THAN, WHILE


@dataclasses.dataclass(frozen=True, slots=True)
class TripCount:
    """A ``while`` loop's static trip count, or None and why it has none.

    Attributes:
        trips: how many times the body runs, exactly as the ``while`` runs it; None if
            that is not known when tracing.
        reason: why (a fori_loop with literal bounds, or what is missing).
    """

    trips: int | None
    reason: str


class _NotStatic(Exception):
    """The loop has no static trip count; the message says why."""


def static_trip_count(eqn: JaxprEqn, constants: Mapping[Any, Any] | None = None) -> TripCount:
    """The trip count of a counting ``while`` (see the module docstring), or why none.

    Args:
        eqn: any equation; only ``while`` equations can have a static trip count.
        constants: values of the enclosing level's constant variables (its closed-over
            arrays), so a bound closed over from outside counts as constant.

    Returns:
        A ``TripCount``; ``trips`` is None unless the loop provably runs that many times.
    """
    if eqn.primitive.name != WHILE:
        return TripCount(None, f"a {eqn.primitive.name}, not a while loop")
    try:
        lower, upper, step, dtype = _counting_loop(eqn, constants or {})
    except _NotStatic as why:
        return TripCount(None, str(why))
    if upper <= lower:
        return TripCount(0, f"counts from {lower} to {upper}: the body never runs")
    if step <= 0:
        return TripCount(None, f"the counter steps by {step} from {lower} towards {upper}, "
                               "so only wrap-around of its integer type could end the loop")
    trips = -(-(upper - lower) // step)
    last = lower + trips * step  # the counter after the last trip; all before are smaller
    largest = int(np.iinfo(dtype).max)
    if last > largest:
        return TripCount(None, f"the {dtype.name} counter would step from "
                               f"{lower + (trips - 1) * step} to {last}, past {largest}: it "
                               "wraps around and the loop runs on")
    return TripCount(trips, f"{dtype.name} counter from {lower} to {upper} by {step}")


def _counting_loop(eqn: JaxprEqn, constants: Mapping[Any, Any]
                   ) -> tuple[int, int, int, np.dtype[Any]]:
    """``(lower, upper, step, counter dtype)`` of a counting ``while``, else _NotStatic."""
    info = _compat.while_info(eqn)
    cond, cond_consts = _compat.open_jaxpr(info.cond_jaxpr)
    body, body_consts = _compat.open_jaxpr(info.body_jaxpr)
    operands = [constants.get(a, a) if not _compat.is_literal(a) else a for a in eqn.invars]
    cond_operands = operands[:info.cond_nconsts]
    body_operands = operands[info.cond_nconsts:info.cond_nconsts + info.body_nconsts]
    init = operands[info.cond_nconsts + info.body_nconsts:]
    cond_carry = list(cond.invars[info.cond_nconsts:])
    body_carry = list(body.invars[info.body_nconsts:])
    # The condition's other equations (if any) are pure (the pass refuses loops with
    # effects), so only the one computing the predicate matters.
    compare = _producer(cond, cond.outvars[0])
    if compare is None or compare.primitive.name != LESS_THAN:
        raise _NotStatic("its condition is not a `counter < upper` comparison")
    counter_atom, upper_atom = (_see_through_casts(cond, a) for a in compare.invars)
    if _compat.is_literal(counter_atom) or counter_atom not in cond_carry:
        raise _NotStatic("the left side of its `<` is not a loop carry")
    k = cond_carry.index(counter_atom)
    aval = _compat.array_aval(counter_atom)
    try:
        dtype = np.dtype(aval.dtype)
    except TypeError:
        raise _NotStatic(f"its counter has dtype {aval.dtype}") from None
    if not np.issubdtype(dtype, np.integer) or getattr(aval, "shape", None) != ():
        raise _NotStatic(f"its counter is a {aval.str_short()}, not an integer scalar: "
                         "its trip count depends on rounding")

    # upper: a literal, a constant of the condition, or a carry the body passes through.
    if upper_atom in cond_carry:
        u = cond_carry.index(upper_atom)
        if u == k or body.outvars[u] is not body_carry[u]:
            raise _NotStatic("the body changes the loop's upper bound")
        upper = _constant(init[u], "the upper bound")
    else:
        upper = _constant(_resolve(upper_atom, cond, cond_consts, cond_operands),
                          "the upper bound")

    # The body advances the counter by a constant step, nothing else.
    counter_in = body_carry[k]
    advance = _producer(body, body.outvars[k])
    if advance is None or advance.primitive.name != ADD:
        raise _NotStatic("the body does not advance the counter by one `add`")
    a, b = (_see_through_casts(body, atom) for atom in advance.invars)
    if a is counter_in:
        step_atom = b
    elif b is counter_in:
        step_atom = a
    else:
        raise _NotStatic("the body does not add a step to the counter itself")
    step = _constant(_resolve(step_atom, body, body_consts, body_operands), "the step")
    lower = _constant(init[k], "the counter's start")
    return lower, upper, step, dtype


def _producer(jaxpr: JaxprLike, atom: Atom) -> JaxprEqn | None:
    """The equation of ``jaxpr`` that computes ``atom``, if one does."""
    if _compat.is_literal(atom):
        return None
    for eqn in jaxpr.eqns:
        if atom in eqn.outvars:
            return eqn
    return None


def _see_through_casts(jaxpr: JaxprLike, atom: Atom) -> Atom:
    """``atom``, or what it is a same-dtype ``convert_element_type`` of: such a cast only
    drops a weak type (``while_loop(lambda c: c[0] < 10, ...)`` with a Python-int
    counter) and leaves the value as it is."""
    for _ in range(len(jaxpr.eqns)):
        eqn = _producer(jaxpr, atom)
        if eqn is None or eqn.primitive.name != CONVERT_ELEMENT_TYPE:
            return atom
        (source,) = eqn.invars
        if getattr(source.aval, "dtype", None) != _compat.array_aval(atom).dtype:
            return atom
        atom = source
    return atom


def _resolve(atom: Atom, jaxpr: JaxprLike, consts: list[Any], operands: list[Any]) -> Any:
    """The atom or value a condition/body atom stands for outside the loop: a literal,
    a closed-over constant, or the loop operand fed to one of its constvars."""
    if _compat.is_literal(atom):
        return atom
    if atom in jaxpr.constvars:
        return consts[jaxpr.constvars.index(atom)]
    if atom in jaxpr.invars[:len(operands)]:
        return operands[jaxpr.invars.index(atom)]
    return atom  # computed inside, or a carry: not constant


def _constant(value: Any, what: str) -> int:
    """A scalar integer constant's value, or _NotStatic naming ``what`` is not one."""
    if _compat.is_literal(value):
        value = _compat.literal_value(value)
    elif isinstance(value, (_compat.Var, _compat.DropVar)) or _compat.is_tracer(value):
        raise _NotStatic(f"{what} is only known when the program runs")
    array = np.asarray(value)
    if array.shape != () or not np.issubdtype(array.dtype, np.integer):
        raise _NotStatic(f"{what} is not an integer scalar")
    return int(array)
