"""Loop passes: jaxpr-to-jaxpr rewrites of ``scan`` and ``while`` loops.

Each pass is a pure function of a closed jaxpr that returns a new one (or the
same object when it changes nothing) and the ``LoopDecision``s it made:

* ``make_loops_static``: ``fori_loop`` ``while``s with literal bounds become
  static scans; other ``while``s are reported as host-sync loops.
* ``batch_scans``: independent scans running the same body become one ``vmap``ped scan.
* ``fuse_scans``: independent scans become one scan running their bodies side by side.
* ``batch_branches``: identical independent straight-line subgraphs (ensemble members)
  become one ``vmap``ped subgraph, where the target's cost model says it pays.
* ``batch_matmuls``: same-shaped matmuls and convolutions of one stage in *different*
  members (the halves of a fused scan body, experts, towers) run as one batched op.
* ``unroll_scans``: an unroll factor per static scan.

``apply_loop_passes`` runs them in that order at every nesting level.

Example::

    closed = jax.make_jaxpr(f)(*args)
    new, decisions = apply_loop_passes(closed, **loop_defaults("gpu"), target="gpu")
    g = jax.extend.core.jaxpr_as_fun(new)      # same values and gradients as f

Sharp edges:
  * Fusing and batching reorder nothing inside a body, but XLA may compile the
    merged loop differently; results agree to float rounding, usually exactly.
  * The decision indices refer to each level as the pass saw it (see ``LoopDecision``).
"""

from __future__ import annotations

from typing import Any

from .._structure import StructuralKeys
from ._walk import (
    KIND_BATCHED,
    KIND_BATCHED_MATMULS,
    KIND_BATCHED_SUBGRAPHS,
    KIND_FUSED,
    KIND_HOST_SYNC,
    KIND_LEFT_ALONE,
    KIND_MADE_STATIC,
    KIND_MATMULS_LEFT_ALONE,
    KIND_SUBGRAPHS_LEFT_ALONE,
    KIND_UNROLLED,
    SUBGRAPH_KINDS,
    LevelPass,
    LoopDecision,
    Rewrite,
    walk_levels,
)
from .batch_branches import batch_branches, batch_branches_level
from .batch_matmuls import batch_matmuls, batch_matmuls_level
from .batch_scans import batch_scans, batch_scans_level
from .fuse_scans import fuse_scans, fuse_scans_level
from .share_common import share_common_level, share_common_subexpressions
from .static_loops import make_loops_static, make_loops_static_level
from .unroll import Unroll, _costs, unroll_scans, unroll_scans_level

__all__ = [
    "KIND_BATCHED",
    "KIND_BATCHED_MATMULS",
    "KIND_BATCHED_SUBGRAPHS",
    "KIND_FUSED",
    "KIND_HOST_SYNC",
    "KIND_LEFT_ALONE",
    "KIND_MADE_STATIC",
    "KIND_MATMULS_LEFT_ALONE",
    "KIND_SUBGRAPHS_LEFT_ALONE",
    "KIND_UNROLLED",
    "SUBGRAPH_KINDS",
    "LoopDecision",
    "apply_loop_passes",
    "batch_branches",
    "batch_matmuls",
    "batch_scans",
    "fuse_scans",
    "loop_defaults",
    "make_loops_static",
    "share_common_subexpressions",
    "unroll_scans",
]

# What does no harm where, measured with benchmarks/loops_cpu.py (see the numbers there).
# On a GPU every loop trip costs launches and a trip-count check, so fewer, fuller trips win.
_DEFAULTS: dict[str, dict[str, Any]] = {
    # share_common: XLA's CSE cannot see into stream regions, so on the GPU equal
    # equations are merged before planning; elsewhere XLA's own CSE does it.
    "gpu": {"fuse": True, "batch": True, "batch_branches": True, "batch_matmuls": True,
            "unroll": "auto", "share_common": True},
    "cpu": {"fuse": False, "batch": False, "batch_branches": False, "batch_matmuls": False,
            "unroll": None, "share_common": False},
    "tpu": {"fuse": False, "batch": False, "batch_branches": False, "batch_matmuls": False,
            "unroll": None, "share_common": False},
}


def loop_defaults(target: str) -> dict[str, Any]:
    """The loop pass settings jaxpar uses by default on ``target``.

    Args:
        target: ``"gpu"``, ``"cpu"`` or ``"tpu"``.

    Returns:
        ``{"fuse": bool, "batch": bool, "batch_branches": bool, "batch_matmuls": bool,
        "unroll": "auto" | int | None}``, ready to pass
        to ``apply_loop_passes(closed, **loop_defaults(target), target=target)``.

    Raises:
        ValueError: unknown ``target``.
    """
    if target not in _DEFAULTS:
        raise ValueError(f"jaxpar: target={target!r} is not one of {sorted(_DEFAULTS)}")
    return dict(_DEFAULTS[target])


def apply_loop_passes(closed_jaxpr: Any, *, fuse: bool, batch: bool, unroll: Unroll,
                      target: str, batch_branches: bool = False, batch_matmuls: bool = False,
                      share_common: bool = False) -> tuple[Any, tuple[LoopDecision, ...]]:
    """Runs share_common -> static_loops -> batch -> fuse -> batch_branches -> batch_matmuls
    -> unroll at
    every nesting level.

    Args:
        closed_jaxpr: the program, as from ``jax.make_jaxpr``; never mutated.
        fuse: fuse independent scans into one.
        batch: batch independent scans with identical bodies into one vmapped scan.
        unroll: ``"auto"``, a positive int, or None (leave unroll factors alone).
        target: ``"gpu"``, ``"cpu"`` or ``"tpu"`` (the cost model ``unroll="auto"`` and
            ``batch_branches`` use).
        batch_branches: batch identical independent straight-line subgraphs into one
            vmapped subgraph where the cost model says it pays.
        batch_matmuls: run same-shaped matmuls and convolutions of one stage in different
            independent members as one batched op where the cost model says it pays.
        share_common: merge equations that compute the same thing (XLA's CSE cannot
            see into the stream regions the planner may make).

    Returns:
        ``(new_closed_jaxpr, decisions)``. ``new_closed_jaxpr is closed_jaxpr`` when
        nothing changed, so applying the passes again changes nothing.

    Raises:
        ValueError: ``unroll`` or ``target`` is not supported.

    Example::

        new, decisions = apply_loop_passes(jax.make_jaxpr(f)(x), fuse=True, batch=True,
                                           unroll="auto", target="gpu")
    """
    costs = _costs(target)
    if unroll is not None and not (unroll == "auto" or (
            isinstance(unroll, int) and not isinstance(unroll, bool) and unroll >= 1)):
        raise ValueError(f"jaxpar: unroll={unroll!r} is not supported; pass 'auto', a "
                         "positive int, or None")
    # One set of structural keys for the passes of this call: the parameter dicts of
    # unchanged equations survive rebuilt levels, so each is keyed once.
    structure = StructuralKeys()
    passes: list[LevelPass] = []
    if share_common:
        share_memo: dict[int, Any] = {}

        def share_level(j: Any, path: str) -> tuple[list[Rewrite], list[LoopDecision]]:
            return share_common_level(j, path, structure, share_memo)
        passes.append(share_level)
    passes.append(make_loops_static_level)
    if batch:
        passes.append(batch_scans_level)
    if fuse:
        def fuse_level(j: Any, path: str) -> tuple[list[Rewrite], list[LoopDecision]]:
            return fuse_scans_level(j, path, leave_identical=batch)
        passes.append(fuse_level)
    if batch_branches:
        memo: dict[int, Any] = {}

        def branches_level(j: Any, path: str) -> tuple[list[Rewrite], list[LoopDecision]]:
            return batch_branches_level(j, path, costs, memo, structure)
        passes.append(branches_level)
    if batch_matmuls:
        matmul_memo: dict[int, Any] = {}

        def matmuls_level(j: Any, path: str) -> tuple[list[Rewrite], list[LoopDecision]]:
            return batch_matmuls_level(j, path, costs, matmul_memo)
        passes.append(matmuls_level)
    if unroll is not None:
        def unroll_level(j: Any, path: str) -> tuple[list[Rewrite], list[LoopDecision]]:
            return unroll_scans_level(j, path, unroll=unroll, costs=costs)
        passes.append(unroll_level)
    new, decisions = walk_levels(closed_jaxpr, passes)
    return new, tuple(decisions)
