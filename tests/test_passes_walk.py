"""The walker of the passes (``jaxpar/passes/_walk.py``): what it tells about a pass that
fails, and the checks of every level it rebuilds under ``JAXPAR_CHECKS=1``.

A pass's exception keeps its class (``except ValueError`` still catches it) and gets a
note naming the pass, the level's path and the passes run before it at that level.
With ``JAXPAR_CHECKS=1``, every rebuilt level goes through JAX's own jaxpr checker, so
a pass that emits a malformed level fails there, named, and not later in XLA.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax
from pass_checker import assert_well_formed
from programs import Program, feature_programs, loop_programs, programs, scan_programs

import jaxpar.passes as passes
from jaxpar import _compat
from jaxpar._analysis import Analysis
from jaxpar._options import Options
from jaxpar.passes import Level, LevelResult, Pass, Rewrite, apply_passes, run_passes
from jaxpar.passes._walk import CHECKS_VARIABLE, walk_levels


def _row(name: str) -> Pass:
    (row,) = [p for p in passes.PASSES if p.name == name]
    return row


def _scan_of_sines(x: jax.Array) -> jax.Array:
    def body(c: jax.Array, _: Any) -> tuple[jax.Array, None]:
        return jnp.sin(c) * 2, None

    return lax.scan(body, x, None, length=3)[0] + jnp.sin(x)


def _two_scans(x: jax.Array, y: jax.Array) -> jax.Array:
    def body(c: jax.Array, _: Any) -> tuple[jax.Array, None]:
        return jnp.tanh(c @ c), None

    return lax.scan(body, x, None, length=4)[0] + lax.scan(body, y, None, length=4)[0]


def _analysis() -> Analysis:
    return Analysis(Options().resolve("gpu"))


# ------------------------------------------------------------------ a pass that fails


def test_a_failing_pass_keeps_its_class_and_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row's ``ValueError`` in a nested level is still a ``ValueError``, noted with the
    row's name, the level's path and the passes run before it there."""
    seen: list[str] = []

    def broken(level: Level, analysis: Analysis) -> LevelResult:
        if level.path:  # only inside the scan's body
            seen.append(level.path)
            raise ValueError("the broken pass broke")
        return LevelResult()

    table = [_row("share_common"), _row("make_loops_static"),
             Pass("broken", broken, lambda s: True, "raises in nested levels")]
    closed = jax.make_jaxpr(_scan_of_sines)(jnp.ones(3))
    with pytest.raises(ValueError, match="the broken pass broke") as info:
        walk_levels(closed, table, _analysis())
    (path,) = seen
    assert path.startswith("/scan#") and path.endswith(".jaxpr")
    (note,) = [n for n in info.value.__notes__ if "broken" in n]
    assert f"pass 'broken' at level {path!r}" in note
    assert "run before it at this level: share_common, make_loops_static" in note


def test_a_broken_row_of_the_table_is_named_through_run_passes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_passes`` with a row of ``PASSES`` replaced by one that fails: the error is
    the pass's own (a ``KeyError`` here) and its note names the row and the rows before."""

    def broken(level: Level, analysis: Analysis) -> LevelResult:
        raise KeyError("fuse_scans lost a key")

    table = tuple(dataclasses.replace(p, run=broken) if p.name == "fuse_scans" else p
                  for p in passes.PASSES)
    monkeypatch.setattr(passes, "PASSES", table)
    closed = jax.make_jaxpr(_two_scans)(jnp.ones((4, 4)), jnp.ones((4, 4)))
    with pytest.raises(KeyError) as info:
        run_passes(closed, target="gpu", fuse_scans=True)
    (note,) = [n for n in info.value.__notes__ if n.startswith("jaxpar:")]
    assert "pass 'fuse_scans' at level '/scan#0.jaxpr'" in note  # innermost first
    assert "round 1;" in note
    before = note.split("run before it at this level: ")[1]
    assert "make_loops_static" in before and "batch_scans" in before
    assert "fuse_scans" not in before


# The frames between ``run_passes`` and a pass's ``run`` on a program's top level: the
# walker's own (``walk_levels``, the level's rounds, the pass's step), nothing more.
MAX_WALKER_FRAMES = 3


def test_a_pass_runs_few_frames_below_run_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A traceback through the walker stays short: at most ``MAX_WALKER_FRAMES`` frames
    between ``run_passes`` and the pass's ``run`` that raised (no frame of the CUDA-graph
    mode search's reuse of steps in between)."""

    def broken(level: Level, analysis: Analysis) -> LevelResult:
        raise KeyError("share_common lost a key")

    table = tuple(dataclasses.replace(p, run=broken) if p.name == "share_common" else p
                  for p in passes.PASSES)
    monkeypatch.setattr(passes, "PASSES", table)
    closed = jax.make_jaxpr(jnp.sin)(jnp.ones(3))
    with pytest.raises(KeyError) as info:
        run_passes(closed, target="gpu")
    names = [entry.name for entry in info.traceback]
    between = names[names.index("run_passes") + 1:names.index("broken")]
    assert names.count("run_passes") == 1
    assert len(between) <= MAX_WALKER_FRAMES, between


def test_an_error_is_noted_once() -> None:
    """The same error object raised again (a walk of the same level, say) gets one note."""
    error = ValueError("x")

    def broken(level: Level, analysis: Analysis) -> LevelResult:
        raise error

    table = [Pass("broken", broken, lambda s: True, "raises")]
    closed = jax.make_jaxpr(jnp.sin)(jnp.ones(3))
    for _ in range(2):
        with pytest.raises(ValueError):
            walk_levels(closed, table, _analysis())
    assert len(error.__notes__) == 1


# ------------------------------------------------------------------ JAXPAR_CHECKS=1


def _leaky(level: Level, analysis: Analysis) -> LevelResult:
    """A pass bug: ``sin`` rewritten (as ``cos(x - pi/2)``) with a debug callback the
    level does not declare among its effects; the splice keeps the level's effects."""

    def emit(rows: list[list[Any]]) -> list[list[Any]]:
        jax.debug.callback(lambda v: None, rows[0][0])
        return [[jnp.cos(rows[0][0] - jnp.pi / 2)]]

    found = [i for i, e in enumerate(level.eqns) if e.primitive.name == "sin"]
    return LevelResult([Rewrite((i,), emit) for i in found], [])


_LEAKY = Pass("leaky", _leaky, lambda s: True, "emits an effect its level does not declare")


def test_checks_catch_a_malformed_rebuilt_level(monkeypatch: pytest.MonkeyPatch) -> None:
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(3))
    table = [_row("make_loops_static"), _LEAKY]
    monkeypatch.delenv(CHECKS_VARIABLE, raising=False)
    new, _ = walk_levels(closed, table, _analysis())  # unchecked: the bug goes through
    with pytest.raises(TypeError):  # JAX's JaxprTypeError
        _compat.check_jaxpr(new)
    monkeypatch.setenv(CHECKS_VARIABLE, "0")
    walk_levels(closed, table, _analysis())
    monkeypatch.setenv(CHECKS_VARIABLE, "1")
    with pytest.raises(TypeError, match="effect") as info:
        walk_levels(closed, table, _analysis())
    notes = "\n".join(info.value.__notes__)
    assert f"{CHECKS_VARIABLE}=1: a level rebuilt with a pass's rewrites is malformed" in notes
    assert "pass 'leaky' at level '/'" in notes
    assert "run before it at this level: make_loops_static" in notes


def test_checks_run_on_every_rebuilt_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each level the walker rebuilds is checked once (a nested level's rebuild and the
    enclosing level rebuilt with it included); none when the variable is unset."""
    checked: list[Any] = []
    real = _compat.check_jaxpr
    monkeypatch.setattr(_compat, "check_jaxpr", lambda j: checked.append(j) or real(j))
    closed = jax.make_jaxpr(_two_scans)(jnp.ones((4, 4)), jnp.ones((4, 4)))
    monkeypatch.delenv(CHECKS_VARIABLE, raising=False)
    run_passes(closed, target="gpu", fuse_scans=True)
    assert checked == []
    monkeypatch.setenv(CHECKS_VARIABLE, "1")
    new, decisions = run_passes(closed, target="gpu", fuse_scans=True)
    assert new is not closed and decisions
    assert checked and checked[-1] is new


@given(st.one_of(programs(), scan_programs(), loop_programs(), feature_programs()))
def test_the_passes_pass_the_checks_on_random_programs(program: Program) -> None:
    """Every pass on (the GPU's loop settings and the batching passes) under
    ``JAXPAR_CHECKS=1``: every level rebuilt on the way is well formed."""
    closed = jax.make_jaxpr(program.fn)(*program.args)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CHECKS_VARIABLE, "1")
        new, _ = apply_passes(closed, fuse_scans=True, batch_scans=True, unroll="cost",
                              target="gpu", batch_branches=True, batch_matmuls=True,
                              share_common=True)
    assert_well_formed(new)
