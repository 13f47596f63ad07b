"""`minigpt export RUN --hf DIR`: a run's newest checkpoint, whatever layout saved it, as a Hugging Face model
directory that transformers' AutoModelForCausalLM opens (minigpt/hf/layouts.py says which layout holds which shape)."""

from __future__ import annotations

import json
from pathlib import Path

import click


def tokenizer_files(tokenizer, seq_len: int) -> dict[str, bytes]:
    """The run's tokenizer as a tokenizer.json (a byte run's: its exact equivalent, minigpt/tokenizer.py) and the
    tokenizer_config.json with which transformers' AutoTokenizer opens it."""
    from minigpt.tokenizer import FILE_NAME

    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len}
    return {FILE_NAME: tokenizer.to_json().encode("utf-8"), "tokenizer_config.json": json.dumps(settings).encode()}


def checkpoint_of(run: str) -> tuple[Path, Path]:
    """(checkpoint, run directory): RUN's newest checkpoint that verifies, or RUN itself when it is one (then the run
    directory is the one above its checkpoints/)."""
    from parallel.checkpoint.files import MARKER
    from parallel.run.sample import find_checkpoint

    path = Path(run)
    if (path / MARKER).is_file():
        return path, path.parent.parent
    skipped: list = []
    found = find_checkpoint(out=run, skipped=skipped, other="give one checkpoint as RUN (RUN/checkpoints/step-N)")
    if skipped:
        click.echo("export: skipped " + "; ".join(f"{e.path.name} ({e.reason})" for e in skipped), err=True)
    return found, path


@click.command()
@click.argument("run", metavar="RUN")
@click.option("--hf", "hf_dir", required=True, metavar="DIR",
              help="The Hugging Face model directory to write (config.json, model.safetensors, the tokenizer's files): "
                   "a new or empty directory.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def export(run: str, hf_dir: str, as_json: bool) -> None:
    """Write RUN's newest valid checkpoint (a run directory, or one checkpoint) as a Hugging Face model."""
    from minigpt.errors import check_output_path
    from minigpt.hf.files import check_new_dir, write_hf_dir

    check_output_path("--hf", hf_dir, "a directory's path")
    target = check_new_dir(hf_dir, "--hf")
    from minigpt.hf.layouts import layout_of  # after the cheap checks: torch comes with the checkpoint's reader
    from parallel.run.sample import checkpoint_model_config, checkpoint_tokenizer, load_model

    checkpoint, _ = checkpoint_of(run)
    config, _ = checkpoint_model_config(checkpoint)
    layout = layout_of(config)  # a shape transformers cannot hold: one line, before the weights are read
    model, state = load_model(checkpoint)
    tokenizer = checkpoint_tokenizer(checkpoint, state, config.vocab_size)
    write_hf_dir(model.state_dict(), config, target, tokenizer_files(tokenizer, config.seq_len))
    result = {"checkpoint": str(checkpoint), "step": state["step"], "layout": state["layout"], "hf_dir": str(target),
              "architecture": layout, "tokenizer": tokenizer.name, "files": sorted(p.name for p in target.iterdir()),
              "n_params": config.n_params()}
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"exported {checkpoint} (step {state['step']}, {config.n_params():,} parameters) as a transformers "
               f"{layout} model: {target} ({', '.join(result['files'])})")
