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

from minigpt.errors import ConfigError
from minigpt.data import BatchLayout, Corpus, get_batch, validation_batches
from minigpt.model import GPT
from parallel.train_config import TrainConfig

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


def measure_peak_flops(device: torch.device, size: int = 1024, repeats: int = 5) -> float:
    """The device's fp32 matmul rate, measured: MFU on CPU is against this, not a datasheet."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    a @ b  # warm-up
    synchronize(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; never LayerNorms or biases."""
    decay, no_decay = [], []
    for param in model.parameters():
        (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


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


def train(cfg: TrainConfig, on_step: StepLog | None = None) -> dict:
    """Train for cfg.steps and return the summary (also written to the run directory)."""
    device = pick_device(cfg.device)
    corpus = Corpus.load(cfg.data, cfg.model.seq_len)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(device)
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2)
    )
    layout = BatchLayout(cfg.global_batch, cfg.micro_batches)
    peak_flops = measure_peak_flops(device)
    flops_per_token = cfg.model.train_flops_per_token()
    run = RunFiles(Path(cfg.out_dir) if cfg.out_dir else default_run_dir(cfg))
    run.write_json("config.json", {"train": cfg.as_dict(), "data": corpus.source})

    losses, step_times, val_history = [], [], []
    try:
        for step in range(cfg.steps):
            lr = cfg.learning_rate(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            synchronize(device)
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for micro in range(cfg.micro_batches):
                x, y = get_batch(corpus.train, cfg.model.seq_len, layout, cfg.seed, step, micro)
                loss = model(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
                (loss / cfg.micro_batches).backward()
                loss_sum += loss.item()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
            optimizer.step()
            synchronize(device)
            step_time = time.perf_counter() - start

            loss_value = loss_sum / cfg.micro_batches
            if not math.isfinite(loss_value):
                raise ConfigError(f"the loss became {loss_value} at step {step}: lower --lr")
            losses.append(loss_value)
            step_times.append(step_time)
            tokens_per_s = cfg.tokens_per_step / step_time
            record = {
                "step": step,
                "loss": loss_value,
                "lr": lr,
                "grad_norm": float(grad_norm),
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
    tail = losses[-min(20, len(losses)) :]
    summary = {
        "config": cfg.as_dict(),
        "data": corpus.source,
        "device": describe_device(device),
        "n_params": cfg.model.n_params(),
        "losses": losses,
        "final_loss": sum(tail) / len(tail),
        "val_loss": val_history[-1]["val_loss"],
        "val_history": val_history,
        "step_time_s": step_time_s,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "peak_flops": peak_flops,
        "mfu": flops_per_token * tokens_per_s / peak_flops,
        "run_dir": str(run.path),
    }
    run.write_json("summary.json", summary)
    return summary
