"""Flat parameter buffers and AdamW on fp32 masters, written to be sharded.

`FlatParameters` moves every parameter of a model into one flat buffer in the
compute format (the Parameters become views into it) and gives them one flat
gradient buffer (each `.grad` is a view, and autograd accumulates into it in
place). `MasterAdamW` owns the fp32 master weights and the fp32 AdamW moments
for one contiguous range of that flat space -- the whole of it in a single
process, one rank's 1/N under ZeRO -- and never assumes it holds every parameter:
the two numbers that need every rank (is any gradient non-finite? the global
gradient norm) go through `reduce_max` and `reduce_sum`, which ZeRO turns into
all-reduces.

One step: cast the shard's gradients to fp32, unscale, check finiteness (skip
the step on overflow), clip by the global norm, AdamW with decoupled weight
decay on the masters, copy the masters back into the compute weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from precision.scaler import LossScaler

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True)
class Segment:
    """Where one parameter lives in the flat buffer."""

    name: str
    start: int
    end: int
    decay: bool  # matrices and embeddings decay; LayerNorms and biases do not


class FlatParameters:
    """All parameters of a module as views into one flat compute-format buffer."""

    def __init__(self, module: nn.Module, pad_to: int = 1):
        named = list(module.named_parameters())  # a tied weight appears once
        if not named:
            raise ValueError("the module has no parameters")
        first = named[0][1]
        self.dtype, self.device = first.dtype, first.device
        self.segments: list[Segment] = []
        offset = 0
        for name, param in named:
            self.segments.append(Segment(name, offset, offset + param.numel(), param.dim() >= 2))
            offset += param.numel()
        self.numel = offset
        self.padded_numel = -(-offset // pad_to) * pad_to
        self.data = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        self.grad = torch.zeros_like(self.data)
        self.params = [param for _, param in named]
        for segment, param in zip(self.segments, self.params):
            view = self.data[segment.start : segment.end].view_as(param)
            view.copy_(param.detach())
            param.data = view
            param.grad = self.grad[segment.start : segment.end].view_as(param)

    def zero_grad(self) -> None:
        self.grad.zero_()


class MasterAdamW:
    """AdamW on fp32 masters for the flat range [start, end) of a FlatParameters."""

    def __init__(
        self,
        flat: FlatParameters,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        shard: tuple[int, int] | None = None,
        masters_are_weights: bool = False,
    ):
        self.flat = flat
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.start, self.end = shard if shard is not None else (0, flat.padded_numel)
        weights = flat.data[self.start : self.end]
        self.masters_are_weights = masters_are_weights
        if masters_are_weights:
            # Update the weights in place: plain fp32 training, or -- with 16-bit
            # weights -- "pure" 16-bit training, where an update smaller than half
            # the spacing of the format at a weight is rounded away (the failure
            # that fp32 masters exist to prevent; `minigpt numerics` shows it).
            self.masters = weights
        else:
            self.masters = weights.float().clone()
        self.exp_avg = torch.zeros_like(self.masters, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros_like(self.masters, dtype=torch.float32)
        self.steps = 0
        # Ranges of this shard (local offsets) that take weight decay.
        self.decay_ranges = [
            (max(s.start, self.start) - self.start, min(s.end, self.end) - self.start)
            for s in flat.segments
            if s.decay and s.end > self.start and s.start < self.end
        ]

    def step(
        self,
        lr: float | None = None,
        grad_clip: float = 0.0,
        scaler: LossScaler | None = None,
        grads: torch.Tensor | None = None,
        reduce_max: Reduce = _identity,
        reduce_sum: Reduce = _identity,
    ) -> "StepResult":
        """One optimizer step from this shard's gradients (default: the flat grad buffer's range)."""
        lr = self.lr if lr is None else lr
        shard_grads = self.flat.grad[self.start : self.end] if grads is None else grads
        grad = shard_grads.float()
        if grad.data_ptr() == shard_grads.data_ptr():
            grad = grad.clone()  # never scribble on the gradient buffer
        if scaler is not None:
            scaler.unscale_([grad])
        overflow = reduce_max((~torch.isfinite(grad)).any().float())
        skipped = scaler.update(overflow) if scaler is not None else bool(overflow)
        if skipped:
            return StepResult(grad_norm=math.nan, skipped=True, loss_scale=self._scale(scaler))
        grad_norm = math.sqrt(float(reduce_sum(grad.pow(2).sum())))
        if grad_clip > 0:
            coefficient = grad_clip / (grad_norm + 1e-6)
            if coefficient < 1:
                grad.mul_(coefficient)
        self._adamw(grad, lr)
        if not self.masters_are_weights:
            self.flat.data[self.start : self.end].copy_(self.masters)
        return StepResult(grad_norm=grad_norm, skipped=False, loss_scale=self._scale(scaler))

    @torch.no_grad()
    def _adamw(self, grad: torch.Tensor, lr: float) -> None:
        self.steps += 1
        beta1, beta2 = self.betas
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if self.weight_decay:
            for start, end in self.decay_ranges:
                self.masters[start:end].mul_(1 - lr * self.weight_decay)
        bias_correction1 = 1 - beta1**self.steps
        bias_correction2 = 1 - beta2**self.steps
        denominator = (self.exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(self.eps)
        self.masters.addcdiv_(self.exp_avg, denominator, value=-lr / bias_correction1)

    @staticmethod
    def _scale(scaler: LossScaler | None) -> float:
        return scaler.scale if scaler is not None else 1.0

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this optimizer owns (masters only when they are not the weights)."""
        tensors = {"adam_m": self.exp_avg, "adam_v": self.exp_avg_sq}
        if not self.masters_are_weights:
            tensors["master"] = self.masters
        return tensors


@dataclass(frozen=True)
class StepResult:
    grad_norm: float
    skipped: bool
    loss_scale: float


def bytes_per_param(flat: FlatParameters, optimizer: MasterAdamW) -> dict[str, float]:
    """Bytes per model parameter of each role, measured from the live tensors."""
    tensors = {"compute": flat.data, "grad": flat.grad, **optimizer.state_tensors()}
    measured = {role: tensor.numel() * tensor.element_size() / flat.numel for role, tensor in tensors.items()}
    measured.setdefault("master", 0.0)
    return measured
