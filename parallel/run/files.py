"""The run directory: config.json at the start, metrics.jsonl per step, summary.json and loss.png at the end.

A run with a tokenizer.json (not bytes) keeps its copy beside config.json, written at the start.
Rank 0 writes it, and the process that launched the run its summary and loss.png
(parallel/run/loss_plot.py). JSON files are written to a temporary name and renamed, so a reader
never sees half a file. No file is opened through a symlink (O_NOFOLLOW; a
temporary name is unlinked first, never followed): the launching process refused links out of
the run directory before the run (parallel/run/directory.py), and this holds even for one made since.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from job.train_config import TrainConfig
from minigpt.tokenizer import BYTES, FILE_NAME


def default_run_dir(cfg: TrainConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    m = cfg.model
    return Path("runs") / f"{stamp}-L{m.n_layers}d{m.d_model}-{cfg.precision}"


@dataclass
class RunFiles:
    """The run directory: config.json at the start, metrics.jsonl per step, summary.json and loss.png at the end."""

    path: Path
    resume: bool = False  # append to the metrics of the run being continued
    events: object = None  # where the run asks for TensorBoard's events, a Board (parallel/run/tensorboard.py): each
    # record logged goes there too

    def __post_init__(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics = open_no_follow(self.path / "metrics.jsonl", "a" if self.resume else "w")

    def write_json(self, name: str, obj: dict) -> None:
        write_json_file(self.path / name, obj)

    def write_tokenizer(self, tokenizer) -> dict:
        """The run's copy of a tokenizer.json (minigpt/tokenizer.py), which `minigpt sample` decodes with and an
        export carries; a byte run has none. What config.json records of the tokenizer."""
        if tokenizer.spec == BYTES:
            return {**tokenizer.describe(), "file": None}
        write_text_file(self.path / FILE_NAME, tokenizer.to_json())
        return {**tokenizer.describe(), "file": FILE_NAME}

    def log(self, record: dict) -> None:
        """One line of metrics.jsonl, stamped "time": the wall clock (Unix seconds) when it is written, after the
        step's validation and save (bench/campaign.py times restarts and checkpoints by it)."""
        record["time"] = time.time()
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.events is not None:
            self.events.log(record)

    def close(self) -> None:
        self.metrics.close()
        if self.events is not None:
            self.events.close()


def write_json_file(path: Path, obj: dict) -> None:
    """`obj` as indented JSON in `path`, through write_text_file."""
    write_text_file(path, json.dumps(obj, indent=2) + "\n")


def write_text_file(path: Path, text: str) -> None:
    """`path` written through a temporary name and renamed: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with open_no_follow(tmp, "w") as handle:
        handle.write(text)
    tmp.replace(path)


def open_no_follow(path: Path, mode: str):
    """`path` opened to write ("w", "a", "wb"), never through a symlink: a ".tmp" name is unlinked and
    made afresh, any other raises OSError (ELOOP) where it is a symlink."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if mode.startswith("a") else os.O_TRUNC)
    if ".tmp" in path.name:
        path.unlink(missing_ok=True)
        flags |= os.O_EXCL
    return os.fdopen(os.open(path, flags, 0o644), mode, **({} if "b" in mode else {"encoding": "utf-8"}))
