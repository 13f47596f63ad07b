"""TensorBoard event files in the run directory (RUN/tensorboard): metrics.jsonl's numbers, one point a step.

`minigpt train` asks for them (TrainConfig.tensorboard) where the `tensorboard` package is installed (the optional
extra minigpt[tensorboard]); rank 0 writes them with torch.utils.tensorboard's SummaryWriter, imported only then
(about half a second here: no other rank, and no run that did not ask, pays it). Each scalar's global_step is the
optimizer step; the memory of every rank (the total of parallel/run/train.py's `rank_memory` after the run's first
step, which metrics.jsonl's first line holds by category) is one tag per rank, logged at every step beside the others.

A resumed run, or one the elastic agent restarted, writes a new events file into the same folder, opened with
SummaryWriter's purge_step at the step it continues from: TensorBoard hides what the older files hold at or past
that step (steps logged before a crash, after the checkpoint), so every step shows once, as the run went on.
Torch-free at import: the command line asks `available()` before any torch is loaded.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EVENTS_DIR = "tensorboard"
INSTALL = "pip install 'minigpt[tensorboard]'"
FLUSH_S = 5  # seconds between writes to disk (SummaryWriter's default is 120): a run is watched as it goes
# metrics.jsonl's key -> the scalar's tag (TensorBoard groups the tags by what comes before the "/")
TAGS = {
    "loss": "loss/train",
    "val_loss": "loss/validation",
    "lr": "optimizer/learning_rate",
    "grad_norm": "optimizer/grad_norm",
    "loss_scale": "optimizer/loss_scale",
    "tokens_per_s": "speed/tokens_per_s",
    "step_time_s": "speed/step_time_s",
    "mfu": "speed/mfu",
}
MEMORY_TAG = "memory/rank{}"  # bytes held by the rank: parameters, gradients, optimizer states, activations, buffers


def available() -> bool:
    """Whether the tensorboard package is installed, found without importing it."""
    return importlib.util.find_spec("tensorboard") is not None


def events_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / EVENTS_DIR


def announce(run_dir: str | Path, writing: bool) -> str:
    """The line that tells the user where the events go and how to look at them, or how to get them."""
    if writing:
        return f"tensorboard: {events_dir(run_dir)} (tensorboard --logdir {run_dir})"
    return f"tensorboard: not installed, so no event files ({INSTALL} gives them)"


class Board:
    """Rank 0's writer of one run's events."""

    def __init__(self, run_dir: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter  # here only: half a second of imports

        self.writer = SummaryWriter(str(events_dir(run_dir)), purge_step=first_step, flush_secs=FLUSH_S)
        self.memory: list[int] = []  # each rank's bytes in all, from the first record

    def log(self, record: dict) -> None:
        """One step's scalars: those of `record` (a line of metrics.jsonl) and each rank's bytes, which the run's
        first record carries by category ("memory_per_rank")."""
        step = record["step"]
        if "memory_per_rank" in record:
            self.memory = [sum(categories.values()) for categories in record["memory_per_rank"]]
        for key, tag in TAGS.items():
            if record.get(key) is not None:
                self.writer.add_scalar(tag, record[key], step)
        for source, loss in (record.get("val_by_source") or {}).items():  # a mixture's sources, each its tag
            self.writer.add_scalar(f"{TAGS['val_loss']}/{source}", loss, step)
        for rank, held in enumerate(self.memory):
            self.writer.add_scalar(MEMORY_TAG.format(rank), held, step)

    def close(self) -> None:
        self.writer.close()  # flushes what is queued
