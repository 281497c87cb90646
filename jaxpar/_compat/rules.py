"""JAX's rule tables and the internals a primitive's rules read, for the primitives
jaxpar owns (``jaxpar._ops``): every rule of a call-like primitive registered in one
call (``register_call_primitive``), and the pieces of JAX those rules need (symbolic
zeros, batching a jaxpr, checkify's operands, lowering a body inline).

A call-like primitive holds a closed ``call_jaxpr`` and one more parameter. Its module
in ``_ops`` writes each rule and names them all in one ``CallRules``; the tables those
rules go into, and how they are called on each jax release, are read here.

Example::

    register_call_primitive(region_p, CallRules(
        impl=None, abstract_eval=call_abstract_eval, lowering=_region_lowering, ...))

Sharp edges:
  * jax <= 0.10 passes a discharge rule which operands to discharge and the avals
    first, jax >= 0.11 a ``DischargeContext`` (``call_discharge``); jax >= 0.11 passes a
    checkify rule a context first (``checkify_operands``); jax >= 0.12 lowers a body's
    high types before staging it (``define_to_lojax``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
from jax._src import checkify as _checkify
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import sharding_impls as _sharding_impls
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.state import discharge as _state_discharge
from jax.experimental import jet as _jet

from .jaxprs import ClosedJaxpr, jaxpr_eval


@dataclasses.dataclass(frozen=True, slots=True)
class CallRules:
    """Every rule of a call-like primitive, each as JAX's table calls it (``**params``:
    ``call_jaxpr`` and the primitive's other parameter).

    Attributes:
      impl: runs an equation eagerly; None: compiled alone, as ``jax.jit`` runs it.
      abstract_eval: the outputs' types and the effects.
      lowering: ``(ctx, *args, **params)`` to MLIR values.
      batcher: ``(axis_data, values, dims, **params)`` to ``(outputs, dims)``.
      jvp: ``(primals, tangents, **params)``, tangents with symbolic zeros.
      transpose: ``(cotangents, *args, **params)``, linear args undefined primals.
      dce: ``(used_outputs, ..., eqn)`` to ``(used_inputs, new eqn or None)``.
      checkify: ``(*operands, **params)``, the operands as ``checkify_operands`` reads.
      jet: ``(primals, series, **params)``.
      rebind: ``rebind(body, args, **params)`` runs ``body`` as the same call again (or
        inline), for the state discharge rule (``call_discharge``).
    """

    impl: Callable[..., Any] | None
    abstract_eval: Callable[..., Any]
    lowering: Callable[..., Any]
    batcher: Callable[..., Any]
    jvp: Callable[..., Any]
    transpose: Callable[..., Any]
    dce: Callable[..., Any]
    checkify: Callable[..., Any]
    jet: Callable[..., Any]
    rebind: Callable[..., Sequence[Any]]


def register_call_primitive(prim: Any, rules: CallRules) -> None:
    """Puts each of ``rules`` in its JAX table for ``prim``; partial eval for
    ``jax.checkpoint`` is JAX's closed-call rule (``call_partial_eval_rule``)."""
    if rules.impl is None:
        _dispatch.simple_impl(prim)  # eagerly: compiled alone
    else:
        prim.def_impl(rules.impl)
    prim.def_effectful_abstract_eval(rules.abstract_eval)
    _mlir.register_lowering(prim, rules.lowering)
    _batching.fancy_primitive_batchers[prim] = rules.batcher
    _ad.primitive_jvps[prim] = rules.jvp
    _ad.primitive_transposes[prim] = rules.transpose
    _pe.dce_rules[prim] = rules.dce
    _pe.partial_eval_jaxpr_custom_rules[prim] = call_partial_eval_rule()
    _checkify.error_checks[prim] = rules.checkify
    _jet.jet_rules[prim] = cast(Any, rules.jet)  # JAX types the table by its first rule
    register_discharge_rule(prim, call_discharge(rules.rebind))
    define_to_lojax(prim)


# ------------------------------------------------------------- the rules' versions
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


# ------------------------------------------------------- what the rules read of JAX
# JAX's DCE rule of a closed call: ``(used_outputs, ..., eqn)`` (jax >= 0.12 passes which
# inputs hold live refs before the equation) to ``(used_inputs, new eqn or None)``.
closed_call_dce: Callable[..., tuple[list[bool], Any]] = _pe.dce_jaxpr_closed_call_rule


def separate_consts(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list[Any]]:
    """``closed`` without consts (they become its leading inputs), and the consts."""
    jaxpr, consts = _pe.separate_consts(closed)
    return jaxpr, list(consts)


def symbolic_zero(value: Any) -> Any:
    """The symbolic zero tangent of ``value`` (JAX's ``ad.Zero``)."""
    return _ad.Zero(jax.typeof(value).to_tangent_aval())


def is_symbolic_zero(tangent: Any) -> bool:
    return type(tangent) is _ad.Zero


def is_undefined_primal(value: Any) -> bool:
    """Whether a transpose rule's operand is linear (its value unknown)."""
    return bool(_ad.is_undefined_primal(value))


def instantiate_zeros(tangent: Any) -> Any:
    """A cotangent as an array: a symbolic zero becomes zeros."""
    return _ad.instantiate_zeros(tangent)


def batch_jaxpr(call_jaxpr: ClosedJaxpr, axis_data: Any, dims: Sequence[Any]
                ) -> tuple[ClosedJaxpr, list[Any]]:
    """``call_jaxpr`` batched along ``dims`` (a batching rule's ``axis_data``), and its
    outputs' batch dimensions."""
    batched, dims_out = _batching.batch_jaxpr2(call_jaxpr, axis_data, tuple(dims))
    return batched, list(dims_out)


def axis_name(axis_data: Any) -> Any:
    """The name of a batching rule's axis (``vmap(axis_name=...)``); None: unnamed."""
    name = getattr(axis_data, "name", None)
    return None if name is _core.no_axis_name else name


def checkify_operands(args: Sequence[Any]) -> tuple[tuple[Any, ...], Any, Any, list[Any]]:
    """A checkify rule's operands: ``(context, error, enabled_errors, values)``;
    ``context`` is empty on jax <= 0.10, which passes none."""
    context_type = getattr(_checkify, "CheckifyContext", None)
    context = tuple(args[:1]) if context_type is not None and isinstance(
        args[0], context_type) else ()
    error, enabled_errors, *values = args[len(context):]
    return context, error, enabled_errors, values


def checkify_jaxpr(context: tuple[Any, ...], jaxpr: ClosedJaxpr, enabled_errors: Any,
                   error_tree: Any, avals: Sequence[Any]) -> tuple[ClosedJaxpr, Any]:
    """``jaxpr`` with its checks made values: it takes the error's leaves, then
    ``jaxpr``'s inputs (``avals``: all of them), and returns the error's then its own
    outputs; and the output tree."""
    checked, out_tree, _ = _checkify.jaxpr_to_checkify_jaxpr(
        *context, jaxpr, enabled_errors, error_tree, *avals)
    return checked, out_tree


def lower_fun(fn: Callable[..., Sequence[Any]]) -> Callable[..., Any]:
    """A lowering rule that traces ``fn(*args, **params)`` (multiple results) and lowers
    what it stages."""
    return _mlir.lower_fun(fn, multiple_results=True)  # type: ignore[no-any-return]


def lowers_inline(call_jaxpr: ClosedJaxpr) -> bool:
    """Whether ``lower_inline`` lowers ``call_jaxpr``: not a body with high types (which
    ``lower_fun``'s trace lowers) or internal mutable arrays (which it discharges)."""
    jaxpr = call_jaxpr.jaxpr
    return not (getattr(jaxpr, "is_high", False) or any(
        isinstance(e, _core.InternalMutableArrayEffect) for e in jaxpr.effects))


def lower_inline(ctx: Any, call_jaxpr: ClosedJaxpr, args: Sequence[Any]) -> Any:
    """``call_jaxpr``'s equations lowered inline into the caller, as ``lower_fun`` of an
    evaluation of it lowers them, without first tracing the body again into an equal
    jaxpr (the same steps as ``lower_fun``, jax 0.10.2 - 0.12, after its trace)."""
    jaxpr = call_jaxpr.jaxpr
    module = (ctx.module_context if ctx.platforms is None
              else ctx.module_context.replace(platforms=ctx.platforms))
    out, tokens = _mlir.jaxpr_subcomp(
        module, jaxpr, ctx.name_stack, ctx.tokens_in,
        _mlir.ir_consts(call_jaxpr.consts, [v.aval for v in jaxpr.constvars]), *args,
        dim_var_values=ctx.dim_var_values, const_lowering=ctx.const_lowering,
        outer_traceback=_mlir.xc.Traceback())
    ctx.set_tokens_out(tokens)
    return out


def partitioned_by_xla(ctx: Any) -> bool:
    """Whether XLA's sharding propagation lays out the values of the program being lowered
    (more than one device, outside the manual axes of a ``shard_map``)."""
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, _sharding_impls.ShardingContext):
        return bool(axis_context.num_devices > 1)
    if isinstance(axis_context, _sharding_impls.SPMDAxisContext):
        return any(size > 1 and name not in axis_context.manual_axes
                   for name, size in axis_context.mesh.shape.items())
    return False
