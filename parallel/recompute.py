"""Selective activation recomputation (Korthikanti et al. 2022): the attention core runs again in the backward.

The core (minigpt/model.py's AttentionCore: Qwen3's query and key norms, RoPE and the attention
itself) keeps its input, the fused qkv output, and nothing of its own; the backward runs it again
on that input and differentiates the copy, for the input and for the core's own parameters (the
norms' weights, inputs of the autograd function so that their gradients reach them as any other
weight's: accumulated into .grad, with every hook on them). What the core would have kept (the
normed and rotated q and k, the log-sum-exp) is alive only while its block's backward runs. The
input is saved with save_for_backward, so the activation meter (parallel/memory.py) sees it like
any other saved tensor. Like torch's reentrant checkpoint, but small enough to read; the core has
no randomness (attention dropout is not part of the model), so the recomputed values equal the
first ones bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from job.train_config import check_train_recompute
from parallel.backward import gradients_from


class RecomputedCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, core: nn.Module, names: tuple[str, ...], *params: torch.Tensor) -> torch.Tensor:
        ctx.core, ctx.names, ctx.params = core, names, params  # parameters as inputs: their gradients flow
        ctx.save_for_backward(x)
        with torch.no_grad():
            return core(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        again = x.detach().requires_grad_()
        needed = ctx.needs_input_grad[3:]
        # the rerun differentiates stand-ins sharing the parameters' storage, not the parameters: a hook on a
        # parameter (tensor parallelism's sum over its group) then runs once, when this function's gradient reaches it
        stand_ins = {name: param.detach().requires_grad_(need)
                     for name, param, need in zip(ctx.names, ctx.params, needed)}
        with torch.enable_grad():
            out = functional_call(ctx.core, stand_ins, (again,))
        wanted = [stand_ins[name] for name, need in zip(ctx.names, needed) if need]
        grads = iter(gradients_from(out, [again, *wanted], grad, allow_unused=True))
        grad_x = next(grads)
        return (grad_x, None, None, *(next(grads) if need else None for need in needed))


class Recomputed(nn.Module):
    """`inner` run without keeping anything but its input; run again in the backward."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.inner(x)
        named = dict(self.inner.named_parameters())
        return RecomputedCall.apply(x, self.inner, tuple(named), *named.values())


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Make `model`'s blocks recompute as `mode` says ("none" or "selective"), from outside, in place."""
    check_train_recompute(mode)
    if mode == "selective":
        for block in model.blocks:
            block.attn.core = Recomputed(block.attn.core)
    return model
