"""Public entry points: ``parallel_branches``, ``inspect`` and ``on_stream``.

Example::

    @jaxpar.parallel_branches(target="gpu")
    def two_scans(a, b):
        return lax.scan(step1, a, xs)[0], lax.scan(step2, b, xs)[0]

    print(jaxpar.inspect(two_scans)(a, b))

The analysis of one signature (trace, passes, plan, CUDA-graph mode, emitter) is
``_pipeline.analyse``; ``_dispatch`` keys, caches and dispatches it (``CallState``, the
jits) and emits its ``Prepared`` in each trace (``Prepared.run``); this module is the
public face: ``ParallelBranches`` holds a ``CallState`` (shared with the other decorations
of the same function and options, ``_dispatch.shared``) and hands it to the dispatcher.

Sharp edges:
  * Every call runs under a ``jax.jit`` (eager calls, and calls under grad,
    vmap or jvp, stay compiled; under another jit it is inlined). At the top level
    it is one made per environment (``XLA_FLAGS``, ``JAXPAR_DISABLE``) that takes the
    call's arguments as they are and rewrites inside its trace (``_dispatch.fast``);
    calling the decorated function calls that jit's C++ object, so a compiled signature
    costs a call what ``jax.jit`` costs. The environment is read when a call misses
    (a new signature, a transformation, ``clear_cache()``), not at every call. The function's
    ``trace``/``lower``/``eval_shape`` are ``jax.jit``'s on the decorated
    function, so there every non-static leaf must be an array, in the arguments
    and in the outputs (Equinox's and NNX's splits apply to calls only).
  * Decorating a function again with the same options (a step decorated inline in a
    loop) shares the first decoration's plans and compiled programs, as ``jax.jit(f)``
    twice shares its caches: ``parallel_branches(f)(2); parallel_branches(f)(3)`` traces
    ``f`` once. ``clear_cache()`` of one clears them for all; ``tune=True`` and options
    that cannot be hashed share nothing.
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

import contextlib
import functools
import inspect as pyinspect
import operator
import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, Unpack, overload

import jax

from . import _pipeline
from ._analysis import jaxpr_has_placement
from ._compat import donated_arguments
from ._dispatch import (
    CallTuner,
    JitOptions,
    StagedJits,
    call_state,
    check_measure,
    inside_stream_call,
    lower_with_options,
    options_applied,
    reset,
    stream_call_body,
)
from ._dispatch import XlaOptionsNotAppliedWarning as XlaOptionsNotAppliedWarning
from ._emit import GroupIds, region_call
from ._frameworks import nnx_arguments, refuse_module_as_function
from ._model.gpu import CommandBufferMode, GpuProfile
from ._options import PASS_TABLE, TARGETS, Options, PassRow, Switch, Target, Unroll, WhileUnroll
from ._plan import LevelPlan
from ._report.plan import Plan
from ._spelling import check_known
from ._trace import (
    Scalars,
    Signature,
    StaticArgs,
    abstract,
    check_function,
    function_name,
    short_repr,
    split_arguments,
    split_outputs,
    trace,
)
from ._tune import TuneBudget, Tuning

F = TypeVar("F", bound=Callable[..., Any])


class ParallelBranches:
    """A function rewritten by ``parallel_branches``; call it like the original.

    Like a ``jax.jit`` function it has ``trace``, ``lower`` and ``eval_shape``, and
    ``clear_cache()``; ``__wrapped__`` is the original function.
    """

    # Calling the function calls ``CallState.call``: once the environment's jit is
    # installed (``_dispatch.fast``), that jit's C++ object, reached through C-level
    # lookups only (a property whose getter is an ``attrgetter``), so a compiled call runs
    # no Python of jaxpar's (TPU v5e host: a Python wrapper around the same jit cost 2-3
    # us a call, 2% of a 125 us step's issue time; this, within the noise of jax.jit's).
    if TYPE_CHECKING:
        def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    else:
        __call__ = property(operator.attrgetter("_state.call"))

    def __init__(self, fun: Callable[..., Any], options: Options,
                 static_args: StaticArgs | None = None, *,
                 jit_options: JitOptions | None = None,
                 command_buffers: CommandBufferMode | None = None,
                 gpu: GpuProfile | None = None, tune: TuneBudget | None = None,
                 measure: bool | str = False):
        check_function(fun, "parallel_branches")
        refuse_module_as_function(fun, "parallel_branches")
        functools.update_wrapper(self, fun)
        self.__wrapped__ = fun
        self.options = options
        self.tune = tune
        # The function's plans, memos and jits (``_dispatch``), and the tuner's hook. Its
        # jits reach it through a weak reference: a strong one would make a cycle that
        # keeps the function's closed-over arrays alive after ``del`` until the cyclic
        # collector runs, where ``jax.jit`` frees them at once. ``command_buffers`` and
        # ``gpu``: what to plan for instead of the CUDA-graph mode in XLA_FLAGS and this
        # machine's GPU (gpu_preview plans for the GPU and the mode it judges in).
        # Shared with the other decorations of ``fun`` with the same options, as jax.jit
        # shares its caches (``_dispatch.shared``; not with ``tune``), the measuring
        # tuner's decisions with them.
        self.measure = measure
        self._state = call_state(fun, options, static_args or StaticArgs(),
                                 jit_options or JitOptions(),
                                 {"command_buffers": command_buffers, "gpu": gpu},
                                 None if tune is None else CallTuner(tune), measure)
        self._tuner: CallTuner | None = self._state.tuner  # type: ignore[assignment]
        # ``analyses`` counts from here: a shared state's earlier plans are its twins'.
        self._analyses_before = self._state.analyses
        reset(self._state)
        # The jits of ``trace``, ``lower`` and ``eval_shape``.
        self._stages = StagedJits(self)

    @property
    def static_argnums(self) -> tuple[int, ...]:
        return self._state.static_args.nums

    @property
    def static_argnames(self) -> tuple[str, ...]:
        return self._state.static_args.names

    @property
    def jit_options(self) -> JitOptions:
        """``jax.jit``'s options given to ``parallel_branches`` (donation, shardings,
        ``keep_unused``)."""
        return self._state.jit_options

    @property
    def analyses(self) -> int:
        """How many times a signature was planned since this function was decorated (for
        tests and tooling; settable, as the plain attribute it was). The decorations of
        one function with the same options share their plans: a signature one planned is
        not planned again for the others, and each counts the plans made for all since
        it was made."""
        return self._state.analyses - self._analyses_before

    @analyses.setter
    def analyses(self, count: int) -> None:
        self._analyses_before = self._state.analyses - count

    def __deepcopy__(self, memo: dict[int, Any]) -> ParallelBranches:
        # Copied as itself, as copy.deepcopy copies a function (its plans and compiled
        # programs, caches that hold locks and tracebacks, cannot be copied): a config or
        # model holding it deep-copies as with jax.jit.
        return self

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return functools.partial(self, instance)

    def tuning(self, *args: Any, **kwargs: Any) -> Tuning | None:
        """The tuner's decision for these arguments (``tune=True`` only), as a call makes
        it: stored in this process or on disk, else measured now. With abstract
        arguments (``jax.ShapeDtypeStruct``) only a decision this process made at those
        shapes; None without one, or without ``tune=True``."""
        if self._tuner is None:
            return None
        return self._tuner.tuning_of_call(self._state, args, kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(f).trace(...)`` of the rewritten function: a ``jax.stages.Traced``."""
        return self._stages.get().trace(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(f).lower(...)``: a ``jax.stages.Lowered`` (``.as_text()``, ``.compile()``).

        Its ``compile()`` uses the XLA options the plan chose (``Plan.xla_options``), as a
        call does; options given to ``compile(compiler_options=...)`` are added to them.
        """
        return lower_with_options(self._state, self._stages, args, kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The output shapes and dtypes, as ``jax.ShapeDtypeStruct`` s, without running."""
        return self._stages.get().eval_shape(*args, **kwargs)

    def clear_cache(self) -> None:
        """Forgets every rewrite and compiled program of this function; the next call reads
        the environment (``XLA_FLAGS``, ``JAXPAR_DISABLE``) again. They are those of every
        decoration of the same function with the same options too (which share them, as
        ``jax.jit(f).clear_cache()`` evicts ``f`` from the caches its jits share)."""
        self._state.clear()
        reset(self._state)
        self._stages.clear_cache()

    def __repr__(self) -> str:
        return f"parallel_branches({function_name(getattr(self, '__wrapped__', None))})"

    def _planned_for(self) -> dict[str, Any]:
        """What ``inspect`` of this function plans for instead of the CUDA-graph mode in
        XLA_FLAGS and this machine's GPU (set by ``gpu_preview``)."""
        return dict(self._state.planned_for)

    # For ``gpu_preview`` (``_compiled.preview``), which compiles a fresh function once.

    def _options_applied(self) -> contextlib.AbstractContextManager[None]:
        """Within: this function's traces are compiled with its plan's XLA options by
        whoever traces them, so no ``XlaOptionsNotAppliedWarning`` is due."""
        return options_applied(self._state)

    def _analysed_report(self) -> tuple[Plan, LevelPlan]:
        """The report and plan of the one signature analysed.

        Raises:
          RuntimeError: no signature was analysed, or several.
        """
        return self._state.analysed_report()


_Argnums = int | Sequence[int] | None
_Argnames = str | Iterable[str] | None


@overload
def parallel_branches(fun: F, *, max_streams: int = ..., target: Target = ...,
                      min_cost_us: float = ..., fuse_scans: Switch = ...,
                      batch_scans: Switch = ..., batch_branches: Switch = ...,
                      batch_matmuls: Switch = ...,
                      unroll: Unroll = ..., unroll_while: WhileUnroll = ...,
                      hoist_scan_inputs: Switch = ..., associative_scans: Switch = ...,
                      group_collectives: Switch = ...,
                      force_streams: bool = ..., tune: bool | TuneBudget = ...,
                      measure: bool | str = ...,
                      command_buffers: str = ...,
                      memory: str | float = ...,
                      static_argnums: _Argnums = ..., static_argnames: _Argnames = ...,
                      donate_argnums: _Argnums = ..., donate_argnames: _Argnames = ...,
                      in_shardings: Any = ..., out_shardings: Any = ...,
                      keep_unused: bool = ...,
                      ) -> F: ...
@overload
def parallel_branches(fun: None = None, *, max_streams: int = ..., target: Target = ...,
                      min_cost_us: float = ..., fuse_scans: Switch = ...,
                      batch_scans: Switch = ..., batch_branches: Switch = ...,
                      batch_matmuls: Switch = ...,
                      unroll: Unroll = ..., unroll_while: WhileUnroll = ...,
                      hoist_scan_inputs: Switch = ..., associative_scans: Switch = ...,
                      group_collectives: Switch = ...,
                      force_streams: bool = ..., tune: bool | TuneBudget = ...,
                      measure: bool | str = ...,
                      command_buffers: str = ...,
                      memory: str | float = ...,
                      static_argnums: _Argnums = ..., static_argnames: _Argnames = ...,
                      donate_argnums: _Argnums = ..., donate_argnames: _Argnames = ...,
                      in_shardings: Any = ..., out_shardings: Any = ...,
                      keep_unused: bool = ...,
                      ) -> Callable[[F], F]: ...
def parallel_branches(fun: Any = None, *, max_streams: int = 4, target: Target = "auto",
                      min_cost_us: float = 5.0, fuse_scans: Switch = "auto",
                      batch_scans: Switch = "auto", batch_branches: Switch = "auto",
                      batch_matmuls: Switch = "auto",
                      unroll: Unroll = "auto", unroll_while: WhileUnroll = "auto",
                      hoist_scan_inputs: Switch = "auto", associative_scans: Switch = "auto",
                      group_collectives: Switch = "auto",
                      force_streams: bool = False, tune: bool | TuneBudget = False,
                      measure: bool | str = "auto",
                      command_buffers: str = "auto", memory: str | float = "auto",
                      static_argnums: _Argnums = None, static_argnames: _Argnames = None,
                      donate_argnums: _Argnums = None, donate_argnames: _Argnames = None,
                      in_shardings: Any = None, out_shardings: Any = None,
                      keep_unused: bool = False,
                      **unknown: Any) -> Any:
    """Rewrites ``fun`` for a GPU or a TPU: its independent work batched, fused or run
    concurrently.

    The function is traced to a jaxpr (per argument signature, cached). On target
    ``"gpu"`` independent loops are fused, batched and unrolled, identical branches
    and same-shaped matmuls batched and independent collectives grouped where the
    cost model says it pays; the function is compiled in the CUDA-graph mode its GPU
    model estimates fastest (``command_buffers``); and independent regions that the
    GPU pricing says pay (or every one, with ``force_streams``) are emitted as
    non-inlined calls with ``_xla_stream_annotation`` (stream ids 1..k) and a shared
    ``_scheduling_group_id``. On target ``"tpu"`` independent scans with identical
    bodies are batched and small loops read by blocks; on ``"cpu"`` the program is
    re-emitted unchanged.
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
      batch_matmuls: run same-shaped matmuls and convolutions at one launch depth in
        different independent members (the halves of a fused scan body, experts,
        towers) as one batched op, where the target's cost model says it pays.
      unroll: ``"auto"`` (the target's default: ``"cost"`` on GPUs and TPUs, None on CPUs),
        ``"cost"`` (a factor per scan from the target's cost model), an unroll factor
        >= 1, or None to leave scans alone.
      unroll_while: an int k >= 2 runs the body of each ``while`` loop whose trip count
        is data-dependent (ODE solvers, Newton iterations, NUTS) k times per trip of the
        loop, each run after the first guarded by the loop's condition (its result
        selected where the condition holds; under ``lax.cond`` where the body holds a
        while loop or a host callback), so the final carry is the loop's own for every
        trip count; None or ``"auto"`` (default:
        off on every target) leaves while loops alone. For the device to weigh against
        one body per trip (``measure``); loops with effects, loops inside another
        while loop, loops under vmap whose body holds a while loop or a host callback,
        and bodies of more than 512 equations for k copies are left alone.
      hoist_scan_inputs: run the work of a scan's body that reads no carry (an RNN's
        input projections, a sampler's random draws from the step's key) for all steps
        at once before the loop, which then reads the results (``True``); ``"auto"``
        (default) leaves it off on every target, and a TPU measures it (``measure``).
        Effects, conditionals, collectives and stacks over 1 GiB stay in the loop.
      associative_scans: run a scan whose carries each follow a linear recurrence
        (``c = a * c + b`` with ``a``, ``b`` reading no carry: a moving average, a
        discounted return or GAE, a Mamba layer's state) as
        ``lax.associative_scan``, about ``2 log2 L`` rounds instead of ``L`` trips
        (``True``); values agree within rounding. ``"auto"`` (default) leaves it off on
        every target, and a TPU measures it (``measure``).
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
        it reuses a decision made at the same shapes, else runs the plan. The first
        call waits for the measuring; ``measure`` measures without waiting.
      measure: let the device decide, at the cost of ``jax.jit``'s first call
        (``_dispatch.measuring``): the first top-level call of a signature runs
        ``jax.jit``'s program while jaxpar's candidates (its plan, rolled, read by
        blocks, ``lax.scan``'s unroll 8 and 16, batched or not) compile on a background
        thread; a later call times them against ``jax.jit``'s program and the fastest
        runs from then on (a rewrite must win by 3%), remembered on disk (as ``tune``)
        so a later process measures nothing. ``"auto"`` (default): on where the target is
        the accelerator the call runs on (a GPU or TPU target on its device), off on a
        CPU; True: on everywhere (also on a CPU); False: the model's plan alone, the
        same program from the first call (bit-stable runs). ``JAXPAR_MEASURE=0`` turns
        it off process-wide. Switching programs between calls changes rounding only.
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
        of the plain program's footprint or a floor of 1/4096 of the device's memory
        more, whichever is more (the floor: the GPU profile's memory on target
        ``"gpu"``, a TPU v5e's 16 GiB on ``"tpu"``, a 16 GiB host on ``"cpu"``; at
        least 1 MiB); ``"any"``; or a number of bytes. Rewrites and modes beyond it are
        left out, and ``inspect`` says which.
      static_argnums: positional arguments that are static (hashable Python
        values that key the cache and may steer tracing), as in ``jax.jit``;
        negative numbers count from the end.
      static_argnames: the same by name; numbers and names complete each other
        as in ``jax.jit``.
      donate_argnums, donate_argnames, in_shardings, out_shardings, keep_unused:
        ``jax.jit``'s, with its meaning and checks, so that replacing ``jax.jit`` by
        ``parallel_branches`` keeps donation and shardings: a donated argument's buffers
        are given to the call (deleted after it, as under ``jax.jit``), shardings are
        those of the compiled program. Under an outer ``jit``, ``grad`` or ``vmap``
        donation does nothing (as for a ``jax.jit`` inside another) and shardings become
        sharding constraints. Shardings need calls whose arguments are arrays and
        containers of them (not static values jaxpar splits off, nor NNX objects).

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
    given = locals()  # the parameters: Options' fields by name (a test keeps them equal)
    _refuse_outer_jit_options(unknown, "parallel_branches")
    check_known(unknown, (*Options.names(), "tune", "measure", *CALL_OPTIONS, *JIT_OPTIONS))
    check_measure(measure)
    if not isinstance(tune, (bool, TuneBudget)):
        raise TypeError(f"tune must be True, False or a jaxpar.TuneBudget, got {tune!r}")
    # A pass table option the written signature lacks comes in ``unknown`` (the runtime
    # signature, ``__signature__``, names it).
    options = Options.create(**{name: given[name] if name in given else unknown[name]
                                for name in Options.names() if name in given or name in unknown})

    def decorate(f: Any) -> ParallelBranches:
        check_function(f, "parallel_branches")
        statics = StaticArgs.resolve(f, static_argnums, static_argnames)
        return ParallelBranches(f, options, statics,
                                jit_options=jit_options_of(
                                    f, statics, donate_argnums=donate_argnums,
                                    donate_argnames=donate_argnames,
                                    in_shardings=in_shardings, out_shardings=out_shardings,
                                    keep_unused=keep_unused),
                                tune=tune if isinstance(tune, TuneBudget)
                                else TuneBudget() if tune else None, measure=measure)

    return decorate if fun is None else decorate(fun)


def table_options(written: pyinspect.Signature) -> tuple[PassRow, ...]:
    """The rows of the pass table whose option the ``written`` signature lacks."""
    return tuple(row for row in PASS_TABLE
                 if row.option is not None and row.option not in written.parameters)


def option_entry(row: PassRow) -> str:
    """The ``Args:`` entry of ``row``'s option, from the row (its summary, its kind's
    values, the targets whose rows turn it on)."""
    on = [target.name for target in TARGETS
          if row.kind.is_on(target.default(str(row.option), row.kind))]
    auto = f"on for {', '.join(on)}, off elsewhere" if on else "off on every target"
    return textwrap.fill(f"{row.option}: {row.summary} (the pass ``{row.name}``): "
                         f'{row.kind.values}; ``"auto"``: {auto}.', width=88,
                         initial_indent=" " * 6, subsequent_indent=" " * 8)


def with_table_options(function: F) -> F:
    """``function`` with a keyword (``__signature__``) and an ``Args:`` entry (``__doc__``)
    for each pass table option its written signature lacks, after the last it has: a
    pass added to the table is an option of ``parallel_branches`` at runtime (the
    written signatures, for type checkers, are checked by
    ``tests/test_api_signatures.py``)."""
    written = pyinspect.signature(function)
    missing = table_options(written)
    if not missing:
        return function
    parameters = list(written.parameters.values())
    # Where Options has them: after min_cost_us and the table's options written out.
    options = {"min_cost_us", *(row.option for row in PASS_TABLE)}
    at = 1 + max(i for i, p in enumerate(parameters) if p.name in options)
    added = [pyinspect.Parameter(str(row.option), pyinspect.Parameter.KEYWORD_ONLY,
                                 default="auto", annotation=row.kind.annotation)
             for row in missing]
    function.__signature__ = written.replace(  # type: ignore[attr-defined]
        parameters=[*parameters[:at], *added, *parameters[at:]])
    doc = function.__doc__ or ""
    entries = "".join(option_entry(row) + "\n" for row in missing)
    following = f"\n      {parameters[at].name}:"
    function.__doc__ = (doc.replace(following, "\n" + entries.rstrip("\n") + following, 1)
                        if following in doc else doc.replace("\n    Returns:",
                                                             "\n" + entries + "\n    Returns:"))
    return function


with_table_options(parallel_branches)


# Options of a call rather than of the plan, as jax.jit takes them: accepted by
# parallel_branches and inspect (their signatures name each; a test keeps them equal).
CALL_OPTIONS = ("static_argnums", "static_argnames")

# jax.jit's options parallel_branches takes as jax.jit does (``JitOptions``); inspect
# takes none of them (they do not change the plan).
JIT_OPTIONS = ("donate_argnums", "donate_argnames", "in_shardings", "out_shardings",
                "keep_unused")
# jax.jit's options it does not take: deprecated in jax (device, backend).
_OUTER_JIT_OPTIONS = ("device", "backend")


def _refuse_outer_jit_options(given: dict[str, Any], api: str) -> None:
    named = [name for name in _OUTER_JIT_OPTIONS if name in given]
    if named:
        settings = ", ".join(f"{name}={given[name]!r}" for name in named)
        raise TypeError(
            f"{api} takes no {', '.join(named)} (jax deprecates them): place the arguments "
            "on the device with jax.device_put, or give in_shardings; or jit around the "
            f"decorated function:\n    step = jax.jit(jaxpar.parallel_branches(f), {settings})")
    if api == "inspect":
        named = [name for name in JIT_OPTIONS if name in given]
        if named:
            raise TypeError(
                f"inspect takes no {', '.join(named)}: they do not change jaxpar's plan. Give "
                "them to parallel_branches (as to jax.jit); inspect(f) of such a function "
                "plans as its calls do.")
        named = [name for name in ("measure", "tune") if name in given]
        settings = ", ".join(f"{name}={given[name]!r}" for name in named)
        if named and not any(given[name] for name in named):
            raise TypeError(
                f"inspect takes no {settings}: it plans without running the function, "
                f"which is what {settings} asks; leave {'it' if len(named) == 1 else 'them'} "
                "out.")
        if named:
            raise TypeError(
                f"inspect takes no {', '.join(named)}: it plans without running the function. "
                f"Give {'it' if len(named) == 1 else 'them'} to parallel_branches and inspect "
                "the decorated function after a call; its Plan.tuning says what was "
                "measured:\n"
                f"    step = jaxpar.parallel_branches(f, {settings})\n    step(*args)\n"
                "    print(jaxpar.inspect(step)(*args))")


def jit_options_of(fun: Callable[..., Any], statics: StaticArgs, **given: Any) -> JitOptions:
    """``jax.jit``'s options as ``jax.jit`` checks and completes them (donated numbers and
    names from each other, by ``fun``'s signature).

    Raises:
      TypeError, ValueError: as ``jax.jit`` raises them for these options.
    """
    if given["keep_unused"] not in (True, False):
        raise TypeError(f"keep_unused must be True or False, got {given['keep_unused']!r}")
    chosen = {k: v for k, v in given.items() if v is not None and v is not False}
    if not chosen:
        return JitOptions()
    nums, names = donated_arguments(fun, static_argnums=statics.nums,
                                    static_argnames=statics.names, **chosen)
    return JitOptions(donate_argnums=nums, donate_argnames=names,
                      in_shardings=given["in_shardings"], out_shardings=given["out_shardings"],
                      keep_unused=bool(given["keep_unused"]))


class InspectOptions(TypedDict, total=False):
    """The keywords of ``inspect``: ``Options``' fields and ``CALL_OPTIONS`` (a test keeps
    them equal), typed as ``parallel_branches`` types them."""

    max_streams: int
    target: Target
    min_cost_us: float
    fuse_scans: Switch
    batch_scans: Switch
    batch_branches: Switch
    batch_matmuls: Switch
    unroll: Unroll
    unroll_while: WhileUnroll
    hoist_scan_inputs: Switch
    associative_scans: Switch
    group_collectives: Switch
    force_streams: bool
    command_buffers: str
    memory: str | float
    static_argnums: _Argnums
    static_argnames: _Argnames


def inspect(fun: Callable[..., Any], *args: Any, **options: Unpack[InspectOptions]
            ) -> Callable[..., Plan]:
    """Shows how ``parallel_branches`` would partition ``fun``, like ``jax.make_jaxpr``.

    Args:
      fun: a function, or one already decorated with ``parallel_branches``
        (its options and static arguments are the starting point; ``options``
        override them).
      **options: any option of ``parallel_branches``, including
        ``static_argnums`` and ``static_argnames``; not ``measure`` or ``tune``
        (inspect runs nothing: inspect a function decorated with them instead), nor
        ``jax.jit``'s options.

    Returns:
      A function taking ``fun``'s arguments (arrays or ``jax.ShapeDtypeStruct``)
      and returning a ``jaxpar.Plan``: the parallel sections with their
      regions, stream ids, equation counts, main primitives, estimated cost and
      source lines, and what was left alone and why. For a function decorated
      with ``tune=True`` or measuring on (and no ``options`` here), ``Plan.tuning`` is its
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
    given: dict[str, Any] = dict(options)
    _refuse_outer_jit_options(given, "inspect")
    check_known(given, (*Options.names(), *CALL_OPTIONS))
    planned_for: dict[str, Any] = {}
    tuned = fun if isinstance(fun, ParallelBranches) and (fun.tune is not None or fun.measure) \
        and not given \
        else None
    if isinstance(fun, ParallelBranches):
        base, inner = fun.options.to_dict(), fun.__wrapped__
        given_nums, given_names = fun.static_argnums or None, fun.static_argnames or None
        planned_for = fun._planned_for()
    else:
        base, inner, given_nums, given_names = {}, fun, None, None
    check_function(inner, "inspect")
    refuse_module_as_function(inner, "inspect")
    statics = StaticArgs.resolve(inner, given.pop("static_argnums", given_nums),
                                 given.pop("static_argnames", given_names))
    resolved = Options.create(**{**base, **given})

    @functools.wraps(inner)
    def make_plan(*args: Any, **kwargs: Any) -> Plan:
        settings = resolved.resolve(**planned_for)
        with nnx_arguments(object(), inner, args, kwargs) as (traced_fun, pure_args,
                                                              pure_kwargs, _):
            layout, leaves = split_arguments(traced_fun, pure_args, pure_kwargs, statics,
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
                with stream_call_body():
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


