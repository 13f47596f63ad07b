"""MiniMax-M2's transformers layout (MiniMaxM2ForCausalLM, model_type "minimax_m2"), both ways: Llama's block with q and
k each RMS-normalised over all their heads at once (q_norm, k_norm: ours qk_norm_whole, pre norms kept), the first
rotary_dim (partial_rotary_factor) columns of each head turned (ours the last: minigpt/hf/rope.py moves the rows and
the norms' gains), and every block a mixture of SwiGLU experts in Mixtral's names (block_sparse_moe: w1, w3, w2, one
tensor per expert and projection; intermediate_size the experts' width) chosen by sigmoid scores with a bias
(block_sparse_moe.e_score_correction_bias: ours expert_bias, read frozen), the chosen scores renormalised, no shared
experts or groups. Its checkpoints' multi-token prediction modules (use_mtp) are left out as transformers leaves them;
router_aux_loss_coef is not read (transformers' loss for it is Mixtral's softmax one, not a sigmoid router's:
--aux-loss-coef sets minigpt's). Torch-free."""

from __future__ import annotations

from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from minigpt.hf.moe import config_number, refuse_unless
from minigpt.hf.rope import partial_rope_fields, partial_rotary_factor

ARCHITECTURE = "MiniMaxM2ForCausalLM"
BIAS_AT = "block_sparse_moe."  # where its checkpoints keep the choice bias (minigpt/hf/deepseek.py's router_extras)


def is_minimax(config: GPTConfig) -> bool:
    """Whether `config` is a mixture of experts with q/k norms over all heads (then only this layout holds it)."""
    return config.is_moe and config.qk_norm_whole


def check_minimax(config: GPTConfig) -> None:
    """ConfigError unless MiniMax-M2's layout holds `config` exactly."""
    llama = (config.norm, config.mlp, config.positions) == ("rmsnorm", "swiglu", "rope")
    routing = (config.router == "sigmoid" and not config.n_shared_experts and not config.dense_layers
               and config.routed_scale == 1.0 and not config.group_limited
               and not config.router_bias and config.renormalize_gates)
    if not (llama and routing and config.pre_norms) or config.bias or config.qkv_bias or config.post_norms \
            or config.attention_sinks or config.mtp_depth:
        raise ConfigError("a mixture of experts with q/k norms over all heads is written in transformers' MiniMax-M2 "
                          "layout, which holds a bias-free pre-norm rmsnorm + swiglu + rope block, every block's "
                          "experts chosen by sigmoid scores, renormalised (no shared experts, groups, scaled gates or "
                          "multi-token prediction): this shape is not one")


def minimax_hf_config(config: GPTConfig, llama: dict) -> dict:
    """config.json of the MiniMax-M2 model holding `config` (`llama`: the fields the Llama-style layouts write)."""
    return {"architectures": [ARCHITECTURE], "model_type": "minimax_m2", **llama,
            **partial_rope_fields(config, llama["rope_parameters"]),
            "intermediate_size": config.expert_width, "num_local_experts": config.n_experts,
            "num_experts_per_tok": config.top_k, "rotary_dim": config.rotary_dim, "use_qk_norm": True,
            "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True,
            "router_aux_loss_coef": config.aux_loss_coef, "router_jitter_noise": 0.0, "pad_token_id": None}


def minimax_config(hf: dict, dense: GPTConfig) -> GPTConfig:
    """The GPTConfig of a MiniMax-M2 config.json (`dense`: its Llama-style fields as read, the experts' width its
    intermediate_size); ConfigError naming what minigpt would compute differently."""
    refuse_unless(hf.get("scoring_func", "sigmoid") == "sigmoid", "its router's scores are not sigmoids")
    refuse_unless(hf.get("qk_norm_type", "per_layer") == "per_layer", "its q/k norms are not over all heads")
    refuse_unless(not hf.get("router_jitter_noise"), "its router adds jitter noise")
    head = dense.head_dim
    turned = hf.get("rotary_dim")
    refuse_unless(turned is None or (isinstance(turned, int) and not isinstance(turned, bool) and 0 < turned <= head),
                  f"its rotary_dim is {turned!r}, not a whole number of a {head}-wide head's columns")
    rotated = turned / head if turned is not None else partial_rotary_factor(hf, 1.0)
    return dense.with_(qk_norm=True, qk_norm_whole=True, rotary_fraction=rotated, router="sigmoid", expert_bias=True,
                       expert_bias_rate=0.0, n_experts=config_number(hf, "num_local_experts"),
                       top_k=config_number(hf, "num_experts_per_tok"), d_expert=None)
