"""The device a rank runs on: choosing it, naming it, timing it, measuring its matmul peak."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

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
# best over sizes counts; on the CPU two modest sizes (about 0.3 s in all on one core) keep the
# measurement at every start cheap while a size that happens to suit the cache less does not decide.
CUDA_PEAK_SIZES = (4096, 8192)
CPU_PEAK_SIZES = (512, 1024)
CUDA_PEAK_REPEATS = 7  # a size's time is their median
CPU_PEAK_REPEATS = 3  # a size's time is the fastest; seven repeats of 1024^3 here were within 4% of each other


def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """The device's matmul rate in `dtype`, in FLOP/s, measured: MFU is against this, not a datasheet.

    Each size is run once to warm up (kernel choice, clocks), then timed CUDA_PEAK_REPEATS or
    CPU_PEAK_REPEATS times (on a CPU the fastest repeat is the answer, and a run's rank 0 times it while
    the others wait); the peak is the best rate over sizes.
      CUDA  a repeat is timed with CUDA events around a few back-to-back matmuls: the GPU's own
            time (host timing would add launch and synchronisation latency to a kernel of a
            fraction of a millisecond); a size's time is the median of its repeats.
      CPU   a repeat is perf_counter around one matmul, which is the CPU's own time; other
            processes on shared cores can only lengthen it, so a size's time is the fastest repeat.
    """
    on_gpu = device.type == "cuda"
    calls = CUDA_MATMULS_PER_REPEAT if on_gpu else 1
    repeats = CUDA_PEAK_REPEATS if on_gpu else CPU_PEAK_REPEATS
    best = 0.0
    for size in CUDA_PEAK_SIZES if on_gpu else CPU_PEAK_SIZES:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        out = torch.empty(size, size, device=device, dtype=dtype)
        matmul = lambda: torch.matmul(a, b, out=out)  # noqa: E731
        device_seconds(matmul, 1, device)  # warm-up
        times = [device_seconds(matmul, calls, device) / calls for _ in range(repeats)]
        seconds = statistics.median(times) if on_gpu else min(times)
        best = max(best, 2 * size**3 / seconds)
    return best


CUDA_MATMULS_PER_REPEAT = 4  # back to back between two events: the GPU never waits for the host


def device_seconds(fn, calls: int, device: torch.device) -> float:
    """Seconds for `calls` back-to-back calls of fn on `device`: between two CUDA events on a GPU (the
    GPU's own time, no host synchronisation inside), with perf_counter on a CPU (where a call's
    return is its work done). Every kernel timer of the project reads this."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - begin


@dataclass
class PeakFlops:
    """The peak MFU divides by: the best of its measurement and of every rate achieved.

    A matmul timed while other processes share the cores can come out low (MFU of 362% was seen
    on a busy machine). The device cannot run the model faster than its peak, so a step whose
    model FLOP rate (per rank) beats the measured peak proves the measurement low: the peak is
    raised to that rate, MFU cannot pass 1 by construction, and `note` says that it happened.
    It is timed at the start, and on a CPU again at the end only when a step proved that timing low.
    """

    measured: float  # FLOP/s, timed at start-up
    dtype: torch.dtype = torch.float32
    best_achieved: float = 0.0  # FLOP/s of the model, per rank, in the fastest step so far

    @property
    def value(self) -> float:
        return max(self.measured, self.best_achieved)

    def observe(self, achieved: float) -> float:
        """Take a step's model FLOP rate per rank into account; that step's MFU (<= 1)."""
        self.best_achieved = max(self.best_achieved, achieved)
        return achieved / self.value

    @property
    def note(self) -> str | None:
        if self.best_achieved <= self.measured:
            return None
        return (f"a step ran the model at {self.best_achieved:.3g} FLOP/s per rank, above the timed matmul peak "
                f"{self.measured:.3g}: that timing was low (a busy machine), so the peak reported is the best "
                f"achieved rate")

    def as_dict(self) -> dict:
        return {
            "peak_flops": self.value,
            "peak_flops_dtype": str(self.dtype).removeprefix("torch."),
            "peak_flops_measured": self.measured,
            "best_achieved_flops": self.best_achieved,
            "peak_note": self.note,
        }


def cuda_device_count() -> int:
    """The GPUs torch can use here (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def runs_on_cuda(device: str, local_ranks: int) -> bool:
    """Whether ranks asked for `device` (auto, cpu or cuda) run on GPUs: one per local rank, as
    parallel/launch/elastic.py's init_worker picks them (fewer GPUs than ranks: the CPU)."""
    return device != "cpu" and cuda_device_count() >= local_ranks


def smallest_free_gpu_bytes(local_ranks: int) -> int:
    """The least free memory among the first `local_ranks` GPUs (torch.cuda.mem_get_info)."""
    return min(torch.cuda.mem_get_info(index)[0] for index in range(local_ranks))


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
