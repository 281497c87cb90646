"""Reading a ``shard_map`` equation, re-emitting it with a new body, and tracing code
for its body in the environment JAX traced the body in.

Layouts (docs/xla.md, "Emitting an annotated call from JAX"):
  * jax <= 0.6.0: ``jax.experimental.shard_map.shard_map``; params ``mesh, in_names,
    out_names, check_rep, auto, rewrite, jaxpr`` where a "names" entry is a
    ``{dim: (axis, ...)}`` dict.
  * jax >= 0.6.1: ``jax.shard_map``; params ``mesh, in_specs, out_specs, check_vma,
    jaxpr`` plus ``manual_axes`` / ``newly_manual_axes`` (0.10+) or ``auto`` (earlier)
    saying which mesh axes the body is manual over.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import source_info_util as _source_info_util

from .jaxprs import JaxprEqn, JaxprLike, array_aval, internal_primitive_name
from .sources import source_summary

_SHARD_MAP = internal_primitive_name("shard_map_p", "shard_map")

@dataclasses.dataclass(frozen=True)
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
