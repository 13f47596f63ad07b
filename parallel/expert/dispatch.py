"""Routed tokens to the ranks holding their experts and back: all-to-alls over uneven splits.

`ExpertParallel` takes the place of a MoE's `Experts` (minigpt/moe.py), whose interface it keeps: rows grouped
by global expert and the count of each. Per call, on the expert group (job/exchange/experts.py lists the same):
  1. counts    an all-to-all of the E counts: each rank learns how many rows each peer sends its experts;
  2. dispatch  an all-to-all of the rows, rows for rank r going to r (uneven splits);
  3. the received rows, grouped by source and then by local expert, are regrouped by local expert, run through
     this rank's E / ep experts and put back in arrival order;
  4. combine   an all-to-all sending every output home, where it lands in the order its rows left.
The backward runs 4 and 2 in reverse (AllToAll's backward): the outputs' gradients go out with the dispatch's
splits, the inputs' gradients come back with the combine's.
"""

from __future__ import annotations

import torch
from torch import nn

from minigpt.moe import Experts
from parallel.comm import Collectives
from parallel.expert import EXPERT_MARK


class AllToAll(torch.autograd.Function):
    """rows -> the group's all-to-all (input_splits rows to each rank, output_splits from each); its backward is
    the reverse exchange."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], comm: Collectives):
        ctx.splits, ctx.comm = (output_splits, input_splits), comm
        out = rows.new_empty(sum(output_splits), rows.shape[1])
        comm.all_to_all(out, rows.contiguous(), output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty(sum(input_splits), grad.shape[1])
        ctx.comm.all_to_all(back, grad.contiguous(), input_splits, output_splits)
        return back, None, None, None


def slice_experts(experts: Experts, first: int, count: int) -> Experts:
    """`experts` keeping only experts first .. first + count - 1 (copies of their weights, marked as expert shards)."""
    for name in ("w1", "w2", "b1", "b2"):
        full = getattr(experts, name)
        if full is not None:
            part = nn.Parameter(full.detach()[first : first + count].clone())
            setattr(part, EXPERT_MARK, True)
            setattr(experts, name, part)
    return experts


class ExpertParallel(nn.Module):
    """One MoE layer's experts split over the expert group of `comm`: this rank holds E / ep of them."""

    def __init__(self, experts: Experts, comm: Collectives):
        super().__init__()
        self.comm, self.ep = comm, comm.size
        total = experts.w1.shape[0]
        self.n_local = total // self.ep
        self.local = slice_experts(experts, comm.rank * self.n_local, self.n_local)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, self.n_local
        received = torch.empty_like(counts)
        self.comm.all_to_all(received, counts, [local] * ep, [local] * ep)
        by_source = received.view(ep, local)  # rows each rank sends for each of this rank's experts
        sent = counts.view(ep, local).sum(1).tolist()
        arriving = by_source.sum(1).tolist()
        rows = AllToAll.apply(x, arriving, sent, self.comm)
        expert_of_row = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(received)
        order = torch.sort(expert_of_row, stable=True).indices  # by local expert, sources in rank order inside
        out = self.local(rows[order], by_source.sum(0))
        back = out[torch.argsort(order)]  # arrival order again
        return AllToAll.apply(back, sent, arriving, self.comm)
