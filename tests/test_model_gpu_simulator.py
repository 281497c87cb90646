"""``jaxpar/_model/gpu_simulator.py``: the one GPU simulator the planner's mode estimate and the
compiled program's replay share, on hand-built kernels."""

from __future__ import annotations

import random

import pytest

from jaxpar._model.gpu_simulator import Device, LaunchSequence, Streams


def test_overlap_hides_floors_never_work() -> None:
    device, streams = Device(), Streams()
    # Two kernels of 2 us of work and a 3 us floor each, on two streams at once.
    assert streams.run(device, 1, 0.0, work=2.0, duration=3.0) == 3.0
    assert streams.run(device, 2, 0.0, work=2.0, duration=3.0) == 4.0  # its work waits
    assert device.busy == 6.0 and device.free == 4.0
    # Work alone, with no floor to hide: the second ends after both works.
    device, streams = Device(), Streams()
    streams.run(device, 1, 0.0, work=2.0, duration=2.0)
    assert streams.run(device, 2, 0.0, work=2.0, duration=2.0) == 4.0


def test_one_stream_is_the_serial_sum() -> None:
    rng = random.Random(0)
    device, streams = Device(), Streams()
    expected = 0.0
    for _ in range(50):
        work, floor = rng.uniform(0, 5), rng.uniform(0, 5)
        expected += max(work, floor)
        end = streams.run(device, 0, 0.0, work, max(work, floor))
        assert end == pytest.approx(expected)


def test_an_event_makes_a_stream_wait() -> None:
    device, streams = Device(), Streams()
    streams.run(device, 0, 0.0, work=1.0, duration=5.0)
    assert streams.wait(1, 0) == 5.0  # a region starts after what its caller enqueued
    streams.run(device, 1, 0.0, work=1.0, duration=1.0)
    assert streams.ends[1] == 6.0
    assert streams.wait(0, 1) == 6.0  # its done: the caller waits for the region
    assert streams.wait(0, 2) == 6.0 and streams.at(2) == 0.0  # an unused stream: free


def test_a_chain_starts_each_node_after_the_one_before() -> None:
    device, chain = Device(), LaunchSequence(branching=False, queues=4)
    for _ in range(3):
        start = chain.start(0.0, serial=False)
        chain.finished(device.run(start, 0.5, 1.0), serial=False)
    assert chain.end == 3.0


def test_branching_runs_small_nodes_side_by_side_up_to_the_queues() -> None:
    device, graph = Device(), LaunchSequence(branching=True, queues=2)
    starts = []
    for _ in range(3):  # three independent small nodes, 1 us floors, no work
        start = graph.start(0.0, serial=False)
        starts.append(start)
        graph.finished(device.run(start, 0.0, 1.0), serial=False)
    assert starts == [0.0, 0.0, 1.0]  # the third waits for a free queue
    assert graph.end == 2.0
    # A serial node (a dot) starts after everything, and holds back what follows.
    start = graph.start(0.0, serial=True)
    assert start == 2.0
    graph.finished(device.run(start, 0.0, 1.0), serial=True)
    assert graph.start(0.0, serial=False) == 3.0


def test_a_node_waits_for_its_inputs_and_alone_runs_after_everything() -> None:
    graph = LaunchSequence(branching=True, queues=8)
    assert graph.start(4.0, serial=False) == 4.0
    graph.finished(5.0, serial=False)
    assert graph.alone(0.0, 2.0) == 7.0  # a loop: after everything before it
    assert graph.start(0.0, serial=False) == 7.0
    graph.reached(9.0)  # a region's node ending later holds the sequence's end
    assert graph.end == 9.0
