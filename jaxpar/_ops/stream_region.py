"""``stream_region_p``, the primitive jaxpar owns for a region of the emitted program, with
every rule a JAX transformation that meets it needs.

A stream region is an equation of ``stream_region_p``. It lowers exactly like
``xla_metadata_call``: one non-inlined ``call`` carrying the region's frontend
attributes; the lowering *is* ``_compat.stream_call`` of the body. Why a primitive of
jaxpar's own rather than JAX's ``xla_metadata_call``:
  * ``xla_metadata_call`` has no ``checkify`` rule, so the checks of its body would be
    silently dropped; and JAX's own transpose of it yields another plain
    ``xla_metadata_call``, whose derivative under ``jax.checkpoint`` asserts in JAX's
    bilinear transpose (second-order reverse mode).
  * Registering those rules on JAX's ``xla_metadata_call_p`` would change JAX for code
    that is not jaxpar's (importing jaxpar changes nothing outside jaxpar); emitting
    through ``jit`` (which has every rule) cannot put attributes on the call alone; and
    a transformation such as ``checkify`` stages the function before it interprets it,
    so the emitter cannot see it coming. A primitive of our own, with rules only for
    itself, has neither problem.

Rules (named in one ``_compat.CallRules`` at the end): impl, abstract eval (with the
body's effects), lowering, batching, DCE, partial eval for ``jax.checkpoint`` (JAX's
closed-call rule, as for ``xla_metadata_call``), ``checkify``, ``jet``, JVP and
transpose, which call back into the emitter (``register_stream_region_ad``) so that every
derived computation is again a region with these same rules, and state discharge.

Parameters: ``call_jaxpr`` (closed; its consts are concrete constants, which stay in the
call, see ``bind_stream_region``) and ``region``, an object of the emitter's with
``.attributes`` (a tuple of string pairs), ``.packs_results`` (whether the lowering may
pack results, below) and ``.derived(role)`` (the region of a derived computation), that
compares by value.

Example::

    outs = bind_stream_region(lambda a, b: [a @ b], [x, y], region)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import numpy as np

from .. import _compat
from .._compat import ClosedJaxpr
from .call_rules import call_abstract_eval, call_jet

# ---------------------------------------------------------------------- stream_region_p
STREAM_REGION = "jaxpar_stream_region"
stream_region_p = jex_core.Primitive(STREAM_REGION)
stream_region_p.multiple_results = True
# Some releases also ask the primitive whether an equation has effects.
setattr(stream_region_p, "is_effectful",  # noqa: B010
        lambda params: bool(params["call_jaxpr"].effects))

# The emitter's JVP and transpose of a region (see ``register_stream_region_ad``).
_region_ad: dict[str, Callable[..., Any]] = {}


def bind_stream_region(fn: Callable[..., Sequence[Any]], args: Sequence[Any],
                       region: Any) -> list[Any]:
    """``fn(*args)`` as one stream region (a ``stream_region_p`` equation).

    The constants ``fn`` closes over stay in the region's body, as ``jax.jit`` keeps
    them in its program, unless one is a tracer of an outer trace (then all are
    operands). A constant passed into the non-inlined call is an operand of unknown
    sharding, and XLA's sharding propagation, which does not see through such a call,
    then shards the call's results otherwise than ``jax.jit`` shards the same values
    (``P(None, "y")`` where ``jax.jit`` gives ``P()``).
    """
    closed = jax.make_jaxpr(lambda *a: tuple(fn(*a)))(*[jax.typeof(a) for a in args])
    if not any(_compat.is_tracer(c) for c in _compat.open_jaxpr(closed)[1]):
        return list(stream_region_p.bind(*args, call_jaxpr=closed, region=region))
    jaxpr, consts = _compat.separate_consts(closed)
    return list(stream_region_p.bind(*consts, *args, call_jaxpr=jaxpr, region=region))


def register_stream_region_ad(jvp: Callable[..., Any], transpose: Callable[..., Any]) -> None:
    """Installs the emitter's derivative rules for regions (called once, by ``_emit``).

    ``jvp(call_jaxpr, region, primals, tangents)`` gets None for a zero tangent and
    returns ``(outputs, output tangents)`` with None for zeros.
    ``transpose(call_jaxpr, region, args, linear, cotangents)`` gets the non-linear
    operands' values (None where ``linear``) and the outputs' cotangents (None for
    zeros) and returns one cotangent (or None) per operand.
    """
    _region_ad["jvp"] = jvp
    _region_ad["transpose"] = transpose


def packable(avals: Sequence[Any]) -> bool:
    """Whether several results can travel as one flat array (same plain dtype, not weak)."""
    if len(avals) < 2:
        return False
    dtypes = {a.dtype for a in avals}
    if len(dtypes) != 1 or any(getattr(a, "weak_type", False) for a in avals):
        return False
    (dtype,) = dtypes
    if _compat.is_extended_dtype(dtype):  # PRNG keys: NumPy cannot interpret them
        return False
    return bool(np.issubdtype(dtype, np.number) or np.issubdtype(dtype, np.bool_))


# ---------------------------------------- the rules (named in one block at the end)
def _region_lowering(ctx: Any, *args: Any, call_jaxpr: ClosedJaxpr, region: Any) -> Any:
    # The body evaluated inside JAX's own ``xla_metadata_call``: the same call, the same
    # attributes, on every supported jax. Where XLA would not overlap a call returning a
    # tuple (``_compat.PACK_MULTI_RESULT_CALLS``) the call returns its results as one flat array.
    # Packed here, when lowering, and not when emitting: a transformation (``vmap``) then
    # sees each result on its own, batched or not as the body makes it. Not where XLA
    # shards the program: the slices of one flat array would all be sharded as that
    # array, where ``jax.jit`` shards each result as its own computation makes it; nor
    # for a region that must hold its collectives alone (``region.packs_results``).
    pack = (_compat.PACK_MULTI_RESULT_CALLS and region.packs_results
            and packable(call_jaxpr.out_avals) and not _compat.partitioned_by_xla(ctx))
    lowering = _region_packed_lowering if pack else _region_call_lowering
    return lowering(ctx, *args, call_jaxpr=call_jaxpr, region=region)


def _region_call(*args: Any, call_jaxpr: ClosedJaxpr, region: Any) -> list[Any]:
    call = _compat.stream_call(lambda *a: tuple(_compat.jaxpr_eval(call_jaxpr, *a)),
                               dict(region.attributes))
    return list(call(*args))


def _region_packed_call(*args: Any, call_jaxpr: ClosedJaxpr, region: Any) -> list[Any]:
    def packed(*a: Any) -> tuple[Any]:
        return (jax.numpy.concatenate([jax.numpy.ravel(r)
                                       for r in _compat.jaxpr_eval(call_jaxpr, *a)]),)

    (flat,) = _compat.stream_call(packed, dict(region.attributes))(*args)
    results, offset = [], 0
    for aval in call_jaxpr.out_avals:
        size = _compat.aval_size(aval)
        results.append(jax.numpy.reshape(flat[offset:offset + size], aval.shape))
        offset += size
    return results


_region_call_lowering = _compat.lower_fun(_region_call)
_region_packed_lowering = _compat.lower_fun(_region_packed_call)


def _region_batcher(axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[Any], *,
                    call_jaxpr: ClosedJaxpr, region: Any) -> tuple[list[Any], list[Any]]:
    batched, dims_out = _compat.batch_jaxpr(call_jaxpr, axis_data, dims_in)
    outs = stream_region_p.bind(*vals_in, call_jaxpr=batched, region=region)
    return list(outs), dims_out


def _region_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, call_jaxpr: ClosedJaxpr,
                region: Any) -> tuple[list[Any], list[Any]]:
    given = [None if _compat.is_symbolic_zero(t) else t for t in tangents]
    outs, out_tangents = _region_ad["jvp"](call_jaxpr, region, list(primals), given)
    return list(outs), [_compat.symbolic_zero(o) if t is None else t
                        for o, t in zip(outs, out_tangents, strict=True)]


def _region_transpose(cts: Sequence[Any], *args: Any, call_jaxpr: ClosedJaxpr,
                      region: Any) -> list[Any]:
    linear = [_compat.is_undefined_primal(a) for a in args]
    values = [None if lin else a for a, lin in zip(args, linear, strict=True)]
    given = [None if _compat.is_symbolic_zero(ct) else ct for ct in cts]
    return list(_region_ad["transpose"](call_jaxpr, region, values, linear, given))


def _region_checkify(*args: Any, call_jaxpr: ClosedJaxpr, region: Any) -> tuple[Any, list[Any]]:
    context, error, enabled_errors, vals = _compat.checkify_operands(args)
    err_vals, err_tree = jax.tree_util.tree_flatten(error)
    operands = [*err_vals, *vals]
    checked, out_tree = _compat.checkify_jaxpr(
        context, call_jaxpr, enabled_errors, err_tree, [jax.typeof(v) for v in operands])
    checked, consts = _compat.separate_consts(checked)
    outs = stream_region_p.bind(*consts, *operands, call_jaxpr=checked, region=region)
    return jax.tree_util.tree_unflatten(out_tree, outs)  # type: ignore[no-any-return]


def _region_jet(primals_in: Sequence[Any], series_in: Sequence[Any], *, call_jaxpr: ClosedJaxpr,
                region: Any) -> tuple[list[Any], list[Any]]:
    return call_jet(primals_in, series_in, call_jaxpr,
                     lambda body, args: bind_stream_region(body, args, region))


# ------------------------------------------------ registering stream_region_p's rules
_compat.register_call_primitive(stream_region_p, _compat.CallRules(
    impl=None,  # eagerly: compiled alone, as a stream call
    abstract_eval=call_abstract_eval,
    lowering=_region_lowering,
    batcher=_region_batcher,
    jvp=_region_jvp,
    transpose=_region_transpose,
    dce=_compat.closed_call_dce,
    checkify=_region_checkify,
    jet=_region_jet,
    rebind=lambda body, args, region: bind_stream_region(body, args, region),
))
