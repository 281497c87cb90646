"""Recognising loop shapes in jaxprs.

``fori_loop`` with Python-int bounds already becomes a ``scan``; with array
bounds it becomes a ``while`` whose trip count XLA cannot see, so every
iteration copies the predicate to the host. This module recognises that
``while`` shape and, where both bounds are in fact literals, reports them.

Example::

    static_fori_bounds(eqn)   # (0, 7, 1) for fori_loop(jnp.int32(0), jnp.int32(7), ...)

Sharp edges:
  * Only the exact ``fori_loop`` layout is matched (carry ``(i, upper, *xs)``,
    condition ``lt i upper``, body ``i + 1`` and ``upper`` passed through).
"""

from __future__ import annotations

from typing import Any

from . import _compat


def static_fori_bounds(eqn: Any) -> tuple[int, int, int] | None:
    """``(lower, upper, step)`` of a ``fori_loop``-shaped ``while`` with literal bounds."""
    if eqn.primitive.name != "while":
        return None
    params = eqn.params
    cond, _ = _compat.open_jaxpr(params["cond_jaxpr"])
    body, _ = _compat.open_jaxpr(params["body_jaxpr"])
    cond_nconsts, body_nconsts = params["cond_nconsts"], params["body_nconsts"]
    init = eqn.invars[cond_nconsts + body_nconsts:]
    if len(init) < 2 or len(cond.eqns) != 1:
        return None
    (lt,) = cond.eqns
    counter, upper = cond.invars[cond_nconsts:cond_nconsts + 2]
    if lt.primitive.name != "lt" or list(lt.invars) != [counter, upper]:
        return None
    if cond.outvars[0] is not lt.outvars[0]:
        return None
    body_counter, body_upper = body.invars[body_nconsts:body_nconsts + 2]
    if body.outvars[1] is not body_upper:
        return None
    increments = [e for e in body.eqns if e.outvars[0] is body.outvars[0]]
    if len(increments) != 1 or increments[0].primitive.name != "add":
        return None
    a, b = increments[0].invars
    if a is body_counter and _compat.is_literal(b):
        step = b
    elif b is body_counter and _compat.is_literal(a):
        step = a
    else:
        return None
    if not (_compat.is_literal(init[0]) and _compat.is_literal(init[1])):
        return None
    try:
        return (int(init[0].val), int(init[1].val), int(step.val))
    except (TypeError, ValueError):
        return None
