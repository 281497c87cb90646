"""``XLA_FLAGS``: the one module that reads it, and the flags that make jaxpar effective.

jaxpar only *annotates* programs; some XLA passes and limits decide whether the
annotations pay off. ``xla_flags`` lists the flags to put in ``XLA_FLAGS``
before JAX starts its backend; ``check_flags_applied`` warns (or raises) when
that moment has passed. ``async_compute_limit`` and ``command_buffer_mode`` read
what the planner needs from ``XLA_FLAGS``, and ``command_buffer_flags`` spells a
CUDA-graph mode as flags; nothing else in jaxpar touches ``XLA_FLAGS``.

Example::

    import os
    from jaxpar import xla_flags, check_flags_applied
    flags = xla_flags(async_compute_limit=4)
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags])
    import jax; jax.devices()
    check_flags_applied(flags)   # silent: set before the backend started

Sharp edges:
  * XLA reads ``XLA_FLAGS`` once, when the first backend starts. Setting it
    later changes nothing; per-compile ``compiler_options`` (``flags_as_options``)
    work at any time.
  * Seen on jaxlib 0.10.2 (deviceless H200 compile): the collective
    multi-streaming flags *together with* a ``_collectives_group`` call abort
    the compile with ``NOT_FOUND: No ExecutionStreamId found for
    %collective-permute-start``. jaxpar's collective grouping therefore leaves
    them off by default (``multi_stream_collectives=False``).
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from . import _compat
from ._model.gpu import CommandBufferMode

__all__ = ["FlagsNotAppliedWarning", "async_compute_limit", "check_flags_applied",
           "command_buffer_flags", "command_buffer_mode", "command_buffer_mode_set",
           "command_buffer_options", "environment_reader", "flags_as_options", "xla_flags",
           "xla_flags_text"]

_VARIABLE = "XLA_FLAGS"


def xla_flags_text() -> str:
    """The process's ``XLA_FLAGS`` (empty when unset)."""
    return os.environ.get(_VARIABLE, "")


def environment_reader(names: Sequence[str]) -> Callable[[], tuple[Any, ...]]:
    """A function returning the values of ``XLA_FLAGS`` and of the environment variables
    ``names`` (None where unset), to compare with an earlier reading: a decorated
    function reads its environment at every call, so that its settings follow
    ``XLA_FLAGS``.

    ``os.environ.get`` encodes the name and decodes the value at every read (0.7 us
    each); this reads the encoded mapping behind ``os.environ`` (CPython's ``_data``,
    which ``os.environ[...] = ...`` and ``del`` keep current) where it is a dict, and
    ``os.environ.get`` elsewhere. The values are for comparing, not for reading."""
    every = (_VARIABLE, *names)
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and callable(encode):
        get = data.get
        if len(every) == 3:  # what calls read: spelt out, twice as fast as map
            first, second, third = (encode(name) for name in every)
            return lambda: (get(first), get(second), get(third))
        keys = tuple(encode(name) for name in every)
        return lambda: tuple(map(get, keys))
    return lambda: tuple(map(os.environ.get, every))


def async_compute_limit(flags: str | None = None) -> int:
    """XLA's cap on annotated async calls in flight (default 2), from ``XLA_FLAGS``."""
    return _async_compute_limit(xla_flags_text() if flags is None else flags)


# The readers below run on every call of a decorated function (its settings follow
# XLA_FLAGS): each text is parsed once.
@functools.lru_cache(maxsize=64)
def _async_compute_limit(text: str) -> int:
    match = re.search(r"--xla_gpu_experimental_parallel_async_compute_limit=(\d+)", text)
    return max(int(match.group(1)), 1) if match else 2


def command_buffer_mode(flags: str | None = None) -> CommandBufferMode:
    """How XLA:GPU will run captured command buffers, from ``XLA_FLAGS`` (or ``flags``).

    ``OFF`` for ``--xla_gpu_enable_command_buffer=`` (empty), else the
    ``--xla_gpu_command_buffer_scheduling_mode`` (or the older
    ``--xla_gpu_graph_enable_concurrent_region``); ``LHS``, XLA's default, otherwise.
    """
    return _command_buffer_mode(xla_flags_text() if flags is None else flags)


@functools.lru_cache(maxsize=64)
def _command_buffer_mode(text: str) -> CommandBufferMode:
    enabled = re.findall(r"--xla_gpu_enable_command_buffer=(\S*)", text)
    if enabled and enabled[-1].strip("'\"") == "":
        return CommandBufferMode.OFF
    mode = re.findall(r"--xla_gpu_command_buffer_scheduling_mode=(\w+)", text)
    if mode:
        return CommandBufferMode.from_xla_scheduling_mode(mode[-1])
    legacy = re.findall(r"--xla_gpu_graph_enable_concurrent_region=(\w+)", text)
    if legacy:
        return (CommandBufferMode.CONCURRENT if legacy[-1].lower() in ("true", "1")
                else CommandBufferMode.SERIALIZE)
    return CommandBufferMode.LHS


def command_buffer_mode_set(flags: str | None = None) -> bool:
    """Whether ``XLA_FLAGS`` (or ``flags``) sets the CUDA-graph mode explicitly: command
    buffers on or off, their scheduling mode, or the older concurrent-region switch."""
    return _command_buffer_mode_set(xla_flags_text() if flags is None else flags)


@functools.lru_cache(maxsize=64)
def _command_buffer_mode_set(text: str) -> bool:
    return re.search(r"--xla_gpu_(enable_command_buffer|command_buffer_scheduling_mode|"
                     r"graph_enable_concurrent_region)=", text) is not None


def command_buffer_options(mode: CommandBufferMode | str) -> dict[str, str]:
    """The per-compile ``compiler_options`` that select CUDA-graph ``mode`` for one
    function (``jax.jit(f, compiler_options=...)``), whatever ``XLA_FLAGS`` says.

    Accepted by jaxlib 0.10.2 to 0.12 (a wrong value is refused by XLA:
    ``'BOGUS' is not a valid enum value``).

    Raises:
      ValueError: ``mode`` is not a mode.
    """
    mode = CommandBufferMode.parse(mode, "mode")
    if mode is CommandBufferMode.OFF:
        return {"xla_gpu_enable_command_buffer": ""}
    return {"xla_gpu_command_buffer_scheduling_mode": str(mode.xla_scheduling_mode)}


def command_buffer_flags(mode: CommandBufferMode | str) -> list[str]:
    """The ``XLA_FLAGS`` entries that select CUDA-graph ``mode`` (none for XLA's default).

    Raises:
      ValueError: ``mode`` is not a mode.
    """
    mode = CommandBufferMode.parse(mode, "mode")
    if mode is CommandBufferMode.OFF:
        return ["--xla_gpu_enable_command_buffer="]
    if mode is CommandBufferMode.LHS:
        return []
    return [f"--xla_gpu_command_buffer_scheduling_mode={mode.xla_scheduling_mode}"]


class _SectionFields(Protocol):
    @property
    def regions(self) -> Sequence[object]: ...


class PlanFields(Protocol):
    """What ``xla_flags`` reads of a ``jaxpar.Plan`` (defined further down the pipeline)."""

    @property
    def collectives(self) -> Sequence[object]: ...

    @property
    def sections(self) -> Sequence[_SectionFields]: ...


class FlagsNotAppliedWarning(UserWarning):
    """XLA flags were requested after the JAX backend started."""


def xla_flags(plan: PlanFields | None = None, *, collectives: bool | None = None,
              multi_stream_collectives: bool = False, collective_overlap_limit: int = 2,
              async_compute_limit: int | None = None,
              command_buffers: bool = False) -> list[str]:
    """The ``XLA_FLAGS`` entries that make jaxpar's output effective.

    Pass the ``Plan`` of your program (``jaxpar.inspect(f)(*args)``) to get the
    flags for what it uses: the DotMerger threshold only when it has
    collectives, and an async compute limit covering its widest section.
    Explicit arguments override what the plan implies.

    Args:
      plan: the program's plan; None gives the defaults below.
      collectives: add ``--xla_gpu_dot_merger_threshold_mb=0`` (default: when
        ``plan`` has collectives, or always without a plan). XLA's
        ``DotMerger`` merges the per-step matmuls of a hand-written collective
        matmul (they share the weight block) into one GEMM that must wait for
        every transfer, erasing all communication/compute overlap (seen in a
        deviceless H200 compile of ``examples/collective_matmul.py``).
      multi_stream_collectives: add
        ``--xla_gpu_experimental_enable_collective_multi_streaming=true`` and
        ``--xla_gpu_experimental_parallel_collective_overlap_limit=N``
        (defaults false / 1): lets XLA keep up to N asynchronous collectives in
        flight on separate streams (jax >= 0.10). Off by default: it conflicts
        with ``_collectives_group`` calls (see the module's sharp edges), and
        on its own did not put two permutes in flight in our compiles.
      collective_overlap_limit: the N above.
      async_compute_limit: ``--xla_gpu_experimental_parallel_async_compute_limit``
        (XLA default 2): how many stream-annotated calls may be in flight; set
        it to jaxpar's ``max_streams`` to use more than two streams (default:
        the plan's widest section, at least 2).
      command_buffers: add ``--xla_gpu_enable_command_buffer=+WHILE`` so loops
        become CUDA-graph conditional nodes (no per-iteration host launches;
        needs CUDA >= 12.3).

    Returns:
      Flags as ``--name=value`` strings, in a fixed order.

    Raises:
      TypeError: ``plan`` is not a ``Plan``; a switch that is not a bool or a limit that
        is not an int.
      ValueError: a limit below 1.
    """
    # The Plan type lives further down the pipeline (this module is read by the planner):
    # checked by what xla_flags reads of it.
    if plan is not None and not all(hasattr(plan, name) for name in ("collectives",
                                                                      "sections")):
        raise TypeError(f"xla_flags(plan=...) takes the Plan of your program "
                        f"(`jaxpar.inspect(f)(*args)`) or None, got a {type(plan).__name__}")
    for name, value in (("collectives", collectives),
                        ("multi_stream_collectives", multi_stream_collectives),
                        ("command_buffers", command_buffers)):
        if not (isinstance(value, bool) or (value is None and name == "collectives")):
            hint = (" (add the +WHILE flag); a function's CUDA-graph mode is "
                    "parallel_branches(command_buffers=...)" if name == "command_buffers" else "")
            raise TypeError(f"xla_flags: {name} must be True or False{hint}, got {value!r}")
    for name, limit in (("collective_overlap_limit", collective_overlap_limit),
                        ("async_compute_limit", async_compute_limit)):
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise TypeError(f"xla_flags: {name} must be an int >= 1, got {limit!r}")
    if collectives is None:
        collectives = plan is None or bool(plan.collectives)
    if async_compute_limit is None:
        widest = max((len(section.regions) for section in plan.sections), default=0) if plan else 0
        async_compute_limit = max(2, widest)
    if collective_overlap_limit < 1 or async_compute_limit < 1:
        raise ValueError("collective_overlap_limit and async_compute_limit must be >= 1, got "
                         f"{collective_overlap_limit} and {async_compute_limit}")
    flags = [f"--xla_gpu_experimental_parallel_async_compute_limit={async_compute_limit}"]
    if collectives:
        flags.append("--xla_gpu_dot_merger_threshold_mb=0")
    if multi_stream_collectives:
        flags += ["--xla_gpu_experimental_enable_collective_multi_streaming=true",
                  f"--xla_gpu_experimental_parallel_collective_overlap_limit="
                  f"{collective_overlap_limit}"]
    if command_buffers:
        flags.append("--xla_gpu_enable_command_buffer=+WHILE")
    return flags


def _flag_list(flags: Sequence[str], api: str) -> Sequence[str]:
    """``flags``, refused when it is one string: iterating it would read each character
    as a flag (``XLA_FLAGS``'s text, say, where its ``.split()`` was meant)."""
    if isinstance(flags, str):
        raise TypeError(f"{api} takes a list of '--name=value' flags (as xla_flags returns), "
                        f"got the string {flags!r}; pass flags.split() for a space-separated "
                        "string such as XLA_FLAGS")
    return flags


def flags_as_options(flags: Sequence[str]) -> dict[str, bool | int | str]:
    """``--name=value`` flags as ``compiler_options`` for ``Lowered.compile``.

    Raises:
      TypeError: ``flags`` is one string, not a list of flags.
    """
    options: dict[str, bool | int | str] = {}
    for flag in _flag_list(flags, "flags_as_options"):
        name, _, value = flag.removeprefix("--").partition("=")
        options[name] = (True if value == "true" else False if value == "false"
                         else int(value) if value.lstrip("-").isdigit() else value)
    return options


def _flag_names(text: str) -> dict[str, str]:
    names = {}
    for item in text.split():
        name, _, value = item.removeprefix("--").partition("=")
        names[name] = value
    return names


def check_flags_applied(flags: Sequence[str], *, error: bool = False) -> bool:
    """Whether ``flags`` are in ``XLA_FLAGS`` and were there when JAX started.

    Warns with ``FlagsNotAppliedWarning`` (or raises ``RuntimeError`` when
    ``error``) when a flag is missing from ``XLA_FLAGS`` or the backend has
    already started, since XLA reads ``XLA_FLAGS`` only at start-up. (If the
    backend started and the flags are present we assume they were set in time:
    nothing public tells otherwise.)

    Args:
      flags: flags from ``xla_flags``.
      error: raise instead of warning.

    Returns:
      True when every flag is set in ``XLA_FLAGS``.

    Raises:
      TypeError: ``flags`` is one string, not a list of flags.
      RuntimeError: ``error`` is set and a flag is not applied.
    """
    present = _flag_names(xla_flags_text())
    wanted = _flag_names(" ".join(_flag_list(flags, "check_flags_applied")))
    missing = [f"--{n}={v}" for n, v in wanted.items() if present.get(n) != v]
    if not missing:
        return True
    started = _compat.backends_initialized()
    message = (f"XLA flags {' '.join(missing)} are not in XLA_FLAGS"
               + (" and the JAX backend has already started, so setting them now has no "
                  "effect; set XLA_FLAGS before the first JAX computation, or pass "
                  "compiler_options=flags_as_options(flags) to .compile()" if started else
                  "; add them before the first JAX computation"))
    if error:
        raise RuntimeError(message)
    warnings.warn(message, FlagsNotAppliedWarning, stacklevel=2)
    return False
