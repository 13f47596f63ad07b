"""The run directory: config.json at the start, metrics.jsonl per step, summary.json and loss.png at the end.

Only rank 0 writes it. JSON files are written to a temporary name and renamed,
so a reader never sees half a file. No file is opened through a symlink (O_NOFOLLOW; a
temporary name is unlinked first, never followed): the launching process refused links out of
the run directory before the run (parallel/run_dir.py), and this holds even for one made since.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from job.train_config import TrainConfig


def default_run_dir(cfg: TrainConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    m = cfg.model
    return Path("runs") / f"{stamp}-L{m.n_layers}d{m.d_model}-{cfg.precision}"


@dataclass
class RunFiles:
    """The run directory: config.json at the start, metrics.jsonl per step, summary.json and loss.png at the end."""

    path: Path
    resume: bool = False  # append to the metrics of the run being continued

    def __post_init__(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics = open_no_follow(self.path / "metrics.jsonl", "a" if self.resume else "w")

    def write_json(self, name: str, obj: dict) -> None:
        tmp = self.path / (name + ".tmp")
        with open_no_follow(tmp, "w") as handle:
            handle.write(json.dumps(obj, indent=2) + "\n")
        tmp.replace(self.path / name)  # atomic: a reader never sees half a file

    def log(self, record: dict) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()

    def close(self) -> None:
        self.metrics.close()


def open_no_follow(path: Path, mode: str):
    """`path` opened to write ("w", "a", "wb"), never through a symlink: a ".tmp" name is unlinked and
    made afresh, any other raises OSError (ELOOP) where it is a symlink."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if mode.startswith("a") else os.O_TRUNC)
    if ".tmp" in path.name:
        path.unlink(missing_ok=True)
        flags |= os.O_EXCL
    return os.fdopen(os.open(path, flags, 0o644), mode, **({} if "b" in mode else {"encoding": "utf-8"}))


def loss_curves(metrics_path: Path) -> tuple[dict[int, float], dict[int, float]]:
    """Train and validation loss by step from metrics.jsonl; a step logged again (a resumed run) keeps its last value."""
    train: dict[int, float] = {}
    val: dict[int, float] = {}
    for line in metrics_path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        train[record["step"]] = record["loss"]
        if "val_loss" in record:
            val[record["step"]] = record["val_loss"]
    return train, val


def write_loss_plot(run_dir: Path, name: str = "loss.png") -> Path | None:
    """Draw the train and validation loss against the step (matplotlib, Agg) into `run_dir/name`; None
    where matplotlib is not installed (a bare machine running the repository, as bench/gpu.sh does:
    an installed minigpt always has it)."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    train, val = loss_curves(run_dir / "metrics.jsonl")
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        axes.plot(sorted(train), [train[s] for s in sorted(train)], label="train", linewidth=1)
        if val:
            axes.plot(sorted(val), [val[s] for s in sorted(val)], "o-", label="validation", markersize=4)
        axes.set_xlabel("step")
        axes.set_ylabel("loss (nats per token)")
        axes.set_title(run_dir.name)
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        tmp = run_dir / (name + ".tmp.png")
        with open_no_follow(tmp, "wb") as handle:
            figure.savefig(handle, format="png")
        tmp.replace(run_dir / name)  # atomic, as the JSON files
    finally:
        plt.close(figure)
    return run_dir / name
