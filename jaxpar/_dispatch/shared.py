"""One ``CallState`` for every decoration of a function with the same options.

``jax.jit(f)(2); jax.jit(f)(3)`` traces ``f`` once: ``jax.jit`` keys its caches on the
function (weakly) and its options. ``call_state`` does the same for ``parallel_branches``:
a registry from the function (by identity, weakly) and its options, hashed, to the
``CallState`` holding the plans, memos and compiled programs of its calls. A step
decorated inline in a loop (``jaxpar.parallel_branches(step)(state, batch)``) is traced,
planned and compiled once per signature, not at every call; each decoration stays its own
``ParallelBranches`` (its ``analyses`` count its own calls' plans, its staged jits are its
own).

Example::

    first = call_state(fun, options, StaticArgs(), JitOptions(), planned_for, None)
    assert call_state(fun, options, StaticArgs(), JitOptions(), planned_for, None) is first

Sharp edges:
  * Not shared (a state of its own, as before): ``tune=True`` (the tuner's state is the
    decoration's), options that cannot be hashed or compared (a sharding that is not
    hashable), and functions that cannot be weakly referenced. Different options
    (``target``, ``unroll``, ``static_argnums``, ``donate_argnums``...) key different
    states.
  * Keyed by the function object's identity, not its equality: two bound methods of one
    object (``obj.step`` read twice) or two equal Equinox modules share nothing.
  * ``clear_cache()`` of one decoration clears the state all its twins share, as
    ``jax.jit``'s ``clear_cache()`` evicts the function from the caches its jits share.
  * The registry holds a state while its function lives; the state holds the function
    weakly (``CallState.held_weakly``; the decorations hold it strongly), so deleting the
    function and its decorations frees the state, its plans and compiled programs.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable
from typing import Any

from .._memo import WeakIdentityMemo
from .._options import Options
from .._trace import StaticArgs
from .state import CallState, JitOptions, TuneHook, bounded

# Re-entrant: a weak reference's callback can run on this thread while the lock is held,
# when a collection starts inside ``call_state``.
_lock = threading.RLock()
# Each function's states by sharing key, while the function lives.
_states: WeakIdentityMemo[Any, dict[Hashable, CallState]] = WeakIdentityMemo()


def call_state(fun: Callable[..., Any], options: Options, static_args: StaticArgs,
               jit_options: JitOptions, planned_for: dict[str, Any],
               tuner: TuneHook | None, measure: bool | str = False) -> CallState:
    """The state of ``fun`` decorated with these options: the one an earlier decoration
    made, while ``fun`` lives, else a new one (see the module docstring). Without a
    ``tune`` tuner, ``measure`` gives the state a measuring tuner (shared with it)."""
    key = _sharing_key(options, static_args, jit_options, planned_for, tuner, measure)
    new = functools.partial(_new_state, fun, options, static_args, jit_options, planned_for,
                            tuner, measure)
    if key is None:
        return new()
    with _lock:
        states = _states.get(fun)
        if states is None:
            states = {}
            if not _states.set(fun, states):  # no weak reference to it: not shared
                return new()
        try:
            state = states.get(key)
        except Exception:  # an option's __eq__ raised: not shared, never an error
            return new()
        if state is None:
            state = new(held_weakly=True)
            bounded(states)[key] = state
        return state


def _new_state(fun: Callable[..., Any], options: Options, static_args: StaticArgs,
               jit_options: JitOptions, planned_for: dict[str, Any], tuner: TuneHook | None,
               measure: bool | str, held_weakly: bool = False) -> CallState:
    """A new state, with a measuring tuner of its own where ``measure`` asks for one."""
    if tuner is None and measure:
        from .measuring import MeasuringTuner
        tuner = MeasuringTuner(measure)
    return CallState(fun, options, static_args, jit_options, planned_for, tuner,
                     held_weakly=held_weakly)


def shared_states() -> int:
    """How many functions the registry holds states for (for tests)."""
    with _lock:
        return len(_states)


def forget_shared_states() -> None:
    """For tests: later decorations start afresh (those made keep their states), as in a
    new process."""
    with _lock:
        _states.clear()


def _sharing_key(options: Options, static_args: StaticArgs, jit_options: JitOptions,
                 planned_for: dict[str, Any], tuner: TuneHook | None,
                 measure: bool | str) -> Hashable | None:
    """What keys a shared state besides the function; None where nothing is shared."""
    if tuner is not None:
        return None
    key = (options, static_args, jit_options, tuple(sorted(planned_for.items())), measure)
    try:
        hash(key)
    except Exception:  # an unhashable sharding, or a __hash__ that raises
        return None
    return key
