"""Public entry points: ``parallel_branches``, ``inspect`` and ``on_stream``.

Example::

    @jaxpar.parallel_branches(target="gpu")
    def two_scans(a, b):
        return lax.scan(step1, a, xs)[0], lax.scan(step2, b, xs)[0]

    print(jaxpar.inspect(two_scans)(a, b))

Sharp edges:
  * The rewrite is cached per argument structure, shapes, dtypes and options
    (and the XLA_FLAGS async limit); a change to any of them re-plans.
  * Called eagerly the rewritten function runs under ``jax.jit``; called under
    another transformation it is traced inline into the caller.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, overload

import jax

from . import _compat
from ._emit import Emitter, stream_attributes
from ._inspect import Plan, build_report
from ._options import Options, Switch, Target, Unroll
from ._plan import LevelPlan, PlanContext, async_compute_limit, jaxpr_has_placement, plan_jaxpr
from ._trace import Signature, Traced, signature, trace
from .passes import LoopDecision, apply_loop_passes

F = TypeVar("F", bound=Callable[..., Any])

_CACHE_SIZE = 64


@dataclasses.dataclass(frozen=True)
class _Rewrite:
    """Everything derived from one signature: plan, emitter, compiled runner."""

    traced: Traced
    plan: LevelPlan
    loops: tuple[LoopDecision, ...]
    target: str
    emitter: Emitter
    jitted: Callable[..., Any]


def _check_callable(fun: Any, api: str) -> None:
    if not callable(fun):
        raise TypeError(f"{api} expects a callable as `fun`, got {type(fun).__name__}: "
                        f"{fun!r}. Decorate a function, or call {api}(fun, ...).")


class ParallelBranches:
    """A function rewritten by ``parallel_branches``; call it like the original."""

    def __init__(self, fun: Callable[..., Any], options: Options):
        _check_callable(fun, "parallel_branches")
        self.__wrapped__ = fun
        self.options = options
        self._cache: collections.OrderedDict[Any, _Rewrite] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.analyses = 0  # how many times a signature was planned (for tests and tooling)
        functools.update_wrapper(self, fun)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return functools.partial(self, instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sig, leaves = signature(self.__wrapped__, args, kwargs)
        rewrite = self._rewrite(sig)
        if any(_compat.is_tracer(leaf) for leaf in leaves):
            flat_out = _run(rewrite, leaves)
        else:
            flat_out = rewrite.jitted(*leaves)
        return jax.tree_util.tree_unflatten(rewrite.traced.out_tree, flat_out)

    def _rewrite(self, sig: Signature) -> _Rewrite:
        target = self.options.resolved_target()
        key = (sig, target, async_compute_limit())
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        rewrite = _build(self.__wrapped__, sig, self.options, target)
        self.analyses += 1
        if not rewrite.traced.consts_are_tracers:
            with self._lock:
                self._cache[key] = rewrite
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return rewrite

    def __repr__(self) -> str:
        return f"parallel_branches({getattr(self.__wrapped__, '__name__', self.__wrapped__)!r})"


def _analyse(fun: Callable[..., Any], sig: Signature, options: Options, target: str
             ) -> tuple[Traced, LevelPlan, tuple[LoopDecision, ...]]:
    """Trace, loop passes, stream plan: everything up to emission."""
    traced = trace(fun, sig)
    with _collector_paused():
        jaxpr, loops = apply_loop_passes(traced.jaxpr, **options.loop_settings(target),
                                         target=target)
        plan = plan_jaxpr(jaxpr, PlanContext(options, target))
    if jaxpr is not traced.jaxpr:
        traced = dataclasses.replace(traced, jaxpr=jaxpr)
    return traced, plan, loops


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector (if it was on) while jaxpar analyses.

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


def _build(fun: Callable[..., Any], sig: Signature, options: Options, target: str) -> _Rewrite:
    traced, plan, loops = _analyse(fun, sig, options, target)
    emitter = Emitter(plan, emit_streams=(target == "gpu"))
    rewrite_box: list[_Rewrite] = []

    def run_flat(*leaves: Any) -> list[Any]:
        return _run(rewrite_box[0], leaves)

    rewrite = _Rewrite(traced, plan, loops, target, emitter, jax.jit(run_flat))
    rewrite_box.append(rewrite)
    return rewrite


def _run(rewrite: _Rewrite, leaves: Any) -> list[Any]:
    _, consts = _compat.open_jaxpr(rewrite.traced.jaxpr)
    # Inside a user's on_stream call, emitting stream calls would nest them.
    return rewrite.emitter.run(consts, *leaves, emit_streams=not inside_stream_call())


@overload
def parallel_branches(fun: F, *, max_streams: int = ..., target: Target = ...,
                      min_cost_us: float = ..., fuse_scans: Switch = ...,
                      batch_scans: Switch = ..., batch_branches: Switch = ...,
                      batch_matmuls: Switch = ...,
                      unroll: Unroll = ..., group_collectives: Switch = ...) -> F: ...
@overload
def parallel_branches(fun: None = None, *, max_streams: int = ..., target: Target = ...,
                      min_cost_us: float = ..., fuse_scans: Switch = ...,
                      batch_scans: Switch = ..., batch_branches: Switch = ...,
                      batch_matmuls: Switch = ...,
                      unroll: Unroll = ..., group_collectives: Switch = ...
                      ) -> Callable[[F], F]: ...
def parallel_branches(fun: Any = None, *, max_streams: int = 4, target: Target = "auto",
                      min_cost_us: float = 5.0, fuse_scans: Switch = "auto",
                      batch_scans: Switch = "auto", batch_branches: Switch = "auto",
                      batch_matmuls: Switch = "auto",
                      unroll: Unroll = "auto", group_collectives: Switch = "auto") -> Any:
    """Rewrites ``fun`` so independent work runs on separate CUDA streams.

    The function is traced to a jaxpr (per argument signature, cached), the
    equations that do not depend on each other are grouped into regions, and
    each region of a parallel section is emitted as one non-inlined call with
    ``_xla_stream_annotation`` (stream ids 1..k) and a shared
    ``_scheduling_group_id``. The result computes the same values and composes
    with ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``shard_map``.

    Args:
      fun: the function to rewrite. Its arguments are pytrees of arrays; bind
        anything else with ``functools.partial`` first. When omitted,
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
      unroll: ``"auto"``, an unroll factor >= 1, or None to leave scans alone.
      group_collectives: launch independent collectives together.

    Returns:
      The rewritten function (or a decorator, when ``fun`` is omitted).

    Raises:
      TypeError: ``fun`` is not callable, an option has the wrong type, or an
        argument leaf is not an array (raised at call time, naming it).
      ValueError: an option value is out of range.
      jaxpar.TraceError: ``fun`` cannot be traced (at call time).

    Example:
      >>> @jaxpar.parallel_branches(target="gpu")
      ... def f(a, b):
      ...   return jnp.tanh(a @ a) + jnp.tanh(b @ b)
    """
    options = Options.create(max_streams=max_streams, target=target, min_cost_us=min_cost_us,
                             fuse_scans=fuse_scans, batch_scans=batch_scans,
                             batch_branches=batch_branches, batch_matmuls=batch_matmuls,
                             unroll=unroll,
                             group_collectives=group_collectives)
    if fun is None:
        return lambda f: ParallelBranches(f, options)
    return ParallelBranches(fun, options)


def inspect(fun: Callable[..., Any], **options: Any) -> Callable[..., Plan]:
    """Shows how ``parallel_branches`` would partition ``fun``, like ``jax.make_jaxpr``.

    Args:
      fun: a function, or one already decorated with ``parallel_branches``
        (its options are the starting point; ``options`` override them).
      **options: any option of ``parallel_branches``.

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
    base = fun.options.to_dict() if isinstance(fun, ParallelBranches) else {}
    inner = fun.__wrapped__ if isinstance(fun, ParallelBranches) else fun
    _check_callable(inner, "inspect")
    resolved = Options.create(**{**base, **options})

    @functools.wraps(inner)
    def make_plan(*args: Any, **kwargs: Any) -> Plan:
        sig, _ = signature(inner, args, kwargs, allow_abstract=True)
        target = resolved.resolved_target()
        _, plan, loops = _analyse(inner, sig, resolved, target)
        name = str(getattr(inner, "__qualname__", None) or getattr(inner, "__name__", inner))
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

    attributes = stream_attributes(stream, scheduling_group)

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
            sig, leaves = signature(fun, args, kwargs)
            if sig not in checked:
                if jaxpr_has_placement(trace(fun, sig).jaxpr, {}):
                    raise ValueError(
                        f"on_stream({stream}) for {label!r}: the function already contains "
                        "stream-annotated or placed code (on_stream, parallel_branches output, "
                        "compute_on, xla_metadata_call); XLA cannot compile nested stream calls. "
                        "Annotate the inner parts only, or the whole function only.")
                checked.add(sig)

            def flat_body(*flat: Any) -> Any:
                inner_args, inner_kwargs = jax.tree_util.tree_unflatten(sig.in_tree, flat)
                with _inside_stream_call():
                    return fun(*inner_args, **inner_kwargs)

            return _compat.stream_call(flat_body, attributes)(*leaves)

        return wrapper  # type: ignore[return-value]

    return decorate


