"""Selective activation recomputation (Korthikanti et al. 2022): the attention core runs again in the backward.

The core (minigpt/model.py's AttentionCore: RoPE and the attention itself) keeps its input, the fused
qkv output, and nothing of its own; the backward runs it again on that input and differentiates
the copy. What the core would have kept (the rotated q and k, the log-sum-exp) is alive only
while its block's backward runs. The input is saved with save_for_backward, so the activation
meter (parallel/memory.py) sees it like any other saved tensor. Like torch's reentrant
checkpoint, but small enough to read; the core has no parameters and no randomness (attention
dropout is not part of the model), so the recomputed values equal the first ones bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from job.train_config import check_train_recompute
from parallel.backward import gradients_from


class RecomputedCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, core: nn.Module) -> torch.Tensor:
        ctx.core = core
        ctx.save_for_backward(x)
        with torch.no_grad():
            return core(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        again = x.detach().requires_grad_()
        with torch.enable_grad():
            out = ctx.core(again)
        (grad_x,) = gradients_from(out, [again], grad)
        return grad_x, None


class Recomputed(nn.Module):
    """`inner` run without keeping anything but its input; run again in the backward."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.inner(x)
        return RecomputedCall.apply(x, self.inner)


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Make `model`'s blocks recompute as `mode` says ("none" or "selective"), from outside, in place."""
    check_train_recompute(mode)
    if mode == "selective":
        for block in model.blocks:
            block.attn.core = Recomputed(block.attn.core)
    return model
