"""A section's regions are a convex antichain at every level, scan bodies included
(``jaxpar._plan.level``, ``order_units``).

XLA:GPU rejects a scheduling group one of whose members reaches another through work
outside the group ("annotation groups with gaps"). Within one level the planner must never
put two regions of one section on such a path, e.g. a region in a scan body reading, through
main-stream work, what another region of the same section produced; `order_units` refuses
to emit it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jaxpar import _compat
from jaxpar._options import Options
from jaxpar._pipeline import analyse
from jaxpar._plan import RegionPlan, SectionPlan, order_units
from jaxpar._trace import Signature, StaticArgs, abstract, split_arguments


def _reach(graph, start):
    seen, stack = set(), list(start)
    while stack:
        for j in graph.succs[stack.pop()]:
            if j not in seen:
                seen.add(j)
                stack.append(j)
    return seen


def assert_sections_are_antichains(level_plan):
    checked = 0
    for level in level_plan.walk():
        for section in level.sections:
            for region in section.regions:
                reached = _reach(level.graph, region.eqns)
                members = set(region.eqns)
                # Convex: nothing outside the region leads back into it.
                outside = reached - members
                assert not (_reach(level.graph, outside) & members), (level.path, region)
                for other in section.regions:
                    if other is not region:
                        assert not (reached & set(other.eqns)), (level.path, region, other)
                checked += 1
    return checked


def chained_body(w1, w2, w3, a, b, xs):
    """A scan body whose heavy equations are linked through light main-stream work."""
    def step(carry, x):
        c, d = carry
        u = c @ w1               # heavy
        v = jnp.tanh(u) + x      # light, main stream
        w = v @ w2               # heavy, reads u through v
        z = jnp.sin(d @ w3 @ x)  # an independent chain
        return (w, z), u[0]

    return lax.scan(step, (a, b), xs)


def plan_of(fn, *args, **options):
    layout, leaves = split_arguments(fn, args, {}, StaticArgs.resolve(fn, None, None),
                                     allow_abstract=True, api="inspect")
    sig = Signature(layout, tuple(abstract(leaf) for leaf in leaves))
    # The planner's sections are what is checked: forced past the GPU pricing.
    options = Options.create(target="gpu", min_cost_us=0.0, force_streams=True, **options)
    return analyse(fn, sig, options.resolve("gpu")).plan


@pytest.mark.parametrize("unroll", [None, 2])
@pytest.mark.parametrize("fuse_scans", [False, True])
def test_scan_body_sections_are_antichains(unroll, fuse_scans):
    m = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    xs = jax.ShapeDtypeStruct((6, 32, 32), jnp.float32)
    plan = plan_of(chained_body, m, m, m, m, m, xs, unroll=unroll, fuse_scans=fuse_scans)
    assert assert_sections_are_antichains(plan) >= 2  # the body does get regions


def test_order_units_refuses_regions_linked_through_main_stream_work():
    m = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    xs = jax.ShapeDtypeStruct((6, 32, 32), jnp.float32)
    plan = plan_of(chained_body, m, m, m, m, m, xs, unroll=None, fuse_scans=False,
                   batch_matmuls=False)
    body = next(level for level in plan.walk() if level.sections)
    inner, _ = _compat.open_jaxpr(body.jaxpr)
    names = [eqn.primitive.name for eqn in inner.eqns]
    dots = [i for i, name in enumerate(names) if name == "dot_general"]
    u, w = dots[0], dots[1]  # c @ w1, then v @ w2 reading u through tanh/add
    bad = SectionPlan(group=1, regions=(RegionPlan(1, (u,), 0.0), RegionPlan(2, (w,), 0.0)))
    with pytest.raises(RuntimeError, match="depend on each other"):
        order_units(body.graph, [bad])
