"""Stage 4 (target ``"gpu"``): whether a section's regions pay on the compiled program.

A thin hook onto ``jaxpar._price.price_section``: it names the dots outside the
section that XLA's ``DotMerger`` could merge with a region's dot (heavy equations
neither in, feeding, nor fed by the section) and hands over the regions.

Example::

    verdict = price_regions(jaxpr, graph, order, regions, costs, mode=CommandBufferMode.LHS,
                            min_seconds=5e-6)
    verdict.pays, verdict.reason
"""

from __future__ import annotations

from typing import Any

from .._cost import CostModel
from .._gpu_model import CommandBufferMode
from .._graph import Graph
from .._price import Verdict, price_section
from .._structure import StructuralKeys
from .heavy import HeavyOrder
from .regions import RegionSet


def price_regions(jaxpr: Any, graph: Graph, order: HeavyOrder, regions: RegionSet,
                  costs: CostModel, *, mode: CommandBufferMode, min_seconds: float,
                  keys: StructuralKeys | None = None) -> Verdict:
    """``price_section`` of ``regions`` (one open jaxpr level's window ``order``)."""
    mask = regions.heavy_mask
    independent_dots = [
        order.heavy[k] for k in range(len(order.heavy))
        if not (1 << k) & mask and not order.heavy_anc[k] & mask
        and not order.heavy_desc[k] & mask]
    return price_section(jaxpr, graph, [list(slot) for slot in regions.slots], costs,
                         mode=mode, min_gain_seconds=min_seconds,
                         independent_dots=independent_dots, keys=keys)
