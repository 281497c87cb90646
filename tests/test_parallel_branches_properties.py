"""Property-based tests of `jaxpar.parallel_branches` on random programs.

For a random program `f` (see `programs.py`) and `g = parallel_branches(f, **options)`, with
options drawn from `CONFIGURATIONS` (targets "gpu" and "cpu"):

- `jax.jit(g)(*args)` and `g(*args)` compute bit for bit what `jax.jit(f)(*args)` does: the
  rewrite only adds call boundaries and tags, and `g` called eagerly runs under `jax.jit`.
- `jax.jit(jax.grad(loss))` for a scalar loss (the sum of all outputs), and `jax.vmap` run
  eagerly, agree for `g` and `f` within float32 tolerance. The tolerance is for `vmap`, where
  `g`'s stream calls run as whole XLA computations but `f` runs one equation at a time (with
  arrays closed over by nested `jit`s constant-folded), so XLA fuses and rounds differently,
  e.g. it contracts `a * b + c` into an FMA only inside a fusion. Each comparison runs both
  sides the same way: eager and jitted gradients of one function differ by more than the
  tolerance where a gradient cancels (the gradient of `x - max(x)` at the maximum, jax 0.12).
- `parallel_branches` is idempotent: applied twice it gives the jaxpr it gives applied once.
- For target "gpu", the StableHLO lowered for CUDA carries only integer stream ids >= 1, and no
  stream-annotated call runs inside another one (XLA rejects nested annotated calls).

Run with `JAXPAR_HYPOTHESIS_PROFILE=dev|ci|full|thorough` (see `conftest.py`; the default `ci`
draws 10 examples a property, `JAXPAR_FULL=1` selects `full`, 20); a failure prints
the options, the program's listing and the spec that rebuilds it with
`programs.build_program(spec)`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.environment import needs_plugin
from hypothesis import event, given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar import _compiled

try:
    from helpers.environment import fraction_of_examples
    from helpers.lowered import canonical_jaxpr_text
    from programs import (
        Program,
        feature_programs,
        loop_programs,
        programs,
        scan_programs,
        stacked_batch,
    )
except ImportError:  # tests/ imported as a package
    from tests.helpers.environment import fraction_of_examples
    from tests.helpers.lowered import canonical_jaxpr_text
    from tests.programs import (
        Program,
        feature_programs,
        loop_programs,
        programs,
        scan_programs,
        stacked_batch,
    )

# Each example draws one; the first is where shrinking goes.
CONFIGURATIONS: tuple[dict[str, Any], ...] = (
    {"target": "gpu"},
    # Stream tags only, loop rewrites off; every section forced past the GPU pricing, which
    # under XLA's default CUDA-graph mode keeps most of them out.
    {"target": "gpu", "min_cost_us": 0.0, "fuse_scans": False, "batch_scans": False,
     "batch_branches": False, "batch_matmuls": False, "unroll": None, "force_streams": True},
    # Plans every independent branch, however cheap: most random programs get rewritten
    # (about 60%, against 15% with the default threshold).
    {"target": "gpu", "min_cost_us": 0.0, "force_streams": True},
    {"target": "cpu"},
)
GPU_CONFIGURATIONS = tuple(c for c in CONFIGURATIONS if c["target"] == "gpu")
# target="cpu" re-emits the program unchanged: bit-exact. target="gpu" wraps regions in
# non-inlined calls, around which XLA:CPU fuses (and so rounds) differently by an ulp or
# two, and its loop rewrites (unroll, fusion) reassociate float32 arithmetic.
VALUE_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}

# Half the examples are general DAGs, half scan-heavy programs.
any_program = st.one_of(programs(), scan_programs())
configurations = st.sampled_from(CONFIGURATIONS)


def assert_trees_equal(actual: Any, expected: Any, **tolerance: float) -> None:
    """Same tree structure, shapes and dtypes; leaves bit-exact unless a tolerance is given."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    leaves = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    for i, (a, e) in enumerate(leaves):
        a, e = np.asarray(a), np.asarray(e)
        assert (a.shape, a.dtype) == (e.shape, e.dtype), f"leaf {i}"
        if tolerance:
            np.testing.assert_allclose(a, e, err_msg=f"leaf {i}", **tolerance)
        else:
            np.testing.assert_array_equal(a, e, err_msg=f"leaf {i}")


def scalar_loss(fn: Callable[..., Any]) -> Callable[..., jax.Array]:
    def loss(*args: jax.Array) -> jax.Array:
        return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(fn(*args)))

    return loss


@given(program=any_program, options=configurations)
def test_values_match(program: Program, options: dict[str, Any]) -> None:
    g = jaxpar.parallel_branches(program.fn, **options)
    expected = jax.jit(program.fn)(*program.args)
    tolerance = {} if options["target"] == "cpu" else VALUE_TOLERANCE
    assert_trees_equal(jax.jit(g)(*program.args), expected, **tolerance)
    assert_trees_equal(g(*program.args), expected, **tolerance)


@given(program=any_program, options=configurations)
def test_grad_matches(program: Program, options: dict[str, Any]) -> None:
    g = jaxpar.parallel_branches(program.fn, **options)
    argnums = tuple(range(len(program.args)))
    expected = jax.jit(jax.grad(scalar_loss(program.fn), argnums))(*program.args)
    for leaf in jax.tree.leaves(expected):
        assert np.all(np.isfinite(leaf)), "the program's own gradient is not finite"
    actual = jax.jit(jax.grad(scalar_loss(g), argnums))(*program.args)
    assert_trees_equal(actual, expected, **GRAD_TOLERANCE)


@given(program=any_program, options=configurations)
def test_vmap_matches(program: Program, options: dict[str, Any]) -> None:
    g = jaxpar.parallel_branches(program.fn, **options)
    batch = stacked_batch(program.args)
    # Against jit under vmap: eager bfloat16 ops round after each op, XLA's fusions once.
    expected = jax.vmap(jax.jit(program.fn))(*batch)
    assert_trees_equal(jax.vmap(g)(*batch), expected, **VALUE_TOLERANCE)


@given(program=any_program)
def test_idempotent(program: Program) -> None:
    check_idempotent(program)


def check_idempotent(program: Program) -> None:
    # Tracing only, so every configuration but the forced ones: with sections forced into
    # a scan body the emitter unrolls the body itself, and an unrolled body can hold the
    # same equation twice (copy 2's `sin(carry)` is copy 1's `sin(sin(c))`), which a
    # second application merges (share_common) -- same values, one kernel fewer.
    for options in (c for c in CONFIGURATIONS if not c.get("force_streams")):
        once = jaxpar.parallel_branches(program.fn, **options)
        twice = jaxpar.parallel_branches(once, **options)
        assert canonical_jaxpr_text(jax.make_jaxpr(twice)(*program.args)) == (
            canonical_jaxpr_text(jax.make_jaxpr(once)(*program.args))
        ), f"not idempotent with {options}"


# ---- StableHLO lowered for CUDA ---------------------------------------------------------------

_STREAM_ANNOTATION = re.compile(r'_xla_stream_annotation\s*=\s*"([^"]*)"')
_FUNC = re.compile(r'^(\s*)func\.func\s+(?:(?:public|private|nested)\s+)?@("[^"]*"|[\w.$-]+)\(')
_CALL = re.compile(r'(?:^|[\s=])(?:func\.)?call\s+@("[^"]*"|[\w.$-]+)\(')


def stablehlo_functions(text: str) -> dict[str, list[str]]:
    """Maps each `func.func` of a StableHLO module to the lines of its body."""
    functions: dict[str, list[str]] = {}
    current: list[str] | None = None
    closing = ""
    for line in text.splitlines():
        if current is None:
            match = _FUNC.match(line)
            if match:
                current = functions.setdefault(match.group(2).strip('"'), [])
                closing = match.group(1) + "}"
        elif line.rstrip() == closing:
            current = None
        else:
            current.append(line)
    return functions


def annotated_calls(lines: list[str]) -> list[str]:
    """Callees of the stream-annotated `call` ops among `lines`."""
    return [
        match.group(1).strip('"')
        for line in lines
        if _STREAM_ANNOTATION.search(line) and (match := _CALL.search(line))
    ]


def reachable_functions(functions: dict[str, list[str]], root: str) -> set[str]:
    """`root` and every function it calls, directly or not."""
    seen, stack = set(), [root]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in functions.get(name, []):
            if match := _CALL.search(line):
                stack.append(match.group(1).strip('"'))
    return seen


def test_stablehlo_parser_finds_nested_annotated_calls() -> None:
    text = """\
module @jit_f {
  func.func public @main(%arg0: tensor<8xf32>) -> (tensor<8xf32>) {
    %0 = call @"<lambda>"(%arg0) STREAM_1 : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @"<lambda>"(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @inner(%arg0) : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @inner(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = func.call @leaf(%arg0) STREAM_2 : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @leaf(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    return %arg0 : tensor<8xf32>
  }
}
"""
    for stream in ("1", "2"):
        attributes = f'_xla_stream_annotation = "{stream}", inlineable = "false"'
        text = text.replace(f"STREAM_{stream}", f"{{mhlo.frontend_attributes = {{{attributes}}}}}")
    functions = stablehlo_functions(text)
    assert set(functions) == {"main", "<lambda>", "inner", "leaf"}
    assert annotated_calls(functions["main"]) == ["<lambda>"]
    assert annotated_calls(functions["inner"]) == ["leaf"]
    assert reachable_functions(functions, "<lambda>") == {"<lambda>", "inner", "leaf"}


@given(program=any_program)
def test_gpu_lowering_has_flat_integer_stream_annotations(program: Program) -> None:
    for options in GPU_CONFIGURATIONS:  # lowering only, so every GPU configuration
        g = jaxpar.parallel_branches(program.fn, **options)
        lowered = jax.jit(g).trace(*program.args).lower(lowering_platforms=("cuda",))
        check_stream_annotations(lowered.as_text(), options)


def check_stream_annotations(text: str, options: dict[str, Any]) -> None:
    for stream in _STREAM_ANNOTATION.findall(text):
        assert re.fullmatch(r"[0-9]+", stream) and int(stream) >= 1, (
            f"stream annotation {stream!r} is not an integer >= 1 (options {options})"
        )

    functions = stablehlo_functions(text)
    callees = {c for lines in functions.values() for c in annotated_calls(lines)}
    count = len(callees) if len(callees) < 3 else "3+"
    event(f"functions called with a stream annotation ({options}): {count}")
    for callee in callees:
        assert callee in functions, f"annotated call to unknown function @{callee}"
        for name in reachable_functions(functions, callee):
            nested = annotated_calls(functions.get(name, []))
            assert not nested, (
                f"stream-annotated call to @{callee} reaches @{name}, which makes the "
                f"stream-annotated calls {nested}; XLA rejects nested annotated calls "
                f"(options {options})"
            )


# ---- Feature programs: the families that broke jaxpar before ---------------------------------
#
# Loops with counters of every dtype and step, custom rules with nondiff args, callbacks,
# random keys, per-member conds, checkpoints around loops, other dtypes, outputs with None
# leaves and literals (see `programs.feature_program_specs`), checked with the properties
# above and under `shard_map`, a trace-context flip, and eager `grad`/`jvp`. These programs
# compile more than the others, so each property runs a quarter of the profile's examples.


_examples = fraction_of_examples


any_feature_program = st.one_of(feature_programs(), loop_programs())


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", value) or ("raised", exception): a rewrite must fail where `jax.jit` does."""
    try:
        return "ok", jax.block_until_ready(fn())
    except Exception as error:
        return "raised", error


def assert_same_outcome(actual: Callable[[], Any], expected: Callable[[], Any],
                        may_succeed: bool = False, **tolerance: float) -> None:
    """Both raise, or both return equal trees (bit-exact unless a tolerance is given).

    `may_succeed`: the rewrite may return where `jax.jit` raises. For gradients: a `while`
    with a constant trip count becomes a scan, which reverse-mode differentiates."""
    want_kind, want = _outcome(expected)
    got_kind, got = _outcome(actual)
    if want_kind == "raised":
        assert may_succeed or got_kind == "raised", (
            f"jax.jit raises {want!r}, the rewrite returns a value")
        return
    if got_kind == "raised":
        raise AssertionError("the rewrite raises where jax.jit does not") from got
    assert_trees_equal(got, want, **tolerance)


def _value_tolerance(options: dict[str, Any]) -> dict[str, float]:
    return {} if options["target"] == "cpu" else VALUE_TOLERANCE


@_examples(0.15)
@given(program=any_feature_program, options=configurations)
def test_feature_values_match(program: Program, options: dict[str, Any]) -> None:
    g = jaxpar.parallel_branches(program.fn, **options)
    expected = lambda: jax.jit(program.fn)(*program.args)
    tolerance = _value_tolerance(options)
    assert_same_outcome(lambda: jax.jit(g)(*program.args), expected, **tolerance)
    assert_same_outcome(lambda: g(*program.args), expected, **tolerance)


@_examples(0.15)
@given(program=any_feature_program, options=configurations)
def test_feature_grad_matches(program: Program, options: dict[str, Any]) -> None:
    g = jaxpar.parallel_branches(program.fn, **options)
    argnums = tuple(range(len(program.args)))
    assert_same_outcome(
        lambda: jax.jit(jax.grad(scalar_loss(g), argnums))(*program.args),
        lambda: jax.jit(jax.grad(scalar_loss(program.fn), argnums))(*program.args),
        may_succeed=True, **GRAD_TOLERANCE)


@_examples(0.1)
@given(program=any_feature_program, options=configurations)
def test_feature_vmap_matches(program: Program, options: dict[str, Any]) -> None:
    g = jaxpar.parallel_branches(program.fn, **options)
    batch = stacked_batch(program.args)
    assert_same_outcome(lambda: jax.vmap(g)(*batch),
                        lambda: jax.vmap(jax.jit(program.fn))(*batch),
                        **VALUE_TOLERANCE)


@_examples(0.1)
@given(program=feature_programs(), options=configurations)
def test_feature_vmap_of_grad_matches(program: Program, options: dict[str, Any]) -> None:
    """Per-example gradients (``vmap(grad(...))``): custom rules with functions among
    their arguments and integer or None residuals, inside regions that vmap batches."""
    g = jaxpar.parallel_branches(program.fn, **options)
    argnums = tuple(range(len(program.args)))
    batch = stacked_batch(program.args)
    assert_same_outcome(
        lambda: jax.vmap(jax.grad(scalar_loss(g), argnums))(*batch),
        lambda: jax.vmap(jax.grad(scalar_loss(jax.jit(program.fn)), argnums))(*batch),
        may_succeed=True, **GRAD_TOLERANCE)


@_examples(0.1)
@given(program=any_feature_program)
def test_feature_idempotent(program: Program) -> None:
    check_idempotent(program)


def _count_primitive(closed: Any, name: str) -> int:
    """Equations of primitive `name` in a jaxpr and every jaxpr nested in its parameters."""
    count, stack = 0, [closed.jaxpr]
    while stack:
        jaxpr = stack.pop()
        for eqn in jaxpr.eqns:
            count += eqn.primitive.name == name
            for param in eqn.params.values():
                for value in param if isinstance(param, (tuple, list)) else (param,):
                    if hasattr(value, "eqns"):
                        stack.append(value)
                    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
                        stack.append(value.jaxpr)
    return count


@_examples(0.15)
@given(program=feature_programs(), options=st.sampled_from(GPU_CONFIGURATIONS))
def test_rewrite_adds_no_select(program: Program, options: dict[str, Any]) -> None:
    """A `cond` or `while` whose predicate differs per member must not become a `select_n`:
    that runs every branch (or trip) for every member, work `jax.jit` never does. Feature
    programs hold no `select_n` of their own (unrolling may copy one that a program has), so
    any `select_n` in the rewrite comes from batching a cond or while."""
    g = jaxpar.parallel_branches(program.fn, **options)
    assert _count_primitive(jax.make_jaxpr(program.fn)(*program.args), "select_n") == 0
    after = _count_primitive(jax.make_jaxpr(g)(*program.args), "select_n")
    assert after == 0, f"the rewrite adds {after} select_n (options {options})"


@_examples(0.1)
@given(program=feature_programs(), options=configurations)
def test_trace_context_flip_between_calls(program: Program, options: dict[str, Any]) -> None:
    """The same decorated function, called again under another trace context, computes what
    `jax.jit` computes under that context (or fails where it fails)."""
    g = jaxpar.parallel_branches(program.fn, **options)
    tolerance = _value_tolerance(options)
    assert_same_outcome(lambda: g(*program.args), lambda: jax.jit(program.fn)(*program.args),
                        **tolerance)
    for context in (lambda: jax.enable_x64(True), lambda: jax.numpy_rank_promotion("raise")):
        with context():
            assert_same_outcome(lambda: g(*program.args),
                                lambda: jax.jit(program.fn)(*program.args), **tolerance)
    assert_same_outcome(lambda: g(*program.args), lambda: jax.jit(program.fn)(*program.args),
                        **tolerance)


@_examples(0.1)
@given(program=any_program, options=configurations)
def test_eager_grad_and_jvp_match(program: Program, options: dict[str, Any]) -> None:
    """`jax.grad` and `jax.jvp` of the decorated function, without an outer `jit`, give what
    they give for `jax.jit` of the original: bit for bit on target "cpu"."""
    g = jaxpar.parallel_branches(program.fn, **options)
    f = jax.jit(program.fn)
    argnums = tuple(range(len(program.args)))
    tolerance = {} if options["target"] == "cpu" else GRAD_TOLERANCE
    assert_same_outcome(lambda: jax.grad(scalar_loss(g), argnums)(*program.args),
                        lambda: jax.grad(scalar_loss(f), argnums)(*program.args),
                        may_succeed=True, **tolerance)
    tangents = tuple(jnp.ones_like(a) for a in program.args)
    assert_same_outcome(lambda: jax.jvp(g, program.args, tangents),
                        lambda: jax.jvp(f, program.args, tangents), **tolerance)


# ---- Programs inside shard_map ---------------------------------------------------------------

SHARD_MAP_DEVICES = 8


def _sharded(fn: Callable[..., Any], mesh: Any, n_args: int) -> Callable[..., Any]:
    """`fn` per device on its slice of stacked arguments: each device runs one member."""
    def body(*stacked: jax.Array) -> Any:
        out = fn(*(a[0] for a in stacked))
        return jax.tree.map(lambda leaf: jnp.asarray(leaf)[None], out)

    spec = P("x")
    return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * n_args, out_specs=spec)


@pytest.mark.cpu_devices(SHARD_MAP_DEVICES)  # run where there are (tests/conftest.py)
@_examples(0.1)
@given(program=st.one_of(feature_programs(), programs()), options=configurations)
def test_programs_inside_shard_map(program: Program, options: dict[str, Any]) -> None:
    mesh = Mesh(np.array(jax.devices("cpu")[:SHARD_MAP_DEVICES]), ("x",))
    n = len(program.args)
    scales = jnp.linspace(-1.0, 1.0, SHARD_MAP_DEVICES)[:, None, None]
    stacked = tuple(jnp.tanh(a[None] * scales + 0.1 * k) for k, a in enumerate(program.args))
    want = lambda: jax.jit(_sharded(program.fn, mesh, n))(*stacked)
    tolerance = _value_tolerance(options)
    g = jaxpar.parallel_branches(program.fn, **options)
    # The decorated function inside the shard_map body, and the shard_map'ed one decorated.
    assert_same_outcome(lambda: jax.jit(_sharded(g, mesh, n))(*stacked), want, **tolerance)
    outer = jaxpar.parallel_branches(_sharded(program.fn, mesh, n), **options)
    assert_same_outcome(lambda: outer(*stacked), want, **tolerance)


@pytest.mark.cpu_devices(SHARD_MAP_DEVICES)
@_examples(0.1)
@given(program=st.one_of(feature_programs(), programs()), options=configurations)
def test_programs_on_an_explicit_mesh(program: Program, options: dict[str, Any]) -> None:
    """Arguments sharded over a (4, 2) mesh of ``AxisType.Explicit`` axes (sharding in the
    types): the same values as `jax.jit` (or the same failure), and its output shardings."""
    explicit = jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(explicit, explicit),
                         devices=jax.devices("cpu")[:SHARD_MAP_DEVICES])
    g = jaxpar.parallel_branches(program.fn, **options)
    with jax.set_mesh(mesh):
        args = tuple(jax.device_put(a, NamedSharding(
            mesh, P("x", None) if k % 2 == 0 and a.shape[0] % 4 == 0 else P()))
            for k, a in enumerate(program.args))
        tolerance = _value_tolerance(options)
        assert_same_outcome(lambda: g(*args), lambda: jax.jit(program.fn)(*args),
                            **tolerance)
        if _outcome(lambda: jax.jit(program.fn)(*args))[0] == "ok":
            for got, want in zip(jax.tree.leaves(g(*args)),
                                 jax.tree.leaves(jax.jit(program.fn)(*args)), strict=True):
                assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (
                    got.sharding, want.sharding)


# ---- Every emitted program compiles for the GPU (deviceless) --------------------------------



@needs_plugin
@_examples(0.1)
@given(program=st.one_of(scan_programs(), loop_programs(), feature_programs()),
       options=st.sampled_from(GPU_CONFIGURATIONS))
def test_gpu_compile_succeeds(program: Program, options: dict[str, Any]) -> None:
    """XLA:GPU compiles whatever the GPU target emits (for an H200, without a GPU): every
    combination of fused, batched and unrolled loops with regions in their bodies."""
    g = jaxpar.parallel_branches(program.fn, **options)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in program.args]
    try:
        _compiled.compile_for_gpu(program.fn, *specs, gpu="h200")
    except RuntimeError as error:  # a host callback: JAX lowers it only with a GPU present
        assert "live GPU backend" in str(error)
        with pytest.raises(RuntimeError, match="live GPU backend"):
            _compiled.compile_for_gpu(g, *specs, gpu="h200")
        return
    _compiled.compile_for_gpu(g, *specs, gpu="h200")
