"""Reading lowered StableHLO and jaxpr text: the stream-annotated calls, each function's body,
nested stream calls, and a jaxpr's text with scheduling group ids renumbered.

Example::

    from helpers.lowered import lower_for_gpu, stream_calls

    calls = stream_calls(lower_for_gpu(jaxpar.parallel_branches(f, target="gpu"), *args))
    [attrs["_xla_stream_annotation"] for _, attrs in calls]   # ["1", "2"]

Sharp edges:
    `lower_for_gpu` only *lowers* for CUDA (no plugin needed) so the frontend attributes are
    visible; it never compiles.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import jax

STREAM_ATTRIBUTE = "_xla_stream_annotation"
GROUP_ATTRIBUTE = "_scheduling_group_id"

_CALL = re.compile(r"\bcall @([^\s(]+)\(")
_ATTRIBUTES = re.compile(r"mhlo\.frontend_attributes = \{([^}]*)\}")
_PAIR = re.compile(r'([\w.$-]+) = "([^"]*)"')
_FUNC = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([^\s(]+)\(")


def _frontend_attributes(line: str) -> dict[str, str]:
    match = _ATTRIBUTES.search(line)
    return dict(_PAIR.findall(match.group(1))) if match else {}


def stream_calls(lowered_text: str) -> list[tuple[str, dict[str, str]]]:
    """Every `call` in StableHLO text that carries `_xla_stream_annotation`, in text order.

    Returns a list of `(callee, frontend attributes)`.
    """
    calls = []
    for line in lowered_text.splitlines():
        if STREAM_ATTRIBUTE not in line:
            continue
        match = _CALL.search(line)
        if match is None:
            continue
        calls.append((match.group(1), _frontend_attributes(line)))
    return calls


def function_bodies(lowered_text: str) -> dict[str, list[str]]:
    """Maps each `func.func` name of a StableHLO module to the lines of its body."""
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    indent = 0
    for line in lowered_text.splitlines():
        match = _FUNC.match(line)
        if match is not None:
            current = bodies.setdefault(match.group(1), [])
            indent = len(line) - len(line.lstrip())
            continue
        if current is not None:
            if line.strip() == "}" and len(line) - len(line.lstrip()) == indent:
                current = None
            else:
                current.append(line)
    return bodies


def nested_stream_calls(lowered_text: str) -> list[tuple[str, str]]:
    """`(outer, inner)` callee pairs where a stream call is reachable inside another's body.

    XLA cannot compile nested stream calls, so jaxpar must never produce any.
    """
    bodies = function_bodies(lowered_text)
    found = []
    for outer, _ in stream_calls(lowered_text):
        seen: set[str] = set()
        stack = [outer]
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            body = "\n".join(bodies.get(name, []))
            for inner, _ in stream_calls(body):
                found.append((outer, inner))
            stack.extend(_CALL.findall(body))
    return found


def lower_for_gpu(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """StableHLO text of `jax.jit(fn)` lowered for CUDA (no GPU or plugin needed)."""
    return jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()



def canonical_jaxpr_text(closed: Any) -> str:
    """``closed``'s text inside its outermost calls, scheduling group ids renumbered.

    A decorated function is one ``jax.jit`` call (``jit`` of ``jit`` nests, too), and group
    ids are drawn afresh per emission: two rewrites of the same program are compared by
    what they compute and how their regions are grouped, not by the ids' values.
    """
    from jaxpar import _compat, _ops

    inner, _ = _compat.open_jaxpr(closed)
    # jit calls, and the equation that holds a rewritten program (``_ops.program_p``,
    # inlined when lowering) are looked through.
    while (len(inner.eqns) == 1 and inner.eqns[0].primitive.name in ("jit", "pjit",
                                                                    _ops.PROGRAM)
           and list(inner.eqns[0].outvars) == list(inner.outvars)):
        params = inner.eqns[0].params
        closed = params["jaxpr"] if "jaxpr" in params else params["call_jaxpr"]
        inner, _ = _compat.open_jaxpr(closed)
    numbers: dict[str, str] = {}

    def renumber(match: re.Match[str]) -> str:
        return match.group(1) + numbers.setdefault(match.group(2), str(len(numbers) + 1))

    # Group ids appear as attributes, or in the ``region`` parameter of jaxpar's region
    # equations (``GroupIds(id=N)``), depending on how JAX prints them.
    return re.sub(r"(_scheduling_group_id\W{1,4}|GroupIds\(id=)(\d+)", renumber, str(closed))


def all_equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of the jaxprs its equations hold, depth first."""
    from jaxpar import _compat

    inner, _ = _compat.open_jaxpr(jaxpr)
    for eqn in inner.eqns:
        yield eqn
        for _, _, sub in _compat.eqn_subjaxprs(eqn):
            yield from all_equations(sub)
