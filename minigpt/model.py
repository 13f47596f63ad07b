"""A plain GPT: embeddings, pre-LayerNorm blocks, final norm, LM head, loss.

No distributed code lives here. Parallelism is applied from outside
(`parallel/`): tensor parallelism swaps modules (`qkv`, `proj`, `fc1`, `fc2`,
`tok_emb`, `head`) for sharded ones, and pipeline parallelism runs
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

from minigpt.config import GPTConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        batch, seq, width = qkv.shape  # read from qkv: a sharded qkv may return other shapes than x
        heads = width // (3 * self.head_dim)
        # (batch, seq, 3, heads, head_dim) -> three tensors of (batch, heads, seq, head_dim)
        q, k, v = qkv.view(batch, seq, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(batch, seq, heads * self.head_dim)
        return self.dropout(self.proj(out))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, config.d_ff)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(config.d_ff, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class NextTokenLoss(nn.Module):
    """Mean next-token cross-entropy over every position (computed in fp32)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tied_head:
            self.head.weight = self.tok_emb.weight
        self.loss = NextTokenLoss()
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), zero biases, and residual output
        projections scaled by 1/sqrt(2 * n_layers)."""
        std = 0.02
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith("attn.proj") or name.endswith("mlp.fc2")
                nn.init.normal_(module.weight, 0.0, residual_std if is_residual else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        # A tied head shares the embedding matrix; both draw from N(0, 0.02).

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(positions))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm_f(x))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `idx`, or the mean loss when `targets` are given."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.logits(x)
        return logits if targets is None else self.loss(logits, targets)
