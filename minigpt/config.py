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
MLP_KINDS = ("gelu", "swiglu")
NORM_KINDS = ("layernorm", "rmsnorm")
POSITION_KINDS = ("learned", "rope")


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT: everything needed to build it or to count it.

    The defaults are a GPT-2-style block (LayerNorm, GELU MLP, learned positions, multi-head
    attention, biases, tied head). A Llama-style block sets `norm="rmsnorm"`, `mlp="swiglu"`
    (d_ff is then the width of each of its two input projections), `positions="rope"`,
    `n_kv_heads` below `n_heads` (grouped-query attention), `bias=False`, `tied_head=False`.
    """

    vocab_size: int = 256
    seq_len: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 128
    d_ff: int = 512
    tied_head: bool = True
    dropout: float = 0.0
    n_kv_heads: int | None = None  # None: as many as n_heads (multi-head attention)
    mlp: str = "gelu"
    norm: str = "layernorm"
    positions: str = "learned"
    rope_theta: float = 10000.0
    bias: bool = True

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
        self._check_llama_options()

    def _check_llama_options(self) -> None:
        kv = self.n_kv_heads
        if kv is not None:
            if not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0:
                raise ConfigError(f"n_kv_heads must be a positive integer, got {kv!r}")
            if self.n_heads % kv:
                raise ConfigError(f"n_kv_heads={kv} does not divide n_heads={self.n_heads}: grouped-query attention "
                                  f"shares each key/value head among an equal number of query heads")
        for name, kinds in (("mlp", MLP_KINDS), ("norm", NORM_KINDS), ("positions", POSITION_KINDS)):
            if getattr(self, name) not in kinds:
                raise ConfigError(f"{name} must be one of {', '.join(kinds)}, got {getattr(self, name)!r}")
        if self.positions == "rope" and self.head_dim % 2:
            raise ConfigError(f"rotary position embeddings need an even head width, got d_model/n_heads = "
                              f"{self.d_model}/{self.n_heads} = {self.head_dim}: change d_model or n_heads")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) \
                or not 1.0 < self.rope_theta < float("inf"):
            raise ConfigError(f"rope_theta must be a number above 1, got {self.rope_theta!r}")
        for name in ("tied_head", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads when it is not set."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def qkv_width(self) -> int:
        """Output features of the fused q, k, v projection: all query heads, then the key and value heads."""
        return (self.n_heads + 2 * self.kv_heads) * self.head_dim

    @property
    def mlp_in_width(self) -> int:
        """Output features of the MLP's first Linear: d_ff, or 2 d_ff for SwiGLU (gate and up, fused)."""
        return 2 * self.d_ff if self.mlp == "swiglu" else self.d_ff

    @property
    def norm_params(self) -> int:
        """A LayerNorm has a gain and a bias per feature, an RMSNorm only the gain."""
        return (2 if self.norm == "layernorm" else 1) * self.d_model

    def describe(self) -> str:
        """'4 layers, width 128, 4 heads (2 kv), SwiGLU 352, RMSNorm, RoPE, untied, no bias, seq 128'."""
        heads = f"{self.n_heads} heads" + (f" ({self.kv_heads} kv)" if self.kv_heads != self.n_heads else "")
        parts = [f"{self.n_layers} layers", f"width {self.d_model}", heads,
                 f"{'SwiGLU' if self.mlp == 'swiglu' else 'GELU'} {self.d_ff}",
                 "RMSNorm" if self.norm == "rmsnorm" else "LayerNorm",
                 "RoPE" if self.positions == "rope" else "learned positions",
                 "tied head" if self.tied_head else "untied head"]
        return ", ".join(parts + ([] if self.bias else ["no bias"]) + [f"seq {self.seq_len}"])

    def with_(self, **changes) -> "GPTConfig":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)

    # ------------------------------------------------------------------ parameters

    def block_params(self) -> int:
        """Parameters of one transformer block (weights and biases)."""
        d, f, bias = self.d_model, self.d_ff, int(self.bias)
        norms = 2 * self.norm_params
        attention = (d * self.qkv_width + bias * self.qkv_width) + (d * d + bias * d)  # qkv + output projection
        mlp = (d * self.mlp_in_width + bias * self.mlp_in_width) + (f * d + bias * d)
        return norms + attention + mlp

    def embedding_params(self) -> int:
        """Token embeddings, and position embeddings when they are learned (RoPE has none)."""
        positions = self.seq_len if self.positions == "learned" else 0
        return (self.vocab_size + positions) * self.d_model

    def head_params(self) -> int:
        """Final norm plus the LM head's own weight (zero extra when tied)."""
        head = 0 if self.tied_head else self.vocab_size * self.d_model
        return self.norm_params + head

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
        """q @ k^T and p @ v over the full s x s square, per token (one block). Grouped-query
        attention shares key/value heads but every query head still scores the whole sequence."""
        return 2 * 2 * self.seq_len * self.d_model

    def block_forward_flops_per_token(self) -> int:
        """Matmul FLOPs of one block's forward pass, per token."""
        d, f = self.d_model, self.d_ff
        linears = 2 * (d * self.qkv_width + d * d + d * self.mlp_in_width + f * d)
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
          norm inputs 2d, norm outputs feeding qkv and fc1 2d,
          the fused qkv output (H + 2K) x head_dim (q, k and v are views of it; with RoPE the
          rotated copy replaces it, the same size), attention output d (also the
          output projection's input: the fused kernel already writes it in
          (batch, seq, heads, head_dim) order, so no copy is made),
          GELU input f and output f, or for SwiGLU the fused gate/up output 2f, silu(gate) f
          and the product f,
          plus fp32 statistics: a LayerNorm's mean and 1/std (an RMSNorm's 1/rms only) for
          each of the two norms, and the attention log-sum-exp (one per query head),
          plus a 1-byte mask per element of each of the two residual dropouts
          when dropout > 0.
        With recompute="full" only the block's input (d elements) is kept; with
        "selective" the attention core (RoPE and the attention itself) keeps nothing of its
        own: the log-sum-exp goes, the qkv output and the core's output stay, saved around it.
        """
        check_recompute(recompute)
        d, f = self.d_model, self.d_ff
        if recompute == "full":
            return dtype_bytes * d
        mlp = 4 * f if self.mlp == "swiglu" else 2 * f
        tensors = dtype_bytes * (4 * d + self.qkv_width + d + mlp)
        norm_statistics = 2 * (2 if self.norm == "layernorm" else 1)
        statistics = 4 * (norm_statistics + (0 if recompute == "selective" else self.n_heads))
        dropout_masks = 2 * d if self.dropout > 0 else 0
        return tensors + statistics + dropout_masks

    def head_activation_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Final norm input and output (2d) and its fp32 statistics (mean and 1/std, or 1/rms), and the
        fp32 log-probabilities (V) kept by the loss."""
        statistics = 2 if self.norm == "layernorm" else 1
        return dtype_bytes * 2 * self.d_model + 4 * (statistics + self.vocab_size)


def check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")


def check_attention(attention: str) -> None:
    if attention not in ATTENTION_KINDS:
        raise ConfigError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {attention!r}")


def llama(vocab_size: int, seq_len: int, n_layers: int, n_heads: int, n_kv_heads: int, d_model: int, d_ff: int,
          rope_theta: float) -> GPTConfig:
    """A Llama-style shape: RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied head."""
    return GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                     d_model=d_model, d_ff=d_ff, tied_head=False, mlp="swiglu", norm="rmsnorm", positions="rope",
                     rope_theta=rope_theta, bias=False)


LLAMA3_VOCAB = 128_256  # Llama 3's tokenizer (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.2)

PRESETS: dict[str, GPTConfig] = {
    # About 0.8M parameters: trains on 2 CPU cores at a few steps per second.
    "tiny": GPTConfig(vocab_size=256, seq_len=128, n_layers=4, n_heads=4, d_model=128, d_ff=512),
    # The tiny shape made Llama-style: 2 key/value heads for 4 query heads, SwiGLU at 8/3 of the width
    # rounded up to a multiple of 32 (Llama's rule), the same number of parameters within 10%.
    "tiny-llama": llama(256, 128, 4, 4, 2, 128, 352, 10000.0),
    # About 10.7M parameters: the classic character-level Shakespeare model.
    "small": GPTConfig(vocab_size=256, seq_len=256, n_layers=6, n_heads=6, d_model=384, d_ff=1536),
    # GPT-2 small: 124,439,808 parameters with its 50,257-token vocabulary.
    "gpt2-124m": GPTConfig(vocab_size=50257, seq_len=1024, n_layers=12, n_heads=12, d_model=768, d_ff=3072),
    # GPT-3 175B (Brown et al. 2020, table 2.1): 96 layers, width 12,288, 96 heads.
    "gpt3-175b": GPTConfig(
        vocab_size=50257, seq_len=2048, n_layers=96, n_heads=96, d_model=12288, d_ff=4 * 12288
    ),
    # Llama 3 (Dubey et al. 2024, table 3): layers, width, FFN width, heads, key/value heads, RoPE base
    # 500,000, pre-training sequence length 8,192. 8,030,261,248 / 70,553,706,496 / 405,853,388,800
    # parameters, as the published checkpoints count them.
    "llama3-8b": llama(LLAMA3_VOCAB, 8192, 32, 32, 8, 4096, 14336, 500000.0),
    "llama3-70b": llama(LLAMA3_VOCAB, 8192, 80, 64, 8, 8192, 28672, 500000.0),
    "llama3-405b": llama(LLAMA3_VOCAB, 8192, 126, 128, 8, 16384, 53248, 500000.0),
}


def preset(name: str) -> GPTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}") from None


MODEL_FIELDS = ("vocab_size", "seq_len", "n_layers", "n_heads", "n_kv_heads", "d_model", "d_ff", "tied_head",
                "dropout", "mlp", "norm", "positions", "rope_theta", "bias")


def build_config(name: str = "tiny", **overrides) -> GPTConfig:
    """A preset with any explicit fields (MODEL_FIELDS) overriding it; None leaves the preset's value.

    Changing d_model without d_ff keeps the preset's ratio of MLP width to model width.
    """
    unknown = set(overrides) - set(MODEL_FIELDS)
    if unknown:
        raise TypeError(f"build_config() got unknown fields {sorted(unknown)}")
    base = preset(name)
    changes = {key: value for key, value in overrides.items() if value is not None}
    if "d_model" in changes and "d_ff" not in changes:
        if isinstance(changes["d_model"], int):
            changes["d_ff"] = changes["d_model"] * base.d_ff // base.d_model
    return replace(base, **changes)
