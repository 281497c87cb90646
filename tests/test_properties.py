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

Run with `JAXPAR_HYPOTHESIS_PROFILE=dev|ci|thorough` (see `conftest.py`); a failure prints
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
from hypothesis import event, given
from hypothesis import strategies as st

import jaxpar

try:
    from programs import Program, programs, scan_programs, stacked_batch
except ImportError:  # tests/ imported as a package
    from tests.programs import Program, programs, scan_programs, stacked_batch

# Each example draws one; the first is where shrinking goes.
CONFIGURATIONS: tuple[dict[str, Any], ...] = (
    {"target": "gpu"},
    # Stream tags only, loop rewrites off.
    {"target": "gpu", "min_cost_us": 0.0, "fuse_scans": False, "batch_scans": False,
     "batch_branches": False, "batch_matmuls": False, "unroll": None},
    # Plans every independent branch, however cheap: most random programs get rewritten
    # (about 60%, against 15% with the default threshold).
    {"target": "gpu", "min_cost_us": 0.0},
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
    expected = jax.vmap(program.fn)(*batch)
    assert_trees_equal(jax.vmap(g)(*batch), expected, **VALUE_TOLERANCE)


@given(program=any_program)
def test_idempotent(program: Program) -> None:
    for options in CONFIGURATIONS:  # tracing only, so every configuration
        once = jaxpar.parallel_branches(program.fn, **options)
        twice = jaxpar.parallel_branches(once, **options)
        assert str(jax.make_jaxpr(twice)(*program.args)) == str(
            jax.make_jaxpr(once)(*program.args)
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
