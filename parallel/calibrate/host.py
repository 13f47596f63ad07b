"""`minigpt calibrate`'s host measurements: the profile's "measured" field (simulator/costs/host.py reads it).

Why: on a CPU a matmul roofline misses most of what a training step costs (a block is many
small kernels with Python between them), and with more ranks than cores the ranks take turns
on the cores, for compute and for gloo's copies alike. So the simulator gets measured costs.
Everything runs on the ranks' device (parallel/calibrate/device.py: the CPU with gloo, or one
CUDA GPU per rank with NCCL), and every timer waits for the device's queued work first:

- units: seconds of the model's pieces for one micro-batch of b sequences, as one tensor-
  parallel rank computes them in fp32 (TF32 off, torch's default, as an fp32 training run computes) and, on a GPU,
  also in bf16 (the model cast as the bf16 policy casts it: precision/compute.py's apply_precision); each unit says
  its format ("dtype"), and simulator/costs/host.py's unit_times finds a unit for its own format only:
  the model's own block (a mixture of experts': its MoE blocks, routing, experts and combine on one
  rank, ep 1), embedding and final norm + head + loss, made tensor-parallel by
  parallel/tensor/parallelize.py (with and without sequence parallelism) over a group that communicates
  nothing (`AloneCollectives`: the collectives are measured apart); forward and backward each, for every
  tp in (1, 2, 4, 8) that fits the ranks and the model, and every b of plan.micro_batches; the median of >= plan.repeats runs after a warm-up (the runs'
  spread and rank 0's CPU share go to parallel/calibrate/noise.py's record). Rank 0 measures
  alone on one thread while the others wait in a barrier (which takes no CPU): unshared costs.
  Parameter gradients accumulate from run to run, as over a step's micro-batches.
- sharing: how much slower a rank computes when k ranks with one thread each compute at
  once (k = 1, 2, 4, ... and the rank count), and, on a CPU, when rank 0 alone uses every core
  as threads: one block's forward + backward at plan.sharing_micro_batch, tp 1; slowdown =
  the mean of the busy ranks' medians over rank 0's median alone (runs taken in step, as below: a rank done
  first leaves its core to the others while it waits, as in a synchronous step), and for the threads the
  median ratio of runs on every core's thread and on one taken in turn (device.threads_ratio). On CUDA each
  rank has its own GPU ("cores" = the GPUs used), so the rows measure about 1 and there is no threads row.
- stragglers: what waiting for the slowest rank costs while k ranks compute at once, from the same runs. Every
  rank takes each run in step with the others (a barrier before each: the runs of one index are simultaneous, as
  a synchronous step's ranks are), at least SHARING_RUNS x plan.repeats of them and enough to last about
  plan.variation_s (the machine's slow moments, a neighbour's burst on a shared VM, come every few hundred ms).
  The stragglers row is the mean over runs of the slowest busy rank's time over the mean of every busy rank's
  times (simulator/costs/host.py reads it as the coefficient of variation of independent normal ranks giving that
  factor, so that simulator/stragglers.py's order statistics reproduce it at k ranks and carry it to other
  counts). A rank's own spread is not that: with more ranks than cores the ranks take turns, one rank's slow
  run is another's fast one, and the pooled spread (26.7% with 4 ranks on 2 cores, 2026-12-03) priced a 4-rank
  step 27% slower than the slowest rank was.
- collectives: all-reduce, all-gather, reduce-scatter, all-to-all (parallel/comm.py's Collectives over
  gloo or NCCL, S = the full buffer's bytes; all-to-all: each rank's input, split evenly, as expert
  parallelism's exchanges are counted) and p2p (ping-pong inside pairs, half the round trip) by size S,
  group size n and the number W of busy ranks: ranks 0..W-1 split into
  contiguous groups of n that all run at once while the others wait. Each is timed as
  training issues it, on fresh buffers after a piece of compute (`_per_call`): a run of c
  calls less the same compute alone; t = alpha + beta * S is fitted per (kind, n, W) by
  calibrate.fit_alpha_beta. On a CPU each fit also keeps "cpu_share": the share of a core the rank's process
  computed while in the call (its CPU time over the wall time, both as the same difference; the median over sizes
  and busy ranks), what a rank blocked in it does not leave to the others (simulator/engine/simulate.py's
  share_idle_cores).
"""

from __future__ import annotations

import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from parallel.calibrate.device import (piece_model, piece_step, split_runs, stamp, strict_fp32, threads_ratio,
                                       timed_runs, variants)
from parallel.calibrate.noise import Noise
from parallel.comm import Collectives

PIECES = ("block", "embedding", "head")
SPLIT = ("block_backward_input", "block_backward_weight")  # a block's backward in zero-bubble's two halves
UNIT_FORMATS = {"cpu": ("fp32",), "cuda": ("fp32", "bf16")}  # the formats units are measured in, by device type:
# fp32 (the model as built, TF32 off) everywhere; on a GPU also bf16, what training computes in there (on a CPU
# 16-bit training emulates its matmuls with fp32 ones, so fp32's units price it)
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")
SHARING_RUNS = 3  # runs of the sharing block per busy rank, in plan.repeats: enough to see how much a rank's time varies


def host_cores() -> int:
    try:  # the cores this process may run on
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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


def barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def measure_units(plan, rank: int, ranks: int, device: torch.device,
                  noise: Noise | None = None) -> dict[tuple, dict[str, list[float]]] | None:
    """{(model preset, tp, sequence parallel, cp, format): {"block_forward": [s per micro-batch size], ...}} for every
    preset of plan.unit_models and every format of UNIT_FORMATS[device.type]: rank 0 alone on one thread (on
    `device`) while every other rank waits in a barrier (and returns None). `noise` (rank 0's): the CPU share of the
    timed loop and each series' spread of runs."""
    from minigpt.presets import preset

    units = {}
    noise = noise if noise is not None else Noise()
    torch.manual_seed(0)
    barrier()
    shapes = [(name, *variant, fmt) for name in plan.unit_models
              for variant in variants(preset(name), ranks, plan.context_parallel) for fmt in UNIT_FORMATS[device.type]]
    for name, tp, sp, cp, fmt in shapes if rank == 0 else ():
        config = preset(name)
        series = units[(name, tp, sp, cp, fmt)] = {f"{piece}_{way}": [] for piece in PIECES
                                                   for way in ("forward", "backward")} | {s: [] for s in SPLIT}
        model = piece_model(config, tp, sp, device, cp, fmt)  # the same weights for every micro-batch size
        for piece in PIECES:
            for batch in plan.micro_batches:
                step = piece_step(piece, config, tp, batch, model, sp, device, cp)
                with noise.timed():
                    runs = timed_runs(step, plan.repeats, plan.min_run_s * plan.repeats)
                noise.add("units", [f + b for f, b in runs])
                for i, way in enumerate(("forward", "backward")):
                    series[f"{piece}_{way}"].append(statistics.median(run[i] for run in runs))
        for batch in plan.micro_batches:  # a block's backward as zero-bubble splits it: two passes, each its own
            with noise.timed():
                runs = split_runs(config, tp, batch, model, plan.repeats, plan.min_run_s * plan.repeats, sp, device, cp)
            for i, name in enumerate(SPLIT):
                series[name].append(statistics.median(run[i] for run in runs))
    barrier()
    return units if rank == 0 else None


def _slowest(seconds: float) -> float:
    """The largest of every rank's `seconds` (all ranks call it), so that every rank runs as many timed runs."""
    if not dist.is_initialized():
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def measure_sharing(plan, rank: int, ranks: int, cores: int, device: torch.device, noise: Noise | None = None) -> dict:
    """This rank's median block forward + backward seconds with k ranks busy at once, by k,
    and on a CPU rank 0's ratio alone of `cores` threads to one ("threads_ratio"; a GPU's rank has its own GPU),
    recording in
    `noise` (rank 0's) the share of the cores it got meanwhile."""
    from minigpt.presets import preset

    torch.manual_seed(rank)
    step = piece_step("block", preset(plan.model), 1, plan.sharing_micro_batch, device=device)
    step()  # a rank's first block is slow (lazy initialisation): not while others are timed
    alone = _slowest(sum(step()))  # one block, alone: how many runs fill plan.variation_s below
    result: dict = {"busy": {}, "runs": {}}
    for busy in [1] + powers_up_to(ranks, 2):
        barrier()
        if rank < busy:
            step()  # warm-up
        barrier()
        runs = []
        count = max(SHARING_RUNS * plan.repeats, math.ceil(plan.variation_s / (alone * max(1.0, busy / max(1, cores)))))
        for _ in range(count):  # the same count on every rank: `alone` is the slowest rank's
            barrier()  # each run in step: the runs of one index are simultaneous on the busy ranks
            if rank < busy:
                runs.append(sum(step()))
        if rank < busy:
            result["busy"][busy] = statistics.median(runs)
            result["runs"][busy] = runs  # every run, in order: the slowest rank of each index is its straggler
    barrier()
    if cores > 1 and device.type == "cpu":
        if rank == 0:
            noise = noise or Noise()
            result["threads_ratio"] = threads_ratio(step, cores, 2 * plan.repeats - 1,
                                                    lambda: noise.timed_on_cores(cores))
        barrier()
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


def _per_call(op, busy_group, plan, work, device: torch.device) -> tuple[float, float]:
    """(median seconds of op as training issues it: on the fresh output of a piece of compute; the share of one core
    this process spent computing during it).

    A run is c times (buffers = work(); op(buffers)); the same c times work() alone is timed
    just before; a call costs the difference / c, the median over plan.comm_repeats runs. c is
    chosen so a run lasts about plan.min_run_s (the slowest busy rank's probe decides, so every
    busy rank makes the same calls). The CPU share is the process's CPU time (every thread's: gloo's own included)
    over the wall time, both as the same difference: on a CPU a rank blocked in a collective leaves its core to the
    others but for that share (simulator/engine/simulate.py's share_idle_cores)."""
    op(work())  # warm-up
    barrier(busy_group)
    start = stamp(device)
    op(work())
    probe = torch.tensor([stamp(device) - start], dtype=torch.float64, device=device)  # NCCL: on the GPU
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=busy_group)  # every busy rank makes the same calls
    calls = max(1, min(1000, int(plan.min_run_s / max(probe.item(), 1e-7))))
    both, alone, cpu_both, cpu_alone = [], [], [], []
    for _ in range(plan.comm_repeats):
        barrier(busy_group)
        start, cpu = stamp(device), time.process_time()
        for _ in range(calls):
            work()
        alone.append((stamp(device) - start) / calls)
        cpu_alone.append((time.process_time() - cpu) / calls)
        barrier(busy_group)
        start, cpu = stamp(device), time.process_time()
        for _ in range(calls):
            op(work())
        both.append((stamp(device) - start) / calls)
        cpu_both.append((time.process_time() - cpu) / calls)
    seconds = max(statistics.median(both) - statistics.median(alone), 1e-7)
    cpu = statistics.median(cpu_both) - statistics.median(cpu_alone)
    return seconds, min(max(cpu / seconds, 0.0), 1.0)


def _ping_pong(tensor: torch.Tensor, rank: int, partner: int) -> None:
    first, second = (dist.send, dist.recv) if rank < partner else (dist.recv, dist.send)
    first(tensor, partner)
    second(tensor, partner)


def measure_group_collectives(plan, ranks: int, device: torch.device) -> dict[tuple[str, int, int, int], tuple]:
    """{(kind, group size n, busy ranks W, S bytes): (this rank's median seconds, its CPU share)}, where it was busy."""
    from minigpt.presets import preset

    rank, groups, points, config = dist.get_rank(), make_groups(ranks), {}, preset(plan.model)
    for busy, n in group_pairs(ranks):
        barrier()
        if rank < busy:
            comm = Collectives(groups[n], "calibrate")
            block = piece_model(config, 1).blocks[0].to(device)
            x = torch.randn(1, config.seq_len, config.d_model, device=device)
            for size in plan.message_bytes:
                numel = max(n, size // 4 // n * n)

                def work(numel=numel):  # one block forward at micro-batch 1, then the buffers, freshly made
                    with torch.no_grad():
                        block(x)
                    return torch.ones(numel, device=device), torch.ones(numel // n, device=device)

                even = [numel // n] * n  # expert parallelism's exchange, balanced: S each rank's whole input
                ops = {"all_reduce": lambda bufs: comm.all_reduce(bufs[0]),
                       "all_gather": lambda bufs: comm.all_gather(bufs[0], bufs[1]),
                       "reduce_scatter": lambda bufs: comm.reduce_scatter(bufs[1], bufs[0]),
                       "all_to_all": lambda bufs, even=even: comm.all_to_all(torch.empty_like(bufs[0]), bufs[0],
                                                                             even, even)}
                if n == 2:
                    ops["p2p"] = lambda bufs: _ping_pong(bufs[0], rank, rank ^ 1)
                for kind, op in ops.items():
                    seconds, share = _per_call(op, groups[busy], plan, work, device)
                    points[(kind, n, busy, numel * 4)] = (seconds / 2 if kind == "p2p" else seconds, share)
        barrier()
    return points


def measure_host(plan, device: torch.device, noise: Noise | None = None) -> dict:
    """Every host measurement on this rank, on `device` (the calling rank's torch threads are restored).
    "cores": the CPU cores this process may use, or on CUDA the GPUs used (one per rank). `noise`: rank 0's
    record of its measurements alone (noise.Noise), which the units add to."""
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    cores = ranks if device.type == "cuda" else host_cores()
    saved, result = torch.get_num_threads(), {}

    def units():
        with strict_fp32(device):
            return measure_units(plan, rank, ranks, device, noise)

    phases = {"units": units,
              "sharing": lambda: measure_sharing(plan, rank, ranks, cores, device, noise),
              "collectives": lambda: measure_group_collectives(plan, ranks, device) if ranks > 1 else {}}
    torch.set_num_threads(1)
    try:
        seconds = {}
        for name, phase in phases.items():
            start = stamp(device)
            result[name] = phase()
            seconds[name] = stamp(device) - start
    finally:
        torch.set_num_threads(saved)
    timed = result["collectives"]  # (seconds, CPU share) by call
    result["collectives"] = {key: seconds for key, (seconds, _) in timed.items()}
    if device.type == "cpu":  # on a GPU the collectives do not run on the cores
        result["collective_cpu"] = {key: share for key, (_, share) in timed.items()}
    return {"cores": cores, "device": device.type, **result, "seconds": seconds}


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


def fit_cpu_share(hosts: list[dict], kind: str, n: int, busy: int) -> dict:
    """{"cpu_share": the median over the busy ranks and sizes of the share of a core each spent computing in this
    collective}, or {} where it was not measured (a GPU's collectives, or an older rank's record)."""
    shares = [share for host in hosts for (k, g, w, _), share in host.get("collective_cpu", {}).items()
              if (k, g, w) == (kind, n, busy)]
    return {"cpu_share": round(statistics.median(shares), 4)} if shares else {}


def unit_shape(config) -> dict:
    """The shape a unit was measured on, as simulator/costs/host.py keys it: the sizes and every option that changes
    what a block computes (key/value heads, MLP, norm, positions, biases; a test checks the two agree)."""
    shape = {"d_model": config.d_model, "n_heads": config.n_heads, "d_ff": config.d_ff, "seq_len": config.seq_len,
             "vocab_size": config.vocab_size, "kv_heads": config.kv_heads, "mlp": config.mlp, "norm": config.norm,
             "positions": config.positions, "bias": config.bias, "qkv_bias": config.qkv_bias,
             "qk_norm": config.qk_norm, "d_head": config.d_head, "window": config.window_in_use}
    if config.is_mla:  # multi-head latent attention too (simulator/costs/host_units.py's latent_key)
        shape["latent"] = {"kv_lora_rank": config.kv_lora_rank, "q_lora_rank": config.q_lora_rank,
                           "rope_head_dim": config.rope_head_dim, "v_head_dim": config.v_head_dim}
    if config.is_moe:  # a MoE block is a shape of its own (simulator/costs/host.py's expert_key)
        shape["experts"] = {"n_experts": config.n_experts, "top_k": config.top_k, "d_expert": config.expert_width,
                            "n_shared_experts": config.n_shared_experts, "router": config.router,
                            "capacity_factor": config.capacity_factor}
    return shape


def slowest_rank_factor(runs: list[list[float]]) -> float | None:
    """The stragglers row's value from each busy rank's runs taken in step (runs[rank][i] simultaneous): the mean
    over i of the slowest rank's run over the mean of every run (>= 1); None for one rank (nobody to wait for)."""
    count = min((len(r) for r in runs), default=0)
    if len(runs) < 2 or count == 0:
        return None
    slowest = statistics.fmean(max(r[i] for r in runs) for i in range(count))
    return slowest / statistics.fmean(r[i] for r in runs for i in range(count))


def build_measured(hosts: list[dict], plan, fit) -> dict:
    """The profile's "measured" object from every rank's measure_host() (rank 0 first); fit: fit_alpha_beta."""
    from minigpt.presets import preset

    first = hosts[0]
    order = {name: index for index, name in enumerate(plan.unit_models)}
    units = [{**unit_shape(preset(name)), "tp": tp, "sequence_parallel": sp, **({"cp": cp} if cp > 1 else {}),
              "dtype": fmt, "micro_batches": list(plan.micro_batches), **series}
             for (name, tp, sp, cp, fmt), series in sorted(first["units"].items(), key=lambda item: (order[item[0][0]],
                                                                                              *item[0][1:]))]
    base = first["sharing"]["busy"][1]
    sharing = []
    for busy in sorted(first["sharing"]["busy"]):
        times = [h["sharing"]["busy"][busy] for h in hosts if busy in h["sharing"]["busy"]]
        sharing.append([busy, 1, statistics.fmean(times) / base])
    if "threads_ratio" in first["sharing"]:
        sharing.append([1, first["cores"], first["sharing"]["threads_ratio"]])
    stragglers = []
    for busy in sorted(first["sharing"].get("runs", {})):
        factor = slowest_rank_factor([h["sharing"]["runs"][busy] for h in hosts if busy in h["sharing"].get("runs", {})])
        if factor is not None:
            stragglers.append([busy, 1, factor])
    collectives = []
    for (kind, n, busy), points in sorted(collective_points(hosts).items(),
                                          key=lambda item: (item[0][2], item[0][1], KINDS.index(item[0][0]))):
        alpha, beta = fit(points)
        collectives.append({"kind": kind, "group": n, "active": busy, "alpha": alpha, "beta": beta, "points": points,
                            **fit_cpu_share(hosts, kind, n, busy)})
    return {"cores": first["cores"], "device": first.get("device", "cpu"), "units": units, "sharing": sharing,
            "stragglers": stragglers, "collectives": collectives,
            "note": f"parallel/calibrate/host.py; sharing at micro-batch {plan.sharing_micro_batch}, tp 1"}
