"""Exact causal attention one block of keys at a time: the pieces ring attention is made of.

A query chunk meets a key chunk in one of three ways (chunk ids along the whole sequence): an earlier key
chunk is seen whole, the same chunk under the causal triangle, a later one not at all. Under a sliding window
(GPTConfig.window w: query i sees keys i - w < j <= i) a pair may also be out of reach, or partly in it: a band
whose mask comes from the two chunks' distance (BAND, the distance of their first rows). Each block's partial
result is its softmax-weighted values and the log-sum-exp of its scores; partial results merge exactly
(`merge`): out = sum_b exp(lse_b - lse) out_b with lse = log sum_b exp(lse_b), the online softmax of
FlashAttention. The backward recomputes a block's probabilities from the merged log-sum-exp
(p = exp(s - lse)) and D = rowsum(dO * O), as FlashAttention-2's backward does, so each block's gradients
need only that block. Scores and accumulators are fp32; grouped-query attention repeats a key/value head
for its query heads inside the block and sums the gradients back.
"""

from __future__ import annotations

import torch

FULL, DIAGONAL, NONE, BAND = "full", "diagonal", "none", "band"


def meeting(query_chunk: int, key_chunk: int, c: int = 0, window: int = 0) -> str | tuple[str, int, int]:
    """How a query chunk sees a key chunk (both c long) under the causal mask, and a sliding `window` (0: none):
    FULL, DIAGONAL, NONE, or (BAND, the distance of their first rows, the window) where the window cuts the pair."""
    if key_chunk > query_chunk:
        return NONE
    if not window:
        return FULL if key_chunk < query_chunk else DIAGONAL
    distance = (query_chunk - key_chunk) * c  # of the first rows; a pair's rows lie within c - 1 of it
    if distance - (c - 1) >= window:
        return NONE
    if distance + (c - 1) < window:
        return FULL if key_chunk < query_chunk else DIAGONAL
    return BAND, distance, window


def _raw_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q (b, h, c, d) against k (b, h_kv, c, d): fp32 scores, before any cap or mask."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale


def _scores(q: torch.Tensor, k: torch.Tensor, how, scale: float, same: torch.Tensor | None = None,
            cap: float = 0.0) -> torch.Tensor:
    """q (b, h, c, d) against k (b, h_kv, c, d): fp32 scores, capped at `cap` (Gemma 2's cap * tanh(s / cap); 0:
    none), the upper triangle masked on the diagonal, the keys out of the window masked in a band, and where `same`
    ((b, c, c) bools) is given the keys of other documents."""
    s = _raw_scores(q, k, scale)
    if cap:
        s = cap * torch.tanh(s / cap)
    if how == DIAGONAL:
        upper = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(upper, float("-inf"))
    elif isinstance(how, tuple):  # BAND: row a meets column b at distance first + a - b
        _, first, window = how
        rows, cols = s.shape[-2:]
        distance = first + torch.arange(rows, device=s.device)[:, None] - torch.arange(cols, device=s.device)[None, :]
        s = s.masked_fill((distance < 0) | (distance >= window), float("-inf"))
    if same is not None:
        s = s.masked_fill(~same.unsqueeze(1), float("-inf"))
    return s


def forward_block(q, k, v, how: str, scale: float, same: torch.Tensor | None = None,
                  cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out fp32 (b, h, c, d), lse fp32 (b, h, c)) of q attending to one key/value block (`same`, `cap`: _scores')."""
    s = _scores(q, k, how, scale, same, cap)
    lse = torch.logsumexp(s, dim=-1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    finite = lse.masked_fill(lse == float("-inf"), 0.0)  # a row a band (or its document) leaves no key: weights 0
    return torch.matmul(torch.exp(s - finite.unsqueeze(-1)), v.float()), lse


def empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) before any block: zeros and -inf, fp32, for q's rows. `out` (batch, heads, seq, head_dim) is laid
    out in memory as (batch, seq, heads, head_dim), as torch's attention returns it: the caller's transpose back
    to tokens is then free, and the projection after it keeps no copy of its own."""
    b, h, s, d = q.shape
    return (torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device).transpose(1, 2),
            torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device))


def backward_start(q: torch.Tensor, out: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta = rowsum(dout * out), dq zeros fp32): what every block's backward shares."""
    return (dout.float() * out).sum(-1), torch.zeros(q.shape, dtype=torch.float32, device=q.device)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's partial result into (out, lse), in place."""
    new = torch.logaddexp(lse, block_lse)
    shift = new.masked_fill(new == float("-inf"), 0.0)  # a row no block has given a key yet stays zero, not nan
    out.mul_(torch.exp(lse - shift).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - shift).unsqueeze(-1))
    lse.copy_(new)


def backward_block(q, k, v, dout, lse, delta, how: str, scale: float, dq, dk, dv,
                   same: torch.Tensor | None = None, cap: float = 0.0) -> None:
    """Add one block's gradients to dq (of q's chunk) and dk, dv (of the key block), all fp32, in place.
    lse: the merged log-sum-exp of q's rows; delta: rowsum(dout * out); `same`, `cap`: _scores'. Under a cap the
    scores' gradient passes through tanh's derivative, 1 - tanh^2."""
    groups = q.shape[1] // k.shape[1]
    p = torch.exp(_scores(q, k, how, scale, same, cap) - lse.unsqueeze(-1))
    dout = dout.float()
    v_rep = v.repeat_interleave(groups, dim=1).float()
    ds = p * (torch.matmul(dout, v_rep.transpose(-1, -2)) - delta.unsqueeze(-1))
    if cap:
        ds = ds * (1 - torch.tanh(_raw_scores(q, k, scale) / cap).square())
    dq.add_(torch.matmul(ds, k.repeat_interleave(groups, dim=1).float()) * scale)
    b, h_kv, c, d = k.shape
    dk.add_((torch.matmul(ds.transpose(-1, -2), q.float()) * scale).view(b, h_kv, groups, c, d).sum(2))
    dv.add_(torch.matmul(p.transpose(-1, -2), dout).view(b, h_kv, groups, c, d).sum(2))


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Fold GPT-OSS's sinks into a finished (out, lse), in place: each query head's sink is one more key of logit
    sinks[h] whose value is zero (minigpt/attention.py's), met by every row once, on the rank holding the row."""
    new = torch.logaddexp(lse, sinks.detach().float().view(1, -1, 1))
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    lse.copy_(new)


def sinks_grad(lse: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient from the final (sink-merged) lse and delta = rowsum(dout * out): each row's sink weight
    exp(sink - lse) times -delta, summed over the batch and this rank's rows (the other keys' gradients need no
    change: their weights already come from the final lse)."""
    return -(torch.exp(sinks.detach().float().view(1, -1, 1) - lse) * delta).sum(dim=(0, 2)).to(sinks.dtype)
