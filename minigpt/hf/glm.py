"""GLM-4.5's transformers layout (Glm4MoeForCausalLM, model_type "glm4_moe": GLM-4.5, GLM-4.5-Air, GLM-4.6), both ways:
grouped-query attention with DeepSeek's experts.

Attention: Llama's (q_proj, k_proj, v_proj, o_proj; any number of key/value heads, any head width), biases on q, k
and v alone when attention_bias (ours: --qkv-bias), an RMSNorm over each query and key head when use_qk_norm (q_norm,
k_norm; ours: --qk-norm), the first partial_rotary_factor of each head turned (0.5 where the config does not say;
ours the last: minigpt/hf/rope.py moves the rows, and the head norms' gains with them), no sliding window.
Experts: DeepSeek-V3's (minigpt/hf/deepseek.py, the same names): a sigmoid router choosing with its bias
(e_score_correction_bias), the chosen gates renormalised where norm_topk_prob and scaled (routed_scaling_factor),
group-limited choice (n_group, topk_group), shared experts of width n_shared_experts x moe_intermediate_size, the
first first_k_dense_replace blocks dense (width intermediate_size), one tensor per expert and projection in the
checkpoints; its multi-token prediction layers (num_nextn_predict_layers) as DeepSeek-V3's, layer n_layers + k (which
transformers leaves out when it loads). Torch-free.
"""

from __future__ import annotations

from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from minigpt.hf.deepseek import experts_fields, experts_hf_fields
from minigpt.hf.moe import refuse_unless
from minigpt.hf.rope import partial_rope_fields, partial_rotary_factor

ARCHITECTURE = "Glm4MoeForCausalLM"
DEFAULT_ROTATION = 0.5  # transformers' Glm4MoeConfig: the share of each head turned where config.json does not say


def check_glm(config: GPTConfig) -> None:
    """ConfigError unless GLM-4.5's layout holds `config` (a mixture of experts with a sigmoid router and attention
    that is not latent)."""
    block = (config.norm, config.mlp, config.positions) == ("rmsnorm", "swiglu", "rope")
    if not block or config.bias:
        raise ConfigError("a sigmoid router over grouped-query attention is written in transformers' GLM-4.5 layout, "
                          "which holds a bias-free rmsnorm + swiglu + rope block (q, k and v biases aside)")


def glm_hf_config(config: GPTConfig, llama: dict) -> dict:
    """config.json of the GLM-4.5 model holding `config` (`llama`: the fields the Llama-style layouts write)."""
    return {"architectures": [ARCHITECTURE], "model_type": "glm4_moe", **llama, "attention_bias": config.qkv_bias,
            "use_qk_norm": config.qk_norm, **partial_rope_fields(config, llama["rope_parameters"]),
            **experts_hf_fields(config)}


def glm_config(hf: dict, dense: GPTConfig) -> GPTConfig:
    """The GPTConfig of a GLM-4.5 config.json (`dense`: its Llama-style fields as read bias-free, every head turned
    whole); ConfigError naming what minigpt would compute differently."""
    biases, norms = hf.get("attention_bias", False), hf.get("use_qk_norm", False)
    refuse_unless(isinstance(biases, bool) and isinstance(norms, bool),
                  f"its attention_bias / use_qk_norm are {biases!r} / {norms!r}, not true or false")
    refuse_unless(not hf.get("use_sliding_window") and not hf.get("sliding_window"),
                  "it attends through a sliding window, which GLM-4.5's layout has not")
    return dense.with_(qkv_bias=biases, qk_norm=norms, rotary_fraction=partial_rotary_factor(hf, DEFAULT_ROTATION),
                       **experts_fields(hf, dense.n_layers))
