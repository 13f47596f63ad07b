"""A mixture of experts under sequence parallelism: each tensor-parallel rank routes its own slice of the tokens.

With `--sequence-parallel` a MoE layer's input is this rank's contiguous 1/T of the (context-parallel rank's)
sequence, as the LayerNorms' are (parallel/tensor/layers.py's SequenceSplit). The MoE runs on those tokens alone,
whole on every rank (no expert tensor parallelism, Megatron-core's expert-tensor-parallel 1): no collective on its
input or output, and each rank's router, shared and routed experts see 1/T of the tokens, so their gradients are
summed over the group (parallelize.py's hooks; expert-parallel slices through their replicas' all-reduce,
parallel/expert/apply.py). What counts over a whole sequence (minigpt/moe.py) is `SequenceSlices`' business:
  total   the (batch, E) choice counts all-reduced over the tp group (exact: integers in fp32), then handed to
          the view it wraps (context parallelism's, or the sequence itself);
  kept    with a capacity factor, the (batch, s / T, k) expert ids all-gathered over the group in rank order
          (the slices are contiguous), the wrapped view's verdict taken on them and this rank's slice kept;
  share   the router's losses weigh this rank's token means by 1 / T: summed over the group they are the whole
          sequence's mean.
job/exchange/experts.py's routing_exchanges lists both exchanges for the simulator.
"""

from __future__ import annotations

import torch

from minigpt.moe import MoE, WholeSequence
from parallel.comm import Collectives


class SequenceSlices(WholeSequence):
    def __init__(self, comm: Collectives, inner: WholeSequence):
        self.comm, self.inner = comm, inner

    def length(self, local: int) -> int:
        return self.inner.length(local * self.comm.size)

    def total(self, picks: torch.Tensor) -> torch.Tensor:
        return self.inner.total(self.comm.sum(picks.detach().clone()))

    def kept(self, expert_ids: torch.Tensor, n_experts: int, limit: int | None) -> torch.Tensor:
        if limit is None:
            return torch.ones_like(expert_ids, dtype=torch.bool)
        size, piece = self.comm.size, expert_ids.shape[1]
        gathered = torch.empty((size, *expert_ids.shape), dtype=expert_ids.dtype, device=expert_ids.device)
        self.comm.all_gather(gathered.view(-1), expert_ids.contiguous().view(-1))
        local = torch.cat(list(gathered.unbind(0)), dim=1)  # the rank's whole (cp-local) sequence, in token order
        verdict = self.inner.kept(local, n_experts, limit)
        return verdict.narrow(1, self.comm.rank * piece, piece)

    @property
    def gradient_share(self) -> float:
        return self.inner.gradient_share / self.comm.size


def apply_sequence_moe(model: torch.nn.Module, comm: Collectives) -> list[torch.nn.Parameter]:
    """Every MoE layer of `model` routes this rank's slice of the sequence over `comm`'s tp group; returns the
    MoE parameters, whose gradients are parts to be summed over the group."""
    params = []
    for module in model.modules():
        if isinstance(module, MoE):
            module.whole = SequenceSlices(comm, module.whole)
            params += list(module.parameters())
    return params
