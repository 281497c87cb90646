"""Pricing ``batch_matmuls``' groups with the cost model: the launches a group saves
against the stacking, slicing and transposing kernels and bytes it adds, at each end of
the GPU model's ranges (``choose``, ``Price``).

Example::

    accepted, rejected, priced = choose(eqns, graph, groups, launches, costs)
    priced[group].worth            # seconds saved per run of the level, less the cost
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .. import _compat
from .._compat import JaxprEqn
from .._model.cost import CostModel, LaunchPrices, launch_prices
from .._model.memory import stacking_refusal
from .._program.graph import Graph
from .._program.primitives import DOT_GENERAL
from ._level_graph import private_tails_leave
from ._matmul_forms import Column, Transposed, atom_of, is_shared
from ._matmul_groups import Group


def _stack_bytes(column: Column) -> float:
    return 2.0 * sum(_compat.aval_nbytes(a.aval) for a in column)


# What one round of ``choose`` knows of its accepted groups: each unshared column's first
# user and user count, the stacked results other groups read, the columns made by a
# batched op, and the batched equations.
_Round = tuple[dict[Any, Any], dict[Any, int], dict[Any, int], set[Any], set[int]]


@dataclasses.dataclass(frozen=True, slots=True)
class Price:
    """The cost model's view of one group, in seconds per run of the level."""

    saved: float  # launches saved (and the stacking its chained readers are spared)
    cost: float  # stacking kernel, stacking and transposing bytes
    memory: str | None = None  # why its stacked copies are over the memory budget

    @property
    def worth(self) -> float:
        return self.saved - self.cost


def choose(eqns: Sequence[JaxprEqn], graph: Graph, groups: list[Group],
            launches: dict[Group, int], costs: CostModel,
            level_outputs: set[Any] | frozenset[Any] = frozenset(),
            prices: LaunchPrices | Sequence[LaunchPrices] | None = None,
            allowance: float | None = None, loop_inputs: frozenset[Any] = frozenset(),
            program_outputs: bool = False
            ) -> tuple[list[Group], list[Group], dict[Group, Price]]:
    """The groups worth batching, the rest, and each one's price (a dropped group's as
    it was when dropped), by the kernels they save and the kernels they add.

    A group saves ``launches - 1`` kernel launches. Its operand columns that are neither
    shared by all members nor already stacked (by an earlier group of the rewrite, or as
    the result of another batched op) are stacked, in one fused kernel per group. That
    kernel takes the place of an elementwise producer's only where a stacked value is
    made by elementwise work that nothing but batched ops reads; otherwise it is a kernel
    more (the optimizer of two models trained in one step stacked activations its
    backward pass also read, priced at 0 us: 28 -> 32 launches). Each member result that
    leaves the level, or that an equation launching a kernel outside the rewrite reads (a
    matmul, a reduction, a loop), is sliced out of the batched result by a kernel of its
    own; slices that only elementwise work reads fuse into it (``sin(a) @ b`` beside
    ``cos(sin(c) @ d) @ b``, both results leaving: 5 -> 6 launches once compiled). At the
    top level, a matmul whose elementwise tail, computed from its result alone, is
    returned counts the same (``_level_graph.private_tails_leave``): unbatched, XLA fuses the
    tail into the matmul's Triton GEMM; batched, the tail of each slice is a kernel of
    its own (ten ``tanh(x @ w)`` returned apart: 10 launches plain, 13 batched). A
    group whose stacked result another accepted group reads, and that reader, each count
    a launch more: dropping either one slices the result apart or stacks it again. Groups
    are dropped, least worth first, until each one wins at least half a launch more than
    it costs.

    Launches are priced by the one GPU model in the mode the function is compiled in
    (``prices``, ``CostModel.launch_prices``; default a serial chain's): a member's
    launch saved is worth ``prices.beside`` (its kernel floor in a serial chain, only its
    graph node in a ``concurrent`` graph, where the members already overlap), a stacking
    or slicing kernel added costs ``prices.serial``. Given several ``prices`` (the ends
    of the GPU model's ranges, ``_model.cost.ENDS``), a group must pay at each; its price is
    the one at the end where it pays least. A group whose stacked copies (its stacked
    operands and its batched result) need more than ``allowance`` bytes (the memory
    budget's) is left alone, and so is one in a loop body that reads one of
    ``loop_inputs`` (what the body reads from its loop) transposed: XLA moves the
    transpose of a scanned input's slice out of the loop, over the whole input (a
    deviceless H200 compile of two 1,000-trip cells of 100 x 100: 38 MiB, against 0.3
    MiB plain).

    Only the groups' operands and results are looked at (their producers and readers,
    through ``graph``), so a visit costs in proportion to the groups, not the level.
    """
    if prices is None:
        prices = launch_prices(costs.profile, None, 0.0)
    ends = [prices] if isinstance(prices, LaunchPrices) else list(prices)
    pricing = _Pricing(eqns, graph, costs, level_outputs, launches,
                       {eqns[i].outvars[0]: i for g in groups for i in g.members})
    # Matmuls' elementwise tails returned apart (the program's outputs): see
    # ``_level_graph.private_tails_leave``. A convolution's tail stays a kernel of its own
    # either way (cuDNN takes no such epilogue), and a loop body's carries are not
    # returned apart.
    pricing.tails_leave = private_tails_leave(
        eqns, graph, {v: i for v, i in pricing.made_at.items()
                      if eqns[i].primitive.name == DOT_GENERAL},
        pricing.launches_kernel, level_outputs) if program_outputs else set()
    columns = pricing.columns = {g: g.columns(eqns) for g in groups}
    outputs = pricing.outputs = {g: g.outputs(eqns) for g in groups}
    pricing.transposes = {g: sum(2.0 * _compat.aval_nbytes(eqns[i].outvars[0].aval)
                                 for i, s in zip(g.members, g.swapped, strict=True) if s)
                          for g in groups}
    accepted, priced = _refuse_over_budget(eqns, groups, columns, allowance, loop_inputs)
    batched: set[int] = set()
    for _ in range(len(groups) + 1):
        batched.clear()
        batched.update(i for g in accepted for i in g.members)
        produced = {outputs[g] for g in accepted if g.chainable(eqns)}
        first_user, users, chained = _column_users(accepted, columns, produced)
        pays: dict[Group, bool] = {}
        least: dict[Group, float] = {}
        for g in accepted:
            for end in ends:
                price = pricing.price_of(g, end.serial, end.beside,
                                         (first_user, users, chained, produced, batched))
                # Where the model cannot tell, leave the program alone: a group must win
                # at least half a launch more than it costs (a siamese network's backward
                # pass, priced +0.69 us, launched one kernel more once compiled).
                slack = price.worth - end.serial / 2
                if g not in least or slack < least[g]:
                    priced[g], least[g] = price, slack
                pays[g] = pays.get(g, True) and slack > 0
        if all(pays.values()):
            break
        accepted = [g for g in accepted if pays[g]]
    else:  # pragma: no cover - each round removes a group or stops
        raise RuntimeError("jaxpar batch_matmuls: choosing groups did not settle; please "
                           "report it with the program")
    kept = set(accepted)
    return accepted, [g for g in groups if g not in kept], priced


def _refuse_over_budget(eqns: Sequence[JaxprEqn], groups: list[Group],
                        columns: dict[Group, list[Column]], allowance: float | None,
                        loop_inputs: frozenset[Any]
                        ) -> tuple[list[Group], dict[Group, Price]]:
    """``choose``'s first step: the groups (in depth order) whose stacked copies fit
    ``allowance`` and that read no loop input transposed, and the others' refusals."""
    priced: dict[Group, Price] = {}
    accepted = []  # in depth order
    for g in groups:
        stacked = sum(_stack_bytes(c) / 2 for c in dict.fromkeys(columns[g])
                      if not is_shared(c)) + sum(
            _compat.aval_nbytes(eqns[i].outvars[0].aval) for i in g.members)
        refusal = stacking_refusal(stacked, allowance)
        if refusal is None and allowance is not None and any(
                isinstance(read, Transposed) and read.atom in loop_inputs
                for column in columns[g] for read in column):
            refusal = ("it would read an input of the loop transposed, which XLA transposes "
                       "whole, outside the loop: a copy of the whole input")
        if refusal is None:
            accepted.append(g)
        else:
            priced[g] = Price(0.0, 0.0, refusal)
    return accepted, priced


def _column_users(accepted: list[Group], columns: dict[Group, list[Column]],
                  produced: set[Any]
                  ) -> tuple[dict[Column, Group], dict[Column, int], dict[Column, int]]:
    """Each unshared operand column's first user and user count among ``accepted``, and
    how many of them read each stacked result of another group (``produced``)."""
    first_user: dict[Column, Group] = {}
    users: dict[Column, int] = {}
    chained: dict[Column, int] = {}
    for g in accepted:
        for column in dict.fromkeys(columns[g]):
            if is_shared(column):
                continue
            if column in produced:
                chained[column] = chained.get(column, 0) + 1
                continue
            first_user.setdefault(column, g)
            users[column] = users.get(column, 0) + 1
    return first_user, users, chained


@dataclasses.dataclass(slots=True)
class _Pricing:
    """What ``choose`` prices a group by: the level, the groups' operand columns,
    results and transposes, and the kernels each equation launches (looked up once)."""

    eqns: Sequence[JaxprEqn]
    graph: Graph
    costs: CostModel
    level_outputs: set[Any] | frozenset[Any]
    launches: dict[Group, int]
    made_at: dict[Any, int]
    launching: dict[int, bool] = dataclasses.field(default_factory=dict)
    tails_leave: set[Any] = dataclasses.field(default_factory=set)
    columns: dict[Group, list[Column]] = dataclasses.field(default_factory=dict)
    outputs: dict[Group, Column] = dataclasses.field(default_factory=dict)
    transposes: dict[Group, float] = dataclasses.field(default_factory=dict)

    def producer(self, atom: Any, reader: int) -> int | None:
        """The equation making ``atom``, which equation ``reader`` reads (None: an input
        of the level, or a literal)."""
        for p in self.graph.preds[reader]:
            if any(v is atom for v in self.eqns[p].outvars):
                return p
        return None

    def readers(self, atom: Any, source: int) -> list[int]:
        """The equations reading ``atom``, made by equation ``source``."""
        return [r for r in self.graph.succs[source]
                if any(a is atom for a in self.eqns[r].invars)]

    def launches_kernel(self, index: int) -> bool:
        found = self.launching.get(index)
        if found is None:
            found = self.launching[index] = self.costs.launches(self.eqns[index])
        return found

    def replaces_producer(self, read: Any, reader: int, batched: set[int]) -> bool:
        """Whether stacking ``read`` (an operand of equation ``reader``) takes the place
        of its producer's kernel: elementwise work that nothing but the batched ops
        (``batched``) reads."""
        atom = atom_of(read)
        if _compat.is_literal(atom) or atom in self.level_outputs:
            return False
        source = self.producer(atom, reader)
        if source is None:
            return False
        cost = self.costs.eqn_cost(self.eqns[source])
        return (cost.kernels == 0 and cost.flops > 0
                and all(r in batched for r in self.readers(atom, source)))

    def price_of(self, g: Group, launch: float, beside: float, rounds: _Round) -> Price:
        """``g``'s price with a launch at ``launch`` (a member's at ``beside``), given
        the groups accepted this round (``rounds``)."""
        first_user, users, chained, produced, batched = rounds
        columns, outputs, eqns = self.columns, self.outputs, self.eqns
        bandwidth = self.costs.profile.bandwidth
        new = [c for c in dict.fromkeys(columns[g]) if first_user.get(c) is g]
        saved = (self.launches[g] - 1) * beside
        cost = self.transposes[g] / bandwidth
        if new and not any(self.replaces_producer(a, i, batched) for c in new
                           for a, i in zip(c, g.members, strict=True)):
            cost += launch
        cost += sum(_stack_bytes(c) for c in new if users[c] == 1) / bandwidth
        read_chained = chained.get(outputs[g], 0) if outputs[g] in produced else 0
        sliced = sum(out in self.level_outputs or out in self.tails_leave or any(
            self.launches_kernel(r) and not (read_chained and r in batched)
            for r in self.readers(out, self.made_at[out]))
            for out in (eqns[i].outvars[0] for i in g.members))
        cost += sliced * launch
        if read_chained:
            saved += launch  # its readers would otherwise stack its results
        if any(c in produced for c in columns[g] if not is_shared(c)):
            # Its producer's result would otherwise be sliced apart for it: a chained
            # reader's worth, like its producer's, counts the link (crossed_pair's third
            # matmuls, left alone without it, launched three kernels more per trip).
            saved += launch
        return Price(saved, cost)


def chained_columns(eqns: Sequence[JaxprEqn], accepted: list[Group]) -> set[Column]:
    return {g.outputs(eqns) for g in accepted if g.chainable(eqns)}
