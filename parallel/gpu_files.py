"""How many GPUs torch can use here, answered without importing torch (a second or two of CPU) where it can be.

A process reaches a GPU through its driver's device files: NVIDIA's /dev/nvidiactl (beside /dev/nvidia0,
/dev/nvidia1, ...), AMD ROCm's /dev/kfd, and under WSL 2 /dev/dxg. Where none of them exists, torch's
`torch.cuda.device_count()` is 0 whatever torch was built for, so a command that only needs to know
whether a run will be on GPUs (the precision `auto` picks, how many ranks fill the job) knows it without
torch, and can start the server the ranks are forked from (parallel/launch/rank_start.py) before it pays for
torch's import itself. Where one exists, torch is asked: a driver may be installed with no usable device.
Every such question asked before torch is needed goes through `cuda_devices` here, so the rule lives in one place.
"""

from __future__ import annotations

import os

GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def may_have_gpus() -> bool:
    """False when no GPU driver's device file exists here (torch would see no GPU); True otherwise."""
    return any(os.path.exists(path) for path in GPU_DEVICE_FILES)



def cuda_devices() -> int:
    """torch's count of the GPUs it can use (parallel/device.py's cuda_device_count), asked only where a GPU
    driver's device file exists: 0 otherwise, without importing torch."""
    if not may_have_gpus():
        return 0
    from parallel.device import cuda_device_count

    return cuda_device_count()
