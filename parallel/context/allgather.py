"""All-gather context parallelism: every rank gathers the whole sequence's keys and values once per layer.

Llama 3's choice with grouped-query attention (Dubey et al. 2024, section 3.3.2): with few key/value heads,
the keys and values are small beside the queries, so gathering them whole costs less than a ring of steps
and lets each rank run one attention over its query chunks against every key at or before them. The
gather's backward is a reduce-scatter: every rank's gradients for a chunk of keys and values are summed on
the rank that holds it. Positions along the whole sequence give the causal mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.comm import all_gather_flat, reduce_scatter_flat
from parallel.context.blocks import (NONE, backward_block, backward_start, empty_result, forward_block, meeting, merge,
                                     merge_sinks, sinks_grad)
from parallel.context.chunks import chunk_ids
from parallel.context.documents import chunk_documents
from parallel.context.ring import Rehearsal


class GatherSequence(torch.autograd.Function):
    """Every rank's (b, h, 2 c, d) part stacked by rank: (cp, b, h, 2 c, d). Backward: the sum over ranks of
    each part's gradient, scattered back to its rank."""

    @staticmethod
    def forward(ctx, part, group, counter):
        cp = dist.get_world_size(group)
        gathered = torch.empty((cp * part.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device)
        all_gather_flat(gathered, part.contiguous(), group=group)  # along the first dimension
        if counter is not None:
            counter.count("all_gather", gathered)
        ctx.group, ctx.counter = group, counter
        return gathered.view(cp, *part.shape)

    @staticmethod
    def backward(ctx, grad):
        part = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        full = grad.reshape(-1, *grad.shape[2:]).contiguous()
        reduce_scatter_flat(part, full, group=ctx.group)
        if ctx.counter is not None:
            ctx.counter.count("reduce_scatter", full)
        return part, None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                        scale: float | None = None, counter=None, window: int = 0,
                        sinks: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                        softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's two chunks of q against the whole sequence, gathered from `group`
    (parallel/context/chunks.py's split), within `documents` where given (ring_attention's). Shapes (b, h, 2 c, d);
    autograd carries the backward.
    `counter` (a parallel.comm.Collectives) counts the gathers and their backward's reduce-scatters."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if isinstance(group, Rehearsal):  # rank 0 alone: every rank's keys and values a copy of its own
        keys, values = (t.unsqueeze(0).repeat(group.size, *[1] * t.dim()) for t in (k, v))
        return GatheredAttention.apply(q, keys, values, 0, scale, window, sinks, documents, softcap)
    rank = 0 if group is None else dist.get_rank(group)
    keys = k.unsqueeze(0) if group is None else GatherSequence.apply(k, group, counter)
    values = v.unsqueeze(0) if group is None else GatherSequence.apply(v, group, counter)
    return GatheredAttention.apply(q, keys, values, rank, scale, window, sinks, documents, softcap)


class GatheredAttention(torch.autograd.Function):
    """This rank's query chunks against every rank's key/value chunks (stacked by rank), block by block."""

    @staticmethod
    def forward(ctx, q, keys, values, rank: int, scale: float, window: int, sinks: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, cap: float = 0.0):
        cp, c = keys.shape[0], q.shape[2] // 2
        out, lse = empty_result(q)
        for qs, source, ks, how, same in _meetings(rank, cp, c, window, documents):
            block_out, block_lse = forward_block(q[:, :, qs], keys[source][:, :, ks], values[source][:, :, ks],
                                                 how, scale, same, cap)
            merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
        if sinks is not None:
            merge_sinks(out, lse, sinks)
        out = out.to(q.dtype)  # what the caller gets, saved for the backward's delta too (as FlashAttention)
        ctx.save_for_backward(q, keys, values, out, lse, sinks)
        ctx.rank, ctx.scale, ctx.window, ctx.documents, ctx.cap = rank, scale, window, documents, cap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, keys, values, out, lse, sinks = ctx.saved_tensors
        cp, c = keys.shape[0], q.shape[2] // 2
        delta, dq = backward_start(q, out, dout)
        dkeys = torch.zeros(keys.shape, dtype=torch.float32, device=keys.device)
        dvalues = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
        for qs, source, ks, how, same in _meetings(ctx.rank, cp, c, ctx.window, ctx.documents):
            backward_block(q[:, :, qs], keys[source][:, :, ks], values[source][:, :, ks], dout[:, :, qs],
                           lse[:, :, qs], delta[:, :, qs], how, ctx.scale, dq[:, :, qs], dkeys[source][:, :, ks],
                           dvalues[source][:, :, ks], same, ctx.cap)
        dsinks = None if sinks is None else sinks_grad(lse, delta, sinks)
        return dq.to(q.dtype), dkeys.to(keys.dtype), dvalues.to(values.dtype), None, None, None, dsinks, None, None


def _meetings(rank: int, cp: int, c: int, window: int, documents: torch.Tensor | None):
    """(query slice, source rank, key slice, how, same document or None) of every meeting of this rank's query
    chunks with a key chunk."""
    for qi, q_chunk in enumerate(chunk_ids(rank, cp)):
        for source in range(cp):
            for ki, k_chunk in enumerate(chunk_ids(source, cp)):
                how = meeting(q_chunk, k_chunk, c, window)
                if how != NONE:
                    same = chunk_documents(documents, q_chunk, k_chunk, c)
                    yield slice(qi * c, (qi + 1) * c), source, slice(ki * c, (ki + 1) * c), how, same

