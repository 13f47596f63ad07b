"""`parallelize`: the plain GPT of minigpt/model.py made tensor-parallel from outside.

Modules are replaced, never edited: qkv and fc1 become column-parallel (each rank
keeping whole query and key/value heads, and a SwiGLU's gate rows with their up rows; under
multi-head latent attention the up projections keep whole heads of the latent every rank makes), proj and
fc2 row-parallel, the token embedding and the LM head vocabulary-parallel (the
head keeps sharing the embedding's shard when tied), and the loss a
vocabulary-parallel cross-entropy that never gathers the logits. Every shard is
cut from the model's own initialisation, so any layout starts from the same
weights as one process with the same seed. The vocabulary is padded to a
multiple of T with zero rows whose logits never count.
"""

from __future__ import annotations

import torch
from torch import nn

from minigpt.model import AttentionCore, LatentAttention, every_block
from minigpt.moe import MoE
from parallel.comm import Collectives
from parallel.tensor.moe import apply_sequence_moe
from parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ScatterToSequence,
    SequenceSplit,
    SpreadToGroup,
    VocabParallelEmbedding,
    VocabParallelLoss,
    shard_rows,
)
from job.train_config import check_tensor_parallel


def _replace_weight(inner: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    inner.weight = nn.Parameter(weight)
    inner.bias = None if bias is None else nn.Parameter(bias)
    return inner


def _shard_sections(tensor: torch.Tensor | None, sections: list[int], rank: int, size: int) -> torch.Tensor | None:
    """This rank's rows of each section of a fused weight or bias, the sections kept in order: for qkv
    its query heads, then its key heads, then its value heads; for a SwiGLU fc1 its gate rows, then its
    up rows. Section sizes are whole heads (or MLP rows) times `size`, so every rank gets whole heads."""
    if tensor is None:
        return None
    return torch.cat([shard_rows(part, rank, size) for part in tensor.split(sections)])


def _shard_columns(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    columns = weight.shape[1] // size
    return weight[:, rank * columns : (rank + 1) * columns].clone()


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def parallelize(model: nn.Module, comm: Collectives, sequence_parallel: bool = False) -> list[nn.Parameter]:
    """Make `model` tensor-parallel over `comm`'s group, in place.

    Returns the parameters that stay replicated on every rank of the group
    (LayerNorms, position embeddings, biases added after a sum), which a gradient
    norm must count once: the parameters themselves, not their ids, since an id
    outlives a parameter replaced later (expert parallelism's whole experts) and
    CPython gives it to the next object made at that address. With sequence parallelism those that see
    only a piece of the sequence get their gradients summed over the group.
    """
    size, rank = comm.size, comm.rank
    config = model.config
    check_tensor_parallel(config, size, sequence_parallel)
    if size == 1:
        return []
    detached = {name: p.detach() for name, p in model.named_parameters()}

    padded_vocab = -(-config.vocab_size // size) * size
    start = rank * (padded_vocab // size)
    embedding = nn.Parameter(shard_rows(_pad_rows(detached["tok_emb.weight"], padded_vocab), rank, size))
    model.tok_emb = VocabParallelEmbedding(embedding, start, comm)
    head = model.head
    if config.tied_head:
        head.weight = embedding
    else:
        _replace_weight(head, shard_rows(_pad_rows(head.weight.detach(), padded_vocab), rank, size), None)
    model.head = ColumnParallelLinear(head, comm, sequence_parallel)
    model.loss = VocabParallelLoss(start, config.vocab_size, comm)
    if sequence_parallel:
        model.drop = SequenceSplit(model.drop, comm)

    head_dim = config.head_dim
    fused = {"qkv": [config.n_heads * head_dim, config.kv_heads * head_dim, config.kv_heads * head_dim],
             "fc1": [config.d_ff] * (config.mlp_in_width // config.d_ff)}
    experts = []  # a mixture of experts stays whole on every rank (no expert tensor parallelism): each computes it
    latent = []  # MLA's down projection and latent norms: every rank makes the whole latent (its rows under SP)
    for block in every_block(model):  # for the same tokens (or, under SP, for its slice of them: summed below)
        dense = not isinstance(block.mlp, MoE)
        experts += [] if dense else list(block.mlp.parameters())
        mla = isinstance(block.attn, LatentAttention)
        latent += _latent_attention(block.attn, comm, sequence_parallel) if mla else []
        for core in block.attn.modules():  # (the core is wrapped under selective recompute)
            if isinstance(core, AttentionCore):
                _shard_core(core, comm)
        column = ([] if mla else [(block.attn, "qkv")]) + ([(block.mlp, "fc1")] if dense else [])
        for parent, name in column:
            inner = getattr(parent, name)
            weight = _shard_sections(inner.weight.detach(), fused[name], rank, size)
            bias = _shard_sections(None if inner.bias is None else inner.bias.detach(), fused[name], rank, size)
            setattr(parent, name, ColumnParallelLinear(_replace_weight(inner, weight, bias), comm, sequence_parallel))
        for parent, name in ((block.attn, "proj"), (block.mlp, "fc2"))[: 2 if dense else 1]:
            inner = getattr(parent, name)
            bias = None if inner.bias is None else nn.Parameter(inner.bias.detach().clone())
            _replace_weight(inner, _shard_columns(inner.weight.detach(), rank, size), None)
            setattr(parent, name, RowParallelLinear(inner, bias, comm, sequence_parallel))

    sequence_pieces = list(model.norm_f.parameters()) + latent  # replicated and fed 1/T of the sequence under SP
    # the multi-token prediction modules' norms and projection (whole on every rank), and under SP their embedded
    # tokens cut to this rank's slice, as the model's own are after their dropout (ScatterToSequence)
    sequence_pieces += [p for module in model.mtp for part in (module.enorm, module.hnorm, module.eh_proj, module.norm)
                        for p in part.parameters()]
    for module in model.mtp if sequence_parallel else []:
        module.register_forward_pre_hook(lambda _, args: (args[0], ScatterToSequence.apply(args[1], comm)))
    for block in every_block(model):
        norms = (block.ln1, block.ln2, block.post_attn_norm, block.post_mlp_norm)  # Gemma's post norms too
        sequence_pieces += [p for norm in norms for p in norm.parameters()]
        mlp_bias = getattr(getattr(block.mlp, "fc2", None), "bias", None)  # a MoE has none of its own
        sequence_pieces += [b for b in (block.attn.proj.bias, mlp_bias) if b is not None]
    if sequence_parallel:  # a MoE then routes this rank's slice of the tokens (parallel/tensor/moe.py)
        for param in sequence_pieces + apply_sequence_moe(model, comm):
            param.register_hook(lambda grad: _sum_over_group(grad, comm))
    head_norms = [p for core in model.modules() if isinstance(core, AttentionCore) and core.q_norm is not None
                  and not core.whole for norm in (core.q_norm, core.k_norm) for p in norm.parameters()]
    for param in head_norms:  # shared by every head, and a rank holds some of them: its gradient is a part
        param.register_hook(lambda grad: _sum_over_group(grad, comm))
    whole_sequence = [] if model.pos_emb is None else [model.pos_emb.weight]
    return whole_sequence + sequence_pieces + experts + head_norms


def _latent_attention(attn: LatentAttention, comm: Collectives, sequence_parallel: bool) -> list[nn.Parameter]:
    """MLA made tensor-parallel as Megatron-core makes it: the down projection and the latent norms stay whole on
    every rank, the normed latent goes to every rank (`spread`: all-gathered along the sequence under SP, else
    all-reduced backward), the up projections keep this rank's heads (rows) and proj is row-parallel (done with
    the others). Queries made straight from the width (no query latent) gather the block's input themselves.
    Returns the replicated parameters."""
    attn.spread = SpreadToGroup(comm, sequence_parallel)
    for name in ("q_up", "kv_up"):
        inner = getattr(attn, name)
        _replace_weight(inner, shard_rows(inner.weight.detach(), comm.rank, comm.size), None)
    if attn.q_norm is None:
        attn.q_up = ColumnParallelLinear(attn.q_up, comm, sequence_parallel)
    return [*attn.down.parameters(), *attn.kv_norm.parameters(),
            *([] if attn.q_norm is None else attn.q_norm.parameters())]


def _shard_core(core: AttentionCore, comm: Collectives) -> None:
    """The attention core's per-head parameters cut to this rank's heads: GPT-OSS's sinks (one per query head),
    OLMo 2's q/k norms over all heads (a gain per column), whose sums of squares are then summed over the group."""
    if core.sinks is not None:
        core.sinks = nn.Parameter(shard_rows(core.sinks.detach(), comm.rank, comm.size))
    if core.q_norm is not None and core.whole:
        for norm in (core.q_norm, core.k_norm):
            norm.weight = nn.Parameter(shard_rows(norm.weight.detach(), comm.rank, comm.size))
        core.qk_total = _group_sum(comm)


def _group_sum(comm: Collectives):
    """The sum over the group of a tensor each rank computed afresh (all-reduced in place)."""
    def total(tensor: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(tensor)
        return tensor
    return total


def _sum_over_group(grad: torch.Tensor, comm: Collectives) -> torch.Tensor:
    grad = grad.clone()
    comm.all_reduce(grad)
    return grad
