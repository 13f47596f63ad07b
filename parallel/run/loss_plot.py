"""loss.png: the train and validation loss against the step, drawn with matplotlib (Agg).

Importing matplotlib takes about a second here, as long as a short run's steps. A command that
trains starts a `LossPlotter` first thing: a process that imports matplotlib on one core while the
run imports torch on the other, then waits to be told which run directory to draw (one line on its
standard input). Closing its input without a request ends it. Without a plotter the plot is drawn
in the calling process, as it is wherever the plotter could not draw it (which then raises what
went wrong, as a direct call would).

Run as `python -m parallel.run.loss_plot`, this module is the plotter's side.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

DRAWN = "drawn "
NO_MATPLOTLIB = "no matplotlib"
DRAW_TIMEOUT_S = 60.0  # matplotlib's first start on a new machine builds its font cache: seconds, not minutes
# The plotter yields the cores to the run's own start (the ranks' server importing torch): it imports on what
# they leave idle, and is done long before the end of all but the shortest runs.
PLOTTER_NICENESS = 10
# Fixed margins that hold the axis labels of a 7 x 4 inch figure (tight_layout measures every text: a third of a draw)
MARGINS = {"left": 0.1, "right": 0.98, "bottom": 0.13, "top": 0.92}


class LossPlotter:
    """The launching side: a plotting process started early, asked to draw once at the end of the run."""

    def __init__(self, process: subprocess.Popen):
        self.process = process

    @classmethod
    def start(cls) -> "LossPlotter":
        # Its own session: a Ctrl-C in the terminal is the run's to handle; the plotter ends with its input.
        process = subprocess.Popen([sys.executable, "-m", "parallel.run.loss_plot"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                   start_new_session=True)
        return cls(process)

    def draw(self, run_dir: Path) -> Path | None:
        """Draw run_dir/loss.png; its path, or None where matplotlib is not installed."""
        try:
            answer, _ = self.process.communicate(f"{run_dir}\n", timeout=DRAW_TIMEOUT_S)
        except (subprocess.TimeoutExpired, OSError):
            self.close()
            answer = ""
        if self.process.returncode == 0 and answer.startswith(DRAWN):
            return Path(answer[len(DRAWN):].strip())
        if answer.strip() == NO_MATPLOTLIB:
            return None
        return write_loss_plot(run_dir)  # here, so that whatever stops it is raised

    def close(self) -> None:
        """End the plotter unasked (the run failed or was stopped)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


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


def import_pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display); None where matplotlib is not installed
    (a bare machine running the repository, as bench/gpu.sh does: an installed minigpt always has it)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_loss_plot(run_dir: Path, name: str = "loss.png") -> Path | None:
    """Draw the train and validation loss against the step into `run_dir/name`; None without matplotlib."""
    from parallel.run.files import open_no_follow

    plt = import_pyplot()
    if plt is None:
        return None
    train, val = loss_curves(run_dir / "metrics.jsonl")
    tmp = run_dir / (name + ".tmp.png")
    with open_no_follow(tmp, "wb") as handle:
        draw(plt, train, val, run_dir.name, handle)
    tmp.replace(run_dir / name)  # atomic, as the JSON files
    return run_dir / name


def draw(plt, train: dict[int, float], val: dict[int, float], title: str, into) -> None:
    """The loss curves as a PNG into the file object `into`."""
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        axes.plot(sorted(train), [train[s] for s in sorted(train)], label="train", linewidth=1)
        if val:
            axes.plot(sorted(val), [val[s] for s in sorted(val)], "o-", label="validation", markersize=4)
        axes.set_xlabel("step")
        axes.set_ylabel("loss (nats per token)")
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend()
        figure.subplots_adjust(**MARGINS)
        figure.savefig(into, format="png")
    finally:
        plt.close(figure)


def serve() -> None:
    """The plotter: import matplotlib now and draw once into memory (the first figure loads fonts and sets up
    the renderer), then draw the one run directory asked for."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(PLOTTER_NICENESS)
    plt = import_pyplot()
    if plt is None:
        request = sys.stdin.readline()
        print(NO_MATPLOTLIB if request.strip() else "", flush=True)
        return
    draw(plt, {0: 5.5, 1: 5.0}, {1: 4.9}, "warm-up", io.BytesIO())
    request = sys.stdin.readline().strip()
    if request:
        print(f"{DRAWN}{write_loss_plot(Path(request))}", flush=True)


if __name__ == "__main__":
    serve()
    # The run waits for this process to end: leave without finalising matplotlib's modules (0.1 s). Everything
    # it wrote is closed (loss.png renamed into place) and its answer flushed.
    sys.stdout.flush()
    os._exit(0)
