"""The analysis of one signature (``jaxpar._pipeline``): ``analyse`` and its ``Prepared``."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.programs import LOOPS_OFF, deep_birnn, deep_birnn_args, two_scans, two_scans_args
from jax import export

from jaxpar import _compat, _pipeline
from jaxpar._options import Options
from jaxpar._pipeline import Prepared, analyse
from jaxpar._trace import Signature, StaticArgs, abstract, split_arguments


def signature_of(fn: Any, *args: Any) -> Signature:
    layout, leaves = split_arguments(fn, args, {}, StaticArgs.resolve(fn, None, None),
                                     allow_abstract=True, api="inspect")
    return Signature(layout, tuple(abstract(leaf) for leaf in leaves))


def settings_of(target: str, **options: Any) -> Any:
    return Options.create(target=target, **options).resolve(target)


def scans(jaxpr: Any) -> int:
    return sum(eqn.primitive.name == "scan" for eqn in _compat.open_jaxpr(jaxpr)[0].eqns)


def test_analyse_returns_the_plan_and_the_rewritten_program() -> None:
    """Two independent scans on the GPU: fused into one scan by the passes; the record holds
    the rewritten program, its plan, the passes' decisions, the mode and the memory."""
    args = two_scans_args()
    sig = signature_of(two_scans, *args)
    prepared = analyse(two_scans, sig, settings_of("gpu"))
    assert isinstance(prepared, Prepared)
    traced = jax.make_jaxpr(two_scans)(*args)
    assert scans(traced) == 2 and scans(prepared.traced.jaxpr) == 1
    assert any(d.kind.value == "fused" for d in prepared.decisions)
    assert prepared.plan.jaxpr is prepared.traced.jaxpr  # the plan is of that program
    assert prepared.target == "gpu" and prepared.mode is not None
    assert prepared.xla_options == prepared.mode.xla_options
    assert prepared.memory is not None and prepared.memory.plain_bytes > 0
    assert prepared.emitter.plan is prepared.plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.plan = None  # type: ignore[misc]


def test_analyse_plans_streams_where_asked_and_the_emission_computes_the_same() -> None:
    args = two_scans_args()
    prepared = analyse(two_scans, signature_of(two_scans, *args),
                       settings_of("gpu", **LOOPS_OFF))
    ((section,),) = [prepared.plan.sections]
    assert len(section.regions) == 2 and prepared.plan.changes_anything
    emitted = jax.make_jaxpr(lambda *leaves: prepared.run(leaves, True))(*args)
    assert "stream" in str(emitted)
    got = jax.jit(lambda *leaves: prepared.run(leaves, True))(*args)
    for mine, want in zip(got, jax.jit(two_scans)(*args), strict=True):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(want), rtol=1e-6)


def test_other_targets_get_no_mode_and_no_streams() -> None:
    args = two_scans_args()
    prepared = analyse(two_scans, signature_of(two_scans, *args),
                       settings_of("cpu", **LOOPS_OFF))
    assert prepared.mode is None and prepared.xla_options == {}
    assert "stream" not in str(jax.make_jaxpr(lambda *leaves: prepared.run(leaves, True))(*args))


def test_the_stages_run_in_order_and_only_the_trace_with_the_collector_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[str, bool]] = []

    def spy(name: str) -> None:
        real = getattr(_pipeline, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            ran.append((name, gc.isenabled()))
            return real(*args, **kwargs)

        monkeypatch.setattr(_pipeline, name, recorded)

    for name in ("trace", "_memory_budget", "run_passes", "plan_jaxpr", "_within_budget",
                 "_mode_search", "_plain_figures", "Emitter"):
        spy(name)
    args = two_scans_args()
    assert gc.isenabled()
    analyse(two_scans, signature_of(two_scans, *args), settings_of("gpu", **LOOPS_OFF),
            report_now=True)
    assert gc.isenabled()
    order = [name for name, _ in ran]
    first = {name: order.index(name) for name in dict.fromkeys(order)}
    assert list(first) == ["trace", "_memory_budget", "_within_budget", "run_passes",
                           "plan_jaxpr", "_mode_search", "_plain_figures", "Emitter"]
    assert [name for name, on in ran if on] == ["trace", "Emitter"]


def test_the_report_figures_are_priced_now_or_by_the_first_report_alike() -> None:
    """``report_now`` prices the plain program in the analysis; without it the record keeps
    the program as traced and its first report prices it, to the same figures."""
    args = two_scans_args()
    sig = signature_of(two_scans, *args)
    now = analyse(two_scans, sig, settings_of("gpu"), report_now=True)
    later = analyse(two_scans, sig, settings_of("gpu"))
    assert now.unpriced is None and now.plain_us is not None and now.plain_us > 0
    assert later.unpriced is not None and later.plain_us is None
    assert later.plain == now.plain
    options = Options.create(target="gpu")
    assert later.report("two_scans", options).to_dict() == \
        now.report("two_scans", options).to_dict()


@pytest.mark.parametrize("target", ["gpu", "cpu"])
def test_symbolic_sizes_stop_after_the_trace(target: str) -> None:
    def f(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.tanh(x @ x.T), jnp.sin(x).sum(axis=0)

    spec = jax.ShapeDtypeStruct(export.symbolic_shape("n, 8"), jnp.float32)
    prepared = analyse(f, signature_of(f, spec), settings_of(target), report_now=True)
    assert prepared.decisions == () and prepared.mode is None and prepared.memory is None
    assert prepared.plain_us is None and prepared.unpriced is None
    assert not prepared.plan.changes_anything


def test_a_trace_error_comes_out_of_analyse_as_it_is() -> None:
    def bad(x: jax.Array) -> jax.Array:
        return x @ jnp.ones((3, 5))

    x = jnp.ones((8, 8))
    with pytest.raises(TypeError, match="jaxpar could not trace"):
        analyse(bad, signature_of(bad, x), settings_of("gpu"))


# ---- jaxpar never runs a plan its model rates slower than another it planned (issue 45) ----


def test_loops_are_left_unjoined_where_the_model_rates_that_faster(monkeypatch) -> None:
    args = deep_birnn_args()
    sig = signature_of(deep_birnn, *args)
    settings = settings_of("gpu", memory="any")
    prepared = analyse(deep_birnn, sig, settings, report_now=True)
    assert not any(d.kind.value == "fused" for d in prepared.decisions)
    assert scans(prepared.traced.jaxpr) == 2
    (refused,) = prepared.memory.left_out
    assert not refused.memory and refused.kinds == ("loop fusion",)
    assert [d.kind.value for d in refused.decisions] == ["fused"]
    ours = prepared.mode.estimate(prepared.mode.mode)
    # Without the check, the passes' fused plan, which the same model rates slower.
    monkeypatch.setattr(_pipeline, "_without_slower_joins", lambda chosen, *_: chosen)
    fused = analyse(deep_birnn, sig, settings, report_now=True)
    assert any(d.kind.value == "fused" for d in fused.decisions)
    assert ours < fused.mode.estimate(fused.mode.mode)
    assert f"{ours * 1e6:,.1f} us per run against " \
           f"{fused.mode.estimate(fused.mode.mode) * 1e6:,.1f} us with it" in refused.why
    # The values are jax.jit's.
    for got, want in zip(prepared.run(jax.tree_util.tree_leaves(args), emit_streams=True),
                         jax.tree_util.tree_leaves(jax.jit(deep_birnn)(*args)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_join_the_model_rates_faster_is_kept() -> None:
    # The README's two scans: fused and unrolled is the faster plan; nothing refused.
    args = two_scans_args()
    prepared = analyse(two_scans, signature_of(two_scans, *args), settings_of("gpu"))
    assert any(d.kind.value == "fused" for d in prepared.decisions)
    assert not prepared.memory.left_out
