"""The step clock: when each action of a training step started and ended, on the device that ran it.

All times are seconds on one axis, time.perf_counter()'s, which processes on one machine
share, so every rank's track lines up in the Chrome trace.

  CPU   an action's work is done when its Python call returns, so a stamp is simply
        perf_counter() at the action's boundary.
  CUDA  a Python call only enqueues kernels: perf_counter() at its return says when the
        host finished launching, not when the GPU finished computing (the host runs ahead
        by up to the whole step). So a stamp is a torch.cuda.Event(enable_timing=True)
        recorded on the current stream at the boundary; it completes when the GPU has done
        everything enqueued before it. `start` synchronises the device and records an
        anchor event at perf_counter time t0, with the GPU idle; after the step's final
        synchronise (`finish`), each stamp resolves to t0 + anchor.elapsed_time(stamp),
        the GPU-side time of that boundary on the host's axis. Collectives that NCCL runs
        on its own streams show up where the compute stream waits for them.

Usage, once per step:

    clock.start()                  # synchronises; returns t0
    s = clock.stamp(); ...; e = clock.stamp()
    end = clock.finish()           # synchronises; perf_counter after all of the step's work
    events = clock.resolve([(name, kind, s, e)])
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch

# perf_counter seconds (CPU) or a recorded CUDA event (resolved after `finish`).
Stamp = Union[float, Any]
Event = tuple[str, str, Stamp, Stamp]  # (name, kind, start, end)
TimedEvent = tuple[str, str, float, float]


def cuda_timing_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


@dataclass
class StepClock:
    """Stamps for one step at a time. `new_event` makes an object with record() and
    elapsed_time(other) -> milliseconds (torch.cuda.Event); tests pass a fake one."""

    device: torch.device
    new_event: Callable[[], Any] = cuda_timing_event
    origin_s: float = field(default=0.0, init=False)  # perf_counter time of the anchor
    _anchor: Any = field(default=None, init=False, repr=False)

    @property
    def on_device(self) -> bool:
        """True when stamps are device events (CUDA), False when they are host times."""
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.on_device:
            torch.cuda.synchronize(self.device)

    def start(self) -> float:
        """Wait for the device to be idle, anchor the step there; the step's start time."""
        self.synchronize()
        self.origin_s = time.perf_counter()
        if self.on_device:
            self._anchor = self.new_event()
            self._anchor.record()
        return self.origin_s

    def stamp(self) -> Stamp:
        """This point of the step: now (CPU), or when the device gets here (CUDA)."""
        if not self.on_device:
            return time.perf_counter()
        event = self.new_event()
        event.record()
        return event

    def finish(self) -> float:
        """Wait for all of the step's work; the step's end time (host, after the device is done)."""
        self.synchronize()
        return time.perf_counter()

    def seconds(self, stamp: Stamp) -> float:
        """A stamp as perf_counter seconds; for events, only after `finish`."""
        if isinstance(stamp, (int, float)):
            return float(stamp)
        if self._anchor is None:
            raise RuntimeError("a device stamp resolves only against a step started with StepClock.start()")
        return self.origin_s + self._anchor.elapsed_time(stamp) / 1000.0

    def resolve(self, events: list[Event]) -> list[TimedEvent]:
        """(name, kind, start, end) with every stamp in perf_counter seconds."""
        return [(name, kind, self.seconds(start), self.seconds(end)) for name, kind, start, end in events]
