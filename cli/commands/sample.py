"""`minigpt sample`: text from a run's newest checkpoint (any layout), in one process, in the run's tokens (its
tokenizer.json, or bytes: parallel/run/sample.py)."""

from __future__ import annotations

import json

import click

from cli.output import print_table


@click.command()
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="run directory of `minigpt train`: its newest complete checkpoint")
@click.option("--checkpoint", type=click.Path(), default=None, help="one checkpoint directory (checkpoints/step-NNNNNN)")
@click.option("--prompt", default="\n", show_default="a newline", help="text to continue")
@click.option("--tokens", type=int, default=200, show_default=True, help="new tokens to generate (the run's tokenizer's: bytes, unless it trained with --tokenizer)")
@click.option("--temperature", type=float, default=0.8, show_default=True, help="0: greedy (argmax)")
@click.option("--top-k", "top_k", type=int, default=None, help="draw only from the K likeliest tokens")
@click.option("--seed", type=int, default=0, show_default=True, help="the same seed gives the same text")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def sample(out, checkpoint, prompt, tokens, temperature, top_k, seed, as_json) -> None:
    """Generate text from a checkpoint of a run trained in any layout (tp, pp, dp, ZeRO)."""
    from parallel.run.sample import SampleOptions, find_checkpoint, sample_text  # torch only after the flags check

    options = SampleOptions(prompt=prompt, tokens=tokens, temperature=temperature, top_k=top_k, seed=seed)
    options.check()
    skipped = []
    path = find_checkpoint(out, checkpoint, skipped)
    if skipped:
        click.echo("sample: skipped " + "; ".join(f"{e.path.name} ({e.reason})" for e in skipped), err=True)
    result = sample_text(path, options)
    if as_json:
        click.echo(json.dumps(result))
        return
    layout = result["layout"]
    where = f"tp{layout.get('tp')} pp{layout.get('pp')} dp{layout.get('dp')} zero{layout.get('zero')}"
    where += "".join(f" {dim}{layout[dim]}" for dim in ("cp", "ep") if layout.get(dim, 1) > 1)
    print_table(["checkpoint", "step", "layout", "weights", "temperature", "top-k", "seed"],
                [[result["checkpoint"], result["step"], where, result["weights"], temperature,
                  top_k if top_k is not None else "-", seed]])
    click.echo("")
    click.echo(prompt + result["text"])

