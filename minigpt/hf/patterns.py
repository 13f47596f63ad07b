"""Which layers of a transformers model attend through its sliding window (its layer_types), both ways: every
layer, none, or all but every N-th (GPTConfig.full_attention_every's pattern). Torch-free."""

from __future__ import annotations

from minigpt.hf.moe import refuse_unless

SLIDING, FULL = "sliding_attention", "full_attention"


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
