"""The staged forms of a decorated function: its ``trace``, ``lower`` and ``eval_shape``.

They are ``jax.jit``'s on the decorated function itself (whose call, under their trace,
takes the keyed path), one jit without XLA options and one per distinct options a plan
chose: ``lower`` looks the signature's plan up first, so its ``compile()`` uses the
options a call compiles with.

Example::

    stages = StagedJits(owner)
    lowered = lower_with_options(state, stages, args, kwargs)
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import jax

from .. import _compat, targets
from .._frameworks import nnx_arguments
from .._trace import Signature, abstract, split_arguments
from .state import CallState, cached_jit, weak_method
from .trace_scopes import options_applied


class StagedJits:
    """The ``jax.jit`` s of a decorated function that its ``trace``/``lower``/``eval_shape``
    use: one without XLA options, made at first use, and one per distinct options its
    plans chose. They reach the decorated function through a weak reference, as the call
    state's jits do: ``jax.jit(pb)`` kept here would be a cycle."""

    __slots__ = ("_owner", "_plain", "_with_options")

    def __init__(self, owner: Any):
        self._owner = weakref.ref(owner)
        self._plain: Any = None
        self._with_options: dict[tuple[tuple[str, str], ...], Any] = {}

    def get(self, options: dict[str, str] | None = None) -> Any:
        """The jit compiling with ``options`` (none: the plain one)."""
        if options:
            return cached_jit(self._with_options, options, self._make)
        if self._plain is None:
            self._plain = self._make(None)
        return self._plain

    def clear_cache(self) -> None:
        for jitted in self._with_options.values():
            jitted.clear_cache()
        if self._plain is not None:
            self._plain.clear_cache()

    def _make(self, given: dict[str, str] | None) -> Any:
        owner = self._owner()
        if owner is None:  # only a jit captured elsewhere can outlive its owner
            raise ReferenceError("jaxpar: this parallel_branches function was deleted")
        call = functools.wraps(owner.__wrapped__)(weak_method(owner, "__call__", None))
        return jax.jit(call, static_argnums=owner.static_argnums,
                       static_argnames=owner.static_argnames, compiler_options=given,
                       **owner.jit_options.jit_kwargs())


def lower_with_options(state: CallState, stages: StagedJits, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
    """``ParallelBranches.lower``: on the GPU, lowered by a jit carrying the XLA options its
    signature's plan chose, so that ``compile()`` uses them as a call does. The signature
    is traced first (its plan made as a call makes it), then the options read from its
    plan, before the jit carrying them is chosen."""
    if not _compat.top_level() \
            or not targets.get(state.settings().target).compiles_with_xla_options:
        return stages.get().lower(*args, **kwargs)
    traced = stages.get().trace(*args, **kwargs)
    options = planned_options(state, args, kwargs, tuple(traced.jaxpr.in_avals))
    if not options:
        return traced.lower()
    with options_applied(state):
        return stages.get(options).lower(*args, **kwargs)


def planned_options(state: CallState, args: tuple[Any, ...], kwargs: dict[str, Any],
                    avals: tuple[Any, ...] | None = None) -> dict[str, str]:
    """The XLA options a top-level call with these arguments (or their abstract values,
    ``avals`` where a trace gave them) compiles with: its plan's, or its decided
    candidate's with ``tune=True``."""
    with nnx_arguments(object(), state.fun, args, kwargs) as (fun, args, kwargs, nnx_call):
        layout, leaves = split_arguments(fun, args, kwargs, state.static_args,
                                         allow_abstract=True, api="lower")
        key = state.call_key(layout, nnx_call is not None, leaves)
        if not key.rewrite or not targets.get(key.settings.target).compiles_with_xla_options:
            return {}
        if state.tuner is not None:
            key = state.tuner.decided_key(state, dataclasses.replace(key, tune="reuse"),
                                          leaves)
            if not key.rewrite:
                return {}
        if avals is None:
            avals = tuple(abstract(leaf) for leaf in leaves)
        return dict(state.prepare(Signature(key.layout, avals), key.settings,
                                  key.nnx).xla_options)
