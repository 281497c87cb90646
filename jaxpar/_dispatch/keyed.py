"""The keyed path: calls the top-level jit does not serve.

A call under a transformation (``grad``, ``vmap``, an outer ``jit``: tracer arguments), or
inside ``nnx.jit`` (a top-level call with Flax NNX objects), splits its arguments
(``split_arguments``), builds a ``CallKey`` and runs in a ``jax.jit`` taking
``(key, *leaves)``: ``CallState.jitted``, or on the GPU at the top level (the tuner's
candidates) one carrying the plan's XLA options (``jit_for``).

Example::

    out = transformed_call(state, args, kwargs)   # under jax.grad, jax.vmap, jax.jit...

Sharp edges:
  * ``jax.jit``'s ``donate_argnums`` do nothing here, as for a ``jax.jit`` inside another
    one; its ``in_shardings``/``out_shardings`` become sharding constraints on the
    arguments and outputs, laid as an inner ``jax.jit`` lays them (pytree prefixes, over
    the positional arguments that are not static); with Flax NNX objects they are
    refused, as at the top level (constrained, the objects would be copies).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .. import _compat, _processes, targets
from .._channel import CHANNEL
from .._flags import xla_flags_text
from .._frameworks import holds_nnx_object, nnx_arguments
from .._trace import (
    Layout,
    Scalars,
    Signature,
    abstract,
    function_name,
    has_python_scalars,
    needs_python_values,
    split_arguments,
)
from .._tune import fingerprint as program_fingerprint
from .._tune import program_flags, versions
from .state import CallKey, CallState, bounded, cached_jit, weak_method


def transformed_call(state: CallState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call under a transformation (``fast.route``), Flax NNX objects split and written
    back as ``nnx.jit`` does, ``jax.jit``'s shardings as constraints."""
    options = state.jit_options
    nnx = holds_nnx_object((args, kwargs))
    if nnx and options.shardings:  # constrained, the objects would be copies
        raise refuse_nnx_shardings(state)
    if options.in_shardings is not None:
        args = _constrained_arguments(state, args, kwargs, options.in_shardings)
    if not nnx:
        out = split_call(state, state.fun, args, kwargs, False)
    else:
        with nnx_arguments(state.nnx_tag, state.fun, args, kwargs) as (fun, args, kwargs,
                                                                         nnx_call):
            assert nnx_call is not None
            out = nnx_call.from_pure(split_call(state, fun, args, kwargs, True))
    if options.out_shardings is not None:
        out = _constrained(out, options.out_shardings)
    return out


def refuse_nnx_shardings(state: CallState) -> TypeError:
    """The error of a call with Flax NNX objects to a function given shardings."""
    return TypeError(
        f"{function_name(state.fun)} takes in_shardings/out_shardings, which jaxpar "
        "applies to calls whose arguments are arrays and containers of arrays; this "
        "call holds Flax NNX objects. Shard their state with nnx's own sharding "
        "annotations, or call nnx.jit(..., in_shardings=...) around the function.")


def _constrained_arguments(state: CallState, args: tuple[Any, ...], kwargs: dict[str, Any],
                           shardings: Any) -> tuple[Any, ...]:
    """``args`` constrained as ``jax.jit``'s ``in_shardings`` place them: a prefix of the
    positional arguments that are not static (a list read as a tuple).

    Raises:
      ValueError: keyword arguments, as ``jax.jit`` raises for them with ``in_shardings``.
    """
    if kwargs:
        raise ValueError(
            "pjit does not support kwargs when in_shardings is specified. (jaxpar: "
            f"{function_name(state.fun)} takes in_shardings, which apply to positional "
            f"arguments, as under jax.jit; it was given {', '.join(map(repr, kwargs))} by "
            "keyword.)")
    static = {i % len(args) for i in state.static_args.nums if -len(args) <= i < len(args)}
    dynamic = tuple(arg for i, arg in enumerate(args) if i not in static)
    placed = iter(_constrained(dynamic, tuple(shardings) if isinstance(shardings, list)
                               else shardings))
    return tuple(arg if i in static else next(placed) for i, arg in enumerate(args))


def _is_sharding(value: Any) -> bool:
    return value is None or isinstance(value, (jax.sharding.Sharding,
                                                jax.sharding.PartitionSpec))


def _constrained(tree: Any, shardings: Any) -> Any:
    """``tree`` with ``jax.lax.with_sharding_constraint`` applied by ``shardings``, a pytree
    prefix of it (a sharding: all of it; None: unconstrained), as a jit's ``in_shardings``/
    ``out_shardings`` are applied; leaves that are not arrays are left as they are."""
    def constrain(sharding: Any, subtree: Any) -> Any:
        if sharding is None:
            return subtree
        mesh = _compat.context_mesh()
        if isinstance(sharding, jax.sharding.PartitionSpec) and mesh is not None \
                and not _compat.staging():
            # Outside a staged trace (grad or vmap at the top level) on the mesh
            # jax.set_mesh set, as jax.jit reads it: a bare spec's abstract mesh cannot
            # constrain a concrete value.
            sharding = jax.sharding.NamedSharding(mesh, sharding)
        return jax.tree_util.tree_map(
            lambda leaf: jax.lax.with_sharding_constraint(leaf, sharding)
            if isinstance(leaf, jax.Array) or _compat.is_tracer(leaf) else leaf, subtree)

    return jax.tree_util.tree_map(constrain, shardings, tree, is_leaf=_is_sharding)


def split_call(state: CallState, fun: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any], nnx: bool) -> Any:
    """A call on the keyed path: its arguments split by jaxpar, run by ``keyed_call``."""
    # Under a trace (eval_shape), jax.jit takes a ShapeDtypeStruct as an abstract argument.
    layout, leaves = split_arguments(fun, args, kwargs, state.static_args,
                                     allow_abstract=not _compat.top_level())
    # Python scalars are traced as jax.jit traces them, so results match it bit for
    # bit. Under a transformation a function that needs one as a Python value
    # (range(n), an outer jit's static argument passed on) is traced again with them
    # static, where jax.jit would raise.
    retry = has_python_scalars(leaves) and any(map(_compat.is_tracer, leaves))
    if retry and layout in state.scalars_made_static:
        return _call_with_static_scalars(state, fun, args, kwargs, nnx)
    try:
        return keyed_call(state, layout, leaves, nnx)
    except Exception as error:
        if not (retry and needs_python_values(error)):
            raise
    out = _call_with_static_scalars(state, fun, args, kwargs, nnx)
    state.scalars_made_static.add(layout)
    return out


def _call_with_static_scalars(state: CallState, fun: Callable[..., Any],
                              args: tuple[Any, ...], kwargs: dict[str, Any], nnx: bool) -> Any:
    """A call with its Python scalars static (``split_call``)."""
    layout, leaves = split_arguments(fun, args, kwargs, state.static_args,
                                     scalars=Scalars.STATIC)
    return keyed_call(state, layout, leaves, nnx)


def keyed_call(state: CallState, layout: Layout, leaves: list[Any], nnx: bool) -> Any:
    """A call under its ``CallKey`` in the jit ``jit_for`` picks."""
    key = state.call_key(layout, nnx, leaves)
    if jax.process_count() > 1:
        agree_across_processes(state, key, leaves)
    tuner = state.tuner
    if tuner is not None and key.rewrite and key.emit_streams:
        # A concrete call decides first (measuring where no decision exists), outside
        # any trace; a traced one reuses a decision this process made. The decision is
        # looked up when jax.jit traces (once per signature).
        concrete = not key.call_site and not any(map(_compat.is_tracer, leaves))
        if concrete:
            tuner.decide(state, key, leaves)
        key = dataclasses.replace(key, tune="measure" if concrete else "reuse",
                                  tune_generation=tuner.generation)
    return run_keyed(state, key, leaves)


def run_keyed(state: CallState, key: CallKey, leaves: Sequence[Any],
              jitted: Any = None) -> Any:
    """``(jitted or jit_for(...))(key, *leaves)``, the output put together."""
    CHANNEL.traced_consts.discard(id(state))
    dynamic, outputs = (jitted or jit_for(state, key, leaves))(key, *leaves)
    if id(state) in CHANNEL.traced_consts:
        # The trace closed over another trace's tracers: jit must not reuse it.
        CHANNEL.traced_consts.discard(id(state))
        state.jitted.clear_cache()
    return outputs.rebuild(dynamic)


def options_jit(state: CallState, options: dict[str, str]) -> Any:
    """The keyed jit compiling with ``options`` (made once per distinct options)."""
    return cached_jit(state.jitted_with, options, lambda given: jax.jit(
        weak_method(state, "call_traced", state.fun, top=True), static_argnums=0,
        compiler_options=given or None, keep_unused=state.jit_options.keep_unused))


def jit_for(state: CallState, key: CallKey, leaves: Sequence[Any]) -> Any:
    """The jit a call with ``key`` runs under: on the GPU at the top level, one carrying
    the XLA options (the CUDA-graph mode) its plan chose (``{}`` included: these jits
    trace only top-level calls, never one under a transformation, whose trace ``jitted``
    keeps), else ``jitted``. With the tuner, the decided candidate's plan."""
    if not (targets.get(key.settings.target).compiles_with_xla_options and key.rewrite
            and key.emit_streams and _compat.top_level()):
        return state.jitted
    avals = tuple(abstract(leaf) for leaf in leaves)
    settings = key.settings
    if state.tuner is not None and key.tune:
        decided = state.tuner.decided_key(state, key, leaves)
        if not decided.rewrite:
            return state.jitted
        settings = decided.settings
    options = state.prepare(Signature(key.layout, avals), settings, key.nnx,
                            key.local_axes).xla_options
    return options_jit(state, options)


def agree_across_processes(state: CallState, key: CallKey, leaves: Sequence[Any]) -> None:
    """At the first top-level call of a signature whose arguments span every process:
    the processes compare what decides jaxpar's program for it (``_processes.agree``: a
    collective, which every process reaches there as it reaches the program).

    Raises:
      ProcessMismatchError: on every process, where they would compile different
        programs (another ``XLA_FLAGS``, GPU calibration, options or version).
    """
    if key.call_site or not key.rewrite or not _compat.top_level():
        return
    avals = tuple(abstract(leaf) for leaf in leaves)
    checked = (key, avals, _compat.trace_context())
    if checked in state.memos.agreed:
        return
    if _processes.span(leaves) == _processes.ALL:
        prepared = state.prepare(Signature(key.layout, avals), key.settings, key.nnx,
                                 key.local_axes)
        levels = [(level.path, level.order, level.collective_groups)
                  for level in prepared.plan.walk()]
        loops = [(d.location, d.kind, d.eqns, d.unroll, d.pass_name) for d in prepared.decisions]
        _processes.agree(state.call_text(avals), {
            "versions": versions(), "xla_flags": program_flags(xla_flags_text()),
            "settings": repr(key.settings),
            "decisions": program_fingerprint(repr((levels, loops))),
            "xla_options": sorted(prepared.xla_options.items())})
    bounded(state.memos.agreed)[checked] = None
