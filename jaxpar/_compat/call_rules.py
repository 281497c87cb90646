"""Rules that jaxpar's call-like primitives (``stream_region_p``, ``program_p``) share: each
holds a ``call_jaxpr`` (closed) and one more parameter. Each primitive registers its
rules in one block of its own module; these are the pieces both blocks use.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src.interpreters import partial_eval as _pe
from jax._src.state import discharge as _state_discharge
from jax.experimental import jet as _jet

from .jaxprs import ClosedJaxpr, jaxpr_eval


def call_abstract_eval(*avals: Any, call_jaxpr: ClosedJaxpr, **params: Any) -> tuple[Any, Any]:
    """The body's output types and effects."""
    del avals, params
    return list(call_jaxpr.out_avals), call_jaxpr.effects


def call_jet(primals_in: Sequence[Any], series_in: Sequence[Any], call_jaxpr: ClosedJaxpr,
             emit: Callable[[Callable[..., Any], list[Any]], Sequence[Any]]
             ) -> tuple[list[Any], list[Any]]:
    """The jet rule of a call-like equation; ``emit(body, args)`` runs the body (as a
    region, or inline)."""
    order = max((len(s) for s in series_in if s is not _jet.zero_series), default=1)
    series = [[_jet.zero_term] * order if s is _jet.zero_series else list(s) for s in series_in]
    counts = [len(s) for s in series]

    def body(*flat: Any) -> list[Any]:
        primals, rest = list(flat[:len(primals_in)]), list(flat[len(primals_in):])
        nested, start = [], 0
        for count in counts:
            nested.append(rest[start:start + count])
            start += count
        # Jet rules see Taylor coefficients (the k-th term over (k+1)!); the public
        # ``jet`` takes and returns derivatives.
        nested = [[t * math.factorial(k + 1) for k, t in enumerate(s)] for s in nested]
        outs, out_series = _jet.jet(lambda *a: jaxpr_eval(call_jaxpr, *a), primals, nested)
        return [*outs, *[t / math.factorial(k + 1) for s in out_series
                         for k, t in enumerate(s)]]

    zeros = [[jax.numpy.zeros_like(p) if t is _jet.zero_term else t for t in s]
             for p, s in zip(primals_in, series, strict=True)]
    flat = list(emit(body, [*primals_in, *[t for s in zeros for t in s]]))
    num_out = len(call_jaxpr.out_avals)
    outs, terms = flat[:num_out], flat[num_out:]
    return outs, [terms[i * order:(i + 1) * order] for i in range(num_out)]


def call_discharge(rebind: Callable[..., Sequence[Any]]) -> Callable[..., Any]:
    """The state discharge rule of a call-like primitive, as ``jax.jit``'s.

    JAX discharges mutable arrays (``jax.new_ref``, ``r[...] += x``) before lowering a
    program that creates them, equation by equation, and a call whose body creates or
    touches one needs a rule. Its body is discharged (each discharged ``Ref`` operand
    becomes a value and its final value one more output) and run again through
    ``rebind(body, operands, **params)``: the same call, or inline. jax <= 0.10 passes
    which operands to discharge and the avals first, jax >= 0.11 a ``DischargeContext``.
    """
    def discharge(should_discharge: Sequence[bool], args: Sequence[Any],
                  call_jaxpr: ClosedJaxpr, params: dict[str, Any]
                  ) -> tuple[list[Any], list[Any]]:
        discharged = _state_discharge.discharge_state(call_jaxpr,
                                                      should_discharge=list(should_discharge))
        flat = list(rebind(lambda *a: jaxpr_eval(discharged, *a), list(args), **params))
        num_out = len(call_jaxpr.out_avals)
        outs, ref_values = flat[:num_out], iter(flat[num_out:])
        return [next(ref_values) if d else None for d in should_discharge], outs

    if hasattr(_state_discharge, "DischargeContext"):
        def rule(ctx: Any, *args: Any, call_jaxpr: ClosedJaxpr, **params: Any
                 ) -> tuple[list[Any], list[Any]]:
            return discharge(ctx.should_discharge, args, call_jaxpr, params)
        return rule

    def partial_rule(should_discharge: Sequence[bool], in_avals: Sequence[Any],
                     out_avals: Sequence[Any], *args: Any, call_jaxpr: ClosedJaxpr,
                     **params: Any) -> tuple[list[Any], list[Any]]:
        del in_avals, out_avals
        return discharge(should_discharge, args, call_jaxpr, params)
    return partial_rule


def register_discharge_rule(prim: Any, rule: Callable[..., Any]) -> None:
    """Registers ``rule`` (from ``call_discharge``) as ``prim``'s state discharge rule,
    with the registry of the form this jax calls."""
    register = getattr(_state_discharge, "register_partial_discharge_rule", None)
    if register is None or hasattr(_state_discharge, "DischargeContext"):
        register = _state_discharge.register_discharge_rule
    register(prim)(rule)


def call_partial_eval_rule() -> Callable[..., Any]:
    """The partial eval rule for ``jax.checkpoint``: the call splits into a known and a
    staged call, each keeping the call's parameters (what JAX does for
    ``xla_metadata_call``)."""
    return functools.partial(_pe.closed_call_partial_eval_custom_rule, "call_jaxpr",
                             lambda *args: (args[-2], args[-1]))


def define_to_lojax(prim: Any) -> None:
    """jax >= 0.12: a body holding "high" types (refs, hi-level avals) is lowered to low
    types before staging, as ``jax.jit`` and ``xla_metadata_call`` do. Nothing on older
    releases."""
    lower_and_eval = getattr(_pe, "_lower_and_eval", None)
    if lower_and_eval is not None:
        def to_lojax(*hi_args: Any, call_jaxpr: ClosedJaxpr, **params: Any) -> Any:
            return lower_and_eval(prim, call_jaxpr, hi_args, **params)

        prim.to_lojax = to_lojax
