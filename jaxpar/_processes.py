"""What the processes of one multi-process JAX program must agree on, and the check.

Under ``jax.distributed`` every process traces, plans and compiles its own copy of a
program. A program whose arguments live on several processes' devices runs only if
every process compiled the same collectives in the same order: a host whose
``XLA_FLAGS``, GPU calibration or jaxpar version makes jaxpar plan differently would
otherwise pair different programs on a collective (a hang on NCCL or gloo, or mixed
results). So at the first top-level call of each signature of such a program, the
processes exchange what decides jaxpar's program (its settings, its decisions, the XLA
options it compiles with) and refuse to run, on every process alike, where they differ.

Sharp edges:
  * ``gather`` is a collective: every process must reach it at the same point, as every
    process must reach the program itself. jaxpar enters it only at the first top-level
    call of a signature whose arguments span every process (``span``), and in the
    tuner's first call there; never in ``inspect``, ``tuning()``, ``lower`` or under an
    outer transformation.
  * A computation over the devices of some processes but not all is not checked (the
    exchange needs every process).
  * Only jaxpar's own choices are compared: a user's program that differs between hosts
    (a constant from ``jax.process_index()``) is the user's, as under ``jax.jit``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from . import _compat

LOCAL = "local"  # the arguments live on this process's devices only (or one process)
ALL = "all"  # on every process's devices
SOME = "some"  # on several processes' devices, not all

# What to make equal, by the field that differs.
_REMEDIES = {
    "xla_flags": "start every process with the same XLA_FLAGS",
    "settings": "give every process the same XLA_FLAGS, GPU calibration "
                "(the profile in $JAXPAR_PROFILE_DIR) and options",
    "decisions": "give every process the same XLA_FLAGS, GPU calibration and options",
    "xla_options": "give every process the same XLA_FLAGS and GPU calibration",
    "versions": "install the same jax, jaxlib and jaxpar on every host",
    "schedule": "give every process the same XLA_FLAGS (the CUDA-graph mode decides "
                "which candidates are the same program)",
    "tune": "decorate the function with the same tune= budget on every process",
}


class ProcessMismatchError(RuntimeError):
    """The processes of a multi-process program would compile or run different programs
    for one call of a decorated function (raised on every process alike, before any of
    them runs it, instead of a hang on the first collective)."""


def span(leaves: Sequence[Any]) -> str:
    """Whose devices the concrete array arguments live on: ``LOCAL``, ``ALL`` or
    ``SOME`` (always ``LOCAL`` in a single process)."""
    if jax.process_count() == 1:
        return LOCAL
    processes: set[int] = set()
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and not _compat.is_tracer(leaf):
            processes.update(getattr(device, "process_index", 0)
                             for device in leaf.sharding.device_set)
    if len(processes) <= 1:
        return LOCAL
    return ALL if len(processes) == jax.process_count() else SOME


def gather(text: str) -> list[str]:
    """Every process's ``text``, in process order (a collective: see the module's
    docstring)."""
    from jax.experimental import multihost_utils
    data = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
    lengths = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32)))
    padded = np.zeros(max(int(lengths.max()), 1), np.int32)
    padded[:data.size] = data
    everyone = np.asarray(multihost_utils.process_allgather(padded))
    return [bytes(row[:int(n)].astype(np.uint8).tolist()).decode()
            for row, n in zip(everyone, lengths.reshape(-1), strict=True)]


def agree(what: str, fields: Mapping[str, Any],
          compared: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Every process's ``fields`` (JSON values), in process order; raises on every
    process where those named in ``compared`` (default: all) differ.

    Args:
      what: the call, for the message (``"f at f32[8,4]"``).
      fields: this process's.
      compared: the fields that must be equal; the others are only exchanged.

    Raises:
      ProcessMismatchError: naming each field that differs, the processes' values and
        what to make equal.
    """
    everyone = [json.loads(text) for text in gather(json.dumps(fields, sort_keys=True,
                                                               default=str))]
    names = list(fields) if compared is None else list(compared)
    differ = [name for name in names
              if any(other.get(name) != everyone[0].get(name) for other in everyone)]
    if differ:
        raise ProcessMismatchError(_message(what, everyone, differ))
    return everyone


def _message(what: str, everyone: list[dict[str, Any]], differ: list[str]) -> str:
    lines = [f"jaxpar: the {len(everyone)} processes would run different programs for "
             f"{what}, which would hang or mix programs at the first collective; refused "
             "on every process. What differs:"]
    for name in differ:
        values = [_short(doc.get(name)) for doc in everyone]
        shown = "; ".join(f"process {i}: {value}" for i, value in enumerate(values)
                          if i == 0 or value != values[0])
        lines.append(f"  {name}: {shown} (fix: {_REMEDIES.get(name, 'make it equal')})")
    return "\n".join(lines)


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."
