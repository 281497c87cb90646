"""Options of ``parallel_branches`` and ``inspect``, validated in one place.

Example::

    options = Options.create(max_streams=2, target="gpu")
    options.resolved_target()   # "gpu"

Sharp edges:
  * ``"auto"`` for the loop and collective switches means "the default for the
    target", decided when the function is traced, not when it is decorated.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable
from typing import Any, Literal

import jax

Target = Literal["auto", "gpu", "cpu", "tpu"]
Switch = bool | Literal["auto"]
Unroll = int | Literal["auto"] | None

TARGETS = ("auto", "gpu", "cpu", "tpu")
_BACKEND_TARGETS = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "cpu": "cpu", "tpu": "tpu"}


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    """Validated options; hashable, so they can key the rewrite cache."""

    max_streams: int = 4
    target: str = "auto"
    min_cost_us: float = 5.0
    fuse_scans: Switch = "auto"
    batch_scans: Switch = "auto"
    batch_branches: Switch = "auto"
    batch_matmuls: Switch = "auto"
    unroll: Unroll = "auto"
    group_collectives: Switch = "auto"
    force_streams: bool = False

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def create(cls, **kwargs: Any) -> Options:
        check_known(kwargs, cls.names())
        options = cls(**kwargs)
        options.validate()
        return options

    def validate(self) -> None:
        if isinstance(self.max_streams, bool) or not isinstance(self.max_streams, int):
            raise TypeError(f"max_streams must be an int >= 1, got {self.max_streams!r}")
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}; use 1 to keep "
                             "everything on one stream")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(map(repr, TARGETS))}, "
                             f"got {self.target!r}")
        if (isinstance(self.min_cost_us, bool) or not isinstance(self.min_cost_us, (int, float))
                or not math.isfinite(self.min_cost_us) or self.min_cost_us < 0):
            raise ValueError(f"min_cost_us must be a finite number >= 0 (microseconds), "
                             f"got {self.min_cost_us!r}")
        for name in ("fuse_scans", "batch_scans", "batch_branches", "batch_matmuls",
                     "group_collectives"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or value == "auto"):
                raise ValueError(f"{name} must be True, False or 'auto', got {value!r}")
        if not isinstance(self.force_streams, bool):
            raise TypeError(f"force_streams must be True or False, got {self.force_streams!r}")
        unroll = self.unroll
        if not (unroll is None or unroll == "auto"
                or (isinstance(unroll, int) and not isinstance(unroll, bool) and unroll >= 1)):
            raise ValueError(f"unroll must be 'auto', None (leave scans alone) or an int >= 1, "
                             f"got {unroll!r}")

    def resolved_target(self) -> str:
        if self.target != "auto":
            return self.target
        backend = jax.default_backend()
        return _BACKEND_TARGETS.get(backend, "cpu")

    def loop_settings(self, target: str) -> dict[str, Any]:
        """The ``apply_loop_passes`` switches, "auto" resolved for ``target``."""
        from .passes import loop_defaults  # late: the passes import the cost model

        defaults = loop_defaults(target)
        return {"fuse": defaults["fuse"] if self.fuse_scans == "auto" else self.fuse_scans,
                "batch": defaults["batch"] if self.batch_scans == "auto" else self.batch_scans,
                "batch_branches": (defaults["batch_branches"] if self.batch_branches == "auto"
                                   else self.batch_branches),
                "batch_matmuls": (defaults["batch_matmuls"] if self.batch_matmuls == "auto"
                                  else self.batch_matmuls),
                "unroll": defaults["unroll"] if self.unroll == "auto" else self.unroll,
                "share_common": defaults["share_common"]}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'max_streams'?)`` for a misspelled name, or ``""``."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_known(given: Iterable[str], valid: Iterable[str], api: str = "jaxpar") -> None:
    """Raises ``TypeError`` for names in ``given`` that are not in ``valid``, suggesting the
    closest valid name; every entry point that takes options uses it.

    Raises:
      TypeError: an unknown name, e.g. ``unknown jaxpar option 'max_stream' (did you
        mean 'max_streams'?); valid options are: ...``.
    """
    valid = list(valid)
    unknown = sorted(set(given) - set(valid))
    if unknown:
        named = ", ".join(repr(name) + did_you_mean(name, valid) for name in unknown)
        raise TypeError(f"unknown {api} option(s) {named}; valid options are: "
                        f"{', '.join(valid)}")
