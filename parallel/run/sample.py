"""Text from a checkpoint: load any layout's checkpoint into one plain GPT and sample from it.

A checkpoint holds the plain GPT's global tensors whatever the layout that saved it
(parallel/checkpoint/sharded.py), so loading it into one process is DCP's resharding with one
reader: every tensor is one box covering the whole of it. The weights loaded are the
fp32 masters when the policy kept them apart from the compute weights (bf16, fp16, fp8
runs: the values training updates), the weights themselves otherwise (fp32 runs).

Sampling is autoregressive over the run's tokens: bytes (minigpt/data.py), or the tokenizer.json the run
kept in its directory (minigpt/tokenizer.py), which encodes the prompt and decodes the text; the context is the last
seq_len tokens; temperature 0 is greedy (argmax), otherwise the logits are divided by the
temperature, cut to the top k, and a token is drawn with a torch.Generator seeded by
`seed`, so the same seed gives the same text.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from minigpt.config import GPTConfig
from minigpt.tokenizer import BYTES, FILE_NAME, ByteTokenizer, load_tokenizer
from minigpt.errors import ConfigError, check_output_path, check_path_given, check_seed
from minigpt.model import GPT
from parallel.checkpoint.dcp import SafeReader, TensorsOnlyLoadPlanner, check_tensors, read_metadata
from parallel.checkpoint.files import MARKER, STATE_FILE, newest_valid_checkpoint, read_state
from parallel.checkpoint.layout import BUFFER, global_shapes, saved_buffers

MODEL_PREFIX, MASTER_PREFIX = "model.", "optimizer.master."


@dataclass(frozen=True)
class SampleOptions:
    """What to generate; `check` refuses bad values (ConfigError) before anything is loaded."""

    prompt: str = "\n"
    tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = None
    seed: int = 0

    def check(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens < 1:
            raise ConfigError(f"--tokens must be a positive integer, got {self.tokens!r}")
        if not self.temperature >= 0:  # also refuses nan
            raise ConfigError(f"--temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"--top-k must be at least 1, got {self.top_k!r}")
        if not self.prompt:
            raise ConfigError("--prompt is empty: give at least one character (the default is a newline)")
        check_seed("--seed", self.seed)


def find_checkpoint(out: str | os.PathLike | None = None, checkpoint: str | os.PathLike | None = None,
                    skipped: list | None = None, other: str = "pass --checkpoint PATH") -> Path:
    """The checkpoint to load: `checkpoint` itself, or the newest of run directory `out` that verifies
    (complete, every file's sha256 right); the newer ones passed over are appended to `skipped`. `other`: how the
    command takes one checkpoint instead, said when `out` has none."""
    if (out is None) == (checkpoint is None):
        raise ConfigError("give exactly one of --out RUN_DIR (a `minigpt train` run) or --checkpoint PATH")
    check_output_path("--out", out, "a run directory's path")
    check_path_given("--checkpoint", checkpoint, "a checkpoint directory's path")
    if checkpoint is not None:
        return Path(checkpoint)
    run = Path(out)
    if not run.is_dir():
        raise ConfigError(
            f"run directory {str(run)!r} does not exist or is not a directory: pass the --out of a `minigpt train` run"
        )
    found, _, passed = newest_valid_checkpoint(run / "checkpoints", None,
                                               read=lambda entry: checkpoint_model_config(entry)[1])
    if skipped is not None:
        skipped.extend(passed)
    if found is not None:
        return found
    why = "; ".join(f"{error.path.name} is {error.reason}" for error in passed)
    raise ConfigError(
        f"run directory {str(run)!r} has no checkpoint that verifies under checkpoints/"
        + (f" ({why})" if why else "") + f": train it without --no-save (it keeps its final weights), or {other}"
    )


class _ShapeOf:
    """Just enough of a TrainConfig for read_state's shape check: the checkpoint's own shape."""

    def __init__(self, model: GPTConfig) -> None:
        self.model = model


def checkpoint_model_config(path: Path) -> tuple[GPTConfig, dict]:
    """The model shape a checkpoint was saved with, and its state.json (ConfigError when unusable)."""
    try:
        saved = read_state_unchecked(path)
        fields = {name: saved["model"][name] for name in GPTConfig.__dataclass_fields__ if name in saved["model"]}
        model = GPTConfig(**{**fields, "dropout": 0.0})
    except (KeyError, TypeError) as error:
        raise ConfigError(f"checkpoint {path} is corrupt: its model shape is unreadable ({error})") from None
    return model, read_state(path, _ShapeOf(model))  # every file present and of the size written


def read_state_unchecked(path: Path) -> dict:
    """state.json's model entry, read only far enough to know the shape (read_state checks the rest)."""
    if not path.is_dir() or not (path / MARKER).is_file():
        read_state(path, None)  # raises the right one-line error (missing, not a directory, incomplete)
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: nested too deep
        raise ConfigError(f"checkpoint {path} is corrupt: cannot read {STATE_FILE} ({error})") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ConfigError(f"checkpoint {path} is corrupt: {STATE_FILE} has no model shape")
    return state


def load_model(path: str | os.PathLike) -> tuple[GPT, dict]:
    """A plain fp32 GPT on the CPU with the checkpoint's weights, in eval mode, and the checkpoint's state."""
    path = Path(path)
    config, state = checkpoint_model_config(path)
    metadata = read_metadata(path)
    shapes = global_shapes(config)
    separate = all(MASTER_PREFIX + name in metadata.state_dict_metadata for name in shapes)
    prefix = MASTER_PREFIX if separate else MODEL_PREFIX
    buffers = {BUFFER + name: shape for name, shape in saved_buffers(config).items()}  # a MoE's choice bias
    check_tensors(path, metadata, {prefix + name: shape for name, shape in shapes.items()} | buffers)
    model = GPT(config)
    model.eval()
    params = dict(model.named_parameters())  # a tied head once, as tok_emb.weight
    targets = {prefix + name: torch.zeros(shape, dtype=metadata.state_dict_metadata[prefix + name].properties.dtype)
               for name, shape in shapes.items()} | {name: torch.zeros(shape) for name, shape in buffers.items()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP's note on single-process use
            dcp.load(targets, storage_reader=SafeReader(path), planner=TensorsOnlyLoadPlanner(), no_dist=True)
    except Exception as error:  # a truncated or foreign data file
        text = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        raise ConfigError(f"checkpoint {path} is corrupt: reading its tensors failed ({text})") from None
    with torch.no_grad():
        for name in shapes:
            params[name].copy_(targets[prefix + name].float())
        model_buffers = dict(model.named_buffers())
        for name in buffers:
            model_buffers[name[len(BUFFER):]].copy_(targets[name])
    return model, {**state, "weights": prefix.rstrip(".")}


@torch.no_grad()
def generate(model: GPT, options: SampleOptions, tokenizer=None) -> list[int]:
    """`options.tokens` new token ids after the prompt's (in `tokenizer`'s ids; None: bytes), one at a time from
    the last seq_len of context."""
    options.check()
    seq_len, tokenizer = model.config.seq_len, tokenizer or ByteTokenizer()
    context = tokenizer.encode(options.prompt).long().view(1, -1)
    if context.numel() == 0:
        raise ConfigError(f"--prompt {options.prompt!r} encodes to no token with tokenizer {tokenizer.name!r}: "
                          f"give more text")
    generator = torch.Generator().manual_seed(options.seed)
    new: list[int] = []
    for _ in range(options.tokens):
        logits = model(context[:, -seq_len:])[0, -1].float()
        token = next_token(logits, options, generator)
        new.append(token)
        context = torch.cat([context, torch.tensor([[token]])], dim=1)
    return new


def next_token(logits: torch.Tensor, options: SampleOptions, generator: torch.Generator) -> int:
    """Greedy at temperature 0; otherwise a draw from the tempered, top-k-cut softmax."""
    if options.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / options.temperature
    if options.top_k is not None and options.top_k < logits.numel():
        kth = torch.topk(logits, options.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_text(path: str | os.PathLike, options: SampleOptions) -> dict:
    """Load the checkpoint at `path` and generate: the text and what it came from."""
    options.check()
    model, state = load_model(path)
    tokenizer = checkpoint_tokenizer(Path(path), state, model.config.vocab_size)
    new = generate(model, options, tokenizer)
    return {
        "checkpoint": str(path),
        "step": state["step"],
        "layout": state["layout"],
        "precision": state.get("precision"),
        "weights": state["weights"],
        "prompt": options.prompt,
        "tokens": len(new),
        "temperature": options.temperature,
        "top_k": options.top_k,
        "seed": options.seed,
        "tokenizer": tokenizer.name,
        "text": tokenizer.decode(new),
    }


def checkpoint_tokenizer(path: Path, state: dict, vocab_size: int):
    """The tokenizer the checkpoint's run trained with: its run directory's tokenizer.json (the run's copy), else
    the one its settings name; bytes for a run without one. ConfigError when it is gone or outgrows the model."""
    spec = (state.get("config") or {}).get("tokenizer", BYTES)
    kept = path.parent.parent / FILE_NAME if path.parent.name == "checkpoints" else None
    if kept is not None and kept.is_file():
        spec = str(kept)
    elif spec != BYTES and not (isinstance(spec, str) and Path(spec).exists()):
        raise ConfigError(f"checkpoint {path} was trained with tokenizer {spec!r}, which is gone, and its run "
                          f"directory keeps no {FILE_NAME}: put the tokenizer.json back in the run directory")
    tokenizer = load_tokenizer(spec)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens, more than the model's "
                          f"vocabulary ({vocab_size}): it is not the tokenizer checkpoint {path} was trained with")
    return tokenizer
