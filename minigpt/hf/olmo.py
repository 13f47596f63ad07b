"""OLMo 2's transformers layout (Olmo2ForCausalLM, model_type "olmo2"), both ways: Llama's attention and MLP with no
norm before either branch and an RMSNorm after each branch's output (post_attention_layernorm,
post_feedforward_layernorm: ours post_attn_norm, post_mlp_norm, pre_norms off), and q and k each RMS-normalised over
all their heads at once before the rotation (q_norm, k_norm, a gain per column: ours qk_norm_whole), no biases
(transformers' attention_bias puts one on the output projection too, which minigpt's q/k/v biases do not: refused).
OLMo 3 (Olmo3ForCausalLM, "olmo3") is OLMo 2's block with a sliding window in the layers its layer_types name (three
in four, every fourth whole: full_attention_every) and a rotation per layer type, read where both rotate alike
(one base, unscaled) or where the full layers alone are YaRN-scaled (its long-context models: ours rope_yarn with
the windowed blocks rotating unscaled by rope_local_theta, the same base), and written for a model whose window is
shorter than its context.
Torch-free."""

from __future__ import annotations

from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from minigpt.hf.moe import config_number, refuse_unless
from minigpt.hf.patterns import FULL, SLIDING

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
            or config.query_scale is not None or config.rope_linear != 1 or config.mtp_depth \
            or config.rope_local_theta not in (None, config.rope_theta) \
            or (config.rope_local_theta is not None and config.rope_yarn is None):
        raise ConfigError("q/k norms over all heads or blocks without pre norms are written in transformers' OLMo 2 "
                          "layout, which holds both, with a norm after each branch, in a bias-free dense rmsnorm + "
                          "swiglu + rope model: this shape is not one")


def olmo_hf_config(config: GPTConfig, llama: dict, layer_types: dict) -> dict:
    """config.json of the OLMo 2 model holding `config` (`llama`: the fields the Llama-style layouts write), or OLMo
    3's where it has a sliding window (`layer_types`: its window fields)."""
    if not config.window_in_use:
        return {"architectures": [ARCHITECTURE], "model_type": "olmo2", **llama, "attention_bias": False,
                "pad_token_id": None}
    rope = {kind: dict(llama["rope_parameters"]) for kind in (FULL, SLIDING)}
    if config.rope_local_theta is not None:  # YaRN on the full layers alone
        rope[SLIDING] = {"rope_type": "default", "rope_theta": float(config.rope_local_theta)}
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", **llama, **layer_types,
            "rope_parameters": rope, "attention_bias": False, "pad_token_id": None}


def olmo_config(hf: dict, dense: GPTConfig) -> GPTConfig:
    """The GPTConfig of an OLMo 2 config.json (`dense`: its Llama-style fields, read bias-free)."""
    refuse_unless(hf.get("attention_bias", False) is False, "its attention has biases, the output projection's too")
    return dense.with_(**OLMO2)


def olmo3_rotation(hf: dict) -> tuple[dict, dict]:
    """An OLMo 3 config.json with its per-layer-type rotation as one, as the Llama-style reader takes it, and the
    GPTConfig fields beside it: none where both layer types rotate alike (one base, unscaled), rope_local_theta where
    the full layers alone are YaRN-scaled (the windowed ones rotating unscaled by the same base); ConfigError for
    another."""
    parameters = hf.get("rope_parameters")
    if not (isinstance(parameters, dict) and (FULL in parameters or SLIDING in parameters)):
        return hf, {}  # transformers 4's rope_theta (and any rope_scaling, which the reader checks)
    full, sliding = parameters.get(FULL), parameters.get(SLIDING)
    refuse_unless(all(isinstance(kind, dict) for kind in (full, sliding)), f"its rotation per layer type is "
                                                                          f"{parameters}")
    kinds = [kind.get("rope_type", "default") for kind in (full, sliding)]
    refuse_unless(kinds in (["default", "default"], ["yarn", "default"]),
                  f"its rotation per layer type ({parameters}) is scaled other than by YaRN on the full layers alone, "
                  f"which minigpt does not compute")
    bases = {float(config_number(kind, "rope_theta", 10000.0)) for kind in (full, sliding)}
    refuse_unless(len(bases) == 1, f"its layer types rotate by different bases {sorted(bases)}")
    base = bases.pop()
    if kinds[0] == "yarn":
        return {**hf, "rope_parameters": full}, {"rope_local_theta": base}
    return {**hf, "rope_parameters": {"rope_type": "default", "rope_theta": base}}, {}


def olmo_names(ours: str, theirs: str) -> dict[str, tuple[str, ...]]:
    """A block's post norms (its only norms beside q's and k's)."""
    return {f"{ours}post_attn_norm.weight": (f"{theirs}post_attention_layernorm.weight",),
            f"{ours}post_mlp_norm.weight": (f"{theirs}post_feedforward_layernorm.weight",)}
