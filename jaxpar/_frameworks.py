"""Equinox modules and Flax NNX objects as arguments, handled as each library's own jit does.

* **Equinox** (``eqx.filter_jit``): when an argument holds an ``eqx.Module``, every leaf
  that is not an array is static, Python ``bool``/``int``/``float``/``complex`` included
  (fields such as ``hidden_size: int``, ``Dropout.p`` or ``BatchNorm.inference`` steer
  tracing), and non-array output leaves (activation functions, a returned module's
  static fields) come back as they are. ``_trace.split_arguments`` and ``_trace.trace``
  apply it; this module only recognises the modules.
* **Flax NNX** (``nnx.jit``): graph objects (modules, ``nnx.Optimizer``, metrics,
  ``nnx.Rngs``) are split into their graph definitions (static) and their state (traced)
  by ``nnx.to_tree`` before the call, merged inside it by ``nnx.from_tree``, and the
  state the call changed (parameters, optimizer state, BatchNorm statistics, RNG
  counters, metric totals) is written back to the caller's objects afterwards, whatever
  the function returns. ``NnxCall`` does the four steps, as ``nnx.jit`` does them.

Neither library is imported here: both are looked up in ``sys.modules``, so they count
only when the user has imported them.

Example::

    call = NnxCall(tag)                       # tag: hashable, one per decorated function
    with call.context():
        pure_args, pure_kwargs = call.to_pure(args, kwargs)
        pure_out = run(call.inner(fun), pure_args, pure_kwargs)  # traced, maybe cached
        out = call.from_pure(pure_out)        # the caller's objects are updated here

Sharp edges:
  * A module passed as the *function* (``parallel_branches(model)``) is refused for NNX
    (its state would be frozen into the first trace) and for Linen (it needs
    ``model.apply``): ``refuse_module_as_function`` says what to write instead. So is a
    Flax NNX, Linen or Equinox module *class* (``@parallel_branches`` on ``class
    MLP(nnx.Module)``): only its constructor would be traced.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax


def equinox_module_type() -> type | None:
    """``eqx.Module`` when the user imported Equinox, else None."""
    module = getattr(sys.modules.get("equinox"), "Module", None)
    return module if isinstance(module, type) else None


def holds_equinox_module(tree: Any) -> bool:
    """Whether a pytree holds an ``eqx.Module`` anywhere."""
    module = equinox_module_type()
    if module is None:
        return False
    found = []

    def visit(node: Any) -> bool:
        if isinstance(node, module):
            found.append(node)
        return False

    jax.tree_util.tree_flatten(tree, is_leaf=visit)
    return bool(found)


def nnx_graph_node_check() -> Callable[[Any], bool] | None:
    """Whether a value is a Flax NNX module or other stateful object (a graph node that is
    not a ``Variable``: the ``State`` of ``nnx.split`` holds Variables and is fine).
    None unless the user imported flax.nnx (never imported here)."""
    is_graph_node = getattr(sys.modules.get("flax.nnx.graph"), "is_graph_node", None)
    variable = getattr(sys.modules.get("flax.nnx"), "Variable", None)
    if not callable(is_graph_node):
        return None
    if not isinstance(variable, type):
        return is_graph_node  # type: ignore[no-any-return]

    def is_stateful_object(value: Any) -> bool:
        return not isinstance(value, variable) and bool(is_graph_node(value))

    return is_stateful_object


def is_nnx_object(value: Any) -> bool:
    """Whether ``value`` itself is a Flax NNX module or other stateful object."""
    check = nnx_graph_node_check()
    return check is not None and bool(check(value))


def holds_nnx_object(tree: Any) -> bool:
    """Whether a pytree holds a Flax NNX graph object (module, optimizer, metric, Rngs)."""
    is_graph_node = nnx_graph_node_check()
    if is_graph_node is None:
        return False
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_graph_node)
    return any(is_graph_node(leaf) for leaf in leaves)


class NnxCall:
    """``nnx.jit``'s four steps around one traced function: split the caller's objects
    (outside), merge them (inside), split what the call left (inside), and update the
    caller's objects from it (outside). ``tag`` names the update context; one per
    decorated function."""

    def __init__(self, tag: Any):
        self._nnx = sys.modules["flax.nnx"]
        self._tag = tag

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return self._nnx.update_context(self._tag)  # type: ignore[no-any-return]

    def to_pure(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        pure_args, pure_kwargs = self._nnx.to_tree((args, kwargs), ctxtag=self._tag)
        return tuple(pure_args), dict(pure_kwargs)

    def from_pure(self, pure_out: Any) -> Any:
        """The function's output, with the caller's objects updated in place."""
        _, _, out = self._nnx.from_tree(pure_out, ctxtag=self._tag, is_inner=False)
        return out

    def inner(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        """``fun`` over split objects, returning the objects' new state beside its output
        (named after ``fun``, so trace errors name the user's arguments)."""
        nnx, tag = self._nnx, self._tag
        is_graph_node = nnx_graph_node_check()

        def inside(pure_args: tuple[Any, ...], pure_kwargs: dict[str, Any]) -> Any:
            args, kwargs = nnx.from_tree((pure_args, pure_kwargs), ctxtag=tag, is_inner=True)
            out = fun(*args, **kwargs)
            objects = jax.tree_util.tree_map(
                lambda leaf: leaf if is_graph_node is not None and is_graph_node(leaf) else None,
                (args, kwargs), is_leaf=is_graph_node)
            return nnx.to_tree((*objects, out), ctxtag=tag)

        @functools.wraps(fun)
        def merged(*pure_args: Any, **pure_kwargs: Any) -> Any:
            try:
                nnx.current_update_context(tag)
            except ValueError:
                # Traced outside a call's context (the measuring thread's build, timing
                # a candidate): one of its own. The split state carries the objects'
                # indices, so the output's state maps back to the caller's objects in
                # the call's own context, as a cached trace's does.
                with nnx.update_context(tag):
                    return inside(pure_args, pure_kwargs)
            return inside(pure_args, pure_kwargs)

        return merged


@contextlib.contextmanager
def nnx_arguments(tag: Any, fun: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]
                  ) -> Iterator[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any],
                                      NnxCall | None]]:
    """``(fun, args, kwargs, None)`` when no argument holds an NNX object; otherwise, inside
    ``nnx.jit``'s update context, the function over split objects, the split arguments and
    the ``NnxCall`` whose ``from_pure`` turns the output back."""
    if not holds_nnx_object((args, kwargs)):
        yield fun, args, kwargs, None
        return
    call = NnxCall(tag)
    with call.context():
        pure_args, pure_kwargs = call.to_pure(args, kwargs)
        yield call.inner(fun), pure_args, pure_kwargs, call


def refuse_module_as_function(fun: Any, api: str) -> None:
    """Raises ``TypeError`` for a Flax NNX or Linen module (or its bound method) passed as
    the function: an NNX module's state would be frozen into the first trace, and a
    Linen module needs ``apply``; and for a Flax or Equinox module class (a decorated
    ``class MLP(nnx.Module)``), which would trace only the constructor. Short: never
    the module's repr."""
    if isinstance(fun, type):
        _refuse_module_class(fun, api)
        return
    owner = getattr(fun, "__self__", fun)
    is_graph_node = nnx_graph_node_check()
    kind = type(owner).__name__
    result = "plan" if api == "inspect" else "y"
    if is_graph_node is not None and is_graph_node(owner):
        raise TypeError(
            f"{api} got a Flax NNX {kind} as the function: its parameters and state would be "
            "read once, when it is first traced, and never again. Pass the module as an "
            "argument instead; like nnx.jit, jaxpar splits it and writes the updated state "
            f"back:\n    {result} = jaxpar.{api}(lambda model, x: model(x))(model, x)")
    linen_module = getattr(sys.modules.get("flax.linen"), "Module", None)
    called = fun is owner or getattr(fun, "__name__", None) == "__call__"
    if called and isinstance(linen_module, type) and isinstance(owner, linen_module):
        raise TypeError(
            f"{api} got a Flax Linen {kind} as the function; a Linen module is called "
            "through its apply method with its variables:\n"
            f"    {result} = jaxpar.{api}(model.apply)(variables, x)")


def _refuse_module_class(cls: type, api: str) -> None:
    """Raises ``TypeError`` for a Flax NNX, Flax Linen or Equinox module class: decorated,
    the class becomes a function object (``isinstance`` and subclassing break) and only
    its constructor is traced (and planned, by ``inspect``)."""
    nnx_module = getattr(sys.modules.get("flax.nnx"), "Module", None)
    linen_module = getattr(sys.modules.get("flax.linen"), "Module", None)
    equinox_module = equinox_module_type()
    name = cls.__name__
    result = "plan" if api == "inspect" else "y"
    if isinstance(linen_module, type) and issubclass(cls, linen_module):
        kind, advice, recipe = "Flax Linen", "construct it and decorate its apply method", (
            f"    model = {name}(...)\n"
            "    variables = model.init(jax.random.key(0), x)\n"
            f"    {result} = jaxpar.{api}(model.apply)(variables, x)")
    elif isinstance(nnx_module, type) and issubclass(cls, nnx_module):
        kind, advice, recipe = "Flax NNX", _PASS_THE_MODULE, (
            f"    model = {name}(..., rngs=nnx.Rngs(0))\n"
            f"    {result} = jaxpar.{api}(lambda model, x: model(x))(model, x)")
    elif equinox_module is not None and issubclass(cls, equinox_module):
        kind, advice, recipe = "Equinox", _PASS_THE_MODULE, (
            f"    model = {name}(...)\n"
            f"    {result} = jaxpar.{api}(lambda model, x: model(x))(model, x)")
    else:
        return
    decorated = "" if api == "inspect" else ", and the decorated name would not be a class"
    raise TypeError(
        f"{api} got the {kind} module class {name}, not a function: only its constructor "
        f"would be traced{decorated}. Instead {advice}:\n{recipe}")


_PASS_THE_MODULE = "construct it and pass it as an argument of a decorated function"
