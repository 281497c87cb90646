"""Tracing contexts: where a call runs (eagerly, under ``disable_jit``, under a
transformation, while staging), re-binding and staging an equation in the user's
source context, ``vmap`` axes, linearization, and JAX's cache and backend state.

Sharp edge: re-binding an equation must happen inside ``eqn.ctx.manager`` and the
user's source context, or metadata and error locations are lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import core as _core
from jax._src import source_info_util as _source_info_util
from jax._src.array import ArrayImpl as _ArrayImpl
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import partial_eval as _pe

from .jaxprs import JaxprEqn, JaxprLike, Literal, make_closed_jaxpr, open_jaxpr


def is_tracer(value: Any) -> bool:
    """Whether ``value`` is a JAX tracer (we are inside jit, grad, vmap, ...)."""
    return isinstance(value, jax.core.Tracer)


# The type of a concrete ``jax.Array`` (never a tracer): a decorated function's call
# checks each argument leaf, and most are of this exact type.
ARRAY_IMPL: type = _ArrayImpl


def trace_context() -> Any:
    """The configuration ``jax.jit`` keys its caches on, as one hashable value.

    Everything that changes what tracing produces: ``jax_enable_x64``, rank and dtype
    promotion, ``default_matmul_precision``, the default device, the mesh and axis
    environment, ``disable_jit`` and more. ``jax._src.config.trace_context`` on every
    version tried (0.10.2, 0.12); there is no public name for it.
    """
    from jax._src import config as _config

    return _config.trace_context()


def context_mesh() -> Any:
    """The mesh ``jax.set_mesh`` set, None without one; under a trace too, where
    ``jax.sharding.get_mesh`` refuses (``jax._src.mesh.get_concrete_mesh``: the empty mesh
    in jax 0.10, None in 0.12, where none is set)."""
    from jax._src import mesh as _mesh

    mesh = _mesh.get_concrete_mesh()
    return None if mesh is None or mesh.empty else mesh


def jit_disabled() -> bool:
    """Whether ``jax.disable_jit()`` is in force (then functions run op by op, eagerly)."""
    return bool(jax.config.jax_disable_jit)  # type: ignore[attr-defined]


def register_for_clear_caches(cache: Any, label: str) -> bool:
    """Has ``jax.clear_caches()`` call ``cache.cache_clear()`` from now on.

    JAX keeps a weak registry of its own caches (``jax._src.util.register_cache``, the
    hook ``util.cache`` and ``weakref_lru_cache`` use; 0.10.2 to 0.12), which
    ``jax.clear_caches()`` walks. ``cache`` must be weakly referenceable and have
    ``cache_clear()``, ``cache_info()`` and ``cache_keys()``; the registry drops it when
    it dies. Returns False (and registers nothing) where the hook is missing.
    """
    try:
        from jax._src import util as _util
    except ImportError:
        return False
    register = getattr(_util, "register_cache", None)
    if register is None:
        return False
    register(cache, label)
    return True


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any], params: dict[str, Any] | None = None
             ) -> list[Any]:
    """Binds ``eqn``'s primitive on ``invals``, keeping its source info and context."""
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (_source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
          eqn.ctx.manager):
        out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


@dataclasses.dataclass(frozen=True, slots=True)
class Linearized:
    """``fn`` at some avals split into a forward and a linear jaxpr (``linearize_split``).

    ``forward`` (closed) takes the primals and returns ``num_outputs`` outputs, then
    ``num_residuals`` residuals. ``linear`` (open; its constvars are the residuals)
    takes the tangents of the inexact primals and returns the tangents of all outputs.
    """

    forward: Any
    linear: Any
    num_outputs: int
    num_residuals: int


def linearize_split(fn: Callable[..., Sequence[Any]], avals: Sequence[Any],
                    diff: Sequence[bool]) -> Linearized:
    """Traces the linearization of ``fn`` (a tuple of outputs) at ``avals``.

    Only the primals with ``diff`` set are differentiated; the others are closed over.
    Public API only (``jax.linearize`` and ``jax.make_jaxpr``), so the split is the
    one JAX itself computes for ``jax.linearize`` on every version.
    """
    cell: dict[str, Any] = {}

    def forward(*primals: Any) -> tuple[Any, ...]:
        def of_diff(*diff_primals: Any) -> tuple[Any, ...]:
            it = iter(diff_primals)
            return tuple(fn(*[next(it) if d else p for p, d in zip(primals, diff, strict=True)]))

        diff_primals = [p for p, d in zip(primals, diff, strict=True) if d]
        outs, f_lin = jax.linearize(of_diff, *diff_primals)
        # The aval's own tangent type keeps weak types and, inside shard_map, the
        # varying manual axes (a ShapeDtypeStruct would drop them).
        tangent_avals = [jax.typeof(p).to_tangent_aval() for p in diff_primals]
        inner, residuals = open_jaxpr(make_closed_jaxpr(f_lin, tangent_avals))
        cell["linear"], cell["counts"] = inner, (len(outs), len(residuals))
        return (*outs, *residuals)

    closed = jax.make_jaxpr(forward)(*avals)
    num_outputs, num_residuals = cell["counts"]
    return Linearized(closed, cell["linear"], num_outputs, num_residuals)


def eval_linear(lin: Linearized, residuals: Sequence[Any], tangents: Sequence[Any]) -> list[Any]:
    """Applies ``lin.linear`` to ``tangents`` with the given residuals."""
    return list(jax.core.eval_jaxpr(lin.linear, list(residuals), *tangents))


def stage_jaxpr(jaxpr: JaxprLike, *args: Any) -> list[Any]:
    """``jaxpr_eval(jaxpr, *args)``, each equation staged by an ``EqnStager``."""
    inner, consts = open_jaxpr(jaxpr)
    env: dict[Any, Any] = dict(zip(inner.constvars, consts, strict=True))
    env.update(zip(inner.invars, args, strict=True))
    stage = EqnStager()
    for eqn in inner.eqns:
        outs = stage(eqn, [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [v.val if isinstance(v, Literal) else env[v] for v in inner.outvars]


class EqnStager:
    """``bind_eqn(eqn, invals)`` for the equations of a jaxpr traced before, inside the
    ``jax.jit`` trace now staging (jaxpar's emission of a rewritten program).

    Where a bind would only abstract-evaluate the equation and stage it, the equation
    is staged as it is, as JAX inlines a jit call (``partial_eval.inline_jaxpr_into_
    trace``, jax 0.10.2 - 0.12): the same steps as the trace's
    ``default_process_primitive`` but the abstract evaluation, whose results the
    equation holds already (its operands' types are checked equal to its inputs'),
    about a quarter of a bind's time. It keeps its source info (its name stack under
    the current one) and context, and constant inputs are folded by JAX's rules, as a
    bind does. Every other equation is bound (``bind_eqn``): outside such a trace or in
    a ``set_xla_metadata`` scope, with effects, or with an operand that is not the
    trace's tracer (a constant), a primitive with a staging or forwarding rule, bind
    parameters of its own or high types, or operands of other types.
    """

    __slots__ = ("_stack", "_trace")

    def __init__(self) -> None:
        from jax._src import xla_metadata_lib as _metadata

        trace = _core.trace_ctx.trace
        # Under a ``set_xla_metadata`` scope a bind merges the scope's metadata into each
        # equation's context, which an equation staged as it is would not carry.
        staging = type(trace) is _pe.DynamicJaxprTrace and not _metadata.current_xla_metadata()
        self._trace = trace if staging else None
        self._stack = _source_info_util.current_name_stack()

    def __call__(self, eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
        trace, primitive = self._trace, eqn.primitive
        if (trace is None or eqn.effects or primitive in _pe.custom_staging_rules
                or primitive in _pe.forwarding_rules
                or type(primitive).get_bind_params is not _core.Primitive.get_bind_params):
            return bind_eqn(eqn, invals)
        info = eqn.source_info
        source = info.replace(name_stack=self._stack + info.name_stack)
        tracer = _pe.DynamicJaxprTracer
        ins = []
        traced = False
        for v, x in zip(eqn.invars, invals, strict=True):
            if isinstance(v, Literal):
                ins.append(tracer(trace, v.aval, v, source))
            elif type(x) is tracer and x._trace is trace and x.aval == v.aval:
                ins.append(x)
                traced = True
            else:
                return bind_eqn(eqn, invals)
        params = eqn.params
        if not traced or primitive.is_high(*[t.aval for t in ins], **params):
            return bind_eqn(eqn, invals)
        avals = [v.aval for v in eqn.outvars]
        folded = _pe.try_constant_folding(primitive, ins, params, avals)
        if folded is not None:
            outs = [trace.new_const(c, source_info=source, aval=aval)
                    for c, aval in zip(folded, avals, strict=True)]
        else:
            outs = trace.emit_eqn(ins, avals, primitive, params, eqn.effects, source, eqn.ctx)
        return list(outs)


def eqn_context(eqn: JaxprEqn) -> Any:
    """A context manager under which new equations get ``eqn``'s source info and context.

    Used when a pass emits a replacement for ``eqn`` (e.g. a fused scan) through public
    APIs such as ``lax.scan``, so errors and profiles still point at the user's line.
    """
    name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
    stack = contextlib.ExitStack()
    stack.enter_context(_source_info_util.user_context(eqn.source_info.traceback,
                                                       name_stack=name_stack))
    stack.enter_context(eqn.ctx.manager)
    return stack


def backends_initialized() -> bool:
    """Whether JAX has started a backend (so new XLA_FLAGS would be ignored).

    There is no public API for this; ``jax._src.xla_bridge`` keeps the started
    backends in ``_backends`` (every version tried, 0.4.35 - 0.12). Answers
    True when the internals moved, so callers err on the side of warning.
    """
    try:
        from jax._src import xla_bridge
    except ImportError:
        return True
    backends = getattr(xla_bridge, "_backends", None)
    return True if backends is None else bool(backends)


def top_level() -> bool:
    """Whether JAX runs eagerly here, under no transformation at all: the only place
    ``jax.jit(..., compiler_options=...)`` may be called (jax 0.10 refuses it on a
    nested jit, which a call under ``grad`` or ``vmap`` becomes)."""
    return isinstance(_core.trace_ctx.trace, _core.EvalTrace)


def staging() -> bool:
    """Whether the current trace stages out a program (an outer ``jit``, ``make_jaxpr``,
    ``shard_map``...), under any ``grad``/``vmap`` layers, rather than running eagerly."""
    trace = _core.trace_ctx.trace
    for _ in range(64):  # trace stacks are a few levels deep
        if trace is None:
            return False
        if isinstance(trace, _pe.DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def vmap_axis_names(values: Sequence[Any]) -> frozenset[Any]:
    """The names of the ``jax.vmap`` axes that ``values`` are traced under, where a
    collective over the name is a reduction on this device: ``vmap`` without
    ``spmd_axis_name`` or an explicit mesh axis (those spread the axis over devices)."""
    names: set[Any] = set()
    for value in values:
        while isinstance(value, _batching.BatchTracer):
            data = getattr(value._trace, "axis_data", None)
            if (data is not None and data.name not in (None, _core.no_axis_name)
                    and getattr(data, "spmd_name", None) is None
                    and getattr(data, "explicit_mesh_axis", None) is None):
                names.add(data.name)
            value = value.val
    return frozenset(names)
