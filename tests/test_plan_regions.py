"""``jaxpar._plan.regions``: regions (hull, private producers and consumers, absorption up to
the window's end), and that every planning phase's value, regions last, is frozen."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxpar._plan.heavy import heavy_order
from jaxpar._plan.plans import REASON_EFFECTFUL
from jaxpar._plan.regions import build_regions, convex_hull
from jaxpar._plan.sections import choose_sections, decompose
from jaxpar._program.graph import build_graph


def open_level(fn, *shapes):
    closed = jax.make_jaxpr(fn)(*[jnp.ones(s, jnp.float32) for s in shapes])
    return closed.jaxpr


def indices(jaxpr, name):
    return [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == name]


# ------------------------------------------------------------------ regions


def two_towers(a, b):
    x = jnp.tanh(a.T @ a)
    y = jnp.tanh(b @ b)
    return x + y


def test_regions_take_hull_private_producers_and_consumers():
    jaxpr = open_level(two_towers, (8, 8), (8, 8))
    graph = build_graph(jaxpr)
    dots = indices(jaxpr, "dot_general")
    transpose = indices(jaxpr, "transpose")[0]
    tanhs = indices(jaxpr, "tanh")
    add = indices(jaxpr, "add")[0]
    seconds = [1.0] * len(jaxpr.eqns)
    order = heavy_order(graph, dots, seconds, min_seconds=0.5, end=graph.size)
    found = build_regions(order, graph, seconds, {}, ((0,), (1,)), taken={},
                          section_index=0, streams=2, min_seconds=0.5)
    assert found.enclosed == ()
    regions = found.regions
    assert regions is not None
    assert sorted(regions.slots) == sorted([(transpose, dots[0], tanhs[0]), (dots[1], tanhs[1])])
    assert all(add not in slot for slot in regions.slots)
    assert regions.heavy_mask == 0b11
    plans = regions.region_plans()
    assert [p.stream for p in plans] == [1, 2]
    assert plans[0].eqns[0] < plans[1].eqns[0]
    assert [p.seconds for p in plans] == [float(len(p.eqns)) for p in plans]
    assert regions.assignment(3) == {i: (3, s) for s, slot in enumerate(regions.slots)
                                     for i in slot}
    # An equation an earlier section holds is not absorbed.
    taken = {tanhs[1]: (0, 0)}
    again = build_regions(order, graph, seconds, {}, ((0,), (1,)), taken=taken,
                          section_index=1, streams=2, min_seconds=0.5).regions
    assert again is not None
    assert all(tanhs[1] not in slot for slot in again.slots)
    # Too little to hide: no regions.
    assert build_regions(order, graph, seconds, {}, ((0,), (1,)), taken={}, section_index=0,
                         streams=2, min_seconds=2.0).regions is None


def chain_and_tower(a, b):
    p = a @ a
    q = jnp.sin(p)
    r = q @ q
    return r, b @ b


def test_hull_and_a_blocked_equation_inside_it():
    jaxpr = open_level(chain_and_tower, (8, 8), (8, 8))
    graph = build_graph(jaxpr)
    dots = indices(jaxpr, "dot_general")
    sin = indices(jaxpr, "sin")[0]
    seconds = [1.0] * len(jaxpr.eqns)
    order = heavy_order(graph, dots, seconds, min_seconds=0.5, end=graph.size)
    assert convex_hull(order, graph, [0, 1]) == [dots[0], sin, dots[1]]
    found = build_regions(order, graph, seconds, {sin: REASON_EFFECTFUL}, ((0, 1), (2,)),
                          taken={}, section_index=0, streams=2, min_seconds=0.5)
    assert found.regions is None  # one branch left: nothing to overlap
    ((enclosed,),) = (found.enclosed,)
    assert enclosed.eqns == (dots[0], dots[1])
    assert enclosed.blocked == sin
    assert enclosed.reason == REASON_EFFECTFUL


# ------------------------------------------------------------------ frozen values


def test_phase_values_are_frozen():
    jaxpr = open_level(two_towers, (8, 8), (8, 8))
    graph = build_graph(jaxpr)
    seconds = [1.0] * len(jaxpr.eqns)
    order = heavy_order(graph, indices(jaxpr, "dot_general"), seconds, 0.5, graph.size)
    tree = decompose(order)
    choice = choose_sections(tree, 2, 0.5)
    found = build_regions(order, graph, seconds, {}, choice.branch_sets[0], {}, 0, 2, 0.5)
    assert found.regions is not None
    for value, field in [(order, "units"), (tree, "cost"), (choice, "branch_sets"),
                         (choice.tree, "benefit"), (found, "regions"),
                         (found.regions, "slots")]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)
    # And their collections are tuples, not lists that could be changed in place.
    assert isinstance(order.members, tuple) and isinstance(order.unit_anc, tuple)
    assert isinstance(found.regions.slots[0], tuple)


def test_absorption_stops_at_the_window_end():
    jaxpr = open_level(two_towers, (8, 8), (8, 8))
    graph = build_graph(jaxpr)
    dots = indices(jaxpr, "dot_general")
    tanhs = indices(jaxpr, "tanh")
    assert dots[0] < tanhs[0] < dots[1] < tanhs[1]
    seconds = [1.0] * len(jaxpr.eqns)
    # The next window starts right after the second dot: its tanh belongs to that window.
    order = heavy_order(graph, dots, seconds, min_seconds=0.5, end=dots[1] + 1)
    regions = build_regions(order, graph, seconds, {}, ((0,), (1,)), taken={},
                            section_index=0, streams=2, min_seconds=0.5).regions
    assert regions is not None
    absorbed = {i for slot in regions.slots for i in slot}
    assert tanhs[0] in absorbed
    assert tanhs[1] not in absorbed


def dependent_pair(a):
    x = a @ a
    t = x * 2.0
    return t @ t


def test_a_producer_depending_on_the_section_is_not_absorbed():
    # Called on two dependent branches (the DP never pairs those): the light `t`
    # between them must not join the second region, which would chain the two.
    jaxpr = open_level(dependent_pair, (8, 8))
    graph = build_graph(jaxpr)
    dots = indices(jaxpr, "dot_general")
    mul = indices(jaxpr, "mul")[0]
    seconds = [1.0] * len(jaxpr.eqns)
    order = heavy_order(graph, dots, seconds, min_seconds=0.5, end=graph.size)
    regions = build_regions(order, graph, seconds, {}, ((0,), (1,)), taken={},
                            section_index=0, streams=2, min_seconds=0.5).regions
    assert regions is not None
    assert sorted(regions.slots) == [(dots[0],), (dots[1],)]
    assert all(mul not in slot for slot in regions.slots)
