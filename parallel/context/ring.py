"""Ring attention: exact causal attention over a context-parallel group, keys and values passed around a ring.

Each of the cp ranks holds two chunks of the sequence (parallel/context/chunks.py: i and 2 cp - 1 - i) of
q, k and v, shaped (batch, heads, 2 c, head_dim) (k and v may have fewer heads: grouped-query attention).
Forward: at step t a rank holds the key/value chunks of rank (rank - t) mod cp; before computing with them
it starts sending them to the next rank and receiving the next ones from the previous rank (asynchronous
p2p, batch_isend_irecv), so the transfer runs while the block at hand is computed; after cp steps every
query chunk has met every key chunk at or before it, the partial results merged with their log-sum-exp
(parallel/context/blocks.py). Backward: the same ring again, the key/value chunks travelling with their
gradients dK and dV, which every rank adds to as the chunks pass; after the last step one more hop brings
each rank its own chunks' complete dK and dV. The keys and values for the next step are sent ahead while
a block's gradients are computed; a block's dK and dV are computed into a buffer of their own while the
sum of the ranks before arrives, added once the block is done and sent on behind the next block, so only
the last hop home waits on its own (as Megatron-core's and Transformer Engine's rings overlap them).

A ring of one rank (no group) is plain blockwise causal attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.context.blocks import (NONE, backward_block, backward_start, empty_result, forward_block, meeting, merge,
                                     merge_sinks, sinks_grad)
from parallel.context.chunks import chunk_ids
from parallel.context.documents import chunk_documents


class Ring:
    """A context-parallel group seen as a ring: this rank, its size, and a step to the next rank."""

    def __init__(self, group: dist.ProcessGroup | None, counter=None):
        self.group, self.counter = group, counter  # counter: a parallel.comm.Collectives that counts the sends
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start_pass(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Send `tensors` to the next rank and receive their like from the previous one, asynchronously:
        (the buffers being received, the requests to wait on)."""
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.previous, self.group) for r in received]
        if self.counter is not None:
            for tensor in tensors:
                self.counter.count("send", tensor)
        return received, dist.batch_isend_irecv(ops)


class Rehearsal:
    """A context-parallel group of `size` ranks seen from its rank 0, that sends nothing: what one rank computes
    under context parallelism, timed alone by parallel/calibrate (as its AloneCollectives does for tensor
    parallelism). Handed in place of a process group; the exchange is measured apart (p2p, collectives)."""

    def __init__(self, size: int):
        self.size = size


class RehearsedRing(Ring):
    """Rank 0 of a Rehearsal's ring: every pass hands back copies of what it would send (the buffers a real
    pass receives into), and there is nothing to wait for."""

    def __init__(self, rehearsal: Rehearsal):
        self.group, self.counter, self.size, self.rank = None, None, rehearsal.size, 0

    def start_pass(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        return [t.clone(memory_format=torch.contiguous_format) for t in tensors], []


def _pairs(rank: int, source: int, cp: int, c: int, window: int, documents: torch.Tensor | None):
    """(query slice, key slice, how, same document or None) of every pair of this rank's chunks and `source`'s
    that meet."""
    for qi, q_chunk in enumerate(chunk_ids(rank, cp)):
        for ki, k_chunk in enumerate(chunk_ids(source, cp)):
            how = meeting(q_chunk, k_chunk, c, window)
            if how != NONE:
                same = chunk_documents(documents, q_chunk, k_chunk, c)
                yield slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c), how, same


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float, window: int, sinks: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, cap: float = 0.0):
        cp, c = ring.size, q.shape[2] // 2
        out, lse = empty_result(q)
        kv = [k, v]
        for step in range(cp):
            incoming = ring.start_pass(kv) if step < cp - 1 else None
            source = (ring.rank - step) % cp
            for qs, ks, how, same in _pairs(ring.rank, source, cp, c, window, documents):
                block_out, block_lse = forward_block(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], how, scale, same,
                                                     cap)
                merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            if incoming is not None:
                for request in incoming[1]:
                    request.wait()
                kv = incoming[0]
        if sinks is not None:
            merge_sinks(out, lse, sinks)
        out = out.to(q.dtype)  # what the caller gets, saved for the backward's delta too (as FlashAttention)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ring, ctx.scale, ctx.window, ctx.documents, ctx.cap = ring, scale, window, documents, cap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        cp, c = ring.size, q.shape[2] // 2
        delta, dq = backward_start(q, out, dout)
        kv, travelling = [k, v], None  # travelling: the dk/dv pass in flight (what arrives, its requests)
        for step in range(cp):
            incoming = ring.start_pass(kv) if step < cp - 1 else None  # the next keys and values, ahead
            source = (ring.rank - step) % cp
            grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)]  # this block's
            for qs, ks, how, same in _pairs(ring.rank, source, cp, c, ctx.window, ctx.documents):
                backward_block(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], dout[:, :, qs], lse[:, :, qs],
                               delta[:, :, qs], how, scale, dq[:, :, qs], grads[0][:, :, ks], grads[1][:, :, ks], same,
                               ctx.cap)
            if travelling is not None:  # the source's dk/dv from the ranks before, sent during this block
                for request in travelling[1]:
                    request.wait()
                for mine, arrived in zip(grads, travelling[0]):
                    mine.add_(arrived)
            if cp > 1:  # on to the next rank, behind the next block; the last hop brings each rank its own
                travelling = ring.start_pass(grads)
            if incoming is not None:
                for request in incoming[1]:
                    request.wait()
                kv = incoming[0]
        if travelling is not None:
            for request in travelling[1]:
                request.wait()
            grads = travelling[0]
        dsinks = None if sinks is None else sinks_grad(lse, delta, sinks)
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, dsinks, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                   scale: float | None = None, counter=None, window: int = 0,
                   sinks: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                   softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's two chunks of q against the whole sequence's keys and values, which
    the ranks of `group` hold two chunks each (parallel/context/chunks.py). Shapes (b, h, 2 c, d).
    `counter` (a parallel.comm.Collectives) counts every tensor sent as a "send". `window`: a sliding window
    (0: none); the keys and values still travel the whole ring, the blocks out of reach are not computed.
    `sinks`: GPT-OSS's, one logit per query head, merged once per row on the rank holding it. `documents`:
    (batch, whole sequence) document ids, each query seeing its own document's keys (None: one document)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ring = RehearsedRing(group) if isinstance(group, Rehearsal) else Ring(group, counter)
    return RingAttention.apply(q, k, v, ring, scale, window, sinks, documents, softcap)
