"""Compute overlapped with data-parallel communication inside one action, as our ZeRO code does it. Torch-free.

A backward (or a ZeRO-3 forward) is cut into segments: compute, optionally preceded by an
all-gather of the segment's weights and followed by a reduction of its gradients. The
communication runs on one stream in the order it is issued (collectives on one NCCL
communicator run one at a time); compute waits only where our code waits:

  - a segment's compute starts once its weights are gathered; the gather of the segment
    `prefetch` places ahead is issued when this one starts computing (parallel/data/zero3.py
    prefetches one unit; with 0 a segment's gather is issued when the compute before it ends);
  - a reduction is issued when the segment's compute ends; with `max_in_flight`, when more
    are in the air the compute waits for the oldest (parallel/data/zero.py's MAX_IN_FLIGHT);
  - `wait_at_end`: the action ends only when every reduction is done (ZeRO-2 and ZeRO-3 wait
    at the end of each micro-batch's backward); otherwise the communication may run past it
    (ZeRO 0/1: the last backward's buckets are waited for before the optimizer step).

While the stream is busy a segment's compute runs `slowdown` slower (the SMs NCCL's channels hold:
simulator/engine/overlap.py); every collective issued before a segment starts has been issued at or
before that moment, so from it the stream is busy without a gap until its last one ends. The
stalls and the slowdown are the action's exposed data-parallel time.

`serial`: on a CPU host whose ranks each have their own cores, gloo moves the bytes with the
core that computes, so the communication is charged in issue order on the compute stream
instead (nothing overlaps; simulator/engine/host.py decides when).

Gradient buckets become ready during a backward as it walks the parameters in reverse:
`ready_offsets` spreads each unit's backward time over its tensors by size (an
approximation: a matmul's weight gradient is not produced at a uniform rate).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from job.layout import Tensor
from simulator.engine.overlap import slowed


@dataclass(frozen=True)
class Segment:
    compute: float
    gather: float = 0.0
    reduce: float = 0.0


@dataclass(frozen=True)
class Overlapped:
    """When an action's compute stream ends (stalls included) and when its communication ends, from its start."""

    end: float
    comm_end: float
    compute: float  # the compute of the segments, stalls left out

    @property
    def exposed(self) -> float:
        return self.end - self.compute


def overlap(segments: Sequence[Segment], max_in_flight: int | None, wait_at_end: bool,
            serial: bool = False, prefetch: int = 1, comm_free: float = 0.0, slowdown: float = 0.0) -> Overlapped:
    """`comm_free`: the stream is busy that long from the start (collectives issued before); `slowdown`:
    the fraction of its rate a segment's compute loses while the stream is busy (Overlap.dp_slowdown)."""
    if serial:  # the communication takes the cores that compute (gloo on a CPU host): nothing hides
        end = sum(s.gather + s.compute + s.reduce for s in segments)
        return Overlapped(end=end, comm_end=end, compute=sum(s.compute for s in segments))
    clock, comm = 0.0, max(0.0, comm_free)
    gathered: list[float | None] = [None] * len(segments)
    for index in range(min(prefetch, len(segments))):  # gathered before any compute
        if segments[index].gather > 0:
            comm = gathered[index] = comm + segments[index].gather
    in_flight: deque[float] = deque()
    for index, segment in enumerate(segments):
        if gathered[index] is None and segment.gather > 0:  # not prefetched: gathered now, waited for
            comm = gathered[index] = max(comm, clock) + segment.gather
        if gathered[index] is not None:
            clock = max(clock, gathered[index])
        ahead = index + prefetch
        if prefetch > 0 and ahead < len(segments) and segments[ahead].gather > 0:
            comm = gathered[ahead] = max(comm, clock) + segments[ahead].gather
        clock = slowed(clock, segment.compute, comm, slowdown)  # the stream is busy from clock to comm
        if segment.reduce > 0:
            comm = max(comm, clock) + segment.reduce
            in_flight.append(comm)
            if max_in_flight is not None and len(in_flight) > max_in_flight:
                clock = max(clock, in_flight.popleft())
    if wait_at_end:
        clock = max(clock, comm)
    return Overlapped(end=clock, comm_end=max(clock, comm), compute=sum(s.compute for s in segments))


def ready_offsets(unit_tensors: Sequence[Sequence[Tensor]], unit_backward: Sequence[float]) -> list[float]:
    """For each tensor (model order), the time into the backward at which its gradient is complete."""
    done: list[float] = [0.0] * sum(len(unit) for unit in unit_tensors)
    index_of_first = []
    count = 0
    for unit in unit_tensors:
        index_of_first.append(count)
        count += len(unit)
    clock = 0.0
    for unit_index in reversed(range(len(unit_tensors))):
        unit = unit_tensors[unit_index]
        total = sum(t.numel for t in unit) or 1
        for offset in reversed(range(len(unit))):
            clock += unit_backward[unit_index] * unit[offset].numel / total
            done[index_of_first[unit_index] + offset] = clock
    return done
