"""A mixture of experts under context parallelism: routing counted over whole sequences that a rank holds part of.

Routing itself is token by token; two things count over a whole sequence (minigpt/moe.py): the capacity of each
expert (first choices first, in token order) and the balance loss's share f_e of the sequence's choices that
picked e. `ContextSequence` is the MoE's view of the whole sequence on a rank holding two chunks of each
(parallel/context/chunks.py):
  total   the (batch, E) choice counts all-reduced over the cp group (integers in fp32: exact), so f_e is the
          whole sequence's; the balance loss's mean score P_e stays this rank's mean, and the ranks' gradients,
          averaged over the group as every gradient is (apply.py), average it into the whole sequence's;
  kept    with a capacity factor, every rank's (batch, s / cp, k) expert ids all-gathered, put back in token order
          (chunks.whole_sequence), ranked as one process ranks them, and this rank's two chunks of the verdict
          kept: every layout drops the very same choices.
Both go through the group's Collectives (job/exchange/experts.py's routing_exchanges lists them for the simulator).
Expert parallelism is unchanged: each rank sends its own tokens' rows to the ranks of its expert group (ep data
ranks at the same cp place); the experts' gradients are averaged over every cp place too (parallel/expert/apply.py).
"""

from __future__ import annotations

import torch

from minigpt.moe import MoE, WholeSequence, kept_choices
from parallel.comm import Collectives
from parallel.context.chunks import local_part, whole_sequence


class ContextSequence(WholeSequence):
    def __init__(self, comm: Collectives, rank: int, cp: int):
        self.comm, self.rank, self.cp = comm, rank, cp

    def length(self, local: int) -> int:
        return local * self.cp

    def total(self, picks: torch.Tensor) -> torch.Tensor:
        return self.comm.sum(picks.detach().clone())

    def kept(self, expert_ids: torch.Tensor, n_experts: int, limit: int | None) -> torch.Tensor:
        if limit is None:
            return torch.ones_like(expert_ids, dtype=torch.bool)
        gathered = torch.empty((self.cp, *expert_ids.shape), dtype=expert_ids.dtype, device=expert_ids.device)
        self.comm.all_gather(gathered.view(-1), expert_ids.contiguous().view(-1))
        whole = whole_sequence(list(gathered.unbind(0)), dim=1)
        return local_part(kept_choices(whole, n_experts, limit), self.rank, self.cp, dim=1)


def apply_context_moe(model: torch.nn.Module, comm: Collectives, rank: int, cp: int) -> None:
    """Every MoE layer of `model` counts its routing over the whole sequences of `comm`'s cp group."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.whole = ContextSequence(comm, rank, cp)
