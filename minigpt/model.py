"""A plain GPT: embeddings, pre-norm blocks, final norm, LM head, loss.

GPT-2-style by default; the config's options make it Llama-style (RMSNorm, SwiGLU, rotary
positions, grouped-query attention, no biases, untied head) with the same module names, or give it
DeepSeek's multi-head latent attention (LatentAttention).

No distributed code lives here. Parallelism is applied from outside
(`parallel/`): tensor parallelism swaps modules (`qkv`, `proj`, `fc1`, `fc2`,
`tok_emb`, `head`; under multi-head latent attention `spread`, `q_up`, `kv_up`) for sharded ones,
and pipeline parallelism runs
`embed`, slices of `blocks`, and `logits`/`loss` on different ranks. To make that
possible the attention reads its shapes from the qkv output, so a column-sharded
qkv simply carries fewer heads (and, under sequence parallelism, the whole
sequence gathered from the pieces its input had).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minigpt.attention import (RotaryQK, causal_attention, current_documents, rotation_scaling, wide_format,
                               within_documents)
from minigpt.config import GPTConfig
from minigpt.moe import MoE, activation


class RMSNorm(nn.Module):
    """y = x / rms(x) * g (Zhang & Sennrich 2019): statistics in fp32, output in the input's format."""

    def __init__(self, width: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)


class RMSNormFunction(torch.autograd.Function):
    """Saves the input and one fp32 1/rms per row, as LayerNorm's kernel saves its input and statistics
    (torch's own RMSNorm on CPU is composite and keeps fp32 copies of the whole input)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        x32 = x.to(wide_format(x.dtype))
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inv_rms)
        return (x32 * inv_rms * weight.to(x32.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, inv_rms = ctx.saved_tensors
        x32, grad32 = x.to(inv_rms.dtype), grad.to(inv_rms.dtype)
        normed = x32 * inv_rms
        grad_weight = (grad32 * normed).flatten(0, -2).sum(0).to(weight.dtype)
        grad_normed = grad32 * weight.to(x32.dtype)
        grad_x = inv_rms * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


class WholeQKNormFunction(torch.autograd.Function):
    """q and k each RMS-normalised over all their columns at once (OLMo 2's q_norm and k_norm): one fp32 1/rms per
    row for each, from the sum of squares of the `widths` (q's, k's) columns. `total` joins the sums of columns held
    elsewhere to this rank's (tensor parallelism: a sum over its group, the same call again in the backward for
    the sums there); None: every column is here. Saves the inputs and the two 1/rms, as RMSNormFunction."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps: float, widths: tuple[int, int], total):
        q32, k32 = q.to(wide_format(q.dtype)), k.to(wide_format(k.dtype))
        squares = torch.cat([q32.pow(2).sum(-1, keepdim=True), k32.pow(2).sum(-1, keepdim=True)], dim=-1)
        squares = squares if total is None else total(squares)
        inv_rms = torch.rsqrt(squares / squares.new_tensor(widths) + eps)
        ctx.save_for_backward(q, k, q_weight, k_weight, inv_rms)
        ctx.widths, ctx.total = widths, total
        return tuple((x32 * inv_rms[..., i:i + 1] * w.to(x32.dtype)).to(x.dtype)
                     for i, (x, x32, w) in enumerate(((q, q32, q_weight), (k, k32, k_weight))))

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        q, k, q_weight, k_weight, inv_rms = ctx.saved_tensors
        normed, grad_normed, grad_weights = [], [], []
        for i, (x, w, grad) in enumerate(((q, q_weight, grad_q), (k, k_weight, grad_k))):
            x32, grad32 = x.to(inv_rms.dtype), grad.to(inv_rms.dtype)
            normed.append(x32 * inv_rms[..., i:i + 1])
            grad_weights.append((grad32 * normed[i]).flatten(0, -2).sum(0).to(w.dtype))
            grad_normed.append(grad32 * w.to(x32.dtype))
        dots = torch.cat([(g * n).sum(-1, keepdim=True) for g, n in zip(grad_normed, normed)], dim=-1)
        dots = (dots if ctx.total is None else ctx.total(dots)) / dots.new_tensor(ctx.widths)
        grads = [(inv_rms[..., i:i + 1] * (grad_normed[i] - normed[i] * dots[..., i:i + 1])).to(x.dtype)
                 for i, x in enumerate((q, k))]
        return grads[0], grads[1], grad_weights[0], grad_weights[1], None, None, None


def make_norm(config: GPTConfig) -> nn.Module:
    eps = config.norm_eps
    return RMSNorm(config.d_model, eps=eps) if config.norm == "rmsnorm" else nn.LayerNorm(config.d_model, eps=eps)


class AttentionCore(nn.Module):
    """From the fused qkv output to the heads' outputs: split, RoPE, causal attention.

    Reads its head counts from the input's width: a column-sharded qkv carries fewer heads of each
    kind, in the same ratio of query heads to key/value heads (`group`). The one module that
    selective recomputation runs again (parallel/recompute.py). `positions` and `attend` are what a rank
    holding part of each sequence changes (parallel/context/apply.py's subclass); the rest is the same."""

    def __init__(self, config: GPTConfig, window: int | None = None, rotates: bool = True, local: bool = False):
        super().__init__()
        self.head_dim, self.group = config.head_dim, config.n_heads // config.kv_heads
        self.qk_dim, self.v_dim, self.rotary = config.qk_head_dim, config.v_head_dim, config.rotary_dim
        self.window = config.window if window is None else window  # a sliding window (0: none); a block's own
        self.local = local  # Gemma 3's sliding blocks rotate by their own base, unscaled (GPTConfig.layer_local)
        theta = config.rope_local_theta if local else config.rope_theta
        self.rope_theta = theta if config.positions == "rope" and rotates else None
        self.rope_scaling = None if local else rotation_scaling(config)
        self.scale = config.softmax_scale  # of q @ k^T
        # Qwen3's norms, over each head (one head's gains, shared), or OLMo 2's over all of q's or k's heads at once
        self.whole = config.qk_norm_whole
        self.widths = (config.n_heads * config.head_dim, config.kv_heads * config.head_dim)
        q_width, k_width = self.widths if self.whole else (config.head_dim, config.head_dim)
        self.q_norm = RMSNorm(q_width, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(k_width, eps=config.norm_eps) if config.qk_norm else None
        self.qk_total = None  # the whole norms' sum over the columns elsewhere (tensor parallelism sets it)
        self.sinks = nn.Parameter(torch.zeros(config.n_heads)) if config.attention_sinks else None  # GPT-OSS's
        self.softcap = config.attention_softcap  # Gemma 2's cap on the scores (0: none)

    def split_sizes(self, width: int) -> tuple[int, int, list[int]]:
        """(query heads, key/value heads, the widths of q, k and v) of a fused tensor `width` wide."""
        kv_heads = width // (self.group * self.qk_dim + self.qk_dim + self.v_dim)
        heads = kv_heads * self.group
        return heads, kv_heads, [heads * self.qk_dim, kv_heads * self.qk_dim, kv_heads * self.v_dim]

    def normed(self, qkv: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
        """qkv with each query and key head RMS-normalised (a new fused tensor; v copied)."""
        batch, seq, _ = qkv.shape
        q, k, v = qkv.split(self.split_sizes(qkv.shape[-1])[2], dim=-1)
        if self.whole:
            q, k = WholeQKNormFunction.apply(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                             self.widths, self.qk_total)
            return torch.cat([q, k, v], dim=-1)
        q = self.q_norm(q.view(batch, seq, heads, self.head_dim)).view(batch, seq, -1)
        k = self.k_norm(k.view(batch, seq, kv_heads, self.head_dim)).view(batch, seq, -1)
        return torch.cat([q, k, v], dim=-1)

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        batch, seq, width = qkv.shape
        heads, kv_heads, sizes = self.split_sizes(width)
        if self.q_norm is not None:
            qkv = self.normed(qkv, heads, kv_heads)
        if self.rope_theta is not None:
            qkv = RotaryQK.apply(qkv, heads + kv_heads, self.qk_dim, self.rotary, self.rope_theta, self.positions(),
                                 self.rope_scaling)
        q, k, v = qkv.split(sizes, dim=-1)
        # (batch, seq, heads, head width) -> (batch, heads, seq, head width), views of the fused tensor
        q, k = (t.view(batch, seq, -1, self.qk_dim).transpose(1, 2) for t in (q, k))
        v = v.view(batch, seq, -1, self.v_dim).transpose(1, 2)
        if self.v_dim == self.qk_dim:
            return self.attend(q, k, v).transpose(1, 2).contiguous().view(batch, seq, heads * self.v_dim)
        # SDPA's fused kernels take one head width: v zero-padded to q and k's, the output cut back to v's (as
        # torchtitan's DeepSeek-V3 runs it); the padded v and output are saved, and the cut copy the projection reads
        out = self.attend(q, k, F.pad(v, (0, self.qk_dim - self.v_dim)))[..., : self.v_dim]
        return out.transpose(1, 2).contiguous().view(batch, seq, heads * self.v_dim)

    def positions(self) -> torch.Tensor | None:
        """The tokens' positions in their sequence for the rotation; None: 0 .. seq - 1, the whole sequence."""
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over (batch, heads, seq, head_dim) q, k, v (fewer key/value heads: grouped-query), through
        the block's sliding window, with its sinks where it has them, within the documents within_documents set
        (minigpt/attention.py)."""
        return causal_attention(q, k, v, self.scale, self.window, self.group, self.sinks, current_documents(),
                                self.softcap)


class CausalSelfAttention(nn.Module):
    """`window`: the block's sliding window (GPTConfig.layer_window; None: the model's); `rotates`: whether it turns
    its queries and keys by rotary positions (GPTConfig.layer_rotates); `local`: by rope_local_theta (layer_local)."""

    def __init__(self, config: GPTConfig, window: int | None = None, rotates: bool = True, local: bool = False):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.d_model, config.qkv_width, bias=config.linear_bias("attn.qkv"))
        self.core = AttentionCore(config, window, rotates, local)
        self.proj = nn.Linear(config.attention_width, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.core(self.qkv(x))))


# DeepSeek's latent norms keep RMSNorm's default epsilon whatever the model's (its modeling code and transformers'
# DeepseekV3Attention build q_a_layernorm and kv_a_layernorm without rms_norm_eps)
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, section 2.1): one down projection makes a query
    latent (q_lora_rank wide; none when 0), a key/value latent (kv_lora_rank) and a rotated key shared by every head
    (rope_head_dim); the two latents are RMS-normalised, and up projections make each head's query (head_dim +
    rope_head_dim), key (head_dim, the shared rotated key after it) and value (v_head_dim). From there the fused q,
    k, v tensor goes through the same AttentionCore as the other attentions (rotating each q and k head's last
    rope_head_dim columns), then the output projection.

    `spread` is where tensor parallelism hands the normed latent to every rank of its group (an identity here:
    parallel/tensor/parallelize.py swaps it); the up projections then make only that rank's heads."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.sizes = [config.q_lora_rank, config.kv_lora_rank, config.rope_head_dim]
        self.key_value = [config.head_dim, config.v_head_dim]
        heads, d = config.n_heads, config.d_model
        self.down = nn.Linear(d, config.latent_width, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS) if config.q_lora_rank else None
        self.kv_norm = RMSNorm(config.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.spread = nn.Identity()
        self.q_up = nn.Linear(config.q_up_in_width, heads * config.qk_head_dim, bias=False)
        self.kv_up = nn.Linear(config.kv_lora_rank, heads * sum(self.key_value), bias=False)
        self.core = AttentionCore(config)
        self.proj = nn.Linear(config.attention_width, d, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q_latent, kv_latent, rotated_key = self.down(x).split(self.sizes, dim=-1)
        normed = [self.kv_norm(kv_latent), rotated_key]
        if self.q_norm is not None:
            normed.insert(0, self.q_norm(q_latent))
        q_latent, kv_latent, rotated_key = self.spread(torch.cat(normed, dim=-1)).split(self.sizes, dim=-1)
        q = self.q_up(q_latent if self.q_norm is not None else x)
        key_value = self.kv_up(kv_latent).unflatten(-1, (-1, sum(self.key_value)))  # (batch, seq, heads, k + v)
        batch, seq, heads, _ = key_value.shape
        k, v = key_value.split(self.key_value, dim=-1)
        k = torch.cat([k, rotated_key.unsqueeze(2).expand(batch, seq, heads, -1)], dim=-1)
        qkv = torch.cat([q, k.flatten(2), v.flatten(2)], dim=-1)
        return self.dropout(self.proj(self.core(qkv)))


class MLP(nn.Module):
    """GELU(x W1) W2, relu(x W1)^2 W2 (GPTConfig.mlp "relu2"), or SwiGLU (Shazeer 2020): (silu(x Wg) * x Wu) W2
    with Wg and Wu fused in fc1."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.kind = config.mlp
        self.fc1 = nn.Linear(config.d_model, config.mlp_in_width, bias=config.bias)
        self.fc2 = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a column-sharded SwiGLU fc1 holds this rank's gate rows, then its up rows: its halves are still gate and up
        return self.dropout(self.fc2(activation(self.fc1(x), self.kind)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(x)) (with post_norms x + post(attn(ln1(x))) and
    x + post(mlp(ln2(x))), Gemma's; without pre_norms x + post(attn(x)), OLMo 2's); the MLP a mixture of experts
    (minigpt/moe.py) when block `layer` of the model is one (GPTConfig.is_moe_layer), the attention through the
    block's window (GPTConfig.layer_window)."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln1 = make_norm(config) if config.pre_norms else nn.Identity()  # none: OLMo 2's block
        window = config.layer_window(layer)
        self.attn = LatentAttention(config) if config.is_mla else CausalSelfAttention(
            config, window, config.layer_rotates(layer), config.layer_local(layer))
        self.ln2 = make_norm(config) if config.pre_norms else nn.Identity()
        self.mlp = MoE(config, layer) if config.is_moe_layer(layer) else MLP(config)
        # Gemma's norm of each branch before its residual add; otherwise the branch as it is
        self.post_attn_norm = make_norm(config) if config.post_norms else nn.Identity()
        self.post_mlp_norm = make_norm(config) if config.post_norms else nn.Identity()
        self.residual = config.residual_multiplier  # Granite's (1: none)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.scaled(self.post_attn_norm(self.attn(self.ln1(x))))
        return x + self.scaled(self.post_mlp_norm(self.mlp(self.ln2(x))))

    def scaled(self, branch: torch.Tensor) -> torch.Tensor:
        """A branch times Granite's residual_multiplier before its residual add (as it is at 1)."""
        return branch if self.residual == 1 else branch * self.residual


class NextTokenLoss(nn.Module):
    """Mean next-token cross-entropy over every position (computed in fp32) whose target is not IGNORED."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORED)


IGNORED = -100  # a target no loss counts (cross_entropy's ignore_index): the positions a prediction runs past


class MultiTokenPrediction(nn.Module):
    """DeepSeek-V3's multi-token prediction module k (arXiv 2412.19437, 2.2): from depth k - 1's hidden state h
    (depth 0: the model's, after its final norm) and the embedding e of token i + k, the hidden state that predicts
    token i + k + 1: norm(block(W [enorm(e); hnorm(h)])), W a 2d -> d projection, the block of the model's last
    kind; the model's embedding and head are shared. The order inside the concatenation is the released weights'
    (Megatron-core's and vLLM's: the embedding first)."""

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.enorm, self.hnorm = make_norm(config), make_norm(config)
        self.eh_proj = nn.Linear(2 * config.d_model, config.d_model, bias=False)
        self.block = Block(config, layer)
        self.norm = make_norm(config)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return self.norm(self.block(self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))))


def output_logits(logits: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """The head's output as the model gives it: divided by Granite's logits_scaling, capped by Gemma 2's
    final_logit_softcapping (cap * tanh(logits / cap)); as it is without either. Element by element, so a
    vocabulary-parallel head's shard is treated as it is."""
    if config.logit_divisor != 1:
        logits = logits / config.logit_divisor
    cap = config.logit_softcap
    return cap * torch.tanh(logits / cap) if cap else logits


def embedded(x: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """The token embeddings as the blocks take them: times sqrt(d_model) in their own format with embed_scale
    (Gemma's normalizer, as transformers rounds it), times embed_multiplier (Granite's), else as they are."""
    if config.embed_multiplier != 1:  # Granite's embedding_multiplier, a Python number as transformers multiplies
        return x * config.embed_multiplier
    return x * torch.tensor(config.d_model ** 0.5, dtype=x.dtype) if config.embed_scale else x


def every_block(model: nn.Module) -> list[Block]:
    """The model's blocks, then its multi-token prediction modules' (what expert parallelism splits)."""
    return [*model.blocks, *(module.block for module in model.mtp)]


def ahead(targets: torch.Tensor, k: int) -> torch.Tensor:
    """The tokens k places after each position's next one: targets moved k places left, the last k IGNORED
    (the input tokens of depth k are ahead(targets, k - 1): their wrapped last ones only reach IGNORED positions,
    as attention is causal). `targets` (batch, seq) whole sequences, or (1 + D, batch, seq): each depth's already
    moved (a layout that holds pieces of the sequences moves them before it cuts: parallel/run/train.py)."""
    if targets.dim() == 3:
        return targets[k]
    if k == 0:
        return targets
    moved = torch.roll(targets, -k, dims=1)
    moved[:, -k:] = IGNORED
    return moved


def predict_ahead(modules: nn.ModuleList, embed, normed: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    """Each depth's normed hidden state, from the model's own (`normed`) and the targets' embeddings (`embed(ids)`:
    the model's token embedding, called once for every depth's tokens)."""
    tokens = [ahead(targets, k).clamp(min=0) for k in range(len(modules))]  # IGNORED ones read token 0: causal,
    embedded = embed(torch.cat(tokens)).chunk(len(modules))  # nothing that counts sees them
    hidden, out = normed, []
    for module, inputs in zip(modules, embedded):
        hidden = module(hidden, inputs)
        out.append(hidden)
    return out


def prediction_loss(loss: nn.Module, logits: torch.Tensor, ahead_logits: list[torch.Tensor], targets: torch.Tensor,
                    weight: float, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the next-token loss, the training objective): the next token's loss plus `weight` times the mean over the
    depths of each depth's loss on its own tokens (GPTConfig.mtp_weight, DeepSeek-V3's lambda). Given the whole
    sequences' `seq_len`, each depth's loss is weighed by the share of the depth's positions over those sequences
    that these targets hold, against an even share (1 when they are whole sequences): a layout that holds pieces of
    the sequences averages the pieces' objectives, and so gets each depth's mean over every position that has one."""
    main = loss(logits, ahead(targets, 0))
    if not ahead_logits:
        return main, main
    extra = sum(_depth_loss(loss, out, ahead(targets, k), k, seq_len) for k, out in enumerate(ahead_logits, start=1))
    return main, main + weight / len(ahead_logits) * extra


def _depth_loss(loss: nn.Module, logits: torch.Tensor, targets: torch.Tensor, k: int,
                seq_len: int | None) -> torch.Tensor:
    """Depth k's mean loss over the positions here that have a token k places on, weighed by their share (above)."""
    if seq_len is None or seq_len == targets.shape[-1]:
        return loss(logits, targets)
    held = int((targets != IGNORED).sum())
    if held == 0:  # every position here runs past the sequence: nothing to learn, nothing to average in
        return logits.sum() * 0.0
    parts = seq_len / targets.shape[-1]
    return loss(logits, targets) * (held * parts / (targets.shape[-2] * (seq_len - k)))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model) if config.positions == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layers))
        self.norm_f = make_norm(config)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tied_head:
            self.head.weight = self.tok_emb.weight
        self.loss = NextTokenLoss()
        self.reset_parameters()  # before the modules below: the model's own draws are those of a model without them
        self.mtp = nn.ModuleList(MultiTokenPrediction(config, config.n_layers + k) for k in range(config.mtp_depth))
        self.reset_parameters(self.mtp)

    @torch.no_grad()
    def reset_parameters(self, within: nn.Module | None = None) -> None:
        """GPT-2 initialisation: N(0, 0.02), zero biases, and residual output
        projections scaled by 1/sqrt(2 * n_layers); of the modules `within` only, when given."""
        std = 0.02
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in (self if within is None else within).named_modules():
            if isinstance(module, MoE):  # each expert as a dense MLP: its input N(0, 0.02), its output residual
                nn.init.normal_(module.experts.w1, 0.0, std)
                nn.init.normal_(module.experts.w2, 0.0, residual_std)
                for bias in (module.experts.b1, module.experts.b2):
                    if bias is not None:
                        nn.init.zeros_(bias)
            if isinstance(module, nn.Linear):
                is_residual = name.endswith("attn.proj") or name.endswith("mlp.fc2") or name.endswith("shared.fc2")
                nn.init.normal_(module.weight, 0.0, residual_std if is_residual else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, AttentionCore) and module.sinks is not None:
                nn.init.zeros_(module.sinks)  # a sink's logit 0: its key weighs as one of score 0 would
        # A tied head shares the embedding matrix; both draw from N(0, 0.02).

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        x = embedded(self.tok_emb(idx), self.config)
        if self.pos_emb is not None:  # rotary positions enter in the attention instead
            x = x + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        return self.drop(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return output_logits(self.head(self.norm_f(x)), self.config)

    def trunk(self, idx: torch.Tensor) -> torch.Tensor:
        """The last block's output for `idx` (before the final norm)."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `idx`, or the mean next-token loss when `targets` are given; `documents`: (batch, seq) each
        token's document (minigpt/attention.py's document_ids), attention kept within each (None: one document)."""
        with within_documents(documents):
            logits = self.logits(self.trunk(idx))
        return logits if targets is None else self.loss(logits, targets)

    def objective(self, idx: torch.Tensor, targets: torch.Tensor,
                  documents: torch.Tensor | None = None) -> torch.Tensor:
        """What training minimises: the next-token loss, plus the multi-token prediction's (prediction_loss)."""
        with within_documents(documents):  # the prediction modules' blocks attend within them too
            normed = self.norm_f(self.trunk(idx))
            hidden = predict_ahead(self.mtp, self.tok_emb, normed, targets)
        logits = [output_logits(self.head(h), self.config) for h in hidden]
        return prediction_loss(self.loss, output_logits(self.head(normed), self.config), logits, targets,
                               self.config.mtp_weight)[1]
