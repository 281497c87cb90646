"""Public entry points: ``parallel_branches``, ``inspect`` and ``on_stream``.

Example::

    @jaxpar.parallel_branches(target="gpu")
    def two_scans(a, b):
        return lax.scan(step1, a, xs)[0], lax.scan(step2, b, xs)[0]

    print(jaxpar.inspect(two_scans)(a, b))

The analysis of one signature (trace, passes, plan, CUDA-graph mode, emitter) is
``_pipeline.analyse``; this module keys, caches and dispatches it (``_PlanCache``, the
jits), emits its ``Prepared`` in each trace (``Prepared.run``) and reports it.

Sharp edges:
  * Every call runs under a ``jax.jit`` (eager calls, and calls under grad,
    vmap or jvp, stay compiled; under another jit it is inlined). At the top level
    it is one made per environment (``XLA_FLAGS``, ``JAXPAR_DISABLE``) that takes the
    call's arguments as they are and rewrites inside its trace (``_TopLevel``), so a
    compiled signature costs a call what ``jax.jit`` costs plus reading the
    environment variables and checking the arguments' types. The function's
    ``trace``/``lower``/``eval_shape`` are ``jax.jit``'s on the decorated
    function, so there every non-static leaf must be an array, in the arguments
    and in the outputs (Equinox's and NNX's splits apply to calls only).
  * ``tune=True`` measures at concrete top-level calls only (``_tune`` says how); under
    an outer ``jit``, ``grad`` or ``vmap`` a call runs the decision a concrete call made
    in this process at the same shapes, or else the plan as without tuning.
  * The rewrite is cached per argument structure, shapes, dtypes and options
    (and the XLA_FLAGS async limit, and JAX's trace context as ``jax.jit`` keys
    it: ``enable_x64``, promotion rules, matmul precision, default device...);
    a change to any of them re-plans.
  * On target ``"gpu"`` the plan chooses the function's CUDA-graph mode
    (``command_buffers``): a call at the top level, and ``lower(...).compile()``, compile
    with it as ``compiler_options``. ``jax.jit`` takes compiler options only at the top
    level, so under an outer ``jax.jit``, ``grad`` or ``vmap`` the outer compile's
    options apply (``inspect(f)(...).xla_options`` are the ones to give it).
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, overload

import jax
import numpy as np

from . import _compat, _pipeline, _primitives, _processes
from ._analysis import jaxpr_has_placement
from ._emit import GroupIds, region_call
from ._flags import environment_reader, xla_flags_text
from ._frameworks import (
    NnxCall,
    holds_equinox_module,
    holds_nnx_object,
    nnx_arguments,
    refuse_module_as_function,
)
from ._gpu_model import (
    PROFILE_DIR_VARIABLE,
    CommandBufferMode,
    GpuProfile,
    local_gpu_kind,
    local_profile_stamp,
)
from ._options import (
    DISABLE_VARIABLE,
    Options,
    ResolveInputs,
    Settings,
    Switch,
    Target,
    Unroll,
    check_known,
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
    check_function,
    function_name,
    has_python_scalars,
    needs_python_values,
    packed_outputs,
    short_repr,
    split_arguments,
    split_outputs,
    trace,
)
from ._tune import (
    CANDIDATES,
    Program,
    TuneBudget,
    Tuning,
    program_flags,
    undecided,
    unmeasured,
    versions,
)
from ._tune import decide as decide_candidate
from ._tune import decision_key as tuning_key
from ._tune import fingerprint as program_fingerprint
from ._tune import load as load_decision

F = TypeVar("F", bound=Callable[..., Any])

_CACHE_SIZE = 64


@dataclasses.dataclass(frozen=True)
class _CallKey:
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
    # Bumped by each measurement: a jit cache entry whose trace raised _MeasureFirst
    # stays off jax.jit's fast C++ path, so the calls after it use a new key.
    tune_generation: int = 0


class _WrongOptions(Exception):
    """Raised from the trace of a signature whose plan chooses XLA options other than
    those of the jit the call ran (``_dispatch``): the call looks the
    signature's plan up first instead, and so does every later call with its key."""


# The jit options a call expects its trace to confirm: (function, key, options).
_expected = threading.local()
# At most this many settings and remembered jits per decorated function (a program
# changing its XLA_FLAGS or arguments' structure at every call must not grow them
# without end).
_MEMO_SIZE = 256


def _bounded(memo: dict[Any, Any]) -> dict[Any, Any]:
    """``memo``, emptied first when full."""
    if len(memo) >= _MEMO_SIZE:
        memo.clear()
    return memo


class _CallMemos:
    """What a decorated function's calls remember beyond its plans: the settings of each
    environment (``Options.resolve_inputs``); the jits of top-level calls by environment
    (``top``: by the variables read, ``top_modes``: by what they decide) and what the
    argument trees hold (``tree_kinds``, ``_direct_tree``); and per top-level GPU key of
    ``_keyed_call``'s path the jit its signatures chose with that jit's options
    (``key_jits``), or that they chose two (``mixed_keys``). Emptied by ``clear_cache()`` and
    ``jax.clear_caches()``, as the jits' caches are; each holds at most ``_MEMO_SIZE``
    entries."""

    __slots__ = ("__weakref__", "agreed", "key_jits", "mixed_keys", "settings", "top",
                 "top_modes", "tree_kinds")

    def __init__(self, function: str) -> None:
        self.settings: dict[ResolveInputs, Settings] = {}
        self.top: dict[tuple[Any, ...], _TopLevel | None] = {}
        self.top_modes: dict[_Mode, _TopLevel] = {}
        self.tree_kinds: dict[Any, int] = {}
        self.key_jits: dict[_CallKey, tuple[Any, tuple[tuple[str, str], ...]]] = {}
        self.mixed_keys: dict[_CallKey, None] = {}
        # Signatures whose program the processes compared (``_agree_across_processes``).
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


def _options_key(options: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(options.items()))


@dataclasses.dataclass(frozen=True)
class _Mode:
    """What a top-level call reads from its environment: the settings (``XLA_FLAGS``) and
    whether to rewrite at all (``JAXPAR_DISABLE``)."""

    settings: Settings
    rewrite: bool


class _TopLevel:
    """The jits that serve top-level calls in one environment (``_Mode``).

    ``direct`` takes the call's own arguments (with ``static_argnums``/``static_argnames``
    as ``jax.jit`` takes them) and splits them in its trace, so once a signature is
    compiled JAX's C++ dispatch alone runs the call, as it runs a ``jax.jit`` function:
    for calls whose leaves are arrays and Python scalars (``ParallelBranches.__call__``).
    ``flat`` takes them split, ``(layout, nnx), *leaves``: calls with static leaves,
    Equinox modules holding Python scalars, Flax NNX objects. Both trace what
    ``_call_traced`` traces for a top-level call; neither holds the decorated function
    but weakly, nor this object.

    With ``tune=True`` a trace runs the candidate this process decided for its signature;
    without a decision it raises ``_MeasureFirst``: the call takes ``_keyed_call``'s
    path, which decides, and the jits are made anew (``renew``).

    On target ``"gpu"`` both compile with the XLA options (CUDA-graph mode) ``options``:
    none at first; the first signature whose plan chose others moves them (``retarget``)
    while no signature ran in them yet (``accepted``). Once a signature's plan chose
    options other than those of the signatures run, ``direct`` and ``flat`` become
    None: the environment's calls take ``_keyed_call``'s path, which picks a jit per
    signature.
    """

    __slots__ = ("accepted", "direct", "flat", "mode", "options")

    def __init__(self, pb: ParallelBranches, mode: _Mode):
        self.mode = mode
        self.options: tuple[tuple[str, str], ...] = ()
        # Set by the jits' traces when a signature's plan chose ``options``.
        self.accepted = [False]
        self.direct: Any
        self.flat: Any
        self.direct, self.flat = _top_level_jits(pb, mode, (), self.accepted)

    def renew(self, pb: ParallelBranches) -> None:
        """New jits with the same options: the tuner decided a signature whose trace
        raised, and jax.jit keeps such a signature off its C++ path."""
        self.direct, self.flat = _top_level_jits(pb, self.mode, self.options, self.accepted)

    def retarget(self, pb: ParallelBranches, options: tuple[tuple[str, str], ...]) -> bool:
        """Moves the jits to ``options`` (True), or gives them up (False)."""
        if self.accepted[0] or self.direct is None or options == self.options:
            self.direct = self.flat = None
            return False
        self.options = options
        self.direct, self.flat = _top_level_jits(pb, self.mode, options, self.accepted)
        return True


class _Retarget(Exception):
    """Raised from a top-level jit's trace whose plan chose other XLA options than the
    jit's (``_TopLevel``)."""

    def __init__(self, options: tuple[tuple[str, str], ...]):
        super().__init__(options)
        self.options = options


# The variables a top-level call's environment is read from, on every call (XLA_FLAGS
# and these).
_read_environment = environment_reader((DISABLE_VARIABLE, PROFILE_DIR_VARIABLE))


def _read_gpu_environment() -> tuple[Any, ...]:
    """``_read_environment`` and this GPU's calibration file: a function planned for the
    machine's own GPU reads its figures from that file."""
    return *_read_environment(), local_profile_stamp()


# Whether the last exception out of a top-level jit was raised in its trace (by jaxpar or
# the user's function) rather than by jax.jit refusing an argument first.
_top_level_state = threading.local()
# Leaf types ``direct`` takes as jax.jit does: arrays, then Python scalars (traced).
_DIRECT_ARRAYS = frozenset({_compat.ARRAY_IMPL, np.ndarray})
_DIRECT_LEAVES = _DIRECT_ARRAYS | {bool, int, float, complex}
# What an argument tree holds (``_CallMemos.tree_kinds``): no framework object, an
# Equinox module (its Python scalars are static), a Flax NNX object.
_PLAIN_TREE, _EQUINOX_TREE, _NNX_TREE = 0, 1, 2
# ``_direct_failed``/``_flat_call``: not served there, take the next path.
_INDIRECT: Any = object()


class _MeasureFirst(Exception):
    """Raised from a concrete call's trace that finds no decision: ``_keyed_call`` measures
    outside the trace, then calls again. Only traces (a new signature) pay for it."""


_call_sites = itertools.count(1)


class _PlanCache:
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


class ParallelBranches:
    """A function rewritten by ``parallel_branches``; call it like the original.

    Like a ``jax.jit`` function it has ``trace``, ``lower`` and ``eval_shape``, and
    ``clear_cache()``; ``__wrapped__`` is the original function.
    """

    def __init__(self, fun: Callable[..., Any], options: Options,
                 static_args: StaticArgs | None = None, *,
                 command_buffers: CommandBufferMode | None = None,
                 gpu: GpuProfile | None = None, tune: TuneBudget | None = None):
        check_function(fun, "parallel_branches")
        refuse_module_as_function(fun, "parallel_branches")
        functools.update_wrapper(self, fun)
        self.__wrapped__ = fun
        self.options = options
        # What to plan for instead of the CUDA-graph mode in XLA_FLAGS and this machine's
        # GPU: gpu_preview plans for the GPU and the mode it judges in.
        self._planned_for: dict[str, Any] = {"command_buffers": command_buffers, "gpu": gpu}
        self._static_args = static_args or StaticArgs()
        self._has_statics = bool(self._static_args.nums or self._static_args.names)
        self._cache = _PlanCache(_CACHE_SIZE)
        _compat.register_for_clear_caches(self._cache,
                                          f"jaxpar rewrites of {function_name(fun)}")
        self.analyses = 0  # how many times a signature was planned (for tests and tooling)
        # One jit for every call, eager or under a transformation: grad, vmap and
        # jvp of a jitted call stay compiled, and jit inside jit is inlined. It reaches
        # this object through a weak reference: a strong one would make a cycle (self ->
        # jit -> call -> self) that keeps the function's closed-over arrays alive after
        # ``del`` until the cyclic collector runs, where ``jax.jit`` frees them at once.
        self._jitted: Any = jax.jit(_weak_method(self, "_call_traced", fun), static_argnums=0)
        # Top-level GPU calls' jits, by the XLA options (CUDA-graph mode) their plans
        # chose, {} included; and the staged jits of ``lower``, by options too.
        self._jitted_with: dict[tuple[tuple[str, str], ...], Any] = {}
        self._stages = _StagedJits(self)
        self._memos = _CallMemos(function_name(fun))  # settings, jits picked per key
        # What a top-level call reads its environment with (``_top_level`` chooses).
        self._read_environment: Callable[[], tuple[Any, ...]] = _read_environment
        self._saw_traced_consts = threading.local()
        # nnx.jit's update context is keyed by a tag: one per decorated function (not
        # self, which the traced function would then keep alive in a cycle).
        self._nnx_tag = object()
        self._nnx_function: Callable[..., Any] | None = None
        # Layouts (with Python scalars traced) whose trace needed them as Python values.
        self._scalars_made_static: set[Layout] = set()
        # tune=True: how the tuner measures, and its decisions in this process by
        # signature (what jax.jit traces anew), which traced calls reuse.
        self.tune = tune
        self._tunings: dict[Any, Tuning] = {}
        self._tune_generation = 0

    @property
    def static_argnums(self) -> tuple[int, ...]:
        return self._static_args.nums

    @property
    def static_argnames(self) -> tuple[str, ...]:
        return self._static_args.names

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return functools.partial(self, instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        top = None
        context = _compat.call_context()
        if context == _compat.EAGER:
            # Most calls: JAX's C++ dispatch once compiled (``_TopLevel``). What follows
            # runs on every call, so it is spelt out here rather than in helpers.
            top = self._memos.top.get(self._read_environment(), _INDIRECT)
            if top is _INDIRECT:
                top = _top_level(self)
            if top is not None and top.direct is not None:
                # Arrays and Python scalars only, not in containers: no flattening needed.
                types = set(map(type, args))
                if kwargs:
                    types.update(map(type, kwargs.values()))
                if (types <= _DIRECT_LEAVES and not self._has_statics) \
                        or _direct_tree(self, args, kwargs):
                    try:
                        return top.direct(*args, **kwargs)
                    except BaseException as error:
                        out = _direct_failed(self, top, error, args, kwargs)
                    if out is not _INDIRECT:
                        return out
        elif context == _compat.JIT_DISABLED:  # jax.disable_jit(): the original, eagerly
            return self.__wrapped__(*args, **kwargs)
        if not holds_nnx_object((args, kwargs)):  # no context to enter
            return _split_call(self, self.__wrapped__, args, kwargs, False, top)
        # Flax NNX objects among the arguments: split, call, write the new state back.
        with nnx_arguments(self._nnx_tag, self.__wrapped__, args, kwargs) as (
                fun, args, kwargs, nnx_call):
            out = _split_call(self, fun, args, kwargs, nnx_call is not None, top)
            return out if nnx_call is None else nnx_call.from_pure(out)

    def tuning(self, *args: Any, **kwargs: Any) -> Tuning | None:
        """The tuner's decision for these arguments (``tune=True`` only), as a call makes
        it: stored in this process or on disk, else measured now. With abstract
        arguments (``jax.ShapeDtypeStruct``) only a decision this process made at those
        shapes; None without one, or without ``tune=True``."""
        return _tuning_of_call(self, args, kwargs) if self.tune is not None else None

    def _traced_function(self, nnx: bool) -> Callable[..., Any]:
        if not nnx:
            return self.__wrapped__
        if self._nnx_function is None:
            self._nnx_function = NnxCall(self._nnx_tag).inner(self.__wrapped__)
        return self._nnx_function

    def _call_traced(self, key: _CallKey, *leaves: Any) -> tuple[list[Any], OutputStatics]:
        # Array outputs leave the jit as values, the rest (functions, a returned Equinox
        # module's static fields) in the output's tree structure.
        if key.tune:
            key = _decided_key(self, key, leaves)
        if not key.rewrite:
            args, kwargs = key.layout.rebuild(leaves)
            out = self._traced_function(key.nnx)(*args, **kwargs)
            return split_outputs(out, key.layout.static_scalars)
        rewrite = self._prepare(Signature(key.layout, tuple(abstract(leaf) for leaf in leaves)),
                                key.settings, key.nnx, key.local_axes)
        expected = getattr(_expected, "value", None)
        if expected is not None and expected[0] is self and expected[1] == key:
            _expected.value = None  # this trace's: not a nested call's
            if _options_key(rewrite.xla_options) != expected[2]:
                raise _WrongOptions
        if rewrite.traced.consts_are_tracers:
            self._saw_traced_consts.value = True
        _warn_if_options_lost(self, key, rewrite)
        return rewrite.run(leaves, key.emit_streams), rewrite.traced.outputs

    def _prepare(self, sig: Signature, settings: Settings, nnx: bool = False,
                 local_axes: frozenset[Any] = frozenset()) -> Prepared:
        # JAX's trace context (x64, promotion rules, matmul precision, default device,
        # mesh...) changes what tracing produces, so it keys the plan as it keys jax.jit.
        key = (sig, settings, _compat.trace_context(), nnx, local_axes)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        with _primitives.local_axes(local_axes):
            rewrite = _pipeline.analyse(self._traced_function(nnx), sig, settings)
        self.analyses += 1
        if not rewrite.traced.consts_are_tracers:
            self._cache.put(key, rewrite)
        return rewrite

    def _staged(self, options: dict[str, str] | None = None) -> Any:
        return self._stages.get(options)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(f).trace(...)`` of the rewritten function: a ``jax.stages.Traced``."""
        return self._staged().trace(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(f).lower(...)``: a ``jax.stages.Lowered`` (``.as_text()``, ``.compile()``).

        Its ``compile()`` uses the XLA options the plan chose (``Plan.xla_options``), as a
        call does; options given to ``compile(compiler_options=...)`` are added to them.
        """
        return _lower_with_options(self, args, kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The output shapes and dtypes, as ``jax.ShapeDtypeStruct`` s, without running."""
        return self._staged().eval_shape(*args, **kwargs)

    def clear_cache(self) -> None:
        """Forgets every rewrite and compiled program of this function."""
        self._cache.cache_clear()
        self._memos.cache_clear()
        self._scalars_made_static.clear()
        self._tunings.clear()
        self._jitted.clear_cache()
        for jitted in self._jitted_with.values():
            jitted.clear_cache()
        self._stages.clear_cache()

    def __repr__(self) -> str:
        return f"parallel_branches({function_name(getattr(self, '__wrapped__', None))})"


def _split_call(pb: ParallelBranches, fun: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any], nnx: bool, top: _TopLevel | None = None) -> Any:
    """A call of ``pb`` not served by ``_TopLevel.direct``: its arguments split by jaxpar,
    run by ``_TopLevel.flat`` at the top level, else with ``_keyed_call``."""
    # Under a trace (eval_shape), jax.jit takes a ShapeDtypeStruct as an abstract argument.
    layout, leaves = split_arguments(fun, args, kwargs, pb._static_args,
                                     allow_abstract=top is None and not _compat.top_level())
    if top is not None:  # at the top level: no tracers, no retrying
        out = _flat_call(pb, top, layout, nnx, leaves)
        if out is not _INDIRECT:
            return out
    # Python scalars are traced as jax.jit traces them, so results match it bit for
    # bit. Under a transformation a function that needs one as a Python value
    # (range(n), an outer jit's static argument passed on) is traced again with them
    # static, where jax.jit would raise; at the top level the error stands, and says
    # to use static_argnums.
    retry = has_python_scalars(leaves) and any(map(_compat.is_tracer, leaves))
    if retry and layout in pb._scalars_made_static:
        return _call_with_static_scalars(pb, fun, args, kwargs, nnx)
    try:
        return _keyed_call(pb, layout, leaves, nnx)
    except Exception as error:
        if not (retry and needs_python_values(error)):
            raise
    out = _call_with_static_scalars(pb, fun, args, kwargs, nnx)
    pb._scalars_made_static.add(layout)
    return out


def _keyed_call(pb: ParallelBranches, layout: Layout, leaves: list[Any], nnx: bool) -> Any:
    """A call under a transformation, the tuner's deciding call, a call under several
    processes, or in an environment whose signatures chose different XLA options
    (``_TopLevel``)."""
    key = _call_key(pb, layout, nnx, leaves)
    if jax.process_count() > 1:
        _agree_across_processes(pb, key, leaves)
    if pb.tune is not None and key.rewrite and key.emit_streams:
        # The decision is looked up when jax.jit traces (once per signature), so a
        # call that hits jit's cache pays nothing for the tuner.
        concrete = not key.call_site and not any(map(_compat.is_tracer, leaves))
        key = dataclasses.replace(key, tune="measure" if concrete else "reuse",
                                  tune_generation=pb._tune_generation)
    pb._saw_traced_consts.value = False
    try:
        dynamic, outputs = _dispatch(pb, key, leaves)
    except _MeasureFirst:
        _tuning(pb, dataclasses.replace(key, tune="", tune_generation=0), leaves,
                first_call=True)
        pb._tune_generation += 1
        key = dataclasses.replace(key, tune_generation=pb._tune_generation)
        dynamic, outputs = _jit_for(pb, key, leaves)(key, *leaves)
    if pb._saw_traced_consts.value:
        # The trace closed over another trace's tracers: jit must not reuse it.
        pb._jitted.clear_cache()
    return outputs.rebuild(dynamic)


def _top_level(pb: ParallelBranches) -> _TopLevel | None:
    """The jits of top-level calls of ``pb`` in this environment (``_CallMemos.top``
    missed), None where calls take ``_keyed_call``'s path: under several processes (they
    agree at each signature's first call first)."""
    memos = pb._memos
    top = None
    settings = _settings(pb)
    if settings.target == "gpu" and pb._planned_for["gpu"] is None \
            and local_gpu_kind() is not None:
        pb._read_environment = _read_gpu_environment
    if jax.process_count() == 1:
        mode = _Mode(settings, not disabled_by_environment())
        top = memos.top_modes.get(mode)
        if top is None:
            top = _bounded(memos.top_modes)[mode] = _TopLevel(pb, mode)
    _bounded(memos.top)[pb._read_environment()] = top
    return top


def _direct_tree(pb: ParallelBranches, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``_TopLevel.direct`` takes this call: where its arguments (less the static
    ones) have only arrays and Python scalars as leaves, and ``jax.jit`` splits them as
    ``split_arguments`` does: no Flax NNX object among them, and no Equinox module with a
    Python scalar (Equinox makes them static)."""
    statics = pb._static_args
    dynamic = _dynamic_arguments(statics, args, kwargs) if pb._has_statics else (args, kwargs)
    leaves, tree = jax.tree_util.tree_flatten(dynamic)
    types = set(map(type, leaves))
    if not types <= _DIRECT_LEAVES:
        return False
    kinds = pb._memos.tree_kinds
    try:
        kind = kinds.get(tree)
    except TypeError:  # a node's unhashable data: jaxpar's path says what to do
        return False
    if kind is None:
        kind = _NNX_TREE if holds_nnx_object(dynamic) else \
            _EQUINOX_TREE if holds_equinox_module(dynamic) else _PLAIN_TREE
        _bounded(kinds)[tree] = kind
    return kind == _PLAIN_TREE or (kind == _EQUINOX_TREE and types <= _DIRECT_ARRAYS)


def _direct_failed(pb: ParallelBranches, top: _TopLevel, error: BaseException,
                   args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """After ``top.direct(*args, **kwargs)`` raised ``error``: the call in the jit its plan
    chose (``_Retarget``), or ``_INDIRECT`` where ``jax.jit`` refused an argument before
    tracing (jaxpar's path then says what is wrong in its words), or ``error`` again."""
    traced = getattr(_top_level_state, "raised", False)
    _top_level_state.raised = False
    if isinstance(error, _MeasureFirst):
        top.renew(pb)
        return _INDIRECT
    if isinstance(error, _Retarget):
        if not top.retarget(pb, error.options):
            return _INDIRECT
        try:
            return top.direct(*args, **kwargs)
        except BaseException as again:
            return _direct_failed(pb, top, again, args, kwargs)
    if traced or not isinstance(error, (TypeError, ValueError, OverflowError)):
        raise error
    return _INDIRECT


def _flat_call(pb: ParallelBranches, top: _TopLevel, layout: Layout, nnx: bool,
               leaves: list[Any]) -> Any:
    """``top.flat((layout, nnx), *leaves)``, or ``_INDIRECT`` once ``top`` gave up."""
    if top.flat is None:
        return _INDIRECT
    try:
        return top.flat((layout, nnx), *leaves)
    except _MeasureFirst:
        _top_level_state.raised = False
        top.renew(pb)
        return _INDIRECT
    except _Retarget as error:
        _top_level_state.raised = False
        if top.retarget(pb, error.options):
            return _flat_call(pb, top, layout, nnx, leaves)
        return _INDIRECT
    except BaseException:
        _top_level_state.raised = False
        raise


def _dynamic_arguments(statics: StaticArgs, args: tuple[Any, ...], kwargs: dict[str, Any]
                       ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` without the static arguments."""
    nums = {i if i >= 0 else i + len(args) for i in statics.nums}
    return (tuple(a for i, a in enumerate(args) if i not in nums),
            {k: v for k, v in kwargs.items() if k not in statics.names})


def _top_level_jits(pb: ParallelBranches, mode: _Mode, options: tuple[tuple[str, str], ...],
                    accepted: list[bool]) -> tuple[Any, Any]:
    """``_TopLevel``'s two jits, compiling with ``options``. Their functions reach ``pb``
    through a weak reference and hold ``mode``, ``options`` and ``accepted`` only, never
    the ``_TopLevel`` holding them (no cycle keeps a dead function's programs alive)."""
    ref = weakref.ref(pb)
    statics = pb._static_args

    def direct(*args: Any, **kwargs: Any) -> Any:
        return _top_level_trace(ref, mode, options, accepted, None, args, kwargs)

    def flat(split: tuple[Layout, bool], *leaves: Any) -> Any:
        return _top_level_trace(ref, mode, options, accepted, split, leaves, {})

    # Named as the user's function (lowered programs and profiles name it, as jax.jit's
    # do), with its signature, which jax.jit reads static_argnames by.
    fun = pb.__wrapped__
    direct = functools.wraps(fun)(direct)
    flat.__name__ = flat.__qualname__ = direct.__name__
    given = dict(options) or None
    return (jax.jit(direct, static_argnums=statics.nums, static_argnames=statics.names,
                    compiler_options=given),
            jax.jit(flat, static_argnums=0, compiler_options=given))


def _top_level_trace(ref: weakref.ref[ParallelBranches], mode: _Mode,
                     options: tuple[tuple[str, str], ...], accepted: list[bool],
                     split: tuple[Layout, bool] | None, args: Sequence[Any],
                     kwargs: dict[str, Any]) -> Any:
    """The trace of a top-level call (``_TopLevel``): the program ``_call_traced`` gives a
    top-level call, returning the call's output itself (``packed_outputs``).

    Raises:
      _Retarget: the plan chose XLA options other than ``options``.
      _MeasureFirst: ``tune=True`` and no decision for this signature in this process.
    """
    try:
        pb = ref()
        if pb is None:  # only a jit captured elsewhere can outlive its owner
            raise ReferenceError("jaxpar: this parallel_branches function was deleted")
        if split is None:
            layout, leaves = split_arguments(pb.__wrapped__, tuple(args), kwargs,
                                             pb._static_args)
            nnx = False
        else:
            (layout, nnx), leaves = split, list(args)
        key = _CallKey(layout, nnx, True, mode.rewrite, mode.settings, 0)
        if pb.tune is not None and key.rewrite:
            key = _decided_key(pb, dataclasses.replace(key, tune="measure"), leaves)
        rewrite = None if not key.rewrite else pb._prepare(
            Signature(layout, tuple(abstract(leaf) for leaf in leaves)), key.settings, nnx)
        chosen = () if rewrite is None else _options_key(rewrite.xla_options)
        if chosen != options:
            raise _Retarget(chosen)
        accepted[0] = True
        if rewrite is None:
            full_args, full_kwargs = layout.rebuild(leaves)
            out = pb._traced_function(nnx)(*full_args, **full_kwargs)
            return packed_outputs(*split_outputs(out, layout.static_scalars))
        with options_applied(pb):  # this jit compiles with them: no warning is due
            return packed_outputs(rewrite.run(leaves, True), rewrite.traced.outputs)
    except BaseException:
        _top_level_state.raised = True
        raise


class XlaOptionsNotAppliedWarning(UserWarning):
    """A decorated function whose plan chose XLA options (a CUDA-graph mode) was traced
    inside another jit or transformation, whose compile decides the options."""


# The decorated function whose options-carrying top-level jit is tracing (``_jit_for``).
_top_trace = threading.local()
# The functions warned about with ``XlaOptionsNotAppliedWarning`` (once each).
_warned_options_lost: weakref.WeakSet[ParallelBranches] = weakref.WeakSet()


@contextlib.contextmanager
def options_applied(pb: ParallelBranches) -> Iterator[None]:
    """Within: traces of ``pb`` are compiled with its plan's XLA options by whoever
    traces them (``lower`` with the options, ``gpu_preview``), so no warning is due."""
    before = getattr(_top_trace, "owner", None)
    _top_trace.owner = pb
    try:
        yield
    finally:
        _top_trace.owner = before


def _warn_if_options_lost(pb: ParallelBranches, key: _CallKey, rewrite: Prepared) -> None:
    """Warns, once per function, when ``pb``'s plan chose XLA options for another
    CUDA-graph mode than the process's but this trace is not the top-level jit that
    applies them (nor ``lower``'s): an outer ``jax.jit``, or ``grad``/``vmap`` of the
    call, compiles it with the outer program's options."""
    options = rewrite.xla_options
    mode = rewrite.mode
    if not options or mode is None or mode.mode is mode.user_mode or not key.emit_streams \
            or pb in _warned_options_lost \
            or getattr(_top_trace, "owner", None) is pb \
            or getattr(_lowering, "owner", None) is pb:
        return
    _warned_options_lost.add(pb)
    name = function_name(pb.__wrapped__)
    shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
    warnings.warn(
        f"jaxpar: the plan of `{name}` compiles it with XLA options {{{shown}}}, but it is "
        "traced inside another jit or transformation, whose compile decides the options, "
        "so they are not applied. Pass them to the outermost jit: jax.jit(<the function "
        f"that calls {name}>, compiler_options=jaxpar.inspect({name})(*args).xla_options), "
        f"or call `{name}` at the top level (warned once per function; a warnings filter "
        "silences it where the outer jit has them).",
        XlaOptionsNotAppliedWarning, stacklevel=2)


def _agree_across_processes(pb: ParallelBranches, key: _CallKey, leaves: Sequence[Any]
                            ) -> None:
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
    if checked in pb._memos.agreed:
        return
    if _processes.span(leaves) == _processes.ALL:
        prepared = pb._prepare(Signature(key.layout, avals), key.settings, key.nnx,
                               key.local_axes)
        levels = [(level.path, level.order, level.collective_groups)
                  for level in prepared.plan.walk()]
        loops = [(d.location, d.kind, d.eqns, d.unroll, d.pass_name) for d in prepared.decisions]
        _processes.agree(_call_text(pb, avals), {
            "versions": versions(), "xla_flags": program_flags(xla_flags_text()),
            "settings": repr(key.settings),
            "decisions": program_fingerprint(repr((levels, loops))),
            "xla_options": sorted(prepared.xla_options.items())})
    _bounded(pb._memos.agreed)[checked] = None


def _decided_key(pb: ParallelBranches, key: _CallKey, leaves: Sequence[Any]) -> _CallKey:
    """At trace time: the key of the candidate this signature's decision chose (the plan's
    own key without a decision under a transformation).

    Raises:
      _MeasureFirst: a concrete call (``key.tune == "measure"``) without a decision.
    """
    by_shape = (key.layout, tuple(abstract(leaf) for leaf in leaves), key.nnx, key.settings,
                _compat.trace_context())
    tuning = pb._tunings.get(by_shape)
    if tuning is None and key.tune == "measure":
        raise _MeasureFirst
    key = dataclasses.replace(key, tune="", tune_generation=0)
    return key if tuning is None else _candidate_key(pb, key, tuning.chosen)


def _tuning(pb: ParallelBranches, key: _CallKey, leaves: Sequence[Any],
            first_call: bool = False) -> Tuning | None:
    """The decision for one signature (``ParallelBranches.tune`` set): this process's, the
    stored one, or measured now; at traced or abstract arguments only this process's.

    Under several processes only ``first_call`` (the first real call of the signature,
    which every process makes) decides, with the others where the arguments span them
    (``_tune.decide``'s collective); any other read (``tuning()``, ``inspect``) is
    local: this process's decision or the stored file, never measured.
    """
    assert pb.tune is not None
    avals = tuple(abstract(leaf) for leaf in leaves)
    by_shape = (key.layout, avals, key.nnx, key.settings, _compat.trace_context())
    hit = pb._tunings.get(by_shape)
    # Concrete values at the top level (not ShapeDtypeStructs, not tracers).
    concrete = not _compat.staging() and not any(map(_compat.is_tracer, leaves)) and all(
        isinstance(leaf, (jax.Array, int, float, complex)) or hasattr(leaf, "__array__")
        for leaf in leaves)
    if hit is not None or not concrete:
        return hit
    name, fields = _tuning_key(pb, key, leaves, avals)
    if jax.process_count() > 1 and not first_call:
        # Local: the stored file or nothing, not remembered (the first call decides).
        return load_decision(name) or undecided(name, pb.tune)
    span = _processes.span(leaves)
    if span == _processes.SOME:
        tuning = unmeasured(name, pb.tune, "the arguments span some processes but not all, "
                                           "which cannot time together")
    else:
        tuning = decide_candidate(name, fields, lambda: _candidates(pb, key, leaves),
                                  pb.tune, together=span == _processes.ALL,
                                  what=_call_text(pb, avals))
    pb._tunings[by_shape] = tuning
    return tuning


def _tuning_key(pb: ParallelBranches, key: _CallKey, leaves: Sequence[Any],
                avals: tuple[Any, ...]) -> tuple[str, dict[str, Any]]:
    """``_tune.decision_key`` of one signature (traces the function to fingerprint it)."""
    shardings = tuple(getattr(leaf, "sharding", None) for leaf in leaves)
    traced = trace(pb._traced_function(key.nnx), Signature(key.layout, avals))
    return tuning_key(
        program=program_fingerprint(str(traced.jaxpr)),
        arguments=[f"{aval} {sharding!r}" for aval, sharding in zip(avals, shardings,
                                                                    strict=True)],
        statics=f"{key.layout.in_tree} {key.layout.statics!r}",
        options={**pb.options.to_dict(), **pb._planned_for, "nnx": key.nnx,
                 "settings": key.settings})


def _call_text(pb: ParallelBranches, avals: Sequence[Any]) -> str:
    """``f(f32[8,4], ...)``: a call, for messages."""
    shown = ", ".join(str(aval) for aval in avals[:4]) + (", ..." if len(avals) > 4 else "")
    return f"{function_name(pb.__wrapped__)}({shown})"


def _candidate_key(pb: ParallelBranches, key: _CallKey, label: str) -> _CallKey:
    overrides = next(c.overrides for c in CANDIDATES if c.label == label)
    if overrides is None:
        return dataclasses.replace(key, rewrite=False)
    options = dataclasses.replace(pb.options, **overrides)
    return dataclasses.replace(key, settings=options.resolve(**pb._planned_for))


def _candidates(pb: ParallelBranches, key: _CallKey, leaves: Sequence[Any]) -> list[Program]:
    """Each candidate's program, or the label of an earlier candidate whose lowered
    program is the same text (timed once)."""
    out: list[Program] = []
    seen: dict[str, str] = {}
    for candidate in CANDIDATES:
        candidate_key = _candidate_key(pb, key, candidate.label)
        jitted = _jit_for(pb, candidate_key, leaves)
        options = {} if not candidate_key.rewrite else pb._prepare(
            Signature(key.layout, tuple(abstract(leaf) for leaf in leaves)),
            candidate_key.settings, key.nnx, key.local_axes).xla_options
        # What decides the program on jaxpar's side, which processes compare.
        digest = program_fingerprint(repr((candidate_key.rewrite, candidate_key.settings,
                                           sorted(options.items()))))
        # The XLA options (the CUDA-graph mode) are not in the lowered text.
        text = f"{jitted.lower(candidate_key, *leaves).as_text()}\n{id(jitted)}"
        if text in seen:
            out.append(Program(candidate, None, seen[text], digest))
            continue
        seen[text] = candidate.label
        out.append(Program(candidate, functools.partial(_run_candidate, pb, candidate_key,
                                                        tuple(leaves)), None, digest))
    return out


def _run_candidate(pb: ParallelBranches, key: _CallKey, leaves: tuple[Any, ...]) -> Any:
    return _jit_for(pb, key, leaves)(key, *leaves)[0]


def _tuning_of_call(pb: ParallelBranches, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> Tuning | None:
    with nnx_arguments(object(), pb.__wrapped__, args, kwargs) as (fun, args, kwargs, nnx_call):
        layout, leaves = split_arguments(fun, args, kwargs, pb._static_args,
                                         allow_abstract=True, api="tuning")
        return _tuning(pb, _call_key(pb, layout, nnx_call is not None, leaves), leaves)


class _StagedJits:
    """The ``jax.jit`` s of a decorated function that its ``trace``/``lower``/``eval_shape``
    use: one without XLA options, made at first use, and one per distinct options its
    plans chose (``lower`` compiles with them). They reach the function through a weak
    reference, as ``_jitted`` does: ``jax.jit(pb)`` kept here would be a cycle."""

    __slots__ = ("_owner", "_plain", "_with_options")

    def __init__(self, owner: ParallelBranches):
        self._owner = weakref.ref(owner)
        self._plain: Any = None
        self._with_options: dict[tuple[tuple[str, str], ...], Any] = {}

    def get(self, options: dict[str, str] | None) -> Any:
        """The jit compiling with ``options`` (none: the plain one)."""
        if options:
            return _cached_jit(self._with_options, options, self._make)
        if self._plain is None:
            self._plain = self._make(None)
        return self._plain

    def clear_cache(self) -> None:
        for jitted in self._with_options.values():
            jitted.clear_cache()
        if self._plain is not None:
            self._plain.clear_cache()

    def _make(self, given: dict[str, str] | None) -> Any:
        pb = self._owner()
        if pb is None:  # only a jit captured elsewhere can outlive its owner
            raise ReferenceError("jaxpar: this parallel_branches function was deleted")
        call = functools.wraps(pb.__wrapped__)(_weak_method(pb, "__call__", None))
        return jax.jit(call, static_argnums=pb.static_argnums,
                       static_argnames=pb.static_argnames, compiler_options=given)


def _call_with_static_scalars(pb: ParallelBranches, fun: Callable[..., Any],
                              args: tuple[Any, ...], kwargs: dict[str, Any], nnx: bool) -> Any:
    """A call of ``pb`` with its Python scalars static (``_split_call``)."""
    layout, leaves = split_arguments(fun, args, kwargs, pb._static_args,
                                     scalars=Scalars.STATIC)
    return _keyed_call(pb, layout, leaves, nnx)


def _call_key(pb: ParallelBranches, layout: Layout, nnx: bool, leaves: Sequence[Any] = ()
              ) -> _CallKey:
    """The key of a call of ``pb`` (its settings built once per environment)."""
    return _CallKey(layout, nnx, not inside_stream_call(), not disabled_by_environment(),
                    _settings(pb), next(_call_sites) if _compat.staging() else 0,
                    _compat.vmap_axis_names(leaves))


def _settings(pb: ParallelBranches) -> Settings:
    """``pb``'s settings in this environment, built once per environment."""
    inputs = pb.options.resolve_inputs(**pb._planned_for)
    settings = pb._memos.settings.get(inputs)
    if settings is None:
        settings = pb.options.settings_from(inputs)
        _bounded(pb._memos.settings)[inputs] = settings
    return settings


def _dispatch(pb: ParallelBranches, key: _CallKey, leaves: Sequence[Any]) -> Any:
    """A call of ``pb``: ``jitted(key, *leaves)`` for the jit ``_jit_for`` picks; where
    every signature planned under ``key`` chose one jit (``_CallMemos.key_jits``), that
    jit, whose trace of a new signature checks the choice (``_call_traced``)."""
    memos = pb._memos
    known = memos.key_jits.get(key)
    # Remembered only where ``_jit_for`` picks by the plan (target "gpu", rewriting,
    # streams on, not tuning): it does so at the top level, outside ``lower``.
    if known is not None and _compat.top_level() \
            and getattr(_lowering, "owner", None) is not pb:
        jitted, options = known
        _expected.value = (pb, key, options)
        try:
            return jitted(key, *leaves)
        except _WrongOptions:
            memos.key_jits.pop(key, None)
            _bounded(memos.mixed_keys)[key] = None
        finally:
            _expected.value = None
    jitted = _jit_for(pb, key, leaves, remember=True)
    return jitted(key, *leaves)


def _jit_for(pb: ParallelBranches, key: _CallKey, leaves: Sequence[Any],
             remember: bool = False) -> Any:
    """The jit a call with ``key`` runs under: on the GPU at the top level, one carrying
    the XLA options (the CUDA-graph mode) its plan chose (``{}`` included: these jits
    trace only top-level calls, never one under a transformation, whose trace ``_jitted``
    keeps), else ``_jitted``. With ``remember``, a top-level GPU pick is remembered for
    ``key`` (``_dispatch``)."""
    lowering = getattr(_lowering, "owner", None) is pb
    if not (key.settings.target == "gpu" and key.rewrite and key.emit_streams and (
            lowering or _compat.top_level())):
        return pb._jitted
    # The plan chooses this function's XLA options: they go into this jit's compile,
    # and only there. jax.jit takes them only at the top level; inside another jit
    # the outer one's options apply. With the tuner, the decided candidate's plan.
    avals = tuple(abstract(leaf) for leaf in leaves)
    settings = key.settings
    if pb.tune is not None and key.tune:
        tuning = pb._tunings.get((key.layout, avals, key.nnx, key.settings,
                                    _compat.trace_context()))
        if tuning is not None:
            decided = _candidate_key(pb, key, tuning.chosen)
            if not decided.rewrite:
                return pb._jitted
            settings = decided.settings
    options = pb._prepare(Signature(key.layout, avals), settings, key.nnx,
                            key.local_axes).xla_options
    if lowering:
        _lowering.options = options
        return pb._jitted
    jitted = _cached_jit(pb._jitted_with, options, lambda given: jax.jit(
        _weak_method(pb, "_call_traced", pb.__wrapped__, top=True), static_argnums=0,
        compiler_options=given or None))
    if remember and not key.tune and key not in pb._memos.mixed_keys:
        _bounded(pb._memos.key_jits)[key] = (jitted, _options_key(options))
    return jitted


def _cached_jit(cache: dict[tuple[tuple[str, str], ...], Any], options: dict[str, str],
                make: Callable[[dict[str, str]], Any]) -> Any:
    """The jit ``make(options)`` made once per distinct ``options``, kept in ``cache``."""
    key = _options_key(options)
    if key not in cache:
        cache[key] = make(dict(options))
    return cache[key]


def _lower_with_options(function: ParallelBranches, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> Any:
    """``function.lower``: traced once to learn the XLA options its plan chose, then
    lowered by a jit carrying them, so that ``compile()`` uses them as a call does."""
    if not _compat.top_level():
        return function._staged().lower(*args, **kwargs)
    _lowering.owner, _lowering.options = function, {}
    staged = function._staged()
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
    with options_applied(function):
        return function._staged(options).lower(*args, **kwargs)


def _weak_method(owner: Any, method: str, fun: Callable[..., Any] | None,
                 top: bool = False) -> Callable[..., Any]:
    """A function calling ``owner.<method>`` through a weak reference to ``owner``,
    named after ``fun`` (lowered programs and profiles name the user's function, as
    ``jax.jit`` does). ``top``: the trace of a jit carrying the XLA options of
    ``owner``'s plan (``_jit_for``), which ``_top_trace`` tells the trace."""
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


def analysed_report(pb: ParallelBranches) -> tuple[Plan, LevelPlan]:
    """The report and plan of the one signature ``pb`` has analysed (``gpu_preview``
    compiles a fresh ``ParallelBranches`` once and reports what that compile analysed).

    Raises:
      RuntimeError: ``pb`` analysed no signature, or several.
    """
    entries = pb._cache.cache_keys()
    if pb.analyses != 1 or len(entries) != 1:
        raise RuntimeError(f"jaxpar: expected one analysis of {pb!r}, found {pb.analyses}")
    prepared = pb._cache.get(entries[0])
    assert prepared is not None
    return prepared.report(function_name(pb.__wrapped__), pb.options), prepared.plan


_Argnums = int | Sequence[int] | None
_Argnames = str | Iterable[str] | None


@overload
def parallel_branches(fun: F, *, max_streams: int = ..., target: Target = ...,
                      min_cost_us: float = ..., fuse_scans: Switch = ...,
                      batch_scans: Switch = ..., batch_branches: Switch = ...,
                      batch_matmuls: Switch = ...,
                      unroll: Unroll = ..., group_collectives: Switch = ...,
                      force_streams: bool = ..., tune: bool | TuneBudget = ...,
                      command_buffers: str = ...,
                      memory: str | float = ...,
                      static_argnums: _Argnums = ..., static_argnames: _Argnames = ...,
                      ) -> F: ...
@overload
def parallel_branches(fun: None = None, *, max_streams: int = ..., target: Target = ...,
                      min_cost_us: float = ..., fuse_scans: Switch = ...,
                      batch_scans: Switch = ..., batch_branches: Switch = ...,
                      batch_matmuls: Switch = ...,
                      unroll: Unroll = ..., group_collectives: Switch = ...,
                      force_streams: bool = ..., tune: bool | TuneBudget = ...,
                      command_buffers: str = ...,
                      static_argnums: _Argnums = ..., static_argnames: _Argnames = ...,
                      ) -> Callable[[F], F]: ...
def parallel_branches(fun: Any = None, *, max_streams: int = 4, target: Target = "auto",
                      min_cost_us: float = 5.0, fuse_scans: Switch = "auto",
                      batch_scans: Switch = "auto", batch_branches: Switch = "auto",
                      batch_matmuls: Switch = "auto",
                      unroll: Unroll = "auto", group_collectives: Switch = "auto",
                      force_streams: bool = False, tune: bool | TuneBudget = False,
                      command_buffers: str = "auto", memory: str | float = "auto",
                      static_argnums: _Argnums = None, static_argnames: _Argnames = None,
                      **unknown: Any) -> Any:
    """Rewrites ``fun`` so XLA:GPU runs its independent work concurrently.

    The function is traced to a jaxpr (per argument signature, cached). On target
    ``"gpu"`` independent loops are fused, batched and unrolled, identical branches
    and same-shaped matmuls batched and independent collectives grouped where the
    cost model says it pays; the function is compiled in the CUDA-graph mode its GPU
    model estimates fastest (``command_buffers``); and independent regions that the
    GPU pricing says pay (or every one, with ``force_streams``) are emitted as
    non-inlined calls with ``_xla_stream_annotation`` (stream ids 1..k) and a shared
    ``_scheduling_group_id``. On other targets the program is re-emitted unchanged.
    The result computes the same values and composes with ``jax.jit``, ``jax.grad``,
    ``jax.vmap`` and ``shard_map``.

    Args:
      fun: the function to rewrite. Its arguments are pytrees: array leaves are
        traced (and Python scalars, as ``jax.jit`` traces them), other hashable
        leaves (functions, strings...) are static, and non-array outputs come back
        as they are. With an Equinox module among the arguments it follows
        ``eqx.filter_jit`` (Python scalars static too); Flax NNX objects (modules,
        optimizers, metrics, ``nnx.Rngs``) are handled as ``nnx.jit`` handles them:
        the state the call changes is written back to them. When omitted,
        ``parallel_branches(**options)`` returns a decorator.
      max_streams: most regions (and so streams) per parallel section, >= 1.
        The effective cap is also bounded by XLA's
        ``--xla_gpu_experimental_parallel_async_compute_limit`` (default 2).
      target: ``"gpu"``, ``"cpu"``, ``"tpu"`` or ``"auto"`` (the default
        backend when the function is traced). Stream annotations are emitted
        only for ``"gpu"``; elsewhere they do nothing but block inlining.
      min_cost_us: estimated device time (microseconds) a branch must reach to
        be worth a stream of its own.
      fuse_scans: fuse independent equal-length scans (``"auto"``: per target).
      batch_scans: batch independent identical scans with ``vmap``.
      batch_branches: batch identical independent straight-line subgraphs (the
        members of an ensemble) into one ``vmap``ped subgraph, where the target's
        cost model says the stacking copies cost less than the launches saved.
      batch_matmuls: run same-shaped matmuls and convolutions of one stage in
        different independent members (the halves of a fused scan body, experts,
        towers) as one batched op, where the target's cost model says it pays.
      unroll: ``"auto"`` (the target's default: ``"cost"`` on GPUs, None elsewhere),
        ``"cost"`` (a factor per scan from the target's cost model), an unroll factor
        >= 1, or None to leave scans alone.
      group_collectives: launch independent collectives together.
      force_streams: emit every independent section found, even where the GPU
        estimate says it does not pay (a stream cut forfeits fusions, XLA's dot
        merging and CUDA-graph overlap); for experiments and for measuring on a
        real GPU. By default such sections are left alone and ``inspect`` says why.
      tune: measure, at the first concrete call of each signature, plain ``jax.jit`` of
        ``fun`` and jaxpar with its rewrites and without some of them (``_tune.CANDIDATES``)
        on this device, run the fastest (plain unless a rewrite is more than 3% faster),
        and store the decision under ``$JAXPAR_TUNE_DIR`` (default
        ``~/.cache/jaxpar/tune``) so a later process compiles only the winner.
        ``inspect`` shows the measured table. Under an outer ``jit``/``grad``/``vmap``
        it reuses a decision made at the same shapes, else runs the plan.
      command_buffers: XLA's CUDA-graph mode for this function's compile, on target
        ``"gpu"``: ``"auto"`` (default) plans the function in XLA's default ``"lhs"``
        mode, in ``"concurrent_regions"`` mode (small independent kernels become
        parallel graph nodes) and with graphs ``"off"`` (stream regions holding loops
        keep their overlap), and compiles it in another mode than the process's only
        where the GPU model estimates it at least 5% faster at the nominal figures and
        at the pessimistic end of every uncertain figure's range, within the memory
        budget (with the built-in, unmeasured figures no mode change holds there; a
        calibration on the GPU narrows them); a mode set in ``XLA_FLAGS`` is kept, and
        so is the process's mode with ``force_streams=True``. ``"keep"``: always the
        process's mode. ``"lhs"``, ``"concurrent"``, ``"concurrent_regions"``,
        ``"serialize"`` or ``"off"``: that mode. The choice goes into this function's
        own ``jax.jit`` as ``compiler_options`` (``Plan.xla_options``; other functions
        keep the process's flags); under an outer ``jax.jit``, ``grad`` or ``vmap`` the
        outer compile's options apply (jaxpar warns once,
        ``XlaOptionsNotAppliedWarning``). Ignored on other targets.
      memory: how much more temporary memory than the plain program jaxpar's program
        may need, as its memory model estimates both: ``"auto"`` (default) at most 10%
        or 1 MiB more, whichever is more; ``"any"``; or a number of bytes. Rewrites
        and modes beyond it are left out, and ``inspect`` says which.
      static_argnums: positional arguments that are static (hashable Python
        values that key the cache and may steer tracing), as in ``jax.jit``;
        negative numbers count from the end.
      static_argnames: the same by name; numbers and names complete each other
        as in ``jax.jit``.

    Returns:
      The rewritten function, a ``jaxpar.ParallelBranches`` with ``trace``,
      ``lower``, ``eval_shape`` and ``clear_cache`` as on ``jax.jit`` (or a
      decorator, when ``fun`` is omitted). Under ``jax.disable_jit()`` it calls
      ``fun`` eagerly; with ``JAXPAR_DISABLE=1`` in the environment it runs as
      plain ``jax.jit`` of ``fun``.

    Raises:
      TypeError: ``fun`` is not callable or is a Flax NNX or Linen module (with what
        to write instead), an option is unknown (with the closest valid name) or
        belongs to an outer ``jax.jit`` (``donate_argnums``...), ``max_streams``,
        ``force_streams`` or ``tune`` has the wrong type; at call time, an argument
        leaf that is neither an array nor hashable (naming it).
      ValueError: any other bad option value (out of range, or of the wrong type:
        ``min_cost_us="5"``, ``fuse_scans="yes"``), or a static argument number or
        name ``fun`` does not take.
      Exception: at call time, an error raised tracing ``fun`` keeps its class, as under
        ``jax.jit`` (the function's own ``ValueError``, JAX's ``ConcretizationTypeError``,
        ...), with jaxpar's context (function, arguments, advice) added as a note.

    Example:
      >>> @jaxpar.parallel_branches(target="gpu")
      ... def f(a, b):
      ...   return jnp.tanh(a @ a) + jnp.tanh(b @ b)
    """
    _refuse_outer_jit_options(unknown, "parallel_branches")
    check_known(unknown, (*Options.names(), "tune", *_CALL_OPTIONS))
    if not isinstance(tune, (bool, TuneBudget)):
        raise TypeError(f"tune must be True, False or a jaxpar.TuneBudget, got {tune!r}")
    options = Options.create(max_streams=max_streams, target=target, min_cost_us=min_cost_us,
                             fuse_scans=fuse_scans, batch_scans=batch_scans,
                             batch_branches=batch_branches, batch_matmuls=batch_matmuls,
                             unroll=unroll,
                             group_collectives=group_collectives, force_streams=force_streams,
                             command_buffers=command_buffers, memory=memory)

    def decorate(f: Any) -> ParallelBranches:
        check_function(f, "parallel_branches")
        return ParallelBranches(f, options, StaticArgs.resolve(f, static_argnums,
                                                               static_argnames),
                                tune=tune if isinstance(tune, TuneBudget)
                                else TuneBudget() if tune else None)

    return decorate if fun is None else decorate(fun)


# Options of a call rather than of the plan: accepted by parallel_branches and inspect.
_CALL_OPTIONS = ("static_argnums", "static_argnames")

# jax.jit's options that belong to a jit around the decorated function.
_OUTER_JIT_OPTIONS = ("donate_argnums", "donate_argnames", "in_shardings", "out_shardings",
                      "keep_unused", "device", "backend")


def _refuse_outer_jit_options(given: dict[str, Any], api: str) -> None:
    named = [name for name in _OUTER_JIT_OPTIONS if name in given]
    if named:
        settings = ", ".join(f"{name}={given[name]!r}" for name in named)
        raise TypeError(
            f"{api} takes no {', '.join(named)}: that is a job for the jax.jit around the "
            f"decorated function, which jaxpar composes with:\n"
            f"    step = jax.jit(jaxpar.parallel_branches(f), {settings})")


def inspect(fun: Callable[..., Any], *args: Any, **options: Any) -> Callable[..., Plan]:
    """Shows how ``parallel_branches`` would partition ``fun``, like ``jax.make_jaxpr``.

    Args:
      fun: a function, or one already decorated with ``parallel_branches``
        (its options and static arguments are the starting point; ``options``
        override them).
      **options: any option of ``parallel_branches``, including
        ``static_argnums`` and ``static_argnames``.

    Returns:
      A function taking ``fun``'s arguments (arrays or ``jax.ShapeDtypeStruct``)
      and returning a ``jaxpar.Plan``: the parallel sections with their
      regions, stream ids, equation counts, main primitives, estimated cost and
      source lines, and what was left alone and why. For a function decorated
      with ``tune=True`` (and no ``options`` here), ``Plan.tuning`` is the tuner's
      measured table for those arguments (``ParallelBranches.tuning``: measured now
      when no decision exists and the arguments are arrays).

    Raises:
      TypeError, ValueError: as for ``parallel_branches``; ``inspect(f, x, y)``, which
        means ``inspect(f)(x, y)``.

    Example:
      >>> plan = jaxpar.inspect(f, target="gpu")(a, b)
      >>> print(plan)
    """
    if args:
        raise TypeError(
            f"inspect takes the function and options, then the arguments in a second call, "
            f"like jax.make_jaxpr: write jaxpar.inspect(f, **options)(*args) (got {len(args)} "
            "argument(s) after the function).")
    _refuse_outer_jit_options(options, "inspect")
    check_known(options, (*Options.names(), *_CALL_OPTIONS))
    planned_for: dict[str, Any] = {}
    tuned = fun if isinstance(fun, ParallelBranches) and fun.tune is not None and not options \
        else None
    if isinstance(fun, ParallelBranches):
        base, inner = fun.options.to_dict(), fun.__wrapped__
        given_nums, given_names = fun.static_argnums or None, fun.static_argnames or None
        planned_for = fun._planned_for
    else:
        base, inner, given_nums, given_names = {}, fun, None, None
    check_function(inner, "inspect")
    refuse_module_as_function(inner, "inspect")
    statics = StaticArgs.resolve(inner, options.pop("static_argnums", given_nums),
                                 options.pop("static_argnames", given_names))
    resolved = Options.create(**{**base, **options})

    @functools.wraps(inner)
    def make_plan(*args: Any, **kwargs: Any) -> Plan:
        settings = resolved.resolve(**planned_for)
        with nnx_arguments(object(), inner, args, kwargs) as (traced_fun, args, kwargs, _):
            layout, leaves = split_arguments(traced_fun, args, kwargs, statics,
                                             allow_abstract=True, api="inspect")
            sig = Signature(layout, tuple(abstract(leaf) for leaf in leaves))
            prepared = _pipeline.analyse(traced_fun, sig, settings, report_now=True)
        tuning = None if tuned is None else tuned.tuning(*args, **kwargs)
        return prepared.report(function_name(inner), resolved, tuning)

    return make_plan


@contextlib.contextmanager
def array_function(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                   statics: StaticArgs, api: str) -> Iterator[tuple[Callable[..., Any], list[Any]]]:
    """``fun`` as a function of its array leaves only, and those leaves, for compiling with
    plain ``jax.jit`` what ``parallel_branches(fun)`` runs: static arguments, non-array
    leaves and NNX graph definitions are bound, and only the array outputs returned."""
    with nnx_arguments(object(), fun, args, kwargs) as (traced_fun, args, kwargs, _):
        layout, leaves = split_arguments(traced_fun, args, kwargs, statics, allow_abstract=True,
                                         api=api)

        def flat(*flat_leaves: Any) -> list[Any]:
            full_args, full_kwargs = layout.rebuild(flat_leaves)
            return split_outputs(traced_fun(*full_args, **full_kwargs), layout.static_scalars)[0]

        flat.__name__ = str(getattr(fun, "__name__", "fun"))
        flat.__qualname__ = str(getattr(fun, "__qualname__", flat.__name__))
        yield flat, leaves


# ``lower`` traces the function once to learn the options its plan chose.
_lowering = threading.local()

_stream_state = threading.local()


def inside_stream_call() -> bool:
    """Whether we are tracing the body of a user's ``on_stream`` call."""
    return bool(getattr(_stream_state, "depth", 0))


@contextlib.contextmanager
def _inside_stream_call() -> Iterator[None]:
    _stream_state.depth = getattr(_stream_state, "depth", 0) + 1
    try:
        yield
    finally:
        _stream_state.depth -= 1


def on_stream(stream: int, *misplaced: Any, scheduling_group: int | None = None
              ) -> Callable[[F], F]:
    """Puts a function on CUDA stream ``stream`` yourself (the manual API).

    The wrapped function lowers to one non-inlined call with
    ``_xla_stream_annotation=str(stream)`` on every supported JAX version.
    Functions that should overlap share a ``scheduling_group``. Composes with
    ``jit``, ``grad`` (the backward pass gets its own annotated call) and
    ``vmap``; ``parallel_branches`` leaves such calls alone.

    Args:
      stream: stream id, an int >= 1 (id 0 is not portable across XLA versions).
      misplaced: nothing; here only to answer ``on_stream(fun, 1)`` (the function given
        first, as to ``parallel_branches``) with the call form to write.
      scheduling_group: optional int >= 1 shared by calls meant to overlap.

    Returns:
      A decorator.

    Raises:
      TypeError, ValueError: bad ``stream`` or ``scheduling_group``.
      ValueError: (when called) the function is already inside a stream call or
        contains one; XLA cannot compile nested stream calls.

    Example:
      >>> fwd = jaxpar.on_stream(1, scheduling_group=1)(lambda x: x @ w)
      >>> bwd = jaxpar.on_stream(2, scheduling_group=1)(lambda y: y @ v)
    """
    if callable(stream) or misplaced:
        given = ", ".join(short_repr(a) for a in (stream, *misplaced))
        raise TypeError(f"on_stream takes the stream id and returns a decorator: write "
                        f"on_stream(1)(fun) or @on_stream(1) above the function (and "
                        f"scheduling_group= by keyword), got on_stream({given})")
    for name, value, optional in (("stream", stream, False),
                                  ("scheduling_group", scheduling_group, True)):
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int >= 1, got {value!r}")
        if value < 1:
            why = ("XLA's stream id 0 means the main stream on older versions and a side "
                   "stream on newer ones" if name == "stream" else
                   "give the calls meant to overlap one shared id, an int >= 1")
            raise ValueError(f"{name} must be >= 1, got {value}: {why}")

    group = GroupIds(fixed=scheduling_group) if scheduling_group is not None else None

    def decorate(fun: F) -> F:
        check_function(fun, "on_stream")
        checked: set[Signature] = set()
        label = function_name(fun)

        @functools.wraps(fun)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if inside_stream_call():
                raise ValueError(
                    f"on_stream({stream}) for {label!r} is called inside another stream call; "
                    "XLA cannot compile nested stream calls. Call the two functions side by "
                    "side instead.")
            layout, leaves = split_arguments(fun, args, kwargs, api="on_stream",
                                             scalars=Scalars.STATIC_UNDER_TRACE)
            sig = Signature(layout, tuple(abstract(leaf) for leaf in leaves))
            if sig not in checked:
                if jaxpr_has_placement(trace(fun, sig).jaxpr):
                    raise ValueError(
                        f"on_stream({stream}) for {label!r}: the function already contains "
                        "stream-annotated or placed code (on_stream, parallel_branches output, "
                        "compute_on, xla_metadata_call); XLA cannot compile nested stream calls. "
                        "Annotate the inner parts only, or the whole function only.")
                checked.add(sig)

            out_tree: list[Any] = []

            def flat_body(*flat: Any) -> list[Any]:
                inner_args, inner_kwargs = layout.rebuild(flat)
                with _inside_stream_call():
                    out = fun(*inner_args, **inner_kwargs)
                out_leaves, tree = jax.tree_util.tree_flatten(out)
                out_tree.append(tree)
                return out_leaves

            # A region like parallel_branches' own (not a bare xla_metadata_call), so
            # checkify and higher-order autodiff see its body; its derived
            # calls keep the user's attributes, as xla_metadata_call's do.
            outs = region_call(flat_body, stream, group)(*leaves)
            return jax.tree_util.tree_unflatten(out_tree[-1], outs)

        return wrapper  # type: ignore[return-value]

    return decorate


