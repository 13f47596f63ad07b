"""Activation bytes, measured: what the forward pass keeps alive for the backward.

On CPU: a saved-tensors hook records every tensor autograd saves and sums the
distinct storages, leaving out the parameters' own storages. On CUDA: the
allocator's count of bytes allocated after the forward minus before it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch


class ActivationMeter:
    def __init__(self, device: torch.device, parameter_storages: Callable[[], set[int]]):
        """`parameter_storages()` names the storages holding weights right now (ZeRO-3 moves them)."""
        self.device = device
        self.parameter_storages = parameter_storages
        self.bytes = 0

    @contextmanager
    def measure_forward(self):
        """Around one forward pass: afterwards `bytes` holds what it kept for the backward."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.memory_allocated(self.device) - before
            return
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.parameter_storages():
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self.bytes = sum(storages.values())
