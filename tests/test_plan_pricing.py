"""The GPU pricing of stream sections: cuts that cannot pay on the compiled program are refused.

Each refusal rule (``jaxpar/_plan/pricing.py``) gets a program that triggers it and one that does
not, checked on the plan, on the lowered text (no stream call is emitted) and on values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers.lowered import lower_for_gpu, stream_calls
from helpers.trees import assert_tree_close, assert_tree_equal
from jax import lax

import jaxpar
from jaxpar import _compat
from jaxpar._flags import command_buffer_mode
from jaxpar._model.cost import CostModel
from jaxpar._model.gpu import CommandBufferMode
from jaxpar._plan.pricing import price_section
from jaxpar._program.graph import build_graph
from jaxpar.targets import device_profile

MODE_LHS, MODE_OFF = CommandBufferMode.LHS, CommandBufferMode.OFF
MODE_CONCURRENT, MODE_SERIALIZE = CommandBufferMode.CONCURRENT, CommandBufferMode.SERIALIZE

GRAPHS_OFF = "--xla_gpu_enable_command_buffer="
S = jax.ShapeDtypeStruct


@pytest.fixture
def graphs_off(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", GRAPHS_OFF)


@pytest.mark.parametrize(("flags", "mode"), [
    ("", MODE_LHS),
    ("--xla_force_host_platform_device_count=8", MODE_LHS),
    (GRAPHS_OFF, MODE_OFF),
    ("--xla_gpu_enable_command_buffer=''", MODE_OFF),
    ("--xla_gpu_enable_command_buffer=+WHILE", MODE_LHS),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT", MODE_CONCURRENT),
    ("--xla_gpu_command_buffer_scheduling_mode=SERIALIZE", MODE_SERIALIZE),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT_REGIONS",
     CommandBufferMode.CONCURRENT_REGIONS),
    ("--xla_gpu_graph_enable_concurrent_region=false", MODE_SERIALIZE),
    ("--xla_gpu_graph_enable_concurrent_region=true", MODE_CONCURRENT),
    # The last occurrence wins, as in XLA's flag parser.
    (f"{GRAPHS_OFF} --xla_gpu_enable_command_buffer=+WHILE", MODE_LHS),
])
def test_command_buffer_mode_from_flags(flags, mode):
    assert command_buffer_mode(flags) == mode


def gptj_block(h, wq, wk, wv, wo, w1, w2):
    """GPT-J's parallel block: attention and MLP both read ``h``."""
    q, k, v = h @ wq, h @ wk, h @ wv
    attention = jax.nn.softmax(q @ k.T / 8.0) @ v
    mlp = jax.nn.gelu(h @ w1) @ w2
    return h + attention @ wo + mlp


def gptj_args():
    keys = jax.random.split(jax.random.key(0), 7)
    shapes = [(256, 512), *[(512, 512)] * 4, (512, 2048), (2048, 512)]
    return [0.02 * jax.random.normal(k, s) for k, s in zip(keys, shapes, strict=True)]


def two_chains(a, wa, b, wb):
    """Two independent matmul chains sharing no operand."""
    return jnp.tanh(jnp.tanh(a @ wa) @ wa), jnp.sin(jnp.sin(b @ wb) @ wb)


def two_chains_args(n=512):
    keys = jax.random.split(jax.random.key(1), 4)
    return [0.02 * jax.random.normal(k, (n, n)) for k in keys]


def reasons(plan):
    return [note.detail for note in plan.left_alone if note.reason == "does not pay"]


def test_dots_sharing_an_operand_stay_merged(graphs_off):
    # XLA merges h@wq, h@wk, h@wv and h@w1 into one GEMM (DotMerger); a cut between the
    # attention and the MLP would split it.
    plan = jaxpar.inspect(gptj_block, target="gpu")(*gptj_args())
    assert not plan.sections
    assert any("DotMerger" in r for r in reasons(plan))
    assert not stream_calls(lower_for_gpu(jaxpar.parallel_branches(gptj_block, target="gpu"),
                                          *gptj_args()))
    forced = jaxpar.inspect(gptj_block, target="gpu", force_streams=True)(*gptj_args())
    assert forced.sections


def test_graph_captured_sections_win_nothing_by_default(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    plan = jaxpar.inspect(two_chains, target="gpu")(*two_chains_args())
    assert not plan.sections
    (reason,) = reasons(plan)
    assert "LHS mode" in reason and "--xla_gpu_enable_command_buffer=" in reason
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT")
    plan = jaxpar.inspect(two_chains, target="gpu")(*two_chains_args())
    assert not plan.sections and "CONCURRENT mode" in reasons(plan)[0]


def test_sections_that_overlap_pay_with_graphs_off(graphs_off):
    # At 512 the overlap wins less than the launches of both chains on the one host thread.
    # (Side by side, the regions keep their temporaries apart: more memory than the
    # default budget allows, which leaves the section out; the pricing is checked here.)
    args = two_chains_args(1024)
    plan = jaxpar.inspect(two_chains, target="gpu", memory="any")(*args)
    assert len(plan.sections) == 1 and len(plan.sections[0].regions) == 2
    assert not jaxpar.inspect(two_chains, target="gpu")(*args).sections
    g = jaxpar.parallel_branches(two_chains, target="gpu", memory="any")
    assert len(stream_calls(lower_for_gpu(g, *args))) == 2
    assert_tree_equal(jax.jit(g)(*args), jax.jit(two_chains)(*args))


def test_the_plan_cache_follows_the_command_buffer_mode(monkeypatch):
    g = jaxpar.parallel_branches(two_chains, target="gpu", memory="any")
    args = [S((1024, 1024), jnp.float32)] * 4

    def lowered():  # a fresh function each time, so jax.jit's own trace cache misses
        return jax.jit(lambda *a: g(*a)).lower(*args).as_text()

    monkeypatch.setenv("XLA_FLAGS", "")
    assert not stream_calls(lowered())
    monkeypatch.setenv("XLA_FLAGS", GRAPHS_OFF)
    assert len(stream_calls(lowered())) == 2
    assert g.analyses == 2


def test_overlap_hides_kernel_latency_not_work():
    # Streams share one device: side by side, two regions hide their kernels' fixed
    # latency (the cost model's floor per kernel), never their flops or bytes.
    closed = jax.make_jaxpr(two_chains)(*[S((4096, 4096), jnp.float32)] * 4)
    inner, _ = _compat.open_jaxpr(closed)
    assert [e.primitive.name for e in inner.eqns] == ["dot_general", "tanh"] * 2 + [
        "dot_general", "sin"] * 2
    costs = CostModel(device_profile("gpu"))
    verdict = price_section(inner, build_graph(inner), [range(4), range(4, 8)], costs,
                            mode=MODE_OFF)
    latency = device_profile("gpu").min_kernel_seconds
    # Four kernels (two matmuls a chain): all their latency hides behind the other work.
    assert verdict.gain_seconds == pytest.approx(4 * latency, rel=1e-6)
    assert verdict.added_kernels == 0
    lhs = price_section(inner, build_graph(inner), [range(4), range(4, 8)], costs,
                        mode=MODE_LHS)
    assert not lhs.pays and lhs.gain_seconds == 0.0


def test_overlap_cannot_beat_the_host_that_launches_every_kernel():
    # Tiny kernels with graphs off: each region is bound by its launches (launch_s each,
    # more than a tiny kernel's floor), and one host thread makes the launches of both.
    closed = jax.make_jaxpr(two_chains)(*[S((64, 64), jnp.float32)] * 4)
    inner, _ = _compat.open_jaxpr(closed)
    costs = CostModel(device_profile("gpu"))
    gpu = device_profile("gpu").gpu
    assert gpu is not None and gpu.launch_s > gpu.kernel_floor_s
    verdict = price_section(inner, build_graph(inner), [range(4), range(4, 8)], costs,
                            mode=MODE_OFF)
    assert not verdict.pays and verdict.gain_seconds == 0.0
    assert "one host thread launches" in verdict.reason


def test_regions_read_apart_are_refused():
    # XLA overlaps two regions only when one instruction reads results of both; here each
    # chain's result is read by a matmul of its own.
    def read_apart(a, b, c1, c2):
        x = jnp.tanh(a @ a)
        y = jnp.sin(b @ b)
        return x @ c1, y @ c2

    closed = jax.make_jaxpr(read_apart)(*[S((512, 512), jnp.float32)] * 4)
    inner, _ = _compat.open_jaxpr(closed)
    assert [e.primitive.name for e in inner.eqns] == [
        "dot_general", "tanh", "dot_general", "sin", "dot_general", "dot_general"]
    costs = CostModel(device_profile("gpu"))
    graph = build_graph(inner)
    apart = price_section(inner, graph, [[0, 1], [2, 3]], costs, mode=MODE_OFF)
    assert not apart.pays and "no one instruction reads" in apart.reason
    # With their readers inside, the regions' results meet at the program's outputs.
    together = price_section(inner, graph, [[0, 1, 4], [2, 3, 5]], costs, mode=MODE_OFF)
    assert "no one instruction reads" not in together.reason


def with_conds(a, wa, b, wb):
    """Each branch holds a cond: a host sync that serialises the other stream's launch."""
    def branch(x, w):
        y = jnp.tanh(x @ w)
        return lax.cond(jnp.sum(y) > 0, lambda t: t @ w, lambda t: (t * 2.0) @ w, y)
    return branch(a, wa), branch(b, wb)


def test_host_syncs_inside_a_region_are_refused(graphs_off):
    args = two_chains_args()
    plan = jaxpar.inspect(with_conds, target="gpu")(*args)
    assert not plan.sections
    assert any("blocks the host" in r for r in reasons(plan))
    g = jaxpar.parallel_branches(with_conds, target="gpu")
    assert_tree_equal(jax.jit(g)(*args), jax.jit(with_conds)(*args))


def small_scans(a, b, xs):
    r1, _ = lax.scan(lambda c, x: (jnp.tanh(c @ x) @ x, None), a, xs)
    r2, _ = lax.scan(lambda c, x: (jnp.sin(x @ c) @ c, None), b, xs)
    return r1, r2


def test_small_kernel_loops_stay_in_the_graph():
    # A region holding a loop is never graph-captured: its small kernels would launch one
    # by one on every trip, which costs more than the overlap wins.
    args = [S((64, 64), jnp.float32)] * 2 + [S((1000, 64, 64), jnp.float32)]
    loops_off = {"fuse_scans": False, "batch_scans": False, "unroll": None}
    plan = jaxpar.inspect(small_scans, target="gpu", **loops_off)(*args)
    assert not plan.sections
    assert "launch" in reasons(plan)[0]


def test_big_kernel_loops_keep_their_overlap():
    # A region holding a loop is never graph-captured, so it keeps its stream overlap even
    # in XLA's default graph mode; with big kernels per trip the launches cost nothing.
    def big_scans(a, b, xs):
        r1, _ = lax.scan(lambda c, x: (jnp.tanh(c @ x), None), a, xs)
        r2, _ = lax.scan(lambda c, x: (jnp.sin(x @ c), None), b, xs)
        return r1, r2
    args = [S((2048, 2048), jnp.float32)] * 2 + [S((16, 2048, 2048), jnp.float32)]
    loops_off = {"fuse_scans": False, "batch_scans": False, "unroll": None}
    plan = jaxpar.inspect(big_scans, target="gpu", **loops_off)(*args)
    assert len(plan.sections) == 1 and len(plan.sections[0].regions) == 2


def test_values_are_unchanged_whatever_is_refused(graphs_off):
    args = gptj_args()
    got = jax.jit(jaxpar.parallel_branches(gptj_block, target="gpu"))(*args)
    assert_tree_close(got, jax.jit(gptj_block)(*args), rtol=1e-6, atol=1e-7)
