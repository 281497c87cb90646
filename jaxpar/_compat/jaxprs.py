"""Jaxpr types and splicing: the classes the package annotates with, opening, re-tracing,
editing and evaluating a jaxpr, and where JAX keeps the primitives it does not export.

Sharp edge: up to jax 0.10 ``ClosedJaxpr`` wraps a ``Jaxpr``; from 0.11 they are one
class and every ``Jaxpr`` carries ``.consts``. ``open_jaxpr`` hides this.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import jax
import jax.extend.core as jex_core
import numpy as np
from jax._src import core as _core
from jax._src import sharding_impls as _sharding_impls

if TYPE_CHECKING:
    from typing_extensions import TypeIs


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

# Where JAX keeps the primitive objects that ``jax.extend.core.primitives`` and
# ``jax.lax`` do not export (their homes move between releases).
PRIMITIVE_HOMES = ("jax._src.core", "jax._src.lax.parallel", "jax._src.shard_map",
                   "jax._src.callback", "jax._src.debugging", "jax._src.random.prng",
                   "jax._src.prng", "jax._src.pjit", "jax._src.compute_on",
                   "jax._src.xla_metadata", "jax.experimental.scheduling_groups",
                   "jax._src.lax.eval_jaxpr", "jax._src.ad_checkpoint")


def internal_primitive(attribute: str) -> Any | None:
    """The primitive JAX keeps in one of its internal modules as ``attribute`` (e.g.
    ``"pvary_p"``), or None where this jax has none of that name."""
    for home in PRIMITIVE_HOMES:
        try:
            module = importlib.import_module(home)
        except ImportError:
            continue
        primitive = getattr(module, attribute, None)
        if isinstance(primitive, jex_core.Primitive):
            return primitive
    return None


def internal_primitive_name(attribute: str, known_name: str) -> str:
    """The primitive's name from its object; ``known_name`` (its name on every supported
    jax) where a release keeps the object elsewhere, so ``import jaxpar`` never fails on
    it (``tests/test_program_primitives.py`` checks the lookup on the supported versions)."""
    primitive = internal_primitive(attribute)
    return known_name if primitive is None else str(primitive.name)


def jax_primitive_names() -> frozenset[str]:
    """Names of every primitive the running jax defines at module level (for tests).

    Imports JAX's public modules and its internal homes (``PRIMITIVE_HOMES``), then
    collects the ``Primitive`` attributes of every loaded ``jax`` module.
    """
    for name in ("jax.numpy", "jax.lax", "jax.random", "jax.nn", "jax.scipy",
                 "jax.experimental.shard_map", "jax.experimental.compute_on",
                 "jax.experimental.xla_metadata", "jax.experimental.scheduling_groups",
                 "jax.experimental.custom_partitioning", "jax.ad_checkpoint",
                 "jax.experimental.checkify", *PRIMITIVE_HOMES):
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
    return frozenset(names)


def ordering_effects(eqn: JaxprEqn) -> frozenset[Any]:
    """``eqn``'s effects that order it against other effectful equations.

    ``NamedAxisEffect`` (collectives over a mesh axis inside ``shard_map``) only
    records which axes are used; it imposes no order.
    """
    return frozenset(e for e in eqn.effects if not isinstance(e, _core.NamedAxisEffect))


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


def check_jaxpr(jaxpr: JaxprLike) -> None:
    """Checks ``jaxpr`` (closed or open) with JAX's own checker: types, variables bound
    before use, effects, nested jaxprs. Raises JAX's ``JaxprTypeError`` if malformed."""
    jex_core.check_jaxpr(open_jaxpr(jaxpr)[0])


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
    ``branches``, instead of guessing parameter names. A jaxpr that is not a level of its
    own (``is_level``) is yielded too: reading its equations is safe (callbacks,
    placement, costs); opening and rewriting it is not.
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


def is_level(jaxpr: JaxprLike) -> bool:
    """Whether jaxpar may open ``jaxpr`` (found in an equation's parameters) as a level
    and rewrite it: it carries a value for each of its constvars, none of them a tracer.

    Equinox's primitives (lineax's ``linear_solve``, which optimistix and diffrax's
    implicit solvers call) keep a closure-converted function's jaxpr among their static
    parameters and pass its constants as operands, in an order only the primitive knows:
    on jax 0.10 its constvars have no values, from 0.11 (one ``Jaxpr`` class) they are
    the finished trace's tracers. A rewrite there could change what the primitive binds.
    """
    inner, consts = open_jaxpr(jaxpr)
    return len(inner.constvars) == len(consts) and not any(
        isinstance(c, jax.core.Tracer) for c in consts)


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


def jaxpr_eval(jaxpr: JaxprLike, *args: Any) -> list[Any]:
    """Evaluates a closed or open jaxpr (open ones take no consts)."""
    inner, consts = open_jaxpr(jaxpr)
    return list(jax.core.eval_jaxpr(inner, consts, *args))
