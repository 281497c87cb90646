"""The short report in words a JAX user knows (``jaxpar/_report/words.py`` and
``Plan.text``), checked on real programs: the README's two scans, the guide's towers and
memory example, the quickstart's forced streams, and a bidirectional RNN with
two MLP heads (issue 45's user program).

A user who knows JAX but not jaxpar must be able to answer from the default output
alone: faster or slower, by how much and from what; whether memory fits; what was done to
each loop (its trips, the unroll factor); what was refused and why, said where the
refused rewrite would have been; what was left alone, named; places as the user wrote
them. One test per question.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxpar
from jaxpar._report.render import first_clause

S = jax.ShapeDtypeStruct
F32 = jnp.float32


def readme_two_scans(a, b, xs):  # README.md's first example, as written there
    r1, _ = lax.scan(lambda c, x: (jnp.tanh(c @ x), None), a, xs)
    r2, _ = lax.scan(lambda c, x: (jnp.sin(x @ c) + c, None), b, xs)
    return r1, r2


README_ARGS = (S((64, 64), F32), S((64, 64), F32), S((100, 64, 64), F32))
# docs/guide.md, "The memory budget": the same program at 100 x 100, 200 steps.
GUIDE_ARGS = (S((100, 100), F32), S((100, 100), F32), S((200, 100, 100), F32))


def towers(a, b):  # docs/guide.md, "inspect"
    return jnp.tanh(a @ a) @ a, jnp.sin(b @ b) @ b


def birnn(rnn, heads, xs, depth: int = 0):
    """Issue 45's user program: a bidirectional RNN, its parameters in a dict the user
    indexes (``rnn["fw_W"]``), and two MLP heads on the last states; each cell followed
    by ``depth`` residual sine steps."""
    h0 = jnp.zeros((xs.shape[1], rnn["fw_U"].shape[0]), xs.dtype)

    def forward(h, x):
        h = _deepened(jnp.tanh(x @ rnn["fw_W"] + h @ rnn["fw_U"]), depth)
        return h, h

    def backward(h, x):
        h = _deepened(jnp.tanh(x @ rnn["bw_W"] + h @ rnn["bw_U"]), depth)
        return h, h

    _, hf = lax.scan(forward, h0, xs)
    _, hb = lax.scan(backward, h0, xs, reverse=True)
    feats = jnp.concatenate([hf[-1], hb[0]], -1)
    heads_out = [jax.nn.relu(feats @ heads[k]["w1"]) @ heads[k]["w2"] for k in ("a", "b")]
    return tuple(heads_out)


def _deepened(h, depth: int):
    for _ in range(depth):
        h = h + 0.5 * jnp.sin(h)
    return h


def deep_birnn(rnn, heads, xs):
    """``birnn`` with cells deep in elementwise work (28 equations a body): apart, each
    scan is unrolled by 10 of its 100 trips; fused, the body's 56 equations exceed
    ``MAX_UNROLLED_EQNS`` at 10 copies and unroll='auto' unrolls it by 5 only."""
    return birnn(rnn, heads, xs, depth=8)


def birnn_args(features: int = 32, hidden: int = 64, steps: int = 100, batch: int = 64
               ) -> tuple[Any, ...]:
    rnn = {"fw_W": S((features, hidden), F32), "fw_U": S((hidden, hidden), F32),
           "bw_W": S((features, hidden), F32), "bw_U": S((hidden, hidden), F32)}
    heads = {k: {"w1": S((2 * hidden, hidden), F32), "w2": S((hidden, 10), F32)}
             for k in ("a", "b")}
    return rnn, heads, S((steps, batch, features), F32)


def _lines(plan: jaxpar.Plan) -> list[str]:
    return plan.text().splitlines()


def _section(lines: list[str], title: str) -> list[str]:
    """The indented lines under ``  <title>:``."""
    start = lines.index(f"  {title}:")
    out = []
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        out.append(line.strip())
    return out


# --------------------------------------------------------------- faster or slower, from what


def test_the_header_says_faster_or_slower_by_how_much_and_from_what():
    plan = jaxpar.inspect(readme_two_scans, target="gpu")(*README_ARGS)
    figure = plan.estimate
    header = _lines(plan)[1]
    speedup = figure.plain_us / figure.jaxpar_us
    assert speedup > 1.5
    assert header == (f"  {speedup:.2f}x faster than jax.jit (estimated): jax.jit "
                      f"{figure.plain_us:,.1f} us -> jaxpar {figure.jaxpar_us:,.1f} us per run, "
                      "from jaxpar's GPU planning model (public figures, not measured on a "
                      "GPU); not a compile or a run")
    # No ratio a reader must decode, no XLA jargon where jaxpar keeps the mode.
    assert not re.search(r"\(x\d", plan.text()) and "lhs" not in plan.text()
    # A plan the pricing refused, forced (the quickstart's, with the loops left alone):
    # slower, and said so.
    forced = jaxpar.inspect(readme_two_scans, target="gpu", force_streams=True,
                            fuse_scans=False, unroll=None)(*README_ARGS)
    assert forced.estimate.ratio > 1.0
    assert _lines(forced)[1].startswith(f"  {forced.estimate.ratio:.2f}x slower than jax.jit "
                                        "(estimated): ")
    # Off a GPU nothing changes: as fast, by the CPU's cost model.
    cpu = jaxpar.inspect(readme_two_scans, target="cpu")(*README_ARGS)
    assert _lines(cpu)[2].startswith("  as fast as jax.jit (estimated): ")
    assert "from jaxpar's cpu cost model" in _lines(cpu)[2]


# ------------------------------------------------------------------------- memory fits


def test_the_memory_line_says_whether_it_fits():
    plan = jaxpar.inspect(readme_two_scans, target="gpu")(*README_ARGS)
    (line,) = [line for line in _lines(plan) if line.startswith("  memory: ")]
    assert line.startswith("  memory: fits the budget: est. ")
    assert line.endswith("for jax.jit's program (the budget allows 3.7 MiB more)")
    anything = jaxpar.inspect(readme_two_scans, target="gpu", memory="any")(*README_ARGS)
    assert "(memory='any': no budget)" in anything.text()


# ------------------------------------------------------------------ what was done to each loop


def test_each_loop_is_named_with_its_own_trips_and_the_unroll_factor():
    plan = jaxpar.inspect(readme_two_scans, target="gpu")(*README_ARGS)
    loops = _section(_lines(plan), "loops")
    fused = next(line for line in loops if line.startswith("fused: "))
    # Per loop: 100 trips each, not "200 -> 100" summed over both.
    assert fused.startswith("fused: 2 scans of 100 trips each -> one scan of 100 trips, "
                            "running their bodies side by side (in ")
    unrolled = next(line for line in loops if line.startswith("unrolled by "))
    factor = next(d.unroll for d in plan.decisions if d.kind == "unrolled")
    assert unrolled.startswith(f"unrolled by {factor}: 100 trips -> {100 // factor} (in ")
    # Chosen by the GPU model that prices the plan (the rule of thumb no longer decides on
    # target gpu).
    assert "unroll='auto' chose it as the GPU model's fastest of unroll 1, 2, 4, 5, 10" \
        in unrolled
    assert not any(line.startswith("unrolled: auto") for line in loops)
    # Sources as the user wrote them: both scans' lines (this file's).
    assert fused.count("test_report_words.py:") == 2


def test_no_line_leaves_a_bracket_open():
    # A reason cut at its first clause once left "(mixed directions" open.
    assert first_clause("2 scans run side by side (mixed directions: reverse members read "
                        "flipped xs); more") == "2 scans run side by side"
    assert first_clause("a: b (c: d) e", clauses=2) == "a: b e"
    plans = [jaxpar.inspect(readme_two_scans, target="gpu")(*README_ARGS),
             jaxpar.inspect(birnn, target="gpu", memory="any", unroll=None)(*birnn_args()),
             jaxpar.inspect(birnn, target="gpu")(*birnn_args()),
             jaxpar.inspect(towers, target="gpu")(S((512, 512), F32), S((512, 512), F32))]
    assert any("forward and reverse" in plan.text() for plan in plans)
    for plan in plans:
        for line in _lines(plan):
            assert line.count("(") == line.count(")"), line
            assert line.count("[") == line.count("]"), line


# ------------------------------------------------------------ what was refused, and why


def test_a_refusal_for_memory_is_said_where_the_loop_rewrite_would_have_been():
    plan = jaxpar.inspect(readme_two_scans, target="gpu", memory=0)(*GUIDE_ARGS)
    assert plan.memory is not None and plan.memory.left_out
    (refused,) = plan.memory.left_out
    assert refused.memory and refused.kinds == ("loop fusion",)
    lines = _lines(plan)
    loops = _section(lines, "loops")
    # Under loops:, with the figure that decided it and the budget; not under memory:.
    line = next(line for line in loops if line.startswith("not fused: "))
    assert line.startswith("not fused: 2 scans of 200 trips each (would be one scan of "
                           "200 trips) (in ")
    assert line.endswith(": with loop fusion, jaxpar's program would need est. 78.1 KiB "
                         "more temporary memory than jax.jit's; the memory budget allows "
                         "0 B more (memory=... sets another)")
    memory = lines.index(next(line for line in lines if line.startswith("  memory: ")))
    assert lines[memory + 1].startswith("  loops:")


def test_a_join_the_model_rates_slower_is_refused_with_both_figures():
    # Issue 45: with memory="any" jaxpar ran the fused plan its model rated slower than
    # the one it ran by default (fusion left out for memory).
    plan = jaxpar.inspect(deep_birnn, target="gpu", memory="any")(*birnn_args())
    assert "fused" not in {d.kind for d in plan.decisions}
    line = next(line for line in _section(_lines(plan), "loops")
                if line.startswith("not fused: "))
    found = re.search(r"estimated faster without loop fusion: ([\d,.]+) us per run against "
                      r"([\d,.]+) us with it$", line)
    assert found, line
    without, with_fusion = (float(v.replace(",", "")) for v in found.groups())
    # The plan run is the faster one, and the header shows its figure.
    assert without < with_fusion
    assert plan.estimate.jaxpar_us == pytest.approx(without, abs=0.05)
    default = jaxpar.inspect(deep_birnn, target="gpu")(*birnn_args())
    assert plan.estimate.jaxpar_us <= default.estimate.jaxpar_us


# ----------------------------------------------------------------- what was left alone


def test_what_was_left_alone_is_named_the_heaviest_first():
    plan = jaxpar.inspect(birnn, target="gpu")(*birnn_args())
    lines = _lines(plan)
    count = len(plan.left_alone)
    assert count > 3
    start = lines.index(f"  left alone ({count}), the heaviest first:")
    heaviest = sorted(plan.left_alone, key=lambda note: -note.cost_us)[:3]
    for line, note in zip(lines[start + 1:start + 4], heaviest, strict=True):
        assert line.startswith(f"    {note.reason}: {note.primitives[0]}"), line
        assert "(in " in line or " at " in line, line
    assert lines[start + 4].startswith(f"    and {count - 3} more (")
    readme = jaxpar.inspect(readme_two_scans, target="gpu")(*README_ARGS)
    too_cheap = [line for line in _lines(readme) if line.startswith("    too cheap: ")]
    assert too_cheap and all("below min_cost_us=5.0" in line and "(in scan body at " in line
                             for line in too_cheap)
    assert "verbose=True lists them" not in plan.text()


# ------------------------------------------------------------ places as the user wrote them


def test_places_are_named_as_the_user_wrote_them():
    plan = jaxpar.inspect(birnn, target="gpu")(*birnn_args())
    text = plan.text()
    assert "rnn['fw_W']" in text and "rnn['bw_U']" in text, text
    assert " + " not in text, text  # "rnn.fw_W + rnn.fw_U" read as arithmetic


# ---------------------------------------------------------------- the CUDA-graph mode line


def test_the_mode_line_only_where_jaxpar_sets_options():
    plan = jaxpar.inspect(readme_two_scans, target="gpu")(*README_ARGS)
    assert plan.mode is not None and not plan.mode.chosen
    assert "XLA options" not in plan.text() and "CUDA graph" not in plan.text()
    assert "XLA options: none" in plan.text(verbose=True)
    chosen = jaxpar.inspect(readme_two_scans, target="gpu",
                            command_buffers="concurrent_regions")(*README_ARGS)
    line = next(line for line in _lines(chosen) if "XLA options:" in line)
    assert line == ("  XLA options: xla_gpu_command_buffer_scheduling_mode='CONCURRENT_REGIONS': "
                    "this function's CUDA graphs run in concurrent_regions mode (the "
                    "process's: lhs): as the command_buffers option says")


def test_the_closing_hint_names_the_command_line_flag():
    text = jaxpar.inspect(readme_two_scans, target="gpu")(*README_ARGS).text()
    assert text.splitlines()[-1] == ("  (every reason in full: print(plan.text(verbose=True)), "
                                     "or python -m jaxpar inspect --verbose)")
