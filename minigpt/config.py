"""The model's shape and all of its arithmetic: parameters, FLOPs, activation bytes.

This module is the single home of the model's arithmetic. It never imports torch:
the simulator uses it to size models it will never build.

Conventions:
- FLOPs count matrix multiplications only (2 FLOPs per multiply-accumulate), the
  usual convention for MFU. LayerNorm, GELU, softmax and the residual adds are
  left out; they are a few percent of the total for any real shape.
- Attention scores are counted for the full s x s square (no causal discount),
  which is what a dense kernel computes.
- Backward costs twice the forward (gradients of inputs and of weights).
- Recomputation adds what it runs again: "full" one block forward per layer,
  "selective" (Korthikanti et al. 2022) the attention core's two s x s matmuls.
- A FlashAttention-2 backward also recomputes the scores q @ k^T: `attention="flash"`
  counts that matmul; the default counts the model's FLOPs (MFU's convention).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from minigpt.errors import ConfigError

RECOMPUTE_MODES = ("none", "selective", "full")
ATTENTION_KINDS = ("flash", "unfused")


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT: everything needed to build it or to count it."""

    vocab_size: int = 256
    seq_len: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 128
    d_ff: int = 512
    tied_head: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layers", "n_heads", "d_model", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} does not divide d_model={self.d_model}: "
                f"choose a head count that divides the width"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def with_(self, **changes) -> "GPTConfig":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)

    # ------------------------------------------------------------------ parameters

    def block_params(self) -> int:
        """Parameters of one transformer block (weights and biases)."""
        d, f = self.d_model, self.d_ff
        layer_norms = 2 * (2 * d)
        attention = (d * 3 * d + 3 * d) + (d * d + d)  # qkv + output projection
        mlp = (d * f + f) + (f * d + d)
        return layer_norms + attention + mlp

    def embedding_params(self) -> int:
        """Token and position embeddings."""
        return (self.vocab_size + self.seq_len) * self.d_model

    def head_params(self) -> int:
        """Final LayerNorm plus the LM head's own weight (zero extra when tied)."""
        head = 0 if self.tied_head else self.vocab_size * self.d_model
        return 2 * self.d_model + head

    def n_params(self) -> int:
        """Total trainable parameters, each counted once (a tied head is not counted twice)."""
        return self.embedding_params() + self.n_layers * self.block_params() + self.head_params()

    def param_breakdown(self) -> dict:
        return {
            "embedding": self.embedding_params(),
            "per_block": self.block_params(),
            "blocks": self.n_layers * self.block_params(),
            "head": self.head_params(),
            "total": self.n_params(),
        }

    # ------------------------------------------------------------------ FLOPs

    def attention_core_flops_per_token(self) -> int:
        """q @ k^T and p @ v over the full s x s square, per token (one block)."""
        return 2 * 2 * self.seq_len * self.d_model

    def block_forward_flops_per_token(self) -> int:
        """Matmul FLOPs of one block's forward pass, per token."""
        d, f = self.d_model, self.d_ff
        linears = 2 * (d * 3 * d + d * d + d * f + f * d)
        return linears + self.attention_core_flops_per_token()

    def head_forward_flops_per_token(self) -> int:
        """The LM head's matmul (tied or not, it is one d x V product)."""
        return 2 * self.d_model * self.vocab_size

    def forward_flops_per_token(self) -> int:
        return self.n_layers * self.block_forward_flops_per_token() + self.head_forward_flops_per_token()

    def train_flops_per_token(self, recompute: str = "none", attention: str | None = None) -> int:
        """Forward + backward matmul FLOPs per token, recomputation included.

        recompute="full" runs every block's forward a second time during the backward
        (only block inputs are kept), adding one block forward per layer; "selective"
        runs the attention core again (q @ k^T, p @ v). attention="flash" adds the
        scores q @ k^T that a FlashAttention-2 backward recomputes (half the core's
        forward); None or "unfused" count the backward as twice the forward.
        """
        check_recompute(recompute)
        if attention is not None:
            check_attention(attention)
        flops = 3 * self.forward_flops_per_token()
        if recompute == "full":
            flops += self.n_layers * self.block_forward_flops_per_token()
        elif recompute == "selective":
            flops += self.n_layers * self.attention_core_flops_per_token()
        if attention == "flash":
            flops += self.n_layers * self.attention_core_flops_per_token() // 2
        return flops

    # ------------------------------------------------------------------ activations

    def activation_bytes_per_token_per_layer(self, dtype_bytes: int = 4, recompute: str = "none") -> int:
        """Bytes one block keeps for its backward pass, per token.

        Counted from what the block saves (see minigpt/model.py), with fused
        attention (no s x s matrix is kept):
          LayerNorm inputs 2d, LayerNorm outputs feeding qkv and fc1 2d,
          q, k, v 3d (views of one qkv tensor), attention output d (also the
          output projection's input: the fused kernel already writes it in
          (batch, seq, heads, head_dim) order, so no copy is made),
          GELU input f and output f                       -> (8d + 2f) elements,
          plus fp32 statistics: mean and 1/std of two LayerNorms (4 values)
          and the attention log-sum-exp (one per head),
          plus a 1-byte mask per element of each of the two residual dropouts
          when dropout > 0.
        With recompute="full" only the block's input (d elements) is kept; with
        "selective" the attention core keeps nothing of its own (the log-sum-exp goes;
        q, k, v and its output stay, saved by the matmuls around it).
        """
        check_recompute(recompute)
        d, f = self.d_model, self.d_ff
        if recompute == "full":
            return dtype_bytes * d
        tensors = dtype_bytes * (8 * d + 2 * f)
        statistics = 4 * (4 + (0 if recompute == "selective" else self.n_heads))
        dropout_masks = 2 * d if self.dropout > 0 else 0
        return tensors + statistics + dropout_masks

    def head_activation_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Final LayerNorm input and output (2d) and its fp32 mean and 1/std (2), and the fp32
        log-probabilities (V) kept by the loss."""
        return dtype_bytes * 2 * self.d_model + 4 * (2 + self.vocab_size)


def check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")


def check_attention(attention: str) -> None:
    if attention not in ATTENTION_KINDS:
        raise ConfigError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {attention!r}")


PRESETS: dict[str, GPTConfig] = {
    # About 0.8M parameters: trains on 2 CPU cores at a few steps per second.
    "tiny": GPTConfig(vocab_size=256, seq_len=128, n_layers=4, n_heads=4, d_model=128, d_ff=512),
    # About 10.7M parameters: the classic character-level Shakespeare model.
    "small": GPTConfig(vocab_size=256, seq_len=256, n_layers=6, n_heads=6, d_model=384, d_ff=1536),
    # GPT-2 small: 124,439,808 parameters with its 50,257-token vocabulary.
    "gpt2-124m": GPTConfig(vocab_size=50257, seq_len=1024, n_layers=12, n_heads=12, d_model=768, d_ff=3072),
    # GPT-3 175B (Brown et al. 2020, table 2.1): 96 layers, width 12,288, 96 heads.
    "gpt3-175b": GPTConfig(
        vocab_size=50257, seq_len=2048, n_layers=96, n_heads=96, d_model=12288, d_ff=4 * 12288
    ),
}


def preset(name: str) -> GPTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}") from None


def build_config(
    name: str = "tiny",
    *,
    vocab_size: int | None = None,
    seq_len: int | None = None,
    n_layers: int | None = None,
    n_heads: int | None = None,
    d_model: int | None = None,
    d_ff: int | None = None,
    tied_head: bool | None = None,
    dropout: float | None = None,
) -> GPTConfig:
    """A preset with any explicit dimensions overriding it.

    Changing d_model without d_ff keeps the preset's ratio of MLP width to model width.
    """
    base = preset(name)
    changes = {
        key: value
        for key, value in dict(
            vocab_size=vocab_size,
            seq_len=seq_len,
            n_layers=n_layers,
            n_heads=n_heads,
            d_model=d_model,
            d_ff=d_ff,
            tied_head=tied_head,
            dropout=dropout,
        ).items()
        if value is not None
    }
    if "d_model" in changes and "d_ff" not in changes:
        if isinstance(changes["d_model"], int):
            changes["d_ff"] = changes["d_model"] * base.d_ff // base.d_model
    return replace(base, **changes)
