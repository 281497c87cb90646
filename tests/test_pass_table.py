"""Options read once (``Options.resolve``), one ``Analysis`` per call, passes as a table."""

from __future__ import annotations

import functools
import gc
import importlib
import weakref

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxpar
from jaxpar import _analysis, _api, _cost
from jaxpar._flags import command_buffer_mode
from jaxpar._gpu_model import CommandBufferMode
from jaxpar._options import TARGET_DEFAULTS, Options, Settings
from jaxpar.passes import (
    PASSES,
    DecisionKind,
    PassDecision,
    apply_loop_passes,
    batch_scans,
    fuse_scans,
    loop_defaults,
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


# ---------------------------------------------------------------- Options.resolve


def test_resolve_reads_auto_per_target():
    for target in ("gpu", "cpu", "tpu"):
        settings = Options().resolve(target, async_limit=2, command_buffers="lhs")
        defaults = TARGET_DEFAULTS[target]
        assert settings.target == target
        assert settings.fuse_scans is defaults["fuse_scans"]
        assert settings.batch_matmuls is defaults["batch_matmuls"]
        assert settings.group_collectives is defaults["group_collectives"]
        assert settings.unroll == defaults["unroll"]
        assert "auto" not in {str(v) for v in vars_of(settings).values()}


def vars_of(settings: Settings) -> dict:
    return {name: getattr(settings, name) for name in settings.__dataclass_fields__}


def test_resolve_keeps_explicit_switches_and_limits_streams():
    settings = Options.create(fuse_scans=False, unroll=3, max_streams=4).resolve(
        "gpu", async_limit=3, command_buffers="off")
    assert settings.fuse_scans is False and settings.unroll == 3
    assert settings.streams_per_section == 3
    assert settings.command_buffers is CommandBufferMode.OFF
    forced = Options.create(force_streams=True).resolve("gpu", command_buffers="lhs")
    # Forced sections are still priced (the report shows the verdict), never refused.
    assert forced.command_buffers is CommandBufferMode.LHS and forced.force_streams
    assert Options().resolve("cpu", command_buffers="lhs").command_buffers is None


def test_resolve_reads_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_experimental_parallel_async_compute_limit=4 "
                                    "--xla_gpu_enable_command_buffer=")
    settings = Options.create(max_streams=8).resolve("gpu")
    assert settings.streams_per_section == 4
    assert settings.command_buffers is CommandBufferMode.OFF is command_buffer_mode()


def test_resolve_rejects_bad_values():
    with pytest.raises(ValueError, match="target must be one of"):
        Options().resolve("abacus")
    with pytest.raises(ValueError, match="async_limit"):
        Options().resolve("gpu", async_limit=0)
    with pytest.raises(ValueError, match="command_buffers"):
        Options().resolve("gpu", command_buffers="sometimes")


def test_settings_are_hashable_and_frozen():
    settings = Options().resolve("gpu", async_limit=2, command_buffers="lhs")
    assert hash(settings) == hash(Options().resolve("gpu", async_limit=2,
                                                   command_buffers="lhs"))
    with pytest.raises(AttributeError):
        settings.target = "cpu"  # type: ignore[misc]


def test_loop_defaults_come_from_the_options():
    assert loop_defaults("gpu")["fuse"] is TARGET_DEFAULTS["gpu"]["fuse_scans"]
    assert loop_defaults("cpu")["unroll"] is None
    assert loop_defaults("gpu")["unroll"] == "cost"  # one spelling of "by cost" everywhere


def test_auto_means_the_targets_default_at_every_level():
    # "auto" is the target's default in parallel_branches and in the pass functions alike;
    # "cost" asks the cost model on any target.
    def loop(c, xs):
        return lax.scan(lambda carry, x: (0.5 * carry + jnp.sin(x), None), c, xs)[0]

    closed = jax.make_jaxpr(loop)(jnp.ones(4), jnp.ones((1000, 4)))

    def unroll_of(new):
        (scan,) = [e for e in new.jaxpr.eqns if e.primitive.name == "scan"]
        return scan.params["unroll"]

    assert jaxpar.passes.unroll_scans(closed, unroll="auto", target="cpu")[0] is closed
    by_cost_cpu = unroll_of(jaxpar.passes.unroll_scans(closed, unroll="cost", target="cpu")[0])
    assert by_cost_cpu > 1
    assert unroll_of(jaxpar.passes.unroll_scans(closed, unroll="auto", target="gpu")[0]) == \
        unroll_of(jaxpar.passes.unroll_scans(closed, unroll="cost", target="gpu")[0]) > 1
    loop_passes = functools.partial(jaxpar.passes.apply_loop_passes, closed, fuse=False,
                                    batch=False, unroll="auto")
    assert loop_passes(target="cpu")[0] is closed
    assert unroll_of(loop_passes(target="gpu")[0]) == \
        unroll_of(jaxpar.passes.unroll_scans(closed)[0])
    plan = jaxpar.inspect(loop, target="cpu", unroll="cost")(jnp.ones(4), jnp.ones((1000, 4)))
    assert [d.unroll for d in plan.loops if d.kind == "unrolled"] == [by_cost_cpu]
    assert not [d for d in jaxpar.inspect(loop, target="cpu")(jnp.ones(4), jnp.ones((1000, 4)))
                .loops if d.kind == "unrolled"]
    with pytest.raises(ValueError, match="'cost'"):
        jaxpar.parallel_branches(loop, unroll="by cost")


def test_each_pass_has_one_name():
    # Row, module, function (and option, where there is one) share the name.
    for row in PASSES:
        module = importlib.import_module(f"jaxpar.passes.{row.name}")
        assert row.run is module.run, row.name
        assert callable(getattr(jaxpar.passes, row.name)), row.name
    assert jaxpar.passes.share_common_subexpressions is jaxpar.passes.share_common
    assert jaxpar.passes.LoopPass is jaxpar.passes.Pass
    assert jaxpar.passes.LoopDecision is jaxpar.passes.PassDecision


# ---------------------------------------------------------------- the pass table


def test_table_rows_are_unique_and_run_in_order():
    names = [p.name for p in PASSES]
    assert len(set(names)) == len(names)
    assert names == ["share_common", "inline_twin_calls", "make_loops_static", "batch_scans",
                     "fuse_scans", "batch_branches", "batch_matmuls", "unroll_scans"]


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
        target="gpu", fuse_scans=True))
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
        apply_loop_passes(closed, fuse=False, batch=False, unroll=0, target="gpu")


def test_run_passes_keeps_values():
    closed = jax.make_jaxpr(_two_scans)(*_args())
    new, _ = run_passes(closed, target="gpu")
    expected = jax.jit(_two_scans)(*_args())
    got = jax.jit(jax.extend.core.jaxpr_as_fun(new))(*_args())[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6)


# ---------------------------------------------------------------- one Analysis per call


def test_one_cost_model_per_inspect(monkeypatch):
    made = []
    original = _cost.CostModel.__init__

    def counting(self, profile):
        made.append(profile)
        original(self, profile)

    monkeypatch.setattr(_cost.CostModel, "__init__", counting)
    jaxpar.inspect(_two_scans, target="gpu")(*_args())
    assert len(made) == 1


def test_each_equation_is_costed_once_per_inspect(monkeypatch):
    computed = []
    original = _cost.CostModel.eqn_cost

    def counting(self, eqn):
        if eqn not in self._eqn_costs:  # the memo keeps each eqn alive: ids stay unique
            computed.append(id(eqn))
        return original(self, eqn)

    monkeypatch.setattr(_cost.CostModel, "eqn_cost", counting)
    jaxpar.inspect(_two_scans, target="gpu")(*_args())
    assert computed and len(computed) == len(set(computed))


def test_the_analysis_dies_with_the_call(monkeypatch):
    seen = []
    original = _analysis.Analysis.__init__

    def record(self, settings):
        original(self, settings)
        seen.append(weakref.ref(self))

    monkeypatch.setattr(_analysis.Analysis, "__init__", record)
    traced = []
    original_trace = _api.trace

    def trace(fun, sig):
        out = original_trace(fun, sig)
        traced.append(weakref.ref(out.jaxpr))
        return out

    monkeypatch.setattr(_api, "trace", trace)
    plan = jaxpar.inspect(_two_scans, target="gpu")(*_args())
    assert plan.sections is not None
    gc.collect()
    assert seen and all(ref() is None for ref in seen)
    assert traced and all(ref() is None for ref in traced)  # nothing module-global holds it


def test_analysis_takes_settings():
    with pytest.raises(TypeError, match="Settings"):
        _analysis.Analysis(Options())  # type: ignore[arg-type]


# ---------------------------------------------------------------- every row through the checker


def _every_pass_program(ws, x, h):
    """Something for each row: twin equations, a counting while, identical and different
    scans, identical ensemble members, same-shaped matmuls of different members, twin
    nested jit calls."""
    shared = jnp.sin(x) + jnp.sin(x)  # share_common: two equal sin
    count = lax.fori_loop(0, jnp.int32(5), lambda i, c: c + i, jnp.int32(1))  # static while
    body = lambda c, xs: (jnp.tanh(c @ ws[0] + xs), None)
    s1, _ = lax.scan(body, h, jnp.ones((6, 8)))  # two identical scans
    s2, _ = lax.scan(body, h * 2.0, jnp.ones((6, 8)))
    s3, _ = lax.scan(lambda c, xs: (jnp.sin(c) * xs, None), h, jnp.ones((4, 8)))  # another
    members = [jnp.tanh(jnp.tanh(x @ w) @ w) for w in ws]  # identical members
    mixed = jnp.tanh(x @ ws[0]).sum() + jnp.sin(x @ ws[1]).sum()  # different members
    twins = _jitted_layer(x, ws[2]) * _jitted_layer(x * 2.0, ws[3])  # twin nested jits
    return shared.sum() * count + s1.sum() + s2.sum() + s3.sum() + sum(
        m.sum() for m in members) + mixed + twins.sum()


_jitted_layer = jax.jit(lambda x, w: jnp.sin(x @ w))


@pytest.mark.parametrize("row", PASSES, ids=lambda row: row.name)
def test_every_row_passes_the_checker(row):
    from pass_checker import check_pass

    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(k, (8, 8)) * 0.3 for k in jax.random.split(key, 4)]
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    h = jnp.linspace(-1.0, 1.0, 8)
    settings = Settings(target="gpu", share_common=True, batch_scans=True, fuse_scans=True,
                        batch_branches=True, batch_matmuls=True, unroll="cost")

    def run(closed):
        return run_pass(row.name, closed, settings=settings)

    result = check_pass(run, _every_pass_program, ws, x, h,
                        tolerance={"rtol": 2e-5, "atol": 2e-5},
                        grad_tolerance={"rtol": 2e-4, "atol": 2e-5})
    assert result.new is not result.closed, f"{row.name} changed nothing here"
    assert {d.pass_name for d in result.decisions} <= {row.name}


def test_plan_dicts_hold_plain_strings_and_the_pass_name():
    plan = jaxpar.inspect(_two_scans, target="gpu")(*_args())
    loops = plan.to_dict()["loops"]
    assert loops
    for loop in loops:
        assert type(loop["kind"]) is str
        assert loop["pass"] in {p.name for p in PASSES}
