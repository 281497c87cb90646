"""Stream regions: ``stream_call`` (one non-inlined call carrying XLA frontend
attributes), the attributes an equation carries, and ``stream_region_p``, the primitive
jaxpar owns for a region of the emitted program, with every rule a JAX transformation
that meets it needs.

A stream region is an equation of ``stream_region_p``. It lowers exactly like
``xla_metadata_call``: one non-inlined ``call`` carrying the region's frontend
attributes; the lowering *is* ``stream_call`` of the body. Why a primitive of jaxpar's
own rather than JAX's ``xla_metadata_call``:
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

Rules (registered in one block at the end): impl, abstract eval (with the body's
effects), lowering, batching, DCE, partial eval for ``jax.checkpoint`` (JAX's
closed-call rule, as for ``xla_metadata_call``), ``checkify``, ``jet``, JVP and
transpose, which call back into the emitter (``register_stream_region_ad``) so that every
derived computation is again a region with these same rules, and state discharge.

Parameters: ``call_jaxpr`` (closed; its consts are concrete constants, which stay in the
call, see ``bind_stream_region``) and ``region``, an object of the emitter's with
``.attributes`` (a tuple of string pairs), ``.packs_results`` (whether the lowering may
pack results, below) and ``.derived(role)`` (the region of a derived computation), that
compares by value.

Sharp edge: ``xla_metadata_call`` moved from ``jax.experimental.scheduling_groups``
(0.8-0.10) to ``jax.experimental.xla_metadata`` (0.11+) and changed its equation
parameters; ``eqn_frontend_attributes`` reads both layouts.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.extend.core as jex_core
import numpy as np
from jax._src import checkify as _checkify
from jax._src import dispatch as _dispatch
from jax._src import sharding_impls as _sharding_impls
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax.experimental import jet as _jet

from .avals import aval_size, is_extended_dtype
from .call_rules import (
    call_abstract_eval,
    call_discharge,
    call_jet,
    call_partial_eval_rule,
    define_to_lojax,
    register_discharge_rule,
)
from .jaxprs import (
    JAX_VERSION,
    PRIMITIVE_HOMES,
    ClosedJaxpr,
    JaxprEqn,
    internal_primitive_name,
    jaxpr_eval,
    open_jaxpr,
)
from .tracing import is_tracer

try:  # jax >= 0.11
    from jax.experimental.xla_metadata import (  # type: ignore[attr-defined]
        xla_metadata_call as _xla_metadata_call,
    )
except ImportError:  # jax 0.8 - 0.10
    from jax.experimental.scheduling_groups import (  # type: ignore[no-redef]
        xla_metadata_call as _xla_metadata_call,
    )

# XLA:GPU up to the XLA in jax 0.10 does not overlap a stream-annotated call that
# returns a tuple with anything else (seen deviceless on an H200 with jaxlib 0.10.2;
# fixed by 0.12). The emitter then packs same-dtype results into one array.
PACK_MULTI_RESULT_CALLS = JAX_VERSION < (0, 11)


def stream_call(fn: Callable[..., Any], attributes: dict[str, str]) -> Callable[..., Any]:
    """Wraps ``fn`` so it lowers to one non-inlined call with ``attributes``."""
    return _xla_metadata_call(fn, **attributes)


# ---------------------------------------------------------------------- stream_region_p
STREAM_REGION = "jaxpar_stream_region"
stream_region_p = jex_core.Primitive(STREAM_REGION)
stream_region_p.multiple_results = True
# Some releases also ask the primitive whether an equation has effects.
setattr(stream_region_p, "is_effectful",  # noqa: B010
        lambda params: bool(params["call_jaxpr"].effects))

# The emitter's JVP and transpose of a region (see ``register_stream_region_ad``).
_region_ad: dict[str, Callable[..., Any]] = {}

# ---------------------------------------------------------------- frontend attributes
_XLA_METADATA_CALL = internal_primitive_name("xla_metadata_call_p", "xla_metadata_call")


def eqn_frontend_attributes(eqn: JaxprEqn) -> dict[str, str]:
    """The XLA frontend attributes the user or jaxpar attached to ``eqn``."""
    attrs: dict[str, str] = {}
    ctx_meta = getattr(eqn.ctx, "xla_metadata", None)
    if ctx_meta:
        attrs.update({str(k): str(v) for k, v in dict(ctx_meta).items()})
    compute_type = getattr(eqn.ctx, "compute_type", None)
    if compute_type is not None:
        attrs["_xla_compute_type"] = str(compute_type)
    if eqn.primitive is stream_region_p:
        attrs.update(dict(eqn.params["region"].attributes))
    elif eqn.primitive.name == _XLA_METADATA_CALL:
        if "xla_metadata" in eqn.params:  # jax >= 0.11
            attrs.update({str(k): str(v) for k, v in eqn.params["xla_metadata"]})
        else:  # jax 0.8 - 0.10: the attributes are the parameters themselves
            attrs.update({str(k): str(v) for k, v in eqn.params.items() if k != "jaxpr"})
    return attrs


def has_frontend_attributes(eqn: JaxprEqn) -> bool:
    """``bool(eqn_frontend_attributes(eqn))`` without building the dict: the passes ask
    this of every equation of every level they visit."""
    ctx = eqn.ctx
    if getattr(ctx, "xla_metadata", None) or getattr(ctx, "compute_type", None) is not None:
        return True
    primitive = eqn.primitive
    if primitive is stream_region_p or primitive.name == _XLA_METADATA_CALL:
        return bool(eqn_frontend_attributes(eqn))
    return False


def all_primitive_names() -> frozenset[str]:
    """Names of every primitive the running jax defines at module level (for tests).

    Imports JAX's public modules and its internal homes (``PRIMITIVE_HOMES``), then collects the
    ``Primitive`` attributes of every loaded ``jax`` module, and jaxpar's own
    (``stream_region_p``).
    """
    for name in ("jax.numpy", "jax.lax", "jax.random", "jax.nn", "jax.scipy",
                 "jax.experimental.shard_map", "jax.experimental.compute_on",
                 "jax.experimental.xla_metadata", "jax.experimental.scheduling_groups",
                 "jax.experimental.custom_partitioning", "jax.ad_checkpoint",
                 "jax.experimental.checkify", *PRIMITIVE_HOMES):
        try:
            importlib.import_module(name)
        except ImportError:  # not in this release
            continue
    names = set()
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "jax" or module_name.startswith("jax.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, jex_core.Primitive):
                names.add(value.name)
    names.add(stream_region_p.name)
    return frozenset(names)


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
    if not any(is_tracer(c) for c in open_jaxpr(closed)[1]):
        return list(stream_region_p.bind(*args, call_jaxpr=closed, region=region))
    jaxpr, consts = _pe.separate_consts(closed)
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
    if is_extended_dtype(dtype):  # PRNG keys: NumPy cannot interpret them
        return False
    return bool(np.issubdtype(dtype, np.number) or np.issubdtype(dtype, np.bool_))


# ---------------------------------------- the rules (registered in one block at the end)
def _partitioned_by_xla(ctx: Any) -> bool:
    """Whether XLA's sharding propagation lays out the values of the program being lowered
    (more than one device, outside the manual axes of a ``shard_map``)."""
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, _sharding_impls.ShardingContext):
        return axis_context.num_devices > 1
    if isinstance(axis_context, _sharding_impls.SPMDAxisContext):
        return any(size > 1 and name not in axis_context.manual_axes
                   for name, size in axis_context.mesh.shape.items())
    return False


def _region_lowering(ctx: Any, *args: Any, call_jaxpr: ClosedJaxpr, region: Any) -> Any:
    # The body evaluated inside JAX's own ``xla_metadata_call``: the same call, the same
    # attributes, on every supported jax. Where XLA would not overlap a call returning a
    # tuple (``PACK_MULTI_RESULT_CALLS``) the call returns its results as one flat array.
    # Packed here, when lowering, and not when emitting: a transformation (``vmap``) then
    # sees each result on its own, batched or not as the body makes it. Not where XLA
    # shards the program: the slices of one flat array would all be sharded as that
    # array, where ``jax.jit`` shards each result as its own computation makes it; nor
    # for a region that must hold its collectives alone (``region.packs_results``).
    pack = (PACK_MULTI_RESULT_CALLS and region.packs_results
            and packable(call_jaxpr.out_avals) and not _partitioned_by_xla(ctx))
    lowering = _region_packed_lowering if pack else _region_call_lowering
    return lowering(ctx, *args, call_jaxpr=call_jaxpr, region=region)


def _region_call(*args: Any, call_jaxpr: ClosedJaxpr, region: Any) -> list[Any]:
    call = stream_call(lambda *a: tuple(jaxpr_eval(call_jaxpr, *a)), dict(region.attributes))
    return list(call(*args))


def _region_packed_call(*args: Any, call_jaxpr: ClosedJaxpr, region: Any) -> list[Any]:
    def packed(*a: Any) -> tuple[Any]:
        return (jax.numpy.concatenate([jax.numpy.ravel(r) for r in jaxpr_eval(call_jaxpr, *a)]),)

    (flat,) = stream_call(packed, dict(region.attributes))(*args)
    results, offset = [], 0
    for aval in call_jaxpr.out_avals:
        size = aval_size(aval)
        results.append(jax.numpy.reshape(flat[offset:offset + size], aval.shape))
        offset += size
    return results


_region_call_lowering = _mlir.lower_fun(_region_call, multiple_results=True)
_region_packed_lowering = _mlir.lower_fun(_region_packed_call, multiple_results=True)


def _region_batcher(axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[Any], *,
                    call_jaxpr: ClosedJaxpr, region: Any) -> tuple[list[Any], list[Any]]:
    batched, dims_out = _batching.batch_jaxpr2(call_jaxpr, axis_data, tuple(dims_in))
    outs = stream_region_p.bind(*vals_in, call_jaxpr=batched, region=region)
    return list(outs), list(dims_out)


def _region_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, call_jaxpr: ClosedJaxpr,
                region: Any) -> tuple[list[Any], list[Any]]:
    given = [None if type(t) is _ad.Zero else t for t in tangents]
    outs, out_tangents = _region_ad["jvp"](call_jaxpr, region, list(primals), given)
    return list(outs), [_ad.Zero(jax.typeof(o).to_tangent_aval()) if t is None else t
                        for o, t in zip(outs, out_tangents, strict=True)]


def _region_transpose(cts: Sequence[Any], *args: Any, call_jaxpr: ClosedJaxpr,
                      region: Any) -> list[Any]:
    linear = [_ad.is_undefined_primal(a) for a in args]
    values = [None if lin else a for a, lin in zip(args, linear, strict=True)]
    given = [None if type(ct) is _ad.Zero else ct for ct in cts]
    return list(_region_ad["transpose"](call_jaxpr, region, values, linear, given))


def _region_checkify(*args: Any, call_jaxpr: ClosedJaxpr, region: Any) -> tuple[Any, list[Any]]:
    # jax <= 0.10: (error, enabled_errors, *vals); jax >= 0.11 passes a context first.
    context_type = getattr(_checkify, "CheckifyContext", None)
    context = args[:1] if context_type is not None and isinstance(args[0], context_type) else ()
    error, enabled_errors, *vals = args[len(context):]
    err_vals, err_tree = jax.tree_util.tree_flatten(error)
    operands = [*err_vals, *vals]
    checked, out_tree, _ = _checkify.jaxpr_to_checkify_jaxpr(
        *context, call_jaxpr, enabled_errors, err_tree, *[jax.typeof(v) for v in operands])
    checked, consts = _pe.separate_consts(checked)
    outs = stream_region_p.bind(*consts, *operands, call_jaxpr=checked, region=region)
    return jax.tree_util.tree_unflatten(out_tree, outs)  # type: ignore[no-any-return]


def _region_jet(primals_in: Sequence[Any], series_in: Sequence[Any], *, call_jaxpr: ClosedJaxpr,
                region: Any) -> tuple[list[Any], list[Any]]:
    return call_jet(primals_in, series_in, call_jaxpr,
                     lambda body, args: bind_stream_region(body, args, region))


# ------------------------------------------------ registering stream_region_p's rules
_dispatch.simple_impl(stream_region_p)  # eagerly: compiled alone, as a stream call
stream_region_p.def_effectful_abstract_eval(call_abstract_eval)
_mlir.register_lowering(stream_region_p, _region_lowering)
_batching.fancy_primitive_batchers[stream_region_p] = _region_batcher
_ad.primitive_jvps[stream_region_p] = _region_jvp
_ad.primitive_transposes[stream_region_p] = _region_transpose
_pe.dce_rules[stream_region_p] = _pe.dce_jaxpr_closed_call_rule
_pe.partial_eval_jaxpr_custom_rules[stream_region_p] = call_partial_eval_rule()
_checkify.error_checks[stream_region_p] = _region_checkify
_jet.jet_rules[stream_region_p] = cast(Any, _region_jet)  # JAX types the table by its first rule
register_discharge_rule(stream_region_p, call_discharge(
    lambda body, args, region: bind_stream_region(body, args, region)))
define_to_lojax(stream_region_p)
