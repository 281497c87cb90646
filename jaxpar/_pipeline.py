"""The analysis of one signature, stage by stage: the one place the stages run in order.

``analyse(fun, signature, settings)`` returns a ``Prepared``: the rewritten program, its
plan and the emitter that emits it, with what a report adds. The stages, in order:

1. **trace** (``_trace.trace``): the user's function at the signature, to a closed jaxpr.
   A program with symbolic sizes (``jax.export``) stops here: nothing can be priced, so
   it runs as ``jax.jit`` runs it (``_plan.symbolic_plan``). The stages after this one run
   with Python's cyclic collector paused (``_collector_paused``) and one ``Analysis``
   (settings, cost model, memos), which dies before the pause ends.
2. **memory budget** (``_memory_budget``): the memory model's temporary bytes of the
   plain program, and how many more jaxpar's program may need (``Settings.memory``).
3. **passes and plan** (``_within_budget``): the rewrite passes (``passes.run_passes``)
   and the stream plan (``_plan.plan_jaxpr``) of the traced program; while the plan
   needs more memory than the budget allows, again with the fewest kinds of rewrite
   left out (``_plan.budget.LADDER``); and where a pass joined loops (fused or batched
   scans), planned again without the joins, kept where the GPU model estimates that
   faster (jaxpar never runs a plan its model rates slower than another it made).
4. **CUDA-graph mode search** (``_mode_search``, target ``"gpu"``): with
   ``command_buffers="auto"`` the program is planned in each candidate mode and the mode
   the GPU model estimates fastest at every end of its ranges, within the memory
   budget, is kept (``_plan.modes``); otherwise the mode kept, with its estimate.
5. **report figures** (``_plain_figures``): the cost model's time of the plain program
   and the GPU model's time of it in the user's mode, which only a report shows. Priced
   here with ``report_now`` (``inspect``: the memos are warm), else by the first report
   that asks for them (``Prepared.plain``); a call lowers without them.
6. **emit** (``_emit.Emitter``): the emitter of the plan. The emission itself runs in
   each trace of the call, with the call's values (``Prepared.run``).

``Prepared.report`` turns the result into the public ``Plan``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax

from . import _compat, _ops, targets
from ._analysis import Analysis
from ._emit import Emitter
from ._model.cost import launch_pricing
from ._model.gpu import CommandBufferMode
from ._model.memory import MemoryModel, format_bytes
from ._options import PASS_TABLE, Options, Settings
from ._plan import LevelPlan, plan_jaxpr, symbolic_plan
from ._plan.budget import (
    LADDER,
    LeftOut,
    MemoryFigures,
    leave_out,
    left_out_for_memory,
    left_out_for_time,
    mode_memory_reason,
    over_budget,
)
from ._plan.gpu_time import estimate_plain_seconds, estimate_seconds
from ._plan.modes import CANDIDATES as MODE_CANDIDATES
from ._plan.modes import (
    MIN_GAIN,
    ModeChoice,
    ModeEnds,
    ModeSteps,
    choose_mode,
    kept_mode,
    optimistic,
    pessimistic,
    regions_hold_loops,
)
from ._report.build import build_report
from ._report.plan import Plan
from ._trace import Signature, Traced, trace, tracing_for_a_plan
from ._tune import Tuning
from .passes import NEW_LOOP_KINDS, PASSES, UNCHANGED_KINDS, DecisionKind, PassDecision, run_passes


@dataclasses.dataclass(frozen=True)
class PlainFigures:
    """What a report compares the plan with (stage 5, ``_plain_figures``)."""

    # The cost model's time of the program as traced, top-level equations one after
    # another, in microseconds.
    plain_us: float | None
    # The CUDA-graph mode chosen, with ``plain_seconds`` (the GPU model's time of the
    # program as traced in the user's mode) filled in.
    mode: ModeChoice | None


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Everything derived from one signature: the rewritten program, its plan and emitter,
    and what the report adds (``analyse``)."""

    traced: Traced  # the trace, its jaxpr the rewritten program (the passes' output)
    plan: LevelPlan
    decisions: tuple[PassDecision, ...]  # the passes' decisions, in their order
    settings: Settings
    emitter: Emitter
    # The CUDA-graph mode the function is compiled in (target "gpu"), and why.
    mode: ModeChoice | None = None
    # The cost model's time of the program as traced (``_plain_figures``).
    plain_us: float | None = None
    # The program as traced, where the figures of the plain program only a report shows
    # (``plain_us``, ``mode.plain_seconds``) are left for its first report (``plain``).
    unpriced: _compat.ClosedJaxpr | None = None
    # The memory model's temporary bytes of jaxpar's program against the plain one.
    memory: MemoryFigures | None = None

    @property
    def target(self) -> str:
        return self.settings.target

    @functools.cached_property
    def plain(self) -> PlainFigures:
        """``plain_us`` and ``mode`` with ``plain_seconds``: as the analysis gave them, or
        (``unpriced``) priced now, by a fresh ``Analysis`` of the same settings: the cost
        model and the GPU model are pure functions of the settings and the equations, so
        the figures equal those the analysis would have given."""
        if self.unpriced is None:
            return PlainFigures(self.plain_us, self.mode)
        with _collector_paused():
            return _plain_figures(self.unpriced, Analysis(self.settings), self.mode)

    @property
    def xla_options(self) -> dict[str, str]:
        return self.mode.xla_options if self.mode is not None else {}

    def report(self, function: str, options: Options, tuning: Tuning | None = None) -> Plan:
        """The public ``Plan`` of this analysis (``options``: as the user gave them)."""
        settings = self.settings
        plain = self.plain
        with _collector_paused():
            return build_report(self.plan, function, settings.target,
                                emitted=targets.get(settings.target).emits_streams,
                                options=options.to_dict(),
                                decisions=self.decisions, plain_us=plain.plain_us,
                                priced_in=(settings.modes.priced.value
                                           if settings.modes.priced else None),
                                tuning=tuning, mode=plain.mode, memory=self.memory)

    def run(self, leaves: Any, emit_streams: bool) -> list[Any]:
        """Stage 6's emission: the rewritten program applied to ``leaves`` in the caller's
        trace (with stream regions where ``emit_streams`` and the plan has any)."""
        jaxpr, consts = _compat.open_jaxpr(self.traced.jaxpr)
        emitter = self.emitter
        with _collector_paused():
            if not (emit_streams and emitter.plan.changes_anything) or tracing_for_a_plan():
                return emitter.run(consts, *leaves, emit_streams=emit_streams)
            # One equation that lowers inline and remembers the original program, so
            # checkify reports what jax.jit reports (``_ops.program_p``). Inside another
            # decorated function's trace the outer program's equation does that. Closed
            # over, the program's constants are concrete while it is emitted, so a region
            # keeps the ones it reads in its body, as jax.jit keeps them in its program
            # (``_ops.bind_stream_region`` says why that matters for output shardings).
            return _ops.bind_program(
                lambda *a: emitter.run(consts, *a),
                lambda *a: jax.core.eval_jaxpr(jaxpr, consts, *a),
                list(leaves))


def analyse(fun: Callable[..., Any], signature: Signature, settings: Settings,
            report_now: bool = False) -> Prepared:
    """The analysis of one signature: the stages of this module's docstring, in order. The
    figures of the plain program only a report shows are priced in the analysis when
    ``report_now`` (``inspect``: its memos are warm then), else by the first report, if
    one is ever asked for (a call lowers without them)."""
    traced = trace(fun, signature)  # 1. trace
    symbolic = _compat.symbolic_dimensions(traced.jaxpr)
    if symbolic:  # nothing can be priced: the program as jax.jit runs it
        decided = Decided(traced.jaxpr, symbolic_plan(traced.jaxpr, symbolic), (), None,
                          None, None)
        unpriced = None
    else:
        unpriced = None if report_now else traced.jaxpr
        with _collector_paused():
            decided = _decide(traced, settings, baseline=report_now)  # 2. to 5.
        if decided.jaxpr is not traced.jaxpr:
            traced = dataclasses.replace(traced, jaxpr=decided.jaxpr)
    emits = targets.get(settings.target).emits_streams
    emitter = Emitter(decided.plan, emit_streams=emits)  # 6. emit
    return Prepared(traced, decided.plan, decided.decisions, settings, emitter, decided.mode,
                    decided.plain_us, unpriced, decided.memory)


@dataclasses.dataclass(frozen=True)
class Decided:
    """What stages 2 to 5 decided for one signature (``_decide``)."""

    jaxpr: _compat.ClosedJaxpr  # the rewritten program
    plan: LevelPlan
    decisions: tuple[PassDecision, ...]
    plain_us: float | None
    mode: ModeChoice | None
    memory: MemoryFigures | None


@dataclasses.dataclass(frozen=True)
class ProgramBudget:
    """Stage 2: the memory budget applied to one program (``_options.MemoryBudget`` is
    the rule): the memory model, the plain program's temporary bytes, and the most
    jaxpar's program may need (None: any)."""

    model: MemoryModel
    plain_bytes: float
    allowed: float | None
    footprint: float = 0.0  # the plain program's arguments, outputs and temporaries


@dataclasses.dataclass(frozen=True)
class Planned:
    """One program planned: the passes' program, its plan, the passes' decisions, and the
    memory model's temporary bytes of it."""

    jaxpr: _compat.ClosedJaxpr
    plan: LevelPlan
    decisions: tuple[PassDecision, ...]
    temp_bytes: float


@dataclasses.dataclass(frozen=True)
class WithinBudget:
    """Stage 3: the program planned within the memory budget, the analysis it was planned
    with (its settings less the kinds of rewrite left out), and what was left out."""

    analysis: Analysis
    planned: Planned
    left_out: tuple[LeftOut, ...] = ()
    # The kinds of rewrite left out, as ``LADDER``'s rows: (name, Settings switches).
    dropped: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Why the program stays over the budget: rewrites the user named (``kept_over_budget``).
    kept: str = ""


@dataclasses.dataclass(frozen=True)
class ModeSearch:
    """Stage 4: the CUDA-graph mode (None: the target chooses none) and the program
    planned in it."""

    choice: ModeChoice | None
    planned: Planned


def _decide(traced: Traced, settings: Settings, baseline: bool) -> Decided:
    """Stages 2 to 5 of ``traced``. Its ``Analysis`` objects (and their memos, which keep
    hundreds of thousands of small objects alive) die when it returns, inside
    ``_collector_paused``: the collection that follows then scans only what the call
    keeps."""
    analysis = Analysis(settings)
    budget = _memory_budget(traced, analysis)  # 2. memory budget
    analysis.memory_allowance = budget.allowed  # for the passes that stack copies
    # What the passes did, shared by their walks in every mode (and rung) of the call.
    steps = ModeSteps()
    within = _within_budget(traced, analysis, budget, steps)  # 3. passes and plan
    search = _mode_search(traced, within, budget, steps)  # 4. CUDA-graph mode
    figures = MemoryFigures(budget.plain_bytes, search.planned.temp_bytes, budget.allowed,
                            within.left_out, within.kept)
    plain = PlainFigures(None, search.choice)
    if baseline:  # 5. report figures
        plain = _plain_figures(traced.jaxpr, within.analysis, search.choice)
    planned = search.planned
    return Decided(planned.jaxpr, planned.plan, planned.decisions, plain.plain_us, plain.mode,
                   figures)


def _memory_budget(traced: Traced, analysis: Analysis) -> ProgramBudget:
    """Stage 2: the memory model of ``analysis`` and the budget of ``traced``."""
    settings = analysis.settings
    memory = MemoryModel(analysis.costs, analysis.shared.memory)
    # The plain program in the mode it is compared in: the user's, or the one the
    # command_buffers option names (not jaxpar's choice, so not counted against it).
    base_mode = settings.modes.compile or settings.modes.user
    plain_bytes = memory.temp_bytes(traced.jaxpr, base_mode)
    # The budget's share is of the plain program's peak: its arguments and outputs, which
    # both programs hold, and of its temporaries what it surely needs (the model may
    # overestimate a program: a bidirectional LSTM, 288 MiB, 194.5 once compiled). Two
    # scans over 800 MB of inputs may so use 80 MB more, where the temporaries alone (156
    # KiB) allowed 1 MiB and left a user's unroll=8 out for 2.5 MiB.
    footprint = _io_bytes(traced.jaxpr) + min(plain_bytes, memory.least_bytes(traced.jaxpr))
    allowed = settings.memory.allowed(footprint) if settings.memory is not None else None
    return ProgramBudget(memory, plain_bytes, allowed, footprint)


def _io_bytes(jaxpr: _compat.ClosedJaxpr) -> float:
    """Bytes of a program's arguments and outputs."""
    inner, _ = _compat.open_jaxpr(jaxpr)
    return float(sum(_compat.aval_nbytes(v.aval) for v in (*inner.invars, *inner.outvars)
                     if not _compat.is_literal(v)))


def _within_budget(traced: Traced, analysis: Analysis, budget: ProgramBudget,
                   steps: ModeSteps) -> WithinBudget:
    """Stage 3: the passes and the plan of ``traced`` with ``analysis``'s settings; while
    the program the memory model sees needs more than ``budget.allowed`` bytes beyond the
    plain program's, the fewest kinds of rewrite left out that bring it within
    (``_plan.budget.LADDER``, the first kinds first); then, where a pass joined loops, the
    program without those joins where the GPU model estimates it faster
    (``_without_slower_joins``)."""
    settings = analysis.settings
    mode = settings.modes.priced
    passed: dict[Settings, tuple[_compat.ClosedJaxpr, tuple[PassDecision, ...]]] = {}
    plain_bytes, allowed = budget.plain_bytes, budget.allowed

    def attempt(dropped: tuple[tuple[str, tuple[str, ...]], ...]) -> WithinBudget:
        planned = leave_out(settings, dropped)
        level = analysis if planned == settings else analysis.with_settings(planned)
        # Sections are the planner's: the passes' results serve every rung alike.
        key = dataclasses.replace(planned, streams_per_section=settings.streams_per_section)
        if key not in passed:
            passed[key] = run_passes(traced.jaxpr, analysis=level, steps=steps)
        jaxpr, decisions = passed[key]
        plan = plan_jaxpr(jaxpr, level)
        bytes_needed = budget.model.temp_bytes(plan.jaxpr, mode,
                                               _section_eqns(plan, settings.target))
        return WithinBudget(level, Planned(jaxpr, plan, decisions, bytes_needed),
                            dropped=dropped)

    first = attempt(())
    chosen = first
    if over_budget(plain_bytes, first.planned.temp_bytes, allowed, "") is not None:
        chosen = _left_out_for_memory(first, attempt, budget, settings.explicit)
    return _without_slower_joins(chosen, attempt, budget)


_Rung = tuple[str, tuple[str, ...]]


def _left_out_for_memory(first: WithinBudget, attempt: Callable[[tuple[_Rung, ...]],
                         WithinBudget], budget: ProgramBudget,
                         explicit: frozenset[str]) -> WithinBudget:
    """The program with the fewest kinds of rewrite left out (``LADDER``, the first kinds
    first) that brings it within ``budget``; every rewrite left out where none does. Only
    what jaxpar chose ("auto") is fitted to the budget: a rewrite the user asked for by
    name (``explicit``) is kept, and the report says what it costs (``kept_over_budget``)."""
    plain_bytes, allowed = budget.plain_bytes, budget.allowed
    assert allowed is not None
    ladder = [(what, kept) for what, switches in LADDER
              if (kept := tuple(n for n in switches if n not in explicit))]
    found = first
    for count in range(1, len(ladder) + 1):
        for dropped in itertools.combinations(ladder, count):
            found = attempt(dropped)
            if over_budget(plain_bytes, found.planned.temp_bytes, allowed, "") is None:
                return _record(found, left_out_for_memory(
                    tuple(what for what, _ in dropped), plain_bytes,
                    first.planned.temp_bytes, allowed, _refused(first, found)))
    if explicit:
        found = dataclasses.replace(found, kept=kept_over_budget(
            explicit, found.planned.temp_bytes - plain_bytes, budget.footprint, allowed,
            bool(ladder)))
        if not ladder:
            return found
    return _record(found, left_out_for_memory(
        tuple(what for what, _ in ladder), plain_bytes, first.planned.temp_bytes, allowed,
        _refused(first, found)))


def _without_slower_joins(chosen: WithinBudget, attempt: Callable[[tuple[_Rung, ...]],
                          WithinBudget], budget: ProgramBudget) -> WithinBudget:
    """``chosen``, or the same program with its loops left unjoined where the GPU model
    estimates that no slower and it fits the budget: the passes decide loop by loop (fusing
    two scans, then unrolling the fused loop by a smaller factor than each alone), and
    jaxpar never runs a plan its own model rates slower than another it planned. Only
    where a pass joined loops, on the GPU target; one more plan of the program there
    (the two-scan seed's ``inspect``: 9.0 ms against 5.8 ms without it, on this project's
    CPU machine, best of 5)."""
    settings = chosen.analysis.settings
    mode = settings.modes.priced
    # A join the user asked for by name (fuse_scans=True) is never left out.
    joins = tuple(dict.fromkeys(d.pass_name for d in chosen.planned.decisions
                                if d.kind in NEW_LOOP_KINDS
                                and d.pass_name not in settings.explicit))
    if mode is None or settings.gpu is None or not joins:
        return chosen
    what = ("loop fusion" if joins == ("fuse_scans",) else "loop batching"
            if joins == ("batch_scans",) else "loop fusion and batching")
    estimates = chosen.analysis.shared.mode_estimates
    costs = chosen.analysis.costs
    chosen = _without_slower_matmul_batching(chosen, attempt, budget, estimates)
    other = _unjoined(chosen, attempt, budget, (what, joins))
    if other is None:
        return chosen
    with_joins = estimate_seconds(chosen.planned.plan, costs, mode, estimates)
    without = estimate_seconds(other.planned.plan, costs, mode, estimates)
    # A join must pay, in time or, at the same time, in memory (two scans unrolled apart
    # may keep twice the copies a fused one does); where it pays in neither the loops stay
    # apart, so planning jaxpar's own program again (its loops already apart) changes
    # nothing.
    tie = math.isclose(without, with_joins, rel_tol=1e-9)
    if (not tie and without > with_joins) or (
            tie and chosen.planned.temp_bytes < other.planned.temp_bytes):
        return chosen
    return dataclasses.replace(other, left_out=(*chosen.left_out, left_out_for_time(
        (what,), with_joins, without, _refused(chosen, other))))


_MATMUL_BATCHING: _Rung = ("matmul batching", ("batch_matmuls",))


def _without_slower_matmul_batching(chosen: WithinBudget,
                                    attempt: Callable[[tuple[_Rung, ...]], WithinBudget],
                                    budget: ProgramBudget, estimates: Any) -> WithinBudget:
    """``chosen``, or its joined loops without matmul batching where the GPU model rates
    that faster and it fits the budget: batching the matmuls of a fused body decides
    inside the body, before the body's unroll factor is priced, so the joined program may
    be faster without it (two transposed matmul chains fused and unrolled by 10: 8,190 us
    batched, 6,890 us not), and the join must be weighed against its best form."""
    settings = chosen.analysis.settings
    if "batch_matmuls" in settings.explicit or not any(
            d.pass_name == "batch_matmuls" and d.kind not in UNCHANGED_KINDS
            for d in chosen.planned.decisions):
        return chosen
    other = attempt((*chosen.dropped, _MATMUL_BATCHING))
    if over_budget(budget.plain_bytes, other.planned.temp_bytes, budget.allowed,
                   "") is not None:
        return chosen
    mode, costs = settings.modes.priced, chosen.analysis.costs
    if mode is None:  # no GPU model to rate it with (its caller prices on the GPU only)
        return chosen
    batched = estimate_seconds(chosen.planned.plan, costs, mode, estimates)
    unbatched = estimate_seconds(other.planned.plan, costs, mode, estimates)
    if unbatched >= batched:
        return chosen
    return dataclasses.replace(other, left_out=(*chosen.left_out, left_out_for_time(
        (_MATMUL_BATCHING[0],), batched, unbatched, _refused(chosen, other))))


def _unjoined(chosen: WithinBudget, attempt: Callable[[tuple[_Rung, ...]], WithinBudget],
              budget: ProgramBudget, joins: _Rung) -> WithinBudget | None:
    """``chosen``'s program without ``joins`` within ``budget``, or None where it does not
    fit: with what ``chosen`` left out for memory given back where it then fits (a fused
    loop's copies may need the memory its unrolling was left out for, two loops unrolled
    apart not: a bidirectional GRU of 64 steps, rolled without it), else still left
    out."""
    tried = [()] if chosen.dropped else []
    for dropped in (*tried, chosen.dropped):
        other = attempt((*dropped, joins))
        if over_budget(budget.plain_bytes, other.planned.temp_bytes, budget.allowed,
                       "") is None:
            return other
    return None


def _record(found: WithinBudget, left_out: LeftOut) -> WithinBudget:
    return dataclasses.replace(found, left_out=(*found.left_out, left_out))


def _refused(before: WithinBudget, after: WithinBudget) -> tuple[PassDecision, ...]:
    """The rewrites ``before``'s passes made whose passes ``after``'s settings turn off:
    what leaving kinds of rewrite out refused (the passes that only serve others, such
    as ``bound_fusions``, not counted)."""
    settings = after.analysis.settings
    off = {p.name for p in PASSES if not p.enabled(settings) and not p.after}
    return tuple(d for d in before.planned.decisions
                 if d.pass_name in off and d.kind not in UNCHANGED_KINDS)


def kept_over_budget(explicit: frozenset[str], extra: float, footprint: float,
                     allowed: float | None, others_left_out: bool) -> str:
    """What the rewrites the user asked for cost beyond the memory budget, kept."""
    share = f", {100 * extra / footprint:.1f}% of the plain program's {format_bytes(footprint)}" \
        if footprint > 0 else ""
    budget = ("" if allowed is None
              else f"; the memory budget allows {format_bytes(allowed)} more")
    options = {row.name: row.option for row in PASS_TABLE}
    names = ", ".join(sorted(options.get(name) or name for name in explicit))
    return (f"kept as you asked ({names}): jaxpar's program needs est. "
            f"{format_bytes(extra)} more memory than the plain program{share}, over the "
            f"budget{budget}" + ("; jaxpar's own choices left out" if others_left_out else ""))


def _section_eqns(plan: LevelPlan, target: str = "gpu") -> list[list[int]]:
    """The top-level equations of each stream section ``plan`` emits: none off a GPU, where
    a section's parts run one after another (an unchanged program needs no more memory)."""
    if not targets.get(target).emits_streams:
        return []
    return [[i for region in section.regions for i in region.eqns]
            for section in plan.sections if section.pays is not False]


def _mode_search(traced: Traced, within: WithinBudget, budget: ProgramBudget,
                 steps: ModeSteps) -> ModeSearch:
    """Stage 4: on target ``"gpu"``, the CUDA-graph mode chosen among the candidates
    (``_choose_mode``, with ``command_buffers="auto"``) or kept, and the program planned
    in it; elsewhere no mode, and the program of stage 3."""
    analysis = within.analysis
    settings = analysis.settings
    planned = within.planned
    graph_modes = targets.get(settings.target).compiles_with_xla_options
    if graph_modes and settings.modes.choose \
            and settings.modes.priced is not None:
        return _choose_mode(traced, analysis, planned, budget, steps)
    choice = None
    if graph_modes:
        # What the GPU model's estimates of every mode and of the plain program share.
        estimates = analysis.shared.mode_estimates
        explicit = settings.modes.compile
        kept = explicit or settings.modes.priced or settings.modes.user
        if kept is not None:
            choice = kept_mode(kept, settings.modes.user, explicit is not None,
                               estimate_seconds(planned.plan, analysis.costs, kept, estimates),
                               forced=settings.force_streams,
                               measured=_measured(settings))
    return ModeSearch(choice, planned)


def _measured(settings: Settings) -> bool:
    return settings.gpu is not None and settings.gpu.calibrated


@dataclasses.dataclass(frozen=True)
class _Judged:
    """One candidate mode's program, the GPU model's time of it, and its times at the ends
    of the model's ranges against the user's mode (None: no gain at the nominal figures,
    so the ends were not asked)."""

    planned: Planned
    seconds: float
    ends: ModeEnds | None = None


def _choose_mode(traced: Traced, analysis: Analysis, planned: Planned, budget: ProgramBudget,
                 steps: ModeSteps) -> ModeSearch:
    """The program planned in each candidate mode (``_plan.modes.CANDIDATES``), and the
    mode ``choose_mode`` keeps, with the program planned in it.

    A candidate is planned on the passes' program of the user's mode first; only one
    that wins there at every end of the GPU model's ranges has the passes run again in
    its own launch pricing (``_model.cost.launch_pricing``: the batching passes price launches
    otherwise in a branching graph), and is judged again on that program; the walks
    share the passes' steps (``steps``)."""
    settings = analysis.settings
    user = settings.modes.priced
    gpu = settings.gpu
    assert user is not None and gpu is not None
    estimates = analysis.shared.mode_estimates
    costs = analysis.costs
    plan = planned.plan
    batched = any(d.kind in (DecisionKind.BATCHED_MATMULS, DecisionKind.BATCHED_SUBGRAPHS)
                  for d in planned.decisions)
    plans = {user: _Judged(planned, estimate_seconds(plan, costs, user, estimates))}

    def judged(mode: CommandBufferMode, other: Analysis, mode_jaxpr: Any, mode_decisions: Any
               ) -> _Judged | None:
        mode_plan = plan_jaxpr(mode_jaxpr, other)
        if mode is CommandBufferMode.OFF and not regions_hold_loops(mode_plan):
            return None  # graphs off only for regions' loops (_plan.modes)
        seconds = estimate_seconds(mode_plan, costs, mode, estimates)
        if seconds > plans[user].seconds * (1 - MIN_GAIN):
            # No gain at the nominal figures: never chosen, and its memory never a reason
            # (``choose_mode``), so the memory model is not asked.
            return _Judged(Planned(mode_jaxpr, mode_plan, mode_decisions, math.nan), seconds)
        entry = Planned(mode_jaxpr, mode_plan, mode_decisions,
                        budget.model.temp_bytes(mode_plan.jaxpr, mode, _section_eqns(mode_plan)))
        pair = [(estimate_seconds(mode_plan, costs, mode, estimates, at),
                 estimate_seconds(plan, costs, user, estimates, at))
                for at in (pessimistic(gpu, mode), optimistic(gpu, mode))]
        return _Judged(entry, seconds, ModeEnds(mode, pair[0], pair[1]))

    ends: dict[CommandBufferMode, ModeEnds] = {}
    for mode in MODE_CANDIDATES:
        if mode in plans:
            continue
        other = analysis.with_settings(settings.priced_in(mode))
        found = judged(mode, other, planned.jaxpr, planned.decisions)
        if found is None:
            continue
        if found.ends is not None and found.ends.pessimistic_ratio <= 1 - MIN_GAIN \
                and batched and launch_pricing(mode) != launch_pricing(user):
            found = judged(mode, other, *run_passes(traced.jaxpr, analysis=other, steps=steps))
            assert found is not None
        plans[mode] = found
        if found.ends is not None:
            ends[mode] = found.ends
    refused = {mode: why for mode, entry in plans.items() if entry.ends is not None
               and (why := mode_memory_reason(mode, budget.plain_bytes,
                                              entry.planned.temp_bytes, budget.allowed))}
    choice = choose_mode({mode: entry.seconds for mode, entry in plans.items()}, user,
                         tuple(ends.values()), refused, measured=_measured(settings))
    return ModeSearch(choice, plans[choice.mode].planned)


def _plain_figures(jaxpr: _compat.ClosedJaxpr, analysis: Analysis, choice: ModeChoice | None
                   ) -> PlainFigures:
    """Stage 5: what a report compares the plan with, for ``jaxpr`` as traced: the cost
    model's time of its top level, one equation after another (``jax.jit``'s program as
    the planner sees it), in microseconds; and ``choice`` with the GPU model's time of it
    in the user's mode (``ModeChoice.plain_seconds``)."""
    inner, _ = _compat.open_jaxpr(jaxpr)
    costs = analysis.costs
    plain_us = sum(costs.seconds(costs.eqn_cost(eqn)) for eqn in inner.eqns) * 1e6
    if choice is not None:
        choice = dataclasses.replace(choice, plain_seconds=estimate_plain_seconds(
            jaxpr, costs, choice.user_mode, analysis.shared.mode_estimates))
    return PlainFigures(plain_us, choice)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector (if it was on) while jaxpar analyses,
    reports or emits (not while the user's function itself is traced).

    The analysis allocates many small, short-lived objects among the large object
    graphs of JAX's jaxprs; collections triggered by those allocations re-scan the jaxprs
    and took a third of the analysis time of a 10k-equation program. Nothing the analysis
    makes needs the collector (reference counting frees it), and it is back on, with its
    usual thresholds, the moment the analysis ends or raises.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
