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
  xla_metadata   ``stream_call`` and the XLA frontend attributes JAX attaches
  rules          JAX's rule tables, and what the rules of jaxpar's own primitives
                 (``jaxpar._ops``) read of JAX's internals
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
    array_aval,
    check_jaxpr,
    eqn_replace_subjaxprs,
    eqn_subjaxprs,
    fresh_var,
    in_avals,
    internal_primitive,
    is_drop_var,
    is_jaxpr_like,
    is_level,
    is_literal,
    jax_primitive_names,
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
    custom_jvp_rule,
    scan_info,
    scan_length,
    scan_params_with_unroll,
    while_info,
)
from .rules import (
    CallRules,
    axis_name,
    batch_jaxpr,
    checkify_jaxpr,
    checkify_operands,
    closed_call_dce,
    instantiate_zeros,
    is_symbolic_zero,
    is_undefined_primal,
    lower_fun,
    lower_inline,
    lowers_inline,
    partitioned_by_xla,
    register_call_primitive,
    separate_consts,
    symbolic_zero,
)
from .shard_map import (
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
from .tracing import (
    ARRAY_IMPL,
    EqnStager,
    backends_initialized,
    bind_eqn,
    context_mesh,
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
from .xla_metadata import (
    PACK_MULTI_RESULT_CALLS,
    has_jax_frontend_attributes,
    jax_frontend_attributes,
    stream_call,
)

__all__ = [
    "check_jaxpr",
    "ARRAY_IMPL",
    "Atom",
    "ClosedJaxpr",
    "DropVar",
    "EqnStager",
    "JAX_VERSION",
    "Jaxpr",
    "JaxprEqn",
    "JaxprLike",
    "Literal",
    "PACK_MULTI_RESULT_CALLS",
    "Primitive",
    "ScanInfo",
    "ShapedArray",
    "Var",
    "argument_names",
    "array_aval",
    "aval_nbytes",
    "aval_size",
    "backends_initialized",
    "backward",
    "bind_eqn",
    "context_mesh",
    "custom_jvp_rule",
    "display_name",
    "eqn_context",
    "eqn_replace_subjaxprs",
    "eqn_subjaxprs",
    "eval_linear",
    "fresh_var",
    "in_avals",
    "internal_primitive",
    "is_drop_var",
    "is_extended_dtype",
    "jax_value_type",
    "is_jaxpr_like",
    "is_level",
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
    "plain_call_body",
    "prng_impl_name",
    "rebased_source",
    "rebind_shard_map",
    "register_for_clear_caches",
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
    "symbolic_dimensions",
    "symbolic_sizes",
    "top_level",
    "trace_context",
    "user_source",
    "vmap_axis_names",
    "while_info",
    "with_weak_type",
    "CallRules",
    "axis_name",
    "batch_jaxpr",
    "checkify_jaxpr",
    "checkify_operands",
    "closed_call_dce",
    "instantiate_zeros",
    "is_symbolic_zero",
    "is_undefined_primal",
    "lower_fun",
    "lower_inline",
    "lowers_inline",
    "partitioned_by_xla",
    "register_call_primitive",
    "separate_consts",
    "symbolic_zero",
    "has_jax_frontend_attributes",
    "jax_frontend_attributes",
    "jax_primitive_names",
]
