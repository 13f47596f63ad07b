"""The attention's softmax over keys as the model computes it: causal, through a sliding window where one is shorter
than the sequence, and with GPT-OSS's sinks. One SDPA call each (torch's fused kernels where they take the mask)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from minigpt.activations import SINK_COLUMNS


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                     group: int = 1, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """(batch, heads, seq, width) q attending to k, v (fewer key/value heads when `group` > 1: grouped-query), each
    query to itself and the keys before it, only the window - 1 nearest where `window` is shorter than the sequence;
    `sinks`: one logit per query head in each softmax's denominator (None: none)."""
    seq = q.shape[2]
    windowed = bool(window) and window < seq
    if sinks is not None:
        return _with_sinks(q, k, v, scale, window if windowed else 0, group, sinks)
    if windowed:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(seq, window, q.device), scale=scale,
                                              enable_gqa=group > 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)


def _with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int, group: int,
                sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink per query head (GPT-OSS; transformers' eager_attention_forward appends the sinks' logits
    to the scores, softmaxes and drops them) as one SDPA call: a key at position 0 that every query sees (the
    causal mask aligned lower-right over seq + 1 keys), its value zero; q carries each head's logit / scale in a
    column of its own, where the sink's key is 1 and the others' 0, so its score is the logit and theirs unchanged;
    v is zero-padded to the same width (fused kernels take one) and the output cut back. The gradient reaches the
    logits through that column."""
    batch, heads, seq, width = q.shape
    kv_heads = k.shape[1]
    logit = (sinks / scale).to(q.dtype).view(1, heads, 1, 1).expand(batch, heads, seq, 1)
    q = torch.cat([q, logit, q.new_zeros(batch, heads, seq, SINK_COLUMNS - 1)], dim=-1)
    sink_key = k.new_zeros(batch, kv_heads, 1, width + SINK_COLUMNS)
    sink_key[..., width] = 1.0
    k = torch.cat([sink_key, F.pad(k, (0, SINK_COLUMNS))], dim=2)
    v_width = v.shape[-1]
    v = F.pad(v, (0, width + SINK_COLUMNS - v_width, 1, 0))  # the sink's zero row first, zero columns after
    mask = sink_mask(seq, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)[..., :v_width]


@functools.lru_cache(maxsize=8)
def sink_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """(seq, seq + 1) bools: every query sees the sink (key 0) and keys 1 + j as window_mask (causal where `window` is
    0). Built here, not with torch.nn.attention.bias's causal_lower_right, whose import loads torch._dynamo."""
    keys = window_mask(seq, window, device) if window else torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    return F.pad(keys, (1, 0), value=True)


@functools.lru_cache(maxsize=8)
def window_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """(seq, seq) bools: query i sees key j when i - window < j <= i (transformers' sliding window). Made once per
    shape and device, shared by every layer."""
    distance = torch.arange(seq, device=device)[:, None] - torch.arange(seq, device=device)[None, :]
    return (distance >= 0) & (distance < window)
