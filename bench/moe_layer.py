"""The simulator's mixture-of-experts layer against whole MoE layers timed on one H100. A validation, not a fit.

    python bench/moe_layer.py           # a table, then what the measured layers split into
    python bench/moe_layer.py --json    # one JSON object

The measurements are SonicMoE's Figure 14 (arXiv 2512.14080; bench/moe_layer_h100.json says how they were read
and what each series ran): twelve layers of 1.4B to 120B-parameter MoE shapes (d 768 to 4096, expert widths 256
to 2048, 2 to 16 experts a token, 24,576 to 40,960 tokens), forward and backward, as TFLOP/s of the experts' GEMM
FLOPs (6 T n d K forward, 12 T n d K backward). The simulator prices the same layer -- its router, dispatch,
experts and combine ops of simulator/costs/layers/moe.py, for one micro-batch on one rank at expert parallelism 1
on the h100-sxm preset -- as the megatron-core stack computes it (Transformer Engine's GroupedLinear as cuBLAS
GEMMs, one per expert on 4 streams) and as our executor does (one grouped kernel per Linear), and is compared
with the "Megatron" series (Megatron-core's MoELayer: Transformer Engine's grouped GEMM through its CUTLASS
kernel, the permutation unfused) and the "SonicMoE" series (the paper's kernels: what the GPU gives).

Where the time goes, from the measurements alone: at one d every Megatron layer fits 1 / TF = a + b / n (n the
expert width). At fixed d the experts' FLOPs are 6 T n d K and the bytes of everything done once per routed row
(gather, scatter, aggregation, the gate) are proportional to T d K, so a is the grouped GEMMs' time per FLOP
(1 / a: their rate) and b / n the routed rows' memory traffic per FLOP. The same split of the simulator's own price
(its experts' GEMMs, and everything else) is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from job.layout import Layout  # noqa: E402
from minigpt.config import GPTConfig  # noqa: E402
from precision.policy import policy  # noqa: E402
from simulator.costs.compute import op_time  # noqa: E402
from simulator.costs.hardware import presets  # noqa: E402
from simulator.costs.op_types import RECOMPUTE, Gemm  # noqa: E402
from simulator.costs.ops import block_ops  # noqa: E402
from simulator.engine.overlap import stack_default  # noqa: E402

DATA = Path(__file__).with_name("moe_layer_h100.json")
MOE_OPS = ("router", "dispatch.", "experts.", "combine.", "moe.")  # the MoE's ops in a block's op lists
STACKS = ("megatron-core", "executor")


def layer_model(row: dict) -> GPTConfig:
    """A one-block MoE model of the row's shape: SwiGLU experts, no bias, sequences of 2048 (the benchmark's)."""
    d = row["d_model"]
    return GPTConfig(vocab_size=32000, seq_len=2048, n_layers=1, n_heads=max(1, d // 128), d_model=d, d_ff=4 * d,
                     mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, tied_head=False,
                     n_experts=row["experts"], top_k=row["top_k"], d_expert=row["expert_width"])


def priced(row: dict, stack: str, gpu) -> dict:
    """The simulator's seconds of the row's MoE layer, forward and backward, split into its experts' GEMMs and the
    rest."""
    ops = block_ops(layer_model(row), row["tokens"] // 2048, Layout(), policy("bf16"),
                    stack_default(stack, "flash", "none"), True)
    passes = {"forward": ops.forward, "backward": [op for op in ops.backward if op.phase != RECOMPUTE]}
    out = {}
    for name, listed in passes.items():
        moe = [op for op in listed if op.name.startswith(MOE_OPS)]
        gemms = sum(op_time(op, gpu) for op in moe if isinstance(op, Gemm) and op.name.startswith("experts."))
        out[name] = {"seconds": sum(op_time(op, gpu) for op in moe), "expert_gemms_s": gemms}
    return out


def flops(row: dict) -> tuple[float, float]:
    """The layer's experts' FLOPs, forward and backward (the figure's convention)."""
    forward = 6 * row["tokens"] * row["expert_width"] * row["d_model"] * row["top_k"]
    return forward, 2 * forward


def split_fit(rows: list[dict], series: str, which: int) -> dict:
    """Per d, the least-squares fit of 1 / TF = a + b / n to a measured series' layers (which 0: forward, 1:
    backward): the grouped GEMMs' rate 1 / a and the routed rows' term b, with the fit's worst relative miss."""
    fits = {}
    for d in sorted({row["d_model"] for row in rows}):
        mine = [row for row in rows if row["d_model"] == d]
        n = np.array([row["expert_width"] for row in mine], dtype=float)
        inverse = np.array([1.0 / row[series][which] for row in mine])
        (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), 1.0 / n], axis=1), inverse, rcond=None)
        miss = float(np.max(np.abs((a + b / n) / inverse - 1)))
        fits[d] = {"gemm_tflops": 1.0 / a, "b": float(b), "worst_miss": miss, "layers": len(mine)}
    return fits


def table(rows: list[dict], gpu) -> list[dict]:
    """Every row's measured and priced TFLOP/s, forward and backward, and the priced split per FLOP."""
    out = []
    for row in rows:
        fwd_flops, bwd_flops = flops(row)
        entry = {key: row[key] for key in ("model", "tokens", "d_model", "expert_width", "experts", "top_k")}
        entry["measured"] = {name: row[name] for name in ("megatron", "sonicmoe")}
        for stack in STACKS:
            price = priced(row, stack, gpu)
            passes = (("forward", fwd_flops), ("backward", bwd_flops))
            entry[stack] = {
                "tflops": [f / price[p]["seconds"] / 1e12 for p, f in passes],
                "expert_gemm_tflops": [f / price[p]["expert_gemms_s"] / 1e12 for p, f in passes],
                "rest_per_tflop": [(price[p]["seconds"] - price[p]["expert_gemms_s"]) / f * 1e12 for p, f in passes],
            }
        out.append(entry)
    return out


def report(entries: list[dict], fits: dict) -> None:
    print("| layer | n / E / K | Megatron measured fwd / bwd | megatron-core priced | priced / measured | executor priced "
          "| SonicMoE measured |")
    print("|---|---|---|---|---|---|---|")
    for e in entries:
        meg, core, ours = e["measured"]["megatron"], e["megatron-core"]["tflops"], e["executor"]["tflops"]
        sonic = e["measured"]["sonicmoe"]
        print(f"| {e['model']} d {e['d_model']} | {e['expert_width']} / {e['experts']} / {e['top_k']} "
              f"| {meg[0]} / {meg[1]} | {core[0]:.0f} / {core[1]:.0f} "
              f"| {core[0] / meg[0]:.2f} / {core[1] / meg[1]:.2f} | {ours[0]:.0f} / {ours[1]:.0f} "
              f"| {sonic[0]} / {sonic[1]} |")
    ratios = np.array([[e["megatron-core"]["tflops"][i] / e["measured"]["megatron"][i] for i in (0, 1)]
                       for e in entries])
    print(f"megatron-core priced over Megatron measured: forward {ratios[:, 0].min():.2f}-{ratios[:, 0].max():.2f}, "
          f"backward {ratios[:, 1].min():.2f}-{ratios[:, 1].max():.2f} (TFLOP/s: above 1, the price is faster)")
    print("\nwhat the Megatron forward splits into, per d (1 / TF = a + b / n over its layers), against the price's "
          "own split:")
    print("| d | layers | measured grouped GEMMs TF/s (1 / a) | priced expert GEMMs TF/s | measured routed rows b / n at "
          "n = 512 (ms per TFLOP) | priced rest at n = 512 | fit's worst miss |")
    print("|---|---|---|---|---|---|---|")
    for d, fit in fits.items():
        at512 = [e for e in entries if e["d_model"] == d and e["expert_width"] == 512]
        priced_gemm = np.mean([e["megatron-core"]["expert_gemm_tflops"][0] for e in entries if e["d_model"] == d])
        rest = at512[0]["megatron-core"]["rest_per_tflop"][0] if at512 else float("nan")
        print(f"| {d} | {fit['layers']} | {fit['gemm_tflops']:.0f} | {priced_gemm:.0f} | {fit['b'] / 512 * 1e3:.2f} "
              f"| {rest * 1e3:.2f} | {fit['worst_miss'] * 100:.1f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = json.loads(DATA.read_text())["rows"]
    gpu = presets().hardware("h100-sxm").gpu
    entries = table(rows, gpu)
    fits = split_fit(rows, "megatron", 0)
    if args.json:
        print(json.dumps({"rows": entries, "megatron_forward_split": {str(d): fit for d, fit in fits.items()}}))
    else:
        report(entries, fits)


if __name__ == "__main__":
    main()
