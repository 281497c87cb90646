"""``jaxpar._plan.heavy``: the heavy order, its units and how cheap equations attach to them."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar._plan.heavy import attach_loose_ends, heavy_order
from jaxpar._plan.sections import decompose
from jaxpar._program.graph import build_graph


def open_level(fn, *shapes):
    closed = jax.make_jaxpr(fn)(*[jnp.ones(s, jnp.float32) for s in shapes])
    return closed.jaxpr


def indices(jaxpr, name):
    return [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == name]


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
