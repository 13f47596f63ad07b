"""A model's activation arithmetic: the bytes one block, the MoE MLP and the head keep for the backward, per token,
under each recomputation mode. Part of GPTConfig (minigpt/config.py), which inherits it; like config.py it never
imports torch, so the simulator can size models it will never build. Each method's docstring says what is counted
and minigpt/model.py is what it counts (checked against torch's saved tensors by tests/test_recompute.py)."""

from __future__ import annotations

from minigpt.errors import ConfigError

RECOMPUTE_MODES = ("none", "selective", "full")  # what our trainer runs and every shape allows
# torchtitan's selective op checkpointing (activation_checkpoint.mode "selective", selective_ac_option "op"): the
# simulator describes it (simulator/costs/torchtitan/selective_op.py) for the shapes op_recompute_refusal lets through
OP_RECOMPUTE = "op"
SIM_RECOMPUTE_MODES = (*RECOMPUTE_MODES, OP_RECOMPUTE)
# the columns q, k and v gain for attention sinks (minigpt/attention.py): the sink's logit and zeros, as fused
# kernels take head widths in eights
SINK_COLUMNS = 8


class ActivationArithmetic:
    """GPTConfig's activation bytes (its fields read through self)."""

    @property
    def mlp_saved_widths(self) -> int:
        """What an MLP keeps per token in widths of its hidden layer: fc1's output and fc2's input (GELU, squared
        ReLU: 2), SwiGLU's (GeGLU's) gate and up, its silu(gate) and fc2's input (4), the clamped SwiGLU's fc1 output (it
        saves only that and recomputes the rest: minigpt/moe.py's ClampedSwiGLU) and fc2's input (3)."""
        return {"swiglu": 4, "geglu": 4, "clamped-swiglu": 3}.get(self.mlp, 2)

    def activation_bytes_per_token_per_layer(self, dtype_bytes: int = 4, recompute: str = "none",
                                             moe: bool | None = None) -> int:
        """Bytes one block keeps for its backward pass, per token.

        Counted from what the block saves (see minigpt/model.py), with fused
        attention (no s x s matrix is kept):
          norm inputs 2d, norm outputs feeding qkv and fc1 2d (without pre_norms qkv's and fc1's inputs, the
          residual stream, 2d),
          the fused qkv output (H + 2K) x head_dim (q, k and v are views of it; with RoPE the
          rotated copy replaces it, the same size), attention output H x head_dim (d unless d_head
          sets the heads apart from the width; also the
          output projection's input: the fused kernel already writes it in
          (batch, seq, heads, head_dim) order, so no copy is made),
          with query and key norms (qk_norm) the qkv output as well (their input) and one fp32 1/rms per
          query and key head (two with qk_norm_whole: q's and k's),
          under MLA also its down projection's output (the latent norms' input) and the normed latent (the up
          projections' input), latent_width each, and each latent norm's fp32 1/rms (q's, kv's), the fused
          qkv being the heads the up projections make (the shared rotated key repeated per head), and
          with value heads narrower than query heads the zero-padded v and the padded output (padded_values_width),
          with attention sinks q, k, v and the output padded by SINK_COLUMNS (sink_padding_width),
          GELU input f and output f, or for SwiGLU the fused gate/up output 2f, silu(gate) f
          and the product f,
          plus fp32 statistics: a LayerNorm's mean and 1/std (an RMSNorm's 1/rms only) for
          each of the two pre norms, and the attention log-sum-exp (one per query head),
          plus a 1-byte mask per element of each of the two residual dropouts
          when dropout > 0, and with post_norms (Gemma's) each branch's output, 2d, and the two norms'
          statistics.
        With recompute="full" only the block's input (d elements) is kept; with
        "selective" the attention core (RoPE and the attention itself) keeps nothing of its
        own: the log-sum-exp goes, the qkv output and the core's output stay, saved around it.
        A MoE block (`moe` as in block_params) keeps its MLP's (moe_activation_bytes_per_token) in place of
        the dense MLP's, and moe_activation_bytes_per_sequence more per sequence.
        """
        check_recompute(recompute)
        d, f = self.d_model, self.d_ff
        if recompute == "full":
            return dtype_bytes * d
        if recompute == OP_RECOMPUTE:
            return self.op_activation_bytes_per_token_per_layer(dtype_bytes)
        if self.is_moe if moe is None else moe:
            mlp_bytes = self.moe_activation_bytes_per_token(dtype_bytes)
        else:
            mlp_bytes = dtype_bytes * self.mlp_saved_widths * f
        latent = 2 * self.latent_width if self.is_mla else 0  # MLA's down output and its normed copy
        padded = self.padded_values_width + self.sink_padding_width if recompute != "selective" else 0  # the core's
        norm_inputs = 4 * d if self.pre_norms else 2 * d  # without pre norms qkv and fc1 keep the residual stream
        tensors = dtype_bytes * (norm_inputs + latent + self.qkv_width + self.attention_width + padded) + mlp_bytes
        norm_statistics = 2 * int(self.pre_norms) * (2 if self.norm == "layernorm" else 1) + self.latent_norms
        statistics = 4 * (norm_statistics + (0 if recompute == "selective" else self.n_heads))
        if self.qk_norm and recompute != "selective":  # the norms keep their input (the qkv output) and 1/rms
            tensors += dtype_bytes * self.qkv_width
            statistics += 4 * (2 if self.qk_norm_whole else self.n_heads + self.kv_heads)
        if self.post_norms:  # Gemma's: each branch's output (the post norm's input) and its statistics
            tensors += dtype_bytes * 2 * d
            statistics += 4 * 2 * (2 if self.norm == "layernorm" else 1)
        dropout_masks = 2 * d if self.dropout > 0 else 0
        return tensors + statistics + dropout_masks

    def op_recompute_refusal(self) -> str | None:
        """Why torchtitan's selective op policy (recompute "op") cannot be described for this shape, or None.

        The policy (torchtitan's _apply_ac_to_transformer_block, selective_ac_option "op") keeps the outputs of
        aten.mm and of the flash attention and recomputes everything else, every second mm included; it counts on
        a Llama block of bias-free Linears run as separate projections (q, k, v, o, then w1, w3, w2). A Linear
        with a bias runs as addmm (never kept), a MoE's experts as grouped matmuls, dropout draws again."""
        if self.is_moe:
            return "a mixture of experts (its grouped expert matmuls are not aten.mm)"
        if self.is_mla:
            return "multi-head latent attention (the policy counts on a Llama block's q, k, v and o projections)"
        if self.bias or self.qkv_bias:
            return ("Linears with biases (they run as addmm, which the policy never keeps): use "
                    + ("--no-bias" if self.bias else "--no-qkv-bias"))
        if self.dropout > 0:
            return "dropout (torchtitan's models have none)"
        if self.post_norms or self.mlp == "geglu":
            return "post norms (Gemma's, OLMo 2's) or GeGLU (torchtitan's Llama block has neither)"
        return None

    def check_op_recompute(self) -> None:
        reason = self.op_recompute_refusal()
        if reason is not None:
            raise ConfigError(f"--recompute {OP_RECOMPUTE} (torchtitan's selective op policy) is described for "
                              f"dense Llama-style blocks only, not for {reason}")

    def op_recomputed_flops_per_token(self) -> int:
        """The matmuls torchtitan's op policy runs again per token and block: every second aten.mm of the forward
        (k and o, and SwiGLU's up projection w3; a GELU MLP's fc2 is not needed by the backward, so the
        recompute stops before it: torch.utils.checkpoint's early stop)."""
        d = self.d_model
        flops = 2 * d * self.kv_heads * self.head_dim + 2 * self.attention_width * d
        return flops + (2 * d * self.d_ff if self.mlp == "swiglu" else 0)

    def op_activation_bytes_per_token_per_layer(self, dtype_bytes: int = 4) -> int:
        """What torchtitan's op policy keeps per token and block: the block's input (the checkpoint's), the
        kept mm outputs (q and v; SwiGLU's gate w1 and down w2, or GELU's fc1) and the attention's output and
        fp32 log-sum-exp (one per query head)."""
        self.check_op_recompute()
        d = self.d_model
        mm = (self.n_heads + self.kv_heads) * self.head_dim + (self.d_ff + d if self.mlp == "swiglu" else self.d_ff)
        return dtype_bytes * (d + mm + self.attention_width) + 4 * self.n_heads

    def moe_activation_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """What a MoE MLP (minigpt/moe.py) keeps per token, dropless (every one of the top_k choices routed).

        Per routed copy (top_k per token): its input row d and output row d, the expert's hidden tensors as a
        dense MLP's (GELU 2 x width, SwiGLU 4 x width), its gate (in the compute format) and three int64 indices
        (its expert, its token, its place in the sorted order). Per token, in fp32: the router scores (E), and
        when the gates are renormalised the chosen scores (top_k) and their sum; a sigmoid router's balance
        loss its sum of scores; the z-loss the logits (E) and their log-sum-exp. The shared experts keep what
        a dense MLP of their width keeps, and with a gate their output and the gate (Qwen2-MoE's). The norm output
        feeding the router is the block's (its 4d)."""
        b, e, k, experts = dtype_bytes, self.expert_width, self.top_k, self.n_experts
        hidden = self.mlp_saved_widths * e
        routed = k * (b * (2 * self.d_model + hidden + 1) + 3 * 8)
        scores = 4 * experts
        if self.gates_renormalised:
            scores += 4 * (k + 1)
        if self.aux_loss_coef and self.router == "sigmoid":
            scores += 4
        if self.z_loss_coef:
            scores += 4 * (experts + 1)
        shared = self.n_shared_experts * b * hidden
        if self.shared_expert_gate:  # their output and its gate, sigmoid(x . w), for the product's backward
            shared += b * (self.d_model + 1)
        return routed + scores + shared

    def moe_activation_bytes_per_sequence(self) -> int:
        """Per sequence and MoE layer: the balance loss's fp32 share of choices per expert (E)."""
        return 4 * self.n_experts if self.is_moe and self.aux_loss_coef else 0

    def head_activation_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Final norm input and output (2d) and its fp32 statistics (mean and 1/std, or 1/rms), and the
        fp32 log-probabilities (V) kept by the loss; with Gemma 2's cap on the logits, its tanh's output (V)."""
        statistics = 2 if self.norm == "layernorm" else 1
        capped = dtype_bytes * self.vocab_size if self.logit_softcap else 0
        return dtype_bytes * 2 * self.d_model + 4 * (statistics + self.vocab_size) + capped


def check_recompute(recompute: str) -> None:
    if recompute not in SIM_RECOMPUTE_MODES:
        raise ConfigError(f"recompute must be one of {', '.join(SIM_RECOMPUTE_MODES)}, got {recompute!r}")
