"""``program_p``: the rewritten program as one equation that remembers the program it
came from, with its rules.

checkify reports, of several failing checks, the first in the order it traces them (per
error kind the earliest, across kinds the smallest code, and codes are drawn in tracing
order). A rewritten program runs the same checks in another order (packed streams,
batched members, fused loops), so with several checks failing at once it would report
another error than ``jax.jit``. ``program_p`` wraps the rewritten program; it lowers
inline (no call, nothing in the HLO changes), every transformation sees straight through
it, and its checkify rule checks the *original* program, in the user's order. Only the
equation bound by ``bind_program`` knows its source: an equation another rule rebuilt
(DCE, checkpoint's split) holds another body and is checked as it is.

Example::

    outs = bind_program(rewritten, original, args)   # checkify checks ``original``
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core

from .. import _compat
from .._compat import ClosedJaxpr, jaxpr_eval, open_jaxpr
from .call_rules import call_abstract_eval, call_jet

PROGRAM = "jaxpar_program"
program_p = jex_core.Primitive(PROGRAM)
program_p.multiple_results = True
setattr(program_p, "is_effectful",  # noqa: B010
        lambda params: bool(params["call_jaxpr"].effects))


class ProgramSource:
    """``program_p``'s ``source``: the original program of one bound equation.

    ``fn(*operands[skip:])`` computes what the equation's body computes, in the user's
    order. Compares by identity, as JAX compares a jaxpr.
    """

    __slots__ = ("body", "checks_only", "fn", "skip")

    def __init__(self, fn: Callable[..., Sequence[Any]], skip: int,
                 checks_only: bool = False) -> None:
        self.fn, self.skip = fn, skip
        self.body: ClosedJaxpr | None = None  # the equation's body, once bound
        # An equation with no outputs that only holds the original's checks for
        # checkify (its body is empty; DCE keeps it).
        self.checks_only = checks_only

    def __repr__(self) -> str:
        return "<original program>"


def _body_jaxpr(fn: Callable[..., Sequence[Any]], avals: Sequence[Any]
                  ) -> tuple[ClosedJaxpr, list[Any]]:
    """``fn`` traced at ``avals`` as a closed jaxpr without consts, and the consts it
    closed over (values or tracers of an outer trace), to pass as leading operands."""
    closed = jax.make_jaxpr(lambda *args: tuple(fn(*args)))(*avals)
    return _compat.separate_consts(closed)


def bind_program(fn: Callable[..., Sequence[Any]], source: Callable[..., Sequence[Any]],
                 args: Sequence[Any], checks_only: bool = False) -> list[Any]:
    """``fn(*args)`` as one ``program_p`` equation whose checkify rule runs ``source``
    (the same function of ``args``, as the user wrote it) instead."""
    jaxpr, consts = _body_jaxpr(fn, [jax.typeof(a) for a in args])
    marker = ProgramSource(source, len(consts), checks_only)
    marker.body = jaxpr
    return list(program_p.bind(*consts, *args, call_jaxpr=jaxpr, source=marker))


def _program_eval(*args: Any, call_jaxpr: ClosedJaxpr, source: Any) -> list[Any]:
    del source
    return jaxpr_eval(call_jaxpr, *args)


_program_lowered_by_tracing = _compat.lower_fun(_program_eval)


def _program_lowering(ctx: Any, *args: Any, call_jaxpr: ClosedJaxpr, source: Any) -> Any:
    """``program_p`` lowered inline: its body's equations, as ``mlir.lower_fun`` of
    ``_program_eval`` lowers them, without first tracing the body again into an equal
    jaxpr (that trace cost as much as the emission's own: a bind per equation).

    The same steps as ``lower_fun`` (jax 0.10.2 - 0.12) after its trace; a body with
    high types (which its trace lowers) or internal mutable arrays (which it discharges)
    takes that path.
    """
    if not _compat.lowers_inline(call_jaxpr):
        return _program_lowered_by_tracing(ctx, *args, call_jaxpr=call_jaxpr, source=source)
    return _compat.lower_inline(ctx, call_jaxpr, args)


def _checked_first(source: ProgramSource, check: Callable[..., Any],
                   body: Callable[..., Sequence[Any]]) -> Callable[..., list[Any]]:
    """A source for an equation a transformation derived from ``source``'s: it runs the
    original program's checks first (``check``, its outputs dropped), then ``body``.
    checkify then reports the original's first failing check, as for ``jax.jit``: the
    body's own checks only find again what the original's found first. Only checkify
    runs a source, so only a checked program computes twice."""
    def fn(*operands: Any) -> list[Any]:
        check(*operands[source.skip:])
        return list(body(*operands))
    return fn


def _program_batcher(axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[Any], *,
                     call_jaxpr: ClosedJaxpr, source: Any) -> tuple[list[Any], list[Any]]:
    batched, dims_out = _compat.batch_jaxpr(call_jaxpr, axis_data, dims_in)
    if (source.body is not call_jaxpr
            or getattr(axis_data, "explicit_mesh_axis", None) is not None):
        return jaxpr_eval(batched, *vals_in), dims_out
    spmd = getattr(axis_data, "spmd_name", None)
    original = jax.vmap(
        lambda *a: tuple(source.fn(*a)),
        in_axes=list(dims_in[source.skip:]),  # None: not mapped
        axis_size=axis_data.size, axis_name=_compat.axis_name(axis_data),
        **({"spmd_axis_name": spmd} if spmd is not None else {}))
    outs = bind_program(lambda *v: jaxpr_eval(batched, *v),
                        _checked_first(source, original, lambda *v: jaxpr_eval(batched, *v)),
                        list(vals_in))
    return outs, dims_out


def _program_dce(used_outputs: list[bool], *rest: Any) -> tuple[list[bool], Any]:
    # As for a closed call; an equation that keeps every operand keeps its source too
    # (the original program's outputs narrowed alike), so checkify of reverse mode, which
    # drops the forward outputs it does not need, still checks the original. jax >= 0.12
    # passes which inputs hold live refs before the equation.
    eqn = rest[-1]
    source = eqn.params["source"]
    if source.checks_only and source.body is eqn.params["call_jaxpr"]:
        return [True] * len(eqn.invars), eqn
    used_inputs, new_eqn = _compat.closed_call_dce(used_outputs, *rest)
    if new_eqn is None or source.body is not eqn.params["call_jaxpr"] or not all(used_inputs):
        return used_inputs, new_eqn

    def narrowed(*operands: Any) -> list[Any]:
        outs = source.fn(*operands)
        return [o for o, used in zip(outs, used_outputs, strict=True) if used]

    marker = ProgramSource(narrowed, source.skip)
    marker.body = new_eqn.params["call_jaxpr"]
    return used_inputs, new_eqn.replace(params={**new_eqn.params, "source": marker})


def _program_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, call_jaxpr: ClosedJaxpr,
                 source: Any) -> tuple[list[Any], list[Any]]:
    # Inline. First, for checkify, an equation holding the original program's checks
    # (nothing runs otherwise), so a checked derivative reports the original's first
    # failing check. A body holding a shard_map is split as jax.linearize splits it
    # (the outputs from the primals alone, then the tangents from the residuals): a JVP
    # of the whole body traced at once leaves the primal outputs of a shard_map unknown
    # to reverse mode's partial evaluation. Other bodies are differentiated whole, which
    # runs each effect of a custom rule as often as jax.jit's derivative does.
    if source.body is call_jaxpr and not source.checks_only:
        bind_program(lambda *p: [], _checked_first(source, source.fn, lambda *p: []),
                     list(primals), checks_only=True)
    def inexact(aval: Any) -> bool:
        return bool(jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact))

    avals = [jax.typeof(p) for p in primals]
    diff = [not _compat.is_symbolic_zero(t) and inexact(a)
            for a, t in zip(avals, tangents, strict=True)]
    if not any(diff):
        outs = jaxpr_eval(call_jaxpr, *primals)
        return outs, [_compat.symbolic_zero(o) for o in outs]
    if not any(_compat.is_shard_map(eqn) for eqn in open_jaxpr(call_jaxpr)[0].eqns):
        # Only the operands with a tangent are differentiated; the others are closed over.
        # A zero tangent made dense would be a known value: the tangent computation fed by
        # it alone (a region's linear half, a ``custom_vjp``'s ``custom_lin``) would then
        # run as primal work, where ``vmap`` batches ``custom_lin`` and fails ("can't
        # apply forward-mode autodiff (jvp) to a custom_vjp function").
        def of_diff(*diff_primals: Any) -> tuple[Any, ...]:
            given = iter(diff_primals)
            return tuple(jaxpr_eval(call_jaxpr, *[next(given) if d else p
                                                  for p, d in zip(primals, diff, strict=True)]))

        outs, out_tangents = jax.jvp(
            of_diff, tuple(p for p, d in zip(primals, diff, strict=True) if d),
            tuple(t for t, d in zip(tangents, diff, strict=True) if d))
        return list(outs), list(out_tangents)
    lin = _compat.linearize_split(lambda *a: jaxpr_eval(call_jaxpr, *a), avals, diff)
    forward = jaxpr_eval(lin.forward, *primals)
    outs, residuals = forward[:lin.num_outputs], forward[lin.num_outputs:]
    out_tangents = _compat.eval_linear(lin, residuals,
                               [t for t, d in zip(tangents, diff, strict=True) if d])
    return outs, [t if inexact(jax.typeof(o)) else _compat.symbolic_zero(o)
                  for o, t in zip(outs, out_tangents, strict=True)]


def _program_transpose(cts: Sequence[Any], *args: Any, call_jaxpr: ClosedJaxpr,
                       source: Any) -> list[Any]:
    del source
    linear = [_compat.is_undefined_primal(a) for a in args]

    def body(*lin: Any) -> tuple[Any, ...]:
        given = iter(lin)
        full = [next(given) if is_linear else a for a, is_linear in zip(args, linear, strict=True)]
        return tuple(jaxpr_eval(call_jaxpr, *full))

    avals = [a.aval for a, is_linear in zip(args, linear, strict=True) if is_linear]
    transposed = jax.linear_transpose(
        body, *[jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals])
    given = transposed(tuple(_compat.instantiate_zeros(ct) for ct in cts))
    out = iter(given)
    return [next(out) if is_linear else None for is_linear in linear]


def _program_checkify(*args: Any, call_jaxpr: ClosedJaxpr, source: Any) -> tuple[Any, list[Any]]:
    context, error, enabled_errors, vals = _compat.checkify_operands(args)
    if source.body is call_jaxpr:  # the equation bind_program made: check the original
        vals, fn = vals[source.skip:], source.fn
    else:
        def fn(*a: Any) -> list[Any]:
            return jaxpr_eval(call_jaxpr, *a)
    original = jax.make_jaxpr(lambda *a: tuple(fn(*a)))(*[jax.typeof(v) for v in vals])
    err_vals, err_tree = jax.tree_util.tree_flatten(error)
    checked, out_tree = _compat.checkify_jaxpr(
        context, original, enabled_errors, err_tree,
        [jax.typeof(v) for v in [*err_vals, *vals]])
    outs = jaxpr_eval(checked, *err_vals, *vals)
    return jax.tree_util.tree_unflatten(out_tree, outs)  # type: ignore[no-any-return]


def _program_jet(primals_in: Sequence[Any], series_in: Sequence[Any], *, call_jaxpr: ClosedJaxpr,
                 source: Any) -> tuple[list[Any], list[Any]]:
    del source
    return call_jet(primals_in, series_in, call_jaxpr, lambda body, args: body(*args))


# ------------------------------------------------ registering program_p's rules
_compat.register_call_primitive(program_p, _compat.CallRules(
    impl=_program_eval,
    abstract_eval=call_abstract_eval,
    lowering=_program_lowering,
    batcher=_program_batcher,
    jvp=_program_jvp,
    transpose=_program_transpose,
    dce=_program_dce,
    checkify=_program_checkify,
    jet=_program_jet,
    # Inline: the program lowers inline, and JAX discharges state only when lowering,
    # after every transformation it would check.
    rebind=lambda body, args, source: body(*args),
))
