"""jaxpar: run independent parts of a JAX program concurrently on a GPU.

``parallel_branches`` finds work that does not depend on each other and tags
it with CUDA stream ids through XLA frontend attributes; ``inspect`` shows the
partition; ``on_stream`` places a function on a stream by hand.
"""

from ._api import ParallelBranches as ParallelBranches
from ._api import inspect as inspect
from ._api import on_stream as on_stream
from ._api import parallel_branches as parallel_branches
from ._inspect import LeftAlone as LeftAlone
from ._inspect import Plan as Plan
from ._inspect import Region as Region
from ._inspect import Section as Section
from ._trace import TraceError as TraceError
from .passes import LoopDecision as LoopDecision

__version__ = "0.1.0"

__all__ = [
    "LeftAlone",
    "LoopDecision",
    "ParallelBranches",
    "Plan",
    "Region",
    "Section",
    "TraceError",
    "__version__",
    "inspect",
    "on_stream",
    "parallel_branches",
]
