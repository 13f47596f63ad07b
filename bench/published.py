"""The simulator against published training runs (validation only: nothing is tuned to these rows).

    python bench/published.py                    # Narayanan et al. 2021, Table 1, all ten rows
    python bench/published.py --json             # one JSON object
    python bench/published.py --legacy           # flags an older minigpt knows (for a before/after)
    python bench/published.py --table dgxc       # NVIDIA's DGX-Cloud GPT-3 175B on 128-2,048 H100s, bf16 and fp8

Each row of bench/published_runs.json is simulated through the command line a user would type,
`minigpt simulate ... --json`, on the a100-80gb preset (DGX A100 nodes, HDR InfiniBand) with the
run's own layout, batch, micro-batch, schedule and full recomputation, in fp16 as the runs were.
The published step time comes from the paper's own accounting: its FLOPs per iteration (Eq. 3,
96 B s l h^2 (1 + s/6h + V/16lh), recomputation included) over the published TFLOP/s per GPU times
the GPUs. The naive rule beside it: the same FLOPs over (GPUs x peak x 0.5).

How the 2021 stack is described (settings, not fitted numbers; each from the paper or its scripts):
attention unfused (Megatron 2021 materialises the scores; its softmax is one fused kernel), the
"megatron-2021" overlap preset (tensor-parallel communication exposed, the data-parallel all-reduce
after the last backward, point-to-point exposed), and dropout 0.1 (the scripts' default).

`--table dgxc`: NVIDIA/dgxc-benchmarking's GPT-3 175B rows (bench/published_runs.json's
"dgxc_gpt3_175b_h100", with their source), each simulated with its own layout (tp 4 x pp 8 with 12
virtual chunks, sequence parallel, the distributed optimizer as ZeRO-1, micro-batch 1, no recomputation)
and precision on the h100-sxm preset, against the published step time; the naive rule beside it is the
MFU convention's FLOPs (6 P + 12 l h s per token) over (GPUs x dense peak x 0.5). The rows run with the
stack's own overlap, the "megatron-core" preset (simulator/engine/overlap.py: tensor-parallel collectives
behind the Linears through Transformer Engine's userbuffers, the distributed optimizer's reduce-scatter in
the backward and its parameter all-gather in the next forward, asynchronous pipeline sends, each hidden
collective slowing the compute it overlaps by the SMs it holds; gradient-accumulation fusion, fp8 weights cast
once per step, Transformer Engine's fused casts), and dropout 0.1 as the run's gpt3_175b_hydra.yaml sets it
(hidden_dropout and attention_dropout 0.1; the same file sets ub_tp_comm_overlap, gradient_accumulation_fusion,
overlap_grad_sync, overlap_param_sync, overlap_p2p_comm and fp8_params, which the preset describes): settings of
the run and its stack, not fitted numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "bench" / "published_runs.json"
A100_PEAK = 312e12  # the paper's denominator (A100 fp16/bf16 dense), as bench/published_runs.json says


def paper_flops(run: dict, seq: int, vocab: int) -> float:
    """Eq. 3 of Narayanan et al. 2021: FLOPs of one iteration, recomputation included."""
    b, l, h = run["global_batch_size"], run["layers"], run["hidden_size"]
    return 96 * b * seq * l * h * h * (1 + seq / (6 * h) + vocab / (16 * l * h))


def command(run: dict, seq: int, vocab: int, legacy: bool) -> list[str]:
    interleaved = run["virtual_chunks"] > 1
    args = [sys.executable, "-m", "cli", "simulate", "--layers", str(run["layers"]), "--hidden", str(run["hidden_size"]),
            "--heads", str(run["attention_heads"]), "--vocab", str(vocab), "--seq-len", str(seq),
            "--global-batch", str(run["global_batch_size"]), "--micro-batch", str(run["micro_batch_size"]),
            "--tp", str(run["tensor_parallel"]), "--pp", str(run["pipeline_parallel"]),
            "--dp", str(run["data_parallel"]), "--gpu", "a100-80gb", "--recompute", "full", "--precision", "fp16",
            "--schedule", "interleaved" if interleaved else "1f1b", "--virtual-chunks", str(run["virtual_chunks"]),
            "--json"]
    if not legacy:
        args += ["--attention", "unfused", "--overlap", "megatron-2021", "--dropout", "0.1"]
    return args


def simulate(run: dict, seq: int, vocab: int, legacy: bool) -> dict:
    result = subprocess.run(command(run, seq, vocab, legacy), capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{run['name']}: minigpt simulate failed: {result.stderr.strip()}")
    return json.loads(result.stdout)


def rows(legacy: bool) -> tuple[list[dict], dict]:
    data = json.loads(RUNS.read_text())
    seq, vocab = data["common"]["sequence_length"], data["common"]["vocabulary"]
    out = []
    for run in data["runs"]:
        flops = paper_flops(run, seq, vocab)
        published = flops / (run["achieved_tflops_per_gpu"] * 1e12 * run["gpus"])
        sim = simulate(run, seq, vocab, legacy)
        naive = flops / (run["gpus"] * A100_PEAK * 0.5)
        out.append({"name": run["name"], "gpus": run["gpus"], "published_step_s": published,
                    "predicted_step_s": sim["step_time_s"], "error": sim["step_time_s"] / published - 1,
                    "naive_step_s": naive, "naive_error": naive / published - 1,
                    "predicted_tflops_per_gpu": flops / (sim["step_time_s"] * run["gpus"]) / 1e12,
                    "published_tflops_per_gpu": run["achieved_tflops_per_gpu"],
                    "breakdown": sim.get("breakdown"), "provenance": sim.get("provenance")})
    return out, data["source"]


DGXC_DROPOUT = 0.1  # gpt3_175b_hydra.yaml: hidden_dropout 0.1, attention_dropout 0.1
H100_PEAK = {"bf16": 989e12, "fp8": 1979e12}  # the dense peaks the rows' MFU divides by (their "conv")


def dgxc_command(run: dict) -> list[str]:
    return [sys.executable, "-m", "cli", "simulate", "--layers", str(run["l"]), "--hidden", str(run["h"]),
            "--heads", str(run["a"]), "--kv-heads", str(run["kv"]), "--d-ff", str(run["ffn"]),
            "--vocab", str(run["V"]), "--seq-len", str(run["s"]), "--mlp", run["mlp"],
            "--global-batch", str(run["gb"]), "--micro-batch", str(run["mb"]), "--tp", str(run["tp"]),
            "--pp", str(run["pp"]), "--dp", str(run["dp"]), "--cp", str(run["cp"]), "--zero", str(run["zero"]),
            *(["--sequence-parallel"] if run["sp"] else []), "--schedule", "interleaved" if run["v"] > 1 else "1f1b",
            "--virtual-chunks", str(run["v"]), "--recompute", run["recompute"], "--precision", run["precision"],
            "--gpu", run["gpu"], "--overlap", "megatron-core", "--dropout", str(DGXC_DROPOUT), "--json"]


def dgxc_rows() -> tuple[list[dict], str]:
    table = json.loads(RUNS.read_text())["dgxc_gpt3_175b_h100"]
    out = []
    for run in table["rows"]:
        result = subprocess.run(dgxc_command(run), capture_output=True, text=True, cwd=ROOT)
        if result.returncode != 0:
            raise SystemExit(f"{run['id']}: minigpt simulate failed: {result.stderr.strip()}")
        sim, published = json.loads(result.stdout), run["pub_s"]
        n_params = 12 * run["l"] * run["h"] ** 2 + run["V"] * run["h"]  # the convention's matmul parameters
        flops = run["gb"] * run["s"] * (6 * n_params + 12 * run["l"] * run["h"] * run["s"])
        naive = flops / (run["n_gpus"] * H100_PEAK[run["precision"]] * 0.5)
        out.append({"name": run["id"], "gpus": run["n_gpus"], "precision": run["precision"],
                    "published_step_s": published, "predicted_step_s": sim["step_time_s"],
                    "error": sim["step_time_s"] / published - 1, "naive_step_s": naive,
                    "naive_error": naive / published - 1, "published_mfu": run["pub_mfu"], "predicted_mfu": sim["mfu"],
                    "breakdown": sim.get("breakdown")})
    return out, table["source"]


def summary(table: list[dict], key: str) -> dict:
    errors = [row[key] for row in table]
    return {"mape": statistics.mean(abs(e) for e in errors), "signed_mean": statistics.mean(errors),
            "worst": max(errors, key=abs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--legacy", action="store_true", help="only the flags an older minigpt simulate knows")
    parser.add_argument("--table", choices=("narayanan", "dgxc"), default="narayanan")
    args = parser.parse_args()
    if args.table == "dgxc":
        return print_dgxc(args.json)
    table, source = rows(args.legacy)
    report(table, source["paper"], args.json, "TFLOP/s pub / pred",
           lambda r: f"{r['published_tflops_per_gpu']} / {r['predicted_tflops_per_gpu']:.0f}")


def print_dgxc(as_json: bool) -> None:
    table, source = dgxc_rows()
    report(table, source, as_json, "MFU pub / pred", lambda r: f"{r['published_mfu']:.1%} / {r['predicted_mfu']:.1%}",
           by_precision=True)


def report(table: list[dict], source: str, as_json: bool, column: str, cell, by_precision: bool = False) -> None:
    """The rows as a markdown table (with `column` filled by `cell(row)`) and the summaries, or one JSON object."""
    result = {"rows": table, "simulator": summary(table, "error"), "naive": summary(table, "naive_error"),
              "source": source}
    if as_json:
        print(json.dumps(result))
        return
    print(f"| run | GPUs | published step s | predicted s | error | {column} | naive s | naive error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['name']} | {r['gpus']} | {r['published_step_s']:.2f} | {r['predicted_step_s']:.2f} | "
              f"{r['error']:+.1%} | {cell(r)} | {r['naive_step_s']:.2f} | {r['naive_error']:+.1%} |")
    lines = [(p, summary([r for r in table if r["precision"] == p], "error")) for p in ("bf16", "fp8")] \
        if by_precision else []
    for name, s in lines + [(name, result[name]) for name in ("simulator", "naive")]:
        print(f"{name}: MAPE {s['mape']:.1%}, signed mean {s['signed_mean']:+.1%}, worst {s['worst']:+.1%}")


if __name__ == "__main__":
    main()
