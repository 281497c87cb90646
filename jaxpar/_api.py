"""Public entry points: ``parallel_branches``, ``inspect`` and ``on_stream``.

Example::

    @jaxpar.parallel_branches(target="gpu")
    def two_scans(a, b):
        return lax.scan(step1, a, xs)[0], lax.scan(step2, b, xs)[0]

    print(jaxpar.inspect(two_scans)(a, b))

Sharp edges:
  * Every call runs under one ``jax.jit`` (eager calls, and calls under grad,
    vmap or jvp, stay compiled; under another jit it is inlined). Its
    ``trace``/``lower``/``eval_shape`` are ``jax.jit``'s on the decorated
    function, so there every non-static leaf must be an array.
  * The rewrite is cached per argument structure, shapes, dtypes and options
    (and the XLA_FLAGS async limit, and JAX's trace context as ``jax.jit`` keys
    it: ``enable_x64``, promotion rules, matmul precision, default device...);
    a change to any of them re-plans.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import itertools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, overload

import jax

from . import _compat
from ._analysis import Analysis, jaxpr_has_placement
from ._emit import Emitter, GroupIds, region_call
from ._inspect import Plan, build_report
from ._options import Options, Settings, Switch, Target, Unroll, check_known
from ._plan import LevelPlan, plan_jaxpr
from ._trace import (
    Layout,
    Signature,
    StaticArgs,
    Traced,
    abstract,
    split_arguments,
    trace,
)
from .passes import LoopDecision, run_passes

F = TypeVar("F", bound=Callable[..., Any])

_CACHE_SIZE = 64

DISABLE_VARIABLE = "JAXPAR_DISABLE"


def disabled_by_environment() -> bool:
    """Whether ``JAXPAR_DISABLE`` is set (``1``, ``true``, ``yes`` or ``on``): decorated
    functions then run as plain ``jax.jit`` of the original function."""
    return os.environ.get(DISABLE_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """Everything derived from one signature: plan and emitter."""

    traced: Traced
    plan: LevelPlan
    loops: tuple[LoopDecision, ...]
    target: str
    emitter: Emitter


@dataclasses.dataclass(frozen=True)
class _CallKey:
    """The static argument of the one ``jax.jit`` a decorated function runs under."""

    layout: Layout
    emit_streams: bool  # False inside a user's on_stream call (stream calls cannot nest)
    rewrite: bool  # False when JAXPAR_DISABLE is set: run the original function
    # The options resolved for the target and XLA_FLAGS (the async compute limit and
    # the CUDA-graph mode), which jax.jit's own cache does not see.
    settings: Settings
    # Inside a program being staged out, each call site gets its own trace: the emitted
    # scheduling group ids must differ between two calls XLA inlines into one
    # computation (equal ids linked through other work abort the GPU compile).
    call_site: int


_call_sites = itertools.count(1)


class _PlanCache:
    """The rewrites of one decorated function, most recently used last.

    Registered with ``jax.clear_caches()``, which empties it, as it empties JAX's own
    caches; it holds jaxprs, so it dies with the decorated function.
    """

    def __init__(self, size: int):
        self._size = size
        self._entries: collections.OrderedDict[Any, _Prepared] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> _Prepared | None:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
            return hit

    def put(self, key: Any, rewrite: _Prepared) -> None:
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


def _check_callable(fun: Any, api: str) -> None:
    if not callable(fun):
        raise TypeError(f"{api} expects a callable as `fun`, got {type(fun).__name__}: "
                        f"{fun!r}. Decorate a function, or call {api}(fun, ...).")


class ParallelBranches:
    """A function rewritten by ``parallel_branches``; call it like the original.

    Like a ``jax.jit`` function it has ``trace``, ``lower`` and ``eval_shape``, and
    ``clear_cache()``; ``__wrapped__`` is the original function.
    """

    def __init__(self, fun: Callable[..., Any], options: Options,
                 static_args: StaticArgs | None = None):
        _check_callable(fun, "parallel_branches")
        functools.update_wrapper(self, fun)
        self.__wrapped__ = fun
        self.options = options
        self._static_args = static_args or StaticArgs()
        self._cache = _PlanCache(_CACHE_SIZE)
        _compat.register_for_clear_caches(self._cache, f"jaxpar rewrites of {self!r}")
        self.analyses = 0  # how many times a signature was planned (for tests and tooling)
        # One jit for every call, eager or under a transformation: grad, vmap and
        # jvp of a jitted call stay compiled, and jit inside jit is inlined.
        def call(key: _CallKey, *leaves: Any) -> Any:
            return self._call_traced(key, *leaves)

        # Named after the user's function in lowered programs and profiles, as jax.jit does.
        call.__name__ = str(getattr(fun, "__name__", "parallel_branches"))
        call.__qualname__ = str(getattr(fun, "__qualname__", call.__name__))
        self._jitted: Any = jax.jit(call, static_argnums=0)
        self._stages: Any = None
        self._saw_traced_consts = threading.local()

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
        if _compat.jit_disabled():  # jax.disable_jit(): run the original, eagerly
            return self.__wrapped__(*args, **kwargs)
        layout, leaves = split_arguments(self.__wrapped__, args, kwargs, self._static_args)
        key = _CallKey(layout, not inside_stream_call(), not disabled_by_environment(),
                       self.options.resolve(), next(_call_sites) if _compat.staging() else 0)
        self._saw_traced_consts.value = False
        out = self._jitted(key, *leaves)
        if self._saw_traced_consts.value:
            # The trace closed over another trace's tracers: jit must not reuse it.
            self._jitted.clear_cache()
        return out

    def _call_traced(self, key: _CallKey, *leaves: Any) -> Any:
        if not key.rewrite:
            args, kwargs = key.layout.rebuild(leaves)
            return self.__wrapped__(*args, **kwargs)
        rewrite = self._prepare(Signature(key.layout, tuple(abstract(leaf) for leaf in leaves)),
                                key.settings)
        if rewrite.traced.consts_are_tracers:
            self._saw_traced_consts.value = True
        flat_out = _run(rewrite, leaves, key.emit_streams)
        return jax.tree_util.tree_unflatten(rewrite.traced.out_tree, flat_out)

    def _prepare(self, sig: Signature, settings: Settings) -> _Prepared:
        # JAX's trace context (x64, promotion rules, matmul precision, default device,
        # mesh...) changes what tracing produces, so it keys the plan as it keys jax.jit.
        key = (sig, settings, _compat.trace_context())
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        rewrite = _build(self.__wrapped__, sig, settings)
        self.analyses += 1
        if not rewrite.traced.consts_are_tracers:
            self._cache.put(key, rewrite)
        return rewrite

    def _staged(self) -> Any:
        if self._stages is None:
            self._stages = jax.jit(self, static_argnums=self.static_argnums,
                                   static_argnames=self.static_argnames)
        return self._stages

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(f).trace(...)`` of the rewritten function: a ``jax.stages.Traced``."""
        return self._staged().trace(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(f).lower(...)``: a ``jax.stages.Lowered`` (``.as_text()``, ``.compile()``)."""
        return self._staged().lower(*args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The output shapes and dtypes, as ``jax.ShapeDtypeStruct`` s, without running."""
        return self._staged().eval_shape(*args, **kwargs)

    def clear_cache(self) -> None:
        """Forgets every rewrite and compiled program of this function."""
        self._cache.cache_clear()
        self._jitted.clear_cache()
        if self._stages is not None:
            self._stages.clear_cache()

    def __repr__(self) -> str:
        return f"parallel_branches({getattr(self.__wrapped__, '__name__', self.__wrapped__)!r})"


def _analyse(fun: Callable[..., Any], sig: Signature, settings: Settings
             ) -> tuple[Traced, LevelPlan, tuple[LoopDecision, ...]]:
    """Trace, loop passes, stream plan: everything up to emission, with one ``Analysis``
    (settings, cost model, memos) that dies when this returns."""
    traced = trace(fun, sig)
    with _collector_paused():
        analysis = Analysis(settings)
        jaxpr, loops = run_passes(traced.jaxpr, analysis=analysis)
        plan = plan_jaxpr(jaxpr, analysis)
    if jaxpr is not traced.jaxpr:
        traced = dataclasses.replace(traced, jaxpr=jaxpr)
    return traced, plan, loops


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector (if it was on) while jaxpar analyses,
    reports or emits (not while the user's function itself is traced).

    The analysis allocates many small, short-lived objects among the large object
    graphs of JAX's jaxprs; collections triggered by those allocations re-scan the jaxprs
    and took a third of the analysis time of a 10k-equation program. Nothing the analysis
    makes needs the collector (reference counting frees it), and it is back on, with its
    usual thresholds, the moment the analysis ends or raises.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _build(fun: Callable[..., Any], sig: Signature, settings: Settings) -> _Prepared:
    traced, plan, loops = _analyse(fun, sig, settings)
    target = settings.target
    return _Prepared(traced, plan, loops, target, Emitter(plan, emit_streams=(target == "gpu")))


def _run(rewrite: _Prepared, leaves: Any, emit_streams: bool) -> list[Any]:
    _, consts = _compat.open_jaxpr(rewrite.traced.jaxpr)
    with _collector_paused():
        return rewrite.emitter.run(consts, *leaves, emit_streams=emit_streams)


_Argnums = int | Sequence[int] | None
_Argnames = str | Iterable[str] | None


@overload
def parallel_branches(fun: F, *, max_streams: int = ..., target: Target = ...,
                      min_cost_us: float = ..., fuse_scans: Switch = ...,
                      batch_scans: Switch = ..., batch_branches: Switch = ...,
                      batch_matmuls: Switch = ...,
                      unroll: Unroll = ..., group_collectives: Switch = ...,
                      force_streams: bool = ...,
                      static_argnums: _Argnums = ..., static_argnames: _Argnames = ...,
                      ) -> F: ...
@overload
def parallel_branches(fun: None = None, *, max_streams: int = ..., target: Target = ...,
                      min_cost_us: float = ..., fuse_scans: Switch = ...,
                      batch_scans: Switch = ..., batch_branches: Switch = ...,
                      batch_matmuls: Switch = ...,
                      unroll: Unroll = ..., group_collectives: Switch = ...,
                      force_streams: bool = ...,
                      static_argnums: _Argnums = ..., static_argnames: _Argnames = ...,
                      ) -> Callable[[F], F]: ...
def parallel_branches(fun: Any = None, *, max_streams: int = 4, target: Target = "auto",
                      min_cost_us: float = 5.0, fuse_scans: Switch = "auto",
                      batch_scans: Switch = "auto", batch_branches: Switch = "auto",
                      batch_matmuls: Switch = "auto",
                      unroll: Unroll = "auto", group_collectives: Switch = "auto",
                      force_streams: bool = False,
                      static_argnums: _Argnums = None, static_argnames: _Argnames = None,
                      **unknown: Any) -> Any:
    """Rewrites ``fun`` so independent work runs on separate CUDA streams.

    The function is traced to a jaxpr (per argument signature, cached), the
    equations that do not depend on each other are grouped into regions, and
    each region of a parallel section is emitted as one non-inlined call with
    ``_xla_stream_annotation`` (stream ids 1..k) and a shared
    ``_scheduling_group_id``. The result computes the same values and composes
    with ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``shard_map``.

    Args:
      fun: the function to rewrite. Its arguments are pytrees: array leaves are
        traced (and Python scalars, as ``jax.jit`` traces them), other hashable
        leaves (functions, strings...) are static, as in ``eqx.filter_jit``. When
        omitted, ``parallel_branches(**options)`` returns a decorator.
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
      unroll: ``"auto"``, an unroll factor >= 1, or None to leave scans alone.
      group_collectives: launch independent collectives together.
      force_streams: emit every independent section found, even where the GPU
        estimate says it does not pay (a stream cut forfeits fusions, XLA's dot
        merging and CUDA-graph overlap); for experiments and for measuring on a
        real GPU. By default such sections are left alone and ``inspect`` says why.
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
      TypeError: ``fun`` is not callable, an option is unknown (with the closest
        valid name) or has the wrong type; at call time, an argument leaf that is
        neither an array nor hashable, or a Flax NNX module (naming it).
      ValueError: an option value is out of range, or a static argument number or
        name ``fun`` does not take.
      jaxpar.TraceError: ``fun`` cannot be traced (at call time).

    Example:
      >>> @jaxpar.parallel_branches(target="gpu")
      ... def f(a, b):
      ...   return jnp.tanh(a @ a) + jnp.tanh(b @ b)
    """
    check_known(unknown, (*Options.names(), *_CALL_OPTIONS))
    options = Options.create(max_streams=max_streams, target=target, min_cost_us=min_cost_us,
                             fuse_scans=fuse_scans, batch_scans=batch_scans,
                             batch_branches=batch_branches, batch_matmuls=batch_matmuls,
                             unroll=unroll,
                             group_collectives=group_collectives, force_streams=force_streams)

    def decorate(f: Any) -> ParallelBranches:
        _check_callable(f, "parallel_branches")
        return ParallelBranches(f, options, StaticArgs.resolve(f, static_argnums,
                                                               static_argnames))

    return decorate if fun is None else decorate(fun)


# Options of a call rather than of the plan: accepted by parallel_branches and inspect.
_CALL_OPTIONS = ("static_argnums", "static_argnames")


def inspect(fun: Callable[..., Any], **options: Any) -> Callable[..., Plan]:
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
      source lines, and what was left alone and why.

    Raises:
      TypeError, ValueError: as for ``parallel_branches``.

    Example:
      >>> plan = jaxpar.inspect(f, target="gpu")(a, b)
      >>> print(plan)
    """
    check_known(options, (*Options.names(), *_CALL_OPTIONS))
    if isinstance(fun, ParallelBranches):
        base, inner = fun.options.to_dict(), fun.__wrapped__
        given_nums, given_names = fun.static_argnums or None, fun.static_argnames or None
    else:
        base, inner, given_nums, given_names = {}, fun, None, None
    _check_callable(inner, "inspect")
    statics = StaticArgs.resolve(inner, options.pop("static_argnums", given_nums),
                                 options.pop("static_argnames", given_names))
    resolved = Options.create(**{**base, **options})

    @functools.wraps(inner)
    def make_plan(*args: Any, **kwargs: Any) -> Plan:
        layout, leaves = split_arguments(inner, args, kwargs, statics, allow_abstract=True,
                                         api="inspect")
        sig = Signature(layout, tuple(abstract(leaf) for leaf in leaves))
        settings = resolved.resolve()
        target = settings.target
        _, plan, loops = _analyse(inner, sig, settings)
        name = str(getattr(inner, "__qualname__", None) or getattr(inner, "__name__", inner))
        with _collector_paused():
            return build_report(plan, name, target, emitted=(target == "gpu"),
                                options=resolved.to_dict(), loops=loops)

    return make_plan


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


def on_stream(stream: int, *, scheduling_group: int | None = None) -> Callable[[F], F]:
    """Puts a function on CUDA stream ``stream`` yourself (the manual API).

    The wrapped function lowers to one non-inlined call with
    ``_xla_stream_annotation=str(stream)`` on every supported JAX version.
    Functions that should overlap share a ``scheduling_group``. Composes with
    ``jit``, ``grad`` (the backward pass gets its own annotated call) and
    ``vmap``; ``parallel_branches`` leaves such calls alone.

    Args:
      stream: stream id, an int >= 1 (id 0 is not portable across XLA versions).
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
    for name, value, optional in (("stream", stream, False),
                                  ("scheduling_group", scheduling_group, True)):
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int >= 1, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}: XLA's stream id 0 means the "
                             "main stream on older versions and a side stream on newer ones")

    group = GroupIds(fixed=scheduling_group) if scheduling_group is not None else None

    def decorate(fun: F) -> F:
        _check_callable(fun, "on_stream")
        checked: set[Signature] = set()
        label = getattr(fun, "__name__", repr(fun))

        @functools.wraps(fun)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if inside_stream_call():
                raise ValueError(
                    f"on_stream({stream}) for {label!r} is called inside another stream call; "
                    "XLA cannot compile nested stream calls. Call the two functions side by "
                    "side instead.")
            layout, leaves = split_arguments(fun, args, kwargs, api="on_stream")
            sig = Signature(layout, tuple(abstract(leaf) for leaf in leaves))
            if sig not in checked:
                if jaxpr_has_placement(trace(fun, sig).jaxpr, {}):
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
            # checkify and higher-order autodiff see its body (issue 18); its derived
            # calls keep the user's attributes, as xla_metadata_call's do.
            outs = region_call(flat_body, stream, group)(*leaves)
            return jax.tree_util.tree_unflatten(out_tree[-1], outs)

        return wrapper  # type: ignore[return-value]

    return decorate


