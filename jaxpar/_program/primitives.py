"""Every family of JAX primitives jaxpar treats specially, by name, in one table.

jaxprs name their equations' primitives (``eqn.primitive.name``), and several
stages decide by that name: the cost model, the planner, the passes, the
pricing. Each family is a ``frozenset`` of names built here from the primitive
objects themselves: ``jax.extend.core.primitives`` and ``jax.lax`` where JAX
exports them, ``_compat.internal_primitive`` where only its internal modules
hold them. A name is therefore never a guess (``"clamp_p"`` names no primitive;
``clamp_p.name`` is ``"clamp"``), and ``tests/test_program_primitives.py`` checks every
entry against the primitives the running jax defines.

Example::

    from jaxpar._program import primitives
    if eqn.primitive.name in primitives.COLLECTIVE: ...

Sharp edges:
  * A primitive that only some supported jax releases define (listed in
    ``VERSION_SPECIFIC``) is left out of its families where it is missing:
    no equation can carry its name there.
  * Primitives defined by other libraries (Pallas kernels, custom calls) are
    in no family and get the default treatment everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax.extend.core as _jex_core
import jax.extend.core.primitives as _exported
from jax import lax as _lax

from .. import _compat, _ops
from .._channel import CHANNEL
from .._compat import JaxprEqn
from .._memo import IdentityMemo

# The attribute names each family was built from, and those this jax lacks (for tests).
FAMILY_ATTRIBUTES: dict[str, tuple[str, ...]] = {}
MISSING: dict[str, tuple[str, ...]] = {}

# Primitives only some supported jax releases define: attribute -> the ``major.minor``
# releases known to define it. Everything else must exist on every supported release.
VERSION_SPECIFIC: dict[str, frozenset[str]] = {
    "log2_p": frozenset({"0.12"}),
    "one_minus_square_p": frozenset({"0.12"}),
    "polynomial_p": frozenset({"0.12"}),
}


def _lookup(attribute: str) -> Any | None:
    for home in (_exported, _lax):
        primitive = getattr(home, attribute, None)
        if isinstance(primitive, _jex_core.Primitive):
            return primitive
    return _compat.internal_primitive(attribute)


def _family(family: str, *attributes: str) -> frozenset[str]:
    """Names of the primitives JAX keeps as ``attributes`` (e.g. ``"scatter_add_p"``)."""
    names, missing = set(), []
    for attribute in attributes:
        primitive = _lookup(attribute)
        if primitive is None:
            missing.append(attribute)
        else:
            names.add(str(primitive.name))
    FAMILY_ATTRIBUTES[family] = attributes
    MISSING[family] = tuple(missing)
    return frozenset(names)


def _name(attribute: str) -> str:
    """The name of one primitive every supported jax defines (its attribute without
    ``_p`` should a release keep the object where ``_lookup`` does not look, so that
    ``import jaxpar`` never fails on it; ``tests/test_program_primitives.py`` checks the lookup)."""
    found = _family(attribute.removesuffix("_p"), attribute)
    return next(iter(found)) if found else attribute.removesuffix("_p")


# Single primitives some stage recognises on its own.
SCAN = _name("scan_p")
WHILE = _name("while_p")
COND = _name("cond_p")
DOT_GENERAL = _name("dot_general_p")
CONV = _name("conv_general_dilated_p")
TRANSPOSE = _name("transpose_p")
STACK = _name("stack_p")
PPERMUTE = _name("ppermute_p")
PURE_CALLBACK = _name("pure_callback_p")
LESS_THAN = _name("lt_p")
ADD = _name("add_p")
CONVERT_ELEMENT_TYPE = _name("convert_element_type_p")
CUSTOM_JVP_CALL = _name("custom_jvp_call_p")
CUSTOM_VJP_CALL = _name("custom_vjp_call_p")
BROADCAST_IN_DIM = _name("broadcast_in_dim_p")
IOTA = _name("iota_p")
SLICE = _name("slice_p")
SQUEEZE = _name("squeeze_p")
OPTIMIZATION_BARRIER = _name("optimization_barrier_p")

# Loops, as the report lists them.
LOOPS = frozenset({SCAN, WHILE})
# Loops and conds: control flow a CUDA graph does not capture by default.
MAY_BRANCH_OR_LOOP = frozenset({SCAN, WHILE, COND})

# Cross-device communication: grouped, never moved onto a compute stream.
COLLECTIVE = _family(
    "COLLECTIVE", "ppermute_p", "psum_p", "pmax_p", "pmin_p", "all_gather_p", "all_to_all_p",
    "reduce_scatter_p", "psum_invariant_p", "all_gather_invariant_p", "pbroadcast_p",
    "ragged_all_to_all_p")

# Collectives whose ``axes`` may hold positional (integer) axes. ``jax.vmap(f,
# axis_name=...)`` inside a traced function resolves ``psum``/``pmean`` over its axis
# into these, over the mapped positional axis: JAX lowers that part to a ``reduce`` on
# this device, so over positional axes alone nothing is communicated.
AXES_REDUCTIONS = _family("AXES_REDUCTIONS", "psum_p", "pmax_p", "pmin_p")




@contextlib.contextmanager
def local_axes(names: frozenset[Any]) -> Iterator[None]:
    """While planning a function called under ``jax.vmap(..., axis_name=n)``: ``n`` is
    mapped on this device, so a ``psum``/``pmax``/``pmin`` over it communicates nothing
    (see ``_compat.vmap_axis_names``)."""
    saved: frozenset[Any] = CHANNEL.local_axes
    CHANNEL.local_axes = saved | names
    try:
        yield
    finally:
        CHANNEL.local_axes = saved


def is_collective(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` communicates across devices: a ``COLLECTIVE`` primitive, unless it
    is one of ``AXES_REDUCTIONS`` over positional axes and the names of ``jax.vmap`` axes
    on this device only (a local reduction, e.g. the batch statistics of a BatchNorm
    under ``jax.vmap(..., axis_name=...)``; see ``local_axes``)."""
    name = eqn.primitive.name
    if name not in COLLECTIVE:
        return False
    if name in AXES_REDUCTIONS:
        local: frozenset[Any] = CHANNEL.local_axes
        axes = eqn.params.get("axes", ("?",))
        return not all(isinstance(axis, int) or axis in local for axis in axes)
    return True


# Collectives the collectives pass groups unless told otherwise.
DEFAULT_GROUPABLE = frozenset({PPERMUTE})

# Primitives whose nested jaxprs the planner re-emits with a plan of their own. Others
# with nested jaxprs (pallas_call, custom_transpose, ...) stay opaque.
RECURSIVE = _family(
    "RECURSIVE", "jit_p", "closed_call_p", "eval_jaxpr_p", "remat_p", "scan_p", "while_p",
    "cond_p", "custom_jvp_call_p", "custom_vjp_call_p", "shard_map_p")

# "The user already placed this code": never wrapped, moved or nested.
USER_PLACEMENT = _family("USER_PLACEMENT", "xla_metadata_call_p", "compute_on_p") | {
    _ops.STREAM_REGION}  # jaxpar's own regions (parallel_branches, on_stream)

# Cost model: shape-only equations, which XLA turns into layout changes or folds away.
COST_FREE = _family(
    "COST_FREE", "reshape_p", "squeeze_p", "broadcast_in_dim_p", "convert_element_type_p",
    "bitcast_convert_type_p", "iota_p", "copy_p", "stop_gradient_p", "pvary_p",
    "optimization_barrier_p", "sharding_constraint_p", "reshard_p", "axis_index_p",
    "device_put_p", "random_wrap_p", "random_unwrap_p")

# Cost model: equations that launch exactly one kernel of their own.
COST_ONE_KERNEL = _family(
    "COST_ONE_KERNEL", "reduce_sum_p", "reduce_max_p", "reduce_min_p", "reduce_prod_p",
    "reduce_and_p", "reduce_or_p", "reduce_xor_p", "argmax_p", "argmin_p", "cumsum_p",
    "cumprod_p", "cummax_p", "cummin_p", "cumlogsumexp_p", "sort_p", "gather_p", "scatter_p",
    "scatter_add_p", "scatter_mul_p", "scatter_min_p", "scatter_max_p", "dynamic_slice_p",
    "dynamic_update_slice_p", "concatenate_p", "stack_p", "pad_p", "transpose_p", "rev_p",
    "select_n_p", "reduce_precision_p", "top_k_p", "fft_p", "rng_bit_generator_p", "threefry2x32_p",
    "random_bits_p", "random_seed_p", "ppermute_p", "psum_p", "all_gather_p", "all_to_all_p",
    "reduce_scatter_p", "pmax_p", "pmin_p", "psum_invariant_p", "all_gather_invariant_p",
    "cholesky_p", "lu_p", "qr_p", "eigh_p", "svd_p", "triangular_solve_p",
    "householder_product_p", "reduce_window_p", "reduce_window_sum_p", "reduce_window_max_p",
    "reduce_window_min_p", "select_and_scatter_add_p", "select_and_gather_add_p",
    "approx_top_k_p")

# Cost model: one-kernel equations XLA:GPU may fuse into a neighbour's kernel (a Triton
# GEMM's operand prologue takes a concatenate or a transpose; a slice or a select joins
# the elementwise fusion reading it), so the compiled program may launch fewer kernels
# than the model counts (the CUDA-graph mode choice counts only the others).
MAY_FUSE_AWAY = _family(
    "MAY_FUSE_AWAY", "concatenate_p", "pad_p", "transpose_p", "rev_p", "select_n_p",
    "dynamic_slice_p", "gather_p", "reduce_precision_p")

# Kernels that fill the GPU or call a library: XLA's ``CONCURRENT_REGIONS`` mode runs
# them serially (``CanRunConcurrently`` in xla/service/gpu/gpu_hlo_ordering.cc keeps dots,
# convolutions and library calls out of its concurrent regions; collectives use their
# own streams), and so do jaxpar's models of the branching CUDA-graph modes
# (``_plan.modes``, ``_model.memory``).
SERIAL_KERNELS = frozenset({DOT_GENERAL, CONV}) | COLLECTIVE | _family(
    "SERIAL_KERNELS", "sort_p", "fft_p", "cholesky_p", "lu_p", "qr_p", "eigh_p", "svd_p",
    "triangular_solve_p", "householder_product_p")

# The heavy ops batch_matmuls stacks: one kernel each, whose batched form is one kernel.
BATCHED_MATMULS = frozenset({DOT_GENERAL, CONV})

# Equations common-subexpression sharing must run once per occurrence, even on equal
# operands (side effects, fresh randomness, user placement).
NEVER_SHARED = _family(
    "NEVER_SHARED", "pure_callback_p", "io_callback_p", "debug_callback_p", "rng_uniform_p",
    "random_seed_p", "xla_metadata_call_p", "compute_on_p") | {_ops.STREAM_REGION}

# Equations that must run once per call, whatever their operands (effects aside): host
# calls, stateful random numbers, user placement. Merging copies of them, or of anything
# holding them, is never faithful (``passes/_batchable.merge_refusal``).
RUN_EVERY_CALL = _family(
    "RUN_EVERY_CALL", "pure_callback_p", "io_callback_p", "debug_callback_p", "rng_uniform_p",
    "xla_metadata_call_p", "compute_on_p")

# Pricing: ops XLA folds into a neighbour or into a layout; they never stop a fusion.
LAYOUT_ONLY = _family(
    "LAYOUT_ONLY", "reshape_p", "squeeze_p", "convert_element_type_p", "bitcast_convert_type_p",
    "transpose_p", "broadcast_in_dim_p", "copy_p")

# The report's places: ops that only move a parameter's numbers, so their result still is
# the parameter (``_report.places``).
PARAMETER_VIEWS = _family(
    "PARAMETER_VIEWS", "transpose_p", "reshape_p", "broadcast_in_dim_p",
    "convert_element_type_p", "squeeze_p", "copy_p", "slice_p", "concatenate_p",
    "reduce_precision_p")

# Division and remainder (of any dtype; ``targets.tpu_model.divides_integers`` looks at integer
# results): on a TPU a loop body holding an integer one stays rolled.
DIVISIONS = _family("DIVISIONS", "div_p", "rem_p")

# Pricing: identities XLA drops, so a value read through one is the value itself.
IDENTITIES = _family("IDENTITIES", "stop_gradient_p", "copy_p")

# Pricing: calls whose body's inputs are the equation's inputs, one for one.
TRANSPARENT_CALLS = _family(
    "TRANSPARENT_CALLS", "jit_p", "closed_call_p", "custom_jvp_call_p", "remat_p")

# Pricing: a conditional on a traced value blocks the host thread launching the graph.
HOST_BLOCKING = frozenset({COND})

# Pricing: loops keep a region out of a captured CUDA graph.
NOT_CAPTURED = frozenset({WHILE, SCAN})

# GPU preview: primitives that may hold a loop inside (nested calls and loops).
MAY_HOLD_LOOPS = _family(
    "MAY_HOLD_LOOPS", "scan_p", "while_p", "jit_p", "closed_call_p", "eval_jaxpr_p", "remat_p",
    "cond_p", "custom_jvp_call_p", "custom_vjp_call_p")

# Elementwise arithmetic, comparisons, bit ops and casts: what XLA fuses into one loop
# kernel with the values it reads (``passes/bound_fusions``).
ELEMENTWISE = _family(
    "ELEMENTWISE",
    "abs_p", "acos_p", "acosh_p", "add_p", "and_p", "asin_p", "asinh_p", "atan_p",
    "atan2_p", "atanh_p", "bessel_i0e_p", "bessel_i1e_p", "bitcast_convert_type_p", "cbrt_p",
    "ceil_p", "clamp_p", "clz_p", "complex_p", "conj_p", "convert_element_type_p", "copy_p",
    "cos_p", "cosh_p", "digamma_p", "div_p", "eq_p", "erf_p", "erf_inv_p", "erfc_p", "exp_p",
    "exp2_p", "expm1_p", "floor_p", "ge_p", "gt_p", "igamma_p", "igamma_grad_a_p", "igammac_p",
    "imag_p", "integer_pow_p", "is_finite_p", "le_p", "lgamma_p", "log_p", "log1p_p",
    "logistic_p", "lt_p", "max_p", "min_p", "mul_p", "ne_p", "neg_p", "nextafter_p", "not_p",
    "or_p", "polygamma_p", "population_count_p", "pow_p", "real_p", "reduce_precision_p",
    "regularized_incomplete_beta_p", "rem_p", "round_p", "rsqrt_p", "select_n_p",
    "shift_left_p", "shift_right_arithmetic_p", "shift_right_logical_p", "sign_p", "sin_p",
    "sinh_p", "sqrt_p", "square_p", "stop_gradient_p", "sub_p", "tan_p", "tanh_p", "xor_p",
    "zeta_p", "log2_p", "one_minus_square_p", "polynomial_p", "mulhi_p")

# Batching passes: primitives whose vmap rule adds a batch dimension and nothing else
# (see passes/_batchable.py for why this is an allow-list). ``add_any`` (JAX keeps it as
# ``add_jaxvals_p``) is not on it: the list has always missed it.
BATCH_FAITHFUL = ELEMENTWISE | _family(
    "BATCH_FAITHFUL",
    # identities under vmap: placement, checkpoint names, barriers, shard_map's type cast
    "device_put_p", "name_p", "optimization_barrier_p", "pvary_p",
    # structure: shapes, slicing, indexing
    "broadcast_in_dim_p", "concatenate_p", "dynamic_slice_p", "dynamic_update_slice_p",
    "gather_p", "iota_p", "pad_p", "reshape_p", "rev_p", "scatter_p", "scatter_add_p",
    "scatter_sub_p", "scatter_max_p", "scatter_min_p", "scatter_mul_p",
    "select_and_gather_add_p", "select_and_scatter_add_p", "select_and_scatter_p", "slice_p",
    "squeeze_p", "transpose_p", "stack_p", "unstack_p", "split_p", "tile_p",
    # reductions, scans over an axis, sorting
    "argmax_p", "argmin_p", "cumlogsumexp_p", "cummax_p", "cummin_p", "cumprod_p", "cumsum_p",
    "reduce_p", "reduce_and_p", "reduce_max_p", "reduce_min_p", "reduce_or_p", "reduce_prod_p",
    "reduce_sum_p", "reduce_window_p", "reduce_window_max_p", "reduce_window_min_p",
    "reduce_window_sum_p", "reduce_xor_p", "sort_p", "top_k_p", "approx_top_k_p",
    # reductions over positional axes (checked by their rule: named axes communicate)
    "psum_p", "pmax_p", "pmin_p",
    # contractions and transforms
    "dot_general_p", "conv_general_dilated_p", "fft_p",
    # threefry random bits and keys (the key type is checked: see BATCH_KEYED_RANDOM)
    "threefry2x32_p", "random_bits_p", "random_fold_in_p", "random_seed_p", "random_split_p",
    "random_wrap_p", "random_unwrap_p",
    # nested jaxprs (checked recursively)
    "jit_p", "closed_call_p", "remat_p", "custom_jvp_call_p", "custom_vjp_call_p", "scan_p",
    "cond_p", "while_p")

# Calls into the host: the user wrote them for the shapes they are called with, so the
# batching passes never put them under a vmap the user did not write.
HOST_CALLBACKS = _family("HOST_CALLBACKS", "pure_callback_p", "io_callback_p",
                         "debug_callback_p")


def calls_the_host(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` holds a host callback at any depth (``jax.pure_callback``
    included, which has no effect in the jaxpr; jaxprs an equation binds itself, as
    equinox's primitives hold them, included). Timing candidates would call the user's
    host function thousands of times, where ``jax.jit`` calls it once a call."""
    memo: IdentityMemo[Any, bool] = IdentityMemo()

    def holds(j: Any) -> bool:
        return memo.lookup(j, lambda: any(
            eqn.primitive.name in HOST_CALLBACKS
            or any(holds(sub) for _, _, sub in _compat.eqn_subjaxprs(eqn))
            for eqn in _compat.open_jaxpr(j)[0].eqns))
    return holds(jaxpr)


# Batching passes: random primitives whose keys must be threefry keys to batch faithfully.
BATCH_KEYED_RANDOM = _family(
    "BATCH_KEYED_RANDOM", "random_bits_p", "random_fold_in_p", "random_seed_p",
    "random_split_p", "random_wrap_p", "random_unwrap_p")

# Batching passes: control flow whose predicate or index must not differ per member.
BATCH_DYNAMIC = frozenset({COND, WHILE, SCAN})
