"""A decorated function's call state: its options, plans and caches, and the keyed jit.

``_api.ParallelBranches`` holds a ``CallState`` (one for every decoration of a function
with the same options: ``shared``); every other part of ``_dispatch`` takes
it as an argument. It holds what the function's calls share: the function, its options
and static arguments, ``jax.jit``'s options given to it (``JitOptions``), its plans by
signature (``PlanCache``), the memos of its calls (``CallMemos``), the jit that calls
under a transformation run in (``jitted``, keyed by a ``CallKey``) and ``call``, what
calling the decorated function calls (``_api.ParallelBranches.__call__``): JAX's C++
dispatch once the function ran at the top level (``fast``).

Example::

    state = CallState(fun, options, StaticArgs(), JitOptions(), planned_for={}, tuner=None)
    rewrite = state.prepare(signature, state.settings())   # the plan, cached

Sharp edges:
  * Every jit reaches the ``CallState`` through a weak reference (``weak_method``): a strong
    one would make a cycle (state -> jit -> function -> state) that keeps the function's
    closed-over arrays alive after ``del`` until the cyclic collector runs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import itertools
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from .. import _compat, _pipeline
from .._channel import CHANNEL
from .._frameworks import NnxCall
from .._options import Options, ResolveInputs, Settings, disabled_by_environment
from .._pipeline import Prepared
from .._plan import LevelPlan
from .._program import primitives as _primitives
from .._report.plan import Plan
from .._trace import (
    Layout,
    OutputStatics,
    Signature,
    StaticArgs,
    abstract,
    function_name,
    split_outputs,
)
from .trace_scopes import inside_stream_call

_CACHE_SIZE = 64
# At most this many settings and remembered jits per decorated function (a program
# changing its XLA_FLAGS or arguments' structure at every call must not grow them
# without end).
MEMO_SIZE = 256
_call_sites = itertools.count(1)


@dataclasses.dataclass(frozen=True, slots=True)
class JitOptions:
    """``jax.jit``'s own options that a decorated function takes as ``jax.jit`` does:
    donation, shardings and ``keep_unused``. Hashable (shardings are)."""

    donate_argnums: tuple[int, ...] = ()
    donate_argnames: tuple[str, ...] = ()
    in_shardings: Any = None
    out_shardings: Any = None
    keep_unused: bool = False

    def jit_kwargs(self) -> dict[str, Any]:
        """The keywords a ``jax.jit`` over the call's own arguments takes."""
        out: dict[str, Any] = {}
        if self.donate_argnums:
            out["donate_argnums"] = self.donate_argnums
        if self.donate_argnames:
            out["donate_argnames"] = self.donate_argnames
        if self.in_shardings is not None:
            out["in_shardings"] = self.in_shardings
        if self.out_shardings is not None:
            out["out_shardings"] = self.out_shardings
        if self.keep_unused:
            out["keep_unused"] = True
        return out

    @property
    def shardings(self) -> bool:
        return self.in_shardings is not None or self.out_shardings is not None

    @property
    def donates(self) -> bool:
        return bool(self.donate_argnums or self.donate_argnames)


@dataclasses.dataclass(frozen=True)
class CallKey:
    """The static argument of the jits a call runs under on the keyed path (``keyed``)."""

    layout: Layout
    # The arguments held Flax NNX objects: the traced function is the user's, over their
    # split state (NnxCall.inner), as under nnx.jit.
    nnx: bool
    emit_streams: bool  # False inside a user's on_stream call (stream calls cannot nest)
    rewrite: bool  # False when JAXPAR_DISABLE is set: run the original function
    # The options resolved for the target and XLA_FLAGS (the async compute limit and
    # the CUDA-graph mode), which jax.jit's own cache does not see.
    settings: Settings
    # Inside a program being staged out, each call site gets its own trace: the emitted
    # scheduling group ids must differ between two calls XLA inlines into one
    # computation (equal ids linked through other work abort the GPU compile).
    call_site: int
    # Names of the jax.vmap axes the call is mapped over on this device: a psum over
    # them is a local reduction, not a collective (``_program.primitives.local_axes``).
    local_axes: frozenset[Any] = frozenset()
    # tune=True: "measure" at a concrete top-level call (decided before the call, so the
    # trace finds the decision), "reuse" under a transformation (a decision this process
    # made, else the plan); "" when not tuning, or running a chosen candidate.
    tune: str = ""
    # The tuner's count of decisions when the key was made: a trace made before a
    # decision is not reused after it.
    tune_generation: int = 0


class XlaOptionsNotAppliedWarning(UserWarning):
    """A decorated function whose plan chose XLA options (a CUDA-graph mode) was traced
    inside another jit or transformation, whose compile decides the options."""


class TuneHook(Protocol):
    """What the dispatcher asks of ``tune=True`` (``_dispatch.decisions.CallTuner``)."""

    generation: int
    synchronous: bool  # decides before a signature's first call (else after it)

    def decided_key(self, state: CallState, key: CallKey, leaves: Sequence[Any]
                    ) -> CallKey: ...

    def decide(self, state: CallState, key: CallKey, leaves: Sequence[Any]) -> None: ...

    def register(self, state: CallState, key: CallKey, leaves: Sequence[Any]) -> Any: ...

    def note_unregistered(self, key: CallKey, leaves: Sequence[Any], error: Exception
                          ) -> None: ...

    def start(self, state: CallState, registered: Any,
              first_call_s: float | None = None) -> None: ...

    def forget(self, registered: Any) -> None: ...

    def clear(self) -> None: ...


def bounded(memo: dict[Any, Any]) -> dict[Any, Any]:
    """``memo``, emptied first when full."""
    if len(memo) >= MEMO_SIZE:
        memo.clear()
    return memo


def options_key(options: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(options.items()))


class CallMemos:
    """What a decorated function's calls remember beyond its plans: the settings of each
    environment (``settings``), the top-level paths by environment reading (``fast``) and
    by what the reading decides (``fast_by_mode``), and the signatures whose program the
    processes compared (``agreed``). Emptied by ``clear_cache()`` and ``jax.clear_caches()``,
    as the jits' caches are; each holds at most ``MEMO_SIZE`` entries."""

    __slots__ = ("__weakref__", "agreed", "fast", "fast_by_mode", "settings")

    def __init__(self, function: str) -> None:
        self.settings: dict[ResolveInputs, Settings] = {}
        self.fast: dict[tuple[Any, ...], Any] = {}
        self.fast_by_mode: dict[Any, Any] = {}
        self.agreed: dict[Any, None] = {}
        _compat.register_for_clear_caches(self, f"jaxpar call memos of {function}")

    def _memos(self) -> tuple[dict[Any, Any], ...]:
        return (self.settings, self.fast, self.fast_by_mode, self.agreed)

    def cache_clear(self) -> None:
        for memo in self._memos():
            memo.clear()

    def cache_info(self) -> tuple[int, int]:  # what jax's cache registry asks of a cache
        return sum(map(len, self._memos())), MEMO_SIZE

    def cache_keys(self) -> list[Any]:
        return [key for memo in self._memos() for key in memo]


class PlanCache:
    """The rewrites of one decorated function, most recently used last.

    Registered with ``jax.clear_caches()``, which empties it, as it empties JAX's own
    caches; it holds jaxprs, so it dies with the decorated function.
    """

    def __init__(self, size: int):
        self._size = size
        self._entries: collections.OrderedDict[Any, Prepared] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Prepared | None:
        with self._lock:
            try:
                hit = self._entries.get(key)
            except Exception as error:  # a static value's __eq__ raised, as jax.jit says
                raise ValueError(
                    "static arguments should be comparable using __eq__ (as in jax.jit): "
                    f"comparing one raised {type(error).__name__}: {error}") from error
            if hit is not None:
                self._entries.move_to_end(key)
            return hit

    def put(self, key: Any, rewrite: Prepared) -> None:
        with self._lock:
            self._entries[key] = rewrite
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)

    def cache_clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def cache_info(self) -> tuple[int, int]:
        return len(self._entries), self._size

    def cache_keys(self) -> list[Any]:
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class CallState:
    """Everything a decorated function's calls share (see the module docstring). Held by
    its ``ParallelBranches`` (one, or the twins ``shared`` gives it to) and, when shared,
    by ``shared``'s registry while the function lives; nothing else holds it but weakly."""

    __slots__ = ("__weakref__", "_fun", "_nnx_function", "analyses", "boundary", "call",
                 "has_statics", "held_weakly", "installed", "jit_options", "jitted",
                 "jitted_with", "memos", "nnx_tag", "options", "planned_for", "plans",
                 "read_environment", "scalars_made_static", "static_args", "switch_lock",
                 "tuner")

    def __init__(self, fun: Callable[..., Any], options: Options, static_args: StaticArgs,
                 jit_options: JitOptions, planned_for: dict[str, Any],
                 tuner: TuneHook | None, held_weakly: bool = False):
        name = function_name(fun)
        # A state shared between decorations (``shared``) lives in a registry as long as
        # the function does, so it holds the function weakly (its decorations hold it):
        # a strong reference would keep both alive for ever.
        self.held_weakly = held_weakly
        self._fun: Callable[[], Any] = weakref.ref(fun) if held_weakly else lambda: fun
        self.options = options
        # What to plan for instead of the CUDA-graph mode in XLA_FLAGS and this machine's
        # GPU: gpu_preview plans for the GPU and the mode it judges in.
        self.planned_for = planned_for
        self.static_args = static_args
        self.jit_options = jit_options
        self.has_statics = bool(static_args.nums or static_args.names)
        self.plans = PlanCache(_CACHE_SIZE)
        _compat.register_for_clear_caches(self.plans, f"jaxpar rewrites of {name}")
        self.analyses = 0  # how many times a signature was planned
        self.memos = CallMemos(name)
        # nnx.jit's update context is keyed by a tag: one per decorated function (not
        # the owner, which the traced function would then keep alive in a cycle).
        self.nnx_tag = object()
        self._nnx_function: Callable[..., Any] | None = None
        # Layouts (with Python scalars traced) whose trace needed them as Python values.
        self.scalars_made_static: set[Layout] = set()
        self.tuner = tuner
        self.jitted: Any = jax.jit(weak_method(self, "call_traced", fun), static_argnums=0,
                                   keep_unused=jit_options.keep_unused)
        self.jitted_with: dict[tuple[tuple[str, str], ...], Any] = {}
        # What calling the decorated function calls, and what a call that misses reads
        # its environment with; both set by ``_dispatch.fast``.
        self.call: Callable[..., Any] = _unset_call
        self.read_environment: Callable[[], tuple[Any, ...]] = _unset_call
        # The call ``install_call`` installed last, and a hook the next call goes through
        # before it (the measuring tuner's decision at a call boundary), set from the
        # measuring thread too: both change under ``switch_lock``.
        self.installed: Callable[..., Any] = _unset_call
        self.boundary: Callable[..., Any] | None = None
        self.switch_lock = threading.RLock()

    @property
    def fun(self) -> Callable[..., Any]:
        """The decorated function (the original)."""
        fun = self._fun()
        if fun is None:  # only a jit captured elsewhere can outlive its function
            raise ReferenceError("jaxpar: this parallel_branches function was deleted")
        return fun

    def traced_function(self, nnx: bool) -> Callable[..., Any]:
        if not nnx:
            return self.fun
        if self.held_weakly:  # made per trace: kept, it would hold the function
            return NnxCall(self.nnx_tag).inner(self.fun)
        if self._nnx_function is None:
            self._nnx_function = NnxCall(self.nnx_tag).inner(self.fun)
        return self._nnx_function

    def call_traced(self, key: CallKey, *leaves: Any) -> tuple[list[Any], OutputStatics]:
        """The trace of ``jitted`` and ``jitted_with``'s jits. Array outputs leave the jit
        as values, the rest (functions, a returned Equinox module's static fields) in the
        output's tree structure."""
        if key.tune:
            assert self.tuner is not None
            key = self.tuner.decided_key(self, key, leaves)
        if not key.rewrite:
            args, kwargs = key.layout.rebuild(leaves)
            out = self.traced_function(key.nnx)(*args, **kwargs)
            return split_outputs(out, key.layout.static_scalars)
        rewrite = self.prepare(Signature(key.layout, tuple(abstract(leaf) for leaf in leaves)),
                               key.settings, key.nnx, key.local_axes)
        if rewrite.traced.consts_are_tracers:
            CHANNEL.traced_consts.add(id(self))
        _warn_if_options_lost(self, key, rewrite)
        return rewrite.run(leaves, key.emit_streams), rewrite.traced.outputs

    def prepare(self, sig: Signature, settings: Settings, nnx: bool = False,
                local_axes: frozenset[Any] = frozenset()) -> Prepared:
        """The signature's analysis (``_pipeline.analyse``), cached."""
        # JAX's trace context (x64, promotion rules, matmul precision, default device,
        # mesh...) changes what tracing produces, so it keys the plan as it keys jax.jit.
        key = (sig, settings, _compat.trace_context(), nnx, local_axes)
        hit = self.plans.get(key)
        if hit is not None:
            return hit
        with _primitives.local_axes(local_axes):
            rewrite = _pipeline.analyse(self.traced_function(nnx), sig, settings)
        self.analyses += 1
        if not rewrite.traced.consts_are_tracers:
            self.plans.put(key, rewrite)
        return rewrite

    def settings(self) -> Settings:
        """The settings in this environment, built once per environment."""
        inputs = self.options.resolve_inputs(**self.planned_for)
        settings = self.memos.settings.get(inputs)
        if settings is None:
            settings = self.options.settings_from(inputs)
            bounded(self.memos.settings)[inputs] = settings
        return settings

    def call_key(self, layout: Layout, nnx: bool, leaves: Sequence[Any] = (),
                 settings: Settings | None = None, rewrite: bool | None = None) -> CallKey:
        """The key of a call (its settings built once per environment)."""
        return CallKey(layout, nnx, not inside_stream_call(),
                       not disabled_by_environment() if rewrite is None else rewrite,
                       self.settings() if settings is None else settings,
                       next(_call_sites) if _compat.staging() else 0,
                       _compat.vmap_axis_names(leaves))

    def call_text(self, avals: Sequence[Any]) -> str:
        """``f(f32[8,4], ...)``: a call, for messages."""
        shown = ", ".join(str(aval) for aval in avals[:4]) + (", ..." if len(avals) > 4 else "")
        return f"{function_name(self.fun)}({shown})"

    def analysed_report(self) -> tuple[Plan, LevelPlan]:
        """The report and plan of the one signature analysed (``gpu_preview`` compiles a
        fresh function once and reports what that compile analysed).

        Raises:
          RuntimeError: no signature was analysed, or several.
        """
        entries = self.plans.cache_keys()
        if self.analyses != 1 or len(entries) != 1:
            raise RuntimeError(f"jaxpar: expected one analysis of "
                               f"parallel_branches({function_name(self.fun)}), "
                               f"found {self.analyses}")
        prepared = self.plans.get(entries[0])
        assert prepared is not None
        return prepared.report(function_name(self.fun), self.options), prepared.plan

    def clear(self) -> None:
        """Forgets every plan, memo and compiled program of the jits held here."""
        for fast in list(self.memos.fast_by_mode.values()):
            fast.clear_cache()
        self.plans.cache_clear()
        self.memos.cache_clear()
        self.scalars_made_static.clear()
        if self.tuner is not None:
            self.tuner.clear()
        self.jitted.clear_cache()
        for jitted in self.jitted_with.values():
            jitted.clear_cache()


def install_call(state: CallState, call: Callable[..., Any]) -> None:
    """Makes ``call`` what calling the decorated function calls (behind ``state.boundary``
    while one is set: the next call goes through it first)."""
    with state.switch_lock:
        state.installed = call
        state.call = call if state.boundary is None else functools.partial(state.boundary,
                                                                            call)


def set_boundary(state: CallState, boundary: Callable[..., Any] | None) -> None:
    """Sets (or, None, removes) the hook the next call goes through before the installed
    call; it receives that call first, then the call's arguments."""
    with state.switch_lock:
        state.boundary = boundary
        install_call(state, state.installed)


def _unset_call(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("jaxpar: a call state's call was used before its function set it")


# The call states warned about with ``XlaOptionsNotAppliedWarning`` (once each).
_warned_options_lost: weakref.WeakSet[CallState] = weakref.WeakSet()


def _warn_if_options_lost(state: CallState, key: CallKey, rewrite: Prepared) -> None:
    """Warns, once per function, when its plan chose XLA options for another
    CUDA-graph mode than the process's but this trace is not compiled with them (an
    outer ``jax.jit``, or ``grad``/``vmap`` of the call, compiles it with the outer
    program's options)."""
    options = rewrite.xla_options
    mode = rewrite.mode
    if not options or mode is None or mode.mode is mode.user_mode or not key.emit_streams \
            or state in _warned_options_lost or CHANNEL.options_owner is state:
        return
    _warned_options_lost.add(state)
    name = function_name(state.fun)
    shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
    warnings.warn(
        f"jaxpar: the plan of `{name}` compiles it with XLA options {{{shown}}}, but it is "
        "traced inside another jit or transformation, whose compile decides the options, "
        "so they are not applied. Pass them to the outermost jit: jax.jit(<the function "
        f"that calls {name}>, compiler_options=jaxpar.inspect({name})(*args).xla_options), "
        f"or call `{name}` at the top level (warned once per function; a warnings filter "
        "silences it where the outer jit has them).",
        XlaOptionsNotAppliedWarning, stacklevel=2)


def cached_jit(cache: dict[tuple[tuple[str, str], ...], Any], options: dict[str, str],
               make: Callable[[dict[str, str]], Any]) -> Any:
    """The jit ``make(options)`` made once per distinct ``options``, kept in ``cache``."""
    key = options_key(options)
    if key not in cache:
        cache[key] = make(dict(options))
    return cache[key]


def weak_method(owner: Any, method: str, fun: Callable[..., Any] | None,
                top: bool = False) -> Callable[..., Any]:
    """A function calling ``owner.<method>`` through a weak reference to ``owner``,
    named after ``fun`` (lowered programs and profiles name the user's function, as
    ``jax.jit`` does). ``top``: the trace of a jit carrying the XLA options of
    ``owner``'s plan, which the channel tells the trace (``options_applied``)."""
    ref = weakref.ref(owner)

    def call(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        if target is None:  # only a jit captured elsewhere can outlive its owner
            raise ReferenceError("jaxpar: this parallel_branches function was deleted")
        if not top:
            return getattr(target, method)(*args, **kwargs)
        before = CHANNEL.options_owner
        CHANNEL.options_owner = target
        try:
            return getattr(target, method)(*args, **kwargs)
        finally:
            CHANNEL.options_owner = before

    name_after(call, fun)
    return call


def wrapping(call: Callable[..., Any], state: CallState) -> Callable[..., Any]:
    """``call`` dressed as the state's function (``functools.wraps``: its name, docs and
    signature, which ``jax.jit`` reads ``static_argnames`` by). Where the state holds the
    function weakly, ``__wrapped__`` is a weak proxy (JAX reads the source line through
    it) and the signature is copied onto ``call``."""
    fun = state.fun
    functools.wraps(fun)(call)
    if state.held_weakly:
        with contextlib.suppress(TypeError, ValueError):  # no signature: as jax.jit finds
            call.__signature__ = inspect.signature(fun)  # type: ignore[attr-defined]
        call.__wrapped__ = weakref.proxy(fun)  # type: ignore[attr-defined]
    return call


def name_after(call: Callable[..., Any], fun: Any) -> Callable[..., Any]:
    """``call`` named as ``fun`` (without reading ``fun``'s repr)."""
    if fun is not None:
        name, qualname = getattr(fun, "__name__", None), getattr(fun, "__qualname__", None)
        call.__name__ = name if isinstance(name, str) else type(fun).__name__
        call.__qualname__ = qualname if isinstance(qualname, str) else call.__name__
    return call

