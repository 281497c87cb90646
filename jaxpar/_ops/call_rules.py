"""Rules that jaxpar's call-like primitives (``stream_region_p``, ``program_p``) share: each
holds a ``call_jaxpr`` (closed) and one more parameter. Each primitive names its rules in
one ``_compat.CallRules`` in its own module; these are the pieces both use. (How JAX's
tables take the rules, and the rules that differ between jax releases, are in the
``rules`` module of ``_compat``.)

Example::

    outs, series = call_jet(primals, series_in, call_jaxpr, lambda body, args: body(*args))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental import jet as _jet

from .._compat import ClosedJaxpr, jaxpr_eval


def call_abstract_eval(*avals: Any, call_jaxpr: ClosedJaxpr, **params: Any) -> tuple[Any, Any]:
    """The body's output types and effects."""
    del avals, params
    return list(call_jaxpr.out_avals), call_jaxpr.effects


def call_jet(primals_in: Sequence[Any], series_in: Sequence[Any], call_jaxpr: ClosedJaxpr,
             emit: Callable[[Callable[..., Any], list[Any]], Sequence[Any]]
             ) -> tuple[list[Any], list[Any]]:
    """The jet rule of a call-like equation; ``emit(body, args)`` runs the body (as a
    region, or inline)."""
    order = max((len(s) for s in series_in if s is not _jet.zero_series), default=1)
    series = [[_jet.zero_term] * order if s is _jet.zero_series else list(s) for s in series_in]
    counts = [len(s) for s in series]

    def body(*flat: Any) -> list[Any]:
        primals, rest = list(flat[:len(primals_in)]), list(flat[len(primals_in):])
        nested, start = [], 0
        for count in counts:
            nested.append(rest[start:start + count])
            start += count
        # Jet rules see Taylor coefficients (the k-th term over (k+1)!); the public
        # ``jet`` takes and returns derivatives.
        nested = [[t * math.factorial(k + 1) for k, t in enumerate(s)] for s in nested]
        outs, out_series = _jet.jet(lambda *a: jaxpr_eval(call_jaxpr, *a), primals, nested)
        return [*outs, *[t / math.factorial(k + 1) for s in out_series
                         for k, t in enumerate(s)]]

    zeros = [[jax.numpy.zeros_like(p) if t is _jet.zero_term else t for t in s]
             for p, s in zip(primals_in, series, strict=True)]
    flat = list(emit(body, [*primals_in, *[t for s in zeros for t in s]]))
    num_out = len(call_jaxpr.out_avals)
    outs, terms = flat[:num_out], flat[num_out:]
    return outs, [terms[i * order:(i + 1) * order] for i in range(num_out)]
