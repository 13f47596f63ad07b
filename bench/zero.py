"""Our ZeRO stages against torch's own data parallelism, in one spawned group.

Not a test: it prints a table (and one JSON object with --json). Every run
trains the same model from the same seed on the same global batches, on the
same ranks and backend (gloo on CPU, NCCL when every rank has a GPU):

  minigpt zero0  against  torch DistributedDataParallel + torch.optim.AdamW (fp32)
  minigpt zero3  against  torch FSDP2 (fully_shard per block and on the root) + AdamW (fp32)
  minigpt zero1, zero2    for context (compared with DDP)

Every run is repeated --rounds times, the runs taking turns, so a change in the
machine's load falls on all of them. Per run: the median step time over the
--steps steps after --warmup warm-up steps of every round,
tokens/s, each rank's model-state memory (parameters + gradients + optimizer
states, from the live tensors), the communication buffers where known, and the
losses (ours and torch's should agree: same model, seed, batches and schedule).

    python bench/zero.py --model tiny --dp 2 --steps 20
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# `python bench/zero.py` puts bench/ first on sys.path, where a script named like one of our
# packages (a bench/precision.py once) would shadow it: imports come from the repository root.
_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_BENCH_DIR)] + [p for p in sys.path if os.path.abspath(p or ".") != _BENCH_DIR]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from minigpt.presets import preset  # noqa: E402
from minigpt.data import BatchLayout, Corpus, get_batch  # noqa: E402
from minigpt.errors import ConfigError  # noqa: E402
from minigpt.model import GPT  # noqa: E402
from parallel.device import describe_device, synchronize  # noqa: E402
from parallel.launch.elastic import finish_worker, init_worker, launch  # noqa: E402
from parallel.run.train import train_on_rank  # noqa: E402
from job.train_config import TrainConfig  # noqa: E402

# The order the runs go in: each of ours right before the torch run it is compared with.
RUNS = ("zero0", "ddp", "zero3", "fsdp2", "zero1", "zero2")
BASELINE_OF = {"zero0": "ddp", "zero1": "ddp", "zero2": "ddp", "zero3": "fsdp2"}
STATE_ROLES = ("parameters", "gradients", "optimizer")


@dataclasses.dataclass(frozen=True)
class Job:
    cfg: TrainConfig  # the shared settings; `zero` is set per run
    warmup: int
    rounds: int
    runs: tuple[str, ...]
    out_dir: str
    device: str  # "auto", "cpu" or "cuda"


# ---------------------------------------------------------------- ours


def dp_counters(comm: dict) -> dict:
    """The data-parallel group's counters ({kind: {bytes, volume, calls}}), whether the
    summary keeps them per group ({"dp": ..., "tp": ...}) or, for a dp-only run, flat."""
    return comm["dp"] if isinstance(comm.get("dp"), dict) and "calls" not in comm["dp"] else comm


def run_ours(cfg: TrainConfig, device: torch.device, warmup: int) -> dict | None:
    """train_on_rank as `minigpt train` runs it; rank 0 reads back its per-step log."""
    summary = train_on_rank(cfg, device)
    if summary is None:
        return None
    records = [json.loads(line) for line in Path(cfg.out_dir, "metrics.jsonl").read_text().splitlines()]
    memory = []
    for rank in summary["memory_per_rank"]:
        memory.append(
            {
                "parameters": rank["parameters"],
                "gradients": rank["gradients"],
                "optimizer": rank["master_weights"] + rank["adam_m"] + rank["adam_v"],
                "comm_buffers": rank["comm_buffers"],
            }
        )
    return {
        "step_times_s": [r["step_time_s"] for r in records][warmup:],
        "losses": summary["losses"],
        "memory_per_rank": memory,
        "comm_per_step": dp_counters(summary["comm_bytes_per_step"]),
        "comm_buffers_note": "peak of our buckets, staging and gathered units",
        "peak_memory_bytes": summary["peak_memory_bytes"],
    }


# ---------------------------------------------------------------- torch's


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds for a tensor (a DTensor's local shard)."""
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def torch_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    params = list(model.parameters())  # a tied weight once
    optimizer_bytes = sum(
        local_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    return {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": optimizer_bytes,
    }


def build_torch(kind: str, cfg: TrainConfig, device: torch.device):
    """(model to call, plain model, optimizer): the GPT from cfg.seed wrapped by DDP or FSDP2."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(device)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=cfg.bucket_mb,  # the same bucket size as ours, first bucket included
        )
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    # Weight decay where ours applies it (precision/flat.py): matrices and embeddings, not norms or biases.
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    return wrapped, model, optimizer


def run_torch(kind: str, cfg: TrainConfig, device: torch.device, warmup: int) -> dict | None:
    """The same steps as train_on_rank (fp32, one micro-batch): batches, schedule, clipping."""
    corpus = Corpus.load(cfg.data, cfg.model.seq_len)
    wrapped, model, optimizer = build_torch(kind, cfg, device)
    layout = BatchLayout(cfg.global_batch, cfg.micro_batches, cfg.dp)
    rank, size = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # where train_on_rank resets it: model and optimizer built
    step_times, losses = [], []
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = cfg.learning_rate(step)
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        x, y = get_batch(corpus.train, cfg.model.seq_len, layout, cfg.seed, step, 0, rank)
        loss = wrapped(x.to(device), y.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        loss_value = loss.item()
        synchronize(device)
        step_times.append(time.perf_counter() - start)
        mean = torch.tensor([loss_value], dtype=torch.float64, device=device)  # outside the timing, as ours
        dist.all_reduce(mean)
        losses.append(float(mean[0]) / size)
    memory = torch_memory(model, optimizer)
    if kind == "ddp":
        logged = wrapped._get_ddp_logging_data()
        memory["comm_buffers"] = sum(int(s) for s in str(logged.get("bucket_sizes", "0")).split(",") if s)
        note = "DDP's reducer buckets: the bucket bytes DDP logs at construction (all parameters once), not measured"
    else:
        memory["comm_buffers"] = None
        note = "not measured (FSDP2's all-gather and reduce-scatter buffers)"
    memory_per_rank: list = [None] * size
    dist.all_gather_object(memory_per_rank, memory)
    if rank != 0:
        return None
    return {
        "step_times_s": step_times[warmup:],
        "losses": losses,
        "memory_per_rank": memory_per_rank,
        "comm_per_step": None,
        "comm_buffers_note": note,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


# ---------------------------------------------------------------- the group


def bench_worker(job: Job) -> dict | None:
    """Every run, in rounds, in this one spawned group; rank 0 returns the results.

    The runs take turns (round 1: every run, round 2: every run again, ...), so a change
    in the machine's load during the benchmark falls on all of them alike.
    """
    device = init_worker(None if job.device == "auto" else job.device)
    try:
        results: dict[str, dict] = {}
        for round_index in range(job.rounds):
            for name in job.runs:
                if name.startswith("zero"):
                    out_dir = os.path.join(job.out_dir, f"{name}-{round_index}")
                    cfg = dataclasses.replace(job.cfg, zero=int(name[4:]), device=device.type, out_dir=out_dir)
                    result = run_ours(cfg, device, job.warmup)
                else:
                    result = run_torch(name, job.cfg, device, job.warmup)
                dist.barrier()
                if result is None:
                    continue
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if name not in results:
                    results[name] = result
                else:  # same losses every round (deterministic); the step times pool
                    results[name]["step_times_s"] += result["step_times_s"]
        if dist.get_rank() != 0:
            return None
        return {"device": describe_device(device), "backend": dist.get_backend(), "results": results}
    finally:
        finish_worker()


def summarize(name: str, result: dict, tokens_per_step: int) -> dict:
    step = statistics.median(result["step_times_s"])
    memory = result["memory_per_rank"]
    states = max(sum(rank[role] for role in STATE_ROLES) for rank in memory)
    buffers = [rank["comm_buffers"] for rank in memory]
    return {
        "run": name,
        "step_ms": step * 1000,
        "step_ms_min": min(result["step_times_s"]) * 1000,
        "tokens_per_s": tokens_per_step / step,
        "model_state_bytes": states,
        "memory_rank0": {role: memory[0][role] for role in STATE_ROLES},
        "comm_buffer_bytes": None if None in buffers else max(buffers),
        "comm_buffers_note": result["comm_buffers_note"],
        "comm_per_step": result["comm_per_step"],
        "peak_memory_bytes": result["peak_memory_bytes"],  # CUDA only: rank 0's allocator peak
        "first_loss": result["losses"][0],
        "last_loss": result["losses"][-1],
        "losses": result["losses"],
    }


def compare(rows: dict[str, dict]) -> None:
    """Ratios ours/theirs and the largest loss difference over the steps."""
    for name, row in rows.items():
        base = rows.get(BASELINE_OF.get(name, ""))
        if base is None:
            continue
        row["baseline"] = base["run"]
        row["step_time_ratio"] = row["step_ms"] / base["step_ms"]
        row["memory_ratio"] = row["model_state_bytes"] / base["model_state_bytes"]
        row["max_loss_gap"] = max(abs(a - b) for a, b in zip(row["losses"], base["losses"]))
        row["last_loss_gap"] = abs(row["last_loss"] - base["last_loss"])


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.2f}"


def fmt(row: dict, key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else ""


def print_table(header: dict, rows: dict[str, dict]) -> None:
    print(" ".join(f"{k}={v}" for k, v in header.items()))
    print(
        f"{'run':<7} {'step ms':>8} {'min ms':>7} {'tokens/s':>9} {'states MiB':>10} {'params':>7} {'grads':>7} "
        f"{'optim':>7} {'comm MiB':>8} {'vs':>6} {'time x':>7} {'mem x':>6} {'last loss':>9} {'dlast':>7} "
        f"{'max dloss':>9}"
    )
    for row in rows.values():
        memory = row["memory_rank0"]
        ratio = row.get("baseline")
        print(
            f"{row['run']:<7} {row['step_ms']:8.1f} {row['step_ms_min']:7.1f} {row['tokens_per_s']:9,.0f} "
            f"{mib(row['model_state_bytes']):>10} {mib(memory['parameters']):>7} {mib(memory['gradients']):>7} "
            f"{mib(memory['optimizer']):>7} "
            f"{mib(row['comm_buffer_bytes']):>8} {ratio or '':>6} "
            f"{fmt(row, 'step_time_ratio', '.2f'):>7} {fmt(row, 'memory_ratio', '.2f'):>6} "
            f"{row['last_loss']:9.4f} {fmt(row, 'last_loss_gap', '.0e'):>7} {fmt(row, 'max_loss_gap', '.1e'):>9}"
        )
    print(
        "step ms: median over every timed step of every round; states: parameters + gradients + optimizer "
        "states, MiB, the largest rank; params/grads/optim: rank 0; time x, mem x: ours / theirs; "
        "dlast, max dloss: |loss difference| at the last step and the largest over all steps"
    )
    print("\nour collectives in one step (calls, MiB of buffer):")
    for row in rows.values():
        if row["comm_per_step"]:
            parts = [f"{kind} {c['calls']}x {c['bytes'] / 2**20:.2f}" for kind, c in row["comm_per_step"].items()]
            print(f"  {row['run']:<6} " + ", ".join(parts))
    for row in rows.values():
        if not row["run"].startswith("zero"):
            print(f"comm buffers of {row['run']}: {row['comm_buffers_note']}")
    if any(row["peak_memory_bytes"] for row in rows.values()):
        peaks = ", ".join(f"{row['run']} {mib(row['peak_memory_bytes'])}" for row in rows.values())
        print(f"CUDA peak allocated on rank 0, MiB: {peaks}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a preset of minigpt/config.py")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks (processes)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    parser.add_argument("--rounds", type=int, default=2, help="times every run is repeated, taking turns")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    parser.add_argument(
        "--bucket-mb", type=float, default=TrainConfig.bucket_mb,
        help="gradient bucket size, MiB, of ours and of DDP (default: ours, which is DDP's default cap)",
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--runs", default=",".join(RUNS), help=f"a subset of {','.join(RUNS)}")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        runs = tuple(name for name in RUNS if name in args.runs.split(","))
        unknown = set(args.runs.split(",")) - set(RUNS)
        if unknown or not runs:
            raise ConfigError(f"--runs takes names from {','.join(RUNS)}, got {args.runs!r}")
        if args.dp < 2:
            raise ConfigError(f"--dp must be at least 2 (DDP and FSDP2 need a group), got {args.dp}")
        if args.warmup < 0 or args.steps < 1 or args.rounds < 1:
            raise ConfigError("--steps and --rounds must be >= 1 and --warmup >= 0")
        model = preset(args.model)
        cfg = TrainConfig(
            model=model, steps=args.warmup + args.steps, global_batch=args.batch_size, dp=args.dp,
            eval_every=0, eval_batches=1, bucket_mb=args.bucket_mb, device=args.device,
        )
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // args.dp)
    with tempfile.TemporaryDirectory(prefix="minigpt-bench-zero-") as out_dir:
        job = Job(cfg=cfg, warmup=args.warmup, rounds=args.rounds, runs=runs, out_dir=out_dir, device=args.device)
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        report = launch(bench_worker, job, args.dp, threads_per_rank=threads)
        wall = time.perf_counter() - started
        load_after = os.getloadavg()[0]
    rows = {name: summarize(name, result, cfg.tokens_per_step) for name, result in report["results"].items()}
    compare(rows)
    header = {
        "device": report["device"],
        "backend": report["backend"],
        "torch": torch.__version__,
        "model": args.model,
        "params": model.n_params(),
        "dp": args.dp,
        "threads_per_rank": threads,
        "global_batch": args.batch_size,
        "tokens_per_step": cfg.tokens_per_step,
        "steps": f"{args.rounds}x({args.warmup}+{args.steps})",
        "bucket_mb": args.bucket_mb,
        "wall_s": round(wall, 1),
        "load_1min": f"{load_before:.1f}->{load_after:.1f}",
    }
    if args.json:
        print(json.dumps({**header, "rows": list(rows.values())}))
    else:
        print_table(header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
