"""The tuner's hook into a decorated function's calls (``parallel_branches(tune=True)``).

``_tune`` measures candidates and stores decisions; this module is what a function's calls
ask of it: the decision for a signature (this process's, the stored one, or measured now:
``decide``, before the first call of a signature runs), the key of the candidate it chose
(``decided_key``, when jax.jit traces the signature), and each candidate's program to time.
A compiled call pays nothing for the tuner.

Example::

    tuner = CallTuner(TuneBudget())
    state = CallState(fun, options, StaticArgs(), planned_for, tuner)
    tuner.tuning_of_call(state, args, kwargs)  # measures at concrete arguments

Sharp edges:
  * Decisions are kept per signature and trace context in this process; under several
    processes only a signature's first real call decides (``tuning``).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .. import _compat, _processes, targets
from .._frameworks import nnx_arguments
from .._trace import Signature, abstract, split_arguments, trace
from .._tune import (
    CANDIDATES,
    CHOSEN,
    PLAIN,
    REPEATED_BY_TIMING,
    Candidate,
    Program,
    TuneBudget,
    Tuning,
    repeated_by_timing,
    undecided,
    unmeasured,
)
from .._tune import decide as decide_candidate
from .._tune import decision_key as tuning_key
from .._tune import fingerprint as program_fingerprint
from .._tune import load as load_decision
from .fast import donated_leaves, key_program, splits_statics
from .keyed import jit_for
from .state import CallKey, CallState, bounded, wrapping


class CallTuner:
    """A decorated function's tuner: how it measures (``budget``), its decisions in this
    process by signature (what jax.jit traces anew), which traced calls reuse, and the
    generation of measurements (``CallKey.tune_generation``); ``unregistered``: why a split
    call's signature (NNX objects, static leaves) could not be registered for measuring,
    by signature (it runs ``jax.jit``'s program; the measuring tuner's ``tuning`` says so)."""

    __slots__ = ("budget", "decisions", "generation", "unregistered")

    synchronous = True  # decides before a signature's first call (``measuring``: after)

    def __init__(self, budget: TuneBudget):
        self.budget = budget
        self.decisions: dict[Any, Tuning] = {}
        self.generation = 0
        self.unregistered: dict[Any, str] = {}

    def clear(self) -> None:
        self.decisions.clear()
        self.unregistered.clear()

    def decided_key(self, state: CallState, key: CallKey, leaves: Sequence[Any]) -> CallKey:
        """At trace time: the key of the candidate this signature's decision chose (the
        plan's own key without a decision: under a transformation, or where a concrete
        call could not measure)."""
        tuning = self.decisions.get(signature_of(key, leaves))
        key = dataclasses.replace(key, tune="", tune_generation=0)
        return key if tuning is None else candidate_key_of(state, key, tuning.chosen)

    def decide(self, state: CallState, key: CallKey, leaves: Sequence[Any]) -> None:
        """Before a concrete top-level call of ``key``'s signature runs: its decision, made
        now (measured) where none exists; a new decision starts a new generation, so that
        traces made before it are not reused."""
        plain = dataclasses.replace(key, tune="", tune_generation=0)
        if signature_of(plain, leaves) in self.decisions:
            return
        self.tuning(state, plain, leaves, first_call=True)
        self.generation += 1

    def register(self, state: CallState, key: CallKey, leaves: Sequence[Any]) -> Any:
        """Before a signature's first top-level call is traced: what ``start`` takes
        after it (the measuring tuner's; this tuner decided in ``decide``)."""
        return None

    def note_unregistered(self, key: CallKey, leaves: Sequence[Any], error: Exception
                          ) -> None:
        """``register`` raised for a split call's signature (``fast.measure_new_trace``)."""
        plain = dataclasses.replace(key, tune="", tune_generation=0)
        bounded(self.unregistered)[signature_of(plain, leaves)] = \
            f"{type(error).__name__}: {error}"

    def start(self, state: CallState, registered: Any,
              first_call_s: float | None = None) -> None:
        """After that call ran (see ``register``; ``first_call_s``: its time, where it was
        registered after it ran)."""

    def forget(self, registered: Any) -> None:
        """That call raised: what ``register`` made is dropped."""

    def tuning(self, state: CallState, key: CallKey, leaves: Sequence[Any],
               first_call: bool = False) -> Tuning | None:
        """The decision for one signature: this process's, the stored one, or measured
        now; at traced or abstract arguments only this process's.

        Under several processes only ``first_call`` (the first real call of the signature,
        which every process makes) decides, with the others where the arguments span them
        (``_tune.decide``'s collective); any other read (``tuning()``, ``inspect``) is
        local: this process's decision or the stored file, never measured.
        """
        avals = tuple(abstract(leaf) for leaf in leaves)
        by_shape = signature_of(key, leaves, avals)
        hit = self.decisions.get(by_shape)
        # Concrete values at the top level (not ShapeDtypeStructs, not tracers).
        concrete = not _compat.staging() and not any(map(_compat.is_tracer, leaves)) and all(
            isinstance(leaf, (jax.Array, int, float, complex)) or hasattr(leaf, "__array__")
            for leaf in leaves)
        if hit is not None or not concrete:
            return hit
        traced, name, fields = traced_decision_key(state, key, leaves, avals)
        if jax.process_count() > 1 and not first_call:
            # Local: the stored file or nothing, not remembered (the first call decides).
            return load_decision(name) or undecided(name, self.budget)
        span = _processes.span(leaves)
        if repeated_by_timing(traced.jaxpr):
            tuning = unmeasured(name, self.budget, REPEATED_BY_TIMING)
        elif span == _processes.SOME:
            tuning = unmeasured(name, self.budget, "the arguments span some processes but "
                                                   "not all, which cannot time together")
        else:
            tuning = decide_candidate(
                name, fields, lambda: candidate_programs(state, key, leaves),
                self.budget, together=span == _processes.ALL, what=state.call_text(avals))
        self.decisions[by_shape] = tuning
        return tuning

    def tuning_of_call(self, state: CallState, args: tuple[Any, ...], kwargs: dict[str, Any]
                       ) -> Tuning | None:
        """``ParallelBranches.tuning``: the decision for these arguments, as a call makes
        it."""
        with nnx_arguments(object(), state.fun, args, kwargs) as (fun, args, kwargs, nnx_call):
            layout, leaves = split_arguments(fun, args, kwargs, state.static_args,
                                             allow_abstract=True, api="tuning")
            return self.tuning(state, state.call_key(layout, nnx_call is not None, leaves),
                               leaves)


def signature_of(key: CallKey, leaves: Sequence[Any],
                 avals: tuple[Any, ...] | None = None) -> Any:
    """What a tuner keys its decisions by in this process: the call's layout, abstract
    values, NNX split, settings and JAX's trace context."""
    if avals is None:
        avals = tuple(abstract(leaf) for leaf in leaves)
    return key.layout, avals, key.nnx, key.settings, _compat.trace_context()


def signature_decision_key(state: CallState, key: CallKey, leaves: Sequence[Any],
                           avals: tuple[Any, ...]) -> tuple[str, dict[str, Any]]:
    """``_tune.decision_key`` of one signature (traces the function to fingerprint it)."""
    return traced_decision_key(state, key, leaves, avals)[1:]


def traced_decision_key(state: CallState, key: CallKey, leaves: Sequence[Any],
                        avals: tuple[Any, ...]) -> tuple[Any, str, dict[str, Any]]:
    """The signature's trace (``_trace.trace``) and its decision's key and fields."""
    shardings = tuple(getattr(leaf, "sharding", None) for leaf in leaves)
    traced = trace(state.traced_function(key.nnx), Signature(key.layout, avals))
    return traced, *tuning_key(
        program=program_fingerprint(str(traced.jaxpr)),
        arguments=[f"{aval} {sharding!r}" for aval, sharding in zip(avals, shardings,
                                                                    strict=True)],
        statics=f"{key.layout.in_tree} {key.layout.statics!r}",
        options={**state.options.to_dict(), **state.planned_for, "nnx": key.nnx,
                 "settings": key.settings})


def candidate_key_of(state: CallState, key: CallKey, label: str) -> CallKey:
    overrides = next(c.overrides for c in CANDIDATES if c.label == label)
    if overrides is None:
        return dataclasses.replace(key, rewrite=False)
    options = dataclasses.replace(state.options, **overrides)
    return dataclasses.replace(key, settings=options.resolve(**state.planned_for))


# The order candidates are built in (a deadline may stop the measuring thread's build
# between two): jax.jit's program and the plan (always built), then lax.scan's unroll by
# 8 (with and without the loops' carry-free work hoisted) and by 16 (what the chip chose
# wherever a rewrite other than the plan won: 13 of 13 loop programs and the 8-chain HMC
# in docs/benchmarks.md's r1-r5), the loops rolled, linear recurrences associative, the
# plan hoisted, then the table's order. The programs keep the table's order.
BUILD_FIRST = (PLAIN, CHOSEN, "jaxpar unrolled by 8",
               "jaxpar, scan inputs hoisted, unrolled by 8", "jaxpar unrolled by 16",
               "jaxpar without unrolling", "jaxpar, linear scans associative",
               "jaxpar, scan inputs hoisted")
BUILD_LAST: tuple[str, ...] = ()
ALWAYS_BUILT = 2  # jax.jit's program and the plan: no deadline stops them


def build_order() -> list[Candidate]:
    """``CANDIDATES`` in the order they are built."""
    def rank(index: int) -> tuple[int, int]:
        label = CANDIDATES[index].label
        if label in BUILD_FIRST:
            return 0, BUILD_FIRST.index(label)
        return (2 if label in BUILD_LAST else 1), index

    return [CANDIDATES[i] for i in sorted(range(len(CANDIDATES)), key=rank)]


def own_program(candidate: Candidate, key: CallKey) -> bool:
    """Whether ``candidate`` is a program of its own on the key's target (else it is the
    plan's, not built again)."""
    return candidate.targets is None or key.settings.target in candidate.targets


def candidate_programs(state: CallState, key: CallKey, leaves: Sequence[Any],
                       compile_them: bool = False, check: Any = None) -> list[Program]:
    """Each candidate's program (``CANDIDATES`` order), or the label of an earlier built
    candidate whose lowered program is the same (timed once).

    ``compile_them``: each distinct one compiled now (the measuring thread), so timing
    it compiles nothing. ``check``: called before each candidate after the first
    ``ALWAYS_BUILT`` (in ``build_order``); it raises to stop the build, or returns
    False to build no more (a deadline: the rest are left out, ``Program(run=None)``
    without ``same_as``). A candidate after those whose build raises is
    ``Program(run=None, failed=why)``: not timed, the others still are.

    Each is compiled as the function's call compiles it (``called_jit``: its donation and
    shardings), for ``tune=True`` and measuring alike; calls jaxpar splits (Flax NNX
    objects; static leaves of its own, such as an Equinox module's functions) run in its
    keyed jits, whose arguments are the split's leaves: their candidates too, not over
    the call's own arguments (which JAX cannot take).
    """
    as_called = not key.nnx and not splits_statics(state, key.layout,
                                                   *key.layout.rebuild(leaves))
    built: dict[str, Program] = {}
    seen: dict[str, str] = {}
    for index, candidate in enumerate(build_order()):
        if not own_program(candidate, key):
            chosen = built[CHOSEN]
            built[candidate.label] = Program(candidate, None, chosen.same_as or CHOSEN,
                                             chosen.digest)
            continue
        if check is not None and index >= ALWAYS_BUILT and check() is False:
            break
        try:
            built[candidate.label] = _built(state, key, leaves, candidate, seen,
                                            compile_them, as_called)
        except Exception as error:
            if index < ALWAYS_BUILT:
                raise  # jax.jit's program or the plan: the call itself would fail alike
            # One candidate that cannot be built is not timed; the others still are.
            built[candidate.label] = Program(candidate, None,
                                             failed=f"{type(error).__name__}: {error}"[:300])
    return [built.get(c.label) or Program(c, None) for c in CANDIDATES]


def _built(state: CallState, key: CallKey, leaves: Sequence[Any], candidate: Candidate,
           seen: dict[str, str], compile_them: bool, as_called: bool) -> Program:
    """One candidate's ``Program``, lowered (and compiled where ``compile_them``) unless
    an earlier one lowered to the same program (``seen``: text to label)."""
    candidate_key = candidate_key_of(state, key, candidate.label)
    options = {} if not candidate_key.rewrite else state.prepare(
        Signature(key.layout, tuple(abstract(leaf) for leaf in leaves)),
        candidate_key.settings, key.nnx, key.local_axes).xla_options
    # What decides the program on jaxpar's side, which processes compare.
    digest = program_fingerprint(repr((candidate_key.rewrite, candidate_key.settings,
                                       sorted(options.items()))))
    if as_called:
        compiled_with = options if targets.get(
            key.settings.target).compiles_with_xla_options else {}
        jitted = called_jit(state, candidate_key, compiled_with)
        args, kwargs = key.layout.rebuild(leaves)
        lowered = jitted.lower(*args, **kwargs)
        run: Any = CalledRun(jitted, key.layout, tuple(leaves), donated_positions(state, key,
                                                                                 leaves))
    else:
        jitted = jit_for(state, candidate_key, leaves)
        lowered = jitted.lower(candidate_key, *leaves)
        run = functools.partial(run_candidate, state, candidate_key, tuple(leaves))
        compiled_with = {"jit": str(id(jitted))}
    # The XLA options (the CUDA-graph mode) are not in the lowered text.
    text = f"{lowered.as_text()}\n{sorted(compiled_with.items())!r}"
    if text in seen:
        return Program(candidate, None, seen[text], digest)
    seen[text] = candidate.label
    if compile_them:
        lowered.compile()
    return Program(candidate, run, None, digest)


def run_candidate(state: CallState, key: CallKey, leaves: tuple[Any, ...]) -> Any:
    return jit_for(state, key, leaves)(key, *leaves)[0]


def called_jit(state: CallState, key: CallKey, options: dict[str, str]) -> Any:
    """A ``jax.jit`` of ``key``'s program (``fast.key_program``) over the call's own
    arguments, as the function's top-level jit compiles it: its static arguments,
    ``jax.jit`` options (donation, ``in_shardings``/``out_shardings``, ``keep_unused``)
    and the XLA ``options``."""
    ref = weakref.ref(state)

    def entry(*args: Any, **kwargs: Any) -> Any:
        alive = ref()
        if alive is None:
            raise ReferenceError("jaxpar: this parallel_branches function was deleted")
        layout, leaves = split_arguments(alive.fun, args, kwargs, alive.static_args)
        return key_program(alive, dataclasses.replace(key, layout=layout), leaves)

    return jax.jit(wrapping(entry, state), static_argnums=state.static_args.nums,
                   static_argnames=state.static_args.names,
                   compiler_options=dict(options) or None, **state.jit_options.jit_kwargs())


def donated_positions(state: CallState, key: CallKey, leaves: Sequence[Any]
                      ) -> tuple[int, ...]:
    """The positions of the leaves the function donates (none without donation)."""
    if not state.jit_options.donates:
        return ()
    args, kwargs = key.layout.rebuild(leaves)
    return donated_leaves(state, key.layout, args, kwargs)


# What the copies of donated arguments that one timing round holds may take together
# (``CalledRun.fresh``): at least one call a round, whatever its arguments' size.
DONATED_COPIES_BYTES = 1 << 30


class CalledRun:
    """A candidate's run as the function's call runs it: ``called_jit``'s program at a
    call's leaves. Where the function donates arguments, each run gets its own copies of
    them (a donated buffer is consumed by its run; the call's own arguments stay for the
    call)."""

    __slots__ = ("donated", "jitted", "layout", "leaves")

    def __init__(self, jitted: Any, layout: Any, leaves: tuple[Any, ...],
                 donated: tuple[int, ...]):
        self.jitted, self.layout, self.leaves, self.donated = jitted, layout, leaves, donated

    def at(self, leaves: Sequence[Any]) -> CalledRun:
        """The same program at other leaves (a call's concrete arguments)."""
        return CalledRun(self.jitted, self.layout, tuple(leaves), self.donated)

    def fresh(self, calls: int) -> list[Callable[[], Any]]:
        """Up to ``calls`` runs, each with its own copies of the donated leaves (made
        now), as many as ``DONATED_COPIES_BYTES`` allows (one at least)."""
        if self.donated:
            size = sum(getattr(self.leaves[i], "nbytes", 0) for i in self.donated)
            calls = max(1, min(calls, DONATED_COPIES_BYTES // max(size, 1)))
        return [self._run_with_copies() for _ in range(calls)]

    def _run_with_copies(self) -> Callable[[], Any]:
        leaves = list(self.leaves)
        for i in self.donated:
            leaf = leaves[i]
            if isinstance(leaf, jax.Array):  # placed as it is (uncommitted stays so)
                leaves[i] = jax.device_put(leaf, leaf.sharding if getattr(
                    leaf, "committed", True) else None, may_alias=False)
        args, kwargs = self.layout.rebuild(leaves)
        return functools.partial(self.jitted, *args, **kwargs)

    def __call__(self) -> Any:
        return self._run_with_copies()()
