"""What a run pays before and after its steps: `minigpt train --model tiny --steps 2` at 1, 4 and 8 ranks,
and `minigpt calibrate --quick`, timed from a plain shell. A benchmark, not a test.

    .venv/bin/python bench/startup.py                 # 5 rounds, a table
    .venv/bin/python bench/startup.py --rounds 3 --no-calibrate

The three runs are 1 rank, dp 4 with ZeRO-1, and tp 2 x pp 2 x dp 2 with ZeRO-3 (8 ranks). Each round runs
them one after another in turn (1, 4, 8, then the next round), so a machine that gets busier or quieter
during the benchmark stretches every case alike; each multi-rank run is also divided by the 1-rank run of
its own round, and the table gives the median of those ratios with their range. Wall time is the command's,
from process start to exit (time.perf_counter around subprocess.run): what a user waits for.
A first round that is not counted warms the machine's file cache and writes the project's bytecode, as a
user's first run does (the runs are timed with Python writing bytecode, its default, even where the
environment sets PYTHONDONTWRITEBYTECODE: otherwise every run compiles the project's modules again). Each
round also times `python -c "import torch"`, the floor under any run that imports torch, on the same machine
at the same moment. Point PYTHONPATH at another checkout (and run its interpreter) to time that one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = {  # name: extra flags of `minigpt train --model tiny --steps 2`
    "1 rank": [],
    "4 ranks (dp 4, ZeRO-1)": ["--dp", "4", "--zero", "1"],
    "8 ranks (tp 2 x pp 2 x dp 2, ZeRO-3)": ["--tp", "2", "--pp", "2", "--dp", "2", "--zero", "3"],
}
CALIBRATE = "calibrate --quick (8 ranks)"
IMPORT_TORCH = "python -c 'import torch' (the floor)"


def minigpt_command() -> list[str]:
    """The console script beside this interpreter, as a user runs it; `python -m cli` without one."""
    script = Path(sys.executable).with_name("minigpt")
    return [str(script)] if script.exists() else [sys.executable, "-m", "cli"]


def timed(command: list[str], cwd: str) -> float:
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=environment)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"bench/startup.py: {' '.join(command)} failed:\n{result.stderr[-2000:]}")
    return seconds


def one_round(work: str, round_index: int, calibrate: bool) -> dict[str, float]:
    seconds = {IMPORT_TORCH: timed([sys.executable, "-c", "import torch"], work)}
    for index, (name, flags) in enumerate(RUNS.items()):
        out = os.path.join(work, f"run-{round_index}-{index}")
        seconds[name] = timed([*minigpt_command(), "train", "--model", "tiny", "--steps", "2", *flags, "--out", out],
                              work)
    if calibrate:
        profile = os.path.join(work, f"profile-{round_index}.json")
        seconds[CALIBRATE] = timed([*minigpt_command(), "calibrate", "--quick", "--allow-busy", "--out", profile], work)
    return seconds


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(rounds: list[dict[str, float]]) -> list[list[str]]:
    base = "1 rank"
    rows = []
    for name in rounds[0]:
        times = [r[name] for r in rounds]
        ratios = [r[name] / r[base] for r in rounds]
        ratio = "1" if name == base else spread(ratios) if name in RUNS else ""  # the runs against each other only
        rows.append([name, spread(times), ratio])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-calibrate", action="store_true", help="Leave out calibrate --quick (a minute a round).")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="minigpt-startup-")
    rounds = []
    try:
        one_round(work, -1, calibrate=False)  # not counted: bytecode written, files cached
        for index in range(args.rounds):
            rounds.append(one_round(work, index, not args.no_calibrate))
            print(f"round {index + 1}/{args.rounds}: " + ", ".join(f"{v:.2f} s" for v in rounds[-1].values()),
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    header = ["command", "wall s: median (min-max)", "/ 1 rank: median (min-max)"]
    rows = table(rounds)
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(3)]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    print(f"\n{args.rounds} rounds on {os.cpu_count()} cores; `minigpt train --model tiny --steps 2 ...` and "
          f"`minigpt calibrate --quick`, each from a fresh process")


if __name__ == "__main__":
    main()
