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

A carry whose update reads no other carry (GAE's ``next_value``, replaced each step by
the step's value; a previous action) is known step by step before any of this: its value
at each step is its update at the step before, ``vmap``ped over the steps (in levels,
where one such carry reads another); the other carries may read it as an input.

What counts as linear is read from the body's equations (``_forms``): a carry, then only
``add``/``sub`` of it with a carry-free value or itself, ``mul`` by a carry-free value
(a reset where an episode ends: ``(1 - done) * g``), ``div`` by a literal other than
zero, ``neg``, a no-op
``convert_element_type``, and plain nested ``jit`` calls of these. A carry that mixes
with another carry, goes through anything else (``tanh``, a matmul), or changes shape
is not linear, and the scan is left alone. So is a reset by ``jnp.where(done, 0, g)``
(``select_n``): it is linear, but the loop drops a non-finite ``g`` where the
composition would multiply it by zero (``0 * inf`` is NaN), and the values must be the
loop's.

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
  * Only floating linear carries (the tangent of step 1); a scan with an integer carry
    that reads itself (a counter) is left alone (an integer known carry is fine).
  * Values agree where the products of the coefficients stay finite: the compositions
    multiply ``a`` over many steps, which the loop never does, so decays above 1 that
    overflow (``1e30`` twice) give NaN where the loop's values are finite, and an
    infinite coefficient may turn the loop's infinities into NaN (``b`` is read at
    ``c = 0``). Stable recurrences (decays at most 1) are what this is for.
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
from .._program.graph import graph_and_writers, reachable
from .._program.interp import Env
from ._loop_candidates import loop_candidates, stacked_limit
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
    limit = stacked_limit(analysis, "associative_scans", MAX_STACKED_BYTES)
    rewrites: list[Rewrite] = []
    decisions: list[PassDecision] = []
    for index in loop_candidates(eqns):
        eqn = eqns[index]
        info = _compat.scan_info(eqn)
        linear = _linear(eqn) if info.length >= 2 else None
        if linear is None:
            continue
        stacked = 3 * info.length * sum(_compat.aval_nbytes(v.aval) for v in
                                        eqn.outvars[:info.num_carry])
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


class _Linear:
    """A linear scan's body read for the rewrite.

    Attributes:
      known: the carries whose update reads no carry but earlier known ones (a GAE's
        ``next_value = value``), in the order they can be computed, a level at a time
        with the indices of the equations its updates need: each step's value is the
        update of the step before (``vmap``ped), so they are inputs of a kind.
      linear: the other carries, each ``a * c + b`` of itself.
      free: indices of the equations the ``linear`` carries' updates need that read
        none of the ``linear`` carries (run outside the ``jvp``).
      update: indices of those the ``linear`` carries' outputs need that do read them
        (each linear in one carry; run under the ``jvp``).
    """

    __slots__ = ("free", "known", "linear", "update")

    def __init__(self, known: list[tuple[list[int], list[int]]], linear: list[int],
                 free: list[int], update: list[int]) -> None:
        self.known, self.linear, self.free, self.update = known, linear, free, update


def _linear(eqn: JaxprEqn) -> _Linear | None:
    """The scan's body read (``_Linear``) when its every carry output is either free of
    the carries but known ones, or ``a * c + b`` of its own carry ``c`` (``a``, ``b`` free
    of the linear carries), those floating, its body without effects; else None."""
    info = _compat.scan_info(eqn)
    body, _ = _compat.open_jaxpr(info.jaxpr)
    carries = body.invars[info.num_consts:info.num_consts + info.num_carry]
    if not carries or any(inner.effects for inner in body.eqns):
        return None
    avals = [_compat.array_aval(v) for v in carries]
    shapes = [(a.shape, a.dtype) for a in avals]
    remaining = list(range(len(carries)))
    known: list[list[int]] = []
    while True:
        forms: dict[Any, int] = {carries[k]: k for k in remaining}
        out = _forms(body, forms, shapes)[:info.num_carry]
        level = [k for k in remaining if out[k] == _FREE]
        if not level:
            break
        known.append(level)
        remaining = [k for k in remaining if k not in level]
    if any(out[k] != k for k in remaining):
        return None
    # A call reading a linear carry whose other results read none (a nested jit returning
    # both): those results exist only where the call runs, under the jvp; left alone.
    if any(forms.get(v) == _FREE for inner in body.eqns for v in inner.outvars):
        return None
    if any(not jnp.issubdtype(avals[k].dtype, jnp.inexact) for k in remaining):
        return None
    free = [i for i, inner in enumerate(body.eqns)
            if not any(a in forms for a in inner.invars if not _compat.is_literal(a))]
    # What each group of carry outputs needs. The equations free of the linear carries
    # need only free ones (a call mixing both was refused above), so an update's
    # ancestors among the free ones and those among the update's are the two parts.
    graph, writers = graph_and_writers(body)

    def needed(carries: Sequence[int], among: set[int]) -> list[int]:
        start = [writers[v] for v in (body.outvars[k] for k in carries)
                 if not _compat.is_literal(v) and v in writers]
        return sorted((set(start) | reachable(graph, start, forward=False)) & among)

    free_set = set(free)
    update = set(range(len(body.eqns))) - free_set
    return _Linear([(level, needed(level, free_set)) for level in known], remaining,
                   needed(remaining, free_set), needed(remaining, update))


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
              or (name == "div" and ins[0] == k and _nonzero_literal(eqn.invars[1]))
              or (name == "convert_element_type" and out.dtype == shapes[k][1])
              or name == "copy")
    return [k] if linear else other


def _nonzero_literal(atom: Any) -> bool:
    """Whether ``atom`` is a literal other than zero (a carry divided by it stays finite
    where it was; by a computed value that may be zero, ``b = 0 / 0`` would be NaN)."""
    if not _compat.is_literal(atom):
        return False
    try:
        return bool(jnp.all(jnp.asarray(_compat.literal_value(atom)) != 0))
    except Exception:
        return False


def _emitter(eqn: JaxprEqn, linear: _Linear) -> EmitFn:
    """The scan ``eqn`` as: the known carries' values step by step (``vmap``ped updates,
    level by level), every step's ``(a, b)`` of the linear carries (``jvp`` of the
    vmapped update), their prefix compositions, the carries, then the ``ys`` vmapped
    (see the module docstring)."""
    info = _compat.scan_info(eqn)
    body, body_consts = _compat.open_jaxpr(info.jaxpr)
    nc, ncarry, reverse = info.num_consts, info.num_carry, info.reverse
    carry_vars = body.invars[nc:nc + ncarry]

    def emit(invals: list[list[Any]]) -> list[list[Any]]:
        (operands,) = invals
        consts = operands[:nc]
        # Arrays of the carries' types (a literal initial carry, ``0.0``, is a scalar).
        init = [_compat.with_weak_type(jnp.asarray(v, _compat.array_aval(var).dtype), var.aval)
                for v, var in zip(operands[nc:nc + ncarry], carry_vars, strict=True)]
        xs = list(operands[nc + ncarry:])

        def inputs(x: Sequence[Any], known_in: dict[int, Any]) -> Env:
            env = Env()
            env.write(body.constvars, body_consts)
            env.write_inputs(body.invars[:nc], consts)
            env.write_inputs(body.invars[nc + ncarry:], x)
            env.write_inputs([carry_vars[k] for k in known_in], list(known_in.values()))
            return env

        def run(env: Env, indices: Sequence[int]) -> None:
            env.bind(body.eqns[i] for i in indices)

        # 1. The known carries, level by level: each step's carry in is the step before's
        # update (the first step's: the initial carry).
        carry_in: dict[int, Any] = {}
        after: dict[int, Any] = {}
        for level, needs in linear.known:
            def updated(x: list[Any], known_in: dict[int, Any], level: list[int] = level,
                        needs: list[int] = needs) -> list[Any]:
                env = inputs(x, known_in)
                run(env, needs)
                return env.read_all([body.outvars[k] for k in level])
            outs = _over_steps(updated, xs, dict(carry_in), info.length)
            for k, out in zip(level, outs, strict=True):
                after[k] = _broadcast_steps(out, init[k], info.length)
                carry_in[k] = _shifted(after[k], init[k], reverse)

        # 2. The linear carries: every step's (a, b), their prefix compositions.
        def affine(x: list[Any], known_in: dict[int, Any]) -> tuple[list[Any], list[Any]]:
            # The equations free of the linear carries run as they are; only the linear
            # carries' update is differentiated (add, mul, div, ...: jvp rules all).
            env = inputs(x, known_in)
            run(env, linear.free)

            def update(*carry: Any) -> list[Any]:
                local = Env()
                local.values = dict(env.values)
                local.write_inputs([carry_vars[k] for k in linear.linear], carry)
                run(local, linear.update)
                outs = local.read_all([body.outvars[k] for k in linear.linear])
                return [jnp.broadcast_to(v, c.shape).astype(c.dtype)
                        for v, c in zip(outs, carry, strict=True)]

            start = [init[k] for k in linear.linear]
            b, a = jax.jvp(update, [jnp.zeros_like(c) for c in start],
                           [jnp.ones_like(c) for c in start])
            return list(a), list(b)

        def compose(first: tuple[list[Any], list[Any]], then: tuple[list[Any], list[Any]]
                    ) -> tuple[list[Any], list[Any]]:
            (a1, b1), (a2, b2) = first, then
            return ([p * q for p, q in zip(a2, a1, strict=True)],
                    [p * q + r for p, q, r in zip(a2, b1, b2, strict=True)])

        with _compat.eqn_context(eqn):
            if linear.linear:
                a, b = _over_steps(affine, xs, dict(carry_in), info.length)
                prefix_a, prefix_b = lax.associative_scan(compose, (a, b), reverse=reverse)
                for k, pa, pb in zip(linear.linear, prefix_a, prefix_b, strict=True):
                    after[k] = pa * init[k] + pb
                    carry_in[k] = _shifted(after[k], init[k], reverse)
            final = [after[k][0] if reverse else after[k][-1] for k in range(ncarry)]
            ys: list[Any] = []
            if len(body.outvars) > ncarry:
                ins = [carry_in[k] for k in range(ncarry)]
                ys = list(jax.vmap(
                    lambda c, x: evaluate(info.jaxpr, *consts, *c, *x)[ncarry:])(ins, xs))
        # The scan's own output types (weak types included: the update's arithmetic
        # above made strong ones).
        return [[_compat.with_weak_type(v, out.aval) for v, out in
                 zip(final + ys, eqn.outvars, strict=True)]]

    return emit


def _over_steps(fn: Any, xs: list[Any], known_in: dict[int, Any], length: int) -> Any:
    """``fn(x, known_in)`` for every step, ``vmap``ped over the scanned inputs and the
    known carries' values (a scan without scanned inputs: over the known values, or
    once, broadcast by the caller)."""
    if xs or known_in:
        return jax.vmap(fn)(xs, known_in)
    return jax.tree.map(lambda v: jnp.broadcast_to(v, (length, *jnp.shape(v))), fn([], {}))


def _broadcast_steps(value: Any, init: Any, length: int) -> Any:
    """A known carry's values over the steps, with the carry's dtype and shape."""
    return jnp.broadcast_to(value, (length, *jnp.shape(init))).astype(init.dtype)


def _shifted(after: Any, init: Any, reverse: bool) -> Any:
    """Each step's carry in, from the carries after each step: ``init`` first (last for a
    reverse scan), then the carries after the step before."""
    first = init[None]
    if reverse:
        return jnp.concatenate([after[1:], first])
    return jnp.concatenate([first, after[:-1]])
