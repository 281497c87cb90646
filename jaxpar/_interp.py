"""The variable environment of a jaxpr interpreter.

The emitter and the loop passes both evaluate jaxprs equation by equation;
this is the environment they share: literals read as their values, dropped
outputs (``_``) are not stored.

Example::

    env = Env()
    env.write(jaxpr.invars, args)
    outs = [env.read(v) for v in jaxpr.outvars]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _compat


class Env:
    """Values of a jaxpr's variables during evaluation."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[Any, Any] = {}

    def read(self, atom: Any) -> Any:
        return _compat.literal_value(atom) if _compat.is_literal(atom) else self.values[atom]

    def read_all(self, atoms: Sequence[Any]) -> list[Any]:
        return [self.read(atom) for atom in atoms]

    def write(self, variables: Sequence[Any], values: Sequence[Any]) -> None:
        for var, value in zip(variables, values, strict=True):
            if not _compat.is_drop_var(var):
                self.values[var] = value
