"""The model's parameters and matmul FLOPs per token: part of GPTConfig (minigpt/config.py), which inherits both (their
fields read through self); torch-free, as config.py. The conventions are config.py's docstring's."""

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
        gate = 2 * d if self.shared_expert_gate else 0  # Qwen2-MoE's shared experts' gate, d -> 1
        return 2 * d * self.n_experts + (self.top_k + self.n_shared_experts) * expert + gate

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


class ParameterArithmetic:
    """GPTConfig's parameter counts."""

    def attention_params(self) -> int:
        """The fused qkv projection and the output projection, weights and biases (and the query and key norms'
        gains: one head's width each, shared by the heads, or every column's with qk_norm_whole); under MLA its
        projections and latent norms."""
        d, width = self.d_model, self.attention_width
        if self.is_mla:
            return self.mla_projection_params() + self.q_lora_rank + self.kv_lora_rank + width * d
        qkv_bias, proj_bias = int(self.linear_bias("attn.qkv")), int(self.linear_bias("attn.proj"))
        qk_norms = 0 if not self.qk_norm else (self.n_heads + self.kv_heads) * self.head_dim if self.qk_norm_whole \
            else 2 * self.head_dim
        sinks = self.n_heads if self.attention_sinks else 0
        return (d * self.qkv_width + qkv_bias * self.qkv_width) + (width * d + proj_bias * d) + qk_norms + sinks

    def mla_projection_params(self) -> int:
        """MLA's down projection (d -> latent_width) and its query and key/value up projections (no biases)."""
        up = self.q_up_in_width * self.n_heads * self.qk_head_dim
        up += self.kv_lora_rank * self.n_heads * (self.head_dim + self.v_head_dim)
        return self.d_model * self.latent_width + up

    def dense_mlp_params(self) -> int:
        d, f, bias = self.d_model, self.d_ff, int(self.bias)
        return (d * self.mlp_in_width + bias * self.mlp_in_width) + (f * d + bias * d)

    def expert_params(self) -> int:
        """One expert: an MLP of width expert_width (its biases when the model has them)."""
        d, e, bias = self.d_model, self.expert_width, int(self.bias)
        return (d * self.expert_in_width + bias * self.expert_in_width) + (e * d + bias * d)

    def router_params(self) -> int:
        """The router's d x E projection (and its bias, router_bias)."""
        return (self.d_model + int(self.router_bias)) * self.n_experts

    def shared_expert_params(self) -> int:
        """The shared experts, one MLP of width n_shared_experts x expert_width (DeepSeek's), so one output bias, and
        its gate's d weights (Qwen2-MoE's shared_expert_gate)."""
        d, shared, bias = self.d_model, self.n_shared_experts, int(self.bias)
        if shared == 0:
            return 0
        mlp = shared * (d * self.expert_in_width + bias * self.expert_in_width + self.expert_width * d) + bias * d
        return mlp + (d if self.shared_expert_gate else 0)

    def moe_mlp_params(self, active: bool = False) -> int:
        """A MoE MLP: router, routed experts (only the top_k a token uses when `active`) and shared experts."""
        routed = self.top_k if active else self.n_experts
        return self.router_params() + routed * self.expert_params() + self.shared_expert_params()

    def block_params(self, moe: bool | None = None, active: bool = False) -> int:
        """Parameters of one transformer block (weights and biases): a MoE block when `moe` (None: the kind most
        of the model's blocks are, MoE for a MoE model); `active`: only those one token uses."""
        moe = self.is_moe if moe is None else moe
        mlp = self.moe_mlp_params(active) if moe else self.dense_mlp_params()
        norms = 2 * int(self.pre_norms) + 2 * int(self.post_norms)
        return norms * self.norm_params + self.attention_params() + mlp

    def blocks_params(self, active: bool = False) -> int:
        """Parameters of all the blocks (dense and MoE)."""
        return sum(count * self.block_params(moe, active) for moe, count in self._layer_kinds())

    def embedding_params(self) -> int:
        """Token embeddings, and position embeddings when they are learned (RoPE has none)."""
        positions = self.seq_len if self.positions == "learned" else 0
        return (self.vocab_size + positions) * self.d_model

    def head_params(self) -> int:
        """Final norm plus the LM head's own weight (zero extra when tied)."""
        head = 0 if self.tied_head else self.vocab_size * self.d_model
        return self.norm_params + head

    def mtp_params(self, active: bool = False) -> int:
        """The multi-token prediction modules': each an embedding norm, a hidden-state norm, the 2d -> d projection,
        a block of the model's last kind and a final norm (the embedding and the head are the model's)."""
        block = self.block_params(self.mtp_is_moe, active)
        return self.mtp_depth * (3 * self.norm_params + 2 * self.d_model**2 + block)

    def n_params(self) -> int:
        """Total trainable parameters, each counted once (a tied head is not counted twice), the multi-token
        prediction modules' included (DeepSeek-V3's published 671B leaves its 14B out: `main_params`)."""
        return self.main_params() + self.mtp_params()

    def main_params(self) -> int:
        """The parameters without the multi-token prediction modules: what inference keeps."""
        return self.embedding_params() + self.blocks_params() + self.head_params()

    def active_params(self) -> int:
        """Parameters one token goes through: every one of a dense model; of a MoE model's experts only its
        top_k routed ones and the shared ones (the embedding and head counted whole, as published counts do),
        without the multi-token prediction modules, as published counts give them."""
        return self.embedding_params() + self.blocks_params(active=True) + self.head_params()

    def param_breakdown(self) -> dict:
        breakdown = {
            "embedding": self.embedding_params(),
            "per_block": self.block_params(),
            "blocks": self.blocks_params(),
            "head": self.head_params(),
            "total": self.n_params(),
        }
        if self.mtp_depth:
            breakdown["mtp"] = self.mtp_params()
        if self.is_moe:
            breakdown.update(per_expert=self.expert_params(), active=self.active_params())
        return breakdown
