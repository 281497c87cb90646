"""The top-level path: a decorated function's calls served by JAX's C++ dispatch.

A ``FastPath`` holds, for one environment (``Mode``: the settings ``XLA_FLAGS`` decides and
whether ``JAXPAR_DISABLE`` is set), a ``jax.jit`` of ``entry`` over the call's own
arguments, with the function's ``static_argnums``/``static_argnames``, its ``jax.jit``
options (donation, shardings) and the XLA options its plans chose. Calling the decorated
function calls that jit's C++ object itself (``CallState.call``), so once a signature is
compiled a call runs no Python of jaxpar's, as a ``jax.jit`` function's does. Every call
the C++ side has not compiled reaches ``route`` (the jit's cache miss), which decides, in
Python and once per signature for plain calls:

* under a transformation (tracer arguments): the keyed path (``keyed.transformed_call``);
* the environment changed since this jit was installed: the new environment's jit;
* Flax NNX objects, static leaves (strings, functions, objects, Python scalars beside an
  Equinox module): split by jaxpar and run in the environment's flat jit, every call
  (nothing is cached on the C++ side for them);
* otherwise (arrays, Python scalars, containers of them): after the processes agree and
  the tuner decides, and with the plan's XLA options found first (``plan_options``),
  ``jax.jit``'s own miss traces ``entry`` and compiles; the C++ side caches the result.
  A signature whose plan chose other XLA options than the environment's jit compiles
  with (once another signature ran in it) runs in the same jit made with those options
  (``FastPath.with_options``: the function's donation and shardings kept), reached
  through this jit's miss at each call.

Example::

    fast = current(state)            # reads the environment, installs the jit
    out = fast.routed.call(x, y)     # = calling the decorated function

Sharp edges:
  * The environment (``XLA_FLAGS``, ``JAXPAR_DISABLE``, a GPU's calibration file) is read
    when a call misses, not at every call: a signature compiled before a change keeps its
    program until a call misses (a new signature, a transformation) or ``clear_cache()``.
  * Under ``jax.disable_jit()`` the C++ object calls ``entry`` eagerly: it calls the
    user's function.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .. import _compat, targets
from .._channel import CHANNEL
from .._compat import Miss, RoutedJit, routed_jit
from .._flags import environment_reader
from .._frameworks import holds_nnx_object, is_nnx_object, nnx_arguments
from .._model.gpu import PROFILE_DIR_VARIABLE, local_gpu_kind, local_profile_stamp
from .._options import DISABLE_VARIABLE, Settings, disabled_by_environment
from .._trace import (
    Layout,
    Signature,
    StateKeyed,
    StaticArg,
    abstract,
    function_name,
    packed_outputs,
    split_arguments,
    split_outputs,
)
from . import keyed
from .state import CallKey, CallState, bounded, install_call, name_after, options_key, wrapping
from .trace_scopes import options_applied

# The variables a top-level call's environment is read from when a call misses
# (XLA_FLAGS and these).
read_environment = environment_reader((DISABLE_VARIABLE, PROFILE_DIR_VARIABLE))


def read_gpu_environment() -> tuple[Any, ...]:
    """``read_environment`` and this GPU's calibration file: a function planned for the
    machine's own GPU reads its figures from that file."""
    return *read_environment(), local_profile_stamp()


@dataclasses.dataclass(frozen=True)
class Mode:
    """What a top-level call reads from its environment: the settings (``XLA_FLAGS``) and
    whether to rewrite at all (``JAXPAR_DISABLE``)."""

    settings: Settings
    rewrite: bool


Options = tuple[tuple[str, str], ...]


class FastPath:
    """The jits of top-level calls in one environment (see the module docstring):
    ``routed``, over the call's own arguments (its C++ object is what calling the
    decorated function calls), and the flat jits, over jaxpar's split of the arguments
    (``(layout, nnx), *leaves``), one per donated-leaf pattern. Both compile with
    ``options``, the XLA options of the signatures they run; ``accepted``: a signature
    ran in them (they no longer move to other options). ``others``: the same jits
    compiling with other XLA options, for signatures whose plans chose them
    (``with_options``), with the function's donation and shardings as here. Their
    functions hold the call state weakly, and never this object."""

    __slots__ = ("accepted", "flat_jits", "mode", "nnx_jitted", "options", "others", "routed",
                 "splits", "static_at")

    def __init__(self, state: CallState, mode: Mode, options: Options = ()):
        self.mode = mode
        self.options = options
        self.accepted = False
        self.flat_jits: dict[tuple[int, ...], Any] = {}
        self.others: dict[Options, FastPath] = {}
        # How calls of one argument structure split (``memo_split``): the static leaves'
        # positions by structure and leaf types, and the split by their values too.
        self.static_at: dict[Any, tuple[int, ...] | None] = {}
        self.splits: dict[Any, FlatSplit] = {}
        # ``nnx.jit`` of the function's keyed path, for calls with Flax NNX objects.
        self.nnx_jitted: Any = None
        ref = weakref.ref(state)
        self.routed: RoutedJit = routed_jit(
            _entry(ref, mode, state), functools.partial(_miss, ref, mode, options),
            static_argnums=state.static_args.nums, static_argnames=state.static_args.names,
            compiler_options=dict(options) or None, **state.jit_options.jit_kwargs())

    def flat(self, state: CallState, donated: tuple[int, ...]) -> Any:
        """The flat jit donating the leaves at ``donated``."""
        jitted = self.flat_jits.get(donated)
        if jitted is None:
            flat = _flat(weakref.ref(state), self.mode)
            name_after(flat, state.fun)
            jitted = self.flat_jits[donated] = jax.jit(
                flat, static_argnums=0, compiler_options=dict(self.options) or None,
                donate_argnums=tuple(i + 1 for i in donated),
                keep_unused=state.jit_options.keep_unused)
        return jitted

    def with_options(self, state: CallState, options: Options) -> FastPath:
        """This environment's jits compiling with ``options`` (made once per options)."""
        if options == self.options:
            return self
        other = self.others.get(options)
        if other is None:
            other = self.others[options] = FastPath(state, self.mode, options)
            other.accepted = True
        return other

    def clear_cache(self) -> None:
        for other in self.others.values():
            other.clear_cache()
        self.routed.clear_cache()
        for jitted in self.flat_jits.values():
            jitted.clear_cache()
        self.static_at.clear()
        self.splits.clear()


@dataclasses.dataclass(frozen=True, slots=True)
class FlatSplit:
    """A remembered split of the calls of one argument structure, leaf types and static
    values (``memo_split``): the layout, and the positions of the traced leaves among
    the flattened arguments and of the donated ones among those."""

    layout: Layout
    traced: tuple[int, ...]
    donated: tuple[int, ...]


def memo_split(state: CallState, fast: FastPath, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> tuple[FlatSplit, list[Any]] | None:
    """A call's split as an earlier call of the same structure, leaf types and static
    values split (one flatten and two lookups, as ``eqx.filter_jit`` partitions), with its
    flattened leaves; None where none was remembered."""
    leaves, tree = jax.tree_util.tree_flatten(state.static_args.mark(args, kwargs))
    shape_key = (tree, tuple(map(type, leaves)))
    at = fast.static_at.get(shape_key)
    if at is None:
        return None
    try:
        found = fast.splits.get((shape_key, tuple(_static_value(leaves[i]) for i in at)))
    except TypeError:  # an unhashable static value: the full split says what to do
        return None
    return None if found is None else (found, leaves)


def _static_value(leaf: Any) -> tuple[type, Any]:
    """A static leaf's key: its value and the value's type, as ``Layout.statics`` and
    ``jax.jit`` key it (``1 == 1.0 == True``; a ``static_argnums`` value's type is not in
    the leaf types, which show ``StaticArg``)."""
    value = leaf.value if isinstance(leaf, StaticArg) else leaf
    return type(value), value


def _remember_split(state: CallState, fast: FastPath, layout: Layout, args: tuple[Any, ...],
                    kwargs: dict[str, Any], donated: tuple[int, ...]) -> None:
    """Remembers the split of a call whose static leaves key it by their own values (not a
    snapshot of an object's state, which must be taken at every call)."""
    if any(isinstance(value, StateKeyed) for _, _, value in layout.statics):
        return
    leaves, tree = jax.tree_util.tree_flatten(state.static_args.mark(args, kwargs))
    if tree != layout.in_tree:
        return
    static = tuple(index for index, _, _ in layout.statics)
    shape_key = (tree, tuple(map(type, leaves)))
    try:
        key = (shape_key, tuple(_static_value(leaves[i]) for i in static))
        hash(key)
    except TypeError:
        return
    traced = tuple(i for i in range(len(leaves)) if i not in set(static))
    bounded(fast.static_at)[shape_key] = static
    bounded(fast.splits)[key] = FlatSplit(layout, traced, donated)


def first_call(ref: weakref.ref[CallState], *args: Any, **kwargs: Any) -> Any:
    """A decorated function's call until its environment's jit is installed."""
    state = _alive(ref)
    return current(state).routed.call(*args, **kwargs)


def reset(state: CallState) -> None:
    """Forgets the installed jit: the next call reads the environment again."""
    install_call(state, functools.partial(first_call, weakref.ref(state)))
    state.read_environment = read_environment


def current(state: CallState) -> FastPath:
    """The environment's ``FastPath`` (read now), installed as the function's call."""
    memos = state.memos
    reading = state.read_environment()
    # Under the lock the measuring thread switches paths with (``replace_path``): the path
    # read is the one installed, never one a switch just replaced.
    with state.switch_lock:
        return _current(state, memos, reading)


def _current(state: CallState, memos: Any, reading: tuple[Any, ...]) -> FastPath:
    fast = memos.fast.get(reading)
    if fast is None:
        settings = state.settings()
        if targets.get(settings.target).compiles_with_xla_options \
                and state.planned_for["gpu"] is None and local_gpu_kind() is not None:
            state.read_environment = read_gpu_environment
            reading = read_gpu_environment()
        mode = Mode(settings, not disabled_by_environment())
        fast = memos.fast_by_mode.get(mode)
        if fast is None:
            fast = bounded(memos.fast_by_mode)[mode] = FastPath(state, mode)
        bounded(memos.fast)[reading] = fast
    if state.installed is not fast.routed.call:
        install_call(state, fast.routed.call)
    return fast


def _alive(ref: weakref.ref[CallState]) -> CallState:
    state = ref()
    if state is None:  # only a jit captured elsewhere can outlive its owner
        raise ReferenceError("jaxpar: this parallel_branches function was deleted")
    return state


# --------------------------------------------------------------------- the traces


def _entry(ref: weakref.ref[CallState], mode: Mode, state: CallState) -> Callable[..., Any]:
    """The function ``FastPath.routed`` jits: the call's own arguments in, its output
    out (``packed_outputs``), jaxpar's program of the signature in between."""

    def entry(*args: Any, **kwargs: Any) -> Any:
        state = _alive(ref)
        if _compat.jit_disabled():  # jax.disable_jit(): the original, eagerly
            return state.fun(*args, **kwargs)
        layout, leaves = split_arguments(state.fun, args, kwargs, state.static_args)
        return top_program(state, CallKey(layout, False, True, mode.rewrite, mode.settings, 0),
                           leaves)

    # Named as the user's function, with its signature (jax.jit reads static_argnames and
    # donate_argnames by it), as jax.jit's own programs and profiles name it.
    return wrapping(entry, state)


def _flat(ref: weakref.ref[CallState], mode: Mode) -> Callable[..., Any]:
    def flat(split: tuple[Layout, bool], *leaves: Any) -> Any:
        layout, nnx = split
        CHANNEL.traced_anew = True
        return top_program(_alive(ref), CallKey(layout, nnx, True, mode.rewrite,
                                                mode.settings, 0), list(leaves))
    return flat


def top_program(state: CallState, key: CallKey, leaves: Sequence[Any]) -> Any:
    """What a top-level call's jit traces: the tuner's decided candidate where it decided
    one, else the signature's plan (or the original function without rewriting); the
    call's output itself (``packed_outputs``)."""
    if state.tuner is not None and key.rewrite:
        key = state.tuner.decided_key(state, dataclasses.replace(key, tune="measure"), leaves)
    return key_program(state, key, leaves)


def key_program(state: CallState, key: CallKey, leaves: Sequence[Any]) -> Any:
    """``key``'s program of the call (its settings' plan, or the original function where
    ``key`` does not rewrite), its output packed as ``top_program``'s."""
    if not key.rewrite:
        full_args, full_kwargs = key.layout.rebuild(leaves)
        out = state.traced_function(key.nnx)(*full_args, **full_kwargs)
        return packed_outputs(*split_outputs(out, key.layout.static_scalars))
    rewrite = state.prepare(Signature(key.layout, tuple(abstract(leaf) for leaf in leaves)),
                            key.settings, key.nnx)
    with options_applied(state):  # the jit compiles with the plan's options
        return packed_outputs(rewrite.run(leaves, True), rewrite.traced.outputs)


# ------------------------------------------------------ measuring the split calls




def measured_split(state: CallState, mode: Mode, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> tuple[CallKey, list[Any]]:
    """A top-level call's key and leaves as the measuring tuner keys its signature: Flax
    NNX objects split as ``nnx.jit`` splits them (the candidates are timed on that split
    state, which they never write back), static leaves in the layout."""
    if not holds_nnx_object((args, kwargs)):
        layout, leaves = split_arguments(state.fun, args, kwargs, state.static_args)
        return CallKey(layout, False, True, mode.rewrite, mode.settings, 0), leaves
    with nnx_arguments(state.nnx_tag, state.fun, args, kwargs) as (fun, pure_args,
                                                                     pure_kwargs, _):
        layout, leaves = split_arguments(fun, pure_args, pure_kwargs, state.static_args)
    return CallKey(layout, True, True, mode.rewrite, mode.settings, 0), leaves


def measure_new_trace(state: CallState, mode: Mode, out: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any], started: float) -> Any:
    """``out``, after a call jaxpar split (NNX objects, static leaves) that began at
    ``started`` (``time.perf_counter``): where it traced a signature anew at the top level
    and the measuring tuner takes it, the signature is registered and started as
    ``route`` does for the C++ path's calls (it ran ``jax.jit``'s program, as the trace
    found no decision), its first call's time counted from ``started``. Costs one split
    of the arguments, once per signature. Never raises: measuring never breaks a call (the
    signature then runs ``jax.jit``'s program)."""
    traced, CHANNEL.traced_anew = CHANNEL.traced_anew, False
    tuner = state.tuner
    if not traced or tuner is None or tuner.synchronous or not mode.rewrite \
            or not _compat.top_level():  # a trace under an outer one is no call to measure
        return out
    try:
        key, leaves = measured_split(state, mode, args, kwargs)
    except Exception:
        return out  # ``tuning`` of these arguments splits them the same way, and says why
    try:
        measured = tuner.register(state, key, leaves)
    except Exception as error:
        try:
            tuner.note_unregistered(key, leaves, error)
        except Exception:
            pass
        return out
    if measured is not None:
        tuner.start(state, measured, time.perf_counter() - started)
    return out


# --------------------------------------------------------------------- the misses


def _miss(ref: weakref.ref[CallState], mode: Mode, options: Options, jax_miss: Miss
          ) -> Miss:
    def miss(*args: Any, **kwargs: Any) -> tuple[Any, Any, bool]:
        return route(_alive(ref), mode, options, jax_miss, args, kwargs)
    return miss


def _uncached(out: Any) -> tuple[Any, Any, bool]:
    return out, None, False


def route(state: CallState, mode: Mode, options: Options, jax_miss: Miss,
          args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, bool]:
    """A call the C++ side did not serve (see the module docstring)."""
    if not _compat.top_level():  # tracers: under grad, vmap, jvp, an outer jit
        return _uncached(keyed.transformed_call(state, args, kwargs))
    fast = current(state)
    if fast.mode != mode or (fast.options != options and options not in fast.others):
        # The environment changed since this jit was installed.
        return _uncached(fast.routed.call(*args, **kwargs))
    started = time.perf_counter()
    CHANNEL.traced_anew = False  # what this call's split path traces sets it
    remembered = memo_split(state, fast, args, kwargs) if fast.splits else None
    if remembered is not None:
        split, flat_leaves = remembered
        out = fast.flat(state, split.donated)((split.layout, False),
                                              *[flat_leaves[i] for i in split.traced])
        return _uncached(measure_new_trace(state, fast.mode, out, args, kwargs, started))
    if holds_nnx_object((args, kwargs)):
        out = _nnx_call(state, fast, args, kwargs)
        return _uncached(measure_new_trace(state, fast.mode, out, args, kwargs, started))
    layout, leaves = split_arguments(state.fun, args, kwargs, state.static_args)
    if splits_statics(state, layout, args, kwargs):
        out = flat_call(state, fast, layout, False, leaves, args, kwargs)
        return _uncached(measure_new_trace(state, fast.mode, out, args, kwargs, started))
    key = CallKey(layout, False, True, mode.rewrite, mode.settings, 0)
    tuner = state.tuner
    # A signature the measuring tuner takes runs jax.jit's program until decided: known
    # before its options are chosen (none, then) and its trace made.
    measured = tuner.register(state, key, leaves) if tuner is not None else None
    try:
        out = _run_signature(state, fast, options, jax_miss, key, leaves, args, kwargs)
    except BaseException:
        if measured is not None and tuner is not None:
            tuner.forget(measured)
        raise
    if measured is not None and tuner is not None:
        tuner.start(state, measured)  # after the call: it costs what jax.jit's first does
    return out


def _run_signature(state: CallState, fast: FastPath, options: Options, jax_miss: Miss,
                   key: CallKey, leaves: list[Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> tuple[Any, Any, bool]:
    """A signature's first call on this path: in the jit carrying the XLA options it
    compiles with (this one, or one made with them), by jax.jit's own miss here."""
    chosen = _prepare_signature(state, key, leaves)
    if chosen != options:
        if not fast.accepted:  # no signature ran in this jit: it moves to the options
            fast = retarget(state, fast, chosen)
        return _uncached(fast.with_options(state, chosen).routed.call(*args, **kwargs))
    fast.accepted = True
    return jax_miss(*args, **kwargs)


def runs_routed(state: CallState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a top-level call with these arguments runs in ``FastPath.routed`` (no Flax
    NNX objects, no static leaves of jaxpar's), not split by jaxpar."""
    if holds_nnx_object((args, kwargs)):
        return False
    layout, _ = split_arguments(state.fun, args, kwargs, state.static_args)
    return not splits_statics(state, layout, args, kwargs)


def splits_statics(state: CallState, layout: Layout, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> bool:
    """Whether the call holds static leaves of jaxpar's (strings, functions, objects, an
    Equinox module's Python scalars), which JAX's dispatch cannot take as such (``args``
    may be abstract: only the static arguments' places are read)."""
    return len(layout.statics) > _declared_statics(state, args, kwargs)


def _declared_statics(state: CallState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """How many of this call's arguments ``static_argnums``/``static_argnames`` name (each
    one static leaf, which JAX's dispatch hashes itself)."""
    statics = state.static_args
    if not statics.nums and not statics.names:
        return 0
    count = len({i % len(args) for i in statics.nums if -len(args) <= i < len(args)})
    return count + sum(1 for name in statics.names if name in kwargs)


def _prepare_signature(state: CallState, key: CallKey, leaves: Sequence[Any]) -> Options:
    """Before the first call of a signature: the processes agree, the tuner decides, and
    the XLA options its program compiles with (its plan's, or the decided candidate's)."""
    if jax.process_count() > 1:
        keyed.agree_across_processes(state, key, leaves)
    if state.tuner is not None and key.rewrite:
        state.tuner.decide(state, key, leaves)
    return plan_options(state, key, leaves)


def plan_options(state: CallState, key: CallKey, leaves: Sequence[Any]) -> Options:
    """The XLA options a top-level call of ``key``'s signature compiles with: those its
    plan chose (the tuner's decided candidate's, with ``tune=True``); none off the GPU."""
    if not key.rewrite or not targets.get(key.settings.target).compiles_with_xla_options:
        return ()
    if state.tuner is not None:
        key = state.tuner.decided_key(state, dataclasses.replace(key, tune="measure"), leaves)
        if not key.rewrite:
            return ()
    avals = tuple(abstract(leaf) for leaf in leaves)
    return options_key(state.prepare(Signature(key.layout, avals), key.settings,
                                     key.nnx).xla_options)


def replace_path(state: CallState, old: FastPath, new: FastPath) -> None:
    """``new`` in ``old``'s place for every environment reading, installed."""
    state.memos.fast_by_mode[old.mode] = new
    for reading, held in list(state.memos.fast.items()):
        if held is old:
            state.memos.fast[reading] = new
    install_call(state, new.routed.call)


def retarget(state: CallState, fast: FastPath, options: Options) -> FastPath:
    """A new ``FastPath`` for ``fast``'s environment compiling with ``options``, installed."""
    moved = FastPath(state, fast.mode, options)
    replace_path(state, fast, moved)
    return moved


def flat_call(state: CallState, fast: FastPath, layout: Layout, nnx: bool,
              leaves: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A top-level call whose arguments jaxpar split: in the environment's flat jit, or
    in one carrying other XLA options where its signature's plan chose them (with the
    function's donation, as in the environment's)."""
    if state.jit_options.shardings:
        raise TypeError(
            f"{function_name(state.fun)} takes in_shardings/out_shardings, which apply to "
            "calls whose arguments are arrays and containers of arrays (as under jax.jit); "
            "this call holds values jaxpar passes as static (strings, functions, objects, "
            "an Equinox module's Python scalars) or Flax NNX objects. Place the arrays with "
            "jax.device_put instead, or make the other values static_argnums/"
            "static_argnames.")
    key = CallKey(layout, nnx, True, fast.mode.rewrite, fast.mode.settings, 0)
    fast = fast.with_options(state, _prepare_signature(state, key, leaves))
    donated = donated_leaves(state, layout, args, kwargs) if state.jit_options.donates else ()
    # Where nothing is decided per signature (a plan's XLA options, a tuner's decision, the
    # processes' agreement), later calls of this structure skip the split (``memo_split``).
    if not nnx and not targets.get(key.settings.target).compiles_with_xla_options \
            and jax.process_count() == 1 \
            and (state.tuner is None or not state.tuner.synchronous):
        _remember_split(state, fast, layout, args, kwargs, donated)
    return fast.flat(state, donated)((layout, nnx), *leaves)


def _nnx_call(state: CallState, fast: FastPath, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
    """A top-level call with Flax NNX objects. Where their other leaves are arrays and
    Python scalars: run by ``nnx.jit`` (which splits the objects, and writes back the
    state the call changed) around the keyed path, so jaxpar's plan is made in
    ``nnx.jit``'s trace and a call costs what ``nnx.jit``'s costs, and the function's call
    then sends such calls there directly (``_nnx_router``). With static values of
    jaxpar's among them (a config object, a string), which ``nnx.jit`` would refuse, or
    with ``tune=True`` (whose decision a concrete call makes before its trace): split as
    ``nnx.jit`` splits the objects and run in the flat jit."""
    if (state.tuner is not None and state.tuner.synchronous) or \
            not _plain_besides_nnx(state, args, kwargs):
        # tune=True: nnx.jit's trace would hold no concrete call to measure; the split
        # here decides each signature before its first call (``flat_call``).
        return _nnx_flat_call(state, fast, args, kwargs)
    if fast.nnx_jitted is None:
        from flax import nnx

        ref = weakref.ref(state)

        def planned(*inner_args: Any, **inner_kwargs: Any) -> Any:
            CHANNEL.traced_anew = True
            return keyed.transformed_call(_alive(ref), inner_args, inner_kwargs)

        name_after(planned, state.fun)
        fast.nnx_jitted = nnx.jit(planned, static_argnums=state.static_args.nums,
                                  static_argnames=state.static_args.names,
                                  **_nnx_jit_options(state))
    kinds = frozenset(type(value) for value in (*args, *kwargs.values())
                      if is_nnx_object(value))
    if kinds:
        install_call(state, functools.partial(_nnx_router, weakref.ref(state), fast.mode,
                                              fast.routed.call, fast.nnx_jitted,
                                              kinds | _ROUTED_LEAVES))
    return fast.nnx_jitted(*args, **kwargs)


# Argument types ``_nnx_router`` sends to ``nnx.jit`` beside the NNX objects' own.
_ROUTED_LEAVES = frozenset({_compat.ARRAY_IMPL, bool, int, float, complex})


def _plain_besides_nnx(state: CallState, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> bool:
    """Whether every leaf of the call's arguments (static arguments aside) is an NNX
    object, an array or a Python scalar."""
    marked = state.static_args.mark(args, kwargs)
    leaves = jax.tree_util.tree_leaves(marked, is_leaf=is_nnx_object)
    return all(isinstance(leaf, (jax.Array, StaticArg, bool, int, float, complex))
               or is_nnx_object(leaf) for leaf in leaves)


def _nnx_router(ref: weakref.ref[CallState], mode: Mode, call: Any, nnx_jitted: Any,
                kinds: frozenset[type], *args: Any, **kwargs: Any) -> Any:
    """The call of a function whose calls pass Flax NNX objects: ``nnx.jit``'s where every
    argument is an NNX object (of a kind seen), an array or a Python scalar, by type, and
    one is an NNX object; otherwise the C++ dispatch (whose miss routes the rest)."""
    nnx = False
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if kind not in kinds:
            return call(*args, **kwargs)
        nnx = nnx or kind not in _ROUTED_LEAVES
    if not nnx:
        return call(*args, **kwargs)
    # The flag of an enclosing trace (this call inside another decorated function's) is
    # kept for it: this call says only whether nnx.jit traced a new signature of its own.
    enclosing, CHANNEL.traced_anew = CHANNEL.traced_anew, False
    try:
        started = time.perf_counter()
        out = nnx_jitted(*args, **kwargs)
        return measure_new_trace(_alive(ref), mode, out, args, kwargs, started)
    finally:
        CHANNEL.traced_anew = enclosing and not _compat.top_level()


def _nnx_flat_call(state: CallState, fast: FastPath, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
    """An NNX call with static values: the objects split as ``nnx.jit`` splits them, the
    call in the flat jit, the state it changed written back."""
    with nnx_arguments(state.nnx_tag, state.fun, args, kwargs) as (fun, pure_args,
                                                                     pure_kwargs, nnx_call):
        layout, leaves = split_arguments(fun, pure_args, pure_kwargs, state.static_args)
        out = flat_call(state, fast, layout, True, leaves, pure_args, pure_kwargs)
        assert nnx_call is not None
        return nnx_call.from_pure(out)


def _nnx_jit_options(state: CallState) -> dict[str, Any]:
    options = state.jit_options
    out: dict[str, Any] = {}
    if options.donate_argnums:
        out["donate_argnums"] = options.donate_argnums
    if options.donate_argnames:
        out["donate_argnames"] = options.donate_argnames
    if options.shardings:
        raise keyed.refuse_nnx_shardings(state)
    return out


def donated_leaves(state: CallState, layout: Layout, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> tuple[int, ...]:
    """The positions among the traced leaves of the arguments ``donate_argnums`` and
    ``donate_argnames`` name (``static_argnums`` resolved against them as jax.jit does)."""
    options = state.jit_options
    nums = {i if i >= 0 else i + len(args) for i in options.donate_argnums}
    names = set(options.donate_argnames)
    positions = list(range(layout.in_tree.num_leaves))
    by_arg, by_kwarg = jax.tree_util.tree_unflatten(layout.in_tree, positions)
    chosen: set[int] = set()
    for i, arg in enumerate(by_arg):
        if i in nums:
            chosen.update(jax.tree_util.tree_leaves(arg))
    for name, arg in by_kwarg.items():
        if name in names:
            chosen.update(jax.tree_util.tree_leaves(arg))
    static = {index for index, _, _ in layout.statics}
    traced = [i for i in positions if i not in static]
    return tuple(k for k, i in enumerate(traced) if i in chosen)
