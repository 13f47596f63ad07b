"""Measured pipeline bubble of GPipe, 1F1B and ZB-H1 against their closed forms as the micro-batches grow.

The bubble of a rank in a step is 1 - (its forward and backward time) / (the step's pipeline
span, from the first compute of any rank to the last), read from the executor's trace;
averaged over ranks and steps (the first step left out). Time in send/receive and Python
between actions counts as bubble here, as it does for a GPU. Blocks dominate the cost (small vocabulary), so the stages are
close to equal. The closed forms are (p-1)/(m+p-1) for GPipe and 1F1B and (p-1)/(3m+p-1) for ZB-H1
(forward, input gradient and weight gradient taking equal time). ZB-H1's backward halves are timed
on their own in the table (mean ms of one F, B, Bi and W on the last stage): the closed form assumes
F = Bi = W, and Bi + W = B. Not a test: it prints a markdown table (or --json).

    python bench/bubble.py --pp 2 --micro-batches 1,2,4,8,16 --schedules 1f1b,zb-h1
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from minigpt.config import GPTConfig
from job.schedule_check import closed_form_bubble
from parallel.run.train import train
from job.train_config import TrainConfig


def measured_bubble(trace_path: Path) -> float:
    """Mean over ranks and steps of 1 - (rank's compute time) / (the step's pipeline span: first
    compute of any rank to last compute of any rank) -- the closed form's quantity."""
    per_rank = rank_bubbles(trace_path)
    return sum(per_rank.values()) / len(per_rank)


def rank_bubbles(trace_path: Path) -> dict[int, float]:
    """Each rank's bubble (as in `measured_bubble`), averaged over the steps after the first."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    steps = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "step"]
    bounds = {}
    for start, end, name in steps:  # every rank has its own step event; take the widest
        lo, hi = bounds.get(name, (start, end))
        bounds[name] = (min(lo, start), max(hi, end))
    computes: dict[str, dict[int, list]] = {}
    for event in events:
        if event.get("cat") != "compute":
            continue
        for name, (start, end) in bounds.items():
            if start <= event["ts"] <= end:
                computes.setdefault(name, {}).setdefault(event["tid"], []).append(event)
    fractions: dict[int, list[float]] = {}
    for name, ranks in computes.items():
        if name == "step 0":
            continue
        everything = [e for events_of_rank in ranks.values() for e in events_of_rank]
        span = max(e["ts"] + e["dur"] for e in everything) - min(e["ts"] for e in everything)
        for rank, events_of_rank in ranks.items():
            fractions.setdefault(rank, []).append(1 - sum(e["dur"] for e in events_of_rank) / span)
    return {rank: sum(values) / len(values) for rank, values in sorted(fractions.items())}


def compute_times(trace_path: Path) -> dict[str, float]:
    """Mean ms of one forward, backward, input gradient and weight gradient on the last pipeline rank
    (steps after the first)."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    last = max(e["tid"] for e in events if e.get("cat") == "compute")
    first_step = max(e["ts"] + e["dur"] for e in events if e.get("cat") == "step" and e["name"] == "step 0")
    found: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "compute" and e["tid"] == last and e["ts"] > first_step:
            letter = e["name"].rstrip("0123456789").removesuffix("c").rstrip("0123456789")
            found.setdefault(letter, []).append(e["dur"] / 1000)
    return {letter: sum(times) / len(times) for letter, times in found.items()}


def run(pp: int, m: int, kind: str, steps: int, model: GPTConfig) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(model=model, steps=steps, global_batch=4 * m, micro_batches=m, pp=pp,
                          schedule=kind, eval_every=0, eval_batches=1, out_dir=out, device="cpu")
        summary = train(cfg)
        trace = Path(summary["trace"])
        per_rank = rank_bubbles(trace)
        return {"schedule": kind, "pp": pp, "micro_batches": m, "measured": sum(per_rank.values()) / len(per_rank),
                "per_rank": list(per_rank.values()),
                "closed_form": closed_form_bubble(pp, m, kind), "step_time_s": summary["step_time_s"],
                "compute_ms": compute_times(trace)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro-batches", default="1,2,4,8,16")
    parser.add_argument("--schedules", default="gpipe,1f1b,zb-h1")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = GPTConfig(vocab_size=256, seq_len=64, n_layers=4 * args.pp, n_heads=4, d_model=args.d_model,
                      d_ff=4 * args.d_model)
    rows = [run(args.pp, int(m), kind, args.steps, model)
            for m in args.micro_batches.split(",") for kind in args.schedules.split(",")]
    if args.json:
        print(json.dumps(rows))
        return
    print("| schedule | pp | micro-batches | measured bubble | per rank | closed form | step ms "
          "| F / B / Bi / W ms (last rank) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        times = " / ".join(f"{r['compute_ms'][k]:.2f}" if k in r["compute_ms"] else "-" for k in ("F", "B", "Bi", "W"))
        ranks = " / ".join(f"{b:.2f}" for b in r["per_rank"])
        print(f"| {r['schedule']} | {r['pp']} | {r['micro_batches']} | {r['measured']:.3f} | {ranks} | {r['closed_form']:.3f} | "
              f"{r['step_time_s'] * 1000:.0f} | {times} |")


if __name__ == "__main__":
    main()
