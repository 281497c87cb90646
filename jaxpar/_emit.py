"""Emission: evaluate a planned jaxpr, one stream call per region.

The rewritten program is produced by *evaluating* the original jaxpr with an
interpreter (like ``jax.core.eval_jaxpr``) under whatever trace is current:
plain equations are re-bound as they were, each region becomes one
``xla_metadata_call`` carrying ``_xla_stream_annotation``, ``inlineable="false"``
and ``_scheduling_group_id``, and equations with planned nested jaxprs are
re-bound with those jaxprs re-traced through the same interpreter. Because it
is an interpreter, the result composes with ``jit``, ``grad`` and ``vmap`` the
way any JAX code does.

Example::

    emitter = Emitter(level_plan, emit_streams=True)
    outputs = emitter.run(consts, *args)

Sharp edges:
  * Regions are never nested: nested jaxprs inside a region are bound as they
    were, and the planner never plans inside a region.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from . import _compat
from ._interp import Env
from ._plan import LevelPlan
from .passes.collectives import emit_collective_group

STREAM_ATTRIBUTE = "_xla_stream_annotation"
GROUP_ATTRIBUTE = "_scheduling_group_id"


def stream_attributes(stream: int, group: int | None) -> dict[str, str]:
    """The frontend attributes that put one call on CUDA stream ``stream``."""
    attrs = {STREAM_ATTRIBUTE: str(stream), "inlineable": "false"}
    if group is not None:
        attrs[GROUP_ATTRIBUTE] = str(group)
    return attrs


class Emitter:
    """Evaluates a ``LevelPlan`` tree; caches per-level derived data."""

    def __init__(self, plan: LevelPlan, emit_streams: bool):
        self.plan = plan
        self.emit_streams = emit_streams
        self._region_io: dict[tuple[int, int, int], tuple[list[Any], list[Any]]] = {}
        self._params: dict[tuple[int, int], dict[str, Any] | None] = {}
        self._readers: dict[int, dict[Any, list[int]]] = {}

    def run(self, consts: Sequence[Any], *args: Any, emit_streams: bool = True) -> list[Any]:
        if not (self.emit_streams and emit_streams):
            return _compat.jaxpr_eval(self.plan.jaxpr, *args)
        return self._evaluate(self.plan, consts, args)

    def _evaluate(self, level: LevelPlan, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        inner, _ = _compat.open_jaxpr(level.jaxpr)
        env = Env()
        read, write = env.read, env.write
        write(inner.constvars, consts)
        write(inner.invars, args)
        nested = {index: subs for index, subs in level.nested
                  if any(sub.changes_anything for _, sub in subs)}
        eqns = inner.eqns
        for unit in level.order:
            if unit[0] == "eqn":
                index = unit[1]
                eqn = eqns[index]
                invals = [read(v) for v in eqn.invars]
                if index in nested and _compat.is_shard_map(eqn):
                    # Collectives in the body need the mesh axes bound: re-emit
                    # through shard_map itself rather than re-tracing the body alone.
                    ((_, body_plan),) = nested[index]
                    _, body_consts = _compat.open_jaxpr(body_plan.jaxpr)
                    outs = _compat.rebind_shard_map(
                        eqn, self._sub_runner(body_plan, body_consts), invals)
                else:
                    params = (self._nested_params(level, index, nested[index])
                              if index in nested else None)
                    outs = _compat.bind_eqn(eqn, invals, params)
                write(eqn.outvars, outs)
                continue
            if unit[0] == "collectives":
                members = [eqns[i] for i in level.collective_groups[unit[1]].eqns]
                results = emit_collective_group(
                    members, [[read(v) for v in eqn.invars] for eqn in members])
                for eqn, outs in zip(members, results, strict=True):
                    write(eqn.outvars, outs)
                continue
            _, s, r = unit
            section = level.sections[s]
            region = section.regions[r]
            in_vars, out_vars = self._io(level, s, r)
            body = _region_body([eqns[i] for i in region.eqns], in_vars, out_vars)
            packed = _compat.PACK_MULTI_RESULT_CALLS and _packable([v.aval for v in out_vars])
            if packed:
                body = _packed(body)
            call = _compat.stream_call(body, stream_attributes(region.stream, section.group))
            results = call(*env.read_all(in_vars))
            if packed:
                results = _unpack(results, [v.aval for v in out_vars])
            write(out_vars, results)
        return [read(v) for v in inner.outvars]

    def _io(self, level: LevelPlan, s: int, r: int) -> tuple[list[Any], list[Any]]:
        key = (id(level), s, r)
        hit = self._region_io.get(key)
        if hit is None:
            readers = self._readers.get(id(level))
            if readers is None:
                readers = self._readers[id(level)] = _readers(level)
            hit = region_io(level, level.sections[s].regions[r].eqns, readers)
            self._region_io[key] = hit
        return hit

    def _nested_params(self, level: LevelPlan, index: int,
                       subs: tuple[tuple[tuple[str, int | None], LevelPlan], ...]
                       ) -> dict[str, Any] | None:
        key = (id(level), index)
        if key not in self._params:
            inner, _ = _compat.open_jaxpr(level.jaxpr)
            eqn = inner.eqns[index]
            replacements = {}
            for slot, sub in subs:
                if not sub.changes_anything:
                    continue
                _, sub_consts = _compat.open_jaxpr(sub.jaxpr)
                new = _compat.retrace_like(self._sub_runner(sub, sub_consts), sub.jaxpr)
                if new is not None:
                    replacements[slot] = new
            self._params[key] = (_compat.eqn_replace_subjaxprs(eqn, replacements)
                                 if replacements else None)
        return self._params[key]

    def _sub_runner(self, sub: LevelPlan, consts: list[Any]) -> Callable[..., list[Any]]:
        def run(*args: Any) -> list[Any]:
            return self._evaluate(sub, consts, args)
        return run


_OUTPUT = -1  # stands for "read by the jaxpr's outputs" in ``_readers``


def _readers(level: LevelPlan) -> dict[Any, list[int]]:
    """For each variable of the level, the equations reading it (``_OUTPUT``: the outputs)."""
    inner, _ = _compat.open_jaxpr(level.jaxpr)
    readers: dict[Any, list[int]] = {}
    for i, eqn in enumerate(inner.eqns):
        for v in eqn.invars:
            if not _compat.is_literal(v):
                readers.setdefault(v, []).append(i)
    for v in inner.outvars:
        if not _compat.is_literal(v):
            readers.setdefault(v, []).append(_OUTPUT)
    return readers


def region_io(level: LevelPlan, region_eqns: Sequence[int],
              readers: dict[Any, list[int]]) -> tuple[list[Any], list[Any]]:
    """Variables a region reads from outside, and those it must return."""
    inner, _ = _compat.open_jaxpr(level.jaxpr)
    eqns = inner.eqns
    members = set(region_eqns)
    defined: set[Any] = set()
    inputs: dict[Any, None] = {}
    for i in region_eqns:
        for v in eqns[i].invars:
            if not _compat.is_literal(v) and v not in defined:
                inputs.setdefault(v, None)
        defined.update(v for v in eqns[i].outvars if not _compat.is_drop_var(v))
    outputs = [v for i in region_eqns for v in eqns[i].outvars
               if not _compat.is_drop_var(v)
               and any(r not in members for r in readers.get(v, ()))]
    return list(inputs), outputs


def _region_body(eqns: list[Any], in_vars: list[Any], out_vars: list[Any]) -> Callable[..., Any]:
    def body(*values: Any) -> tuple[Any, ...]:
        env = Env()
        env.write(in_vars, values)
        for eqn in eqns:
            env.write(eqn.outvars, _compat.bind_eqn(eqn, env.read_all(eqn.invars)))
        return tuple(env.read_all(out_vars))
    return body


def _packable(avals: Sequence[Any]) -> bool:
    """Whether several results can travel as one flat array (same plain dtype, not weak)."""
    if len(avals) < 2:
        return False
    dtypes = {a.dtype for a in avals}
    if len(dtypes) != 1 or any(getattr(a, "weak_type", False) for a in avals):
        return False
    (dtype,) = dtypes
    return bool(np.issubdtype(dtype, np.number) or np.issubdtype(dtype, np.bool_))


def _packed(body: Callable[..., tuple[Any, ...]]) -> Callable[..., Any]:
    def packed_body(*values: Any) -> Any:
        return jnp.concatenate([jnp.ravel(r) for r in body(*values)])
    return packed_body


def _unpack(flat: Any, avals: Sequence[Any]) -> list[Any]:
    results, offset = [], 0
    for aval in avals:
        size = _compat.aval_size(aval)
        results.append(jnp.reshape(flat[offset:offset + size], aval.shape))
        offset += size
    return results
