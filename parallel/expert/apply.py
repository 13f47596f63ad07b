"""Expert parallelism applied to a model from outside, and the two groups it runs over.

The expert group is ep consecutive data-parallel ranks at one (pp, cp, tp) place of the mesh (parallel/mesh.py):
they split every MoE layer's experts, rank i of the group holding experts i x E / ep onwards. The ranks at the
same place of every expert group, at every cp place (dp x cp / ep of them; under sequence parallelism at every tp
place too, x tp), hold the same experts and sum or average their gradients (parallel/expert/gradients.py).
job/exchange/experts.py describes both for the simulator.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minigpt.moe import MoE
from parallel.comm import Collectives
from parallel.expert.dispatch import ExpertParallel
from parallel.mesh import Mesh


def expert_groups(mesh: Mesh, ep: int, device: torch.device,
                  sequence_parallel: bool = False) -> tuple[Collectives, Collectives]:
    """(this rank's expert group, the ranks holding its experts: the same place of every expert group at every cp
    place, and under sequence parallelism at every tp place too, whose ranks route other tokens through copies of
    the same experts); every rank builds every group (new_group is collective), in one order."""
    mine: dict[str, dist.ProcessGroup] = {}
    places = [[tp] for tp in range(mesh.tp)] if not sequence_parallel else [list(range(mesh.tp))]
    for pp in range(mesh.pp):
        for tps in places:
            place = lambda dp, cp, tp: mesh.global_rank(pp, dp, cp, tp)  # noqa: E731
            cuts = [("ep", [place(dp, cp, tp) for dp in range(start, start + ep)])
                    for tp in tps for cp in range(mesh.cp) for start in range(0, mesh.dp, ep)]
            if mesh.dp * mesh.cp * len(tps) > ep:
                cuts += [("replicas", [place(dp, cp, tp) for dp in range(first, mesh.dp, ep) for cp in range(mesh.cp)
                                       for tp in tps]) for first in range(ep)]
            for kind, ranks in cuts:
                group = dist.new_group(ranks)
                if mesh.rank in ranks:
                    mine[kind] = group
    return Collectives(mine["ep"], "ep", device), Collectives(mine.get("replicas"), "ep_replicas", device)


def apply_expert_parallel(model: nn.Module, comm: Collectives) -> None:
    """Every MoE layer's experts split over `comm`'s group, in place (after tensor parallelism, which leaves the
    experts whole)."""
    for block in model.blocks:
        if isinstance(block.mlp, MoE):
            block.mlp.experts = ExpertParallel(block.mlp.experts, comm)
