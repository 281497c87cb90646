"""Run a ``while`` loop's body several times per trip, each copy after the first guarded
by the loop's condition.

A ``while`` loop whose trip count is data-dependent (an ODE solver's steps, a Newton
iteration to tolerance, NUTS's tree doubling) is one XLA can neither unroll nor read
by blocks: every trip pays the loop's control (on a GPU the predicate's copy to the
host, on a TPU the chip's branch back) for one run of the body. With
``unroll_while=k`` the loop ``while cond(c): c = body(c)`` becomes::

    def body_k(c):
        c = body(c)                                   # the outer cond just held
        for _ in range(k - 1):
            c = select(cond(c), body(c), c)           # or lax.cond: see below
        return c

    while cond(c): c = body_k(c)

Once ``cond`` is false a guarded copy passes the carry on unchanged, so ``cond`` stays
false (it is a function of the carry) and every later copy and the outer loop stop: the
final carry is the original's for every trip count, 0 trips and counts ``k`` does not
divide included, and each copy runs the body's own equations on the same values.

How each copy after the first is guarded depends on what the body holds:

* **selected** (a body holding no loop of unknown trips and no host callback): each copy
  runs the body and keeps its result where the condition holds,
  ``c = select(cond(c), body(c), c)``. No branch: the copies fuse as one straight-line
  body, as a scan's unrolled trips do. Once the loop has stopped, the last trip's later
  copies compute the body on the final carry and drop it: at most ``k - 1`` runs of
  work a loop, and no value of them is kept (a division by zero or an index past a
  buffer there is computed and dropped; XLA traps neither). On a GPU this is the only
  form that saves anything: a ``cond`` copies its predicate to the host as the loop's
  own test does.
* **under ``lax.cond``** (a body holding a ``while`` loop or a host callback, at any
  depth, the JVP rules of its ``custom_jvp`` calls included):
  ``c = lax.cond(cond(c), body, identity, c)`` runs the body only while the loop would,
  so a stopped loop does no extra work: an inner ``while`` run on a finished state need
  not stop, and a callback must not be called on it.

Under ``vmap``, where lanes stop at different trips, JAX turns a batched ``cond`` into
the select itself, as it does the loop's own predicate; a loop already vmapped (its
condition has a value per lane) runs ``k`` trips per trip, each updating the lanes
whose condition holds, as the loop does (such a loop whose body would need
``lax.cond`` is left alone). Bodies without effects only (see below), so running a copy
or not is the only difference the guard can make.

Between selected copies, the carries the condition reads, and those the body computes
them from, pass an optimization barrier: XLA's simplifier would otherwise fold one
copy's arithmetic into the next (``(t + h) + h`` into ``t + 2h``) and a loop testing a
float sum (``t < t1``, or a flag ``t >= t1``) would stop a trip early. The other
carries differ from the loop's by rounding at most.

Whether it pays is for the device to say (the measured candidates of ``_tune``): the
copies save trips of the loop's control and let XLA fuse across copies, and add a
select or a ``cond`` each. No target turns it on by default.

Example::

    new, decisions = unroll_while_loops(jax.make_jaxpr(solve)(y0), k=4)
    [d.kind for d in decisions]            # ["unrolled"]

Sharp edges:
  * Only the outermost ``while`` loops are rewritten: one in another loop's body or
    condition is left alone (its copies would multiply with the outer loop's).
    A ``while`` in a ``scan``'s body is outermost.
  * Left alone: loops with effects (ordered effects, ``io_callback``,
    ``jax.debug.print``), loops the user placed (frontend attributes), and loops
    whose ``k`` copies of body and condition would hold more than
    ``MAX_UNROLLED_EQNS`` equations.
  * A loop under ``vmap`` whose body holds a ``while`` loop or a host callback is left
    alone (its copies select lanes; a lane's copies past its stop would run them).
  * Reading the body's ``custom_jvp`` rules (two deep: ``RULE_DEPTH``) traces them,
    as a ``jvp`` would: a rule's Python side effects run once even where nothing is
    differentiated. A rule with ``symbolic_zeros=True`` is not read (its copies run
    under ``lax.cond``); a third-order ``jvp`` runs rules not read.
  * Selected copies past the stop compute and drop their values: ``checkify``'s
    index and division checks applied around the decorated function see them (an
    error the loop as written does not raise). ``unroll_while=None`` (or
    ``measure=False``, where no target turns it on) for such checks.
  * Counting ``fori_loop``s with static bounds are scans by now (``make_loops_static``
    runs first); scans are ``unroll_scans``' business.
  * The rewritten loop is emitted under the name scope ``WHILE_SCOPE``, which marks
    it as done (running the passes again changes nothing).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import _compat, _ops
from .._analysis import Analysis
from .._compat import JaxprEqn
from .._program.primitives import CUSTOM_JVP_CALL, HOST_CALLBACKS, WHILE
from ._loop_candidates import MAX_UNROLLED_EQNS
from ._protocol import (
    WHILE_SCOPE,
    DecisionKind,
    EmitFn,
    Level,
    LevelResult,
    PassDecision,
    Rewrite,
    decision,
)
from ._splice import evaluate


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: ``settings.unroll_while`` guarded copies of the body per trip for
    every outermost ``while`` of one level that may take them."""
    copies = analysis.settings.unroll_while
    if copies is None:
        return LevelResult()
    eqns, path = level.eqns, level.path
    rewrites: list[Rewrite] = []
    decisions: list[PassDecision] = []
    nested = _inside_while(path)
    for index, eqn in enumerate(eqns):
        if eqn.primitive.name != WHILE:
            continue
        branching = None if nested else _needs_branch(_compat.while_info(eqn).body_jaxpr)
        why = ("it is inside another while loop: only the outermost while loops are "
               "unrolled" if nested else _refusal(eqn, copies, branching))
        if why is not None:
            decisions.append(decision(path, DecisionKind.LEFT_ALONE, eqns, [index],
                                      trips_before=None, trips_after=None, unroll=1,
                                      reason=f"unroll_while={copies}: left alone: {why}"))
            continue
        guard = (f"under the loop's condition (lax.cond: the body holds {branching})"
                 if branching else "selected by the loop's condition (computed past the "
                 f"stop and dropped: at most {copies - 1} runs a loop)")
        rewrites.append(Rewrite((index,), _copies_emitter(eqn, copies, branching is None)))
        decisions.append(decision(
            path, DecisionKind.UNROLLED, eqns, [index], trips_before=None, trips_after=None,
            unroll=copies, reason=f"unroll_while={copies} requested: each trip runs the body "
                                  f"{copies} times, each copy after the first {guard}: "
                                  f"unroll by {copies}"))
    return LevelResult(rewrites, decisions)


def _inside_while(path: str) -> bool:
    """Whether the level at ``path`` is (inside) a ``while``'s body or condition."""
    return any(part.split("#", 1)[0] == WHILE for part in path.split("/") if "#" in part)


def _refusal(eqn: JaxprEqn, copies: int, branching: str | None) -> str | None:
    """Why the ``while`` ``eqn`` keeps one body per trip, or None; ``branching`` is what
    in its body must not run past the stop (``_needs_branch``)."""
    if eqn.effects:
        return (f"the loop has effects ({', '.join(sorted(map(str, eqn.effects)))}): a "
                "callback or print inside it is left as written")
    if WHILE_SCOPE in str(eqn.source_info.name_stack):
        return "it already runs guarded copies of its body"
    if _ops.has_frontend_attributes(eqn):
        return "it carries frontend attributes (a placement the user chose)"
    info = _compat.while_info(eqn)
    if branching is not None and _per_lane(info):
        return (f"its condition has a value per lane (a loop under vmap) and its body holds "
                f"{branching}: the copies select lanes, so a lane's copies past its stop "
                "would run it")
    body = len(_compat.open_jaxpr(info.body_jaxpr)[0].eqns)
    cond = len(_compat.open_jaxpr(info.cond_jaxpr)[0].eqns)
    size = copies * body + (copies - 1) * cond
    if size > MAX_UNROLLED_EQNS:
        return (f"its body holds {body} equations and its condition {cond}: {copies} copies "
                f"would hold {size}, more than {MAX_UNROLLED_EQNS}")
    return None


# How deep ``_needs_branch`` reads ``custom_jvp`` rules: the rules a ``jvp`` of the
# program runs (1), and the rules within those a ``jvp`` of that runs (2: forward over
# forward, a Hessian by ``jacfwd(jacfwd)``). Deeper orders run rules not read.
RULE_DEPTH = 2


def _needs_branch(jaxpr: Any, rules: int = RULE_DEPTH) -> str | None:
    """What in the body ``jaxpr`` (at any depth, and the JVP rules of its ``custom_jvp``
    calls, ``rules`` deep: a ``jvp`` of the program runs them) must not run past the
    loop's stop, in words ("a while loop", "a host callback"), or None: its copies may
    be selected. The depth ends the reading: a rule commonly calls its own function
    (``return f(x), ...``, as ``jax.nn.relu``'s does)."""
    for eqn in _compat.open_jaxpr(jaxpr)[0].eqns:
        if eqn.primitive.name == WHILE:
            return "a while loop, whose trips on a stopped state need not end"
        if eqn.primitive.name in HOST_CALLBACKS:
            return "a host callback, not to be called past the loop's stop"
        subs = [(sub, rules) for _, _, sub in _compat.eqn_subjaxprs(eqn)]
        if rules and eqn.primitive.name == CUSTOM_JVP_CALL:
            if eqn.params.get("symbolic_zeros"):
                return ("a custom_jvp call with symbolic zeros (its rule may run other "
                        "code for each pattern of zero tangents)")
            rule = _compat.custom_jvp_rule(eqn)
            if rule is None:
                return "a custom_jvp call whose JVP rule could not be read"
            subs.append((rule[0], rules - 1))
        for sub, depth in subs:
            found = _needs_branch(sub, depth)
            if found is not None:
                return found
    return None


def _tested_carries(info: Any) -> tuple[bool, ...]:
    """Per carry of the ``while`` (``info``: its ``WhileInfo``), whether the loop's
    condition reads it, or the body computes a carry the condition reads from it (the
    closure: a flag ``done = t >= t1`` makes ``t`` tested too)."""
    condition = _compat.open_jaxpr(info.cond_jaxpr)[0]
    read = {v for eqn in condition.eqns for v in eqn.invars if not _compat.is_literal(v)}
    read.update(v for v in condition.outvars if not _compat.is_literal(v))
    tested = [v in read for v in condition.invars[info.cond_nconsts:]]
    body = _compat.open_jaxpr(info.body_jaxpr)[0]
    sources: dict[Any, frozenset[int]] = {
        v: frozenset({i}) for i, v in enumerate(body.invars[info.body_nconsts:])}
    for eqn in body.eqns:  # which carries each value reads (a call: all its operands)
        found = frozenset().union(*(sources.get(v, frozenset()) for v in eqn.invars
                                    if not _compat.is_literal(v)))
        sources.update((v, found) for v in eqn.outvars)
    reads = [sources.get(v, frozenset()) if not _compat.is_literal(v) else frozenset()
             for v in body.outvars]
    pending = [i for i, t in enumerate(tested) if t]
    while pending:
        for source in reads[pending.pop()]:
            if not tested[source]:
                tested[source] = True
                pending.append(source)
    return tuple(tested)


def _copies_emitter(eqn: JaxprEqn, copies: int, selected: bool) -> EmitFn:
    """The ``while`` ``eqn`` as a ``while`` of the same condition whose body runs the
    original body once and then ``copies - 1`` times guarded by the condition: each
    copy's result selected where it holds (``selected``), or the copy run under
    ``lax.cond`` of it (see the module docstring). A condition with a value per lane (a
    ``while`` under ``vmap``: the loop runs while any lane's holds, and a trip updates
    the lanes whose condition holds) gets ``copies`` such trips per trip, each
    selecting its lanes as the loop does."""
    info = _compat.while_info(eqn)

    def emit(invals: list[list[Any]]) -> list[list[Any]]:
        (operands,) = invals
        cond_consts = operands[:info.cond_nconsts]
        body_consts = operands[info.cond_nconsts:info.cond_nconsts + info.body_nconsts]
        init = operands[info.cond_nconsts + info.body_nconsts:]

        def cond(carry: list[Any]) -> Any:
            (go,) = evaluate(info.cond_jaxpr, *cond_consts, *carry)
            return go

        def body(carry: list[Any]) -> list[Any]:
            return list(evaluate(info.body_jaxpr, *body_consts, *carry))

        def body_copies(carry: list[Any]) -> list[Any]:
            carry = body(carry)
            for _ in range(copies - 1):
                carry = (selected_step(_settled(carry, tested)) if selected else
                         lax.cond(cond(carry), body, list, carry))
            return carry

        def selected_step(carry: list[Any]) -> list[Any]:
            """One copy, its result kept where (in the lanes where) the condition holds."""
            go = cond(carry)
            return [_where(go, new, old) for new, old in zip(body(carry), carry, strict=True)]

        def lanes_copies(carry: list[Any]) -> list[Any]:
            for copy in range(copies):
                carry = selected_step(_settled(carry, tested) if copy else carry)
            return carry

        with _compat.eqn_context(eqn), jax.named_scope(WHILE_SCOPE):
            if lanes:
                final = lax.while_loop(lambda c: jnp.any(cond(c)), lanes_copies, list(init))
            else:
                final = lax.while_loop(cond, body_copies, list(init))
        return [list(final)]

    lanes = _per_lane(info)
    tested = _tested_carries(info)
    return emit


def _per_lane(info: Any) -> bool:
    """Whether the ``while``'s condition has a value per lane (a loop under ``vmap``)."""
    predicate = _compat.open_jaxpr(info.cond_jaxpr)[0].outvars[0]
    return getattr(predicate.aval, "shape", ()) != ()


def _settled(carry: list[Any], tested: tuple[bool, ...]) -> list[Any]:
    """``carry`` with the values the condition reads and those they are computed from
    (``tested``, ``_tested_carries``) behind an optimization barrier: XLA's simplifier
    then cannot fold one copy's arithmetic on them into the next (``(t + h) + h`` into
    ``t + 2h``), so the condition sees the values the loop's own trips compute, and a
    test of a float sum (``t < t1``) stops on ``jax.jit``'s trip. The barrier goes
    before fusion: the copies still fuse. Only those values: the rest differ from the
    loop's by rounding at most (as any fused rewrite), and barriers on a body's
    matrices made a TPU v5e's compile of four RK4 copies run for minutes."""
    held = lax.optimization_barrier([c for c, t in zip(carry, tested, strict=True) if t])
    kept = iter(held)
    return [next(kept) if t else c for c, t in zip(carry, tested, strict=True)]


def _where(go: Any, new: Any, old: Any) -> Any:
    """``new`` where ``go`` holds, else ``old``: ``go`` a scalar (the loop's condition), or
    a predicate per lane (the leading axes: what a ``while`` of a per-lane condition does
    to its carry each trip)."""
    if go.ndim:
        go = lax.broadcast_in_dim(go, new.shape, tuple(range(go.ndim)))
    return lax.select(go, new, old)
