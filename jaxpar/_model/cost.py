"""Cost model: estimated device time of each jaxpr equation.

The planner only needs to know which equations are worth a stream of their
own, so the model is a roofline with a per-kernel floor::

    seconds = kernels * min_kernel_seconds + flops / peak_flops + bytes / bandwidth

Loops multiply their body by the trip count, ``cond`` takes its dearest
branch, and every other equation with nested jaxprs sums them, through one
generic recursion over every jaxpr-valued parameter.

On target ``"gpu"`` the figures are the GPU model's (``jaxpar._model.gpu``: a dot's
peak is the tensor-core peak at JAX's default float32 precision, the floor its
``kernel_floor_s``); each target's profile is its module's (``jaxpar.targets``).

Example::

    costs = CostModel(targets.device_profile("gpu"))
    cost = costs.eqn_cost(eqn)          # Cost(flops=..., bytes=..., kernels=...)
    cost.seconds(costs.profile)

Sharp edges:
  * Elementwise equations launch no kernel of their own: XLA fuses them into a
    neighbour. A region made only of elementwise work is therefore cheap.
  * ``while_loop`` with a traced bound has an unknown trip count; it is costed
    as one trip and flagged (``Cost.unknown_trips``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import _compat
from .._compat import JaxprEqn, JaxprLike
from .._memo import IdentityMemo
from .._program import primitives as _primitives
from .._program.loops import static_trip_count
from ..targets.profile import DeviceProfile as DeviceProfile
from .gpu import MIN_GRAPH_SIZE, CommandBufferMode


@dataclasses.dataclass(frozen=True, slots=True)
class Cost:
    """Work of one equation (or many, added up)."""

    flops: float = 0.0
    bytes: float = 0.0
    kernels: float = 0.0
    unknown_trips: bool = False
    # Time no figure above accounts for: a TPU loop trip's fixed part (``targets.tpu_model``).
    extra_seconds: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes,
                    self.kernels + other.kernels, self.unknown_trips or other.unknown_trips,
                    self.extra_seconds + other.extra_seconds)

    def scale(self, factor: float) -> Cost:
        return Cost(self.flops * factor, self.bytes * factor, self.kernels * factor,
                    self.unknown_trips, self.extra_seconds * factor)

    def seconds(self, profile: DeviceProfile) -> float:
        return (self.kernels * profile.min_kernel_seconds + self.flops / profile.peak_flops
                + self.bytes / profile.bandwidth + self.extra_seconds)


ZERO = Cost()


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchPrices:
    """What one kernel launch costs a level in a CUDA-graph mode, for the passes that
    trade launches (the batching passes): the GPU model's figures (``_model.gpu``),
    read as ``jaxpar._plan.modes`` and ``jaxpar._compiled.estimate`` read them.

    Attributes:
      beside: a kernel that runs beside the other members of its batched group (at
        one launch depth). In a serial chain (``lhs``, ``serialize``, no graph) it costs
        its kernel floor; in a ``concurrent`` graph the members' floors overlap, and it
        costs its graph node on the host only.
      serial: a kernel in series with the rest (the stacking before a batched op, the
        slicing after it): its kernel floor, plus its graph node in a ``concurrent``
        graph.
    """

    beside: float
    serial: float


# The figures a launch's price reads, and the ends a batching decision must win at: the
# GPU model's figures are uncertain (``GpuProfile.ranges``), so a rewrite that trades
# launches for bytes is made only where it pays at both ends of their ranges.
PRICED_FIGURES = ("kernel_floor_s", "graph_floor_s", "chain_node_s", "dag_node_s")
ENDS = ("low", "high")


def launch_pricing(mode: CommandBufferMode | None) -> str:
    """How ``mode`` prices launches: ``"beside"`` (a branching graph's small members
    overlap) or ``"serial"``; two modes of one pricing batch the same."""
    return "beside" if mode is not None and mode.branching else "serial"


def launch_prices(profile: DeviceProfile, mode: CommandBufferMode | None,
                  level_kernels: float, end: str | None = None,
                  serial_kernels: bool = False) -> LaunchPrices:
    """The ``LaunchPrices`` of a level launching ``level_kernels`` kernels compiled in
    ``mode`` (None: no CUDA graphs to speak of, off the GPU), with the GPU's uncertain
    figures at ``end`` (``"low"``, ``"high"``; None: their nominal values). A kernel in a
    CUDA graph (any mode but ``off``) costs the graph's floor, one launched alone the
    device's; only a branching graph (``concurrent``, ``concurrent_regions``; at least
    ``MIN_GRAPH_SIZE`` kernels) runs a batched group's members side by side, and only the small
    ones: ``serial_kernels`` (dots, convolutions: ``_program.primitives.SERIAL_KERNELS``) never
    overlap, so each costs its floor and its node there."""
    gpu = profile.gpu
    if gpu is None or mode is None:
        floor = profile.min_kernel_seconds
        return LaunchPrices(floor, floor)
    if end is not None:
        gpu = gpu.at(dict.fromkeys(PRICED_FIGURES, end))
    floor = gpu.floor_s(graphs=mode is not CommandBufferMode.OFF)
    if not mode.branching or level_kernels < MIN_GRAPH_SIZE:
        return LaunchPrices(floor, floor)
    node = gpu.node_s(mode)
    return LaunchPrices(floor + node if serial_kernels else node, floor + node)


CostRule = Callable[["CostModel", Any], Cost]
cost_rules: dict[str, CostRule] = {}


def register_cost_rule(*names: str) -> Callable[[CostRule], CostRule]:
    def register(rule: CostRule) -> CostRule:
        for name in names:
            cost_rules[name] = rule
        return rule
    return register


def _size_and_bytes(eqn: JaxprEqn) -> tuple[float, float]:
    """(elements of the results, bytes of the operands and results) of ``eqn``: in one
    pass over its atoms, ``_compat.aval_size`` and ``aval_nbytes`` inlined (every
    equation of a program is costed)."""
    literal, itemsize, prod = _compat.Literal, _compat.itemsize, math.prod
    nbytes = size = 0
    for v in eqn.invars:
        if not isinstance(v, literal):
            aval = v.aval
            shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
            if shape is not None and dtype is not None:
                nbytes += prod(shape) * itemsize(dtype)
    for v in eqn.outvars:
        aval = v.aval
        shape = getattr(aval, "shape", None)
        if shape is not None:
            elements = prod(shape)
            size += elements
            dtype = getattr(aval, "dtype", None)
            if dtype is not None:
                nbytes += elements * itemsize(dtype)
    return float(size), float(nbytes)


# Shape-only equations: XLA turns them into layout changes or folds them away.
@register_cost_rule(*sorted(_primitives.COST_FREE))
def _free_rule(model: CostModel, eqn: JaxprEqn) -> Cost:
    return ZERO


# Reductions, sorts, scatters, collectives, decompositions...: one kernel each.
@register_cost_rule(*sorted(_primitives.COST_ONE_KERNEL))
def _one_kernel_rule(model: CostModel, eqn: JaxprEqn) -> Cost:
    size, nbytes = _size_and_bytes(eqn)
    return Cost(flops=size, bytes=nbytes, kernels=1.0)


# Host callbacks: a custom call XLA fuses into no neighbour, so a kernel each at least (the
# round trip to the host is the GPU model's ``sync_s`` on top: ``_plan.gpu_time``).
register_cost_rule(*sorted(_primitives.HOST_CALLBACKS))(_one_kernel_rule)


@register_cost_rule(_primitives.DOT_GENERAL)
def _dot_general_rule(model: CostModel, eqn: JaxprEqn) -> Cost:
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = _compat.array_aval(eqn.invars[0]).shape
    contracted = math.prod(lhs_shape[d] for d in lhs_contract)
    size, nbytes = _size_and_bytes(eqn)
    return Cost(flops=2.0 * size * contracted, bytes=nbytes, kernels=1.0)


@register_cost_rule(_primitives.CONV)
def _conv_rule(model: CostModel, eqn: JaxprEqn) -> Cost:
    rhs_shape = _compat.array_aval(eqn.invars[1]).shape
    dims = eqn.params["dimension_numbers"]
    out_feature_dim = dims.rhs_spec[0] if dims is not None else 0
    # Every output element contracts over the kernel volume (in-features x spatial)
    # of one output feature.
    per_output = math.prod(rhs_shape) / max(rhs_shape[out_feature_dim], 1)
    size, nbytes = _size_and_bytes(eqn)
    return Cost(flops=2.0 * size * per_output, bytes=nbytes, kernels=1.0)


@register_cost_rule(_primitives.SCAN)
def _scan_rule(model: CostModel, eqn: JaxprEqn) -> Cost:
    body = model.jaxpr_cost(eqn.params["jaxpr"])
    if model.profile.trip_seconds is not None:  # a trip's fixed part: control, slices
        body = body + Cost(extra_seconds=model.profile.trip_seconds(eqn))
    return body.scale(_compat.scan_length(eqn))


@register_cost_rule(_primitives.WHILE)
def _while_rule(model: CostModel, eqn: JaxprEqn) -> Cost:
    body = model.jaxpr_cost(eqn.params["body_jaxpr"]) + model.jaxpr_cost(eqn.params["cond_jaxpr"])
    trips = known_while_trip_count(eqn)
    if trips is None:
        return dataclasses.replace(body, unknown_trips=True)
    return body.scale(trips)


@register_cost_rule(_primitives.COND)
def _cond_rule(model: CostModel, eqn: JaxprEqn) -> Cost:
    branches = [model.jaxpr_cost(b) for b in eqn.params["branches"]]
    return max(branches, key=lambda c: c.seconds(model.profile), default=ZERO)


def _default_rule(model: CostModel, eqn: JaxprEqn) -> Cost:
    nested = [model.jaxpr_cost(j) for _, _, j in model.subjaxprs(eqn)]
    if nested:
        # custom_jvp/custom_vjp/remat/jit/shard_map...: the work is the body's.
        # custom_jvp and custom_vjp keep both a primal and a rule; cost the primal.
        if eqn.primitive.name.startswith("custom_"):
            return nested[0]
        total = ZERO
        for cost in nested:
            total = total + cost
        return total
    # Elementwise and everything unknown: fused into a neighbouring kernel.
    size, nbytes = _size_and_bytes(eqn)
    if model.profile.slices_read_kept and eqn.primitive.name == _primitives.SLICE:
        # A slice reads what it keeps: a trip of a scan read by blocks slices its block.
        nbytes = 2.0 * sum(_compat.aval_nbytes(v.aval) for v in eqn.outvars)
    return Cost(flops=size, bytes=nbytes, kernels=0.0)


def known_while_trip_count(eqn: JaxprEqn) -> int | None:
    """Trip count of a counting ``while`` with constant bounds
    (``_program.loops.static_trip_count``), exactly as the loop runs it; None otherwise."""
    return static_trip_count(eqn).trips


class CostModel:
    """Memoised costs of equations and jaxprs under one device profile."""

    def __init__(self, profile: DeviceProfile):
        self.profile = profile
        self._jaxpr_costs: IdentityMemo[JaxprLike, Cost] = IdentityMemo()
        # Equations are immutable, and the passes see the same ones round after round.
        self._eqn_costs: IdentityMemo[JaxprEqn, Cost] = IdentityMemo()
        # Parameter dicts by identity: the jaxprs they hold (``subjaxprs``).
        self._nested: IdentityMemo[dict[str, Any],
                                   tuple[tuple[str, int | None, JaxprLike], ...]] = IdentityMemo()
        # The same model with the GPU's figures at ends of their ranges (``at``).
        self._ends: dict[tuple[tuple[str, str], ...], CostModel] = {}

    def at(self, ends: Mapping[str, str]) -> CostModel:
        """This cost model with the GPU's uncertain figures at ``ends``
        (``GpuProfile.at``), made once per ``ends`` and remembered (its own memos)."""
        key = tuple(sorted(ends.items()))
        found = self._ends.get(key)
        if found is None:
            gpu = self.profile.gpu
            if gpu is None:
                raise ValueError("CostModel.at moves the GPU's figures; this cost model is "
                                 f"for {self.profile.name!r}")
            found = self._ends[key] = CostModel(DeviceProfile.for_gpu(gpu.at(ends)))
        return found

    def eqn_cost(self, eqn: JaxprEqn) -> Cost:
        cost = self._eqn_costs.get(eqn)
        if cost is None:
            rule = cost_rules.get(eqn.primitive.name, _default_rule)
            cost = rule(self, eqn)
            self._eqn_costs.set(eqn, cost)
        return cost

    def launches(self, eqn: JaxprEqn) -> bool:
        """Whether ``eqn`` launches a kernel (``eqn_cost(eqn).kernels > 0``).

        Decided from the primitive's rule where that fixes the answer (shape-only,
        one-kernel and elementwise primitives), so the passes that only need this do not
        cost every equation of a level.
        """
        rule = cost_rules.get(eqn.primitive.name, _default_rule)
        if rule is _free_rule:
            return False
        if rule is _one_kernel_rule or rule is _dot_general_rule or rule is _conv_rule:
            return True
        if rule is _default_rule:
            if not self.subjaxprs(eqn):  # elementwise unless it holds jaxprs
                return False
        return self.eqn_cost(eqn).kernels > 0

    def subjaxprs(self, eqn: JaxprEqn) -> tuple[tuple[str, int | None, JaxprLike], ...]:
        """``_compat.eqn_subjaxprs(eqn)``, memoised by the parameter dict: rewritten
        levels keep the parameter dicts of the equations they copy, and the passes, the
        planner and the mode estimates each ask about every equation."""
        params = eqn.params
        found = self._nested.get(params)
        if found is None:
            found = tuple(_compat.eqn_subjaxprs(eqn))
            self._nested.set(params, found)
        return found

    def jaxpr_cost(self, jaxpr: JaxprLike) -> Cost:
        total = self._jaxpr_costs.get(jaxpr)
        if total is None:
            inner, _ = _compat.open_jaxpr(jaxpr)
            total = ZERO
            for eqn in inner.eqns:
                total = total + self.eqn_cost(eqn)
            self._jaxpr_costs.set(jaxpr, total)
        return total

    def scan_trip_kernels(self, eqn: JaxprEqn) -> float:
        """The tiny kernels one trip of the ``scan`` ``eqn`` adds to its body's, at most:
        the counter's bump, a slice of every distinct scanned input a kernel of the body
        reads (one read only by elementwise work fuses into it) and a write of every
        stacked result. (XLA often fuses them into the body's kernels: deviceless H200
        compiles of a three-layer GRU stack launch 7 kernels a trip, its body's own.)"""
        info = _compat.scan_info(eqn)
        inner = _compat.open_jaxpr(info.jaxpr)[0]
        start = info.num_consts + info.num_carry
        sliced = {id(v) for e in inner.eqns if self.launches(e) for v in e.invars}
        xs = {id(outer) for outer, v in zip(eqn.invars[start:], inner.invars[start:],
                                            strict=True)
              if not _compat.is_literal(outer) and id(v) in sliced}
        return 1.0 + len(xs) + len(eqn.outvars) - info.num_carry

    def invariant_prologues(self, eqn: JaxprEqn) -> int:
        """How many of the ``scan`` ``eqn``'s body equations compute, from loop-invariant
        values only (its constants, literals), an operand of a kernel (a weight's slice or
        transpose read by a dot), shape-only ones aside. XLA computes them once for the
        rolled loop (hoisted or merged into the kernel: ``x @ w[:, :n]`` and
        ``x @ w[:, n:]`` become one dot), and not always for unrolled copies: deviceless H200
        compiles of a three-layer GRU stack whose cells slice their weights launch 17
        kernels a trip unrolled by 2, against 7 a trip rolled."""
        info = _compat.scan_info(eqn)
        inner = _compat.open_jaxpr(info.jaxpr)[0]
        invariant = {id(v) for v in (*inner.constvars, *inner.invars[:info.num_consts])}
        made: set[int] = set()
        for e in inner.eqns:
            if all(_compat.is_literal(v) or id(v) in invariant for v in e.invars):
                invariant.update(id(v) for v in e.outvars)
                # Shape-only equations make nothing, but pass on what they reshape.
                if ((e.primitive.name not in _primitives.COST_FREE and not self.subjaxprs(e))
                        or any(id(v) in made for v in e.invars)):
                    made.update(id(v) for v in e.outvars)
        read = {id(v) for e in inner.eqns
                if self.launches(e) and not any(id(o) in made for o in e.outvars)
                for v in e.invars}
        return sum(1 for e in inner.eqns
                   if any(id(v) in made and id(v) in read for v in e.outvars))

    def seconds(self, cost: Cost) -> float:
        return cost.seconds(self.profile)

    def launch_prices(self, eqns: Sequence[JaxprEqn], mode: CommandBufferMode | None,
                      in_loop_body: bool = False, end: str | None = None,
                      serial_kernels: bool = False) -> LaunchPrices:
        """``launch_prices`` of the level made of ``eqns`` in ``mode``, the uncertain
        figures at ``end``: its graph holds the kernels of every equation but loops and
        conds (never captured). A loop body's kernels (``in_loop_body``) are launched on
        every trip as a serial chain: deviceless H200 compiles of the crossed pair in
        ``concurrent`` mode launch its 1000-trip body's kernels one by one (14.5 launches
        a trip), so there a saved launch is worth a whole launch. ``serial_kernels``:
        as ``launch_prices``'s."""
        if mode is None or not mode.branching or self.profile.gpu is None:
            return launch_prices(self.profile, mode, 0.0, end)
        if in_loop_body:  # launched one by one, in series
            return launch_prices(self.profile, CommandBufferMode.OFF, 0.0, end)
        # The prices only ask whether the graph holds ``MIN_GRAPH_SIZE`` kernels, so the
        # count stops there (kernels are never negative) instead of costing every equation.
        uncaptured = (_primitives.SCAN, _primitives.WHILE, _primitives.COND)
        kernels = 0.0
        for e in eqns:
            if e.primitive.name not in uncaptured:
                kernels += self.eqn_cost(e).kernels
                if kernels >= MIN_GRAPH_SIZE:
                    break
        return launch_prices(self.profile, mode, kernels, end, serial_kernels)
