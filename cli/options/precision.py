"""--precision, one flag for every command that trains or simulates (train, compare, simulate, plan).

Its default, auto, is the format a run on that device trains in: bf16 on a GPU (mixed precision is what
tensor cores are for, and bf16 needs no loss scaling) and fp32 on a CPU, which has no 16-bit matmul worth
using (here bf16 is about 100x slower than fp32: a CPU run of 16-bit formats emulates them, for what they do
to the numbers, not for speed). The first lines of every command say which format auto chose.
"""

from __future__ import annotations

import click

from job.train_config import PRECISIONS
from parallel.gpu_files import cuda_devices

AUTO = "auto"
GPU_PRECISION = "bf16"
CPU_PRECISION = "fp32"
HELP = "Number format of the compute: fp32, bf16, fp16 or fp8; auto: bf16 on a GPU, fp32 on a CPU."


def precision_option(function):
    """The --precision flag, as every command spells it."""
    return click.option("--precision", default=AUTO, show_default=True, type=click.Choice((AUTO, *PRECISIONS)),
                        help=HELP)(function)


def training_precision(requested: str, device: str, world_size: int) -> str:
    """What a run of `world_size` ranks on `device` (auto, cpu or cuda) computes in: `requested`, or for auto
    bf16 when it will run on GPUs (one per rank on this node, as parallel/launch/elastic.py's init_worker picks them)
    and fp32 on the CPU. Imports torch only for auto with a device that may be a GPU, where a GPU driver is
    installed (parallel/gpu_files.py)."""
    if requested != AUTO:
        return requested
    if device == "cpu":
        return CPU_PRECISION
    import os

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return GPU_PRECISION if cuda_devices() >= local_ranks else CPU_PRECISION


def simulated_precision(requested: str, hardware=None) -> str:
    """What a simulated job computes in: `requested`, or for auto fp32 on a calibrated CPU host profile and
    bf16 on every GPU (a preset, None here, or a CUDA profile); `hardware`: simulator.costs.hardware's Hardware. Torch-free."""
    if requested != AUTO:
        return requested
    measured = None if hardware is None else hardware.gpu.measured
    on_cpu = measured is not None and measured.device == "cpu"
    return CPU_PRECISION if on_cpu else GPU_PRECISION
