"""Stream regions (``jaxpar._emit.region_call``) under the JAX transformations that are not
autodiff's first order.

A region is an equation of jaxpar's own primitive (`_ops.stream_region_p`), lowered
like `xla_metadata_call`, with a rule for each transformation that can meet it
(`jaxpar._ops.stream_region`). Before,
regions were bare `xla_metadata_call`s: `checkify` has no rule for those and silently
dropped every check in their bodies, `jet` failed, and JAX's own transpose of one made a
plain `xla_metadata_call` whose derivative under `jax.checkpoint` asserted (second-order
reverse mode, JAX's `testScanGrad`/`testScanHigherOrderDifferentiation` with `jax.jit`
routed through `parallel_branches`). `jaxpar.on_stream` had the same holes.

Every program here is checked to contain stream calls, so no test passes vacuously.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from helpers.lowered import STREAM_ATTRIBUTE, lower_for_gpu, stream_calls
from helpers.trees import assert_tree_close
from jax import lax
from jax.experimental import checkify, jet

import jaxpar

FORCED = {"target": "gpu", "force_streams": True, "min_cost_us": 0.0}
W = jnp.full((8, 8), 0.1)


def branches(a, b, i, k, s):
    """Four independent branches; the arguments decide which error (if any) fires."""
    x = jnp.tanh(a @ W) @ W
    y = (jnp.sin(b @ W) @ W)[i]                                    # index out of bounds
    z = jnp.log(jnp.cos(a @ W.T) @ W + s)                          # nan when s < -1
    q = (jnp.round(b @ W.T @ W * 10.0)).astype(jnp.int32) // k     # integer division by 0
    return x, y, z, q


def stream_branches(a, b, i, k, s):
    """The same branches placed by hand with `on_stream`, one with a user check."""
    def first(a, s):
        checkify.check(jnp.all(s > -5.0), "s must exceed -5, got {}", s)
        return jnp.tanh(a @ W) @ W, jnp.log(jnp.cos(a @ W.T) @ W + s)

    def second(b, i, k):
        return ((jnp.sin(b @ W) @ W)[i],
                (jnp.round(b @ W.T @ W * 10.0)).astype(jnp.int32) // k)

    (x, z) = jaxpar.on_stream(1, scheduling_group=3)(first)(a, s)
    (y, q) = jaxpar.on_stream(2, scheduling_group=3)(second)(b, i, k)
    return x, y, z, q


def plain_branches(a, b, i, k, s):
    """`stream_branches` without the streams: what `jax.jit` checks."""
    checkify.check(jnp.all(s > -5.0), "s must exceed -5, got {}", s)
    return branches(a, b, i, k, s)


A = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)
CLEAN = (A, A * 0.5, 2, 3, 0.0)
TRIGGERS = {  # one error each
    "none": CLEAN,
    "index": (A, A * 0.5, 7, 3, 0.0),
    "nan": (A, A * 0.5, 2, 3, -2.0),
    "div": (A, A * 0.5, 2, 0, 0.0),
    "user": (A, A * 0.5, 2, 3, -6.0),  # nan too: the check comes first in program order
}
ERROR_SETS = {
    "user_checks": checkify.user_checks,
    "index_checks": checkify.index_checks,
    "float_checks": checkify.float_checks,
    "nan_checks": checkify.nan_checks,
    "div_checks": checkify.div_checks,
    "automatic_checks": checkify.automatic_checks,
    "all_checks": checkify.all_checks,
}


def _errors(fn, errors):
    checked = jax.jit(checkify.checkify(fn, errors=errors))
    return {name: checked(*args)[0].get() for name, args in TRIGGERS.items()}


@functools.cache
def _decorated():
    return jaxpar.parallel_branches(branches, **FORCED)


@pytest.mark.parametrize("errors", sorted(ERROR_SETS))
def test_checkify_sees_inside_regions(errors):
    fn = _decorated()
    assert len(stream_calls(lower_for_gpu(fn, *CLEAN))) >= 2
    checked = checkify.checkify(fn, errors=ERROR_SETS[errors])
    # checkify threads one error value through every check, which chains the regions
    # one after another, so under checkify jaxpar checks the program as written: the
    # same checks in the same order as jax.jit (``_ops.program_p``).
    assert not stream_calls(lower_for_gpu(checked, *CLEAN))
    want = _errors(branches, ERROR_SETS[errors])
    assert _errors(fn, ERROR_SETS[errors]) == want
    if errors == "all_checks":  # the test can fail: every error fires somewhere
        assert all(want[name] for name in ("index", "nan", "div"))


# Several checks failing at once in independent branches: checkify reports the first
# in program order (per kind the earliest, across kinds the earliest drawn code). The
# branches are packed onto streams out of program order (x and z share one), so a
# checked rewritten program reported the log's NaN where jax.jit reports the index.
SEVERAL = {
    "index+nan": (A, A * 0.5, 7, 3, -2.0),
    "index+div": (A, A * 0.5, 7, 0, 0.0),
    "nan+div": (A, A * 0.5, 2, 0, -2.0),
    "index+nan+div": (A, A * 0.5, 7, 0, -2.0),
}


@pytest.mark.parametrize("errors", ["automatic_checks", "all_checks",
                                    "index_checks", "float_checks"])
def test_checkify_reports_the_first_error_in_program_order(errors):
    fn = _decorated()
    plain = jax.jit(checkify.checkify(branches, errors=ERROR_SETS[errors]))
    checked = jax.jit(checkify.checkify(fn, errors=ERROR_SETS[errors]))
    seen = set()
    for name, args in SEVERAL.items():
        want = plain(*args)[0].get()
        assert checked(*args)[0].get() == want, name
        seen.add(want)
    assert len(seen - {None}) >= (2 if errors != "index_checks" else 1)  # not vacuous


def test_checkify_of_a_decorated_function_inside_another():
    inner = _decorated()

    def outer(a, b, i, k, s):
        x, y, z, q = inner(a, b, i, k, s)
        return jnp.sin(x) @ W, y, z, q, jnp.cos(a) @ W

    fn = jaxpar.parallel_branches(outer, **FORCED)
    for args in SEVERAL.values():
        want = jax.jit(checkify.checkify(outer, errors=checkify.all_checks))(*args)
        got = jax.jit(checkify.checkify(fn, errors=checkify.all_checks))(*args)
        assert got[0].get() == want[0].get()
        assert_tree_close(got[1], want[1])


@pytest.mark.parametrize("errors", ["user_checks", "float_checks", "all_checks"])
def test_checkify_sees_inside_on_stream(errors):
    assert len(stream_calls(lower_for_gpu(
        lambda *z: checkify.checkify(stream_branches, errors=ERROR_SETS[errors])(*z), *CLEAN))) == 2
    want = _errors(plain_branches, ERROR_SETS[errors])
    assert _errors(stream_branches, ERROR_SETS[errors]) == want
    assert want["user"] if errors != "float_checks" else want["nan"]


def test_checkify_of_grad_and_vmap_through_regions():
    fn = _decorated()

    def loss(f):
        return lambda a, s: jnp.sum(f(a, a * 0.5, 2, 3, s)[2])

    for name, transform in (("grad", lambda f: jax.grad(loss(f))),
                            ("vmap", lambda f: jax.vmap(loss(f), in_axes=(0, None)))):
        arg = A if name == "grad" else jnp.stack([A, -A])
        got = jax.jit(checkify.checkify(transform(fn), errors=checkify.float_checks))
        want = jax.jit(checkify.checkify(transform(branches), errors=checkify.float_checks))
        for s in (0.0, -2.0):
            assert got(arg, s)[0].get() == want(arg, s)[0].get(), (name, s)
            assert_tree_close(got(arg, s)[1], want(arg, s)[1], rtol=2e-5, atol=2e-6)
    assert want(arg, -2.0)[0].get() is not None


def test_jet_through_regions_matches_jax():
    def f(a, b):
        return jnp.tanh(a @ W) @ W, jnp.sin(b @ W) @ W

    g = jaxpar.parallel_branches(f, **FORCED)
    a, b = A, A * 0.5
    assert len(stream_calls(lower_for_gpu(g, a, b))) == 2
    series = ([a, a * 0.3, -a], [b, b * 2.0, b])
    assert_tree_close(jet.jet(g, (a, b), series), jet.jet(f, (a, b), series),
                      rtol=1e-5, atol=1e-6)


# --- second-order reverse mode (JAX's tests/lax_control_flow_test.py) --------------------

POLICIES = {"nothing_saveable": jax.checkpoint_policies.nothing_saveable,
            "everything_saveable": jax.checkpoint_policies.everything_saveable}


def checkpointed_scan(policy, f, *args):
    return jax.checkpoint(functools.partial(lax.scan, f), policy=POLICIES[policy])(*args)


def scan_step(c, a):
    """testScanGrad's body: three reductions, which forced streams put in regions."""
    d = jnp.array([0.3, -0.7])
    b = jnp.sum(jnp.sin(a)) + jnp.sum(jnp.sin(c)) + jnp.sum(jnp.sin(d))
    return jnp.sin(c * b), b


def stream_step(c, a):
    """The same body with its reductions placed by hand."""
    d = jnp.array([0.3, -0.7])
    sa = jaxpar.on_stream(1)(lambda v: jnp.sum(jnp.sin(v)))(a)
    sc = jaxpar.on_stream(2)(lambda v: jnp.sum(jnp.sin(v)))(c)
    b = sa + sc + jnp.sum(jnp.sin(d))
    return jnp.sin(c * b), b


SCAN_ARGS = (jnp.array([0.4, -1.1, 0.7, 0.2]),
             jnp.linspace(-1.0, 1.0, 15).reshape(5, 3))


def _second_order(step, policy):
    def first(c, as_):
        return jnp.sum(checkpointed_scan(policy, step, c, as_)[0])

    return jax.grad(lambda c, as_: jnp.sum(jnp.cos(jax.grad(first, argnums=(0, 1))(c, as_)[0])),
                    argnums=(0, 1))


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("kind", ["parallel_branches", "on_stream"])
def test_grad_of_grad_through_checkpointed_scan(kind, policy):
    step = (jaxpar.parallel_branches(scan_step, **FORCED) if kind == "parallel_branches"
            else stream_step)
    got = _second_order(step, policy)
    assert len(stream_calls(lower_for_gpu(got, *SCAN_ARGS))) >= 2
    assert_tree_close(jax.jit(got)(*SCAN_ARGS), jax.jit(_second_order(jax.jit(scan_step), policy))(
        *SCAN_ARGS), rtol=2e-5, atol=2e-6)


SECOND_ORDER = {
    "hessian": jax.hessian,
    "jacfwd(grad)": lambda f: jax.jacfwd(jax.grad(f)),
    "jacrev(jacrev)": lambda f: jax.jacrev(jax.jacrev(f)),
}


@pytest.mark.parametrize(("kind", "transform"), [("parallel_branches", "hessian"),
                                                 ("parallel_branches", "jacfwd(grad)"),
                                                 ("on_stream", "jacrev(jacrev)")])
def test_hessian_and_forward_over_reverse(kind, transform):
    step = (jaxpar.parallel_branches(scan_step, **FORCED) if kind == "parallel_branches"
            else stream_step)

    def loss(step):
        return lambda c: jnp.sum(checkpointed_scan("nothing_saveable", step, c, SCAN_ARGS[1])[1])

    c = SCAN_ARGS[0]
    got = SECOND_ORDER[transform](loss(step))
    assert stream_calls(lower_for_gpu(got, c))
    want = jax.jit(SECOND_ORDER[transform](loss(jax.jit(scan_step))))(c)
    assert_tree_close(jax.jit(got)(c), want, rtol=5e-5, atol=5e-6)


def test_transposed_regions_keep_their_stream():
    g = jaxpar.parallel_branches(scan_step, **FORCED)
    text = lower_for_gpu(_second_order(g, "nothing_saveable"), *SCAN_ARGS)
    assert {attrs[STREAM_ATTRIBUTE] for _, attrs in stream_calls(text)} == {"1", "2"}


def test_region_equations_are_jaxpars_own():
    """The emitted program holds jaxpar's primitive, never a bare `xla_metadata_call`."""
    jaxpr = jax.make_jaxpr(_decorated())(*CLEAN)
    text = str(jaxpr)
    assert "jaxpar_stream_region" in text and "xla_metadata_call" not in text


def test_export_keeps_the_stream_calls():
    """`jax.export` serializes what the region primitive lowers to: the same stream calls."""
    fn = _decorated()
    exported = jax.export.export(jax.jit(fn), platforms=["cpu", "cuda"])(*CLEAN)
    assert exported.mlir_module().count(STREAM_ATTRIBUTE) >= 2
    assert_tree_close(exported.call(*CLEAN), jax.jit(branches)(*CLEAN), rtol=1e-5, atol=1e-6)


def test_on_stream_keeps_the_effects_of_an_unused_call(capfd):
    """jax 0.10's `xla_metadata_call` declared no effects, so an unused call was dropped
    with its `debug.print`; the region declares its body's effects on every version."""
    def body(x):
        jax.debug.print("inside {}", jnp.sum(x))
        return jnp.tanh(x @ x)

    placed = jaxpar.on_stream(1)(body)

    def g(x):
        placed(x)  # the output is unused: only the print remains
        return x * 2.0

    x = jnp.ones((4, 4))
    assert_tree_close(jax.jit(g)(x), x * 2.0)
    jax.effects_barrier()
    assert "inside 16.0" in capfd.readouterr().out
    assert jax.jit(g).lower(x).as_text().count(STREAM_ATTRIBUTE) == 1


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_checkify_of_grad_and_vmap_reports_the_first_error_in_program_order(transform):
    # Under grad the forward part, under vmap the batched program, is one equation whose
    # checkify rule runs the original program's checks first.
    fn = _decorated()

    def loss(f):
        return lambda a, b, i, k, s: sum(jnp.sum(t.astype(jnp.float32)) for t in f(a, b, i, k, s))

    def transformed(f):
        if transform == "grad":
            return jax.grad(loss(f), argnums=(0, 1))
        return jax.vmap(loss(f), in_axes=(0, 0, None, None, None))

    def batch(args):
        a, b, *rest = args
        return (a, b, *rest) if transform == "grad" else (a[None], b[None], *rest)

    seen = set()
    for name, args in SEVERAL.items():
        errors = checkify.automatic_checks
        want = jax.jit(checkify.checkify(transformed(branches), errors=errors))(*batch(args))
        got = jax.jit(checkify.checkify(transformed(fn), errors=errors))(*batch(args))
        assert got[0].get() == want[0].get(), name
        seen.add(want[0].get())
    assert len(seen - {None}) >= 2


# --- mutable arrays ------------------------------------------------------------------------
# JAX discharges mutable arrays (`jax.new_ref`) equation by equation before it lowers a
# program that creates them; the rewritten program's equation and the regions had no state
# discharge rule ("No state discharge rule implemented for primitive: jaxpar_program").
# Equations touching a ref have effects and stay on the main stream, in order.


def ref_branches(x, y):
    r, s = jax.new_ref(jnp.zeros_like(x)), jax.new_ref(jnp.zeros_like(y))
    r[...] += jnp.tanh(x @ W)
    s[...] += jnp.sin(y @ W)
    return (jax.freeze(r) @ W * 2.0).sum() + jnp.cos(jax.freeze(s) @ W).sum()


def ref_scan(x, y):
    def step(carry, row):
        r = jax.new_ref(jnp.zeros_like(row))
        r[...] += jnp.tanh(row @ W)
        r[...] += jnp.sin(row)
        return carry + jax.freeze(r).sum(), None

    total, _ = lax.scan(step, 0.0, jnp.stack([x, 2.0 * x]))
    return total + jnp.cos(y @ W).sum()


def _in_a_scan(fn):
    def run(x, y):
        def step(carry, _):
            r = jax.new_ref(carry)
            r[...] += fn(x, y)
            return jax.freeze(r), None
        return lax.scan(step, 0.0, None, length=2)[0]
    return run


REF_USES = {"jit": lambda fn: fn, "vmap": jax.vmap, "in a scan": _in_a_scan}


@pytest.mark.parametrize("use", sorted(REF_USES))
@pytest.mark.parametrize("program", ["branches", "scan"])
@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_mutable_arrays_in_a_rewritten_program(target, program, use):
    fn = {"branches": ref_branches, "scan": ref_scan}[program]
    g = jaxpar.parallel_branches(fn, target=target, force_streams=True, min_cost_us=0.0)
    x, y = A, A * 0.5
    if use == "vmap":
        x, y = jnp.stack([x, -x]), jnp.stack([y, 2.0 * y])
    got = jax.jit(REF_USES[use](g))(x, y)
    want = jax.jit(REF_USES[use](fn))(x, y)
    if target == "gpu":
        assert stream_calls(lower_for_gpu(g, A, A * 0.5))
        assert_tree_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert jnp.array_equal(got, want)


def test_a_region_creating_a_mutable_array_is_discharged():
    """A region (here `on_stream`'s) whose body creates and updates a ref: the lowering
    discharges it, and the region stays one stream call."""
    def body(x):
        r = jax.new_ref(jnp.zeros_like(x))
        r[...] += jnp.tanh(x @ W)
        return jax.freeze(r) * 2.0

    placed = jaxpar.on_stream(1)(body)
    assert_tree_close(jax.jit(placed)(A), jax.jit(body)(A), rtol=1e-6, atol=1e-6)
    assert len(stream_calls(lower_for_gpu(placed, A))) == 1
