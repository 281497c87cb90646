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

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

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

from jax._src import source_info_util as _source_info_util

__all__ = [
    "JAX_VERSION",
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "Var",
    "bind_eqn",
    "eqn_frontend_attributes",
    "eqn_replace_subjaxprs",
    "eqn_subjaxprs",
    "is_tracer",
    "make_closed_jaxpr",
    "open_jaxpr",
    "retrace_like",
    "source_summary",
    "stream_call",
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

# From jax 0.11 ``ClosedJaxpr`` is ``Jaxpr``: "closed" then means "has consts".
_UNIFIED_JAXPR = ClosedJaxpr is Jaxpr

# Names of primitives that mean "the user already placed this code"; matched by
# name because their Python homes move between releases.
USER_PLACEMENT_PRIMITIVES = frozenset(
    {"xla_metadata_call", "compute_on", "compute_on2", "annotate_device_placement"}
)


def is_tracer(value: Any) -> bool:
    """Whether ``value`` is a JAX tracer (we are inside jit, grad, vmap, ...)."""
    return isinstance(value, jax.core.Tracer)


def is_jaxpr_like(value: Any) -> bool:
    return isinstance(value, (Jaxpr, ClosedJaxpr))


def open_jaxpr(jaxpr: Any) -> tuple[Any, list[Any]]:
    """Returns ``(open_jaxpr, consts)`` for a ``Jaxpr`` or ``ClosedJaxpr``.

    The open jaxpr's ``constvars`` line up with ``consts``.
    """
    if _UNIFIED_JAXPR:
        return jaxpr, list(getattr(jaxpr, "consts", ()) or ())
    if isinstance(jaxpr, ClosedJaxpr):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, []


def has_consts(jaxpr: Any) -> bool:
    return bool(open_jaxpr(jaxpr)[1])


def all_invars(jaxpr: Any) -> list[Any]:
    """Constvars then invars of an open jaxpr."""
    return [*jaxpr.constvars, *jaxpr.invars]


def in_avals(jaxpr: Any) -> list[Any]:
    inner, _ = open_jaxpr(jaxpr)
    return [v.aval for v in inner.invars]


def _spec(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def make_closed_jaxpr(fn: Callable[..., Any], avals: Sequence[Any]) -> Any:
    """Traces ``fn`` at the given abstract values to a closed jaxpr."""
    return jax.make_jaxpr(fn)(*[_spec(a) if not isinstance(a, jax.ShapeDtypeStruct) else a
                                for a in avals])


def retrace_like(fn: Callable[..., Any], original: Any) -> Any | None:
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


def eqn_subjaxprs(eqn: Any) -> Iterator[tuple[str, int | None, Any]]:
    """Yields ``(param_name, index_or_None, jaxpr)`` for every jaxpr parameter.

    Visits every parameter, including tuples of jaxprs such as ``cond``'s
    ``branches``, instead of guessing parameter names.
    """
    for name, value in eqn.params.items():
        if is_jaxpr_like(value):
            yield name, None, value
        elif isinstance(value, (tuple, list)):
            for index, item in enumerate(value):
                if is_jaxpr_like(item):
                    yield name, index, item


def eqn_replace_subjaxprs(eqn: Any, replacements: dict[tuple[str, int | None], Any]
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


def eqn_frontend_attributes(eqn: Any) -> dict[str, str]:
    """The XLA frontend attributes the user or jaxpar attached to ``eqn``."""
    attrs: dict[str, str] = {}
    ctx_meta = getattr(eqn.ctx, "xla_metadata", None)
    if ctx_meta:
        attrs.update({str(k): str(v) for k, v in dict(ctx_meta).items()})
    compute_type = getattr(eqn.ctx, "compute_type", None)
    if compute_type is not None:
        attrs["_xla_compute_type"] = str(compute_type)
    if eqn.primitive.name == "xla_metadata_call":
        if "xla_metadata" in eqn.params:  # jax >= 0.11
            attrs.update({str(k): str(v) for k, v in eqn.params["xla_metadata"]})
        else:  # jax 0.8 - 0.10: the attributes are the parameters themselves
            attrs.update({str(k): str(v) for k, v in eqn.params.items() if k != "jaxpr"})
    return attrs


def bind_eqn(eqn: Any, invals: Sequence[Any], params: dict[str, Any] | None = None) -> list[Any]:
    """Binds ``eqn``'s primitive on ``invals``, keeping its source info and context."""
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (_source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
          eqn.ctx.manager):
        out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def source_summary(eqn: Any) -> str:
    """``file:line (function)`` of the user code that created ``eqn``."""
    try:
        return str(_source_info_util.summarize(eqn.source_info))
    except Exception:
        return "<unknown>"


def literal_value(atom: Any) -> Any:
    return atom.val


def is_literal(atom: Any) -> bool:
    return isinstance(atom, Literal)


def is_drop_var(var: Any) -> bool:
    return isinstance(var, DropVar)


def stream_call(fn: Callable[..., Any], attributes: dict[str, str]) -> Callable[..., Any]:
    """Wraps ``fn`` so it lowers to one non-inlined call with ``attributes``."""
    return _xla_metadata_call(fn, **attributes)


def aval_nbytes(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes such as PRNG keys
        itemsize = 8
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def aval_size(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    return int(np.prod(shape, dtype=np.int64)) if shape is not None else 0


def scan_length(eqn: Any) -> int:
    return int(eqn.params["length"])


def jaxpr_eval(jaxpr: Any, *args: Any) -> list[Any]:
    """Evaluates a closed or open jaxpr (open ones take no consts)."""
    inner, consts = open_jaxpr(jaxpr)
    return list(jax.core.eval_jaxpr(inner, consts, *args))
