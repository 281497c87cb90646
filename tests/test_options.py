"""``jaxpar._options``: options read once (``Options.resolve`` -> ``Settings``), ``"auto"``
meaning the target's default at every level."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxpar
from jaxpar._flags import command_buffer_mode
from jaxpar._model.gpu import CommandBufferMode
from jaxpar._options import PASS_TABLE, ModePolicy, OptionKind, Options, Settings, target_row
from jaxpar.passes import pass_defaults

# ---------------------------------------------------------------- Options.resolve


def test_resolve_reads_auto_per_target():
    for target in ("gpu", "cpu", "tpu"):
        settings = Options().resolve(target, async_limit=2, command_buffers="lhs")
        row = target_row(target)
        assert settings.target == target
        assert ("fuse_scans" in settings.passes) is row.default("fuse_scans")
        assert ("batch_matmuls" in settings.passes) is row.default("batch_matmuls")
        assert ("share_common" in settings.passes) is row.default("share_common")
        assert settings.group_collectives is row.default("group_collectives")
        assert settings.unroll == row.default("unroll", OptionKind.UNROLL)
        assert ("unroll_scans" in settings.passes) is (settings.unroll is not None)
        assert "auto" not in {str(v) for v in vars_of(settings).values()}
    # Today's defaults: everything on the GPU but the measured candidates' own
    # (unroll_while_loops, hoist_scan_inputs, associative_scans: off everywhere); on the
    # TPU what the chip measured paying (identical scans batched, loops read by blocks);
    # nothing on the CPU.
    gpu = Options().resolve("gpu", async_limit=2, command_buffers="lhs")
    assert gpu.passes == {row.name for row in PASS_TABLE if row.switch is not None} - {
        "unroll_while_loops", "hoist_scan_inputs", "associative_scans"}
    assert gpu.unroll_while is None
    assert gpu.unroll == "cost" and gpu.group_collectives
    cpu = Options().resolve("cpu", async_limit=2, command_buffers="lhs")
    assert cpu.passes == frozenset() and cpu.unroll is None and not cpu.group_collectives
    tpu = Options().resolve("tpu", async_limit=2, command_buffers="lhs")
    assert tpu.passes == {"batch_scans", "unroll_scans"} and tpu.unroll == "cost"
    assert not tpu.group_collectives and tpu.explicit == frozenset()
    # A rewrite named by the user is explicit (the memory budget keeps it).
    named = Options(unroll=8, batch_scans=True).resolve("cpu", async_limit=2)
    assert named.explicit == {"unroll_scans", "batch_scans"}
    assert Options(unroll_while=4).resolve("cpu", async_limit=2).explicit == {
        "unroll_while_loops"}


def vars_of(settings: Settings) -> dict:
    return {name: getattr(settings, name) for name in settings.__dataclass_fields__}


def test_resolve_keeps_explicit_switches_and_limits_streams():
    settings = Options.create(fuse_scans=False, unroll=3, max_streams=4).resolve(
        "gpu", async_limit=3, command_buffers="off")
    assert "fuse_scans" not in settings.passes and "batch_scans" in settings.passes
    assert settings.unroll == 3 and "unroll_scans" in settings.passes
    assert settings.streams_per_section == 3
    assert settings.modes.priced is CommandBufferMode.OFF
    forced = Options.create(force_streams=True).resolve("gpu", command_buffers="lhs")
    # Forced sections are still priced (the report shows the verdict), never refused.
    assert forced.modes.priced is CommandBufferMode.LHS and forced.force_streams
    assert Options().resolve("cpu", command_buffers="lhs").modes == ModePolicy()


def test_resolve_reads_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_experimental_parallel_async_compute_limit=4 "
                                    "--xla_gpu_enable_command_buffer=")
    settings = Options.create(max_streams=8).resolve("gpu")
    assert settings.streams_per_section == 4
    assert settings.modes.priced is CommandBufferMode.OFF is command_buffer_mode()


def test_resolve_makes_one_mode_policy(monkeypatch):
    """The ``command_buffers`` option and the user's mode become one ``ModePolicy``:
    priced, chosen, the user's, compiled in."""
    monkeypatch.setenv("XLA_FLAGS", "")
    lhs, concurrent = CommandBufferMode.LHS, CommandBufferMode.CONCURRENT
    assert Options().resolve("gpu").modes == ModePolicy(lhs, choose=True, user=lhs)
    assert Options().resolve("gpu", command_buffers="lhs").modes == ModePolicy(lhs, user=lhs)
    assert Options.create(command_buffers="keep").resolve("gpu").modes == \
        ModePolicy(lhs, user=lhs)
    named = Options.create(command_buffers="concurrent").resolve("gpu")
    assert named.modes == ModePolicy(concurrent, user=lhs, compile=concurrent)
    assert Options().resolve("cpu").modes == ModePolicy()
    # Priced in another mode: only ``priced`` changes, and equal settings hash alike.
    moved = named.priced_in(lhs)
    assert moved.modes == ModePolicy(lhs, user=lhs, compile=concurrent)
    assert moved == Options.create(command_buffers="concurrent").resolve("gpu").priced_in(lhs)
    assert hash(moved) == hash(named.priced_in(lhs)) and moved != named


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


def test_pass_defaults_come_from_the_options():
    assert pass_defaults("gpu")["fuse_scans"] is target_row("gpu").default("fuse_scans")
    assert pass_defaults("cpu")["unroll"] is None
    assert pass_defaults("gpu")["unroll"] == "cost"  # one spelling of "by cost" everywhere


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
    loop_passes = functools.partial(jaxpar.passes.apply_passes, closed, fuse_scans=False,
                                    batch_scans=False, unroll="auto")
    assert loop_passes(target="cpu")[0] is closed
    assert unroll_of(loop_passes(target="gpu")[0]) == \
        unroll_of(jaxpar.passes.unroll_scans(closed)[0])
    plan = jaxpar.inspect(loop, target="cpu", unroll="cost")(jnp.ones(4), jnp.ones((1000, 4)))
    assert [d.unroll for d in plan.decisions if d.kind == "unrolled"] == [by_cost_cpu]
    assert not [d for d in jaxpar.inspect(loop, target="cpu")(jnp.ones(4), jnp.ones((1000, 4)))
                .decisions if d.kind == "unrolled"]
    with pytest.raises(ValueError, match="'cost'"):
        jaxpar.parallel_branches(loop, unroll="by cost")
