"""The one place that touches JAX internals and version-dependent layouts.

Everything else in jaxpar talks to jaxprs through the names this package exports, so a
new JAX release means reading this package, not the whole of jaxpar. Its modules, each
on one subject (a module imports only the ones listed before it):

  jaxprs         the jaxpr types, opening, editing, splicing and evaluating jaxprs
  avals          dtypes, bytes and element counts, weak types, PRNG key types
  sources        where an equation comes from (source line, layer path, names)
  tracing        where a call runs, re-binding and staging equations, linearization
  loops          ``scan``, ``while`` and ``custom_jvp_call`` parameters
  shard_map      reading and re-emitting ``shard_map`` equations
  call_rules     the rules jaxpar's two call-like primitives share
  stream_region  ``stream_call``, frontend attributes, ``stream_region_p`` and its rules
  program        ``program_p`` (the rewritten program) and its rules
  jit            ``routed_jit``: ``jax.jit``'s C++ object with a cache miss of jaxpar's

Example::

    from jaxpar import _compat
    closed = _compat.make_closed_jaxpr(lambda x: x * 2, [jax.ShapeDtypeStruct((3,), "float32")])
    body, consts = _compat.open_jaxpr(closed)
"""

from __future__ import annotations

from .avals import (
    aval_nbytes,
    aval_size,
    is_extended_dtype,
    itemsize,
    jax_value_type,
    prng_impl_name,
    with_weak_type,
)
from .jaxprs import (
    JAX_VERSION,
    Atom,
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    JaxprEqn,
    JaxprLike,
    Literal,
    Primitive,
    ShapedArray,
    Var,
    all_invars,
    array_aval,
    check_jaxpr,
    eqn_replace_subjaxprs,
    eqn_subjaxprs,
    fresh_var,
    has_consts,
    in_avals,
    internal_primitive,
    is_drop_var,
    is_jaxpr_like,
    is_literal,
    jaxpr_eval,
    literal_value,
    make_closed_jaxpr,
    open_jaxpr,
    ordering_effects,
    plain_call_body,
    replace_eqn,
    retrace_like,
    splice_jaxpr,
    symbolic_dimensions,
    symbolic_sizes,
)
from .jit import Miss, RoutedJit, donated_arguments, routed_jit
from .loops import (
    ScanInfo,
    WhileInfo,
    custom_jvp_rule,
    scan_info,
    scan_length,
    scan_params_with_unroll,
    while_info,
)
from .program import (
    PROGRAM,
    ProgramSource,
    bind_program,
    program_p,
)
from .shard_map import (
    ShardMapInfo,
    is_shard_map,
    nested_trace_context,
    rebind_shard_map,
    shard_map_info,
)

# Private helpers the tests call.
from .sources import _display_path as _display_path
from .sources import _site_packages as _site_packages
from .sources import (
    argument_names,
    backward,
    display_name,
    name_scope,
    rebased_source,
    source_key,
    source_summary,
    user_source,
)
from .stream_region import (
    PACK_MULTI_RESULT_CALLS,
    STREAM_REGION,
    all_primitive_names,
    bind_stream_region,
    eqn_frontend_attributes,
    has_frontend_attributes,
    packable,
    register_stream_region_ad,
    stream_call,
    stream_region_p,
)
from .tracing import (
    ARRAY_IMPL,
    EAGER,
    JIT_DISABLED,
    TRANSFORMED,
    EqnStager,
    Linearized,
    backends_initialized,
    bind_eqn,
    call_context,
    eqn_context,
    eval_linear,
    is_tracer,
    jit_disabled,
    linearize_split,
    register_for_clear_caches,
    stage_jaxpr,
    staging,
    top_level,
    trace_context,
    vmap_axis_names,
)

__all__ = [
    "check_jaxpr",
    "ARRAY_IMPL",
    "Atom",
    "ClosedJaxpr",
    "DropVar",
    "EAGER",
    "EqnStager",
    "JAX_VERSION",
    "JIT_DISABLED",
    "Jaxpr",
    "JaxprEqn",
    "JaxprLike",
    "Linearized",
    "Literal",
    "PACK_MULTI_RESULT_CALLS",
    "PROGRAM",
    "Primitive",
    "ProgramSource",
    "STREAM_REGION",
    "ScanInfo",
    "ShapedArray",
    "ShardMapInfo",
    "TRANSFORMED",
    "Var",
    "WhileInfo",
    "all_invars",
    "all_primitive_names",
    "argument_names",
    "array_aval",
    "aval_nbytes",
    "aval_size",
    "backends_initialized",
    "backward",
    "bind_eqn",
    "bind_program",
    "bind_stream_region",
    "call_context",
    "custom_jvp_rule",
    "display_name",
    "eqn_context",
    "eqn_frontend_attributes",
    "eqn_replace_subjaxprs",
    "eqn_subjaxprs",
    "eval_linear",
    "fresh_var",
    "has_consts",
    "has_frontend_attributes",
    "in_avals",
    "internal_primitive",
    "is_drop_var",
    "is_extended_dtype",
    "jax_value_type",
    "is_jaxpr_like",
    "is_literal",
    "is_shard_map",
    "is_tracer",
    "itemsize",
    "jaxpr_eval",
    "Miss",
    "RoutedJit",
    "donated_arguments",
    "routed_jit",
    "jit_disabled",
    "linearize_split",
    "literal_value",
    "make_closed_jaxpr",
    "name_scope",
    "nested_trace_context",
    "open_jaxpr",
    "ordering_effects",
    "packable",
    "plain_call_body",
    "prng_impl_name",
    "program_p",
    "rebased_source",
    "rebind_shard_map",
    "register_for_clear_caches",
    "register_stream_region_ad",
    "replace_eqn",
    "retrace_like",
    "scan_info",
    "scan_length",
    "scan_params_with_unroll",
    "shard_map_info",
    "source_key",
    "source_summary",
    "splice_jaxpr",
    "stage_jaxpr",
    "staging",
    "stream_call",
    "stream_region_p",
    "symbolic_dimensions",
    "symbolic_sizes",
    "top_level",
    "trace_context",
    "user_source",
    "vmap_axis_names",
    "while_info",
    "with_weak_type",
]
