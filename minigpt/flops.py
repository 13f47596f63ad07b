"""The model's matmul FLOPs per token: part of GPTConfig (minigpt/config.py), which inherits it (its fields read
through self); torch-free, as config.py. The conventions are config.py's docstring's."""

from __future__ import annotations

from minigpt.activations import OP_RECOMPUTE, check_recompute
from minigpt.errors import ConfigError

ATTENTION_KINDS = ("flash", "unfused")


class FlopArithmetic:
    """GPTConfig's FLOPs per token."""


    @property
    def window_in_use(self) -> int:
        """The sliding window where it is shorter than the sequence; 0 where none or one as long (full attention)."""
        return self.window if self.window < self.seq_len else 0

    @property
    def attended(self) -> int:
        """The keys a query scores in the FLOP convention: the whole sequence, or a window shorter than it."""
        return self.window_in_use or self.seq_len

    @property
    def attended_by_blocks(self) -> int:
        """The keys a query scores, summed over the blocks: the windowed blocks' `attended`, the whole sequence in
        the blocks of full attention."""
        full = self.full_attention_layers
        return (self.n_layers - full) * self.attended + full * self.seq_len

    def attention_core_flops_per_token(self, attended: int | None = None) -> int:
        """q @ k^T and p @ v over the full s x s square, per token (one block; a sliding window's s x w band;
        `attended`: keys scored, default the windowed blocks'). Grouped-query attention shares key/value heads but
        every query head still scores the whole sequence."""
        return 2 * (attended or self.attended) * self.n_heads * (self.qk_head_dim + self.v_head_dim)

    def blocks_core_flops_per_token(self) -> int:
        """The attention cores' matmuls of all the blocks, forward, per token."""
        return self.attention_core_flops_per_token(self.attended_by_blocks)

    def attention_linear_flops_per_token(self) -> int:
        """The attention's projections, forward, per token: qkv and proj (MLA: down, up and proj)."""
        d = self.d_model
        projections = self.mla_projection_params() if self.is_mla else d * self.qkv_width
        return 2 * (projections + self.attention_width * d)

    def mlp_forward_flops_per_token(self, moe: bool | None = None) -> int:
        """Matmul FLOPs of one MLP's forward per token: the dense MLP, or a MoE's router and the experts a token
        goes through (top_k routed and the shared ones; tokens a capacity drops are still counted, as MFU does)."""
        d = self.d_model
        if not (self.is_moe if moe is None else moe):
            return 2 * (d * self.mlp_in_width + self.d_ff * d)
        expert = 2 * (d * self.expert_in_width + self.expert_width * d)
        return 2 * d * self.n_experts + (self.top_k + self.n_shared_experts) * expert

    def block_forward_flops_per_token(self, moe: bool | None = None) -> int:
        """Matmul FLOPs of one block's forward pass, per token (`moe` as in block_params)."""
        linears = self.attention_linear_flops_per_token() + self.mlp_forward_flops_per_token(moe)
        return linears + self.attention_core_flops_per_token()

    def blocks_forward_flops_per_token(self) -> int:
        linears = sum(count * (self.attention_linear_flops_per_token() + self.mlp_forward_flops_per_token(moe))
                      for moe, count in self._layer_kinds())
        return linears + self.blocks_core_flops_per_token()

    def head_forward_flops_per_token(self) -> int:
        """The LM head's matmul (tied or not, it is one d x V product)."""
        return 2 * self.d_model * self.vocab_size

    def mtp_forward_flops_per_token(self) -> int:
        """The multi-token prediction modules' matmuls, forward, per token: each its 2d -> d projection, its block
        and the shared head once more (every position runs them; the last k's losses are masked)."""
        block = self.block_forward_flops_per_token(self.mtp_is_moe)
        return self.mtp_depth * (2 * 2 * self.d_model**2 + block + self.head_forward_flops_per_token())

    def forward_flops_per_token(self) -> int:
        return self.blocks_forward_flops_per_token() + self.head_forward_flops_per_token() \
            + self.mtp_forward_flops_per_token()

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
            flops += self.blocks_forward_flops_per_token()
        elif recompute == "selective":
            flops += self.blocks_core_flops_per_token()
        elif recompute == OP_RECOMPUTE:
            self.check_op_recompute()
            flops += self.n_layers * self.op_recomputed_flops_per_token()
        if attention == "flash":  # the scores q @ k^T again: 2 s x (query and key head width) per head
            keys = self.attended_by_blocks + self.mtp_depth * self.attended
            flops += 2 * keys * self.n_heads * self.qk_head_dim
        return flops


def check_attention(attention: str) -> None:
    if attention not in ATTENTION_KINDS:
        raise ConfigError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {attention!r}")
