"""A planned program's time per run on the GPU, in a CUDA-graph mode, before anything is
compiled (``estimate_seconds``; ``estimate_plain_seconds`` for the program as traced):
what ``_plan.modes`` chooses the mode by. Each level is timed by the GPU model of jaxpr
levels (``_model.gpu_levels.LevelModel``: kernels, graphs, loops, the one GPU simulator), which
``passes.unroll_scans`` prices unroll factors by too; here the plan adds what only a plan
knows:

* the regions of the stream sections the plan kept (priced in that mode by
  ``_plan.pricing``) are the model's lanes: a region's node waits only for its inputs and
  its lane, and each region costs the host a start and a done event; a section the
  pricing would not emit (``force_streams``) is taken at its verdict: its regions on the
  main stream, plus its cut's cost;
* each collectives group the plan launches as one NCCL group is launched once.

Example::

    seconds = estimate_seconds(plan, costs, CommandBufferMode.CONCURRENT_REGIONS)
    plain = estimate_plain_seconds(jaxpr, costs, CommandBufferMode.LHS)

Sharp edges:
  * The model's (``_model.gpu_levels``): a model of the compiled program before it is compiled,
    which ``gpu_preview`` judges, and the first GPU run must confirm both.
"""

from __future__ import annotations

from typing import Any

from .._compat import JaxprLike
from .._memo import IdentityMemo
from .._model.cost import CostModel
from .._model.gpu import CommandBufferMode, GpuProfile
from .._model.gpu_levels import LevelModel
from .plans import LevelPlan


def estimate_plain_seconds(jaxpr: JaxprLike, costs: CostModel, mode: CommandBufferMode,
                           memo: IdentityMemo[Any, Any] | None = None,
                           gpu: GpuProfile | None = None) -> float:
    """Estimated seconds per run of ``jaxpr`` as ``jax.jit`` compiles it, in ``mode``
    (``memo``: as for ``estimate_seconds``; ``gpu``: the figures, default the cost
    model's)."""
    return LevelModel(costs, mode, memo=memo, gpu=gpu).jaxpr(jaxpr, top=True).run_seconds


def estimate_seconds(plan: LevelPlan, costs: CostModel, mode: CommandBufferMode,
                     memo: IdentityMemo[Any, Any] | None = None,
                     gpu: GpuProfile | None = None) -> float:
    """Estimated seconds per run of ``plan``'s program compiled in ``mode``.

    A section the GPU pricing would not emit (kept by ``force_streams``) is taken at its
    verdict: its regions run as if on the main stream, plus the cost of its cut.
    ``memo``, one per call, shared by the estimates of its plans in every mode and of the
    plain program (``SharedMemos.mode_estimates``), remembers what they share: each
    equation's kernel time and work, and each nested level's span in each mode. It must
    be used with one cost model only. ``gpu``: the GPU's figures, default the cost
    model's (``pessimistic`` and ``optimistic`` give the ends of their ranges).
    """
    lanes = {i: (s, r) for s, section in enumerate(plan.sections) if section.pays is not False
             for r, region in enumerate(section.regions) for i in region.eqns}
    numbered = {key: n for n, key in enumerate(dict.fromkeys(lanes.values()))}
    model = LevelModel(costs, mode, {i: numbered[key] for i, key in lanes.items()}, memo, gpu)
    forced = sum(section.cost_seconds or 0.0 for section in plan.sections
                 if section.pays is False)
    return model.jaxpr(plan.jaxpr, top=True).run_seconds + forced - _grouped_seconds(
        plan, model.gpu)


def _grouped_seconds(plan: LevelPlan, gpu: GpuProfile) -> float:
    """What launching each collectives group as one NCCL group saves: its members are
    launched once (one call, not one launch each), as the compiled schedule counts them.
    (Their transfers side by side are not credited: the model does not serialise
    collectives in jax.jit's program either.) Each level counts once (a group in a loop
    body, once a run, not once a trip)."""
    return sum(gpu.launch_s * (len(group.eqns) - 1) for level in plan.walk()
               for group in level.collective_groups)
