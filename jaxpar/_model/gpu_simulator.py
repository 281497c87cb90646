"""One GPU's device and streams, as both of jaxpar's GPU estimates run them: the planner's
(``_plan.modes``, a planned jaxpr before anything is compiled) and the compiled program's
(``_compiled.replay``, XLA's scheduled HLO). Each feeds this simulator its own kernels.

* ``Device``: the GPU's roofline throughput, shared by every stream. A kernel that
  starts at ``start`` with ``work`` seconds of roofline work and lasts at least
  ``duration`` (its floor) ends at ``max(start + duration, max(start, free) + work)``:
  overlap hides kernel floors and launch latency, never the work itself. On one stream
  this is exactly the serial sum.
* ``Streams``: CUDA streams, each running its kernels in order; an event makes one
  stream wait for another (a stream region's start and done).
* ``LaunchSequence``: when the nodes of one launch sequence start. In a chain (an
  ``LHS`` CUDA graph, kernels launched alone) each starts after the one before; in the
  branching CUDA-graph modes (``CommandBufferMode.branching``) a small node starts when
  its inputs are ready, at most ``hardware_queues`` at once, while a serial node (a dot,
  a convolution, a library call, a kernel that fills the GPU: XLA's own
  ``CONCURRENT_REGIONS`` rule) starts after everything before it and holds back
  everything after it.

The host is not here: the two estimates model it differently, for a reason. The planner
prices a jaxpr before XLA has scheduled it, so it knows no launch order: it sums the
host's costs (launches, graph nodes, events) and takes the longer of host and device,
level by level, memoised across the CUDA-graph modes and the ends of the GPU model's
ranges it compares (it prices every candidate plan, so it must be cheap). The replay
reads XLA's schedule, so it runs a host clock that enqueues every kernel in order and
gates its start, replays loops trip by trip, and counts host syncs. A shared host model
would lose one of these: the planner's would need the schedule it is choosing, the
replay's would forget the order it has.

Example::

    device, streams = Device(), Streams()
    first = streams.run(device, 1, 0.0, work=2e-6, duration=3e-6)   # 3e-6: its floor
    second = streams.run(device, 2, 0.0, work=2e-6, duration=3e-6)  # 4e-6: shares the GPU
    chain = LaunchSequence(branching=False, queues=4)
    start = chain.start(0.0, serial=False)                         # after the one before
"""

from __future__ import annotations

import heapq


class Device:
    """The GPU's throughput, shared by every stream: when it is next free for work, and
    the seconds of kernels it ran (``busy``: their durations, floors included)."""

    __slots__ = ("busy", "free")

    def __init__(self) -> None:
        self.free = 0.0
        self.busy = 0.0

    def run(self, start: float, work: float, duration: float) -> float:
        """A kernel started at ``start``: when it ends. Its work waits for the device's
        earlier work; its floor (``duration``) does not."""
        begin_work = max(start, self.free)
        self.free = begin_work + work
        self.busy += duration
        return max(start + duration, begin_work + work)

    def hold(self, until: float) -> None:
        """Work that occupies the whole device until ``until`` (a loop run alone)."""
        self.free = max(self.free, until)


class Streams:
    """CUDA streams: when each has run everything enqueued on it (``ends``)."""

    __slots__ = ("ends",)

    def __init__(self, ends: dict[int, float] | None = None) -> None:
        self.ends: dict[int, float] = {} if ends is None else ends

    def at(self, stream: int) -> float:
        """When ``stream`` is free (0 for one not used yet)."""
        return self.ends.setdefault(stream, 0.0)

    def run(self, device: Device, stream: int, ready: float, work: float,
            duration: float) -> float:
        """A kernel on ``stream`` that may start at ``ready`` (its inputs, its launch):
        when it ends."""
        start = max(ready, self.at(stream))
        finish = self.ends[stream] = device.run(start, work, duration)
        return finish

    def wait(self, stream: int, other: int) -> float:
        """An event: ``stream`` waits for everything enqueued on ``other``; when it is
        free again."""
        waited = self.ends[stream] = max(self.ends.get(stream, 0.0), self.at(other))
        return waited


class LaunchSequence:
    """When each node of one launch sequence starts (see the module docstring).

    Call ``start`` for a node, run it, then ``finished`` with its end; ``end`` is when
    the last node so far ends. ``alone`` places a node that runs outside the sequence's
    graph, after everything before it (a loop).
    """

    __slots__ = ("barrier", "branching", "end", "in_flight", "queues")

    def __init__(self, branching: bool, queues: int, begin: float = 0.0) -> None:
        self.branching = branching
        self.queues = max(1, queues)
        self.end = begin
        self.barrier = begin  # when the last serial node ends: nothing starts before
        self.in_flight: list[float] = []  # ends of the small nodes running beside others

    def start(self, ready: float, serial: bool) -> float:
        """When a node whose inputs are ready at ``ready`` starts."""
        if self.branching and not serial:
            start = max(self.barrier, ready)
            in_flight = self.in_flight
            while in_flight and in_flight[0] <= start:
                heapq.heappop(in_flight)
            if len(in_flight) >= self.queues:  # every hardware queue busy
                start = max(start, heapq.heappop(in_flight))
            return start
        return max(self.end, ready)  # a chain, or a kernel that fills the GPU

    def finished(self, finish: float, serial: bool) -> None:
        """The node ``start`` placed ends at ``finish``."""
        if self.branching and not serial:
            heapq.heappush(self.in_flight, finish)
        else:
            self.barrier = finish
            self.in_flight.clear()
        self.reached(finish)

    def alone(self, ready: float, duration: float) -> float:
        """A node run outside the graph, after everything before it, lasting
        ``duration``: when it ends."""
        finish = self.barrier = max(self.end, ready) + duration
        self.reached(finish)
        return finish

    def reached(self, finish: float) -> None:
        """Something the sequence waits for at its end (a stream region's node, a free
        equation) ends at ``finish``."""
        if finish > self.end:
            self.end = finish
