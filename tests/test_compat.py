"""``jaxpar/_compat.py``: the shortcuts the hot paths take must agree with the full
answers they stand for, on the jax this runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.xla_metadata import set_xla_metadata

import jaxpar
from jaxpar import _compat

try:  # jax >= 0.11
    from jax.experimental.xla_metadata import xla_metadata_call
except ImportError:  # jax 0.8 - 0.10
    from jax.experimental.scheduling_groups import xla_metadata_call


def _equations(jaxpr: Any) -> Iterator[Any]:
    inner, _ = _compat.open_jaxpr(jaxpr)
    for eqn in inner.eqns:
        yield eqn
        for _, _, sub in _compat.eqn_subjaxprs(eqn):
            yield from _equations(sub)


def _placed(x: jax.Array) -> jax.Array:
    with set_xla_metadata(note="1"):
        y = x @ x
    z = xla_metadata_call(jnp.sin, _xla_stream_annotation="1", inlineable="false")(x)
    bare = xla_metadata_call(jnp.cos)(x)  # a metadata call without attributes
    w = jaxpar.on_stream(1)(lambda v: v @ v)(x)
    return y + z + bare + w


def test_has_frontend_attributes_is_the_truth_of_eqn_frontend_attributes() -> None:
    x = jnp.ones((8, 8))
    programs = [jax.make_jaxpr(_placed)(x),
                jax.make_jaxpr(jax.grad(lambda v: _placed(v).sum()))(x)]
    answers = [(_compat.has_frontend_attributes(e), bool(_compat.eqn_frontend_attributes(e)))
               for program in programs for e in _equations(program)]
    assert [a for a in answers if a[0] != a[1]] == []
    assert sum(a for a, _ in answers) >= 4  # metadata, both calls' attributes, the stream
    assert sum(not a for a, _ in answers) >= 4  # and plain equations


def _lines(x: jax.Array) -> jax.Array:
    for _ in range(3):
        x = jnp.tanh(x @ x)  # one source line, three equations each
    with jax.named_scope("scoped"):
        y = jnp.sin(x)
    return x + y


def test_equal_source_keys_have_equal_summaries() -> None:
    x = jnp.ones((4, 4))
    for program in (jax.make_jaxpr(_lines)(x),
                    jax.make_jaxpr(jax.grad(lambda v: _lines(v).sum()))(x)):
        summaries: dict[Any, str] = {}
        eqns = list(_equations(program))
        for eqn in eqns:
            summary = _compat.source_summary(eqn)
            assert summaries.setdefault(_compat.source_key(eqn), summary) == summary
        assert 1 < len(summaries) < len(eqns)  # keys repeat, and tell sources apart
