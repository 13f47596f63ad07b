"""What a measured unit (simulator/costs/host.py) was measured on: the keys a unit is found by, read from a model
(unit_key) or checked from a profile's entry (shape_options), and the number check every field of a profile goes
through (positive). Torch-free."""

from __future__ import annotations

from minigpt.config import MLP_KINDS, NORM_KINDS, POSITION_KINDS, ROUTER_KINDS, GPTConfig
from minigpt.errors import ConfigError
from simulator.json_file import COUNT, SECONDS, finite_number

UNIT_KEYS = ("d_model", "n_heads", "d_ff", "seq_len", "vocab_size", "tp")
# The shape's options, keys of a unit too; a unit without them predates them and measured a GPT-2-style block
# (kv_heads None: as many as n_heads). Their values: minigpt/config.py's kinds.
UNIT_SHAPE_DEFAULTS = {"kv_heads": None, "mlp": "gelu", "norm": "layernorm", "positions": "learned", "bias": True,
                       "qkv_bias": False, "qk_norm": False, "d_head": None, "window": 0}
SHAPE_KINDS = {"mlp": MLP_KINDS, "norm": NORM_KINDS, "positions": POSITION_KINDS}
# A MoE unit's "experts": GPTConfig's fields, each with what it may be (d_expert: the width, resolved)
EXPERT_FIELDS = ("n_experts", "top_k", "d_expert", "n_shared_experts", "router", "capacity_factor")
# A unit of multi-head latent attention's "latent": its widths (v_head_dim: the value heads', resolved)
LATENT_FIELDS = ("kv_lora_rank", "q_lora_rank", "rope_head_dim", "v_head_dim")


def expert_key(model: GPTConfig) -> tuple | None:
    """A mixture of experts' block as a unit keys it (EXPERT_FIELDS' order, the width resolved); None: dense."""
    if not model.is_moe:
        return None
    return (model.n_experts, model.top_k, model.expert_width, model.n_shared_experts, model.router,
            model.capacity_factor)


def latent_key(model: GPTConfig) -> tuple | None:
    """Multi-head latent attention as a unit keys it (LATENT_FIELDS' order, d_value resolved); None: ordinary
    attention."""
    if not model.is_mla:
        return None
    return model.kv_lora_rank, model.q_lora_rank, model.rope_head_dim, model.v_head_dim


def unit_key(model: GPTConfig, tp: int) -> tuple:
    """What a unit is measured on: UNIT_KEYS' sizes, then the shape's options (UNIT_SHAPE_DEFAULTS' order), then its
    experts (expert_key: None for a dense block) and its latent attention (latent_key: None for ordinary)."""
    return (model.d_model, model.n_heads, model.d_ff, model.seq_len, model.vocab_size, tp,
            model.kv_heads, model.mlp, model.norm, model.positions, model.bias, model.qkv_bias, model.qk_norm,
            model.head_dim, model.window_in_use, expert_key(model), latent_key(model))


def positive(value: object, where: str, integer: bool = False, zero: bool = False, high: float | None = None) -> float:
    """A number > 0 (>= 0 with `zero`), at most `high` (default: a count for an integer, seconds otherwise;
    simulator/json_file.py's ranges, within which no simulated step overflows)."""
    kinds = (int,) if integer else (int, float)
    high = high if high is not None else COUNT[1] if integer else SECONDS[1]
    if not isinstance(value, kinds) or finite_number(value) is None or value < 0 or (value == 0 and not zero) or (
            value > high):
        kind = "positive integer" if integer else "number >= 0" if zero else "number > 0"
        raise ConfigError(f"{where} must be a {kind} of at most {high:g}, got {value!r}")
    return value


def shape_options(entry: dict, at: str, n_heads: int, d_model: int) -> tuple:
    """A unit's shape options (UNIT_SHAPE_DEFAULTS' order), the defaults where it has none."""
    options = {**UNIT_SHAPE_DEFAULTS, **{k: entry[k] for k in UNIT_SHAPE_DEFAULTS if k in entry}}
    kv = n_heads if options["kv_heads"] is None else options["kv_heads"]
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or n_heads % kv:
        raise ConfigError(f"{at}.kv_heads must be a positive integer dividing n_heads={n_heads}, got {kv!r}")
    for name, kinds in SHAPE_KINDS.items():
        if options[name] not in kinds:
            raise ConfigError(f"{at}.{name} must be one of {', '.join(kinds)}, got {options[name]!r}")
    for name in ("bias", "qkv_bias", "qk_norm"):
        if not isinstance(options[name], bool):
            raise ConfigError(f"{at}.{name} must be true or false, got {options[name]!r}")
    head_dim = options["d_head"]
    if head_dim is None:
        head_dim = d_model // n_heads
    elif isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ConfigError(f"{at}.d_head must be a positive integer (or absent: d_model / n_heads), got {head_dim!r}")
    window = options["window"]
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ConfigError(f"{at}.window must be a whole number >= 0 (0: no sliding window), got {window!r}")
    return (kv, options["mlp"], options["norm"], options["positions"], options["bias"], options["qkv_bias"],
            options["qk_norm"], head_dim, window, _experts(entry, at), _latent(entry, at))


def _section(entry: dict, at: str, name: str, fields: tuple[str, ...]) -> dict | None:
    """A unit's optional section `name` (None where absent), checked to hold exactly `fields`."""
    section = entry.get(name)
    if section is not None and (not isinstance(section, dict) or set(section) != set(fields)):
        raise ConfigError(f"{at}.{name} must hold exactly {', '.join(fields)}")
    return section


def _experts(entry: dict, at: str) -> tuple | None:
    """A unit's "experts" as expert_key keys them (None: a dense block's unit)."""
    experts = _section(entry, at, "experts", EXPERT_FIELDS)
    if experts is None:
        return None
    counts = [int(positive(experts[k], f"{at}.experts.{k}", integer=True, high=2**20, zero=k == "n_shared_experts"))
              for k in EXPERT_FIELDS[:4]]
    if counts[1] > counts[0]:
        raise ConfigError(f"{at}.experts.top_k must be at most n_experts={counts[0]}, got {counts[1]}")
    if experts["router"] not in ROUTER_KINDS:
        raise ConfigError(f"{at}.experts.router must be one of {', '.join(ROUTER_KINDS)}, got {experts['router']!r}")
    factor = experts["capacity_factor"]
    if factor is not None:
        factor = float(positive(factor, f"{at}.experts.capacity_factor", high=2**20))
    return (*counts, experts["router"], factor)


def _latent(entry: dict, at: str) -> tuple | None:
    """A unit's "latent" (multi-head latent attention) as latent_key keys it (None: ordinary attention)."""
    latent = _section(entry, at, "latent", LATENT_FIELDS)
    if latent is None:
        return None
    return tuple(int(positive(latent[k], f"{at}.latent.{k}", integer=True, high=2**20, zero=k == "q_lora_rank"))
                 for k in LATENT_FIELDS)
