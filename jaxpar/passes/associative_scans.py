"""Run a scan whose carries each follow a linear recurrence of themselves as
``lax.associative_scan``: rounds of the whole sequence at once instead of a trip per step.

An exponential moving average, a discounted return or GAE (``g = r + gamma * (1 - done)
* g``), a state-space layer's state (Mamba's ``h = exp(dt * A) * h + dt * B * x``) and a
linear RNN all update their carry as ``c = a_t * c + b_t``, elementwise, where ``a_t``
and ``b_t`` read the step's inputs and the loop's constants but not the carry. Such a
loop is a prefix product of affine maps, which compose associatively::

    (a1, b1) then (a2, b2)  =  (a2 * a1, a2 * b1 + b2)

so ``lax.associative_scan`` computes every step's carry in about ``2 log2 L`` rounds over
the whole sequence instead of ``L`` dependent trips. With ``associative_scans=True``:

1. every step's ``(a_t, b_t)`` at once: the body's carry update ``vmap``ped over the
   steps' inputs and run at ``c = 0`` with the tangent ``c' = 1`` (``jax.jvp``: the
   primal is ``b_t``, the tangent ``a_t``, exactly, as the update is linear in ``c``);
2. the prefix compositions (``lax.associative_scan``, ``reverse`` as the scan's), and
   each step's carry ``A_t * c0 + B_t``;
3. the body's per-step outputs (``ys``) ``vmap``ped over each step's carry in and input.

What counts as linear is read from the body's equations (``_form``): a carry, then only
``add``/``sub`` of it with a carry-free value or itself, ``mul`` by and ``div`` by a
carry-free value, ``neg``, ``select_n`` on a carry-free predicate (a reset where an
episode ends), a no-op ``convert_element_type``, and plain nested ``jit`` calls of
these (``jnp.where``). A carry that mixes with another carry, goes through anything else
(``tanh``, a matmul), or changes shape is not linear, and the scan is left alone.

Whether it pays is for the device to say (the measured candidates of ``_tune``,
``targets/tpu.py``): it turns ``L`` trips into ``O(log L)`` rounds, each reading and
writing the stacked ``(a, b)`` of every step (``O(L)`` work and memory, where the loop
held one step's). The products are formed in another order than the loop's, so values
agree within rounding (a decay's product over many steps may differ in its last bits),
not bit for bit. No target turns it on by default.

Example::

    new, decisions = associative_scans(jax.make_jaxpr(ema)(c0, xs))
    [d.kind for d in decisions]            # ["scanned in parallel"]

Sharp edges:
  * Only floating carries (the tangent of step 1); a scan with an integer carry (a
    counter) is left alone.
  * Left alone: scans with effects or user placement, length below 2, and scans whose
    stacked values (``(a, b)`` of every step, the carries) would pass
    ``MAX_STACKED_BYTES`` or the memory budget's allowance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import _compat
from .._analysis import Analysis
from .._compat import JaxprEqn
from .._model.memory import format_bytes
from .._program.interp import Env
from ._loop_candidates import loop_candidates
from ._protocol import DecisionKind, EmitFn, Level, LevelResult, PassDecision, Rewrite, decision
from ._splice import evaluate

# The most bytes of stacked values (every step's ``a`` and ``b`` and carry) one scan may take.
MAX_STACKED_BYTES = 1 << 30

_FREE = -1  # a value that reads no carry
_OTHER = -2  # a value that reads a carry in any other way
# Equations whose result is linear in the carry ``k`` when their operands are (see the
# module docstring): each maps the operands' forms to the result's.
_LINEAR_BINARY = frozenset({"add", "sub"})


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: every scan of one level whose carries follow linear recurrences
    becomes ``lax.associative_scan``."""
    eqns, path = level.eqns, level.path
    allowance = analysis.allowance_for("associative_scans")
    rewrites: list[Rewrite] = []
    decisions: list[PassDecision] = []
    for index in loop_candidates(eqns):
        eqn = eqns[index]
        info = _compat.scan_info(eqn)
        linear = _linear(eqn) if info.length >= 2 else None
        if linear is None:
            continue
        stacked = 3 * info.length * sum(_bytes(_compat.array_aval(v)) for v in
                                        eqn.outvars[:info.num_carry])
        limit = MAX_STACKED_BYTES if allowance is None else min(MAX_STACKED_BYTES, allowance)
        carries = ("its carry follows" if info.num_carry == 1
                   else f"its {info.num_carry} carries each follow")
        if stacked > limit:
            decisions.append(decision(
                path, DecisionKind.LEFT_ALONE, eqns, [index], trips_before=info.length,
                trips_after=info.length, unroll=None,
                reason=f"{carries} a linear recurrence (c = a * c + b), but every "
                       f"step's would stack {format_bytes(stacked)}, more than the "
                       f"{format_bytes(limit)} allowed"))
            continue
        rounds = 2 * math.ceil(math.log2(info.length))
        rewrites.append(Rewrite((index,), _emitter(eqn, linear)))
        decisions.append(decision(
            path, DecisionKind.SCANNED_IN_PARALLEL, eqns, [index], trips_before=info.length,
            trips_after=None, unroll=None,
            reason=f"{carries} a linear recurrence (c = a * c + b): "
                   f"lax.associative_scan runs its {info.length} steps in about {rounds} "
                   f"rounds, {format_bytes(stacked)} stacked; values agree within rounding"))
    return LevelResult(rewrites, decisions)


def _bytes(aval: Any) -> int:
    return math.prod(aval.shape) * aval.dtype.itemsize


class _Linear:
    """A linear scan's body read for the rewrite: ``free`` the indices of its equations
    that read no carry (run outside the ``jvp``), ``update`` those the carry outputs need
    that do (each linear in one carry; run under the ``jvp``)."""

    __slots__ = ("free", "update")

    def __init__(self, free: list[int], update: list[int]) -> None:
        self.free, self.update = free, update


def _linear(eqn: JaxprEqn) -> _Linear | None:
    """The scan's body read (``_Linear``) when its every carry output is ``a * c + b``
    of its own carry ``c`` (``a``, ``b`` carry-free), its carries floating, its body
    without effects; else None."""
    info = _compat.scan_info(eqn)
    body, _ = _compat.open_jaxpr(info.jaxpr)
    carries = body.invars[info.num_consts:info.num_consts + info.num_carry]
    avals = [_compat.array_aval(v) for v in carries]
    if not carries or any(not jnp.issubdtype(a.dtype, jnp.inexact) for a in avals):
        return None
    if any(inner.effects for inner in body.eqns):
        return None
    forms: dict[Any, int] = {v: k for k, v in enumerate(carries)}
    shapes = [(a.shape, a.dtype) for a in avals]
    out = _forms(body, forms, shapes)
    if not all(form in (k, _FREE) for k, form in enumerate(out[:info.num_carry])):
        return None
    free = [i for i, inner in enumerate(body.eqns)
            if not any(a in forms for a in inner.invars if not _compat.is_literal(a))]
    producer = {v: i for i, inner in enumerate(body.eqns) for v in inner.outvars}
    needed: set[int] = set()
    stack = [producer[v] for v in body.outvars[:info.num_carry]
             if not _compat.is_literal(v) and v in producer]
    while stack:
        i = stack.pop()
        if i in needed or i in free:
            continue
        needed.add(i)
        stack.extend(producer[a] for a in body.eqns[i].invars
                     if not _compat.is_literal(a) and a in producer)
    return _Linear(free, sorted(needed))


def _forms(jaxpr: Any, forms: dict[Any, int], shapes: Sequence[tuple[Any, Any]]
           ) -> list[int]:
    """The form of each of ``jaxpr``'s outputs (``k``: linear in carry ``k``, ``_FREE``,
    ``_OTHER``) given its inputs' in ``forms`` (a variable absent is free); the forms of
    the variables that read a carry are added to ``forms``."""
    def form(atom: Any) -> int:
        return _FREE if _compat.is_literal(atom) else forms.get(atom, _FREE)

    for inner in jaxpr.eqns:
        ins = [form(a) for a in inner.invars]
        if all(f == _FREE for f in ins):
            continue  # reads no carry: its outputs are free (absent from ``forms``)
        results = _eqn_forms(inner, ins, shapes)
        for var, result in zip(inner.outvars, results, strict=True):
            forms[var] = result
    return [form(a) for a in jaxpr.outvars]


def _eqn_forms(eqn: JaxprEqn, ins: list[int], shapes: Sequence[tuple[Any, Any]]
               ) -> list[int]:
    """The forms of ``eqn``'s outputs given its operands' (some read a carry)."""
    other = [_OTHER] * len(eqn.outvars)
    if _OTHER in ins:
        return other
    called = _compat.plain_call_body(eqn)
    if called is not None:
        inner, _ = _compat.open_jaxpr(called[1])
        inner_forms = {v: f for v, f in zip(inner.invars, ins, strict=True) if f != _FREE}
        return _forms(inner, inner_forms, shapes)
    carried = {f for f in ins if f != _FREE}
    if len(carried) != 1:
        return other  # two carries mixed
    (k,) = carried
    if len(eqn.outvars) != 1:
        return other
    out = _compat.array_aval(eqn.outvars[0])
    if (out.shape, out.dtype) != shapes[k]:
        return other
    name = eqn.primitive.name
    linear = (name in _LINEAR_BINARY or name == "neg"
              or (name == "mul" and ins.count(k) == 1)
              or (name == "div" and ins[0] == k and ins[1] == _FREE)
              or (name == "select_n" and ins[0] == _FREE)
              or (name == "convert_element_type" and out.dtype == shapes[k][1])
              or name == "copy")
    return [k] if linear else other


def _emitter(eqn: JaxprEqn, linear: _Linear) -> EmitFn:
    """The scan ``eqn`` as every step's ``(a, b)`` (``jvp`` of the vmapped carry update),
    their prefix compositions, the carries, then the ``ys`` vmapped (see the module
    docstring)."""
    info = _compat.scan_info(eqn)
    body, body_consts = _compat.open_jaxpr(info.jaxpr)
    nc, ncarry, reverse = info.num_consts, info.num_carry, info.reverse

    def emit(invals: list[list[Any]]) -> list[list[Any]]:
        (operands,) = invals
        consts = operands[:nc]
        init = operands[nc:nc + ncarry]
        xs = operands[nc + ncarry:]

        def affine(*x: Any) -> tuple[list[Any], list[Any]]:
            # The carry-free equations run as they are; only the carry's update is
            # differentiated (its equations all have jvp rules: add, mul, select_n, ...).
            env = Env()
            env.write(body.constvars, body_consts)
            env.write_inputs(body.invars[:nc], consts)
            env.write_inputs(body.invars[nc + ncarry:], x)
            for i in linear.free:
                inner = body.eqns[i]
                env.write(inner.outvars, _compat.bind_eqn(inner, env.read_all(inner.invars)))

            def update(*carry: Any) -> list[Any]:
                local = Env()
                local.values = dict(env.values)
                local.write_inputs(body.invars[nc:nc + ncarry], carry)
                for i in linear.update:
                    inner = body.eqns[i]
                    local.write(inner.outvars,
                                _compat.bind_eqn(inner, local.read_all(inner.invars)))
                return [jnp.broadcast_to(v, c.shape).astype(c.dtype) for v, c in
                        zip(local.read_all(body.outvars[:ncarry]), carry, strict=True)]

            zeros = [jnp.zeros_like(c) for c in init]
            ones = [jnp.ones_like(c) for c in init]
            b, a = jax.jvp(update, zeros, ones)
            return list(a), list(b)

        def compose(first: tuple[list[Any], list[Any]], then: tuple[list[Any], list[Any]]
                    ) -> tuple[list[Any], list[Any]]:
            (a1, b1), (a2, b2) = first, then
            return ([p * q for p, q in zip(a2, a1, strict=True)],
                    [p * q + r for p, q, r in zip(a2, b1, b2, strict=True)])

        with _compat.eqn_context(eqn):
            a, b = jax.vmap(affine)(*xs) if xs else _unscanned(affine, info.length)
            prefix_a, prefix_b = lax.associative_scan(compose, (a, b), reverse=reverse)
            after = [pa * c0 + pb for pa, pb, c0 in zip(prefix_a, prefix_b, init, strict=True)]
            final = [c[0] if reverse else c[-1] for c in after]
            ys: list[Any] = []
            if len(body.outvars) > ncarry:
                before = [_shifted(c, c0, reverse) for c, c0 in zip(after, init, strict=True)]
                ys = list(jax.vmap(lambda c, x: evaluate(info.jaxpr, *consts, *c, *x)[ncarry:])(
                    before, list(xs)))
        return [final + ys]

    return emit


def _unscanned(affine: Any, length: int) -> tuple[list[Any], list[Any]]:
    """``affine`` of a scan without scanned inputs: the same ``(a, b)`` every step."""
    a, b = affine()
    def tile(v: Any) -> Any:
        return jnp.broadcast_to(v, (length, *jnp.shape(v)))
    return [tile(v) for v in a], [tile(v) for v in b]


def _shifted(after: Any, init: Any, reverse: bool) -> Any:
    """Each step's carry in, from the carries after each step: ``init`` first (last for a
    reverse scan), then the carries after the step before."""
    first = init[None]
    if reverse:
        return jnp.concatenate([after[1:], first])
    return jnp.concatenate([first, after[:-1]])
