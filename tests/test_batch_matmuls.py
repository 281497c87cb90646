"""batch_matmuls: same-shaped matmuls of different, independent members run as one.

Structure is checked on the rewritten jaxprs (how many ``dot_general``s, ``concatenate``s
and batch dimensions), values and gradients against plain ``jax.jit`` of the original,
and, where the CUDA PJRT plugin is installed, kernel launches per run on the deviceless
H200 compile (two scans with different bodies at most the hand-written ``vmap``'s launches;
no program here launching more than without the pass).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from helpers.benchmarks import hetero_batch_benchmark, seed_002_small_args
from helpers.environment import needs_plugin
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from pass_checker import (
    all_eqns,
    assert_same_gradients,
    assert_same_outputs,
    check_pass,
    count_primitive,
)

import jaxpar
from jaxpar.passes import (
    SUBGRAPH_KINDS,
    DecisionKind,
    apply_passes,
    batch_matmuls,
    pass_defaults,
)

bench = hetero_batch_benchmark()

VALUE_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def _loop_passes(matmuls: bool) -> Callable[[Any], Any]:
    return partial(apply_passes, fuse_scans=True, batch_scans=True, unroll=None, target="gpu",
                   batch_branches=True, batch_matmuls=matmuls)


def _passes(fn: Callable[..., Any], *args: Any, matmuls: bool = True) -> tuple[Any, Any]:
    """The passes' output (checked by ``check_pass`` but for values, which
    ``_check_values_and_grads`` compares through ``jaxpar.parallel_branches``)."""
    result = check_pass(_loop_passes(matmuls), fn, *args, values=False, grads=False)
    return result.new, result.decisions


_count = count_primitive


def _batched_dots(jaxpr: Any) -> int:
    """dot_generals whose result has more dimensions than the matrices of these tests."""
    return sum(e.primitive.name == "dot_general" and e.outvars[0].aval.ndim > 2
               for e in all_eqns(jaxpr))


def _check_values_and_grads(fn: Callable[..., Any], *args: Any,
                            grad_tolerance: dict[str, float] = GRAD_TOLERANCE) -> None:
    """The whole pipeline keeps values and gradients (both under ``jax.jit``)."""
    rewritten = jaxpar.parallel_branches(fn, target="gpu")
    assert_same_outputs(rewritten, fn, args, tolerance=VALUE_TOLERANCE, jit=True)
    assert_same_gradients(rewritten, fn, args, tolerance=grad_tolerance, jit=True)


SEED_SMALL = seed_002_small_args()


# ------------------------------------------------------ two scans with different bodies


def test_two_scans_with_different_bodies_run_batched_matmuls_in_one_loop() -> None:
    before, _ = _passes(bench.seed_002, *SEED_SMALL, matmuls=False)
    after, decisions = _passes(bench.seed_002, *SEED_SMALL)
    assert _count(before, "scan") == _count(after, "scan") == 1
    assert _count(before, "dot_general") == 8
    assert _count(after, "dot_general") == 4
    assert _batched_dots(after) == 4
    batched = [d for d in decisions if d.kind == DecisionKind.BATCHED_MATMULS]
    assert len(batched) == 4
    assert all(d.location.startswith("/scan#0") for d in batched)
    # Which members: the sources name both step functions.
    assert all({"seed_body", "seed_other_body"} <= {s.split("(")[-1].rstrip(")")
                                                    for s in d.sources} for d in batched)
    _check_values_and_grads(bench.seed_002, *SEED_SMALL)


def test_chain_stays_stacked_between_batched_matmuls() -> None:
    after, decisions = _passes(bench.seed_002, *SEED_SMALL)
    # Two distinct operand columns are stacked ([X1, tanh X2] and [X1, X2]); each later
    # matmul reads the previous one's stacked result: no unstack and restack.
    assert _count(after, "concatenate") + _count(after, "stack") == 2
    reasons = [d.reason for d in decisions if d.kind == DecisionKind.BATCHED_MATMULS]
    assert sum("1 already-stacked" in r for r in reasons) == 3


def test_inspect_reports_each_batched_group() -> None:
    plan = jaxpar.inspect(bench.seed_002, target="gpu")(*SEED_SMALL)
    text = plan.text(verbose=True)
    assert text.count("batched matmuls in scan body [") == 4
    assert "2 kernel launches -> 1" in text
    assert str(plan).count("batched matmuls in scan body: ") == 4
    assert [d.kind for d in plan.decisions if d.kind in SUBGRAPH_KINDS] == \
        [DecisionKind.BATCHED_MATMULS] * 4
    assert [d["kind"] for d in plan.to_dict()["decisions"]
            if d["kind"] in SUBGRAPH_KINDS] == [DecisionKind.BATCHED_MATMULS] * 4
    assert "batched matmuls: dot_general, dot_general" in plan.to_svg()


@pytest.mark.parametrize("name", ["rnn_pair", "transposed_pair", "crossed_pair",
                                  "crossed_cells"])
def test_own_pairs_values_and_grads(name: str) -> None:
    args = bench.program_args(name, "smoke")
    after, decisions = _passes(bench.PROGRAMS[name][0], *args)
    assert any(d.kind == DecisionKind.BATCHED_MATMULS for d in decisions)
    assert _batched_dots(after) >= 1
    _check_values_and_grads(bench.PROGRAMS[name][0], *args)


@pytest.mark.parametrize("name", ["hetero_ensemble", "experts", "multi_head"])
def test_straight_line_members_values_and_grads(name: str) -> None:
    args = bench.program_args(name, "smoke")
    _check_values_and_grads(bench.PROGRAMS[name][0], *args)


def test_hetero_ensemble_matmuls_batched() -> None:
    args = bench.program_args("hetero_ensemble", "smoke")
    before, _ = _passes(bench.hetero_ensemble, *args, matmuls=False)
    after, decisions = _passes(bench.hetero_ensemble, *args)
    # Layers 2 and 3 of the four members: one batched matmul each (the first layer shares
    # x, which XLA's DotMerger merges, or batch_branches batches as identical subgraphs).
    batched = [d for d in decisions if d.kind == DecisionKind.BATCHED_MATMULS]
    assert len(batched) == 2
    assert all(len(d.eqns) == 4 for d in batched)
    assert _count(after, "dot_general") == _count(before, "dot_general") - 2 * 3


# --------------------------------------------------------------------------- rules


def _square(seed: int, count: int, n: int = 6) -> list[jax.Array]:
    keys = jax.random.split(jax.random.PRNGKey(seed), count)
    return [jax.random.normal(k, (n, n)) / n for k in keys]


def test_swapped_operand_order_is_matched() -> None:
    def f(p: Any, q: Any, x: Any, y: Any) -> Any:
        h = jnp.sin(p)[:3]  # [3, n]
        g = jnp.cos(q)[:3]
        a = jnp.tanh(h @ x) @ x  # h @ x
        b = jnp.einsum("ij,bi->jb", y, g)  # (g @ y).T: the same form, operands swapped
        c = jax.nn.relu(b).T @ y
        # Reduced, not returned apart: a matmul's elementwise tail returned apart costs a
        # kernel of its own once batched (test_tails_returned_apart_are_left_alone).
        return jnp.tanh(a).sum(0), jnp.tanh(c).sum(0)

    args = _square(1, 4)
    after, decisions = _passes(f, *args)
    swapped = [d for d in decisions if d.kind == DecisionKind.BATCHED_MATMULS
               and "operands swapped" in d.reason]
    assert len(swapped) == 1
    assert _batched_dots(after) == 2
    _check_values_and_grads(f, *args)


def test_crossed_operand_order_stays_stacked() -> None:
    """``h @ x`` beside ``y @ h``: one member reads its operands transposed throughout,
    so the chain stays stacked and the ``x`` column is stacked once."""
    def f(a: Any, b: Any, x: Any, y: Any) -> Any:
        # Elementwise readers: the slices fuse into them; reduced, since tails returned
        # apart cost a kernel each (test_tails_returned_apart_are_left_alone).
        return (jnp.tanh((jnp.tanh(a) @ x) @ x).sum(0),
                jnp.tanh(y @ (y @ jnp.sin(b))).sum(0))

    args = _square(5, 4)
    after, decisions = _passes(f, *args)
    batched = [d for d in decisions if d.kind == DecisionKind.BATCHED_MATMULS]
    assert len(batched) == 2
    assert "1 already-stacked" in batched[1].reason
    assert all("2 operands read transposed" in d.reason for d in batched)
    assert _count(after, "concatenate") + _count(after, "stack") == 2
    assert _batched_dots(after) == 2
    _check_values_and_grads(f, *args)


def test_level_inputs_only_left_alone_by_cost() -> None:
    """Stacking operands nothing else computes is a kernel of its own: no launch saved."""
    def f(a: Any, b: Any, c: Any, d: Any) -> Any:
        return jnp.tanh(a @ b), jnp.sin(c @ d)

    result = check_pass(batch_matmuls, f, *_square(2, 4), values=False, grads=False,
                        counts={"dot_general": 2})
    new, decisions = result.new, result.decisions
    assert _batched_dots(new) == 0
    (left,) = [d for d in decisions if d.kind == DecisionKind.MATMULS_LEFT_ALONE]
    assert left.reason.startswith("batching would save 1 kernel launch but add at least as much")
    # The cost model's numbers, also as fields: the group does not pay.
    assert left.saving_us is not None and left.saving_us <= 0
    assert "cost model: saves" in left.reason and left.depth == 1
    assert left.members == tuple((i,) for i in left.eqns)


def _leaving(a: Any, b: Any, c: Any, d: Any) -> Any:
    return jnp.sin(a) @ b, jnp.cos(jnp.sin(c) @ d) @ b


def test_results_sliced_out_for_the_outputs_cost_a_kernel() -> None:
    """Two depth-1 matmuls whose results leave the level: slicing them out of the batched
    result is a kernel, as many as batching saves, so they are left alone."""
    result = check_pass(batch_matmuls, _leaving, *_square(4, 4), unchanged=True,
                        kinds=[DecisionKind.MATMULS_LEFT_ALONE])
    (left,) = result.decisions
    assert left.reason.startswith("batching would save 1 kernel launch but add at least as "
                                  "much in stacking and slicing kernels")
    assert left.saving_us is not None and left.saving_us <= 0


def _crossed_leaving(a: Any, b: Any, x: Any, y: Any) -> Any:
    return (jnp.tanh(a) @ x) @ x, y @ (y @ jnp.sin(b))


def _swapped_leaving(p: Any, q: Any, x: Any, y: Any) -> Any:
    h, g = jnp.sin(p)[:3], jnp.cos(q)[:3]
    return jnp.tanh(h @ x) @ x, jax.nn.relu(jnp.einsum("ij,bi->jb", y, g)).T @ y


@needs_plugin
@pytest.mark.parametrize(("fn", "most"), [(_crossed_leaving, 4), (_swapped_leaving, 5)])
def test_chains_whose_results_leave_launch_no_more(fn: Any, most: int) -> None:
    # Batched with slicing priced at 0 us these launched 6 (plain 4) and 7 (plain 6).
    # In XLA's default lhs mode batching saves launches; the chosen mode (concurrent here:
    # the members already overlap as graph nodes, so batching is left alone) never
    # launches more than plain either.
    args = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * 4
    plain = bench.count(fn, args)
    in_lhs = bench.count(jaxpar.parallel_branches(fn, target="gpu", command_buffers="lhs"), args)
    assert in_lhs["launches"] <= min(most, plain["launches"])
    chosen = bench.count(jaxpar.parallel_branches(fn, target="gpu"), args)
    assert chosen["launches"] <= plain["launches"]


@needs_plugin
def test_results_sliced_out_for_the_outputs_launch_no_more() -> None:
    # Batched, this launched 6 kernels against plain's 5 (the two slices for the outputs).
    args = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * 4
    plain = bench.count(_leaving, args)
    counted = bench.count(jaxpar.parallel_branches(_leaving, target="gpu"), args)
    assert counted["launches"] <= plain["launches"]


def test_matmuls_sharing_an_operand_are_left_to_xla() -> None:
    def f(x: Any, w1: Any, w2: Any) -> Any:
        h = jnp.sin(x)
        return jnp.tanh(h @ w1), jax.nn.relu(h @ w2)

    check_pass(batch_matmuls, f, *_square(3, 3), unchanged=True, kinds=[])


def test_different_stages_are_not_batched_together() -> None:
    def f(a: Any, b: Any, c: Any, d: Any) -> Any:
        first = jnp.tanh(jnp.sin(a) @ b).sum(0)  # launch depth 1; elementwise work reads its slice
        second = jnp.cos(jnp.sin(c) @ d) @ b  # launch depths 1 and 2
        return first, second

    result = check_pass(batch_matmuls, f, *_square(4, 4), values=False, grads=False,
                        counts={"dot_general": 2})
    new, decisions = result.new, result.decisions
    # Only the two depth-1 matmuls batch; the depth-2 one stays alone.
    (batched,) = [d for d in decisions if d.kind == DecisionKind.BATCHED_MATMULS]
    assert "at launch depth 1" in batched.reason
    assert _batched_dots(new) == 1


def test_convolutions_of_different_members_batch() -> None:
    def conv(x: Any, w: Any) -> Any:
        return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def f(x: Any, w1: Any, w2: Any) -> Any:
        return jax.nn.relu(conv(jnp.sin(x), w1)), jnp.tanh(conv(jnp.cos(x), w2))

    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    args = (jax.random.normal(keys[0], (2, 5, 5, 3)), jax.random.normal(keys[1], (3, 3, 3, 4)),
            jax.random.normal(keys[2], (3, 3, 3, 4)))
    check_pass(batch_matmuls, f, *args, values=False, grads=False,
               counts={"conv_general_dilated": 1},
               expect=lambda r: [d.primitives for d in r.decisions]
               == [("conv_general_dilated",) * 2])
    _check_values_and_grads(f, *args)


def test_backward_pass_matmuls_batched() -> None:
    """grad of the rewritten function batches the backward matmuls (vmap's transpose)."""
    def loss(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
        r1, r2 = bench.seed_002(a, b, xs1, xs2)
        return jnp.sum(jnp.sin(r1)) + jnp.sum(jnp.cos(r2))

    every = (0, 1, 2, 3)  # the matmuls read xs: their gradients need the backward matmuls
    grad_of_rewritten = jax.make_jaxpr(jax.grad(jaxpar.parallel_branches(loss, target="gpu"),
                                                every))(*SEED_SMALL)
    plain = jax.make_jaxpr(jax.grad(loss, every))(*SEED_SMALL)
    assert _batched_dots(plain) == 0
    dots = _count(grad_of_rewritten, "dot_general")
    assert dots > 4 and _batched_dots(grad_of_rewritten) == dots  # backward batched too
    rewritten_grad = jaxpar.parallel_branches(jax.grad(loss, every), target="gpu")
    result = check_pass(partial(apply_passes, **pass_defaults("gpu"), target="gpu"),
                        jax.grad(loss, every), *SEED_SMALL, values=False, grads=False)
    # Rewriting the gradient function leaves its matmuls unbatched: their results leave
    # the fused loop's body or feed other matmuls, and slicing them out costs what
    # batching saves (deviceless H200: 264 launches plain, 123 rewritten; 117 when these
    # were batched at a stacking and slicing price of 0 us).
    assert _count(result.new, "dot_general") <= _count(result.closed, "dot_general")
    assert_same_outputs(rewritten_grad, jax.grad(loss, every), SEED_SMALL, jit=True,
                        tolerance={"rtol": 1e-4, "atol": 1e-5})


def test_applying_twice_changes_nothing() -> None:
    # check_pass applies the passes to their output: the same object, no further rewrite.
    repeat = check_pass(_loop_passes(True), bench.seed_002, *SEED_SMALL, values=False,
                        grads=False).repeat_decisions
    assert not [d for d in repeat if d.kind == DecisionKind.BATCHED_MATMULS]


def test_defaults_and_option() -> None:
    assert pass_defaults("gpu")["batch_matmuls"] is True
    assert pass_defaults("cpu")["batch_matmuls"] is False
    assert pass_defaults("tpu")["batch_matmuls"] is False
    with pytest.raises(ValueError, match="batch_matmuls"):
        jaxpar.parallel_branches(bench.seed_002, batch_matmuls="yes")  # type: ignore[arg-type]
    off = jaxpar.inspect(bench.seed_002, target="gpu", batch_matmuls=False)(*SEED_SMALL)
    assert not [d for d in off.decisions if d.kind == DecisionKind.BATCHED_MATMULS]
    cpu = jaxpar.inspect(bench.seed_002, target="cpu")(*SEED_SMALL)
    assert not [d for d in cpu.decisions if d.kind in SUBGRAPH_KINDS]


# --------------------------------------------------------------------------- properties

_ACTS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "tanh": jnp.tanh, "sin": jnp.sin, "relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid,
    "scale": lambda v: 0.5 * v, "none": lambda v: v}


@st.composite
def body_specs(draw: st.DrawFn) -> tuple[tuple[str, str], ...]:
    """A step body: matmuls of the carry with the step's x, each ``cx`` (carry @ x) or
    ``xc`` (x @ carry), each followed by an activation."""
    return tuple(draw(st.lists(st.tuples(st.sampled_from(["cx", "xc"]),
                                         st.sampled_from(sorted(_ACTS))),
                               min_size=1, max_size=4)))


def _body(spec: tuple[tuple[str, str], ...]) -> Callable[..., Any]:
    def step(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        h = c
        for order, act in spec:
            h = _ACTS[act](h @ x if order == "cx" else x @ h)
        return 0.5 * c + jnp.tanh(h), None
    return step


def _pair(spec_a: Any, spec_b: Any, scans: bool) -> Callable[..., Any]:
    step_a, step_b = _body(spec_a), _body(spec_b)

    def scanned(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
        return lax.scan(step_a, a, xs1)[0], lax.scan(step_b, b, xs2)[0]

    def straight(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
        return step_a(a, xs1[0])[0], step_b(jnp.sin(b), xs2[1])[0]

    return scanned if scans else straight


@settings(max_examples=10)  # each example compiles four programs
@given(body_specs(), body_specs(), st.booleans())
def test_random_pairs_of_bodies_keep_values_and_grads(spec_a: Any, spec_b: Any,
                                                      scans: bool) -> None:
    fn = _pair(spec_a, spec_b, scans)
    args = bench.seed_args(4, 3)
    before, _ = _passes(fn, *args, matmuls=False)
    after, decisions = _passes(fn, *args)
    batched = [d for d in decisions if d.kind == DecisionKind.BATCHED_MATMULS]
    assert _count(after, "dot_general") == _count(before, "dot_general") - len(batched)
    for d in batched:
        assert d.primitives == ("dot_general", "dot_general")
    _check_values_and_grads(fn, *args)


# --------------------------------------------------------------------------- deviceless


def _launches_and_temps(fn: Any, args: Any) -> tuple[dict[str, Any], int]:
    """``bench.count`` of ``fn``'s deviceless H200 compile, and its temporary bytes."""
    counted = bench.count(fn, args)
    return counted, counted["temp_bytes"]


def _within_the_budget(fn: Any, args: Any, plain_temp: int, temp: int,
                       **options: Any) -> None:
    """The compile's temporaries are plain jit's plus at most what jaxpar's memory budget
    allows for ``fn`` (``plan.memory.allowed_bytes``: unrolled by the GPU model's fastest
    factor, a few MiB more; a stacked copy of the scanned inputs would be hundreds)."""
    plan = jaxpar.inspect(fn, target="gpu", **options)(*args)
    assert plan.memory is not None
    assert temp <= plain_temp + plan.memory.allowed_bytes, (plain_temp, temp)


@needs_plugin
@pytest.mark.parametrize("name", ["seed_002", "seed_002_identical"])
def test_two_scans_launch_at_most_100_000_within_the_memory_budget(name: str) -> None:
    """The seed's two scans (100 x 100 matrices, 10,000 steps), bodies different and
    identical: at most 100,000 launches a run, at most the hand-vmapped program's, and
    no more temporary memory than plain jit's beyond the budget (no stacked copy of the
    scanned inputs: 763 MiB once)."""
    fn = getattr(bench, name)
    args = jax.eval_shape(lambda: bench.program_args(name, "full"))
    plain, plain_temp = _launches_and_temps(fn, args)
    counted, temp = _launches_and_temps(jaxpar.parallel_branches(fn, target="gpu"), args)
    assert counted["loops"] == 1
    assert counted["launches"] <= 100_000 < plain["launches"]
    hand = bench.count(bench.seed_002_hand_vmap, args)
    assert counted["launches"] <= hand["launches"]
    _within_the_budget(fn, args, plain_temp, temp)


@needs_plugin
@pytest.mark.parametrize("size", ["quick", "full"])
def test_crossed_pair_launches_at_most_six_tenths_of_plain(size: str) -> None:
    args = jax.eval_shape(lambda: bench.program_args("crossed_pair", size))
    plain, plain_temp = _launches_and_temps(bench.crossed_pair, args)
    counted, temp = _launches_and_temps(
        jaxpar.parallel_branches(bench.crossed_pair, target="gpu"), args)
    assert counted["launches"] <= 0.6 * plain["launches"]
    _within_the_budget(bench.crossed_pair, args, plain_temp, temp)


@needs_plugin
def test_readme_two_scans_fewer_launches_at_plain_memory() -> None:
    """The README's ``two_scans`` at 256 x 256 (100 steps): fewer launches than plain jit,
    and temporaries within the budget (1.31 MB plain against 3.15 MB once)."""
    args = jax.eval_shape(lambda: bench.program_args("readme_two_scans", "full"))
    plain, plain_temp = _launches_and_temps(bench.readme_two_scans, args)
    counted, temp = _launches_and_temps(
        jaxpar.parallel_branches(bench.readme_two_scans, target="gpu"), args)
    assert counted["launches"] < plain["launches"]
    assert temp <= plain_temp + max(0.1 * plain_temp, 2**20), (plain_temp, temp)


@needs_plugin
@pytest.mark.parametrize("name", ["crossed_cells", "rnn_pair"])
def test_reading_a_scanned_input_transposed_is_left_alone(name: str) -> None:
    """Batching ``h @ x`` beside ``x @ h`` reads one member's slice of the scanned input
    transposed; XLA moves that transpose out of the loop, over the whole input (0.3 MiB
    plain, 38 MiB batched, once compiled): such groups are left alone, within the memory
    budget, and the scans still fuse."""
    fn = getattr(bench, name)
    args = jax.eval_shape(lambda: bench.program_args(name, "quick"))
    plain, plain_temp = _launches_and_temps(fn, args)
    # The scans fused by name: unasked, jaxpar keeps them apart where its model rates the
    # join slower (each unrolled on its own), and there is then nothing to batch.
    fused = {"target": "gpu", "fuse_scans": True}
    counted, temp = _launches_and_temps(jaxpar.parallel_branches(fn, **fused), args)
    assert counted["loops"] == 1 and counted["launches"] <= 0.85 * plain["launches"]
    _within_the_budget(fn, args, plain_temp, temp, fuse_scans=True)
    plan = jaxpar.inspect(fn, **fused)(*args)
    assert "fused" in {str(d.kind) for d in plan.decisions}
    assert DecisionKind.BATCHED_MATMULS not in {d.kind for d in plan.decisions}
    anything = jaxpar.inspect(fn, **fused, memory="any")(*args)
    assert DecisionKind.BATCHED_MATMULS in {d.kind for d in anything.decisions}


_GUARD_PAIRS = [
    ((("cx", "tanh"), ("cx", "none")), (("xc", "relu"),)),
    ((("xc", "sin"), ("cx", "sigmoid")), (("cx", "scale"), ("xc", "tanh"), ("cx", "none"))),
    ((("cx", "none"),), (("cx", "none"),)),
]


@needs_plugin
@pytest.mark.parametrize("name", [n for n in bench.PROGRAMS if n != "seed_002_hand_vmap"])
def test_no_program_launches_more_with_the_pass(name: str) -> None:
    args = jax.eval_shape(lambda: bench.program_args(name, "quick"))
    fn = bench.PROGRAMS[name][0]
    before = bench.count(jaxpar.parallel_branches(fn, target="gpu", batch_matmuls=False), args)
    after = bench.count(jaxpar.parallel_branches(fn, target="gpu"), args)
    assert after["launches"] <= before["launches"]


@needs_plugin
@pytest.mark.parametrize("pair", range(len(_GUARD_PAIRS)))
@pytest.mark.parametrize("scans", [True, False])
def test_random_style_pairs_launch_no_more(pair: int, scans: bool) -> None:
    fn = _pair(*_GUARD_PAIRS[pair], scans)
    args = jax.eval_shape(lambda: bench.seed_args(100, 1000))
    before = bench.count(jaxpar.parallel_branches(fn, target="gpu", batch_matmuls=False), args)
    after = bench.count(jaxpar.parallel_branches(fn, target="gpu"), args)
    assert after["launches"] <= before["launches"]


def _deep_towers(ws: Any, xs: Any) -> Any:
    """Three towers of four matmuls, their own activations; the last matmul of each at
    the highest precision."""
    outs = []
    for w, x, act in zip(ws, xs, (jnp.tanh, jnp.sin, jax.nn.relu), strict=True):
        for stage in range(4):
            precision = lax.Precision.HIGHEST if stage == 3 else None
            x = act(jnp.matmul(x, w[stage], precision=precision))
        outs.append(x.sum(0))  # reduced: tails returned apart would not batch
    return outs


def test_equal_units_are_traced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewrites of one form and layout share a trace (``Rewrite.key``); the one whose
    parameters differ (its precision) is traced on its own, and keeps them."""
    from jaxpar.passes import _splice

    keys = iter(jax.random.split(jax.random.PRNGKey(3), 15))
    ws = [[jax.random.normal(next(keys), (64, 64)) / 8 for _ in range(4)] for _ in range(3)]
    xs = [jax.random.normal(next(keys), (16, 64)) for _ in range(3)]
    traced = []
    trace = _splice._trace_rewrite

    def counting(rewrite: Any, operands: Any) -> Any:
        traced.append(rewrite.emit.__module__)
        return trace(rewrite, operands)

    monkeypatch.setattr(_splice, "_trace_rewrite", counting)
    plan = jaxpar.inspect(_deep_towers, target="gpu", command_buffers="lhs")(ws, xs)
    assert [d.kind for d in plan.decisions].count(DecisionKind.BATCHED_MATMULS) == 4
    assert traced.count("jaxpar.passes._matmul_emission") == 2  # batch_matmuls' emitters
    text = jax.jit(jaxpar.parallel_branches(_deep_towers, target="gpu", command_buffers="lhs")
                   ).lower(ws, xs).as_text()
    batched = [line for line in text.splitlines()
               if "dot_general" in line and "batching_dims" in line]
    assert len(batched) == 4
    assert sum("HIGHEST" in line for line in batched) == 1
    _check_values_and_grads(_deep_towers, ws, xs)


@pytest.mark.parametrize("program", ["deep_towers", "crossed_cells"])
def test_copied_units_carry_the_source_info_of_their_own_trace(
        monkeypatch: pytest.MonkeyPatch, program: str) -> None:
    """A unit traced once and copied gives each copy the tracebacks and name stacks a
    trace of its own gives it: the debug locations of the lowered program equal those
    of a run whose rewrites carry no key (every unit traced alone)."""
    import importlib

    from jaxpar.passes import _protocol, _splice

    passes = [importlib.import_module(f"jaxpar.passes.{name}")
              for name in ("batch_matmuls", "batch_branches")]
    if program == "deep_towers":
        keys = iter(jax.random.split(jax.random.PRNGKey(3), 15))
        fn: Any = _deep_towers
        args: Any = ([[jax.random.normal(next(keys), (64, 64)) / 8 for _ in range(4)]
                      for _ in range(3)], [jax.random.normal(next(keys), (16, 64))
                                           for _ in range(3)])
    else:
        fn, args = bench.crossed_cells, jax.eval_shape(
            lambda: bench.program_args("crossed_cells", "quick"))
    traced: list[list[int]] = []
    trace = _splice._trace_rewrite
    monkeypatch.setattr(_splice, "_trace_rewrite",
                        lambda *a: traced[-1].append(1) or trace(*a))

    def lowered(keyed: bool) -> str:
        traced.append([])
        with monkeypatch.context() as patch:
            if not keyed:
                for module in passes:
                    patch.setattr(module, "Rewrite",
                                  lambda eqns, emit, key=None: _protocol.Rewrite(eqns, emit))
            # (memory="any": crossed_cells' groups read a scanned input transposed, which
            # the default memory budget leaves alone; the copies are what is checked.)
            # (fuse_scans by name: crossed_cells' scans are otherwise kept apart.)
            decorated = jaxpar.parallel_branches(fn, target="gpu", command_buffers="lhs",
                                                 memory="any", fuse_scans=True)
            decorated.clear_cache()  # the first lowering's plan, shared with it, is traced anew
            return jax.jit(decorated).lower(*args).as_text(debug_info=True)

    # One line, so the two lowerings' call sites (in their locations) are the same.
    keyed, alone = [lowered(keyed) for keyed in (True, False)]
    assert len(traced[0]) < len(traced[1])  # copies were made
    assert "vmap()" in keyed and keyed == alone


# --------------------------------------------------------------------------- modes


def _towers(ws: Any, xs: Any, head: jax.Array) -> jax.Array:
    """Three towers of two matmuls, their own weights, inputs and activations, joined by a
    head."""
    acts = (jnp.tanh, jnp.sin, jax.nn.relu)
    z = jnp.concatenate([act(act(x @ a) @ b)
                         for (a, b), x, act in zip(ws, xs, acts, strict=True)], -1)
    return z @ head


def _towers_args() -> tuple[Any, ...]:
    keys = iter(jax.random.split(jax.random.PRNGKey(7), 10))
    ws = [(jax.random.normal(next(keys), (64, 128)) / 8,
           jax.random.normal(next(keys), (128, 64)) / 8) for _ in range(3)]
    xs = [jax.random.normal(next(keys), (16, 64)) for _ in range(3)]
    return ws, xs, jax.random.normal(next(keys), (192, 10))


def test_launches_are_priced_in_the_functions_mode() -> None:
    from jaxpar._model.cost import launch_prices
    from jaxpar._model.gpu import CommandBufferMode
    from jaxpar.targets import device_profile

    profile = device_profile("gpu")
    gpu = profile.gpu
    assert gpu is not None
    # Off the GPU, and with graphs off: the device's floor for a kernel launched alone;
    # in a chain graph, the graph's floor for a dependent kernel.
    for mode, floor in ((None, profile.min_kernel_seconds),
                        (CommandBufferMode.OFF, gpu.kernel_floor_s),
                        (CommandBufferMode.LHS, gpu.graph_floor_s)):
        prices = launch_prices(profile, mode, 100)
        assert (prices.beside, prices.serial) == (floor, floor)
    assert gpu.graph_floor_s < gpu.kernel_floor_s
    floor = gpu.graph_floor_s
    for mode in (CommandBufferMode.CONCURRENT, CommandBufferMode.CONCURRENT_REGIONS):
        branching = launch_prices(profile, mode, 100)
        assert branching.beside == gpu.dag_node_s
        assert branching.serial == floor + gpu.dag_node_s
        # A dot or a convolution fills the GPU: it never runs beside its group's others.
        heavy = launch_prices(profile, mode, 100, serial_kernels=True)
        assert heavy.beside == heavy.serial == floor + gpu.dag_node_s
        # Too few kernels for a graph: launched one by one, in series.
        few = launch_prices(profile, mode, 4)
        assert (few.beside, few.serial) == (floor, floor)
    # The ends of the GPU model's ranges: a launch is worth less at the low end.
    low, high = (launch_prices(profile, CommandBufferMode.LHS, 100, end) for end in ("low", "high"))
    assert (low.serial, high.serial) == gpu.span("graph_floor_s")
    assert low.serial < floor < high.serial


def test_towers_are_batched_in_every_mode() -> None:
    # Dots fill the GPU: none runs beside another in any mode (XLA's own
    # CONCURRENT_REGIONS rule, and no public evidence that overlapping them pays), so a
    # concurrent graph does not make the matmuls' saved launches worth less, and they are
    # batched there as in a serial chain.
    args = _towers_args()
    kinds = {}
    for mode in ("lhs", "concurrent", "concurrent_regions"):
        plan = jaxpar.inspect(_towers, target="gpu", command_buffers=mode)(*args)
        kinds[mode] = [d.kind for d in plan.decisions if d.kind in SUBGRAPH_KINDS]
    assert kinds["lhs"].count(DecisionKind.BATCHED_MATMULS) == 2
    assert kinds["concurrent"] == kinds["concurrent_regions"] == kinds["lhs"]
    auto = jaxpar.inspect(_towers, target="gpu")(*args)
    assert [d.kind for d in auto.decisions if d.kind in SUBGRAPH_KINDS] == kinds["lhs"]
    # The towers' weight gradients reach 30 and the plain program's own float32 error
    # against float64 is up to 1.2e-4 there; jax 0.12's CPU dots put one element of the
    # batched program 1.4e-5 from the plain one's, so the absolute bound is 5e-5.
    _check_values_and_grads(_towers, *args, grad_tolerance={"rtol": 1e-4, "atol": 5e-5})


def _members_apart(xs: Any, ws: Any) -> Any:
    return [jnp.tanh(x @ w) for x, w in zip(xs, ws, strict=True)]


def _members_summed(xs: Any, ws: Any) -> Any:
    return sum(jnp.tanh(x @ w) for x, w in zip(xs, ws, strict=True))


def _members_args(count: int) -> tuple[list[Any], list[Any]]:
    return ([jax.ShapeDtypeStruct((8, 16), jnp.float32)] * count,
            [jax.ShapeDtypeStruct((16, 16), jnp.float32)] * count)


def test_tails_returned_apart_are_left_alone() -> None:
    """Unbatched, XLA:GPU fuses ``tanh`` into each member's matmul (a Triton GEMM's
    epilogue); batched, each member's ``tanh`` of its slice is a kernel of its own, so
    ten members returned apart save nothing. Summed, the tails are one kernel for all."""
    apart, apart_decisions = _passes(_members_apart, *jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), _members_args(10)))
    assert _batched_dots(apart) == 0
    (left,) = [d for d in apart_decisions if d.kind == DecisionKind.MATMULS_LEFT_ALONE]
    assert "saves" in left.reason
    summed, _ = _passes(_members_summed, *jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), _members_args(10)))
    assert _batched_dots(summed) == 1


@needs_plugin
def test_tails_returned_apart_launch_no_more_than_plain() -> None:
    """Deviceless H200: the members returned apart launch no more kernels than plain
    (batched, they launched 13 against 10); summed, far fewer."""
    args = _members_args(10)
    for fn, most in ((_members_apart, 1.0), (_members_summed, 0.5)):
        plain, _ = _launches_and_temps(fn, args)
        counted, _ = _launches_and_temps(jaxpar.parallel_branches(fn, target="gpu"), args)
        assert counted["launches"] <= most * plain["launches"], (fn.__name__, counted, plain)
