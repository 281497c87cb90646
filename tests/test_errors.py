"""Bad input gets an error that names the argument and says what to do instead."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar


def f(x, y):
    return x + y


X = jnp.ones(3)


# --- not a function ------------------------------------------------------------------------


def test_parallel_branches_non_callable():
    with pytest.raises(TypeError, match=r"parallel_branches refuses what jax.jit refuses.*"
                                        r"Expected a callable value, got 3"):
        jaxpar.parallel_branches(3)


def test_decorator_form_non_callable():
    with pytest.raises(TypeError, match=r"callable value, got 'not a function'"):
        jaxpar.parallel_branches(target="gpu")("not a function")


def test_inspect_non_callable():
    with pytest.raises(TypeError, match=r"inspect refuses .*callable value, got 'f'. "
                                        r"A value of type str is not callable"):
        jaxpar.inspect("f")


def _plain(x):
    return x


def _generator(x):
    yield x


# What jax.jit refuses at decoration (0.10.2 to 0.12, TypeError each): a staticmethod or
# classmethod object, anything not callable, a generator function.
_REFUSED_LIKE_JIT = {
    "staticmethod": (staticmethod(_plain),
                     r"staticmethod arguments are not supported.*@staticmethod"),
    "classmethod": (classmethod(_plain),
                    r"Expected a callable value, got <classmethod.*@classmethod"),
    "generator": (_generator, r"Expected a function, got a generator function: `_generator`"),
    "partial_generator": (functools.partial(_generator), r"got a generator function"),
    "int": (3, r"Expected a callable value, got 3\. A value of type int is not callable"),
}


@pytest.mark.parametrize("name", sorted(_REFUSED_LIKE_JIT))
def test_decoration_refuses_what_jax_jit_refuses(name):
    fun, message = _REFUSED_LIKE_JIT[name]
    with pytest.raises(TypeError):
        jax.jit(fun)
    for api, decorate in (("parallel_branches", jaxpar.parallel_branches),
                          ("parallel_branches", jaxpar.parallel_branches(target="gpu")),
                          ("inspect", jaxpar.inspect), ("on_stream", jaxpar.on_stream(1))):
        with pytest.raises(TypeError, match=rf"^{api} .*{message}"):
            decorate(fun)


def test_non_callable_with_a_failing_repr_gets_the_type_error():
    class Opaque:
        def __repr__(self):
            raise ValueError("invalid repr")

    with pytest.raises(TypeError, match=r"Expected a callable value, got <Opaque "
                                        r".*type Opaque is not callable"):
        jaxpar.parallel_branches(Opaque())


def test_classmethod_and_staticmethod_outermost_work():
    class Model:
        @classmethod
        @jaxpar.parallel_branches(target="cpu")
        def scaled(cls, x):
            return x * 2.0

        @staticmethod
        @jaxpar.parallel_branches(target="cpu")
        def shifted(x):
            return x + 1.0

    np.testing.assert_array_equal(Model.scaled(X), X * 2.0)
    np.testing.assert_array_equal(Model().shifted(X), X + 1.0)


# --- options -------------------------------------------------------------------------------


def test_unknown_option_in_parallel_branches():
    with pytest.raises(TypeError, match="max_stream"):
        jaxpar.parallel_branches(f, max_stream=2)


def test_unknown_option_lists_every_option_parallel_branches_takes():
    with pytest.raises(TypeError) as error:
        jaxpar.parallel_branches(f, tunes=True)
    valid = str(error.value).split("valid options are: ")[1].split(", ")
    assert "tune" in valid and "static_argnums" in valid and "memory" in valid
    assert "did you mean 'tune'" in str(error.value)


def test_unknown_option_in_inspect_lists_the_valid_ones():
    with pytest.raises(TypeError, match=r"unknown jaxpar option.*'max_stream'.*max_streams"):
        jaxpar.inspect(f, max_stream=2)


@pytest.mark.parametrize("options", [{"measure": True}, {"tune": True},
                                     {"measure": "auto", "tune": None}])
def test_inspect_says_to_inspect_a_function_decorated_with_measure_or_tune(options):
    # They are parallel_branches' options, so "unknown option" would mislead: inspect runs
    # nothing, and a decorated function's Plan.tuning holds what was measured.
    with pytest.raises(TypeError, match=r"(?s)inspect takes no (measure|tune).*plans without "
                                        r"running.*jaxpar.inspect\(step\)") as error:
        jaxpar.inspect(f, **options)
    assert "unknown" not in str(error.value)


@pytest.mark.parametrize("options", [{"measure": False}, {"measure": False, "tune": None}])
def test_inspect_says_measure_false_is_what_it_does_already(options):
    with pytest.raises(TypeError, match=r"inspect takes no measure=False.*plans without "
                                        r"running the function, which is what .* asks; "
                                        r"leave (it|them) out"):
        jaxpar.inspect(f, **options)


@pytest.mark.parametrize("target", ["cuda", "GPU", "", None, 1])
def test_bad_target(target):
    with pytest.raises(ValueError, match=r"target must be one of 'auto', 'gpu', 'cpu', 'tpu'"):
        jaxpar.parallel_branches(f, target=target)
    with pytest.raises(ValueError, match="target"):
        jaxpar.inspect(f, target=target)


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-2, ValueError),
                                               (1.5, TypeError), (True, TypeError),
                                               ("2", TypeError), (None, TypeError)])
def test_bad_max_streams(value, error):
    with pytest.raises(error, match=r"max_streams must be an int >= 1|max_streams must be >= 1"):
        jaxpar.parallel_branches(f, max_streams=value)


def test_max_streams_zero_says_what_to_do():
    with pytest.raises(ValueError, match="use 1"):
        jaxpar.parallel_branches(f, max_streams=0)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, False, "yes", "2"])
def test_bad_unroll(value):
    with pytest.raises(ValueError, match=r"unroll must be 'auto' \(the target's default\), "
                                         r"'cost' .*None .*or an int >= 1"):
        jaxpar.parallel_branches(f, unroll=value)


@pytest.mark.parametrize("value", [1, 2, 8, None, "auto", "cost"])
def test_good_unroll(value):
    jaxpar.parallel_branches(f, unroll=value)


@pytest.mark.parametrize("name", ["fuse_scans", "batch_scans", "group_collectives"])
@pytest.mark.parametrize("value", ["yes", "on", 1, 0, None, "AUTO"])
def test_bad_switches(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be True, False or 'auto'"):
        jaxpar.parallel_branches(f, **{name: value})


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), "5", True])
def test_bad_min_cost_us(value):
    with pytest.raises(ValueError, match="min_cost_us must be a finite number >= 0"):
        jaxpar.parallel_branches(f, min_cost_us=value)


def test_bad_options_in_inspect_of_decorated():
    g = jaxpar.parallel_branches(f, target="gpu")
    with pytest.raises(ValueError, match="max_streams"):
        jaxpar.inspect(g, max_streams=0)


# --- arguments that are not arrays ---------------------------------------------------------


class Unhashable:
    __hash__ = None  # type: ignore[assignment]


def test_unhashable_argument_is_named():
    g = jaxpar.parallel_branches(f)
    with pytest.raises(TypeError, match=r"argument `y` of `f` is a set, neither an array nor "
                                        r"hashable") as info:
        g(X, {1, 2})
    assert "functools.partial" in str(info.value)


def test_string_argument_is_static():
    # Hashable non-array leaves are static values (as in eqx.filter_jit), so a string
    # steering the function works.
    def act(x, kind):
        return jnp.tanh(x) if kind == "tanh" else jnp.sin(x)

    g = jaxpar.parallel_branches(act)
    assert jnp.array_equal(g(X, "tanh"), jax.jit(act, static_argnums=1)(X, "tanh"))
    assert jnp.array_equal(g(X, "sin"), jax.jit(act, static_argnums=1)(X, "sin"))


def test_unhashable_object_inside_dict_names_the_path():
    def uses_config(x, config):
        return x * config["scale"]

    g = jaxpar.parallel_branches(uses_config)
    with pytest.raises(TypeError, match=r"argument `config\['name'\]` of `.*uses_config` is a "
                                        r"Unhashable, neither an array nor hashable"):
        g(X, {"scale": 2.0, "name": Unhashable()})


def test_nested_path_in_tuple_and_keyword():
    def h(x, *, options):
        return x

    g = jaxpar.parallel_branches(h)
    with pytest.raises(TypeError, match=r"argument `options\['layers'\]\[1\]` .* is a set"):
        g(X, options={"layers": (X, {"relu"})})


def test_non_array_via_varargs():
    def h(*xs):
        return xs[0]

    g = jaxpar.parallel_branches(h)
    with pytest.raises(TypeError, match=r"argument `args\[1\]` .* is a set"):
        g(X, {"oops"})


def test_non_array_in_inspect_mentions_bad_leaf():
    with pytest.raises(TypeError, match=r"argument `y` of `f` is a set"):
        jaxpar.inspect(f)(X, {"abc"})


def test_shape_dtype_struct_only_in_inspect():
    g = jaxpar.parallel_branches(f)
    spec = jax.ShapeDtypeStruct((3,), jnp.float32)
    with pytest.raises(TypeError, match=r"inspect\(\) also accepts jax.ShapeDtypeStruct"):
        g(spec, X)


# --- functions that cannot be traced -------------------------------------------------------


def branchy(x):
    if x.sum() > 0:
        return x
    return -x


def _text(error: BaseException) -> str:
    """The message and notes, as a traceback shows them."""
    return "\n".join([str(error), *getattr(error, "__notes__", ())])


def test_python_control_flow_on_traced_value():
    g = jaxpar.parallel_branches(branchy)
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        g(X)
    message = _text(info.value)
    assert "jaxpar could not trace `branchy`" in message
    assert "TracerBoolConversionError above" in message
    assert "float32[3]" in message
    assert "jnp/lax" in message


def test_trace_error_from_inspect():
    with pytest.raises(jax.errors.TracerBoolConversionError, match="`branchy`"):
        jaxpar.inspect(branchy)(X)


def test_user_exception_keeps_its_class_and_identity():
    error = KeyError("missing weight")

    def broken(x):
        raise error

    g = jaxpar.parallel_branches(broken)
    for _ in range(2):  # the note is added once to an exception object raised again
        with pytest.raises(KeyError, match=r"missing weight(.|\n)*`.*broken`") as info:
            g(X)
        assert info.value is error
        assert sum(note.startswith("jaxpar") for note in info.value.__notes__) == 1


def test_shape_error_names_the_shapes():
    def mismatched(x, y):
        return x @ y

    g = jaxpar.parallel_branches(mismatched)
    with pytest.raises(TypeError,
                       match=r"mismatched(.|\n)*x: float32\[2, 3\], y: float32\[4, 5\]"):
        g(jnp.ones((2, 3)), jnp.ones((4, 5)))


def test_trace_error_puts_the_cause_and_argument_first_and_shortens_the_types():
    def steer_by(params, n):
        return params["w0"] * 2 if n > 0 else params["w0"]

    params = {f"w{i}": jnp.ones((i + 1, 2)) for i in range(20)}
    g = jaxpar.parallel_branches(steer_by)
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        g(params, 3)
    first, *rest = info.value.__notes__[0].splitlines()
    assert first.startswith("jaxpar could not trace `"), first
    assert "(argument n): the TracerBoolConversionError above" in first, first
    assert "float32" not in first, first
    types = next(line for line in rest if line.startswith("Traced with 21 argument(s): "))
    assert "params['w0']: float32[1, 2]" in types, types
    assert types.endswith("... (13 more)."), types
    assert len(types) < 400, types


# --- arrays JAX cannot trace, and errors from inside the trace, name the argument ----------


def classify(x, labels):
    return x * labels


def test_numpy_string_array_names_the_argument():
    g = jaxpar.parallel_branches(classify)
    with pytest.raises(TypeError, match=r"argument `labels` of `classify` is an array of dtype "
                                        r"<U1, which JAX cannot trace"):
        g(X, np.array(["a", "b"]))


def test_overflowing_python_int_names_the_argument():
    g = jaxpar.parallel_branches(classify)
    with pytest.raises(OverflowError, match=r"argument `labels` of `classify`: .*too large"):
        g(X, 2**40)


def steer(x, w, n, flag):
    for _ in range(n):
        x = jnp.tanh(x @ w)
    return -x if flag else x


W = jnp.eye(3)


def test_python_int_steering_the_trace_names_it_and_suggests_static_argnums():
    g = jaxpar.parallel_branches(steer)
    with pytest.raises(jax.errors.TracerIntegerConversionError) as info:
        g(X, W, 3, True)
    message = _text(info.value)
    assert "argument n" in message and "flat_args" not in message
    assert "static_argnums" in message and "convert traced arrays" in message


def test_python_bool_steering_the_trace_names_it():
    g = jaxpar.parallel_branches(steer, static_argnums=2)
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        g(X, W, 3, True)
    message = _text(info.value)
    assert "argument flag" in message and "flat_args" not in message


def test_keyword_leaf_named_in_trace_errors():
    def h(x, *, config):
        return x if config["sign"] > 0 else -x

    g = jaxpar.parallel_branches(h)
    with pytest.raises(jax.errors.TracerBoolConversionError, match=r"config\['sign'\]"):
        g(X, config={"sign": jnp.float32(1.0)})


def test_conversion_hint_only_for_conversion_errors():
    def mismatched(x, y):
        return x @ y

    g = jaxpar.parallel_branches(mismatched)
    with pytest.raises(TypeError) as info:
        g(jnp.ones((2, 3)), jnp.ones((4, 5)))
    assert "jaxpar could not trace" in _text(info.value)
    assert "convert traced arrays" not in _text(info.value)
    assert "static_argnums" not in _text(info.value)


# --- did you mean ----------------------------------------------------------------------------


def test_misspelled_option_suggests_the_name_in_parallel_branches():
    with pytest.raises(TypeError, match=r"'max_stream' \(did you mean 'max_streams'\?\)"):
        jaxpar.parallel_branches(f, max_stream=2)
    with pytest.raises(TypeError, match=r"'static_argnum' \(did you mean 'static_argnums'\?\)"):
        jaxpar.parallel_branches(static_argnum=1)


def test_misspelled_option_suggests_the_name_in_inspect():
    with pytest.raises(TypeError, match=r"'unrol' \(did you mean 'unroll'\?\)"):
        jaxpar.inspect(f, unrol=2)


def test_misspelled_option_suggests_the_name_in_gpu_preview():
    # Checked before anything else, so it needs no CUDA plugin.
    with pytest.raises(TypeError, match=r"'devics' \(did you mean 'devices'\?\)"):
        jaxpar.gpu_preview(f, X, X, devics=2)
    with pytest.raises(TypeError, match=r"'fuse_scan' \(did you mean 'fuse_scans'\?\)"):
        jaxpar.gpu_preview(f, X, X, fuse_scan=False)


def test_misspelled_static_argname_suggests_the_name():
    with pytest.raises(ValueError, match=r"'nn' \(did you mean 'n'\?\)"):
        jaxpar.parallel_branches(steer, static_argnames="nn")


def test_string_where_an_array_belongs_is_named_with_its_value():
    # Strings are static leaves, so the failure comes from inside the function; the
    # message lists every argument, the string with its path, type and value (jax.jit
    # names "path b").
    def f(a, b):
        return jnp.tanh(a @ b.T)

    g = jaxpar.parallel_branches(f)
    with pytest.raises(AttributeError) as info:
        g(jnp.ones((4, 8)), "hello")
    message = _text(info.value)
    assert "Traced with 2 argument(s): a: float32[4, 8], b: static str 'hello'." in message
    assert "argument `b` is a static str 'hello'" in message
    assert "pass one (jnp.asarray(...))" in message
    # The message itself names it too, as jax.jit's does ("... at path b"): what
    # str(error) and pytest.raises(match=...) read.
    assert "at path b (static str 'hello')" in str(info.value)


@pytest.mark.parametrize("how", ["positional", "keyword", "nested"])
def test_inspect_names_a_string_argument_in_the_message(how):
    def f(x, w):
        return x @ (w["k"] if isinstance(w, dict) else w)

    x = jnp.ones(3)
    given = {"positional": ((x, "abc"), {}), "keyword": ((x,), {"w": "abc"}),
             "nested": ((x, {"k": "abc"}), {})}[how]
    with pytest.raises(TypeError) as info:
        jaxpar.inspect(f)(*given[0], **given[1])
    path = "w['k']" if how == "nested" else "w"
    assert f"at path {path} (static str 'abc')" in str(info.value), str(info.value)
    assert str(info.value).startswith("unsupported operand type(s) for @")
    # One note and one naming, however often the error passes through jaxpar.
    assert str(info.value).count("jaxpar: tracing") == 1


def test_static_leaves_are_listed_with_their_paths():
    def g(params, act):
        return act(params["w"] @ params["b"])

    with pytest.raises(TypeError) as info:
        jaxpar.parallel_branches(g)({"w": jnp.ones((4, 8)), "b": "bias" * 40}, act=jnp.tanh)
    message = info.value.__notes__[0]
    assert "params['b']: static str 'biasbias" in message
    assert "bias" * 40 not in message and "..." in message  # shortened
    assert "params['w']: float32[4, 8]" in message
    assert "act: static " in message
    assert len(message.splitlines()[0]) < 400


# --- errors raised tracing the function keep their class, as under jax.jit -----------------


_LEAKED = []


def _leak(x):
    _LEAKED.append(x)
    return x


def _use_leaked(x):
    return x + _LEAKED[-1]


def _user_value_error(x):
    raise ValueError("bad shape")


def _not_implemented(x):
    raise NotImplementedError("no rule for this primitive")


def _shard_map_out_specs_too_long(x):
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    return jax.shard_map(jnp.sin, mesh=mesh, in_specs=P("x"), out_specs=P("x", None))(x)


TRACING_FAILURES = {
    "int of an array": (lambda x: int(x), X),
    "traced shape": (lambda n: jnp.zeros(n), 3),
    "cond on None": (lambda x: jax.lax.cond(None, lambda: x, lambda: -x), X),
    "int32 overflow": (lambda x: x + jnp.int32(2**31), X),
    "user ValueError": (_user_value_error, X),
    "user KeyError": (lambda x: {}["missing"], X),
    "bool of a tracer": (branchy, X),
    "range of a tracer": (lambda x, n: x * len(range(n)), (X, 3)),
    "arange of a tracer": (lambda x: jnp.arange(x.sum()), X),
    "leaked tracer": (_use_leaked, X),
    "shard_map out_specs too long": (_shard_map_out_specs_too_long, X),
    "NotImplementedError": (_not_implemented, X),
    "shape mismatch": (lambda x: x @ jnp.ones((4, 5)), X),
}


def _raised(call, *args):
    try:
        call(*args)
    except Exception as error:  # the class is what is compared
        return error
    raise AssertionError("no error raised")


@pytest.mark.parametrize("target", ["cpu", "gpu"])
@pytest.mark.parametrize("how", ["direct", "under jax.jit", "inspect"])
@pytest.mark.parametrize("case", list(TRACING_FAILURES))
def test_tracing_errors_keep_the_class_jax_jit_raises(case, how, target):
    fun, args = TRACING_FAILURES[case]
    args = args if isinstance(args, tuple) else (args,)
    if fun is _use_leaked:
        if how == "inspect":
            pytest.skip("the leaked tracer is a constant of the program, which inspect "
                        "plans without running")
        jax.jit(_leak)(X)
    want = _raised(lambda: jax.jit(fun)(*args))
    if how == "inspect":
        got = _raised(lambda: jaxpar.inspect(fun, target=target)(*args))
    else:
        g = jaxpar.parallel_branches(fun, target=target)
        got = _raised(lambda: g(*args) if how == "direct" else jax.jit(g)(*args))
    assert type(got) is type(want), (got, want)
    assert str(want) in str(got) or type(want) is jax.errors.UnexpectedTracerError
    if type(want) is jax.errors.UnexpectedTracerError:
        return  # raised running the traced program (the tracer is one of its constants)
    name = getattr(fun, "__name__", "<lambda>")
    assert any(note.startswith("jaxpar could not trace") and name in note
               for note in getattr(got, "__notes__", ())), getattr(got, "__notes__", None)


def test_tracing_error_under_a_transformation_is_retried_with_static_scalars_only_for_conversions():
    # Python scalars are traced as jax.jit traces them; under vmap a conversion error is
    # retried with them static (where jax.jit raises), any other error keeps its class.
    g = jaxpar.parallel_branches(lambda x, n: x * len(range(n)))
    assert jax.vmap(lambda x: g(x, 3))(jnp.ones((2, 3))).shape == (2, 3)
    h = jaxpar.parallel_branches(_user_value_error)
    with pytest.raises(ValueError, match="bad shape"):
        jax.vmap(h)(jnp.ones((2, 3)))


@pytest.mark.parametrize("api", ["parallel_branches", "inspect"])
def test_decoration_errors_match_jax_jit(api):
    def generator(x):
        yield x

    decorate = getattr(jaxpar, api)
    for fun in (generator, staticmethod(f), classmethod(f), 3, "f"):
        want = _raised(jax.jit, fun)
        got = _raised(decorate, fun)
        assert type(got) is type(want) is TypeError, (fun, got, want)
        assert str(want).split(",")[0] in str(got), (got, want)


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_shape_dtype_struct_under_eval_shape_is_abstract_as_for_jax_jit(target):
    # Called under a trace, jax.jit takes a ShapeDtypeStruct as an abstract argument; so
    # does a decorated function. At the top level it is still refused (above).
    inner = jaxpar.parallel_branches(lambda x: x * 2.0, target=target)
    spec = jax.ShapeDtypeStruct((3,), jnp.float32)
    got = jax.eval_shape(lambda: inner(spec))
    want = jax.eval_shape(lambda: jax.jit(lambda x: x * 2.0)(spec))
    assert (got.shape, got.dtype) == (want.shape, want.dtype) == ((3,), jnp.float32)
