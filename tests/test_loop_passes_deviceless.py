"""Every loop-pass combination compiles for an H200 (deviceless), regions in bodies included.

XLA:GPU rejects a scheduling group whose members are connected through work outside it
("Support for annotation groups with gaps doesn't exist yet"). `lax.scan(unroll=k)` copies
its body's stream regions, one group for all copies, with the carry between them: a fused,
unrolled bidirectional RNN did not compile. The emitter now unrolls such scans itself, one
group per copy; this file compiles fuse_scans x batch_scans x unroll x regions-in-body for a
few loop programs, forward and backward. Skipped, with the `pip install` line, without the
CUDA plugin. Programs that lower to the same jaxpr (up to group numbering) compile once.

Sharp edges:
    The whole matrix (all programs, forward and backward) takes about ten minutes on two
    cores; by default the forward matrix of the two small programs and the backward pass
    of the two-chain body for each unroll setting run (about a minute and a half). Set
    `JAXPAR_FULL_DEVICELESS=1` for everything.
"""

from __future__ import annotations

import itertools
import os
import re

import jax
import jax.numpy as jnp
import pytest
from helpers.environment import needs_plugin
from jax import lax

import jaxpar
from jaxpar._compiled import compile_for_gpu, parse_schedule

pytestmark = needs_plugin

sig = jax.nn.sigmoid


def S(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def birnn(W, U, V, R, xs):
    """A forward LSTM scan and a reverse GRU scan (Flax's bidirectional RNN)."""
    def lstm(ch, x):
        c, h = ch
        i, fg, g, o = jnp.split(x @ W + h @ U, 4, -1)
        c = sig(fg) * c + sig(i) * jnp.tanh(g)
        return (c, sig(o) * jnp.tanh(c)), None

    def gru(h, x):
        r = sig(x @ V[:, :16] + h @ R[:, :16])
        return 0.5 * h + 0.5 * jnp.tanh(x @ V[:, 16:] + r * (h @ R[:, 16:])), None

    z = jnp.zeros((2, 16))
    return lax.scan(lstm, (z, z), xs)[0][1], lax.scan(gru, z, xs, reverse=True)[0]


BIRNN_ARGS = (S(8, 64), S(16, 64), S(8, 32), S(16, 32), S(5, 2, 8))


def two_scans(a, b, xs):
    r1, _ = lax.scan(lambda c, x: (jnp.tanh(c @ x), c[0]), a, xs)
    r2, _ = lax.scan(lambda c, x: (jnp.sin(x @ c) + c, None), b, xs)
    return r1, r2


def branchy_body(a, b, w1, w2, xs):
    """One scan whose body holds two independent chains: regions without any fusion."""
    def step(carry, x):
        c1, c2 = carry
        return (jnp.tanh(c1 @ w1 @ x), jnp.sin(x @ c2 @ w2)), c1[0] + c2[0]

    return lax.scan(step, (a, b), xs)


def loss_grad(fn):
    def grad(*args):
        return jax.grad(lambda *z: sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(fn(*z))),
                        argnums=tuple(range(len(args))))(*args)
    return grad


PROGRAMS = {
    "birnn": (birnn, BIRNN_ARGS),
    "two_scans": (two_scans, (S(16, 16), S(16, 16), S(5, 16, 16))),
    "branchy_body": (branchy_body, (S(16, 16), S(16, 16), S(16, 16), S(16, 16), S(5, 16, 16))),
}
COMBOS = list(itertools.product([False, True], [False, True], [None, 2, "auto"], [True, False]))
FULL = bool(os.environ.get("JAXPAR_FULL_DEVICELESS"))
# (program, backward) pairs run by default; the rest with JAXPAR_FULL_DEVICELESS=1.
DEFAULT_CASES = {("two_scans", False), ("branchy_body", False), ("branchy_body", True)}

_GROUP = re.compile(r"_scheduling_group_id=(\d+)")
_COMPILED: dict[str, str] = {}  # canonical jaxpr text -> compiled HLO, for the whole module


def _canonical(text):
    """The jaxpr text with scheduling groups renumbered by first appearance."""
    numbers: dict[str, str] = {}
    return _GROUP.sub(lambda m: "_scheduling_group_id=" + numbers.setdefault(
        m.group(1), str(len(numbers) + 1)), text)


def _compile(fn, args):
    key = _canonical(str(jax.make_jaxpr(fn)(*args)))
    if key not in _COMPILED:
        _COMPILED[key] = compile_for_gpu(fn, *args)
    return _COMPILED[key]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_every_loop_pass_combination_compiles(name, backward):
    if not FULL and (name, backward) not in DEFAULT_CASES:
        pytest.skip("part of the full matrix: set JAXPAR_FULL_DEVICELESS=1")
    fn, args = PROGRAMS[name]
    combos = COMBOS
    if backward and not FULL:  # by default the backward pass without the loop rewrites
        combos = [c for c in COMBOS if not c[0] and not c[1] and c[3]]
    streamed = 0
    for fuse, batch, unroll, regions in combos:
        # batch_matmuls off: since it batches crossed operand orders (x @ W beside W @ x),
        # it joins branchy_body's two chains into one op, leaving no regions to compile.
        g = jaxpar.parallel_branches(fn, target="gpu", fuse_scans=fuse, batch_scans=batch,
                                     unroll=unroll, min_cost_us=0.0 if regions else 1e9,
                                     force_streams=regions, batch_matmuls=False)
        program = loss_grad(g) if backward else g
        try:
            schedule = parse_schedule(_compile(program, args))
        except Exception as error:  # name the combination that failed
            raise AssertionError(f"{name} fuse={fuse} batch={batch} unroll={unroll} "
                                 f"regions={regions}: {error}") from error
        streamed += bool(schedule.stream_ids)
    assert streamed  # regions were emitted (and compiled) in some combinations


def test_bidirectional_rnn_overlaps_two_regions():
    """The bidirectional RNN: fused, unrolled, regions in the body (forced past the pricing,
    which by default keeps them out under XLA's CUDA-graph mode), compiles and overlaps."""
    assert jaxpar.gpu_preview(birnn, *BIRNN_ARGS).jaxpar.async_in_flight == 0
    preview = jaxpar.gpu_preview(birnn, *BIRNN_ARGS, force_streams=True)
    assert preview.jaxpar.async_in_flight == 2
