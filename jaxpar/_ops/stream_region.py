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
closed-call rule, as for ``xla_metadata_call``), ``checkify``, ``jet``, state discharge,
and JVP and transpose, under which every derived computation is again a region with
these same rules (``_jvp_as_two_regions``, ``_transpose_as_a_region``).

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
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._compat import ClosedJaxpr, JaxprLike
from .call_rules import call_abstract_eval, call_jet

# ---------------------------------------------------------------------- stream_region_p
STREAM_REGION = "jaxpar_stream_region"
stream_region_p = jex_core.Primitive(STREAM_REGION)
stream_region_p.multiple_results = True
# Some releases also ask the primitive whether an equation has effects.
setattr(stream_region_p, "is_effectful",  # noqa: B010
        lambda params: bool(params["call_jaxpr"].effects))


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
    outs, out_tangents = _jvp_as_two_regions(call_jaxpr, region, list(primals), given)
    return list(outs), [_compat.symbolic_zero(o) if t is None else t
                        for o, t in zip(outs, out_tangents, strict=True)]


def _region_transpose(cts: Sequence[Any], *args: Any, call_jaxpr: ClosedJaxpr,
                      region: Any) -> list[Any]:
    linear = [_compat.is_undefined_primal(a) for a in args]
    values = [None if lin else a for a, lin in zip(args, linear, strict=True)]
    given = [None if _compat.is_symbolic_zero(ct) else ct for ct in cts]
    return list(_transpose_as_a_region(call_jaxpr, region, values, linear, given))


def _inexact(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))


def _jvp_as_two_regions(call_jaxpr: JaxprLike, region: Any, primals: list[Any],
                        tangents: list[Any | None]) -> tuple[list[Any], list[Any | None]]:
    """The JVP of a region: what ``jax.linearize`` computes, as two regions.

    JAX differentiates an ``xla_metadata_call`` by differentiating its body whole:
    the JVP of a region holding a loop is one loop carrying primal and tangent values
    together. Transposing that inside ``jax.checkpoint`` (which partially evaluates
    the JVP without splitting the call) fails with an ``AssertionError`` in JAX's
    transpose rule, and outside it the transposed regions inherit the forward
    regions' scheduling group, which XLA:GPU rejects ("annotation groups with gaps").
    So a region's JVP is a forward region returning the outputs and the residuals and
    a linear region mapping input tangents to output tangents, each on the same
    stream in a derived group, each a region again (higher derivatives work the same
    way). ``tangents`` holds None for zero tangents; so do the returned ones.
    """
    avals = [jax.typeof(p) for p in primals]
    diff = [_inexact(a) and t is not None for a, t in zip(avals, tangents, strict=True)]
    if not any(diff):
        outs = bind_stream_region(
            lambda *a: _compat.jaxpr_eval(call_jaxpr, *a), primals, region)
        return outs, [None] * len(outs)
    lin = _compat.linearize_split(lambda *a: _compat.jaxpr_eval(call_jaxpr, *a), avals, diff)
    forward_jaxpr, forward_consts = _compat.open_jaxpr(lin.forward)
    forward = _lean_region(
        forward_jaxpr.invars, forward_jaxpr.outvars,
        dict(zip(forward_jaxpr.constvars, forward_consts, strict=True)),
        lambda *p: _compat.jaxpr_eval(lin.forward, *p), primals, region.derived("forward"))
    outs, residuals = forward[:lin.num_outputs], forward[lin.num_outputs:]
    out_diff = [_inexact(jax.typeof(o)) for o in outs]
    if not any(out_diff):
        return list(outs), [None] * len(outs)
    diff_tangents = [t for t, d in zip(tangents, diff, strict=True) if d]
    linear = lin.linear
    kept = [v for v, d in zip(linear.outvars, out_diff, strict=True) if d]

    def evaluate_linear(*values: Any) -> list[Any]:
        res, tans = values[:lin.num_residuals], values[lin.num_residuals:]
        return [t for t, d in zip(_compat.eval_linear(lin, res, tans), out_diff, strict=True)
                if d]

    linear_outs = iter(_lean_region(
        [*linear.constvars, *linear.invars], kept, {}, evaluate_linear,
        [*residuals, *diff_tangents], region.derived("linear")))
    return list(outs), [next(linear_outs) if d else None for d in out_diff]


def _transpose_as_a_region(call_jaxpr: JaxprLike, region: Any, values: list[Any | None],
                           linear: list[bool], cotangents: list[Any | None]
                           ) -> list[Any | None]:
    """The transpose of a (linear) region, as a region on the same stream and group.

    JAX's transpose of an ``xla_metadata_call`` is a plain ``xla_metadata_call`` again,
    which JAX then differentiates by its own rule: second-order reverse mode through
    ``jax.checkpoint`` asserted there. Ours is a region with our rules.
    """
    in_avals = _compat.in_avals(call_jaxpr)
    out_avals = list(call_jaxpr.out_avals)
    transposed_in = [i for i, lin in enumerate(linear) if lin and _inexact(in_avals[i])]
    given = [j for j, ct in enumerate(cotangents) if ct is not None and _inexact(out_avals[j])]
    if not transposed_in or not given:
        return [None] * len(values)
    wanted = set(transposed_in)
    residuals = [v for v, lin in zip(values, linear, strict=True) if not lin]

    def transposed(*operands: Any) -> list[Any]:
        res, cts = operands[:len(residuals)], list(operands[len(residuals):])

        def linear_fn(*lin_values: Any) -> list[Any]:
            lin_it, res_it = iter(lin_values), iter(res)
            full = [next(res_it) if not lin else next(lin_it) if i in wanted
                    else _zeros(in_avals[i]) for i, lin in enumerate(linear)]
            outs = _compat.jaxpr_eval(call_jaxpr, *full)
            return [outs[j] for j in given]

        return list(jax.linear_transpose(linear_fn, *[in_avals[i] for i in transposed_in])(cts))

    operands = [*residuals, *[cotangents[j] for j in given]]
    closed = _compat.make_closed_jaxpr(transposed, [jax.typeof(o) for o in operands])
    inner, consts = _compat.open_jaxpr(closed)
    results = iter(_lean_region(inner.invars, inner.outvars,
                                dict(zip(inner.constvars, consts, strict=True)),
                                lambda *o: _compat.jaxpr_eval(closed, *o), operands, region))
    return [next(results) if i in wanted else None for i in range(len(values))]


def _zeros(aval: Any) -> Any:
    return np.zeros(aval.shape, aval.dtype) if aval.dtype == jax.dtypes.float0 else \
        jnp.zeros(aval.shape, aval.dtype)



def _lean_region(invars: Sequence[Any], outvars: Sequence[Any], consts: dict[Any, Any],
                 evaluate: Callable[..., Sequence[Any]], args: Sequence[Any],
                 region: Any) -> list[Any]:
    """``evaluate(*args)`` (a jaxpr's evaluation) as a region returning only new values.

    ``invars``/``outvars`` are the jaxpr's, ``consts`` maps its constvars to values.
    Outputs that are inputs, constants or literals are taken outside the region, and
    each computed value is returned once. The forward half of a linearization
    forwards primal inputs as residuals; returned from the call, they made XLA:GPU
    find a cycle in a loop body (deviceless H200, jaxlib 0.10.2).
    """
    position = {v: i for i, v in enumerate(invars)}
    first: dict[Any, int] = {}  # computed outvar -> its slot among the region's results
    picks: list[int] = []  # output index of each slot
    sources: list[tuple[bool, Any]] = []  # (computed?, slot or value) per output
    for index, v in enumerate(outvars):
        if _compat.is_literal(v):
            sources.append((False, _compat.literal_value(v)))
        elif v in position:
            sources.append((False, args[position[v]]))
        elif v in consts:
            sources.append((False, consts[v]))
        else:
            if v not in first:
                first[v] = len(picks)
                picks.append(index)
            sources.append((True, first[v]))
    computed: list[Any] = []
    if picks:
        def body(*values: Any) -> list[Any]:
            outs = evaluate(*values)
            return [outs[i] for i in picks]

        computed = bind_stream_region(body, args, region)
    return [computed[ref] if is_computed else ref for is_computed, ref in sources]


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
