"""The rewrite passes: jaxpr-to-jaxpr rewrites of loops, independent members and equal
equations, before planning.

Each pass has one name, used by its row of the pass table (``_options.PASS_TABLE``: its
option, how it is turned on, its rung of the memory budget's ladder, what it works
after), its module here (with ``run`` and, for state of its own for a call, ``State``),
its one-pass function here (written out, or made from its row where none is:
``_one_pass_function``), its option where it has one, and its test file
(``tests/test_<name>.py``; ``tests/test_loop_passes.py`` for the four passes that rewrite
loops). ``PASSES`` binds each row to its module (``Pass.of``): a ``Pass`` holds the name,
one ``run(level, analysis) -> LevelResult`` function with the same signature for every
pass, whether settings turn it on, and what the walker does for it
(``remembers_search``, ``state``, ``prices_launches``; see ``_protocol.Pass``). Adding
a pass is its module and its row (the steps: ``_options``' docstring). ``run_passes``
runs any of them, in table order, at every nesting level of a closed jaxpr, and returns
a new one (or the same object when nothing changed) and the ``PassDecision``s made
(each with the pass's name and a ``DecisionKind``):

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
* ``associative_scans``: a scan whose carries each follow a linear recurrence
  (``c = a * c + b``: a moving average, a discounted return, a state-space layer) runs as
  ``lax.associative_scan`` (off unless ``associative_scans=True`` asks; a TPU measures it).
* ``hoist_scan_inputs``: the work of a scan's body that reads no carry (input
  projections, random draws) runs for all steps at once before the loop (off unless
  ``hoist_scan_inputs=True`` asks; a TPU measures it).
* ``unroll_scans``: an unroll factor per static scan.
* ``unroll_while_loops``: ``k`` runs of a ``while`` body per trip, each after the first
  guarded by the loop's condition (off unless ``unroll_while=k`` asks).

* ``share_common``: equal equations computed once (on by default on GPUs only).
* ``inline_twin_calls``: independent nested ``jit`` calls running one body (twin critics
  behind ``jax.jit``) are inlined, so the two batching passes see their work.

``apply_passes`` (a keyword per switch of the table; ``pass_defaults(target)`` gives
the target's) and the one-pass functions named above run ``run_passes`` with fixed
settings.

Deprecated, going in jaxpar 0.3.0 (reading one warns, naming its replacement; the
table is ``_deprecations.DEPRECATIONS``): the names from before the passes outgrew
loops, ``LoopPass`` (``Pass``), ``LoopDecision`` (``PassDecision``),
``apply_loop_passes`` (``apply_passes``), ``loop_defaults`` (``pass_defaults``), and
``share_common_subexpressions`` (``share_common``).

Example::

    closed = jax.make_jaxpr(f)(*args)
    new, decisions = run_passes(closed, target="gpu")        # the target's defaults
    new, decisions = run_passes(closed, ["fuse_scans"], target="gpu")
    g = jax.extend.core.jaxpr_as_fun(new)      # same values and gradients as f

Sharp edges:
  * Fusing and batching reorder nothing inside a body, but XLA may compile the
    merged loop differently; results agree to float rounding, usually exactly.
  * The decision indices refer to each level as the pass saw it (see ``PassDecision``).
  * ``PASSES`` imports each row's module by the row's name (``importlib``): a pass
    module's import is not written out here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

from .._analysis import Analysis
from .._compat import ClosedJaxpr
from .._deprecations import deprecated_attributes
from .._options import PASS_TABLE, Options, PassRow, Settings, check_target, pass_defaults
from .._spelling import check_known
from ._protocol import (
    BLOCK_SCOPE,
    JAXPAR_SCOPES,
    NEW_LOOP_KINDS,
    SUBGRAPH_KINDS,
    UNCHANGED_KINDS,
    WHILE_SCOPE,
    DecisionKind,
    Level,
    LevelResult,
    Pass,
    PassDecision,
    Rewrite,
)
from ._walk import StepCache, walk_levels

__all__ = [
    "BLOCK_SCOPE",
    "JAXPAR_SCOPES",
    "NEW_LOOP_KINDS",
    "PASSES",
    "SUBGRAPH_KINDS",
    "UNCHANGED_KINDS",
    "WHILE_SCOPE",
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
    "unroll_while_loops",
]


def _bind(row: PassRow) -> Pass:
    """The ``Pass`` of ``row``: its module's ``run`` and ``State`` (the module of the row's
    name; imported here, before the one-pass function of that name replaces the module as
    this package's attribute).

    Raises:
      ImportError: the row's module is missing, or has no ``run``: naming the row, the
        file and what it must define.
    """
    name = f"{__name__}.{row.name}"
    expected = (f"jaxpar/passes/{row.name}.py defining run(level: Level, analysis: Analysis) "
                "-> LevelResult (and State, a class made once per call, for state of its "
                "own); see jaxpar/passes/_protocol.py")
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise  # the module is there; something it imports is not
        raise ImportError(f"jaxpar's pass table (_options.PASS_TABLE) has the row "
                          f"{row.name!r}, and there is no module {name}: add {expected}, or "
                          "remove the row") from None
    run = getattr(module, "run", None)
    if not callable(run):
        raise ImportError(f"{module.__name__} has no run(level, analysis) for its row "
                          f"{row.name!r} of the pass table (_options.PASS_TABLE): the row "
                          f"needs {expected}")
    return Pass.of(row, run, getattr(module, "State", None))


# The passes, in the order they run at each level: the pass table's rows, bound.
PASSES: tuple[Pass, ...] = tuple(_bind(row) for row in PASS_TABLE)
_BY_NAME = {p.name: p for p in PASSES}


def run_passes(closed_jaxpr: ClosedJaxpr, names: Sequence[str] | None = None, *,
               analysis: Analysis | None = None, target: str = "gpu",
               steps: StepCache | None = None, **options: Any
               ) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Runs the passes at every nesting level of ``closed_jaxpr`` (never mutated).

    Args:
        closed_jaxpr: the program, as from ``jax.make_jaxpr``.
        names: the passes to run (``Pass.name``s), in table order whatever the order
            given; None runs every pass the settings turn on.
        analysis: the call's ``Analysis`` (settings, cost model, memos); default one made
            from ``target`` and ``options``.
        target: ``"gpu"``, ``"cpu"`` or ``"tpu"``, when no ``analysis`` is given.
        steps: what the passes did in the walks of the program with other settings, to
            take on first visits instead of running them (``_walk.StepCache``; the
            CUDA-graph mode search's ``_plan.modes.ModeSteps``); default none.
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
    new, decisions = walk_levels(closed_jaxpr, chosen, analysis, steps=steps)
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


def _run_row(name: str, jaxpr: ClosedJaxpr, target: str = "gpu", *also: str
             ) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Runs the pass ``name`` alone, after the passes it works on (its row's ``after``),
    with those and ``also`` on, on ``target``: the one-pass functions below."""
    row = _BY_NAME[name]
    settings = Settings(target=check_target(target, concrete=True),
                        passes=frozenset({name, *row.after, *also}))
    return run_passes(jaxpr, [*row.after, name], analysis=Analysis(settings))


def apply_passes(closed_jaxpr: ClosedJaxpr, *, target: str, **switches: Any
                 ) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Runs the passes these switches turn on, in table order, at every nesting level.

    Unlike ``run_passes``, every switch is explicit (an unset one is off, whatever the
    target) and no GPU profile or CUDA-graph mode is read from the machine, so the result
    depends on the arguments alone; ``pass_defaults(target)`` gives the target's switches.
    The switches are the pass table's (``_options.PASS_TABLE``): a pass's option, or its
    name for a pass only the target turns on.

    Args:
        closed_jaxpr: the program, as from ``jax.make_jaxpr``; never mutated.
        target: ``"gpu"``, ``"cpu"`` or ``"tpu"`` (its defaults, and the cost model
            ``unroll="cost"`` and the batching passes use).
        fuse_scans: fuse independent scans into one.
        batch_scans: batch independent scans with identical bodies into one vmapped scan.
        unroll: ``"auto"`` (the target's default: ``"cost"`` on GPUs, None elsewhere),
            ``"cost"`` (a factor per scan from the cost model), a positive int, or None
            (leave unroll factors alone), as in ``parallel_branches``.
        batch_branches: batch identical independent straight-line subgraphs into one
            vmapped subgraph where the cost model says it pays.
        batch_matmuls: run same-shaped matmuls and convolutions at one launch depth in
            different independent members as one batched op where the cost model says it pays.
        share_common: merge equations that compute the same thing (XLA's CSE cannot
            see into the stream regions the planner may make).
        unroll_while: an int k >= 2 (k runs of each outermost ``while`` body per trip)
            or None (leave while loops alone), as in ``parallel_branches``.

    Returns:
        ``(new_closed_jaxpr, decisions)`` as ``run_passes``.

    Raises:
        TypeError: an unknown switch (naming the closest).
        ValueError: ``unroll`` or ``target`` is not supported.

    Example::

        new, decisions = apply_passes(jax.make_jaxpr(f)(x), fuse_scans=True,
                                      batch_scans=True, unroll="auto", target="gpu")
        new, decisions = apply_passes(jax.make_jaxpr(f)(x), **pass_defaults("gpu"),
                                      target="gpu")
    """
    settings = Settings.of_switches(check_target(target, concrete=True), **switches)
    return run_passes(closed_jaxpr, analysis=Analysis(settings))


def make_loops_static(jaxpr: ClosedJaxpr) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Replaces static ``fori_loop`` ``while``s by scans at every level of ``jaxpr``
    (never mutated); other ``while``s are reported as host-sync loops.

    Returns:
        ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.
    """
    return _run_row("make_loops_static", jaxpr)


def batch_scans(jaxpr: ClosedJaxpr) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Batches independent identical scans at every level of ``jaxpr`` (never mutated).

    Returns:
        ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.
    """
    return _run_row("batch_scans", jaxpr)


def fuse_scans(jaxpr: ClosedJaxpr, *, leave_identical: bool = False
               ) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Fuses independent scans at every level of ``jaxpr`` (never mutated).

    Args:
        jaxpr: a closed jaxpr (as from ``jax.make_jaxpr``).
        leave_identical: do not fuse scans that ``batch_scans`` could batch instead.

    Returns:
        ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.
    """
    return _run_row("fuse_scans", jaxpr, "gpu", *(("batch_scans",) if leave_identical else ()))


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
    return _run_row("batch_branches", jaxpr, target)


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
    return _run_row("batch_matmuls", jaxpr, target)


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
    return _run_row("bound_fusions", jaxpr, target)


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
    return run_pass("unroll_scans", jaxpr, settings=Settings.of_switches(
        check_target(target, concrete=True), "unroll_scans", unroll=unroll))


def unroll_while_loops(jaxpr: ClosedJaxpr, *, unroll_while: int | None, target: str = "gpu"
                       ) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Runs the body of every outermost ``while`` of ``jaxpr`` (never mutated)
    ``unroll_while`` times per trip, each run after the first guarded by the loop's condition.

    Run alone, a counting ``fori_loop`` with constant bounds is unrolled too; in
    ``parallel_branches`` ``make_loops_static`` has made it a scan first.

    Args:
        jaxpr: a closed jaxpr (as from ``jax.make_jaxpr``).
        unroll_while: an int >= 2, or None (leave every loop alone).
        target: ``"gpu"``, ``"cpu"`` or ``"tpu"``.

    Returns:
        ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.

    Raises:
        ValueError: ``unroll_while`` or ``target`` is not one of the above.
    """
    return run_pass("unroll_while_loops", jaxpr, settings=Settings.of_switches(
        check_target(target, concrete=True), "unroll_while_loops", unroll_while=unroll_while))


def share_common(jaxpr: ClosedJaxpr) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Merges equal equations at every level of ``jaxpr`` (never mutated).

    Returns:
        ``(new_jaxpr, ())``; ``new_jaxpr is jaxpr`` when nothing was shared.
    """
    return _run_row("share_common", jaxpr)


def inline_twin_calls(jaxpr: ClosedJaxpr) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """Inlines independent nested ``jit`` calls of one body at every level of ``jaxpr``
    (never mutated), so the batching passes can batch what they run.

    Returns:
        ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when nothing changed.
    """
    return _run_row("inline_twin_calls", jaxpr)


def _apply_loop_passes(closed_jaxpr: ClosedJaxpr, *, fuse: bool, batch: bool, **switches: Any
                       ) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
    """``apply_passes`` with its old keywords ``fuse`` and ``batch``."""
    return apply_passes(closed_jaxpr, fuse_scans=fuse, batch_scans=batch, **switches)


def _loop_defaults(target: str) -> dict[str, Any]:
    """``pass_defaults`` with its old keys ``fuse`` and ``batch``."""
    switches = pass_defaults(target)
    return {"fuse": switches.pop("fuse_scans"), "batch": switches.pop("batch_scans"),
            **switches}


def _one_pass_function(row: PassRow) -> Callable[..., tuple[ClosedJaxpr,
                                                             tuple[PassDecision, ...]]]:
    """The one-pass function of a row without one written above: ``row``'s pass alone
    (after the passes its row works after) on ``target``; a pass whose option carries a
    value (``OptionKind.carries_value``) takes it by the option's name."""

    def one_pass(jaxpr: ClosedJaxpr, target: str = "gpu", **value: Any
                 ) -> tuple[ClosedJaxpr, tuple[PassDecision, ...]]:
        if row.option is not None and row.kind.carries_value:
            check_known(value, (row.option,), row.name)
            settings = Settings.of_switches(check_target(target, concrete=True), row.name,
                                            **{row.option: value.get(row.option, "auto")})
            return run_passes(jaxpr, [*row.after, row.name], analysis=Analysis(settings))
        check_known(value, (), row.name)
        return _run_row(row.name, jaxpr, target)

    after = f", after {', '.join(row.after)} (what it works on)" if row.after else ""
    given = (f"; ``{row.option}=``: {row.kind.values}" if row.option is not None
             and row.kind.carries_value else "")
    one_pass.__name__ = one_pass.__qualname__ = row.name
    one_pass.__module__ = __name__
    one_pass.__doc__ = (f"Runs the pass ``{row.name}`` ({row.summary}) alone{after}, at every "
                        f"level of ``jaxpr`` (never mutated), on ``target``{given}.\n\n"
                        "Returns ``(new_jaxpr, decisions)``; ``new_jaxpr is jaxpr`` when "
                        "nothing changed. Made from its row of the pass table.")
    return one_pass


# A row's one-pass function: the one written above, or one made from its row (where the
# package attribute of the row's name is still its module).
for _row in PASS_TABLE:
    if not callable(globals().get(_row.name)):
        globals()[_row.name] = _one_pass_function(_row)
__all__ += sorted({row.name for row in PASS_TABLE} - set(__all__))


# The names from before the passes outgrew loops (rows of ``_deprecations.DEPRECATIONS``,
# going in 0.3.0), each what it gives; none is in ``__all__``.
__getattr__ = deprecated_attributes(__name__, {
    "LoopPass": Pass,
    "LoopDecision": PassDecision,
    "apply_loop_passes": _apply_loop_passes,
    "loop_defaults": _loop_defaults,
    "share_common_subexpressions": share_common,
})
