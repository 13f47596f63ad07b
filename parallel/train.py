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
from minigpt.model import GPT
from parallel.comm import Collectives
from parallel.device import describe_device, measure_peak_flops, synchronize
from parallel.launch import finish_worker, init_worker, launch
from parallel.memory import ActivationMeter
from parallel.mesh import Mesh, build_mesh
from parallel.run_files import RunFiles, default_run_dir
from parallel.tensor import parallelize
from parallel.train_config import TrainConfig
from parallel.zero import make_data_parallel
from precision.compute import apply_precision, dtype_of, needs_emulation
from precision.optimizer import MasterAdamW, state_bytes
from precision.policy import TEXTBOOK_MIXED_ADAM, policy as precision_policy
from precision.scaler import LossScaler

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


def make_scaler(cfg: TrainConfig, loss_scaling: bool) -> LossScaler | None:
    if not loss_scaling:
        return None
    if cfg.loss_scale is not None:
        return LossScaler.static(cfg.loss_scale)
    return LossScaler(growth_interval=cfg.loss_scale_window)


def mean_over(group, value: float, size: int) -> float:
    """The mean of a Python number over a group (not counted as training traffic)."""
    if group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, group=group)
    return float(tensor[0]) / size


@torch.no_grad()
def evaluate(model: GPT, corpus: Corpus, cfg: TrainConfig, device: torch.device) -> float:
    """Validation loss on fixed batches; every rank runs it (ZeRO-3 needs all of them)."""
    model.eval()
    batch = max(1, cfg.global_batch // (cfg.micro_batches * cfg.dp))
    losses = [
        model(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)).item()
        for x, y in validation_batches(corpus.val, cfg.model.seq_len, batch, cfg.eval_batches, cfg.seed)
    ]
    model.train()
    return sum(losses) / len(losses)


def train_on_rank(cfg: TrainConfig, device: torch.device, on_step: StepLog | None = None) -> dict | None:
    mesh = build_mesh(cfg.pp, cfg.dp, cfg.tp, device)
    corpus = Corpus.load(cfg.data, cfg.model.seq_len)
    policy = precision_policy(cfg.precision)
    torch.manual_seed(cfg.seed)
    model = apply_precision(GPT(cfg.model), policy, device)  # built on the CPU in fp32, then cast
    tp_comm = Collectives(mesh.group("tp"), "tp")
    replicated = parallelize(model, tp_comm, cfg.sequence_parallel)
    dp_comm = Collectives(mesh.group("dp"), "dp")
    bucket_numel = max(1, int(cfg.bucket_mb * 2**20) // dtype_of(policy.compute).itemsize)
    data_parallel = make_data_parallel(cfg.zero, model, dp_comm, bucket_numel)
    optimizer = MasterAdamW(
        data_parallel.weights,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        weight_decay=cfg.weight_decay,
        decay_ranges=data_parallel.decay_ranges,
        masters_are_weights=policy.master is None,
        shared_ranges=data_parallel.ranges_of(replicated),
        shared_copies=mesh.tp,
    )
    scaler = make_scaler(cfg, policy.loss_scaling)
    layout = BatchLayout(cfg.global_batch, cfg.micro_batches, cfg.dp)
    # Emulated 16-bit matmuls run as fp32 matmuls, so the CPU's fp32 rate is their peak.
    peak_dtype = torch.float32 if needs_emulation(policy, device) else dtype_of(policy.compute)
    peak_flops = measure_peak_flops(device, peak_dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    flops_per_token = cfg.model.train_flops_per_token()
    activations = ActivationMeter(device, data_parallel.parameter_storages)
    is_logger = mesh.rank == 0
    run = RunFiles(Path(cfg.out_dir)) if is_logger else None
    if run:
        run.write_json("config.json", {"train": cfg.as_dict(), "data": corpus.source})

    losses, step_times, val_history, comm_per_step = [], [], [], {}
    try:
        for step in range(cfg.steps):
            lr = cfg.learning_rate(step)
            dp_comm.reset_counters()
            tp_comm.reset_counters()
            synchronize(device)
            start = time.perf_counter()
            data_parallel.begin_step()
            loss_sum = 0.0
            for micro in range(cfg.micro_batches):
                data_parallel.begin_micro_batch(last=micro == cfg.micro_batches - 1)
                x, y = get_batch(corpus.train, cfg.model.seq_len, layout, cfg.seed, step, micro, mesh.dp_rank)
                x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
                if step == 0 and micro == 0:
                    with activations.measure_forward():
                        loss = model(x, y)
                else:
                    loss = model(x, y)
                scaled = loss / cfg.micro_batches
                (scaler.scale_loss(scaled) if scaler else scaled).backward()
                data_parallel.end_micro_batch()
                loss_sum += loss.item()
            grads = data_parallel.finish_grads()
            result = optimizer.step(
                grads,
                lr,
                grad_clip=cfg.grad_clip,
                scaler=scaler,
                reduce_max=lambda value: tp_comm.max(data_parallel.reduce_max(value)),
                reduce_sum=lambda value: tp_comm.sum(data_parallel.reduce_sum(value)),
            )
            if not result.skipped:
                data_parallel.after_update()
            data_parallel.end_step()
            synchronize(device)
            step_time = time.perf_counter() - start
            comm_per_step = {"dp": dp_comm.counters(), "tp": tp_comm.counters()}

            loss_value = mean_over(mesh.group("dp"), loss_sum / cfg.micro_batches, mesh.dp)
            if scaler is None and (result.skipped or not math.isfinite(loss_value)):
                raise TrainingError(
                    f"step {step}: the loss is {loss_value} and the gradients are "
                    f"{'not finite' if result.skipped else 'finite'} under {policy.name}: "
                    f"lower --lr or use another precision"
                )
            losses.append(loss_value)
            step_times.append(step_time)
            tokens_per_s = cfg.tokens_per_step / step_time
            record = {
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
                record["val_loss"] = evaluate(model, corpus, cfg, device)
                val_history.append({"step": step, "val_loss": record["val_loss"]})
                data_parallel.end_step()
            if run:
                run.log(record)
                if on_step is not None:
                    on_step(record)
    finally:
        if run:
            run.close()

    memory = rank_memory(data_parallel, optimizer, activations, cfg, device)
    memory_per_rank = gather_from_all(mesh, memory)
    if not is_logger:
        return None
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
        },
        "precision": policy.as_dict(),
        "compute_path": "emulated on CPU (16-bit storage, fp32 accumulation)"
        if needs_emulation(policy, device)
        else "native",
        "n_params": cfg.model.n_params(),
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


def rank_memory(data_parallel, optimizer: MasterAdamW, activations: ActivationMeter, cfg, device) -> dict:
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
