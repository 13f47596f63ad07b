"""Measured pipeline bubble of GPipe and 1F1B against (p-1)/(m+p-1) as the micro-batches grow.

The bubble of a rank in a step is 1 - (its forward and backward time) / (the step's pipeline
span, from the first compute of any rank to the last), read from the executor's trace;
averaged over ranks and steps (the first step left out). Time in send/receive and Python
between actions counts as bubble here, as it does for a GPU. Blocks dominate the cost (small vocabulary), so the stages are
close to equal. Not a test: it prints a markdown table (or --json).

    python bench/bubble.py --pp 2 --micro-batches 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from minigpt.config import GPTConfig
from parallel.train import train
from parallel.train_config import TrainConfig


def measured_bubble(trace_path: Path) -> float:
    """Mean over ranks and steps of 1 - (rank's compute time) / (the step's pipeline span: first
    compute of any rank to last compute of any rank) -- the closed form's quantity."""
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
    fractions = []
    for name, ranks in computes.items():
        if name == "step 0":
            continue
        everything = [e for events_of_rank in ranks.values() for e in events_of_rank]
        span = max(e["ts"] + e["dur"] for e in everything) - min(e["ts"] for e in everything)
        fractions += [1 - sum(e["dur"] for e in events_of_rank) / span for events_of_rank in ranks.values()]
    return sum(fractions) / len(fractions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro-batches", default="1,2,4,8,16")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = GPTConfig(vocab_size=256, seq_len=64, n_layers=4 * args.pp, n_heads=4, d_model=128, d_ff=512)
    rows = []
    for m in (int(x) for x in args.micro_batches.split(",")):
        for kind in ("gpipe", "1f1b"):
            with tempfile.TemporaryDirectory() as out:
                cfg = TrainConfig(model=model, steps=args.steps, global_batch=4 * m, micro_batches=m, pp=args.pp,
                                  schedule=kind, eval_every=0, eval_batches=1, out_dir=out, device="cpu")
                summary = train(cfg)
                bubble = measured_bubble(Path(summary["trace"]))
            expected = (args.pp - 1) / (m + args.pp - 1)
            rows.append({"schedule": kind, "pp": args.pp, "micro_batches": m, "measured": bubble, "closed_form": expected,
                         "step_time_s": summary["step_time_s"]})
    if args.json:
        print(json.dumps(rows))
        return
    print(f"| schedule | pp | micro-batches | measured bubble | (p-1)/(m+p-1) | step ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['schedule']} | {r['pp']} | {r['micro_batches']} | {r['measured']:.3f} | {r['closed_form']:.3f} | "
              f"{r['step_time_s'] * 1000:.0f} |")


if __name__ == "__main__":
    main()
