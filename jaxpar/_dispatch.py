"""How a decorated function's calls reach their compiled program: its call state, its jits
and the paths a call takes through them.

``_api.ParallelBranches`` owns one ``CallState`` (the function, its options, its plans, what
its calls remember and its jits) and hands it to the functions here, which are the whole
dispatcher: a top-level call runs in its environment's ``TopLevel`` jits (``direct`` once
compiled, which JAX's C++ dispatch alone serves; ``flat`` for split arguments), any other
call (under a transformation, the tuner's deciding call, several processes, an
environment whose signatures chose different XLA options) takes ``keyed_call``: a
``CallKey`` and the jit ``jit_for`` picks. Each jit traces ``CallState.call_traced``, which
emits the signature's plan (``_pipeline.Prepared``).

Example::

    state = CallState(fun, options, StaticArgs(), planned_for, None)
    out = split_call(state, fun, args, kwargs, False)

Sharp edges:
  * The jits reach the ``CallState`` through a weak reference (``weak_method``): a strong
    one would make a cycle (state -> jit -> call -> state) that keeps the function's
    closed-over arrays alive after ``del`` until the cyclic collector runs.
  * ``tune=True`` enters through the ``TuneHook`` a ``CallState`` holds (``_call_tuner``):
    this module asks it for a signature's decided key and lets it measure, nothing more.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from . import _compat, _pipeline, _primitives, _processes
from ._flags import environment_reader, xla_flags_text
from ._frameworks import NnxCall, holds_equinox_module, holds_nnx_object
from ._gpu_model import PROFILE_DIR_VARIABLE, local_gpu_kind, local_profile_stamp
from ._options import (
    DISABLE_VARIABLE,
    Options,
    ResolveInputs,
    Settings,
    disabled_by_environment,
)
from ._pipeline import Prepared
from ._plan import LevelPlan
from ._report.plan import Plan
from ._trace import (
    Layout,
    OutputStatics,
    Scalars,
    Signature,
    StaticArgs,
    abstract,
    function_name,
    has_python_scalars,
    needs_python_values,
    packed_outputs,
    split_arguments,
    split_outputs,
)
from ._tune import fingerprint as program_fingerprint
from ._tune import program_flags, versions

_CACHE_SIZE = 64
# At most this many settings and remembered jits per decorated function (a program
# changing its XLA_FLAGS or arguments' structure at every call must not grow them
# without end).
_MEMO_SIZE = 256


@dataclasses.dataclass(frozen=True)
class CallKey:
    """The static argument of the one ``jax.jit`` a decorated function runs under."""

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
    # them is a local reduction, not a collective (``_primitives.local_axes``).
    local_axes: frozenset[Any] = frozenset()
    # tune=True: "measure" at a concrete top-level call (decide when tracing, measuring
    # first if no decision exists), "reuse" under a transformation (a decision this
    # process made, else the plan); "" when not tuning, or running a chosen candidate.
    tune: str = ""
    # Bumped by each measurement: a jit cache entry whose trace raised MeasureFirst
    # stays off jax.jit's fast C++ path, so the calls after it use a new key.
    tune_generation: int = 0


class WrongOptions(Exception):
    """Raised from the trace of a signature whose plan chose XLA options other than
    those of the jit the call ran (``dispatch``): the call looks the
    signature's plan up first instead, and so does every later call with its key."""


class MeasureFirst(Exception):
    """Raised from a concrete call's trace that finds no decision: ``keyed_call`` measures
    outside the trace, then calls again. Only traces (a new signature) pay for it."""


class Retarget(Exception):
    """Raised from a top-level jit's trace whose plan chose other XLA options than the
    jit's (``TopLevel``)."""

    def __init__(self, options: tuple[tuple[str, str], ...]):
        super().__init__(options)
        self.options = options


class XlaOptionsNotAppliedWarning(UserWarning):
    """A decorated function whose plan chose XLA options (a CUDA-graph mode) was traced
    inside another jit or transformation, whose compile decides the options."""


class TuneHook(Protocol):
    """What the dispatcher asks of ``tune=True`` (``_call_tuner.CallTuner``)."""

    generation: int

    def decided_key(self, state: CallState, key: CallKey, leaves: Sequence[Any]
                    ) -> CallKey: ...

    def decided_candidate(self, state: CallState, key: CallKey, avals: tuple[Any, ...]
                          ) -> CallKey | None: ...

    def measure(self, state: CallState, key: CallKey, leaves: Sequence[Any]) -> CallKey: ...

    def clear(self) -> None: ...


# The jit options a call expects its trace to confirm: (call state, key, options).
_expected = threading.local()
# The call state whose options-carrying jit is tracing (``jit_for``, ``options_applied``).
_top_trace = threading.local()
# ``lower`` traces the function once to learn the options its plan chose.
_lowering = threading.local()
# Whether the last exception out of a top-level jit was raised in its trace (by jaxpar or
# the user's function) rather than by jax.jit refusing an argument first.
_top_level_state = threading.local()
_stream_state = threading.local()
# The call states warned about with ``XlaOptionsNotAppliedWarning`` (once each).
_warned_options_lost: weakref.WeakSet[CallState] = weakref.WeakSet()
_call_sites = itertools.count(1)

# Leaf types ``direct`` takes as jax.jit does: arrays, then Python scalars (traced).
DIRECT_ARRAYS = frozenset({_compat.ARRAY_IMPL, np.ndarray})
DIRECT_LEAVES = DIRECT_ARRAYS | {bool, int, float, complex}
# What an argument tree holds (``CallMemos.tree_kinds``): no framework object, an
# Equinox module (its Python scalars are static), a Flax NNX object.
_PLAIN_TREE, _EQUINOX_TREE, _NNX_TREE = 0, 1, 2
# ``direct_failed``/``flat_call``: not served there, take the next path.
INDIRECT: Any = object()

# The variables a top-level call's environment is read from, on every call (XLA_FLAGS
# and these).
read_environment = environment_reader((DISABLE_VARIABLE, PROFILE_DIR_VARIABLE))


def read_gpu_environment() -> tuple[Any, ...]:
    """``read_environment`` and this GPU's calibration file: a function planned for the
    machine's own GPU reads its figures from that file."""
    return *read_environment(), local_profile_stamp()


def inside_stream_call() -> bool:
    """Whether we are tracing the body of a user's ``on_stream`` call."""
    return bool(getattr(_stream_state, "depth", 0))


@contextlib.contextmanager
def stream_call_body() -> Iterator[None]:
    """Within: the body of a user's ``on_stream`` call is being traced."""
    _stream_state.depth = getattr(_stream_state, "depth", 0) + 1
    try:
        yield
    finally:
        _stream_state.depth -= 1


def _bounded(memo: dict[Any, Any]) -> dict[Any, Any]:
    """``memo``, emptied first when full."""
    if len(memo) >= _MEMO_SIZE:
        memo.clear()
    return memo


def options_key(options: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(options.items()))


@dataclasses.dataclass(frozen=True)
class Mode:
    """What a top-level call reads from its environment: the settings (``XLA_FLAGS``) and
    whether to rewrite at all (``JAXPAR_DISABLE``)."""

    settings: Settings
    rewrite: bool


class CallMemos:
    """What a decorated function's calls remember beyond its plans: the settings of each
    environment (``Options.resolve_inputs``); the jits of top-level calls by environment
    (``top``: by the variables read, ``top_modes``: by what they decide) and what the
    argument trees hold (``tree_kinds``, ``direct_tree``); and per top-level GPU key of
    ``keyed_call``'s path the jit its signatures chose with that jit's options
    (``key_jits``), or that they chose two (``mixed_keys``). Emptied by ``clear_cache()`` and
    ``jax.clear_caches()``, as the jits' caches are; each holds at most ``_MEMO_SIZE``
    entries."""

    __slots__ = ("__weakref__", "agreed", "key_jits", "mixed_keys", "settings", "top",
                 "top_modes", "tree_kinds")

    def __init__(self, function: str) -> None:
        self.settings: dict[ResolveInputs, Settings] = {}
        self.top: dict[tuple[Any, ...], TopLevel | None] = {}
        self.top_modes: dict[Mode, TopLevel] = {}
        self.tree_kinds: dict[Any, int] = {}
        self.key_jits: dict[CallKey, tuple[Any, tuple[tuple[str, str], ...]]] = {}
        self.mixed_keys: dict[CallKey, None] = {}
        # Signatures whose program the processes compared (``agree_across_processes``).
        self.agreed: dict[Any, None] = {}
        _compat.register_for_clear_caches(self, f"jaxpar call memos of {function}")

    def _memos(self) -> tuple[dict[Any, Any], ...]:
        return (self.settings, self.top, self.top_modes, self.tree_kinds, self.key_jits,
                self.mixed_keys, self.agreed)

    def cache_clear(self) -> None:
        for memo in self._memos():
            memo.clear()

    def cache_info(self) -> tuple[int, int]:  # what jax's cache registry asks of a cache
        return sum(map(len, self._memos())), _MEMO_SIZE

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
    """Everything a decorated function's calls share: the function, its options and
    static arguments, its plans (``plans``, ``analyses``), what its calls remember
    (``memos``), the jit every call runs under (``jitted``: eager calls and calls under
    grad, vmap or jvp stay compiled; jit inside jit is inlined) and the top-level GPU
    jits by the XLA options their plans chose (``jitted_with``), and the tuner's hook.
    Owned by one ``ParallelBranches``; nothing else holds it but weakly."""

    __slots__ = ("__weakref__", "_nnx_function", "analyses", "fun", "has_statics", "jitted",
                 "jitted_with", "memos", "nnx_tag", "options", "planned_for", "plans",
                 "read_environment", "saw_traced_consts", "scalars_made_static",
                 "static_args", "tuner")

    def __init__(self, fun: Callable[..., Any], options: Options, static_args: StaticArgs,
                 planned_for: dict[str, Any], tuner: TuneHook | None):
        name = function_name(fun)
        self.fun = fun
        self.options = options
        # What to plan for instead of the CUDA-graph mode in XLA_FLAGS and this machine's
        # GPU: gpu_preview plans for the GPU and the mode it judges in.
        self.planned_for = planned_for
        self.static_args = static_args
        self.has_statics = bool(static_args.nums or static_args.names)
        self.plans = PlanCache(_CACHE_SIZE)
        _compat.register_for_clear_caches(self.plans, f"jaxpar rewrites of {name}")
        self.analyses = 0  # how many times a signature was planned
        self.memos = CallMemos(name)  # settings, jits picked per key
        # What a top-level call reads its environment with (``top_level`` chooses).
        self.read_environment: Callable[[], tuple[Any, ...]] = read_environment
        self.saw_traced_consts = threading.local()
        # nnx.jit's update context is keyed by a tag: one per decorated function (not
        # the owner, which the traced function would then keep alive in a cycle).
        self.nnx_tag = object()
        self._nnx_function: Callable[..., Any] | None = None
        # Layouts (with Python scalars traced) whose trace needed them as Python values.
        self.scalars_made_static: set[Layout] = set()
        self.tuner = tuner
        self.jitted: Any = jax.jit(weak_method(self, "call_traced", fun), static_argnums=0)
        self.jitted_with: dict[tuple[tuple[str, str], ...], Any] = {}

    def traced_function(self, nnx: bool) -> Callable[..., Any]:
        if not nnx:
            return self.fun
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
        expected = getattr(_expected, "value", None)
        if expected is not None and expected[0] is self and expected[1] == key:
            _expected.value = None  # this trace's: not a nested call's
            if options_key(rewrite.xla_options) != expected[2]:
                raise WrongOptions
        if rewrite.traced.consts_are_tracers:
            self.saw_traced_consts.value = True
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
            _bounded(self.memos.settings)[inputs] = settings
        return settings

    def call_key(self, layout: Layout, nnx: bool, leaves: Sequence[Any] = ()) -> CallKey:
        """The key of a call (its settings built once per environment)."""
        return CallKey(layout, nnx, not inside_stream_call(), not disabled_by_environment(),
                       self.settings(), next(_call_sites) if _compat.staging() else 0,
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
        self.plans.cache_clear()
        self.memos.cache_clear()
        self.scalars_made_static.clear()
        if self.tuner is not None:
            self.tuner.clear()
        self.jitted.clear_cache()
        for jitted in self.jitted_with.values():
            jitted.clear_cache()


class TopLevel:
    """The jits that serve top-level calls in one environment (``Mode``).

    ``direct`` takes the call's own arguments (with ``static_argnums``/``static_argnames``
    as ``jax.jit`` takes them) and splits them in its trace, so once a signature is
    compiled JAX's C++ dispatch alone runs the call, as it runs a ``jax.jit`` function:
    for calls whose leaves are arrays and Python scalars (``ParallelBranches.__call__``).
    ``flat`` takes them split, ``(layout, nnx), *leaves``: calls with static leaves,
    Equinox modules holding Python scalars, Flax NNX objects. Both trace what
    ``CallState.call_traced`` traces for a top-level call; neither holds the call state
    but weakly, nor this object.

    With ``tune=True`` a trace runs the candidate this process decided for its signature;
    without a decision it raises ``MeasureFirst``: the call takes ``keyed_call``'s
    path, which decides, and the jits are made anew (``renew``).

    On target ``"gpu"`` both compile with the XLA options (CUDA-graph mode) ``options``:
    none at first; the first signature whose plan chose others moves them (``retarget``)
    while no signature ran in them yet (``accepted``). Once a signature's plan chose
    options other than those of the signatures run, ``direct`` and ``flat`` become
    None: the environment's calls take ``keyed_call``'s path, which picks a jit per
    signature.
    """

    __slots__ = ("accepted", "direct", "flat", "mode", "options")

    def __init__(self, state: CallState, mode: Mode):
        self.mode = mode
        self.options: tuple[tuple[str, str], ...] = ()
        # Set by the jits' traces when a signature's plan chose ``options``.
        self.accepted = [False]
        self.direct: Any
        self.flat: Any
        self.direct, self.flat = top_level_jits(state, mode, (), self.accepted)

    def renew(self, state: CallState) -> None:
        """New jits with the same options: the tuner decided a signature whose trace
        raised, and jax.jit keeps such a signature off its C++ path."""
        self.direct, self.flat = top_level_jits(state, self.mode, self.options, self.accepted)

    def retarget(self, state: CallState, options: tuple[tuple[str, str], ...]) -> bool:
        """Moves the jits to ``options`` (True), or gives them up (False)."""
        if self.accepted[0] or self.direct is None or options == self.options:
            self.direct = self.flat = None
            return False
        self.options = options
        self.direct, self.flat = top_level_jits(state, self.mode, options, self.accepted)
        return True


# --------------------------------------------------------------- the top-level path


def top_level(state: CallState) -> TopLevel | None:
    """The jits of top-level calls in this environment (``CallMemos.top`` missed), None
    where calls take ``keyed_call``'s path: under several processes (they agree at each
    signature's first call first)."""
    memos = state.memos
    top = None
    settings = state.settings()
    if settings.target == "gpu" and state.planned_for["gpu"] is None \
            and local_gpu_kind() is not None:
        state.read_environment = read_gpu_environment
    if jax.process_count() == 1:
        mode = Mode(settings, not disabled_by_environment())
        top = memos.top_modes.get(mode)
        if top is None:
            top = _bounded(memos.top_modes)[mode] = TopLevel(state, mode)
    _bounded(memos.top)[state.read_environment()] = top
    return top


def direct_tree(state: CallState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``TopLevel.direct`` takes this call: where its arguments (less the static
    ones) have only arrays and Python scalars as leaves, and ``jax.jit`` splits them as
    ``split_arguments`` does: no Flax NNX object among them, and no Equinox module with a
    Python scalar (Equinox makes them static)."""
    dynamic = _dynamic_arguments(state.static_args, args, kwargs) if state.has_statics \
        else (args, kwargs)
    leaves, tree = jax.tree_util.tree_flatten(dynamic)
    types = set(map(type, leaves))
    if not types <= DIRECT_LEAVES:
        return False
    kinds = state.memos.tree_kinds
    try:
        kind = kinds.get(tree)
    except TypeError:  # a node's unhashable data: jaxpar's path says what to do
        return False
    if kind is None:
        kind = _NNX_TREE if holds_nnx_object(dynamic) else \
            _EQUINOX_TREE if holds_equinox_module(dynamic) else _PLAIN_TREE
        _bounded(kinds)[tree] = kind
    return kind == _PLAIN_TREE or (kind == _EQUINOX_TREE and types <= DIRECT_ARRAYS)


def direct_failed(state: CallState, top: TopLevel, error: BaseException,
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """After ``top.direct(*args, **kwargs)`` raised ``error``: the call in the jit its plan
    chose (``Retarget``), or ``INDIRECT`` where ``jax.jit`` refused an argument before
    tracing (jaxpar's path then says what is wrong in its words), or ``error`` again."""
    traced = getattr(_top_level_state, "raised", False)
    _top_level_state.raised = False
    if isinstance(error, MeasureFirst):
        top.renew(state)
        return INDIRECT
    if isinstance(error, Retarget):
        if not top.retarget(state, error.options):
            return INDIRECT
        try:
            return top.direct(*args, **kwargs)
        except BaseException as again:
            return direct_failed(state, top, again, args, kwargs)
    if traced or not isinstance(error, (TypeError, ValueError, OverflowError)):
        raise error
    return INDIRECT


def _flat_call(state: CallState, top: TopLevel, layout: Layout, nnx: bool,
               leaves: list[Any]) -> Any:
    """``top.flat((layout, nnx), *leaves)``, or ``INDIRECT`` once ``top`` gave up."""
    if top.flat is None:
        return INDIRECT
    try:
        return top.flat((layout, nnx), *leaves)
    except MeasureFirst:
        _top_level_state.raised = False
        top.renew(state)
        return INDIRECT
    except Retarget as error:
        _top_level_state.raised = False
        if top.retarget(state, error.options):
            return _flat_call(state, top, layout, nnx, leaves)
        return INDIRECT
    except BaseException:
        _top_level_state.raised = False
        raise


def _dynamic_arguments(statics: StaticArgs, args: tuple[Any, ...], kwargs: dict[str, Any]
                       ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` without the static arguments."""
    nums = {i if i >= 0 else i + len(args) for i in statics.nums}
    return (tuple(a for i, a in enumerate(args) if i not in nums),
            {k: v for k, v in kwargs.items() if k not in statics.names})


def top_level_jits(state: CallState, mode: Mode, options: tuple[tuple[str, str], ...],
                   accepted: list[bool]) -> tuple[Any, Any]:
    """``TopLevel``'s two jits, compiling with ``options``. Their functions reach ``state``
    through a weak reference and hold ``mode``, ``options`` and ``accepted`` only, never
    the ``TopLevel`` holding them (no cycle keeps a dead function's programs alive)."""
    ref = weakref.ref(state)
    statics = state.static_args

    def direct(*args: Any, **kwargs: Any) -> Any:
        return _top_level_trace(ref, mode, options, accepted, None, args, kwargs)

    def flat(split: tuple[Layout, bool], *leaves: Any) -> Any:
        return _top_level_trace(ref, mode, options, accepted, split, leaves, {})

    # Named as the user's function (lowered programs and profiles name it, as jax.jit's
    # do), with its signature, which jax.jit reads static_argnames by.
    direct = functools.wraps(state.fun)(direct)
    flat.__name__ = flat.__qualname__ = direct.__name__
    given = dict(options) or None
    return (jax.jit(direct, static_argnums=statics.nums, static_argnames=statics.names,
                    compiler_options=given),
            jax.jit(flat, static_argnums=0, compiler_options=given))


def _top_level_trace(ref: weakref.ref[CallState], mode: Mode,
                     options: tuple[tuple[str, str], ...], accepted: list[bool],
                     split: tuple[Layout, bool] | None, args: Sequence[Any],
                     kwargs: dict[str, Any]) -> Any:
    """The trace of a top-level call (``TopLevel``): the program ``call_traced`` gives a
    top-level call, returning the call's output itself (``packed_outputs``).

    Raises:
      Retarget: the plan chose XLA options other than ``options``.
      MeasureFirst: ``tune=True`` and no decision for this signature in this process.
    """
    try:
        state = ref()
        if state is None:  # only a jit captured elsewhere can outlive its owner
            raise ReferenceError("jaxpar: this parallel_branches function was deleted")
        if split is None:
            layout, leaves = split_arguments(state.fun, tuple(args), kwargs, state.static_args)
            nnx = False
        else:
            (layout, nnx), leaves = split, list(args)
        key = CallKey(layout, nnx, True, mode.rewrite, mode.settings, 0)
        if state.tuner is not None and key.rewrite:
            key = state.tuner.decided_key(state, dataclasses.replace(key, tune="measure"),
                                          leaves)
        rewrite = None if not key.rewrite else state.prepare(
            Signature(layout, tuple(abstract(leaf) for leaf in leaves)), key.settings, nnx)
        chosen = () if rewrite is None else options_key(rewrite.xla_options)
        if chosen != options:
            raise Retarget(chosen)
        accepted[0] = True
        if rewrite is None:
            full_args, full_kwargs = layout.rebuild(leaves)
            out = state.traced_function(nnx)(*full_args, **full_kwargs)
            return packed_outputs(*split_outputs(out, layout.static_scalars))
        with options_applied(state):  # this jit compiles with them: no warning is due
            return packed_outputs(rewrite.run(leaves, True), rewrite.traced.outputs)
    except BaseException:
        _top_level_state.raised = True
        raise


# ------------------------------------------------------ split and keyed calls


def split_call(state: CallState, fun: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any], nnx: bool, top: TopLevel | None = None) -> Any:
    """A call not served by ``TopLevel.direct``: its arguments split by jaxpar, run by
    ``TopLevel.flat`` at the top level, else with ``keyed_call``."""
    # Under a trace (eval_shape), jax.jit takes a ShapeDtypeStruct as an abstract argument.
    layout, leaves = split_arguments(fun, args, kwargs, state.static_args,
                                     allow_abstract=top is None and not _compat.top_level())
    if top is not None:  # at the top level: no tracers, no retrying
        out = _flat_call(state, top, layout, nnx, leaves)
        if out is not INDIRECT:
            return out
    # Python scalars are traced as jax.jit traces them, so results match it bit for
    # bit. Under a transformation a function that needs one as a Python value
    # (range(n), an outer jit's static argument passed on) is traced again with them
    # static, where jax.jit would raise; at the top level the error stands, and says
    # to use static_argnums.
    retry = has_python_scalars(leaves) and any(map(_compat.is_tracer, leaves))
    if retry and layout in state.scalars_made_static:
        return _call_with_static_scalars(state, fun, args, kwargs, nnx)
    try:
        return keyed_call(state, layout, leaves, nnx)
    except Exception as error:
        if not (retry and needs_python_values(error)):
            raise
    out = _call_with_static_scalars(state, fun, args, kwargs, nnx)
    state.scalars_made_static.add(layout)
    return out


def _call_with_static_scalars(state: CallState, fun: Callable[..., Any],
                              args: tuple[Any, ...], kwargs: dict[str, Any], nnx: bool) -> Any:
    """A call with its Python scalars static (``split_call``)."""
    layout, leaves = split_arguments(fun, args, kwargs, state.static_args,
                                     scalars=Scalars.STATIC)
    return keyed_call(state, layout, leaves, nnx)


def keyed_call(state: CallState, layout: Layout, leaves: list[Any], nnx: bool) -> Any:
    """A call under a transformation, the tuner's deciding call, a call under several
    processes, or in an environment whose signatures chose different XLA options
    (``TopLevel``)."""
    key = state.call_key(layout, nnx, leaves)
    if jax.process_count() > 1:
        agree_across_processes(state, key, leaves)
    tuner = state.tuner
    if tuner is not None and key.rewrite and key.emit_streams:
        # The decision is looked up when jax.jit traces (once per signature), so a
        # call that hits jit's cache pays nothing for the tuner.
        concrete = not key.call_site and not any(map(_compat.is_tracer, leaves))
        key = dataclasses.replace(key, tune="measure" if concrete else "reuse",
                                  tune_generation=tuner.generation)
    state.saw_traced_consts.value = False
    try:
        dynamic, outputs = dispatch(state, key, leaves)
    except MeasureFirst:
        assert tuner is not None
        key = tuner.measure(state, key, leaves)
        dynamic, outputs = jit_for(state, key, leaves)(key, *leaves)
    if state.saw_traced_consts.value:
        # The trace closed over another trace's tracers: jit must not reuse it.
        state.jitted.clear_cache()
    return outputs.rebuild(dynamic)


def dispatch(state: CallState, key: CallKey, leaves: Sequence[Any]) -> Any:
    """A call: ``jitted(key, *leaves)`` for the jit ``jit_for`` picks; where every
    signature planned under ``key`` chose one jit (``CallMemos.key_jits``), that jit,
    whose trace of a new signature checks the choice (``CallState.call_traced``)."""
    memos = state.memos
    known = memos.key_jits.get(key)
    # Remembered only where ``jit_for`` picks by the plan (target "gpu", rewriting,
    # streams on, not tuning): it does so at the top level, outside ``lower``.
    if known is not None and _compat.top_level() \
            and getattr(_lowering, "owner", None) is not state:
        jitted, options = known
        _expected.value = (state, key, options)
        try:
            return jitted(key, *leaves)
        except WrongOptions:
            memos.key_jits.pop(key, None)
            _bounded(memos.mixed_keys)[key] = None
        finally:
            _expected.value = None
    jitted = jit_for(state, key, leaves, remember=True)
    return jitted(key, *leaves)


def jit_for(state: CallState, key: CallKey, leaves: Sequence[Any],
            remember: bool = False) -> Any:
    """The jit a call with ``key`` runs under: on the GPU at the top level, one carrying
    the XLA options (the CUDA-graph mode) its plan chose (``{}`` included: these jits
    trace only top-level calls, never one under a transformation, whose trace ``jitted``
    keeps), else ``jitted``. With ``remember``, a top-level GPU pick is remembered for
    ``key`` (``dispatch``)."""
    lowering = getattr(_lowering, "owner", None) is state
    if not (key.settings.target == "gpu" and key.rewrite and key.emit_streams and (
            lowering or _compat.top_level())):
        return state.jitted
    # The plan chooses this function's XLA options: they go into this jit's compile,
    # and only there. jax.jit takes them only at the top level; inside another jit
    # the outer one's options apply. With the tuner, the decided candidate's plan.
    avals = tuple(abstract(leaf) for leaf in leaves)
    settings = key.settings
    if state.tuner is not None and key.tune:
        decided = state.tuner.decided_candidate(state, key, avals)
        if decided is not None:
            if not decided.rewrite:
                return state.jitted
            settings = decided.settings
    options = state.prepare(Signature(key.layout, avals), settings, key.nnx,
                            key.local_axes).xla_options
    if lowering:
        _lowering.options = options
        return state.jitted
    jitted = cached_jit(state.jitted_with, options, lambda given: jax.jit(
        weak_method(state, "call_traced", state.fun, top=True), static_argnums=0,
        compiler_options=given or None))
    if remember and not key.tune and key not in state.memos.mixed_keys:
        _bounded(state.memos.key_jits)[key] = (jitted, options_key(options))
    return jitted


def agree_across_processes(state: CallState, key: CallKey, leaves: Sequence[Any]) -> None:
    """At the first top-level call of a signature whose arguments span every process:
    the processes compare what decides jaxpar's program for it (``_processes.agree``: a
    collective, which every process reaches there as it reaches the program).

    Raises:
      ProcessMismatchError: on every process, where they would compile different
        programs (another ``XLA_FLAGS``, GPU calibration, options or version).
    """
    if key.call_site or not key.rewrite or not _compat.top_level():
        return
    avals = tuple(abstract(leaf) for leaf in leaves)
    checked = (key, avals, _compat.trace_context())
    if checked in state.memos.agreed:
        return
    if _processes.span(leaves) == _processes.ALL:
        prepared = state.prepare(Signature(key.layout, avals), key.settings, key.nnx,
                                 key.local_axes)
        levels = [(level.path, level.order, level.collective_groups)
                  for level in prepared.plan.walk()]
        loops = [(d.location, d.kind, d.eqns, d.unroll, d.pass_name) for d in prepared.decisions]
        _processes.agree(state.call_text(avals), {
            "versions": versions(), "xla_flags": program_flags(xla_flags_text()),
            "settings": repr(key.settings),
            "decisions": program_fingerprint(repr((levels, loops))),
            "xla_options": sorted(prepared.xla_options.items())})
    _bounded(state.memos.agreed)[checked] = None


# ------------------------------------------------------------ XLA options and jits


@contextlib.contextmanager
def options_applied(state: CallState) -> Iterator[None]:
    """Within: traces of ``state``'s function are compiled with its plan's XLA options by
    whoever traces them (``lower`` with the options, ``gpu_preview``), so no warning is
    due."""
    before = getattr(_top_trace, "owner", None)
    _top_trace.owner = state
    try:
        yield
    finally:
        _top_trace.owner = before


def _warn_if_options_lost(state: CallState, key: CallKey, rewrite: Prepared) -> None:
    """Warns, once per function, when its plan chose XLA options for another
    CUDA-graph mode than the process's but this trace is not the top-level jit that
    applies them (nor ``lower``'s): an outer ``jax.jit``, or ``grad``/``vmap`` of the
    call, compiles it with the outer program's options."""
    options = rewrite.xla_options
    mode = rewrite.mode
    if not options or mode is None or mode.mode is mode.user_mode or not key.emit_streams \
            or state in _warned_options_lost \
            or getattr(_top_trace, "owner", None) is state \
            or getattr(_lowering, "owner", None) is state:
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


class StagedJits:
    """The ``jax.jit`` s of a decorated function that its ``trace``/``lower``/``eval_shape``
    use: one without XLA options, made at first use, and one per distinct options its
    plans chose (``lower`` compiles with them). They reach the decorated function through
    a weak reference, as ``CallState.jitted`` does: ``jax.jit(pb)`` kept here would be a
    cycle."""

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
                       static_argnames=owner.static_argnames, compiler_options=given)


def lower_with_options(state: CallState, stages: StagedJits, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
    """``ParallelBranches.lower``: traced once to learn the XLA options its plan chose,
    then lowered by a jit carrying them, so that ``compile()`` uses them as a call does."""
    if not _compat.top_level():
        return stages.get().lower(*args, **kwargs)
    _lowering.owner, _lowering.options = state, {}
    staged = stages.get()
    # The options are learnt from the trace: a trace this jit cached (an earlier lower
    # of the same signature) would not run it, and the options would stay {}.
    staged.clear_cache()
    try:
        traced = staged.trace(*args, **kwargs)
        options = _lowering.options
    finally:
        _lowering.owner = _lowering.options = None
    if not options:
        return traced.lower()
    with options_applied(state):
        return stages.get(options).lower(*args, **kwargs)


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
    ``owner``'s plan (``jit_for``), which ``_top_trace`` tells the trace."""
    ref = weakref.ref(owner)

    def call(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        if target is None:  # only a jit captured elsewhere can outlive its owner
            raise ReferenceError("jaxpar: this parallel_branches function was deleted")
        if not top:
            return getattr(target, method)(*args, **kwargs)
        before = getattr(_top_trace, "owner", None)
        _top_trace.owner = target
        try:
            return getattr(target, method)(*args, **kwargs)
        finally:
            _top_trace.owner = before

    if fun is not None:
        name, qualname = getattr(fun, "__name__", None), getattr(fun, "__qualname__", None)
        call.__name__ = name if isinstance(name, str) else type(fun).__name__
        call.__qualname__ = qualname if isinstance(qualname, str) else call.__name__
    return call
