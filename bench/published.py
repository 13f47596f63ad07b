"""The simulator against published training runs (validation only: nothing is tuned to these rows).

    python bench/published.py                    # Narayanan et al. 2021, Table 1, all ten rows
    python bench/published.py --json             # one JSON object (--legacy: flags an older minigpt knows)
    python bench/published.py --table dgxc       # NVIDIA's DGX-Cloud GPT-3 175B on 128-2,048 H100s, bf16 and fp8
    python bench/published.py --table moe        # mixtures of experts: Mixtral 8x7B, Qwen3-30B-A3B on H100s
    python bench/published.py --table torchtitan # torchtitan's Llama 3.1 8B, FSDP on 8 and 128 H100s at 500 W
    python bench/published.py --table torchtitan-cp  # the same with context parallelism, 32K-256K tokens, float8
    python bench/published.py --implied-rate     # per run, the tensor-core rate at which the simulator meets it

Each row of bench/published_runs.json is simulated through the command line a user would type,
`minigpt simulate ... --json`, on the a100-80gb preset (DGX A100 nodes, HDR InfiniBand) with the
run's own layout, batch, micro-batch, schedule and full recomputation, in fp16 as the runs were.
The published step time comes from the paper's own accounting: its FLOPs per iteration (Eq. 3,
96 B s l h^2 (1 + s/6h + V/16lh), recomputation included) over the published TFLOP/s per GPU times
the GPUs. The naive rule beside it: the same FLOPs over (GPUs x peak x 0.5).

How the 2021 stack is described (settings, not fitted numbers; each from the paper or its scripts): attention
unfused (Megatron 2021 materialises the scores; its softmax is one fused kernel), the "megatron-2021" overlap preset
(tensor-parallel communication exposed, the data-parallel all-reduce after the last backward, point-to-point
exposed), and dropout 0.1 (the scripts' default).

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
overlap_grad_sync, overlap_param_sync and overlap_p2p_comm, which the preset describes), `--fp8-param-gather` on the
fp8 rows (the yaml's fp8_params: true, both releases: the weights kept in fp8 and all-gathered so), and
`--sp-saved-input sharded`: Megatron-core's sequence-parallel Linears save their input shard and gather it again in
the backward (TE's bulk overlap hides that gather behind the input-gradient GEMM), and `--tp-overlap-cfg` with the
same yaml's ub_tp_comm_overlap_cfg (bench/dgxc_gpt3_175b_userbuffers.json: proj's and fc2's forward GEMMs on the 108
and 112 SMs their pipelined reduce-scatters leave): settings of the run and its stack, not fitted numbers.
`--table dgxc-v25.02`: the same benchmark's next release ("dgxc_gpt3_175b_h100_v25_02": NeMo 24.12, 6 virtual
chunks, cuDNN's attention), simulated the same way with its 6 chunks and `--attention-kernel cudnn` (the row's
"attention_kernel", as its NVTE_FUSED_ATTN=1 says; v25.01's rows state flash-attn-2, as its NVTE_FUSED_ATTN=0 says,
where the megatron-core stack would run Transformer Engine's own choice, cuDNN's on H100): how far the published figure itself moves
with the software on the same GPUs and layout. The acceptance table stays v25.01's.

`--implied-rate`: what the simulator's error on these runs looks like, as one number per run (a diagnosis, not a fit:
nothing here changes a simulator number): the factor on the GPU preset's tensor-core peaks (bf16, fp16, fp8; HBM,
links, every other number as they are) at which `minigpt simulate` meets the published step. Each run is simulated
twice, with the preset as it is and with its tensor-core peaks times IMPLIED_LOW (a profile written to a temporary
file and given as --hardware); the step is taken as a + b / factor through both (the tensor-core work scales with
1 / factor, the rest not) and solved for the published step. A factor near 1 says the error is not the tensor
cores' rate; one shared by runs of different stacks, formats and scales says it is. The runs: Narayanan et al.'s
ten rows and the ten DGX-Cloud rows as simulated above, and Meta's Llama 3 405B on 8,192 and 16,384 H100s
("llama3_405b_h100": its layout, the megatron-core preset as the nearest description of its stack, interleaved over
7 chunks; the published step is the simulator's model FLOPs over the published TFLOP/s per GPU, as the row's
"assumed" says).

`--table torchtitan`: torchtitan's own Llama 3.1 8B rows (bench/published_runs.json's "torchtitan_llama3_h100": 1D
FSDP on 8 and 128 of Meta's 96 GB H100s at 500 W, eager and compiled), simulated as its config at the benchmark's
commit runs them (selective op checkpointing, --elementwise eager or fused); the published step is 2 x 8,192 tokens
over the published tokens/s per GPU, and the published peak reserved memory stands beside the predicted memory.
`--table torchtitan-cp`: its long-context rows ("torchtitan_cp_llama3_h100": FSDP x CP on 8 GPUs, 32K-256K tokens,
compiled, torchao's float8, full recomputation), a GPU's tokens a step dp x s / 8 over the published tokens/s.

`--table moe`: published mixture-of-experts runs (bench/published_runs.json's "moe_training", each row with its
source, the recipe its settings come from and what it assumes), each simulated with the run's own layout (tp,
pp, virtual chunks, ep, dp, ZeRO-1 for Megatron's distributed optimizer or ZeRO-3 for FSDP), micro- and global
batch, recomputation and precision, on the preset of its GPU, with the overlap preset of its stack
("megatron-core" for Megatron-Core and Megatron-Bridge runs, "torchtitan-fsdp2" for PyTorch FSDP2 ones) and the
attention kernel its source implies (the table's "attention": cuDNN's where Transformer Engine chooses on H100). The
published step time is the source's own (a step time, or the global batch's tokens over the published tokens/s
per GPU times the GPUs, or the FLOPs of the source's convention over its TFLOP/s per GPU times the GPUs). The
naive rule beside it: 6 x active parameters x tokens over (GPUs x the dense peak of the run's format x 0.5).
The MFU column puts the published TFLOP/s (the source's FLOP convention) and the predicted (the simulator's:
active parameters, no recomputation) over the same peak, the one the simulator's MFU divides by. Rows the
simulator cannot express stay out of the summary: those simulated with a stated approximation are shown apart,
those it refuses are given to it to show the refusal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script, bench/ is first on the path: --implied-rate reads the presets
    sys.path.insert(0, str(ROOT))
RUNS = ROOT / "bench" / "published_runs.json"
HARDWARE = ROOT / "simulator" / "costs" / "hardware.json"  # the GPU presets' peaks (the naive rule's denominator)
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


def run_simulate(args: list[str], name: str) -> dict:
    """`minigpt simulate ... --json` as a subprocess, its JSON; a failure ends the bench naming the run."""
    result = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{name}: minigpt simulate failed: {result.stderr.strip()}")
    return json.loads(result.stdout)


def simulate(run: dict, seq: int, vocab: int, legacy: bool) -> dict:
    return run_simulate(command(run, seq, vocab, legacy), run["name"])


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
DGXC_USERBUFFERS = ROOT / "bench" / "dgxc_gpt3_175b_userbuffers.json"  # the same yaml's ub_tp_comm_overlap_cfg
H100_PEAK = {"bf16": 989e12, "fp8": 1979e12}  # the dense peaks the rows' MFU divides by (their "conv")


def dgxc_command(run: dict) -> list[str]:
    """A DGX-Cloud row: its shape as flags (GPT-3's, and "shape_flags") or a preset ("model"), the recipe's userbuffers
    file ("ub": GPT-3's if absent, none if null), its dropout ("dropout", else GPT-3's) and racks ("gpus_per_node")."""
    shape = (["--model", run["model"]] if "model" in run else
             ["--layers", str(run["l"]), "--hidden", str(run["h"]), "--heads", str(run["a"]), "--kv-heads", str(run["kv"]),
              "--d-ff", str(run["ffn"]), "--vocab", str(run["V"]), "--mlp", run["mlp"], *run.get("shape_flags", [])])
    ub = run.get("ub", DGXC_USERBUFFERS.name)
    return [sys.executable, "-m", "cli", "simulate", *shape, "--overlap", "megatron-core",
            "--dropout", str(run.get("dropout", DGXC_DROPOUT)),
            *(["--gpus-per-node", str(run["gpus_per_node"])] if "gpus_per_node" in run else []),
            *(["--sp-saved-input", "sharded"] if run["sp"] else []),
            *(["--fp8-param-gather"] if run["precision"] == "fp8" and run["zero"] > 0 else []),  # the yaml's fp8_params
            *(["--tp-overlap-cfg", str(ROOT / "bench" / ub)] if ub and run["sp"] and run["tp"] > 1 else []),
            *layout_flags(run), "--json"]


def layout_flags(run: dict) -> list[str]:
    """The flags DGX-Cloud and MoE rows state alike: batch, layout (and "stage_layers"), format, GPU, the kernel last."""
    return ["--seq-len", str(run["s"]), "--global-batch", str(run["gb"]), "--micro-batch", str(run["mb"]),
            "--tp", str(run["tp"]), "--pp", str(run["pp"]), "--dp", str(run["dp"]), "--cp", str(run["cp"]),
            "--zero", str(run["zero"]), *(["--sequence-parallel"] if run["sp"] else []),
            "--schedule", "interleaved" if run["v"] > 1 else "1f1b", "--virtual-chunks", str(run["v"]),
            *(["--stage-layers", run["stage_layers"]] if run.get("stage_layers") else []),
            "--recompute", run["recompute"], "--precision", run["precision"], "--gpu", run["gpu"],
            *[arg for key in ("recompute_modules", "attention_kernel") if run.get(key)
              for arg in ("--" + key.replace("_", "-"), run[key])]]


def stated_rows(table: dict) -> list[dict]:
    """A DGX-Cloud table's rows with what the table states for all of them (its "attention_kernel": the v25.01 rows
    are copied unchanged from the validation file, so the kernel its configure.sh sets is stated beside them)."""
    stated = {"attention_kernel": table["attention_kernel"]} if "attention_kernel" in table else {}
    return [{**stated, **run} for run in table["rows"]]


DGXC_TABLES = {"dgxc": "dgxc_gpt3_175b_h100", "dgxc-v25.02": "dgxc_gpt3_175b_h100_v25_02",
               "dgxc-gb200": "dgxc_llama31_405b_gb200", "dgxc-llama-h100": "dgxc_llama31_h100",
               "dgxc-nemotron-h100": "dgxc_nemotron4_h100"}


def dgxc_naive(run: dict) -> float:
    """Half the dense peak: of the H100 over the GPT-3 convention's FLOPs, or of the row's GPU preset over the FLOPs
    a sequence its source states ("seq_flops")."""
    if "seq_flops" in run:
        peak = json.loads(HARDWARE.read_text())["gpus"][run["gpu"]]["peak_flops"][run["precision"]]
        return run["gb"] * run["seq_flops"] / (run["n_gpus"] * peak * 0.5)
    n_params = 12 * run["l"] * run["h"] ** 2 + run["V"] * run["h"]  # the convention's matmul parameters
    flops = run["gb"] * run["s"] * (6 * n_params + 12 * run["l"] * run["h"] * run["s"])
    return flops / (run["n_gpus"] * H100_PEAK[run["precision"]] * 0.5)


def dgxc_rows(table_name: str = "dgxc") -> tuple[list[dict], str]:
    table = json.loads(RUNS.read_text())[DGXC_TABLES[table_name]]
    out = []
    for run in stated_rows(table):
        sim, published, naive = run_simulate(dgxc_command(run), run["id"]), run["pub_s"], dgxc_naive(run)
        out.append({"name": run["id"], "gpus": run["n_gpus"], "precision": run["precision"],
                    "published_step_s": published, "predicted_step_s": sim["step_time_s"],
                    "error": sim["step_time_s"] / published - 1, "naive_step_s": naive,
                    "naive_error": naive / published - 1, "published_mfu": run["pub_mfu"], "predicted_mfu": sim["mfu"],
                    "breakdown": sim.get("breakdown")})
    return out, table["source"]


TORCHTITAN_TOKENS = 2 * 8192  # a GPU's tokens a step in torchtitan's Tables 1 and 3: local batch 2 of 8,192


def torchtitan_command(run: dict) -> list[str]:
    """`minigpt simulate` of a torchtitan row as its config (llama3_8b.toml at 9dec370) runs it: the row's "assumed"."""
    n = run["n_gpus"]
    return [sys.executable, "-m", "cli", "simulate", "--model", "llama3-8b", "--seq-len", "8192", "--dp", str(n),
            "--zero", "3", "--micro-batch", "2", "--global-batch", str(2 * n), "--recompute", "op",
            "--gpu", "h100-96gb-500w", "--overlap", "torchtitan-fsdp2", "--elementwise", run["elementwise"], "--json"]


def torchtitan_cp_command(run: dict) -> list[str]:
    """`minigpt simulate` of a row of torchtitan's long-context table (Table 2) as the table's "assumed" says it ran:
    one sequence per FSDP rank split over its cp ranks, all-gathered keys and values, full recomputation, compiled,
    torchao's float8 Linears."""
    return [sys.executable, "-m", "cli", "simulate", "--model", "llama3-8b", "--seq-len", str(run["s"]),
            "--dp", str(run["dp"]), "--cp", str(run["cp"]), *(["--cp-kind", "allgather"] if run["cp"] > 1 else []),
            "--zero", "3", "--micro-batch", "1", "--global-batch", str(run["dp"]), "--recompute", "full",
            "--gpu", "h100-96gb-500w", "--overlap", "torchtitan-fsdp2", "--elementwise", "fused", "--precision", "fp8",
            "--fp8-recipe", "current", "--json"]


TORCHTITAN_TABLES = {  # table: (its key in published_runs.json, its command, a GPU's tokens a step, its precision)
    "torchtitan": ("torchtitan_llama3_h100", torchtitan_command, lambda run: TORCHTITAN_TOKENS, "bf16"),
    "torchtitan-cp": ("torchtitan_cp_llama3_h100", torchtitan_cp_command,
                      lambda run: run["dp"] * run["s"] // run["n_gpus"], "fp8")}


def torchtitan_rows(name: str = "torchtitan") -> tuple[list[dict], str]:
    """torchtitan's Llama 3.1 8B rows (TORCHTITAN_TABLES: 1D FSDP, or FSDP with context parallelism): step times
    from the published tokens/s per GPU, and the published peak reserved memory beside the predicted memory."""
    key, command, tokens, precision = TORCHTITAN_TABLES[name]
    table = json.loads(RUNS.read_text())[key]
    out = []
    for run in table["rows"]:
        n, sim = run["n_gpus"], run_simulate(command(run), run["id"])
        published = tokens(run) / run["tps"]
        naive = 6 * sim["parameters"]["total"] * tokens(run) / (H100_PEAK["bf16"] * 0.5)
        out.append({"name": run["id"], "gpus": n, "precision": precision, "published_step_s": published,
                    "predicted_step_s": sim["step_time_s"], "error": sim["step_time_s"] / published - 1,
                    "naive_step_s": naive, "naive_error": naive / published - 1,
                    "published_memory_gib": run["memory_gib"], "predicted_memory_gib": sim["memory_per_gpu"]["total"] / 2**30,
                    "breakdown": sim.get("breakdown")})
    return out, table["source"]


MOE_FIELDS = {"--layers": "n_layers", "--hidden": "d_model", "--heads": "n_heads", "--kv-heads": "n_kv_heads",
              "--d-ff": "d_ff", "--vocab": "vocab_size", "--head-dim": "d_head", "--expert-width": "d_expert",
              "--experts": "n_experts", "--top-k": "top_k", "--mtp-depth": "mtp_depth"}  # the rows' model flags


def moe_command(run: dict) -> list[str]:
    """`minigpt simulate` with the run's model, layout, batch, recomputation, format, GPU and stack."""
    model = [arg for flag, value in run["model_flags"].items() for arg in (flag, str(value))]
    return [sys.executable, "-m", "cli", "simulate", "--model", run["model"], *model, "--ep", str(run["ep"]),
            *(["--no-reshard-after-forward"] if run["reshard_after_forward"] is False else []),
            *(["--sync-grads-once"] if run.get("sync_grads_once") else []), "--overlap", run["overlap"],
            "--dropout", str(run["dropout"]), "--ep-dispatcher", run.get("dispatcher", "alltoall"),
            *(["--no-tp-overlap"] if run.get("tp_overlap") is False else []),
            *(["--fp8-recipe", run["fp8_recipe"]] if run.get("fp8_recipe") else []),
            *(["--fp8-param-gather"] if run.get("fp8_param_gather") else []),
            *(["--elementwise", run["elementwise"]] if run.get("elementwise") else []),
            *(["--tp-overlap-cfg", str(ROOT / run["tp_overlap_cfg"])] if run.get("tp_overlap_cfg") else []),
            *layout_flags(run), "--json"]


def megatron_flops(shape: dict, batch: int, seq: int) -> float:
    """FLOPs of a step as Megatron-Core v0.9 counts them (training.py, num_floating_point_operations):
    full s x s attention scores, no router, SwiGLU's third GEMM as 3/2."""
    h, l = shape["hidden"], shape["layers"]
    query = shape["kv_channels"] * shape["heads"] / h
    attention = (1 + shape["query_groups"] / shape["heads"] + seq / h) * query
    mlp = shape["ffn"] / h * shape["topk"] * (1.5 if shape["swiglu"] else 1)
    return 12 * batch * seq * l * h * h * (attention + mlp + shape["padded_vocab"] / (2 * l * h))


def published_step(run: dict) -> float:
    """The source's step time: published, or its tokens/s per GPU, or its convention's FLOPs over its TFLOP/s."""
    pub, tokens = run["published"], run["gb"] * run["s"]
    if "step_s" in pub:
        return pub["step_s"]
    if "tokens_per_s_per_gpu" in pub:
        return tokens / (pub["tokens_per_s_per_gpu"] * run["n_gpus"])
    if pub.get("conv") == "mcore_flops":
        return megatron_flops(run["conv_shape"], run["gb"], run["s"]) / (pub["tflops_per_gpu"] * 1e12 * run["n_gpus"])
    raise SystemExit(f"{run['id']}: no step time, tokens/s or FLOP convention to derive a published step from")


def naive_step(run: dict) -> float:
    """6 x active parameters x tokens over (GPUs x the dense peak of the run's format x 0.5)."""
    from minigpt.presets import build_config  # torch-free: the shapes' one home (only this table needs it)
    fields = {MOE_FIELDS[flag]: value for flag, value in run["model_flags"].items()}
    active = build_config(run["model"], seq_len=run["s"], **fields).active_params()
    peak = json.loads(HARDWARE.read_text())["gpus"][run["gpu"]]["peak_flops"][run["precision"]]
    return 6 * active * run["gb"] * run["s"] / (run["n_gpus"] * peak * 0.5)


def moe_row(run: dict) -> dict:
    sim, published, naive = run_simulate(moe_command(run), run["id"]), published_step(run), naive_step(run)
    peak = sim["tflops_per_gpu"] / sim["mfu"]  # the peak the simulator's MFU divides by (TFLOP/s)
    pub_tflops = run["published"].get("tflops_per_gpu")
    return {"name": run["id"], "gpus": run["n_gpus"], "precision": run["precision"], "published_step_s": published,
            "predicted_step_s": sim["step_time_s"], "error": sim["step_time_s"] / published - 1,
            "naive_step_s": naive, "naive_error": naive / published - 1, "predicted_mfu": sim["mfu"],
            "published_mfu": pub_tflops / peak if pub_tflops else None, "breakdown": sim["breakdown"],
            "fits": sim["fits"], "why": run.get("why")}


def refusal(run: dict) -> dict:
    """What `minigpt simulate` says to a layout it cannot run (its one-line error), or that it ran."""
    result = subprocess.run(moe_command(run), capture_output=True, text=True, cwd=ROOT)
    said = result.stderr.strip().splitlines()[-1] if result.returncode else "ran (not refused)"
    return {"name": run["id"], "gpus": run["n_gpus"], "published": run["published"], "why": run["why"],
            "simulate_says": said}


def moe_rows() -> tuple[list[dict], list[dict], list[dict], dict]:
    table = json.loads(RUNS.read_text())["moe_training"]
    return ([moe_row(run) for run in table["rows"]], [moe_row(run) for run in table["outside_mape"]],
            [refusal(run) for run in table["refused"]], table["sources"])


def print_moe(as_json: bool) -> None:
    rows, outside, refused, sources = moe_rows()
    if as_json:
        print(json.dumps({"rows": rows, "simulator": summary(rows, "error"), "naive": summary(rows, "naive_error"),
                          "outside_mape": outside, "refused": refused, "sources": sources}))
        return
    report(rows, sources, False, "MFU pub / pred", moe_mfu)
    print("\nsimulated with an approximation, outside the summary:")
    for r in outside:
        print(f"- {r['name']} ({r['gpus']} GPUs): published {r['published_step_s']:.2f} s, predicted "
              f"{r['predicted_step_s']:.2f} s ({r['error']:+.1%}; MFU {moe_mfu(r)}; naive {r['naive_error']:+.1%})"
              f"{'' if r['fits'] else ', over the memory by its count'}: {r['why']}")
    print("\nrefused by minigpt simulate, outside the summary:" if refused else "\nnone refused by minigpt simulate")
    for r in refused:
        print(f"- {r['name']} ({r['gpus']} GPUs, published {r['published']}): {r['simulate_says']}")


def moe_mfu(row: dict) -> str:
    published = "n/a" if row["published_mfu"] is None else f"{row['published_mfu']:.1%}"
    return f"{published} / {row['predicted_mfu']:.1%}"


def summary(table: list[dict], key: str) -> dict:
    errors = [row[key] for row in table]
    return {"mape": statistics.mean(abs(e) for e in errors), "signed_mean": statistics.mean(errors),
            "worst": max(errors, key=abs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--legacy", action="store_true", help="only the flags an older minigpt simulate knows")
    parser.add_argument("--table", choices=("narayanan", *DGXC_TABLES, "moe", *TORCHTITAN_TABLES), default="narayanan")
    parser.add_argument("--implied-rate", action="store_true",
                        help="per run of the A100, DGX-Cloud and Llama 3 tables, the tensor-core rate factor that meets it")
    args = parser.parse_args()
    if args.implied_rate:
        return print_implied(args.json)
    if args.table in DGXC_TABLES:
        return print_dgxc(args.json, args.table)
    if args.table == "moe":
        return print_moe(args.json)
    if args.table in TORCHTITAN_TABLES:
        table, source = torchtitan_rows(args.table)
        return report(table, source, args.json, "memory GiB pub (max reserved) / pred",
                      lambda r: f"{r['published_memory_gib']:.1f} / {r['predicted_memory_gib']:.1f}")
    table, source = rows(args.legacy)
    report(table, source["paper"], args.json, "TFLOP/s pub / pred",
           lambda r: f"{r['published_tflops_per_gpu']} / {r['predicted_tflops_per_gpu']:.0f}")


def print_dgxc(as_json: bool, table_name: str = "dgxc") -> None:
    table, source = dgxc_rows(table_name)
    # both in the run's own convention (its FLOP count over its peak: fp8 rows over the fp8 peak), so the predicted MFU
    # is the published one scaled by the step times
    report(table, source, as_json, "MFU pub / pred (the run's convention)",
           lambda r: f"{r['published_mfu']:.1%} / {r['published_mfu'] * r['published_step_s'] / r['predicted_step_s']:.1%}",
           by_precision=True)


IMPLIED_LOW = 0.75  # --implied-rate's second point of the two-point solve: any factor well away from 1
TENSOR_FORMATS = ("bf16", "fp16", "fp8")
LLAMA3_CHUNKS = 7  # --implied-rate's Llama 3 405B: interleaved chunks per stage, 126 layers over 16 stages


def scaled_profile(gpu: str, factor: float, folder: Path) -> Path:
    """A profile of preset `gpu` with its tensor-core peaks times `factor`."""
    from simulator.costs.hardware import load_hardware, save_hardware

    hardware = load_hardware(gpu)
    peaks = {fmt: (peak * factor if peak and fmt in TENSOR_FORMATS else peak)
             for fmt, peak in hardware.gpu.peak_flops.items()}
    return save_hardware(replace(hardware, gpu=replace(hardware.gpu, peak_flops=peaks)), folder / f"{gpu}-{factor}.json")


def simulated(args: list[str], profile: Path, name: str) -> dict:
    """`minigpt simulate` of `args` (which name a --gpu) on `profile` instead."""
    args = list(args)
    at = args.index("--gpu")
    args[at : at + 2] = ["--hardware", str(profile)]
    return run_simulate(args, name)


def llama3_command(row: dict) -> list[str]:
    return [sys.executable, "-m", "cli", "simulate", "--model", row["model"], "--tp", str(row["tp"]),
            "--cp", str(row["cp"]), "--pp", str(row["pp"]), "--dp", str(row["dp"]), "--zero", "1",
            "--seq-len", str(row["s"]), "--global-batch", str(row["gb"]), "--micro-batch", "1",
            "--sequence-parallel", "--sp-saved-input", "sharded", "--schedule", "interleaved",
            "--virtual-chunks", str(LLAMA3_CHUNKS), "--gpu", "h100-sxm", "--overlap", "megatron-core",
            "--attention-kernel", "flash-attn-2", "--json"]  # Meta's own stack, not Transformer Engine: FA2's table


def implied_runs() -> list[tuple[str, str, list[str], object]]:
    """(family, name, simulate's arguments, the published step: seconds, or a function of the simulation)."""
    data = json.loads(RUNS.read_text())
    seq, vocab = data["common"]["sequence_length"], data["common"]["vocabulary"]
    out = [("Narayanan et al. 2021, A100", run["name"], command(run, seq, vocab, False),
            paper_flops(run, seq, vocab) / (run["achieved_tflops_per_gpu"] * 1e12 * run["gpus"]))
           for run in data["runs"]]
    out += [(f"DGX-Cloud GPT-3 175B, H100, {row['precision']}", row["id"], dgxc_command(row), row["pub_s"])
            for row in stated_rows(data["dgxc_gpt3_175b_h100"])]
    out += [("Llama 3 405B, H100", row["id"], llama3_command(row),
             lambda sim, row=row: sim["step_time_s"] * sim["tflops_per_gpu"] / row["pub_tflops"])
            for row in data["llama3_405b_h100"]["rows"]]
    return out


def implied(family: str, name: str, args: list[str], published, folder: Path) -> dict:
    gpu = args[args.index("--gpu") + 1]
    full = run_simulate(args, name)  # the preset itself: factor 1
    low = simulated(args, scaled_profile(gpu, IMPLIED_LOW, folder), name)["step_time_s"]
    step = published(full) if callable(published) else published
    b = (low - full["step_time_s"]) / (1 / IMPLIED_LOW - 1)  # the tensor-core part at factor 1
    a = full["step_time_s"] - b
    factor = b / (step - a) if step > a else None  # None: even infinitely fast tensor cores would not be slow enough
    return {"family": family, "name": name, "gpu": gpu, "published_step_s": step,
            "predicted_step_s": full["step_time_s"], "error": full["step_time_s"] / step - 1,
            "tensor_core_share": b / full["step_time_s"], "factor": factor}


def print_implied(as_json: bool) -> None:
    with tempfile.TemporaryDirectory() as folder:
        rows = [implied(*run, Path(folder)) for run in implied_runs()]
    families = {}
    for row in rows:
        families.setdefault(row["family"], []).append(row["factor"])
    by_family = {family: {"mean": statistics.fmean(f), "min": min(f), "max": max(f)}
                 for family, f in families.items() if None not in f}
    if as_json:
        print(json.dumps({"rows": rows, "by_family": by_family}))
        return
    print("| run | GPU | published step s | predicted s | error | tensor-core share of the step | factor needed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        factor = "-" if r["factor"] is None else f"{r['factor']:.3f}"
        print(f"| {r['name']} | {r['gpu']} | {r['published_step_s']:.2f} | {r['predicted_step_s']:.2f} | "
              f"{r['error']:+.1%} | {r['tensor_core_share']:.0%} | {factor} |")
    for family, f in by_family.items():
        print(f"{family}: factor {f['mean']:.3f} on average ({f['min']:.3f}-{f['max']:.3f})")


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
