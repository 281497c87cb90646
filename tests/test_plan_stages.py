"""The planner's stages one at a time: heavy order and units, the series-parallel
dynamic programme on hand-built trees, regions (hull, balance, private neighbours),
and that every stage's value is frozen."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxpar._graph import build_graph
from jaxpar._plan.heavy import attach_loose_ends, heavy_order
from jaxpar._plan.plans import REASON_EFFECTFUL
from jaxpar._plan.regions import build_regions, convex_hull
from jaxpar._plan.sections import (
    choose_sections,
    decompose,
    leaf,
    lpt_balance,
    overlapped_seconds,
    parallel,
    series,
)

US = 1e-6


def open_level(fn, *shapes):
    closed = jax.make_jaxpr(fn)(*[jnp.ones(s, jnp.float32) for s in shapes])
    return closed.jaxpr


def indices(jaxpr, name):
    return [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == name]


# ------------------------------------------------------------------ dynamic programme


def test_parallel_node_beats_its_children_becomes_one_section():
    tree = parallel(series(leaf(0, 20 * US), leaf(1, 10 * US)), leaf(2, 30 * US))
    choice = choose_sections(tree, streams=2, min_seconds=5 * US)
    assert choice.tree.as_section
    assert choice.tree.benefit == pytest.approx(30 * US)
    assert choice.branch_sets == (((0, 1), (2,)),)
    assert choice.declined == ()


def test_children_sections_beat_the_parallel_node():
    # The top node could hide only d's 20 us; the section inside hides 50 us.
    inner = parallel(leaf(0, 50 * US), leaf(1, 50 * US))
    tree = parallel(series(inner, leaf(2, 1 * US)), leaf(3, 20 * US))
    choice = choose_sections(tree, streams=2, min_seconds=5 * US)
    assert not choice.tree.as_section
    assert choice.tree.benefit == pytest.approx(50 * US)
    assert choice.branch_sets == (((0,), (1,)),)
    # The series child carries its section's benefit up; its leaf none.
    series_choice = choice.tree.children[0]
    assert series_choice.benefit == pytest.approx(50 * US)
    assert series_choice.children[0].as_section
    assert series_choice.children[1].benefit == 0.0


def test_a_tie_goes_to_the_outer_section():
    inner = parallel(leaf(0, 10 * US), leaf(1, 10 * US))
    tree = parallel(series(inner, leaf(2, 0.0)), leaf(3, 10 * US))
    choice = choose_sections(tree, streams=2, min_seconds=1 * US)
    assert choice.tree.as_section  # hides 10 us, as much as the inner section
    assert choice.branch_sets == (((0, 1, 2), (3,)),)


def test_min_seconds_threshold():
    tree = parallel(leaf(0, 4 * US), leaf(1, 4 * US))
    below = choose_sections(tree, streams=2, min_seconds=5 * US)
    assert below.branch_sets == ()
    assert below.tree.benefit == 0.0
    assert [(d.positions, d.cost, d.one_stream) for d in below.declined] == [
        ((0,), 4 * US, False), ((1,), 4 * US, False)]
    above = choose_sections(tree, streams=2, min_seconds=3 * US)
    assert above.branch_sets == (((0,), (1,)),)
    assert above.declined == ()


def test_one_stream_makes_no_section_and_declines_the_whole_node():
    tree = parallel(leaf(0, 100 * US), leaf(1, 100 * US), leaf(2, 100 * US))
    choice = choose_sections(tree, streams=1, min_seconds=1 * US)
    assert choice.branch_sets == ()
    assert [(d.positions, d.one_stream) for d in choice.declined] == [((0, 1, 2), True)]


def test_branches_are_balanced_longest_first():
    tree = parallel(leaf(0, 30 * US), leaf(1, 20 * US), leaf(2, 10 * US))
    two = choose_sections(tree, streams=2, min_seconds=1 * US)
    assert two.tree.benefit == pytest.approx(30 * US)  # {30} against {20, 10}
    three = choose_sections(tree, streams=3, min_seconds=1 * US)
    assert three.tree.benefit == pytest.approx(10 * US)
    bins = lpt_balance([("a", 3.0), ("b", 5.0), ("c", 2.0), ("d", 1.0)], 2,
                       lambda item: item[1], lambda item: ord(item[0]))
    assert bins == [[("b", 5.0), ("d", 1.0)], [("a", 3.0), ("c", 2.0)]]
    assert overlapped_seconds([1.0], 4, float, int) == 0.0  # one branch hides nothing


def test_nested_sections_in_series_add_up():
    first = parallel(leaf(0, 10 * US), leaf(1, 10 * US))
    second = parallel(leaf(2, 7 * US), leaf(3, 8 * US))
    choice = choose_sections(series(first, second), streams=2, min_seconds=1 * US)
    assert choice.tree.benefit == pytest.approx(17 * US)
    assert choice.branch_sets == (((0,), (1,)), ((2,), (3,)))


# ------------------------------------------------------------------ heavy order


def diamond(a, b):
    x = a @ a
    y = b @ b
    z = x @ y
    return jnp.tanh(z)


def test_heavy_masks_of_a_small_program():
    jaxpr = open_level(diamond, (8, 8), (8, 8))
    graph = build_graph(jaxpr)
    dots = indices(jaxpr, "dot_general")
    assert len(dots) == 3
    seconds = [1.0] * len(jaxpr.eqns)
    order = heavy_order(graph, dots, seconds, min_seconds=0.5, end=graph.size)
    assert order.heavy == tuple(dots)
    assert order.heavy_anc == (0b001, 0b010, 0b111)
    assert order.heavy_desc == (0b101, 0b110, 0b100)
    tanh = indices(jaxpr, "tanh")[0]
    assert order.anc_of(tanh) == 0b111
    assert order.desc_of(tanh) == 0  # after the last heavy equation
    assert order.units == (0, 1, 2)
    tree = decompose(order)
    assert tree.kind == "series"
    assert [c.kind for c in tree.children] == ["parallel", "leaf"]
    assert [c.positions for c in tree.children[0].children] == [(0,), (1,)]


def test_cheap_source_joins_its_only_successor():
    jaxpr = open_level(diamond, (8, 8), (8, 8))
    graph = build_graph(jaxpr)
    dots = indices(jaxpr, "dot_general")
    seconds = [1.0] * len(jaxpr.eqns)
    seconds[dots[0]] = 0.0  # x is a cheap source feeding only z
    order = heavy_order(graph, dots, seconds, min_seconds=0.5, end=graph.size)
    assert order.units == (1, 2)
    assert order.members[2] == (0, 2)
    assert order.members[0] == ()
    assert order.unit_anc[2] == 0b110  # x's bit maps onto its unit, z
    assert order.expand([2]) == [0, 2]
    assert order.cost([1, 2]) == 2.0
    # The same order with x not cheap keeps three units.
    assert attach_loose_ends(order.heavy_anc, order.heavy_desc, [False] * 3) == [0, 1, 2]
    assert attach_loose_ends(order.heavy_anc, order.heavy_desc, [True, False, False]) == [2, 1, 2]


def test_cheap_node_with_two_successors_stays_alone():
    # A source feeding two heavy equations has no single neighbour to join.
    assert attach_loose_ends((0b001, 0b011, 0b101), (0b111, 0b010, 0b100),
                             [True, False, False]) == [0, 1, 2]


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


def test_stage_values_are_frozen():
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
