"""The device a rank runs on: choosing it, naming it, timing it, measuring its matmul peak."""

from __future__ import annotations

import math
import time

import torch

from minigpt.errors import ConfigError


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


def check_device(requested: str, local_ranks: int) -> None:
    """Before any worker starts: a CUDA request needs a GPU for every local rank."""
    if requested != "cuda":
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise ConfigError("--device cuda was asked for but torch sees no CUDA device: use --device cpu or auto")
    if gpus < local_ranks:
        raise ConfigError(
            f"--device cuda needs one GPU per rank: {local_ranks} local ranks but {gpus} GPU(s); "
            f"use fewer ranks per node or --device cpu"
        )
