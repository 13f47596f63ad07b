"""`minigpt calibrate`'s failure costs: checkpoint writes and reads per byte, and how long the ranks take to start.

What a campaign on this machine loses to a failure (simulator/campaign/): a checkpoint's write blocks training,
a restart starts the ranks again and reads the newest checkpoint back. Measured here as training pays them:

- checkpoint: every rank writes its own shard at once with torch.distributed.checkpoint (the library
  parallel/checkpoint/ saves with: a FileSystemWriter, its files synced), then every rank reads it back, at each
  size of plan.checkpoint_bytes per rank, in a directory beside the profile (plan.storage_dir: the disk a run's
  checkpoints go to when they are written beside it); the seconds are the slowest rank's, between barriers. A
  line t = alpha + beta * S over the bytes S of all ranks is fitted (parallel/calibrate/links.py's fit_alpha_beta):
  1 / beta is this server's write (read) bandwidth.
- start: once the calibration is done, its ranks are launched again to do nothing (`measure_start`): the seconds
  from the launch (parallel.launch.elastic.launch, whose ranks fork from a server that has torch loaded, up since
  the calibration's launch, as it is at a restart) to every rank's process group being up. A restart on this
  machine is that, the launcher noticing the failure (its monitor interval) and the checkpoint read back; the
  first step's warm-up is not part of it (measured nowhere here).
"""

from __future__ import annotations

import shutil
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from parallel.calibrate.device import stamp
from parallel.calibrate.host import barrier


def measure_checkpoint(plan, device: torch.device) -> dict | None:
    """{"write": [[all ranks' bytes, seconds], ...], "read": [...]} on rank 0 (None elsewhere and without
    plan.storage_dir): each size written and read plan.checkpoint_repeats times, the median kept."""
    import torch.distributed.checkpoint as dcp

    if not plan.storage_dir:
        return None
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's notes on single-process use
        return _measure_checkpoint(dcp, plan, rank, ranks, device)


def _measure_checkpoint(dcp, plan, rank: int, ranks: int, device: torch.device) -> dict | None:
    root = Path(plan.storage_dir)
    points: dict[str, list[list[float]]] = {"write": [], "read": []}
    warm = {f"shard-{rank}": torch.zeros(16, device=device)}  # DCP's first save and load set themselves up: untimed
    dcp.save(warm, checkpoint_id=str(root / "warm-up"), no_dist=ranks == 1)
    dcp.load(warm, checkpoint_id=str(root / "warm-up"), no_dist=ranks == 1)
    for size in plan.checkpoint_bytes:
        state = {f"shard-{rank}": torch.randn(size // 4, device=device)}  # fp32: 4 bytes an element
        timings: dict[str, list[float]] = {"write": [], "read": []}
        for repeat in range(plan.checkpoint_repeats):
            where = root / f"{size}-{repeat}"
            for kind in ("write", "read"):
                barrier()
                start = stamp(device)
                if kind == "write":
                    dcp.save(state, checkpoint_id=str(where), no_dist=ranks == 1)
                else:
                    dcp.load(state, checkpoint_id=str(where), no_dist=ranks == 1)
                barrier()
                timings[kind].append(stamp(device) - start)
            barrier()
            if rank == 0:
                shutil.rmtree(where, ignore_errors=True)
        for kind in timings:
            points[kind].append([size * ranks, statistics.median(timings[kind])])
    barrier()
    return points if rank == 0 else None


def start_rank(device: str | None) -> float:
    """A rank that only starts: its process group up and every rank's with it, rank 0's clock then."""
    from parallel.launch.elastic import finish_worker, init_worker

    init_worker(device)
    try:
        barrier()
        return time.time()
    finally:
        finish_worker()


def measure_start(ranks: int, device: str | None) -> float:
    """Seconds from launching `ranks` ranks that do nothing to all of them being up, as a restart starts them: the
    launcher's processes fork from its server, which an earlier launch (the calibration's) left running."""
    from parallel.launch.elastic import launch

    if ranks == 1:
        return 0.0  # one rank runs in the launching process: nothing starts
    launched = time.time()
    return launch(start_rank, device, ranks) - launched


def build_failure_costs(points: dict, start_s: float, monitor_s: float, fit) -> dict:
    """The profile's measured["failure_costs"]: write and read fits, their points, the ranks' start and the
    launcher's monitor interval (fit: fit_alpha_beta)."""
    costs = {}
    for kind in ("write", "read"):
        alpha, beta = fit(points[kind])
        costs[kind] = {"alpha": alpha, "beta": beta, "points": points[kind]}
    costs["start_s"] = start_s
    costs["monitor_s"] = monitor_s
    costs["note"] = ("parallel/calibrate/storage.py: checkpoint write and read with torch.distributed.checkpoint by "
                     "every rank at once, S the bytes of all ranks; start_s from launching the ranks again to all of "
                     "them up; monitor_s the launcher's interval between checks of its ranks")
    return costs
