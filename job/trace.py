"""Timelines of the executor: every action of every rank, as a Chrome trace and as a breakdown.

Every time is in seconds on time.perf_counter()'s axis, which the processes of one
machine share, so the ranks' tracks line up. What a time means depends on the device
(parallel/clock.py stamps them):

  CPU   when the action's Python call started and returned: the CPU did the work then.
  CUDA  when the GPU reached the action's boundary: a CUDA event recorded on the current
        stream there, resolved after the step's final synchronise against an anchor
        recorded at the step's start. So an action's duration is the GPU's time for
        its kernels (and for waiting on NCCL work the current stream depends on), not
        the host's time to enqueue them; the step's start and end are host times taken
        with the device idle (synchronised), so a step holds all of its GPU work.

The tensor-parallel time `tp` (part of compute), and expert parallelism's `ep` (its all-to-alls, also inside
the compute actions), is the time inside blocking collectives: host wall time on the CPU; on CUDA, CUDA events
around each call on the current stream (parallel/comm.py BlockedTime), since the host returns from an NCCL call
before the transfer is done.

Breakdown of a step on a rank, from its events:
  compute   forward and backward actions
  p2p       time inside send/receive batches: on a pipeline this is where a rank
            waits for its neighbour, so it holds the pipeline bubble and the
            exposed point-to-point communication together
  dp        gradient reduction not hidden by the backward, the optimizer step and
            ZeRO's gathers after it
  other     the rest of the step (Python between actions)
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_STEPS = 50  # traced steps kept, so that long runs leave a file Perfetto opens quickly


class Trace:
    def __init__(self, rank: int):
        self.rank = rank
        self.steps: list[dict] = []

    def add_step(self, step: int, start: float, end: float, events: list[tuple[str, str, float, float]],
                 tp_seconds: float = 0.0, ep_seconds: float = 0.0) -> None:
        """`tp_seconds`: the time spent inside blocking tensor-parallel collectives during the
        compute actions (on CUDA from events on the stream: see the module's docstring); `ep_seconds`:
        inside expert parallelism's all-to-alls, also within the compute actions."""
        if len(self.steps) < MAX_STEPS:
            self.steps.append({"step": step, "start": start, "end": end, "events": events, "tp": tp_seconds,
                               "ep": ep_seconds})

    def as_dict(self) -> dict:
        return {"rank": self.rank, "steps": self.steps}


def chrome_trace_events(timelines: list[dict]) -> list[dict]:
    """The Chrome trace events of `timelines` (the executor's or the simulator's, in one format): one
    track per rank with its actions named as in the schedule, and one per rank for its steps."""
    origin = min((s["start"] for t in timelines for s in t["steps"]), default=0.0)
    events = []
    for timeline in timelines:
        rank = timeline["rank"]
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        for step in timeline["steps"]:
            events.append(_event(f"step {step['step']}", "step", step["start"], step["end"], rank + 1000, origin))
            events += [_event(name, kind, start, end, rank, origin) for name, kind, start, end in step["events"]]
    return events


def write_chrome_trace(path: Path, timelines: list[dict]) -> Path:
    """The one writer of Chrome traces (executor and simulator); opens in Perfetto or chrome://tracing."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"traceEvents": chrome_trace_events(timelines), "displayTimeUnit": "ms"}),
                   encoding="utf-8")
    tmp.replace(path)
    return path


def _event(name: str, kind: str, start: float, end: float, tid: int, origin: float) -> dict:
    return {
        "name": name,
        "cat": kind,
        "ph": "X",
        "ts": (start - origin) * 1e6,
        "dur": max(0.0, end - start) * 1e6,
        "pid": 0,
        "tid": tid,
    }


def breakdown(timelines: list[dict]) -> dict:
    """Mean seconds per step of each kind over ranks and steps (the first step, a warm-up, left out);
    tp_s (ep_s) is the part of compute_s spent inside blocking tensor-parallel collectives (expert parallelism's
    all-to-alls)."""
    totals = {"step": 0.0, "compute": 0.0, "p2p": 0.0, "dp": 0.0, "tp": 0.0, "ep": 0.0}
    count = 0
    for timeline in timelines:
        steps = timeline["steps"][1:] or timeline["steps"]
        for step in steps:
            totals["step"] += step["end"] - step["start"]
            totals["tp"] += step.get("tp", 0.0)  # inside compute: not in "other" below
            totals["ep"] += step.get("ep", 0.0)
            for _, kind, start, end in step["events"]:
                if kind in totals:
                    totals[kind] += end - start
            count += 1
    if count == 0:
        return {}
    mean = {kind: value / count for kind, value in totals.items()}
    mean["other"] = max(0.0, mean["step"] - mean["compute"] - mean["p2p"] - mean["dp"])
    mean["bubble_and_p2p_fraction"] = mean["p2p"] / mean["step"] if mean["step"] else 0.0
    return {f"{kind}_s" if not kind.endswith("fraction") else kind: value for kind, value in mean.items()}
