"""What the planner finds at each level (``jaxpar._plan.level``) and what it leaves alone:
parallel branches nested inside other primitives' jaxprs, side effects, user-annotated code,
and idempotence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers.lowered import (
    STREAM_ATTRIBUTE,
    canonical_jaxpr_text,
    lower_for_gpu,
    nested_stream_calls,
    stream_calls,
)
from helpers.programs import (
    FOUR_BRANCHES_OPTIONS,
    chain,
    four_branches,
    four_branches_args,
    two_scans,
    two_scans_args,
)
from helpers.trees import assert_same_values
from jax import lax
from jax.experimental import io_callback
from jax.experimental.xla_metadata import set_xla_metadata

import jaxpar
from jaxpar import _compat, _ops
from jaxpar._analysis import Analysis
from jaxpar._model.gpu import CommandBufferMode
from jaxpar._options import Options
from jaxpar._plan import plan_jaxpr
from jaxpar._report.build import build_report

try:  # jax >= 0.11
    from jax.experimental.xla_metadata import xla_metadata_call
except ImportError:  # jax 0.8 - 0.10
    from jax.experimental.scheduling_groups import xla_metadata_call

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:2])
OPTIONS = FOUR_BRANCHES_OPTIONS  # target="gpu", branches of two 256x256 matmuls are worth it


def pair_sum(x, y):
    return chain(x) + chain(y)


def pair_diff(x, y):
    return chain(x) - chain(y)


@jax.custom_jvp
def custom_pair(x, y):
    return pair_sum(x, y)


@custom_pair.defjvp
def _custom_pair_jvp(primals, tangents):
    x, y = primals
    tx, ty = tangents
    return custom_pair(x, y), tx + ty


@jax.custom_vjp
def custom_vjp_pair(x, y):
    return pair_sum(x, y)


custom_vjp_pair.defvjp(lambda x, y: (pair_sum(x, y), None), lambda _, g: (g, g))


def in_jit(x, y):
    return jax.jit(pair_sum)(x, y) * 2.0


def in_scan(x, y):
    def body(carry, _):
        a, b = carry
        return (chain(a), chain(b)), None

    (a, b), _ = lax.scan(body, (x, y), None, length=3)
    return a + b


def in_cond(x, y):
    return lax.cond(jnp.sum(x) > 0, pair_sum, pair_diff, x, y)


def in_switch(x, y):
    return lax.switch(jnp.argmax(x[0, :3]), [pair_sum, pair_diff, lambda x, y: x + y], x, y)


def in_checkpoint(x, y):
    return jax.checkpoint(pair_sum)(x, y) + 1.0


def in_custom_jvp(x, y):
    return custom_pair(x, y) * 3.0


def in_custom_vjp(x, y):
    return custom_vjp_pair(x, y) * 3.0


def in_while(x, y):
    def body(carry):
        i, a, b = carry
        return i + 1, chain(a), chain(b)

    _, a, b = lax.while_loop(lambda carry: carry[0] < 3, body, (0, x, y))
    return a - b


def in_fori(x, y):
    def body(_, carry):
        a, b = carry
        return chain(a), chain(b)

    a, b = lax.fori_loop(0, 2, body, (x, y))
    return a * b


def in_jit_in_scan(x, y):
    def body(carry, _):
        return jax.jit(lambda c: (chain(c[0]), chain(c[1])))(carry), None

    (a, b), _ = lax.scan(body, (x, y), None, length=2)
    return a + b


NESTED = [in_jit, in_scan, in_cond, in_switch, in_checkpoint, in_custom_jvp, in_custom_vjp,
          in_while, in_fori, in_jit_in_scan]


def _args():
    return four_branches_args()[:2]


@pytest.mark.parametrize("program", NESTED, ids=lambda f: f.__name__)
def test_branches_in_nested_jaxpr_are_annotated(program):
    args = _args()
    g = jaxpar.parallel_branches(program, **OPTIONS)
    text = lower_for_gpu(g, *args)
    calls = stream_calls(text)
    assert len(calls) >= 2, f"no stream calls for {program.__name__}"
    assert {attrs[STREAM_ATTRIBUTE] for _, attrs in calls} == {"1", "2"}
    assert nested_stream_calls(text) == []
    assert_same_values(g(*args), jax.jit(program)(*args), "gpu")
    plan = jaxpar.inspect(program, **OPTIONS)(*args)
    assert plan.sections, str(plan)
    assert all(section.location != "/" for section in plan.sections), str(plan)


@pytest.mark.parametrize("program", [in_cond, in_switch], ids=lambda f: f.__name__)
def test_every_branch_of_cond_takes_its_own_path(program):
    g = jaxpar.parallel_branches(program, **OPTIONS)
    x, y = _args()
    for x_in in (x, -x, x.at[0, 1].set(5.0), x.at[0, 2].set(5.0)):
        assert_same_values(g(x_in, y), jax.jit(program)(x_in, y), "gpu")


@pytest.mark.parametrize("program", [in_scan, in_checkpoint, in_custom_jvp, in_cond],
                         ids=lambda f: f.__name__)
def test_grad_through_nested_plans(program):
    g = jaxpar.parallel_branches(program, **OPTIONS)
    args = _args()

    def loss(fn):
        return lambda x, y: jnp.sum(fn(x, y) ** 2)

    got = jax.grad(loss(g), argnums=(0, 1))(*args)
    want = jax.grad(loss(program), argnums=(0, 1))(*args)
    for a, b in zip(got, want, strict=True):
        assert jnp.allclose(a, b, rtol=1e-4, atol=1e-5)


# --- side effects --------------------------------------------------------------------------


def test_debug_callback_order_is_preserved():
    log: list[tuple[str, float]] = []

    def record(name):
        return lambda value: log.append((name, float(value)))

    def program(a, b, c, d):
        outs = []
        for name, x in zip("abcd", (a, b, c, d), strict=True):
            y = chain(x)
            jax.debug.callback(record(name), jnp.sum(y), ordered=True)
            outs.append(y)
        return sum(outs)

    args = four_branches_args()
    want = jax.jit(program)(*args)
    jax.effects_barrier()
    expected, log[:] = list(log), []
    g = jaxpar.parallel_branches(program, **OPTIONS)
    got = g(*args)
    jax.effects_barrier()
    assert [name for name, _ in log] == [name for name, _ in expected] == list("abcd")
    assert_same_values(got, want, "gpu")


def test_unordered_callbacks_in_program_order(capsys):
    def program(x, y):
        a = chain(x)
        jax.debug.print("first {}", jnp.sum(a) * 0 + 1)
        b = chain(y)
        jax.debug.print("second {}", jnp.sum(b) * 0 + 2)
        return a + b

    args = _args()
    jax.jit(program)(*args)
    jax.effects_barrier()
    expected = capsys.readouterr().out
    jaxpar.parallel_branches(program, **OPTIONS)(*args)
    jax.effects_barrier()
    # Unordered effects may run in either order at run time (XLA:CPU runs independent
    # thunks concurrently), with or without jaxpar: both must run, once each. jaxpar's
    # part, keeping the equations in program order, is checked on the jaxpr.
    assert sorted(capsys.readouterr().out.splitlines()) == sorted(expected.splitlines())
    closed = jax.make_jaxpr(jaxpar.parallel_branches(program, **OPTIONS))(*args)
    inner = _compat.open_jaxpr(closed)[0]
    while len(inner.eqns) == 1 and inner.eqns[0].primitive.name in ("jit", "pjit",
                                                                    _ops.PROGRAM):
        params = inner.eqns[0].params  # the decorated call, the rewritten program
        inner = _compat.open_jaxpr(params.get("jaxpr", params.get("call_jaxpr")))[0]
    prints = [e.params["fmt"] for e in inner.eqns if e.primitive.name == "debug_print"]
    assert prints == ["first {}", "second {}"]


def _effect_in_branch(x, y):
    a = x @ x
    a = io_callback(lambda v: v, jax.ShapeDtypeStruct(a.shape, a.dtype), a, ordered=True)
    a = jnp.tanh(a) @ x
    return jnp.tanh(a) + chain(y)


def test_effectful_equation_never_inside_a_region():
    args = _args()
    plan = jaxpar.inspect(_effect_in_branch, **OPTIONS)(*args)
    assert "effectful" in {note.reason for note in plan.left_alone}, str(plan)
    eqns = jax.make_jaxpr(_effect_in_branch)(*args).eqns
    effectful = {i for i, eqn in enumerate(eqns) if eqn.effects}
    assert effectful
    for section in plan.sections:
        for region in section.regions:
            assert not effectful & set(region.eqn_indices), str(plan)
    g = jaxpar.parallel_branches(_effect_in_branch, **OPTIONS)
    assert_same_values(g(*args), jax.jit(_effect_in_branch)(*args), "gpu")


def test_effectful_equation_inside_scan_body_keeps_order():
    log: list[int] = []

    def program(x, y):
        def body(carry, i):
            a, b = carry
            a = chain(a)
            jax.debug.callback(lambda i: log.append(int(i)), i, ordered=True)
            return (a, chain(b)), None

        (a, b), _ = lax.scan(body, (x, y), jnp.arange(3))
        return a + b

    args = _args()
    g = jaxpar.parallel_branches(program, **OPTIONS)
    assert_same_values(g(*args), jax.jit(program)(*args), "gpu")
    jax.effects_barrier()
    assert log == [0, 1, 2, 0, 1, 2]


# --- user-annotated code -------------------------------------------------------------------


def _user_on_stream(x, y, z, w):
    a = jaxpar.on_stream(1, scheduling_group=7)(chain)(x)
    b = jaxpar.on_stream(2, scheduling_group=7)(chain)(y)
    return a + b + chain(z) + chain(w)


def _user_set_xla_metadata(x, y, z, w):
    with set_xla_metadata(_xla_stream_annotation="3", inlineable="false"):
        a = jax.jit(chain)(x)
    return a + chain(y) + chain(z) * chain(w)


def _user_xla_metadata_call(x, y, z, w):
    a = xla_metadata_call(chain, _xla_stream_annotation="3", inlineable="false")(x)
    return a + chain(y) + chain(z) * chain(w)


def _user_compute_on(x, y, z, w):
    from jax.experimental.compute_on import compute_on

    with compute_on("gpu_stream:3"):
        a = jax.jit(chain)(x)
    return a + chain(y) + chain(z) * chain(w)


def _user_annotation_inside_branch(x, y, z, w):
    a = jaxpar.on_stream(3)(chain)(x @ x)
    a = jnp.tanh(a @ x)
    return a + chain(y)


USER_ANNOTATED = [_user_on_stream, _user_set_xla_metadata, _user_xla_metadata_call,
                  _user_annotation_inside_branch]
if JAX_VERSION < (0, 11):  # compute_on("gpu_stream:N") is how jax 0.10 users place code
    USER_ANNOTATED.append(_user_compute_on)


@pytest.mark.parametrize("program", USER_ANNOTATED, ids=lambda f: f.__name__)
def test_user_annotated_code_is_left_alone(program):
    args = four_branches_args()
    plan = jaxpar.inspect(program, **OPTIONS)(*args)
    assert "already annotated" in {note.reason for note in plan.left_alone}, str(plan)
    g = jaxpar.parallel_branches(program, **OPTIONS)
    text = lower_for_gpu(g, *args)
    assert nested_stream_calls(text) == [], text
    user_text = lower_for_gpu(program, *args)
    user_calls = stream_calls(user_text)
    calls = stream_calls(text)
    # Every call the user wrote is still there with the user's attributes.
    for _, attrs in user_calls:
        assert attrs in [a for _, a in calls]
    # Annotated equations are never in a region.
    eqns = jax.make_jaxpr(program)(*args).eqns
    annotated = {i for i, eqn in enumerate(eqns)
                 if eqn.primitive.name in ("xla_metadata_call", "compute_on", "compute_on2",
                                           "jaxpar_stream_region")
                 or getattr(eqn.ctx, "xla_metadata", None)
                 or getattr(eqn.ctx, "compute_type", None)}
    assert annotated
    for section in plan.sections:
        if section.location == "/":
            for region in section.regions:
                assert not annotated & set(region.eqn_indices)


@pytest.mark.parametrize("program", [p for p in USER_ANNOTATED if p is not _user_compute_on],
                         ids=lambda f: f.__name__)
def test_user_annotated_code_same_values(program):
    args = four_branches_args()
    g = jaxpar.parallel_branches(program, **OPTIONS)
    assert_same_values(g(*args), jax.jit(program)(*args), "gpu")


# --- idempotence ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("program", "args", "options"),
    [(two_scans, two_scans_args(), {"target": "gpu"}),
     (four_branches, four_branches_args(), OPTIONS),
     (in_scan, four_branches_args()[:2], OPTIONS),
     (in_cond, four_branches_args()[:2], OPTIONS),
     (two_scans, two_scans_args(), {"target": "cpu"})],
    ids=["two_scans", "four_branches", "in_scan", "in_cond", "two_scans_cpu"])
def test_idempotent(program, args, options):
    once = jaxpar.parallel_branches(program, **options)
    twice = jaxpar.parallel_branches(jaxpar.parallel_branches(program, **options), **options)
    assert canonical_jaxpr_text(jax.make_jaxpr(twice)(*args)) == canonical_jaxpr_text(
        jax.make_jaxpr(once)(*args))
    assert_same_values(twice(*args), once(*args), "cpu")


def _branches_with_a_callback(a, b, c, d):
    """``four_branches`` with an effectful callback (an equation that never moves) beside
    a scan of the same four chains."""
    io_callback(lambda x: None, None, a[0, 0], ordered=True)

    def step(carry, _):
        return carry + four_branches(a, b, c, d), None

    looped, _ = lax.scan(step, jnp.zeros_like(a), None, length=2)
    return four_branches(a, b, c, d) + looped


def test_plans_sharing_a_call_equal_fresh_ones():
    """Planned in each CUDA-graph mode by the analyses of one call (sharing each level's
    basis, each window's sections and each equation's reason to stay in place), a
    program gets the plan a fresh analysis makes, whichever mode plans first."""
    closed = jax.make_jaxpr(_branches_with_a_callback)(*four_branches_args())
    settings = Options.create(**OPTIONS).resolve("gpu")
    modes = (CommandBufferMode.LHS, CommandBufferMode.CONCURRENT, CommandBufferMode.OFF)

    def report(analysis):
        plan = plan_jaxpr(closed, analysis)
        return build_report(plan, "f", "gpu", emitted=True, options={}).to_dict(), plan.order

    fresh = {mode: report(Analysis(settings.priced_in(mode)))
             for mode in modes}
    assert all(fresh[mode][0]["sections"] for mode in modes)
    # Pricing differs between the modes here, so a plan leaking from one to another shows.
    assert fresh[CommandBufferMode.OFF] != fresh[CommandBufferMode.LHS]
    for order in (modes, modes[::-1]):
        first = Analysis(settings.priced_in(order[0]))
        for mode in order:
            shared = first.with_settings(settings.priced_in(mode))
            assert report(shared) == fresh[mode]
