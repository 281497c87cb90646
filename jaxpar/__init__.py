"""jaxpar: run independent parts of a JAX program concurrently on a GPU.

``parallel_branches`` finds work that does not depend on each other and rewrites the
program so XLA:GPU runs it concurrently (loops fused, batched and unrolled, branches
and matmuls batched, collectives grouped, a CUDA-graph mode chosen per function, CUDA
stream regions where they pay); ``inspect`` shows the plan and why; ``gpu_preview``
compiles both programs for a GPU without one; ``on_stream`` places a function on a
stream by hand.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._api import ParallelBranches as ParallelBranches
    from ._api import XlaOptionsNotAppliedWarning as XlaOptionsNotAppliedWarning
    from ._api import inspect as inspect
    from ._api import on_stream as on_stream
    from ._api import parallel_branches as parallel_branches
    from ._compiled.gpu_compile import make_gpu_mesh as make_gpu_mesh
    from ._compiled.preview import GpuPreview as GpuPreview
    from ._compiled.preview import gpu_preview as gpu_preview
    from ._flags import FlagsNotAppliedWarning as FlagsNotAppliedWarning
    from ._flags import check_flags_applied as check_flags_applied
    from ._flags import flags_as_options as flags_as_options
    from ._flags import xla_flags as xla_flags
    from ._processes import ProcessMismatchError as ProcessMismatchError
    from ._report.plan import Plan as Plan
    from ._report.types import Collective as Collective
    from ._report.types import LeftAlone as LeftAlone
    from ._report.types import Region as Region
    from ._report.types import Section as Section
    from ._trace import StaticArgumentWarning as StaticArgumentWarning
    from ._tune import TuneBudget as TuneBudget
    from ._tune import TuneCacheWarning as TuneCacheWarning
    from ._tune import Tuning as Tuning
    from .passes import PassDecision as PassDecision

# The public names, imported on first use (PEP 562): ``import jaxpar`` and
# ``python -m jaxpar --help`` do not import jax; the first name used does. The one list
# of them: ``__all__`` is built from it.
_LAZY = {
    "ParallelBranches": "._api",
    "XlaOptionsNotAppliedWarning": "._api",
    "inspect": "._api",
    "on_stream": "._api",
    "parallel_branches": "._api",
    "make_gpu_mesh": "._compiled.gpu_compile",
    "GpuPreview": "._compiled.preview",
    "gpu_preview": "._compiled.preview",
    "FlagsNotAppliedWarning": "._flags",
    "check_flags_applied": "._flags",
    "flags_as_options": "._flags",
    "xla_flags": "._flags",
    "ProcessMismatchError": "._processes",
    "Plan": "._report.plan",
    "Collective": "._report.types",
    "LeftAlone": "._report.types",
    "Region": "._report.types",
    "Section": "._report.types",
    "StaticArgumentWarning": "._trace",
    "TuneBudget": "._tune",
    "TuneCacheWarning": "._tune",
    "Tuning": "._tune",
    "PassDecision": ".passes",
}


# Names kept for compatibility (rows of ``_deprecations.DEPRECATIONS``), not in
# ``__all__``: each use warns, naming what to use instead.
_DEPRECATED = {"TraceError": "._trace"}


def __getattr__(name: str) -> object:
    import importlib

    module = _LAZY.get(name)
    if module is None and name in _DEPRECATED:
        from ._deprecations import warn_deprecated

        warn_deprecated(f"jaxpar.{name}")
        return getattr(importlib.import_module(_DEPRECATED[name], __name__), name)
    if module is None:
        raise AttributeError(f"module 'jaxpar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__version__ = "0.1.0"

# The public names: the lazy table's (the ``TYPE_CHECKING`` imports above name the same,
# for type checkers; tests/test_architecture.py keeps the two equal) and the version.
__all__ = sorted([*_LAZY, "__version__"])
