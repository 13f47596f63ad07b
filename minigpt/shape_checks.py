"""The checks a GPTConfig runs on its fields when it is made (GPTConfig.__post_init__), each bad value one
ConfigError saying what is allowed, and the names of the shape's kinds. Torch-free; imports nothing of minigpt's
model so that minigpt/config.py can import it."""

from __future__ import annotations

import math

from minigpt.errors import ConfigError

MLP_KINDS = ("gelu", "swiglu", "relu2", "clamped-swiglu", "geglu")
GATED_MLPS = ("swiglu", "clamped-swiglu", "geglu")  # fc1 makes a gate and an up projection, fused
# GPT-OSS's clamped SwiGLU (its reference code and transformers' GptOssExperts: swiglu_alpha, swiglu_limit)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
NORM_KINDS = ("layernorm", "rmsnorm")
POSITION_KINDS = ("learned", "rope")
ROUTER_KINDS = ("softmax", "sigmoid")
FLAGS = ("tied_head", "bias", "qkv_bias", "qk_norm", "attention_sinks", "rope_yarn_truncate", "post_norms",
         "embed_scale", "qk_norm_whole", "pre_norms")  # the shape's yes-or-no fields


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_shape(config) -> None:
    """Every field of `config` (a GPTConfig), or ConfigError naming the first bad one."""
    for name in ("vocab_size", "seq_len", "n_layers", "n_heads", "d_model", "d_ff"):
        if not _positive_int(getattr(config, name)):
            raise ConfigError(f"{name} must be a positive integer, got {getattr(config, name)!r}")
    if config.d_head is not None and not _positive_int(config.d_head):
        raise ConfigError(f"d_head must be a positive integer (or unset for d_model / n_heads), got {config.d_head!r}")
    if config.d_head is None and config.d_model % config.n_heads:
        raise ConfigError(f"n_heads={config.n_heads} does not divide d_model={config.d_model}: "
                          f"choose a head count that divides the width")
    if not 0.0 <= config.dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {config.dropout}")
    if not isinstance(config.window, int) or isinstance(config.window, bool) or config.window < 0:
        raise ConfigError(f"window must be a whole number >= 0 (0: no sliding window), got {config.window!r}")
    every = config.full_attention_every
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ConfigError(f"full_attention_every must be a whole number >= 0 (0: every block through the window), "
                          f"got {every!r}")
    if every and not config.window:
        raise ConfigError("full_attention_every needs a sliding window (window): without one every block attends "
                          "to the whole context")
    if every and config.mtp_depth:
        raise ConfigError("full_attention_every with multi-token prediction modules: no model has both, and which "
                          "attention a module's block takes is not defined")
    for name in ("attention_softcap", "logit_softcap"):
        cap = getattr(config, name)
        if not _number(cap) or not 0 <= cap < math.inf:
            raise ConfigError(f"{name} must be a finite number >= 0 (0: none), got {cap!r}")
    for name in ("embed_multiplier", "residual_multiplier", "logit_divisor", "attention_multiplier"):
        value = getattr(config, name)
        if not (value is None and name == "attention_multiplier") and (not _number(value) or not 0 < value < math.inf):
            raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    if config.embed_multiplier != 1 and config.embed_scale:
        raise ConfigError("embed_multiplier (Granite's) and embed_scale (Gemma's sqrt(width)) both scale the "
                          "embeddings: set one")
    if config.attention_multiplier is not None and (config.query_scale is not None or config.kv_lora_rank):
        raise ConfigError("attention_multiplier (Granite's softmax scale) with query_scale (Gemma's) or multi-head "
                          "latent attention's own: set one")
    if config.attention_softcap and (config.attention_sinks or config.kv_lora_rank):
        raise ConfigError("attention_softcap caps the scores of Gemma 2's attention: not with sinks or multi-head "
                          "latent attention (no model has both)")
    nope = config.nope_every
    if not isinstance(nope, int) or isinstance(nope, bool) or nope < 0:
        raise ConfigError(f"nope_every must be a whole number >= 0 (0: every block rotates), got {nope!r}")
    if nope and (config.positions != "rope" or config.kv_lora_rank):
        raise ConfigError("nope_every leaves rotary positions out of some blocks: it needs positions rope and no "
                          "multi-head latent attention")
    if config.window and config.kv_lora_rank:
        raise ConfigError("a sliding window with multi-head latent attention: no model has both, minigpt neither")
    eps = config.norm_eps
    if not _number(eps) or not 0 < eps < 1:
        raise ConfigError(f"norm_eps must be a number in (0, 1), got {eps!r}")
    if config.qk_norm_whole and not config.qk_norm:
        raise ConfigError("qk_norm_whole normalises q and k over all their heads at once: it needs qk_norm")
    if not config.pre_norms and not config.post_norms:
        raise ConfigError("pre_norms off leaves the block without a norm: a block without them (OLMo 2's) normalises "
                          "each branch's output instead (post_norms)")
    _check_llama_options(config)
    if config.n_experts != 0:
        _check_moe_options(config)
    elif config.router_bias:
        raise ConfigError("router_bias is a mixture of experts' router's: this model is dense (n_experts 0)")
    depth, weight = config.mtp_depth, config.mtp_weight
    if not isinstance(depth, int) or isinstance(depth, bool) or not 0 <= depth < config.seq_len:
        raise ConfigError(f"mtp_depth must be a whole number of modules from 0 to seq_len - 1, got {depth!r}")
    if not _number(weight) or not math.isfinite(weight) or weight < 0:
        raise ConfigError(f"mtp_weight must be a finite number >= 0, got {weight!r}")


def _check_moe_options(config) -> None:
    for name in ("n_experts", "top_k"):
        if not _positive_int(getattr(config, name)):
            raise ConfigError(f"{name} must be a positive integer, got {getattr(config, name)!r}")
    if config.top_k > config.n_experts:
        raise ConfigError(f"top_k={config.top_k} is above the {config.n_experts} experts: each token picks "
                          f"distinct experts, so choose top_k <= n_experts")
    if config.d_expert is not None and not _positive_int(config.d_expert):
        raise ConfigError(f"d_expert must be a positive integer (or unset for d_ff), got {config.d_expert!r}")
    for name in ("n_shared_experts", "dense_layers"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{name} must be a whole number >= 0, got {value!r}")
    if config.dense_layers >= config.n_layers:
        raise ConfigError(f"dense_layers={config.dense_layers} leaves no MoE layer of {config.n_layers}: "
                          f"choose dense_layers < n_layers (or n_experts 0 for a dense model)")
    every = config.moe_every
    if not _positive_int(every) or not config.n_moe_layers:
        raise ConfigError(f"moe_every must be a positive integer leaving a MoE block among the {config.n_layers} "
                          f"(blocks N - 1, 2N - 1, ... past the {config.dense_layers} dense ones), got {every!r}")
    if every > 1 and config.mtp_depth:
        raise ConfigError("multi-token prediction modules take the model's last block kind, which a MoE every "
                          "moe_every blocks leaves unsaid: give one or the other")
    if config.router not in ROUTER_KINDS:
        raise ConfigError(f"router must be one of {', '.join(ROUTER_KINDS)}, got {config.router!r}")
    cf = config.capacity_factor
    if cf is not None and (not _number(cf) or not 0 < cf < float("inf")):
        raise ConfigError(f"capacity_factor must be a number above 0 (or unset for dropless routing), got {cf!r}")
    for name in ("aux_loss_coef", "z_loss_coef"):
        value = getattr(config, name)
        if not _number(value) or not 0 <= value < float("inf"):
            raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    _check_groups(config)


def _check_groups(config) -> None:
    """DeepSeek-V3's group-limited routing, routed scale and choice bias."""
    groups, chosen, scale = config.expert_groups, config.groups_per_token, config.routed_scale
    rate = config.expert_bias_rate
    if not isinstance(config.router_bias, bool):
        raise ConfigError(f"router_bias must be true or false, got {config.router_bias!r}")
    if not isinstance(config.shared_expert_gate, bool) or (config.shared_expert_gate and not config.n_shared_experts):
        raise ConfigError(f"shared_expert_gate must be true or false, and true only with shared experts (the output it "
                          f"gates), got {config.shared_expert_gate!r} with {config.n_shared_experts!r} shared")
    if not isinstance(config.renormalize_gates, bool):
        raise ConfigError(f"renormalize_gates must be true or false, got {config.renormalize_gates!r}")
    if not isinstance(config.expert_bias, bool):
        raise ConfigError(f"expert_bias must be true or false, got {config.expert_bias!r}")
    if not _number(rate) or not 0 <= rate < float("inf") or (rate and not config.expert_bias):
        raise ConfigError(f"expert_bias_rate must be a finite number >= 0, and above 0 only with expert_bias (the "
                          f"bias it moves), got {rate!r}")
    if not _number(scale) or not 0 < scale < float("inf"):
        raise ConfigError(f"routed_scale must be a number above 0, got {scale!r}")
    top = config.group_score_top
    if not _positive_int(top):
        raise ConfigError(f"group_score_top must be a positive integer (DeepSeek-V3's groups are scored by their 2 "
                          f"best experts, DeepSeek-V2's by their best), got {top!r}")
    if not _positive_int(groups) or config.n_experts % groups or (groups > 1 and config.n_experts // groups < top):
        raise ConfigError(f"expert_groups must be a positive integer dividing the {config.n_experts} experts into "
                          f"groups of {top} or more (each group is scored by its {top} best), got {groups!r}")
    if chosen is not None and (not _positive_int(chosen) or chosen > groups):
        raise ConfigError(f"groups_per_token must be a positive integer of at most expert_groups={groups} (or unset "
                          f"for all), got {chosen!r}")
    if (chosen or groups) * (config.n_experts // groups) < config.top_k:
        raise ConfigError(f"top_k={config.top_k} is above the {chosen * (config.n_experts // groups)} experts of a "
                          f"token's {chosen} groups: choose more groups_per_token")


def _check_llama_options(config) -> None:
    kv = config.n_kv_heads
    if kv is not None:
        if not _positive_int(kv):
            raise ConfigError(f"n_kv_heads must be a positive integer, got {kv!r}")
        if config.n_heads % kv:
            raise ConfigError(f"n_kv_heads={kv} does not divide n_heads={config.n_heads}: grouped-query attention "
                              f"shares each key/value head among an equal number of query heads")
    for name, kinds in (("mlp", MLP_KINDS), ("norm", NORM_KINDS), ("positions", POSITION_KINDS)):
        if getattr(config, name) not in kinds:
            raise ConfigError(f"{name} must be one of {', '.join(kinds)}, got {getattr(config, name)!r}")
    if config.positions == "rope" and config.head_dim % 2 and not config.kv_lora_rank:
        raise ConfigError(f"rotary position embeddings need an even head width, got {config.head_dim}: change "
                          f"d_model or n_heads (or d_head)")
    if not _number(config.rope_theta) or not 1.0 < config.rope_theta < float("inf"):
        raise ConfigError(f"rope_theta must be a number above 1, got {config.rope_theta!r}")
    if config.rope_scaling is not None:
        _check_rope_scaling(config)
    if config.rope_yarn is not None:
        _check_rope_yarn(config)
    elif config.rope_yarn_truncate is not True:
        raise ConfigError("rope_yarn_truncate rounds YaRN's correction range: set it with rope_yarn only")
    _check_partial_rotation(config)
    _check_gemma(config)
    _check_latent_attention(config)
    for name in FLAGS:
        if not isinstance(getattr(config, name), bool):
            raise ConfigError(f"{name} must be true or false, got {getattr(config, name)!r}")


def _check_latent_attention(config) -> None:
    """Multi-head latent attention's fields (kv_lora_rank > 0), and none of them set without it."""
    for name in ("kv_lora_rank", "q_lora_rank", "rope_head_dim"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{name} must be a whole number >= 0, got {value!r}")
    if config.d_value is not None and not _positive_int(config.d_value):
        raise ConfigError(f"d_value must be a positive integer (or unset for d_head), got {config.d_value!r}")
    if not config.kv_lora_rank:
        if config.q_lora_rank or config.rope_head_dim or config.d_value is not None:
            raise ConfigError("q_lora_rank, rope_head_dim and d_value shape multi-head latent attention: set "
                              "kv_lora_rank above 0 with them")
        return
    if config.positions != "rope" or not config.rope_head_dim or config.rope_head_dim % 2:
        raise ConfigError(f"multi-head latent attention rotates rope_head_dim columns of each query and key head: "
                          f"use positions rope and an even rope_head_dim above 0, got {config.positions} and "
                          f"{config.rope_head_dim}")
    if config.d_value is not None and config.d_value > config.d_head + config.rope_head_dim:
        raise ConfigError(f"d_value={config.d_value} is wider than a query head ({config.d_head} + "
                          f"{config.rope_head_dim}): the attention pads values to the query's width, not the reverse")
    clashes = [name for name, on in (("n_kv_heads", config.n_kv_heads not in (None, config.n_heads)),
                                     ("qk_norm", config.qk_norm), ("bias", config.bias),
                                     ("attention_sinks", config.attention_sinks),
                                     ("qkv_bias", config.qkv_bias)) if on]
    if clashes:
        raise ConfigError(f"multi-head latent attention has one key and value head per query head (n_kv_heads "
                          f"unset or {config.n_heads}), no head norms, sinks or biases: change {', '.join(clashes)}")


def _check_rope_scaling(config) -> None:
    scaling = config.rope_scaling
    if not isinstance(scaling, (tuple, list)) or len(scaling) != 4 or any(
            not _number(v) or not 0 < v < float("inf") for v in scaling):
        raise ConfigError(f"rope_scaling must be four positive numbers (factor, low_freq_factor, "
                          f"high_freq_factor, original_max_position_embeddings), got {scaling!r}")
    if not scaling[2] > scaling[1] or config.positions != "rope":
        raise ConfigError(f"rope_scaling scales rotary positions (positions rope), its high_freq_factor above its "
                          f"low_freq_factor: got {scaling!r} with positions {config.positions}")
    object.__setattr__(config, "rope_scaling", tuple(scaling))  # a list read from JSON: the same shape


def _check_rope_yarn(config) -> None:
    yarn = config.rope_yarn
    fields = "(factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim)"
    if not isinstance(yarn, (tuple, list)) or len(yarn) != 6 or any(
            not _number(v) or not 0 <= v < float("inf") for v in yarn):
        raise ConfigError(f"rope_yarn must be six finite numbers >= 0 {fields}, got {yarn!r}")
    factor, context, fast, slow = yarn[:4]
    if not (factor >= 1 and _positive_int(context) and fast >= slow > 0):  # equal betas: the ramp a step (Kimi K2)
        raise ConfigError(f"rope_yarn {fields} needs a factor of 1 or more, a whole original context and beta_fast "
                          f"at least beta_slow, above 0, got {tuple(yarn)!r}")
    if config.positions != "rope" or config.rope_scaling is not None:
        raise ConfigError(f"rope_yarn scales rotary positions (positions rope, without Llama 3.1's rope_scaling): got "
                          f"positions {config.positions}, rope_scaling {config.rope_scaling!r}")
    object.__setattr__(config, "rope_yarn", tuple(yarn))  # a list read from JSON: the same shape


def _check_partial_rotation(config) -> None:
    """rotary_fraction (an even whole number of each head's columns) and rope_longrope (a factor for each rotated
    pair), both of rotary positions only, LongRoPE instead of the other scalings."""
    fraction = config.rotary_fraction
    if not _number(fraction) or not 0 < fraction <= 1:
        raise ConfigError(f"rotary_fraction must be a number in (0, 1], got {fraction!r}")
    if fraction != 1 and (config.positions != "rope" or config.kv_lora_rank):
        raise ConfigError("rotary_fraction turns part of each head by rotary positions: it needs positions rope and "
                          "no multi-head latent attention (whose rotated columns are rope_head_dim)")
    turned = config.head_dim * fraction
    if fraction != 1 and not (turned == round(turned) and round(turned) % 2 == 0 and turned >= 2):
        raise ConfigError(f"rotary_fraction {fraction} of {config.head_dim}-wide heads turns {turned:g} columns: it "
                          f"must be an even whole number of them")
    longrope = config.rope_longrope
    if longrope is None:
        return
    pairs = config.rotary_dim // 2
    if not (isinstance(longrope, (tuple, list)) and len(longrope) == 4 and all(
            isinstance(f, (tuple, list)) and len(f) == pairs and all(_number(v) and 0 < v < float("inf") for v in f)
            for f in longrope[:2]) and _positive_int(longrope[2]) and _number(longrope[3])
            and 1 <= longrope[3] < float("inf")):
        raise ConfigError(f"rope_longrope must be (short_factors, long_factors, original_max_position_embeddings, "
                          f"attention_factor): {pairs} positive factors each (one per rotated pair), a whole original "
                          f"context and an attention factor of 1 or more, got {longrope!r}")
    if config.positions != "rope" or config.rope_scaling is not None or config.rope_yarn is not None:
        raise ConfigError("rope_longrope scales rotary positions: it needs positions rope, without rope_scaling or "
                          "rope_yarn")
    object.__setattr__(config, "rope_longrope", (tuple(longrope[0]), tuple(longrope[1]), longrope[2],
                                                 float(longrope[3])))  # lists read from JSON: the same shape


def _check_gemma(config) -> None:
    """Gemma's pieces: a positive query_scale, the local rotary base of windowed blocks (with a window, rotary
    positions) and a linear factor of 1 or more (rotary, no other scaling)."""
    scale = config.query_scale
    if scale is not None and not (_number(scale) and 0 < scale < float("inf")):
        raise ConfigError(f"query_scale must be a positive number (or unset for the head width), got {scale!r}")
    if scale is not None and config.kv_lora_rank:
        raise ConfigError("query_scale sets the softmax scale, which multi-head latent attention sets its own way")
    local = config.rope_local_theta
    if local is not None and not (_number(local) and 1 < local < float("inf") and config.positions == "rope"
                                  and config.window):
        raise ConfigError(f"rope_local_theta is the windowed blocks' rotary base: a number above 1, with positions rope "
                          f"and a window, got {local!r}")
    linear = config.rope_linear
    if not (_number(linear) and 1 <= linear < float("inf")):
        raise ConfigError(f"rope_linear must be a number of 1 or more, got {linear!r}")
    if linear != 1 and (config.positions != "rope" or config.rope_scaling is not None or config.rope_yarn is not None
                        or config.rope_longrope is not None or config.kv_lora_rank):
        raise ConfigError("rope_linear divides rotary positions: it needs positions rope, no other scaling and no "
                          "multi-head latent attention")
