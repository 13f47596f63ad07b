"""Expert parallelism applied to a model from outside, and the two groups it runs over.

The expert group is ep consecutive ranks of those routing distinct tokens through one set of experts on a pipeline
stage (job/exchange/experts.py's expert_places: the dp x cp data ranks at one tp place, or under sequence
parallelism every rank of the stage, in rank order, as Megatron-core folds its expert groups with expert tensor
parallelism 1): they split every MoE layer's experts, rank i of the group holding experts i x E / ep onwards. The
ranks at the same place of every expert group hold the same experts and sum (the tp slices of the tokens) and
average their gradients (parallel/expert/gradients.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minigpt.model import every_block
from minigpt.moe import MoE
from job.exchange.experts import expert_places
from parallel.comm import Collectives
from parallel.expert.dispatch import ExpertParallel
from parallel.mesh import Mesh


def expert_groups(mesh: Mesh, ep: int, device: torch.device,
                  sequence_parallel: bool = False) -> tuple[Collectives, Collectives]:
    """(this rank's expert group, the ranks holding its experts), job/exchange/experts.py's expert_places on every
    pipeline stage; every rank builds every group (new_group is collective), in one order."""
    mine: dict[str, dist.ProcessGroup] = {}
    for pp in range(mesh.pp):
        groups, replicas = expert_places(mesh.dp, mesh.cp, mesh.tp, sequence_parallel, ep)
        for kind, cuts in (("ep", groups), ("replicas", replicas)):
            for places in cuts:
                ranks = [mesh.global_rank(pp, d, c, t) for d, c, t in places]
                group = dist.new_group(ranks)
                if mesh.rank in ranks:
                    mine[kind] = group
    return Collectives(mine["ep"], "ep", device), Collectives(mine.get("replicas"), "ep_replicas", device)


def apply_expert_parallel(model: nn.Module, comm: Collectives) -> None:
    """Every MoE layer's experts split over `comm`'s group, in place (after tensor parallelism, which leaves the
    experts whole)."""
    for block in every_block(model):
        if isinstance(block.mlp, MoE):
            block.mlp.experts = ExpertParallel(block.mlp.experts, comm)
