"""Which layers of a transformers model attend through its sliding window (its layer_types, Mistral's sliding_window,
the Qwens' max_window_layers), both ways: every layer, none, or all but every N-th (GPTConfig.full_attention_every's
pattern); and which rotate (SmolLM3's no_rope_layers: GPTConfig.nope_every). Torch-free."""

from __future__ import annotations

from minigpt.config import GPTConfig
from minigpt.hf.moe import config_number, refuse_unless

SLIDING, FULL = "sliding_attention", "full_attention"
UNIFORM_WINDOWS = ("mistral", "phi3", "mixtral")  # whose sliding_window, when set, is every layer's
LAYER_TYPES = ("qwen2", "qwen3", "gpt_oss", "gemma3_text", "gemma2", "olmo3")  # whose layer_types say which layers slide
WINDOWED_LAYOUTS = ("mistral", "mixtral", "phi3", *LAYER_TYPES)  # the layouts minigpt writes a window in


def layer_kinds(layers: int, every: int) -> list[str]:
    """Each layer's kind when every `every`-th attends to the whole context (0: none does; GPTConfig.layer_window)."""
    return [FULL if every and (i + 1) % every == 0 else SLIDING for i in range(layers)]


def full_attention_every(kinds, layers: int) -> int | None:
    """full_attention_every of a layer_types list: 0 when every layer slides, N when all but every N-th do, None
    when none does; ConfigError for another list or pattern."""
    refuse_unless(isinstance(kinds, list) and len(kinds) == layers and set(kinds) <= {SLIDING, FULL},
                  f"its layer_types are {kinds!r}, not one of {SLIDING!r} or {FULL!r} per layer")
    if SLIDING not in kinds:
        return None
    every = next((n for n in range(2, layers + 1) if kinds == layer_kinds(layers, n)), None) if FULL in kinds else 0
    refuse_unless(every is not None, f"its layers attend through the window in a pattern minigpt does not compute "
                                     f"({kinds}): every layer, or all but every N-th")
    return every


def layer_types(config: GPTConfig) -> dict:
    """A Qwen2, Qwen3 or GPT-OSS config.json's window fields: none in use, or the window and each layer's kind."""
    if not config.window_in_use:
        return {"use_sliding_window": False, "sliding_window": None}
    return {"use_sliding_window": True, "sliding_window": config.window,
            "layer_types": layer_kinds(config.n_layers, config.full_attention_every)}


def windows(hf: dict, kind: str, seq_len: int | None) -> dict:
    """The GPTConfig fields of a model's sliding window shorter than the training context (none where there is none,
    or one as long): a Mistral's, Phi-3's or Mixtral's in every layer, a Qwen2's, Qwen3's or GPT-OSS's in the layers its
    layer_types (else max_window_layers) name, every layer or all but every N-th (full_attention_every);
    ConfigError for another pattern or model."""
    if full_attention(hf, seq_len):
        return {}
    window = config_number(hf, "sliding_window")
    if kind in UNIFORM_WINDOWS and not hf.get("layer_types"):
        return {"window": window}
    refuse_unless(kind in LAYER_TYPES, "it attends through a sliding window shorter than the context in some of its "
                                       "layers, which minigpt reads of Qwen2, Qwen3 and GPT-OSS models only "
                                       "(layer_types)")
    layers = config_number(hf, "num_hidden_layers")
    kinds = hf.get("layer_types") or [SLIDING if i >= hf.get("max_window_layers", 28) else FULL for i in range(layers)]
    every = full_attention_every(kinds, layers)
    return {} if every is None else {"window": window, "full_attention_every": every}


def full_attention(hf: dict, seq_len: int | None) -> bool:
    """Whether every position of the training context (seq_len, or max_position_embeddings) attends to all before
    it: no sliding window in use, or one at least as long (a token sees the window's tokens, itself the last).
    Mistral's, Phi-3's and Mixtral's window is in use whenever sliding_window is set; the Qwens' only with
    use_sliding_window or a "sliding_attention" layer (a window in use whose length is not given: not full)."""
    window = hf.get("sliding_window")
    in_use = hf.get("use_sliding_window", window is not None) or "sliding_attention" in (hf.get("layer_types") or ())
    if not in_use:
        return True
    context = seq_len or config_number(hf, "max_position_embeddings")
    return window is not None and context <= config_number(hf, "sliding_window")


def nope_every(hf: dict, layers: int) -> int:
    """SmolLM3's no_rope_layers (1: the layer rotates) as nope_every: every no_rope_layer_interval-th layer without
    rotary positions (its default list), or none; ConfigError for another pattern or a sliding window."""
    refuse_unless(not hf.get("use_sliding_window"), "it attends through a sliding window in its unrotated layers")
    every = hf.get("no_rope_layer_interval", 4)
    refuse_unless(isinstance(every, int) and not isinstance(every, bool) and every > 0,
                  f"its no_rope_layer_interval is {every!r}, not a whole number above 0")
    listed = hf.get("no_rope_layers")
    if listed is None or listed == [1] * layers:
        return 0 if listed is not None else every
    refuse_unless(listed == [int((layer + 1) % every != 0) for layer in range(layers)],
                  f"its unrotated layers (no_rope_layers {listed}) are not every {every}-th")
    return every
