"""Every name jaxpar keeps for compatibility, in one table, and the one helper that warns.

A deprecated name keeps working through the minor release that deprecates it and goes in
the next minor release. ``DEPRECATIONS`` has a row per name: what the user writes, what
to write instead, the release that removes it, and whether using it warns (a key of
``Plan.to_dict()`` cannot). ``warn_deprecated`` is the one warning (a
``DeprecationWarning`` naming the replacement), ``deprecated_attributes`` a module's
``__getattr__`` for its deprecated names. ``tests/test_deprecations.py`` fails once
``jaxpar.__version__`` reaches a row's release with the name still there.

The names below were deprecated after 0.1.0, for the next minor release (0.2.0, the
CHANGELOG's "Unreleased"), so they go in 0.3.0.

Example::

    __getattr__ = deprecated_attributes(__name__, {"LoopPass": Pass})   # jaxpar.passes

    @property
    def loops(self):                                                     # Plan.loops
        warn_deprecated("Plan.loops")
        return loop_decisions(self.decisions)

Sharp edges:
  * Importing this module imports nothing else (``import jaxpar`` stays free of jax).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

__all__ = ["DEPRECATIONS", "Deprecation", "deprecated_attributes", "warn_deprecated"]


class Deprecation(NamedTuple):
    """One name kept for compatibility.

    Attributes:
      name: as the user writes it (``"jaxpar.passes.LoopPass"``, ``"Plan.loops"``,
        ``'Plan.to_dict()["loops"]'``).
      use: what to write instead.
      goes_in: the release that removes it.
      warns: whether using it warns (``warn_deprecated``); a dict key cannot.
    """

    name: str
    use: str
    goes_in: str
    warns: bool = True


_NEXT = "0.3.0"  # the minor release after the one that deprecates them

DEPRECATIONS: tuple[Deprecation, ...] = (
    # The names of jaxpar.passes from before the passes outgrew loops.
    Deprecation("jaxpar.passes.LoopPass", "jaxpar.passes.Pass", _NEXT),
    Deprecation("jaxpar.passes.LoopDecision", "jaxpar.passes.PassDecision", _NEXT),
    Deprecation("jaxpar.passes.apply_loop_passes", "jaxpar.passes.apply_passes", _NEXT),
    Deprecation("jaxpar.passes.loop_defaults", "jaxpar.passes.pass_defaults", _NEXT),
    Deprecation("jaxpar.passes.share_common_subexpressions", "jaxpar.passes.share_common",
                _NEXT),
    # The decisions split by kind, and a matmul group's launch depth under its old name.
    Deprecation("Plan.loops", "Plan.decisions (every decision, in the passes' order)", _NEXT),
    Deprecation("Plan.subgraphs", "Plan.decisions (every decision, in the passes' order)",
                _NEXT),
    Deprecation("PassDecision.stage", "PassDecision.depth (the launch depth)", _NEXT),
    Deprecation('Plan.to_dict()["loops"]', 'Plan.to_dict()["decisions"]', _NEXT, warns=False),
    Deprecation('Plan.to_dict()["subgraphs"]', 'Plan.to_dict()["decisions"]', _NEXT,
                warns=False),
    Deprecation('Plan.to_dict()["decisions"][i]["stage"]',
                'Plan.to_dict()["decisions"][i]["depth"]', _NEXT, warns=False),
    # Raised by nothing since 0.1.0: an error tracing the function keeps its own class.
    Deprecation("jaxpar.TraceError",
                "the exception you would catch around jax.jit (jaxpar raises the function's "
                "own, with jaxpar's context as a note)", _NEXT),
)
_BY_NAME = {row.name: row for row in DEPRECATIONS}


def warn_deprecated(name: str, stacklevel: int = 3) -> None:
    """Warns that ``name`` (a row of ``DEPRECATIONS``) is deprecated, naming what to use.

    ``stacklevel`` 3 points at the line that used the name when the caller is the
    property or ``__getattr__`` it reached.

    Raises:
      KeyError: ``name`` has no row (every deprecated name needs one).
    """
    row = _BY_NAME.get(name)
    if row is None or not row.warns:
        raise KeyError(f"{name!r} is not a warning row of jaxpar._deprecations.DEPRECATIONS")
    warnings.warn(f"{name} is deprecated and goes in jaxpar {row.goes_in}; use {row.use}",
                  DeprecationWarning, stacklevel=stacklevel)


def deprecated_attributes(module: str, values: Mapping[str, Any]) -> Callable[[str], Any]:
    """A module's ``__getattr__`` for its deprecated names: ``values[name]``, with the
    warning of the row ``f"{module}.{name}"``; other names raise ``AttributeError``.

    Raises:
      KeyError: a name of ``values`` that has no row.
    """
    missing = [name for name in values if f"{module}.{name}" not in _BY_NAME]
    if missing:
        raise KeyError(f"{module}: {missing} need rows in jaxpar._deprecations.DEPRECATIONS")

    def __getattr__(name: str) -> Any:
        if name not in values:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_deprecated(f"{module}.{name}")
        return values[name]

    return __getattr__
