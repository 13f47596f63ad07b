"""Step time of each precision policy against fp32 and against torch.autocast with the same dtype.

Not a test: it prints a table (and --json). On CPU our 16-bit paths are
emulated (16-bit storage, fp32 accumulation) while autocast runs native 16-bit
CPU kernels; on CUDA both are native.

    python bench/mixed_precision.py --model tiny --steps 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from minigpt.presets import preset
from minigpt.data import BatchLayout, Corpus, get_batch
from minigpt.model import GPT
from parallel.device import measure_peak_flops, pick_device, synchronize
from parallel.run.train import train
from job.train_config import TrainConfig

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def run_ours(cfg: TrainConfig) -> dict:
    with tempfile.TemporaryDirectory() as out:
        summary = train(TrainConfig(**{**cfg.__dict__, "out_dir": out}))
    return {
        "step_time_s": summary["step_time_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "final_loss": summary["final_loss"],
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "mfu": summary["mfu"],
    }


def run_autocast(cfg: TrainConfig, name: str) -> dict:
    """torch's own mixed precision: fp32 weights, autocast, torch AdamW (and GradScaler for fp16)."""
    device = pick_device(cfg.device)
    dtype = AUTOCAST_DTYPES[name]
    corpus = Corpus.load(cfg.data, cfg.model.seq_len)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    scaler = torch.amp.GradScaler(device.type, enabled=name == "fp16")
    layout = BatchLayout(cfg.global_batch, cfg.micro_batches)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for step in range(cfg.steps):
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        x, y = get_batch(corpus.train, cfg.model.seq_len, layout, cfg.seed, step)
        with torch.autocast(device.type, dtype=dtype):
            loss = model(x.to(device), y.to(device))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    step_time = statistics.median(times)
    peak = measure_peak_flops(device, dtype if device.type == "cuda" else torch.float32)
    tokens_per_s = cfg.tokens_per_step / step_time
    tail = losses[-min(20, len(losses)) :]
    return {
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_s,
        "final_loss": sum(tail) / len(tail),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "mfu": cfg.model.train_flops_per_token() * tokens_per_s / peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precisions", default="fp32,bf16,fp16,fp8")
    parser.add_argument("--no-autocast", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = preset(args.model)
    if args.seq_len:
        model = model.with_(seq_len=args.seq_len)
    rows = []
    for name in args.precisions.split(","):
        cfg = TrainConfig(
            model=model, steps=args.steps, global_batch=args.batch_size, eval_every=0, eval_batches=1,
            device=args.device, precision=name,
        )
        rows.append({"run": f"minigpt {name}", **run_ours(cfg)})
        if name in AUTOCAST_DTYPES and not args.no_autocast:
            rows.append({"run": f"torch.autocast {name}", **run_autocast(cfg, name)})
    base = rows[0]["step_time_s"]
    for row in rows:
        row["speedup_vs_fp32"] = base / row["step_time_s"]
    device = pick_device(args.device)
    header = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "params": model.n_params(),
        "tokens_per_step": args.batch_size * model.seq_len,
        "steps": args.steps,
    }
    if args.json:
        print(json.dumps({**header, "rows": rows}))
        return
    print(" ".join(f"{k}={v}" for k, v in header.items()))
    print(f"{'run':<22} {'step ms':>9} {'tokens/s':>11} {'MFU':>7} {'vs fp32':>8} {'peak MiB':>9} {'loss':>7}")
    for r in rows:
        memory = f"{r['peak_memory_bytes'] / 2**20:9.0f}" if r["peak_memory_bytes"] else f"{'-':>9}"
        print(
            f"{r['run']:<22} {r['step_time_s'] * 1000:9.1f} {r['tokens_per_s']:11,.0f} {r['mfu']:7.1%} "
            f"{r['speedup_vs_fp32']:7.2f}x {memory} {r['final_loss']:7.3f}"
        )


if __name__ == "__main__":
    main()
