"""The plain GPT in Hugging Face transformers' layouts: GPT-2 (GPT2LMHeadModel), Llama (LlamaForCausalLM), Phi-3
(Phi3ForCausalLM), SmolLM3 (SmolLM3ForCausalLM), Qwen2 (Qwen2ForCausalLM, also Qwen2.5's) and Qwen3
(Qwen3ForCausalLM).

A shape is written in the layout that holds it exactly, and refused (ConfigError, one line) when neither does:

- GPT-2: LayerNorm, GELU (tanh approximation: transformers' "gelu_new"), learned positions, multi-head
  attention with d_model / n_heads wide heads. Its Linears are Conv1D, weights stored (in, out): each is our
  (out, in) weight transposed. Its Linears always have biases: a shape without them is written with zero
  biases, which compute the same (a shape with q/k/v biases only, --qkv-bias, too). The fused qkv is c_attn,
  q then k then v, as ours.
- Llama: RMSNorm, SwiGLU, rotary positions (both use the rotate-half pairing of each head's two halves),
  any number of key/value heads, any head width, biases in every Linear or none. Our fused qkv splits into
  q_proj, k_proj and v_proj by rows; our fused fc1 (gate rows, then up rows) into gate_proj and up_proj.
  Mistral's checkpoints (MistralForCausalLM) are read as Llama's block, which they are when their sliding window
  holds the whole training context (or they have none); Phi-3's and Phi-4's (Phi3ForCausalLM) too, their fused
  qkv_proj and gate_up_proj split into Llama's pieces as they are read (`unfused`), when they rotate whole heads
  without LongRoPE.
- Phi-3: Llama's block with fused qkv_proj and gate_up_proj (our fused Linears' rows as they are), for a model that
  rotates part of each head (rotary_fraction; transformers' partial_rotary_factor turns each head's first columns,
  ours the last: minigpt/hf/rope.py moves the query and key rows) or by LongRoPE (Phi-3.5-mini, Phi-4-mini).
- SmolLM3: Llama's block, every no_rope_layer_interval-th layer without rotary positions (no_rope_layers; ours:
  nope_every), no sliding window.
- Qwen2: Llama's block with biases on q_proj, k_proj and v_proj and none elsewhere (ours: --no-bias --qkv-bias),
  every norm with the one epsilon (rms_norm_eps); a sliding window in the layers its layer_types name (every one,
  or all but every N-th: GPTConfig.full_attention_every, Gemma 3's and GPT-OSS's pattern).
- Qwen3: Llama's block with an RMSNorm over each query and key head before the rotation (q_norm, k_norm, one
  head's width each, shared by the heads: ours, --qk-norm), no bias in its MLP (so none anywhere here), every
  norm with the one epsilon (rms_norm_eps), a sliding window as Qwen2's.

All hold a tied or an untied head (tie_word_embeddings) and the model's norm epsilon (norm_eps; GPT-2's
layer_norm_epsilon, the others' rms_norm_eps). A mixture of experts is written in Mixtral's, Qwen3-MoE's, with a
gated shared expert Qwen2-MoE's or, its q/k norms over all heads and a softmax router, OLMoE's layout
(minigpt/hf/moe.py), with a sigmoid router in GLM-4.5's (minigpt/hf/glm.py) or, its q/k norms over all heads,
MiniMax-M2's (minigpt/hf/minimax.py), with latent attention in DeepSeek-V3's
(minigpt/hf/deepseek.py); OLMo 2's norms in its layout (minigpt/hf/olmo.py), Gemma 3's pieces in its (gemma.py).
A transformers model computed differently is refused rather than trained as something else.
Torch-free except `to_hf` and `from_hf`, which move tensors.
"""

from __future__ import annotations

from minigpt.config import GPTConfig, block_name
from minigpt.errors import ConfigError
from minigpt.hf.deepseek import (DEEPSEEK_EXPERTS, DEEPSEEK_TYPES, MLA_LAYOUTS, MTP_LAYOUTS, attention_names,
                                 deepseek_config, deepseek_layout,
                                 deepseek_hf_config, interleaved, mtp_copies, mtp_names, router_extras,
                                 router_extras_from_hf, shared_names, split_sizes)
from minigpt.hf.gemma import GEMMA_LAYOUTS, gemma_config, gemma_hf_config, gemma_layout, gemma_names, is_gemma, norm_gain
from minigpt.hf.glm import check_glm, glm_config, glm_hf_config
from minigpt.hf.gpt_oss import (check_gpt_oss, gpt_oss_config, gpt_oss_hf_config, gpt_oss_names,
                                 oss_experts_from_hf, oss_experts_to_hf)
from minigpt.hf.moe import (ARCHITECTURES, experts_from_hf, experts_to_hf, moe_fields, moe_hf_config,
                            moe_layout, refuse_unless, router_names)
from minigpt.hf.moe import config_number as _number  # config.json's number at a key (ConfigError if not one)
from minigpt.hf.minimax import BIAS_AT, check_minimax, is_minimax, minimax_config, minimax_hf_config
from minigpt.hf.olmo import check_olmo, is_olmo, olmo3_rotation, olmo_config, olmo_hf_config, olmo_names
from minigpt.hf.patterns import LAYER_TYPES, WINDOWED_LAYOUTS, layer_types, nope_every, windows
from minigpt.hf.rope import partial_rotary_factor, read_rope, rope_fields, rotation_moved

LLAMA_FAMILY = ("llama", "mistral", "phi3", "qwen2", "qwen3", "smollm3", *ARCHITECTURES)  # Llama's block, and theirs
PARTIAL_ROTATION = ("phi3", "glm4_moe", "minimax_m2")  # the layouts that turn part of each head
# where a layout with a choice bias keeps it (e_score_correction_bias): DeepSeek's under the router, MiniMax-M2's beside
CHOICE_BIAS = {"deepseek_v3": "mlp.gate.", "glm4_moe": "mlp.gate.", "minimax_m2": BIAS_AT}
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # transformers' names of the tanh-approximated GELU


def layout_of(config: GPTConfig) -> str:
    """"gpt2", "llama", "mistral" (Llama's with a sliding window), "phi3", "smollm3", "qwen2", "qwen3", "gemma3_text",
    "gemma2",
    "olmo2", "mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "glm4_moe", "minimax_m2", "deepseek_v3", "deepseek_v2" or
    "gpt_oss": the transformers layout
    that holds
    `config` exactly; ConfigError saying why not."""
    layout = _block_layout(config)
    if config.mtp_depth and layout not in MTP_LAYOUTS:
        raise ConfigError(f"multi-token prediction modules are written in DeepSeek-V3's or GLM-4.5's layout (as "
                          f"their checkpoints hold them), which cannot hold this {layout} shape")
    if config.nope_every and layout != "smollm3" or config.rope_longrope is not None and layout != "phi3" \
            or config.rotary_fraction != 1 and layout not in PARTIAL_ROTATION:
        raise ConfigError(f"transformers' {layout} layout turns every block's whole heads: blocks without rotary "
                          f"positions are written in SmolLM3's layout, part of each head turned in Phi-3's, "
                          f"GLM-4.5's or MiniMax-M2's, LongRoPE in Phi-3's: none of them holds this shape")
    if config.moe_every > 1 and layout not in ("qwen3_moe", "qwen2_moe"):
        raise ConfigError(f"a mixture of experts in every {config.moe_every}-th block is written in transformers' "
                          f"Qwen3-MoE or Qwen2-MoE layout (decoder_sparse_step), which cannot hold this {layout} "
                          f"shape")
    if _granite(config) and layout != "granite":
        raise ConfigError(f"Granite's scalings are written in transformers' Granite layout, which cannot hold this "
                          f"{layout} shape")
    if config.window_in_use and layout not in WINDOWED_LAYOUTS:
        raise ConfigError(f"a sliding window is written in transformers' Mistral, Mixtral, Qwen2, Qwen3 or GPT-OSS "
                          f"layout, which cannot hold this {layout} shape")
    if config.window_in_use and config.full_attention_every and layout not in LAYER_TYPES:
        raise ConfigError("some blocks through a sliding window and the others not (--full-attention-every) are "
                          "written in transformers' Qwen2 layout (q, k and v biases), Qwen3's (q/k norms) or "
                          "GPT-OSS's, whose layer_types hold the pattern: this shape is none of them")
    if layout == "mistral" and config.bias:
        raise ConfigError("transformers' Mistral layout, which holds a sliding window, has no biases")
    return layout


def _granite(config: GPTConfig) -> bool:
    """Whether `config` has one of Granite's scalings."""
    return config.embed_multiplier != 1 or config.residual_multiplier != 1 or config.logit_divisor != 1 \
        or config.attention_multiplier is not None


def _block_layout(config: GPTConfig) -> str:
    """The layout of `config`'s block (layout_of's before the window)."""
    if config.is_mla:
        return deepseek_layout(config)
    if config.is_moe and config.qk_norm_whole and config.router == "softmax":  # OLMoE's, before MiniMax-M2's
        return moe_layout(config)
    if is_minimax(config):  # before OLMo 2's: their q/k norms are the same
        check_minimax(config)
        return "minimax_m2"
    if is_olmo(config):  # before Gemma's: its post norms are Gemma's too
        check_olmo(config)
        return "olmo3" if config.window_in_use else "olmo2"
    if is_gemma(config):
        return gemma_layout(config)
    if config.attention_sinks or config.mlp == "clamped-swiglu" or config.router_bias:
        check_gpt_oss(config)
        return "gpt_oss"
    if config.is_moe and config.router == "sigmoid":  # DeepSeek's experts after grouped-query attention
        check_glm(config)
        return "glm4_moe"
    if config.is_moe:
        return moe_layout(config)
    gpt2 = (config.norm, config.mlp, config.positions) == ("layernorm", "gelu", "learned")
    llama = (config.norm, config.mlp, config.positions) == ("rmsnorm", "swiglu", "rope")
    if _granite(config):
        if not llama or config.qkv_bias or config.qk_norm or config.window_in_use or config.nope_every:
            raise ConfigError("Granite's scalings are written in transformers' Granite layout, which holds them with "
                              "Llama's block (no head norms, window or unrotated blocks)")
        return "granite"
    if config.nope_every:
        if not llama or config.qkv_bias or config.qk_norm or config.rotary_fraction != 1 or config.rope_longrope \
                or config.window_in_use:
            raise ConfigError("blocks without rotary positions (nope_every) are written in transformers' SmolLM3 "
                              "layout, which holds Llama's block (whole heads rotated, no window, no head norms)")
        return "smollm3"
    if config.rotary_fraction != 1 or config.rope_longrope is not None:
        if not llama or config.bias or config.qkv_bias or config.qk_norm:
            raise ConfigError("part of each head rotated (rotary_fraction) or LongRoPE is written in transformers' "
                              "Phi-3 layout, which holds a bias-free rmsnorm + swiglu + rope model without head norms")
        return "phi3"
    if config.qk_norm:
        if not llama or config.bias or config.qkv_bias:
            raise ConfigError("per-head q/k norms (--qk-norm) are written in transformers' Qwen3 layout, which holds "
                              "a bias-free rmsnorm + swiglu + rope model only")
        return "qwen3"
    if llama and config.qkv_bias and not config.bias:
        return "qwen2"
    if gpt2:
        if config.kv_heads != config.n_heads or config.head_dim * config.n_heads != config.d_model:
            raise ConfigError("transformers' GPT-2 layout has neither grouped-query attention nor heads of another "
                              "width than d_model / n_heads: this shape cannot be written in it")
        return "gpt2"
    if llama:
        return "mistral" if config.window_in_use else "llama"
    raise ConfigError(f"a {config.norm} + {config.mlp} + {config.positions}-positions model is neither GPT-2's "
                      f"layout (layernorm, gelu, learned) nor Llama's (rmsnorm, swiglu, rope): transformers cannot "
                      f"hold it")


def hf_config(config: GPTConfig) -> dict:
    """config.json of the transformers model holding `config` (layout_of's), dropout as the run's."""
    common = {"vocab_size": config.vocab_size, "tie_word_embeddings": config.tied_head, "dtype": "float32",
              "bos_token_id": None, "eos_token_id": None}
    if layout_of(config) in MLA_LAYOUTS:
        return deepseek_hf_config(config, common, rope_fields)
    if layout_of(config) == "gpt_oss":
        return gpt_oss_hf_config(config, common, rope_fields, layer_types(config))
    if layout_of(config) in GEMMA_LAYOUTS:
        return gemma_hf_config(config, common)
    if layout_of(config) == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
            "n_positions": config.seq_len, "n_embd": config.d_model, "n_layer": config.n_layers,
            "n_head": config.n_heads, "n_inner": config.d_ff, "activation_function": "gelu_new",
            "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
            "layer_norm_epsilon": config.norm_eps,
        }
    llama = {
        "max_position_embeddings": config.seq_len, "hidden_size": config.d_model,
        "intermediate_size": config.d_ff, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
        "hidden_act": "silu", "rms_norm_eps": config.norm_eps, "attention_bias": config.bias,
        "attention_dropout": config.dropout, **rope_fields(config),
    }
    layout = layout_of(config)
    if layout == "glm4_moe":
        return glm_hf_config(config, {**common, **llama})
    if layout in ("olmo2", "olmo3"):
        return olmo_hf_config(config, {**common, **llama}, layer_types(config))
    if layout == "minimax_m2":
        return minimax_hf_config(config, {**common, **llama})
    if layout == "phi3":  # Llama's block with fused projections, part of each head rotated, LongRoPE
        longrope = {"original_max_position_embeddings": config.rope_longrope[2]} if config.rope_longrope else {}
        return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", **common, **llama,
                "partial_rotary_factor": config.rotary_fraction, "sliding_window": config.window or None,
                "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "pad_token_id": None,  # its default
                **longrope}  # 32000 would be past a smaller vocabulary
    if layout == "smollm3":  # Llama's block, every nope_every-th without rotary positions
        rotates = [int(config.layer_rotates(layer)) for layer in range(config.n_layers)]
        return {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", **common, **llama,
                "mlp_bias": config.bias, "no_rope_layers": rotates, "no_rope_layer_interval": config.nope_every,
                "use_sliding_window": False, "pad_token_id": None}
    if layout == "granite":  # Llama's block with its scalings (the softmax's always: transformers' default is 1)
        return {"architectures": ["GraniteForCausalLM"], "model_type": "granite", **common, **llama,
                "mlp_bias": config.bias, "embedding_multiplier": config.embed_multiplier,
                "residual_multiplier": config.residual_multiplier, "attention_multiplier": config.softmax_scale,
                "logits_scaling": config.logit_divisor}
    if layout == "mistral":  # Llama's block through a sliding window
        return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **common, **llama,
                "sliding_window": config.window}
    if layout in ARCHITECTURES:
        return {"architectures": [ARCHITECTURES[layout]], "model_type": layout, **common, **llama,
                **moe_hf_config(config, layout)}
    if layout in ("qwen2", "qwen3"):
        architecture = "Qwen2ForCausalLM" if layout == "qwen2" else "Qwen3ForCausalLM"
        return {"architectures": [architecture], "model_type": layout, **common, **llama,
                "max_window_layers": config.n_layers, **layer_types(config)}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common, **llama, "mlp_bias": config.bias}


def config_from_hf(hf: dict, seq_len: int | None = None) -> GPTConfig:
    """The GPTConfig of a transformers config.json (GPT-2, Llama, Mistral, Phi-3, Qwen2, Qwen3, the mixtures, ...), or
    ConfigError naming what minigpt cannot compute the same. `seq_len`: the training context of a rotary model (at
    most its max_position_embeddings; default: that); a GPT-2's is its n_positions, the rows of its position table."""
    kind = hf.get("model_type")
    refuse_unless(isinstance(kind, str), f"its model_type is {kind!r}, not a name")
    tied = hf.get("tie_word_embeddings", True)
    refuse_unless(isinstance(tied, bool), f"tie_word_embeddings is {tied!r}")
    if kind == "gpt2":
        d_model, positions = _number(hf, "n_embd"), _number(hf, "n_positions")
        refuse_unless(hf.get("activation_function", "gelu_new") in GPT2_ACTIVATIONS,
                      f"its activation is {hf.get('activation_function')!r}, minigpt's GELU the tanh one (gelu_new)")
        refuse_unless(not hf.get("scale_attn_by_inverse_layer_idx") and hf.get("scale_attn_weights", True),
                      "its attention scores are not scaled by 1/sqrt(head width) alone")
        refuse_unless(seq_len in (None, positions), f"a GPT-2's context is its {positions} learned positions, "
                                                     f"not --seq-len {seq_len}")
        return GPTConfig(vocab_size=_number(hf, "vocab_size"), seq_len=positions, n_layers=_number(hf, "n_layer"),
                         n_heads=_number(hf, "n_head"), d_model=d_model,
                         d_ff=hf.get("n_inner") or 4 * d_model, tied_head=tied,
                         norm_eps=_number(hf, "layer_norm_epsilon", 1e-5))
    if kind in DEEPSEEK_TYPES:
        return deepseek_config(hf, tied, seq_len, read_rope)
    if kind == "gpt_oss":
        return gpt_oss_config(hf, tied, seq_len, read_rope, windows(hf, kind, seq_len))
    if kind in GEMMA_LAYOUTS:
        return gemma_config(hf, tied, seq_len)
    if kind == "olmo3":  # OLMo 2's block, a sliding window in the layers layer_types names
        rotation, local = olmo3_rotation(hf)  # YaRN on the full layers alone: the windowed ones unscaled (local)
        return olmo_config(hf, _bias_free(rotation, tied, seq_len)).with_(**windows(hf, kind, seq_len), **local)
    if kind in READERS:  # Llama's attention with DeepSeek's experts, OLMo 2's norms, or MiniMax-M2's
        return READERS[kind](hf, _bias_free(hf, tied, seq_len))
    if kind == "granite":  # Llama's block with its scalings
        return _llama_config(hf, tied, seq_len).with_(**{ours: float(_number(hf, theirs, 1.0)) for ours, theirs in (
            ("embed_multiplier", "embedding_multiplier"), ("residual_multiplier", "residual_multiplier"),
            ("attention_multiplier", "attention_multiplier"), ("logit_divisor", "logits_scaling"))})
    if kind not in LLAMA_FAMILY:
        raise ConfigError(f"config.json's model_type is {kind!r}: minigpt reads transformers' 'gpt2', 'llama', "
                          f"'mistral', 'phi3', 'qwen2', 'qwen3', 'smollm3', 'gemma3_text', 'gemma2', 'granite', "
                          f"'mixtral', 'qwen3_moe', 'qwen2_moe', 'olmoe', 'deepseek_v3' (and Kimi K2's 'kimi_k2'), "
                          f"'deepseek_v2', 'glm4_moe', 'olmo2', 'olmo3', 'minimax_m2' and 'gpt_oss' models")
    window_fields = windows(hf, kind, seq_len)
    if kind == "llama":
        return _llama_config(hf, tied, seq_len)
    if kind == "smollm3":  # Llama's block, every no_rope_layer_interval-th without rotary positions
        plain = _llama_config(hf, tied, seq_len)
        return plain.with_(nope_every=nope_every(hf, plain.n_layers))
    if kind in ("qwen3", *ARCHITECTURES):  # their attention's biases are the o projection's too; none in the MLP
        refuse_unless(not hf.get("attention_bias"), "its attention has biases and its MLP none")
    # Phi-3: Llama's block with fused projections, the first partial_rotary_factor of each head rotated
    rotated = partial_rotary_factor(hf, 1.0) if kind == "phi3" else 1.0
    dense = _bias_free(hf, tied, seq_len, rotated)  # but Qwen2's q, k and v biases, set below
    if kind == "phi3":
        return dense.with_(**window_fields)

    if kind in ARCHITECTURES:  # a mixture of experts: Mixtral's (Llama's attention), Qwen3-MoE's (Qwen3's), OLMoE's
        return dense.with_(qk_norm=kind in ("qwen3_moe", "olmoe"), qk_norm_whole=kind == "olmoe", **window_fields,
                           **moe_fields(hf, kind))
    # Qwen2: biases on q, k and v alone
    return dense.with_(qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3", **window_fields)


READERS = {"glm4_moe": glm_config, "olmo2": olmo_config, "minimax_m2": minimax_config}  # model_type: its reader


def _bias_free(hf: dict, tied: bool, seq_len: int | None, rotated: float = 1.0) -> GPTConfig:
    """The Llama-style fields of a config.json whose attention_bias the caller reads itself (the Qwens' and GLM-4.5's
    are q, k and v's alone), no bias in any Linear."""
    return _llama_config({**hf, "attention_bias": False, "mlp_bias": False}, tied, seq_len, rotated)


def _llama_config(hf: dict, tied: bool, seq_len: int | None, rotated: float = 1.0) -> GPTConfig:
    theta, scaling = read_rope(hf)
    refuse_unless(hf.get("hidden_act", "silu") == "silu", f"its MLP activation is {hf.get('hidden_act')!r}, not silu")
    bias = hf.get("attention_bias", False)
    refuse_unless(bias == hf.get("mlp_bias", False), "it has biases in the attention or the MLP, not both")
    refuse_unless(hf.get("pretraining_tp", 1) == 1, "its pretraining_tp splits the Linears' computation")
    longest = _number(hf, "max_position_embeddings")
    if seq_len is not None and seq_len > longest:
        raise ConfigError(f"--seq-len {seq_len} is longer than the model's max_position_embeddings ({longest})")
    heads, width, head_dim = _number(hf, "num_attention_heads"), _number(hf, "hidden_size"), hf.get("head_dim")
    refuse_unless(head_dim is None or (isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim > 0),
                  f"its head_dim is {head_dim!r}, not a whole number above 0")
    return GPTConfig(vocab_size=_number(hf, "vocab_size"), seq_len=seq_len or longest,
                     n_layers=_number(hf, "num_hidden_layers"), n_heads=heads,
                     n_kv_heads=hf.get("num_key_value_heads") or heads, d_model=width,
                     d_ff=_number(hf, "intermediate_size"), tied_head=tied, mlp="swiglu", norm="rmsnorm",
                     positions="rope", rope_theta=theta, **scaling, bias=bool(bias),
                     norm_eps=_number(hf, "rms_norm_eps", 1e-6), rotary_fraction=rotated,
                     d_head=None if head_dim is None or head_dim * heads == width else head_dim)


def names(config: GPTConfig) -> dict[str, tuple[str, ...]]:
    """Our parameter name -> the transformers names it is written as (two for a fused weight split in Llama and
    Qwen; three for the qkv). Tied: no lm_head (transformers ties it to the embedding). A mixture of experts' stacked
    experts are not here (minigpt/hf/moe.py's expert_names: one tensor per expert and projection)."""
    layout = layout_of(config)
    gpt2 = layout == "gpt2"
    base = "transformer." if gpt2 else "model."
    table = {"tok_emb.weight": (base + ("wte" if gpt2 else "embed_tokens") + ".weight",),
             "norm_f.weight": (base + ("ln_f" if gpt2 else "norm") + ".weight",)}
    if gpt2:
        table |= {"pos_emb.weight": ("transformer.wpe.weight",), "norm_f.bias": ("transformer.ln_f.bias",)}
    if not config.tied_head:
        table["head.weight"] = ("lm_head.weight",)
    for i in range(config.n_layers + config.mtp_depth):  # a multi-token prediction module's block past them
        ours, theirs = block_name(i, config.n_layers), f"{base}{'h' if gpt2 else 'layers'}.{i}."
        moe = config.is_moe_layer(i)  # a router and experts in place of the dense MLP
        if layout in MLA_LAYOUTS:  # Llama's norms and MLP names, the latent attention's own
            table |= {**_llama_block(ours, theirs, config, mlp=not moe, attention=False),
                      **attention_names(config, ours, theirs)}
        else:
            table |= _gpt2_block(ours, theirs) if gpt2 else _llama_block(ours, theirs, config, mlp=not moe,
                                                                          fused=layout == "phi3")
        if layout == "gpt_oss":
            table |= gpt_oss_names(ours, theirs)
        elif layout in GEMMA_LAYOUTS:
            table |= gemma_names(ours, theirs)
        elif layout in ("olmo2", "olmo3"):  # its norms after each branch
            table |= olmo_names(ours, theirs)
        elif moe:
            table |= router_names(ours, theirs, layout)
        if moe and layout in DEEPSEEK_EXPERTS:
            table |= shared_names(config, i, theirs)
        if config.qk_norm:
            table |= {f"{ours}attn.core.{norm}.weight": (f"{theirs}self_attn.{norm}.weight",)
                      for norm in ("q_norm", "k_norm")}
    return table | mtp_names(config)


def _gpt2_block(ours: str, theirs: str) -> dict:
    table = {}
    for mine, hf in (("ln1", "ln_1"), ("ln2", "ln_2"), ("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                     ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
        table |= {ours + mine + ".weight": (theirs + hf + ".weight",), ours + mine + ".bias": (theirs + hf + ".bias",)}
    return table


def _llama_block(ours: str, theirs: str, config: GPTConfig, mlp: bool = True, attention: bool = True,
                 fused: bool = False) -> dict:
    """Llama's block names; `fused`: Phi-3's, whose qkv_proj and gate_up_proj hold our fused Linears' rows as ours."""
    table = {ours + "ln1.weight": (theirs + "input_layernorm.weight",),  # none in OLMo 2's block
             ours + "ln2.weight": (theirs + "post_attention_layernorm.weight",)} if config.pre_norms else {}
    qkv = ("self_attn.qkv_proj",) if fused else ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    linears = {"attn.qkv": qkv, "attn.proj": ("self_attn.o_proj",)} if attention else {}
    if mlp:
        linears |= {"mlp.fc1": ("mlp.gate_up_proj",) if fused else ("mlp.gate_proj", "mlp.up_proj"),
                    "mlp.fc2": ("mlp.down_proj",)}
    for mine, hf in linears.items():
        table[ours + mine + ".weight"] = tuple(theirs + name + ".weight" for name in hf)
        if config.linear_bias(mine):
            table[ours + mine + ".bias"] = tuple(theirs + name + ".bias" for name in hf)
    return table


def _split_sizes(config: GPTConfig, ours: str) -> list[int]:
    """Rows of each transformers piece of a fused weight (Llama's qkv and fc1; DeepSeek-V3's down projection and
    shared experts' fc1)."""
    sizes = split_sizes(config, ours)
    if sizes is not None:
        return sizes
    if ours.endswith("attn.qkv.weight") or ours.endswith("attn.qkv.bias"):
        kv = config.kv_heads * config.head_dim
        return [config.n_heads * config.head_dim, kv, kv]
    return [config.d_ff, config.d_ff]


def _conv1d(ours: str) -> bool:
    """GPT-2's Conv1D weights: the block's Linears (stored transposed)."""
    return ours.startswith("blocks.") and ours.endswith(".weight") and ".ln" not in ours


def to_hf(state: dict, config: GPTConfig, gradients: bool = False) -> dict:
    """Our plain GPT's state (tensors by our names) as transformers' tensors (contiguous, ready for safetensors).
    A GPT-2 shape without biases gets zero biases. `gradients`: the tensors are gradients (the layouts' row moves
    apply, not Gemma's gains less 1)."""
    import torch

    layout, out = layout_of(config), {}
    gpt2 = layout == "gpt2"
    for ours, theirs in names(config).items():
        tensor = state.get(ours)
        if tensor is None and gpt2 and ours.endswith(".bias"):  # --no-bias: zeros compute the same
            rows = state[ours[: -len("bias")] + "weight"].shape[0]
            tensor = torch.zeros(rows, dtype=state["tok_emb.weight"].dtype)
        if gpt2 and _conv1d(ours):
            tensor = tensor.t()
        if layout in MLA_LAYOUTS:  # its rotated rows in DeepSeek's neighbouring pairs
            tensor = interleaved(tensor, config, ours, to_hf=True)
        tensor = rotation_moved(tensor, config, ours, to_hf=True)  # a partial rotation's columns first, as theirs
        if layout in GEMMA_LAYOUTS and not gradients:  # its norms' weights are the gains less 1
            tensor = norm_gain(tensor, ours, to_hf=True)
        pieces = tensor.split(_split_sizes(config, ours)) if len(theirs) > 1 else (tensor,)
        out |= {name: piece.contiguous() for name, piece in zip(theirs, pieces)}
    for layer in _moe_layers(config):
        if layout == "gpt_oss":
            out |= oss_experts_to_hf(state, config, layer, f"model.layers.{layer}.")
            continue
        out |= experts_to_hf(state, config, layer, f"model.layers.{layer}.", layout)
        if layout in CHOICE_BIAS:
            out |= router_extras(state, config, layer, f"model.layers.{layer}.", CHOICE_BIAS[layout])
    return out | mtp_copies(state, config)


def _moe_layers(config: GPTConfig) -> list[int]:
    """The MoE blocks, a multi-token prediction module's (DeepSeek-V3's layer n_layers + k) included."""
    return [layer for layer in range(config.n_layers + config.mtp_depth) if config.is_moe_layer(layer)]


# Phi-3's fused projections (Phi3ForCausalLM) and Llama's pieces of them, which our fused Linears split into
FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def unfused(table: dict, config: GPTConfig) -> dict:
    """`table` (tensors, or a header's shapes as lists) with Phi-3's fused qkv_proj (q, k then v rows) and
    gate_up_proj (gate then up rows) also as Llama's pieces, split by rows as the shape says; a fused tensor of
    another size stays whole (its pieces are then missing, and said so)."""
    out = dict(table)
    for name, value in table.items():
        fused = next((key for key in FUSED if name.endswith(key)), None)
        if fused is None:
            continue
        sizes = _split_sizes(config, "attn.qkv.weight" if fused.startswith("self_attn") else "mlp.fc1.weight")
        rows = value[0] if isinstance(value, list) else value.shape[0]
        if rows != sum(sizes):
            continue
        parts = [[size, *value[1:]] for size in sizes] if isinstance(value, list) else value.split(sizes)
        out |= {name[: -len(fused)] + piece: part for piece, part in zip(FUSED[fused], parts)}
    return out


def lookup(table: dict, name: str):
    """table[name], or under the name without its 'transformer.'/'model.' prefix (how GPT-2's own checkpoints, and
    some others, name their tensors); None when neither is there."""
    short = name.split(".", 1)[1] if name.startswith(("transformer.", "model.")) else name
    return table.get(name, table.get(short))


def from_hf(tensors: dict, config: GPTConfig) -> dict:
    """transformers' tensors (by their names, with or without the 'transformer.'/'model.' prefix) as our plain
    GPT's state, in fp32; ConfigError naming a tensor that is missing or of the wrong shape."""
    import torch

    def found(name: str) -> torch.Tensor:
        tensor = lookup(tensors, name)
        if tensor is None:
            raise ConfigError(f"the model's weights have no {name}")
        return tensor.to(torch.float32)

    tensors = unfused(tensors, config)  # a Phi-3's fused projections, as Llama's pieces
    layout, state = layout_of(config), {}
    gpt2 = layout == "gpt2"
    for ours, theirs in names(config).items():
        pieces = [found(name) for name in theirs]
        tensor = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if layout in MLA_LAYOUTS:  # its rotated rows back in our rotate-half pairs
            tensor = interleaved(tensor, config, ours, to_hf=False)
        tensor = rotation_moved(tensor, config, ours, to_hf=False)  # a partial rotation's columns last, as ours
        if layout in GEMMA_LAYOUTS:
            tensor = norm_gain(tensor, ours, to_hf=False)
        state[ours] = tensor.t() if gpt2 and _conv1d(ours) else tensor
    for layer in _moe_layers(config):
        if layout == "gpt_oss":
            state |= oss_experts_from_hf(found, config, layer, f"model.layers.{layer}.")
            continue
        state |= experts_from_hf(found, config, layer, f"model.layers.{layer}.", layout)
        if layout in CHOICE_BIAS:
            state |= router_extras_from_hf(found, config, layer, f"model.layers.{layer}.", CHOICE_BIAS[layout])
    return state
