"""Planning phase 5 (target ``"gpu"``): pricing a stream section: does cutting the program
here pay?

The planner proposes sections (regions meant to overlap); this module says what
one is expected to win or cost on the compiled GPU program, from what XLA:GPU is
known to do with stream-annotated calls (``docs/xla.md``, from
"Stream-annotated calls" to "CUDA graphs"):

* **Overlap won.** Streams share one device: running two regions side by side
  hides the fixed latency of their kernels (the cost model's per-kernel floor),
  never their work (flops at peak, bytes at full bandwidth), and one host thread
  still launches every kernel (``launch_s`` each, ``node_s`` in a CUDA graph).
  The pair takes ``max(longest region, total work, total launches)`` instead of the
  sum, the same model as the compiled-schedule estimate (``jaxpar._compiled.estimate``) that
  judges it.
* **What the cut costs.** A call is a fusion barrier: an elementwise producer
  outside feeding a region (or an elementwise consumer outside reading a region's
  elementwise result) becomes a kernel of its own. Before jax 0.11 a multi-result
  region is packed (a concatenate plus one slice per result).
* **What XLA would have done.** ``DotMerger`` merges mutually independent dots
  that share an operand into one GEMM; a cut between them forfeits that, so such
  a section is refused.
* **Host syncs.** A ``cond`` or a ``while`` without a known trip count blocks the
  host thread, so the other region is launched only after it: refused.
* **Serialised by the scheduler.** XLA overlaps regions only when one instruction
  reads results of all of them; read apart, each start lands right before its done:
  refused.
* **CUDA graphs** (command buffers, on by default). In XLA's default ``LHS``
  scheduling mode a captured region is chained serially with everything else, so
  its stream overlap is lost; in ``CONCURRENT`` mode the graph already overlaps
  independent kernels by itself. Either way a capturable section wins nothing
  and costs its fusion barriers. A region holding a ``while`` is not captured: it
  keeps its overlap, but its loop body then launches kernel by kernel on every
  trip. The mode is read from ``XLA_FLAGS`` when planning
  (``_flags.command_buffer_mode``).

Every figure (launch, graph node, kernel floor, throughput) is the GPU model's
(``jaxpar._model.gpu``), through the cost model's ``DeviceProfile.gpu``: the same
figures the compiled-schedule estimate judges with.

Example::

    verdict = price_section(jaxpr, graph, [region_a, region_b], costs,
                            mode=command_buffer_mode())
    verdict.pays, verdict.reason

Sharp edges:
  * The graph-capture rules are read from XLA's source, not yet confirmed on a
    GPU (``docs/gpu_evidence.md``, section 5); ``benchmarks/gpu.sh`` measures them.
  * Convolutions count as capturable (cuDNN calls are a default command type), as
    the compiled-schedule estimate assumes.

The phase's entry is ``price_regions``: it names the dots outside the section that
XLA's ``DotMerger`` could merge with a region's dot (heavy equations neither in,
feeding, nor fed by the section) and hands the regions to ``price_section``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from .. import _compat
from .._compat import Atom, Jaxpr, JaxprEqn
from .._model.cost import CostModel
from .._model.gpu import CommandBufferMode, GpuProfile
from .._program.graph import DisjointSets, Graph, reachable
from .._program.primitives import (
    COND,
    DOT_GENERAL,
    HOST_BLOCKING,
    IDENTITIES,
    LAYOUT_ONLY,
    NOT_CAPTURED,
    SCAN,
    TRANSPARENT_CALLS,
    WHILE,
)
from .._program.structure import StructuralKeys
from .heavy import HeavyOrder
from .regions import RegionSet

# DotMerger merges candidates up to this size (operands plus output), since jax 0.9.2.
DOT_MERGER_BYTES = 64 * 2**20

@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """What a section is expected to do to the compiled GPU program."""

    pays: bool
    gain_seconds: float  # device time won by overlapping the regions
    cost_seconds: float  # time added by the cut (kernels, lost graph capture)
    added_kernels: int
    reason: str


def _heavy_work(eqn: JaxprEqn, costs: CostModel, outer: dict[Any, Any], keys: StructuralKeys
                ) -> Iterator[tuple[Any, ...]]:
    """Keys of the kernels ``eqn`` launches on values of the level (through plain calls).

    ``outer`` maps a nested body's input variables to the level's variables. Two keys are
    equal when XLA's CSE, which sees through calls, would compute the kernel once.
    """
    name = eqn.primitive.name
    subs = list(_compat.eqn_subjaxprs(eqn))
    if subs:
        if name not in TRANSPARENT_CALLS:
            return
        inner, _ = _compat.open_jaxpr(subs[0][2])
        if len(inner.invars) != len(eqn.invars):
            return
        mapping = {v: outer.get(a, a) for v, a in zip(inner.invars, eqn.invars, strict=True)
                   if not _compat.is_literal(a)}
        for inner_eqn in inner.eqns:
            (source,) = inner_eqn.invars if len(inner_eqn.invars) == 1 else (None,)
            if inner_eqn.primitive.name in IDENTITIES and source in mapping:
                mapping[inner_eqn.outvars[0]] = mapping[source]  # XLA drops these
                continue
            yield from _heavy_work(inner_eqn, costs, mapping, keys)
        return
    if costs.eqn_cost(eqn).kernels <= 0 or eqn.effects:
        return
    operands = []
    for a in eqn.invars:
        if _compat.is_literal(a) or a not in outer:
            return  # computed inside the call: not comparable across calls here
        operands.append(id(outer[a]))
    yield (name, keys.equation(eqn), tuple(operands))


def _walk_eqns(eqn: JaxprEqn) -> Any:
    yield eqn
    for _, _, sub in _compat.eqn_subjaxprs(eqn):
        inner, _ = _compat.open_jaxpr(sub)
        for inner_eqn in inner.eqns:
            yield from _walk_eqns(inner_eqn)


def _work_seconds(eqn: JaxprEqn, costs: CostModel) -> float:
    """The part of ``eqn``'s time that is work (flops and bytes), not kernel latency."""
    cost = costs.eqn_cost(eqn)
    return cost.flops / costs.profile.peak_flops + cost.bytes / costs.profile.bandwidth


def _gpu(costs: CostModel) -> GpuProfile:
    gpu = costs.profile.gpu
    if gpu is None:
        raise ValueError(f"price_section prices for a GPU; the cost model is for "
                         f"{costs.profile.name!r}. Use "
                         f"CostModel(targets.device_profile('gpu', ...)).")
    return gpu


def _launch_penalty(eqn: JaxprEqn, costs: CostModel) -> float:
    """Device time lost when ``eqn``'s kernels launch one by one instead of from a graph.

    A launch costs the host the GPU's ``launch_s`` (a chain graph's node ``chain_node_s``); the
    device waits only for the part a kernel does not cover by running. Loop bodies
    count once per trip.
    """
    name = eqn.primitive.name
    subs = [sub for _, _, sub in _compat.eqn_subjaxprs(eqn)]
    if subs:
        inner = [sum(_launch_penalty(e, costs) for e in _compat.open_jaxpr(sub)[0].eqns)
                 for sub in subs]
        if name == COND:
            return max(inner)
        if name == SCAN:
            return _compat.scan_length(eqn) * sum(inner)
        if name == WHILE:
            cost = costs.eqn_cost(eqn)
            body = costs.jaxpr_cost(eqn.params["body_jaxpr"]) + costs.jaxpr_cost(
                eqn.params["cond_jaxpr"])
            trips = cost.kernels / body.kernels if body.kernels else 1.0
            return trips * sum(inner)
        return sum(inner)
    cost = costs.eqn_cost(eqn)
    if cost.kernels <= 0:
        return 0.0
    each = costs.seconds(cost) / cost.kernels
    gpu = _gpu(costs)
    return cost.kernels * (max(gpu.launch_s - each, 0.0) - max(gpu.chain_node_s - each, 0.0))


def _is_light(eqn: JaxprEqn, costs: CostModel) -> bool:
    """Fusible work (elementwise or layout): launches no kernel of its own (and holds no
    jaxpr). ``launches`` is ``eqn_cost(eqn).kernels > 0``, decided from the rule where
    the rule fixes it."""
    return not costs.subjaxprs(eqn) and not costs.launches(eqn)


def _split_clusters(eqns: Sequence[JaxprEqn], graph: Graph, owner: dict[int, int],
                    costs: CostModel) -> int:
    """Kernels added by cutting fusion clusters: per cluster, its sides minus one."""
    light = {i for i in graph.live if _is_light(eqns[i], costs)}
    clusters = DisjointSets(graph.size)
    for i in light:
        for p in graph.preds[i]:
            if p in light:
                clusters.union(p, i)
    sides: dict[int, set[int]] = {}
    for i in light:
        sides.setdefault(clusters.find(i), set()).add(owner.get(i, -1))
    return sum(len(owners) - 1 for owners in sides.values() if len(owners) > 1)


def _dot_source(eqns: Sequence[JaxprEqn], producer: dict[Any, int], var: Atom) -> Atom:
    """The variable a dot operand comes from through layout-only equations."""
    seen = 0
    while not _compat.is_literal(var) and var in producer and seen < 16:
        eqn = eqns[producer[var]]
        if eqn.primitive.name not in LAYOUT_ONLY or len(eqn.invars) != 1:
            break
        var = eqn.invars[0]
        seen += 1
    return var


def _writers(eqns: Sequence[JaxprEqn]) -> dict[Any, int]:
    """Which equation writes each variable of a level (``_dot_source`` reads it)."""
    return {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars
            if not _compat.is_drop_var(v)}


def _dot_bytes(eqn: JaxprEqn) -> int:
    return sum(_compat.aval_nbytes(v.aval) for v in [*eqn.invars, *eqn.outvars]
               if not _compat.is_literal(v))


def price_section(jaxpr: Jaxpr, graph: Graph, regions: Sequence[Sequence[int]],
                  costs: CostModel, *, mode: CommandBufferMode, min_gain_seconds: float = 0.0,
                  independent_dots: Sequence[int] = (),
                  keys: StructuralKeys | None = None) -> Verdict:
    """The expected effect of emitting ``regions`` of one level as one stream section.

    Args:
        jaxpr: the level (open jaxpr) the indices refer to.
        graph: its dependency graph.
        regions: each region's equation indices.
        costs: the GPU's cost model (``device_profile("gpu", ...)``).
        mode: the CUDA-graph mode (``_flags.command_buffer_mode()``).
        min_gain_seconds: the least net gain that counts as paying.
        independent_dots: ``dot_general`` equations outside the regions that are
            independent of them (``DotMerger`` could merge them with a region's dot).
        keys: the call's structural keys (``Analysis.structural_keys``), so equations
            the passes already keyed are not keyed again; default a fresh set.

    Returns:
        A ``Verdict``.

    Raises:
        ValueError: ``costs`` is not a GPU's cost model, or ``mode`` is not a mode.
    """
    _gpu(costs)
    mode = CommandBufferMode.parse(mode, "mode")
    eqns = jaxpr.eqns
    owner = {i: r for r, members in enumerate(regions) for i in members}

    # What XLA would have done that the cut forbids, and host syncs: refuse outright.
    refusal = _merged_dots_refusal(eqns, regions, independent_dots)
    if refusal is None:
        keys = StructuralKeys() if keys is None else keys
        refusal = _twins_refusal(eqns, regions, costs, keys)
    if refusal is None:
        refusal = _host_blocking_refusal(eqns, regions, costs)
    if refusal is not None:
        return refusal

    # XLA's scheduler overlaps two regions only when one instruction consumes results of
    # both (a concatenate, a fused add, the program's outputs); read apart, each region's
    # start lands right before its done (docs/design.md, "When XLA overlaps stream
    # regions", seen in deviceless H200 schedules).
    readers = []
    for members in regions:
        inside = set(members)
        found = {s for i in members for s in graph.succs[i] if s not in inside}
        if any(i in graph.feeds_output for i in members):
            found.add(-1)
        readers.append(found)
    if not set.intersection(*readers):
        return Verdict(False, 0.0, 0.0, 0,
                       "no one instruction reads the results of all its regions, so XLA "
                       "schedules each region's start right before its done: they would "
                       "not overlap")

    net, gain, cost, added, why, host_bound = _overlap(eqns, graph, regions, owner, costs, mode)
    if net > max(min_gain_seconds, 0.0):
        # A cut must pay at the pessimistic end of the GPU model's ranges too.
        low = _overlap(eqns, graph, regions, owner, costs.at(PESSIMISTIC), mode)
        if low[0] > max(min_gain_seconds, 0.0):
            return Verdict(True, gain, cost, added,
                           f"overlap wins est. {gain * 1e6:.1f} us against {cost * 1e6:.1f} "
                           f"us for {added} kernels the cut adds (est. {low[1] * 1e6:.1f} "
                           f"against {low[2] * 1e6:.1f} us at the pessimistic end of the "
                           "GPU model's ranges)")
        _, gain, cost, added, _, _ = low
        return Verdict(False, gain, cost, added,
                       f"overlap would win est. {gain * 1e6:.1f} us against "
                       f"{cost * 1e6:.1f} us at the pessimistic end of the GPU model's "
                       "ranges (dear launches, cheap kernel floors): it cannot be told to "
                       "pay")
    if why:
        reason = (f"{why}, so it would win nothing and cost est. {cost * 1e6:.1f} us "
                  f"({added} kernels the cut adds); with command buffers off "
                  "(XLA_FLAGS=--xla_gpu_enable_command_buffer=) the overlap could pay")
    elif gain <= 0.0 and host_bound is not None:
        reason = (f"one host thread launches the regions' kernels one by one (est. "
                  f"{host_bound * 1e6:.1f} us of launches), so running them side by side "
                  "wins nothing")
    elif gain <= 0.0:
        reason = ("the regions' work already fills the GPU (their kernels' fixed latency is "
                  "all overlap could hide), so running them side by side wins nothing")
    else:
        reason = (f"overlap would win est. {gain * 1e6:.1f} us but the cut costs "
                  f"{cost * 1e6:.1f} us ({added} kernels it adds, launches outside graphs)")
    return Verdict(False, gain, cost, added, reason)


def _merged_dots_refusal(eqns: Sequence[JaxprEqn], regions: Sequence[Sequence[int]],
                         independent_dots: Sequence[int]) -> Verdict | None:
    """``price_section``'s refusal where a cut splits matmuls XLA merges (DotMerger)."""
    producer = _writers(eqns)
    sources: dict[Any, tuple[int, int]] = {}  # operand source -> (dot, region or -1)
    placed = [(i, r) for r, members in enumerate(regions) for i in members]
    for i, r in [*placed, *((i, -1) for i in independent_dots)]:
        eqn = eqns[i]
        if eqn.primitive.name != DOT_GENERAL or _dot_bytes(eqn) > DOT_MERGER_BYTES:
            continue
        for operand in eqn.invars:
            source = _dot_source(eqns, producer, operand)
            if _compat.is_literal(source):
                continue
            seen = sources.setdefault(source, (i, r))
            if seen[0] != i and seen[1] != r:
                return Verdict(False, 0.0, 0.0, 0,
                               f"equations {seen[0]} and {i} are matmuls sharing an operand, "
                               "which XLA merges into one GEMM (DotMerger); a stream cut "
                               "between them would split it")
    return None


def _twins_refusal(eqns: Sequence[JaxprEqn], regions: Sequence[Sequence[int]],
                   costs: CostModel, keys: StructuralKeys) -> Verdict | None:
    """``price_section``'s refusal where two regions compute the same heavy work, which
    XLA computes once (CSE)."""
    twins: dict[tuple[Any, ...], tuple[int, int]] = {}
    for r, members in enumerate(regions):
        for i in members:
            level_vars = {a: a for a in eqns[i].invars if not _compat.is_literal(a)}
            for key in _heavy_work(eqns[i], costs, level_vars, keys):
                seen = twins.setdefault(key, (i, r))
                if seen[1] != r:
                    return Verdict(False, 0.0, 0.0, 0,
                                   f"equations {seen[0]} and {i} both compute `{key[0]}` of "
                                   "the same operands, which XLA computes once (CSE); in two "
                                   "stream regions each would run its own")
    return None


def _host_blocking_refusal(eqns: Sequence[JaxprEqn], regions: Sequence[Sequence[int]],
                           costs: CostModel) -> Verdict | None:
    """``price_section``'s refusal where a region holds work that blocks the host."""
    for members in regions:
        for i in members:
            for inner in _walk_eqns(eqns[i]):
                name = inner.primitive.name
                unknown_trips = name == WHILE and costs.eqn_cost(inner).unknown_trips
                # A cond on the platform (jnp's per-backend lowerings) is resolved when
                # compiling; only a cond on a traced value runs as a conditional.
                on_platform = name == COND and inner.params.get("branches_platforms")
                if (name in HOST_BLOCKING and not on_platform) or unknown_trips:
                    return Verdict(False, 0.0, 0.0, 0,
                                   f"equation {i} holds a `{name}` that blocks the host "
                                   "thread, so the other region would be launched only "
                                   "after it finishes")
    return None


def price_collective_section(jaxpr: Jaxpr, graph: Graph, region: Sequence[int],
                             costs: CostModel, *, mode: CommandBufferMode) -> Verdict:
    """The expected effect of running ``region`` on a stream beside a collectives group.

    It wins nothing against ``jax.jit``'s program: XLA:GPU's collectives are
    asynchronous, and its latency-hiding scheduler already places main-stream compute
    independent of a transfer between the transfer's start and its done (the plain
    collective matmul compiled deviceless for 8 H200s: every matmul beside a
    transfer). What the cut costs is priced as for any section, and where the region's
    matmuls share an operand with independent matmuls outside it (a collective matmul's
    per-step matmuls all read the local block of ``w``), XLA's ``DotMerger`` merges
    them into one GEMM in ``jax.jit``'s program, which the cut splits (1 matmul kernel
    there, 4 in jaxpar's).
    """
    _gpu(costs)
    mode = CommandBufferMode.parse(mode, "mode")
    eqns = jaxpr.eqns
    inside = set(region)
    _, _, cost, added, _, _ = _overlap(eqns, graph, [list(region)], dict.fromkeys(region, 0),
                                       costs, mode)
    reason = ("XLA's latency-hiding scheduler already overlaps this compute with the "
              "group's transfers in jax.jit's program (asynchronous collectives), so a "
              "stream region wins nothing")
    related = reachable(graph, region, True) | reachable(graph, region, False)
    producer = _writers(eqns)
    own = {_dot_source(eqns, producer, v) for i in region
           if eqns[i].primitive.name == DOT_GENERAL for v in eqns[i].invars}
    merged = sorted(i for i in graph.live if i not in inside and i not in related
                    and eqns[i].primitive.name == DOT_GENERAL
                    and _dot_bytes(eqns[i]) <= DOT_MERGER_BYTES
                    and any(not _compat.is_literal(source) and source in own
                            for source in (_dot_source(eqns, producer, v)
                                           for v in eqns[i].invars)))
    if merged:
        reason += (f"; its matmuls share an operand with {len(merged)} independent "
                   f"matmul{'s' * (len(merged) != 1)} outside it (first: equation "
                   f"{merged[0]}), which XLA merges into one GEMM (DotMerger) in jax.jit's "
                   "program: the cut would split them")
    reason += f"; the cut costs est. {cost * 1e6:.1f} us ({added} kernels it adds)"
    return Verdict(False, 0.0, cost, added, reason)


# The end of each uncertain GPU figure (``GpuProfile.ranges``) that favours leaving a
# section alone: dear launches and graph nodes, cheap kernel floors (less to hide).
PESSIMISTIC = {"launch_s": "high", "chain_node_s": "high", "dag_node_s": "high",
               "graph_launch_s": "high", "event_s": "high", "sync_s": "high",
               "kernel_floor_s": "low", "graph_floor_s": "low"}


def _overlap(eqns: Sequence[JaxprEqn], graph: Graph, regions: Sequence[Sequence[int]],
             owner: dict[int, int], costs: CostModel, mode: CommandBufferMode
             ) -> tuple[float, float, float, int, str, float | None]:
    """What running ``regions`` side by side wins and costs with ``costs``' figures: the
    net, the gain, the cost, the kernels the cut adds, why a captured section wins
    nothing (or ""), and the host's launching time where it bounds the section."""
    def seconds(i: int) -> float:
        return costs.seconds(costs.eqn_cost(eqns[i]))

    graphs_on = mode is not CommandBufferMode.OFF
    captured = [not any(inner.primitive.name in NOT_CAPTURED
                        for i in members for inner in _walk_eqns(eqns[i]))
                for members in regions]
    # One host thread enqueues the kernels of every region: a kernel launched on its own
    # costs it launch_s (a graph node node_s), so a region takes at least its
    # launches, and side by side the regions never finish before all their launches are
    # made (the estimate's host model, jaxpar/_compiled/estimate.py).
    gpu = _gpu(costs)
    per_launch = [gpu.node_s(mode) if graphs_on and is_captured else gpu.launch_s
                  for is_captured in captured]
    launches = [sum(costs.eqn_cost(eqns[i]).kernels for i in members) * host
                for members, host in zip(regions, per_launch, strict=True)]
    times = [max(sum(seconds(i) for i in members), launched)
             for members, launched in zip(regions, launches, strict=True)]
    busy = [sum(_work_seconds(eqns[i], costs) for i in members) for members in regions]
    launching = sum(launches)
    overlapped = max(max(times), sum(busy), launching)
    gain = max(sum(times) - overlapped, 0.0)
    why = ""
    if graphs_on and all(captured):
        default = "XLA's default " if mode is CommandBufferMode.LHS else ""
        why = ("CUDA graphs in CONCURRENT mode already overlap independent kernels"
               if mode is CommandBufferMode.CONCURRENT else
               "CUDA graphs in CONCURRENT_REGIONS mode already overlap independent small "
               "kernels, and run the rest one after another"
               if mode is CommandBufferMode.CONCURRENT_REGIONS else
               f"CUDA graphs in {default}{mode.xla_scheduling_mode} mode chain a captured "
               "region serially with everything else")
        gain = 0.0

    # What the cut adds: XLA fuses each connected cluster of light (elementwise and
    # layout) equations into one kernel; a cluster the cut divides becomes one kernel
    # per side.
    added = _split_clusters(list(eqns), graph, owner, costs)
    if _compat.PACK_MULTI_RESULT_CALLS:
        for members in regions:
            inside = set(members)
            results = sum(1 for i in members for s in graph.succs[i] if s not in inside)
            results += sum(1 for i in members if i in graph.feeds_output)
            if results > 1:
                added += 1 + results
    cost = added * costs.profile.min_kernel_seconds
    if graphs_on:
        for members, is_captured in zip(regions, captured, strict=True):
            if not is_captured:  # launched kernel by kernel, loop bodies on every trip
                cost += sum(_launch_penalty(eqns[i], costs) for i in members)
    host_bound = launching if launching >= max(max(times), sum(busy)) else None
    return gain - cost, gain, cost, added, why, host_bound


def price_regions(jaxpr: Jaxpr, graph: Graph, order: HeavyOrder, regions: RegionSet,
                  costs: CostModel, *, mode: CommandBufferMode, min_seconds: float,
                  keys: StructuralKeys | None = None) -> Verdict:
    """``price_section`` of ``regions`` (one open jaxpr level's window ``order``)."""
    mask = regions.heavy_mask
    independent_dots = [
        order.heavy[k] for k in range(len(order.heavy))
        if not (1 << k) & mask and not order.heavy_anc[k] & mask
        and not order.heavy_desc[k] & mask]
    return price_section(jaxpr, graph, [list(slot) for slot in regions.slots], costs,
                         mode=mode, min_gain_seconds=min_seconds,
                         independent_dots=independent_dots, keys=keys)
