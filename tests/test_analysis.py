"""``jaxpar._analysis``: one ``Analysis`` per call, one cost model, each equation costed once."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxpar
from jaxpar import _analysis, _pipeline
from jaxpar._model import cost as _cost
from jaxpar._options import Options


def _two_scans(a, b):
    fa, _ = lax.scan(lambda c, x: (jnp.tanh(c + x), None), a, jnp.ones((5, 3)))
    fb, _ = lax.scan(lambda c, x: (jnp.sin(c * x), None), b, jnp.ones((5, 3)))
    return fa + fb


def _args():
    return jnp.ones(3), jnp.full(3, 0.5)


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
    original_trace = _pipeline.trace

    def trace(fun, sig):
        out = original_trace(fun, sig)
        traced.append(weakref.ref(out.jaxpr))
        return out

    monkeypatch.setattr(_pipeline, "trace", trace)
    plan = jaxpar.inspect(_two_scans, target="gpu")(*_args())
    assert plan.sections is not None
    gc.collect()
    assert seen and all(ref() is None for ref in seen)
    assert traced and all(ref() is None for ref in traced)  # nothing module-global holds it


def test_analysis_takes_settings():
    with pytest.raises(TypeError, match="Settings"):
        _analysis.Analysis(Options())  # type: ignore[arg-type]


def test_other_settings_share_the_shared_memos_and_keep_their_own():
    """``with_settings`` (another CUDA-graph mode): the ``shared`` memos, a later stage's
    included (``shared.of``), are the very objects of the first analysis; the walk's
    ``memos`` are its own; another call's analysis shares nothing."""
    from jaxpar._model.gpu import CommandBufferMode
    from jaxpar._plan.level import PlanMemos

    settings = Options().resolve("gpu")
    first = _analysis.Analysis(settings)
    other = first.with_settings(settings.priced_in(CommandBufferMode.CONCURRENT_REGIONS))
    (eqn,) = jax.make_jaxpr(jnp.sin)(1.0).eqns
    first.shared.of(PlanMemos).blocked_reason.set(eqn, "effectful")
    first.memos.pass_visits.set(eqn, True, extra="fuse_scans")
    first.shared.pass_states["fuse_scans"] = state = object()
    assert other.shared.of(PlanMemos).blocked_reason.get(eqn) == "effectful"
    assert other.shared.pass_states["fuse_scans"] is state
    assert other.memos.pass_visits.get(eqn, extra="fuse_scans") is None
    fresh = _analysis.Analysis(settings)
    assert fresh.shared.of(PlanMemos).blocked_reason.get(eqn) is None
    assert not fresh.shared.pass_states
