"""`parallelize`: the plain GPT of minigpt/model.py made tensor-parallel from outside.

Modules are replaced, never edited: qkv and fc1 become column-parallel, proj and
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

from parallel.comm import Collectives
from parallel.tensor_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceSplit,
    VocabParallelEmbedding,
    VocabParallelLoss,
    shard_rows,
)
from job.train_config import check_tensor_parallel


def _replace_weight(inner: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    inner.weight = nn.Parameter(weight)
    inner.bias = None if bias is None else nn.Parameter(bias)
    return inner


def _shard_heads(tensor: torch.Tensor, heads: int, rank: int, size: int) -> torch.Tensor:
    """Rows of a qkv weight (3*d, ...) or bias (3*d,) for this rank's heads of q, k and v."""
    per_head = tensor.shape[0] // (3 * heads)
    grouped = tensor.reshape(3, heads, per_head, *tensor.shape[1:])
    local = heads // size
    return grouped[:, rank * local : (rank + 1) * local].reshape(-1, *tensor.shape[1:]).clone()


def _shard_columns(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    columns = weight.shape[1] // size
    return weight[:, rank * columns : (rank + 1) * columns].clone()


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def parallelize(model: nn.Module, comm: Collectives, sequence_parallel: bool = False) -> set[int]:
    """Make `model` tensor-parallel over `comm`'s group, in place.

    Returns the ids of the parameters that stay replicated on every rank of the
    group (LayerNorms, position embeddings, biases added after a sum), which a
    gradient norm must count once. With sequence parallelism those that see
    only a piece of the sequence get their gradients summed over the group.
    """
    size, rank = comm.size, comm.rank
    config = model.config
    check_tensor_parallel(config.n_heads, config.d_ff, config.seq_len, size, sequence_parallel)
    if size == 1:
        return set()
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

    heads = config.n_heads
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        qkv = attn.qkv
        _replace_weight(qkv, _shard_heads(qkv.weight.detach(), heads, rank, size), _shard_heads(qkv.bias.detach(), heads, rank, size))
        attn.qkv = ColumnParallelLinear(qkv, comm, sequence_parallel)
        fc1 = mlp.fc1
        _replace_weight(fc1, shard_rows(fc1.weight.detach(), rank, size), shard_rows(fc1.bias.detach(), rank, size))
        mlp.fc1 = ColumnParallelLinear(fc1, comm, sequence_parallel)
        for parent, name in ((attn, "proj"), (mlp, "fc2")):
            inner = getattr(parent, name)
            bias = nn.Parameter(inner.bias.detach().clone())
            _replace_weight(inner, _shard_columns(inner.weight.detach(), rank, size), None)
            setattr(parent, name, RowParallelLinear(inner, bias, comm, sequence_parallel))

    replicated = [model.pos_emb.weight, model.norm_f.weight, model.norm_f.bias]
    for block in model.blocks:
        replicated += [block.ln1.weight, block.ln1.bias, block.ln2.weight, block.ln2.bias]
        replicated += [block.attn.proj.bias, block.mlp.fc2.bias]
    if sequence_parallel:
        for param in replicated[1:]:  # all but the position embedding see 1/T of the sequence
            param.register_hook(lambda grad: _sum_over_group(grad, comm))
    return {id(param) for param in replicated}


def _sum_over_group(grad: torch.Tensor, comm: Collectives) -> torch.Tensor:
    grad = grad.clone()
    comm.all_reduce(grad)
    return grad
