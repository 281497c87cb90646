"""``jaxpar._flags``: the XLA flags a plan wants (``xla_flags``) and the check that they were
applied before JAX's backend started (``check_flags_applied``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxpar import _compat, _flags


def test_xla_flags():
    flags = _flags.xla_flags()
    assert "--xla_gpu_dot_merger_threshold_mb=0" in flags
    assert "--xla_gpu_experimental_parallel_async_compute_limit=2" in flags
    more = _flags.xla_flags(multi_stream_collectives=True, command_buffers=True,
                            async_compute_limit=4)
    assert "--xla_gpu_experimental_enable_collective_multi_streaming=true" in more
    assert "--xla_gpu_enable_command_buffer=+WHILE" in more
    assert _flags.flags_as_options(more)["xla_gpu_experimental_parallel_async_compute_limit"] == 4
    with pytest.raises(ValueError):
        _flags.xla_flags(async_compute_limit=0)


@pytest.mark.parametrize(("kwargs", "match"), [
    # A CUDA-graph mode name is parallel_branches' command_buffers, not this switch.
    ({"command_buffers": "lhs"}, r"command_buffers must be True or False.*parallel_branches"),
    ({"multi_stream_collectives": "yes"}, r"multi_stream_collectives must be True or False"),
    ({"collectives": 1}, r"collectives must be True or False"),
    ({"async_compute_limit": "4"}, r"async_compute_limit must be an int"),
    ({"collective_overlap_limit": 2.5}, r"collective_overlap_limit must be an int"),
])
def test_xla_flags_refuses_wrong_types(kwargs, match):
    with pytest.raises(TypeError, match=match):
        _flags.xla_flags(**kwargs)


def test_xla_flags_follow_the_plan(monkeypatch):
    import jaxpar

    def four(x, w1, w2, w3, w4):
        return sum(jnp.tanh(jnp.tanh(x @ w) @ w) for w in (w1, w2, w3, w4))

    args = [jnp.ones((512, 512)) * 0.01] * 5
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_experimental_parallel_async_compute_limit=4")
    plan = jaxpar.inspect(four, target="gpu", batch_branches=False,
                          batch_matmuls=False, force_streams=True)(*args)
    assert max(len(s.regions) for s in plan.sections) == 4
    flags = jaxpar.xla_flags(plan)
    # No collectives: no DotMerger flag; four streams: a limit of four.
    assert "--xla_gpu_dot_merger_threshold_mb=0" not in flags
    assert "--xla_gpu_experimental_parallel_async_compute_limit=4" in flags
    assert jaxpar.check_flags_applied(flags)
    assert "--xla_gpu_experimental_parallel_async_compute_limit=3" in jaxpar.xla_flags(
        plan, async_compute_limit=3)


def test_check_flags_applied(monkeypatch):
    flags = _flags.xla_flags()
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
    assert _flags.check_flags_applied(flags)
    monkeypatch.setenv("XLA_FLAGS", "")
    jax.devices()  # make sure the backend has started
    assert _compat.backends_initialized()
    with pytest.warns(_flags.FlagsNotAppliedWarning, match="already started"):
        assert not _flags.check_flags_applied(flags)
    with pytest.raises(RuntimeError, match="not in XLA_FLAGS"):
        _flags.check_flags_applied(flags, error=True)


@pytest.mark.parametrize("check", [_flags.flags_as_options, _flags.check_flags_applied])
def test_flags_refuse_one_string(check):
    # A string is a sequence of one-character "flags": XLA_FLAGS's text passed as it is
    # gave {'-': '', 'x': '', ...} (and check_flags_applied warned about '--x=', ...).
    with pytest.raises(TypeError, match=r"list of '--name=value' flags.*\.split\(\)"):
        check("--xla_gpu_enable_command_buffer= --xla_foo=1")
    assert _flags.flags_as_options("--a=1 --b=true".split()) == {"a": 1, "b": True}
