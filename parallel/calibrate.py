"""`minigpt calibrate`'s measurements: this machine's matmuls, memory copy, one block, and collectives.

Rank 0 (of ranks started through parallel.launch.launch, gloo on the CPU) measures the
matmuls, the copy and the block alone on one thread while the others wait: one device's
own numbers, which the simulator slows by the measured cost of sharing cores for a job
with more ranks. Then parallel/calibrate_host.py measures the "measured" field (the model's pieces alone,
the cost of sharing cores, and collectives by group size and load), which also gives the
whole-world collectives below.

- matmuls: fp32, square (n x n) @ (n x n) and GPT-shaped (2n x n) @ (n x 4n) (tokens x d @ d x 4d,
  the fc1 shape), the median of `repeats` timed runs each; the efficiency at smallest side n is
  the mean of both shapes' rates over the peak. A CPU has no datasheet peak here, so the
  "peak" is the best rate measured (efficiency 1.0 at the best point, by construction).
- launch latency: the median time of an 8 x 8 matmul.
- memory bandwidth: a large tensor copy, (read + write bytes) / seconds, as compute.py's
  roofline counts bytes moved.
- one block of the model preset (tiny by default) at its shape: forward and backward seconds.
- collectives (ranks >= 2): all-reduce, all-gather, reduce-scatter (through parallel/comm.py's
  Collectives) among all ranks and p2p (ping-pong inside rank pairs, every pair at once, half
  the round trip) by message size S (the full buffer, comm.py's convention): calibrate_host's
  points with every rank busy; each is the slowest rank's median. A least-squares line
  t = alpha + beta * S per collective is fitted in `fit_alpha_beta`.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from minigpt.errors import ConfigError
from parallel.calibrate_host import build_measured, collective_points, measure_host
from parallel.launch import finish_worker, init_worker, launch

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True)
class CalibrationPlan:
    ranks: int = 8
    threads_per_rank: int = 1
    matmul_sizes: tuple[int, ...] = (64, 128, 256, 512, 1024)
    repeats: int = 5
    min_run_s: float = 0.02  # each timed run repeats the operation until it lasts about this long
    copy_bytes: int = 256 * 2**20
    message_bytes: tuple[int, ...] = (4 * 2**10, 32 * 2**10, 256 * 2**10, 2 * 2**20, 8 * 2**20)
    comm_repeats: int = 5
    model: str = "tiny"
    micro_batch: int = 8
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16)  # the host units' micro-batch sizes
    sharing_micro_batch: int = 8


def make_plan(ranks: int, quick: bool = False, threads_per_rank: int | None = None, model: str = "tiny",
              micro_batch: int = 8) -> CalibrationPlan:
    """The measurements of one calibration; ConfigError on bad input (before any rank starts)."""
    for name, value in (("--ranks", ranks), ("--micro-batch", micro_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if threads_per_rank is not None and (isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int)
                                         or threads_per_rank < 1):
        raise ConfigError(f"--threads-per-rank must be a positive integer, got {threads_per_rank!r}")
    from minigpt.config import preset

    preset(model)  # ConfigError for an unknown preset
    threads = threads_per_rank or (1 if ranks > 1 else torch.get_num_threads())
    if quick:
        return CalibrationPlan(ranks, threads, (64, 256, 512), 3, 0.005, 16 * 2**20,
                               (4 * 2**10, 256 * 2**10, 8 * 2**20), 3, model, micro_batch, (1, 4, 16))
    return CalibrationPlan(ranks, threads, model=model, micro_batch=micro_batch)


def calibrate(plan: CalibrationPlan) -> dict:
    """Run the measurements on plan.ranks local ranks; every rank's raw measurements, by rank."""
    return launch(measure_rank, plan, plan.ranks, threads_per_rank=plan.threads_per_rank)


# ---------------------------------------------------------------- one rank


def _timed(fn, min_run_s: float, repeats: int) -> float:
    """Median seconds of one fn() call: `repeats` runs of enough calls to last min_run_s each."""
    fn()  # warm-up
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(min_run_s / once))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs)


def measure_matmuls(plan: CalibrationPlan) -> dict:
    """FLOP/s by smallest side, per shape, and the per-call latency."""
    rates: dict[str, dict[int, float]] = {"square": {}, "gpt": {}}
    torch.manual_seed(0)
    for n in plan.matmul_sizes:
        for shape, (m, k, cols) in (("square", (n, n, n)), ("gpt", (2 * n, n, 4 * n))):
            a, b = torch.randn(m, k), torch.randn(k, cols)
            out = torch.empty(m, cols)
            seconds = _timed(lambda: torch.mm(a, b, out=out), plan.min_run_s, plan.repeats)
            rates[shape][n] = 2 * m * k * cols / seconds
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    latency = _timed(lambda: torch.mm(a, b), plan.min_run_s, plan.repeats)
    return {"rates": rates, "launch_latency": latency}


def measure_copy(plan: CalibrationPlan) -> float:
    """Bytes per second moved by a large copy (read + write)."""
    src = torch.randn(plan.copy_bytes // 4)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), plan.min_run_s, plan.repeats)
    return 2 * plan.copy_bytes / seconds


def measure_block(plan: CalibrationPlan) -> dict:
    """Forward and backward seconds of one block of plan.model at its shape, fp32."""
    from minigpt.config import preset
    from minigpt.model import Block

    config = preset(plan.model)
    torch.manual_seed(0)
    block = Block(config)
    x = torch.randn(plan.micro_batch, config.seq_len, config.d_model, requires_grad=True)
    forwards, backwards = [], []
    for i in range(plan.repeats + 1):
        start = time.perf_counter()
        out = block(x)
        middle = time.perf_counter()
        out.sum().backward()
        end = time.perf_counter()
        if i:  # the first is a warm-up
            forwards.append(middle - start)
            backwards.append(end - middle)
        block.zero_grad(set_to_none=True)
        x.grad = None
    return {"model": plan.model, "micro_batch": plan.micro_batch, "seq_len": config.seq_len,
            "d_model": config.d_model, "forward_s": statistics.median(forwards),
            "backward_s": statistics.median(backwards)}


def measure_rank(plan: CalibrationPlan) -> list[dict] | None:
    """One rank's part: every measurement; rank 0 returns every rank's, the others None."""
    init_worker("cpu")
    try:
        if plan.ranks == 1:
            saved = torch.get_num_threads()
            torch.set_num_threads(plan.threads_per_rank)
        try:
            # Rank 0 alone measures the matmuls, the copy and the block (the others wait in a barrier,
            # which takes no CPU): a device's own numbers. What sharing costs is measured apart
            # (calibrate_host's "sharing"), and the simulator applies it to the job's ranks.
            start = time.perf_counter()
            result = {}
            if not dist.is_initialized() or dist.get_rank() == 0:
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                try:
                    result = {"matmuls": measure_matmuls(plan), "copy_bandwidth": measure_copy(plan),
                              "block": measure_block(plan)}
                finally:
                    torch.set_num_threads(threads)
            if dist.is_initialized():
                dist.barrier()
            compute_s = time.perf_counter() - start
            result["host"] = measure_host(plan)  # starts with a barrier
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


def build_profile(measured: list[dict], plan: CalibrationPlan, name: str, cores: int, date: str) -> dict:
    """The hardware profile (hardware.json's schema, one GPU) from every rank's measurements."""
    sizes = plan.matmul_sizes
    alone = measured[0]  # rank 0 measured the matmuls, the copy and the block alone
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
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 2**34
    source = f"measured by minigpt calibrate on {date}"
    node, nic = f"{name}-node", f"{name}-loopback"
    gpu = {
        "source": (f"{source}: fp32 on the CPU, one rank on one of {cores} core(s) (up to {plan.ranks} ranks "
                   f"for the collectives and the sharing); peak_flops.fp32 is the best measured matmul rate (a CPU has no "
                   f"datasheet peak here), tf32 = fp32 (no TF32 on a CPU), 16-bit and fp8 not measured"),
        "node": node,
        "peak_flops": {"fp32": peak, "tf32": peak, "bf16": None, "fp16": None, "fp8": None},
        "hbm_bytes": int(memory),
        "hbm_bandwidth": copy_bandwidth,
        "nvlink_bandwidth": link_bandwidth,
        "nvlink_latency": link_latency,
        "matmul_efficiency": {"launch_latency": launch_latency, "fp32": table},
        "calibration": {
            "date": date,
            "backend": "gloo",
            "ranks": plan.ranks,
            "cores": cores,
            "threads_per_rank": plan.threads_per_rank,
            "ranks_per_core": plan.ranks / cores,
            "oversubscribed": plan.ranks * plan.threads_per_rank > cores,
            "load_average_1min": _load_average(),  # other work on the machine skews every number
            "note": (f"{plan.ranks} rank(s) on {cores} core(s): rank 0 measured the matmuls, the copy and the block "
                     f"alone on one thread; the collectives ran on {plan.threads_per_rank} thread(s) per rank with "
                     f"every rank busy; 'measured' holds the sharing and the collectives by group size and load"),
            "peak_note": "efficiency = measured rate / the best measured rate (the peak of a CPU profile)",
            "links": link_note,
            "matmul_rates": {"square": {str(n): r for n, r in square.items()}, "gpt": {str(n): r for n, r in gpt.items()}},
            "block": block,
            "copy_bytes": plan.copy_bytes,
            "plan": {k: v for k, v in asdict(plan).items() if k not in ("ranks", "threads_per_rank")},
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
