"""`minigpt calibrate`'s host measurements: the profile's "measured" field (simulator/host.py reads it).

Why: on a CPU a matmul roofline misses most of what a training step costs (a block is many
small kernels with Python between them), and with more ranks than cores the ranks take turns
on the cores, for compute and for gloo's copies alike. So the simulator gets measured costs:

- units: seconds of the model's pieces for one micro-batch of b sequences, as one tensor-
  parallel rank computes them (fp32): the model's own block, embedding and final norm + head
  + loss, made tensor-parallel by parallel/tensor.py (with and without sequence parallelism)
  over a group that communicates nothing (`AloneCollectives`: the collectives are measured
  apart); forward and backward each, for every tp in (1, 2, 4, 8) that fits the ranks and
  the model, and every b of plan.micro_batches; the median of >= plan.repeats runs after a warm-up. Rank 0 measures
  alone on one thread while the others wait in a barrier (which takes no CPU): unshared costs.
  Parameter gradients accumulate from run to run, as over a step's micro-batches.
- sharing: how much slower a rank computes when k ranks with one thread each compute at
  once (k = 1, 2, 4, ... and the rank count), and when rank 0 alone uses every core as
  threads: one block's forward + backward at plan.sharing_micro_batch, tp 1; slowdown =
  the mean of the busy ranks' medians over rank 0's median alone on one thread.
- collectives: gloo all-reduce, all-gather, reduce-scatter (parallel/comm.py's Collectives,
  S = the full buffer's bytes) and p2p (ping-pong inside pairs, half the round trip) by size
  S, group size n and the number W of busy ranks: ranks 0..W-1 split into contiguous groups
  of n that all run at once while the others wait. A single timed call is mostly noise, so
  each timed run is c back-to-back calls, c chosen so a run lasts about plan.min_run_s (the
  slowest busy rank's probe call decides, so every busy rank makes the same calls); a call
  is run / c, the median over plan.comm_repeats runs, and a point is the slowest rank's
  median. (Timing each call after a piece of compute instead, as training issues them, was
  tried: it raised the 2-rank costs by about as much as training shows, but with 8 ranks on
  2 cores it charged every collective the full 4-way sharing, which training, with ranks
  idle in pipeline bubbles, does not see: the 8-rank prediction went from +0.5% to +75%.) t = alpha + beta * S is fitted per (kind, n, W) by calibrate.fit_alpha_beta.
"""

from __future__ import annotations

import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from parallel.comm import Collectives, Done

TENSOR_PARALLEL = (1, 2, 4, 8)
PIECES = ("block", "embedding", "head")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


def host_cores() -> int:
    try:  # the cores this process may run on
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def tp_sizes(config, ranks: int) -> list[int]:  # tensor-parallel sizes this model and these ranks allow
    return [tp for tp in TENSOR_PARALLEL if tp <= ranks and config.n_heads % tp == 0 and config.d_ff % tp == 0]


def powers_up_to(ranks: int, start: int) -> list[int]:
    """start, 2 start, 4 start, ... up to ranks, and ranks itself."""
    values = [k for k in (2**i for i in range(ranks.bit_length())) if start <= k <= ranks]
    return values + ([ranks] if ranks not in values and ranks >= start else [])


def group_pairs(ranks: int) -> list[tuple[int, int]]:
    """(busy ranks W, group size n): n a power of two dividing W, or W itself."""
    pairs = []
    for busy in powers_up_to(ranks, 2):
        pairs += [(busy, n) for n in powers_up_to(busy, 2) if busy % n == 0]
    return pairs


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


# ---------------------------------------------------------------- the model's pieces


class AloneCollectives(Collectives):
    """A tensor-parallel group of `size` ranks seen from rank 0, that communicates nothing.

    Every call does only its local share of work (all-reduce nothing, all-gather and
    reduce-scatter one copy), so parallel/tensor.py's real modules run on one rank alone and
    their compute can be timed apart from their communication, which the profile measures
    separately (the collectives below)."""

    def __init__(self, size: int) -> None:
        super().__init__(None, "alone")
        self.size, self.rank = size, 0

    def all_reduce(self, tensor, op=None, async_op: bool = False):
        return Done() if async_op else None

    def all_gather(self, output, shard, async_op: bool = False):
        output.view(self.size, -1).copy_(shard.reshape(1, -1).expand(self.size, -1))
        return Done() if async_op else None

    def reduce_scatter(self, shard, full, async_op: bool = False):
        shard.copy_(full.reshape(self.size, -1)[self.rank].view_as(shard))
        return Done() if async_op else None


def variants(config, ranks: int) -> list[tuple[int, bool]]:
    """(tp, sequence_parallel) pairs measured: every tp that fits, with and without sequence parallelism."""
    return [(tp, sp) for tp in tp_sizes(config, ranks) for sp in ((False, True) if tp > 1 else (False,))
            if not sp or config.seq_len % tp == 0]


def piece_model(config, tp: int, sequence_parallel: bool = False):
    """The GPT made tensor-parallel by parallel/tensor.py over a group that communicates nothing."""
    from minigpt.model import GPT
    from parallel.tensor import parallelize

    model = GPT(config)
    parallelize(model, AloneCollectives(tp), sequence_parallel)
    return model


def piece_step(piece: str, config, tp: int, batch: int, model=None, sequence_parallel: bool = False):
    """A function timing one forward and one backward of `piece` ("block", "embedding" or "head")
    as training runs it on one tensor-parallel rank: () -> (forward s, backward s); a block's
    time is that of all the model's blocks run in turn, divided by their number."""
    seq, d, clock = config.seq_len, config.d_model, time.perf_counter
    model = model if model is not None else piece_model(config, tp, sequence_parallel)
    rows = seq // tp if sequence_parallel else seq  # the sequence a rank holds between the layers
    x = None if piece == "embedding" else torch.randn(batch, rows, d, requires_grad=True)
    grad = None if piece == "head" else torch.randn(batch, rows, d)
    if piece == "block":  # every block in turn, as a chunk runs them (their weights do not all stay in cache)
        def forward():
            out = x
            for block in model.blocks:
                out = block(out)
            return out
    elif piece == "embedding":
        idx = torch.randint(config.vocab_size, (batch, seq))
        forward = lambda: model.embed(idx)  # noqa: E731
    else:
        targets = torch.randint(config.vocab_size, (batch, seq))
        forward = lambda: model.loss(model.logits(x), targets)  # noqa: E731

    per = len(model.blocks) if piece == "block" else 1

    def step() -> tuple[float, float]:
        if x is not None:
            x.grad = None
        start = clock()
        out = forward()
        middle = clock()
        out.backward(grad)
        return (middle - start) / per, (clock() - middle) / per

    return step


def _medians(step, repeats: int, min_total_s: float) -> tuple[float, float]:
    """Median (forward, backward) seconds after a warm-up: at least `repeats` runs, more
    (up to 5x) for short pieces so the runs last about min_total_s."""
    step()
    first = step()
    runs = min(max(repeats, math.ceil(min_total_s / max(sum(first), 1e-7))), 5 * repeats)
    samples = [first] + [step() for _ in range(runs - 1)]
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def measure_units(plan, rank: int, ranks: int) -> dict[int, dict[str, list[float]]] | None:
    """{tp: {"block_forward": [s per micro-batch size], ...}}: rank 0 alone on one thread
    while every other rank waits in a barrier (and returns None)."""
    from minigpt.config import preset

    config, units = preset(plan.model), {}
    torch.manual_seed(0)
    _barrier()
    for tp, sp in variants(config, ranks) if rank == 0 else ():
        series = units[(tp, sp)] = {f"{piece}_{way}": [] for piece in PIECES for way in ("forward", "backward")}
        model = piece_model(config, tp, sp)  # the same weights for every micro-batch size
        for piece in PIECES:
            for batch in plan.micro_batches:
                step = piece_step(piece, config, tp, batch, model, sp)
                times = _medians(step, plan.repeats, plan.min_run_s * plan.repeats)
                for way, seconds in zip(("forward", "backward"), times):
                    series[f"{piece}_{way}"].append(seconds)
    _barrier()
    return units if rank == 0 else None


def measure_sharing(plan, rank: int, ranks: int, cores: int) -> dict:
    """This rank's median block forward + backward seconds with k ranks busy at once, by k,
    and rank 0's alone with `cores` threads ("threads")."""
    from minigpt.config import preset

    torch.manual_seed(rank)
    step = piece_step("block", preset(plan.model), 1, plan.sharing_micro_batch)
    timed = lambda: statistics.median(sum(step()) for _ in range(plan.repeats))  # noqa: E731
    step()  # a rank's first block is slow (lazy initialisation): not while others are timed
    result: dict = {"busy": {}}
    for busy in [1] + powers_up_to(ranks, 2):
        _barrier()
        if rank < busy:
            step()  # warm-up
        _barrier()  # the busy ranks start their timed runs together
        if rank < busy:
            result["busy"][busy] = timed()
    _barrier()
    if cores > 1:
        if rank == 0:
            torch.set_num_threads(cores)  # measure_host sets the threads back
            step()
            result["threads"] = timed()
            torch.set_num_threads(1)
        _barrier()
    return result


# ---------------------------------------------------------------- collectives


def make_groups(ranks: int) -> dict[int, object]:
    """This rank's group of each size (every rank creates every group, in the same order)."""
    rank, groups = dist.get_rank(), {}
    for n in sorted({n for _, n in group_pairs(ranks)}):
        for first in range(0, ranks - n + 1, n):
            group = dist.group.WORLD if n == ranks else dist.new_group(list(range(first, first + n)))
            if first <= rank < first + n:
                groups[n] = group
    return groups


def _per_call(op, busy_group, plan, work) -> float:
    """Median seconds of op as training issues it: on the fresh output of a piece of compute.

    A run is c times (buffers = work(); op(buffers)); the same c times work() alone is timed
    just before; a call costs the difference / c, the median over plan.comm_repeats runs. c is
    chosen so a run lasts about plan.min_run_s (the slowest busy rank's probe decides, so every
    busy rank makes the same calls)."""
    op(work())  # warm-up
    _barrier(busy_group)
    start = time.perf_counter()
    op(work())
    probe = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=busy_group)  # every busy rank makes the same calls
    calls = max(1, min(1000, int(plan.min_run_s / max(probe.item(), 1e-7))))
    both, alone = [], []
    for _ in range(plan.comm_repeats):
        _barrier(busy_group)
        start = time.perf_counter()
        for _ in range(calls):
            work()
        alone.append((time.perf_counter() - start) / calls)
        _barrier(busy_group)
        start = time.perf_counter()
        for _ in range(calls):
            op(work())
        both.append((time.perf_counter() - start) / calls)
    return max(statistics.median(both) - statistics.median(alone), 1e-7)


def _ping_pong(tensor: torch.Tensor, rank: int, partner: int) -> None:
    first, second = (dist.send, dist.recv) if rank < partner else (dist.recv, dist.send)
    first(tensor, partner)
    second(tensor, partner)


def measure_group_collectives(plan, ranks: int) -> dict[tuple[str, int, int, int], float]:
    """{(kind, group size n, busy ranks W, S bytes): this rank's median seconds}, where it was busy."""
    from minigpt.config import preset

    rank, groups, points, config = dist.get_rank(), make_groups(ranks), {}, preset(plan.model)
    for busy, n in group_pairs(ranks):
        _barrier()
        if rank < busy:
            comm = Collectives(groups[n], "calibrate")
            block, x = piece_model(config, 1).blocks[0], torch.randn(1, config.seq_len, config.d_model)
            for size in plan.message_bytes:
                numel = max(n, size // 4 // n * n)

                def work(numel=numel):  # one block forward at micro-batch 1, then the buffers, freshly made
                    with torch.no_grad():
                        block(x)
                    return torch.ones(numel), torch.ones(numel // n)

                ops = {"all_reduce": lambda bufs: comm.all_reduce(bufs[0]),
                       "all_gather": lambda bufs: comm.all_gather(bufs[0], bufs[1]),
                       "reduce_scatter": lambda bufs: comm.reduce_scatter(bufs[1], bufs[0])}
                if n == 2:
                    ops["p2p"] = lambda bufs: _ping_pong(bufs[0], rank, rank ^ 1)
                for kind, op in ops.items():
                    seconds = _per_call(op, groups[busy], plan, work)
                    points[(kind, n, busy, numel * 4)] = seconds / 2 if kind == "p2p" else seconds
        _barrier()
    return points


def measure_host(plan) -> dict:
    """Every host measurement on this rank (the calling rank's torch threads are restored)."""
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    cores, saved, result = host_cores(), torch.get_num_threads(), {}
    phases = {"units": lambda: measure_units(plan, rank, ranks),
              "sharing": lambda: measure_sharing(plan, rank, ranks, cores),
              "collectives": lambda: measure_group_collectives(plan, ranks) if ranks > 1 else {}}
    torch.set_num_threads(1)
    try:
        seconds = {}
        for name, phase in phases.items():
            start = time.perf_counter()
            result[name] = phase()
            seconds[name] = time.perf_counter() - start
    finally:
        torch.set_num_threads(saved)
    return {"cores": cores, **result, "seconds": seconds}


# ---------------------------------------------------------------- into the profile


def collective_points(hosts: list[dict]) -> dict[tuple[str, int, int], list[list[float]]]:
    """{(kind, n, W): [[S, the slowest busy rank's seconds], ...] by increasing S} over every rank's measurements."""
    slowest: dict[tuple, float] = {}
    for host in hosts:
        for key, seconds in host["collectives"].items():
            slowest[key] = max(seconds, slowest.get(key, 0.0))
    series: dict[tuple[str, int, int], list[list[float]]] = {}
    for (kind, n, busy, size), seconds in sorted(slowest.items()):
        series.setdefault((kind, n, busy), []).append([int(size), seconds])
    return series


def build_measured(hosts: list[dict], plan, fit) -> dict:
    """The profile's "measured" object from every rank's measure_host() (rank 0 first); fit: fit_alpha_beta."""
    from minigpt.config import preset

    config, first = preset(plan.model), hosts[0]
    units = [{"d_model": config.d_model, "n_heads": config.n_heads, "d_ff": config.d_ff, "seq_len": config.seq_len,
              "vocab_size": config.vocab_size, "tp": tp, "sequence_parallel": sp,
              "micro_batches": list(plan.micro_batches), **series}
             for (tp, sp), series in sorted(first["units"].items())]
    base = first["sharing"]["busy"][1]
    sharing = []
    for busy in sorted(first["sharing"]["busy"]):
        times = [h["sharing"]["busy"][busy] for h in hosts if busy in h["sharing"]["busy"]]
        sharing.append([busy, 1, statistics.fmean(times) / base])
    if "threads" in first["sharing"]:
        sharing.append([1, first["cores"], first["sharing"]["threads"] / base])
    collectives = []
    for (kind, n, busy), points in sorted(collective_points(hosts).items(),
                                          key=lambda item: (item[0][2], item[0][1], KINDS.index(item[0][0]))):
        alpha, beta = fit(points)
        collectives.append({"kind": kind, "group": n, "active": busy, "alpha": alpha, "beta": beta, "points": points})
    return {"cores": first["cores"], "units": units, "sharing": sharing, "collectives": collectives,
            "note": f"parallel/calibrate_host.py; sharing at micro-batch {plan.sharing_micro_batch}, tp 1"}
