"""Plan lines that say what is so (issue 49, point 6), each on a program of our own, with
the program's values against ``jax.jit``: the summary off a GPU, a dynamic ``while`` loop
worded per target, a scan read by blocks named by the user's line, the ``min_cost_us``
comparison, a reason said once, an unchanged program's memory, and a gradient's refused
loop fusions labelled by direction.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxpar
from jaxpar._plan.sections import choose_sections, leaf, parallel


def _same_values(fun: Any, target: str, *args: Any) -> None:
    got, want = jaxpar.parallel_branches(fun, target=target)(*args), jax.jit(fun)(*args)
    for mine, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=2e-5, atol=2e-5)


def _plan(fun: Any, target: str, *args: Any) -> jaxpar.Plan:
    _same_values(fun, target, *args)
    return jaxpar.inspect(jaxpar.parallel_branches(fun, target=target))(*args)


def two_towers(a: Any, b: Any, w: Any) -> Any:  # two independent matmul chains
    x = jnp.tanh(jnp.tanh(a @ w) @ w) @ w
    y = jnp.sin(jnp.sin(b @ w) @ w) @ w
    return x + y


def _tower_args(n: int) -> tuple[Any, Any, Any]:
    return (jnp.linspace(-1, 1, n * n).reshape(n, n), jnp.linspace(1, -1, n * n).reshape(n, n),
            jnp.eye(n) * 0.5)


TOWER_ARGS = _tower_args(64)
# Large enough that the TPU's cost model finds the two towers worth a section as well.
TOWERS_BY_TARGET = {"tpu": _tower_args(512), "cpu": TOWER_ARGS}


@pytest.mark.parametrize("target", ["tpu", "cpu"])
def test_the_summary_off_a_gpu_says_no_stream_regions(target: str) -> None:
    plan = _plan(two_towers, target, *TOWERS_BY_TARGET[target])
    assert plan.num_regions == 2, plan.text()
    summary = plan.summary()
    assert "nothing is emitted" in plan.text()
    assert "stream regions in" not in summary, summary
    assert summary.startswith(f"no stream regions ({plan.num_regions} independent parts in "
                              f"1 section run one after another on {target})"), summary


def test_the_summary_on_a_gpu_counts_stream_regions() -> None:
    plan = _plan(two_towers, "gpu", *TOWER_ARGS)
    summary = plan.summary()
    if plan.num_regions:
        assert f"{plan.num_regions} stream regions in" in summary, summary
    else:
        assert "stream regions in" not in summary, summary


def dynamic_loop(a: Any) -> Any:
    bound = jnp.int32(3) + jnp.sum(a > 100).astype(jnp.int32)  # known only when it runs
    return lax.while_loop(lambda c: c[0] < bound, lambda c: (c[0] + 1, c[1] * 1.5),
                          (jnp.int32(0), a))[1]


@pytest.mark.parametrize(("target", "label", "says"), [
    ("gpu", "host-sync loop", "on a GPU every iteration waits for the host"),
    ("tpu", "dynamic while loop", "a TPU keeps the loop's control on the chip (no host sync)"),
    ("cpu", "dynamic while loop", "on a CPU the loop's control runs on the host"),
])
def test_a_while_loop_without_a_trip_count_is_worded_per_target(target: str, label: str,
                                                                 says: str) -> None:
    plan = _plan(dynamic_loop, target, jnp.linspace(0, 1, 32))
    short, verbose = plan.text(), plan.text(verbose=True)
    assert f"    {label}: no static trip count" in short, short
    assert says in verbose, verbose
    if target != "gpu":
        assert "host-sync" not in short and "waits for the host" not in verbose, verbose


def tiny_scans(a: Any, b: Any) -> Any:  # read by blocks on a TPU
    s1 = lax.scan(lambda c, t: (c * 0.9 + t, c), a[0], a)[0]
    s2 = lax.scan(lambda c, t: (jnp.cos(c) + t, c), b[0], b)[0]
    return s1, s2


def test_a_scan_read_by_blocks_is_named_by_the_users_line() -> None:
    a = jnp.linspace(0, 1, 256 * 8).reshape(256, 8)
    plan = _plan(tiny_scans, "tpu", a, a[::-1])
    lines = [line for line in plan.text().splitlines() if "read by blocks" in line]
    assert len(lines) == 2, plan.text()
    line_of = tiny_scans.__code__.co_firstlineno
    for line, offset in zip(lines, (1, 2), strict=True):
        assert f"test_report_plan_wording.py:{line_of + offset})" in line, line
        assert "<unknown>" not in line and "jaxpar_blocks" not in line, line


def test_too_cheap_says_what_overlap_would_hide() -> None:
    # Two branches of 27 us and 0.8 us: side by side they hide 0.8 us, below 5 us.
    choice = choose_sections(parallel(leaf(0, 27e-6), leaf(1, 0.8e-6)), 2, 5e-6)
    assert [round(d.overlap * 1e6, 1) for d in choice.declined] == [0.8, 0.8]
    plan = _plan(two_towers, "tpu", *TOWER_ARGS)
    cheap = [line for line in plan.text().splitlines() if "too cheap:" in line]
    assert cheap, plan.text()
    for line in cheap:
        assert "running it beside the branches independent of it would hide est." in line
        hidden = float(line.split("would hide est. ")[1].split(" us")[0])
        assert hidden < 5.0 and line.endswith("below min_cost_us=5.0"), line


def integer_scan(a: Any, k: Any) -> Any:  # a TPU keeps it rolled: its body divides integers
    return lax.scan(lambda c, x: (c + x // k, c), a[0], a)[0]


def test_a_reason_for_keeping_a_scan_rolled_is_said_once() -> None:
    plan = _plan(integer_scan, "tpu", jnp.arange(16 * 8, dtype=jnp.int32).reshape(16, 8), 3)
    lines = [line for line in plan.text().splitlines() if "kept rolled" in line]
    assert lines and all(line.count("kept rolled") == 1 for line in lines), lines
    assert "its body divides integers" in lines[0], lines


@pytest.mark.parametrize("target", ["tpu", "cpu"])
def test_an_unchanged_program_claims_no_extra_memory(target: str) -> None:
    plan = _plan(two_towers, target, *TOWERS_BY_TARGET[target])
    assert plan.num_regions == 2 and not plan.decisions, plan.text()  # a section, no rewrite
    assert plan.memory is not None
    assert plan.memory.jaxpar_bytes == plan.memory.plain_bytes, plan.memory
    assert "stream sections left out" not in plan.text(verbose=True)


def _gru(p: dict[str, Any], h: Any, x: Any) -> Any:
    z = jax.nn.sigmoid(x @ p["wz"] + h @ p["uz"])
    n = jnp.tanh(x @ p["wn"] + (z * h) @ p["un"])
    return (1 - z) * n + z * h


def bidirectional(pf: Any, pb: Any, xs: Any, h0: Any) -> Any:
    _, ys_f = lax.scan(lambda h, x: (_gru(pf, h, x),) * 2, h0, xs)
    _, ys_b = lax.scan(lambda h, x: (_gru(pb, h, x),) * 2, h0, xs, reverse=True)
    return jnp.stack([ys_f, ys_b])


def _gru_args(steps: int, batch: int = 32, width: int = 128, inputs: int = 64) -> tuple:
    def params(seed: int) -> dict[str, Any]:
        keys = jax.random.split(jax.random.PRNGKey(seed), 4)
        return {name: jax.random.normal(key, (inputs if name[0] == "w" else width, width))
                * 0.1 for name, key in zip(("wz", "wn", "uz", "un"), keys, strict=True)}
    return (params(0), params(1), jnp.linspace(-1, 1, steps * batch * inputs).reshape(
        steps, batch, inputs), jnp.zeros((batch, width)))


def test_a_gradients_refused_loop_fusions_are_labelled() -> None:
    def loss(pf: Any, pb: Any, xs: Any, h0: Any) -> Any:
        return jnp.sum(bidirectional(pf, pb, xs, h0) ** 2)

    plan = _plan(jax.grad(loss, argnums=(0, 1)), "gpu", *_gru_args(64))
    lines = [line for line in plan.text().splitlines() if "not fused:" in line]
    if len(lines) < 2:
        pytest.skip("the plan fuses the gradient's scans")
    assert len(set(lines)) == len(lines), lines  # no two lines alike
    assert ", forward and reverse" in lines[0], lines
    first = bidirectional.__code__.co_firstlineno
    forward = f"test_report_plan_wording.py:{first + 1}"
    backward = [line for line in lines if "(backward)" in line]
    assert len(backward) == 1 and forward + " (backward)" in backward[0], lines
    assert any(forward in line and "(backward)" not in line for line in lines), lines
