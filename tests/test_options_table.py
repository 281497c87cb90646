"""``jaxpar._options``' two tables: a pass is declared once (its row of ``PASS_TABLE``),
a target once (its row of ``TARGETS``), and ``Options``, ``Settings``, validation, the
defaults, the budget's ladder and the walker's rows follow from a row added, with no
other module touched."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxpar.passes
from jaxpar._analysis import Analysis
from jaxpar._options import (
    PASS_TABLE,
    TARGETS,
    OptionKind,
    Options,
    PassNames,
    PassRow,
    Rung,
    Settings,
    TargetRow,
    check_tables,
    pass_defaults,
)
from jaxpar._plan.budget import LADDER, ladder, leave_out
from jaxpar.passes import PASSES, Level, LevelResult
from jaxpar.passes._walk import walk_levels

FIXED = {"async_limit": 2, "command_buffers": "lhs"}  # nothing read from the machine

# A pass a test adds: its row is all the tables need.
WIDEN = PassRow("widen_loops", "a test's pass", option="widen_loops", rung=Rung.BATCHING)


def _two_scans(a: jax.Array, b: jax.Array) -> jax.Array:
    fa, _ = lax.scan(lambda c, x: (jnp.tanh(c + x), None), a, jnp.ones((5, 3)))
    fb, _ = lax.scan(lambda c, x: (jnp.sin(c * x), None), b, jnp.ones((5, 3)))
    return fa + fb


# ---------------------------------------------------------------- the tables themselves


def test_the_tables_hold_together_and_the_passes_are_their_rows() -> None:
    check_tables(PASS_TABLE, TARGETS, Options.declared.__annotations__)
    assert [p.name for p in PASSES] == [row.name for row in PASS_TABLE]
    for row, bound in zip(PASS_TABLE, PASSES, strict=True):
        module = __import__(f"jaxpar.passes.{row.name}", fromlist=["run"])
        assert bound.run is module.run and bound.state is getattr(module, "State", None)
        assert (bound.summary, bound.after, bound.prices_launches, bound.remembers_search) == \
            (row.summary, row.after, row.prices_launches, row.remembers_search)
    # The options: each switch row's option is its name; unroll_scans' is ``unroll``.
    assert {row.name: row.option for row in PASS_TABLE if row.option} == {
        "batch_scans": "batch_scans", "fuse_scans": "fuse_scans",
        "batch_branches": "batch_branches", "batch_matmuls": "batch_matmuls",
        "unroll_scans": "unroll", "unroll_while_loops": "unroll_while",
        "hoist_scan_inputs": "hoist_scan_inputs", "associative_scans": "associative_scans"}
    assert [kind for kind, _ in LADDER] == ["stream sections", *(r.value for r in Rung)]


@pytest.mark.parametrize("passes, targets, message", [
    ((*PASS_TABLE, PASS_TABLE[0]), TARGETS, r"pass\(s\) \['share_common'\] twice"),
    ((*PASS_TABLE, PassRow("x", "x", runs_with=("nothing",))), TARGETS, r"\['nothing'\]"),
    ((PassRow("late", "x", after=("fuse_scans",)), *PASS_TABLE), TARGETS, "must be rows"),
    ((*PASS_TABLE, PassRow("x", "x", option="max_streams")), TARGETS, "Options' own"),
    ((*PASS_TABLE, PassRow("x", "x", option="x", always=True)), TARGETS, "no runs_with"),
    (PASS_TABLE, (*TARGETS, TargetRow("npu", ("npu",), {"fuse_scan": True})),
     r"no option 'fuse_scan' \(did you mean 'fuse_scans'\?\)"),
    (PASS_TABLE, (*TARGETS, TargetRow("npu", ("npu",), {"unroll": 0})), "unroll must be"),
    (PASS_TABLE, (*TARGETS, TargetRow("npu", ("npu",), {"fuse_scans": "auto"})),
     "the default itself"),
    (PASS_TABLE, (*TARGETS, TargetRow("gpu2", ("gpu",))), r"backend\(s\) \['gpu'\] twice"),
])
def test_tables_that_contradict_themselves_are_refused(passes: Any, targets: Any,
                                                       message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Options.for_tables(passes, targets)


def test_the_defaults_are_the_target_rows() -> None:
    for row in TARGETS:
        settings = Options().resolve(row.name, **FIXED)  # type: ignore[arg-type]
        on = {p.name for p in PASS_TABLE if p.switch is not None
              and p.kind.is_on(row.default(p.switch, p.kind))}
        assert settings.passes == on, row.name
        assert settings.group_collectives is row.default("group_collectives")
        # pass_defaults and apply_passes' keywords are the same switches, both ways.
        switches = pass_defaults(row.name)
        assert switches == settings.pass_switches()
        back = Settings.of_switches(row.name, **switches)
        assert (back.passes, back.unroll) == (settings.passes, settings.unroll)


def test_settings_passes_is_a_frozen_set_with_one_text_in_every_process() -> None:
    settings = Settings("gpu", passes={"fuse_scans", "batch_scans"})  # type: ignore[arg-type]
    assert isinstance(settings.passes, frozenset) and type(settings.passes) is PassNames
    assert repr(settings.passes) == "frozenset({'batch_scans', 'fuse_scans'})"
    assert repr(Settings("gpu").passes) == "frozenset()"
    assert hash(settings) == hash(Settings("gpu", passes=frozenset({"batch_scans",
                                                                     "fuse_scans"})))
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.passes = frozenset()  # type: ignore[misc]
    # The passes named by the user too: a candidate overriding two options (hoisting and
    # lax.scan's unroll) must read alike in every process measuring together.
    named = Settings("tpu", explicit={"unroll_scans", "hoist_scan_inputs"})  # type: ignore[arg-type]
    assert repr(named.explicit) == "frozenset({'hoist_scan_inputs', 'unroll_scans'})"


_CANDIDATE_SETTINGS = """
import jaxpar
from jaxpar import targets
from jaxpar._options import Options
for label, overrides in sorted(targets.get("tpu").candidates.items()):
    print(label, repr(Options.create(**overrides).resolve("tpu", async_limit=2,
                                                          command_buffers="lhs")))
"""


def test_every_candidates_settings_read_alike_under_any_string_hash_seed() -> None:
    import os
    import subprocess
    import sys

    def texts(seed: str) -> str:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", _CANDIDATE_SETTINGS], env=env,
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    first = texts("1")
    assert "jaxpar, scan inputs hoisted, unrolled by 8" in first
    assert all(texts(seed) == first for seed in ("2", "12345"))


def test_leaving_out_a_rung_turns_its_rows_off() -> None:
    settings = Options().resolve("gpu", **FIXED)
    unrolling, batching, fusion = LADDER[1:]
    assert leave_out(settings, ()) is settings
    without = leave_out(settings, [unrolling, batching])
    assert without.passes == {"fuse_scans", "share_common"} and without.unroll is None
    assert leave_out(settings, [LADDER[0]]).streams_per_section == 1
    off = leave_out(settings, [fusion])
    assert "fuse_scans" not in off.passes and "share_common" not in off.passes
    # The passes that run with others follow them.
    runs = {p.name for p in PASSES if p.enabled(without)}
    assert "bound_fusions" not in runs and "inline_twin_calls" not in runs
    assert "make_loops_static" in runs


# ---------------------------------------------------------------- a pass is one row


def test_a_new_pass_row_is_enough_for_options_settings_and_validation() -> None:
    table = (*PASS_TABLE, WIDEN)
    widened = Options.for_tables(table, TARGETS)
    assert "widen_loops" in widened.names() and widened().widen_loops == "auto"
    # No target turns it on: "auto" is off everywhere, True turns it on.
    assert "widen_loops" not in widened().resolve("gpu", **FIXED).passes
    assert "widen_loops" in widened.create(widen_loops=True).resolve("cpu", **FIXED).passes
    with pytest.raises(ValueError, match="widen_loops must be True, False or 'auto'"):
        widened.create(widen_loops="yes")
    with pytest.raises(TypeError, match="did you mean 'widen_loops'"):
        widened.create(widen_loop=True)
    # The budget's ladder leaves it out with its rung; Options itself is unchanged.
    assert dict(ladder(table))["batching"] == ("batch_scans", "batch_branches",
                                               "batch_matmuls", "associative_scans",
                                               "hoist_scan_inputs", "widen_loops")
    assert "widen_loops" not in Options.names()


def test_a_new_pass_module_and_row_run_in_the_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def run(level: Level, analysis: Analysis) -> LevelResult:
        seen.append(level.path)
        return LevelResult()

    module = types.ModuleType("jaxpar.passes.widen_loops")
    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "jaxpar.passes.widen_loops", module)
    bound = jaxpar.passes._bind(WIDEN)
    assert bound.run is run and bound.name == "widen_loops" and bound.state is None
    widened = Options.for_tables((*PASS_TABLE, WIDEN), TARGETS)
    closed = jax.make_jaxpr(_two_scans)(jnp.ones(3), jnp.ones(3))
    for value, runs in ((True, True), (False, False)):
        seen.clear()
        settings = widened.create(widen_loops=value).resolve("cpu", **FIXED)
        walk_levels(closed, [p for p in (*PASSES, bound) if p.enabled(settings)],
                    Analysis(settings))
        assert bool(seen) is runs and (not runs or "" in seen)
    monkeypatch.delitem(__import__("sys").modules, "jaxpar.passes.widen_loops")
    with pytest.raises(ImportError, match=r"row 'widen_loops', and there is no module "
                                          r"jaxpar\.passes\.widen_loops: add "
                                          r"jaxpar/passes/widen_loops\.py defining run"):
        jaxpar.passes._bind(WIDEN)  # a row without its module


def test_a_pass_without_an_option_is_turned_on_by_its_row() -> None:
    # runs_with: on with any of those passes; by target: a column of its own name.
    shadow = PassRow("shadow_matmuls", "a test's pass", runs_with=("batch_matmuls",))
    quiet = PassRow("quiet_common", "a test's pass")
    table = (*PASS_TABLE, shadow, quiet)
    targets = (*TARGETS, TargetRow("npu", ("npu",), {"quiet_common": True}))
    assert shadow.switch is None and quiet.switch == "quiet_common"
    made = Options.for_tables(table, targets)
    assert "shadow_matmuls" not in made.names() and "quiet_common" not in made.names()
    on_npu = made().resolve("npu", **FIXED)
    assert on_npu.passes == {"quiet_common"} and quiet.enabled(on_npu)
    assert not shadow.enabled(on_npu)
    assert shadow.enabled(made.create(batch_matmuls=True).resolve("npu", **FIXED))


# ---------------------------------------------------------------- a target is one row


def test_a_new_target_row_is_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    npu = TargetRow("npu", ("npu", "npu_v2"), {"batch_matmuls": True, "unroll": 4})
    made = Options.for_tables(PASS_TABLE, (*TARGETS, npu))
    settings = made.create(target="npu").resolve(**FIXED)
    assert settings.target == "npu" and settings.passes == {"batch_matmuls", "unroll_scans"}
    assert settings.unroll == 4 and not settings.group_collectives
    assert made.create(target="npu", unroll=None).resolve(**FIXED).passes == {"batch_matmuls"}
    with pytest.raises(ValueError, match="target must be one of 'auto', 'gpu', 'cpu', "
                                         "'tpu', 'npu', got 'npx'"):
        made.create(target="npx")
    monkeypatch.setattr(jax, "default_backend", lambda: "npu_v2")
    assert made().resolve_target() == "npu"
    with pytest.raises(ValueError, match="target must be one of"):
        Options.create(target="npu")  # the shipped table has no such row


def test_the_tpu_defaults_are_one_row() -> None:
    # Changing what a target turns on is an edit of its row and nothing else.
    tpu = TargetRow("tpu", ("tpu",), {"batch_matmuls": True, "fuse_scans": True})
    targets = tuple(tpu if row.name == "tpu" else row for row in TARGETS)
    made = Options.for_tables(PASS_TABLE, targets)
    settings = made().resolve("tpu", **FIXED)
    assert settings.passes == {"batch_matmuls", "fuse_scans"}
    assert [p.name for p in PASSES if p.enabled(settings)] == [
        "inline_twin_calls", "make_loops_static", "fuse_scans", "batch_matmuls",
        "bound_fusions"]
    assert made().resolve("gpu", **FIXED) == Options().resolve("gpu", **FIXED)
    # The shipped row: what the TPU v5e measured paying.
    assert Options().resolve("tpu", **FIXED).passes == {"batch_scans", "unroll_scans"}


def test_option_kinds_check_and_resolve() -> None:
    switch, unroll = OptionKind.SWITCH, OptionKind.UNROLL
    assert (switch.off, unroll.off) == (False, None)
    assert switch.resolve("auto", True) is True and switch.resolve(False, True) is False
    assert unroll.resolve("auto", "cost") == "cost" and unroll.resolve(3, None) == 3
    assert unroll.is_on(0 + 1) and not unroll.is_on(None) and not switch.is_on(False)
    for bad in ("on", 1, None):
        with pytest.raises(ValueError, match="x must be True, False or 'auto'"):
            switch.check("x", bad)
    for bad in (0, True, "by cost", 1.5):
        with pytest.raises(ValueError, match="y must be 'auto'"):
            unroll.check("y", bad)
