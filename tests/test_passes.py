"""``jaxpar.passes``: the pass table (``PASSES``, ``run_pass``, ``run_passes``), one name per pass,
every row through the pass checker, and the deprecated names from before the passes outgrew
loops."""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxpar
from jaxpar._analysis import Analysis
from jaxpar._options import Settings
from jaxpar.passes import (
    PASSES,
    DecisionKind,
    Pass,
    PassDecision,
    apply_passes,
    batch_scans,
    fuse_scans,
    pass_defaults,
    run_pass,
    run_passes,
    unroll_scans,
)


def _two_scans(a, b):
    fa, _ = lax.scan(lambda c, x: (jnp.tanh(c + x), None), a, jnp.ones((5, 3)))
    fb, _ = lax.scan(lambda c, x: (jnp.sin(c * x), None), b, jnp.ones((5, 3)))
    return fa + fb


def _args():
    return jnp.ones(3), jnp.full(3, 0.5)


# ---------------------------------------------------------------- one name per pass


def test_each_pass_has_one_name():
    # Row, module, function (and option, where there is one) share the name.
    for row in PASSES:
        module = importlib.import_module(f"jaxpar.passes.{row.name}")
        assert row.run is module.run, row.name
        assert callable(getattr(jaxpar.passes, row.name)), row.name


def test_a_row_without_a_written_function_gets_one_made_from_the_row():
    # What a new pass gets (_one_pass_function): the written ones' results, for a switch
    # and for an option carrying a value; and every row is exported.
    by_name = {row.name: row for row in jaxpar._options.PASS_TABLE}
    made = jaxpar.passes._one_pass_function(by_name["fuse_scans"])
    closed = jax.make_jaxpr(_two_scans)(*_args())
    assert str(made(closed)) == str(fuse_scans(closed)) != str((closed, ()))
    assert made.__name__ == "fuse_scans" and "scans run side by side" in made.__doc__

    def loop(x):
        return lax.while_loop(lambda c: c[0] < 10.0, lambda c: (c[0] + c[1], c[1]), x)

    looped = jax.make_jaxpr(loop)((jnp.float32(0.0), jnp.float32(1.5)))
    unroll = jaxpar.passes._one_pass_function(by_name["unroll_while_loops"])
    written = jaxpar.passes.unroll_while_loops(looped, unroll_while=2)
    assert str(unroll(looped, unroll_while=2)) == str(written) != str((looped, ()))
    with pytest.raises(TypeError, match=r"unknown unroll_while_loops option.*'unroll'"):
        unroll(looped, unroll=2)
    assert {row.name for row in PASSES} <= set(jaxpar.passes.__all__)


# ---------------------------------------------------------------- deprecated names

# The names from before the passes outgrew loops: each still works until 0.3.0, and warns
# naming its replacement.
DEPRECATED = {"LoopPass": "Pass", "LoopDecision": "PassDecision",
              "apply_loop_passes": "apply_passes", "loop_defaults": "pass_defaults",
              "share_common_subexpressions": "share_common"}
# Old names whose keywords were renamed with them (``fuse``, ``batch``: ``fuse_scans``,
# ``batch_scans``, as the options of ``parallel_branches`` say).
KEYWORDS_RENAMED = {"apply_loop_passes", "loop_defaults"}


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_old_names_warn_and_are_the_new_ones(old):
    new = DEPRECATED[old]
    with pytest.warns(DeprecationWarning, match=rf"jaxpar\.passes\.{old} is deprecated "
                      rf"and goes in jaxpar 0\.3\.0; use jaxpar\.passes\.{new}$"):
        value = getattr(jaxpar.passes, old)
    if old in KEYWORDS_RENAMED:  # the old keywords: a wrapper, checked below
        assert value is not getattr(jaxpar.passes, new) and callable(value)
    else:
        assert value is getattr(jaxpar.passes, new)
    assert old not in jaxpar.passes.__all__ and new in jaxpar.passes.__all__


def test_importing_an_old_name_warns_at_the_import():
    with pytest.warns(DeprecationWarning, match="use jaxpar.passes.Pass$") as caught:
        from jaxpar.passes import LoopPass
    assert LoopPass is Pass
    assert caught[0].filename == __file__  # the warning points at the importing line


def test_old_functions_give_the_new_ones_results():
    closed = jax.make_jaxpr(_two_scans)(*_args())
    with pytest.warns(DeprecationWarning, match="use jaxpar.passes.pass_defaults"):
        old_defaults = jaxpar.passes.loop_defaults("gpu")
    # The old dict keeps its old keys (``fuse``, ``batch``), the old function takes them.
    new_defaults = pass_defaults("gpu")
    assert old_defaults["fuse"] is new_defaults["fuse_scans"] is True
    assert old_defaults["batch"] is new_defaults["batch_scans"] is True
    assert {k: v for k, v in old_defaults.items() if k not in ("fuse", "batch")} == {
        k: v for k, v in new_defaults.items() if k not in ("fuse_scans", "batch_scans")}
    with pytest.warns(DeprecationWarning, match="use jaxpar.passes.apply_passes"):
        old, old_decisions = jaxpar.passes.apply_loop_passes(closed, **old_defaults,
                                                             target="gpu")
    new, new_decisions = apply_passes(closed, **pass_defaults("gpu"), target="gpu")
    assert new is not closed and str(old) == str(new)
    assert [d.kind for d in old_decisions] == [d.kind for d in new_decisions]
    assert DecisionKind.FUSED in [d.kind for d in new_decisions]
    twins = jax.make_jaxpr(lambda x: jnp.sin(x) + jnp.sin(x))(jnp.ones(3))
    with pytest.warns(DeprecationWarning, match="use jaxpar.passes.share_common"):
        shared, _ = jaxpar.passes.share_common_subexpressions(twins)
    assert [e.primitive.name for e in shared.jaxpr.eqns].count("sin") == 1
    assert str(shared) == str(jaxpar.passes.share_common(twins)[0])
    with pytest.warns(DeprecationWarning, match="use jaxpar.passes.PassDecision$"):
        assert all(isinstance(d, jaxpar.passes.LoopDecision) for d in old_decisions)


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'LoopPasses'"):
        jaxpar.passes.LoopPasses  # noqa: B018


# ---------------------------------------------------------------- the pass table


def test_table_rows_are_unique_and_run_in_order():
    names = [p.name for p in PASSES]
    assert len(set(names)) == len(names)
    assert names == ["share_common", "inline_twin_calls", "make_loops_static", "batch_scans",
                     "fuse_scans", "batch_branches", "batch_matmuls", "bound_fusions",
                     "associative_scans", "hoist_scan_inputs", "unroll_scans",
                     "unroll_while_loops"]


def test_decisions_carry_the_pass_name_and_an_enum_kind():
    closed = jax.make_jaxpr(_two_scans)(*_args())
    _, decisions = run_passes(closed, target="gpu")
    assert decisions
    for d in decisions:
        assert isinstance(d, PassDecision)
        assert isinstance(d.kind, DecisionKind)
        assert d.pass_name in {p.name for p in PASSES}
    fused = [d for d in decisions if d.kind == DecisionKind.FUSED]
    assert fused and all(d.pass_name == "fuse_scans" for d in fused)
    assert DecisionKind.FUSED == "fused"  # still compares equal to the old strings


def test_run_pass_is_the_public_functions():
    closed = jax.make_jaxpr(_two_scans)(*_args())
    via_table, table_decisions = run_pass("fuse_scans", closed, settings=Settings(
        target="gpu", passes=frozenset({"fuse_scans"})))
    via_function, function_decisions = fuse_scans(closed)
    assert str(via_table) == str(via_function)
    assert [d.kind for d in table_decisions] == [d.kind for d in function_decisions]
    unrolled, _ = unroll_scans(closed, unroll=5)
    assert all(e.params["unroll"] == 5 for e in unrolled.jaxpr.eqns
               if e.primitive.name == "scan")
    same, decisions = batch_scans(closed)  # different bodies: nothing to batch
    assert same is closed and decisions == ()


def test_run_passes_names_and_errors():
    closed = jax.make_jaxpr(_two_scans)(*_args())
    only_static, decisions = run_passes(closed, ["make_loops_static"], target="gpu")
    assert only_static is closed and decisions == ()
    with pytest.raises(ValueError, match="unknown pass"):
        run_passes(closed, ["fuse_scan"], target="gpu")
    with pytest.raises(ValueError, match="target"):
        run_passes(closed, target="abacus")
    with pytest.raises(TypeError, match="did you mean 'fuse_scans'"):
        run_passes(closed, target="gpu", fuse_scan=True)
    with pytest.raises(ValueError, match="unroll"):
        apply_passes(closed, fuse_scans=False, batch_scans=False, unroll=0, target="gpu")


def test_run_passes_keeps_values():
    closed = jax.make_jaxpr(_two_scans)(*_args())
    new, _ = run_passes(closed, target="gpu")
    expected = jax.jit(_two_scans)(*_args())
    got = jax.jit(jax.extend.core.jaxpr_as_fun(new))(*_args())[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6)


# ---------------------------------------------------------------- every row through the checker


def _every_pass_program(ws, x, h):
    """Something for each row: twin equations, a counting while, identical and different
    scans, identical ensemble members, same-shaped matmuls of different members, twin
    nested jit calls (the counting while is unroll_while_loops' too, run alone)."""
    shared = jnp.sin(x) + jnp.sin(x)  # share_common: two equal sin
    count = lax.fori_loop(0, jnp.int32(5), lambda i, c: c + i, jnp.int32(1))  # static while
    body = lambda c, xs: (jnp.tanh(c @ ws[0] + xs), None)
    s1, _ = lax.scan(body, h, jnp.ones((6, 8)))  # two identical scans
    s2, _ = lax.scan(body, h * 2.0, jnp.ones((6, 8)))
    s3, _ = lax.scan(lambda c, xs: (jnp.sin(c) * (xs @ ws[1]), None), h,  # another, and
                     jnp.ones((4, 8)))  # a matmul reading no carry (hoist_scan_inputs)
    s4, _ = lax.scan(lambda c, xs: (c * 0.5 + xs, None), h, jnp.ones((5, 8)))  # linear
    members = [jnp.tanh(jnp.tanh(x @ w) @ w) for w in ws]  # identical members
    mixed = jnp.tanh(x @ ws[0]).sum() + jnp.sin(x @ ws[1]).sum()  # different members
    twins = _jitted_layer(x, ws[2]) * _jitted_layer(x * 2.0, ws[3])  # twin nested jits
    return shared.sum() * count + s1.sum() + s2.sum() + s3.sum() + s4.sum() + sum(
        m.sum() for m in members) + mixed + twins.sum()


_jitted_layer = jax.jit(lambda x, w: jnp.sin(x @ w))


@pytest.mark.parametrize("row", PASSES, ids=lambda row: row.name)
def test_every_row_passes_the_checker(row):
    from pass_checker import check_pass

    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(k, (8, 8)) * 0.3 for k in jax.random.split(key, 4)]
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    h = jnp.linspace(-1.0, 1.0, 8)
    settings = Settings(target="gpu", passes=frozenset({
        "share_common", "batch_scans", "fuse_scans", "batch_branches", "batch_matmuls",
        "unroll_scans", "unroll_while_loops", "hoist_scan_inputs", "associative_scans"}),
        unroll="cost",
        unroll_while=2)

    def run(closed):
        if row.after:  # what it works on first (alone it has nothing to work on)
            return run_passes(closed, [*row.after, row.name], analysis=Analysis(settings))
        return run_pass(row.name, closed, settings=settings)

    # 40 identical members summed: more slices in one chain than bound_fusions allows.
    program = _many_members_program if row.after else _every_pass_program
    result = check_pass(run, program, ws, x, h,
                        tolerance={"rtol": 2e-5, "atol": 2e-5},
                        grad_tolerance={"rtol": 2e-4, "atol": 2e-5})
    assert result.new is not result.closed, f"{row.name} changed nothing here"
    assert {d.pass_name for d in result.decisions} <= {row.name, *row.after}
    if row.after:  # its own decision, beside those of the passes it works after
        assert row.name in {d.pass_name for d in result.decisions}


def _many_members_program(ws, x, h):
    return sum(jnp.tanh(x * (1.0 + 0.01 * i) @ ws[i % 4]) for i in range(40)) + h


def test_plan_dicts_hold_plain_strings_and_the_pass_name():
    plan = jaxpar.inspect(_two_scans, target="gpu")(*_args())
    decisions = plan.to_dict()["decisions"]
    assert decisions
    for decision in decisions:
        assert type(decision["kind"]) is str
        assert decision["pass"] in {p.name for p in PASSES}


def test_stage_is_the_deprecated_name_of_a_decisions_launch_depth():
    """``PassDecision.depth`` is a matmul group's launch depth; the old name ``stage``
    (one release more) warns and reads it, and ``to_dict`` carries both keys."""
    ws = jnp.stack([jnp.eye(8) * (1.0 + 0.1 * i) for i in range(4)])
    plan = jaxpar.inspect(_many_members_program, target="gpu", command_buffers="lhs")(
        ws, jnp.ones((8, 8)), jnp.ones((8, 8)))
    groups = [d for d in plan.decisions if d.kind == DecisionKind.BATCHED_MATMULS]
    assert groups and all(d.depth == 1 for d in groups), str(plan)
    for d in groups:
        with pytest.warns(DeprecationWarning, match=r"PassDecision\.stage .*PassDecision\.depth"):
            assert d.stage == d.depth
    for entry in plan.to_dict()["decisions"]:
        assert entry["stage"] == entry["depth"]
    assert PassDecision("/", DecisionKind.FUSED, (), (), (), None, None, None, "").depth is None


# ---------------------------------------------------------------- the walk's revisits


def _nested_scans(a, b):
    def body(c, x):  # a body with two scans of its own, fused inside it
        p, _ = lax.scan(lambda s, y: (jnp.tanh(s + y), None), c, jnp.ones((4, 3)))
        q, _ = lax.scan(lambda s, y: (jnp.sin(s * y), None), c, jnp.ones((4, 3)))
        return p + q + x, None

    out, _ = lax.scan(body, a, jnp.ones((3, 3)))
    return _two_scans(out, b) + jnp.cos(a) + jnp.cos(a)


def test_revisits_of_barren_levels_change_nothing(monkeypatch):
    """A pass that changed nothing at a level (and reported only what it left alone) is
    not run again on that very level and path in the walk: the rewritten program and
    the decisions are exactly those of a walk that runs it again, in every mode."""
    from helpers.benchmarks import load_benchmark

    import jaxpar.passes as passes
    from jaxpar.passes import _walk

    overhead = load_benchmark("overhead")
    programs = [(_two_scans, _args()), (_nested_scans, _args()),
                (overhead.build_program(400), overhead.program_args())]

    def walk(fn, args, shortcut, mode):
        runs = []

        def counted(row):
            def run(level, analysis):
                runs.append(row.name)
                return row.run(level, analysis)
            return dataclasses.replace(row, run=run)

        with monkeypatch.context() as patch:
            patch.setattr(passes, "PASSES", tuple(counted(row) for row in passes.PASSES))
            if not shortcut:
                patch.setattr(_walk, "_barren", lambda step: False)
            new, decisions = run_passes(jax.make_jaxpr(fn)(*args), target="gpu",
                                        command_buffers=mode)
        return str(new), decisions, len(runs)

    for fn, args in programs:
        for mode in ("lhs", "concurrent"):
            text, decisions, runs = walk(fn, args, True, mode)
            text_again, decisions_again, runs_again = walk(fn, args, False, mode)
            assert text == text_again and decisions == decisions_again
            assert runs < runs_again


def _fused_with_remainder(a, b):
    def body(c, _):  # three inner scans of one length: fused, then their matmuls batched
        # (one matmul per member: by batch_matmuls)
        outs = [lax.scan(lambda s, _, f=f: (f(s @ s), None), c, None, length=2)[0]
                for f in (jnp.tanh, jnp.sin, jnp.cos)]
        return sum(outs), None

    # Unequal lengths: fused for two trips, and a remainder scan for the third.
    return lax.scan(body, a, None, length=3)[0] + lax.scan(body, b, None, length=2)[0]


def test_produced_reaches_into_bodies_traced_afresh(monkeypatch):
    """A decision's ``produced`` lists every equation of the rewritten program made by it,
    at any depth: also in a remainder scan's body, whose equations the rewrite traced
    afresh (no records of their own) around the inner scan bodies already rewritten.
    Reference: the records read at every nested level."""
    from jaxpar import _compat
    from jaxpar.passes import _protocol, _splice

    def every_level(self, jaxpr, path, found):
        inner, _ = _compat.open_jaxpr(jaxpr)
        for index, eqn in enumerate(inner.eqns):
            for number, holds in sorted(self.get(eqn)):
                found.setdefault(number, []).append(_protocol.Product(path or "/", index, holds))
            for name, item, sub in _compat.eqn_subjaxprs(eqn):
                label = f"{name}[{item}]" if item is not None else name
                every_level(self, sub, f"{path}/{eqn.primitive.name}#{index}.{label}", found)

    a = jnp.ones((16, 16))
    closed = jax.make_jaxpr(_fused_with_remainder)(a, a)
    for mode in ("lhs", "concurrent"):
        new, decisions = run_passes(closed, target="gpu", command_buffers=mode)
        with monkeypatch.context() as patch:
            patch.setattr(_splice.EqnOrigins, "_collect", every_level)
            new_again, decisions_again = run_passes(closed, target="gpu", command_buffers=mode)
        assert str(new) == str(new_again) and decisions == decisions_again
        # The first body's batched matmuls are in the remainder scan's body (equation
        # 1's), below an inner scan that trace bound afresh.
        batched = [d for d in decisions if d.kind in (DecisionKind.BATCHED_SUBGRAPHS,
                                                      DecisionKind.BATCHED_MATMULS)]
        assert "/scan#1.jaxpr/scan#0.jaxpr" in {p.location for d in batched
                                                for p in d.produced}
