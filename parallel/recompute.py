"""Activation recomputation: selective (Korthikanti et al. 2022), the attention core runs again in the backward;
full (Chen et al. 2016, Megatron's --recompute-granularity full per layer), every block does.

Selective. The core (minigpt/model.py's AttentionCore: Qwen3's query and key norms, RoPE and the attention
itself) keeps its input, the fused qkv output, and nothing of its own; the backward runs it again on that input
and backpropagates through the copy into the input and into the core's own weights (the norms'), accumulating into
.grad as torch's reentrant checkpoint does, so every hook on them runs once (tensor parallelism's sum over its
group: a rerun differentiated for the weights by name ran it twice, and one for the input alone left the norms'
weights without gradients). What the core would have kept (the normed and rotated q and k, the log-sum-exp) is
alive only while its block's backward runs. The input is saved with save_for_backward, so the activation meter
(parallel/memory.py) sees it like any other saved tensor. The core has no randomness (attention dropout is not
part of the model), so the recomputed values equal the first ones bit for bit; it attends within the documents its
forward did (minigpt/attention.py's within_documents, kept with the input).

Full. A block keeps its input alone (the sequence-parallel shard under sequence parallelism): its forward runs
without a graph, and the backward runs it again from that input, with the random state its forward began with
(dropout draws the same masks), then backpropagates through the copy into the input and into the block's
parameters, accumulating into .grad as torch's reentrant checkpoint does, every hook on the parameters running once
(ZeRO's reductions, tensor parallelism's sums). The rerun calls the block's forward itself, not the module, so hooks
on the block (ZeRO-3 gathers it for its backward before this runs) do not fire twice; its collectives (tensor,
context and expert parallelism's) run again in the same order on every rank. The embeddings and the head are not
recomputed (Megatron's granularity: the transformer layers). Under a zero-bubble schedule the rerun (of a block or
of a core) happens in the backward's first half, which keeps the rerun's graph and defers its weight gradients to
the second (SPLIT). In fp8 the rerun quantises with the scales its forward used and records no amax
(precision/fp8.py's recompute_phase), as Transformer Engine keeps a recomputed forward's fp8 metadata.
"""

from __future__ import annotations

import collections
import functools
from typing import Callable

import torch
from torch import nn

from job.train_config import check_train_recompute
from minigpt.attention import current_documents, within_documents
from parallel.backward import backward_from
from precision.fp8 import recompute_phase


# Set by a zero-bubble schedule's split backward while it runs a chunk's activation gradients
# (parallel/pipeline/weight_gradients.py): split(rerun, again, grad) runs a recomputed block (or core) again,
# keeping what its weight gradients need for later, and returns its input's gradient.
SPLIT: list[Callable[[Callable[[], torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor] | None] = [None]


class Recompute(torch.autograd.Function):
    """run(x) without a graph, x kept; in the backward run(x) again and backpropagate through the copy (above)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.run, ctx.states, ctx.scales = run, random_states(x.device), collections.deque()  # fp8's, for the rerun
        ctx.documents = current_documents()  # the micro-batch's (a pipeline's backward runs among others' forwards)
        ctx.save_for_backward(x)
        with torch.no_grad(), recompute_phase("first", ctx.scales):
            return run(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        again = x.detach().requires_grad_()

        def rerun() -> torch.Tensor:
            devices = [x.device] if x.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), torch.enable_grad(), recompute_phase("again", ctx.scales), \
                    within_documents(ctx.documents):
                restore_random_states(ctx.states, x.device)
                return ctx.run(again)

        if SPLIT[0] is not None:  # a zero-bubble backward's first half: the weights' gradients wait
            return SPLIT[0](rerun, again, grad), None
        backward_from(rerun(), grad)  # into the parameters' .grad and into again.grad
        return again.grad, None


def random_states(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def restore_random_states(states: tuple, device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


class Recomputed(nn.Module):
    """`inner` run without keeping anything but its input; run again in the backward (selective recomputation)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.inner(x)
        return Recompute.apply(x, self.inner)


def recomputed_forward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A block's forward under full recomputation; as usual where no gradient reaches its input (evaluation: the
    parameters' gradients travel through the input's). The rerun calls the block's own forward, not the module."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return type(block).forward(block, x)
    return Recompute.apply(x, functools.partial(type(block).forward, block))


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Make `model`'s blocks recompute as `mode` says ("none", "selective" or "full"), from outside, in place.
    Full recomputation replaces each block's forward on the instance (no wrapper: the blocks keep their place and
    their parameters' names for tensor parallelism, the pipeline's split and ZeRO-3's units)."""
    check_train_recompute(mode)
    for block in model.blocks:
        if mode == "selective":
            block.attn.core = Recomputed(block.attn.core)
        elif mode == "full":
            block.forward = functools.partial(recomputed_forward, block)
    return model
