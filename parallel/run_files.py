"""The run directory: config.json at the start, metrics.jsonl per step, summary.json at the end.

Only rank 0 writes it. JSON files are written to a temporary name and renamed,
so a reader never sees half a file.
"""

from __future__ import annotations

import json
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
    """The run directory: config.json at the start, metrics.jsonl per step, summary.json at the end."""

    path: Path
    resume: bool = False  # append to the metrics of the run being continued

    def __post_init__(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics = open(self.path / "metrics.jsonl", "a" if self.resume else "w", encoding="utf-8")

    def write_json(self, name: str, obj: dict) -> None:
        tmp = self.path / (name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.path / name)  # atomic: a reader never sees half a file

    def log(self, record: dict) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()

    def close(self) -> None:
        self.metrics.close()
