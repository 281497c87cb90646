"""A ``jax.jit`` whose cache misses a function of ours answers first.

``jax.jit`` is a C++ object (``PjitFunction``): a call whose signature it compiled before
runs without any Python; any other call (a new signature, a tracer argument, a leaf JAX
cannot trace) goes to its Python ``cache_miss``, which traces, compiles and hands back
what the C++ side caches for the next call. ``routed_jit`` builds the same C++ object
around a ``cache_miss`` of ours, which may answer a call itself (returning no cache data,
so that such calls keep coming to it) or pass it to ``jax.jit``'s own.

Example::

    routed = routed_jit(fun, lambda jax_miss: my_miss, static_argnums=(1,))
    routed.call(x, 3)        # C++ only once (x's signature, 3) was compiled

Sharp edges:
  * Built from ``jax._src.pjit`` internals that are the same in jax 0.10.2 and 0.12:
    ``PjitFunction._cache_miss`` and ``_jit_info``, ``pxla.JitGlobalCppCacheKeys``, the
    global C++ caches and ``_jax.pjit``'s arguments. ``routed_jit`` checks them when
    first used and says which is missing.
  * Under ``jax.disable_jit()`` the C++ object calls ``fun`` itself, eagerly, with the
    call's arguments: neither miss function runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

# (args, kwargs) -> (outputs, data the C++ side caches or None, whether to rebuild)
Miss = Callable[..., tuple[Any, Any, bool]]


@dataclasses.dataclass(frozen=True, slots=True)
class RoutedJit:
    """``call``: the C++ function to call; ``jax_miss``: ``jax.jit``'s own cache miss for
    the same function and options (trace, compile, and the data to cache);
    ``plain``: the ``jax.jit`` object itself (its ``lower``, ``trace``, ``clear_cache``)."""

    call: Any
    jax_miss: Miss
    plain: Any

    def cache_size(self) -> int:
        return int(self.call._cache_size())

    def clear_cache(self) -> None:
        self.call._clear_cache()
        self.plain.clear_cache()


def routed_jit(fun: Callable[..., Any], make_miss: Callable[[Miss], Miss],
               **jit_options: Any) -> RoutedJit:
    """``jax.jit(fun, **jit_options)`` with ``make_miss(jax's miss)`` answering its misses.

    Raises:
      RuntimeError: this JAX's jit internals are not the ones jaxpar knows.
    """
    plain: Any = jax.jit(fun, **jit_options)
    try:
        from jax._src import pjit as _pjit
        from jax._src import tree_util as _tree_util
        from jax._src.interpreters import pxla as _pxla
        from jax._src.lib import _jax

        info = plain._jit_info
        jax_miss = plain._cache_miss
        key = _pxla.JitGlobalCppCacheKeys(
            donate_argnums=info.donate_argnums, donate_argnames=info.donate_argnames,
            device=info.device, backend=info.backend,
            in_shardings_treedef=info.in_shardings_treedef,
            in_shardings_leaves=info.in_shardings_leaves,
            out_shardings_treedef=info.out_shardings_treedef,
            out_shardings_leaves=info.out_shardings_leaves,
            in_layouts_treedef=info.in_layouts_treedef,
            in_layouts_leaves=info.in_layouts_leaves,
            out_layouts_treedef=info.out_layouts_treedef,
            out_layouts_leaves=info.out_layouts_leaves,
            compiler_options_kvs=info.compiler_options_kvs)
        cache = _pjit._get_cpp_global_cache(key.contains_explicit_attributes)
        call = _jax.pjit(getattr(fun, "__name__", "fun"), fun, make_miss(jax_miss),
                         info.static_argnums, info.static_argnames, key,
                         _tree_util.dispatch_registry, _pxla.cc_shard_arg, cache)
    except (AttributeError, ImportError, TypeError) as error:
        raise RuntimeError(
            f"jaxpar: this JAX ({jax.__version__}) lays out jax.jit's internals otherwise "
            f"than jaxpar knows (jax 0.10.2 to 0.12): {type(error).__name__}: {error}") from error
    return RoutedJit(call, jax_miss, plain)


def donated_arguments(fun: Callable[..., Any], **jit_options: Any) -> tuple[tuple[int, ...],
                                                                          tuple[str, ...]]:
    """``(donate_argnums, donate_argnames)`` as ``jax.jit(fun, **jit_options)`` checks and
    completes them from each other by ``fun``'s signature.

    Raises:
      TypeError, ValueError: as ``jax.jit`` raises them for these options.
    """
    jitted: Any = jax.jit(fun, **jit_options)
    info = jitted._jit_info
    return tuple(info.donate_argnums), tuple(info.donate_argnames)
