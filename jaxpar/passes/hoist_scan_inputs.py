"""Run the work of a scan's body that reads no carry for every step at once, before the
loop.

A recurrent layer's step is ``h = tanh(h @ w + x @ u)``: ``x @ u`` reads the step's input
and the weights, never the carry, yet a rolled (or unrolled) loop runs it once per step,
a small matmul on the loop's critical path. The same holds for a sampler drawing its
step's random numbers from the step's key, and for a GRU's or LSTM's input gates as flax
writes them (inside the cell). With ``hoist_scan_inputs=True`` such work runs as one
batched computation over all the steps' inputs before the loop (one matmul of
``L * batch`` rows instead of ``L`` of ``batch``; the draws of ``L`` keys in one kernel),
and the loop reads its results as scanned inputs::

    def body(h, x):                      u_x = vmap(lambda x: x @ u)(xs)   # before the loop
        return tanh(h @ w + x @ u), h    def body(h, ux): return tanh(h @ w + ux), h

What moves: the body's "heavy" equations (``HEAVY``: matmuls, convolutions, random
draws, and calls whose bodies hold one) that depend on the step's inputs and on nothing
the carry reaches, with the equations they need (which read only the inputs and the
loop's constants). What they feed stays in the loop (a bias add after the matmul fuses
there as before). The values the loop then reads are stacked over the steps; the
stacked bytes are bounded (``MAX_HOISTED_BYTES``, and the memory budget's allowance).

Each step computes the same equations on the same values: ``vmap`` of the moved
equations computes each step's row as the loop did (a batched matmul's accumulation
order on an accelerator may differ, within the target's tolerance, as any fusion
does). Whether it pays is for the device to say (the measured candidates of ``_tune``,
``targets/tpu.py``): it removes work from every trip and adds a scanned input per moved
value; no target turns it on by default.

Example::

    new, decisions = hoist_scan_inputs(jax.make_jaxpr(rnn)(h0, xs, w, u))
    [d.kind for d in decisions]            # ["hoisted"]

Sharp edges:
  * Never moved: equations with effects (callbacks, prints), collectives, loops and
    conditionals (a ``cond`` under ``vmap`` runs both branches), user placements, and
    calls holding any of these; scans with effects or user placement are left alone.
  * A scan of length 0 is left alone (nothing runs).
  * Running the passes again changes nothing: what is left in the body reads the carry
    or is not heavy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import jax
from jax import lax

from .. import _compat
from .._analysis import Analysis
from .._compat import JaxprEqn
from .._model.memory import format_bytes
from .._program.graph import build_graph, reachable
from .._program.interp import Env
from .._program.primitives import (
    COLLECTIVE,
    CONV,
    DOT_GENERAL,
    MAY_BRANCH_OR_LOOP,
    PURE_CALLBACK,
    USER_PLACEMENT,
)
from ._loop_candidates import loop_candidates, stacked_limit
from ._protocol import DecisionKind, EmitFn, Level, LevelResult, PassDecision, Rewrite, decision

# The equations worth a stacked input: each is a kernel of its own on every trip.
HEAVY = frozenset({DOT_GENERAL, CONV, "random_bits", "threefry2x32", "random_split",
                   "random_fold_in", "erf_inv"})
_WORDS = {DOT_GENERAL: "matmul", CONV: "convolution", "random_bits": "random draw",
          "threefry2x32": "random draw", "random_split": "key split",
          "random_fold_in": "key fold-in", "erf_inv": "erf_inv"}
# Never moved out of the loop (see the module's sharp edges).
PINNED = MAY_BRANCH_OR_LOOP | COLLECTIVE | USER_PLACEMENT | {PURE_CALLBACK}
# The most bytes the stacked values of one scan may take.
MAX_HOISTED_BYTES = 1 << 30


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: every scan of one level whose body has heavy work that reads no
    carry gets that work run for all steps before it."""
    eqns, path = level.eqns, level.path
    limit = stacked_limit(analysis, "hoist_scan_inputs", MAX_HOISTED_BYTES)
    rewrites: list[Rewrite] = []
    decisions: list[PassDecision] = []
    for index in loop_candidates(eqns):
        eqn = eqns[index]
        split = _split(eqn)
        if split is None:
            continue
        stacked = split.stacked_bytes
        what = _what(split)
        length = _compat.scan_info(eqn).length
        if stacked > limit:
            decisions.append(decision(
                path, DecisionKind.LEFT_ALONE, eqns, [index], trips_before=length,
                trips_after=length, unroll=None,
                reason=f"{what} of its body read no carry, but would stack "
                       f"{format_bytes(stacked)} over its {length} steps, more than the "
                       f"{format_bytes(limit)} allowed"))
            continue
        rewrites.append(Rewrite((index,), _emitter(eqn, split)))
        decisions.append(decision(
            path, DecisionKind.HOISTED, eqns, [index], trips_before=length,
            trips_after=length, unroll=None,
            reason=f"{what} of its body read no carry: run for all {length} steps before the "
                   f"loop, {format_bytes(stacked)} stacked; the loop reads their results"))
    return LevelResult(rewrites, decisions)


class _Split:
    """A scan body's equations split into those moved before the loop and the rest.

    Attributes:
      moved: indices of the body's equations run for every step before the loop.
      needed: indices of the equations the moved ones need, in body order (the moved ones
        and the loop-invariant ones they read).
      heavy: the primitives of the moved heavy equations.
      handed: the moved equations' outputs the loop still reads (stacked over steps).
      xs_read: which of the scan's scanned inputs the moved equations read.
      xs_kept: which scanned inputs the loop still reads.
      stacked_bytes: the stacked ``handed`` values' bytes.
    """

    __slots__ = ("handed", "heavy", "moved", "needed", "stacked_bytes", "xs_kept", "xs_read")

    def __init__(self, moved: set[int], needed: list[int], heavy: list[str],
                 handed: list[Any], xs_read: list[int], xs_kept: list[int],
                 stacked_bytes: int) -> None:
        self.moved, self.needed, self.heavy = moved, needed, heavy
        self.handed, self.xs_read, self.xs_kept = handed, xs_read, xs_kept
        self.stacked_bytes = stacked_bytes


def _what(split: _Split) -> str:
    """The moved heavy equations in words: ``2 matmuls, 1 random draw``."""
    words = Counter(_WORDS.get(name, f"{name} call") for name in split.heavy)
    return ", ".join(f"{n} {word}{'' if n == 1 else 's'}" for word, n in sorted(words.items()))


def _pinned(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` must stay where it is: effects, or a pinned primitive (in it or
    in a jaxpr it holds)."""
    if eqn.effects or eqn.primitive.name in PINNED:
        return True
    return any(_pinned(inner) for _, _, sub in _compat.eqn_subjaxprs(eqn)
               for inner in _compat.open_jaxpr(sub)[0].eqns)


def _heavy(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is, or holds, a ``HEAVY`` equation."""
    if eqn.primitive.name in HEAVY:
        return True
    return any(_heavy(inner) for _, _, sub in _compat.eqn_subjaxprs(eqn)
               for inner in _compat.open_jaxpr(sub)[0].eqns)


def _split(eqn: JaxprEqn) -> _Split | None:
    """The scan's body split (``_Split``), or None when no heavy equation reads only the
    step's inputs and the loop's constants."""
    info = _compat.scan_info(eqn)
    if info.length == 0:
        return None
    body, _ = _compat.open_jaxpr(info.jaxpr)
    invars = body.invars
    consts = invars[:info.num_consts]
    xs = invars[info.num_consts + info.num_carry:]
    # Each variable's kind: "inv" reads only constants, "step" reads the step's inputs
    # (and constants), absent: reads the carry (or comes from a pinned equation).
    kind: dict[Any, str] = {v: "inv" for v in (*body.constvars, *consts)}
    kind.update((v, "step") for v in xs)
    eqn_kind: list[str | None] = []
    for inner in body.eqns:
        kinds = [kind.get(a, "carry") if not _compat.is_literal(a) else "inv"
                 for a in inner.invars]
        if "carry" in kinds or _pinned(inner):
            eqn_kind.append(None)
            continue
        this = "step" if "step" in kinds else "inv"
        eqn_kind.append(this)
        kind.update((v, this) for v in inner.outvars)
    heavy = [i for i, inner in enumerate(body.eqns) if eqn_kind[i] == "step" and _heavy(inner)]
    if not heavy:
        return None
    needed = set(heavy) | reachable(build_graph(body), heavy, forward=False)
    moved = {i for i in needed if eqn_kind[i] == "step"}
    kept = [i for i in range(len(body.eqns)) if i not in moved]
    read_by_loop = {a for i in kept for a in body.eqns[i].invars if not _compat.is_literal(a)}
    read_by_loop.update(a for a in body.outvars if not _compat.is_literal(a))
    handed = [v for i in sorted(moved) for v in body.eqns[i].outvars
              if not _compat.is_drop_var(v) and v in read_by_loop]
    needed_reads = {a for i in needed for a in body.eqns[i].invars
                    if not _compat.is_literal(a)}
    xs_read = [k for k, v in enumerate(xs) if v in needed_reads]
    xs_kept = [k for k, v in enumerate(xs) if v in read_by_loop]
    stacked = sum(_compat.aval_nbytes(v.aval) for v in handed) * info.length
    return _Split(moved, sorted(needed), [body.eqns[i].primitive.name for i in heavy],
                  handed, xs_read, xs_kept, stacked)


def _emitter(eqn: JaxprEqn, split: _Split) -> EmitFn:
    """The scan ``eqn`` as: the moved equations ``vmap``ped over the steps' inputs, then
    a scan of the rest reading their results as scanned inputs."""
    info = _compat.scan_info(eqn)
    body, body_consts = _compat.open_jaxpr(info.jaxpr)
    nc, ncarry = info.num_consts, info.num_carry
    moved = split.moved

    def emit(invals: list[list[Any]]) -> list[list[Any]]:
        (operands,) = invals
        consts = operands[:nc]
        init = operands[nc:nc + ncarry]
        xs = operands[nc + ncarry:]

        def before(*step_xs: Any) -> list[Any]:
            env = _env(body, body_consts, consts)
            env.write_inputs([body.invars[nc + ncarry + k] for k in split.xs_read], step_xs)
            env.bind(body.eqns[i] for i in split.needed)
            return env.read_all(split.handed)

        def step(carry: list[Any], scanned: tuple[list[Any], list[Any]]
                 ) -> tuple[list[Any], list[Any]]:
            kept_xs, handed = scanned
            env = _env(body, body_consts, consts)
            env.write_inputs(body.invars[nc:nc + ncarry], carry)
            env.write_inputs([body.invars[nc + ncarry + k] for k in split.xs_kept], kept_xs)
            env.write_inputs(split.handed, handed)
            env.bind(inner for i, inner in enumerate(body.eqns) if i not in moved)
            outs = env.read_all(body.outvars)
            return outs[:ncarry], outs[ncarry:]

        with _compat.eqn_context(eqn):
            stacked = jax.vmap(before)(*[xs[k] for k in split.xs_read])
            final, ys = lax.scan(step, list(init), ([xs[k] for k in split.xs_kept],
                                                   list(stacked)),
                                 length=info.length, reverse=info.reverse, unroll=info.unroll)
        return [list(final) + list(ys)]

    return emit


def _env(body: Any, body_consts: Sequence[Any], consts: Sequence[Any]) -> Env:
    env = Env()
    env.write(body.constvars, body_consts)
    env.write_inputs(body.invars[:len(consts)], consts)
    return env

