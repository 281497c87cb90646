"""Inline nested ``jit`` calls that have an independent twin, so the batching passes see
their work.

RL code writes ``qf.apply = jax.jit(qf.apply)``: TD3's twin critics become two ``jit``
equations running one body on different parameters. The batching passes
(``batch_branches``, ``batch_matmuls``) look at one level's equations, and a ``jit``
equation is opaque to them, so the critics' matmuls were never batched, although the
same model written without the ``jit`` was. XLA inlines such calls anyway
(``CallInliner``), so inlining them in the jaxpr changes nothing XLA compiles except the
op names, which keep the call's name as a ``jax.named_scope``.

A call is inlined when it only names its body (no shardings, layouts, donation or
compiler options: ``_compat.plain_call_body``), launches a kernel, and another call at
the same level runs a body of the same signature (the same primitives on the same
types, equation by equation; the calls' names and the bodies' traces may differ) on
operands of the same types, with no path between the two. Calls without a twin keep
their boundary (the planner recurses into them instead).

Example::

    critic = jax.jit(mlp)
    def q_min(p1, p2, x):
        return jnp.minimum(critic(p1, x), critic(p2, x))
    # two jit equations -> the body's equations twice, which batch_matmuls then batches

Sharp edges:
  * A call with effects, user placement (``on_stream``, XLA metadata) or any sharding,
    layout, donation or compiler option of its own is never inlined.
  * Twins are inlined on the GPU defaults (with ``batch_branches`` or
    ``batch_matmuls``) whether or not batching then pays; the compiled program is the
    same either way.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax

from .. import _compat
from .._analysis import Analysis
from .._compat import JaxprLike
from .._memo import IdentityMemo
from ._level_graph import ancestor_masks, independent
from ._protocol import DecisionKind, EmitFn, Level, LevelResult, PassDecision, Rewrite, decision
from ._splice import evaluate


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: one rewrite per inlined call (see the module docstring).

    A level found to have no twins is not searched again (the row
    ``remembers_search``).
    """
    return LevelResult(*_inline_level(level, analysis))


def _inline_level(level: Level, analysis: Analysis) -> tuple[list[Rewrite], list[PassDecision]]:
    inner, _ = _compat.open_jaxpr(level.jaxpr)
    eqns, graph = inner.eqns, level.graph
    classes: dict[Hashable, list[int]] = {}
    bodies: dict[int, tuple[str, Any]] = {}
    signatures: IdentityMemo[JaxprLike, Hashable] = IdentityMemo()
    for index, eqn in enumerate(eqns):
        call = _compat.plain_call_body(eqn)
        if (call is None or index not in graph.live or eqn.effects
                or analysis.annotated(eqn) or not analysis.costs.launches(eqn)):
            continue
        bodies[index] = call
        key = (_signature(call[1], signatures), tuple(v.aval for v in eqn.invars))
        classes.setdefault(key, []).append(index)
    classes = {k: m for k, m in classes.items() if len(m) > 1}
    if not classes:
        return [], []
    ancestors = ancestor_masks(graph, sorted(i for m in classes.values() for i in m))
    rewrites: list[Rewrite] = []
    decisions: list[PassDecision] = []
    for members in classes.values():
        twins = [i for i in members
                 if any(j != i and independent(ancestors, i, j) for j in members)]
        if len(twins) < 2:
            continue
        for index in twins:
            name, body = bodies[index]
            rewrites.append(Rewrite((index,), _emitter(name, body)))
        name = bodies[twins[0]][0]
        decisions.append(decision(
            level.path, DecisionKind.INLINED, eqns, twins, trips_before=None, trips_after=None,
            unroll=None, members=[(i,) for i in twins],
            reason=f"{len(twins)} independent `{eqns[twins[0]].primitive.name}` calls run "
                   f"bodies of one signature (`{name}`): inlined so the batching passes see "
                   "their work (XLA inlines them anyway)"))
    return rewrites, decisions


def _signature(jaxpr: JaxprLike, memo: IdentityMemo[JaxprLike, Hashable]) -> Hashable:
    """Per equation (nested jaxprs too), its primitive and its operand and result types.

    Coarser than a structural key on purpose: inlining is right whatever the bodies
    compute (XLA inlines the calls anyway), so this only says where batching may find
    work of the same shapes; bodies traced apart (two ``jax.jit`` wrappers, a ``custom_jvp``
    such as ``relu`` traced twice) still match.
    """
    hit = memo.get(jaxpr)
    if hit is not None:
        return hit
    inner, _ = _compat.open_jaxpr(jaxpr)
    key = (tuple(v.aval for v in inner.invars), tuple(
        (eqn.primitive.name, tuple(getattr(a, "aval", None) for a in eqn.invars),
         tuple(v.aval for v in eqn.outvars),
         tuple(_signature(sub, memo) for _, _, sub in _compat.eqn_subjaxprs(eqn)))
        for eqn in inner.eqns))
    memo.set(jaxpr, key)
    return key


def _emitter(name: str, body: JaxprLike) -> EmitFn:
    def emit(invals: list[list[Any]]) -> list[list[Any]]:
        with jax.named_scope(name):
            return [evaluate(body, *invals[0])]

    return emit
