"""Deviceless GPU compiles and their schedules, under their former home.

The compiler lives in ``jaxpar._gpu_compile`` (plugin discovery, meshes, compiling
for a GPU without one) and the schedule reader in ``jaxpar._schedule`` (starts and
dones, streams, overlap). This module re-exports their names for code that imports
them from here; jaxpar itself imports the two modules.

Example::

    from jaxpar._deviceless import compile_for_gpu, parse_schedule
"""

from __future__ import annotations

import importlib
import importlib.metadata  # noqa: F401

from ._gpu_compile import GPU_TARGETS as GPU_TARGETS
from ._gpu_compile import _check_gpu_text as _check_gpu_text
from ._gpu_compile import compile_for_gpu as compile_for_gpu
from ._gpu_compile import gpu_target_config as gpu_target_config
from ._gpu_compile import make_gpu_mesh as make_gpu_mesh
from ._gpu_compile import plugin_status as plugin_status
from ._schedule import _COLLECTIVES as _COLLECTIVES
from ._schedule import AsyncEvent as AsyncEvent
from ._schedule import ComputationSchedule as ComputationSchedule
from ._schedule import Schedule as Schedule
from ._schedule import WhileLoop as WhileLoop
from ._schedule import _attribute_group as _attribute_group
from ._schedule import _backend_config as _backend_config
from ._schedule import _called as _called
from ._schedule import _frontend_attributes as _frontend_attributes
from ._schedule import _Instruction as _Instruction
from ._schedule import _known_trip_count as _known_trip_count
from ._schedule import _Module as _Module
from ._schedule import _refine_async as _refine_async
from ._schedule import _split_computations as _split_computations
from ._schedule import parse_schedule as parse_schedule

__all__ = [
    "GPU_TARGETS",
    "AsyncEvent",
    "ComputationSchedule",
    "Schedule",
    "WhileLoop",
    "compile_for_gpu",
    "gpu_target_config",
    "make_gpu_mesh",
    "parse_schedule",
    "plugin_status",
]
