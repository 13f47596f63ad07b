"""The routed experts' gradients under expert parallelism, beside ZeRO's data parallelism over the dense weights.

A rank's experts (parallel/expert/dispatch.py marks them) are left out of ZeRO's flat buffers and buckets
(parallel/pipeline/executor.py's parameter_groups, parallel/data/zero3.py's units); `WithExperts` wraps the ZeRO
stage that runs and adds them:
  - flat in a buffer of their own (whole on the rank: ZeRO-3 does not shard them); after the backward (at the
    optimizer step) their gradients, already summed over every token the expert group routed to them, are divided
    by the dp x cp data ranks (the mean over the global batch, as ZeRO's) and averaged over the ranks that hold the
    same experts (the expert-data group, R ranks: job/exchange/experts.py's expert_gradient_reduction);
  - under ZeRO 0 that is one all-reduce, and every rank updates all its experts; under ZeRO 1-3 their optimizer
    states are sharded over the expert-data group as Megatron-core's distributed optimizer shards them: the buffer
    is padded to a multiple of R, the gradients are reduce-scattered, rank r of the group keeps fp32 masters and
    AdamW moments for piece r only and updates it, and `end_step` all-gathers the new weights (the dense ZeRO
    stage's own sharding is unchanged);
  - handed to the optimizer after ZeRO's pieces (`weights`, `finish_grads`);
  - in the gradient norm once each: the optimizer sums the squares of the dense weights and of the experts apart
    (MasterAdamW's norm_split, at `dense_numel`), and `reduce_sum` sums the first as ZeRO does over the data
    group and the second over the expert group (each expert lives on one of its ranks) and, when sharded, the
    expert-data group (each piece on one of its ranks); tensor-parallel copies are divided out by the optimizer's
    shared ranges, as for every replicated weight.
Everything else of the data-parallel protocol (parallel/data/protocol.py) is ZeRO's.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel.comm import Collectives
from parallel.expert import is_expert_shard
from precision.flat import FlatParameters


def expert_shards(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, param) for name, param in model.named_parameters() if is_expert_shard(param)]


class WithExperts:
    def __init__(self, inner, model: nn.Module, experts_comm: Collectives, replicas: Collectives, data_ranks: int):
        """`inner`: the ZeRO stage over the dense weights; `experts_comm`: the expert group; `replicas`: the
        ranks holding the same experts; `data_ranks`: dp x cp."""
        # named apart from ZeRO's own `flat` and `replicas`, which every other reader gets through __getattr__
        self.inner, self.experts_comm, self.expert_replicas = inner, experts_comm, replicas
        self.data_ranks = data_ranks
        self.stage = inner.stage
        self.sharded = inner.stage >= 1 and replicas.size > 1  # the module docstring
        rank, shards = (replicas.rank, replicas.size) if self.sharded else (0, 1)
        self.expert_flat = FlatParameters(expert_shards(model), pad_to=shards)  # one bucket: one piece a rank
        (self.expert_range,) = self.expert_flat.shard_ranges(rank, shards)  # what this rank's optimizer owns
        self.gather_pending = False

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # the rest of the protocol is ZeRO's

    @property
    def dense_numel(self) -> int:
        weights = self.inner.weights
        return sum(w.numel() for w in weights) if isinstance(weights, list) else weights.numel()

    @property
    def weights(self) -> list[torch.Tensor]:
        weights = self.inner.weights
        start, end = self.expert_range
        return (list(weights) if isinstance(weights, list) else [weights]) + [self.expert_flat.data[start:end]]

    def _expert_ranges(self, select) -> list[tuple[int, int]]:
        """The parts of the experts' buffer `select(index)` picks, in `weights` coordinates (after ZeRO's pieces)."""
        flat, base = self.expert_flat, self.dense_numel
        return [(base + lo, base + hi) for lo, hi in flat.local_ranges([self.expert_range], select)]

    @property
    def decay_ranges(self) -> list[tuple[int, int]]:
        return list(self.inner.decay_ranges) + self._expert_ranges(lambda i: self.expert_flat.segments[i].decay)

    def ranges_of(self, param_ids: set[int]) -> list[tuple[int, int]]:
        params = self.expert_flat.params
        return self.inner.ranges_of(param_ids) + self._expert_ranges(lambda i: id(params[i]) in param_ids)

    def begin_step(self) -> None:
        self.inner.begin_step()
        self.expert_flat.zero_grad()

    def finish_grads(self) -> torch.Tensor:
        dense = self.inner.finish_grads()
        grad = self.expert_flat.grad
        grad.div_(self.data_ranks)
        if self.sharded:
            start, end = self.expert_range
            piece = torch.empty(end - start, dtype=grad.dtype, device=grad.device)
            self.expert_replicas.reduce_scatter(piece, grad)
            grad, self.gather_pending = piece, True
        else:
            self.expert_replicas.all_reduce(grad)
        return torch.cat([dense.reshape(-1), grad.to(dense.dtype)])

    def gather_experts(self) -> None:
        """Every rank of the expert-data group gets the pieces the others updated (sharded states only)."""
        start, end = self.expert_range
        self.expert_replicas.all_gather(self.expert_flat.data, self.expert_flat.data[start:end].clone())
        self.gather_pending = False

    def end_step(self) -> None:
        self.inner.end_step()
        if self.gather_pending:
            self.gather_experts()

    def after_update(self) -> None:
        """Outside a scheduled step (a loaded checkpoint): refresh every weight, the experts' pieces too."""
        self.inner.after_update()
        if self.sharded:
            self.gather_experts()

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value`: the squared norm's (dense, experts') parts on this rank; each summed over its own ranks."""
        experts = self.experts_comm.sum(value[1:].clone())
        if self.sharded:
            experts = self.expert_replicas.sum(experts)
        return torch.cat([self.inner.reduce_sum(value[:1].clone()), experts])

    def parameter_storages(self) -> set[int]:
        return self.inner.parameter_storages() | {self.expert_flat.data.untyped_storage().data_ptr()}

    def memory(self) -> dict[str, int]:
        memory, flat = dict(self.inner.memory()), self.expert_flat
        memory["parameters"] += flat.data.numel() * flat.data.element_size()
        memory["gradients"] += flat.grad.numel() * flat.grad.element_size()
        if self.sharded:  # the reduce-scatter's piece (simulator/states.py's experts_states)
            start, end = self.expert_range
            memory["comm_buffers"] += (end - start) * flat.grad.element_size()
        return memory
