"""The plain model made context-parallel from outside: each rank computes two chunks of every sequence.

`apply_context_parallel` swaps every block's attention core (minigpt/model.py's AttentionCore, the module
selective recomputation also wraps) for `ContextAttentionCore`, its subclass that keeps the core's norm modules
(Qwen3's qk_norm) and changes only where q and k are rotated (at the tokens' true positions) and how they attend
(across the group by ring or all-gather: parallel/context/ring.py, allgather.py), and
re-indexes a learned position embedding to the same positions (a forward pre-hook: the parameters and their
names stay the model's). A mixture of experts counts its routing over whole sequences (parallel/context/moe.py);
everything else in a block works token by token and needs nothing. Each rank's loss
is the mean over its tokens, the same count on every rank, so the sequence's loss is their mean and its
gradient the mean of the ranks' gradients (`average_over`). Multi-token prediction's modules run the same way on
targets moved ahead over whole sequences before the cut (parallel/run/train.py's micro_batches); each depth's loss
weighs its rank's mean by the share of the depth's positions the rank holds (minigpt/model.py's prediction_loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minigpt.config import GPTConfig
from minigpt.attention import current_documents
from minigpt.model import GPT, AttentionCore, every_block
from parallel.context.allgather import allgather_attention
from parallel.comm import Collectives
from parallel.context.chunks import check_split, positions
from parallel.context.moe import apply_context_moe
from parallel.context.ring import Rehearsal, ring_attention

KINDS = {"ring": ring_attention, "allgather": allgather_attention}


class ContextAttentionCore(AttentionCore):
    """AttentionCore for a rank that holds two chunks of each sequence (parallel/context/chunks.py): the same split,
    norms and rotation, at the chunks' true positions, and attention across the group by ring or all-gather."""

    def __init__(self, config: GPTConfig, core: AttentionCore, group: dist.ProcessGroup | None, kind: str,
                 token_positions: torch.Tensor, counter=None):
        super().__init__(config, core.window, core.rope_theta is not None, core.local)  # the core's sizes, rotation
        self.q_norm, self.k_norm = core.q_norm, core.k_norm  # the model's own norm modules (their weights and names)
        # GPT-OSS's sinks (None: none), merged by the ring and the all-gather once per row; Gemma 2's cap on the scores
        self.sinks, self.softcap = core.sinks, core.softcap
        self.cp_group, self.exchange, self.counter = group, KINDS[kind], counter
        self.register_buffer("token_positions", token_positions, persistent=False)

    def positions(self) -> torch.Tensor:
        return self.token_positions

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.exchange(q, k, v, self.cp_group, scale=self.scale, counter=self.counter, window=self.window,
                             sinks=self.sinks, documents=current_documents(), softcap=self.softcap)


def apply_context_parallel(model: GPT, group: dist.ProcessGroup | Rehearsal | None, kind: str,
                           counter=None) -> torch.Tensor:
    """Make `model` compute this rank's two chunks of each sequence over `group`; the tokens' positions
    (feed the model `chunks.local_part` of its inputs and targets). ValueError on a kind or length that
    cannot be split. `counter` (a parallel.comm.Collectives over the group) counts what the layers exchange."""
    if kind not in KINDS:
        raise ValueError(f"unknown context-parallel attention {kind!r}: choose one of {', '.join(KINDS)}")
    if isinstance(group, Rehearsal):  # its rank 0, alone (parallel/calibrate times it)
        cp, rank = group.size, 0
    else:
        cp = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
    check_split(model.config.seq_len, cp)
    device = next(model.parameters()).device
    token_positions = positions(rank, cp, model.config.seq_len, device)
    for block in every_block(model):  # the multi-token prediction modules' too
        block.attn.core = ContextAttentionCore(model.config, block.attn.core, group, kind, token_positions, counter)
    if model.config.is_moe and cp > 1 and not isinstance(group, Rehearsal):  # a rehearsal routes its own part
        apply_context_moe(model, counter or Collectives(group, "cp"), rank, cp)
    if model.pos_emb is not None:  # the model asks for 0 .. 2c - 1; these tokens sit at token_positions
        model.pos_emb.register_buffer("token_positions", token_positions, persistent=False)  # moves with the model
        model.pos_emb.register_forward_pre_hook(lambda module, args: (module.token_positions[args[0]],))
    return token_positions


def average_over(group: dist.ProcessGroup | None, tensors: list[torch.Tensor]) -> None:
    """Each tensor replaced, in place, by its mean over the group's ranks."""
    if group is None:
        return
    size = dist.get_world_size(group)
    for tensor in tensors:
        dist.all_reduce(tensor, group=group)
        tensor.div_(size)
