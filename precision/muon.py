"""Muon on fp32 master weights: the hidden matrices' updates orthogonalised, AdamW for the rest.

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers"; Liu et al. 2025, "Muon is scalable for LLM
training", arXiv 2502.16982, Moonlight's recipe; Kimi K2, with its QK-clip, and GLM-4.5 report training with it)
keeps one momentum buffer per matrix and steps along the nearest semi-orthogonal matrix to its Nesterov update,
found by five Newton-Schulz iterations of the quintic (3.4445, -4.7750, 2.0315): parallel/run/muon.py's
orthogonalized. Moonlight's two changes make it a drop-in for AdamW: the orthogonal update is scaled by
0.2 sqrt(max(rows, cols)), which gives it AdamW's update RMS, so the learning rate and the schedule carry over, and
decoupled weight decay applies to the matrices as to every other weight.

Which parameters: job/muon.py's takes_muon (every matrix of a block; the embeddings, head, norms, biases: AdamW).

The update needs each matrix whole, while a rank holds a piece of it (a tensor-parallel shard, a ZeRO piece, some
experts): `MasterMuon` works on the rank's flat range as MasterAdamW does and leaves the whole-matrix part to an
`orthogonalize` callback (parallel/run/muon.py gathers the pieces, and the one-process run has them whole).
Its state: the momentum of the matrices (fp32, in `exp_avg`, where AdamW keeps its first moment) and AdamW's two
moments of the other weights (`exp_avg_sq` holds those alone, end to end): 4 bytes a matrix weight less than AdamW.
"""

from __future__ import annotations

from typing import Callable

import torch

from precision.optimizer import MasterAdamW

Ranges = list[tuple[int, int]]


def _cut(ranges: Ranges, bounds: Ranges) -> Ranges:
    """`ranges` cut where the pieces `bounds` meet, so that each lies inside one piece."""
    return [(max(a, lo), min(b, hi)) for a, b in ranges for lo, hi in bounds if max(a, lo) < min(b, hi)]


def _complement(ranges: Ranges, numel: int) -> Ranges:
    out, at = [], 0
    for start, end in sorted(ranges):
        if at < start:
            out.append((at, start))
        at = end
    return out + ([(at, numel)] if at < numel else [])


class MasterMuon(MasterAdamW):
    """Muon for the matrices at `matrix_ranges` (of the weights laid end to end), AdamW for the other weights.

    `orthogonalize(update)`: fills the matrices' ranges of the flat `update` (the rank's Nesterov momentum there)
    with the orthogonalised update of each whole matrix (`orthogonalized`), in place."""

    def __init__(self, weights, matrix_ranges: Ranges, orthogonalize: Callable[[torch.Tensor], None],
                 momentum: float = 0.95, **options):
        super().__init__(weights, **options)
        self.momentum, self.orthogonalize = momentum, orthogonalize
        self.matrix_ranges = _cut(sorted(matrix_ranges), self.bounds)
        self.adam_ranges = _cut(_complement(self.matrix_ranges, self.numel), self.bounds)
        self.adam_offsets, offset = [], 0  # where each AdamW range's second moment starts in exp_avg_sq
        for start, end in self.adam_ranges:
            self.adam_offsets.append(offset)
            offset += end - start
        self.exp_avg_sq = torch.zeros(offset, dtype=torch.float32, device=self.exp_avg.device)
        # each range's masters, a view of the one piece it lies in
        self.matrix_masters = [self._master(start, end) for start, end in self.matrix_ranges]
        self.adam_masters = [self._master(start, end) for start, end in self.adam_ranges]

    def second_moment(self, start: int, end: int) -> torch.Tensor:
        """exp_avg_sq of the weights [start, end) laid end to end: an AdamW range's part (a checkpoint's box)."""
        for (lo, hi), offset in zip(self.adam_ranges, self.adam_offsets):
            if lo <= start and end <= hi:
                return self.exp_avg_sq[offset + start - lo : offset + end - lo]
        raise AssertionError(f"[{start}, {end}) is not within one range of AdamW's weights")

    def _master(self, start: int, end: int) -> torch.Tensor:
        for master, (lo, hi) in zip(self.master_pieces, self.bounds):
            if lo <= start and end <= hi:
                return master[start - lo : end - lo]
        raise AssertionError(f"[{start}, {end}) crosses a piece of the weights")

    @torch.no_grad()
    def _adamw(self, grad: torch.Tensor, lr: float, factor: float = 1.0) -> None:
        """One step: decay every weight that takes it, Muon's update on the matrices, AdamW's on the rest."""
        self.steps += 1
        self._decay(lr)
        update = torch.zeros(self.numel, dtype=torch.float32, device=self.exp_avg.device)
        for start, end in self.matrix_ranges:  # Nesterov: the gradient plus the momentum it joined
            momentum, step = self.exp_avg[start:end], grad[start:end] * factor
            momentum.mul_(self.momentum).add_(step)
            update[start:end] = step.add_(momentum, alpha=self.momentum)
        self.orthogonalize(update)
        for (start, end), master in zip(self.matrix_ranges, self.matrix_masters):
            master.add_(update[start:end], alpha=-lr)
        for (start, end), offset, master in zip(self.adam_ranges, self.adam_offsets, self.adam_masters):
            first, second = self.exp_avg[start:end], self.exp_avg_sq[offset : offset + end - start]
            denominator = self._moments(grad[start:end], first, second, factor)
            master.addcdiv_(first, denominator, value=-lr / (1 - self.betas[0]**self.steps))
