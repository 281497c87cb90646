"""jaxpar on real models from the JAX ecosystem, used the way a new user would.

Each test builds a small model with a library people actually use (Flax, Equinox, Optax,
optimistix's solvers through lineax, `jax.example_libraries.stax`, `jax.scipy`,
`jax.random`, `lax.scan`, `custom_jvp` and `jax.checkpoint`), decorates the plain
function with `parallel_branches`, and checks through one helper, `check_against_jit`,
that:

- the values equal the undecorated `jax.jit(f)`, for `target="gpu"` (within a few ulps:
  XLA fuses around the calls the rewrite adds) and `"cpu"` (bit for bit: the program is
  re-emitted unchanged), called as they are and under `jax.jit`;
- gradients of a scalar loss match `jax.grad` of the original (rtol 1e-5, atol 1e-6);
- `jaxpar.inspect(f, target="gpu")` renders with `str` and serialises with `json.dumps`;
- the decorated function lowers for CUDA (`lowering_platforms=("cuda",)`) on this machine;
- where the model has heavy independent branches, the plan uses at least two streams.

By default `target="cpu"` is checked under `jax.jit` only: its eager call and gradient
run the same wrapper as the GPU target's, which is checked in every form. `JAXPAR_FULL=1`
runs every form for both targets (see tests/conftest.py).

Example::

    JAX_PLATFORMS=cpu pytest tests/test_ecosystem.py -q
    JAXPAR_FULL=1 JAX_PLATFORMS=cpu pytest tests/test_ecosystem.py -q   # the full matrix

Sharp edges:
    The extra libraries are test-only; `tests/requirements-ecosystem.txt` pins versions known
    to work with each supported jax. A test whose library is missing is skipped, not failed.
    `check_against_jit` compares with `jax.jit`, so its Equinox programs take the arrays
    split off with `eqx.partition`; whole modules and training steps, compared with
    `eqx.filter_jit` and `nnx.jit`, are in `test_frameworks.py`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxpar

try:
    from helpers.environment import FULL
    from helpers.programs import run_optimized
except ImportError:  # tests/ imported as a package
    from tests.helpers.environment import FULL
    from tests.helpers.programs import run_optimized

TARGETS = ("gpu", "cpu")
GRAD_RTOL = 1e-5
GRAD_ATOL = 1e-6


def _is_float(leaf: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.floating)


def _scalar_loss(out: Any) -> jax.Array:
    """A loss that touches every floating output leaf, so every branch gets a cotangent."""
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(out) if _is_float(leaf)]
    return sum(jnp.mean(jnp.square(leaf.astype(jnp.float32))) for leaf in leaves)


def _assert_trees(got: Any, want: Any, *, exact: bool) -> None:
    """Same structure; leaves bit-exact (same dtype) or within the gradient tolerance."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for path, got_leaf, want_leaf in zip(
        [p for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]],
        jax.tree_util.tree_leaves(got),
        jax.tree_util.tree_leaves(want),
        strict=True,
    ):
        got_leaf, want_leaf = _comparable(got_leaf), _comparable(want_leaf)
        where = jax.tree_util.keystr(path)
        if exact:
            assert got_leaf.dtype == want_leaf.dtype, where
            np.testing.assert_array_equal(got_leaf, want_leaf, err_msg=where)
        else:
            np.testing.assert_allclose(got_leaf, want_leaf, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                       err_msg=where)


def _assert_trees_equal(got: Any, want: Any) -> None:
    _assert_trees(got, want, exact=True)


def _assert_trees_close(got: Any, want: Any) -> None:
    _assert_trees(got, want, exact=False)


def _comparable(leaf: Any) -> np.ndarray:
    # Typed PRNG keys have no NumPy dtype; their raw key data is what must match.
    if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)


def check_against_jit(
    f: Callable[..., Any],
    args: Sequence[Any],
    *,
    grad_argnums: int | tuple[int, ...] = 0,
    min_streams: int = 0,
    **options: Any,
) -> jaxpar.Plan:
    """Checks `parallel_branches(f)` against `jax.jit(f)`; returns the gpu plan.

    Args:
      f: the user's function, undecorated.
      args: positional arguments (pytrees of arrays).
      grad_argnums: which arguments the loss is differentiated with respect to; None skips
        the gradient check.
      min_streams: the least `plan.num_streams` the gpu plan must reach.
      **options: more `parallel_branches` options, for every target.
    """
    want = jax.jit(f)(*args)
    loss = lambda fun: lambda *a: _scalar_loss(fun(*a))
    want_grad = None
    if grad_argnums is not None:
        want_grad = jax.jit(jax.grad(loss(f), argnums=grad_argnums))(*args)
    for target in TARGETS:
        decorated = jaxpar.parallel_branches(f, target=target, **options)
        # "cpu" re-emits the program unchanged: bit-exact. "gpu" adds non-inlined calls,
        # around which XLA:CPU fuses (and so rounds) differently: within a few ulps.
        same = _assert_trees_equal if target == "cpu" else _assert_trees_close
        same(jax.jit(decorated)(*args), want)
        every_form = target == "gpu" or FULL  # the module docstring says why
        if every_form:
            same(decorated(*args), want)
        if grad_argnums is not None and every_form:
            got_grad = jax.jit(jax.grad(loss(decorated), argnums=grad_argnums))(*args)
            _assert_trees_close(got_grad, want_grad)

    # The analysis finds the streams; they are forced past the GPU pricing (which under
    # XLA's default CUDA-graph mode leaves most straight-line sections out) so that their
    # emission is checked on real models too.
    json.loads(json.dumps(jaxpar.inspect(f, target="gpu", **options)(*args).to_dict()))
    options = {**options, "force_streams": True}
    plan = jaxpar.inspect(f, target="gpu", **options)(*args)
    assert isinstance(plan, jaxpar.Plan)
    rendered = str(plan)
    assert rendered.startswith("jaxpar plan for")
    json.loads(json.dumps(plan.to_dict()))
    assert plan.num_streams >= min_streams, rendered

    decorated = jaxpar.parallel_branches(f, target="gpu", **options)
    # Compiled at XLA's default level: forced regions around convolutions crawl at the
    # suite's level 0 on the CPU (helpers.programs.run_optimized says why).
    _assert_trees_close(run_optimized(decorated, *args), want)
    hlo = jax.jit(decorated).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    if plan.num_streams >= 2:
        assert "_xla_stream_annotation" in hlo, rendered
    return plan


def _normal(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# ---------------------------------------------------------------------------------------------
# Flax


def test_flax_nnx_multibranch_mlp():
    nnx = pytest.importorskip("flax.nnx")

    class Branch(nnx.Module):
        def __init__(self, width: int, depth: int, rngs: nnx.Rngs):
            self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

        def __call__(self, x):
            for layer in self.layers:
                x = nnx.gelu(layer(x))
            return x

    class ThreeTowers(nnx.Module):
        def __init__(self, width: int, rngs: nnx.Rngs):
            self.towers = nnx.List([Branch(width, 3, rngs) for _ in range(3)])
            self.norm = nnx.LayerNorm(width, rngs=rngs)
            self.head = nnx.Linear(3 * width, 8, rngs=rngs)

        def __call__(self, x):
            x = self.norm(x)
            return self.head(jnp.concatenate([tower(x) for tower in self.towers], axis=-1))

    width = 256
    model = ThreeTowers(width, nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    x = _normal(1, (32, width))
    # The towers are identical: the GPU target can batch them (one vmapped tower over
    # stacked weights, where the cost model says it pays), but the stacked weights need
    # more than a 1 MiB budget allows here (nine 256 x 256 matrices copied: the default
    # budget's floor is 1/4096 of the GPU's memory, 3.7 MiB for the generic profile, which
    # allows them), so within it the towers stay apart, and the plan says so; without a
    # budget it batches them; without batching, streams.
    default = check_against_jit(forward, (state, x), grad_argnums=(0, 1), memory=2**20)
    assert not [d for d in default.decisions if d.kind == "batched subgraphs"], str(default)
    assert default.memory is not None
    assert "batching left out" in default.memory.left_out[0].line()
    plan = check_against_jit(forward, (state, x), grad_argnums=(0, 1), memory="any")
    assert [d.kind for d in plan.decisions if d.kind == "batched subgraphs"], str(plan)
    check_against_jit(forward, (state, x), grad_argnums=(0, 1), min_streams=2,
                      batch_branches=False, batch_matmuls=False, memory="any")


def test_flax_nnx_module_argument_keeps_batchnorm_state_as_nnx_jit_does():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear = nnx.Linear(8, 8, rngs=rngs)
            self.norm = nnx.BatchNorm(8, rngs=rngs)

        def __call__(self, x):
            return self.norm(jnp.tanh(self.linear(x)))

    x = _normal(5, (16, 8))
    # The module as an argument: as under nnx.jit, the BatchNorm statistics the call
    # updates reach the caller's module, also when the call sits inside nnx.jit.
    reference = Net(nnx.Rngs(0))
    want = nnx.jit(lambda net, x: net(x))(reference, x)
    for wrap in (lambda f: f, nnx.jit):
        model = Net(nnx.Rngs(0))
        decorated = jaxpar.parallel_branches(lambda net, x: net(x), target="cpu")
        _assert_trees_close(wrap(lambda net, x, f=decorated: f(net, x))(model, x), want)
        _assert_trees_close(model.norm.mean[...], reference.norm.mean[...])

    # The explicit form: state in, updated state out, written back.
    model = Net(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jaxpar.parallel_branches(target="cpu")
    def step(state, x):
        net = nnx.merge(graphdef, state)
        y = net(x)
        return y, nnx.state(net)

    y, state = step(state, x)
    nnx.update(model, state)
    _assert_trees_close(y, want)
    assert float(jnp.abs(reference.norm.mean[...]).sum()) > 0
    _assert_trees_close(model.norm.mean[...], reference.norm.mean[...])
    _assert_trees_close(model.norm.var[...], reference.norm.var[...])


def test_flax_linen_inception_cnn():
    nn = pytest.importorskip("flax.linen")

    class Inception(nn.Module):
        features: int = 64

        @nn.compact
        def __call__(self, x):
            conv = functools.partial(nn.Conv, self.features)
            a = nn.relu(conv((1, 1))(x))
            b = nn.relu(conv((3, 3))(nn.relu(conv((1, 1))(x))))
            c = nn.relu(conv((3, 3))(nn.relu(conv((3, 3))(nn.relu(conv((1, 1))(x))))))
            d = conv((1, 1))(nn.max_pool(x, (3, 3), strides=(1, 1), padding="SAME"))
            return jnp.concatenate([a, b, c, d], axis=-1)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(64, (3, 3))(x))
            x = Inception()(x)
            return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))

    # 8x32x32x64 makes the 3x3 branches heavy enough for a stream each on the GPU model.
    x = _normal(2, (8, 32, 32, 3))
    params = jax.jit(Net().init)(jax.random.key(0), x)

    def loss(params, x, labels):
        logits = Net().apply(params, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    labels = jnp.arange(8) % 10
    check_against_jit(Net().apply, (params, x), grad_argnums=(0, 1), min_streams=2)
    # The training-step shape users write: value and gradient of a loss wrt params.
    step = jax.value_and_grad(loss)
    _assert_trees_close(
        jax.jit(jaxpar.parallel_branches(step, target="gpu"))(params, x, labels),
        jax.jit(step)(params, x, labels))
    check_against_jit(step, (params, x, labels), grad_argnums=None, min_streams=2)


# ---------------------------------------------------------------------------------------------
# Equinox


def test_equinox_two_branch_model():
    eqx = pytest.importorskip("equinox")

    class TwoBranch(eqx.Module):
        left: eqx.nn.MLP
        right: eqx.nn.MLP
        head: eqx.nn.Linear

        def __init__(self, width: int, key: jax.Array):
            k1, k2, k3 = jax.random.split(key, 3)
            self.left = eqx.nn.MLP(width, width, width, depth=3, key=k1)
            self.right = eqx.nn.MLP(width, width, width, depth=3,
                                    activation=jax.nn.gelu, key=k2)
            self.head = eqx.nn.Linear(2 * width, 4, key=k3)

        def __call__(self, x):
            return self.head(jnp.concatenate([self.left(x), self.right(x)]))

    width = 256
    model = TwoBranch(width, jax.random.key(0))
    xs = _normal(1, (16, width))

    # The whole module works too: its function leaves (activations) are static values, as
    # in eqx.filter_jit.
    _assert_trees_close(
        jaxpar.parallel_branches(lambda m, x: jax.vmap(m)(x), target="gpu")(model, xs),
        eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(model, xs))

    params, static = eqx.partition(model, eqx.is_array)

    def forward(params, xs):
        return jax.vmap(eqx.combine(params, static))(xs)

    # The two branches' matmuls are batched by default (batch_matmuls); streams are
    # what is checked here.
    check_against_jit(forward, (params, xs), grad_argnums=(0, 1), min_streams=2,
                      batch_matmuls=False)

    # Equinox's own filtered transformations around the decorated function.
    decorated = jaxpar.parallel_branches(forward, target="gpu")

    @eqx.filter_jit
    @eqx.filter_grad
    def grad_decorated(model, xs):
        return _scalar_loss(decorated(eqx.filter(model, eqx.is_array), xs))

    @eqx.filter_jit
    @eqx.filter_grad
    def grad_plain(model, xs):
        return _scalar_loss(jax.vmap(model)(xs))

    _assert_trees_close(
        eqx.filter(grad_decorated(model, xs), eqx.is_array),
        eqx.filter(grad_plain(model, xs), eqx.is_array))

    # An ensemble: a stacked MLP vmapped over its members, plus an unrelated second ensemble.
    keys = jax.random.split(jax.random.key(3), 4)
    ensemble = eqx.filter_vmap(lambda k: eqx.nn.MLP(64, 8, 128, depth=2, key=k))(keys)
    ens_params, ens_static = eqx.partition(ensemble, eqx.is_array)

    def ensemble_forward(ens_params, xs):
        members = eqx.combine(ens_params, ens_static)
        per_member = eqx.filter_vmap(lambda m: jax.vmap(m)(xs))(members)
        return jnp.mean(per_member, axis=0)

    check_against_jit(ensemble_forward, (ens_params, _normal(4, (16, 64))),
                      grad_argnums=(0, 1))


def test_optimistix_newton_and_levenberg_marquardt_through_lineax():
    # lineax's linear_solve is an equinox primitive that keeps the operator's
    # closure-converted jaxpr in its static parameters and binds that jaxpr's constants
    # as operands: jaxpar raised on it (make_loops_static) on jax 0.10.2, by default.
    optx = pytest.importorskip("optimistix")

    def solve(a):
        root = optx.root_find(lambda y, a: jnp.tanh(y) + a * y - 1.0,
                              optx.Newton(rtol=1e-6, atol=1e-6), jnp.zeros_like(a), args=a)
        fit = optx.least_squares(lambda y, a: y ** 2 - a,
                                 optx.LevenbergMarquardt(rtol=1e-6, atol=1e-6),
                                 jnp.ones_like(a), args=a)
        return root.value, fit.value

    a = jnp.linspace(0.5, 2.0, 8)
    def total(fn):
        return lambda a: sum(v.sum() for v in fn(a))

    want = jax.jit(solve)(a)
    want_grad = jax.jit(jax.grad(total(solve)))(a)
    for options in ({}, {"target": "tpu", "measure": False},
                    {"target": "tpu", "measure": False, "unroll_while": 4}):
        decorated = jaxpar.parallel_branches(solve, **options)
        _assert_trees_close(decorated(a), want)
        _assert_trees_close(jax.grad(total(decorated))(a), want_grad)
        planned = {k: v for k, v in options.items() if k != "measure"}
        assert str(jaxpar.inspect(solve, **planned)(a)).startswith("jaxpar plan for `test_")


# ---------------------------------------------------------------------------------------------
# Optax


def test_optax_adam_update_step():
    optax = pytest.importorskip("optax")
    shapes = {f"layer{i}": {"w": (32, 16 + i), "b": (16 + i,)} for i in range(8)}
    optimizer = optax.adam(learning_rate=1e-3)

    @jax.jit  # one compile for the set-up, not one per operation and leaf shape
    def set_up():
        params = {name: {k: _normal(10 * i + j, shape)
                         for j, (k, shape) in enumerate(leaf.items())}
                  for i, (name, leaf) in enumerate(shapes.items())}
        grads = jax.tree_util.tree_map(lambda p: 0.1 * jnp.cos(3.0 * p), params)
        opt_state = optimizer.init(params)
        # One step first, so the moments are not zero and the count is not zero.
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return grads, opt_state, optax.apply_updates(params, updates)

    grads, opt_state, params = set_up()

    def update_step(grads, opt_state, params):
        updates, new_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state

    check_against_jit(update_step, (grads, opt_state, params), grad_argnums=(0, 2))


# ---------------------------------------------------------------------------------------------
# jax.example_libraries.stax


def test_stax_inception_block():
    from jax.example_libraries import stax

    def conv(features, window):
        return stax.Conv(features, window, padding="SAME")

    inception = stax.serial(
        stax.FanOut(4),
        stax.parallel(
            stax.serial(conv(64, (1, 1)), stax.Relu),
            stax.serial(conv(64, (1, 1)), stax.Relu, conv(64, (3, 3)), stax.Relu),
            stax.serial(conv(64, (1, 1)), stax.Relu, conv(64, (3, 3)), stax.Relu,
                        conv(64, (3, 3)), stax.Relu),
            stax.serial(stax.MaxPool((3, 3), strides=(1, 1), padding="SAME"),
                        conv(64, (1, 1))),
        ),
        stax.FanInConcat(axis=-1),
    )
    init_fun, apply_fun = stax.serial(conv(64, (3, 3)), stax.Relu, inception,
                                      stax.GeneralConv(("NHWC", "HWIO", "NHWC"), 16, (1, 1)))
    x = _normal(5, (8, 32, 32, 3))
    _, params = init_fun(jax.random.PRNGKey(0), x.shape)
    check_against_jit(apply_fun, (params, x), grad_argnums=(0, 1), min_streams=2)


# ---------------------------------------------------------------------------------------------
# jax.scipy


def test_jax_scipy_linalg_on_independent_matrices():
    import jax.scipy.linalg as jsl

    n = 48
    a = _normal(1, (n, n), 1 / n**0.5) + 2.0 * jnp.eye(n)  # well conditioned
    spd = _normal(2, (n, n), 1 / n**0.5)
    spd = spd @ spd.T + n * jnp.eye(n, dtype=jnp.float32) / 4
    generator = _normal(3, (n, n), 0.3 / n**0.5)
    rhs = _normal(4, (n, 3))

    def f(a, spd, generator, rhs):
        return {
            "solve": jsl.solve(a, rhs),
            "cho_solve": jsl.cho_solve(jsl.cho_factor(spd), rhs),
            "expm": jsl.expm(generator),
            "lu_solve": jsl.lu_solve(jsl.lu_factor(a.T), rhs),
            "triangular": jsl.solve_triangular(jnp.tril(spd), rhs, lower=True),
            "logdet": jnp.linalg.slogdet(spd)[1],
        }

    check_against_jit(f, (a, spd, generator, rhs), grad_argnums=(0, 1, 2, 3))


# ---------------------------------------------------------------------------------------------
# jax.random


def _random_mixture(key, x):
    k_normal, k_uniform, k_mask, k_perm = jax.random.split(key, 4)
    w1 = jax.random.normal(k_normal, (x.shape[-1], 64), x.dtype)
    w2 = jax.random.uniform(k_uniform, (x.shape[-1], 64), x.dtype, -1.0, 1.0)
    mask = jax.random.bernoulli(k_mask, 0.7, (x.shape[0], 64))
    perm = jax.random.permutation(k_perm, x.shape[0])
    h = jnp.where(mask, jnp.tanh(x @ w1), 0.0) + jnp.sin(x @ w2)
    return {"h": h[perm], "next_key": jax.random.fold_in(key, 1)}


@pytest.mark.parametrize("key_kind", ["raw_uint32", "typed"])
def test_jax_random_split_keys(key_kind):
    key = jax.random.PRNGKey(0) if key_kind == "raw_uint32" else jax.random.key(0)
    x = _normal(7, (16, 32))
    check_against_jit(_random_mixture, (key, x), grad_argnums=1)
    if key_kind == "typed":  # once is enough: each random program takes a second to compile
        # A batch of keys, as in per-example dropout.
        keys = jax.random.split(key, 3)
        check_against_jit(jax.vmap(_random_mixture, in_axes=(0, None)), (keys, x),
                          grad_argnums=1)


# ---------------------------------------------------------------------------------------------
# Bidirectional RNN


def _rnn_params(seed: int, features: int, hidden: int) -> dict[str, jax.Array]:
    return {"w_in": _normal(seed, (features, hidden), features**-0.5),
            "w_rec": _normal(seed + 1, (hidden, hidden), hidden**-0.5),
            "b": jnp.zeros((hidden,), jnp.float32)}


def _rnn(params, xs, reverse):
    def step(h, x):
        h = jnp.tanh(x @ params["w_in"] + h @ params["w_rec"] + params["b"])
        return h, h

    h0 = jnp.zeros((xs.shape[1], params["w_rec"].shape[0]), xs.dtype)
    return lax.scan(step, h0, xs, reverse=reverse)


def bidirectional_rnn(forward_params, backward_params, xs):
    h_fwd, ys_fwd = _rnn(forward_params, xs, reverse=False)
    h_bwd, ys_bwd = _rnn(backward_params, xs, reverse=True)
    return jnp.concatenate([ys_fwd, ys_bwd], axis=-1), (h_fwd, h_bwd)


def test_bidirectional_rnn_two_scans():
    xs = _normal(8, (12, 8, 32))  # time, batch, features
    args = (_rnn_params(10, 32, 128), _rnn_params(20, 32, 128), xs)
    plan = check_against_jit(bidirectional_rnn, args, grad_argnums=(0, 1, 2))
    # Two long, independent scans: either they run on two streams or jaxpar fused them into
    # one loop (which runs both directions in the same kernels); either way not left serial.
    fused = [d for d in plan.decisions if d.kind == "fused" and d.primitives == ("scan", "scan")]
    assert plan.num_streams >= 2 or fused, str(plan)


# ---------------------------------------------------------------------------------------------
# custom_jvp and jax.checkpoint


@jax.custom_jvp
def _soft_clip(x):
    return 3.0 * jnp.tanh(x / 3.0)


@_soft_clip.defjvp
def _soft_clip_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = _soft_clip(x)
    return y, t * (1.0 - jnp.square(y / 3.0))


def custom_rules_and_remat(x, w_relu, w_gelu, w_soft, w_clip):
    @jax.checkpoint
    def relu_tower(h):
        for _ in range(3):
            h = jax.nn.relu(h @ w_relu)
        return h

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_saveable)
    def gelu_tower(h):
        for _ in range(3):
            h = jax.nn.gelu(h @ w_gelu)
        return h

    def softmax_tower(h):
        for _ in range(3):
            h = jax.nn.softmax(h @ w_soft, axis=-1) * h.shape[-1]
        return jax.nn.logsumexp(h, axis=-1)

    clipped = _soft_clip(jax.nn.silu(x @ w_clip) @ w_clip) @ w_clip
    return relu_tower(x) + gelu_tower(x) + clipped, softmax_tower(x)


def test_custom_jvp_and_checkpoint():
    width = 256
    weights = [_normal(30 + i, (width, width), width**-0.5) for i in range(4)]
    check_against_jit(custom_rules_and_remat, (_normal(6, (32, width)), *weights),
                      grad_argnums=(0, 1, 2, 3, 4), min_streams=2)
