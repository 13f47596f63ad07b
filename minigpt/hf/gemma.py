"""Gemma 3's and Gemma 2's transformers layouts (Gemma3ForCausalLM, model_type "gemma3_text"; Gemma2ForCausalLM,
"gemma2"), both ways.

Gemma 3's block is Llama's with GeGLU (gelu_pytorch_tanh), per-head query and key norms (Qwen3's), a norm after the
attention and after the MLP on each branch (post_attention_layernorm, post_feedforward_layernorm: ours post_norms;
its norm before the MLP is pre_feedforward_layernorm), the embeddings times sqrt(hidden_size), the softmax scaled by
query_pre_attn_scalar ** -0.5, and every N-th layer attending to the whole context while the others go through a
sliding window and rotate by their own base (rope_local_base_freq, unscaled; the full layers' rope_theta may be
scaled linearly). Its RMSNorms multiply by (1 + weight): ours hold 1 + its weight, in fp32 the same product.
Torch-free except the tensor function.
"""

from __future__ import annotations

from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from minigpt.hf.moe import config_number, refuse_unless
from minigpt.hf.patterns import FULL, SLIDING, full_attention_every, layer_kinds

ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}  # model_type -> architecture
GEMMA_LAYOUTS = tuple(ARCHITECTURES)


def is_gemma(config: GPTConfig) -> bool:
    """Whether `config` has one of Gemma's pieces (then only Gemma 3's or Gemma 2's layout holds it)."""
    return (config.post_norms or config.embed_scale or config.mlp == "geglu" or config.query_scale is not None
            or config.rope_local_theta is not None or config.rope_linear != 1 or bool(config.attention_softcap)
            or bool(config.logit_softcap))


def gemma_layout(config: GPTConfig) -> str:
    """"gemma3_text" or "gemma2", the layout holding `config`; ConfigError unless one does: Gemma's block whole,
    per-head q/k norms and every rotation whole and unscaled but linearly (Gemma 3), or no q/k norms, one rotary base
    and soft caps (Gemma 2); no mixture of experts."""
    gemma = (config.norm, config.mlp, config.positions) == ("rmsnorm", "geglu", "rope")
    if not (gemma and config.post_norms and config.embed_scale and config.qk_norm_whole is False) or config.bias \
            or config.qkv_bias or config.is_moe or config.is_mla or config.rotary_fraction != 1 or config.nope_every \
            or config.rope_scaling or config.rope_yarn or config.rope_longrope or config.attention_sinks \
            or config.mtp_depth:
        raise ConfigError("Gemma's pieces (post norms, the embedding scale, GeGLU, a query scale, a local rotary base, "
                          "soft caps) are written in transformers' Gemma 3 or Gemma 2 layout, which hold them with an "
                          "rmsnorm + geglu + rope block, no biases, no experts and no other rotary scaling")
    capped = bool(config.attention_softcap or config.logit_softcap)
    if config.qk_norm and not capped:
        return "gemma3_text"
    if not config.qk_norm and config.rope_local_theta is None and config.rope_linear == 1:
        return "gemma2"
    raise ConfigError("transformers' Gemma 3 layout has per-head q/k norms and no soft caps, Gemma 2's soft caps, no "
                      "q/k norms and one rotary base for every layer: this shape is neither")


def gemma_hf_config(config: GPTConfig, common: dict) -> dict:
    """config.json of the Gemma 3 text model or Gemma 2 model holding `config` (`common`: the fields every layout
    writes)."""
    kind = gemma_layout(config)
    kinds = layer_kinds(config.n_layers, config.full_attention_every) if config.window else [FULL] * config.n_layers
    fields = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind, **common, "pad_token_id": None,
        "max_position_embeddings": config.seq_len, "hidden_size": config.d_model, "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": config.norm_eps, "attention_bias": False, "attention_dropout": config.dropout,
        "query_pre_attn_scalar": _whole(config.query_scale or config.head_dim),  # an int to transformers 5
        "sliding_window": config.window or None, "layer_types": kinds,
        "attn_logit_softcapping": config.attention_softcap or None,
        "final_logit_softcapping": config.logit_softcap or None,
    }
    if kind == "gemma2":  # one rotary base (transformers 4's spelling beside 5's)
        return {**fields, "rope_parameters": {"rope_type": "default", "rope_theta": float(config.rope_theta)},
                "rope_theta": float(config.rope_theta)}
    full = {"rope_type": "linear", "factor": config.rope_linear} if config.rope_linear != 1 else {"rope_type": "default"}
    local = config.rope_theta if config.rope_local_theta is None else config.rope_local_theta
    return {**fields, "rope_parameters": {FULL: {**full, "rope_theta": float(config.rope_theta)},
                                          SLIDING: {"rope_type": "default", "rope_theta": float(local)}},
            "rope_theta": float(config.rope_theta), "rope_local_base_freq": float(local),  # transformers 4's spelling
            **({"rope_scaling": full} if config.rope_linear != 1 else {})}


def _whole(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def gemma_config(hf: dict, tied: bool, seq_len: int | None) -> GPTConfig:
    """The GPTConfig of a Gemma 3 text config.json (transformers 5's rope_parameters per layer type, or 4's
    rope_theta, rope_local_base_freq and rope_scaling) or a Gemma 2 one; ConfigError naming what minigpt would
    compute differently."""
    refuse_unless(hf.get("hidden_activation", "gelu_pytorch_tanh") == "gelu_pytorch_tanh",
                  f"its MLP activation is {hf.get('hidden_activation')!r}, not the tanh GELU")
    refuse_unless(not hf.get("attention_bias") and not hf.get("use_bidirectional_attention"),
                  "its attention has biases or is bidirectional")
    second = hf.get("model_type") == "gemma2"
    refuse_unless(second or (hf.get("final_logit_softcapping") is None and hf.get("attn_logit_softcapping") is None),
                  "a Gemma 3 that soft-caps its logits, which transformers' Gemma 3 does not")
    layers, heads = config_number(hf, "num_hidden_layers"), config_number(hf, "num_attention_heads")
    longest = config_number(hf, "max_position_embeddings")
    if seq_len is not None and seq_len > longest:
        raise ConfigError(f"--seq-len {seq_len} is longer than the model's max_position_embeddings ({longest})")
    window, every = _pattern(hf, layers)
    full_theta, local_theta, linear = _gemma2_rotation(hf) if second else _rotations(hf)
    caps = {"attention_softcap": float(hf.get("attn_logit_softcapping") or 0.0),
            "logit_softcap": float(hf.get("final_logit_softcapping") or 0.0)} if second else {}
    return GPTConfig(vocab_size=config_number(hf, "vocab_size"), seq_len=seq_len or longest, n_layers=layers,
                     n_heads=heads, n_kv_heads=config_number(hf, "num_key_value_heads", heads),
                     d_model=config_number(hf, "hidden_size"), d_ff=config_number(hf, "intermediate_size"),
                     d_head=config_number(hf, "head_dim", 256), tied_head=tied, mlp="geglu", norm="rmsnorm",
                     positions="rope", rope_theta=full_theta, bias=False, qk_norm=not second, post_norms=True,
                     embed_scale=True, query_scale=float(config_number(hf, "query_pre_attn_scalar", 256)),
                     rope_local_theta=local_theta if window else None, rope_linear=linear, window=window,
                     full_attention_every=every, norm_eps=config_number(hf, "rms_norm_eps", 1e-6), **caps)


def _gemma2_rotation(hf: dict) -> tuple[float, None, float]:
    """(Gemma 2's one rotary base, no local one, no linear factor): transformers 5's rope_parameters or 4's
    rope_theta, unscaled."""
    parameters = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10_000.0)}
    refuse_unless(isinstance(parameters, dict) and parameters.get("rope_type", "default") == "default"
                  and not hf.get("rope_scaling"), f"its rotation is scaled ({parameters!r})")
    return float(config_number(parameters, "rope_theta", 10_000.0)), None, 1.0


def _pattern(hf: dict, layers: int) -> tuple[int, int]:
    """(window, full_attention_every) of its layer_types (or sliding_window_pattern): every layer full (0, 0), or
    every N-th full and the others through the window, whether or not it is shorter than the context."""
    refuse_unless(isinstance(layers, int) and not isinstance(layers, bool) and layers > 0,
                  f"its num_hidden_layers is {layers!r}, not a whole number above 0")
    every = hf.get("sliding_window_pattern", 6)
    if not hf.get("layer_types"):
        refuse_unless(isinstance(every, int) and not isinstance(every, bool) and every > 0,
                      f"its sliding_window_pattern is {every!r}, not a whole number above 0")
    found = full_attention_every(hf.get("layer_types") or layer_kinds(layers, every), layers)
    return (0, 0) if found is None else (config_number(hf, "sliding_window"), found)


def _rotations(hf: dict) -> tuple[float, float, float]:
    """(the full layers' rotary base, the sliding layers', the full layers' linear factor)."""
    parameters = hf.get("rope_parameters")
    if isinstance(parameters, dict) and FULL in parameters:
        full, local = parameters.get(FULL) or {}, parameters.get(SLIDING) or {}
    else:
        scaling = hf.get("rope_scaling") or {}
        refuse_unless(isinstance(scaling, dict), f"its rope_scaling is {scaling!r}")
        full = {"rope_theta": hf.get("rope_theta", 1_000_000.0), **scaling}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    refuse_unless(isinstance(full, dict) and isinstance(local, dict),
                  f"its rotations per layer type are {full!r} and {local!r}")
    refuse_unless(local.get("rope_type", "default") == "default", "its sliding layers' rotation is scaled")
    kind = full.get("rope_type", full.get("type", "default"))
    refuse_unless(kind in ("default", "linear"), f"its full layers' rotation is scaled as {kind!r}, minigpt computes "
                                                  f"a linear factor there")
    linear = float(config_number(full, "factor")) if kind == "linear" else 1.0
    return (float(config_number(full, "rope_theta", 1_000_000.0)), float(config_number(local, "rope_theta", 10_000.0)),
            linear)


def gemma_names(ours: str, theirs: str) -> dict[str, tuple[str, ...]]:
    """A block's names in Gemma 3's layout beside Llama's q, k, v, o and MLP projections: its four norms."""
    return {ours + "ln1.weight": (theirs + "input_layernorm.weight",),
            ours + "post_attn_norm.weight": (theirs + "post_attention_layernorm.weight",),
            ours + "ln2.weight": (theirs + "pre_feedforward_layernorm.weight",),
            ours + "post_mlp_norm.weight": (theirs + "post_feedforward_layernorm.weight",)}


def norm_gain(tensor, ours: str, to_hf: bool):
    """A norm's weight in Gemma's (1 + weight) convention, or back; any other tensor as it is."""
    if not (ours.endswith("norm.weight") or ours.endswith(("ln1.weight", "ln2.weight", "norm_f.weight"))):
        return tensor
    return tensor - 1 if to_hf else tensor + 1
