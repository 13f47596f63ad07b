"""GPT-OSS (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card"; transformers' GptOssForCausalLM) in minigpt.

Its block is Llama's grouped-query attention with biases on every projection and a learned sink per query head
(GPTConfig.attention_sinks), through a sliding window in the blocks its layer_types name (every other one from
the first: window, full_attention_every 2), rotated by YaRN with its correction range unrounded (truncate false:
rope_yarn_truncate); then a mixture of experts, every block, whose router has a bias (router_bias) and picks the
top k logits, softmaxed over those k (the same gates as minigpt's softmax over every expert renormalised over the
top k), and whose experts are GPT-OSS's clamped SwiGLU (mlp "clamped-swiglu", alpha 1.702, limit 7) with biases.
Its tensors hold a block's experts fused: gate_up_proj (E, d, 2 x width) with the gate and up columns interleaved
(the gate's in the even columns) and gate_up_proj_bias (E, 2 x width) alike, down_proj (E, width, d) and
down_proj_bias (E, d); ours hold the gate's columns, then the up's (minigpt/moe.py's Experts). The released
checkpoints quantise the experts to MXFP4, which minigpt/hf/files.py refuses; their bf16 copies are read.
Torch-free except `oss_experts_to_hf` and `oss_experts_from_hf`, which move tensors.
"""

from __future__ import annotations

from minigpt.config import GPTConfig, block_name
from minigpt.errors import ConfigError
from minigpt.hf.moe import config_number, refuse_unless
from minigpt.shape_checks import SWIGLU_ALPHA, SWIGLU_LIMIT


def check_gpt_oss(config: GPTConfig) -> None:
    """ConfigError unless GPT-OSS's layout holds `config` exactly (a model with sinks, the clamped SwiGLU or a router
    bias is written in no other)."""
    block = ((config.norm, config.positions, config.mlp) == ("rmsnorm", "rope", "clamped-swiglu") and config.bias
             and config.attention_sinks and not config.qk_norm and not config.is_mla)
    routing = (config.is_moe and not config.dense_layers and config.router == "softmax" and config.router_bias
               and config.top_k > 1 and config.renormalize_gates and not config.n_shared_experts
               and not config.expert_bias and config.routed_scale == 1.0 and not config.group_limited)
    if not (block and routing and not config.mtp_depth):
        raise ConfigError("attention sinks, the clamped SwiGLU and a router bias are written in transformers' GPT-OSS "
                          "layout, which holds an rmsnorm + rope model with biases, sinks and every block a mixture "
                          "of clamped-SwiGLU experts routed by a biased softmax over the top k > 1 logits (no "
                          "shared experts, group limits, scaled gates or multi-token prediction): this shape is not")


def gpt_oss_hf_config(config: GPTConfig, common: dict, rope_fields, layer_types: dict) -> dict:
    """config.json of the GPT-OSS model holding `config` (`rope_fields`: layouts.py's; `layer_types`: its window
    fields)."""
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **common,
            "max_position_embeddings": config.seq_len, "hidden_size": config.d_model,
            "intermediate_size": config.expert_width, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
            "head_dim": config.head_dim, "num_local_experts": config.n_experts, "num_experts_per_tok": config.top_k,
            "router_aux_loss_coef": config.aux_loss_coef, "output_router_logits": False,
            "rms_norm_eps": config.norm_eps, "attention_bias": True, "attention_dropout": config.dropout,
            "hidden_act": "silu", "swiglu_alpha": SWIGLU_ALPHA, "swiglu_limit": SWIGLU_LIMIT,
            **rope_fields(config), **{key: value for key, value in layer_types.items() if key != "use_sliding_window"}}


def gpt_oss_config(hf: dict, tied: bool, seq_len: int | None, rope, windows: dict) -> GPTConfig:
    """The GPTConfig of a GPT-OSS config.json (`rope`: layouts.py's reading of its rotation; `windows`: of its
    layer_types); ConfigError naming what minigpt would compute differently."""
    refuse_unless(hf.get("attention_bias", True) is True, "its attention has no biases (GPT-OSS's experts have)")
    for key, ours in (("swiglu_limit", SWIGLU_LIMIT), ("swiglu_alpha", SWIGLU_ALPHA)):
        refuse_unless(config_number(hf, key, ours) == ours, f"its {key} is {hf.get(key)!r}, minigpt's {ours}")
    top_k = config_number(hf, "num_experts_per_tok", 4)
    refuse_unless(top_k > 1, "a top-1 GPT-OSS gives its expert the gate 1, minigpt keeps the probability")
    longest = config_number(hf, "max_position_embeddings")
    if seq_len is not None and seq_len > longest:
        raise ConfigError(f"--seq-len {seq_len} is longer than the model's max_position_embeddings ({longest})")
    theta, scaling = rope(hf)
    heads, width = config_number(hf, "num_attention_heads"), config_number(hf, "hidden_size")
    head_dim = hf.get("head_dim")
    return GPTConfig(vocab_size=config_number(hf, "vocab_size"), seq_len=seq_len or longest,
                     n_layers=config_number(hf, "num_hidden_layers"), n_heads=heads,
                     n_kv_heads=hf.get("num_key_value_heads") or heads, d_model=width,
                     d_ff=config_number(hf, "intermediate_size"), tied_head=tied, mlp="clamped-swiglu",
                     norm="rmsnorm", positions="rope", rope_theta=theta, **scaling, bias=True,
                     norm_eps=config_number(hf, "rms_norm_eps", 1e-5),
                     d_head=None if head_dim is None or head_dim * heads == width else head_dim,
                     attention_sinks=True, n_experts=config_number(hf, "num_local_experts"), top_k=top_k,
                     router_bias=True, aux_loss_coef=config_number(hf, "router_aux_loss_coef", 0.0), **windows)


def gpt_oss_names(ours: str, theirs: str) -> dict:
    """A block's sinks and router: ours -> transformers' names (the prefixes of block `ours` and `theirs`)."""
    return {f"{ours}attn.core.sinks": (f"{theirs}self_attn.sinks",),
            f"{ours}mlp.router.weight": (f"{theirs}mlp.router.weight",),
            f"{ours}mlp.router.bias": (f"{theirs}mlp.router.bias",)}


EXPERTS = {"w1": "gate_up_proj", "b1": "gate_up_proj_bias", "w2": "down_proj", "b2": "down_proj_bias"}


def oss_experts_to_hf(state: dict, config: GPTConfig, layer: int, theirs: str) -> dict:
    """Block `layer`'s experts as GPT-OSS's fused tensors: w1 and b1's gate and up columns interleaved."""
    import torch

    out, ours = {}, block_name(layer, config.n_layers)
    for mine, name in EXPERTS.items():
        tensor = state[f"{ours}mlp.experts.{mine}"]
        if mine in ("w1", "b1"):
            tensor = torch.stack(tensor.chunk(2, dim=-1), dim=-1).flatten(-2)  # gate0, up0, gate1, up1, ...
        out[f"{theirs}mlp.experts.{name}"] = tensor.contiguous()
    return out


def oss_experts_from_hf(found, config: GPTConfig, layer: int, theirs: str) -> dict:
    """Block `layer`'s stacked experts from GPT-OSS's tensors (`found(name)`: the fp32 tensor)."""
    import torch

    state, ours = {}, block_name(layer, config.n_layers)
    for mine, name in EXPERTS.items():
        tensor = found(f"{theirs}mlp.experts.{name}")
        if mine in ("w1", "b1"):
            tensor = torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1)
        state[f"{ours}mlp.experts.{mine}"] = tensor
    return state
