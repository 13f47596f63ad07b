"""The training loop: one loop for every layout.

`train` starts tp x pp x dp workers through torch's launcher (or runs in this
process for a 1 x 1 x 1 layout, or joins the job when torchrun started us);
every worker runs `train_on_rank`: build the mesh, the model in its precision,
its data-parallel wrapper (ZeRO stage) and the master-weight optimizer, then
step. Rank 0 logs, writes the run directory and returns the summary.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from minigpt.data import BatchLayout, Corpus, get_batch, validation_batches
from minigpt.errors import TrainingError
from parallel.build import Rank, build_rank
from parallel.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from parallel.device import describe_device, measure_peak_flops, synchronize
from parallel.launch import finish_worker, init_worker, launch
from parallel.memory import ActivationMeter
from parallel.mesh import Mesh, build_mesh
from parallel.run_files import RunFiles, default_run_dir
from parallel.trace import Trace, breakdown, write_chrome_trace
from parallel.train_config import TrainConfig
from precision.compute import dtype_of, needs_emulation
from precision.optimizer import MasterAdamW, state_bytes
from precision.policy import TEXTBOOK_MIXED_ADAM, policy as precision_policy

StepLog = Callable[[dict], None]


def train(cfg: TrainConfig, on_step: StepLog | None = None) -> dict:
    """Train for cfg.steps on every rank of the layout; rank 0's summary.

    `on_step` is called on rank 0 after every step; with more than one process
    it must be picklable (a module-level function or class instance).
    """
    if cfg.out_dir is None:
        cfg = dataclasses.replace(cfg, out_dir=str(default_run_dir(cfg)))
    return launch(run_worker, (cfg, on_step), cfg.world_size, threads_per_rank=cfg.threads_per_rank or 1)


def run_worker(args: tuple[TrainConfig, StepLog | None]) -> dict | None:
    cfg, on_step = args
    device = init_worker(None if cfg.device == "auto" else cfg.device)
    if cfg.threads_per_rank:
        torch.set_num_threads(cfg.threads_per_rank)
    try:
        return train_on_rank(cfg, device, on_step)
    finally:
        finish_worker()


def mean_over(group, value: float, size: int) -> float:
    """The mean of a Python number over a group (not counted as training traffic)."""
    if group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, group=group)
    return float(tensor[0]) / size


def evaluate(rank: Rank, corpus: Corpus, cfg: TrainConfig, device: torch.device) -> float:
    """Validation loss on fixed batches; every rank runs it (the pipeline and ZeRO-3 need all of them)."""
    rank.stage.eval()
    batch = max(1, cfg.global_batch // cfg.micro_batches)  # the same batches whatever the layout
    losses = [
        rank.executor.evaluate(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
        for x, y in validation_batches(corpus.val, cfg.model.seq_len, batch, cfg.eval_batches, cfg.seed)
    ]
    rank.stage.train()
    rank.data_parallel.end_step()
    return sum(losses) / len(losses)


def micro_batches(corpus: Corpus, cfg: TrainConfig, step: int, dp_rank: int, device: torch.device):
    """This data-parallel rank's inputs and targets of every micro-batch of a step."""
    layout = BatchLayout(cfg.global_batch, cfg.micro_batches, cfg.dp)
    inputs, targets = [], []
    for micro in range(cfg.micro_batches):
        x, y = get_batch(corpus.train, cfg.model.seq_len, layout, cfg.seed, step, micro, dp_rank)
        inputs.append(torch.from_numpy(x).to(device))
        targets.append(torch.from_numpy(y).to(device))
    return inputs, targets


def train_on_rank(cfg: TrainConfig, device: torch.device, on_step: StepLog | None = None) -> dict | None:
    mesh = build_mesh(cfg.pp, cfg.dp, cfg.tp, device)
    corpus = Corpus.load(cfg.data, cfg.model.seq_len)
    policy = precision_policy(cfg.precision)
    rank = build_rank(cfg, mesh, device, policy)
    data_parallel, optimizer, scaler = rank.data_parallel, rank.optimizer, rank.scaler
    # Emulated 16-bit matmuls run as fp32 matmuls, so the CPU's fp32 rate is their peak.
    peak_dtype = torch.float32 if needs_emulation(policy, device) else dtype_of(policy.compute)
    peak_flops = measure_peak_flops(device, peak_dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    flops_per_token = cfg.model.train_flops_per_token()
    activations = ActivationMeter(device, data_parallel.parameter_storages)
    is_logger = mesh.rank == 0
    start_step = 0
    if cfg.resume:
        start_step = load_checkpoint(latest_checkpoint(cfg.checkpoint_dir), rank, cfg)["step"]
    run = RunFiles(Path(cfg.out_dir), resume=cfg.resume) if is_logger else None
    if run:
        run.write_json("config.json", {"train": cfg.as_dict(), "data": corpus.source})

    def scale(loss: torch.Tensor) -> torch.Tensor:
        return scaler.scale_loss(loss) if scaler else loss

    losses, step_times, val_history, comm_per_step, trace = [], [], [], {}, Trace(mesh.rank)
    try:
        for step in range(start_step, cfg.steps):
            lr = cfg.learning_rate(step)
            for comm in rank.comms.values():
                comm.reset_counters()
            inputs, targets = micro_batches(corpus, cfg, step, mesh.dp_rank, device)
            synchronize(device)
            start = time.perf_counter()
            data_parallel.begin_step()
            record = rank.executor.run_step(inputs, targets, scale, activations if step == 0 else None)
            dp_start = time.perf_counter()
            tp_seconds = rank.comms["tp"].seconds  # inside the compute actions (Megatron's collectives block)
            grads = data_parallel.finish_grads()
            result = optimizer.step(
                grads, lr, grad_clip=cfg.grad_clip, scaler=scaler,
                reduce_sum=rank.reduce_sum,
            )
            if not result.skipped:
                data_parallel.after_update()
            data_parallel.end_step()
            synchronize(device)
            end = time.perf_counter()
            record.events.append(("GradReduce+OptimizerStep", "dp", dp_start, end))
            trace.add_step(step, start, end, record.events, tp_seconds)
            step_time = end - start
            comm_per_step = {dim: comm.counters() for dim, comm in rank.comms.items()}

            loss_value = mean_over(mesh.group("pp"), record.loss_sum / cfg.micro_batches, 1)
            loss_value = mean_over(mesh.group("dp"), loss_value, mesh.dp)
            if scaler is None and (result.skipped or not math.isfinite(loss_value)):
                raise TrainingError(
                    f"step {step}: the loss is {loss_value} and the gradients are "
                    f"{'not finite' if result.skipped else 'finite'} under {policy.name}: "
                    f"lower --lr or use another precision"
                )
            losses.append(loss_value)
            step_times.append(step_time)
            tokens_per_s = cfg.tokens_per_step / step_time
            record_out = {
                "step": step,
                "loss": loss_value,
                "lr": lr,
                "grad_norm": result.grad_norm,
                "loss_scale": result.loss_scale,
                "skipped": result.skipped,
                "step_time_s": step_time,
                "tokens_per_s": tokens_per_s,
                "mfu": flops_per_token * tokens_per_s / (peak_flops * cfg.world_size),
            }
            if (step + 1) % cfg.eval_interval == 0 or step == cfg.steps - 1:
                record_out["val_loss"] = evaluate(rank, corpus, cfg, device)
                val_history.append({"step": step, "val_loss": record_out["val_loss"]})
            if cfg.save_every and ((step + 1) % cfg.save_every == 0 or step == cfg.steps - 1):
                record_out["checkpoint"] = str(save_checkpoint(cfg.checkpoint_dir, rank, cfg, step + 1))
            if run:
                run.log(record_out)
                if on_step is not None:
                    on_step(record_out)
    finally:
        if run:
            run.close()

    memory = rank_memory(data_parallel, optimizer, activations)
    memory_per_rank = gather_from_all(mesh, memory)
    timelines = gather_from_all(mesh, trace.as_dict())
    if not is_logger:
        return None
    trace_path = write_chrome_trace(Path(cfg.out_dir) / "trace.json", timelines)
    step_time_s = statistics.median(step_times)
    tokens_per_s = cfg.tokens_per_step / step_time_s
    finite = [loss for loss in losses if math.isfinite(loss)]
    tail = finite[-min(20, len(finite)) :] or [math.nan]
    summary = {
        "config": cfg.as_dict(),
        "data": corpus.source,
        "device": describe_device(device),
        "world_size": cfg.world_size,
        "layout": {
            "tp": cfg.tp,
            "pp": cfg.pp,
            "dp": cfg.dp,
            "zero": data_parallel.stage,
            "sequence_parallel": cfg.sequence_parallel,
            "schedule": cfg.schedule,
            "virtual_chunks": cfg.virtual_chunks,
        },
        "precision": policy.as_dict(),
        "compute_path": "emulated on CPU (16-bit storage, fp32 accumulation)"
        if needs_emulation(policy, device)
        else "native",
        "n_params": cfg.model.n_params(),
        "first_step": start_step,
        "losses": losses,
        "final_loss": sum(tail) / len(tail),
        "val_loss": val_history[-1]["val_loss"],
        "val_history": val_history,
        "skipped_steps": scaler.skipped_steps if scaler else 0,
        "loss_scale": scaler.scale if scaler else None,
        "bytes_per_param": {
            "measured": bytes_per_param(memory, cfg.model.n_params()),
            "policy": policy.bytes_per_param(),
            "textbook_mixed_adam": TEXTBOOK_MIXED_ADAM,
        },
        "memory_per_rank": memory_per_rank,
        "comm_bytes_per_step": comm_per_step,
        "time_breakdown": breakdown(timelines),
        "trace": str(trace_path),
        "step_time_s": step_time_s,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "peak_flops": peak_flops,
        "peak_flops_dtype": str(peak_dtype).removeprefix("torch."),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "mfu": flops_per_token * tokens_per_s / (peak_flops * cfg.world_size),
        "run_dir": str(run.path),
    }
    run.write_json("summary.json", summary)
    return summary


def rank_memory(data_parallel, optimizer: MasterAdamW, activations: ActivationMeter) -> dict:
    """This rank's bytes by category, measured from the live tensors."""
    held = data_parallel.memory()
    states = state_bytes(optimizer)
    return {
        "parameters": held["parameters"],
        "gradients": held["gradients"],
        "master_weights": states.get("master", 0),
        "adam_m": states["adam_m"],
        "adam_v": states["adam_v"],
        "activations": activations.bytes,
        "comm_buffers": held["comm_buffers"],
    }


def bytes_per_param(memory: dict, n_params: int) -> dict[str, float]:
    """Rank 0's model-state bytes per model parameter, by role (for the single-rank view)."""
    return {
        "compute": memory["parameters"] / n_params,
        "grad": memory["gradients"] / n_params,
        "master": memory["master_weights"] / n_params,
        "adam_m": memory["adam_m"] / n_params,
        "adam_v": memory["adam_v"] / n_params,
    }


def gather_from_all(mesh: Mesh, value: dict) -> list[dict]:
    if mesh.world_size == 1:
        return [value]
    values: list = [None] * mesh.world_size
    dist.all_gather_object(values, value)
    return values
