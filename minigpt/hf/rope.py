"""Rotary positions in transformers' config.json and tensors, both ways: the base and its scaling (Llama 3.1's, YaRN's,
LongRoPE's) read and written, and a partial rotation's columns moved between transformers' first and our last ones.
Torch-free except the tensor function."""

from __future__ import annotations

import math

from minigpt.config import GPTConfig
from minigpt.hf.moe import config_number as _number, refuse_unless

LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")  # rope_scaling's


def read_rope(hf: dict) -> tuple[float, dict]:
    """(base, the GPTConfig fields of its scaling: rope_scaling, rope_yarn or rope_longrope, none when unscaled) of
    a transformers 5 rope_parameters or a transformers 4 rope_theta and rope_scaling; ConfigError for a scaling
    minigpt does not compute (Llama 3.1's "llama3", YaRN's "yarn" and LongRoPE's "longrope" it does)."""
    parameters, legacy = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    refuse_unless(isinstance(parameters, dict) and isinstance(legacy, dict),
                  f"its rope_parameters / rope_scaling are {parameters!r} / {legacy!r}")
    rope = {"rope_theta": hf.get("rope_theta") or 10000.0, **parameters, **legacy}
    kind = next((d.get("rope_type", d.get("type")) for d in (legacy, parameters) if d.get("rope_type", d.get("type"))),
                "default")
    theta = float(_number(rope, "rope_theta"))
    if kind == "default":
        return theta, {}
    if kind == "yarn":
        refuse_unless(rope.get("attention_factor") is None and rope.get("truncate", True) in (True, False)
                      and rope.get("factor") is not None and "original_max_position_embeddings" in rope,
                      f"its YaRN scaling ({rope}) sets attention_factor or a truncate neither true nor false, or "
                      f"leaves out factor or original_max_position_embeddings")
        context = _number(rope, "original_max_position_embeddings")
        refuse_unless(float(context).is_integer(), f"its YaRN original_max_position_embeddings is {context!r}")
        unset = {"beta_fast": 32, "beta_slow": 1, "mscale": 0, "mscale_all_dim": 0}  # transformers' defaults, None
        numbers = {key: float(_number(rope, key, default) if rope.get(key) is not None else default)
                   for key, default in unset.items()}
        truncate = {} if rope.get("truncate", True) else {"rope_yarn_truncate": False}
        return theta, {"rope_yarn": (float(_number(rope, "factor")), int(context), *numbers.values()), **truncate}
    if kind == "longrope":
        return theta, {"rope_longrope": longrope(hf, rope)}
    refuse_unless(kind == "llama3" and all(key in rope for key in LLAMA3_ROPE),
                  f"its rotary embedding is scaled as {kind!r} ({rope}); minigpt computes Llama 3.1's 'llama3', "
                  f"YaRN's 'yarn' and LongRoPE's 'longrope'")
    return theta, {"rope_scaling": tuple(_number(rope, key) for key in LLAMA3_ROPE)}


def longrope(hf: dict, rope: dict) -> tuple:
    """rope_longrope of a config.json, as transformers' _compute_longrope_parameters reads it: the original context
    (the rotation's or the config's original_max_position_embeddings), the attention factor its own, else
    sqrt(1 + ln(factor) / ln(original)) (1 when factor <= 1), factor its own, else max_position_embeddings /
    original."""
    original = rope.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    factors = [rope.get(key) for key in ("short_factor", "long_factor")]
    refuse_unless(isinstance(original, int) and not isinstance(original, bool) and original > 1
                  and all(isinstance(f, list) and all(is_number(v) for v in f) for f in factors),
                  f"its LongRoPE scaling ({rope}) leaves out short_factor, long_factor (lists of numbers) or a whole "
                  f"original_max_position_embeddings")
    factor = rope.get("factor") or _number(hf, "max_position_embeddings") / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    refuse_unless(is_number(attention), f"its LongRoPE attention_factor is {attention!r}")
    return tuple(float(v) for v in factors[0]), tuple(float(v) for v in factors[1]), original, float(attention)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def rope_fields(config: GPTConfig) -> dict:
    """rope_parameters (and transformers 4's rope_scaling) of `config`'s rotation, as _rope reads them."""
    rope = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if config.rope_scaling is not None:
        rope = {**rope, "rope_type": "llama3", **dict(zip(LLAMA3_ROPE, config.rope_scaling))}
    elif config.rope_yarn is not None:
        factor, context, fast, slow, mscale, mscale_all_dim = config.rope_yarn
        rope = {**rope, "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": context,
                "beta_fast": fast, "beta_slow": slow, **({"mscale": mscale} if mscale else {}),
                **({"mscale_all_dim": mscale_all_dim} if mscale_all_dim else {}),
                **({} if config.rope_yarn_truncate else {"truncate": False})}
    elif config.rope_longrope is not None:
        short, long, original, attention = config.rope_longrope
        rope = {**rope, "rope_type": "longrope", "short_factor": list(short), "long_factor": list(long),
                "original_max_position_embeddings": original, "attention_factor": attention}
    if config.rotary_fraction != 1:
        rope["partial_rotary_factor"] = config.rotary_fraction
    return {"rope_theta": float(config.rope_theta), "rope_parameters": rope,  # transformers 4 reads rope_theta,
            **({"rope_scaling": rope} if rope["rope_type"] != "default" else {})}  # 5 rope_parameters, 4 this


def partial_rope_fields(config: GPTConfig, rope_parameters: dict) -> dict:
    """A layout's partial_rotary_factor written where it is 1 too (GLM-4.5's and MiniMax-M2's defaults are not 1):
    in rope_parameters (transformers 5) and at the top level (transformers 4), beside `rope_parameters`."""
    return {"rope_parameters": {**rope_parameters, "partial_rotary_factor": config.rotary_fraction},
            "partial_rotary_factor": config.rotary_fraction}


def rotation_moved(tensor, config: GPTConfig, ours: str, to_hf: bool):
    """Our tensor `ours` with each query and key head's rotated columns first (transformers' partial_rotary_factor
    turns each head's first ones) from last (ours, as multi-head latent attention's), or back: the qkv weight's and
    bias's rows, the per-head q/k norms' gains; the same product of each query with each key, the rotation on the same
    columns. Other tensors, whole rotations and latent attention unchanged."""
    import torch

    if config.rotary_fraction == 1 or config.is_mla:
        return tensor
    shift = config.rotary_dim if to_hf else -config.rotary_dim
    if ours.endswith(("attn.core.q_norm.weight", "attn.core.k_norm.weight")):  # one head's gains, or every head's
        return torch.roll(tensor.unflatten(0, (-1, config.head_dim)), shift, dims=1).flatten()
    if not ours.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        return tensor
    rows = (config.n_heads + config.kv_heads) * config.head_dim  # the query and key heads; the values unturned
    moved = torch.roll(tensor[:rows].unflatten(0, (-1, config.head_dim)), shift, dims=1)
    return torch.cat([moved.flatten(0, 1), tensor[rows:]])


def partial_rotary_factor(hf: dict, default: float) -> float:
    """The share of each head a config.json turns: its partial_rotary_factor (transformers 4's, top level) or its
    rope_parameters' (transformers 5's), `default` where neither says; ConfigError when it is not a number."""
    parameters = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}  # (read_rope
    rotated = hf.get("partial_rotary_factor", parameters.get("partial_rotary_factor", default))  # refuses another)
    refuse_unless(is_number(rotated), f"its partial_rotary_factor is {rotated!r}")
    return float(rotated)
