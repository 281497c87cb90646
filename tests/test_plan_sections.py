"""``jaxpar._plan.sections``: the series-parallel dynamic programme on hand-built trees, and
the balance of branches onto streams."""

from __future__ import annotations

import pytest

from jaxpar._plan.sections import (
    choose_sections,
    leaf,
    lpt_balance,
    overlapped_seconds,
    parallel,
    series,
)

US = 1e-6


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
