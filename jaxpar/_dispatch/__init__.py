"""How a decorated function's calls reach their compiled program.

Read in this order:

  state     ``CallState``: one decorated function's options, plans, caches and the jit of
            its keyed path; ``CallKey``; ``JitOptions`` (``jax.jit``'s options it takes)
  shared    ``call_state``: one ``CallState`` for every decoration of a function with the
            same options (as ``jax.jit``'s caches are shared), held while the function lives
  fast      the top-level path: the environment's ``jax.jit`` whose C++ object is the
            function's call once installed, and ``route``, which its cache misses reach
  keyed     calls under a transformation, and top-level calls whose plan chose other
            XLA options: split arguments, a ``CallKey``, the keyed jit
  staged    ``trace``, ``lower`` and ``eval_shape`` (``lower`` with the plan's options)
  tuning    ``tune=True``'s hook: decided before a signature's first call, read when it
            is traced
  measuring ``measure``'s hook: jax.jit's program first, candidates built on a
            background thread, decided at a later call
  channel   the one per-thread channel between calls and the traces they start

``_api.ParallelBranches`` owns a ``CallState`` and its ``__call__`` is ``CallState.call``.

Example::

    state = CallState(fun, options, StaticArgs(), JitOptions(), {}, None)
    reset(state)          # the next call reads the environment and installs the jit
    out = state.call(x)   # JAX's C++ dispatch once x's signature is compiled
"""

from __future__ import annotations

from .decisions import CallTuner
from .fast import FastPath, Mode, current, read_environment, read_gpu_environment, reset
from .keyed import agree_across_processes, jit_for, transformed_call
from .measuring import MeasuringTuner, check_measure
from .shared import call_state
from .staged import StagedJits, lower_with_options, planned_options
from .state import (
    CallKey,
    CallState,
    JitOptions,
    XlaOptionsNotAppliedWarning,
    cached_jit,
    weak_method,
)
from .trace_scopes import inside_stream_call, options_applied, stream_call_body

__all__ = [
    "CallKey",
    "CallState",
    "CallTuner",
    "FastPath",
    "JitOptions",
    "MeasuringTuner",
    "Mode",
    "StagedJits",
    "XlaOptionsNotAppliedWarning",
    "agree_across_processes",
    "cached_jit",
    "check_measure",
    "call_state",
    "current",
    "inside_stream_call",
    "jit_for",
    "lower_with_options",
    "options_applied",
    "planned_options",
    "read_environment",
    "read_gpu_environment",
    "reset",
    "stream_call_body",
    "transformed_call",
    "weak_method",
]
