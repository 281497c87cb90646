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
from collections.abc import Sequence
from typing import Any

import jax

from .. import _compat, _processes
from .._frameworks import nnx_arguments
from .._trace import Signature, abstract, split_arguments, trace
from .._tune import CANDIDATES, CHOSEN, Program, TuneBudget, Tuning, undecided, unmeasured
from .._tune import decide as decide_candidate
from .._tune import decision_key as tuning_key
from .._tune import fingerprint as program_fingerprint
from .._tune import load as load_decision
from .keyed import jit_for
from .state import CallKey, CallState


class CallTuner:
    """A decorated function's tuner: how it measures (``budget``), its decisions in this
    process by signature (what jax.jit traces anew), which traced calls reuse, and the
    generation of measurements (``CallKey.tune_generation``)."""

    __slots__ = ("budget", "decisions", "generation")

    synchronous = True  # decides before a signature's first call (``measuring``: after)

    def __init__(self, budget: TuneBudget):
        self.budget = budget
        self.decisions: dict[Any, Tuning] = {}
        self.generation = 0

    def clear(self) -> None:
        self.decisions.clear()

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

    def start(self, state: CallState, registered: Any) -> None:
        """After that call ran (see ``register``)."""

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
        name, fields = signature_decision_key(state, key, leaves, avals)
        if jax.process_count() > 1 and not first_call:
            # Local: the stored file or nothing, not remembered (the first call decides).
            return load_decision(name) or undecided(name, self.budget)
        span = _processes.span(leaves)
        if span == _processes.SOME:
            tuning = unmeasured(name, self.budget, "the arguments span some processes but "
                                                   "not all, which cannot time together")
        else:
            tuning = decide_candidate(name, fields, lambda: candidate_programs(state, key, leaves),
                                      self.budget, together=span == _processes.ALL,
                                      what=state.call_text(avals))
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


def candidate_programs(state: CallState, key: CallKey, leaves: Sequence[Any],
                compile_them: bool = False, check: Any = None) -> list[Program]:
    """Each candidate's program, or the label of an earlier candidate whose lowered
    program is the same text (timed once); ``compile_them``: each distinct one compiled
    now (the measuring thread), so timing it compiles nothing; ``check`` is called before
    each candidate (it raises to stop the build)."""
    out: list[Program] = []
    seen: dict[str, str] = {}
    for candidate in CANDIDATES:
        if candidate.targets is not None and key.settings.target not in candidate.targets:
            chosen = next(p for p in out if p.candidate.label == CHOSEN)
            out.append(Program(candidate, None, chosen.same_as or CHOSEN, chosen.digest))
            continue
        if check is not None:
            check()
        candidate_key = candidate_key_of(state, key, candidate.label)
        jitted = jit_for(state, candidate_key, leaves)
        options = {} if not candidate_key.rewrite else state.prepare(
            Signature(key.layout, tuple(abstract(leaf) for leaf in leaves)),
            candidate_key.settings, key.nnx, key.local_axes).xla_options
        # What decides the program on jaxpar's side, which processes compare.
        digest = program_fingerprint(repr((candidate_key.rewrite, candidate_key.settings,
                                           sorted(options.items()))))
        # The XLA options (the CUDA-graph mode) are not in the lowered text.
        lowered = jitted.lower(candidate_key, *leaves)
        text = f"{lowered.as_text()}\n{id(jitted)}"
        if text in seen:
            out.append(Program(candidate, None, seen[text], digest))
            continue
        seen[text] = candidate.label
        if compile_them:
            lowered.compile()
        out.append(Program(candidate, functools.partial(run_candidate, state, candidate_key,
                                                        tuple(leaves)), None, digest))
    return out


def run_candidate(state: CallState, key: CallKey, leaves: tuple[Any, ...]) -> Any:
    return jit_for(state, key, leaves)(key, *leaves)[0]
