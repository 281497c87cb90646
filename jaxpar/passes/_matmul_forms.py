"""How a heavy op reads in the form ``batch_matmuls`` runs a group in: its operands as
written or swapped (its result transposed back), each transposed where a 2-D matrix
product's contracting axis is not the form's (``readings_of``); and the columns of
operands, one atom per member, that a group stacks.

Example::

    as_written, *swapped = readings_of(eqn)   # swapped: where the op can run that way
    as_written.reads(eqn)                     # its operands in the form's order
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from .. import _compat
from .._compat import Atom, JaxprEqn, ShapedArray
from .._program.primitives import DOT_GENERAL

# A column of operands, one atom per member (in the group's form).
Column = tuple[Any, ...]


class Transposed(NamedTuple):
    """A 2-D value read with its two axes swapped (in a column: a member's operand, or a
    flipped member's result as the batched op leaves it)."""

    atom: Atom

    @property
    def aval(self) -> Any:  # the bytes are what the cost model reads
        return self.atom.aval


def atom_of(read: Any) -> Any:
    return read.atom if isinstance(read, Transposed) else read


@dataclasses.dataclass(frozen=True, slots=True)
class Reading:
    """How one heavy op runs in a group's form: ``swapped`` operands (its result
    transposed back) and, per operand position of the form, whether the operand is read
    transposed (a 2-D matrix product only: folded into its stacking copy)."""

    form: Hashable
    swapped: bool
    transposed: tuple[bool, ...]
    params: Any

    def reads(self, eqn: JaxprEqn) -> tuple[Any, ...]:
        operands = eqn.invars[::-1] if self.swapped else eqn.invars
        return tuple(Transposed(a) if t else a
                     for a, t in zip(operands, self.transposed, strict=True))

    def output(self, eqn: JaxprEqn) -> Any:
        out = eqn.outvars[0]
        if not self.swapped:
            return out
        # A swapped 2-D product leaves its result transposed; other layouts never match.
        return Transposed(out) if _compat.array_aval(out).ndim == 2 else ("permuted", out)


def _hashable(value: Any) -> Hashable:
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value


# A matrix product in the form the batched op runs it: lhs [m, k] @ rhs [k, n].
_MATRIX_PRODUCT = (((1,), (0,)), ((), ()))


def _matrix_product(eqn: JaxprEqn) -> tuple[int, int] | None:
    """The contracting dimensions of a plain 2-D ``dot_general`` (one each, no batch
    dimensions, no ``out_sharding``), or None."""
    if eqn.primitive.name != DOT_GENERAL or eqn.params.get("out_sharding") is not None:
        return None
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    if (lhs_batch or rhs_batch or len(lhs_contract) != 1 or len(rhs_contract) != 1
            or _compat.array_aval(lhs).ndim != 2 or _compat.array_aval(rhs).ndim != 2):
        return None
    return int(lhs_contract[0]), int(rhs_contract[0])


def _transposed_2d(aval: Any, transposed: bool) -> Any:
    return aval.update(shape=aval.shape[::-1]) if transposed else aval


def readings_of(eqn: JaxprEqn) -> list[Reading]:
    """How ``eqn`` can run in a group: as written, then with its operands swapped.

    A 2-D matrix product reads in the form ``lhs [m, k] @ rhs [k, n]`` both ways, each
    operand transposed where its contracting axis is not the form's (``x @ W`` and
    ``W @ x`` of square matrices then have one form, read ``(x, W)`` and
    ``(W.T, x.T)``); other ``dot_general``s read their operands as they are.
    """
    name, outs = eqn.primitive.name, [v.aval for v in eqn.outvars]
    contract = _matrix_product(eqn)
    if contract is not None:
        found = []
        for swapped in (False, True):
            order = (1, 0) if swapped else (0, 1)
            # The form contracts the lhs's axis 1 and the rhs's axis 0.
            transposed = tuple(contract[q] != 1 - p for p, q in enumerate(order))
            avals = [_transposed_2d(eqn.invars[q].aval, t)
                     for q, t in zip(order, transposed, strict=True)]
            params = dict(eqn.params)
            params["dimension_numbers"] = _MATRIX_PRODUCT
            precision = params.get("precision")
            if swapped and isinstance(precision, tuple) and len(precision) == 2:
                params["precision"] = precision[::-1]
            form = _form_key(name, avals, [_transposed_2d(outs[0], swapped)], params)
            found.append(Reading(form, swapped, transposed, params))
        return found
    params = dict(eqn.params)
    found = [Reading(_form_key(name, [v.aval for v in eqn.invars], outs, params), False,
                      (False,) * len(eqn.invars), params)]
    swapped_params = _swapped_params(eqn)
    if swapped_params is not None:
        lhs, rhs = eqn.invars
        found.append(Reading(_form_key(name, [rhs.aval, lhs.aval], [_transposed_aval(eqn)],
                                        swapped_params), True, (False, False), swapped_params))
    return found


def _form_key(name: str, avals: Sequence[Any], outs: Sequence[Any], params: Any) -> Hashable:
    return (name, tuple(avals), tuple(outs),
            tuple((k, _hashable(v)) for k, v in sorted(params.items())))


def _swapped_params(eqn: JaxprEqn) -> dict[str, Any] | None:
    """A ``dot_general``'s parameters with its operands swapped, or None."""
    if eqn.primitive.name != DOT_GENERAL or eqn.params.get("out_sharding") is not None:
        return None
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    params = dict(eqn.params)
    params["dimension_numbers"] = ((rhs_contract, lhs_contract), (rhs_batch, lhs_batch))
    precision = params.get("precision")
    if isinstance(precision, tuple) and len(precision) == 2:
        params["precision"] = precision[::-1]
    return params


def swap_permutation(eqn: JaxprEqn) -> tuple[int, ...]:
    """How to transpose a swapped ``dot_general``'s result into the original's layout."""
    (lhs_contract, rhs_contract), (lhs_batch, _) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    batch = len(lhs_batch)
    lhs_free = _compat.array_aval(lhs).ndim - len(lhs_contract) - batch
    rhs_free = _compat.array_aval(rhs).ndim - len(rhs_contract) - batch
    return (*range(batch), *range(batch + rhs_free, batch + rhs_free + lhs_free),
            *range(batch, batch + rhs_free))


def _transposed_aval(eqn: JaxprEqn) -> ShapedArray:
    """The result type of ``eqn`` with its operands swapped."""
    out = _compat.array_aval(eqn.outvars[0])
    permutation = swap_permutation(eqn)
    inverse = [0] * len(permutation)
    for new, old in enumerate(permutation):
        inverse[old] = new
    return out.update(shape=tuple(out.shape[inverse[d]] for d in range(out.ndim)))


def is_shared(column: Column) -> bool:
    """Every member reads the very same value (the same atom, transposed or not)."""
    first = column[0]
    if isinstance(first, Transposed):
        return all(isinstance(a, Transposed) and a.atom is first.atom for a in column[1:])
    return all(a is first for a in column[1:])
