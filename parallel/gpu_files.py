"""Whether torch could find a GPU on this machine, answered without importing torch (a second or two of CPU).

A process reaches a GPU through its driver's device files: NVIDIA's /dev/nvidiactl (beside /dev/nvidia0,
/dev/nvidia1, ...), AMD ROCm's /dev/kfd, and under WSL 2 /dev/dxg. Where none of them exists, torch's
`torch.cuda.device_count()` is 0 whatever torch was built for, so a command that only needs to know
whether a run will be on GPUs (the precision `auto` picks, how many ranks fill the job) knows it without
torch, and can start the server the ranks are forked from (parallel/rank_start.py) before it pays for
torch's import itself. Where one exists, torch is asked: a driver may be installed with no usable device.
"""

from __future__ import annotations

import os

GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def may_have_gpus() -> bool:
    """False when no GPU driver's device file exists here (torch would see no GPU); True otherwise."""
    return any(os.path.exists(path) for path in GPU_DEVICE_FILES)
