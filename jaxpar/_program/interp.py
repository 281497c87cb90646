"""The variable environment of a jaxpr interpreter.

The emitter and the passes both evaluate jaxprs equation by equation;
this is the environment they share: literals read as their values, dropped
outputs (``_``) are not stored.

Example::

    env = Env()
    env.write_inputs(jaxpr.invars, args)
    outs = [env.read(v) for v in jaxpr.outvars]

Sharp edges:
  * ``write_inputs`` gives each input the weak type its variable declares. A loop
    body's carry may come in weak (a Python scalar) and go out strong; a rewrite
    that feeds one trip's carry to the next evaluation of the body (a later
    segment of fused scans, an unrolled copy) would otherwise trace the body at
    other types than the original, and its results (a ``ys`` read from the carry)
    would lose their weak type.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .. import _compat
from .._compat import Atom, JaxprEqn


class Env:
    """Values of a jaxpr's variables during evaluation."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[Any, Any] = {}

    def read(self, atom: Atom) -> Any:
        return _compat.literal_value(atom) if _compat.is_literal(atom) else self.values[atom]

    def read_all(self, atoms: Sequence[Any]) -> list[Any]:
        return [self.read(atom) for atom in atoms]

    def write(self, variables: Sequence[Any], values: Sequence[Any]) -> None:
        for var, value in zip(variables, values, strict=True):
            if not _compat.is_drop_var(var):
                self.values[var] = value

    def write_inputs(self, variables: Sequence[Any], values: Sequence[Any]) -> None:
        """``write`` for a jaxpr's invars: each value gets its variable's weak type."""
        self.write(variables, [_compat.with_weak_type(value, var.aval)
                               for var, value in zip(variables, values, strict=True)])

    def bind(self, eqns: Iterable[JaxprEqn]) -> None:
        """Binds each equation on its operands' values here, in order, and writes its
        results (keeping its source info and context: ``_compat.bind_eqn``)."""
        for eqn in eqns:
            self.write(eqn.outvars, _compat.bind_eqn(eqn, self.read_all(eqn.invars)))
