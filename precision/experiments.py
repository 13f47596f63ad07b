"""Experiment (d) of `minigpt numerics`: why fp32 master weights exist.

A LayerNorm's gain (a real nn.Parameter, initialised to 1.0) is trained toward
a target about 2% away, with fp16 compute and the same AdamW both times. With
pure fp16 weights every update (about lr = 1e-4) is smaller than half the fp16
spacing at 1.0 (2**-11, about 4.9e-4), so it rounds away and the gain never
moves; with fp32 masters the same updates accumulate and the loss falls.
Experiments (a)-(c) live beside the format facts in precision/formats.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from precision.formats import ulp
from precision.flat import FlatParameters
from precision.optimizer import MasterAdamW


def train_gain(master_weights: bool, steps: int, lr: float, width: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    target_gain = 1 + 0.02 * torch.randn(width, generator=generator)
    x = torch.randn(256, width, generator=generator)
    y = F.layer_norm(x, (width,), target_gain)
    layer = nn.LayerNorm(width).half()
    flat = FlatParameters(layer)
    optimizer = MasterAdamW.for_flat(flat, lr=lr, betas=(0.9, 0.999), masters_are_weights=not master_weights)
    losses = []
    for _ in range(steps):
        flat.zero_grad()
        loss = F.mse_loss(layer(x.half()).float(), y)
        loss.backward()
        optimizer.step(flat.grad)
        losses.append(loss.item())
    return {
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "loss_ratio": losses[-1] / losses[0],
        "gain_moved": (layer.weight.float() - 1).abs().max().item(),
        "gain_error": (optimizer.masters[: width].float() - target_gain).abs().max().item(),
    }


def experiment_master_weights(steps: int = 300, lr: float = 1e-4, width: int = 64, seed: int = 0) -> dict:
    pure = train_gain(False, steps, lr, width, seed)
    master = train_gain(True, steps, lr, width, seed)
    half_spacing = ulp(1.0, "fp16") / 2
    return {
        "steps": steps,
        "lr": lr,
        "fp16_half_spacing_at_1": half_spacing,
        "pure_fp16": pure,
        "fp32_master": master,
        "finding": (
            f"pure fp16 weights: the gain moved {pure['gain_moved']:.1e} and the loss went "
            f"x{pure['loss_ratio']:.2f}; fp32 masters: the gain moved {master['gain_moved']:.1e} "
            f"and the loss went x{master['loss_ratio']:.2f} (updates of ~{lr:g} are below "
            f"half the fp16 spacing at 1.0, {half_spacing:.1e})"
        ),
    }
