"""Static arguments of ``parallel_branches`` (``jaxpar._api``), as `jax.jit` has them
(`static_argnums`/`static_argnames`) and as `eqx.filter_jit` treats non-array leaves."""

from __future__ import annotations

import dataclasses
import enum
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.environment import needs_plugin
from helpers.trees import assert_tree_equal

import jaxpar


def layers(x, w, n, *, scale=1.0):
    for _ in range(n):
        x = jnp.tanh(x @ w)
    return x * scale


X = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)
W = jnp.eye(4) * 0.5 + 0.1


def test_static_argnums_steers_tracing_and_keys_the_cache():
    g = jaxpar.parallel_branches(layers, target="cpu", static_argnums=2)
    want = jax.jit(layers, static_argnums=2)
    assert_tree_equal(g(X, W, 3), want(X, W, 3))
    assert g.analyses == 1
    assert_tree_equal(g(X + 1.0, W, 3), want(X + 1.0, W, 3))
    assert g.analyses == 1
    assert_tree_equal(g(X, W, 5), want(X, W, 5))
    assert g.analyses == 2
    assert g.static_argnums == (2,) and g.static_argnames == ("n",)


def test_negative_static_argnums_count_from_the_end():
    g = jaxpar.parallel_branches(layers, target="cpu", static_argnums=-1)
    assert_tree_equal(g(X, W, 2), jax.jit(layers, static_argnums=-1)(X, W, 2))


def test_static_argnames_cover_keyword_and_positional_calls():
    g = jaxpar.parallel_branches(layers, target="cpu", static_argnames="n")
    assert g.static_argnums == (2,)
    want = jax.jit(layers, static_argnames="n")(X, W, n=2)
    assert_tree_equal(g(X, W, n=2), want)
    assert_tree_equal(g(X, W, 2), want)


def test_keyword_only_static_argname():
    def scaled(x, *, mode):
        return x * 2.0 if mode == "double" else x

    g = jaxpar.parallel_branches(scaled, target="cpu", static_argnames="mode")
    assert g.static_argnums == ()
    assert_tree_equal(g(X, mode="double"), X * 2.0)


def test_static_values_are_keyed_by_type_too():
    def kind(x, n):
        return x * n

    g = jaxpar.parallel_branches(kind, target="cpu", static_argnums=1)
    want = jax.jit(kind, static_argnums=1)
    assert_tree_equal(g(X, 2), want(X, 2))
    assert_tree_equal(g(X, 2.0), want(X, 2.0))  # 2 == 2.0, but another static value
    assert g.analyses == 2


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"static_argnums": 3}, ValueError, r"static_argnums=\(3,\) .* takes 3 positional"),
    ({"static_argnums": -4}, ValueError, r"out of range"),
    ({"static_argnums": "2"}, TypeError, r"static_argnums must be an int"),
    # A bool is an int to Python (jax.jit reads True as 1), never meant as a position.
    ({"static_argnums": True}, TypeError, r"static_argnums must be an int .*positions"),
    ({"static_argnums": [0, True]}, TypeError, r"got \[0, True\]"),
    ({"static_argnames": "m"}, ValueError, r"no argument named 'm'"),
    ({"static_argnames": 2}, TypeError, r"static_argnames must be a str"),
])
def test_static_arguments_are_validated_like_jax_jit(kwargs, error, match):
    with pytest.raises(error, match=match):
        jaxpar.parallel_branches(layers, **kwargs)


def test_positional_only_static_argname_is_refused():
    def pos_only(x, n, /):
        return x * n

    with pytest.raises(ValueError, match="positional-only"):
        jaxpar.parallel_branches(pos_only, static_argnames="n")


def test_varargs_accept_any_static_argnum():
    def many(*xs):
        return xs[0] * len(xs[1])

    g = jaxpar.parallel_branches(many, target="cpu", static_argnums=1)
    assert_tree_equal(g(X, (1, 2, 3)), X * 3)


def test_unhashable_static_value_is_refused_as_jax_jit_refuses_it():
    # A static argument is hashed by JAX's C++ dispatch, which jaxpar's call is: the error
    # is jax.jit's own (a ValueError naming the value and its type).
    g = jaxpar.parallel_branches(layers, static_argnums=2)
    for decorated in (g, jax.jit(layers, static_argnums=2)):
        with pytest.raises(ValueError, match=r"^Non-hashable static arguments are not "
                                             r"supported.*\[1, 2\]"):
            decorated(X, W, [1, 2])
    np.testing.assert_allclose(g(X, W, 2), jax.jit(layers, static_argnums=2)(X, W, 2))


def test_static_argnames_naming_star_args_is_refused_at_decoration_as_by_jax_jit():
    def h(a, /, b, c, *args, **kwargs):
        return b

    for decorate in (jax.jit, jaxpar.parallel_branches):
        with pytest.raises(ValueError):
            decorate(h, static_argnames=("args", "c"))
        decorate(h, static_argnames=("b", "c", "not_defined"))  # **kwargs takes it


def test_static_argument_traced_by_an_outer_jit_says_to_make_it_static_there():
    # The outer jit traces the int: the message is about the outer jit, not about hashing.
    g = jaxpar.parallel_branches(layers, static_argnums=2)
    with pytest.raises(TypeError, match=r"static argument `n` of `layers` is a traced value.*"
                                        r"static_argnums"):
        jax.jit(g)(X, W, 3)
    assert_tree_equal(jax.jit(g, static_argnums=2)(X, W, 3),
                      jax.jit(layers, static_argnums=2)(X, W, 3))


def test_python_int_without_static_argnums_names_it():
    g = jaxpar.parallel_branches(layers, target="cpu")
    with pytest.raises(jax.errors.TracerIntegerConversionError, match=r"argument n"):
        g(X, W, 3)


# --- under other transformations --------------------------------------------------------------


def test_jit_of_decorated_with_static_argnums():
    # The outer jit's static int reaches the decorated function as a Python value, which
    # stays one under a transformation.
    g = jaxpar.parallel_branches(layers, target="cpu")
    got = jax.jit(g, static_argnums=2)(X, W, 3)
    assert_tree_equal(got, jax.jit(layers, static_argnums=2)(X, W, 3))
    got = jax.jit(g, static_argnames="n")(X, W, n=2)
    assert_tree_equal(got, jax.jit(layers, static_argnames="n")(X, W, n=2))


def test_vmap_with_python_scalar_argument():
    g = jaxpar.parallel_branches(layers, target="cpu")
    xs = jnp.stack([X, X * 0.5])
    got = jax.vmap(g, in_axes=(0, None, None))(xs, W, 2)
    want = jax.jit(jax.vmap(functools.partial(layers, n=2), in_axes=(0, None)))(xs, W)
    assert_tree_equal(got, want)


def test_inspect_takes_static_arguments():
    plan = jaxpar.inspect(layers, target="cpu", static_argnums=2)(X, W, 3)
    assert plan.num_eqns >= 6
    decorated = jaxpar.parallel_branches(layers, static_argnames="n")
    assert jaxpar.inspect(decorated, target="cpu")(X, W, n=3).num_eqns == plan.num_eqns


def test_hashable_leaves_inside_pytrees_are_static():
    def apply(params, x):
        return params["act"](x @ params["w"])

    g = jaxpar.parallel_branches(apply, target="cpu")
    for act in (jnp.tanh, jax.nn.gelu, jnp.tanh):
        want = jax.jit(lambda w, x, act=act: act(x @ w))(W, X)
        assert_tree_equal(g({"w": W, "act": act}, X), want)
    assert g.analyses == 2  # one plan per function, reused for the second tanh


# --- Equinox ----------------------------------------------------------------------------------


def test_equinox_module_with_function_leaves():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 3, 8, depth=2, activation=jax.nn.gelu, key=jax.random.key(0))
    xs = jnp.linspace(-1.0, 1.0, 20).reshape(5, 4)

    def forward(model, xs):
        return jax.vmap(model)(xs)

    g = jaxpar.parallel_branches(forward, target="cpu")
    want = eqx.filter_jit(forward)(model, xs)
    assert_tree_equal(g(model, xs), want)
    assert_tree_equal(eqx.filter_jit(g)(model, xs), want)

    def loss(model, xs):
        return jnp.sum(forward(model, xs) ** 2)

    decorated_loss = jaxpar.parallel_branches(loss, target="cpu")
    grads = eqx.filter_grad(decorated_loss)(model, xs)
    want_grads = eqx.filter_jit(eqx.filter_grad(loss))(model, xs)
    jax.tree_util.tree_map(np.testing.assert_array_equal, eqx.filter(grads, eqx.is_array),
                           eqx.filter(want_grads, eqx.is_array))


# --- gpu_preview takes them like the decorator --------------------------------------------


@needs_plugin
def test_gpu_preview_takes_static_and_keyword_arguments():
    # n steers the trace (a Python loop), scale is a keyword argument.
    preview = jaxpar.gpu_preview(layers, X, W, 3, static_argnums=2, kwargs={"scale": 2.0},
                                 batch_matmuls=False)
    want = jaxpar.inspect(layers, target="gpu", static_argnums=2, batch_matmuls=False)(
        X, W, 3, scale=2.0)
    assert preview.plan.num_eqns == want.num_eqns
    assert preview.plain.kernels == preview.jaxpar.kernels >= 3  # three dependent matmuls
    # A decorated function brings its static arguments along.
    decorated = jaxpar.parallel_branches(layers, static_argnames="n", batch_matmuls=False)
    again = jaxpar.gpu_preview(decorated, X, W, kwargs={"n": 3, "scale": 2.0})
    assert again.plan.num_eqns == want.num_eqns
    assert again.plain.kernels == preview.plain.kernels


# --- plain objects: static, keyed by their state, warned once ----------------------------


class Config:
    """A plain config object: neither an array nor a pytree."""

    def __init__(self, scale, shift=0.0):
        self.scale = scale
        self.shift = shift


class SlottedConfig:
    __slots__ = ("scale",)

    def __init__(self, scale):
        self.scale = scale


def fresh_scaled():
    """A new function each time: warnings are once per function and argument."""
    def scaled(x, cfg):
        return x * cfg.scale
    return scaled


def _static_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category,
                                                         jaxpar.StaticArgumentWarning)]


def test_mutated_config_object_gives_the_new_result():
    # Keyed by identity, the second call reused the trace of scale=2.0 and returned 2.0s.
    g = jaxpar.parallel_branches(fresh_scaled(), target="cpu")
    cfg = Config(2.0)
    with pytest.warns(jaxpar.StaticArgumentWarning):
        assert_tree_equal(g(X, cfg), X * 2.0)
    cfg.scale = 5.0
    assert_tree_equal(g(X, cfg), X * 5.0)
    assert g.analyses == 2
    cfg.scale = 2.0  # back to a value seen before: that trace again
    assert_tree_equal(g(X, cfg), X * 2.0)
    assert g.analyses == 2


@pytest.mark.parametrize("frozen", [False, True])
def test_dataclass_config_is_keyed_by_its_fields(frozen):
    @dataclasses.dataclass(frozen=frozen)
    class Settings:
        scale: float
        layers: tuple[int, ...] = (2,)

    g = jaxpar.parallel_branches(fresh_scaled(), target="cpu")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert_tree_equal(g(X, Settings(2.0)), X * 2.0)
        assert_tree_equal(g(X, Settings(2.0)), X * 2.0)  # an equal one: the same trace
        assert g.analyses == 1
        settings = Settings(3.0)
        assert_tree_equal(g(X, settings), X * 3.0)
        if not frozen:  # a mutable dataclass (unhashable) used to be refused
            settings.scale = 4.0
            assert_tree_equal(g(X, settings), X * 4.0)
    # A frozen dataclass hashes its fields itself: no warning; a mutable one is warned.
    assert len(_static_warnings(record)) == (0 if frozen else 1)


def test_equal_config_objects_share_one_trace():
    traces = []

    def counted(x, cfg):
        traces.append(cfg.scale)
        return x * cfg.scale

    g = jaxpar.parallel_branches(counted, target="cpu")
    with pytest.warns(jaxpar.StaticArgumentWarning):
        for _ in range(3):
            assert_tree_equal(g(X, Config(2.0)), X * 2.0)
    assert g.analyses == 1 and traces == [2.0]
    g(X, Config(3.0))
    # 1 and 1.0 are equal in Python, but not the same constant: their own traces.
    g(X, Config(1.0))
    g(X, Config(1))
    assert g.analyses == 4 and traces == [2.0, 3.0, 1.0, 1]


def test_static_object_warning_names_the_argument_its_type_and_the_fix_once():
    def two(x, cfg, *, other):
        return x * cfg.scale + other.scale

    g = jaxpar.parallel_branches(two, target="cpu")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for scale in (1.0, 2.0, 2.0):
            g(X, Config(scale), other=Config(0.5))
    messages = _static_warnings(record)
    assert len(messages) == 2, messages  # one per argument, not one per call or trace
    first, second = messages
    assert "argument `cfg` of `test_static_object_warning_names_the_argument_its_type_and_the_" \
           "fix_once.<locals>.two` is an object of type Config" in first
    assert "static_argnames=('cfg',)" in first and "as arrays" in first
    assert "snapshot of its attributes, so a change to them is seen" in first
    assert "argument `other`" in second and "static_argnames=('other',)" in second
    assert all(w.filename == __file__ for w in record)  # the user's call, not jaxpar's line
    # Another decorated function warns for its own arguments.
    with pytest.warns(jaxpar.StaticArgumentWarning, match="argument `cfg` of `fresh_scaled"):
        jaxpar.parallel_branches(fresh_scaled(), target="cpu")(X, Config(1.0))


def test_static_argnames_takes_the_object_as_jax_jit_does_without_a_warning():
    scaled = fresh_scaled()
    g = jaxpar.parallel_branches(scaled, target="cpu", static_argnames="cfg")
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxpar.StaticArgumentWarning)
        cfg = Config(2.0)
        assert_tree_equal(g(X, cfg), jax.jit(scaled, static_argnames="cfg")(X, cfg))
        assert_tree_equal(g(X, cfg), X * 2.0)
    assert g.analyses == 1


def test_object_that_cannot_be_compared_by_value_warns_that_changes_are_not_seen():
    g = jaxpar.parallel_branches(fresh_scaled(), target="cpu")
    cfg = SlottedConfig(2.0)
    with pytest.warns(jaxpar.StaticArgumentWarning) as record:
        assert_tree_equal(g(X, cfg), X * 2.0)
    (message,) = _static_warnings(record)
    assert "object of type SlottedConfig" in message
    assert "keyed by identity: a change to it after a call is NOT seen" in message
    cfg.scale = 5.0
    assert_tree_equal(g(X, cfg), X * 2.0)  # as the warning says: the trace of its old state
    assert g.analyses == 1
    # A large NumPy array cannot be compared either (a small one is, by its bytes).
    big = Config(np.ones(4096, np.float32))
    with pytest.warns(jaxpar.StaticArgumentWarning, match="NOT seen"):
        jaxpar.parallel_branches(lambda x, cfg: x + cfg.scale[0], target="cpu")(X, big)


def test_changes_inside_a_config_are_seen():
    g = jaxpar.parallel_branches(lambda x, cfg: x * cfg.inner.scale * sum(cfg.sizes)
                                 + cfg.table[0] + cfg.weights, target="cpu")
    cfg = Config(1.0)
    cfg.inner = Config(2.0)
    cfg.sizes = [1, 2]
    cfg.table = np.zeros(3, np.float32)
    cfg.weights = jnp.zeros(4)
    def check(got, want):
        np.testing.assert_allclose(got, want, rtol=1e-6)

    with pytest.warns(jaxpar.StaticArgumentWarning):
        check(g(X, cfg), X * 2.0 * 3)
    cfg.inner.scale = 3.0  # a nested object
    check(g(X, cfg), X * 3.0 * 3)
    cfg.sizes.append(1)  # a list, in place
    check(g(X, cfg), X * 3.0 * 4)
    cfg.table[0] = 1.0  # a small NumPy array, in place
    check(g(X, cfg), X * 3.0 * 4 + 1.0)
    cfg.weights = jnp.ones(4)  # a JAX array (immutable), replaced
    check(g(X, cfg), X * 3.0 * 4 + 1.0 + 1.0)
    assert g.analyses == 5
    cfg.cycle = cfg  # a cycle cannot be compared by value: identity, and a second warning
    with pytest.warns(jaxpar.StaticArgumentWarning, match="NOT seen"):
        g(X, cfg)


def test_values_with_their_own_equality_are_static_without_a_warning():
    eqx = pytest.importorskip("equinox")

    class Mode(enum.Enum):
        DOUBLE = 2

    def apply(x, act, name, mode, model):
        return act(model(x[0]) if name == "mlp" else x) * mode.value

    model = eqx.nn.MLP(4, 4, 8, depth=1, activation=jax.nn.relu, key=jax.random.key(0))
    g = jaxpar.parallel_branches(apply, target="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxpar.StaticArgumentWarning)
        g(X, jax.nn.relu, "mlp", Mode.DOUBLE, model)  # relu: a custom_jvp object
        g(X, functools.partial(jnp.clip, min=0.0), "id", Mode.DOUBLE, model)
        g(X, jnp.tanh, "id", Mode.DOUBLE, model)


def test_inspect_and_nnx_calls_key_config_objects_by_state():
    nnx = pytest.importorskip("flax.nnx")
    cfg = Config(2.0)
    with pytest.warns(jaxpar.StaticArgumentWarning, match="inspect passes it"):
        assert jaxpar.inspect(fresh_scaled(), target="cpu")(X, cfg).num_eqns > 0
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    def step(model, x, cfg):
        return model(x) * cfg.scale

    g = jaxpar.parallel_branches(step, target="cpu")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = g(model, X, cfg)
        cfg.scale = 3.0
        np.testing.assert_allclose(g(model, X, cfg), first * 1.5, rtol=1e-6)
    assert len(_static_warnings(record)) == 1  # once, although NNX wraps the function


def test_a_static_value_whose_eq_raises_is_a_value_error_as_in_jax_jit():
    class HashableWithoutEq:
        def __hash__(self):
            return 1

        def __eq__(self, other):
            raise NotImplementedError("no comparison")

    g = jaxpar.parallel_branches(lambda x, y: x + 3, static_argnums=1)
    with pytest.raises(ValueError, match=r"static arguments should be comparable using __eq__"):
        g(1, HashableWithoutEq())
        g(1, HashableWithoutEq())  # compared with the first call's entry
