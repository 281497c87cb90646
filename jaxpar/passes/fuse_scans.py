"""Fuse independent scans into one scan that runs their bodies side by side.

Scans of one level with no path between them in the dependency graph become
one ``lax.scan`` whose carries, xs and ys are the members' side by side and
whose consts are all the members' consts. Each trip then launches every
member's kernels, so a GPU runs one loop (one trip count, one set of
per-iteration overheads) instead of several back to back, and XLA may overlap
or multi-output-fuse the members' kernels.

* Directions: the fused scan runs in the direction most members run; a member
  running the other way gets its xs reversed before and its ys reversed after
  (``lax.rev``), which visits the same elements in the same order.
* Unequal lengths: trips are cut at every member's length. The first segment
  runs all members for the shortest length; each later segment runs the members
  still going, starting from the carries the previous segment left. A forward
  member's segment reads ``xs[start:end]``; a reverse member's first trips read
  the *end* of its xs, so its segment reads ``xs[L-end:L-start]`` and its ys
  pieces are concatenated in reverse segment order.

Example::

    def birnn(h0, xs):
        fwd = lax.scan(cell_a, h0, xs)
        bwd = lax.scan(cell_b, h0, xs, reverse=True)
        return fwd, bwd

    new_jaxpr, decisions = fuse_scans(jax.make_jaxpr(birnn)(h0, xs))
    # one scan of len(xs) trips; the backward member reads rev(xs)

Sharp edges:
  * Scans with side effects or user placement attributes are never fused.
  * With ``leave_identical=True`` two scans that ``batch_scans`` could batch are
    not fused with each other (batching them is better).
  * The fused scan's unroll factor is the members' own where they agree, else the
    largest of theirs whose unrolled fused body holds at most ``MAX_UNROLLED_EQNS``
    equations (``unroll_scans``' cap), else 1.
"""

from __future__ import annotations

from typing import Any

from jax import lax

from .. import _compat
from .._analysis import Analysis
from ._batch_members import batch_refusal, body_key
from ._level_graph import group_independent
from ._loop_candidates import MAX_UNROLLED_EQNS, loop_candidates, loop_trips
from ._protocol import DecisionKind, Level, LevelResult, Rewrite, decision
from ._splice import evaluate


def run(level: Level, analysis: Analysis) -> LevelResult:
    """The level pass: one fused scan per group of independent scans of one level.

    With ``batch_scans`` on, scans it could batch instead are not fused together.
    """
    eqns, path = level.eqns, level.path
    leave_identical = "batch_scans" in analysis.settings.passes
    candidates = [i for i in loop_candidates(eqns) if _compat.scan_info(eqns[i]).length > 0]
    if len(candidates) < 2:
        return LevelResult()
    infos = {i: _compat.scan_info(eqns[i]) for i in candidates}
    structure = analysis.structural_keys
    keys = {i: body_key(eqns[i], structure) for i in candidates} if leave_identical else {}

    def batchable(m: int, index: int) -> bool:
        return (keys[m] is not None and keys[m] == keys[index]
                and batch_refusal(eqns, [m, index]) is None)

    def compatible(group: list[int], index: int) -> bool:
        return not leave_identical or not any(batchable(m, index) for m in group)

    def prefer(group: list[int], index: int) -> tuple[int, int]:
        length = infos[index].length
        return (min(abs(infos[m].length - length) for m in group), group[0])

    groups = group_independent(level.graph, candidates, compatible, prefer)
    rewrites, decisions = [], []
    for group in groups:
        if len(group) == 1:
            (index,) = group
            trips = loop_trips(infos[index].length, infos[index].unroll)
            decisions.append(decision(
                path, DecisionKind.LEFT_ALONE, eqns, group, trips_before=trips,
                trips_after=trips, unroll=infos[index].unroll,
                reason="every other scan at this level depends on it, feeds it, or is "
                       "left for batching"))
            continue
        lengths = [infos[i].length for i in group]
        segments = _segments(lengths)
        unroll = _fused_unroll([infos[i] for i in group])
        rewrites.append(Rewrite(tuple(group), _fused_emitter(
            [infos[i] for i in group], unroll, eqns[group[0]])))
        directions = {infos[i].reverse for i in group}
        detail = (f"{len(group)} independent scans run side by side in one scan"
                  + (" (mixed directions: reverse members read flipped xs)"
                     if len(directions) > 1 else "")
                  + (f"; unequal lengths {lengths}: {len(segments)} chained segments"
                     if len(segments) > 1 else ""))
        decisions.append(decision(
            path, DecisionKind.FUSED, eqns, group,
            trips_before=sum(loop_trips(infos[i].length, infos[i].unroll) for i in group),
            trips_after=sum(loop_trips(end - start, min(unroll, end - start))
                            for start, end in segments),
            unroll=unroll, reason=detail))
    return LevelResult(rewrites, decisions)


def _segments(lengths: list[int]) -> list[tuple[int, int]]:
    cuts = sorted(set(lengths))
    return list(zip([0, *cuts[:-1]], cuts, strict=True))


def _fused_unroll(infos: list[_compat.ScanInfo]) -> int:
    """The fused scan's unroll factor: the members' own where they agree; else the
    largest of theirs whose unrolled fused body stays within ``MAX_UNROLLED_EQNS``
    equations, else 1.

    With 1 the fused scan would run more trips than the members did (``unroll=2`` beside
    ``unroll=3``, 12 steps each: 10 trips fused into 12, est. x1.51 on a deviceless H200
    compile with ``unroll=None``); the cap keeps a fully unrolled light member from
    unrolling a heavy one (``unroll=True`` on 200 steps beside 8 rolled matmuls took XLA:CPU
    41 s to compile, against 0.5 s for ``jax.jit``)."""
    factors = sorted({info.unroll for info in infos}, reverse=True)
    if len(factors) == 1:
        return factors[0]
    body = sum(len(_compat.open_jaxpr(info.jaxpr)[0].eqns) for info in infos)
    return next((k for k in factors if k * body <= MAX_UNROLLED_EQNS), 1)


def _fused_emitter(infos: list[_compat.ScanInfo], unroll: int, first: Any) -> Any:
    segments = _segments([info.length for info in infos])

    def emit(invals: list[list[Any]]) -> list[list[Any]]:
        with _compat.eqn_context(first):
            return _emit(invals)

    def _emit(invals: list[list[Any]]) -> list[list[Any]]:
        consts, carries, xs_full = [], [], []
        for info, operands in zip(infos, invals, strict=True):
            split = info.num_consts + info.num_carry
            consts.append(list(operands[:info.num_consts]))
            carries.append(list(operands[info.num_consts:split]))
            xs_full.append(list(operands[split:]))
        ys_pieces: list[list[list[Any]]] = [[] for _ in infos]
        for start, end in segments:
            active = [k for k, info in enumerate(infos) if info.length >= end]
            reverse_votes = sum(infos[k].reverse for k in active)
            reverse = 2 * reverse_votes > len(active)
            seg_xs = []
            for k in active:
                info = infos[k]
                lo, hi = ((info.length - end, info.length - start) if info.reverse
                          else (start, end))
                xs = [x if (lo, hi) == (0, info.length) else lax.slice_in_dim(x, lo, hi)
                      for x in xs_full[k]]
                if info.reverse != reverse:
                    xs = [lax.rev(x, (0,)) for x in xs]
                seg_xs.append(xs)

            def step(carry: list[list[Any]], x: list[list[Any]], active: list[int] = active
                     ) -> tuple[list[list[Any]], list[list[Any]]]:
                new_carry, ys = [], []
                for slot, k in enumerate(active):
                    outs = evaluate(infos[k].jaxpr, *consts[k], *carry[slot], *x[slot])
                    new_carry.append(outs[:infos[k].num_carry])
                    ys.append(outs[infos[k].num_carry:])
                return new_carry, ys

            final, ys = lax.scan(step, [carries[k] for k in active], seg_xs,
                                 length=end - start, reverse=reverse,
                                 unroll=min(unroll, end - start))
            for slot, k in enumerate(active):
                carries[k] = list(final[slot])
                piece = list(ys[slot])
                if infos[k].reverse != reverse:
                    piece = [lax.rev(y, (0,)) for y in piece]
                ys_pieces[k].append(piece)
        results: list[list[Any]] = []
        for k, info in enumerate(infos):
            pieces = ys_pieces[k][::-1] if info.reverse else ys_pieces[k]
            num_ys = len(pieces[0])
            joined: list[Any] = [pieces[0][j] if len(pieces) == 1
                  else lax.concatenate([p[j] for p in pieces], 0) for j in range(num_ys)]
            results.append([*carries[k], *joined])
        return results

    return emit
