"""The training loop: one loop for every layout (today, the 1 x 1 x 1 layout)."""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from minigpt.data import BatchLayout, Corpus, get_batch, validation_batches
from minigpt.errors import ConfigError, TrainingError
from minigpt.model import GPT
from parallel.train_config import TrainConfig
from precision.compute import apply_precision, dtype_of, needs_emulation
from precision.optimizer import FlatParameters, MasterAdamW, bytes_per_param
from precision.policy import TEXTBOOK_MIXED_ADAM, policy as precision_policy
from precision.scaler import LossScaler

StepLog = Callable[[dict], None]


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available: use --device cpu")
    return torch.device(requested)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu ({torch.get_num_threads()} threads)"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """The device's matmul rate in `dtype`, measured: MFU is against this, not a datasheet."""
    size = 4096 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    synchronize(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


@torch.no_grad()
def evaluate(model: GPT, corpus: Corpus, cfg: TrainConfig, device: torch.device) -> float:
    model.eval()
    batch = max(1, cfg.global_batch // cfg.micro_batches)
    losses = [
        model(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)).item()
        for x, y in validation_batches(corpus.val, cfg.model.seq_len, batch, cfg.eval_batches, cfg.seed)
    ]
    model.train()
    return sum(losses) / len(losses)


def default_run_dir(cfg: TrainConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    m = cfg.model
    return Path("runs") / f"{stamp}-L{m.n_layers}d{m.d_model}-{cfg.precision}"


@dataclass
class RunFiles:
    """The run directory: config.json at the start, metrics.jsonl per step, summary.json at the end."""

    path: Path

    def __post_init__(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics = open(self.path / "metrics.jsonl", "w", encoding="utf-8")

    def write_json(self, name: str, obj: dict) -> None:
        tmp = self.path / (name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.path / name)  # atomic: a reader never sees half a file

    def log(self, record: dict) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()

    def close(self) -> None:
        self.metrics.close()


def make_scaler(cfg: TrainConfig, loss_scaling: bool) -> LossScaler | None:
    if not loss_scaling:
        return None
    if cfg.loss_scale is not None:
        return LossScaler.static(cfg.loss_scale)
    return LossScaler(growth_interval=cfg.loss_scale_window)


def train(cfg: TrainConfig, on_step: StepLog | None = None) -> dict:
    """Train for cfg.steps and return the summary (also written to the run directory)."""
    device = pick_device(cfg.device)
    corpus = Corpus.load(cfg.data, cfg.model.seq_len)
    policy = precision_policy(cfg.precision)
    torch.manual_seed(cfg.seed)
    model = apply_precision(GPT(cfg.model), policy, device)  # built on the CPU in fp32, then cast
    flat = FlatParameters(model)
    optimizer = MasterAdamW(
        flat,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        weight_decay=cfg.weight_decay,
        masters_are_weights=policy.master is None,
    )
    scaler = make_scaler(cfg, policy.loss_scaling)
    layout = BatchLayout(cfg.global_batch, cfg.micro_batches)
    # Emulated 16-bit matmuls run as fp32 matmuls, so the CPU's fp32 rate is their peak.
    peak_dtype = torch.float32 if needs_emulation(policy, device) else dtype_of(policy.compute)
    peak_flops = measure_peak_flops(device, peak_dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    flops_per_token = cfg.model.train_flops_per_token()
    run = RunFiles(Path(cfg.out_dir) if cfg.out_dir else default_run_dir(cfg))
    run.write_json("config.json", {"train": cfg.as_dict(), "data": corpus.source})

    losses, step_times, val_history = [], [], []
    try:
        for step in range(cfg.steps):
            lr = cfg.learning_rate(step)
            synchronize(device)
            start = time.perf_counter()
            flat.zero_grad()
            loss_sum = 0.0
            for micro in range(cfg.micro_batches):
                x, y = get_batch(corpus.train, cfg.model.seq_len, layout, cfg.seed, step, micro)
                loss = model(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
                scaled = loss / cfg.micro_batches
                (scaler.scale_loss(scaled) if scaler else scaled).backward()
                loss_sum += loss.item()
            result = optimizer.step(lr, grad_clip=cfg.grad_clip, scaler=scaler)
            synchronize(device)
            step_time = time.perf_counter() - start

            loss_value = loss_sum / cfg.micro_batches
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
                "mfu": flops_per_token * tokens_per_s / peak_flops,
            }
            if (step + 1) % cfg.eval_interval == 0 or step == cfg.steps - 1:
                record["val_loss"] = evaluate(model, corpus, cfg, device)
                val_history.append({"step": step, "val_loss": record["val_loss"]})
            run.log(record)
            if on_step is not None:
                on_step(record)
    finally:
        run.close()

    step_time_s = statistics.median(step_times)
    tokens_per_s = cfg.tokens_per_step / step_time_s
    finite = [loss for loss in losses if math.isfinite(loss)]
    tail = finite[-min(20, len(finite)) :] or [math.nan]
    summary = {
        "config": cfg.as_dict(),
        "data": corpus.source,
        "device": describe_device(device),
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
            "measured": bytes_per_param(flat, optimizer),
            "policy": policy.bytes_per_param(),
            "textbook_mixed_adam": TEXTBOOK_MIXED_ADAM,
        },
        "step_time_s": step_time_s,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "peak_flops": peak_flops,
        "peak_flops_dtype": str(peak_dtype).removeprefix("torch."),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "mfu": flops_per_token * tokens_per_s / peak_flops,
        "run_dir": str(run.path),
    }
    run.write_json("summary.json", summary)
    return summary
