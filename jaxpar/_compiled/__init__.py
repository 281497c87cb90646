"""The compiled-HLO wing: what XLA:GPU makes of a program, seen without a GPU.

The other wing (trace -> graph -> passes -> plan -> emit -> report) decides from
jaxprs and a cost model; this one checks those decisions against XLA's own output.
Four stages, each importing only the ones before it:

* ``gpu_compile``: compile a JAX function for an NVIDIA GPU on a machine without
  one (the CUDA PJRT plugin and a topology file per card);
* ``schedule``: read the scheduled HLO (streams, asynchronous starts and dones,
  while loops and their trip counts);
* ``estimate``: replay that schedule on the one GPU model (launches, graph nodes,
  overlap, time) and judge two programs against each other (``verdict``); its parts are
  ``kernels`` (each kernel's work), ``thunks`` (the thunk sequence and its CUDA graphs)
  and ``replay`` (the host, streams and device running them);
* ``preview``: ``jaxpar.gpu_preview``, plain ``jax.jit`` against jaxpar, both compiled.

Example::

    from jaxpar._compiled import compile_for_gpu, parse_schedule

    text = compile_for_gpu(lambda a: jnp.tanh(a @ a), x, gpu="h200")
    parse_schedule(text).kernels

Sharp edges:
  * Compiling needs the CUDA PJRT plugin at exactly jaxlib's version
    (``plugin_status()`` says which ``pip install`` line fixes it).
"""

from __future__ import annotations

from .gpu_compile import GPU_TARGETS as GPU_TARGETS
from .gpu_compile import compile_for_gpu as compile_for_gpu
from .gpu_compile import gpu_target_config as gpu_target_config
from .gpu_compile import make_gpu_mesh as make_gpu_mesh
from .gpu_compile import plugin_status as plugin_status
from .schedule import Schedule as Schedule
from .schedule import parse_schedule as parse_schedule
