"""Measured model-state bytes per rank for each ZeRO stage against the ZeRO paper's accounting.

Mixed precision (bf16 compute weights and gradients, fp32 masters and AdamW moments), P
parameters, N data-parallel ranks; the paper (Rajbhandari et al. 2020, figure 1) gives per rank:
  baseline (stage 0): 2P + 2P + 12P     stage 1: 4P + 12P/N
  stage 2: 2P + 14P/N                   stage 3: 16P/N
Not a test: it prints a markdown table (or --json).

    python bench/zero_memory.py --model tiny --dp 1,2,4
"""

from __future__ import annotations

import argparse
import json
import tempfile

from minigpt.presets import preset
from parallel.run.train import train
from job.train_config import TrainConfig

MODEL_STATES = ("parameters", "gradients", "master_weights", "adam_m", "adam_v")


def paper_bytes(stage: int, params: int, ranks: int) -> float:
    return {0: 16 * params, 1: 4 * params + 12 * params / ranks, 2: 2 * params + 14 * params / ranks,
            3: 16 * params / ranks}[stage]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dp", default="1,2,4")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = preset(args.model)
    params = model.n_params()
    rows = []
    for ranks in (int(n) for n in args.dp.split(",")):
        for stage in range(4) if ranks > 1 else [0]:
            with tempfile.TemporaryDirectory() as out:
                cfg = TrainConfig(model=model, steps=args.steps, global_batch=16, dp=ranks, zero=stage,
                                  precision="bf16", eval_every=0, eval_batches=1, out_dir=out, bucket_mb=1.0)
                summary = train(cfg)
            memory = summary["memory_per_rank"][0]
            measured = sum(memory[key] for key in MODEL_STATES)
            expected = paper_bytes(stage, params, ranks)
            rows.append({"dp": ranks, "zero": stage, "measured_bytes": measured, "paper_bytes": expected,
                         "ratio": measured / expected, **{k: memory[k] for k in MODEL_STATES},
                         "activations": memory["activations"], "comm_buffers": memory["comm_buffers"],
                         "volume_per_step": {k: v["volume"] for k, v in summary["comm_bytes_per_step"]["dp"].items()}})
    if args.json:
        print(json.dumps({"model": args.model, "params": params, "rows": rows}))
        return
    print(f"model {args.model}, P = {params:,} parameters, bf16 policy; bytes per rank (rank 0)\n")
    print("| dp | ZeRO | parameters | gradients | masters | Adam m+v | measured total | paper | measured/paper |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dp']} | {r['zero']} | {r['parameters']:,} | {r['gradients']:,} | {r['master_weights']:,} | "
              f"{r['adam_m'] + r['adam_v']:,} | {r['measured_bytes']:,} | {r['paper_bytes']:,.0f} | {r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
