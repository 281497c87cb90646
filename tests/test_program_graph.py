"""``jaxpar/_program/graph.py``: the dependency graph and ``contract``'s emission orders."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpar._program import graph as _graph
from jaxpar._program.graph import ContractionCycle, EqnUnit, Graph, RewriteUnit, contract


def _graph_of(preds: list[tuple[int, ...]]) -> Graph:
    succs: list[list[int]] = [[] for _ in preds]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    everything = frozenset(range(len(preds)))
    return Graph(tuple(preds), tuple(map(tuple, succs)), everything, everything)


@st.composite
def _levels(draw: Any) -> tuple[Graph, list[tuple[RewriteUnit, list[int]]]]:
    size = draw(st.integers(2, 14))
    preds = [tuple(sorted(draw(st.sets(st.integers(0, i - 1), max_size=3)))) if i else ()
             for i in range(size)]
    owner = draw(st.lists(st.integers(-1, 3), min_size=size, max_size=size))
    members: dict[int, list[int]] = {}
    for i, k in enumerate(owner):
        if k >= 0:
            members.setdefault(k, []).append(i)
    blocks = [(RewriteUnit(n), eqns) for n, eqns in enumerate(members.values())]
    return _graph_of(preds), blocks


def _kahn(graph: Graph, blocks: Any, monkeypatch: Any) -> Any:
    with monkeypatch.context() as patch:
        patch.setattr(_graph, "_by_first_index", lambda *a: None)
        try:
            return contract(graph, blocks)
        except ContractionCycle:
            return "cycle"


@settings(max_examples=300, deadline=None)
@given(level=_levels())
def test_contract_without_the_heap_orders_as_kahn(level: Any) -> None:
    """Where units in order of their first equation are topological, ``contract``
    takes that order without Kahn's heap: it is exactly Kahn's order, and every other
    case (a cycle included) is Kahn's."""
    graph, blocks = level
    with pytest.MonkeyPatch.context() as monkeypatch:
        expected = _kahn(graph, blocks, monkeypatch)
    try:
        got: Any = contract(graph, blocks)
    except ContractionCycle:
        got = "cycle"
    assert got == expected


def test_contract_keeps_program_order_when_it_can(monkeypatch: Any) -> None:
    # 0 -> 2, 1 -> 3; the block {1, 3} is convex and reads nothing after its first
    # member's place, so the order is program order with the block at 1.
    graph = _graph_of([(), (), (0,), (1,), (2, 3)])
    calls = []
    real = _graph._by_first_index
    monkeypatch.setattr(_graph, "_by_first_index",
                        lambda *a: calls.append(1) or real(*a))
    order = contract(graph, [(RewriteUnit(0), [1, 3])])
    assert order == (EqnUnit(0), RewriteUnit(0), EqnUnit(2), EqnUnit(4)) and calls
    # {0, 3}: 3 reads 1, which comes after 0 -- the block waits for 1 (Kahn's order).
    graph = _graph_of([(), (), (0,), (1,), (2, 3)])
    assert contract(graph, [(RewriteUnit(0), [0, 3])]) == (
        EqnUnit(1), RewriteUnit(0), EqnUnit(2), EqnUnit(4))
    with pytest.raises(ContractionCycle):  # 2 reads 0 and 3 reads 2: not convex
        contract(_graph_of([(), (), (0,), (2,)]), [(RewriteUnit(0), [0, 3])])


def _reference_preds(jaxpr: Any) -> list[tuple[int, ...]]:
    """The definition: the writers of what an equation reads, and for an equation with
    ordering effects the one with effects before it."""
    from jaxpar import _compat

    writer: dict[Any, int] = {}
    preds, last = [], None
    for i, eqn in enumerate(jaxpr.eqns):
        found = {writer[v] for v in eqn.invars if not _compat.is_literal(v) and v in writer}
        if _compat.ordering_effects(eqn):
            if last is not None:
                found.add(last)
            last = i
        preds.append(tuple(sorted(found)))
        writer.update((v, i) for v in eqn.outvars if not _compat.is_drop_var(v))
    return preds


def test_build_graph_is_the_definition() -> None:
    import jax
    import jax.numpy as jnp

    def program(x: Any, y: Any) -> Any:
        a = jnp.sin(x) + 1.0  # a literal operand
        jax.debug.print("{}", a, ordered=True)
        b = a @ y + a
        c, _ = jax.lax.scan(lambda s, _: (s * 2.0, None), b, None, length=2)
        jax.debug.print("{}", x, ordered=True)  # reads only an input: after the first
        return c + b, jnp.cos(y)

    closed = jax.make_jaxpr(program)(jnp.ones((3, 3)), jnp.ones((3, 3)))
    graph = _graph.build_graph(closed.jaxpr)
    assert list(graph.preds) == _reference_preds(closed.jaxpr)
    assert any(len(p) > 1 for p in graph.preds) and any(len(p) == 1 for p in graph.preds)
    for i, ps in enumerate(graph.preds):
        assert all(i in graph.succs[p] for p in ps)
    assert sum(map(len, graph.succs)) == sum(map(len, graph.preds))


def test_rebuilt_graph_is_the_graph_built_afresh(monkeypatch: Any) -> None:
    """Every level the passes rebuild gets the graph (and writers) ``graph_and_writers``
    would make of it (edges, live and output equations), derived from the level it was
    rebuilt from; a level with ordering effects is built afresh."""
    import jax
    import jax.numpy as jnp
    from helpers.benchmarks import load_benchmark

    import jaxpar
    from jaxpar import _analysis

    calls: list[bool] = []  # per derived graph: whether it was built from scratch
    scratch = [0]
    real_derive, real_build = _analysis.rebuilt_graph, _graph._build_graph

    def checked(graph: Graph, writers: Any, old: Any, new: Any, origin: Any) -> Any:
        before = scratch[0]
        got = real_derive(graph, writers, old, new, origin)
        assert got == real_build(new)  # the graph and the writers
        assert all(isinstance(i, int) for i in got[0].live)  # indices, no live objects
        calls.append(scratch[0] > before)
        return got

    def counted(jaxpr: Any) -> Any:
        scratch[0] += 1
        return real_build(jaxpr)

    monkeypatch.setattr(_analysis, "rebuilt_graph", checked)
    monkeypatch.setattr(_graph, "_build_graph", counted)
    overhead = load_benchmark("overhead")
    jaxpar.inspect(overhead.build_program(600), target="gpu")(*overhead.program_args())
    assert len(calls) >= 3 and not any(calls)  # derived, none built afresh

    def scans(x: Any, y: Any) -> Any:  # rewrites between printing effects
        jax.debug.print("{}", x.sum(), ordered=True)
        a = jax.lax.scan(lambda c, _: (jnp.tanh(c @ c), None), x, None, length=3)[0]
        b = jax.lax.scan(lambda c, _: (jnp.sin(c) @ c, None), y, None, length=3)[0]
        jax.debug.print("{}", a.sum(), ordered=True)
        return a + b + jnp.cos(x).sum() + jnp.cos(x).sum()

    x = jnp.ones((16, 16))
    calls.clear()
    plan = jaxpar.inspect(scans, target="gpu")(x, x)
    assert "fused" in [d.kind for d in plan.decisions]
    assert calls and all(calls)  # the effects' chain: built afresh


# --------------------------------------------------------------------------- DisjointSets


def test_disjoint_sets_join_under_the_second_root() -> None:
    sets = _graph.DisjointSets(6)
    assert sets.groups() == [[0], [1], [2], [3], [4], [5]]
    assert sets.union(4, 1) is True
    assert sets.union(1, 4) is False  # already one set
    assert sets.find(4) == sets.find(1) == 1  # ``into``'s root represents the set
    assert sets.union(1, 5) is True
    assert [sets.find(k) for k in range(6)] == [0, 5, 2, 3, 5, 5]
    assert sets.union(0, 2) is True
    # Each set's positions ascending, the sets in order of their first position, whatever
    # the roots.
    assert sets.groups() == [[0, 2], [1, 4, 5], [3]]


def test_disjoint_sets_copy_joins_apart_from_the_original() -> None:
    sets = _graph.DisjointSets(4)
    sets.union(0, 1)
    trial = sets.copy()
    assert trial.union(2, 3) is True
    assert trial.groups() == [[0, 1], [2, 3]]
    assert sets.groups() == [[0, 1], [2], [3]]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=20))))
def test_disjoint_sets_are_the_connected_components(case: Any) -> None:
    size, pairs = case
    sets = _graph.DisjointSets(size)
    for a, b in pairs:
        sets.union(a, b)
    # The components of the undirected graph of ``pairs``, by a plain search.
    neighbours: dict[int, set[int]] = {k: set() for k in range(size)}
    for a, b in pairs:
        neighbours[a].add(b)
        neighbours[b].add(a)
    components: list[list[int]] = []
    seen: set[int] = set()
    for k in range(size):
        if k not in seen:
            found, stack = {k}, [k]
            while stack:
                for j in neighbours[stack.pop()] - found:
                    found.add(j)
                    stack.append(j)
            seen |= found
            components.append(sorted(found))
    assert sets.groups() == components
    assert all(sets.find(k) in group for group in components for k in group)
