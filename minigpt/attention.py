"""The attention's softmax over keys as the model computes it: causal, through a sliding window where one is shorter
than the sequence, with GPT-OSS's sinks, and within each document where the sequences are packed documents (Llama
3's document mask: `within_documents`). One SDPA call each (torch's fused kernels where they take the mask).
And the rotation of its queries and keys by position (RotaryQK), with its scalings (Llama 3.1's, YaRN's,
LongRoPE's, linear)."""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from minigpt.activations import SINK_COLUMNS
from minigpt.config import GPTConfig


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                     group: int = 1, sinks: torch.Tensor | None = None,
                     documents: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """(batch, heads, seq, width) q attending to k, v (fewer key/value heads when `group` > 1: grouped-query), each
    query to itself and the keys before it, only the window - 1 nearest where `window` is shorter than the sequence;
    `sinks`: one logit per query head in each softmax's denominator (None: none); `documents`: (batch, seq) each
    token's document (document_ids), a query seeing only the keys of its own (None: one document); `softcap`: each
    score capped at it (Gemma 2's; 0: none, and no sinks with it)."""
    seq = q.shape[2]
    windowed = bool(window) and window < seq
    if softcap:
        if documents is not None:
            mask = document_mask(documents, window if windowed else 0, False)
        else:
            mask = window_mask(seq, window, q.device) if windowed else causal_mask(seq, q.device)
        return _capped(q, k, v, scale, group, softcap, mask)
    if documents is not None:
        mask = document_mask(documents, window if windowed else 0, sinks is not None)
        if sinks is not None:
            return _with_sinks(q, k, v, scale, group, sinks, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
    if sinks is not None:
        return _with_sinks(q, k, v, scale, group, sinks, sink_mask(seq, window if windowed else 0, q.device))
    if windowed:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(seq, window, q.device), scale=scale,
                                              enable_gqa=group > 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """(batch, seq) int: each token's document in its sequence, counted from 0; the end-of-document token `eod`
    belongs to the document it ends (Megatron's --reset-attention-mask, torchtitan's block-causal mask)."""
    ends = (tokens == eod).to(torch.int32)
    return ends.cumsum(dim=-1, dtype=torch.int32) - ends


def same_document(query_documents: torch.Tensor, key_documents: torch.Tensor) -> torch.Tensor:
    """(batch, queries, keys) bools: whether each query and key lie in one document."""
    return query_documents.unsqueeze(-1) == key_documents.unsqueeze(-2)


# what within_documents set: ((batch, seq) ids, the masks made of them so far by (window, sinks)), or None
_DOCUMENTS: list[tuple[torch.Tensor, dict] | None] = [None]


@contextlib.contextmanager
def within_documents(documents: torch.Tensor | None):
    """Every attention run inside attends within the documents of `documents` ((batch, seq) document_ids of the
    whole sequences; None: across them), as autocast sets a format: the model's forward and a pipeline stage's set
    it for the micro-batch they run, and a recomputation restores the one its forward saw (parallel/recompute.py)."""
    previous, _DOCUMENTS[0] = _DOCUMENTS[0], None if documents is None else (documents, {})
    try:
        yield
    finally:
        _DOCUMENTS[0] = previous


def current_documents() -> torch.Tensor | None:
    """The document ids within_documents set (None: none)."""
    return None if _DOCUMENTS[0] is None else _DOCUMENTS[0][0]


def document_mask(documents: torch.Tensor, window: int, sinks: bool) -> torch.Tensor:
    """(batch, 1, seq, seq) bools: query i sees key j in its document, causally, through `window` (0: none); with
    `sinks` a first column, the sink's, every query sees. Made once for the documents within_documents set and
    shared by every layer (one mask a micro-batch kept for the backward, not one a layer)."""
    entry = _DOCUMENTS[0]
    made = entry[1] if entry is not None and entry[0] is documents else {}
    if (window, sinks) not in made:
        seq, device = documents.shape[-1], documents.device
        keys = window_mask(seq, window, device) if window else causal_mask(seq, device)
        mask = (keys & same_document(documents, documents)).unsqueeze(1)
        made[window, sinks] = F.pad(mask, (1, 0), value=True) if sinks else mask
    return made[window, sinks]


def _capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group: int, cap: float,
            mask: torch.Tensor) -> torch.Tensor:
    """Attention with each score capped at `cap` (Gemma 2's attn_logit_softcapping: cap * tanh(s / cap), before the
    mask), as transformers' eager attention computes it: no fused kernel of torch's takes the cap, so the scores are
    made whole (FlashAttention-2's softcap argument caps them inside its tiles); the softmax in fp32, cast back."""
    if group > 1:
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = cap * torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * (scale / cap))
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
    return torch.matmul(weights.to(q.dtype), v)


def _with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group: int, sinks: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
    """Attention with a sink per query head (GPT-OSS; transformers' eager_attention_forward appends the sinks' logits
    to the scores, softmaxes and drops them) as one SDPA call: a key at position 0 that every query sees (the
    causal mask aligned lower-right over seq + 1 keys: `mask`, sink_mask's or document_mask's), its value zero; q
    carries each head's logit / scale in a column of its own, where the sink's key is 1 and the others' 0, so its
    score is the logit and theirs unchanged; v is zero-padded to the same width (fused kernels take one) and the
    output cut back. The gradient reaches the logits through that column."""
    batch, heads, seq, width = q.shape
    kv_heads = k.shape[1]
    logit = (sinks / scale).to(q.dtype).view(1, heads, 1, 1).expand(batch, heads, seq, 1)
    q = torch.cat([q, logit, q.new_zeros(batch, heads, seq, SINK_COLUMNS - 1)], dim=-1)
    sink_key = k.new_zeros(batch, kv_heads, 1, width + SINK_COLUMNS)
    sink_key[..., width] = 1.0
    k = torch.cat([sink_key, F.pad(k, (0, SINK_COLUMNS))], dim=2)
    v_width = v.shape[-1]
    v = F.pad(v, (0, width + SINK_COLUMNS - v_width, 1, 0))  # the sink's zero row first, zero columns after
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)[..., :v_width]


@functools.lru_cache(maxsize=8)
def sink_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """(seq, seq + 1) bools: every query sees the sink (key 0) and keys 1 + j as window_mask (causal where `window` is
    0). Built here, not with torch.nn.attention.bias's causal_lower_right, whose import loads torch._dynamo."""
    keys = window_mask(seq, window, device) if window else causal_mask(seq, device)
    return F.pad(keys, (1, 0), value=True)


@functools.lru_cache(maxsize=8)
def causal_mask(seq: int, device: torch.device) -> torch.Tensor:
    """(seq, seq) bools: query i sees key j when j <= i."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).tril()


@functools.lru_cache(maxsize=8)
def window_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """(seq, seq) bools: query i sees key j when i - window < j <= i (transformers' sliding window). Made once per
    shape and device, shared by every layer."""
    distance = torch.arange(seq, device=device)[:, None] - torch.arange(seq, device=device)[None, :]
    return (distance >= 0) & (distance < window)


def wide_format(dtype: torch.dtype) -> torch.dtype:
    """The format statistics and rotations are computed in: fp32, or wider when the input is."""
    return torch.promote_types(dtype, torch.float32)


@functools.lru_cache(maxsize=16)
def rope_tables(seq: int, head_dim: int, theta: float, device: torch.device,
                scaling: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, (seq, head_dim), in fp32; frequency i of the
    first half pairs with i of the second half (the rotate-half convention). Made once per shape
    and device and shared by every layer (never written to). `scaling`: None, ("llama3", GPTConfig.rope_scaling),
    ("yarn", GPTConfig.rope_yarn, its attention factor, truncate) or ("longrope", its factors, attention factor)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    factor = 1.0
    if scaling is not None and scaling[0] == "llama3":
        inv_freq = llama3_frequencies(inv_freq, *scaling[1])
    elif scaling is not None and scaling[0] == "longrope":  # each frequency over its own factor (the ones in use)
        inv_freq, factor = inv_freq / torch.tensor(scaling[1], dtype=torch.float64, device=device), scaling[2]
    elif scaling is not None and scaling[0] == "linear":  # positions divided by the factor
        inv_freq = inv_freq / scaling[1]
    elif scaling is not None:
        inv_freq, factor = yarn_frequencies(inv_freq, theta, *scaling[1][:4], truncate=scaling[3]), scaling[2]
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * factor).float(), (angles.sin() * factor).float()


def yarn_frequencies(inv_freq: torch.Tensor, theta: float, factor: float, context: int, fast: float,
                     slow: float, truncate: bool = True) -> torch.Tensor:
    """YaRN's rotary frequencies (Peng et al. 2023, "NTK-by-parts"; transformers' _compute_yarn_parameters, its
    correction range rounded out to whole columns unless `truncate` is False): frequencies turning more than `fast`
    times over the original `context` kept, fewer than `slow` times divided by `factor`, a linear ramp between."""
    dim = 2 * inv_freq.numel()

    def column(rotations: float) -> float:  # the column whose frequency turns `rotations` times over the context
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = column(fast), column(slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device=inv_freq.device) - low)
            / (high - low if high != low else 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def llama3_frequencies(inv_freq: torch.Tensor, factor: float, low: float, high: float, context: int) -> torch.Tensor:
    """Llama 3.1's scaled rotary frequencies (Meta's reference code, transformers' rope_type "llama3"): wavelengths
    shorter than context / high kept, longer than context / low divided by `factor`, those between interpolated."""
    wavelength = 2 * math.pi / inv_freq
    smooth = (context / wavelength - low) / (high - low)
    between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    return torch.where((wavelength >= context / high) & (wavelength <= context / low), between, scaled)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """x (batch, seq, heads, head_dim) rotated by +angle (sign 1) or -angle (sign -1), in fp32."""
    wide = x.to(wide_format(x.dtype))
    first, second = wide.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    cos, sin = cos[:, None, :].to(wide.dtype), sin[:, None, :].to(wide.dtype)
    return (wide * cos + sign * rotated_half * sin).to(x.dtype)


def _rotated_columns(qkv: torch.Tensor, heads: int, head_width: int, rotary: int) -> torch.Tensor:
    """The rotated columns of the first `heads` heads of a fused tensor, (batch, seq, heads, rotary): each head's
    last `rotary` columns (all of them but under multi-head latent attention), a view."""
    return qkv[..., : heads * head_width].unflatten(-1, (heads, head_width))[..., head_width - rotary:]


class RotaryQK(torch.autograd.Function):
    """Rotary position embeddings (Su et al. 2021) applied to the q and k heads of a fused qkv output: the last
    `rotary` columns of each of the first `rotated_heads` heads of `head_width` (the whole head but under MLA).

    Returns a new fused tensor (v copied) so that the attention's saved q, k and v are views of one
    tensor of the qkv output's size, and saves nothing itself: its backward rotates back. `positions`:
    each token's position along the sequence (None: 0, 1, ..., seq - 1)."""

    @staticmethod
    def forward(ctx, qkv, rotated_heads: int, head_width: int, rotary: int, theta: float,
                positions: torch.Tensor | None = None, scaling: tuple | None = None):
        seq = qkv.shape[1]
        if positions is None:
            cos, sin = rope_tables(seq, rotary, theta, qkv.device, scaling)
        else:
            longest = int(positions.max()) + 1
            cos, sin = (table[positions] for table in rope_tables(longest, rotary, theta, qkv.device, scaling))
        ctx.tables, ctx.heads = (cos, sin), (rotated_heads, head_width, rotary)
        out = qkv.clone()
        _rotated_columns(out, *ctx.heads).copy_(_rotate(_rotated_columns(qkv, *ctx.heads), cos, sin, 1.0))
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.tables
        out = grad.clone()
        _rotated_columns(out, *ctx.heads).copy_(_rotate(_rotated_columns(grad, *ctx.heads), cos, sin, -1.0))
        return out, None, None, None, None, None, None


def rotation_scaling(config: GPTConfig) -> tuple | None:
    """rope_tables' `scaling` of the model's rotation (its base's): Llama 3.1's, YaRN's, LongRoPE's or linear."""
    if config.rope_scaling is not None:
        return "llama3", config.rope_scaling
    if config.rope_yarn:
        return "yarn", config.rope_yarn, config.rope_attention_factor, config.rope_yarn_truncate
    if config.rope_longrope:
        return "longrope", config.longrope_factors, config.rope_attention_factor
    return ("linear", config.rope_linear) if config.rope_linear != 1 else None
