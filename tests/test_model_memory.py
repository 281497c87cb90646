"""The memory model (``jaxpar/_model/memory.py``): temporary bytes of a jaxpr by CUDA-graph mode.

On hand-built programs whose buffers can be counted by hand: what is a buffer (a dot's
result, elementwise work a dot reads, a broadcast a loop holds) and what is not
(elementwise work fused into its reader, views, the program's inputs and outputs), when
it dies, what a loop needs while it runs, unrolled copies, uneven unroll factors, stream
sections and the branching modes' bound. Then against XLA itself: deviceless H200
compiles' ``memory_analysis()`` for programs where jaxpar's rewrites raise memory, and
the branching bound against the compile in ``concurrent`` mode.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from helpers.environment import needs_plugin
from jax import lax

from jaxpar._analysis import Analysis
from jaxpar._model.gpu import CommandBufferMode
from jaxpar._model.memory import MemoryModel, format_bytes, stacking_refusal
from jaxpar._options import Options

LHS, CONCURRENT = CommandBufferMode.LHS, CommandBufferMode.CONCURRENT
REGIONS = CommandBufferMode.CONCURRENT_REGIONS
F32 = jnp.float32
MATRIX = 64 * 64 * 4  # bytes of one float32[64, 64]


def _model() -> MemoryModel:
    return MemoryModel(Analysis(Options.create(target="gpu").resolve("gpu")).costs)


def _bytes(fn: Any, *shapes: tuple[int, ...], mode: CommandBufferMode = LHS,
           sections: Any = ()) -> float:
    closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(s, F32) for s in shapes])
    return _model().temp_bytes(closed, mode, sections)


def test_a_chain_of_dots_keeps_two_buffers_at_a_time() -> None:
    def chain(x: jax.Array) -> jax.Array:
        for _ in range(6):
            x = x @ x
        return x

    # Each dot reads the one before and writes a new buffer; the last is the output.
    assert _bytes(chain, (64, 64)) == 2 * MATRIX
    # In concurrent mode nothing is packed: every intermediate buffer at once.
    assert _bytes(chain, (64, 64), mode=CONCURRENT) == 5 * MATRIX
    # In concurrent_regions mode dots run and are packed one after another.
    assert _bytes(chain, (64, 64), mode=REGIONS) == 2 * MATRIX


def test_concurrent_regions_may_keep_small_kernels_buffers_apart() -> None:
    def reductions(x: jax.Array) -> jax.Array:
        a = jnp.cumsum(x, axis=0) @ x  # a small kernel, then a dot
        b = jnp.cumsum(x, axis=1) @ x
        return a + b

    sequential = _bytes(reductions, (64, 64))
    regions = _bytes(reductions, (64, 64), mode=REGIONS)
    # Both cumulative sums' buffers may live beside everything else.
    assert regions == sequential + 2 * MATRIX


def test_elementwise_work_fuses_into_its_reader() -> None:
    def fused(x: jax.Array) -> jax.Array:
        return jnp.tanh(jnp.sin(x) * 2.0 + 1.0).sum()

    def read_by_a_dot(x: jax.Array) -> jax.Array:
        return (jnp.tanh(x) @ x).sum()

    # Elementwise work read by a reduction fuses into it: no buffer beyond the inputs.
    assert _bytes(fused, (64, 64)) == 0
    # A dot reads its operand from memory: the tanh is written, then the dot's result.
    assert _bytes(read_by_a_dot, (64, 64)) == 2 * MATRIX


def test_views_and_the_programs_inputs_and_outputs_are_not_temporaries() -> None:
    def views(x: jax.Array) -> jax.Array:
        return x.reshape(16, 256).T.reshape(64, 64) @ x

    # The reshapes and transpose are views or fuse into the dot's operand.
    assert _bytes(views, (64, 64)) == MATRIX
    assert _bytes(lambda x: x @ x, (64, 64)) == 0  # the result is the output


def test_a_scan_needs_its_body_and_a_copy_of_its_carry_while_it_runs() -> None:
    def scan(c: jax.Array, xs: jax.Array) -> jax.Array:
        return lax.scan(lambda c, x: (jnp.tanh(c @ x) @ x, None), c, xs)[0]

    # Body: the first dot's result and its tanh, which the second dot reads (the second
    # dot's result is the body's output); the slice of xs a dot reads; the carry's copy.
    assert _bytes(scan, (64, 64), (10, 64, 64)) == 4 * MATRIX


def test_unrolled_copies_may_each_keep_their_buffers() -> None:
    def scan(c: jax.Array, xs: jax.Array, unroll: int = 1) -> jax.Array:
        return lax.scan(lambda c, x: (jnp.tanh(c @ x) @ x, None), c, xs, unroll=unroll)[0]

    once = _bytes(scan, (64, 64), (10, 64, 64))
    twice = _bytes(lambda c, xs: scan(c, xs, 2), (64, 64), (10, 64, 64))
    five = _bytes(lambda c, xs: scan(c, xs, 5), (64, 64), (10, 64, 64))
    # Each extra copy: every buffer of its body (the dot's result and its tanh), its
    # carry and its slice of the input, and one slice more in the trip's block of inputs.
    assert twice - once == 5 * MATRIX and five - once == 4 * 5 * MATRIX
    # An unroll factor that does not divide the length copies the scanned inputs.
    uneven = _bytes(lambda c, xs: scan(c, xs, 3), (64, 64), (10, 64, 64))
    assert uneven - once == 2 * 5 * MATRIX + 10 * MATRIX


def test_a_small_gemm_may_write_split_k_partial_sums() -> None:
    # XLA splits a GEMM whose result fills few tiles along its contraction: (256, 256,
    # 256) four ways once compiled, its partial sums a buffer of four results.
    assert _bytes(lambda a, b: (a @ b) @ b, (256, 256), (256, 256)) \
        == 256 * 256 * 4 + 4 * 256 * 256 * 4
    # A result of enough tiles, or a short contraction, is not split.
    assert _bytes(lambda a, b: (a @ b) @ b, (1024, 1024), (1024, 1024)) == 1024 * 1024 * 4
    assert _bytes(lambda a, b: (a @ b) @ b, (512, 64), (64, 64)) == 512 * 64 * 4


def test_a_scanned_input_read_transposed_is_copied_whole() -> None:
    def scan(c: jax.Array, xs: jax.Array, flip: bool) -> jax.Array:
        body = (lambda c, x: (jnp.transpose(x) @ c, None)) if flip else (
            lambda c, x: (x @ c, None))
        return lax.scan(body, c, xs)[0]

    straight = _bytes(lambda c, xs: scan(c, xs, False), (64, 64), (10, 64, 64))
    flipped = _bytes(lambda c, xs: scan(c, xs, True), (64, 64), (10, 64, 64))
    # XLA transposes the whole input outside the loop, not each trip's slice.
    assert flipped - straight >= 10 * MATRIX


def test_a_broadcast_a_loop_holds_is_written_right_before_the_loop() -> None:
    def two_loops(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
        xs_a = jnp.broadcast_to(a, (100, 64, 64))
        xs_b = jnp.broadcast_to(b, (100, 64, 64))
        step = lambda c, x: (c @ x, None)
        return lax.scan(step, a, xs_a)[0], lax.scan(step, b, xs_b)[0]

    # XLA writes each broadcast into the loop's state, just before that loop: one at a
    # time (a deviceless H200 compile of 10,000 x 100 x 100 ones: 381 MiB, not 763).
    held = _bytes(two_loops, (64, 64), (64, 64))
    assert 100 * MATRIX <= held < 2 * 100 * MATRIX


def test_stream_sections_keep_their_buffers_across_the_section() -> None:
    def two_chains(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
        return (a @ a) @ a, (b @ b) @ b

    closed = jax.make_jaxpr(two_chains)(*[jax.ShapeDtypeStruct((64, 64), F32)] * 2)
    model = _model()
    alone = model.temp_bytes(closed, LHS)
    side_by_side = model.temp_bytes(closed, LHS, [[0, 1, 2, 3]])  # one section, two regions
    assert alone == MATRIX  # one chain's intermediate at a time
    assert side_by_side == 2 * MATRIX  # both chains' intermediates live together


def test_format_bytes_and_the_stacking_refusal() -> None:
    assert format_bytes(300) == "300 B"
    assert format_bytes(1.5 * 2**20) == "1.5 MiB"
    assert format_bytes(-2048) == "-2.0 KiB"
    assert stacking_refusal(3 * 2**20, None) is None
    assert stacking_refusal(3 * 2**20, 4 * 2**20) is None
    why = stacking_refusal(3 * 2**20, 2**20)
    assert why is not None and "3.0 MiB" in why and "budget +1.0 MiB" in why


# --------------------------------------------------------------------------- deviceless


def _compiled_temp(fn: Any, shapes: list[Any], mode: CommandBufferMode = LHS) -> int:
    from jaxpar._compiled.gpu_compile import compiled_program, lower_for_gpu
    from jaxpar._flags import command_buffer_options

    return compiled_program(lower_for_gpu(fn, *shapes), command_buffer_options(mode)).temp_bytes


def _branches(*xs: jax.Array) -> list[jax.Array]:
    """Independent chains of small kernels and dots: what a branching mode keeps apart.
    (Dots of a shape XLA does not split along their contraction: the model leaves out
    split-K partial sums.)"""
    outs = []
    for k, x in enumerate(xs):
        y = jnp.cumsum(jnp.tanh(x @ x.T), axis=0) * (k + 1)  # 512 x 512
        outs.append(jnp.sin(y @ x) + jnp.cumsum(x, axis=1))
    return outs


@needs_plugin
@pytest.mark.parametrize("mode", [CONCURRENT, REGIONS])
def test_the_branching_bounds_hold_for_the_compile(mode: CommandBufferMode) -> None:
    shapes = [jax.ShapeDtypeStruct((512, 64), F32)] * 4
    closed = jax.make_jaxpr(_branches)(*shapes)
    model = _model()
    sequential, compiled_lhs = model.temp_bytes(closed, LHS), _compiled_temp(_branches, shapes)
    bound, compiled = model.temp_bytes(closed, mode), _compiled_temp(_branches, shapes, mode)
    # The model's extra bytes in the mode are at least what XLA allocates more (in
    # concurrent mode, more than in XLA's default for these independent chains).
    assert bound - sequential >= compiled - compiled_lhs, (
        sequential, compiled_lhs, bound, compiled)
    assert compiled > compiled_lhs or mode is REGIONS


@pytest.mark.parametrize("mode", [LHS, CONCURRENT, REGIONS])
def test_least_bytes_reads_the_level_traced_before(mode: CommandBufferMode,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``least_bytes`` after ``temp_bytes`` of the same program (the budget asks both)
    reads the largest buffer that level's trace found, whatever the mode it was traced
    in: the figure a fresh model traces."""
    def program(x: Any, w: Any) -> Any:
        y = jnp.tanh(x @ w)
        big = jnp.broadcast_to(y[None], (4, 64, 64))
        carry, ys = lax.scan(lambda c, b: (c + b @ w, c * 2.0), y, big)
        return carry.sum() + ys.sum() + (y @ w).sum()

    closed = jax.make_jaxpr(program)(*[jax.ShapeDtypeStruct((64, 64), F32)] * 2)
    fresh = _model().least_bytes(closed)
    model = _model()
    model.temp_bytes(closed, mode)
    from jaxpar._model import memory as _memory

    traced: list[Any] = []
    trace = _memory._Buffers.trace
    monkeypatch.setattr(_memory._Buffers, "trace",
                        lambda self, *a: (traced.append(a[0]), trace(self, *a))[1])
    assert model.least_bytes(closed) == fresh
    assert traced == []  # read, not traced again
    assert fresh >= 4 * MATRIX  # the broadcast the scan holds, at least
