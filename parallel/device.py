"""The device a rank runs on: choosing it, naming it, timing it, measuring its matmul peak."""

from __future__ import annotations

import statistics
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


# Square matmul sizes timed for the peak. On a GPU the small one may not fill the chip, so the
# best over sizes counts; on the CPU one modest size keeps the measurement at every start cheap.
CUDA_PEAK_SIZES = (4096, 8192)
CPU_PEAK_SIZES = (1024,)


def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """The device's matmul rate in `dtype`, in FLOP/s, measured: MFU is against this, not a datasheet.

    Each size is run once to warm up (kernel choice, clocks), then timed `repeats` times; the peak
    is the best rate over sizes.
      CUDA  a repeat is timed with CUDA events around a few back-to-back matmuls: the GPU's own
            time (host timing would add launch and synchronisation latency to a kernel of a
            fraction of a millisecond); a size's time is the median of its repeats.
      CPU   a repeat is perf_counter around one matmul, which is the CPU's own time; other
            processes on shared cores can only lengthen it, so a size's time is the fastest repeat.
    """
    on_gpu = device.type == "cuda"
    timer = _cuda_matmul_seconds if on_gpu else _host_matmul_seconds
    best = 0.0
    for size in CUDA_PEAK_SIZES if on_gpu else CPU_PEAK_SIZES:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        out = torch.empty(size, size, device=device, dtype=dtype)
        timer(a, b, out)  # warm-up
        times = [timer(a, b, out) for _ in range(repeats)]
        seconds = statistics.median(times) if on_gpu else min(times)
        best = max(best, 2 * size**3 / seconds)
    return best


def _host_matmul_seconds(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.matmul(a, b, out=out)
    return time.perf_counter() - start


CUDA_MATMULS_PER_REPEAT = 4  # back to back between two events: the GPU never waits for the host


def _cuda_matmul_seconds(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CUDA_MATMULS_PER_REPEAT):
        torch.matmul(a, b, out=out)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / CUDA_MATMULS_PER_REPEAT


def cuda_device_count() -> int:
    """The GPUs torch can use here (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(requested: str, local_ranks: int) -> None:
    """Before any worker starts: a CUDA request needs a GPU for every local rank."""
    if requested != "cuda":
        return
    gpus = cuda_device_count()
    if gpus == 0:
        raise ConfigError("--device cuda was asked for but torch sees no CUDA device: use --device cpu or auto")
    if gpus < local_ranks:
        raise ConfigError(
            f"--device cuda needs one GPU per rank: {local_ranks} local ranks but {gpus} GPU(s); "
            f"use fewer ranks per node or --device cpu"
        )
