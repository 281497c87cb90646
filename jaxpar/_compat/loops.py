"""Loop parameters: what the passes read of ``scan``, ``while`` and ``custom_jvp_call``
equations, on every jax version.

Scan parameters changed layout in jax 0.11: ``num_consts``/``num_carry``/``linear``/
``_split_transpose`` (<= 0.10) became ``ft_in``/``ft_out`` FlatTrees (>= 0.11), whose
``unpack()`` gives the (consts, carry, xs) trees with ``len()`` = leaf count. Only the
helpers here read those layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .jaxprs import ClosedJaxpr, Jaxpr, JaxprEqn, JaxprLike, in_avals
from .sources import source_summary


def scan_length(eqn: JaxprEqn) -> int:
    return int(eqn.params["length"])


@dataclasses.dataclass(frozen=True, slots=True)
class ScanInfo:
    """What jaxpar needs to know about one ``scan`` equation, on every jax version.

    The body jaxpr takes ``consts + carry + xs`` (``num_consts``, ``num_carry``, rest)
    and returns ``carry + ys``; the equation's invars and outvars line up with it.
    """

    length: int
    reverse: bool
    unroll: int
    num_consts: int
    num_carry: int
    jaxpr: ClosedJaxpr


def scan_info(eqn: JaxprEqn) -> ScanInfo:
    """Reads a ``scan`` equation's parameters, whichever layout this jax uses."""
    params = eqn.params
    length = int(params["length"])
    if "ft_in" in params:  # jax >= 0.11
        consts_tree, carry_tree, _ = params["ft_in"].unpack()
        num_consts, num_carry = len(consts_tree), len(carry_tree)
    else:  # jax <= 0.10
        num_consts, num_carry = int(params["num_consts"]), int(params["num_carry"])
    unroll = params.get("unroll", 1)
    if isinstance(unroll, bool):
        unroll = max(length, 1) if unroll else 1
    body = params["jaxpr"]
    if len(in_avals(body)) != len(eqn.invars):
        raise NotImplementedError(
            f"jaxpar: scan at {source_summary(eqn)} has {len(eqn.invars)} operands but its "
            f"body takes {len(in_avals(body))}; this jax version's scan layout is not "
            "supported by jaxpar's loop rewrites")
    return ScanInfo(length=length, reverse=bool(params["reverse"]), unroll=int(unroll),
                    num_consts=num_consts, num_carry=num_carry, jaxpr=body)


def scan_params_with_unroll(eqn: JaxprEqn, unroll: int) -> dict[str, Any]:
    """``eqn.params`` of a ``scan`` with only the unroll factor changed."""
    params = dict(eqn.params)
    params["unroll"] = int(unroll)
    return params


def custom_jvp_rule(eqn: JaxprEqn) -> tuple[JaxprLike, int] | None:
    """The jvp rule of a ``custom_jvp_call`` as a jaxpr, with the count of the call's
    leading constant operands (the rule reads the other operands, then one tangent per
    operand, none of them a symbolic zero); None where this jax hides it or tracing the
    rule fails.

    The rule is traced through the equation's own memoised thunk
    (``jvp_jaxpr_fun``), the one JAX calls when it differentiates the call, so it is
    traced at most once per call and what it sees here is what differentiation sees.
    """
    thunk = eqn.params.get("jvp_jaxpr_fun", eqn.params.get("jvp_jaxpr_thunk"))
    num_consts = eqn.params.get("num_consts")
    if thunk is None or not isinstance(num_consts, int):
        return None
    zeros = (False,) * (len(eqn.invars) - num_consts)
    try:
        made = thunk.call_wrapped(*zeros) if hasattr(thunk, "call_wrapped") else thunk(*zeros)
    except Exception:  # a rule that cannot be traced alone: judged unknown, never batched
        return None
    rule = made[0]
    if not isinstance(rule, (Jaxpr, ClosedJaxpr)):
        return None
    return rule, num_consts


@dataclasses.dataclass(frozen=True, slots=True)
class WhileInfo:
    """The parts of a ``while`` equation: operands are ``cond consts + body consts + carry``."""

    cond_nconsts: int
    body_nconsts: int
    cond_jaxpr: ClosedJaxpr
    body_jaxpr: ClosedJaxpr


def while_info(eqn: JaxprEqn) -> WhileInfo:
    """Reads a ``while`` equation's parameters."""
    params = eqn.params
    return WhileInfo(int(params["cond_nconsts"]), int(params["body_nconsts"]),
                     params["cond_jaxpr"], params["body_jaxpr"])
