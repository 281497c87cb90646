"""Measuring by default (``parallel_branches(measure=...)``): the device decides which
program runs, at the cost of ``jax.jit``'s first call.

On an accelerator (``measure="auto"``; ``measure=True`` anywhere) a rewrite the model
proposes runs only once it was measured faster than ``jax.jit``'s program of the same
function on this device. Per signature of a top-level call:

1. The first call runs ``jax.jit``'s program: the function unchanged, compiled as
   ``jax.jit`` compiles it, in the C++ dispatch, and nothing else. At the next call the
   signature is queued on jaxpar's measuring thread (one per process): it traces the
   function, reads a stored decision (``_tune``: keyed by the program's fingerprint, the
   device kind, the versions), and otherwise analyses, lowers and compiles the candidates
   (``_tune.CANDIDATES``) as the function's call compiles them (its ``jax.jit`` options:
   donation, ``in_shardings``/``out_shardings``), in ``decisions.build_order`` (jax.jit's
   program, the plan, lax.scan's unroll by 8 and by 16, the loops rolled, the others)
   until a deadline (``BUILD_DEADLINE_FACTOR`` times the first call, at least
   ``BUILD_DEADLINE_MIN_S``): what was built by then is timed.
2. Meanwhile calls keep running ``jax.jit``'s program, from the C++ cache.
3. Once the candidates are compiled, the next call of that signature (a call boundary, on
   the caller's thread) times them against ``jax.jit``'s program (``MEASURE_BUDGET``: a
   warm-up and one first run each, then between 5 and 20 rounds aiming at ``seconds`` of
   timed runs per distinct candidate, a round k back-to-back calls of each as a loop of
   calls runs them, ``_tune.round_calls``; a clear loser stops early), decides (a rewrite
   must win by the margin), stores the decision, and returns jax.jit's result. Where a
   rewrite won, the measuring thread compiles it into a fresh top-level jit, which is
   installed at a call boundary and then serves the calls from the C++ cache. A built
   signature that is not called again within ``BOUNDARY_CALLS`` calls is left undecided
   (jax.jit's program), so other signatures do not keep paying the boundary.

A stored decision skips the timing: a second process (one process) compiles only the
winner in the background and measures nothing; under several processes each still builds
every candidate, since process 0's stored decision is read at the collective.

Under several processes a program whose arguments span every process decides together at
the signature's second call, which every process reaches at the same step: each waits for
its own candidates, they time one schedule (``_tune.decide``'s collective) and all switch
before that call runs, so every process runs the same program at every step.

Example::

    step = jaxpar.parallel_branches(train_step)     # measure="auto"
    state = step(state, batch)   # jax.jit's program; candidates compile in the background
    state = step(state, batch)   # ... measured at a later call, the winner runs from then on
    print(step.tuning(state, batch).lines())

Sharp edges:
  * Switching programs between calls changes rounding only (the candidates compute the
    same values within the target's tolerance); ``measure=False`` keeps one program from
    the first call, for bit-stable runs.
  * A rewrite runs only once measured faster. Only top-level calls with concrete arrays
    are measured; under ``jax.grad``, ``vmap`` or an outer ``jit`` a decision made at the
    same shapes is reused, else ``jax.jit``'s program runs; so do programs with side
    effects (timing would repeat them). Calls with Flax NNX objects and jaxpar's own
    static leaves (an Equinox module's) are measured: their path registers a signature
    when it traces it (``fast.measure_new_trace``), and the candidates are timed on the
    call's split state (``fast.measured_split``), their outputs dropped; the call itself
    writes the NNX state it changed back, as ``nnx.jit`` does. A call made under a JAX
    context manager (``jax.enable_x64``, ``default_matmul_precision``) that the measuring
    thread does not share is not measured: ``jax.jit``'s program runs (``tuning()`` says why).
    ``measure=False`` runs the model's plan in all these cases.
  * The measuring thread traces the user's function again (for its fingerprint and each
    candidate), beside the caller's thread: Python side effects at trace time happen
    more often than under ``jax.jit``.
  * Candidates are compiled with the function's donation and shardings, as the winner
    runs. A timing run donates copies of the donated arguments, made before its round
    (not timed; the call's own arguments stay for the call): a round holds one copy a
    call, as many calls as ``decisions.DONATED_COPIES_BYTES`` allows (one at least).
  * A candidate's compile cannot be interrupted: the build's deadline is checked
    between candidates, so a build may pass it by one compile; jax.jit's program and
    the plan are always built. ``Tuning.built`` says "built N of M candidates in X s;
    stopped at the deadline"; the rest are not timed (and the stored decision is the
    one made from what was built). Processes timing together build every candidate
    (one schedule).
  * Several processes: the deciding call waits for this process's build; an error while
    timing together reaches the call on every process (as under ``tune=True``), rather
    than leaving the others waiting in a collective.
  * The calls that measure wait for their results (the timing blocks); the time spent is
    in ``Tuning.measure_s``.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import jax

from .. import _compat, _processes, targets
from .._trace import abstract
from .._tune import (
    CHOSEN,
    PLAIN,
    REPEATED_BY_TIMING,
    STORED,
    Program,
    TuneBudget,
    Tuning,
    load,
    repeated_by_timing,
    store,
    untimed,
)
from .._tune import decide as decide_together
from .._tune import measure as measure_programs
from .decisions import (
    CalledRun,
    CallTuner,
    candidate_key_of,
    candidate_programs,
    own_program,
    run_candidate,
    signature_decision_key,
    signature_of,
    traced_decision_key,
)
from .fast import FastPath, current, measured_split, replace_path, runs_routed
from .state import CallKey, CallState, set_boundary

MEASURE_VARIABLE = "JAXPAR_MEASURE"
_NO = frozenset("0 false no off".split())  # what JAXPAR_MEASURE turns measuring off with

# What measuring by default spends per signature: at least 5 rounds, at most 20, aiming
# at about 0.25 s of timed runs per distinct candidate (a candidate clearly slower than
# the best stops early).
MEASURE_BUDGET = TuneBudget(seconds=0.25, min_repeats=5, max_repeats=20)

MEASURE_VALUES = ("auto", True, False)
BOUNDARY_CALLS = 16  # calls a boundary waits for a built signature to be called again

# Where a measuring tuner's decision stands (``Tuning.source``, beside ``_tune``'s).
PENDING = "measuring"  # candidates compiling in the background
NOTHING_TO_MEASURE = "nothing to measure"  # every candidate is jax.jit's program
NOT_MEASURED = "not measured"  # the build failed, or the call's context differs
NOT_YET = "not measured yet (no top-level call of these shapes)"


def measure_disabled_by_environment() -> bool:
    """``JAXPAR_MEASURE=0`` (or false/no/off): measuring off process-wide."""
    return os.environ.get(MEASURE_VARIABLE, "").strip().lower() in _NO


def check_measure(measure: Any) -> None:
    """Raises ``ValueError`` naming ``measure`` when it is not ``"auto"``, True or False."""
    if not (measure is True or measure is False or measure == "auto"):
        raise ValueError(f"measure={measure!r}: use 'auto' (on for accelerator targets on "
                         "their device), True (on everywhere, also on a CPU) or False (the "
                         "model alone, deterministic from the first call)")


class Pending:
    """One signature's build on the measuring thread: its arguments' abstract values,
    the trace context of the call that queued it, and what the build produced."""

    __slots__ = ("arguments", "built", "by_shape", "context", "done", "error", "fallback",
                 "fields", "first_call_s", "key", "name", "programs", "registered", "stored")

    def __init__(self, key: CallKey, by_shape: Any, arguments: tuple[Any, ...]):
        self.key = key
        self.by_shape = by_shape
        self.arguments = arguments
        self.context = _compat.trace_context()
        self.done = threading.Event()
        self.error: str | None = None
        self.fallback = PLAIN  # what runs where the build says why not to measure
        self.name = ""
        self.fields: dict[str, Any] = {}
        self.programs: list[Program] = []
        self.stored: Tuning | None = None
        # The first call's time (trace, compile, run: ``start``), which the build's
        # deadline is a multiple of; what the build says where the deadline stopped it.
        self.registered = _clock()
        self.first_call_s = 0.0
        self.built: str | None = None


class _Worker:
    """The process's measuring thread: one daemon thread running queued tasks in order
    (builds and compiles one at a time). At the interpreter's exit, queued tasks are
    dropped and a running build stops before its next compile (``stopping``), so a
    program's exit waits for at most one compile, never for a queue of them."""

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.stopping = False
        self.idle = threading.Condition()
        self.running = 0
        self.thread = threading.Thread(target=self._run, name="jaxpar-measure", daemon=True)
        self.thread.start()

    def submit(self, task: Any, *args: Any) -> None:
        with self.idle:
            self.running += 1
        self.tasks.put(functools.partial(task, *args))

    def _run(self) -> None:
        while True:
            task = self.tasks.get()
            try:
                if not self.stopping:
                    task()
            except Exception:
                pass
            finally:
                with self.idle:
                    self.running -= 1
                    self.idle.notify_all()

    def wait_idle(self, timeout: float | None) -> bool:
        with self.idle:
            return self.idle.wait_for(lambda: self.running == 0, timeout)

    def stop(self) -> None:
        self.stopping = True
        self.wait_idle(_EXIT_WAIT_S)


_EXIT_WAIT_S = 30.0  # at exit, how long to wait for the compile under way
_WORKER: _Worker | None = None
_WORKER_LOCK = threading.Lock()


def worker() -> _Worker:
    """The process's measuring thread (made at first use)."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = _Worker()
            atexit.register(_WORKER.stop)
        return _WORKER


def stopping() -> None:
    """Raises ``_Skip`` once the interpreter is exiting (checked between compiles)."""
    if _WORKER is not None and _WORKER.stopping:
        raise _Skip("the program is exiting")


def wait_idle(timeout: float | None = None) -> bool:
    """Waits until the measuring thread has nothing queued or running (for tests and
    benchmarks); False if ``timeout`` seconds passed first."""
    return worker().wait_idle(timeout)


def abstract_argument(leaf: Any) -> Any:
    """What the measuring thread lowers in place of a call's leaf: an array's shape, dtype,
    weak type and placement (so the compile is the one the call finds); a Python scalar
    as it is."""
    if isinstance(leaf, jax.Array):
        aval = jax.typeof(leaf)
        sharding = leaf.sharding if getattr(leaf, "committed", True) else None
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding,
                                    weak_type=getattr(aval, "weak_type", False))
    return leaf


class MeasuringTuner(CallTuner):
    """``CallTuner`` that decides in the background (see the module docstring):
    ``measure`` is the option (``"auto"`` or True), ``pending`` the signatures whose
    candidates are being built, ``deferred`` those whose build the next call queues."""

    __slots__ = ("deferred", "idle_boundaries", "lock", "measure", "pending")

    synchronous = False

    def __init__(self, measure: bool | str, budget: TuneBudget = MEASURE_BUDGET):
        super().__init__(budget)
        self.measure = measure
        self.pending: dict[Any, Pending] = {}
        self.deferred: list[Pending] = []
        self.idle_boundaries = 0
        self.lock = threading.RLock()

    def clear(self) -> None:
        with self.lock:
            super().clear()
            self.pending.clear()
            self.deferred.clear()

    # ------------------------------------------------------------------ what runs

    def active(self, key: CallKey) -> bool:
        """Whether calls of ``key`` are measured: ``measure=True``, or ``"auto"`` with the
        target's device the one the call runs on; never with ``JAXPAR_MEASURE=0``."""
        if measure_disabled_by_environment() or not key.rewrite:
            return False
        if self.measure is True:
            return True
        target = targets.get(key.settings.target)
        return target.measured_by_default and jax.default_backend() == target.platform

    def decided_key(self, state: CallState, key: CallKey, leaves: Sequence[Any]) -> CallKey:
        """The decided candidate's key; without a decision (not yet measured, or a call
        under a transformation with no decision at its shapes) ``jax.jit``'s program."""
        plain = dataclasses.replace(key, tune="", tune_generation=0)
        if not self.active(plain):
            return plain
        tuning = self.decisions.get(signature_of(plain, leaves))
        if tuning is not None and tuning.chosen:
            return candidate_key_of(state, plain, tuning.chosen)
        # Unmeasured: jax.jit's program (a rewrite runs only once measured faster).
        return dataclasses.replace(plain, rewrite=False)

    def decide(self, state: CallState, key: CallKey, leaves: Sequence[Any]) -> None:
        """Before a top-level call runs: nothing to wait for (``register`` and ``start``
        queue the build around the first call; a later call's boundary decides,
        ``settle``)."""
        return None

    def tuning(self, state: CallState, key: CallKey, leaves: Sequence[Any],
               first_call: bool = False) -> Tuning | None:
        """This process's decision, a stored one, or where measuring stands."""
        plain = dataclasses.replace(key, tune="", tune_generation=0)
        if not self.active(plain):
            return None
        by_shape = signature_of(plain, leaves)
        hit = self.decisions.get(by_shape)
        if hit is not None:
            return hit
        pending = self.pending.get(by_shape)
        if pending is not None:
            return untimed("", PENDING, pending.name, self.budget)
        concrete = not _compat.staging() and not any(map(_compat.is_tracer, leaves))
        if not concrete:
            return None
        arguments = [abstract_argument(leaf) for leaf in leaves]  # keyed as a build keys
        name, _ = signature_decision_key(state, plain, arguments,
                                         tuple(abstract(x) for x in arguments))
        stored = load(name)
        failed = self.unregistered.get(by_shape)
        if stored is None and failed is not None:
            return untimed(PLAIN, NOT_MEASURED, name, self.budget, why=(
                f"these shapes could not be registered for measuring ({failed}): they run "
                "jax.jit's program"))
        return stored or untimed("", NOT_YET, name, self.budget)

    # ------------------------------------------------------------------ the build

    def register(self, state: CallState, key: CallKey, leaves: Sequence[Any]
                 ) -> Pending | None:
        """Before the first top-level call of a signature is traced: the signature is
        measured (its trace runs ``jax.jit``'s program until decided); None where it is
        not (measuring off here, or decided)."""
        plain = dataclasses.replace(key, tune="", tune_generation=0)
        if not self.active(plain):
            return None
        by_shape = signature_of(plain, leaves)
        with self.lock:
            if by_shape in self.decisions or by_shape in self.pending:
                return None
            if jax.process_count() > 1 and _processes.span(leaves) != _processes.ALL:
                return None  # cannot time together: the model's plan, as under tune=True
            pending = self.pending[by_shape] = Pending(
                plain, by_shape, tuple(map(abstract_argument, leaves)))
        return pending

    def start(self, state: CallState, pending: Pending,
              first_call_s: float | None = None) -> None:
        """After that first call ran (``first_call_s``: its time, where the signature was
        registered after it ran; else since ``register``): the next call is a boundary,
        which queues the candidates' build on the measuring thread (so that nothing of it
        competes with the first call for the host), and under several processes decides
        together."""
        pending.first_call_s = (_clock() - pending.registered if first_call_s is None
                                else first_call_s)
        with self.lock:
            self.deferred.append(pending)
        set_boundary(state, functools.partial(boundary_call, weakref.ref(state)))

    def forget(self, pending: Pending) -> None:
        """The first call raised: the signature is not measured (a later call registers
        it again)."""
        with self.lock:
            self.pending.pop(pending.by_shape, None)

    def launch(self, state: CallState) -> None:
        """Queues the builds ``start`` deferred."""
        with self.lock:
            deferred, self.deferred = self.deferred, []
        for pending in deferred:
            worker().submit(_build, weakref.ref(state), pending)

    # ------------------------------------------------------------------ the decision

    def settle(self, state: CallState, key: CallKey, leaves: Sequence[Any]) -> Tuning | None:
        """At a call boundary with ``leaves`` of ``key``'s signature: its decision, if its
        candidates are built (several processes: waits for them, then decides
        together). None while the build is running."""
        plain = dataclasses.replace(key, tune="", tune_generation=0)
        by_shape = signature_of(plain, leaves)
        pending = self.pending.get(by_shape)
        if pending is None:  # decided before (or never measured): nothing new
            return None
        together = jax.process_count() > 1
        if together:
            pending.done.wait()
        elif not pending.done.is_set():
            return None
        started = time.perf_counter()
        try:
            tuning = self._decided(state, pending, leaves, together)
        except Exception as error:
            if together:
                # Processes timing together are inside collectives: one that went on
                # alone would leave the others waiting. The error reaches every call, as
                # under tune=True.
                with self.lock:
                    self.pending.pop(by_shape, None)
                raise
            tuning = untimed(PLAIN, NOT_MEASURED, pending.name, self.budget,
                             why=f"timing the candidates failed ({type(error).__name__}: "
                                 f"{error}); jax.jit's program runs")
        if tuning.source not in (STORED, NOTHING_TO_MEASURE, NOT_MEASURED):
            tuning = dataclasses.replace(tuning, measure_s=time.perf_counter() - started)
        with self.lock:
            self.pending.pop(by_shape, None)
            self.decisions[by_shape] = tuning
            self.generation += 1
        return tuning

    def _decided(self, state: CallState, pending: Pending, leaves: Sequence[Any],
                 together: bool) -> Tuning:
        if together:
            # Every process's build must have succeeded for them to time together; where
            # one did not, all run the same fallback.
            errors = [json.loads(text) for text in _processes.gather(json.dumps(
                [pending.error, pending.fallback]))]
            if any(error for error, _ in errors):
                fallbacks = {fallback for _, fallback in errors}
                why = next(error for error, _ in errors if error)
                return untimed(fallbacks.pop() if len(fallbacks) == 1 else PLAIN,
                               NOT_MEASURED, pending.name, self.budget,
                               why=f"{why} (on one process at least)")
        elif pending.error is not None:
            return untimed(pending.fallback, NOT_MEASURED, pending.name, self.budget,
                           why=pending.error)
        live = [_at_call(state, pending, p, leaves) for p in pending.programs]
        if together:
            return decide_together(pending.name, pending.fields, lambda: live, self.budget,
                                   together=True, what=state.call_text(
                                       tuple(abstract(x) for x in leaves)))
        if pending.stored is not None:
            return pending.stored
        if sum(1 for p in live if p.run is not None) < 2:
            if pending.built is not None:
                # The deadline stopped the build before a program other than jax.jit's:
                # not a decision to store (a later process builds again).
                return untimed(PLAIN, NOT_MEASURED, pending.name, self.budget,
                               why=f"{pending.built}, before any program other than "
                                   "jax.jit's was built; jax.jit's program runs")
            # Every candidate is jax.jit's program: nothing to time.
            return store(untimed(PLAIN, NOTHING_TO_MEASURE, pending.name, self.budget),
                         pending.fields)
        return store(dataclasses.replace(measure_programs(live, pending.name, self.budget),
                                         built=pending.built), pending.fields)


def _at_call(state: CallState, pending: Pending, program: Program, leaves: Sequence[Any]
             ) -> Program:
    """``program`` run at the deciding call's leaves (built at abstract ones)."""
    if program.run is None:
        return program
    if isinstance(program.run, CalledRun):
        return program._replace(run=program.run.at(leaves))
    return program._replace(run=functools.partial(  # a keyed jit's (NNX calls)
        run_candidate, state, candidate_key_of(state, pending.key, program.candidate.label),
        tuple(leaves)))


def _build(ref: weakref.ref[CallState], pending: Pending) -> None:
    """On the measuring thread: the signature's key, its stored decision, else its
    candidates lowered and compiled; then the boundary that decides (one process)."""
    state = ref()
    if state is None:
        return
    try:
        if _compat.trace_context() != pending.context:
            raise _Skip("the call ran under a JAX context manager (x64, matmul precision, "
                        "default device...) that the measuring thread does not share; "
                        "jax.jit's program runs")
        key, arguments = pending.key, list(pending.arguments)
        avals = tuple(abstract(leaf) for leaf in arguments)
        traced, pending.name, pending.fields = traced_decision_key(state, key, arguments,
                                                                   avals)
        if repeated_by_timing(traced.jaxpr):
            raise _Skip(_EFFECTS)
        pending.stored = load(pending.name)
        if pending.stored is not None and jax.process_count() == 1:
            # A later process: only the winner is compiled (with the fresh jit below).
            pending.programs = []
        else:
            pending.programs = _build_candidates(state, pending, arguments)
    except _Skip as skip:
        pending.error, pending.fallback = str(skip), skip.chosen
    except Exception as error:  # a failed build keeps jax.jit's program; never a call's error
        pending.error = (f"building the candidates failed ({type(error).__name__}: "
                         f"{error}); jax.jit's program runs")
    finally:
        pending.done.set()
    if jax.process_count() == 1:
        tuner = state.tuner
        if isinstance(tuner, MeasuringTuner):
            tuner.idle_boundaries = 0
        set_boundary(state, functools.partial(boundary_call, ref))


# The candidates' build stops at a deadline: this multiple of the signature's first call
# (jax.jit's trace, compile and run), at least ``BUILD_DEADLINE_MIN_S``. A compile under
# way is not interrupted: the deadline is checked between candidates, so the build may
# pass it by one candidate's compile. jax.jit's program and the plan are always built.
BUILD_DEADLINE_FACTOR = 30.0
BUILD_DEADLINE_MIN_S = 60.0
_clock = time.perf_counter  # the build's clock (a test's fake one)


def build_deadline_s(first_call_s: float) -> float:
    """Seconds the candidates' build may take, for a first call of ``first_call_s``."""
    return max(BUILD_DEADLINE_MIN_S, BUILD_DEADLINE_FACTOR * first_call_s)


def _build_candidates(state: CallState, pending: Pending, arguments: list[Any]
                      ) -> list[Program]:
    """The candidates compiled as the function's call compiles them (its donation and
    shardings), in ``decisions.build_order``, until the deadline (one process: processes
    timing together build all, the same schedule); ``pending.built`` says where it
    stopped."""
    started = _clock()
    deadline = started + build_deadline_s(pending.first_call_s)
    alone = jax.process_count() == 1

    def check() -> bool:
        stopping()
        return not alone or _clock() < deadline

    programs = candidate_programs(state, pending.key, arguments, compile_them=True,
                                  check=check)
    own = [p for p in programs if own_program(p.candidate, pending.key)]
    failed = [p for p in own if p.failed is not None]
    left_out = sum(1 for p in own if p.run is None and p.same_as is None) - len(failed)
    notes = []
    if left_out:
        notes.append(f"built {len(own) - left_out - len(failed)} of {len(own)} candidates "
                     f"in {_clock() - started:.1f} s; stopped at the deadline "
                     f"({build_deadline_s(pending.first_call_s):.0f} s)")
    if failed:
        notes.append(f"{len(failed)} could not be built, not timed: " + "; ".join(
            f"{p.candidate.label!r} ({p.failed})" for p in failed))
    if notes:
        pending.built = "; ".join(notes)
    return programs


class _Skip(Exception):
    """A signature the measuring thread does not measure (the reason is its message;
    ``chosen``: what runs instead)."""

    def __init__(self, why: str, chosen: str = PLAIN):
        super().__init__(why)
        self.chosen = chosen


_EFFECTS = (f"{REPEATED_BY_TIMING}; jax.jit's program runs (measure=False runs the "
            "model's plan)")


# ------------------------------------------------------------------------ the boundary


def installed_after_decision(state: CallState, fast: FastPath, args: tuple[Any, ...],
                             kwargs: dict[str, Any], background: bool) -> None:
    """After the measuring tuner chose a rewrite for this call's signature: a fresh
    top-level jit for ``fast``'s environment (``fast``'s holds ``jax.jit``'s trace of the
    signature), the winner compiled into it and then installed. ``background``: compiled
    on the measuring thread while calls keep running ``fast`` (one process); else now,
    so that this call runs it (several processes switch at the same call)."""
    moved = FastPath(state, fast.mode, fast.options)
    moved.accepted = fast.accepted
    # Calls jaxpar splits (NNX objects, static leaves) compile in their own jits at the
    # next call; the C++ dispatch's jit is compiled here for the calls it runs.
    routed = runs_routed(state, args, kwargs)
    abstract_args, abstract_kwargs = jax.tree_util.tree_map(abstract_argument,
                                                            (args, kwargs)) if routed else ((), {})
    ref = weakref.ref(state)

    def switch() -> None:
        alive = ref()
        if alive is None:
            return
        try:  # the call compiles it otherwise
            if routed:
                moved.routed.plain.lower(*abstract_args, **abstract_kwargs).compile()
        except Exception:
            pass
        with alive.switch_lock:
            if alive.memos.fast_by_mode.get(fast.mode) is fast:
                replace_path(alive, fast, moved)

    if background:
        worker().submit(switch)
    else:
        with state.switch_lock:
            replace_path(state, fast, moved)



def boundary_call(ref: weakref.ref[CallState], installed: Any, *args: Any, **kwargs: Any
                  ) -> Any:
    """A call at a boundary (``state.boundary``): where it is of a signature whose
    candidates are built, the decision is made now, timed with this call's arguments;
    where a rewrite won, its program is compiled into a fresh jit (see the module
    docstring). The call itself runs the installed call."""
    state = ref()
    if state is None:
        return installed(*args, **kwargs)
    tuner = state.tuner
    assert isinstance(tuner, MeasuringTuner)
    set_boundary(state, None)
    together = jax.process_count() > 1
    try:
        tuner.launch(state)
        settled = _settle_call(state, tuner, args, kwargs)
        if settled is not None:
            installed_after_decision(state, current(state), args, kwargs,
                                     background=not together)
    except Exception:
        if together:
            raise  # see ``settle``: every process raises, none waits alone
        settled = None  # measuring never breaks a call: jax.jit's program runs
    with tuner.lock:
        # A built signature not called again would keep every other call on this Python
        # path: the boundary stays for at most ``BOUNDARY_CALLS`` calls that settle
        # nothing (its signature then runs jax.jit's program, undecided).
        tuner.idle_boundaries = 0 if settled is not None else tuner.idle_boundaries + 1
        waiting = any(p.done.is_set() or together for p in tuner.pending.values())
        if waiting and (together or tuner.idle_boundaries < BOUNDARY_CALLS):
            set_boundary(state, functools.partial(boundary_call, ref))
    return state.installed(*args, **kwargs)


def _settle_call(state: CallState, tuner: MeasuringTuner, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Tuning | None:
    """The decision this call settles, where a rewrite won (None otherwise)."""
    if not tuner.pending or not _compat.top_level():
        return None
    key, leaves = measured_split(state, current(state).mode, args, kwargs)
    tuning = tuner.settle(state, key, leaves)
    return None if tuning is None or tuning.chosen in ("", PLAIN) else tuning


__all__ = ["CHOSEN", "MEASURE_BUDGET", "MEASURE_VARIABLE", "MeasuringTuner",
           "check_measure", "measure_disabled_by_environment", "wait_idle"]
