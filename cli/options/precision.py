"""--precision, one flag for every command that trains or simulates (train, compare, simulate, plan), and the
optimizer's flags (the precision package's optimizers: fp32 masters and moments).

Its default, auto, is the format a run on that device trains in: bf16 on a GPU (mixed precision is what
tensor cores are for, and bf16 needs no loss scaling) and fp32 on a CPU, which has no 16-bit matmul worth
using (here bf16 is about 100x slower than fp32: a CPU run of 16-bit formats emulates them, for what they do
to the numbers, not for speed). The first lines of every command say which format auto chose.
"""

from __future__ import annotations

from typing import Callable

import click

from job.muon import OPTIMIZERS
from job.train_config import LR_SCHEDULES, PRECISIONS
from parallel.gpu_files import cuda_devices

AUTO = "auto"
GPU_PRECISION = "bf16"
CPU_PRECISION = "fp32"
OPTIMIZER_HELP = ("adamw, or muon (Jordan et al. 2024, with Liu et al. 2025's scale): each hidden matrix steps along "
                  "its orthogonalised Nesterov momentum and keeps no second moment; embeddings, head, norms and "
                  "biases take AdamW. simulate and plan price its all-to-alls and Newton-Schulz GEMMs.")
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


def optimizer_option(default: str | None = "adamw") -> Callable:
    """--optimizer, as train, compare, simulate and plan spell it (`default` None: the stack flags' way, unset
    unless given)."""
    return click.option("--optimizer", default=default, show_default=default is not None,
                        type=click.Choice(OPTIMIZERS), help=OPTIMIZER_HELP + ("" if default else " [default: adamw]"))


def optimizer_options(function):
    """train's optimizer and learning-rate flags."""
    for option in reversed(OPTIMIZER_FLAGS):
        function = option(function)
    return optimizer_option()(function)


OPTIMIZER_FLAGS = [
    click.option("--lr", default=2e-3, show_default=True, type=float, help="Peak learning rate."),
    click.option("--min-lr", type=float, help="Final learning rate of the decay [default: lr/10]."),
    click.option("--lr-schedule", "lr_schedule", type=click.Choice(LR_SCHEDULES), default="cosine",
                 show_default=True,
                 help="After the warmup: cosine or linear decay to --min-lr at the last step, wsd (warmup-stable-"
                      "decay: --lr until the last --decay-fraction of the steps, then linearly to --min-lr), wsd-sqrt "
                      "(the same, the cooldown 1 - sqrt: Hägele et al. 2024) or constant."),
    click.option("--decay-fraction", "decay_fraction", type=float, default=0.2, show_default=True,
                 help="wsd: the share of the steps, at the end, that decays."),
    click.option("--warmup", type=int,
                 help="Warmup steps [default: 10% of steps, at least 10 (at most the run), at most 100]."),
    click.option("--weight-decay", default=0.1, show_default=True, type=float),
    click.option("--grad-clip", default=1.0, show_default=True, type=float, help="Max gradient norm (0: off)."),
    click.option("--muon-momentum", "muon_momentum", default=0.95, show_default=True, type=float,
                 help="--optimizer muon: the matrices' Nesterov momentum."),
]
