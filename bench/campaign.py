"""A real campaign on this machine, failures injected, against `simulator/campaign/` fed its measured costs.

    python bench/campaign.py              # 4 CPU ranks, a rank killed at random times (mean 15 s apart)
    python bench/campaign.py --json

1. A reference run: `minigpt train` of STEPS steps on 4 ranks, never stopped: its losses, and the step time (the
   median of its steps' own step_time_s).
2. The same run with `--save-every` and `--max-restarts`, while this script kills a random worker rank at
   exponential times (mean --mean-s seconds, from the first step on; between two attempts, when there is no
   rank to kill, the kill waits for the next ones) until it ends. Measured from its
   metrics.jsonl (each record stamped with the wall clock when written, after the step's save): the wall time
   from its first step to its last, each checkpoint's cost (a saving step's record gap over the median gap),
   each restart's cost (from the kill to the first record of the next attempt, less its step, for the kills no
   other followed before that record), its losses.
3. The prediction: simulator/campaign/'s SimPy campaign of the same wall time, fed the measured step,
   checkpoint and restart times and the injected failure rate, over 400 seeds: its effective training time
   (steps' failure-free time over the wall time) against the run's own (STEPS x step over its wall time).
The losses of the injected run must equal the reference's, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from parallel.launch.rank_start import launched_ranks  # noqa: E402
from simulator.campaign.model import Campaign, FailureRates  # noqa: E402
from simulator.campaign.run import simulate_campaign  # noqa: E402

ARGS = ["--dp", "4", "--layers", "1", "--seq-len", "32", "--batch-size", "8", "--log-every", "100000",
        "--warmup", "0", "--lr", "2e-3", "--min-lr", "2e-3", "--eval-every", "0"]


def train(out: Path, steps: int, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "cli", "train", *ARGS, "--steps", str(steps), "--out", str(out), "--json", *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=out.parent,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def injected(out: Path, steps: int, save_every: int, mean_s: float, restarts: int, seed: int) -> dict:
    """The run with failures injected: its summary, records and the kill times."""
    rng, kills = random.Random(seed), []
    process = train(out, steps, ["--save-every", str(save_every), "--max-restarts", str(restarts)])
    while not records(out) and process.poll() is None:
        time.sleep(0.05)
    next_kill = time.time() + rng.expovariate(1 / mean_s)
    while process.poll() is None:
        if time.time() >= next_kill and len(kills) < restarts:
            ranks = launched_ranks(process.pid)
            if ranks:  # (between two attempts there is none to kill: the failure waits for the next ranks)
                os.kill(rng.choice(ranks), signal.SIGKILL)
                kills.append(time.time())
                next_kill = time.time() + rng.expovariate(1 / mean_s)
        time.sleep(0.02)
    stdout, stderr = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"the injected run failed: {stderr.strip().splitlines()[-1]}")
    return {"summary": json.loads(stdout), "records": records(out), "kills": kills}


def measured_costs(run: dict, step_s: float, save_every: int) -> dict:
    """The wall time, checkpoint and restart costs read from the injected run's stamped records."""
    rows = run["records"]
    times = [r["time"] for r in rows]
    gaps = [(rows[i], times[i] - times[i - 1]) for i in range(1, len(rows)) if rows[i]["step"] == rows[i - 1]["step"] + 1]
    plain = statistics.median(g for r, g in gaps if "checkpoint" not in r)
    checkpoint = statistics.median(g - plain for r, g in gaps if "checkpoint" in r)
    # an attempt's first record: its step is not one past the record before it (it went back to a checkpoint)
    resumed = [times[i] for i in range(1, len(rows)) if rows[i]["step"] != rows[i - 1]["step"] + 1]
    restarts, kills = [], run["kills"]
    for i, kill in enumerate(kills):
        after = [t for t in resumed if t > kill]
        if after and (i + 1 == len(kills) or kills[i + 1] > after[0]):  # no other kill before it trained again
            restarts.append(after[0] - kill - plain)
    return {"wall_s": times[-1] - times[0] + plain, "record_gap_s": plain, "checkpoint_s": max(0.0, checkpoint),
            "restart_s": statistics.fmean(restarts) if restarts else 0.0, "restarts_measured": len(restarts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--mean-s", type=float, default=15.0, help="mean seconds between injected failures")
    parser.add_argument("--restarts", type=int, default=50, help="--max-restarts (and the most kills injected)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="minigpt-campaign-") as tmp:
        reference = train(Path(tmp) / "reference", args.steps, [])
        stdout, stderr = reference.communicate()
        if reference.returncode != 0:
            raise SystemExit(f"the reference run failed: {stderr.strip().splitlines()[-1]}")
        ref = json.loads(stdout)
        step_s = statistics.median(r["step_time_s"] for r in records(Path(tmp) / "reference"))
        run = injected(Path(tmp) / "injected", args.steps, args.save_every, args.mean_s, args.restarts, args.seed)
    costs = measured_costs(run, step_s, args.save_every)
    rate = 1000 * 86_400 / args.mean_s  # one "server" (this machine) failing every mean_s seconds
    campaign = Campaign(step_s=costs["record_gap_s"], tokens_per_step=256, gpus=4, gpus_per_node=4,
                        hours=costs["wall_s"] / 3600, rates=FailureRates({"injected kill": rate}),
                        checkpoint_s=costs["checkpoint_s"], restart_s=costs["restart_s"],
                        interval_steps=args.save_every)
    predicted = simulate_campaign(campaign, runs=400, seed=args.seed).summary()
    measured_ettr = args.steps * costs["record_gap_s"] / costs["wall_s"]
    first = run["summary"]["first_step"]  # the last attempt's: its losses against the reference's from there
    same = run["summary"]["losses"] == ref["losses"][first:]
    result = {**costs, "steps": args.steps, "kills": len(run["kills"]), "step_s": step_s, "last_attempt_from": first,
              "measured_ettr": measured_ettr, "predicted_ettr": predicted["ettr"],
              "predicted_spread": predicted["ettr_spread"], "predicted_interruptions": predicted["interruptions"],
              "error": predicted["ettr"] / measured_ettr - 1, "losses_equal": same}
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:26s} {value}")


if __name__ == "__main__":
    main()
