"""Hypothesis strategies that build random JAX programs for property-based tests.

A program is drawn as a *spec*: nested tuples of strings and ints that say exactly what to
build. `build_program(spec)` turns a spec into a `Program` deterministically, so a failing
example is reproduced by pasting the spec that its `description` ends with:

    >>> from programs import build_program
    >>> program = build_program(("program", 8, 2, 7, ("block", 2, (("sin", 0),), (2,)), "single"))
    >>> program.fn(*program.args).shape
    (8, 8)

Grammar of a spec:

    program := ("program", n, n_inputs, seed, block, output_kind)
    block   := ("block", n_params, nodes, outs)      # params are v0..v{n_params-1}
    node    := (unary, v) | (binary, v, v) | ("matmul", v, v)
             | ("reduce", "sum"|"max", axis, "keepdims"|"broadcast", v)
             | ("scan", length, reverse, carries, xs, consts, body, ys_mode)
             | ("cond", selector, operands, closure, branches)    # 2 branches: cond, else switch
             | ("jit", operand_sets, closure, block)               # one jitted fn, called per set
             | ("checkpoint", policy, prevent_cse, operands, closure, block)
             | ("parallel", join, ((operands, block), ...))       # independent inline chains

Every value in a program is an `(n, n)` float32 array; a node appends its results to the
block's list of values, and `v` above is an index into that list. Scan `xs` are built from
`(n, n)` values; `ys_mode` is "mean" or "last" (the `ys` reduced to `(n, n)` values), or
"raw" (top level only: the stacked `ys` become extra output leaves of shape
`(length, n, n)`). `output_kind` ("single", "tuple", "dict", "nested") shapes the output tree.

`programs()` draws general DAGs (a quarter of them pure chains; many with a `parallel` node
of 2-4 independent matmul or scan chains, a third of which run one block on different
operands, like the members of an ensemble); `scan_programs()` draws programs made mostly of
independent and dependent scans, of mixed directions and often equal lengths, with consts,
nested scans and conds in their bodies.

Values stay tame: the drawing code tracks a bound on every value and inserts a `tanh` node
after anything that may exceed `_TAME` (every matmul, sums, products), and operands are taken
only from tame values, so outputs and gradients stay finite.

Sharp edges:
    Branch predicates depend on data (`sum(v) > 0`, `argmax`): where two computations of a
    program round differently, a predicate sitting within rounding of its threshold can pick
    another branch (rare, but then no tolerance helps).
    XLA:CPU (jax 0.10.2) runs a `while` whose integer counter starts past its constant bound
    by less than one step (`i = 5; while i < 4: i += 5`) once instead of zero times, and an
    `i < stop` loop whose distance is not a multiple of its step one time short
    (`i = 0; while i < 1: i += 2` never runs), so `jax.jit` is wrong there (jaxpar, which
    makes such loops static, is right); the drawer does not make such loops
    (`_xla_miscounts`).
    Some gradients cancel badly, e.g. that of `x - max(x)` at the maximum: eager and jitted
    gradients of the same program can differ by 1e-4 there (jax 0.12), so compare
    gradients computed the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax import lax

__all__ = [
    "Program",
    "build_program",
    "checkify_program_specs",
    "checkify_programs",
    "collect_effects",
    "describe_spec",
    "feature_program_specs",
    "feature_programs",
    "loop_program_specs",
    "loop_programs",
    "programs",
    "program_specs",
    "rule_program_specs",
    "rule_programs",
    "scan_programs",
    "scan_program_specs",
    "stacked_batch",
]

Spec = tuple[Any, ...]

_TAME = 4.0  # operands are drawn only from values bounded by this
_EXP_INPUT_BOUND = 1.0  # exp is applied only to values bounded by this
_MAX_DEPTH = 2  # nesting of scan / cond / jit / checkpoint / parallel bodies

_UNARY = ("sin", "tanh", "exp", "relu")
_BINARY = ("add", "sub", "mul", "max")
_CHECKPOINT_POLICIES: dict[str, Any] = {
    "none": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A random JAX program and inputs to run it on.

    Attributes:
        fn: takes `len(args)` float32 arrays and returns a pytree of float32 arrays.
        args: the inputs, float32 arrays of shape `(n, n)`.
        description: readable listing of the program, ending with the spec that rebuilds it.
    """

    fn: Callable[..., Any]
    args: tuple[jax.Array, ...]
    description: str

    def __repr__(self) -> str:  # hypothesis prints this for a falsifying example
        return f"Program(\n{self.description}\n)"


# --------------------------------------------------------------------------------------------
# Building a program from a spec.
# --------------------------------------------------------------------------------------------


def build_program(spec: Spec) -> Program:
    """Builds the program a spec describes; deterministic, so failures reproduce from the spec."""
    _, n, n_inputs, seed, block, output_kind = spec
    rng = np.random.default_rng(seed)
    args = tuple(
        jnp.asarray(rng.uniform(-1.0, 1.0, size=(n, n)).astype(np.float32)) for _ in range(n_inputs)
    )

    def fn(*inputs: jax.Array) -> Any:
        raw_ys: list[jax.Array] = []
        outs = _eval_block(block, inputs, raw_ys)
        if output_kind == "extras":  # a None leaf, a literal, an input returned unchanged
            return {"outs": (*outs, *raw_ys), "none": None, "literal": 2.0, "input": inputs[0]}
        return _arrange_outputs(output_kind, [*outs, *raw_ys])

    fn.__name__ = f"program_{seed}"
    return Program(fn=fn, args=args, description=describe_spec(spec))


def stacked_batch(args: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """A batch of two argument sets, `args` and a tame transform of it, for `vmap` tests."""
    return tuple(jnp.stack([a, -0.5 * a[::-1]]) for a in args)


def _arrange_outputs(kind: str, leaves: list[jax.Array]) -> Any:
    if kind == "single" and len(leaves) == 1:
        return leaves[0]
    if kind == "dict":
        return {f"out{i}": leaf for i, leaf in enumerate(leaves)}
    if kind == "nested":
        half = (len(leaves) + 1) // 2
        return {"first": tuple(leaves[:half]), "rest": [*leaves[half:]]}
    return tuple(leaves)


def _eval_block(
    block: Spec, params: Sequence[jax.Array], raw_ys: list[jax.Array] | None
) -> tuple[jax.Array, ...]:
    _, n_params, nodes, outs = block
    assert len(params) == n_params, (len(params), n_params)
    env = list(params)
    for node in nodes:
        env.extend(_node_rules[node[0]](node, env, raw_ys))
    return tuple(env[i] for i in outs)


def _eval_unary(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    name, v = node
    x = env[v]
    if name == "sin":
        return [jnp.sin(x)]
    if name == "tanh":
        return [jnp.tanh(x)]
    if name == "exp":
        return [jnp.exp(x)]
    return [jax.nn.relu(x)]  # a custom_jvp


def _eval_binary(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    name, a, b = node
    x, y = env[a], env[b]
    if name == "add":
        return [x + y]
    if name == "sub":
        return [x - y]
    if name == "mul":
        return [x * y]
    return [jnp.maximum(x, y)]


def _eval_matmul(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    _, a, b = node
    return [env[a] @ env[b]]


def _eval_reduce(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    _, kind, axis, mode, v = node
    x = env[v]
    reduce = jnp.sum if kind == "sum" else jnp.max
    if mode == "keepdims":
        r = reduce(x, axis=axis, keepdims=True)
    else:
        r = reduce(x, axis=axis)
        if axis is not None:
            r = jnp.expand_dims(r, axis)
        r = jnp.broadcast_to(r, x.shape)
    return [x - r]


def _make_xs(x: jax.Array, length: int) -> jax.Array:
    scales = np.linspace(0.5, 1.5, length, dtype=np.float32)[:, None, None]
    return jnp.tanh(x[None] * scales)


def _eval_scan(node: Spec, env: list[jax.Array], raw_ys: list[jax.Array] | None) -> list[jax.Array]:
    _, length, reverse, carries, xs, consts, body, ys_mode = node
    n_carry = len(carries)
    const_values = [env[i] for i in consts]

    def step(carry: tuple[jax.Array, ...], x: tuple[jax.Array, ...]) -> Any:
        outs = _eval_block(body, (*carry, *x, *const_values), None)
        return tuple(outs[:n_carry]), tuple(outs[n_carry:])

    init = tuple(env[i] for i in carries)
    xs_values = tuple(_make_xs(env[i], length) for i in xs)
    final, ys = lax.scan(step, init, xs_values, length=length, reverse=reverse)
    if ys_mode == "raw":
        assert raw_ys is not None, "raw ys are only allowed at the top level"
        raw_ys.extend(ys)
        return list(final)
    if ys_mode == "mean":
        return [*final, *(jnp.mean(y, axis=0) for y in ys)]
    return [*final, *(y[-1] for y in ys)]


def _eval_cond(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    _, selector, operands, closure, branches = node
    closure_values = tuple(env[i] for i in closure)
    functions = [_block_function(b, closure_values) for b in branches]
    operand_values = [env[i] for i in operands]
    s = env[selector]
    if len(branches) == 2:
        return list(lax.cond(jnp.sum(s) > 0, functions[0], functions[1], *operand_values))
    index = jnp.argmax(s[0, : len(branches)])
    return list(lax.switch(index, functions, *operand_values))


def _eval_jit(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    _, operand_sets, closure, block = node
    fn = jax.jit(_block_function(block, tuple(env[i] for i in closure)))
    return [out for operands in operand_sets for out in fn(*(env[i] for i in operands))]


def _eval_checkpoint(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    _, policy, prevent_cse, operands, closure, block = node
    fn = jax.checkpoint(
        _block_function(block, tuple(env[i] for i in closure)),
        prevent_cse=bool(prevent_cse),
        policy=_CHECKPOINT_POLICIES[policy],
    )
    return list(fn(*(env[i] for i in operands)))


def _eval_parallel(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    _, join, chains = node
    ends = []
    for member, (operands, block) in enumerate(chains):
        _MEMBER.append(member)  # per-member nodes in the chain pick their member's values
        try:
            # A top-level ensemble's members may add raw outputs (keys, weak ys) too, so those
            # leave the regions the members become.
            ends.append(_eval_block(block, [env[i] for i in operands], raw_ys))
        finally:
            _MEMBER.pop()
    if join == "add":
        total = ends[0][0]
        for end in ends[1:]:
            total = total + end[0]
        return [total]
    return [out for end in ends for out in end]


def _block_function(
    block: Spec, closure_values: tuple[jax.Array, ...]
) -> Callable[..., tuple[jax.Array, ...]]:
    def fn(*operands: jax.Array) -> tuple[jax.Array, ...]:
        return _eval_block(block, (*operands, *closure_values), None)

    return fn


_node_rules: dict[str, Callable[[Spec, list[jax.Array], Any], list[jax.Array]]] = {
    **{name: _eval_unary for name in _UNARY},
    **{name: _eval_binary for name in _BINARY},
    "matmul": _eval_matmul,
    "reduce": _eval_reduce,
    "scan": _eval_scan,
    "cond": _eval_cond,
    "jit": _eval_jit,
    "checkpoint": _eval_checkpoint,
    "parallel": _eval_parallel,
}
# The member (chain index) of the innermost `parallel` chain being evaluated; per-member
# nodes (custom rules, callbacks, keys, cond thresholds) read their value for it.
_MEMBER: list[int] = []


# --------------------------------------------------------------------------------------------
# Feature nodes: loops with counters, custom rules, callbacks, random keys, per-member conds,
# other dtypes and trace-context-sensitive ops (what the programs that broke jaxpar were made of).
# --------------------------------------------------------------------------------------------


def _member_value(values: Sequence[Any]) -> Any:
    """The value of a per-member node for the member being evaluated (0 outside chains)."""
    member = _MEMBER[-1] if _MEMBER else 0
    return values[member % len(values)]


def _traced_zero(x: jax.Array, dtype: Any) -> jax.Array:
    """A zero of `dtype` that depends on `x`, so a bound built from it is traced, not literal."""
    return (jnp.sum(x) * 0).astype(dtype)


def _constant(value: Any, dtype: Any) -> jax.Array:
    # Through numpy: jnp.asarray reads a Python int as int64 first (uint64 bounds overflow).
    return jnp.asarray(np.asarray(value, dtype=dtype))


def _step_counter(i: jax.Array, step: int | float) -> jax.Array:
    # Unsigned counters cannot hold a negative step: subtract its magnitude instead.
    if step >= 0:
        return i + _constant(step, i.dtype)
    return i - _constant(-step, i.dtype)


def _while_condition(form: str, i: Any, stop: Any) -> Any:
    if form in ("lt", "fori_loop"):
        return i < stop
    if form == "swapped":
        return stop > i
    if form == "le":
        return i <= stop
    if form == "gt":
        return i > stop
    return i != stop  # "ne"


def _eval_while(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    _, dtype, start, stop, step, form, bound, carries, body = node
    dt = jnp.dtype(dtype)
    xs0 = tuple(env[i] for i in carries)
    zero = _traced_zero(xs0[0], dt)

    def mix(i: jax.Array, xs: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        # Every trip leaves a trace of the counter, so a wrong trip count changes the result.
        outs = _eval_block(body, xs, None)
        tick = 0.5 * jnp.sin(0.1 * i.astype(jnp.float32))
        return tuple(0.5 * x + tick for x in outs)

    if form == "fori_loop":
        if bound == "literal":  # concrete bounds: lax.fori_loop makes a scan
            lo, hi = np.asarray(start, dtype=dt), np.asarray(stop, dtype=dt)
        elif bound == "carried":  # one traced bound: a while whose upper bound is a constant
            lo, hi = _constant(start, dt) + zero, _constant(stop, dt)
        else:
            lo, hi = _constant(start, dt) + zero, _constant(stop, dt) + zero
        return list(lax.fori_loop(lo, hi, lambda i, xs: mix(jnp.asarray(i), xs), xs0))
    i0 = _constant(start, dt)
    if bound == "literal":
        # A numpy scalar of the counter's dtype: a Python int beyond int32 (uint32 bounds)
        # would not convert.
        literal = np.asarray(stop, dtype=dt)

        def cond(c: tuple[jax.Array, ...]) -> jax.Array:
            return _while_condition(form, c[0], literal)

        def step_fn(c: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            return (_step_counter(c[0], step), *mix(c[0], c[1:]))

        return list(lax.while_loop(cond, step_fn, (i0, *xs0))[1:])

    def cond_traced(c: tuple[jax.Array, ...]) -> jax.Array:
        return _while_condition(form, c[0], c[1])

    def step_traced(c: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return (_step_counter(c[0], step), c[1], *mix(c[0], c[2:]))

    # "carried": the bound rides in the carry with a constant initial value (as in the
    # loops `lax.fori_loop` makes); "traced": its initial value depends on the inputs.
    stop0 = _constant(stop, dt) if bound == "carried" else _constant(stop, dt) + zero
    init = (i0, stop0, *xs0)
    return list(lax.while_loop(cond_traced, step_traced, init)[2:])


def _eval_counted_scan(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    """A scan with an integer and a bool carry beside a float one, unrolled by `unroll`."""
    _, length, reverse, unroll, int_dtype, xs_mode, v, body = node
    x0 = env[v]

    def step(carry: Any, x_t: Any) -> Any:
        i, flag, x = carry
        (y,) = _eval_block(body, (x,), None)
        if x_t is not None:
            y = 0.5 * y + 0.5 * x_t
        # Arithmetic, not `jnp.where`: feature programs hold no select_n of their own (see
        # test_rewrite_adds_no_select).
        half_unless_flag = 0.5 + 0.5 * flag.astype(y.dtype)
        y = y * half_unless_flag * 0.9 + 0.1 * jnp.tanh(i.astype(jnp.float32))
        return (i + jnp.asarray(1, i.dtype), jnp.logical_not(flag), y), y

    xs = _make_xs(x0, length) if xs_mode == "xs" else None
    init = (jnp.asarray(1, int_dtype), jnp.asarray(True), x0)
    unroll_arg = True if unroll == "full" else unroll
    (i, flag, x), ys = lax.scan(step, init, xs, length=length, reverse=reverse,
                                unroll=unroll_arg)
    count = 0.1 * i.astype(jnp.float32) + flag.astype(jnp.float32)
    return [x + jnp.tanh(count), jnp.sum(ys, axis=0) / max(length, 1)]


# custom_jvp / custom_vjp whose primal ignores the nondiff argument and the rule: two members
# differing only there have identical primal jaxprs but different derivatives.
@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _sin_jvp_scaled(c: float, x: jax.Array) -> jax.Array:
    return jnp.sin(x)


@_sin_jvp_scaled.defjvp
def _sin_jvp_scaled_rule(c: float, primals: Any, tangents: Any) -> Any:
    (x,), (t,) = primals, tangents
    return jnp.sin(x), c * jnp.cos(x) * t


@jax.custom_jvp
def _sin_jvp_a(x: jax.Array) -> jax.Array:
    return jnp.sin(x)


_sin_jvp_a.defjvp(
    lambda primals, tangents: (jnp.sin(primals[0]), jnp.cos(primals[0]) * tangents[0]))


@jax.custom_jvp
def _sin_jvp_b(x: jax.Array) -> jax.Array:
    return jnp.sin(x)


_sin_jvp_b.defjvp(lambda primals, tangents: (jnp.sin(primals[0]), 0.5 * tangents[0]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sin_vjp_scaled(c: float, x: jax.Array) -> jax.Array:
    return jnp.sin(x)


_sin_vjp_scaled.defvjp(lambda c, x: (jnp.sin(x), jnp.cos(x)), lambda c, res, g: (c * res * g,))


def _vjp_pair(bwd_scale: float) -> Any:
    @jax.custom_vjp
    def f(x: jax.Array) -> jax.Array:
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda res, g: (bwd_scale * res * g,))
    return f


_SIN_VJPS = (_vjp_pair(1.0), _vjp_pair(-0.5))


# A custom_vjp whose first argument is a function (not differentiable: nondiff_argnums)
# and whose residuals hold an integer array and None beside a float one.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _act_vjp(act: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    return act(x)


def _act_vjp_fwd(act: Callable[[jax.Array], jax.Array], x: jax.Array) -> Any:
    return act(x), (jnp.argmax(x, axis=-1).astype(jnp.int32), None, x)


def _act_vjp_bwd(act: Callable[[jax.Array], jax.Array], residuals: Any, g: jax.Array) -> Any:
    index, nothing, x = residuals
    assert nothing is None
    (grad,) = jax.vjp(act, x)[1](g)
    # The integer residual is read: the gradient at each row's largest entry is doubled.
    return (grad * (1.0 + (jnp.arange(x.shape[-1]) == index[..., None])),)


_act_vjp.defvjp(_act_vjp_fwd, _act_vjp_bwd)
_ACTIVATIONS = (jnp.sin, jnp.tanh)
_SIN_JVPS = (_sin_jvp_a, _sin_jvp_b)


def _eval_custom(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    _, variant, values, v = node
    x, value = env[v], _member_value(values)
    if variant == "jvp_nondiff":
        return [_sin_jvp_scaled(value, x)]
    if variant == "vjp_nondiff":
        return [_sin_vjp_scaled(value, x)]
    if variant == "jvp_rule":
        return [_SIN_JVPS[value](x)]
    if variant == "vjp_residuals":
        return [_act_vjp(_ACTIVATIONS[value], x)]
    return [_SIN_VJPS[value](x)]  # "vjp_rule"


def _host_half(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x) * 0.5).astype(np.float32)


_HOST_FUNCTIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "sin": np.sin, "cos": np.cos, "tanh": np.tanh, "half": _host_half,
}


def _eval_callback(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    _, kind, vmap_method, functions, v = node
    x = env[v]
    host = _HOST_FUNCTIONS[_member_value(functions)]
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    # The input is cut from autodiff, so gradients flow around the callback (which has none).
    operand = lax.stop_gradient(x)
    if kind == "io":
        from jax.experimental import io_callback

        y = io_callback(host, shape, operand, ordered=False)
    else:
        y = jax.pure_callback(host, shape, operand, vmap_method=vmap_method)
    return [x + y]


def _eval_random(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    _, impl, draw_kind, seeds, v = node
    x = env[v]
    key = jax.random.key(_member_value(seeds), impl=impl)
    if draw_kind == "split":
        key = jax.random.split(key, 3)[1]
    elif draw_kind == "fold_in":
        key = jax.random.fold_in(key, 7)
    if draw_kind == "bits":
        noise = jax.random.bits(key, x.shape, jnp.uint32).astype(jnp.float32) / 2.0**32
    else:
        noise = jax.random.uniform(key, x.shape, jnp.float32, -1.0, 1.0)
    return [x + noise]


def _eval_member_cond(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    """A cond whose predicate may differ per member; its false branch is a costly loop."""
    _, thresholds, trips, v = node
    x = env[v]
    threshold = _member_value(thresholds)

    def cheap(y: jax.Array) -> jax.Array:
        return jnp.tanh(y @ y)

    def costly(y: jax.Array) -> jax.Array:
        # A while loop (traced bound) that jax.jit runs only when the predicate says so.
        hi = trips + _traced_zero(y, jnp.int32)
        return lax.fori_loop(0, hi, lambda i, z: 0.5 * z + 0.5 * jnp.sin(z), y)

    return [lax.cond(jnp.mean(x) > threshold, cheap, costly, x)]


def _eval_cast(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    _, dtype, v = node
    x = env[v]
    if dtype in ("bfloat16", "float16"):
        low = x.astype(dtype)
        return [jnp.tanh(low * jnp.asarray(1.5, dtype) + jnp.asarray(1, dtype)).astype(x.dtype)]
    if dtype == "complex64":
        z = x + 1j * jnp.sin(x)
        return [jnp.real(z * z) + jnp.imag(z)]
    return [(x * 4).astype(dtype).astype(x.dtype) * 0.25]  # int32: a staircase, zero gradient


def _eval_context(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    """Ops whose meaning depends on JAX's trace context (x64, rank promotion)."""
    _, kind, v = node
    x = env[v]
    if kind == "arange":  # float64 under enable_x64: the result is promoted with it
        n = x.shape[0]
        return [x + (jnp.arange(n) / n)[:, None]]
    return [x + jnp.mean(x, axis=0)]  # "rank": implicit rank promotion (n,) -> (n, n)


def _eval_ref(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    """A mutable array (``jax.new_ref``) updated in place, read back with ``jax.freeze``:
    twice in straight-line code ("branches"), or made and updated in each trip of a
    scan ("scan")."""
    _, mode, v = node
    x = env[v]
    if mode == "branches":
        ref = jax.new_ref(jnp.zeros_like(x))
        ref[...] += jnp.sin(x)
        ref[...] += jnp.tanh(x.T)
        return [jax.freeze(ref)]

    def step(carry: jax.Array, row: jax.Array) -> tuple[jax.Array, None]:
        ref = jax.new_ref(jnp.zeros_like(row))
        ref[...] += jnp.sin(row)
        ref[...] += carry
        return jnp.tanh(jax.freeze(ref)), None

    carry, _ = lax.scan(step, x[0], x)
    return [jnp.broadcast_to(carry, x.shape)]


# Single-operand feature nodes: the index in the node of their operand (the last field).
_FEATURE_OPERAND = {
    "custom": 3, "callback": 4, "random": 4, "member_cond": 3, "cast": 2, "context": 2,
    "ref": 2,
}

_node_rules.update({
    "while": _eval_while,
    "counted_scan": _eval_counted_scan,
    "custom": _eval_custom,
    "callback": _eval_callback,
    "random": _eval_random,
    "member_cond": _eval_member_cond,
    "cast": _eval_cast,
    "context": _eval_context,
    "ref": _eval_ref,
})


# --------------------------------------------------------------------------------------------
# Mechanism nodes: custom rules that are nonlinear, effectful or call the host, their
# twins and batched members; host callbacks only right for their own shape; weak-typed and
# key-typed scan carries and ys; checkify hazards. Effects are recorded in `EFFECTS` (debug
# callbacks) or printed as lines starting with `EFFECT_PREFIX` (debug prints).
# --------------------------------------------------------------------------------------------

EFFECT_PREFIX = "program-effect"
# (tag, sum of the value) for every debug callback run by a program; `collect_effects` reads it.
EFFECTS: list[tuple[str, float]] = []
_CLIP = 0.25  # clipped backward rules: small enough that the cotangents of outputs exceed it


def _effect(kind: str, tag: str, value: jax.Array) -> None:
    """An effect a test can count and read: a debug print, a debug callback or an ordered one."""
    total = jnp.sum(value)
    if kind == "print":
        jax.debug.print(EFFECT_PREFIX + " " + tag + " {total}", total=total)
    else:
        jax.debug.callback(functools.partial(_record_effect, tag), total,
                           ordered=kind == "ordered")


def _record_effect(tag: str, total: Any) -> None:
    EFFECTS.append((tag, float(np.asarray(total))))


def collect_effects(run: Callable[[], Any]) -> tuple[tuple[str, Any], list[tuple[str, float]]]:
    """Runs `run` and returns its outcome, ("ok", value) or ("raised", exception), with the
    effects it had: (tag, value) for each debug callback and debug print, sorted."""
    import contextlib
    import io

    EFFECTS.clear()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            outcome: tuple[str, Any] = ("ok", jax.block_until_ready(run()))
        except Exception as error:
            outcome = ("raised", error)
        jax.effects_barrier()
    effects = list(EFFECTS)
    EFFECTS.clear()
    for line in printed.getvalue().splitlines():
        if line.startswith(EFFECT_PREFIX + " "):
            _, tag, value = line.split(" ")
            effects.append((tag, float(value)))
    return outcome, sorted(effects)


def _host_cos(x: np.ndarray) -> np.ndarray:
    return np.cos(np.asarray(x)).astype(np.float32)


def _host_center(x: np.ndarray) -> np.ndarray:
    # Right only for the shape it was written for: the mean of whatever it is given.
    x = np.asarray(x)
    return (x - x.mean()).astype(np.float32)


_HOST_SHAPED: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "cos": _host_cos, "center": _host_center,
}


def _host(function: str, x: jax.Array, vmap_method: str | None) -> jax.Array:
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.pure_callback(_HOST_SHAPED[function], shape, x, vmap_method=vmap_method)


def _rule_derivative(how: str, x: jax.Array) -> jax.Array:
    """The derivative of sin at `x` as a rule computes it: on the device, on the host
    (`host_<vmap_method>`), or with rbg random bits mixed in."""
    if how.startswith("host_"):
        method = how[len("host_"):]
        return _host("cos", x, None if method == "none" else method)
    if how == "rbg":
        bits = jax.random.uniform(jax.random.key(1, impl="rbg"), x.shape, x.dtype)
        return jnp.cos(x) * (1.0 + 0.1 * bits)
    return jnp.cos(x)


def _make_vjp_helper(how: str) -> Callable[[jax.Array], jax.Array]:
    """sin with a custom_vjp whose backward rule is `how`: "clip" (nonlinear in the cotangent),
    "print"/"count"/"ordered" (an effect in every rule), "host_*" or "rbg" (see
    `_rule_derivative`)."""
    effect = how if how in ("print", "count", "ordered") else None

    @jax.custom_vjp
    def helper(x: jax.Array) -> jax.Array:
        if effect:
            _effect(effect, "primal", x)
        return jnp.sin(x)

    def fwd(x: jax.Array) -> Any:
        if effect:
            _effect(effect, "fwd", x)
        return jnp.sin(x), x

    def bwd(x: jax.Array, g: jax.Array) -> Any:
        if how == "clip":
            return (jnp.clip(g * jnp.cos(x), -_CLIP, _CLIP),)
        if effect:
            _effect(effect, "bwd", g)
        return (g * _rule_derivative(how, x),)

    helper.defvjp(fwd, bwd)
    return helper


def _make_jvp_helper(how: str) -> Callable[[jax.Array], jax.Array]:
    """sin with a custom_jvp whose rule is `how`: "print"/"count" (an effect), "host_*" or
    "rbg" (see `_rule_derivative`)."""
    effect = how if how in ("print", "count") else None

    @jax.custom_jvp
    def helper(x: jax.Array) -> jax.Array:
        if effect:
            _effect(effect, "primal", x)
        return jnp.sin(x)

    @helper.defjvp
    def rule(primals: Any, tangents: Any) -> Any:
        (x,), (t,) = primals, tangents
        if effect:
            _effect(effect, "jvp", x)
        return jnp.sin(x), t * _rule_derivative(how, x)

    return helper


_VJP_RULES = ("clip", "print", "count", "ordered", "host_none", "host_sequential",
              "host_expand_dims", "rbg")
_JVP_RULES = ("print", "count", "host_none", "host_expand_dims", "rbg")
_RULE_HELPERS: dict[str, Callable[[jax.Array], jax.Array]] = {
    **{f"vjp_{how}": _make_vjp_helper(how) for how in _VJP_RULES},
    **{f"jvp_{how}": _make_jvp_helper(how) for how in _JVP_RULES},
}
# How a helper is called: as is, through one jax.jit (the same function object every time,
# as a user's jitted helper is), or under jax.checkpoint.
_RULE_WRAPS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "plain": lambda fn: fn,
    "jit": jax.jit,
    "checkpoint": jax.checkpoint,
}
# Helpers as drawn: the nonlinear and effectful rules (what merging and batching get wrong)
# weigh more than the others.
_RULE_HELPER_DRAWS = (*_RULE_HELPERS, "vjp_clip", "vjp_clip", "vjp_clip", "vjp_count",
                      "vjp_print", "jvp_count", "vjp_host_none", "jvp_host_none")
_WRAPPED_HELPERS = {(name, wrap): make(fn) for name, fn in _RULE_HELPERS.items()
                    for wrap, make in _RULE_WRAPS.items()}


def _eval_rule(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    """A helper with a custom rule; "twins": called twice on the same operand (what
    share_common merges), each call's output scaled differently so their cotangents differ."""
    _, helper, wrap, copies, v = node
    fn, x = _WRAPPED_HELPERS[(helper, wrap)], env[v]
    if copies == "twins":
        return [fn(x) * 1.5, fn(x) * 0.5]
    return [fn(x)]


def _eval_host(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    """A pure_callback in the primal (cut from autodiff, which it has no rule for)."""
    _, function, vmap_method, v = node
    x = env[v]
    return [x + _host(function, lax.stop_gradient(x), vmap_method)]


def _eval_weak_scan(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    """A scan whose carry starts as a Python scalar: carry and ys stay weakly typed, their
    updates chosen by the data ("cond": a cond keeps the weak type, arithmetic with arrays
    would not) or by the carry alone ("arith")."""
    _, length, reverse, init, how, ys_mode, v = node
    x = env[v]

    def step(c: Any, x_t: jax.Array) -> Any:
        if how == "arith":  # the carry ignores the data
            return (c + 1 if isinstance(init, int) else c * 0.5 + 0.25), c
        if isinstance(init, int):
            new = lax.cond(jnp.mean(x_t) > 0, lambda c: c + 1, lambda c: c * 2 - 1, c)
        else:
            new = lax.cond(jnp.mean(x_t) > 0, lambda c: c * 0.5, lambda c: c * 0.25 + 0.5, c)
        return new, c

    final, ys = lax.scan(step, init, _make_xs(x, length), reverse=reverse)
    if ys_mode == "raw":
        raw_ys.extend((final, ys))
    scale = jnp.tanh(0.1 * final)
    return [x * scale, x + 0.1 * jnp.tanh(jnp.mean(ys))]


def _eval_key_scan(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    """A scan with a key-typed carry and key-typed ys, each step's key chosen by the data."""
    _, impl, length, seed, how, ys_mode, v = node
    x = env[v]

    def step(k: jax.Array, x_t: jax.Array) -> Any:
        index = jnp.argmax(x_t[0])
        if how == "fold_in":
            new = jax.random.fold_in(k, index)
        else:
            new = jax.random.split(k, 2)[index % 2]
        return new, k

    final, ys = lax.scan(step, jax.random.key(seed, impl=impl), _make_xs(x, length))
    if ys_mode == "raw":
        raw_ys.extend((final, ys))
    noise = jax.random.uniform(final, x.shape, x.dtype, -1.0, 1.0)
    first = jax.random.uniform(ys[0], x.shape, x.dtype, -1.0, 1.0)
    return [x + noise, x * 0.5 + 0.5 * first]


def _eval_key_branch(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    """Two keys, each drawn from the data and the one before (a key chain that broke regions);
    "raw": both keys are outputs of the program, so they leave any region holding them."""
    _, impl, seed, raw, v = node
    x = env[v]
    k1 = jax.random.fold_in(jax.random.key(seed, impl=impl), jnp.argmax((x @ x)[0]))
    noise = jax.random.normal(k1, x.shape, x.dtype)
    k2 = jax.random.fold_in(k1, jnp.argmax((noise @ x)[0]))
    if raw == "raw":
        raw_ys.extend((k1, k2))
    return [x + jax.random.uniform(k2, x.shape, x.dtype, -1.0, 1.0)]


CHECK_MESSAGE = "program check failed"


def _eval_shared_scans(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    _, length, reverse, helper, wrap, operands = node
    fn = _WRAPPED_HELPERS[(helper, wrap)]

    def step(c: jax.Array, x_t: jax.Array) -> Any:  # one function object for every scan
        return jnp.tanh(fn(c) * 0.9 + 0.5 * x_t), c

    outs = []
    for v in operands:
        x = env[v]
        final, ys = lax.scan(step, x, _make_xs(x, length), reverse=reverse)
        outs.append(0.9 * final + 0.1 * jnp.mean(ys, axis=0))
    return outs


def _eval_hazard(node: Spec, env: list[jax.Array], raw_ys: Any) -> list[jax.Array]:
    """What checkify checks, harmless ("ok") or failing ("bad"): an index read from the data
    (out of bounds when bad), a log (of negatives), an integer division (by zero), a user
    check. A failing index or user check names its site (``site``), so with several
    failing the error checkify reports tells which came first."""
    from jax.experimental import checkify

    _, kind, bad, site, v = node
    x = env[v]
    n = x.shape[0]
    zero = _traced_zero(x, jnp.int32)
    if kind == "index":
        i = zero + (n + site if bad == "bad" else jnp.argmax(x[0]))
        return [x + x[i][None, :]]
    if kind == "log":
        return [jnp.log(jnp.tanh(x) + (0.5 if bad == "bad" else 2.0))]
    if kind == "div":
        d = zero + (0 if bad == "bad" else 3)
        return [x + ((x * 4).astype(jnp.int32) // d).astype(x.dtype) * 0.25]
    bound = 0.0 if bad == "bad" else 100.0
    checkify.check(jnp.all(x < bound), f"{CHECK_MESSAGE} at site {site}")
    return [jnp.sin(x)]


_FEATURE_OPERAND.update({"rule": 4, "host": 3, "weak_scan": 6, "key_scan": 6, "key_branch": 4,
                         "hazard": 4})
_node_rules.update({
    "rule": _eval_rule,
    "host": _eval_host,
    "weak_scan": _eval_weak_scan,
    "key_scan": _eval_key_scan,
    "key_branch": _eval_key_branch,
    "hazard": _eval_hazard,
    "shared_scans": _eval_shared_scans,
})


def _feature_outputs(node: Spec) -> int:
    """How many values a single-operand feature node adds to its block."""
    if node[0] == "rule":
        return 2 if node[3] == "twins" else 1
    return 2 if node[0] in ("weak_scan", "key_scan") else 1


# --------------------------------------------------------------------------------------------
# Describing a spec.
# --------------------------------------------------------------------------------------------


def describe_spec(spec: Spec) -> str:
    """Readable listing of a program spec, ending with the spec itself for `build_program`."""
    _, n, n_inputs, seed, block, output_kind = spec
    lines = [f"program: {n_inputs} inputs of f32[{n},{n}] (seed {seed}), outputs as {output_kind}"]
    _describe_block(block, [f"in{i}" for i in range(n_inputs)], "  ", lines)
    lines.append(f"  spec = {spec!r}")
    return "\n".join(lines)


def _describe_block(
    block: Spec, param_names: list[str], indent: str, lines: list[str], prefix: str = "v"
) -> None:
    _, _, nodes, outs = block
    names = list(param_names)
    inner = {"v": "w", "w": "u"}.get(prefix, "t")

    def new(count: int) -> list[str]:
        # Computed values are named by their index in the block, as the spec refers to them.
        return [f"{prefix}{len(names) + k}" for k in range(count)]

    def refs(indices: Sequence[int]) -> str:
        return "[" + ", ".join(names[i] for i in indices) + "]"

    def sub(block_: Spec, params: list[str], header: str, where: str = "") -> None:
        lines.append(f"{indent}  {header}({', '.join(params)}){where}:")
        _describe_block(block_, params, indent + "    ", lines, inner)

    for node in nodes:
        kind = node[0]
        if kind in _UNARY:
            results = new(1)
            lines.append(f"{indent}{results[0]} = {kind} {names[node[1]]}")
        elif kind in _BINARY or kind == "matmul":
            results = new(1)
            lines.append(f"{indent}{results[0]} = {kind} {names[node[1]]} {names[node[2]]}")
        elif kind == "reduce":
            _, how, axis, mode, v = node
            results = new(1)
            lines.append(
                f"{indent}{results[0]} = {names[v]} - {how}({names[v]}, axis={axis}, {mode})"
            )
        elif kind == "scan":
            _, length, reverse, carries, xs, consts, body, ys_mode = node
            n_ys = len(body[3]) - len(carries)
            results = new(len(carries) + (0 if ys_mode == "raw" else n_ys))
            lines.append(
                f"{indent}{', '.join(results) or '()'} = scan(length={length}, "
                f"reverse={reverse}, carry={refs(carries)}, xs_from={refs(xs)}, "
                f"consts={refs(consts)}, ys={n_ys} as {ys_mode})"
            )
            params = (
                [f"c{i}" for i in range(len(carries))]
                + [f"x{i}" for i in range(len(xs))]
                + [f"k{i}" for i in range(len(consts))]
            )
            sub(body, params, "body")
        elif kind == "cond":
            _, selector, operands, closure, branches = node
            results = new(len(branches[0][3]))
            which = "cond(sum(s) > 0" if len(branches) == 2 else "switch(argmax(s[0])"
            lines.append(
                f"{indent}{', '.join(results)} = {which}, s={names[selector]}, "
                f"operands={refs(operands)}, closure={refs(closure)})"
            )
            params = [f"a{i}" for i in range(len(operands))]
            params += [f"k{i}" for i in range(len(closure))]
            for i, branch in enumerate(branches):
                sub(branch, params, f"branch {i}")
        elif kind in ("jit", "checkpoint"):
            if kind == "jit":
                _, operand_sets, closure, body = node
                header = "jit, called on " + " and ".join(refs(s) for s in operand_sets)
            else:
                _, policy, prevent_cse, operands, closure, body = node
                operand_sets = (operands,)
                header = (
                    f"checkpoint(policy={policy}, prevent_cse={bool(prevent_cse)}) "
                    f"on {refs(operands)}"
                )
            results = new(len(body[3]) * len(operand_sets))
            lines.append(f"{indent}{', '.join(results)} = {header}, closure={refs(closure)}")
            params = [f"a{i}" for i in range(len(operand_sets[0]))]
            params += [f"k{i}" for i in range(len(closure))]
            sub(body, params, "fn")
        elif kind == "parallel":
            _, join, chains = node
            results = new(1 if join == "add" else sum(len(b[3]) for _, b in chains))
            lines.append(
                f"{indent}{', '.join(results)} = "
                f"parallel({len(chains)} independent chains, join={join})"
            )
            for i, (operands, chain) in enumerate(chains):
                params = [f"a{j}" for j in range(len(operands))]
                sub(chain, params, f"chain {i}", f" on {refs(operands)}")
        elif kind == "while":
            _, dtype, start, stop, step, form, bound, carries, body = node
            results = new(len(carries))
            lines.append(
                f"{indent}{', '.join(results)} = while {dtype} counter from {start!r} step "
                f"{step!r} while {form} {stop!r} ({bound} bound), carry={refs(carries)}"
            )
            sub(body, [f"c{i}" for i in range(len(carries))], "body")
        elif kind == "counted_scan":
            _, length, reverse, unroll, int_dtype, xs_mode, v, body = node
            results = new(2)
            lines.append(
                f"{indent}{', '.join(results)} = scan with {int_dtype} and bool carries "
                f"(length={length}, reverse={reverse}, unroll={unroll}, xs={xs_mode}) "
                f"on {names[v]}"
            )
            sub(body, ["c0"], "body")
        elif kind == "shared_scans":
            _, length, reverse, helper, wrap, operands = node
            results = new(len(operands))
            lines.append(
                f"{indent}{', '.join(results)} = scans of one step through {helper} ({wrap}), "
                f"length={length}, reverse={reverse}, on {refs(operands)}")
        elif kind in _FEATURE_OPERAND:
            results = new(_feature_outputs(node))
            params_ = ", ".join(repr(p) for p in node[1:_FEATURE_OPERAND[kind]])
            lines.append(f"{indent}{', '.join(results)} = {kind}({params_}) {names[node[-1]]}")
        else:
            raise ValueError(f"unknown node kind {kind!r} in spec")
        names.extend(results)
    lines.append(f"{indent}return {', '.join(names[i] for i in outs)}")


# --------------------------------------------------------------------------------------------
# Drawing specs.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Flavor:
    """How blocks are drawn: which node kinds, how many nodes, which lengths for scans."""

    kinds: tuple[str, ...]  # kinds at the top level; repeated entries weigh a kind
    nested_kinds: tuple[str, ...]  # kinds inside bodies
    max_nodes: int
    max_body_nodes: int
    chain: bool = False  # every top-level node consumes the latest value
    scan_lengths: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
    independent_scans: bool = False  # scans often read only their block's params
    chain_flavor: _Flavor | None = None  # flavor of `parallel` chains (None: _HEAVY)
    replicated_in_3: int = 1  # of 3 `parallel` nodes, how many are replicated ensembles


_SIMPLE = ("unary", "binary", "matmul", "reduce")
_DAG = _Flavor(
    kinds=(
        *_SIMPLE,
        "unary",
        "binary",
        "matmul",
        "scan",
        "scan",
        "cond",
        "jit",
        "checkpoint",
        "parallel",
    ),
    nested_kinds=(*_SIMPLE, "unary", "binary", "matmul", "scan", "cond", "jit", "checkpoint"),
    max_nodes=8,
    max_body_nodes=4,
)
_CHAIN = dataclasses.replace(_DAG, chain=True)
# Chains of `parallel` nodes: heavy work (matmuls, scans of matmuls) a planner can overlap.
_HEAVY = _Flavor(
    kinds=("matmul", "matmul", "unary", "scan"),
    nested_kinds=("matmul", "matmul", "unary", "binary"),
    max_nodes=4,
    max_body_nodes=3,
)
_SCANS = _Flavor(
    kinds=("scan", "scan", "scan", "scan", "unary", "binary", "matmul"),
    nested_kinds=("unary", "binary", "matmul", "scan", "scan", "cond", "reduce"),
    max_nodes=6,
    max_body_nodes=4,
    independent_scans=True,
)
# The members of ensembles in feature programs: heavy work beside per-member nodes.
_MEMBERS = _Flavor(
    kinds=("matmul", "matmul", "unary", "custom", "callback", "random", "member_cond", "while",
           "counted_scan", "scan", "scan"),
    # Scans of members with per-member nodes in their bodies: batch_scans merges those.
    nested_kinds=("matmul", "unary", "binary", "custom", "callback", "random", "member_cond"),
    max_nodes=4,
    max_body_nodes=2,
)
_FEATURES = _Flavor(
    kinds=(*_SIMPLE, "while", "while", "counted_scan", "custom", "callback", "random",
           "member_cond", "cast", "context", "checkpoint_loops", "scan", "parallel", "parallel",
           "ref"),
    nested_kinds=(*_SIMPLE, "while", "counted_scan", "custom", "callback", "random",
                  "member_cond", "cast", "checkpoint", "cond", "scan", "ref"),
    max_nodes=6,
    max_body_nodes=3,
    chain_flavor=_MEMBERS,
    replicated_in_3=2,
)
_LOOPS = _Flavor(
    kinds=("while", "while", "while", "counted_scan", "scan", "checkpoint_loops", "unary",
           "matmul"),
    nested_kinds=("unary", "binary", "matmul", "while", "counted_scan", "checkpoint", "cond"),
    max_nodes=5,
    max_body_nodes=3,
    independent_scans=True,
)
# Programs of custom rules, effects, host callbacks, weak and key types, and the
# members of their ensembles; scans with rules in their bodies are drawn at the top level and
# as `shared_scans` (bodies of chains are too deep for anything but simple nodes).
_RULE_MEMBERS = _Flavor(
    kinds=("matmul", "matmul", "unary", "rule", "rule", "host", "scan", "weak_scan",
           "key_scan", "key_branch"),
    nested_kinds=("matmul", "unary", "binary", "rule", "host"),
    max_nodes=4,
    max_body_nodes=2,
)
_RULES = _Flavor(
    kinds=(*_SIMPLE, "rule", "rule", "rule", "rule", "host", "weak_scan", "weak_scan", "key_scan",
           "key_branch", "shared_scans", "shared_scans", "scan", "parallel", "parallel",
           "parallel"),
    nested_kinds=("unary", "binary", "matmul", "rule", "rule", "host", "weak_scan", "key_scan",
                  "cond", "checkpoint", "jit", "scan"),
    max_nodes=6,
    max_body_nodes=3,
    chain_flavor=_RULE_MEMBERS,
    replicated_in_3=2,
)
_HAZARDS = ("index", "log", "div", "user")
_HAZARD_MEMBERS = _Flavor(
    kinds=("matmul", "matmul", "unary", "hazard", "hazard", "scan"),
    nested_kinds=("matmul", "unary", "hazard"),
    max_nodes=4,
    max_body_nodes=2,
)
_CHECKS = _Flavor(
    kinds=(*_SIMPLE, "hazard", "hazard", "hazard", "scan", "cond", "jit", "checkpoint",
           "parallel", "parallel"),
    nested_kinds=("unary", "binary", "matmul", "hazard", "hazard", "scan", "cond"),
    max_nodes=6,
    max_body_nodes=3,
    chain_flavor=_HAZARD_MEMBERS,
    replicated_in_3=1,
)
# Loop counter dtypes; int64 and uint64 only exist under `jax.enable_x64`.
_COUNTER_DTYPES = ("int8", "int16", "int32", "uint8", "uint32", "float32")
_COUNTER_DTYPES_X64 = (*_COUNTER_DTYPES, "int64", "uint64")
_MAX_TRIPS = 40


def _xla_miscounts(dtype: str, start: Any, stop: Any, step: Any, form: str) -> bool:
    """Whether XLA:CPU (jax 0.10.2) runs this counter loop a wrong number of times: an
    integer counter starting past its bound by less than one step runs once instead of
    never, and an ``i < stop`` loop whose distance is not a multiple of its step runs
    ``(stop - start) // step`` times, one short (see the module's Sharp edges)."""
    if np.dtype(dtype).kind == "f" or abs(step) <= 1:
        return False
    past = start - stop if step > 0 else stop - start
    if 0 < past < abs(step):
        return True
    return form in ("lt", "swapped") and step > 0 and start < stop and (stop - start) % step != 0


def _count_trips(dtype: str, start: Any, stop: Any, step: Any, form: str) -> int | None:
    """Trips of a counter loop in the counter's own arithmetic (wrapping, rounding), or None
    when it runs more than `_MAX_TRIPS` (or forever)."""
    t = np.dtype(dtype).type
    i, s, d = t(start), t(stop), t(abs(step))
    with np.errstate(all="ignore"):
        for trips in range(_MAX_TRIPS + 1):
            if not bool(_while_condition(form, i, s)):
                return trips
            i = t(i + d) if step >= 0 else t(i - d)
    return None


@dataclasses.dataclass(frozen=True)
class _Scope:
    """Where a node is drawn: the bounds of the values before it and how it may be drawn."""

    bounds: list[float]
    n_params: int
    depth: int
    flavor: _Flavor
    top_level: bool

    def tame(self) -> list[int]:
        return [v for v, bound in enumerate(self.bounds) if bound <= _TAME]


class _Drawer:
    """Draws blocks while tracking a bound on the magnitude of every value."""

    def __init__(self, draw: Callable[[st.SearchStrategy[Any]], Any], n: int,
                 counter_dtypes: tuple[str, ...] = ()):
        self.draw = draw
        self.n = n
        self.counter_dtypes = counter_dtypes or _COUNTER_DTYPES
        self.members = 1  # chains of the replicated `parallel` node being drawn
        self.raw_ok = False  # drawing the chains of a top-level `parallel` node
        self.bad_hazards: tuple[str, ...] = ()  # the kinds of checkify hazard that fail

    def block(
        self,
        param_bounds: Sequence[float],
        depth: int,
        flavor: _Flavor,
        *,
        n_tame_outs: int = 0,
        n_any_outs: int | None = None,
        top_level: bool = False,
        root: bool = False,
    ) -> tuple[Spec, list[float]]:
        """Draws a block; returns its spec and the bounds of its outputs.

        The first `n_tame_outs` outputs are tame (scan carries), then come `n_any_outs`
        outputs of any bound, or a drawn number of them when None. A `root` block (the
        program, or a chain of a `parallel` node) draws from `flavor.kinds`, others from
        `flavor.nested_kinds`.
        """
        draw = self.draw
        bounds = list(param_bounds)
        nodes: list[Spec] = []
        root = root or top_level
        kinds = flavor.kinds if root else flavor.nested_kinds
        if depth >= _MAX_DEPTH:
            kinds = tuple(k for k in kinds if k in _SIMPLE) or ("unary",)
        max_nodes = flavor.max_nodes if root else flavor.max_body_nodes
        for i in range(draw(st.integers(1, max_nodes))):
            kind = draw(st.sampled_from(kinds))
            if top_level and i == 0 and flavor is _DAG and draw(st.integers(0, 3)) == 0:
                kind = "parallel"  # often enough that planners find parallel sections
            scope = _Scope(bounds, len(param_bounds), depth, flavor, top_level)
            node, out_bounds = getattr(self, f"_{kind}")(scope)
            nodes.append(node)
            first_new = len(bounds)
            bounds.extend(out_bounds)
            for v in range(first_new, len(bounds)):
                if bounds[v] > _TAME:
                    nodes.append(("tanh", v))
                    bounds.append(1.0)
        outs = self._outs(bounds, len(param_bounds), nodes, n_tame_outs, n_any_outs, top_level)
        return ("block", len(param_bounds), tuple(nodes), outs), [bounds[i] for i in outs]

    def _outs(
        self,
        bounds: list[float],
        n_params: int,
        nodes: list[Spec],
        n_tame: int,
        n_any: int | None,
        top_level: bool,
    ) -> tuple[int, ...]:
        draw = self.draw
        used = {v for node in nodes for v in _node_operands(node)}
        computed = list(range(n_params, len(bounds)))
        sinks = [v for v in computed if v not in used] or [len(bounds) - 1]
        if top_level:
            # All sinks, so little is dead; sometimes only some, sometimes extra outputs
            # (possibly an input returned as is, or one value twice).
            outs = list(sinks)
            if len(outs) > 1 and draw(st.integers(0, 4)) == 0:
                outs = outs[: draw(st.integers(1, len(outs) - 1))]
            outs += draw(st.lists(st.integers(0, len(bounds) - 1), max_size=2))
            return tuple(outs)
        tame = [v for v, bound in enumerate(bounds) if bound <= _TAME]
        tame_computed = [v for v in tame if v >= n_params] or tame
        outs = [draw(st.sampled_from(tame_computed + tame)) for _ in range(n_tame)]
        if n_any is None:
            n_any = draw(st.integers(1 if n_tame == 0 else 0, 2))
        preferred = sinks + computed + list(range(len(bounds)))
        outs += [draw(st.sampled_from(preferred)) for _ in range(n_any)]
        return tuple(outs)

    # ---- operands -----------------------------------------------------------------------------

    def _operand(self, scope: _Scope, *, first: bool = False, params_only: bool = False) -> int:
        tame = scope.tame()
        if params_only:
            tame = [v for v in tame if v < scope.n_params] or tame
        if scope.flavor.chain and scope.top_level and first:
            return tame[-1]
        # Recent values weigh a little more, so programs are deep as well as wide.
        return self.draw(st.sampled_from(tame[::-1] + tame[-3:][::-1]))

    def _operands(
        self, scope: _Scope, low: int, high: int, *, chained: bool = True
    ) -> tuple[int, ...]:
        count = self.draw(st.integers(low, high))
        return tuple(self._operand(scope, first=chained and i == 0) for i in range(count))

    # ---- node kinds ---------------------------------------------------------------------------

    def _unary(self, scope: _Scope) -> tuple[Spec, list[float]]:
        bounds = scope.bounds
        name = self.draw(st.sampled_from(_UNARY))
        if name in ("sin", "tanh"):
            # These tame anything, so they may read an untamed value too.
            if scope.flavor.chain and scope.top_level:
                v = len(bounds) - 1
            else:
                v = self.draw(st.sampled_from(list(range(len(bounds)))[::-1]))
            return (name, v), [1.0]
        v = self._operand(scope, first=True)
        if name == "exp":
            if bounds[v] > _EXP_INPUT_BOUND:
                return ("tanh", v), [1.0]
            return ("exp", v), [math.exp(bounds[v])]
        return ("relu", v), [bounds[v]]

    def _binary(self, scope: _Scope) -> tuple[Spec, list[float]]:
        name = self.draw(st.sampled_from(_BINARY))
        a = self._operand(scope, first=True)
        b = self._operand(scope)
        ba, bb = scope.bounds[a], scope.bounds[b]
        bound = {"add": ba + bb, "sub": ba + bb, "mul": ba * bb, "max": max(ba, bb)}[name]
        return (name, a, b), [bound]

    def _matmul(self, scope: _Scope) -> tuple[Spec, list[float]]:
        a = self._operand(scope, first=True)
        b = self._operand(scope)
        return ("matmul", a, b), [self.n * scope.bounds[a] * scope.bounds[b]]

    def _reduce(self, scope: _Scope) -> tuple[Spec, list[float]]:
        how = self.draw(st.sampled_from(("sum", "max")))
        axis = self.draw(st.sampled_from((0, 1, None)))
        mode = self.draw(st.sampled_from(("keepdims", "broadcast")))
        v = self._operand(scope, first=True)
        count = 1 if how == "max" else (self.n if axis is not None else self.n * self.n)
        return ("reduce", how, axis, mode, v), [scope.bounds[v] * (1 + count)]

    def _scan(self, scope: _Scope) -> tuple[Spec, list[float]]:
        draw = self.draw
        length = draw(st.sampled_from(scope.flavor.scan_lengths))
        reverse = draw(st.booleans())
        n_carry = draw(st.integers(0, 2))
        n_xs = draw(st.integers(0, 2))
        n_consts = draw(st.integers(0, 2))
        if n_carry + n_xs == 0:
            n_carry = 1
        # Independent scans read only their block's params, dependent ones anything.
        params_only = scope.flavor.independent_scans and draw(st.booleans())
        carries = tuple(
            self._operand(scope, first=i == 0, params_only=params_only) for i in range(n_carry)
        )
        xs = tuple(
            self._operand(scope, first=not carries and i == 0, params_only=params_only)
            for i in range(n_xs)
        )
        consts = tuple(self._operand(scope, params_only=params_only) for _ in range(n_consts))
        body_bounds = [_TAME] * n_carry + [1.0] * n_xs + [scope.bounds[i] for i in consts]
        body, out_bounds = self.block(
            body_bounds,
            scope.depth + 1,
            scope.flavor,
            n_tame_outs=n_carry,
            n_any_outs=None if n_carry else draw(st.integers(1, 2)),
        )
        ys_modes = ("mean", "last", "raw") if scope.top_level else ("mean", "last")
        ys_mode = draw(st.sampled_from(ys_modes))
        node = ("scan", length, reverse, carries, xs, consts, body, ys_mode)
        ys_bounds = [] if ys_mode == "raw" else out_bounds[n_carry:]
        return node, [_TAME] * n_carry + ys_bounds

    def _cond(self, scope: _Scope) -> tuple[Spec, list[float]]:
        draw = self.draw
        n_branches = draw(st.sampled_from((2, 2, 3, 4)))
        selector = self._operand(scope)
        operands = self._operands(scope, 1, 3)
        closure = self._operands(scope, 0, 1, chained=False)
        n_outs = draw(st.integers(1, 2))
        param_bounds = [scope.bounds[i] for i in operands + closure]
        branches, out_bounds = [], [0.0] * n_outs
        for _ in range(n_branches):
            branch, branch_bounds = self.block(
                param_bounds, scope.depth + 1, scope.flavor, n_any_outs=n_outs
            )
            branches.append(branch)
            out_bounds = [max(a, b) for a, b in zip(out_bounds, branch_bounds, strict=True)]
        return ("cond", selector, operands, closure, tuple(branches)), out_bounds

    def _jit(self, scope: _Scope) -> tuple[Spec, list[float]]:
        operands = self._operands(scope, 1, 3)
        operand_sets = [operands]
        if self.draw(st.integers(0, 3)) == 0:  # the same jitted function, called twice
            operand_sets.append(tuple(self._operand(scope) for _ in operands))
        closure = self._operands(scope, 0, 1, chained=False)
        param_bounds = [max(scope.bounds[s[k]] for s in operand_sets) for k in range(len(operands))]
        param_bounds += [scope.bounds[i] for i in closure]
        block, out_bounds = self.block(param_bounds, scope.depth + 1, scope.flavor)
        return ("jit", tuple(operand_sets), closure, block), out_bounds * len(operand_sets)

    def _checkpoint(self, scope: _Scope) -> tuple[Spec, list[float]]:
        policy = self.draw(st.sampled_from(tuple(_CHECKPOINT_POLICIES)))
        prevent_cse = int(self.draw(st.booleans()))
        operands = self._operands(scope, 1, 3)
        closure = self._operands(scope, 0, 1, chained=False)
        param_bounds = [scope.bounds[i] for i in operands + closure]
        block, out_bounds = self.block(param_bounds, scope.depth + 1, scope.flavor)
        return ("checkpoint", policy, prevent_cse, operands, closure, block), out_bounds

    def _parallel(self, scope: _Scope) -> tuple[Spec, list[float]]:
        # The chains of a top-level `parallel` node may add raw outputs (keys, weak ys).
        outer_raw, self.raw_ok = self.raw_ok, scope.top_level
        try:
            return self._parallel_chains(scope)
        finally:
            self.raw_ok = outer_raw

    def _parallel_chains(self, scope: _Scope) -> tuple[Spec, list[float]]:
        n_chains = self.draw(st.integers(2, 4))
        join = self.draw(st.sampled_from(("add", "separate")))
        chain_flavor = scope.flavor.chain_flavor or _HEAVY
        if self.draw(st.integers(0, 2)) < scope.flavor.replicated_in_3:
            return self._replicated(scope, n_chains, join, chain_flavor)
        chains, ends = [], []
        for _ in range(n_chains):
            operands = self._operands(scope, 1, 2, chained=False)
            param_bounds = [scope.bounds[i] for i in operands]
            chain, out_bounds = self.block(
                param_bounds, scope.depth + 1, chain_flavor, n_any_outs=1, root=True
            )
            chains.append((operands, chain))
            ends.append(out_bounds[0])
        node = ("parallel", join, tuple(chains))
        return node, [sum(ends)] if join == "add" else ends


    def _replicated(self, scope: _Scope, n_chains: int, join: str,
                    chain_flavor: _Flavor) -> tuple[Spec, list[float]]:
        """A `parallel` node whose chains are one block on different operands: an ensemble.

        Per-member nodes in the block (custom rules, callbacks, keys, cond thresholds) hold
        a value per chain, so members may differ in exactly those.
        """
        n_operands = self.draw(st.integers(1, 2))
        operand_sets = [
            tuple(self._operand(scope) for _ in range(n_operands)) for _ in range(n_chains)
        ]
        param_bounds = [max(scope.bounds[s[k]] for s in operand_sets) for k in range(n_operands)]
        outer_members, self.members = self.members, n_chains
        try:
            chain, out_bounds = self.block(param_bounds, scope.depth + 1, chain_flavor,
                                           n_any_outs=1, root=True)
        finally:
            self.members = outer_members
        node = ("parallel", join, tuple((operands, chain) for operands in operand_sets))
        return node, [out_bounds[0] * n_chains] if join == "add" else out_bounds * n_chains

    # ---- feature node kinds -------------------------------------------------------------------

    def _per_member(self, options: Sequence[Any]) -> tuple[Any, ...]:
        """A value per member of the enclosing ensemble: often one for all, else drawn each."""
        if self.members == 1 or self.draw(st.booleans()):
            return (self.draw(st.sampled_from(options)),) * self.members
        return tuple(self.draw(st.sampled_from(options)) for _ in range(self.members))

    def _counter_range(self, dtype: str, form: str) -> tuple[Any, Any, Any]:
        """Start, stop and step of a loop counter: small, overflowing near a bound, or down."""
        draw = self.draw
        down = form == "gt" or (form == "ne" and draw(st.booleans()))
        if np.dtype(dtype).kind == "f":
            start = draw(st.sampled_from((0.0, 0.5, -1.0, 16777214.0)))
            step = draw(st.sampled_from((0.5, 1.0, 1.5, 0.1, 3.0)))
            stop = start + step * draw(st.integers(0, 8)) + draw(st.sampled_from((0.0, 0.1, 0.7)))
            if down:
                step, stop = -step, start - (stop - start)
            return float(np.float32(start)), float(np.float32(stop)), step
        info = np.iinfo(dtype)
        lo, hi = int(info.min), int(info.max)
        how = draw(st.sampled_from(("small", "small", "overflow", "near_bound")))
        if how == "small":
            start = draw(st.integers(max(lo, -5), 5))
            step = draw(st.sampled_from((1, 1, 2, 3, 5)))
            stop = start + step * draw(st.integers(0, 8)) + draw(st.integers(-1, 1))
        elif how == "overflow":  # steps that wrap around before (or instead of) reaching stop
            step = draw(st.sampled_from((hi // 3, hi // 2, (hi * 4) // 5, hi)))
            stop = hi - draw(st.integers(0, 10))
            start = draw(st.integers(max(lo, -3), 3))
        else:  # start a few steps from the dtype's bound
            step = draw(st.sampled_from((1, 2, 3)))
            start = hi - draw(st.integers(1, 6))
            stop = hi
        if down:
            step, start, stop = -step, stop, start
            if lo == 0 and how != "small":
                start, stop = draw(st.integers(0, 6)), draw(st.integers(0, 3))
        return min(max(start, lo), hi), min(max(stop, lo), hi), step

    def _while(self, scope: _Scope) -> tuple[Spec, list[float]]:
        draw = self.draw
        dtype = draw(st.sampled_from(self.counter_dtypes))
        forms = ("lt", "lt", "swapped", "le", "gt", "ne")
        if np.dtype(dtype).kind != "f":
            forms += ("fori_loop", "fori_loop")
        form = draw(st.sampled_from(forms))
        bound = draw(st.sampled_from(("literal", "carried", "carried", "traced")))
        start, stop, step = self._counter_range(dtype, form)
        if form == "fori_loop":
            step = 1
            # JAX's fori_loop->scan reads concrete bounds as a Python int of the default
            # int type: uint64 bounds, and uint32 bounds above int32's, do not convert.
            if dtype == "uint64" or (dtype == "uint32"
                                     and max(start, stop) > np.iinfo(np.int32).max):
                bound = "carried" if bound == "literal" else bound
        if _count_trips(dtype, start, stop, step, form) is None:
            start, stop, step, form = 0, 3, 1, "lt"  # would run too long: a tame loop instead
        if _xla_miscounts(dtype, start, stop, step, form):
            start = stop  # zero trips, which XLA gets right (see Sharp edges)
        n_carry = draw(st.integers(1, 2))
        carries = tuple(self._operand(scope, first=i == 0) for i in range(n_carry))
        body, _ = self.block([_TAME] * n_carry, scope.depth + 1, scope.flavor,
                             n_tame_outs=n_carry, n_any_outs=0)
        node = ("while", dtype, start, stop, step, form, bound, carries, body)
        return node, [_TAME] * n_carry

    def _counted_scan(self, scope: _Scope) -> tuple[Spec, list[float]]:
        draw = self.draw
        length = draw(st.sampled_from((0, 1, 2, 3, 5, 7)))
        reverse = draw(st.booleans())
        unroll = draw(st.sampled_from((1, 2, 3, "full")))
        int_dtype = draw(st.sampled_from(("int32", "int8", "uint8", "int16")))
        xs_mode = draw(st.sampled_from(("none", "xs")))
        v = self._operand(scope, first=True)
        body, _ = self.block([_TAME], scope.depth + 1, scope.flavor, n_tame_outs=1, n_any_outs=0)
        node = ("counted_scan", length, reverse, unroll, int_dtype, xs_mode, v, body)
        return node, [_TAME + 2.0, _TAME]

    def _custom(self, scope: _Scope) -> tuple[Spec, list[float]]:
        variant = self.draw(st.sampled_from(("jvp_nondiff", "vjp_nondiff", "jvp_rule", "vjp_rule",
                                             "vjp_residuals")))
        options = (0.5, 1.0, 2.0, -1.0) if variant.endswith("nondiff") else (0, 1)
        return ("custom", variant, self._per_member(options), self._operand(scope)), [1.0]

    def _callback(self, scope: _Scope) -> tuple[Spec, list[float]]:
        kind = self.draw(st.sampled_from(("pure", "pure", "io")))
        vmap_method = None
        if kind == "pure":
            vmap_method = self.draw(
                st.sampled_from((None, "sequential", "expand_dims", "broadcast_all")))
        functions = self._per_member(tuple(_HOST_FUNCTIONS))
        v = self._operand(scope)
        return ("callback", kind, vmap_method, functions, v), [scope.bounds[v] + 1.0]

    def _random(self, scope: _Scope) -> tuple[Spec, list[float]]:
        impl = self.draw(st.sampled_from(("threefry2x32", "rbg", "unsafe_rbg")))
        draw_kind = self.draw(st.sampled_from(("uniform", "split", "fold_in", "bits")))
        seeds = self._per_member((0, 1, 2, 3))
        v = self._operand(scope)
        return ("random", impl, draw_kind, seeds, v), [scope.bounds[v] + 1.0]

    def _member_cond(self, scope: _Scope) -> tuple[Spec, list[float]]:
        thresholds = self._per_member((-10.0, -0.1, 0.0, 0.1, 10.0))
        trips = self.draw(st.sampled_from((3, 200)))
        v = self._operand(scope)
        return ("member_cond", thresholds, trips, v), [max(1.0, scope.bounds[v])]

    def _cast(self, scope: _Scope) -> tuple[Spec, list[float]]:
        dtype = self.draw(st.sampled_from(("bfloat16", "float16", "complex64", "int32")))
        v = self._operand(scope)
        bound = scope.bounds[v]
        out = {"complex64": bound * bound + 2.0, "int32": bound}.get(dtype, 1.0)
        return ("cast", dtype, v), [out]

    def _ref(self, scope: _Scope) -> tuple[Spec, list[float]]:
        mode = self.draw(st.sampled_from(("branches", "scan")))
        return ("ref", mode, self._operand(scope)), [2.0 if mode == "branches" else 1.0]

    def _context(self, scope: _Scope) -> tuple[Spec, list[float]]:
        kind = self.draw(st.sampled_from(("arange", "rank")))
        v = self._operand(scope)
        bound = scope.bounds[v]
        return ("context", kind, v), [bound + 1.0 if kind == "arange" else 2.0 * bound]

    # ---- mechanism node kinds -------------------------------------------------------------------

    def _raw_allowed(self, scope: _Scope) -> bool:
        return scope.top_level or (self.raw_ok and scope.depth == 1)

    def _rule(self, scope: _Scope) -> tuple[Spec, list[float]]:
        helper = self.draw(st.sampled_from(_RULE_HELPER_DRAWS))
        wrap = self.draw(st.sampled_from(("jit", "jit", "plain", "checkpoint")))
        copies = self.draw(st.sampled_from(("once", "twins")))
        node = ("rule", helper, wrap, copies, self._operand(scope))
        return node, [1.5, 0.5] if copies == "twins" else [1.0]

    def _host(self, scope: _Scope) -> tuple[Spec, list[float]]:
        function = self.draw(st.sampled_from(tuple(_HOST_SHAPED)))
        vmap_method = self.draw(st.sampled_from(("sequential", "expand_dims", "broadcast_all")))
        v = self._operand(scope)
        return ("host", function, vmap_method, v), [2.0 * scope.bounds[v] + 1.0]

    def _weak_scan(self, scope: _Scope) -> tuple[Spec, list[float]]:
        draw = self.draw
        length = draw(st.sampled_from(tuple(n for n in scope.flavor.scan_lengths if n > 0)))
        reverse = draw(st.booleans())
        init = draw(st.sampled_from((1.0, -0.5, 2)))
        how = draw(st.sampled_from(("cond", "arith")))
        ys_mode = "raw" if self._raw_allowed(scope) and draw(st.booleans()) else "reduce"
        v = self._operand(scope)
        node = ("weak_scan", length, reverse, init, how, ys_mode, v)
        return node, [scope.bounds[v], scope.bounds[v] + 0.1]

    def _key_scan(self, scope: _Scope) -> tuple[Spec, list[float]]:
        draw = self.draw
        impl = draw(st.sampled_from(("threefry2x32", "threefry2x32", "rbg", "unsafe_rbg")))
        length = draw(st.sampled_from(tuple(n for n in scope.flavor.scan_lengths if n > 0)))
        seed = draw(st.integers(0, 3))
        how = draw(st.sampled_from(("fold_in", "split")))
        ys_mode = "raw" if self._raw_allowed(scope) and draw(st.booleans()) else "reduce"
        v = self._operand(scope)
        node = ("key_scan", impl, length, seed, how, ys_mode, v)
        return node, [scope.bounds[v] + 1.0, 0.5 * scope.bounds[v] + 0.5]

    def _key_branch(self, scope: _Scope) -> tuple[Spec, list[float]]:
        impl = self.draw(st.sampled_from(("threefry2x32", "threefry2x32", "rbg", "unsafe_rbg")))
        seed = self.draw(st.integers(0, 3))
        raw = "raw" if self._raw_allowed(scope) and self.draw(st.booleans()) else "inner"
        v = self._operand(scope)
        return ("key_branch", impl, seed, raw, v), [scope.bounds[v] + 1.0]

    def _shared_scans(self, scope: _Scope) -> tuple[Spec, list[float]]:
        """2-3 scans of one step function (through a helper with a custom rule) on different
        operands: what batch_scans batches."""
        draw = self.draw
        length = draw(st.sampled_from(tuple(n for n in scope.flavor.scan_lengths if n > 0)))
        reverse = draw(st.booleans())
        helper = draw(st.sampled_from(_RULE_HELPER_DRAWS))
        wrap = draw(st.sampled_from(("jit", "plain", "checkpoint")))
        operands = tuple(self._operand(scope) for _ in range(draw(st.integers(2, 3))))
        node = ("shared_scans", length, reverse, helper, wrap, operands)
        return node, [1.0] * len(operands)

    def _hazard(self, scope: _Scope) -> tuple[Spec, list[float]]:
        # The failing kind weighs more: a program that never fails checks little.
        kind = self.draw(st.sampled_from((*_HAZARDS, *self.bad_hazards, *self.bad_hazards)))
        bad = "bad" if kind in self.bad_hazards else "ok"
        site = self.draw(st.integers(1, 9))
        v = self._operand(scope)
        bound = scope.bounds[v]
        out = {"index": 2.0 * bound, "log": 1.1, "div": 2.0 * bound + 1.0, "user": 1.0}[kind]
        return ("hazard", kind, bad, site, v), [out]

    def _checkpoint_loops(self, scope: _Scope) -> tuple[Spec, list[float]]:
        """`jax.checkpoint` around 2-3 independent loops, which a planner makes regions of."""
        draw = self.draw
        policy = draw(st.sampled_from(tuple(_CHECKPOINT_POLICIES)))
        prevent_cse = int(draw(st.booleans()))
        operands = self._operands(scope, 2, 3, chained=False)
        param_bounds = [scope.bounds[i] for i in operands]
        bounds, nodes = list(param_bounds), []
        for _ in range(draw(st.integers(2, 3))):
            # Each loop reads only the block's params: the loops are independent.
            inner = _Scope(list(param_bounds), len(param_bounds), scope.depth + 1, _HEAVY, False)
            node, out_bounds = (self._while if draw(st.booleans()) else self._scan)(inner)
            nodes.append(node)
            for bound in out_bounds:
                bounds.append(bound)
                if bound > _TAME:
                    nodes.append(("tanh", len(bounds) - 1))
                    bounds.append(1.0)
        outs = tuple(range(len(param_bounds), len(bounds)))
        block = ("block", len(param_bounds), tuple(nodes), outs)
        node = ("checkpoint", policy, prevent_cse, operands, (), block)
        return node, [bounds[i] for i in outs]


def _node_operands(node: Spec) -> list[int]:
    """Indices of the values in the enclosing block that a node reads."""
    kind = node[0]
    if kind in _UNARY:
        return [node[1]]
    if kind in _BINARY or kind == "matmul":
        return [node[1], node[2]]
    if kind == "reduce":
        return [node[4]]
    if kind == "scan":
        return [*node[3], *node[4], *node[5]]
    if kind == "cond":
        return [node[1], *node[2], *node[3]]
    if kind == "jit":
        return [v for s in node[1] for v in s] + list(node[2])
    if kind == "checkpoint":
        return [*node[3], *node[4]]
    if kind == "parallel":
        return [v for operands, _ in node[2] for v in operands]
    if kind == "while":
        return list(node[7])
    if kind == "counted_scan":
        return [node[6]]
    if kind == "shared_scans":
        return list(node[5])
    if kind in _FEATURE_OPERAND:
        return [node[_FEATURE_OPERAND[kind]]]
    raise ValueError(f"unknown node kind {kind!r} in spec")


_OUTPUT_KINDS = ("tuple", "single", "dict", "nested")


def _program_spec(draw: Callable[[st.SearchStrategy[Any]], Any], flavor: _Flavor,
                  *, counter_dtypes: tuple[str, ...] = (),
                  output_kinds: tuple[str, ...] = _OUTPUT_KINDS,
                  sizes: tuple[int, ...] = (8, 16), bad_hazards: bool = False) -> Spec:
    n = draw(st.sampled_from(sizes))
    n_inputs = draw(st.integers(2, 5))
    seed = draw(st.integers(0, 2**16))
    drawer = _Drawer(draw, n, counter_dtypes)
    if bad_hazards:
        drawer.bad_hazards = tuple(sorted(draw(st.sets(st.sampled_from(_HAZARDS), max_size=3))))
    block, _ = drawer.block([1.0] * n_inputs, 0, flavor, top_level=True)
    output_kind = draw(st.sampled_from(output_kinds))
    return ("program", n, n_inputs, seed, block, output_kind)


@st.composite
def program_specs(draw: Callable[[st.SearchStrategy[Any]], Any]) -> Spec:
    """Specs of random programs: DAGs, pure chains, or independent heavy chains joined."""
    flavor = draw(st.sampled_from((_DAG, _DAG, _DAG, _CHAIN)))
    return _program_spec(draw, flavor)


def programs() -> st.SearchStrategy[Program]:
    """Random programs: DAGs of elementwise ops, matmuls, reductions, scans, conds, switches,
    nested jits, checkpoints and independent heavy chains, with inputs."""
    return program_specs().map(build_program)


@st.composite
def scan_program_specs(draw: Callable[[st.SearchStrategy[Any]], Any]) -> Spec:
    """Specs of programs made mostly of scans: independent and dependent ones, mixed
    directions and lengths (often equal, as loop fusion needs), consts, nested scans and
    conds in bodies."""
    common = draw(st.integers(1, 6))
    other = draw(st.integers(1, 6))
    flavor = dataclasses.replace(_SCANS, scan_lengths=(common, common, common, other))
    return _program_spec(draw, flavor)


def scan_programs() -> st.SearchStrategy[Program]:
    """Random programs made mostly of scans (see `scan_program_specs`), with inputs."""
    return scan_program_specs().map(build_program)


@st.composite
def feature_program_specs(draw: Callable[[st.SearchStrategy[Any]], Any],
                          x64: bool = False) -> Spec:
    """Specs of programs made of what broke jaxpar before: `while` loops with
    counters of every dtype and step (literal and traced bounds, fori-shaped and not), scans
    with int and bool carries (zero-length, reversed, unrolled), custom_jvp/custom_vjp with
    nondiff args, pure/io callbacks, rbg/unsafe_rbg/threefry keys, per-member conds with a
    costly branch, bfloat16/float16/complex64/int32 casts, ops that depend on the trace
    context (x64, rank promotion), checkpoints around independent loops, and ensembles of
    members that differ only in a custom rule, callback, key or cond threshold. Outputs may
    also hold a None leaf, a literal and an input returned unchanged ("extras").

    `x64=True` adds int64 and uint64 loop counters: build and run those under
    `jax.enable_x64(True)`."""
    dtypes = _COUNTER_DTYPES_X64 if x64 else _COUNTER_DTYPES
    # Size 64 too: below that, the cost model rarely finds batching members worth it.
    return _program_spec(draw, _FEATURES, counter_dtypes=dtypes,
                         output_kinds=(*_OUTPUT_KINDS, "extras"), sizes=(8, 16, 64, 64))


def feature_programs(x64: bool = False) -> st.SearchStrategy[Program]:
    """Random feature programs (see `feature_program_specs`), with inputs."""
    return feature_program_specs(x64).map(build_program)


@st.composite
def loop_program_specs(draw: Callable[[st.SearchStrategy[Any]], Any], x64: bool = False) -> Spec:
    """Specs of programs made mostly of loops: counter `while`s of every dtype and step,
    `fori_loop`s, scans with int and bool carries, and checkpoints around independent loops.
    `x64=True` adds int64 and uint64 counters (run those under `jax.enable_x64(True)`)."""
    dtypes = _COUNTER_DTYPES_X64 if x64 else _COUNTER_DTYPES
    return _program_spec(draw, _LOOPS, counter_dtypes=dtypes)


def loop_programs(x64: bool = False) -> st.SearchStrategy[Program]:
    """Random loop programs (see `loop_program_specs`), with inputs."""
    return loop_program_specs(x64).map(build_program)


@st.composite
def rule_program_specs(draw: Callable[[st.SearchStrategy[Any]], Any]) -> Spec:
    """Specs of programs made of what broke the rewrites before: helpers with custom_vjp/custom_jvp
    rules that are nonlinear (a clipped cotangent), effectful (debug prints, debug callbacks,
    ordered ones), host-calling (`pure_callback` with and without `vmap_method`) or random (rbg
    bits), called as is, through `jax.jit` or under `jax.checkpoint`, once or twice on the same
    operand (twins); ensembles whose members hold such helpers, and scans sharing one step
    function through one; host callbacks only right for their own shape; scans with weakly typed
    (Python scalar) carries and ys, with key-typed carries and ys, and key chains, whose ys and
    keys are sometimes outputs of the program (also from the members of ensembles, so they leave
    regions). Effects are seen with `collect_effects`; outputs may hold keys."""
    common = draw(st.integers(1, 5))
    other = draw(st.integers(1, 5))
    flavor = dataclasses.replace(_RULES, scan_lengths=(common, common, other))
    return _program_spec(draw, flavor, sizes=(8, 16, 64))


def rule_programs() -> st.SearchStrategy[Program]:
    """Random rule programs (see `rule_program_specs`), with inputs."""
    return rule_program_specs().map(build_program)


@st.composite
def checkify_program_specs(draw: Callable[[st.SearchStrategy[Any]], Any]) -> Spec:
    """Specs of programs holding what `checkify` checks (see `_eval_hazard`): reads at an
    index from the data, logs, integer divisions and user checks, in ensembles, scans, conds,
    jits and checkpoints. Up to three kinds of hazard fail in a program (out-of-bounds index,
    log of negatives, division by zero, or a failed user check), failing indexes and user
    checks naming their site, so the error `checkify` reports is the first in program order
    and a rewrite that runs checks in another order reports another. User checks need
    `checkify`: run these programs only under it."""
    return _program_spec(draw, _CHECKS, sizes=(8, 16), bad_hazards=True)


def checkify_programs() -> st.SearchStrategy[Program]:
    """Random checkify programs (see `checkify_program_specs`), with inputs."""
    return checkify_program_specs().map(build_program)
