"""Training steps written for `eqx.filter_jit` and `nnx.jit` run as written under jaxpar
(`jaxpar._frameworks`).

Each step is the shape found in public Equinox and Flax NNX code: Python-scalar module
fields that steer tracing (`hidden_size: int`, `patch_size`, `Dropout.p`,
`BatchNorm.inference`), steps that return the updated modules and optimizer states, and
NNX steps that update a model, an `nnx.Optimizer`, metrics and `nnx.Rngs` in place and
return nothing. Each is compared with the library's own jit: values, returned modules'
arrays and static fields, and the caller's objects' state after the call.

Example::

    JAX_PLATFORMS=cpu pytest tests/test_frameworks.py -q

Sharp edges:
    The steps run with `target="cpu"` (the rewrites are off there, which keeps the tests
    fast); what is tested, how arguments and outputs pass, is the same on every target,
    and the read-only NNX forward runs with `target="gpu"`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.environment import needs_plugin

import jaxpar

RTOL = 1e-5
ATOL = 1e-6


def _raw(leaf: Any) -> Any:
    if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(leaf)
    return leaf


def assert_same_pytree(got: Any, want: Any) -> None:
    """Same structure (static fields included: they sit in the tree structure), array
    leaves within float tolerance, other leaves equal."""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for a, b in zip(got_leaves, want_leaves, strict=True):
        if isinstance(b, (jax.Array, np.ndarray)):
            assert isinstance(a, (jax.Array, np.ndarray)), (type(a), type(b))
            np.testing.assert_allclose(_raw(a), _raw(b), rtol=RTOL, atol=ATOL)
        else:
            assert type(a) is type(b) and a == b, (a, b)


# ---------------------------------------------------------------------------------------------
# Equinox: eqx.filter_jit's semantics


def test_equinox_gru_step_with_an_int_field_returns_its_module():
    eqx = pytest.importorskip("equinox")
    optax = pytest.importorskip("optax")

    class Rnn(eqx.Module):
        cell: eqx.nn.GRUCell
        head: eqx.nn.Linear
        hidden_size: int  # steers tracing: jnp.zeros(self.hidden_size)

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.hidden_size = 8
            self.cell = eqx.nn.GRUCell(4, self.hidden_size, key=k1)
            self.head = eqx.nn.Linear(self.hidden_size, 1, key=k2)

        def __call__(self, xs):
            h0 = jnp.zeros(self.hidden_size)
            h, _ = jax.lax.scan(lambda h, x: (self.cell(x, h), None), h0, xs)
            return self.head(h)[0]

    model = Rnn(jax.random.key(0))
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    xs = jax.random.normal(jax.random.key(1), (3, 5, 4))
    ys = jnp.array([0.5, -0.5, 1.0])

    def step(model, opt_state, xs, ys):
        def loss_fn(model):
            return jnp.mean((jax.vmap(model)(xs) - ys) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return loss, eqx.apply_updates(model, updates), opt_state

    want = eqx.filter_jit(step)(model, opt_state, xs, ys)
    got = jaxpar.parallel_branches(step, target="cpu")(model, opt_state, xs, ys)
    assert_same_pytree(got, want)
    assert got[1].hidden_size == 8 and type(got[1].hidden_size) is int
    # The guide's composition: eqx.filter_jit around the decorated step.
    assert_same_pytree(eqx.filter_jit(jaxpar.parallel_branches(step))(model, opt_state, xs, ys),
                       want)


def _vit(eqx: Any, key: jax.Array) -> Any:
    class Vit(eqx.Module):
        patch_size: int
        embed: eqx.nn.Linear
        norm: eqx.nn.BatchNorm
        mlp: eqx.nn.MLP
        dropout: eqx.nn.Dropout
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, 3)
            self.patch_size = 4
            self.embed = eqx.nn.Linear(self.patch_size**2, 16, key=keys[0])
            self.norm = eqx.nn.BatchNorm(16, axis_name="batch", mode="batch")
            self.mlp = eqx.nn.MLP(16, 16, 32, depth=1, activation=jax.nn.gelu, key=keys[1])
            self.dropout = eqx.nn.Dropout(p=0.25)
            self.head = eqx.nn.Linear(16, 3, key=keys[2])

        def __call__(self, image, state, key):
            p = self.patch_size
            patches = image.reshape(image.shape[0] // p, p, image.shape[1] // p, p)
            patches = patches.transpose(0, 2, 1, 3).reshape(-1, p * p)
            tokens = jax.vmap(self.embed)(patches)
            pooled, state = self.norm(jnp.mean(tokens, axis=0), state)
            hidden = self.dropout(self.mlp(pooled), key=key) + pooled
            return self.head(hidden), state

    return eqx.nn.make_with_state(Vit)(key)


def test_equinox_vit_step_with_dropout_and_batchnorm_state():
    eqx = pytest.importorskip("equinox")
    optax = pytest.importorskip("optax")
    model, state = _vit(eqx, jax.random.key(0))
    optimizer = optax.sgd(0.1)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    images = jax.random.normal(jax.random.key(1), (4, 8, 8))
    labels = jnp.array([0, 1, 2, 1])
    key = jax.random.key(2)

    def loss_fn(model, state, images, labels, key):
        keys = jax.random.split(key, images.shape[0])
        batched = jax.vmap(model, axis_name="batch", in_axes=(0, None, 0), out_axes=(0, None))
        logits, state = batched(images, state, keys)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, state

    def train_step(model, state, opt_state, images, labels, key):
        (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
            model, state, images, labels, key)
        updates, opt_state = optimizer.update(grads, opt_state)
        return loss, eqx.apply_updates(model, updates), state, opt_state

    def eval_step(model, state, images, labels, key):
        return loss_fn(eqx.nn.inference_mode(model), state, images, labels, key)

    args = (model, state, opt_state, images, labels, key)
    want = eqx.filter_jit(train_step)(*args)
    got = jaxpar.parallel_branches(train_step, target="cpu")(*args)
    assert_same_pytree(got, want)
    assert got[1].dropout.p == 0.25 and got[1].patch_size == 4
    # In inference mode Dropout.inference and BatchNorm.inference are Python bools that
    # choose the branch: static, as in eqx.filter_jit.
    eval_args = (got[1], got[2], images, labels, key)
    assert_same_pytree(jaxpar.parallel_branches(eval_step, target="cpu")(*eval_args),
                       eqx.filter_jit(eval_step)(*eval_args))


def test_equinox_gan_step_returns_both_modules_and_optimizer_states():
    eqx = pytest.importorskip("equinox")
    optax = pytest.importorskip("optax")
    kg, kd, kz, kx = jax.random.split(jax.random.key(0), 4)
    generator = eqx.nn.MLP(4, 6, 16, depth=2, activation=jax.nn.leaky_relu, key=kg)
    discriminator = eqx.nn.MLP(6, "scalar", 16, depth=2, activation=jax.nn.relu, key=kd)
    g_optimizer, d_optimizer = optax.adam(1e-3), optax.adam(2e-3)
    g_state = g_optimizer.init(eqx.filter(generator, eqx.is_array))
    d_state = d_optimizer.init(eqx.filter(discriminator, eqx.is_array))
    z = jax.random.normal(kz, (8, 4))
    real = jax.random.normal(kx, (8, 6))

    def gan_step(generator, discriminator, g_state, d_state, z, real):
        def d_loss(discriminator):
            fake = jax.vmap(generator)(z)
            return (jnp.mean(jax.nn.softplus(jax.vmap(discriminator)(fake)))
                    + jnp.mean(jax.nn.softplus(-jax.vmap(discriminator)(real))))

        def g_loss(generator):
            return jnp.mean(jax.nn.softplus(-jax.vmap(discriminator)(jax.vmap(generator)(z))))

        dl, d_grads = eqx.filter_value_and_grad(d_loss)(discriminator)
        gl, g_grads = eqx.filter_value_and_grad(g_loss)(generator)
        d_updates, d_state = d_optimizer.update(d_grads, d_state)
        g_updates, g_state = g_optimizer.update(g_grads, g_state)
        return (eqx.apply_updates(generator, g_updates),
                eqx.apply_updates(discriminator, d_updates), g_state, d_state, (gl, dl))

    args = (generator, discriminator, g_state, d_state, z, real)
    want = eqx.filter_jit(gan_step)(*args)
    got = jaxpar.parallel_branches(gan_step, target="cpu")(*args)
    assert_same_pytree(got, want)
    assert got[0].activation is jax.nn.leaky_relu and got[1].out_size == "scalar"


def test_python_scalars_stay_traced_without_an_equinox_module():
    # Everything else keeps jax.jit's rule: a Python int argument is traced, and a Python
    # scalar output comes back as an array.
    g = jaxpar.parallel_branches(lambda x, n: (x * n, 2), target="cpu")
    got = g(jnp.ones(2), 3)
    assert isinstance(got[1], jax.Array)
    np.testing.assert_array_equal(got[0], jnp.full(2, 3.0))
    g(jnp.ones(2), 4)
    assert g.analyses == 1  # one trace for both ints: they are traced
    # Non-array outputs (functions) come back as they are, as from eqx.filter_jit.
    out = jaxpar.parallel_branches(lambda x: (x, jnp.tanh), target="cpu")(jnp.ones(2))
    assert out[1] is jnp.tanh


# ---------------------------------------------------------------------------------------------
# Flax NNX: nnx.jit's semantics


def _nnx_training_objects(nnx: Any, optax: Any) -> tuple[Any, Any, Any, Any]:
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.left = nnx.Linear(6, 8, rngs=rngs)
            self.right = nnx.Linear(6, 8, rngs=rngs)
            self.norm = nnx.BatchNorm(8, rngs=rngs)
            self.dropout = nnx.Dropout(0.25, rngs=rngs)
            self.head = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            hidden = jnp.tanh(self.left(x)) + jax.nn.relu(self.right(x))
            return self.head(self.dropout(self.norm(hidden)))

    model = Net(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"),
                              accuracy=nnx.metrics.Accuracy())
    rngs = nnx.Rngs(noise=7)
    return model, optimizer, metrics, rngs


def test_nnx_optimizer_step_returning_nothing_updates_the_callers_objects():
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    x = jax.random.normal(jax.random.key(3), (16, 6))
    labels = jnp.arange(16) % 3

    def train_step(model, optimizer, metrics, rngs, x, labels):
        x = x + 0.01 * jax.random.normal(rngs.noise(), x.shape)

        def loss_fn(model):
            logits = model(x)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, logits

        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        metrics.update(loss=loss, logits=logits, labels=labels)

    want = _nnx_training_objects(nnx, optax)
    got = _nnx_training_objects(nnx, optax)
    reference = nnx.jit(train_step)
    decorated = jaxpar.parallel_branches(train_step, target="cpu")
    for _ in range(2):
        assert reference(*want, x, labels) is None
        assert decorated(*got, x, labels) is None
    assert decorated.analyses == 1
    assert int(got[1].step[...]) == 2
    assert_same_pytree(nnx.state(got), nnx.state(want))
    assert_same_pytree(got[2].compute(), want[2].compute())


def test_nnx_step_returning_its_module_and_reading_one():
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    model, _, _, _ = _nnx_training_objects(nnx, optax)
    reference, _, _, _ = _nnx_training_objects(nnx, optax)
    x = jax.random.normal(jax.random.key(4), (8, 6))

    def forward(model, x):
        return model(x), model

    y, returned = jaxpar.parallel_branches(forward, target="cpu")(model, x)
    want_y, want_returned = nnx.jit(forward)(reference, x)
    assert returned is model and want_returned is reference
    np.testing.assert_allclose(y, want_y, rtol=RTOL, atol=ATOL)
    assert_same_pytree(nnx.state(model), nnx.state(reference))  # statistics, RNG counts
    # A module that is only read, in eval mode.
    model.eval()
    reference.eval()
    read = jaxpar.parallel_branches(lambda m, x: m(x), target="gpu")
    np.testing.assert_allclose(read(model, x), nnx.jit(lambda m, x: m(x))(reference, x),
                               rtol=RTOL, atol=ATOL)
    plan = jaxpar.inspect(read)(model, x)
    assert plan.num_eqns > 0


def test_nnx_module_as_the_function_is_refused_with_the_recipe():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    for fun in (model, model.__call__):
        with pytest.raises(TypeError) as info:
            jaxpar.parallel_branches(fun)
        message = str(info.value)
        assert message.startswith("parallel_branches got a Flax NNX Linear as the function")
        assert "lambda model, x: model(x)" in message and len(message) < 400
    with pytest.raises(TypeError, match="inspect got a Flax NNX Linear"):
        jaxpar.inspect(model)


def test_linen_module_as_the_function_suggests_apply():
    nn = pytest.importorskip("flax.linen")
    dense = nn.Dense(3)
    with pytest.raises(TypeError, match=r"Flax Linen Dense as the function(.|\n)*model\.apply"):
        jaxpar.parallel_branches(dense)
    variables = dense.init(jax.random.key(0), jnp.ones(2))
    np.testing.assert_allclose(jaxpar.parallel_branches(dense.apply, target="cpu")(
        variables, jnp.ones(2)), dense.apply(variables, jnp.ones(2)), rtol=RTOL)


def test_module_classes_as_the_function_are_refused_with_a_recipe():
    # Decorated, a module class became a ParallelBranches that traced only its constructor
    # (and inspect planned the initialisation); now each is refused as an instance is.
    nnx = pytest.importorskip("flax.nnx")
    nn = pytest.importorskip("flax.linen")
    eqx = pytest.importorskip("equinox")

    class NnxMlp(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(2, 2, rngs=rngs)

        def __call__(self, x):
            return self.linear(x)

    class LinenMlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

    class EqxMlp(eqx.Module):
        weight: jax.Array

        def __call__(self, x):
            return self.weight @ x

    cases = [(NnxMlp, "Flax NNX", "lambda model, x: model(x))(model, x)"),
             (nnx.Linear, "Flax NNX", "rngs=nnx.Rngs(0)"),
             (LinenMlp, "Flax Linen", "(model.apply)(variables, x)"),
             (nn.Dense, "Flax Linen", "model.init("),
             (EqxMlp, "Equinox", "lambda model, x: model(x))(model, x)"),
             (eqx.nn.Linear, "Equinox", "lambda model, x: model(x))(model, x)")]
    for cls, kind, recipe in cases:
        for decorate in (jaxpar.parallel_branches, jaxpar.parallel_branches(target="cpu")):
            with pytest.raises(TypeError) as info:
                decorate(cls)
            message = str(info.value)
            assert message.startswith(
                f"parallel_branches got the {kind} module class {cls.__name__}, not a "
                "function: only its constructor would be traced"), message
            assert recipe in message and "jaxpar.parallel_branches(" in message
        with pytest.raises(TypeError, match=rf"inspect got the {kind} module class "
                                            rf"{cls.__name__}(.|\n)*plan = jaxpar\.inspect\("):
            jaxpar.inspect(cls)
    # A class decorated with @parallel_branches fails at the class statement.
    with pytest.raises(TypeError, match="module class Decorated"):
        @jaxpar.parallel_branches
        class Decorated(nnx.Module):
            pass

    # Other classes are callables as jax.jit takes them (a constructor of arrays).
    class Pair(tuple):
        pass

    assert isinstance(jaxpar.parallel_branches(Pair), jaxpar.ParallelBranches)


# ---------------------------------------------------------------------------------------------
# Options that belong to jax.jit, and inspect's calling convention


def test_device_and_backend_are_refused_with_what_to_do():
    with pytest.raises(TypeError) as info:
        jaxpar.parallel_branches(lambda x: x, device=jax.devices()[0])
    message = str(info.value)
    assert "device_put" in message and "in_shardings" in message
    with pytest.raises(TypeError, match="do not change jaxpar's plan"):
        jaxpar.inspect(lambda x: x, donate_argnums=0)


def test_inspect_with_arguments_says_the_call_is_curried():
    with pytest.raises(TypeError, match=r"jaxpar\.inspect\(f, \*\*options\)\(\*args\)"):
        jaxpar.inspect(lambda x, y: x + y, jnp.ones(2), jnp.ones(2))


@needs_plugin
def test_gpu_preview_takes_modules_as_the_decorated_function_does():
    eqx = pytest.importorskip("equinox")
    nnx = pytest.importorskip("flax.nnx")
    mlp = eqx.nn.MLP(8, 8, 16, depth=2, activation=jax.nn.gelu, key=jax.random.key(0))
    preview = jaxpar.gpu_preview(lambda m, x: jax.vmap(m)(x), mlp, jnp.ones((4, 8)))
    assert preview.plain.matmul_kernels == preview.jaxpar.matmul_kernels == 3
    linear = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    preview = jaxpar.gpu_preview(lambda m, x: m(x), linear, jnp.ones((4, 8)))
    assert preview.plain.matmul_kernels == 1


def test_equinox_module_returned_with_jaxpar_disabled(monkeypatch):
    eqx = pytest.importorskip("equinox")
    # JAXPAR_DISABLE runs the original function under one jit: the same argument and
    # output rules hold there.
    monkeypatch.setenv("JAXPAR_DISABLE", "1")
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))

    def scale(model, factor):
        return jax.tree.map(lambda leaf: leaf * factor, model), factor

    got = jaxpar.parallel_branches(scale)(model, 2)
    assert_same_pytree(got, eqx.filter_jit(scale)(model, 2))
    assert got[1] == 2 and type(got[1]) is int


def test_nnx_ensemble_plan_says_what_it_batched_and_why_it_left_the_rest():
    # The README's claim for ensembles: identical members are batched where stacking pays,
    # and the plan says why the rest is left apart; one already vmapped has nothing to batch.
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.hidden = nnx.Linear(64, 128, rngs=rngs)
            self.out = nnx.Linear(128, 10, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return self.out(jax.nn.gelu(self.hidden(x)))

    members = [MLP(nnx.Rngs(i)) for i in range(4)]
    x = jnp.ones((64, 64))

    def predict(members: Any, x: Any) -> Any:
        return jnp.mean(jnp.stack([m(x) for m in members]), axis=0)

    plan = jaxpar.inspect(predict, target="gpu")(members, x)
    kinds = [str(d.kind) for d in plan.decisions]
    assert "batched subgraphs" in kinds, str(plan)
    left = [d for d in plan.decisions if str(d.kind) == "subgraphs left alone"]
    assert left and all("costs more than" in d.reason for d in left), str(plan)
    assert "subgraphs left alone: 4 identical independent subgraphs" in str(plan)
