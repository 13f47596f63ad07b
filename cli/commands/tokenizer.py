"""`minigpt tokenizer train`: a byte-level BPE trained on local text, written as a Hugging Face tokenizer.json.
`minigpt tokenizer encode`: text files encoded once into a token directory that `minigpt train --data DIR` memory-maps
(no rank encodes the text again; the batches read the windows they take).

The BPE (minigpt/tokenizer.py's train_bpe: the tokenizers library, GPT-2's byte-level pre-tokenizer without a
prefix space, the 256 byte characters as the initial alphabet) encodes every text and decodes it back exactly.
`minigpt train --tokenizer DIR` trains a model in its tokens, `simulate --tokenizer` prices its vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from minigpt.data import CORPUS_NAME, check_data_file, embedded_corpus, read_text_file
from minigpt.errors import ConfigError, check_output_path
from minigpt.tokenizer import FILE_NAME, check_bpe_vocab, eod_id, load_tokenizer, train_bpe, write_token_dir


@click.group()
def tokenizer() -> None:
    """Tokenizers for `minigpt train --tokenizer`: train a byte-level BPE on local text, encode text for --data."""


def check_out_dir(out: str) -> Path:
    """--out: a new or empty directory that can be made and written (nothing there is ever overwritten)."""
    from parallel.run.directory import check_writable

    check_output_path("--out", out, "a directory path")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {out!r} exists and is not a directory: give a new or empty directory")
    if path.is_dir() and any(path.iterdir()):
        raise ConfigError(f"--out {out!r} is not empty: give a new or empty directory (the tokenizer goes to "
                          f"DIR/{FILE_NAME})")
    check_writable(path)
    return path


@tokenizer.command()
@click.option("--vocab-size", "vocab_size", type=int, required=True,
              help="Tokens in the vocabulary: the 256 bytes and vocab-size - 256 merges (fewer when the text holds "
                   "no more pairs).")
@click.option("--data", type=str, help="A UTF-8 text file to train on [default: the embedded Shakespeare corpus].")
@click.option("--out", type=str, required=True, help=f"A new or empty directory: the tokenizer goes to DIR/{FILE_NAME}.")
@click.option("--special", type=str, multiple=True, metavar="TOKEN", help="A special token, its own id, never merged "
              "(an end-of-document token for `encode --eod`, e.g. '<|endoftext|>'); may be given again.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def train(vocab_size: int, data: str | None, out: str, special: tuple[str, ...], as_json: bool) -> None:
    """Train a byte-level BPE on local text (every text round-trips exactly) and write DIR/tokenizer.json."""
    if any(not token or token != token.strip() for token in special) or len(set(special)) < len(special):
        raise ConfigError(f"--special tokens must be distinct, non-empty and without surrounding spaces, got "
                          f"{list(special)!r}")
    check_bpe_vocab(vocab_size - len(special))
    text = embedded_corpus() if data is None else read_text_file(data)
    source = f"embedded:{CORPUS_NAME}" if data is None else data
    if not text:
        raise ConfigError(f"data file {data!r} is empty: a BPE learns its merges from text")
    directory = check_out_dir(out)
    bpe = train_bpe(text.decode("utf-8"), vocab_size, special)
    n_tokens = len(bpe.hf.encode(text.decode("utf-8"), add_special_tokens=False).ids)
    path = bpe.save(directory)
    result = {"tokenizer": str(path), "vocab_size": bpe.vocab_size, "asked": vocab_size, "data": source,
              "bytes": len(text), "tokens": n_tokens, "bytes_per_token": len(text) / n_tokens}
    if as_json:
        click.echo(json.dumps(result))
        return
    fewer = "" if bpe.vocab_size == vocab_size else f" (of {vocab_size:,} asked: the text holds no more pairs)"
    click.echo(f"wrote {path}: byte-level BPE, vocabulary {bpe.vocab_size:,}{fewer}; {result['bytes_per_token']:.2f} "
               f"bytes per token on {source} ({len(text):,} bytes in {n_tokens:,} tokens)")


@tokenizer.command()
@click.argument("files", nargs=-1, required=True)
@click.option("--tokenizer", "spec", default="bytes", show_default=True, metavar="bytes|FILE",
              help="The tokenizer: bytes, or a tokenizer.json (or a directory holding one).")
@click.option("--out", type=str, required=True,
              help="A new or empty directory: tokens.bin, tokens.json and the tokenizer.json go there.")
@click.option("--jsonl", type=str, metavar="KEY", help="Each FILE is JSON Lines: one document per line, its text under "
              "KEY (as datasets' to_json writes them; Megatron's --json-keys).")
@click.option("--eod", type=str, metavar="TOKEN", help="Append TOKEN's id after every document (each text file, each "
              "JSON line): the tokenizer's end-of-document token, e.g. '<|endoftext|>' (Megatron's --append-eod).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def encode(files: tuple[str, ...], spec: str, out: str, jsonl: str | None, eod: str | None, as_json: bool) -> None:
    """Encode UTF-8 text FILES (or JSON Lines documents), in order, into a token directory for `minigpt train --data
    DIR` (each text read and encoded in pieces whose ids are the whole text's)."""
    chosen = load_tokenizer(spec)
    eod_id(chosen, eod)  # the tokenizer has it, before anything is written
    for path in files:  # each there before anything is written (read piece by piece: not UTF-8 is said then)
        check_data_file(path)
    header = write_token_dir(check_out_dir(out), list(files), chosen, eod=eod, jsonl=jsonl)
    if as_json:
        click.echo(json.dumps({"out": out, **header}))
        return
    size = sum(source["bytes"] for source in header["sources"])
    documents = sum(source["documents"] for source in header["sources"])
    ends = f", each of {documents:,} documents ended by {eod!r}" if eod is not None else ""
    click.echo(f"wrote {out}: {header['tokens']:,} tokens ({header['dtype']}) of {len(files)} file"
               f"{'s' if len(files) > 1 else ''} ({size:,} bytes) by {chosen.spec}{ends}; `minigpt train --data "
               f"{out}` trains on them")
