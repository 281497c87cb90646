"""The public surface of `parallel_branches`: decorator forms, pytrees, methods, metadata,
the rewrite cache, targets, and what the standard programs lower to."""

from __future__ import annotations

import dataclasses
import gc
import inspect as pyinspect
import json
import os
import subprocess
import sys
import textwrap
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.benchmarks import hetero_batch_benchmark
from helpers.calls import jaxpar_frames
from helpers.lowered import GROUP_ATTRIBUTE, STREAM_ATTRIBUTE, lower_for_gpu, stream_calls
from helpers.programs import (
    FOUR_BRANCHES_OPTIONS,
    LOOPS_OFF,
    four_branches,
    four_branches_args,
    pure_chain,
    pure_chain_args,
    two_scans,
    two_scans_args,
)
from helpers.trees import assert_same_values, assert_tree_equal

import jaxpar
from jaxpar._pipeline import Prepared, _collector_paused

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def small(a, b):
    """Two independent small branches."""
    return jnp.sin(a @ a), jnp.cos(b @ b)


def small_args():
    return jnp.linspace(0.0, 1.0, 64).reshape(8, 8), jnp.linspace(1.0, 2.0, 64).reshape(8, 8)


# --- decorator forms -----------------------------------------------------------------------


def test_bare_decorator():
    @jaxpar.parallel_branches
    def f(a, b):
        return small(a, b)

    assert isinstance(f, jaxpar.ParallelBranches)
    assert_tree_equal(f(*small_args()), jax.jit(small)(*small_args()))


def test_decorator_with_options():
    @jaxpar.parallel_branches(target="gpu", max_streams=2, min_cost_us=0.0)
    def f(a, b):
        return small(a, b)

    assert isinstance(f, jaxpar.ParallelBranches)
    assert f.options.max_streams == 2
    assert f.options.target == "gpu"
    assert_same_values(f(*small_args()), jax.jit(small)(*small_args()), "gpu")


def test_decorator_with_no_options_called():
    @jaxpar.parallel_branches()
    def f(a, b):
        return small(a, b)

    assert isinstance(f, jaxpar.ParallelBranches)
    assert_tree_equal(f(*small_args()), jax.jit(small)(*small_args()))


def test_function_call_form():
    g = jaxpar.parallel_branches(small, target="gpu", min_cost_us=0.0)
    assert isinstance(g, jaxpar.ParallelBranches)
    assert g.__wrapped__ is small
    assert_same_values(g(*small_args()), jax.jit(small)(*small_args()), "gpu")


# --- pytrees and keyword arguments ---------------------------------------------------------


def nested_io(params, inputs, *, scale, extra=None):
    w1, w2 = params["layers"]
    x = inputs["x"]
    h1 = jnp.tanh(x @ w1) * scale
    h2 = jnp.sin(x @ w2) + params["bias"]
    out = {"pair": (h1, h2), "nothing": None, "nested": {"list": [h1 + h2, x]}}
    if extra is not None:
        out["extra"] = extra["value"] * 2.0
    return out


def nested_args():
    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    params = {"layers": (jax.random.normal(k1, (16, 16)), jax.random.normal(k2, (16, 16))),
              "bias": jnp.float32(0.25)}
    inputs = {"x": jax.random.normal(k3, (4, 16)), "unused": None}
    return params, inputs


@pytest.mark.parametrize("target", ["gpu", "cpu"])
def test_pytrees_and_kwargs_in_and_out(target):
    g = jaxpar.parallel_branches(nested_io, target=target, min_cost_us=0.0)
    params, inputs = nested_args()
    want = jax.jit(nested_io)(params, inputs, scale=jnp.float32(3.0))
    got = g(params, inputs, scale=jnp.float32(3.0))
    assert_same_values(got, want, target)
    assert got["nothing"] is None
    assert isinstance(got["pair"], tuple)
    assert isinstance(got["nested"]["list"], list)

    extra = {"value": jnp.arange(3.0)}
    want = jax.jit(nested_io)(params, inputs, scale=2.0, extra=extra)
    got = g(params, inputs, scale=2.0, extra=extra)
    assert_same_values(got, want, target)


def test_kwargs_can_be_passed_positionally_or_by_name():
    g = jaxpar.parallel_branches(nested_io, target="gpu", min_cost_us=0.0)
    params, inputs = nested_args()
    by_name = g(params=params, inputs=inputs, scale=1.5)
    positional = g(params, inputs, scale=1.5)
    assert_tree_equal(by_name, positional)


def test_python_and_numpy_scalars_are_leaves():
    def f(x, s, t):
        return x * s + t

    g = jaxpar.parallel_branches(f)
    x = jnp.arange(4.0)
    assert_tree_equal(g(x, 2.0, np.float32(1.0)), jax.jit(f)(x, 2.0, np.float32(1.0)))
    assert_tree_equal(g(x, 3, True), jax.jit(f)(x, 3, True))


def test_no_outputs_and_empty_containers():
    def f(x, empty):
        return {"x": x + 1.0, "empty": empty, "none": None}

    g = jaxpar.parallel_branches(f)
    out = g(jnp.ones(3), ())
    assert out["empty"] == () and out["none"] is None
    assert_tree_equal(out, jax.jit(f)(jnp.ones(3), ()))


# --- methods -------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TwoLayers:
    w1: jax.Array
    w2: jax.Array

    @jaxpar.parallel_branches(target="gpu", min_cost_us=0.0, force_streams=True)
    def apply(self, x):
        """Applies both layers side by side."""
        return jnp.tanh(x @ self.w1) + jnp.sin(x @ self.w2)

    def apply_plain(self, x):
        return jnp.tanh(x @ self.w1) + jnp.sin(x @ self.w2)


def test_decorated_method_on_pytree_class():
    model = TwoLayers(jnp.eye(8) * 0.5, jnp.ones((8, 8)) * 0.1)
    x = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)
    assert_same_values(model.apply(x), jax.jit(TwoLayers.apply_plain)(model, x), "gpu")
    assert isinstance(TwoLayers.apply, jaxpar.ParallelBranches)
    assert TwoLayers.apply.__doc__ == "Applies both layers side by side."
    calls = stream_calls(lower_for_gpu(lambda m, x: m.apply(x), model, x))
    assert len(calls) == 2


class NotAPytree:
    def __init__(self):
        self.w = jnp.eye(4)

    @jaxpar.parallel_branches
    def apply(self, x):
        return x @ self.w


def test_decorated_method_on_plain_class_self_is_static():
    # A plain object is a non-array leaf: static, as eqx.filter_jit treats it, keyed by a
    # snapshot of its attributes (a JAX array by identity: arrays are immutable), and
    # warned about once.
    obj = NotAPytree()
    x = jnp.ones((2, 4))
    with pytest.warns(jaxpar.StaticArgumentWarning, match="argument `self` of "
                                                          "`NotAPytree.apply`"):
        assert_tree_equal(obj.apply(x), jax.jit(lambda x: x @ obj.w)(x))
    assert NotAPytree.apply.analyses == 1
    obj.apply(x + 1.0)
    assert NotAPytree.apply.analyses == 1
    NotAPytree().apply(x)  # another object, with another array: another static value
    assert NotAPytree.apply.analyses == 2
    obj.w = jnp.eye(4) * 2.0  # seen: traced again
    assert_tree_equal(obj.apply(x), x * 2.0)
    assert NotAPytree.apply.analyses == 3


# --- metadata ------------------------------------------------------------------------------


def documented(alpha, beta=None):
    """Adds things up."""
    return alpha if beta is None else alpha + beta


def test_functools_wraps_metadata():
    g = jaxpar.parallel_branches(documented, target="cpu")
    assert g.__name__ == "documented"
    assert g.__qualname__ == "documented"
    assert g.__doc__ == "Adds things up."
    assert g.__module__ == documented.__module__
    assert g.__wrapped__ is documented
    assert pyinspect.signature(g) == pyinspect.signature(documented)
    assert "documented" in repr(g)


# --- caching -------------------------------------------------------------------------------


def test_cache_same_signature_does_not_reanalyse():
    g = jaxpar.parallel_branches(small, target="gpu", min_cost_us=0.0)
    a, b = small_args()
    assert g.analyses == 0
    g(a, b)
    assert g.analyses == 1
    g(a + 1.0, b * 2.0)  # new values, same signature
    g(np.asarray(a), np.asarray(b))  # numpy arrays of the same shape and dtype
    assert g.analyses == 1
    g.analyses = 0  # a counter tools may reset, as when it was a plain attribute
    g(a, b)
    assert g.analyses == 0
    g.clear_cache()
    g(a, b)
    assert g.analyses == 1


def test_cache_new_shape_dtype_structure_replans():
    def f(x, y):
        return jax.tree_util.tree_map(lambda v: jnp.sin(v) * 2.0, (x, y))

    g = jaxpar.parallel_branches(f)
    g(jnp.ones(3), jnp.ones(3))
    assert g.analyses == 1
    g(jnp.ones(4), jnp.ones(3))  # shape
    assert g.analyses == 2
    g(jnp.ones(4, jnp.bfloat16), jnp.ones(3))  # dtype
    assert g.analyses == 3
    g((jnp.ones(3), jnp.ones(3)), jnp.ones(3))  # structure
    assert g.analyses == 4
    g({"a": jnp.ones(3)}, jnp.ones(3))  # structure again
    assert g.analyses == 5
    g(jnp.ones(3), y=jnp.ones(3))  # same leaves passed by keyword: another structure
    assert g.analyses == 6
    for call in [lambda: g(jnp.ones(3), jnp.ones(3)), lambda: g(jnp.ones(4), jnp.ones(3)),
                 lambda: g((jnp.ones(3), jnp.ones(3)), jnp.ones(3))]:
        call()
    assert g.analyses == 6


def test_cache_weak_type_is_part_of_the_signature():
    g = jaxpar.parallel_branches(lambda x: x * 2)
    g(jnp.float32(1.0))
    g(1.0)  # weakly typed Python float
    assert g.analyses == 2


def test_cache_option_change_replans(monkeypatch):
    a, b = two_scans_args()
    g = jaxpar.parallel_branches(two_scans, target="gpu", **LOOPS_OFF)
    h = jaxpar.parallel_branches(two_scans, target="gpu", **LOOPS_OFF, max_streams=1)
    g(a, b)
    g(a, b)
    assert g.analyses == 1
    h(a, b)
    assert h.analyses == 1 and g.analyses == 1
    # XLA's async compute limit is an option from the environment, read when a call
    # misses JAX's cache: a compiled signature keeps its program, a new one re-plans.
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")
                       + " --xla_gpu_experimental_parallel_async_compute_limit=1")
    g(a, b)
    assert g.analyses == 1
    g(a, b=b)  # b by keyword: another signature, which misses
    assert g.analyses == 2
    g(a, b)  # the new environment's jit: this signature is planned in it too
    assert g.analyses == 3
    monkeypatch.undo()
    g(a=a, b=b)  # a miss (a third signature) reads the environment: back in the first
    assert g.analyses == 4  # environment's jit, where (a, b) was compiled
    assert jaxpar_frames(lambda: g(a, b)) == []
    assert g.analyses == 4


def test_cache_does_not_replan_under_jit_for_same_signature():
    g = jaxpar.parallel_branches(small, target="gpu", min_cost_us=0.0)
    a, b = small_args()
    g(a, b)
    jax.jit(g)(a, b)
    jax.jit(lambda a, b: g(a, b)[0] * 2)(a, b)
    assert g.analyses == 1



def test_a_call_leaves_the_plain_programs_figures_to_its_first_report():
    """A call lowers without pricing the program as traced (only a report shows those
    figures); its first report prices them, and says exactly what ``inspect`` says."""
    bench = hetero_batch_benchmark()
    args = jax.eval_shape(lambda: bench.program_args("crossed_cells", "quick"))
    pb = jaxpar.parallel_branches(bench.crossed_cells, target="gpu")
    pb.lower(*args)
    (key,) = pb._state.plans.cache_keys()
    prepared = pb._state.plans.get(key)
    assert prepared.plain_us is None and prepared.unpriced is not None
    assert prepared.mode is not None and prepared.mode.plain_seconds is None
    report, _ = pb._analysed_report()
    assert report.plain_cost_us > 0 and report.mode.plain_seconds > 0
    inspected = jaxpar.inspect(bench.crossed_cells, target="gpu")(*args)
    assert report.to_dict() == inspected.to_dict()
    assert pb._analysed_report()[0].to_dict() == inspected.to_dict()  # priced once, kept

# --- targets -------------------------------------------------------------------------------


def test_target_gpu_runs_here_and_lowers_with_annotations():
    args = two_scans_args()
    g = jaxpar.parallel_branches(two_scans, target="gpu", **LOOPS_OFF)
    assert_same_values(g(*args), jax.jit(two_scans)(*args), "gpu")
    calls = stream_calls(lower_for_gpu(g, *args))
    assert len(calls) == 2
    for _, attrs in calls:
        assert attrs["inlineable"] == "false"


def test_target_cpu_emits_no_annotations():
    args = two_scans_args()
    g = jaxpar.parallel_branches(two_scans, target="cpu")
    assert_tree_equal(g(*args), jax.jit(two_scans)(*args))
    text = lower_for_gpu(g, *args)
    assert stream_calls(text) == []
    assert STREAM_ATTRIBUTE not in text


def test_target_auto_resolves_to_cpu_here():
    args = two_scans_args()
    assert jax.default_backend() == "cpu"
    plan = jaxpar.inspect(two_scans, **LOOPS_OFF)(*args)
    assert plan.target == "cpu"
    assert not plan.emitted
    g = jaxpar.parallel_branches(two_scans, **LOOPS_OFF)
    assert_tree_equal(g(*args), jax.jit(two_scans)(*args))
    assert stream_calls(lower_for_gpu(g, *args)) == []


# --- what the standard programs lower to ---------------------------------------------------


def test_two_scans_two_streams_one_group():
    args = two_scans_args()
    g = jaxpar.parallel_branches(two_scans, target="gpu", **LOOPS_OFF)
    calls = stream_calls(lower_for_gpu(g, *args))
    assert sorted(attrs[STREAM_ATTRIBUTE] for _, attrs in calls) == ["1", "2"]
    groups = {attrs.get(GROUP_ATTRIBUTE) for _, attrs in calls}
    assert len(groups) == 1 and None not in groups
    assert len({callee for callee, _ in calls}) == 2


def test_four_branches_uses_at_least_two_streams():
    args = four_branches_args()
    g = jaxpar.parallel_branches(four_branches, **FOUR_BRANCHES_OPTIONS)
    calls = stream_calls(lower_for_gpu(g, *args))
    assert len({attrs[STREAM_ATTRIBUTE] for _, attrs in calls}) >= 2
    assert_same_values(g(*args), jax.jit(four_branches)(*args), "gpu")


def test_pure_chain_has_no_streams():
    args = pure_chain_args()
    g = jaxpar.parallel_branches(pure_chain, target="gpu", min_cost_us=0.0)
    assert stream_calls(lower_for_gpu(g, *args)) == []
    np.testing.assert_array_equal(g(*args), jax.jit(pure_chain)(*args))


@pytest.mark.parametrize("max_streams", [1, 2, 3, 4, 8])
def test_stream_ids_are_at_least_one(max_streams):
    args = four_branches_args()
    options = {**FOUR_BRANCHES_OPTIONS, "max_streams": max_streams}
    g = jaxpar.parallel_branches(four_branches, **options)
    calls = stream_calls(lower_for_gpu(g, *args))
    for _, attrs in calls:
        assert int(attrs[STREAM_ATTRIBUTE]) >= 1
        assert int(attrs[GROUP_ATTRIBUTE]) >= 1
    plan = jaxpar.inspect(four_branches, **options)(*args)
    streams = [r.stream for s in plan.sections for r in s.regions]
    assert all(stream >= 1 for stream in streams)
    assert len(set(streams)) <= max_streams
    if max_streams == 1:
        assert calls == [] and plan.sections == ()


def test_stream_ids_at_least_one_for_scans():
    g = jaxpar.parallel_branches(two_scans, target="gpu", **LOOPS_OFF, max_streams=8)
    for _, attrs in stream_calls(lower_for_gpu(g, *two_scans_args())):
        assert int(attrs[STREAM_ATTRIBUTE]) >= 1


# --- determinism ---------------------------------------------------------------------------

_PLAN_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests_dir!r})
    import jaxpar
    from helpers.programs import (FOUR_BRANCHES_OPTIONS, LOOPS_OFF, four_branches,
                                  four_branches_args, two_scans, two_scans_args)
    plans = [
        jaxpar.inspect(two_scans, target="gpu", **LOOPS_OFF)(*two_scans_args()).to_dict(),
        jaxpar.inspect(two_scans, target="gpu")(*two_scans_args()).to_dict(),
        jaxpar.inspect(four_branches, **FOUR_BRANCHES_OPTIONS)(*four_branches_args()).to_dict(),
        jaxpar.inspect(four_branches, target="cpu")(*four_branches_args()).to_dict(),
    ]
    print("PLANS=" + json.dumps(plans, sort_keys=True))
""")


def _plans_in_subprocess(hash_seed: str) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONHASHSEED": hash_seed}
    result = subprocess.run([sys.executable, "-c", _PLAN_SCRIPT.format(tests_dir=TESTS_DIR)],
                            env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("PLANS=")]
    return line[len("PLANS="):]


def test_plan_is_deterministic_across_processes():
    first = _plans_in_subprocess("1")
    second = _plans_in_subprocess("12345")
    assert first == second
    plans = json.loads(first)
    assert plans[0]["num_streams"] == 2
    assert [loop["kind"] for loop in plans[1]["decisions"]][:1] == ["fused"]
    assert plans[2]["num_streams"] >= 2


def test_analysis_leaves_the_garbage_collector_as_it_found_it():

    def f(a, b):
        return jnp.tanh(a @ a) + jnp.tanh(b @ b)

    x = jnp.ones((8, 8))
    assert gc.isenabled()
    jaxpar.inspect(f, target="gpu")(x, x)
    assert gc.isenabled()
    gc.disable()
    try:
        jaxpar.inspect(f, target="gpu")(x, x)
        assert not gc.isenabled()  # a user's choice is kept
    finally:
        gc.enable()
    with pytest.raises(TypeError, match="jaxpar could not trace"):
        jaxpar.inspect(lambda a: a @ jnp.ones((3, 5)), target="gpu")(x)
    assert gc.isenabled()

    def bad_plan(*args, **kwargs):
        raise RuntimeError("boom")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jaxpar._pipeline, "plan_jaxpr", bad_plan)
        with pytest.raises(RuntimeError, match="boom"):
            jaxpar.inspect(f, target="gpu")(x, x)
    assert gc.isenabled()



def test_emission_and_report_run_with_the_collector_paused_and_restore_it():

    def f(a, b):
        return jnp.tanh(a @ a) + jnp.tanh(b @ b)

    x = jnp.ones((8, 8))
    seen: list[bool] = []
    real_run, real_report = jaxpar._pipeline.Emitter.run, jaxpar._pipeline.build_report

    def spy_run(self, *args, **kwargs):
        seen.append(gc.isenabled())
        return real_run(self, *args, **kwargs)

    def spy_report(*args, **kwargs):
        seen.append(gc.isenabled())
        return real_report(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jaxpar._pipeline.Emitter, "run", spy_run)
        patch.setattr(jaxpar._pipeline, "build_report", spy_report)
        assert gc.isenabled()
        jaxpar.inspect(f, target="gpu")(x, x)
        out = jaxpar.parallel_branches(f, target="gpu")(x, x)
        assert gc.isenabled()
    assert seen == [False, False]  # the report, then the emission
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(f)(x, x)))

    def bad_run(self, *args, **kwargs):
        raise RuntimeError("boom")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jaxpar._pipeline.Emitter, "run", bad_run)
        again = jaxpar.parallel_branches(f, target="gpu")
        again(x, x)  # the first decoration's program: nothing is emitted
        again.clear_cache()  # forgotten for both: the next call emits
        with pytest.raises(RuntimeError, match="boom"):
            again(x, x)
    assert gc.isenabled()

# --- jit's stages and caches ------------------------------------------------------------


def test_trace_lower_compile_and_eval_shape_like_jax_jit():
    args = two_scans_args()
    g = jaxpar.parallel_branches(two_scans, target="gpu", **LOOPS_OFF)
    want = jax.jit(two_scans)
    traced = g.trace(*args)
    assert traced.out_info == want.trace(*args).out_info
    lowered = g.lower(*args)
    assert len(stream_calls(lowered.as_text())) == 2
    assert_same_values(lowered.compile()(*args), want(*args), "gpu")
    assert g.eval_shape(*args) == jax.eval_shape(two_scans, *args)


def test_stages_with_static_arguments_take_the_same_calls_as_jax_jit():
    def layers(x, w, n):
        for _ in range(n):
            x = jnp.tanh(x @ w)
        return x

    x, w = small_args()
    g = jaxpar.parallel_branches(layers, target="cpu", static_argnums=2)
    want = jax.jit(layers, static_argnums=2)
    compiled = g.lower(x, w, 3).compile()
    assert_tree_equal(compiled(x, w), want.lower(x, w, 3).compile()(x, w))
    assert g.eval_shape(x, w, 3) == want.eval_shape(x, w, 3)


def test_clear_cache_and_jax_clear_caches_forget_the_rewrites():
    g = jaxpar.parallel_branches(small, target="cpu")
    a, b = small_args()
    g(a, b)
    g(a, b)
    assert g.analyses == 1
    g.clear_cache()
    g(a, b)
    assert g.analyses == 2
    jax.clear_caches()
    g(a, b)
    assert g.analyses == 3
    g(a, b)
    assert g.analyses == 3


def test_donation_through_an_outer_jit():
    g = jaxpar.parallel_branches(small, target="cpu")
    a, b = small_args()
    want = jax.jit(small)(a, b)
    donated = jnp.array(a)
    got = jax.jit(g, donate_argnums=0)(donated, b)
    assert_tree_equal(got, want)
    assert donated.is_deleted()


# --- off switches ---------------------------------------------------------------------------


def test_disable_jit_calls_the_original_function_eagerly():
    seen = []

    def f(x):
        seen.append(isinstance(x, jax.core.Tracer))
        return jnp.sin(x) * 2.0

    g = jaxpar.parallel_branches(f, target="cpu")
    x = jnp.linspace(0.0, 1.0, 8)
    with jax.disable_jit():
        got = g(x)
    assert seen == [False]
    assert g.analyses == 0
    assert_tree_equal(got, f(x))


def test_environment_variable_turns_jaxpar_off(monkeypatch):
    args = two_scans_args()
    g = jaxpar.parallel_branches(two_scans, target="gpu", **LOOPS_OFF)
    monkeypatch.setenv("JAXPAR_DISABLE", "1")
    assert stream_calls(lower_for_gpu(g, *args)) == []
    assert_tree_equal(g(*args), jax.jit(two_scans)(*args))
    assert g.analyses == 0
    # Read when a function is traced: programs an outer jit already traced keep their
    # version until jax.clear_caches().
    monkeypatch.setenv("JAXPAR_DISABLE", "0")
    jax.clear_caches()
    assert len(stream_calls(lower_for_gpu(g, *args))) == 2
    assert g.analyses == 1


def test_inspect_says_when_the_environment_turns_jaxpar_off(monkeypatch):
    args = two_scans_args()
    assert "JAXPAR_DISABLE" not in jaxpar.inspect(two_scans, target="gpu")(*args).text()
    monkeypatch.setenv("JAXPAR_DISABLE", "1")
    text = jaxpar.inspect(two_scans, target="gpu")(*args).text()
    assert "JAXPAR_DISABLE is set: calls run plain jax.jit" in text.splitlines()[1]


def test_make_gpu_mesh_is_public():
    from jaxpar._compiled import gpu_compile
    assert jaxpar.make_gpu_mesh is gpu_compile.make_gpu_mesh
    assert "make_gpu_mesh" in jaxpar.__all__


# --- lifetime: nothing keeps the function's arrays alive (as jax.jit) ---------------------------


# The cyclic collector off while a test checks that reference counting alone frees an
# object (JAX's test_jit_reference_dropping does the same): jaxpar's own pause.
_collector_off = _collector_paused


_USES = {
    "decorated": lambda g: None,
    "called": lambda g: (g(), g()),
    "inspect": lambda g: jaxpar.inspect(g)(),
    "lower": lambda g: g.lower(),
    "trace": lambda g: g.trace(),
    "eval_shape": lambda g: g.eval_shape(),
    "under_jit_and_grad": lambda g: jax.grad(lambda s: jnp.sum(g()) * s)(1.0),
}


@pytest.mark.parametrize("use", sorted(_USES))
@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_closed_over_arrays_die_with_the_decorated_function(use, target):
    # JAX's test_jit_reference_dropping, with the cyclic collector off: deleting the
    # decorated function frees what it closed over at once.
    with _collector_off():
        x = jnp.ones(10)
        f = (lambda x: lambda: jnp.tanh(x) * 2.0 + jnp.sum(x))(x)
        g = jaxpar.parallel_branches(f, target=target)
        x = weakref.ref(x)
        _USES[use](g)
        del f
        assert x() is not None
        g()
        del g
        assert x() is None


def test_repr_of_the_function_is_never_called():
    # JAX's test_jit_repr_errors: decorating a callable whose repr raises works.
    class Callable:
        def __call__(self, x):
            return x * 2.0

        def __repr__(self):
            raise ValueError("invalid repr")

    g = jaxpar.parallel_branches(Callable(), target="cpu")
    assert "Callable" in repr(g)
    np.testing.assert_array_equal(g(jnp.ones(3)), jnp.full(3, 2.0))
    assert jaxpar.inspect(Callable(), target="cpu")(jnp.ones(3)).num_eqns == 1
    del g.__wrapped__
    assert repr(g).startswith("parallel_branches(")
    # Every way of decorating, planning and staging it: none asks for the repr.
    x = jnp.ones(3)
    for made in (jaxpar.parallel_branches(Callable(), target="gpu"),
                 jaxpar.parallel_branches(Callable(), tune=True),
                 jaxpar.parallel_branches(Callable(), static_argnums=())):
        made.lower(x).as_text()
        made.trace(x)
        jax.eval_shape(made, x)
        str(made)
    assert jaxpar.inspect(Callable(), target="gpu")(x).function == "<Callable object>"
    np.testing.assert_array_equal(jax.jit(jaxpar.on_stream(2)(Callable()))(x),
                                  jnp.full(3, 2.0))


def test_calls_build_their_settings_once_per_environment(monkeypatch):
    """Calls that miss read their environment but build its settings and jits once:
    equal calls run the same jits; a call that misses in another environment (XLA_FLAGS)
    gets other settings, and back in the first environment the first ones again."""
    from jaxpar._dispatch import fast

    built = []
    real = fast.FastPath
    monkeypatch.setattr(fast, "FastPath",
                        lambda *args, **kwargs: built.append(real(*args, **kwargs)) or built[-1])
    g = jaxpar.parallel_branches(small, target="gpu", min_cost_us=0.0)
    a, b = small_args()
    want = jax.jit(small)(a, b)
    for _ in range(2):
        np.testing.assert_allclose(g(a, b), want, rtol=1e-6)
    assert len(built) == 1
    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_FLAGS",
                       flags + " --xla_gpu_experimental_parallel_async_compute_limit=1")
    g.clear_cache()  # the next call misses and reads the environment
    np.testing.assert_allclose(g(a, b), want, rtol=1e-6)
    monkeypatch.setenv("XLA_FLAGS", flags)
    np.testing.assert_allclose(g(a[:4, :4], b[:4, :4]), jax.jit(small)(a[:4, :4], b[:4, :4]),
                               rtol=1e-6)
    np.testing.assert_allclose(g(a, b), want, rtol=1e-6)
    assert len(built) == 3  # after clear_cache, each environment's jits once
    first, other, back = (top.mode.settings for top in built)
    assert other.streams_per_section == 1 != first.streams_per_section
    assert back == first
    jax.clear_caches()
    assert not g._state.memos.settings and not g._state.memos.fast


# --- the per-call path: JAX's own dispatch after the first call of a signature ------------


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_a_second_call_does_not_enter_jaxpars_python(target):
    """After the first call of a signature, arrays and Python scalars go straight into
    JAX's C++ dispatch: no Python frame of jaxpar's; a new scalar value is no new
    signature (traced, as jax.jit traces it), a new dtype or shape is."""
    g = jaxpar.parallel_branches(lambda a, b, s: (jnp.sin(a @ a) * s, jnp.cos(b @ b)),
                                 target=target)
    a, b = small_args()
    want = jax.jit(lambda a, b, s: (jnp.sin(a @ a) * s, jnp.cos(b @ b)))
    assert_tree_equal(g(a, b, 2.0), want(a, b, 2.0))
    assert g.analyses == 1
    for scale in (2.0, 3.0, 0.5):
        assert jaxpar_frames(lambda s=scale: g(a, b, s)) == []
        assert_tree_equal(g(a, b, scale), want(a, b, scale))
    assert g.analyses == 1
    assert_tree_equal(g(a, b, 4), want(a, b, 4))  # an int: another dtype, as for jax.jit
    assert jaxpar_frames(lambda: g(a[:4, :4], b, 2.0))  # a new shape misses: jaxpar plans
    assert g.analyses == 3


def test_nested_arguments_are_checked_not_split():
    """Containers of arrays (a training step's parameters and optimizer state) go to JAX's
    C++ dispatch as they are once their signature is compiled: jaxpar flattens nothing."""
    g = jaxpar.parallel_branches(lambda p, x: jax.tree_util.tree_map(lambda v: v * x, p),
                                 target="cpu")
    params = {"w": [jnp.ones(3), jnp.zeros(2)], "b": (jnp.ones(1),)}
    x = jnp.float32(2.0)
    g(params, x)
    assert jaxpar_frames(lambda: g(params, x)) == []
    assert_tree_equal(g(params, x), jax.tree_util.tree_map(lambda v: v * x, params))


def test_static_leaves_are_split_without_a_key_or_plan_lookup():
    """A call holding a static leaf (a string) misses JAX's C++ dispatch (it cannot take
    a string) and is split by jaxpar (its split remembered for its structure, leaf types
    and static values), then runs in its environment's jit taking the split arguments: no
    new plan for a new scalar value; one for a new string."""
    def f(x, scale, activation):
        return {"tanh": jnp.tanh, "sin": jnp.sin}[activation](x) * scale

    g = jaxpar.parallel_branches(f, target="cpu")
    x = jnp.linspace(0.0, 1.0, 8)
    assert_tree_equal(g(x, 0.5, "tanh"), jax.jit(f, static_argnums=2)(x, 0.5, "tanh"))
    frames = jaxpar_frames(lambda: g(x, 1.5, "tanh"))
    # Split as the first call of this structure was (remembered): no split, no plan.
    assert any(frame.endswith(":memo_split") for frame in frames)
    assert not any(frame.endswith((":split_arguments", ":prepare", ":analyse"))
                   for frame in frames)
    assert_tree_equal(g(x, 1.5, "tanh"), jax.jit(f, static_argnums=2)(x, 1.5, "tanh"))
    assert_tree_equal(g(x, 0.5, "sin"), jax.jit(f, static_argnums=2)(x, 0.5, "sin"))
    assert g.analyses == 2


def test_changes_to_the_environment_between_calls_are_followed(monkeypatch):
    """The environment is read when a call misses JAX's cache (a new signature, a
    transformation, after clear_cache()): XLA_FLAGS (the async compute limit) plans anew,
    JAXPAR_DISABLE runs the original function, and back again the first jits answer
    without planning. A compiled signature keeps its program meanwhile."""
    g = jaxpar.parallel_branches(small, target="gpu", min_cost_us=0.0, force_streams=True)
    a, b = small_args()
    lowered = []
    real_run = Prepared.run
    monkeypatch.setattr(Prepared, "run",
                        lambda rewrite, *rest: lowered.append(rewrite.settings)
                        or real_run(rewrite, *rest))
    want = jax.jit(small)(a, b)
    np.testing.assert_allclose(g(a, b), want, rtol=1e-6)
    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_FLAGS",
                       flags + " --xla_gpu_experimental_parallel_async_compute_limit=1")
    np.testing.assert_allclose(g(a, b), want, rtol=1e-6)
    assert g.analyses == 1 and len(lowered) == 1  # compiled: JAX's dispatch serves it
    g.clear_cache()
    np.testing.assert_allclose(g(a, b), want, rtol=1e-6)
    assert g.analyses == 2 and len(lowered) == 2
    assert lowered[1].streams_per_section == 1 != lowered[0].streams_per_section
    monkeypatch.setenv("JAXPAR_DISABLE", "1")
    g.clear_cache()
    np.testing.assert_allclose(g(a, b), want, rtol=1e-6)
    assert g.analyses == 2 and len(lowered) == 2  # the original function, not planned
    monkeypatch.delenv("JAXPAR_DISABLE")
    monkeypatch.setenv("XLA_FLAGS", flags)
    np.testing.assert_allclose(g(a[:4, :4], b[:4, :4]), jax.jit(small)(a[:4, :4], b[:4, :4]),
                               rtol=1e-6)
    assert len(lowered) == 3 and lowered[2].streams_per_section == lowered[0].streams_per_section


def test_arguments_jax_jit_refuses_get_jaxpars_error(monkeypatch):
    """What jax.jit refuses before tracing (a Python int too large) takes jaxpar's path,
    whose error names the argument, not jax.jit's."""
    g = jaxpar.parallel_branches(lambda x, n: x * n, target="cpu")
    g(jnp.ones(2), 3)
    with pytest.raises(OverflowError, match=r"argument `n` of .*static_argnums"):
        g(jnp.ones(2), 2**70)


def test_a_calibration_written_between_calls_is_read(monkeypatch):
    """On a GPU, a function planned for the machine's own GPU compares its calibration
    file when a call misses too: a calibration written meanwhile changes its settings, as
    ``local_gpu_profile`` reads it (checked here with the file's stamp and the GPU
    faked)."""
    from jaxpar import _dispatch
    from jaxpar._dispatch import fast

    stamp = [None]
    monkeypatch.setattr(fast, "local_gpu_kind", lambda: "NVIDIA H200")
    monkeypatch.setattr(fast, "local_profile_stamp", lambda: stamp[0])
    built = []
    real = fast.FastPath
    monkeypatch.setattr(fast, "FastPath",
                        lambda *args, **kwargs: built.append(real(*args, **kwargs)) or built[-1])
    g = jaxpar.parallel_branches(small, target="gpu")
    cpu = jaxpar.parallel_branches(small, target="cpu")
    a, b = small_args()
    for _ in range(2):
        g(a, b)
        cpu(a, b)
    assert len(built) == 2
    assert g._state.read_environment is _dispatch.read_gpu_environment
    assert cpu._state.read_environment is _dispatch.read_environment
    stamp[0] = (1, 2)  # a calibration file appears
    g(a[:4, :4], b[:4, :4])  # a call that misses reads it
    cpu(a[:4, :4], b[:4, :4])
    assert len(built) == 2  # the same settings: a new reading, the same environment's jits
    assert len(g._state.memos.fast) == 2 and len(cpu._state.memos.fast) == 1
