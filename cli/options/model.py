"""The model flags, one vocabulary for `train`, `simulate` and `compare`: a preset and any field over it."""

from __future__ import annotations

from typing import Callable

import click

from minigpt.config import MLP_KINDS, NORM_KINDS, POSITION_KINDS, PRESETS, GPTConfig, build_config
from minigpt.errors import check_positive_int

POSITIVE = ("layers", "heads", "kv_heads", "d_model", "d_ff", "seq_len", "vocab_size")


def model_options(default: str) -> Callable:
    """Click options for the model, `--model` defaulting to preset `default`."""
    options = [
        click.option("--model", default=default, show_default=True, metavar="PRESET",
                     help=f"Model preset: {', '.join(PRESETS)}; the flags below override its fields."),
        click.option("--layers", type=int, help="Transformer blocks."),
        click.option("--heads", type=int, help="Attention (query) heads."),
        click.option("--kv-heads", "kv_heads", type=int,
                     help="Key/value heads (grouped-query attention; must divide --heads) [default: the preset's]."),
        click.option("--d-model", "--hidden", "d_model", type=int,
                     help="Model width (without --d-ff the MLP keeps the preset's ratio)."),
        click.option("--d-ff", "d_ff", type=int, help="MLP width (for SwiGLU: each of its gate and up projections)."),
        click.option("--seq-len", "seq_len", type=int, help="Sequence length."),
        click.option("--vocab-size", "--vocab", "vocab_size", type=int, help="Vocabulary size."),
        click.option("--untied/--tied", "untied", default=None,
                     help="The LM head with its own weights, or sharing the token embedding [default: the preset's]."),
        click.option("--mlp", type=click.Choice(MLP_KINDS), help="MLP: gelu (GPT-2) or swiglu (Llama)."),
        click.option("--norm", type=click.Choice(NORM_KINDS), help="Norm: layernorm (GPT-2) or rmsnorm (Llama)."),
        click.option("--positions", type=click.Choice(POSITION_KINDS),
                     help="Positions: learned embeddings (GPT-2) or rope, rotary (Llama)."),
        click.option("--rope-theta", "rope_theta", type=float, help="RoPE base (Llama 3: 500000)."),
        click.option("--bias/--no-bias", "bias", default=None, help="Biases in the Linears [default: the preset's]."),
        click.option("--dropout", type=float, help="Dropout probability [default: the preset's, 0]."),
    ]

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def model_from_options(options: dict) -> GPTConfig:
    """The checked model the flags describe; raises ConfigError (one line, exit 2) on a bad value."""
    for name in POSITIVE:
        if options.get(name) is not None:
            check_positive_int(f"--{name.replace('_', '-')}", options[name])
    untied = options.get("untied")
    return build_config(
        options["model"], vocab_size=options.get("vocab_size"), seq_len=options.get("seq_len"),
        n_layers=options.get("layers"), n_heads=options.get("heads"), n_kv_heads=options.get("kv_heads"),
        d_model=options.get("d_model"), d_ff=options.get("d_ff"), tied_head=None if untied is None else not untied,
        dropout=options.get("dropout"), mlp=options.get("mlp"), norm=options.get("norm"),
        positions=options.get("positions"), rope_theta=options.get("rope_theta"), bias=options.get("bias"),
    )
