"""Muon's whole matrices from the pieces a pipeline stage's ranks hold (precision/muon.py's orthogonalize).

A rank's optimizer holds pieces of its stage's matrices: tensor-parallel shards (a fused qkv's sections among
them), ZeRO's pieces cut at any element, the experts of its expert-parallel rank. Where each piece sits in the
plain GPT's tensor is what a checkpoint reads and writes by (parallel/checkpoint/layout.py's placements, each
element with one writer among the ranks holding it). The stage's matrices are dealt out to its ranks (pp rank
alike: dp x cp x tp, the experts' ranks among them) by job/muon.py's assign_matrices, and each step

  1. every rank sends the pieces it writes to the ranks that orthogonalise their matrices (one all-to-all);
  2. each rank puts its matrices together whole and orthogonalises them;
  3. every rank gets back each piece it holds of them (a second all-to-all, the reverse of the first, with the
     pieces several ranks hold sent to each).

Each rank sends and receives what it holds and keeps its own matrices whole, no more, and each matrix is
orthogonalised once (Liu et al. 2025's distributed Muon gathers a matrix on every data-parallel rank holding a piece
of it and computes it on each). Where each rank's boxes are is exchanged once, when the optimizer is built. One
process has one stage and no group: the same code, its all-to-alls copies.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from job.muon import MOONLIGHT_SCALE, NEWTON_SCHULZ, NEWTON_SCHULZ_STEPS, Matrix, assign_matrices, matrices, takes_muon
from parallel.checkpoint.layout import global_shapes, parameter_names, rank_placements
from parallel.comm import Collectives


@torch.no_grad()
def orthogonalized(update: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Newton-Schulz's semi-orthogonal approximation of `update` (a matrix, or a stack of them: the last two
    dimensions), iterated in `dtype` (bf16 as Jordan et al.'s and Moonlight's code on a GPU), times Moonlight's
    scale, in fp32."""
    rows, cols = update.shape[-2:]
    x = update.to(dtype)
    wide = rows <= cols
    x = x if wide else x.transpose(-2, -1)  # iterate on the side whose Gram matrix is the smaller
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    a, b, c = NEWTON_SCHULZ
    for _ in range(NEWTON_SCHULZ_STEPS):
        gram = x @ x.transpose(-2, -1)
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    x = x if wide else x.transpose(-2, -1)
    return x.float() * (MOONLIGHT_SCALE * math.sqrt(max(rows, cols)))


def iteration_format(policy, device: torch.device) -> torch.dtype:
    """What Newton-Schulz iterates in: bf16 on a GPU training in a 16-bit or fp8 format (the reference code's: the
    iteration tolerates it, and tensor cores run it), fp32 otherwise (a CPU has no bf16 matmul worth using:
    precision/compute.py emulates 16-bit formats there)."""
    return torch.bfloat16 if device.type == "cuda" and policy.compute != "fp32" else torch.float32


Box = tuple[Matrix, tuple[int, ...], tuple[int, ...]]  # a matrix, the box's offsets and sizes in it


class StageMatrices:
    """The matrices of one rank's stage: where its optimizer holds pieces of them, and their orthogonalisation."""

    def __init__(self, rank, cfg, group: dist.ProcessGroup | None):
        self.dtype = iteration_format(rank.policy, rank.mesh.device)
        shapes = global_shapes(cfg.model)
        names = set(parameter_names(rank, cfg).values())
        self.shapes = matrices({name: shape for name, shape in shapes.items() if name in names})
        self.comm, self.device = Collectives(group, "muon", rank.mesh.device), rank.mesh.device
        self.owner = {key: owner for owner, keys in enumerate(assign_matrices(self.shapes, self.comm.size))
                      for key in keys}
        # where each matrix this rank orthogonalises sits in its buffer: those of one shape side by side, one batch
        self.offsets, self.batches, total = {}, [], 0  # batches: (start, how many, shape)
        for key in sorted((k for k, owner in self.owner.items() if owner == self.comm.rank),
                          key=lambda k: (self.shapes[k], k)):
            shape = self.shapes[key]
            if self.batches and self.batches[-1][2] == shape:
                self.batches[-1] = (self.batches[-1][0], self.batches[-1][1] + 1, shape)
            else:
                self.batches.append((total, 1, shape))
            self.offsets[key] = total
            total += math.prod(shape)
        self.numel = total
        # (box, position in the optimizer's weights end to end, written by this rank) of every piece held
        self.held = [held for p in rank_placements(rank, cfg) if takes_muon(p.name) for held in _boxes(p)]
        boxes = [[(box, writes) for box, _, writes in self.held]]
        if group is not None:
            boxes = [None] * self.comm.size
            dist.all_gather_object(boxes, [(box, writes) for box, _, writes in self.held], group=group)
        me, ranks = self.comm.rank, range(self.comm.size)
        self.sent = [[box for box, writes in theirs if writes and self.owner[box[0]] == me]
                     for theirs in boxes]  # what each rank sends this one, in its order
        self.returned = [[box for box, _ in theirs if self.owner[box[0]] == me] for theirs in boxes]
        # (position, elements) of the pieces this rank sends each rank, and of those each sends back, in order
        self.outgoing = [[(p, math.prod(box[2])) for box, p, writes in self.held if writes and self.owner[box[0]] == r]
                         for r in ranks]
        self.incoming = [[(p, math.prod(box[2])) for box, p, _ in self.held if self.owner[box[0]] == r] for r in ranks]
        # elements this rank gets from each rank on the way there, and back
        self.there = [sum(math.prod(box[2]) for box in boxes) for boxes in self.sent]
        self.back = [sum(n for _, n in pieces) for pieces in self.incoming]

    def ranges(self) -> list[tuple[int, int]]:
        """The ranges of the optimizer's weights (end to end) that are pieces of these matrices."""
        runs = sorted((position, position + math.prod(box[2])) for box, position, _ in self.held)
        merged: list[tuple[int, int]] = []
        for start, end in runs:
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], end)
            else:
                merged.append((start, end))
        return merged

    def _box(self, buffer: torch.Tensor, box: Box) -> torch.Tensor:
        key, offsets, sizes = box
        start = self.offsets[key]
        whole = buffer[start : start + math.prod(self.shapes[key])].view(self.shapes[key])
        return whole[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))]

    def _exchange(self, pieces: list[list[torch.Tensor]], received: list[int]) -> torch.Tensor:
        """An all-to-all of `pieces` (for each rank, in order) into a flat tensor of `received` elements per rank."""
        sent = [sum(piece.numel() for piece in for_rank) for for_rank in pieces]
        flat = [piece.reshape(-1) for for_rank in pieces for piece in for_rank]
        data = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float32, device=self.device)
        output = torch.empty(sum(received), dtype=torch.float32, device=self.device)
        self.comm.all_to_all(output, data, received, sent)
        return output

    @torch.no_grad()
    def orthogonalize(self, update: torch.Tensor) -> None:
        """Replace this rank's pieces of the matrices in `update` by their whole matrices' orthogonalised update."""
        if not self.shapes:  # a stage of embeddings alone (every rank of it alike)
            return
        outgoing = [[update[position : position + n] for position, n in pieces] for pieces in self.outgoing]
        incoming = self._exchange(outgoing, self.there)
        buffer, at = torch.empty(self.numel, dtype=torch.float32, device=self.device), 0
        for box in (box for boxes in self.sent for box in boxes):
            n = math.prod(box[2])
            self._box(buffer, box).copy_(incoming[at : at + n].view(box[2]))
            at += n
        for start, count, shape in self.batches:  # the matrices of one shape as one batch of GEMMs
            stack = buffer[start : start + count * math.prod(shape)].view(count, *shape)
            stack.copy_(orthogonalized(stack, self.dtype))
        back = self._exchange([[self._box(buffer, box) for box in boxes] for boxes in self.returned], self.back)
        at = 0
        for position, n in (piece for pieces in self.incoming for piece in pieces):
            update[position : position + n].copy_(back[at : at + n])
            at += n


def _boxes(placement) -> list[tuple[Box, int, bool]]:
    """(box, position, written here) of a placement's boxes, a stacked expert tensor's cut into each expert's (a box
    of several experts holds their whole matrices, one after another)."""
    found = []
    for offsets, sizes, position in placement.boxes:
        if len(placement.shape) == 2:
            found.append((((placement.name, -1), offsets, sizes), position, placement.writes))
            continue
        step = math.prod(sizes[1:])
        found += [(((placement.name, offsets[0] + j), offsets[1:], sizes[1:]), position + j * step, placement.writes)
                  for j in range(sizes[0])]
    return found
