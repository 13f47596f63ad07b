"""The model flags, one vocabulary for `train`, `simulate` and `compare`: a preset and any field over it.

A mixture of experts (minigpt/moe.py) is a preset (tiny-moe, mixtral-8x7b, deepseek-v3) or --experts N over any
preset; --top-k, --expert-width, --shared-experts, --dense-layers, --router, --renormalize-gates, --capacity-factor,
--aux-loss-coef, --z-loss-coef and the others of EXPERT_FIELDS change its fields (GPTConfig's n_experts, top_k,
d_expert, n_shared_experts, dense_layers, router, renormalize_gates, capacity_factor, ...) and are refused, in one
line, on a dense model.

--tokenizer (minigpt/tokenizer.py) sets the vocabulary: a tokenizer.json's own, or --vocab-size when that is at
least it (smaller: refused); `bytes` given sets 256; left out, the preset's vocabulary stands."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import click

from minigpt.config import MLP_KINDS, NORM_KINDS, POSITION_KINDS, ROUTER_KINDS, GPTConfig
from minigpt.presets import PRESETS, build_config
from minigpt.errors import ConfigError, check_positive_int
from minigpt.tokenizer import model_vocab_size

POSITIVE = ("layers", "heads", "kv_heads", "d_model", "d_ff", "seq_len", "vocab_size", "head_dim")
# --norm-placement: where a block's norms sit (GPTConfig.pre_norms, post_norms)
NORM_PLACES = {"pre": {"pre_norms": True, "post_norms": False}, "post": {"pre_norms": False, "post_norms": True},
               "both": {"pre_norms": True, "post_norms": True}}


def model_options(default: str) -> Callable:
    """Click options for the model, `--model` defaulting to preset `default`."""
    options = [
        click.option("--model", default=default, show_default=True, metavar="PRESET|CONFIG",
                     help=f"Model preset: {', '.join(PRESETS)}; or a transformers model's config.json (or the "
                          f"directory holding it: its shape, read as --init-from reads it, no weights); the flags "
                          f"below override its fields."),
        click.option("--layers", type=int, help="Transformer blocks."),
        click.option("--heads", type=int, help="Attention (query) heads."),
        click.option("--kv-heads", "kv_heads", type=int,
                     help="Key/value heads (grouped-query attention; must divide --heads) [default: the preset's]."),
        click.option("--d-model", "--hidden", "d_model", type=int,
                     help="Model width (without --d-ff the MLP keeps the preset's ratio)."),
        click.option("--d-ff", "d_ff", type=int, help="MLP width (for SwiGLU: each of its gate and up projections)."),
        click.option("--seq-len", "seq_len", type=int, help="Sequence length."),
        click.option("--vocab-size", "--vocab", "vocab_size", type=int,
                     help="Vocabulary size [default: the preset's, or --tokenizer's vocabulary]."),
        click.option("--tokenizer", type=str, metavar="bytes|FILE",
                     help="bytes (UTF-8 bytes, vocabulary 256) or a Hugging Face tokenizer.json (or a directory "
                          "holding one): the model's vocabulary is the tokenizer's [default: bytes, with the "
                          "preset's vocabulary]."),
        click.option("--untied/--tied", "untied", default=None,
                     help="The LM head with its own weights, or sharing the token embedding [default: the preset's]."),
        click.option("--mlp", type=click.Choice(MLP_KINDS), help="MLP: gelu (GPT-2), swiglu (Llama) or relu2 "
                     "(squared ReLU: Nemotron-4)."),
        click.option("--norm", type=click.Choice(NORM_KINDS), help="Norm: layernorm (GPT-2) or rmsnorm (Llama)."),
        click.option("--positions", type=click.Choice(POSITION_KINDS),
                     help="Positions: learned embeddings (GPT-2) or rope, rotary (Llama)."),
        click.option("--rope-theta", "rope_theta", type=float, help="RoPE base (Llama 3: 500000)."),
        click.option("--bias/--no-bias", "bias", default=None, help="Biases in the Linears [default: the preset's]."),
        click.option("--qkv-bias/--no-qkv-bias", "qkv_bias", default=None,
                     help="Biases in the query, key and value projections, the other Linears as --bias says (Qwen2) "
                          "[default: the preset's]."),
        click.option("--dropout", type=float, help="Dropout probability [default: the preset's, 0]."),
        click.option("--head-dim", "head_dim", type=int,
                     help="Each attention head's width [default: the preset's; else --d-model / --heads]."),
        *rotation_options(),
        click.option("--window", type=int,
                     help="A sliding window: each query attends to itself and the window - 1 tokens before it "
                          "(Mistral 7B: 4096; 0: the whole context) [default: the preset's]."),
        click.option("--full-attention-every", "full_attention_every", type=int,
                     help="With --window: every N-th block attends to the whole context, the others through the "
                          "window (Gemma 3: 6, GPT-OSS: 2); 0: every block through it [default: the preset's, 0]."),
        click.option("--attention-sinks/--no-attention-sinks", "attention_sinks", default=None,
                     help="A learned logit per query head in each softmax's denominator (GPT-OSS's sinks) "
                          "[default: the preset's]."),
        click.option("--qk-norm/--no-qk-norm", "qk_norm", default=None,
                     help="RMS-normalise each query and key head before the rotation (Qwen3) [default: the preset's]."),
        click.option("--qk-norm-whole/--no-qk-norm-whole", "qk_norm_whole", default=None,
                     help="With --qk-norm: q and k each normalised over all their heads at once, a gain per column "
                          "(OLMo 2's) [default: the preset's, per head]."),
        click.option("--norm-placement", "norm_placement", type=click.Choice(NORM_PLACES), default=None,
                     help="Where the block's norms sit: before each branch (pre: GPT-2, Llama), after each branch's "
                          "output only (post: OLMo 2), or both (Gemma's) [default: the preset's]."),
        click.option("--mtp-depth", "mtp_depth", type=int,
                     help="Multi-token prediction modules after the last block (DeepSeek-V3's: 1), module k "
                          "predicting the token k + 1 places on; 0: none [default: the preset's]."),
        click.option("--mtp-weight", "mtp_weight", type=float,
                     help="Their mean loss's weight beside the next token's (DeepSeek-V3's lambda: 0.3, then 0.1) "
                          "[default: the preset's, 0.1]."),
        *scaling_options(),
        *latent_options(),
        *expert_options(),
    ]

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def rotation_options() -> list:
    """How rotary positions turn beyond the base: YaRN's extension, part of each head, blocks without them."""
    return [
        click.option("--rope-yarn", "rope_yarn", metavar="FACTOR[,ORIGINAL[,FAST,SLOW[,MSCALE,MSCALE_ALL]]]",
                     help="Extend a rotary model's context by YaRN (DeepSeek-V3's and Qwen3's long-context recipe): "
                          "its frequencies scaled by FACTOR beyond the ORIGINAL context [default: the model's own], "
                          "beta_fast and beta_slow [32, 1], DeepSeek's mscales [unset]; --seq-len up to FACTOR x "
                          "ORIGINAL; with --init-from too."),
        click.option("--rotary-fraction", "rotary_fraction", type=float,
                     help="The share of each query and key head rotary positions turn, its last columns (Phi-4-mini: "
                          "0.75, Nemotron-4: 0.5; an even number of columns) [default: the preset's, 1]."),
        click.option("--nope-every", "nope_every", type=int,
                     help="Every N-th block attends without rotary positions (SmolLM3: 4); 0: every block rotates "
                          "[default: the preset's, 0]."),
    ]


def scaling_options() -> list:
    """Gemma 2's soft caps and Granite's scalings of the scores, logits, embeddings and branches (SCALING_FIELDS)."""
    return [
        click.option("--attention-softcap", "attention_softcap", type=float,
                     help="Cap each attention score at C: C x tanh(score / C) (Gemma 2: 50); 0: none [default: the "
                          "preset's]."),
        click.option("--logit-softcap", "logit_softcap", type=float,
                     help="Cap each output logit at C: C x tanh(logit / C) (Gemma 2: 30); 0: none [default: the "
                          "preset's]."),
        click.option("--embed-multiplier", "embed_multiplier", type=float,
                     help="Granite's: the token embeddings times M (Granite 3: 12) [default: the preset's, 1]."),
        click.option("--residual-multiplier", "residual_multiplier", type=float,
                     help="Granite's: each branch times M before its residual add (Granite 3: 0.22) [default: 1]."),
        click.option("--attention-multiplier", "attention_multiplier", type=float,
                     help="Granite's: the softmax scale itself (Granite 3: 0.0078125) [default: 1 / sqrt(head width)]."),
        click.option("--logit-divisor", "logit_divisor", type=float,
                     help="Granite's logits_scaling: the output logits divided by D (Granite 3 8B: 16) [default: 1]."),
    ]


# flag -> GPTConfig field of the mixture-of-experts options (--experts itself is n_experts)
LATENT_FIELDS = {"kv_lora_rank": "kv_lora_rank", "q_lora_rank": "q_lora_rank", "rope_head_dim": "rope_head_dim",
                 "v_head_dim": "d_value"}  # flag name: GPTConfig field


def latent_options() -> list:
    """Multi-head latent attention's shape (DeepSeek-V2/V3): minigpt/model.py's LatentAttention."""
    return [
        click.option("--kv-lora-rank", "kv_lora_rank", type=int,
                     help="Multi-head latent attention's key/value latent width (0: ordinary attention; DeepSeek-V3: "
                          "512) [default: the preset's]."),
        click.option("--q-lora-rank", "q_lora_rank", type=int,
                     help="Its query latent width (0: queries straight from the width; DeepSeek-V3: 1536)."),
        click.option("--rope-head-dim", "rope_head_dim", type=int,
                     help="Its rotated columns after each query and key head's --head-dim (DeepSeek-V3: 64)."),
        click.option("--v-head-dim", "v_head_dim", type=int,
                     help="Its value heads' width [default: --head-dim]."),
    ]


EXPERT_FIELDS = {"top_k": "top_k", "expert_width": "d_expert", "shared_experts": "n_shared_experts",
                 "dense_layers": "dense_layers", "router": "router", "capacity_factor": "capacity_factor",
                 "aux_loss_coef": "aux_loss_coef", "z_loss_coef": "z_loss_coef", "expert_groups": "expert_groups",
                 "groups_per_token": "groups_per_token", "routed_scale": "routed_scale", "expert_bias": "expert_bias",
                 "expert_bias_rate": "expert_bias_rate", "router_bias": "router_bias",
                 "renormalize_gates": "renormalize_gates", "group_score_top": "group_score_top",
                 "shared_expert_gate": "shared_expert_gate", "moe_every": "moe_every"}


def expert_options() -> list:
    return [
        click.option("--experts", type=int, help="Routed experts per MoE layer (0: a dense model) [default: the "
                                                  "preset's]."),
        click.option("--top-k", "top_k", type=int, help="Experts each token is routed to."),
        click.option("--expert-width", "expert_width", type=int, help="Each expert's MLP width [default: --d-ff]."),
        click.option("--shared-experts", "shared_experts", type=int, help="Experts every token goes through."),
        click.option("--dense-layers", "dense_layers", type=int, help="First blocks that keep the dense MLP."),
        click.option("--moe-every", "moe_every", type=int, help="After those, every N-th block a mixture of experts "
                     "(blocks N - 1, 2N - 1, ...), the others dense (Megatron's --moe-layer-freq; GShard's 2) "
                     "[default: 1, every block]."),
        click.option("--shared-expert-gate/--no-shared-expert-gate", "shared_expert_gate", default=None,
                     help="The shared experts' output times a learned sigmoid gate per token (Qwen2-MoE's) [default: "
                          "the preset's]."),
        click.option("--router", type=click.Choice(ROUTER_KINDS), help="Router scores: softmax, or sigmoid "
                                                                       "renormalised over the top k (DeepSeek-V3)."),
        click.option("--router-bias/--no-router-bias", "router_bias", default=None,
                     help="A bias on the router's logits (GPT-OSS's) [default: the preset's]."),
        click.option("--renormalize-gates/--no-renormalize-gates", "renormalize_gates", default=None,
                     help="Divide the chosen gates by their sum (top k above 1 or a sigmoid router; Mixtral, "
                          "Qwen3-MoE, DeepSeek-V3); --no-renormalize-gates keeps the chosen scores as they are "
                          "(OLMoE, Qwen1.5-MoE, DeepSeek-V2) [default: the preset's]."),
        click.option("--capacity-factor", "capacity_factor", type=float,
                     help="Each expert takes at most ceil(cf x tokens x k / E) of a sequence [default: dropless]."),
        click.option("--aux-loss-coef", "aux_loss_coef", type=float, help="Load-balancing loss coefficient."),
        click.option("--z-loss-coef", "z_loss_coef", type=float, help="Router z-loss coefficient."),
        click.option("--expert-groups", "expert_groups", type=int,
                     help="The experts in this many equal groups (DeepSeek-V3: 8) [default: 1]."),
        click.option("--groups-per-token", "groups_per_token", type=int,
                     help="Each token's experts from its best this many groups (DeepSeek-V3's node-limited routing: "
                          "4) [default: all]."),
        click.option("--group-score-top", "group_score_top", type=int,
                     help="Each group scored by the sum of its this many best experts' scores (DeepSeek-V3: 2; "
                          "DeepSeek-V2: 1, its best) [default: 2]."),
        click.option("--routed-scale", "routed_scale", type=float,
                     help="The chosen gates multiplied by this (DeepSeek-V3: 2.5) [default: 1]."),
        click.option("--expert-bias/--no-expert-bias", "expert_bias", default=None,
                     help="A per-expert bias added to the scores to choose experts only (DeepSeek-V3's auxiliary-"
                          "loss-free balancing) [default: the preset's; on with --expert-bias-rate above 0]."),
        click.option("--expert-bias-rate", "expert_bias_rate", type=float,
                     help="How far that bias moves after each step, towards the experts below the mean load "
                          "(DeepSeek-V3: 0.001; 0: frozen)."),
    ]


def _expert_fields(options: dict, base: GPTConfig) -> dict:
    """The mixture-of-experts fields the flags set; ConfigError when one is given for a dense model."""
    fields = {field: options.get(flag) for flag, field in EXPERT_FIELDS.items()}
    experts = options.get("experts")
    if experts is not None and (not isinstance(experts, int) or isinstance(experts, bool) or experts < 0):
        raise ConfigError(f"--experts must be a whole number >= 0 (0: a dense model), got {experts!r}")
    dense = experts == 0 or (experts is None and not base.is_moe)
    given = [flag for flag, field in EXPERT_FIELDS.items() if fields[field] is not None]
    if dense and given:
        raise ConfigError(f"--{given[0].replace('_', '-')} sets a mixture of experts' field, but this model is dense: "
                          f"give --experts N (or a MoE preset: tiny-moe, mixtral-8x7b, qwen3-30b-a3b, deepseek-v3)")
    rate = fields["expert_bias_rate"]
    if fields["expert_bias"] is None and isinstance(rate, (int, float)) and rate > 0:
        fields["expert_bias"] = True  # a rate moves a bias: --expert-bias-rate alone turns it on
    if fields["expert_bias"] is False and rate is None:
        fields["expert_bias_rate"] = 0.0  # and --no-expert-bias alone turns the preset's rate off with it
    return {"n_experts": experts, **fields}


def base_model(model: str) -> GPTConfig:
    """--model's shape: a preset's, or a transformers config.json's (a file, or a directory holding one), read by
    minigpt/hf/layouts.py as --init-from reads it; ConfigError for anything else."""
    if model in PRESETS:
        return PRESETS[model]
    if not Path(model).exists():
        raise ConfigError(f"unknown model preset {model!r}: choose one of {', '.join(PRESETS)}, or give a transformers "
                          f"model's config.json (or the directory holding it)")
    from minigpt.hf.layouts import config_from_hf
    from minigpt.hf.files import read_config, read_config_file

    path = Path(model)
    return config_from_hf(read_config(path) if path.is_dir() else read_config_file(path))


def model_from_options(options: dict) -> GPTConfig:
    """The checked model the flags describe; raises ConfigError (one line, exit 2) on a bad value."""
    for name in POSITIVE:
        if options.get(name) is not None:
            check_positive_int(f"--{name.replace('_', '-')}", options[name])
    untied = options.get("untied")
    vocab_size = options.get("vocab_size")
    if options.get("tokenizer") is not None:  # before the shape's other checks: a file that does not parse says so
        vocab_size = model_vocab_size(options["tokenizer"], vocab_size)
    base = base_model(options["model"])
    yarn = options.get("rope_yarn")
    config = build_config(
        base, vocab_size=vocab_size, seq_len=None if yarn else options.get("seq_len"),
        n_layers=options.get("layers"), n_heads=options.get("heads"), n_kv_heads=options.get("kv_heads"),
        d_model=options.get("d_model"), d_ff=options.get("d_ff"), tied_head=None if untied is None else not untied,
        dropout=options.get("dropout"), mlp=options.get("mlp"), norm=options.get("norm"),
        positions=options.get("positions"), rope_theta=options.get("rope_theta"), bias=options.get("bias"),
        d_head=options.get("head_dim"), qk_norm=options.get("qk_norm"), qkv_bias=options.get("qkv_bias"),
        window=options.get("window"), full_attention_every=options.get("full_attention_every"),
        attention_sinks=options.get("attention_sinks"), rotary_fraction=options.get("rotary_fraction"),
        nope_every=options.get("nope_every"), qk_norm_whole=options.get("qk_norm_whole"),
        **{name: options.get(name) for name in SCALING_FIELDS},
        **NORM_PLACES.get(options.get("norm_placement"), {}),
        mtp_depth=options.get("mtp_depth"), mtp_weight=options.get("mtp_weight"),
        **{field: options.get(flag) for flag, field in LATENT_FIELDS.items()},
        **_expert_fields(options, base),
    )
    return config if yarn is None else with_yarn(config, yarn, options.get("seq_len"))


def with_yarn(config: GPTConfig, text: str, seq_len: int | None) -> GPTConfig:
    """`config` extended by --rope-yarn's YaRN (its ORIGINAL context defaulting to the model's own), at `seq_len`
    (default: that context); ConfigError for a model already scaled, unrotated, or a context beyond the factor's."""
    if config.positions != "rope" or config.rope_scaling is not None or config.rope_yarn is not None:
        raise ConfigError("--rope-yarn extends a rotary model whose rotation is not scaled yet: this one has "
                          + ("learned positions" if config.positions != "rope" else "its scaling already"))
    try:
        numbers = [float(part) for part in str(text).split(",")]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 2, 4, 6) or (len(numbers) > 1 and not numbers[1].is_integer()):
        raise ConfigError(f"--rope-yarn takes FACTOR[,ORIGINAL[,FAST,SLOW[,MSCALE,MSCALE_ALL]]], numbers apart by "
                          f"commas (ORIGINAL a whole context), got {text!r}")
    factor, original = numbers[0], int(numbers[1]) if len(numbers) > 1 else config.seq_len
    betas, mscales = numbers[2:4] or [32.0, 1.0], numbers[4:6] or [0.0, 0.0]  # transformers' defaults, unset
    extended = config.with_(rope_yarn=(factor, original, *betas, *mscales))
    seq = config.seq_len if seq_len is None else seq_len
    if seq > factor * original:
        raise ConfigError(f"--seq-len {seq} is beyond YaRN's reach of {factor:g} x {original} tokens: raise the "
                          f"factor or shorten the context")
    return extended.with_(seq_len=seq)


# scaling_options' flags, each its GPTConfig field's name: Gemma 2's caps, Granite's scalings
SCALING_FIELDS = ("attention_softcap", "logit_softcap", "embed_multiplier", "residual_multiplier",
                  "attention_multiplier", "logit_divisor")

# the model flags an imported model's shape leaves open: its training context (rotary models) and dropout, and a
# mixture of experts' routing in training (its balance and z-loss coefficients, a capacity factor)
ROUTING_IN_TRAINING = ("aux_loss_coef", "z_loss_coef", "capacity_factor", "expert_bias_rate")
OPEN_WITH_INIT = ("seq_len", "dropout", "rope_yarn", "mtp_weight", *ROUTING_IN_TRAINING)


def shape_flags_given(options: dict) -> list[str]:
    """The model flags set on the command line or in a config file (--model counts when not left at its default)."""
    given = [name for name in ("layers", "heads", "kv_heads", "d_model", "d_ff", "seq_len", "vocab_size", "untied",
                               "mlp", "norm", "positions", "rope_theta", "bias", "qkv_bias", "dropout", "head_dim",
                               "qk_norm", "window", "full_attention_every", "attention_sinks", "rope_yarn",
                               "rotary_fraction", "nope_every", "qk_norm_whole", "norm_placement",
                               *SCALING_FIELDS,
                               "mtp_depth", "mtp_weight",
                               "experts", *LATENT_FIELDS, *EXPERT_FIELDS) if options.get(name) is not None]
    context = click.get_current_context(silent=True)
    source = context.get_parameter_source("model") if context is not None else None
    if source is not None and source != click.core.ParameterSource.DEFAULT:
        given.insert(0, "model")
    return given


def hf_tokenizer(path: str) -> str | None:
    """--init-from's tokenizer (and a token directory's, --data): the directory's tokenizer.json ("bytes" when it is
    the byte tokenizer's, as a byte run's export writes), or None when it has none."""
    from minigpt.tokenizer import BYTES, FILE_NAME, is_bytes, load_tokenizer

    file = Path(path) / FILE_NAME
    if not file.is_file():
        return None
    return BYTES if is_bytes(load_tokenizer(str(file))) else str(file)


def model_from_hf(options: dict) -> GPTConfig:
    """The shape of --init-from's Hugging Face model directory (its config.json; the weights' files present), with
    --seq-len and --dropout over it; any other model flag is refused: the shape is the directory's."""
    from dataclasses import replace

    from minigpt.hf.layouts import config_from_hf
    from minigpt.hf.files import headers, read_config, weight_files, with_held_modules

    others = [name for name in shape_flags_given(options) if name not in OPEN_WITH_INIT]
    if others:
        raise ConfigError(f"--{others[0].replace('_', '-')} sets the model's shape, which --init-from takes from "
                          f"{options['init_from']}/config.json: leave it out (--seq-len, --rope-yarn, --dropout, --mtp-weight and a "
                          f"mixture of experts' --aux-loss-coef, --z-loss-coef, --capacity-factor and "
                          f"--expert-bias-rate may be given)")
    if options.get("seq_len") is not None:
        check_positive_int("--seq-len", options["seq_len"])
    path, yarn = Path(options["init_from"]), options.get("rope_yarn")
    config = config_from_hf(read_config(path), None if yarn else options.get("seq_len"))
    if yarn is not None:  # a context extended past the model's own
        config = with_yarn(config, yarn, options.get("seq_len"))
    config = with_held_modules(config, headers(weight_files(path)))
    changes = {name: options[name] for name in ("dropout", "mtp_weight", *ROUTING_IN_TRAINING)
               if options.get(name) is not None}
    routing = [name for name in ROUTING_IN_TRAINING if name in changes]
    if routing and not config.is_moe:
        raise ConfigError(f"--{routing[0].replace('_', '-')} sets a mixture of experts' routing, but the model in "
                          f"{options['init_from']} is dense")
    return replace(config, **changes)
