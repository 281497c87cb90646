"""The one place that touches JAX internals and version-dependent layouts.

Everything else in jaxpar talks to jaxprs through the helpers here, so a new
JAX release means reading this file, not the whole package.

Example::

    from jaxpar import _compat
    closed = _compat.make_closed_jaxpr(lambda x: x * 2, [jax.ShapeDtypeStruct((3,), "float32")])
    body, consts = _compat.open_jaxpr(closed)

Sharp edges:
  * Up to jax 0.10 ``ClosedJaxpr`` wraps a ``Jaxpr``; from 0.11 they are one
    class and every ``Jaxpr`` carries ``.consts``. ``open_jaxpr`` hides this.
  * ``xla_metadata_call`` moved from ``jax.experimental.scheduling_groups``
    (0.8-0.10) to ``jax.experimental.xla_metadata`` (0.11+) and changed its
    equation parameters; ``eqn_frontend_attributes`` reads both layouts.
  * Re-binding an equation must happen inside ``eqn.ctx.manager`` and the
    user's source context, or metadata and error locations are lost.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
import re
import sys
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import jax
import jax.extend.core as jex_core
import numpy as np

try:  # jax >= 0.11
    from jax.experimental.xla_metadata import (  # type: ignore[attr-defined]
        xla_metadata_call as _xla_metadata_call,
    )
except ImportError:  # jax 0.8 - 0.10
    from jax.experimental.scheduling_groups import (  # type: ignore[no-redef]
        xla_metadata_call as _xla_metadata_call,
    )

if TYPE_CHECKING:
    from typing_extensions import TypeIs

from jax._src import core as _core
from jax._src import sharding_impls as _sharding_impls
from jax._src import source_info_util as _source_info_util
from jax._src.array import ArrayImpl as _ArrayImpl
from jax._src.lax import lax as _lax_internal

__all__ = [
    "JAX_VERSION",
    "Atom",
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "JaxprEqn",
    "JaxprLike",
    "Literal",
    "Primitive",
    "ShapedArray",
    "all_primitive_names",
    "Var",
    "bind_eqn",
    "eqn_frontend_attributes",
    "eqn_replace_subjaxprs",
    "eqn_subjaxprs",
    "has_frontend_attributes",
    "internal_primitive",
    "is_tracer",
    "jit_disabled",
    "register_for_clear_caches",
    "make_closed_jaxpr",
    "open_jaxpr",
    "replace_eqn",
    "retrace_like",
    "source_summary",
    "splice_jaxpr",
    "stream_call",
    "trace_context",
]


def _parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


JAX_VERSION: tuple[int, ...] = _parse_version(jax.__version__)

Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr
JaxprEqn = jex_core.JaxprEqn
Var = jex_core.Var
Literal = jex_core.Literal
DropVar = jex_core.DropVar
Primitive = jex_core.Primitive
# A jaxpr parameter or level: open (``Jaxpr``) or closed (``ClosedJaxpr``; one class
# from jax 0.11). An equation operand: a variable or a literal.
JaxprLike: TypeAlias = Jaxpr | ClosedJaxpr
ShapedArray = _core.ShapedArray
Atom: TypeAlias = Var | Literal

# From jax 0.11 ``ClosedJaxpr`` is ``Jaxpr``: "closed" then means "has consts".
_UNIFIED_JAXPR = ClosedJaxpr is Jaxpr

# XLA:GPU up to the XLA in jax 0.10 does not overlap a stream-annotated call that
# returns a tuple with anything else (seen deviceless on an H200 with jaxlib 0.10.2;
# fixed by 0.12). The emitter then packs same-dtype results into one array.
PACK_MULTI_RESULT_CALLS = JAX_VERSION < (0, 11)

# Where JAX keeps the primitive objects that ``jax.extend.core.primitives`` and
# ``jax.lax`` do not export (their homes move between releases).
_PRIMITIVE_HOMES = ("jax._src.core", "jax._src.lax.parallel", "jax._src.shard_map",
                    "jax._src.callback", "jax._src.debugging", "jax._src.random.prng",
                    "jax._src.prng", "jax._src.pjit", "jax._src.compute_on",
                    "jax._src.xla_metadata", "jax.experimental.scheduling_groups",
                    "jax._src.lax.eval_jaxpr", "jax._src.ad_checkpoint")


def internal_primitive(attribute: str) -> Any | None:
    """The primitive JAX keeps in one of its internal modules as ``attribute`` (e.g.
    ``"pvary_p"``), or None where this jax has none of that name."""
    for home in _PRIMITIVE_HOMES:
        try:
            module = importlib.import_module(home)
        except ImportError:
            continue
        primitive = getattr(module, attribute, None)
        if isinstance(primitive, jex_core.Primitive):
            return primitive
    return None


def all_primitive_names() -> frozenset[str]:
    """Names of every primitive the running jax defines at module level (for tests).

    Imports JAX's public modules and the internal homes above, then collects the
    ``Primitive`` attributes of every loaded ``jax`` module, and jaxpar's own
    (``stream_region_p``).
    """
    for name in ("jax.numpy", "jax.lax", "jax.random", "jax.nn", "jax.scipy",
                 "jax.experimental.shard_map", "jax.experimental.compute_on",
                 "jax.experimental.xla_metadata", "jax.experimental.scheduling_groups",
                 "jax.experimental.custom_partitioning", "jax.ad_checkpoint",
                 "jax.experimental.checkify", *_PRIMITIVE_HOMES):
        try:
            importlib.import_module(name)
        except ImportError:  # not in this release
            continue
    names = set()
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "jax" or module_name.startswith("jax.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, jex_core.Primitive):
                names.add(value.name)
    names.add(stream_region_p.name)
    return frozenset(names)


def ordering_effects(eqn: JaxprEqn) -> frozenset[Any]:
    """``eqn``'s effects that order it against other effectful equations.

    ``NamedAxisEffect`` (collectives over a mesh axis inside ``shard_map``) only
    records which axes are used; it imposes no order.
    """
    return frozenset(e for e in eqn.effects if not isinstance(e, _core.NamedAxisEffect))


def is_tracer(value: Any) -> bool:
    """Whether ``value`` is a JAX tracer (we are inside jit, grad, vmap, ...)."""
    return isinstance(value, jax.core.Tracer)


# The type of a concrete ``jax.Array`` (never a tracer): a decorated function's call
# checks each argument leaf, and most are of this exact type.
ARRAY_IMPL: type = _ArrayImpl


def trace_context() -> Any:
    """The configuration ``jax.jit`` keys its caches on, as one hashable value.

    Everything that changes what tracing produces: ``jax_enable_x64``, rank and dtype
    promotion, ``default_matmul_precision``, the default device, the mesh and axis
    environment, ``disable_jit`` and more. ``jax._src.config.trace_context`` on every
    version tried (0.10.2, 0.12); there is no public name for it.
    """
    from jax._src import config as _config

    return _config.trace_context()


def jit_disabled() -> bool:
    """Whether ``jax.disable_jit()`` is in force (then functions run op by op, eagerly)."""
    return bool(jax.config.jax_disable_jit)  # type: ignore[attr-defined]


# ``call_context``'s answers.
EAGER, JIT_DISABLED, TRANSFORMED = 0, 1, 2


def _disable_jit_state() -> Any:
    from jax._src import config as _config

    return getattr(_config, "disable_jit", None)


_DISABLE_JIT = _disable_jit_state()


def call_context() -> int:
    """Where a decorated function is called, read once per call: ``JIT_DISABLED`` under
    ``jax.disable_jit()``, else ``EAGER`` where ``top_level()`` holds, else
    ``TRANSFORMED``. Reads ``jax._src.config.disable_jit``'s state object (0.10.2 to
    0.12; ``jit_disabled`` where it is missing), three times faster than the config."""
    if _DISABLE_JIT.value if _DISABLE_JIT is not None else jit_disabled():
        return JIT_DISABLED
    return EAGER if isinstance(_core.trace_ctx.trace, _core.EvalTrace) else TRANSFORMED


def register_for_clear_caches(cache: Any, label: str) -> bool:
    """Has ``jax.clear_caches()`` call ``cache.cache_clear()`` from now on.

    JAX keeps a weak registry of its own caches (``jax._src.util.register_cache``, the
    hook ``util.cache`` and ``weakref_lru_cache`` use; 0.10.2 to 0.12), which
    ``jax.clear_caches()`` walks. ``cache`` must be weakly referenceable and have
    ``cache_clear()``, ``cache_info()`` and ``cache_keys()``; the registry drops it when
    it dies. Returns False (and registers nothing) where the hook is missing.
    """
    try:
        from jax._src import util as _util
    except ImportError:
        return False
    register = getattr(_util, "register_cache", None)
    if register is None:
        return False
    register(cache, label)
    return True


def prng_impl_name(aval: Any) -> str | None:
    """The PRNG implementation (``"threefry2x32"``, ``"rbg"``, ``"unsafe_rbg"``) of a key
    array's type; None for other types. Key dtypes keep it as ``dtype._impl`` (0.4.16 -
    0.12); ``jax.random.key_impl`` only answers for arrays, not types."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None or not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    impl = getattr(dtype, "_impl", None)
    return str(getattr(impl, "name", impl))


def is_jaxpr_like(value: Any) -> bool:
    return isinstance(value, (Jaxpr, ClosedJaxpr))


def open_jaxpr(jaxpr: JaxprLike) -> tuple[Jaxpr, list[Any]]:
    """Returns ``(open_jaxpr, consts)`` for a ``Jaxpr`` or ``ClosedJaxpr``.

    The open jaxpr's ``constvars`` line up with ``consts``.
    """
    if _UNIFIED_JAXPR:  # one class: ``jaxpr`` is a ``Jaxpr``
        return jaxpr, list(getattr(jaxpr, "consts", ()) or ())  # type: ignore[return-value]
    if isinstance(jaxpr, ClosedJaxpr):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, []


def has_consts(jaxpr: JaxprLike) -> bool:
    return bool(open_jaxpr(jaxpr)[1])


def all_invars(jaxpr: Jaxpr) -> list[Var]:
    """Constvars then invars of an open jaxpr."""
    return [*jaxpr.constvars, *jaxpr.invars]


def in_avals(jaxpr: JaxprLike) -> list[Any]:
    inner, _ = open_jaxpr(jaxpr)
    return [v.aval for v in inner.invars]


def make_closed_jaxpr(fn: Callable[..., Any], avals: Sequence[Any]) -> ClosedJaxpr:
    """Traces ``fn`` at abstract values (avals or ``ShapeDtypeStruct``s) to a closed jaxpr.

    Avals are passed through as they are, keeping weak types and, inside
    ``shard_map``, the varying manual axes.
    """
    return jax.make_jaxpr(fn)(*avals)


def retrace_like(fn: Callable[..., Any], original: JaxprLike) -> JaxprLike | None:
    """Traces ``fn`` into a jaxpr of the same kind and signature as ``original``.

    ``fn`` takes the original jaxpr's invars (not its constvars) and returns its
    outputs. Returns None when the result cannot stand in for ``original``
    (``original`` is an open jaxpr and the new trace captured constants).
    """
    closed = make_closed_jaxpr(fn, in_avals(original))
    new_inner, new_consts = open_jaxpr(closed)
    orig_inner, _ = open_jaxpr(original)
    if [v.aval for v in new_inner.outvars] != [v.aval for v in orig_inner.outvars]:
        return None
    if _UNIFIED_JAXPR or isinstance(original, ClosedJaxpr):
        return closed
    # ``original`` is an open jaxpr (remat, shard_map bodies up to jax 0.10).
    if new_consts or new_inner.constvars:
        return None
    return new_inner


def replace_eqn(eqn: JaxprEqn, *, invars: Sequence[Atom] | None = None,
                params: dict[str, Any] | None = None,
                outvars: Sequence[Var] | None = None, source_info: Any = None) -> JaxprEqn:
    """``eqn`` with new input atoms, parameters, output variables and/or source info
    (the same context). Input atoms identical to the equation's own count as unchanged:
    then, with nothing else given, ``eqn`` itself is returned."""
    if invars is not None and all(a is b for a, b in zip(invars, eqn.invars, strict=True)):
        invars = None
    if invars is None and params is None and outvars is None and source_info is None:
        return eqn
    return eqn.replace(invars=None if invars is None else list(invars), params=params,
                       outvars=None if outvars is None else list(outvars),
                       source_info=source_info)


def fresh_var(var: Var) -> Var:
    """A new variable of ``var``'s type (a new drop variable for a drop variable)."""
    if isinstance(var, DropVar):
        return DropVar(var.aval)
    return Var(var.aval)


def splice_jaxpr(original: JaxprLike, eqns: Sequence[JaxprEqn], outvars: Sequence[Atom],
                 new_constvars: Sequence[Var] = (), new_consts: Sequence[Any] = ()
                 ) -> JaxprLike | None:
    """``original`` with new equations and outputs, and constants appended.

    Same kind (open or closed), invars, effects and debug info as ``original``: the
    caller guarantees that ``eqns`` compute ``outvars`` from the same inputs with the
    same effects. Returns None when ``original`` is an open jaxpr (``remat`` and
    ``shard_map`` bodies up to jax 0.10) and there are constants to add.
    """
    inner, consts = open_jaxpr(original)
    constvars = [*inner.constvars, *new_constvars]
    all_consts = [*consts, *new_consts]
    if _UNIFIED_JAXPR:  # jax 0.11+: one class, with the fields of both
        return original.replace(  # type: ignore[call-arg]
            constvars=constvars, consts=all_consts, eqns=list(eqns), outvars=list(outvars),
            debug_info=original.debug_info)
    if new_constvars and not isinstance(original, ClosedJaxpr):
        return None
    new_inner = inner.replace(constvars=constvars, eqns=list(eqns), outvars=list(outvars),
                              debug_info=inner.debug_info)
    return ClosedJaxpr(new_inner, all_consts) if isinstance(original, ClosedJaxpr) else new_inner


def symbolic_sizes(values: Iterable[Any]) -> tuple[str, ...]:
    """The symbolic dimensions (``jax.export.symbolic_shape``) in the shapes of ``values``
    (arrays, avals, shape structs), as text, in first-seen order; ``()`` where every
    size is a number."""
    found: dict[str, None] = {}
    for value in values:
        for dim in getattr(value, "shape", ()):
            if not isinstance(dim, (int, np.integer)):
                found[str(dim)] = None
    return tuple(found)


def symbolic_dimensions(jaxpr: JaxprLike) -> tuple[str, ...]:
    """``symbolic_sizes`` of ``jaxpr``'s inputs and constants: a program's symbolic sizes
    all derive from its inputs'."""
    inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    return symbolic_sizes(var.aval for var in (*inner.constvars, *inner.invars))


def eqn_subjaxprs(eqn: JaxprEqn) -> Iterator[tuple[str, int | None, JaxprLike]]:
    """Yields ``(param_name, index_or_None, jaxpr)`` for every jaxpr parameter.

    Visits every parameter, including tuples of jaxprs such as ``cond``'s
    ``branches``, instead of guessing parameter names.
    """
    found: list[tuple[str, int | None, JaxprLike]] = []
    jaxpr_types = (Jaxpr, ClosedJaxpr)  # is_jaxpr_like, inlined: this runs per equation
    for name, value in eqn.params.items():
        if isinstance(value, jaxpr_types):
            found.append((name, None, value))
        elif isinstance(value, (tuple, list)):
            for index, item in enumerate(value):
                if isinstance(item, jaxpr_types):
                    found.append((name, index, item))
    return iter(found)


def eqn_replace_subjaxprs(eqn: JaxprEqn, replacements: dict[tuple[str, int | None], JaxprLike]
                          ) -> dict[str, Any]:
    """Returns ``eqn.params`` with the given jaxpr parameters replaced."""
    params = dict(eqn.params)
    for (name, index), new in replacements.items():
        if index is None:
            params[name] = new
        else:
            items = list(params[name])
            items[index] = new
            params[name] = type(params[name])(items)
    return params


def _internal_primitive_name(attribute: str, known_name: str) -> str:
    """The primitive's name from its object; ``known_name`` (its name on every supported
    jax) where a release keeps the object elsewhere, so ``import jaxpar`` never fails on
    it (``tests/test_primitives.py`` checks the lookup on the supported versions)."""
    primitive = internal_primitive(attribute)
    return known_name if primitive is None else str(primitive.name)


_XLA_METADATA_CALL = _internal_primitive_name("xla_metadata_call_p", "xla_metadata_call")
_SHARD_MAP = _internal_primitive_name("shard_map_p", "shard_map")


def eqn_frontend_attributes(eqn: JaxprEqn) -> dict[str, str]:
    """The XLA frontend attributes the user or jaxpar attached to ``eqn``."""
    attrs: dict[str, str] = {}
    ctx_meta = getattr(eqn.ctx, "xla_metadata", None)
    if ctx_meta:
        attrs.update({str(k): str(v) for k, v in dict(ctx_meta).items()})
    compute_type = getattr(eqn.ctx, "compute_type", None)
    if compute_type is not None:
        attrs["_xla_compute_type"] = str(compute_type)
    if eqn.primitive is stream_region_p:
        attrs.update(dict(eqn.params["region"].attributes))
    elif eqn.primitive.name == _XLA_METADATA_CALL:
        if "xla_metadata" in eqn.params:  # jax >= 0.11
            attrs.update({str(k): str(v) for k, v in eqn.params["xla_metadata"]})
        else:  # jax 0.8 - 0.10: the attributes are the parameters themselves
            attrs.update({str(k): str(v) for k, v in eqn.params.items() if k != "jaxpr"})
    return attrs


def has_frontend_attributes(eqn: JaxprEqn) -> bool:
    """``bool(eqn_frontend_attributes(eqn))`` without building the dict: the passes ask
    this of every equation of every level they visit."""
    ctx = eqn.ctx
    if getattr(ctx, "xla_metadata", None) or getattr(ctx, "compute_type", None) is not None:
        return True
    primitive = eqn.primitive
    if primitive is stream_region_p or primitive.name == _XLA_METADATA_CALL:
        return bool(eqn_frontend_attributes(eqn))
    return False


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any], params: dict[str, Any] | None = None
             ) -> list[Any]:
    """Binds ``eqn``'s primitive on ``invals``, keeping its source info and context."""
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (_source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
          eqn.ctx.manager):
        out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def plain_call_body(eqn: JaxprEqn) -> tuple[str, JaxprLike] | None:
    """``(name, body)`` of a nested ``jit`` or ``closed_call`` that only names its body:
    no shardings, layouts, donation or compiler options of its own. XLA inlines such a
    call (``CallInliner``), so inlining it in the jaxpr changes only the op names; None
    for any other equation.

    ``jit`` parameters (0.10.2 - 0.12): ``jaxpr, in_shardings, out_shardings,
    in_layouts, out_layouts, donated_invars, ctx_mesh, name, keep_unused, inline,
    compiler_options_kvs``; ``closed_call``: ``call_jaxpr`` alone.
    """
    params = eqn.params
    if "in_shardings" in params and "jaxpr" in params:
        if not all(isinstance(s, _sharding_impls.UnspecifiedValue)
                   for s in (*params["in_shardings"], *params["out_shardings"])):
            return None
        if any(layout is not None for layout in (*params.get("in_layouts", ()),
                                                 *params.get("out_layouts", ()))):
            return None
        if any(params.get("donated_invars", ())) or params.get("compiler_options_kvs"):
            return None
        return str(params.get("name", eqn.primitive.name)), params["jaxpr"]
    if set(params) == {"call_jaxpr"}:
        return eqn.primitive.name, params["call_jaxpr"]
    return None


_JAXPAR_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def source_summary(eqn: JaxprEqn) -> str:
    """``[scope] file:line:column (function)`` of the user code that created ``eqn``.

    ``scope`` is the equation's name stack without JAX's transformation wrappers: the
    layer path a Flax Linen model gives (``TwoTowers/query/dense0``), the module name
    Equinox gives (``eqx.nn.Linear``), a ``jax.named_scope``; ``(backward)`` marks an
    equation of a transposed (reverse-mode) computation. It is left out when empty.
    Never one of jaxpar's own frames: an equation jaxpar made itself (such as the
    stacking of batched operands) is ``<added by jaxpar>``. The path is relative to the
    working directory when the file lies under it, and ``package/module.py`` for an
    installed package (site-packages).
    """
    try:
        frame = next(iter(_source_info_util.user_frames(eqn.source_info.traceback)), None)
    except Exception:
        return "<unknown>"
    if frame is None:
        return "<unknown>"
    if frame.file_name.startswith(_JAXPAR_DIR):
        return "<added by jaxpar>"
    column = f":{frame.start_column}" if frame.start_column else ""
    scope = name_scope(eqn)
    return (f"{f'[{scope}] ' if scope else ''}{_display_path(frame.file_name)}:"
            f"{frame.start_line}{column} ({frame.function_name})")


def user_source(eqn: JaxprEqn) -> str:
    """``file:line (function)`` of the first frame of ``eqn``'s traceback in the user's
    own code: outside JAX, jaxpar and installed packages (a Flax or Equinox layer's
    ``__call__``), so a Flax ``nnx.Linear`` is placed where the user's model calls it.
    The first frame outside JAX when every frame is in a package; ``""`` without one.
    """
    try:
        frames = list(_source_info_util.user_frames(eqn.source_info.traceback))
    except Exception:
        return ""
    own = next((f for f in frames if not _in_a_package(f.file_name)), None)
    frame = own or next(iter(frames), None)
    if frame is None or frame.file_name.startswith(_JAXPAR_DIR):
        return ""
    return f"{_display_path(frame.file_name)}:{frame.start_line} ({frame.function_name})"


def _in_a_package(path: str) -> bool:
    """Whether ``path`` is a module of an installed package (or of jaxpar)."""
    return path.startswith(_JAXPAR_DIR) or any(path.startswith(folder)
                                               for folder in _site_packages())


def backward(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` belongs to a transposed (reverse-mode) computation: its name stack
    holds a ``transpose(...)`` wrapper."""
    try:
        return "transpose(" in str(eqn.source_info.name_stack)
    except Exception:
        return False


def argument_names(jaxpr: JaxprLike) -> tuple[str | None, ...]:
    """Per input of a traced jaxpr, the name JAX gave it from the traced function's
    parameters (``model.towers[0]['kernel']``, ``x``); None where it has none, and
    empty when the jaxpr records no names (or not one per input)."""
    inner, _ = open_jaxpr(jaxpr)
    names = getattr(getattr(inner, "debug_info", None), "arg_names", None)
    if names is None or len(names) != len(inner.invars):
        return ()
    return tuple(name if isinstance(name, str) and name else None for name in names)


def source_key(eqn: JaxprEqn) -> Hashable:
    """What ``source_summary(eqn)`` is made from: the traceback (jaxlib compares and
    hashes one frame by frame, so the equations a Python loop makes on one line share
    theirs) and the name stack. Equal keys, equal summaries (in one working directory).

    Raises:
      TypeError: the key is not hashable (then call ``source_summary`` itself).
    """
    info = eqn.source_info
    key = (info.traceback, info.name_stack)
    hash(key)
    return key


_WRAPPER = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)$")


def name_scope(eqn: JaxprEqn) -> str:
    """The equation's name stack as a user's layer path, without transformation wrappers.

    ``transpose(jvp(TwoTowers))/query/dense0`` -> ``TwoTowers/query/dense0 (backward)``.
    """
    try:
        text = str(eqn.source_info.name_stack)
    except Exception:
        return ""
    parts, backward = [], False
    for part in text.split("/"):
        while match := _WRAPPER.match(part):
            backward |= match.group(1) == "transpose"
            part = match.group(2)
        if part and part not in ("jvp", "transpose", "vmap", "checkpoint", "remat"):
            parts.append(part)
    if parts and parts[0] in parts[1:]:  # an accumulation of two scopes: the innermost
        parts = parts[len(parts) - 1 - parts[::-1].index(parts[0]):]
    scope = "/".join(parts)
    return f"{scope} (backward)" if scope and backward else scope


def display_name(eqn: JaxprEqn) -> str:
    """What to call ``eqn`` in a report: the wrapped function's name for a custom rule
    (``relu``, not ``custom_jvp_call``), the jitted function's for a nested ``jit``."""
    name = eqn.primitive.name
    if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
        for key in ("call_jaxpr", "fun_jaxpr"):
            inner = eqn.params.get(key)
            debug = getattr(getattr(inner, "jaxpr", inner), "debug_info", None)
            func_name = getattr(debug, "func_name", None)
            if func_name and func_name != "<lambda>":
                return str(func_name)
    elif name in ("pjit", "jit") and eqn.params.get("name") not in (None, "<lambda>"):
        return f"jit({eqn.params['name']})"
    return name


def _site_packages() -> tuple[str, ...]:
    """Folders packages are installed in, longest first (``sys.path`` entries named so)."""
    folders = {os.path.join(os.path.abspath(entry), "") for entry in sys.path
               if entry and os.path.basename(entry.rstrip(os.sep)) in ("site-packages",
                                                                      "dist-packages")}
    return tuple(sorted(folders, key=len, reverse=True))


def _display_path(path: str) -> str:
    """``path`` relative to the working directory when under it, ``package/module.py``
    for an installed package, else as it is."""
    cwd = os.getcwd()
    shown = _display_paths.get((path, cwd))
    if shown is None:
        try:
            relative = os.path.relpath(path, cwd)
        except ValueError:  # another drive on Windows
            relative = os.pardir
        shown = path if relative.startswith(os.pardir) else relative
        for folder in _site_packages():
            if path.startswith(folder):
                shown = path[len(folder):]
                break
        if len(_display_paths) >= 4096:  # a program spans few files: never in practice
            _display_paths.clear()
        _display_paths[(path, cwd)] = shown
    return shown


_display_paths: dict[tuple[str, str], str] = {}


def with_weak_type(value: Any, aval: Any) -> Any:
    """``value`` with ``aval``'s weak type when only that differs (the same numbers).

    JAX has no public cast that makes a value weakly typed (``lax.convert_element_type``
    always makes it strong); ``lax._convert_element_type`` is what ``jnp`` uses
    (0.4 - 0.12).
    """
    weak = getattr(aval, "weak_type", None)
    if weak is None:  # tokens, refs: no weak type
        return value
    current = jax.typeof(value)
    if (getattr(current, "weak_type", weak) == weak
            or getattr(current, "dtype", None) != aval.dtype):
        return value
    return _lax_internal._convert_element_type(value, aval.dtype, weak_type=weak)


def array_aval(atom: Atom) -> ShapedArray:
    """``atom``'s type where it holds an array (shape, dtype, ndim), as the operands and
    results of array primitives do; JAX types ``aval`` as the ``AbstractValue`` base."""
    return atom.aval  # type: ignore[return-value]


def literal_value(atom: Literal) -> Any:
    return atom.val


def is_literal(atom: object) -> TypeIs[Literal]:
    return isinstance(atom, Literal)


def is_drop_var(var: object) -> TypeIs[DropVar]:
    return isinstance(var, DropVar)


def stream_call(fn: Callable[..., Any], attributes: dict[str, str]) -> Callable[..., Any]:
    """Wraps ``fn`` so it lowers to one non-inlined call with ``attributes``."""
    return _xla_metadata_call(fn, **attributes)


@dataclasses.dataclass(frozen=True, slots=True)
class Linearized:
    """``fn`` at some avals split into a forward and a linear jaxpr (``linearize_split``).

    ``forward`` (closed) takes the primals and returns ``num_outputs`` outputs, then
    ``num_residuals`` residuals. ``linear`` (open; its constvars are the residuals)
    takes the tangents of the inexact primals and returns the tangents of all outputs.
    """

    forward: Any
    linear: Any
    num_outputs: int
    num_residuals: int


def linearize_split(fn: Callable[..., Sequence[Any]], avals: Sequence[Any],
                    diff: Sequence[bool]) -> Linearized:
    """Traces the linearization of ``fn`` (a tuple of outputs) at ``avals``.

    Only the primals with ``diff`` set are differentiated; the others are closed over.
    Public API only (``jax.linearize`` and ``jax.make_jaxpr``), so the split is the
    one JAX itself computes for ``jax.linearize`` on every version.
    """
    cell: dict[str, Any] = {}

    def forward(*primals: Any) -> tuple[Any, ...]:
        def of_diff(*diff_primals: Any) -> tuple[Any, ...]:
            it = iter(diff_primals)
            return tuple(fn(*[next(it) if d else p for p, d in zip(primals, diff, strict=True)]))

        diff_primals = [p for p, d in zip(primals, diff, strict=True) if d]
        outs, f_lin = jax.linearize(of_diff, *diff_primals)
        # The aval's own tangent type keeps weak types and, inside shard_map, the
        # varying manual axes (a ShapeDtypeStruct would drop them).
        tangent_avals = [jax.typeof(p).to_tangent_aval() for p in diff_primals]
        inner, residuals = open_jaxpr(make_closed_jaxpr(f_lin, tangent_avals))
        cell["linear"], cell["counts"] = inner, (len(outs), len(residuals))
        return (*outs, *residuals)

    closed = jax.make_jaxpr(forward)(*avals)
    num_outputs, num_residuals = cell["counts"]
    return Linearized(closed, cell["linear"], num_outputs, num_residuals)


def eval_linear(lin: Linearized, residuals: Sequence[Any], tangents: Sequence[Any]) -> list[Any]:
    """Applies ``lin.linear`` to ``tangents`` with the given residuals."""
    return list(jax.core.eval_jaxpr(lin.linear, list(residuals), *tangents))


def is_extended_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is one of JAX's extended dtypes (PRNG keys), which NumPy cannot
    interpret: ``np.dtype``, ``np.issubdtype`` and ``np.zeros`` raise on them.

    ``float0`` (the tangent type of integers and keys) is a NumPy structured dtype, so it
    is not extended; it has no elements worth a byte (``itemsize`` 0).
    """
    return dtype is not None and bool(jax.dtypes.issubdtype(dtype, jax.dtypes.extended))


def itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype``, extended dtypes included (a threefry key: 8)."""
    try:
        return _ITEMSIZES[dtype]
    except (KeyError, TypeError):  # a new dtype, or an unhashable one
        pass
    if is_extended_dtype(dtype):
        size = _extended_itemsize(dtype)
    else:
        size = int(np.dtype(dtype).itemsize)
    try:
        _ITEMSIZES[dtype] = size
    except TypeError:
        pass
    return size


def _extended_itemsize(dtype: Any) -> int:
    """Bytes per element of an extended dtype: its ``itemsize`` where it has one (PRNG
    key types, 0.10.2 - 0.12), else its physical element's (``ExtendedDType`` requires
    only ``type`` and ``_rules``; ``_rules.physical_element_aval`` gives the physical
    representation), else 0 (priced as free, as an unknown type is)."""
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    try:
        physical = dtype._rules.physical_element_aval(dtype)
        if is_extended_dtype(physical.dtype):  # no recursion through a strange rule
            return 0
        return math.prod(physical.shape) * itemsize(physical.dtype)
    except Exception:  # a rule that cannot answer for the type alone
        return 0


# dtype -> bytes per element: the cost model asks for every operand and result of every
# equation, and the extended-dtype test alone costs more than the rest of ``aval_nbytes``.
_ITEMSIZES: dict[Any, int] = {}


def aval_nbytes(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return math.prod(shape) * itemsize(dtype)


def aval_size(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    return math.prod(shape) if shape is not None else 0


def scan_length(eqn: JaxprEqn) -> int:
    return int(eqn.params["length"])


def jaxpr_eval(jaxpr: JaxprLike, *args: Any) -> list[Any]:
    """Evaluates a closed or open jaxpr (open ones take no consts)."""
    inner, consts = open_jaxpr(jaxpr)
    return list(jax.core.eval_jaxpr(inner, consts, *args))


def rebased_source(traced: Any, first: Any, now: Any) -> Any:
    """The source info of an equation traced under a member equation whose source info
    was ``first``, as a trace under a member with source info ``now`` gives it: ``now``'s
    traceback, and ``traced``'s name stack with ``first``'s scopes (its end: a bind puts
    an equation's scopes under the current ones) replaced by ``now``'s; where they are
    not its end, ``now``'s name stack."""
    stack, old, new = traced.name_stack.stack, first.name_stack.stack, now.name_stack.stack
    if old == new:
        name_stack = traced.name_stack
    elif stack[len(stack) - len(old):] == old:
        name_stack = _source_info_util.NameStack(stack[:len(stack) - len(old)] + new)
    else:
        name_stack = now.name_stack
    return _source_info_util.SourceInfo(now.traceback, name_stack)


def stage_jaxpr(jaxpr: JaxprLike, *args: Any) -> list[Any]:
    """``jaxpr_eval(jaxpr, *args)``, each equation staged by an ``EqnStager``."""
    inner, consts = open_jaxpr(jaxpr)
    env: dict[Any, Any] = dict(zip(inner.constvars, consts, strict=True))
    env.update(zip(inner.invars, args, strict=True))
    stage = EqnStager()
    for eqn in inner.eqns:
        outs = stage(eqn, [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [v.val if isinstance(v, Literal) else env[v] for v in inner.outvars]


class EqnStager:
    """``bind_eqn(eqn, invals)`` for the equations of a jaxpr traced before, inside the
    ``jax.jit`` trace now staging (jaxpar's emission of a rewritten program).

    Where a bind would only abstract-evaluate the equation and stage it, the equation
    is staged as it is, as JAX inlines a jit call (``partial_eval.inline_jaxpr_into_
    trace``, jax 0.10.2 - 0.12): the same steps as the trace's
    ``default_process_primitive`` but the abstract evaluation, whose results the
    equation holds already (its operands' types are checked equal to its inputs'),
    about a quarter of a bind's time. It keeps its source info (its name stack under
    the current one) and context, and constant inputs are folded by JAX's rules, as a
    bind does. Every other equation is bound (``bind_eqn``): outside such a trace or in
    a ``set_xla_metadata`` scope, with effects, or with an operand that is not the
    trace's tracer (a constant), a primitive with a staging or forwarding rule, bind
    parameters of its own or high types, or operands of other types.
    """

    __slots__ = ("_stack", "_trace")

    def __init__(self) -> None:
        from jax._src import xla_metadata_lib as _metadata
        from jax._src.interpreters import partial_eval as _pe

        trace = _core.trace_ctx.trace
        # Under a ``set_xla_metadata`` scope a bind merges the scope's metadata into each
        # equation's context, which an equation staged as it is would not carry.
        staging = type(trace) is _pe.DynamicJaxprTrace and not _metadata.current_xla_metadata()
        self._trace = trace if staging else None
        self._stack = _source_info_util.current_name_stack()

    def __call__(self, eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
        trace, primitive = self._trace, eqn.primitive
        if (trace is None or eqn.effects or primitive in _pe.custom_staging_rules
                or primitive in _pe.forwarding_rules
                or type(primitive).get_bind_params is not _core.Primitive.get_bind_params):
            return bind_eqn(eqn, invals)
        info = eqn.source_info
        source = info.replace(name_stack=self._stack + info.name_stack)
        tracer = _pe.DynamicJaxprTracer
        ins = []
        traced = False
        for v, x in zip(eqn.invars, invals, strict=True):
            if isinstance(v, Literal):
                ins.append(tracer(trace, v.aval, v, source))
            elif type(x) is tracer and x._trace is trace and x.aval == v.aval:
                ins.append(x)
                traced = True
            else:
                return bind_eqn(eqn, invals)
        params = eqn.params
        if not traced or primitive.is_high(*[t.aval for t in ins], **params):
            return bind_eqn(eqn, invals)
        avals = [v.aval for v in eqn.outvars]
        folded = _pe.try_constant_folding(primitive, ins, params, avals)
        if folded is not None:
            outs = [trace.new_const(c, source_info=source, aval=aval)
                    for c, aval in zip(folded, avals, strict=True)]
        else:
            outs = trace.emit_eqn(ins, avals, primitive, params, eqn.effects, source, eqn.ctx)
        return list(outs)


# ---------------------------------------------------------------------------------------
# Loop parameters (added for jaxpar.passes; issue 3). Scan parameters changed layout in
# jax 0.11: ``num_consts``/``num_carry``/``linear``/``_split_transpose`` (<= 0.10) became
# ``ft_in``/``ft_out`` FlatTrees (>= 0.11), whose ``unpack()`` gives the (consts, carry, xs)
# trees with ``len()`` = leaf count. Only the helpers below read those layouts.
# ---------------------------------------------------------------------------------------


import dataclasses as _dataclasses  # noqa: E402


@_dataclasses.dataclass(frozen=True, slots=True)
class ScanInfo:
    """What jaxpar needs to know about one ``scan`` equation, on every jax version.

    The body jaxpr takes ``consts + carry + xs`` (``num_consts``, ``num_carry``, rest)
    and returns ``carry + ys``; the equation's invars and outvars line up with it.
    """

    length: int
    reverse: bool
    unroll: int
    num_consts: int
    num_carry: int
    jaxpr: ClosedJaxpr

    @property
    def num_xs(self) -> int:
        return len(in_avals(self.jaxpr)) - self.num_consts - self.num_carry


def scan_info(eqn: JaxprEqn) -> ScanInfo:
    """Reads a ``scan`` equation's parameters, whichever layout this jax uses."""
    params = eqn.params
    length = int(params["length"])
    if "ft_in" in params:  # jax >= 0.11
        consts_tree, carry_tree, _ = params["ft_in"].unpack()
        num_consts, num_carry = len(consts_tree), len(carry_tree)
    else:  # jax <= 0.10
        num_consts, num_carry = int(params["num_consts"]), int(params["num_carry"])
    unroll = params.get("unroll", 1)
    if isinstance(unroll, bool):
        unroll = max(length, 1) if unroll else 1
    body = params["jaxpr"]
    if len(in_avals(body)) != len(eqn.invars):
        raise NotImplementedError(
            f"jaxpar: scan at {source_summary(eqn)} has {len(eqn.invars)} operands but its "
            f"body takes {len(in_avals(body))}; this jax version's scan layout is not "
            "supported by jaxpar's loop passes")
    return ScanInfo(length=length, reverse=bool(params["reverse"]), unroll=int(unroll),
                    num_consts=num_consts, num_carry=num_carry, jaxpr=body)


def scan_params_with_unroll(eqn: JaxprEqn, unroll: int) -> dict[str, Any]:
    """``eqn.params`` of a ``scan`` with only the unroll factor changed."""
    params = dict(eqn.params)
    params["unroll"] = int(unroll)
    return params


def custom_jvp_rule(eqn: JaxprEqn) -> tuple[JaxprLike, int] | None:
    """The jvp rule of a ``custom_jvp_call`` as a jaxpr, with the count of the call's
    leading constant operands (the rule reads the other operands, then one tangent per
    operand, none of them a symbolic zero); None where this jax hides it or tracing the
    rule fails.

    The rule is traced through the equation's own memoised thunk
    (``jvp_jaxpr_fun``), the one JAX calls when it differentiates the call, so it is
    traced at most once per call and what it sees here is what differentiation sees.
    """
    thunk = eqn.params.get("jvp_jaxpr_fun", eqn.params.get("jvp_jaxpr_thunk"))
    num_consts = eqn.params.get("num_consts")
    if thunk is None or not isinstance(num_consts, int):
        return None
    zeros = (False,) * (len(eqn.invars) - num_consts)
    try:
        made = thunk.call_wrapped(*zeros) if hasattr(thunk, "call_wrapped") else thunk(*zeros)
    except Exception:  # a rule that cannot be traced alone: judged unknown, never batched
        return None
    rule = made[0]
    if not isinstance(rule, (Jaxpr, ClosedJaxpr)):
        return None
    return rule, num_consts


@_dataclasses.dataclass(frozen=True, slots=True)
class WhileInfo:
    """The parts of a ``while`` equation: operands are ``cond consts + body consts + carry``."""

    cond_nconsts: int
    body_nconsts: int
    cond_jaxpr: ClosedJaxpr
    body_jaxpr: ClosedJaxpr


def while_info(eqn: JaxprEqn) -> WhileInfo:
    """Reads a ``while`` equation's parameters."""
    params = eqn.params
    return WhileInfo(int(params["cond_nconsts"]), int(params["body_nconsts"]),
                     params["cond_jaxpr"], params["body_jaxpr"])


# --------------------------------------------------------------------------- shard_map
# Reading a ``shard_map`` equation and re-emitting it with a new body (issue 4:
# grouping collectives inside shard_map bodies). Layouts (docs/gpu_evidence.md,
# section 1.4):
#   * jax <= 0.6.0: ``jax.experimental.shard_map.shard_map``; params ``mesh,
#     in_names, out_names, check_rep, auto, rewrite, jaxpr`` where a "names" entry
#     is a ``{dim: (axis, ...)}`` dict.
#   * jax >= 0.6.1: ``jax.shard_map``; params ``mesh, in_specs, out_specs,
#     check_vma, jaxpr`` plus ``manual_axes`` / ``newly_manual_axes`` (0.10+) or
#     ``auto`` (earlier) saying which mesh axes the body is manual over.

import dataclasses as _dataclasses  # noqa: E402  (kept with the section it serves)


@_dataclasses.dataclass(frozen=True)
class ShardMapInfo:
    """What re-emitting a ``shard_map`` equation needs, in public-API terms.

    ``in_specs``/``out_specs`` are ``PartitionSpec`` tuples (converted from
    ``in_names``/``out_names`` on old jax); ``check`` is ``check_vma`` (or the
    old ``check_rep``); ``manual_axes`` are the mesh axes the body is manual
    over; ``axis_sizes`` maps every mesh axis name to its size.
    """

    mesh: Any
    in_specs: tuple[Any, ...]
    out_specs: tuple[Any, ...]
    check: bool
    manual_axes: frozenset[Any]
    axis_sizes: tuple[tuple[Any, int], ...]
    body: JaxprLike  # the body jaxpr, as found in the equation

    def axis_size(self, name: Any) -> int:
        """Size of mesh axis ``name`` (a tuple of names multiplies)."""
        sizes = dict(self.axis_sizes)
        names = name if isinstance(name, (tuple, list)) else (name,)
        size = 1
        for n in names:
            size *= sizes[n]
        return size


def is_shard_map(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is a ``shard_map`` equation (matched by name)."""
    return eqn.primitive.name == _SHARD_MAP


def _names_to_spec(names: Any, ndim: int) -> Any:
    from jax.sharding import PartitionSpec

    if not isinstance(names, dict):  # already a PartitionSpec
        return names
    entries: list[Any] = [None] * ndim
    for dim, axes in names.items():
        axes = tuple(axes)
        entries[dim] = axes[0] if len(axes) == 1 else axes
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _mesh_axis_sizes(mesh: Any) -> tuple[tuple[Any, int], ...]:
    shape = mesh.shape  # an OrderedDict name -> size on Mesh and AbstractMesh
    return tuple((name, int(size)) for name, size in shape.items())


def shard_map_info(eqn: JaxprEqn) -> ShardMapInfo:
    """Reads a ``shard_map`` equation's mesh, specs, check flag and manual axes.

    Raises:
      ValueError: ``eqn`` is not a ``shard_map`` equation.
    """
    if not is_shard_map(eqn):
        raise ValueError(f"shard_map_info expects a `shard_map` equation, got "
                         f"`{eqn.primitive.name}` at {source_summary(eqn)}")
    params = eqn.params
    mesh = params["mesh"]
    body = params["jaxpr"]
    if "in_specs" in params:
        in_specs = tuple(params["in_specs"])
        out_specs = tuple(params["out_specs"])
    else:  # jax <= 0.6.0
        in_specs = tuple(_names_to_spec(names, array_aval(v).ndim)
                         for names, v in zip(params["in_names"], eqn.invars, strict=True))
        out_specs = tuple(_names_to_spec(names, array_aval(v).ndim)
                          for names, v in zip(params["out_names"], eqn.outvars, strict=True))
    check = bool(params.get("check_vma", params.get("check_rep", True)))
    sizes = _mesh_axis_sizes(mesh)
    all_axes = frozenset(name for name, _ in sizes)
    if "manual_axes" in params:
        manual = frozenset(params["manual_axes"])
    elif "newly_manual_axes" in params:
        manual = frozenset(params["newly_manual_axes"])
    elif "auto" in params:
        manual = all_axes - frozenset(params["auto"])
    else:
        manual = all_axes
    return ShardMapInfo(mesh, in_specs, out_specs, check, manual, sizes, body)


def _public_shard_map() -> Callable[..., Any]:
    if hasattr(jax, "shard_map"):  # jax >= 0.6.1
        return jax.shard_map  # type: ignore[attr-defined, no-any-return]
    from jax.experimental.shard_map import shard_map  # type: ignore[import-not-found]
    return shard_map  # type: ignore[no-any-return]


def rebind_shard_map(eqn: JaxprEqn, body_fn: Callable[..., Sequence[Any]],
                     invals: Sequence[Any]) -> list[Any]:
    """Re-emits a ``shard_map`` equation through the public API with a new body.

    Mesh, in/out specs, the replication/varying-manual-axes check and the
    manual axes are preserved, and the user's source context is kept.

    Args:
      eqn: a ``shard_map`` equation.
      body_fn: takes the values of the body jaxpr's invars (per-shard) and
        returns the values of its outvars (a sequence).
      invals: the equation's (global) input values.

    Returns:
      The equation's output values, a list.

    Example::

        outs = rebind_shard_map(eqn, lambda *a: jaxpr_eval(eqn.params["jaxpr"], *a), ins)
    """
    info = shard_map_info(eqn)
    shard_map = _public_shard_map()

    def body(*args: Any) -> tuple[Any, ...]:
        return tuple(body_fn(*args))

    all_axes = frozenset(name for name, _ in info.axis_sizes)
    kwargs: dict[str, Any] = {"mesh": info.mesh, "in_specs": info.in_specs,
                              "out_specs": info.out_specs}
    if hasattr(jax, "shard_map"):
        kwargs["check_vma"] = info.check
        if info.manual_axes != all_axes:
            kwargs["axis_names"] = set(info.manual_axes)
    else:  # jax <= 0.6.0
        kwargs["check_rep"] = info.check
        if info.manual_axes != all_axes:
            kwargs["auto"] = all_axes - info.manual_axes
    mapped = shard_map(body, **kwargs)
    name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (_source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
          eqn.ctx.manager):
        out = mapped(*invals)
    return list(out)


def nested_trace_context(eqn: JaxprEqn) -> Any:
    """A context manager under which code for ``eqn``'s nested jaxprs must be traced.

    A ``shard_map`` body is traced by JAX with the mesh's manual axes bound, the mesh
    marked manual over them and the body's ``check_vma`` mode; its values' types name
    those axes (varying manual axes), so tracing a rewrite of the body (``vmap`` of a
    dot, a new ``scan``) outside that environment fails with "unbound axis name".
    Other equations need nothing (a null context).
    """
    import contextlib

    stack = contextlib.ExitStack()
    if not is_shard_map(eqn):
        return stack
    from jax._src import config as _config
    from jax._src import mesh as _mesh
    from jax._src import shard_map as _shard_map

    info = shard_map_info(eqn)
    mesh = eqn.params["mesh"]
    newly_manual = frozenset(eqn.params.get("newly_manual_axes", info.manual_axes))
    stack.enter_context(_shard_map._extend_axis_env(mesh, newly_manual))
    stack.enter_context(_mesh.use_abstract_mesh(_shard_map._as_manual_mesh(mesh, newly_manual)))
    stack.enter_context(_config._check_vma(info.check))
    return stack


def eqn_context(eqn: JaxprEqn) -> Any:
    """A context manager under which new equations get ``eqn``'s source info and context.

    Used when a pass emits a replacement for ``eqn`` (e.g. a fused scan) through public
    APIs such as ``lax.scan``, so errors and profiles still point at the user's line.
    """
    import contextlib

    name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
    stack = contextlib.ExitStack()
    stack.enter_context(_source_info_util.user_context(eqn.source_info.traceback,
                                                       name_stack=name_stack))
    stack.enter_context(eqn.ctx.manager)
    return stack


def backends_initialized() -> bool:
    """Whether JAX has started a backend (so new XLA_FLAGS would be ignored).

    There is no public API for this; ``jax._src.xla_bridge`` keeps the started
    backends in ``_backends`` (every version tried, 0.4.35 - 0.12). Answers
    True when the internals moved, so callers err on the side of warning.
    """
    try:
        from jax._src import xla_bridge
    except ImportError:
        return True
    backends = getattr(xla_bridge, "_backends", None)
    return True if backends is None else bool(backends)


def top_level() -> bool:
    """Whether JAX runs eagerly here, under no transformation at all: the only place
    ``jax.jit(..., compiler_options=...)`` may be called (jax 0.10 refuses it on a
    nested jit, which a call under ``grad`` or ``vmap`` becomes)."""
    return isinstance(_core.trace_ctx.trace, _core.EvalTrace)


def staging() -> bool:
    """Whether the current trace stages out a program (an outer ``jit``, ``make_jaxpr``,
    ``shard_map``...), under any ``grad``/``vmap`` layers, rather than running eagerly."""
    from jax._src.interpreters import partial_eval as _pe

    trace = _core.trace_ctx.trace
    for _ in range(64):  # trace stacks are a few levels deep
        if trace is None:
            return False
        if isinstance(trace, _pe.DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


# --------------------------------------------------------------------- stream regions
# A stream region is an equation of ``stream_region_p``, a primitive jaxpar owns: it
# lowers exactly like ``xla_metadata_call`` (one non-inlined ``call`` carrying the
# region's frontend attributes; the lowering *is* ``stream_call`` of the body), and
# every JAX transformation that can meet it has a rule here (issue 18):
#   * ``xla_metadata_call`` has no ``checkify`` rule, so the checks of its body were
#     silently dropped; and JAX's own transpose of it yields another plain
#     ``xla_metadata_call``, whose derivative under ``jax.checkpoint`` asserts in JAX's
#     bilinear transpose (second-order reverse mode).
#   * Registering those rules on JAX's ``xla_metadata_call_p`` would change JAX for code
#     that is not jaxpar's ("importing jaxpar changes nothing outside jaxpar"); emitting
#     through ``jit`` (which has every rule) cannot put attributes on the call alone;
#     and a transformation such as ``checkify`` stages the function before it
#     interprets it, so the emitter cannot see it coming. A primitive of our own, with
#     rules only for itself, has neither problem.
# Rules: impl, abstract eval (with the body's effects), lowering, batching, DCE,
# partial eval for ``jax.checkpoint`` (JAX's closed-call rule, as for
# ``xla_metadata_call``), ``checkify``, ``jet``, and JVP and transpose, which call back
# into the emitter (``register_stream_region_ad``) so that every derived computation is
# again a region with these same rules, and a state discharge rule (``_call_discharge``).
# Parameters: ``call_jaxpr`` (closed; its consts are concrete constants, which stay in
# the call, see ``bind_stream_region``) and ``region``, an object of the emitter's with
# ``.attributes`` (a tuple of string pairs), ``.packs_results`` (whether the lowering may
# pack results, below) and ``.derived(role)`` (the region of a derived computation),
# that compares by value.

from jax._src import checkify as _checkify  # noqa: E402
from jax._src import dispatch as _dispatch  # noqa: E402
from jax._src.interpreters import ad as _ad  # noqa: E402
from jax._src.interpreters import batching as _batching  # noqa: E402
from jax._src.interpreters import mlir as _mlir  # noqa: E402
from jax._src.interpreters import partial_eval as _pe  # noqa: E402
from jax._src.state import discharge as _state_discharge  # noqa: E402
from jax.experimental import jet as _jet  # noqa: E402

STREAM_REGION = "jaxpar_stream_region"
stream_region_p = jex_core.Primitive(STREAM_REGION)
stream_region_p.multiple_results = True
# Some releases also ask the primitive whether an equation has effects.
setattr(stream_region_p, "is_effectful",  # noqa: B010
        lambda params: bool(params["call_jaxpr"].effects))

# The emitter's JVP and transpose of a region (see ``register_stream_region_ad``).
_region_ad: dict[str, Callable[..., Any]] = {}


def _region_jaxpr(fn: Callable[..., Sequence[Any]], avals: Sequence[Any]
                  ) -> tuple[ClosedJaxpr, list[Any]]:
    """``fn`` traced at ``avals`` as a closed jaxpr without consts, and the consts it
    closed over (values or tracers of an outer trace), to pass as leading operands."""
    closed = jax.make_jaxpr(lambda *args: tuple(fn(*args)))(*avals)
    jaxpr, consts = _pe.separate_consts(closed)
    return jaxpr, list(consts)


def bind_stream_region(fn: Callable[..., Sequence[Any]], args: Sequence[Any],
                       region: Any) -> list[Any]:
    """``fn(*args)`` as one stream region (a ``stream_region_p`` equation).

    The constants ``fn`` closes over stay in the region's body, as ``jax.jit`` keeps
    them in its program, unless one is a tracer of an outer trace (then all are
    operands). A constant passed into the non-inlined call is an operand of unknown
    sharding, and XLA's sharding propagation, which does not see through such a call,
    then shards the call's results otherwise than ``jax.jit`` shards the same values
    (``P(None, "y")`` where ``jax.jit`` gives ``P()``).
    """
    closed = jax.make_jaxpr(lambda *a: tuple(fn(*a)))(*[jax.typeof(a) for a in args])
    if not any(is_tracer(c) for c in open_jaxpr(closed)[1]):
        return list(stream_region_p.bind(*args, call_jaxpr=closed, region=region))
    jaxpr, consts = _pe.separate_consts(closed)
    return list(stream_region_p.bind(*consts, *args, call_jaxpr=jaxpr, region=region))


def register_stream_region_ad(jvp: Callable[..., Any], transpose: Callable[..., Any]) -> None:
    """Installs the emitter's derivative rules for regions (called once, by ``_emit``).

    ``jvp(call_jaxpr, region, primals, tangents)`` gets None for a zero tangent and
    returns ``(outputs, output tangents)`` with None for zeros.
    ``transpose(call_jaxpr, region, args, linear, cotangents)`` gets the non-linear
    operands' values (None where ``linear``) and the outputs' cotangents (None for
    zeros) and returns one cotangent (or None) per operand.
    """
    _region_ad["jvp"] = jvp
    _region_ad["transpose"] = transpose


def vmap_axis_names(values: Sequence[Any]) -> frozenset[Any]:
    """The names of the ``jax.vmap`` axes that ``values`` are traced under, where a
    collective over the name is a reduction on this device: ``vmap`` without
    ``spmd_axis_name`` or an explicit mesh axis (those spread the axis over devices)."""
    names: set[Any] = set()
    for value in values:
        while isinstance(value, _batching.BatchTracer):
            data = getattr(value._trace, "axis_data", None)
            if (data is not None and data.name not in (None, _core.no_axis_name)
                    and getattr(data, "spmd_name", None) is None
                    and getattr(data, "explicit_mesh_axis", None) is None):
                names.add(data.name)
            value = value.val
    return frozenset(names)


def _region_abstract_eval(*avals: Any, call_jaxpr: ClosedJaxpr, **params: Any) -> tuple[Any, Any]:
    del avals, params
    return list(call_jaxpr.out_avals), call_jaxpr.effects


def packable(avals: Sequence[Any]) -> bool:
    """Whether several results can travel as one flat array (same plain dtype, not weak)."""
    if len(avals) < 2:
        return False
    dtypes = {a.dtype for a in avals}
    if len(dtypes) != 1 or any(getattr(a, "weak_type", False) for a in avals):
        return False
    (dtype,) = dtypes
    if is_extended_dtype(dtype):  # PRNG keys: NumPy cannot interpret them
        return False
    return bool(np.issubdtype(dtype, np.number) or np.issubdtype(dtype, np.bool_))


def _partitioned_by_xla(ctx: Any) -> bool:
    """Whether XLA's sharding propagation lays out the values of the program being lowered
    (more than one device, outside the manual axes of a ``shard_map``)."""
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, _sharding_impls.ShardingContext):
        return axis_context.num_devices > 1
    if isinstance(axis_context, _sharding_impls.SPMDAxisContext):
        return any(size > 1 and name not in axis_context.manual_axes
                   for name, size in axis_context.mesh.shape.items())
    return False


def _region_lowering(ctx: Any, *args: Any, call_jaxpr: ClosedJaxpr, region: Any) -> Any:
    # The body evaluated inside JAX's own ``xla_metadata_call``: the same call, the same
    # attributes, on every supported jax. Where XLA would not overlap a call returning a
    # tuple (``PACK_MULTI_RESULT_CALLS``) the call returns its results as one flat array.
    # Packed here, when lowering, and not when emitting: a transformation (``vmap``) then
    # sees each result on its own, batched or not as the body makes it. Not where XLA
    # shards the program: the slices of one flat array would all be sharded as that
    # array, where ``jax.jit`` shards each result as its own computation makes it; nor
    # for a region that must hold its collectives alone (``region.packs_results``).
    pack = (PACK_MULTI_RESULT_CALLS and region.packs_results
            and packable(call_jaxpr.out_avals) and not _partitioned_by_xla(ctx))
    lowering = _region_packed_lowering if pack else _region_call_lowering
    return lowering(ctx, *args, call_jaxpr=call_jaxpr, region=region)


def _region_call(*args: Any, call_jaxpr: ClosedJaxpr, region: Any) -> list[Any]:
    call = stream_call(lambda *a: tuple(jaxpr_eval(call_jaxpr, *a)), dict(region.attributes))
    return list(call(*args))


def _region_packed_call(*args: Any, call_jaxpr: ClosedJaxpr, region: Any) -> list[Any]:
    def packed(*a: Any) -> tuple[Any]:
        return (jax.numpy.concatenate([jax.numpy.ravel(r) for r in jaxpr_eval(call_jaxpr, *a)]),)

    (flat,) = stream_call(packed, dict(region.attributes))(*args)
    results, offset = [], 0
    for aval in call_jaxpr.out_avals:
        size = aval_size(aval)
        results.append(jax.numpy.reshape(flat[offset:offset + size], aval.shape))
        offset += size
    return results


_region_call_lowering = _mlir.lower_fun(_region_call, multiple_results=True)
_region_packed_lowering = _mlir.lower_fun(_region_packed_call, multiple_results=True)


def _region_batcher(axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[Any], *,
                    call_jaxpr: ClosedJaxpr, region: Any) -> tuple[list[Any], list[Any]]:
    batched, dims_out = _batching.batch_jaxpr2(call_jaxpr, axis_data, tuple(dims_in))
    outs = stream_region_p.bind(*vals_in, call_jaxpr=batched, region=region)
    return list(outs), list(dims_out)


def _region_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, call_jaxpr: ClosedJaxpr,
                region: Any) -> tuple[list[Any], list[Any]]:
    given = [None if type(t) is _ad.Zero else t for t in tangents]
    outs, out_tangents = _region_ad["jvp"](call_jaxpr, region, list(primals), given)
    return list(outs), [_ad.Zero(jax.typeof(o).to_tangent_aval()) if t is None else t
                        for o, t in zip(outs, out_tangents, strict=True)]


def _region_transpose(cts: Sequence[Any], *args: Any, call_jaxpr: ClosedJaxpr,
                      region: Any) -> list[Any]:
    linear = [_ad.is_undefined_primal(a) for a in args]
    values = [None if lin else a for a, lin in zip(args, linear, strict=True)]
    given = [None if type(ct) is _ad.Zero else ct for ct in cts]
    return list(_region_ad["transpose"](call_jaxpr, region, values, linear, given))


def _region_checkify(*args: Any, call_jaxpr: ClosedJaxpr, region: Any) -> tuple[Any, list[Any]]:
    # jax <= 0.10: (error, enabled_errors, *vals); jax >= 0.11 passes a context first.
    context_type = getattr(_checkify, "CheckifyContext", None)
    context = args[:1] if context_type is not None and isinstance(args[0], context_type) else ()
    error, enabled_errors, *vals = args[len(context):]
    err_vals, err_tree = jax.tree_util.tree_flatten(error)
    operands = [*err_vals, *vals]
    checked, out_tree, _ = _checkify.jaxpr_to_checkify_jaxpr(
        *context, call_jaxpr, enabled_errors, err_tree, *[jax.typeof(v) for v in operands])
    checked, consts = _pe.separate_consts(checked)
    outs = stream_region_p.bind(*consts, *operands, call_jaxpr=checked, region=region)
    return jax.tree_util.tree_unflatten(out_tree, outs)  # type: ignore[no-any-return]


def _region_jet(primals_in: Sequence[Any], series_in: Sequence[Any], *, call_jaxpr: ClosedJaxpr,
                region: Any) -> tuple[list[Any], list[Any]]:
    return _call_jet(primals_in, series_in, call_jaxpr,
                     lambda body, args: bind_stream_region(body, args, region))


def _call_jet(primals_in: Sequence[Any], series_in: Sequence[Any], call_jaxpr: ClosedJaxpr,
              emit: Callable[[Callable[..., Any], list[Any]], Sequence[Any]]
              ) -> tuple[list[Any], list[Any]]:
    """The jet rule of a call-like equation; ``emit(body, args)`` runs the body (as a
    region, or inline)."""
    order = max((len(s) for s in series_in if s is not _jet.zero_series), default=1)
    series = [[_jet.zero_term] * order if s is _jet.zero_series else list(s) for s in series_in]
    counts = [len(s) for s in series]

    def body(*flat: Any) -> list[Any]:
        primals, rest = list(flat[:len(primals_in)]), list(flat[len(primals_in):])
        nested, start = [], 0
        for count in counts:
            nested.append(rest[start:start + count])
            start += count
        # Jet rules see Taylor coefficients (the k-th term over (k+1)!); the public
        # ``jet`` takes and returns derivatives.
        nested = [[t * math.factorial(k + 1) for k, t in enumerate(s)] for s in nested]
        outs, out_series = _jet.jet(lambda *a: jaxpr_eval(call_jaxpr, *a), primals, nested)
        return [*outs, *[t / math.factorial(k + 1) for s in out_series
                         for k, t in enumerate(s)]]

    zeros = [[jax.numpy.zeros_like(p) if t is _jet.zero_term else t for t in s]
             for p, s in zip(primals_in, series, strict=True)]
    flat = list(emit(body, [*primals_in, *[t for s in zeros for t in s]]))
    num_out = len(call_jaxpr.out_avals)
    outs, terms = flat[:num_out], flat[num_out:]
    return outs, [terms[i * order:(i + 1) * order] for i in range(num_out)]


def _call_discharge(rebind: Callable[..., Sequence[Any]]) -> Callable[..., Any]:
    """The state discharge rule of a call-like primitive, as ``jax.jit``'s.

    JAX discharges mutable arrays (``jax.new_ref``, ``r[...] += x``) before lowering a
    program that creates them, equation by equation, and a call whose body creates or
    touches one needs a rule. Its body is discharged (each discharged ``Ref`` operand
    becomes a value and its final value one more output) and run again through
    ``rebind(body, operands, **params)``: the same call, or inline. jax <= 0.10 passes
    which operands to discharge and the avals first, jax >= 0.11 a ``DischargeContext``.
    """
    def discharge(should_discharge: Sequence[bool], args: Sequence[Any],
                  call_jaxpr: ClosedJaxpr, params: dict[str, Any]
                  ) -> tuple[list[Any], list[Any]]:
        discharged = _state_discharge.discharge_state(call_jaxpr,
                                                      should_discharge=list(should_discharge))
        flat = list(rebind(lambda *a: jaxpr_eval(discharged, *a), list(args), **params))
        num_out = len(call_jaxpr.out_avals)
        outs, ref_values = flat[:num_out], iter(flat[num_out:])
        return [next(ref_values) if d else None for d in should_discharge], outs

    if hasattr(_state_discharge, "DischargeContext"):
        def rule(ctx: Any, *args: Any, call_jaxpr: ClosedJaxpr, **params: Any
                 ) -> tuple[list[Any], list[Any]]:
            return discharge(ctx.should_discharge, args, call_jaxpr, params)
        return rule

    def partial_rule(should_discharge: Sequence[bool], in_avals: Sequence[Any],
                     out_avals: Sequence[Any], *args: Any, call_jaxpr: ClosedJaxpr,
                     **params: Any) -> tuple[list[Any], list[Any]]:
        del in_avals, out_avals
        return discharge(should_discharge, args, call_jaxpr, params)
    return partial_rule


def _register_discharge_rule(prim: Any, rule: Callable[..., Any]) -> None:
    register = getattr(_state_discharge, "register_partial_discharge_rule", None)
    if register is None or hasattr(_state_discharge, "DischargeContext"):
        register = _state_discharge.register_discharge_rule
    register(prim)(rule)


def _register_call_rules(prim: Any, *, lowering: Callable[..., Any], batcher: Any, jvp: Any,
                         transpose: Any, dce: Any, checkify: Any, jet: Any,
                         discharge: Callable[..., Any],
                         lowering_rule: Callable[..., Any] | None = None) -> None:
    """The rules of one of jaxpar's call-like primitives (a ``call_jaxpr`` and one more
    parameter): stream regions and the rewritten program. ``lowering`` is traced when
    lowering (``mlir.lower_fun``), unless a ``lowering_rule`` lowers the equation itself."""
    prim.def_effectful_abstract_eval(_region_abstract_eval)
    _mlir.register_lowering(prim, lowering_rule or _mlir.lower_fun(lowering,
                                                                   multiple_results=True))
    _batching.fancy_primitive_batchers[prim] = batcher
    _ad.primitive_jvps[prim] = jvp
    _ad.primitive_transposes[prim] = transpose
    _pe.dce_rules[prim] = dce
    # Under jax.checkpoint the call splits into a known and a staged call, each keeping
    # the call's parameters (what JAX does for xla_metadata_call).
    _pe.partial_eval_jaxpr_custom_rules[prim] = functools.partial(
        _pe.closed_call_partial_eval_custom_rule, "call_jaxpr",
        lambda *args: (args[-2], args[-1]))
    _checkify.error_checks[prim] = checkify
    _jet.jet_rules[prim] = jet
    _register_discharge_rule(prim, discharge)
    # jax >= 0.12: a body holding "high" types (refs, hi-level avals) is lowered to low
    # types before staging, as jax.jit and xla_metadata_call do.
    lower_and_eval = getattr(_pe, "_lower_and_eval", None)
    if lower_and_eval is not None:
        def to_lojax(*hi_args: Any, call_jaxpr: ClosedJaxpr, **params: Any) -> Any:
            return lower_and_eval(prim, call_jaxpr, hi_args, **params)

        prim.to_lojax = to_lojax


def _register_stream_region_rules() -> None:
    _dispatch.simple_impl(stream_region_p)  # eagerly: compiled alone, as a stream call
    _register_call_rules(stream_region_p, lowering=_region_call, lowering_rule=_region_lowering,
                         batcher=_region_batcher,
                         jvp=_region_jvp, transpose=_region_transpose,
                         dce=_pe.dce_jaxpr_closed_call_rule, checkify=_region_checkify,
                         jet=_region_jet,
                         discharge=_call_discharge(
                             lambda body, args, region: bind_stream_region(body, args, region)))


_register_stream_region_rules()


# ---------------------------------------------------------------------------------------
# The rewritten program as one equation that remembers the program it came from.
# checkify reports, of several failing checks, the first in the order it traces them
# (per error kind the earliest, across kinds the smallest code, and codes are drawn in
# tracing order). A rewritten program runs the same checks in another order (packed
# streams, batched members, fused loops), so with several checks failing at once it
# would report another error than ``jax.jit``. ``program_p`` wraps the rewritten
# program; it lowers inline (no call, nothing in the HLO changes), every transformation
# sees straight through it, and its checkify rule checks the *original* program, in
# the user's order. Only the equation bound by ``bind_program`` knows its source: an
# equation another rule rebuilt (DCE, checkpoint's split) holds another body and is
# checked as it is.
# ---------------------------------------------------------------------------------------

PROGRAM = "jaxpar_program"
program_p = jex_core.Primitive(PROGRAM)
program_p.multiple_results = True
setattr(program_p, "is_effectful",  # noqa: B010
        lambda params: bool(params["call_jaxpr"].effects))


class ProgramSource:
    """``program_p``'s ``source``: the original program of one bound equation.

    ``fn(*operands[skip:])`` computes what the equation's body computes, in the user's
    order. Compares by identity, as JAX compares a jaxpr.
    """

    __slots__ = ("body", "checks_only", "fn", "skip")

    def __init__(self, fn: Callable[..., Sequence[Any]], skip: int,
                 checks_only: bool = False) -> None:
        self.fn, self.skip = fn, skip
        self.body: ClosedJaxpr | None = None  # the equation's body, once bound
        # An equation with no outputs that only holds the original's checks for
        # checkify (its body is empty; DCE keeps it).
        self.checks_only = checks_only

    def __repr__(self) -> str:
        return "<original program>"


def bind_program(fn: Callable[..., Sequence[Any]], source: Callable[..., Sequence[Any]],
                 args: Sequence[Any], checks_only: bool = False) -> list[Any]:
    """``fn(*args)`` as one ``program_p`` equation whose checkify rule runs ``source``
    (the same function of ``args``, as the user wrote it) instead."""
    jaxpr, consts = _region_jaxpr(fn, [jax.typeof(a) for a in args])
    marker = ProgramSource(source, len(consts), checks_only)
    marker.body = jaxpr
    return list(program_p.bind(*consts, *args, call_jaxpr=jaxpr, source=marker))


def _program_eval(*args: Any, call_jaxpr: ClosedJaxpr, source: Any) -> list[Any]:
    del source
    return jaxpr_eval(call_jaxpr, *args)


_program_lowered_by_tracing = _mlir.lower_fun(_program_eval, multiple_results=True)


def _program_lowering(ctx: Any, *args: Any, call_jaxpr: ClosedJaxpr, source: Any) -> Any:
    """``program_p`` lowered inline: its body's equations, as ``mlir.lower_fun`` of
    ``_program_eval`` lowers them, without first tracing the body again into an equal
    jaxpr (that trace cost as much as the emission's own: a bind per equation).

    The same steps as ``lower_fun`` (jax 0.10.2 - 0.12) after its trace; a body with
    high types (which its trace lowers) or internal mutable arrays (which it discharges)
    takes that path.
    """
    jaxpr = call_jaxpr.jaxpr
    if getattr(jaxpr, "is_high", False) or any(
            isinstance(e, _core.InternalMutableArrayEffect) for e in jaxpr.effects):
        return _program_lowered_by_tracing(ctx, *args, call_jaxpr=call_jaxpr, source=source)
    module = (ctx.module_context if ctx.platforms is None
              else ctx.module_context.replace(platforms=ctx.platforms))
    out, tokens = _mlir.jaxpr_subcomp(
        module, jaxpr, ctx.name_stack, ctx.tokens_in,
        _mlir.ir_consts(call_jaxpr.consts, [v.aval for v in jaxpr.constvars]), *args,
        dim_var_values=ctx.dim_var_values, const_lowering=ctx.const_lowering,
        outer_traceback=_mlir.xc.Traceback())
    ctx.set_tokens_out(tokens)
    return out


def _checked_first(source: ProgramSource, check: Callable[..., Any],
                   body: Callable[..., Sequence[Any]]) -> Callable[..., list[Any]]:
    """A source for an equation a transformation derived from ``source``'s: it runs the
    original program's checks first (``check``, its outputs dropped), then ``body``.
    checkify then reports the original's first failing check, as for ``jax.jit``: the
    body's own checks only find again what the original's found first. Only checkify
    runs a source, so only a checked program computes twice."""
    def fn(*operands: Any) -> list[Any]:
        check(*operands[source.skip:])
        return list(body(*operands))
    return fn


def _program_batcher(axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[Any], *,
                     call_jaxpr: ClosedJaxpr, source: Any) -> tuple[list[Any], list[Any]]:
    batched, dims_out = _batching.batch_jaxpr2(call_jaxpr, axis_data, tuple(dims_in))
    name = getattr(axis_data, "name", None)
    if (source.body is not call_jaxpr
            or getattr(axis_data, "explicit_mesh_axis", None) is not None):
        return jaxpr_eval(batched, *vals_in), list(dims_out)
    spmd = getattr(axis_data, "spmd_name", None)
    original = jax.vmap(
        lambda *a: tuple(source.fn(*a)),
        in_axes=list(dims_in[source.skip:]),  # None: not mapped
        axis_size=axis_data.size, axis_name=None if name is _core.no_axis_name else name,
        **({"spmd_axis_name": spmd} if spmd is not None else {}))
    outs = bind_program(lambda *v: jaxpr_eval(batched, *v),
                        _checked_first(source, original, lambda *v: jaxpr_eval(batched, *v)),
                        list(vals_in))
    return outs, list(dims_out)


def _program_dce(used_outputs: list[bool], *rest: Any) -> tuple[list[bool], Any]:
    # As for a closed call; an equation that keeps every operand keeps its source too
    # (the original program's outputs narrowed alike), so checkify of reverse mode, which
    # drops the forward outputs it does not need, still checks the original. jax >= 0.12
    # passes which inputs hold live refs before the equation.
    eqn = rest[-1]
    source = eqn.params["source"]
    if source.checks_only and source.body is eqn.params["call_jaxpr"]:
        return [True] * len(eqn.invars), eqn
    used_inputs, new_eqn = _pe.dce_jaxpr_closed_call_rule(used_outputs, *rest)
    if new_eqn is None or source.body is not eqn.params["call_jaxpr"] or not all(used_inputs):
        return used_inputs, new_eqn

    def narrowed(*operands: Any) -> list[Any]:
        outs = source.fn(*operands)
        return [o for o, used in zip(outs, used_outputs, strict=True) if used]

    marker = ProgramSource(narrowed, source.skip)
    marker.body = new_eqn.params["call_jaxpr"]
    return used_inputs, new_eqn.replace(params={**new_eqn.params, "source": marker})


def _program_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, call_jaxpr: ClosedJaxpr,
                 source: Any) -> tuple[list[Any], list[Any]]:
    # Inline. First, for checkify, an equation holding the original program's checks
    # (nothing runs otherwise), so a checked derivative reports the original's first
    # failing check. A body holding a shard_map is split as jax.linearize splits it
    # (the outputs from the primals alone, then the tangents from the residuals): a JVP
    # of the whole body traced at once leaves the primal outputs of a shard_map unknown
    # to reverse mode's partial evaluation. Other bodies are differentiated whole, which
    # runs each effect of a custom rule as often as jax.jit's derivative does.
    if source.body is call_jaxpr and not source.checks_only:
        bind_program(lambda *p: [], _checked_first(source, source.fn, lambda *p: []),
                     list(primals), checks_only=True)
    def inexact(aval: Any) -> bool:
        return bool(jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact))

    def zero(value: Any) -> Any:
        return _ad.Zero(jax.typeof(value).to_tangent_aval())

    avals = [jax.typeof(p) for p in primals]
    diff = [type(t) is not _ad.Zero and inexact(a) for a, t in zip(avals, tangents, strict=True)]
    if not any(diff):
        outs = jaxpr_eval(call_jaxpr, *primals)
        return outs, [zero(o) for o in outs]
    if not any(is_shard_map(eqn) for eqn in open_jaxpr(call_jaxpr)[0].eqns):
        # Only the operands with a tangent are differentiated; the others are closed over.
        # A zero tangent made dense would be a known value: the tangent computation fed by
        # it alone (a region's linear half, a ``custom_vjp``'s ``custom_lin``) would then
        # run as primal work, where ``vmap`` batches ``custom_lin`` and fails ("can't
        # apply forward-mode autodiff (jvp) to a custom_vjp function").
        def of_diff(*diff_primals: Any) -> tuple[Any, ...]:
            given = iter(diff_primals)
            return tuple(jaxpr_eval(call_jaxpr, *[next(given) if d else p
                                                  for p, d in zip(primals, diff, strict=True)]))

        outs, out_tangents = jax.jvp(
            of_diff, tuple(p for p, d in zip(primals, diff, strict=True) if d),
            tuple(t for t, d in zip(tangents, diff, strict=True) if d))
        return list(outs), list(out_tangents)
    lin = linearize_split(lambda *a: jaxpr_eval(call_jaxpr, *a), avals, diff)
    forward = jaxpr_eval(lin.forward, *primals)
    outs, residuals = forward[:lin.num_outputs], forward[lin.num_outputs:]
    out_tangents = eval_linear(lin, residuals,
                               [t for t, d in zip(tangents, diff, strict=True) if d])
    return outs, [t if inexact(jax.typeof(o)) else zero(o)
                  for o, t in zip(outs, out_tangents, strict=True)]


def _program_transpose(cts: Sequence[Any], *args: Any, call_jaxpr: ClosedJaxpr,
                       source: Any) -> list[Any]:
    del source
    linear = [_ad.is_undefined_primal(a) for a in args]

    def body(*lin: Any) -> tuple[Any, ...]:
        given = iter(lin)
        full = [next(given) if is_linear else a for a, is_linear in zip(args, linear, strict=True)]
        return tuple(jaxpr_eval(call_jaxpr, *full))

    avals = [a.aval for a, is_linear in zip(args, linear, strict=True) if is_linear]
    transposed = jax.linear_transpose(
        body, *[jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals])
    given = transposed(tuple(_ad.instantiate_zeros(ct) for ct in cts))
    out = iter(given)
    return [next(out) if is_linear else None for is_linear in linear]


def _program_checkify(*args: Any, call_jaxpr: ClosedJaxpr, source: Any) -> tuple[Any, list[Any]]:
    context_type = getattr(_checkify, "CheckifyContext", None)
    context = args[:1] if context_type is not None and isinstance(args[0], context_type) else ()
    error, enabled_errors, *vals = args[len(context):]
    if source.body is call_jaxpr:  # the equation bind_program made: check the original
        vals, fn = vals[source.skip:], source.fn
    else:
        def fn(*a: Any) -> list[Any]:
            return jaxpr_eval(call_jaxpr, *a)
    original = jax.make_jaxpr(lambda *a: tuple(fn(*a)))(*[jax.typeof(v) for v in vals])
    err_vals, err_tree = jax.tree_util.tree_flatten(error)
    checked, out_tree, _ = _checkify.jaxpr_to_checkify_jaxpr(
        *context, original, enabled_errors, err_tree,
        *[jax.typeof(v) for v in [*err_vals, *vals]])
    outs = jaxpr_eval(checked, *err_vals, *vals)
    return jax.tree_util.tree_unflatten(out_tree, outs)  # type: ignore[no-any-return]


def _program_jet(primals_in: Sequence[Any], series_in: Sequence[Any], *, call_jaxpr: ClosedJaxpr,
                 source: Any) -> tuple[list[Any], list[Any]]:
    del source
    return _call_jet(primals_in, series_in, call_jaxpr, lambda body, args: body(*args))


def _register_program_rules() -> None:
    program_p.def_impl(_program_eval)
    _register_call_rules(program_p, lowering=_program_eval, lowering_rule=_program_lowering,
                         batcher=_program_batcher,
                         jvp=_program_jvp, transpose=_program_transpose, dce=_program_dce,
                         checkify=_program_checkify, jet=_program_jet,
                         # Inline: the program lowers inline, and JAX discharges state
                         # only when lowering, after every transformation it would check.
                         discharge=_call_discharge(lambda body, args, source: body(*args)))


_register_program_rules()


# --------------------------------------------------------------------- check_jaxpr
# (issue 34: ``JAXPAR_CHECKS=1`` checks every level the passes rebuild; kept apart at the
# end of the file, to be re-applied as it is wherever ``_compat`` lives.)
def check_jaxpr(jaxpr: JaxprLike) -> None:
    """Checks ``jaxpr`` (closed or open) with JAX's own checker: types, variables bound
    before use, effects, nested jaxprs. Raises JAX's ``JaxprTypeError`` if malformed."""
    jex_core.check_jaxpr(open_jaxpr(jaxpr)[0])
