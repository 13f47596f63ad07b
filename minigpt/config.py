"""The model's shape; its arithmetic, which GPTConfig inherits: parameters and FLOPs in minigpt/arithmetic.py,
activation bytes in minigpt/activations.py.

With those two this is the single home of the model's arithmetic. None imports torch: the simulator uses it to
size models it will never build.

Conventions:
- FLOPs count matrix multiplications only (2 FLOPs per multiply-accumulate), the
  usual convention for MFU. LayerNorm, GELU, softmax and the residual adds are
  left out; they are a few percent of the total for any real shape.
- Attention scores are counted for the full s x s square (no causal discount),
  which is what a dense kernel computes; under a sliding window w < s, the s x w band.
- Backward costs twice the forward (gradients of inputs and of weights).
- Recomputation adds what it runs again: "full" one block forward per layer,
  "selective" (Korthikanti et al. 2022) the attention core's two s x s matmuls, "op" (torchtitan's
  selective op policy, simulated only) the key, output and up projections (op_recompute_refusal).
- A FlashAttention-2 backward also recomputes the scores q @ k^T: `attention="flash"`
  counts that matmul; the default counts the model's FLOPs (MFU's convention).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from minigpt.activations import (OP_RECOMPUTE, RECOMPUTE_MODES, SIM_RECOMPUTE_MODES, SINK_COLUMNS,  # noqa: F401
                                 ActivationArithmetic, check_recompute)
from minigpt.arithmetic import (ATTENTION_KINDS, FlopArithmetic, ParameterArithmetic,  # noqa: F401 (re-exported)
                                check_attention)
from minigpt.shape_checks import (GATED_MLPS, MLP_KINDS, NORM_KINDS, POSITION_KINDS, ROUTER_KINDS,  # noqa: F401
                                  check_shape)



@dataclass(frozen=True)
class GPTConfig(ActivationArithmetic, FlopArithmetic, ParameterArithmetic):
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
    # Llama 3.1's rotary frequencies scaled for a longer context (transformers' rope_type "llama3"):
    # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings); None: unscaled
    rope_scaling: tuple[float, float, float, int] | None = None
    # YaRN's (Peng et al. 2023, arXiv 2309.00071; transformers' rope_type "yarn": DeepSeek-V3, Kimi K2, Qwen3's long
    # context): (factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim), the last
    # two 0 where unset; None: unscaled
    rope_yarn: tuple[float, int, float, float, float, float] | None = None
    # YaRN's correction range rounded out to whole columns (transformers' truncate, its default); False: not
    # rounded (GPT-OSS's)
    rope_yarn_truncate: bool = True
    # LongRoPE's (Ding et al. 2024, arXiv 2402.13753; transformers' rope_type "longrope": Phi-3.5, Phi-4-mini): each
    # rotated frequency divided by a factor of its own, the long ones when the context passes the original, cos and
    # sin times an attention factor: (short_factors, long_factors, original_max_position_embeddings,
    # attention_factor); None: unscaled
    rope_longrope: tuple[tuple[float, ...], tuple[float, ...], int, float] | None = None
    # the share of each query and key head that rotary positions turn, its last columns (Phi-4-mini: 0.75; transformers'
    # partial_rotary_factor turns the first ones: its projections are read and written with the columns moved)
    rotary_fraction: float = 1.0
    # a sliding window (Mistral 7B, Phi-3-mini; transformers' sliding_window): each query attends to itself and the
    # window - 1 tokens before it; 0: to the whole causal context
    window: int = 0
    # with a window: every this-many-th block (blocks k - 1, 2k - 1, ...) attends to the whole context, the others
    # through the window (Gemma 3: 6, GPT-OSS: 2; transformers' layer_types); 0: every block through the window
    full_attention_every: int = 0
    # every this-many-th block (blocks k - 1, 2k - 1, ...) attends without rotary positions (SmolLM3: 4, transformers'
    # no_rope_layers), the others rotate; 0: every block rotates
    nope_every: int = 0
    # Gemma 2 and 3's block and embedding (transformers' Gemma3ForCausalLM): a norm after the attention and after the
    # MLP too, each on its branch before the residual add (post_attention_layernorm, post_feedforward_layernorm)
    post_norms: bool = False
    embed_scale: bool = False  # the token embeddings times sqrt(d_model) (Gemma's normalizer)
    query_scale: float | None = None  # softmax scale query_scale ** -0.5 (query_pre_attn_scalar); None: head width's
    rope_local_theta: float | None = None  # the windowed blocks' rotary base, unscaled (Gemma 3's local 10,000)
    rope_linear: float = 1.0  # the other blocks' positions divided by this (transformers' rope_type "linear")
    bias: bool = True  # biases in every Linear
    qkv_bias: bool = False  # biases in the query, key and value projections even when `bias` is off (Qwen2)
    d_head: int | None = None  # each head's width (None: d_model / n_heads); Qwen3 sets it apart from the width
    qk_norm: bool = False  # an RMSNorm over each query and key head before the rotation (Qwen3)
    # with qk_norm: q and k each normalised over all their heads at once, a gain per column (OLMo 2's, OLMoE's)
    qk_norm_whole: bool = False
    # a norm before the attention and before the MLP (ln1, ln2); without them (OLMo 2's "reordered norm") the
    # block normalises each branch's output alone (post_norms)
    pre_norms: bool = True
    # GPT-OSS's attention sinks: a learned logit per query head beside each query's scores in the softmax, a key whose
    # value is zero (its weight taken from the others: a head may attend to nothing)
    attention_sinks: bool = False
    # Gemma 2's soft caps (attn_logit_softcapping, final_logit_softcapping): each attention score s, and each output
    # logit, becomes cap * tanh(s / cap); 0: none
    attention_softcap: float = 0.0
    logit_softcap: float = 0.0
    # Granite's scalings (its muP multipliers): the token embeddings times embed_multiplier, each branch times
    # residual_multiplier before its residual add, the softmax scale attention_multiplier itself (None: the head
    # width's, or query_scale's), the output logits divided by logit_divisor (logits_scaling)
    embed_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logit_divisor: float = 1.0
    # Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, 2.1) when kv_lora_rank > 0: keys and values from a
    # kv_lora_rank latent, queries from a q_lora_rank one (0: from the width), each query and key head d_head wide
    # plus rope_head_dim rotated columns (the key's shared by the heads), each value head d_value (None: d_head).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    rope_head_dim: int = 0
    d_value: int | None = None
    norm_eps: float = 1e-5  # every norm's epsilon (nn.LayerNorm's default, Llama's; Qwen's checkpoints: 1e-6)
    # Mixture of experts (minigpt/moe.py); n_experts 0 is a dense model and the fields below are ignored.
    n_experts: int = 0  # routed experts per MoE layer
    top_k: int = 2  # experts each token is routed to
    d_expert: int | None = None  # each expert's MLP width (None: d_ff); SwiGLU experts have two of these inputs
    n_shared_experts: int = 0  # experts every token goes through, of width d_expert each (DeepSeek)
    dense_layers: int = 0  # the first blocks keep the dense MLP of width d_ff (DeepSeek-V3: 3)
    # after them, every moe_every-th block a mixture (blocks N - 1, 2N - 1, ...), the others dense MLPs of width d_ff
    # (Megatron's --moe-layer-freq, transformers' decoder_sparse_step; GShard's and Switch's 2)
    moe_every: int = 1
    shared_expert_gate: bool = False  # the shared experts' output times sigmoid(x . w), w learned (Qwen2-MoE's)
    router: str = "softmax"  # softmax then top-k; "sigmoid": sigmoid scores, top-k, renormalised (DeepSeek-V3)
    router_bias: bool = False  # a bias on the router's logits, which choose and weigh (GPT-OSS's)
    # the chosen gates renormalised to sum to 1 when top_k > 1 or the router is a sigmoid (Mixtral, Qwen3-MoE,
    # DeepSeek-V3); False: the chosen scores as they are (OLMoE, Qwen1.5/2-MoE, DeepSeek-V2: norm_topk_prob false)
    renormalize_gates: bool = True
    capacity_factor: float | None = None  # None: dropless; else each expert takes ceil(cf x tokens x k / E) per sequence
    aux_loss_coef: float = 0.0  # load balancing (Switch / GShard), per sequence: E x sum_e f_e P_e
    z_loss_coef: float = 0.0  # router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2
    # DeepSeek-V3's routing (arXiv 2412.19437, 2.1.2): a token's top_k from its groups_per_token best of expert_groups
    # groups (each scored by its group_score_top best experts; None: all), the chosen gates multiplied by routed_scale
    expert_groups: int = 1
    groups_per_token: int | None = None
    group_score_top: int = 2  # each group scored by the sum of its this-many best scores (DeepSeek-V2's: 1, the best)
    routed_scale: float = 1.0
    # DeepSeek-V3's auxiliary-loss-free balancing (2.1.2; Wang et al. arXiv 2408.15664): a per-expert bias added to the
    # scores to choose experts only, moved by expert_bias_rate x sign(mean load - load) after every step (0: frozen)
    expert_bias: bool = False
    expert_bias_rate: float = 0.0
    # DeepSeek-V3's multi-token prediction (arXiv 2412.19437, 2.2): mtp_depth modules after the last block, module k
    # predicting token i + k + 1 from depth k - 1's hidden state and token i + k's embedding through a block of the
    # model's last kind and the shared head; their mean loss weighted by mtp_weight (lambda) joins the next token's
    mtp_depth: int = 0
    mtp_weight: float = 0.1

    def __post_init__(self) -> None:
        check_shape(self)

    def linear_bias(self, name: str) -> bool:
        """Whether the Linear `name` (attn.qkv, attn.proj, mlp.fc1, ...) has a bias: every one with `bias`, the
        fused query, key and value projection also with `qkv_bias`."""
        return self.bias or (self.qkv_bias and name.endswith("qkv"))

    @property
    def head_dim(self) -> int:
        """Each attention head's width: d_head, or d_model / n_heads."""
        return self.d_model // self.n_heads if self.d_head is None else self.d_head

    @property
    def is_mla(self) -> bool:  # multi-head latent attention
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:  # each query and key head's width (under MLA its rotated columns after head_dim)
        return self.head_dim + self.rope_head_dim

    @property
    def v_head_dim(self) -> int:  # each value head's width: d_value, or head_dim
        return self.head_dim if self.d_value is None else self.d_value

    @property
    def rotary_dim(self) -> int:  # the columns of a query or key head rotary positions turn: its last ones (MLA's)
        if self.positions != "rope":
            return 0
        return self.rope_head_dim if self.is_mla else round(self.head_dim * self.rotary_fraction)

    @property
    def longrope_factors(self) -> tuple[float, ...] | None:
        """LongRoPE's factors in use: the long ones when the training context passes the original (transformers picks
        them by the longest position of a batch, which a full sequence reaches), else the short ones."""
        if self.rope_longrope is None:
            return None
        short, long, original, _ = self.rope_longrope
        return long if self.seq_len > original else short

    @property
    def rope_attention_factor(self) -> float:
        """What YaRN multiplies the rotation's cos and sin by (1 without it): transformers' attention_factor, mscale's
        over mscale_all_dim's where both are set, else 0.1 ln(factor) + 1; LongRoPE's attention factor."""
        if self.rope_longrope is not None:
            return self.rope_longrope[3]
        if self.rope_yarn is None:
            return 1.0
        factor, _, _, _, mscale, mscale_all_dim = self.rope_yarn
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim \
            else yarn_mscale(factor)

    @property
    def softmax_scale(self) -> float:
        """The attention's scale of q @ k^T: 1 / sqrt(query head width), under MLA with YaRN times mscale_all_dim's
        mscale squared (DeepSeek's reference code and transformers' yarn_apply_mscale)."""
        if self.attention_multiplier is not None:  # Granite's, the scale itself
            return self.attention_multiplier
        if self.query_scale is not None:  # Gemma's query_pre_attn_scalar
            return self.query_scale ** -0.5
        scale = self.qk_head_dim ** -0.5
        if self.is_mla and self.rope_yarn is not None and self.rope_yarn[5]:
            scale *= yarn_mscale(self.rope_yarn[0], self.rope_yarn[5]) ** 2
        return scale

    @property
    def attention_width(self) -> int:
        """The value heads side by side (n_heads x v_head_dim): the attention's output, proj's input."""
        return self.n_heads * self.v_head_dim

    @property
    def padded_values_width(self) -> int:
        """Per token, the attention's zero-padded v and padded output (n_heads x qk_head_dim each) when value heads
        are narrower than query heads (minigpt/model.py's AttentionCore: SDPA's kernels take one head width)."""
        return 2 * self.n_heads * self.qk_head_dim if self.v_head_dim != self.qk_head_dim else 0

    @property
    def sink_padding_width(self) -> int:
        """Per token, what attention sinks add to the core's saved tensors (minigpt/attention.py): q, k and v each
        SINK_COLUMNS wider, and the kernel's padded output beside the cut copy the projection reads; the sink's own
        key and value row (one per sequence) and the mask (one per micro-batch) aside."""
        if not self.attention_sinks:
            return 0
        return (self.n_heads + 2 * self.kv_heads) * SINK_COLUMNS + self.n_heads * (self.qk_head_dim + SINK_COLUMNS)

    @property
    def latent_width(self) -> int:  # MLA's down projection's output: query latent, key/value latent, rotated key
        return self.q_lora_rank + self.kv_lora_rank + self.rope_head_dim

    @property
    def latent_norms(self) -> int:  # MLA's RMSNorms over its latents: the query latent's (if any), the key/value's
        return (2 if self.q_lora_rank else 1) if self.is_mla else 0

    @property
    def q_up_in_width(self) -> int:  # MLA's query up projection's input: the query latent, or the width
        return self.q_lora_rank or self.d_model

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads when it is not set."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def qkv_width(self) -> int:
        """The attention core's input, q, k and v side by side: all query heads, then the key and value heads (the
        fused q, k, v projection's output; under MLA the heads the up projections make, the shared key repeated)."""
        return (self.n_heads + self.kv_heads) * self.qk_head_dim + self.kv_heads * self.v_head_dim

    @property
    def mlp_in_width(self) -> int:
        """Output features of the MLP's first Linear: d_ff, or 2 d_ff for SwiGLU (gate and up, fused)."""
        return 2 * self.d_ff if self.gated_mlp else self.d_ff

    @property
    def gated_mlp(self) -> bool:
        """The MLP is gated (SwiGLU, GeGLU, or GPT-OSS's clamped SwiGLU): its first Linear makes a gate and an up
        half."""
        return self.mlp in GATED_MLPS

    @property
    def norm_params(self) -> int:
        """A LayerNorm has a gain and a bias per feature, an RMSNorm only the gain."""
        return (2 if self.norm == "layernorm" else 1) * self.d_model

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_width(self) -> int:
        """Each expert's hidden width: d_expert, or d_ff when it is not set."""
        return self.d_ff if self.d_expert is None else self.d_expert

    @property
    def expert_in_width(self) -> int:
        """Output features of an expert's first Linear: its width, or twice it for SwiGLU (gate and up)."""
        return 2 * self.expert_width if self.gated_mlp else self.expert_width

    @property
    def group_limited(self) -> bool:
        """Whether a token's experts come from some of the expert groups only (groups_per_token of expert_groups)."""
        return self.groups_per_token not in (None, self.expert_groups)

    @property
    def gates_renormalised(self) -> bool:
        """Whether the chosen scores are divided by their sum: with renormalize_gates, when top_k > 1 or the router
        is a sigmoid (a top-1 softmax keeps its probability, Switch's)."""
        return self.renormalize_gates and (self.top_k > 1 or self.router == "sigmoid")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` (0-based) has a mixture-of-experts MLP: a MoE model's after `dense_layers`, every
        `moe_every`-th of them (counted from block 0, as transformers' decoder_sparse_step)."""
        return self.is_moe and layer >= self.dense_layers and (layer + 1) % self.moe_every == 0

    @property
    def mtp_is_moe(self) -> bool:
        """Whether the multi-token prediction modules' blocks have a mixture of experts: each is block n_layers + k
        of the model's kind (minigpt/model.py's MultiTokenPrediction), the model's last kind."""
        return self.is_moe_layer(self.n_layers)

    def layer_window(self, layer: int) -> int:
        """The sliding window block `layer` (0-based) attends through (0: the whole context): the model's window in
        use, except every full_attention_every-th block."""
        return 0 if _every_nth(layer, self.full_attention_every) else self.window_in_use

    @property
    def full_attention_layers(self) -> int:
        """Blocks that attend to the whole context: every one without a window in use, else every
        full_attention_every-th."""
        if not self.window_in_use:
            return self.n_layers
        return self.n_layers // self.full_attention_every if self.full_attention_every else 0

    def layer_rotates(self, layer: int) -> bool:
        """Whether block `layer` (0-based) turns its queries and keys by rotary positions: every one of a rotary
        model, except every nope_every-th."""
        return self.positions == "rope" and not _every_nth(layer, self.nope_every)

    def layer_local(self, layer: int) -> bool:
        """Whether block `layer` rotates by rope_local_theta (Gemma 3's sliding blocks: those the window pattern puts
        through the window, whether or not it is shorter than the context)."""
        return self.rope_local_theta is not None and bool(self.window) and not _every_nth(layer,
                                                                                         self.full_attention_every)

    def layer_kind(self, layer: int) -> tuple[int, bool]:
        """(sliding window, rotates) of block `layer`: what a block of a per-layer pattern is priced by."""
        return self.layer_window(layer), self.layer_rotates(layer)

    def uniform(self, window: int, rotates: bool = True) -> "GPTConfig":
        """This model with every block attending as one of its blocks does, through `window` (0: the whole context)
        and with or without rotary positions: how a block of a per-layer pattern is priced on its own."""
        unrotated = not rotates and self.positions == "rope"  # (a learned-positions model rotates nowhere)
        if not self.full_attention_every and window == self.window_in_use and not self.nope_every and not unrotated:
            return self
        return self.with_(window=window, full_attention_every=0, nope_every=1 if unrotated else 0,
                          rope_local_theta=self.rope_local_theta if window else None)  # a base: no cost of its own

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(layer) for layer in range(self.n_layers))

    def _layer_kinds(self) -> tuple[tuple[bool, int], ...]:
        """(is MoE, how many blocks) for the model's dense and MoE blocks."""
        return (False, self.n_layers - self.n_moe_layers), (True, self.n_moe_layers)

    def describe(self) -> str:
        """'4 layers, width 128, 4 heads (2 kv), SwiGLU 352, RMSNorm, RoPE, untied, no bias, seq 128'."""
        heads = f"{self.n_heads} heads" + (f" ({self.kv_heads} kv)" if self.kv_heads != self.n_heads else "")
        heads += f" of {self.head_dim}" if self.d_head is not None else ""
        heads += "" if not self.qk_norm else ", QK-norm over all heads" if self.qk_norm_whole else ", QK-norm"
        heads += ", sinks" if self.attention_sinks else ""
        heads += f", scores capped at {self.attention_softcap:g}" if self.attention_softcap else ""
        heads += f", scale {self.attention_multiplier:g}" if self.attention_multiplier is not None else ""
        heads += f", scale {self.query_scale:g}^-0.5" if self.query_scale is not None else ""
        if self.is_mla:
            query = f"q latent {self.q_lora_rank}, " if self.q_lora_rank else ""
            heads = (f"{self.n_heads} heads, latent attention ({query}kv latent {self.kv_lora_rank}, q/k "
                     f"{self.head_dim}+{self.rope_head_dim} rotated, v {self.v_head_dim})")
        kind = {"swiglu": "SwiGLU", "relu2": "squared-ReLU", "clamped-swiglu": "clamped SwiGLU",
                "geglu": "GeGLU"}.get(self.mlp, "GELU")
        mlp = f"{kind} {self.d_ff}"
        if self.is_moe:
            shared = f" + {self.n_shared_experts} shared" if self.n_shared_experts else ""
            dense = f", the first {self.dense_layers} dense ({kind} {self.d_ff})" if self.dense_layers else ""
            dense += f", in 1 block of {self.moe_every}" if self.moe_every > 1 else ""
            grouped = f" of {self.groups_per_token} of {self.expert_groups} groups" if self.group_limited else ""
            if grouped and self.group_score_top != 2:
                grouped += f" (scored by their best{'' if self.group_score_top == 1 else f' {self.group_score_top}'})"
            scaled = f", gates x{self.routed_scale:g}" if self.routed_scale != 1.0 else ""
            if self.expert_bias:
                scaled += f", choice bias (rate {self.expert_bias_rate:g})"
            scaled += ", router bias" if self.router_bias else ""
            scaled += ", gates not renormalised" if not self.renormalize_gates else ""
            scaled += ", shared gated" if self.shared_expert_gate else ""
            mlp = f"{self.n_experts} {kind} experts of {self.expert_width}{shared}, top {self.top_k}{grouped}"
            mlp += scaled + dense
        if self.window_in_use:
            heads += f", window {self.window}"
            if self.full_attention_every:
                heads += f" (1 block in {self.full_attention_every} full)"
        if self.nope_every:
            heads += f", no rotation in 1 block in {self.nope_every}"
        parts = [f"{self.n_layers} layers", f"width {self.d_model}", heads, mlp,
                 ("RMSNorm" if self.norm == "rmsnorm" else "LayerNorm") + (
                     "" if not self.post_norms else " (and after each branch)" if self.pre_norms else
                     " after each branch (none before)"),
                 "learned positions" if self.positions != "rope" else self._rope_words(),
                 ("tied head" if self.tied_head else "untied head")
                 + (f", logits capped at {self.logit_softcap:g}" if self.logit_softcap else "")
                 + (f", logits / {self.logit_divisor:g}" if self.logit_divisor != 1 else "")]
        parts[1] += ", embeddings x sqrt(width)" if self.embed_scale else ""
        parts[1] += f", embeddings x {self.embed_multiplier:g}" if self.embed_multiplier != 1 else ""
        parts[1] += f", branches x {self.residual_multiplier:g}" if self.residual_multiplier != 1 else ""
        biases = [] if self.bias else ["q, k, v biases only" if self.qkv_bias else "no bias"]
        ahead = [f"{self.mtp_depth} multi-token prediction module{'s' if self.mtp_depth > 1 else ''} "
                 f"(weight {self.mtp_weight:g})"] if self.mtp_depth else []
        return ", ".join(parts + biases + ahead + [f"seq {self.seq_len}"])

    def _rope_words(self) -> str:
        scaled = (f"YaRN x{self.rope_yarn[0]:g}" if self.rope_yarn else
                  f"scaled x{self.rope_scaling[0]:g}" if self.rope_scaling else
                  f"LongRoPE, {'long' if self.longrope_factors == self.rope_longrope[1] else 'short'} factors"
                  if self.rope_longrope else "")
        scaled = scaled or (f"positions / {self.rope_linear:g}" if self.rope_linear != 1 else "")
        part = f"{self.rotary_dim} of {self.head_dim} columns" if self.rotary_fraction != 1 else ""
        local = f"base {self.rope_local_theta:g} in the windowed blocks" if self.rope_local_theta is not None else ""
        inside = "; ".join(word for word in (scaled, part, local) if word)
        return f"RoPE ({inside})" if inside else "RoPE"

    def with_(self, **changes) -> "GPTConfig":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)


def block_name(layer: int, n_layers: int) -> str:
    """The plain GPT's name of block `layer` with its dot: one of the model's `n_layers`, or past them a multi-token
    prediction module's (minigpt/model.py's MultiTokenPrediction)."""
    return f"mtp.{layer - n_layers}.block." if layer >= n_layers else f"blocks.{layer}."


def _every_nth(layer: int, every: int) -> bool:
    """Whether block `layer` (0-based) is one of every `every`-th (blocks every - 1, 2 every - 1, ...; 0: none): the
    per-layer patterns' rule (full_attention_every, nope_every; transformers' layer_types and no_rope_layers)."""
    return bool(every) and (layer + 1) % every == 0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (its equation 21, as transformers' yarn_get_mscale): 0.1 mscale ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

