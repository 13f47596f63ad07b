"""DeepSeek-V3's auxiliary-loss-free balancing over a layout: each MoE layer's choice bias moved after every step by
the whole batch's load (minigpt/moe.py's `update_bias`), the same on every rank of every layout.

A layer's routers run where its tokens are: every rank of the pipeline stage holding it routes the tokens of its
data-parallel and context-parallel place (each other tokens), and under sequence parallelism each tensor-parallel
rank its own slice; without it the tensor-parallel peers route the very same tokens. The step's choices per expert
are summed over the stage's ranks that route other tokens (the data group, and the tensor-parallel group under
sequence parallelism; expert parallelism moves tokens after the choice, so it adds nothing): one all-reduce of the
stage's counts a step, fp64 (whole numbers, exact), outside the schedule's traffic like the loss's mean
(parallel/run/step.py). Every rank then applies the same update to its copy of the bias.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minigpt.moe import biased_layers, update_bias
from parallel.mesh import Mesh


def update_expert_bias(stage: nn.Module, mesh: Mesh, sequence_parallel: bool) -> None:
    """Move every biased layer's choice bias by the step's load over the whole batch; every rank calls it after
    the optimizer step (a collective over the stage's token-routing ranks when there are several)."""
    layers = biased_layers(stage)
    if not layers:
        return
    counts = torch.stack([layer.step_load for layer in layers])
    for group in (mesh.data_group(), mesh.group("tp") if sequence_parallel else None):
        if group is not None:
            dist.all_reduce(counts, group=group)
    for layer, load in zip(layers, counts):
        update_bias(layer, load)
