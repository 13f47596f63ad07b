"""AdamW on fp32 master weights, on flat tensors, written to be sharded.

`MasterAdamW` owns the fp32 masters and the fp32 AdamW moments of one flat
range of compute weights -- all of them in a single process, one rank's 1/N
under ZeRO (precision/flat.py lays the parameters out so that range exists) --
and never assumes it holds every parameter: the two numbers that need every
rank (the global gradient norm, and with it whether any gradient is
non-finite: inf and nan survive a sum) go through one `reduce_sum`, which
ZeRO turns into an all-reduce of one number.

One step: cast the gradients to fp32, unscale, check finiteness (skip the step
on overflow), clip by the global norm, AdamW with decoupled weight decay on the
masters, copy the masters back into the compute weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from precision.flat import FlatParameters
from precision.scaler import LossScaler

Reduce = Callable[[torch.Tensor], torch.Tensor]
# The squared norm is summed over rows of this many elements, each in fp32, and the rows' sums in fp64.
NORM_ROW = 1024


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class MasterAdamW:
    """AdamW on fp32 masters (and fp32 moments) for a flat range of compute weights.

    The weights may come in pieces (ZeRO 1 and 2 own one piece of every bucket of
    the flat buffer); masters, moments and gradients lay the pieces end to end.
    """

    def __init__(
        self,
        weights: torch.Tensor | list[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decay_ranges: list[tuple[int, int]] | None = None,
        masters_are_weights: bool = False,
        shared_ranges: list[tuple[int, int, int]] | None = None,
        norm_split: int | None = None,
    ):
        """`weights`: flat 1-D compute weights (one tensor or pieces) that each step writes back into.
        `decay_ranges`: the ranges, in the pieces laid end to end, that take weight
        decay (default: all). `masters_are_weights`: update the weights in place
        instead of keeping fp32 masters -- plain fp32 training, or, with 16-bit
        weights, "pure" 16-bit training, where an update smaller than half the
        spacing of the format at a weight is rounded away (the failure fp32 masters
        exist to prevent). `shared_ranges`: (start, end, copies) of weights that
        `copies` ranks hold identical copies of (tensor parallelism's replicated
        LayerNorms, a pipeline's two copies of a tied embedding): their share of the
        gradient norm is divided by that count, so the all-reduced norm counts them once."""
        self.pieces = [weights] if isinstance(weights, torch.Tensor) else list(weights)
        self.numel = sum(piece.numel() for piece in self.pieces)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.masters_are_weights = masters_are_weights
        self.bounds, offset = [], 0
        for piece in self.pieces:
            self.bounds.append((offset, offset + piece.numel()))
            offset += piece.numel()
        if masters_are_weights:
            self.masters = self.pieces[0] if len(self.pieces) == 1 else None
            self.master_pieces = self.pieces
        else:
            self.masters = torch.cat([piece.detach().float().reshape(-1) for piece in self.pieces])
            self.master_pieces = [self.masters[lo:hi] for lo, hi in self.bounds]
        device = self.pieces[0].device
        self.exp_avg = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.steps = 0
        self.shared_ranges = shared_ranges or []
        # the squared norm in two parts, split here, each summed over its own ranks (expert parallelism's experts)
        self.norm_bounds = [(0, self.numel)] if norm_split is None else [(0, norm_split), (norm_split, self.numel)]
        decay_ranges = [(0, self.numel)] if decay_ranges is None else decay_ranges
        # Decay ranges cut at piece borders, in each piece's own coordinates.
        self.piece_decay = [
            [(max(a, lo) - lo, min(b, hi) - lo) for a, b in decay_ranges if max(a, lo) < min(b, hi)]
            for lo, hi in self.bounds
        ]

    @classmethod
    def for_flat(cls, flat: FlatParameters, **options) -> "MasterAdamW":
        """The whole of a FlatParameters (one process, or a replicated ZeRO-0 rank)."""
        ranges = [(0, flat.padded_numel)]
        return cls(flat.data, decay_ranges=flat.decay_ranges(ranges), **options)

    def step(
        self,
        grads: torch.Tensor,
        lr: float | None = None,
        grad_clip: float = 0.0,
        scaler: LossScaler | None = None,
        reduce_sum: Reduce = _identity,
    ) -> "StepResult":
        """One optimizer step from `grads`, laid out as `weights` (in any float format)."""
        lr = self.lr if lr is None else lr
        grad = grads.float()  # a copy only for 16-bit gradients; never written to
        # Unscaling and clipping are one factor on the gradient, folded into the moments' update
        # below instead of a pass over (and a copy of) the gradients.
        factor = 1.0 / scaler.scale if scaler is not None else 1.0
        sum_of_squares = float(reduce_sum(self.sum_of_squares(grad)).double().sum()) * factor * factor
        overflow = not math.isfinite(sum_of_squares)  # any inf or nan anywhere makes the sum one
        skipped = scaler.update(overflow) if scaler is not None else overflow
        if skipped:
            return StepResult(grad_norm=math.nan, skipped=True, loss_scale=self._scale(scaler))
        grad_norm = math.sqrt(sum_of_squares)
        if grad_clip > 0:
            coefficient = grad_clip / (grad_norm + 1e-6)
            if coefficient < 1:
                factor *= coefficient
        self._adamw(grad, lr, factor)
        if not self.masters_are_weights:
            for piece, master in zip(self.pieces, self.master_pieces):
                piece.copy_(master)
        return StepResult(grad_norm=grad_norm, skipped=False, loss_scale=self._scale(scaler))

    def sum_of_squares(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's part of the squared gradient norm, shared weights counted 1/copies (fp32): one number per
        part of `norm_split` (one, or the weights before it and after it), which `reduce_sum` sums over the ranks
        each part's own. Each part is summed alone, never one taken out of another: a difference would round
        differently on ranks whose other part differs, and replicas that must stay equal would not."""
        parts = []
        for lo, hi in self.norm_bounds:
            total = squares(grad[lo:hi])
            for start, end, copies in self.shared_ranges:
                start, end = max(start, lo), min(end, hi)
                if start < end:
                    total = total - squares(grad[start:end]) * (1 - 1 / copies)
            parts.append(total)
        return torch.stack(parts).float()

    @torch.no_grad()
    def _adamw(self, grad: torch.Tensor, lr: float, factor: float = 1.0) -> None:
        """AdamW with the gradient `factor` * grad (unscaled and clipped), one temporary buffer."""
        self.steps += 1
        denominator = self._moments(grad, self.exp_avg, self.exp_avg_sq, factor)
        self._decay(lr)
        for master, (lo, hi) in zip(self.master_pieces, self.bounds):
            master.addcdiv_(self.exp_avg[lo:hi], denominator[lo:hi], value=-lr / (1 - self.betas[0]**self.steps))

    def _moments(self, grad: torch.Tensor, first: torch.Tensor, second: torch.Tensor, factor: float) -> torch.Tensor:
        """AdamW's moments `first` and `second` of `factor` * grad, updated in place; the step's denominator (the
        second moment's root, bias-corrected, plus eps)."""
        beta1, beta2 = self.betas
        first.mul_(beta1).add_(grad, alpha=(1 - beta1) * factor)
        second.mul_(beta2).addcmul_(grad, grad, value=(1 - beta2) * factor * factor)
        return second.sqrt().div_(math.sqrt(1 - beta2**self.steps)).add_(self.eps)

    def _decay(self, lr: float) -> None:
        """Decoupled weight decay on the masters of the weights that take it."""
        if self.weight_decay:
            for master, decay in zip(self.master_pieces, self.piece_decay):
                for start, end in decay:
                    master[start:end].mul_(1 - lr * self.weight_decay)

    @staticmethod
    def _scale(scaler: LossScaler | None) -> float:
        return scaler.scale if scaler is not None else 1.0

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this optimizer owns (masters only when they are not the weights)."""
        tensors = {"adam_m": self.exp_avg, "adam_v": self.exp_avg_sq}
        if not self.masters_are_weights:
            tensors["master"] = self.masters
        return tensors


def squares(values: torch.Tensor) -> torch.Tensor:
    """The sum of the squares of a flat fp32 tensor, in fp64, without a temporary of its size and accurate
    whatever its length: the norms of rows of NORM_ROW elements (fp32, each short), squared and summed in
    fp64. One torch.dot (what this was) accumulates the whole length in fp32 on a CPU: 2.8e-5 relative
    off on 10.8M gradients (torch's clip_grad_norm_, fp32 per-tensor norms: 4.8e-6; this: 1e-9), and
    that error moves the clipping factor, and with it every update. inf and nan survive it."""
    whole = values.numel() // NORM_ROW * NORM_ROW
    rows = torch.linalg.vector_norm(values[:whole].reshape(-1, NORM_ROW), dim=1).double()
    tail = values[whole:].double()
    return rows.square().sum() + tail.square().sum()


@dataclass(frozen=True)
class StepResult:
    grad_norm: float
    skipped: bool
    loss_scale: float


def state_bytes(optimizer: MasterAdamW) -> dict[str, int]:
    """Bytes of the tensors this optimizer owns, measured from the live tensors."""
    return {role: t.numel() * t.element_size() for role, t in optimizer.state_tensors().items()}
