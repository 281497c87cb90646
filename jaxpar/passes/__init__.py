"""The rewrite passes: jaxpr-to-jaxpr rewrites of loops, independent members and equal
equations, before planning.

Each pass has one name, used by its row of ``PASSES`` (a ``Pass``), its module, its
one-pass function here, its option where it has one, and its test file
(``tests/test_<name>.py``; ``tests/test_loop_passes.py`` for the four passes that rewrite
loops). A row holds the name, one ``run(level, analysis) -> LevelResult`` function with
the same signature for every pass, the setting that turns it on, and what the walker
does for it (``remembers_search``, ``state``, ``prices_launches``; see ``_protocol.Pass``).
``run_passes`` runs any of them, in table order, at every nesting level of a closed
jaxpr, and returns a new one (or the same object when nothing changed) and the
``PassDecision``s made (each with the pass's name and a ``DecisionKind``):

* ``make_loops_static``: ``fori_loop`` ``while``s with literal bounds become
  static scans; other ``while``s are reported as host-sync loops.
* ``batch_scans``: independent scans running the same body become one ``vmap``ped scan.
* ``fuse_scans``: independent scans become one scan running their bodies side by side.
* ``batch_branches``: identical independent straight-line subgraphs (ensemble members)
  become one ``vmap``ped subgraph, where the target's cost model says it pays.
* ``batch_matmuls``: same-shaped matmuls and convolutions at one launch depth in *different*
  members (the halves of a fused scan body, experts, towers) run as one batched op.
* ``bound_fusions``: after the batching passes, an ``optimization_barrier`` wherever an
  elementwise chain has read ``MAX_FUSED_SLICES`` of the members' results they sliced
  out, so XLA never fuses a thousand slices into one kernel (its compile time).
* ``unroll_scans``: an unroll factor per static scan.

* ``share_common``: equal equations computed once (on by default on GPUs only).
* ``inline_twin_calls``: independent nested ``jit`` calls running one body (twin critics
  behind ``jax.jit``) are inlined, so the two batching passes see their work.

``apply_passes`` (every switch a keyword; ``pass_defaults(target)`` gives the target's)
and the one-pass functions named above run ``run_passes`` with fixed settings.

Deprecated, going in the next release (reading one warns, naming its replacement):
the names from before the passes outgrew loops, ``LoopPass`` (``Pass``),
``LoopDecision`` (``PassDecision``), ``apply_loop_passes`` (``apply_passes``),
``loop_defaults`` (``pass_defaults``), and ``share_common_subexpressions``
(``share_common``).

Example::

    closed = jax.make_jaxpr(f)(*args)
    new, decisions = run_passes(closed, target="gpu")        # the target's defaults
    new, decisions = run_passes(closed, ["fuse_scans"], target="gpu")
    g = jax.extend.core.jaxpr_as_fun(new)      # same values and gradients as f

Sharp edges:
  * Fusing and batching reorder nothing inside a body, but XLA may compile the
    merged loop differently; results agree to float rounding, usually exactly.
  * The decision indices refer to each level as the pass saw it (see ``PassDecision``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from .._analysis import Analysis
from .._compat import ClosedJaxpr
from .._options import Options, Settings, check_target, pass_defaults, unroll_setting
from . import batch_branches as _batch_branches
from . import batch_matmuls as _batch_matmuls
from . import batch_scans as _batch_scans
from . import bound_fusions as _bound_fusions
from . import fuse_scans as _fuse_scans
from . import inline_twin_calls as _inline_twin_calls
from . import make_loops_static as _make_loops_static
from . import share_common as _share_common
from . import unroll_scans as _unroll_scans
from ._protocol import (
    NEW_LOOP_KINDS,
    SUBGRAPH_KINDS,
    UNCHANGED_KINDS,
    DecisionKind,
    Level,
    LevelResult,
    Pass,
    PassDecision,
    Rewrite,
)
from ._walk import walk_levels

__all__ = [
    "NEW_LOOP_KINDS",
    "PASSES",
    "SUBGRAPH_KINDS",
    "UNCHANGED_KINDS",
    "DecisionKind",
    "Level",
    "LevelResult",
    "PassDecision",
    "Rewrite",
    "Pass",
    "apply_passes",
    "batch_branches",
    "batch_matmuls",
    "batch_scans",
    "bound_fusions",
    "fuse_scans",
    "inline_twin_calls",
    "make_loops_static",
    "pass_defaults",
    "run_pass",
    "run_passes",
    "share_common",
    "unroll_scans",
]

# The passes, in the order they run at each level.
PASSES: tuple[Pass, ...] = (
    Pass("share_common", _share_common.run, lambda s: s.share_common,
             "equal equations computed once", remembers_search=True,
             state=_share_common.State),
    Pass("inline_twin_calls", _inline_twin_calls.run,
             lambda s: s.batch_branches or s.batch_matmuls,
             "independent nested jit calls running one body are inlined for batching",
             remembers_search=True),
    Pass("make_loops_static", _make_loops_static.run, lambda s: True,
             "counting whiles with static bounds become scans"),
    Pass("batch_scans", _batch_scans.run, lambda s: s.batch_scans,
             "independent identical scans become one vmapped scan"),
    Pass("fuse_scans", _fuse_scans.run, lambda s: s.fuse_scans,
             "independent scans run side by side in one scan"),
    Pass("batch_branches", _batch_branches.run, lambda s: s.batch_branches,
             "identical independent subgraphs become one vmapped subgraph",
             prices_launches=True, remembers_search=True, state=_batch_branches.State),
    Pass("batch_matmuls", _batch_matmuls.run, lambda s: s.batch_matmuls,
             "same-shaped matmuls at one launch depth in different members become one op",
             prices_launches=True, remembers_search=True, state=_batch_matmuls.State),
    Pass("bound_fusions", _bound_fusions.run,
             lambda s: s.batch_branches or s.batch_matmuls or s.batch_scans,
             "a barrier where a chain has read 32 batched members' results (XLA compile time)",
             after=("batch_scans", "batch_branches", "batch_matmuls")),
    Pass("unroll_scans", _unroll_scans.run, lambda s: s.unroll is not None,
             "an unroll factor per static scan"),
)
_BY_NAME = {p.name: p for p in PASSES}


def run_passes(closed_jaxpr: ClosedJaxpr, names: Sequence[str] | None = None, *,
               analysis: Analysis | None = None, target: str = "gpu",
               **options: Any) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Runs the passes at every nesting level of ``closed_jaxpr`` (never mutated).

    Args:
        closed_jaxpr: the program, as from ``jax.make_jaxpr``.
        names: the passes to run (``Pass.name``s), in table order whatever the order
            given; None runs every pass the settings turn on.
        analysis: the call's ``Analysis`` (settings, cost model, memos); default one made
            from ``target`` and ``options``.
        target: ``"gpu"``, ``"cpu"`` or ``"tpu"``, when no ``analysis`` is given.
        **options: ``parallel_branches`` options (``fuse_scans=``, ``unroll=`` ...), when
            no ``analysis`` is given.

    Returns:
        ``(new_closed_jaxpr, decisions)``; ``new_closed_jaxpr is closed_jaxpr`` when
        nothing changed, so running the passes again changes nothing.

    Raises:
        ValueError: an unknown pass name or target, or a bad option value.
        TypeError: an unknown option name.
    """
    if analysis is None:
        analysis = Analysis(Options.create(**options).resolve(check_target(target, concrete=True)))
    elif options:
        raise TypeError(f"run_passes takes either analysis= or options, not both "
                        f"(got {sorted(options)})")
    if names is None:
        chosen = [p for p in PASSES if p.enabled(analysis.settings)]
    else:
        names = [names] if isinstance(names, str) else list(names)
        unknown = [n for n in names if n not in _BY_NAME]
        if unknown:
            raise ValueError(f"jaxpar: unknown pass(es) {unknown}; passes are "
                             f"{[p.name for p in PASSES]}")
        chosen = [p for p in PASSES if p.name in names]
    new, decisions = walk_levels(closed_jaxpr, chosen, analysis)
    return new, tuple(decisions)


def run_pass(name: str, closed_jaxpr: ClosedJaxpr, *, target: str = "gpu",
             settings: Settings | None = None) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Runs the one pass ``name`` at every nesting level (see ``run_passes``).

    ``settings`` (default: ``Options().resolve(target)``) give the pass its switches,
    e.g. ``unroll`` for ``unroll_scans``.
    """
    if settings is None:
        settings = Options().resolve(check_target(target, concrete=True))
    return run_passes(closed_jaxpr, [name], analysis=Analysis(settings))


def _settings(target: str, **switches: Any) -> Settings:
    return Settings(target=check_target(target, concrete=True), **switches)


def apply_passes(closed_jaxpr: ClosedJaxpr, *, fuse_scans: bool, batch_scans: bool, unroll: Any,
                 target: str, batch_branches: bool = False, batch_matmuls: bool = False,
                 share_common: bool = False) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Runs the passes these switches turn on, in table order, at every nesting level.

    Unlike ``run_passes``, every switch is explicit (an unset one is off, whatever the
    target) and no GPU profile or CUDA-graph mode is read from the machine, so the result
    depends on the arguments alone; ``pass_defaults(target)`` gives the target's switches.

    Args:
        closed_jaxpr: the program, as from ``jax.make_jaxpr``; never mutated.
        fuse_scans: fuse independent scans into one.
        batch_scans: batch independent scans with identical bodies into one vmapped scan.
        unroll: ``"auto"`` (the target's default: ``"cost"`` on GPUs, None elsewhere),
            ``"cost"`` (a factor per scan from the cost model), a positive int, or None
            (leave unroll factors alone), as in ``parallel_branches``.
        target: ``"gpu"``, ``"cpu"`` or ``"tpu"`` (its defaults, and the cost model
            ``unroll="cost"`` and the batching passes use).
        batch_branches: batch identical independent straight-line subgraphs into one
            vmapped subgraph where the cost model says it pays.
        batch_matmuls: run same-shaped matmuls and convolutions at one launch depth in
            different independent members as one batched op where the cost model says it pays.
        share_common: merge equations that compute the same thing (XLA's CSE cannot
            see into the stream regions the planner may make).

    Returns:
        ``(new_closed_jaxpr, decisions)`` as ``run_passes``.

    Raises:
        ValueError: ``unroll`` or ``target`` is not supported.

    Example::

        new, decisions = apply_passes(jax.make_jaxpr(f)(x), fuse_scans=True,
                                      batch_scans=True, unroll="auto", target="gpu")
        new, decisions = apply_passes(jax.make_jaxpr(f)(x), **pass_defaults("gpu"),
                                      target="gpu")
    """
    settings = _settings(target, fuse_scans=fuse_scans, batch_scans=batch_scans,
                         batch_branches=batch_branches, batch_matmuls=batch_matmuls,
                         unroll=unroll_setting(unroll, check_target(target, concrete=True)),
                         share_common=share_common)
    return run_passes(closed_jaxpr, analysis=Analysis(settings))


def make_loops_static(jaxpr: ClosedJaxpr) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Replaces static ``fori_loop`` ``while``s by scans at every level of ``jaxpr``
    (never mutated); other ``while``s are reported as host-sync loops.

    Returns:
        ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.
    """
    return run_pass("make_loops_static", jaxpr, settings=_settings("gpu"))


def batch_scans(jaxpr: ClosedJaxpr) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Batches independent identical scans at every level of ``jaxpr`` (never mutated).

    Returns:
        ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.
    """
    return run_pass("batch_scans", jaxpr, settings=_settings("gpu", batch_scans=True))


def fuse_scans(jaxpr: ClosedJaxpr, *, leave_identical: bool = False
               ) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Fuses independent scans at every level of ``jaxpr`` (never mutated).

    Args:
        jaxpr: a closed jaxpr (as from ``jax.make_jaxpr``).
        leave_identical: do not fuse scans that ``batch_scans`` could batch instead.

    Returns:
        ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.
    """
    return run_pass("fuse_scans", jaxpr, settings=_settings(
        "gpu", fuse_scans=True, batch_scans=bool(leave_identical)))


def batch_branches(jaxpr: ClosedJaxpr, target: str = "gpu"
                   ) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Batches identical independent subgraphs at every level of ``jaxpr`` (never mutated).

    Args:
        jaxpr: a closed jaxpr (as from ``jax.make_jaxpr``).
        target: the cost model that decides whether batching pays: ``"gpu"``,
            ``"cpu"`` or ``"tpu"``.

    Returns:
        ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.

    Raises:
        ValueError: unknown ``target``.
    """
    return run_pass("batch_branches", jaxpr, settings=_settings(target, batch_branches=True))


def batch_matmuls(jaxpr: ClosedJaxpr, target: str = "gpu"
                  ) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Batches same-shaped matmuls and convolutions at one launch depth at every level of
    ``jaxpr`` (never mutated).

    Args:
        jaxpr: a closed jaxpr (as from ``jax.make_jaxpr``).
        target: the cost model that decides whether batching pays: ``"gpu"``,
            ``"cpu"`` or ``"tpu"``.

    Returns:
        ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.

    Raises:
        ValueError: unknown ``target``.

    Example::

        new, decisions = batch_matmuls(jax.make_jaxpr(f)(a, b, x), target="gpu")
    """
    return run_pass("batch_matmuls", jaxpr, settings=_settings(target, batch_matmuls=True))


def bound_fusions(jaxpr: ClosedJaxpr, target: str = "gpu"
                  ) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Runs the three batching passes, then ``bound_fusions`` on what they made, at
    every level of ``jaxpr`` (never mutated): alone it has nothing to bound.

    Args:
        jaxpr: a closed jaxpr (as from ``jax.make_jaxpr``).
        target: the cost model that decides whether batching pays: ``"gpu"``,
            ``"cpu"`` or ``"tpu"``.

    Returns:
        ``(new_jaxpr, decisions)`` (the batching passes' and this one's); ``new_jaxpr is
        jaxpr`` when nothing changed.

    Raises:
        ValueError: unknown ``target``.
    """
    row = _BY_NAME["bound_fusions"]
    return run_passes(jaxpr, [*row.after, row.name], analysis=Analysis(_settings(
        target, batch_scans=True, batch_branches=True, batch_matmuls=True)))


def unroll_scans(jaxpr: ClosedJaxpr, *, unroll: Any = "auto", target: str = "gpu"
                 ) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Sets the unroll factor of the scans at every level of ``jaxpr`` (never mutated).

    Args:
        jaxpr: a closed jaxpr (as from ``jax.make_jaxpr``).
        unroll: ``"auto"`` (the target's default: ``"cost"`` on GPUs, None elsewhere),
            ``"cost"`` (a factor per scan from the cost model), a positive int, or None
            (leave every scan alone), as in ``parallel_branches``.
        target: ``"gpu"``, ``"cpu"`` or ``"tpu"``: its default and its cost model.

    Returns:
        ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.

    Raises:
        ValueError: ``unroll`` or ``target`` is not one of the above.
    """
    return run_pass("unroll_scans", jaxpr,
                    settings=_settings(target, unroll=unroll_setting(
                        unroll, check_target(target, concrete=True))))


def share_common(jaxpr: ClosedJaxpr) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Merges equal equations at every level of ``jaxpr`` (never mutated).

    Returns:
        ``(new_jaxpr, ())``; ``new_jaxpr is jaxpr`` when nothing was shared.
    """
    return run_pass("share_common", jaxpr, settings=_settings("gpu", share_common=True))


def inline_twin_calls(jaxpr: ClosedJaxpr) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Inlines independent nested ``jit`` calls of one body at every level of ``jaxpr``
    (never mutated), so the batching passes can batch what they run.

    Returns:
        ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.
    """
    return run_pass("inline_twin_calls", jaxpr,
                    settings=_settings("gpu", batch_branches=True))


def _apply_loop_passes(closed_jaxpr: ClosedJaxpr, *, fuse: bool, batch: bool, **switches: Any
                       ) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """``apply_passes`` with its old keywords ``fuse`` and ``batch``."""
    return apply_passes(closed_jaxpr, fuse_scans=fuse, batch_scans=batch, **switches)


def _loop_defaults(target: str) -> dict[str, Any]:
    """``pass_defaults`` with its old keys ``fuse`` and ``batch``."""
    switches = pass_defaults(target)
    return {"fuse": switches.pop("fuse_scans"), "batch": switches.pop("batch_scans"),
            **switches}


# The names from before the passes outgrew loops: old name -> (its replacement here,
# what the old name gives). Each still works for one release and warns when read
# (``from jaxpar.passes import LoopPass`` too); none is in ``__all__``.
_DEPRECATED: dict[str, tuple[str, Any]] = {
    "LoopPass": ("Pass", Pass),
    "LoopDecision": ("PassDecision", PassDecision),
    "apply_loop_passes": ("apply_passes", _apply_loop_passes),
    "loop_defaults": ("pass_defaults", _loop_defaults),
    "share_common_subexpressions": ("share_common", share_common),
}


def __getattr__(name: str) -> Any:
    if name not in _DEPRECATED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    new, value = _DEPRECATED[name]
    warnings.warn(f"jaxpar.passes.{name} is deprecated and goes in the next release; use "
                  f"jaxpar.passes.{new}", DeprecationWarning, stacklevel=2)
    return value
