"""Megatron-style tensor-parallel layers and their conjugate collectives.

Within a tensor-parallel group of size T every rank holds 1/T of each big
matrix. A column-parallel Linear (qkv, fc1, the LM head) splits the output
features; a row-parallel Linear (proj, fc2) splits the input features and sums
the partial outputs. Between them the activations are sharded, so a block needs
one all-reduce per sub-layer forward and one backward:

  copy_to_tp      identity forward, all-reduce backward   (f in the paper)
  reduce_from_tp  all-reduce forward, identity backward   (g)

With sequence parallelism the regions around them (LayerNorm, dropout,
residual) are sharded along the sequence instead of replicated, and the pair
becomes all-gather / reduce-scatter along the sequence, which moves the same
bytes but keeps 1/T of those activations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel.comm import Collectives
from minigpt.model import IGNORED

SEQ_DIM = 1  # activations are (batch, seq, features)


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Collectives):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        ctx.comm.all_reduce(grad)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Collectives):
        x = x.contiguous()
        comm.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_seq(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """(batch, seq/T, h) on every rank -> (batch, seq, h) on every rank."""
    shards = x.transpose(0, SEQ_DIM).contiguous()  # seq first, so rank pieces are contiguous
    full = torch.empty((shards.shape[0] * comm.size, *shards.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(full, shards)
    return full.transpose(0, SEQ_DIM)


def _reduce_scatter_seq(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """(batch, seq, h) partial sums -> (batch, seq/T, h) of the total, this rank's piece."""
    full = x.transpose(0, SEQ_DIM).contiguous()
    shard = torch.empty((full.shape[0] // comm.size, *full.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(shard, full)
    return shard.transpose(0, SEQ_DIM)


def _split_seq(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    piece = x.shape[SEQ_DIM] // comm.size
    return x.narrow(SEQ_DIM, comm.rank * piece, piece).contiguous()


class GatherFromSequence(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward (before a column-parallel Linear)."""

    @staticmethod
    def forward(ctx, x, comm: Collectives):
        ctx.comm = comm
        return _gather_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.comm), None


class ReduceScatterToSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward (after a row-parallel Linear)."""

    @staticmethod
    def forward(ctx, x, comm: Collectives):
        ctx.comm = comm
        return _reduce_scatter_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.comm), None


class ScatterToSequence(torch.autograd.Function):
    """Keep this rank's piece of the sequence forward, all-gather backward (after the embeddings)."""

    @staticmethod
    def forward(ctx, x, comm: Collectives):
        ctx.comm = comm
        return _split_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.comm), None


def to_every_rank(x: torch.Tensor, comm: Collectives, sequence_parallel: bool) -> torch.Tensor:
    """The input of column-parallel work, whole on every rank: all-gathered along the sequence under sequence
    parallelism (reduce-scattered backward), else the same tensor (all-reduced backward)."""
    return GatherFromSequence.apply(x, comm) if sequence_parallel else CopyToTP.apply(x, comm)


def shard_rows(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    rows = tensor.shape[0] // size
    return tensor[rank * rows : (rank + 1) * rows].clone()


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r: this rank's output features. Input replicated (or sequence-sharded).

    `inner` is the Linear of the precision policy (nn.Linear, the emulated
    16-bit Linear or the fp8 Linear) already holding this rank's rows.
    """

    def __init__(self, inner: nn.Module, comm: Collectives, sequence_parallel: bool):
        super().__init__()
        self.inner, self.comm, self.sequence_parallel = inner, comm, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(to_every_rank(x, self.comm, self.sequence_parallel))


class SpreadToGroup(nn.Module):
    """A small activation every rank of the group needs whole before its column-parallel work (MLA's normed latent):
    all-gathered along the sequence under sequence parallelism, else copied (its gradient all-reduced)."""

    def __init__(self, comm: Collectives, sequence_parallel: bool):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return to_every_rank(x, self.comm, self.sequence_parallel)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b: sharded input features, partial outputs summed across the group.

    `inner` holds this rank's columns and no bias; the bias is added once, after the sum.
    """

    def __init__(self, inner: nn.Module, bias: nn.Parameter | None, comm: Collectives, sequence_parallel: bool):
        super().__init__()
        self.inner, self.bias, self.comm, self.sequence_parallel = inner, bias, comm, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.inner(x)
        if self.sequence_parallel:
            out = ReduceScatterToSequence.apply(partial, self.comm)
        else:
            out = ReduceFromTP.apply(partial, self.comm)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the (padded) vocabulary; other ids contribute zeros, then one all-reduce."""

    def __init__(self, weight: nn.Parameter, start: int, comm: Collectives):
        super().__init__()
        self.weight, self.start, self.comm = weight, start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return ReduceFromTP.apply(out, self.comm)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from vocabulary-sharded logits, never gathering them.

    Each rank holds logits for vocabulary ids [start, start + local); ids at or
    beyond `vocab_size` are padding and never count. Three all-reduces of
    (batch x seq) numbers: the max, the sum of exponentials, the target logit.
    """

    @staticmethod
    def forward(ctx, logits, targets, start: int, vocab_size: int, comm: Collectives):
        logits = logits.float()
        local = logits.shape[-1]
        if start + local > vocab_size:  # this rank holds padded vocabulary: masked in a copy of its logits
            ids = torch.arange(start, start + local, device=logits.device)
            logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
        maximum = logits.max(dim=-1).values
        comm.max(maximum)
        shifted = logits - maximum.unsqueeze(-1)
        local_targets = targets - start
        mine = (local_targets >= 0) & (local_targets < local)
        picked = shifted.gather(-1, local_targets.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1)
        exp = shifted.exp_()  # the exponentials in place of the shifted logits, once the targets' are picked
        sum_exp = exp.sum(dim=-1)
        comm.sum(sum_exp)
        target_logit = torch.where(mine, picked, torch.zeros_like(picked))
        comm.sum(target_logit)
        loss = sum_exp.log() - target_logit
        counted = targets != IGNORED  # the multi-token prediction's positions past the sequence count for nothing
        ctx.save_for_backward(exp, sum_exp, local_targets, mine, counted)
        if bool(counted.all()):
            return loss.mean()
        return torch.where(counted, loss, torch.zeros_like(loss)).sum() / counted.sum()

    @staticmethod
    def backward(ctx, grad):
        """The gradient made in place of the saved exponentials (as Megatron's vocab-parallel cross entropy makes
        it in place of its softmax): the softmax, less one at each target this rank holds, over the tokens."""
        exp, sum_exp, local_targets, mine, counted = ctx.saved_tensors
        logits_grad = exp.div_(sum_exp.unsqueeze(-1))
        targets = local_targets.clamp(0, exp.shape[-1] - 1).unsqueeze(-1)
        logits_grad.scatter_add_(-1, targets, -mine.unsqueeze(-1).to(logits_grad.dtype))
        if bool(counted.all()):
            return logits_grad.mul_(grad / local_targets.numel()), None, None, None, None
        logits_grad.mul_(counted.unsqueeze(-1).to(logits_grad.dtype))
        return logits_grad.mul_(grad / counted.sum()), None, None, None, None


class VocabParallelLoss(nn.Module):
    def __init__(self, start: int, vocab_size: int, comm: Collectives):
        super().__init__()
        self.start, self.vocab_size, self.comm = start, vocab_size, comm

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return VocabParallelCrossEntropy.apply(logits, targets, self.start, self.vocab_size, self.comm)


class SequenceSplit(nn.Module):
    """Placed after the embeddings' dropout: from here on each rank holds 1/T of the sequence."""

    def __init__(self, dropout: nn.Module, comm: Collectives):
        super().__init__()
        self.dropout, self.comm = dropout, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScatterToSequence.apply(self.dropout(x), self.comm)
