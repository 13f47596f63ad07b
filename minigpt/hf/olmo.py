"""OLMo 2's transformers layout (Olmo2ForCausalLM, model_type "olmo2"), both ways: Llama's attention and MLP with no
norm before either branch and an RMSNorm after each branch's output (post_attention_layernorm,
post_feedforward_layernorm: ours post_attn_norm, post_mlp_norm, pre_norms off), and q and k each RMS-normalised over
all their heads at once before the rotation (q_norm, k_norm, a gain per column: ours qk_norm_whole), no biases
(transformers' attention_bias puts one on the output projection too, which minigpt's q/k/v biases do not: refused).
Torch-free."""

from __future__ import annotations

from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from minigpt.hf.moe import refuse_unless

ARCHITECTURE = "Olmo2ForCausalLM"
OLMO2 = {"qk_norm": True, "qk_norm_whole": True, "pre_norms": False, "post_norms": True}  # its block's fields


def is_olmo(config: GPTConfig) -> bool:
    """Whether `config` has one of OLMo 2's pieces (then only its layout holds it)."""
    return config.qk_norm_whole or not config.pre_norms


def check_olmo(config: GPTConfig) -> None:
    """ConfigError unless OLMo 2's layout holds `config`: its block whole, Llama's otherwise, dense."""
    llama = (config.norm, config.mlp, config.positions) == ("rmsnorm", "swiglu", "rope")
    if not llama or any(getattr(config, name) != value for name, value in OLMO2.items()) or config.bias \
            or config.qkv_bias or config.is_moe or config.is_mla or config.attention_sinks or config.embed_scale \
            or config.query_scale is not None or config.rope_local_theta is not None or config.rope_linear != 1 \
            or config.mtp_depth:
        raise ConfigError("q/k norms over all heads or blocks without pre norms are written in transformers' OLMo 2 "
                          "layout, which holds both, with a norm after each branch, in a bias-free dense rmsnorm + "
                          "swiglu + rope model: this shape is not one")


def olmo_hf_config(config: GPTConfig, llama: dict) -> dict:
    """config.json of the OLMo 2 model holding `config` (`llama`: the fields the Llama-style layouts write)."""
    return {"architectures": [ARCHITECTURE], "model_type": "olmo2", **llama, "attention_bias": False,
            "pad_token_id": None}


def olmo_config(hf: dict, dense: GPTConfig) -> GPTConfig:
    """The GPTConfig of an OLMo 2 config.json (`dense`: its Llama-style fields, read bias-free)."""
    refuse_unless(hf.get("attention_bias", False) is False, "its attention has biases, the output projection's too")
    return dense.with_(**OLMO2)


def olmo_names(ours: str, theirs: str) -> dict[str, tuple[str, ...]]:
    """A block's post norms (its only norms beside q's and k's)."""
    return {f"{ours}post_attn_norm.weight": (f"{theirs}post_attention_layernorm.weight",),
            f"{ours}post_mlp_norm.weight": (f"{theirs}post_feedforward_layernorm.weight",)}
