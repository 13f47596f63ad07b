"""`minigpt calibrate`'s measurements: this machine's matmuls, memory copy, one block, and collectives.

The ranks (started through parallel.launch.launch) measure on the device parallel.launch.init_worker
gives them: one CUDA GPU per rank with NCCL when --device is auto and there is a GPU for every
local rank, else the CPU with gloo; each rank reports the device it used (calibrate_device.describe)
and the profile records that, not what was asked for. Rank 0 measures the matmuls, the copy and
the block alone (parallel/calibrate_device.py; on a CPU on one thread) while the others wait:
one device's own numbers, which the simulator slows by the measured cost of sharing cores for
a job with more ranks. Then parallel/calibrate_host.py measures the "measured" field (the model's
pieces alone, the cost of sharing cores, and collectives by group size and load), which also
gives the whole-world collectives below.

- matmul efficiency: at smallest side n, the mean of the square and GPT-shaped rates over the
  peak. There is no datasheet peak here, so the "peak" is the best fp32 rate measured (TF32
  off on a GPU): efficiency 1.0 at the best point, by construction.
- collectives (ranks >= 2): all-reduce, all-gather, reduce-scatter (through parallel/comm.py's
  Collectives) among all ranks and p2p (ping-pong inside rank pairs, every pair at once, half
  the round trip) by message size S (the full buffer, comm.py's convention): calibrate_host's
  points with every rank busy; each is the slowest rank's median. A least-squares line
  t = alpha + beta * S per collective is fitted in `fit_alpha_beta`.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from minigpt.errors import ConfigError, TrainingError
from parallel.calibrate_device import copy_bytes, describe, measure_block, measure_copy, measure_matmuls, stamp
from parallel.calibrate_host import build_measured, collective_points, measure_host
from parallel.launch import finish_worker, init_worker, launch

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True)
class CalibrationPlan:
    ranks: int = 8
    threads_per_rank: int = 1
    matmul_sizes: tuple[int, ...] = (64, 128, 256, 512, 1024)  # on a CPU
    repeats: int = 5
    min_run_s: float = 0.02  # each timed run repeats the operation until it lasts about this long
    copy_bytes: int = 256 * 2**20
    message_bytes: tuple[int, ...] = (4 * 2**10, 32 * 2**10, 256 * 2**10, 2 * 2**20, 8 * 2**20)
    comm_repeats: int = 5
    model: str = "tiny"
    micro_batch: int = 8
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16)  # the host units' micro-batch sizes
    sharing_micro_batch: int = 8
    device: str = "auto"  # "auto": CUDA when every local rank has a GPU, else the CPU; "cpu"
    cuda_matmul_sizes: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)  # on a GPU


DEVICES = ("auto", "cpu")
CPU_RANKS = 8  # the default on a CPU: the largest layout `minigpt compare --matrix` trains


def default_ranks(device: str) -> int:
    """--ranks left out: one rank per GPU when --device auto finds CUDA, else CPU_RANKS."""
    gpus = torch.cuda.device_count() if device == "auto" and torch.cuda.is_available() else 0
    return gpus or CPU_RANKS


def make_plan(ranks: int | None, quick: bool = False, threads_per_rank: int | None = None, model: str = "tiny",
              micro_batch: int = 8, device: str = "auto",
              micro_batches: tuple[int, ...] | None = None) -> CalibrationPlan:
    """The measurements of one calibration; ConfigError on bad input (before any rank starts)."""
    if device not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    ranks = default_ranks(device) if ranks is None else ranks
    for name, value in (("--ranks", ranks), ("--micro-batch", micro_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if threads_per_rank is not None and (isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int)
                                         or threads_per_rank < 1):
        raise ConfigError(f"--threads-per-rank must be a positive integer, got {threads_per_rank!r}")
    if micro_batches is not None and (not micro_batches or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in micro_batches)
            or list(micro_batches) != sorted(set(micro_batches))):
        raise ConfigError(f"--micro-batches must be increasing positive integers such as 1,2,4,8, "
                          f"got {','.join(map(str, micro_batches)) if micro_batches else 'none'}")
    from minigpt.config import preset

    preset(model)  # ConfigError for an unknown preset
    threads = threads_per_rank or (1 if ranks > 1 else torch.get_num_threads())
    if quick:
        return CalibrationPlan(ranks, threads, (64, 256, 512), 3, 0.005, 16 * 2**20,
                               (4 * 2**10, 256 * 2**10, 8 * 2**20), 3, model, micro_batch,
                               tuple(micro_batches or (1, 4, 16)), device=device, cuda_matmul_sizes=(256, 1024, 4096))
    return CalibrationPlan(ranks, threads, model=model, micro_batch=micro_batch, device=device,
                           micro_batches=tuple(micro_batches or CalibrationPlan.micro_batches))


def calibrate(plan: CalibrationPlan) -> list[dict]:
    """Run the measurements on plan.ranks local ranks; every rank's raw measurements, by rank."""
    return launch(measure_rank, plan, plan.ranks, threads_per_rank=plan.threads_per_rank)


# ---------------------------------------------------------------- one rank


def measure_rank(plan: CalibrationPlan) -> list[dict] | None:
    """One rank's part: every measurement; rank 0 returns every rank's, the others None."""
    device = init_worker(None if plan.device == "auto" else plan.device)  # CUDA + NCCL or the CPU + gloo
    try:
        if plan.ranks == 1:
            saved = torch.get_num_threads()
            torch.set_num_threads(plan.threads_per_rank)
        try:
            # Rank 0 alone measures the matmuls, the copy and the block (the others wait in a barrier,
            # which takes no CPU): a device's own numbers. What sharing costs is measured apart
            # (calibrate_host's "sharing"), and the simulator applies it to the job's ranks.
            start = stamp(device)
            result = {}
            if not dist.is_initialized() or dist.get_rank() == 0:
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                try:
                    result = {"matmuls": measure_matmuls(plan, device), "copy_bandwidth": measure_copy(plan, device),
                              "block": measure_block(plan, device)}
                finally:
                    torch.set_num_threads(threads)
            if dist.is_initialized():
                dist.barrier()
            compute_s = stamp(device) - start
            result["device"] = describe(device)  # what this rank measured on
            result["host"] = measure_host(plan, device)  # starts with a barrier
            result["host"]["seconds"] = {"matmuls_copy_block": compute_s, **result["host"]["seconds"]}
        finally:
            if plan.ranks == 1:
                torch.set_num_threads(saved)
        if not dist.is_initialized():
            return [result]
        gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(result, gathered, dst=0)
        return gathered
    finally:
        finish_worker()


# ---------------------------------------------------------------- from measurements to a profile


def fit_alpha_beta(points: list[list[float]] | list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares t = alpha + beta * S over [(S, t), ...], with alpha >= 0 and beta > 0.

    A negative intercept (noise at small sizes) refits the line through the origin; a slope
    that is not positive (too few or too noisy points) falls back to the largest point's t / S.
    """
    if not points:
        raise ValueError("no points to fit")
    xs, ys = [float(p[0]) for p in points], [float(p[1]) for p in points]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    beta = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    alpha = mean_y - beta * mean_x
    if alpha < 0:
        alpha, beta = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    if beta <= 0:
        big = max(range(n), key=lambda i: xs[i])
        alpha, beta = max(0.0, min(ys)), max(ys[big] / xs[big], 1e-15)
    return alpha, beta


def link_from_fit(kind: str, ranks: int, alpha: float, beta: float) -> tuple[float, float]:
    """(per-step latency s, link bandwidth B/s) that make the simulator's ring reproduce the fit.

    simulator/collectives.py: ring all-reduce = 2(n-1) steps of S/n, all-gather and
    reduce-scatter (n-1) steps of S/n, p2p one transfer of S.
    """
    steps = {"all_reduce": 2 * (ranks - 1), "all_gather": ranks - 1, "reduce_scatter": ranks - 1, "p2p": 1}[kind]
    share = 1.0 if kind == "p2p" else 1.0 / ranks
    return alpha / steps, steps * share / beta


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def measured_device(measured: list[dict]) -> dict:
    """The device every rank measured on (calibrate_device.describe); TrainingError if they differ."""
    kinds = {(r["device"]["type"], r["device"]["backend"]) for r in measured}
    if len(kinds) != 1:
        raise TrainingError(f"the ranks measured on different devices: {sorted(kinds)}")
    return measured[0]["device"]


def build_profile(measured: list[dict], plan: CalibrationPlan, name: str, cores: int, date: str) -> dict:
    """The hardware profile (hardware.json's schema, one GPU) from every rank's measurements.
    cores: this machine's CPU cores; on CUDA the GPUs used (one per rank) take their place."""
    device = measured_device(measured)
    on_gpu = device["type"] == "cuda"
    cores = plan.ranks if on_gpu else cores
    alone = measured[0]  # rank 0 measured the matmuls, the copy and the block alone
    sizes = sorted(alone["matmuls"]["rates"]["square"])  # the device's sizes (calibrate_device.matmul_sizes)
    square = {n: alone["matmuls"]["rates"]["square"][n] for n in sizes}
    gpt = {n: alone["matmuls"]["rates"]["gpt"][n] for n in sizes}
    combined = {n: (square[n] + gpt[n]) / 2 for n in sizes}
    peak = max(max(square.values()), max(gpt.values()))
    table = [[n, round(min(1.0, max(combined[n] / peak, 1e-6)), 6)] for n in sizes]
    launch_latency = alone["matmuls"]["launch_latency"]
    copy_bandwidth = alone["copy_bandwidth"]
    block = dict(alone["block"])

    collectives, links = {}, []
    if plan.ranks > 1:
        series = collective_points([r["host"] for r in measured])
        for kind in COLLECTIVE_KINDS:
            # all ranks in one group; p2p: the most pairs busy at once (every rank when the ranks are even)
            busy = max(key[2] for key in series if key[:2] == ("p2p", 2)) if kind == "p2p" else plan.ranks
            points = series[(kind, 2 if kind == "p2p" else plan.ranks, busy)]
            alpha, beta = fit_alpha_beta(points)
            collectives[kind] = {"ranks": plan.ranks if kind != "p2p" else 2, "alpha": alpha, "beta": beta,
                                 "points": points}
            links.append(link_from_fit(kind, collectives[kind]["ranks"], alpha, beta))
    if links:
        link_latency = statistics.median(latency for latency, _ in links)
        link_bandwidth = statistics.median(bandwidth for _, bandwidth in links)
        link_note = "median over the fitted collectives of the per-step latency and link bandwidth of a ring"
    else:
        link_latency, link_bandwidth = 0.0, copy_bandwidth / 2
        link_note = "not measured (one rank): a memory copy's bandwidth, no latency"

    try:
        memory = device["memory_bytes"] or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 2**34
    source = f"measured by minigpt calibrate on {date}"
    node, nic = f"{name}-node", f"{name}-loopback"
    backend = device["backend"]
    if on_gpu:
        about = (f"fp32 on {plan.ranks} CUDA GPU(s) {device['name']}, one rank per GPU, {backend} between them; "
                 f"peak_flops.fp32 is the best measured fp32 matmul rate (TF32 off while measuring: "
                 f"torch.backends.cuda.matmul.allow_tf32 = False), not the datasheet's; "
                 f"tf32, 16-bit and fp8 not measured")
        note = (f"{plan.ranks} rank(s), one CUDA GPU each ({device['name']}), {backend}: rank 0 measured the matmuls, "
                f"the copy and the block alone; the collectives ran with every rank busy; 'measured' holds the units, "
                f"the sharing (a GPU per rank: about 1) and the collectives by group size and load")
        peak_note = ("efficiency = measured rate / the best measured fp32 rate, TF32 off "
                     "(torch.backends.cuda.matmul.allow_tf32 = False while the matmuls ran)")
    else:
        about = (f"fp32 on the CPU, one rank on one of {cores} core(s) (up to {plan.ranks} ranks "
                 f"for the collectives and the sharing), {backend} between them; peak_flops.fp32 is the best measured "
                 f"matmul rate (a CPU has no datasheet peak here), tf32 = fp32 (no TF32 on a CPU), "
                 f"16-bit and fp8 not measured")
        note = (f"{plan.ranks} rank(s) on {cores} core(s): rank 0 measured the matmuls, the copy and the block "
                f"alone on one thread; the collectives ran on {plan.threads_per_rank} thread(s) per rank with "
                f"every rank busy; 'measured' holds the sharing and the collectives by group size and load")
        peak_note = "efficiency = measured rate / the best measured rate (the peak of a CPU profile)"
    gpu = {
        "source": f"{source}: {about}",
        "node": node,
        "peak_flops": {"fp32": peak, "tf32": None if on_gpu else peak, "bf16": None, "fp16": None, "fp8": None},
        "hbm_bytes": int(memory),
        "hbm_bandwidth": copy_bandwidth,
        "nvlink_bandwidth": link_bandwidth,
        "nvlink_latency": link_latency,
        "matmul_efficiency": {"launch_latency": launch_latency, "fp32": table},
        "calibration": {
            "date": date,
            "backend": backend,
            "device": "cuda" if on_gpu else "cpu",
            "device_name": device["name"],
            "device_requested": plan.device,
            "ranks": plan.ranks,
            "cores": cores,
            "threads_per_rank": plan.threads_per_rank,
            "ranks_per_core": plan.ranks / cores,
            "oversubscribed": plan.ranks * plan.threads_per_rank > cores,
            "load_average_1min": _load_average(),  # other work on the machine skews every number
            "note": note,
            "peak_note": peak_note,
            "links": link_note,
            "matmul_rates": {"square": {str(n): r for n, r in square.items()}, "gpt": {str(n): r for n, r in gpt.items()}},
            "block": block,
            "copy_bytes": copy_bytes(plan, torch.device(device["type"])),
            "plan": {**{k: v for k, v in asdict(plan).items()
                        if k not in ("ranks", "threads_per_rank", "cuda_matmul_sizes")}, "matmul_sizes": sizes},
            "phase_seconds": {k: round(v, 2) for k, v in measured[0]["host"]["seconds"].items()},
        },
        "measured": build_measured([r["host"] for r in measured], plan, fit_alpha_beta),
    }
    if collectives:
        gpu["collectives"] = collectives
    return {
        "about": f"hardware profile {name}: {source}",
        "gpus": {name: gpu},
        "nodes": {node: {"source": f"{source}: this machine; every local rank is one device of this node",
                         "gpus_per_node": max(64, plan.ranks), "nics_per_node": 1, "nvswitch": True, "nic": nic}},
        "nics": {nic: {"source": f"{source}: there is no network; set as the measured local links",
                       "bandwidth": link_bandwidth, "latency": link_latency, "switch_latency": 0.0,
                       "switch_radix": 64}},
    }
