"""Kernel benchmark for a lent GPU: GEMM efficiency by number format, element-wise bandwidth, launches, attention.

    python bench/gpu_kernels.py --out kernels.json [--budget-s 150] [--dry-run]

Runs on a bare machine: torch, the repository root on PYTHONPATH, no install; it imports only
minigpt.config (gpt2-124m's shape) and parallel.calibrate.kernels (every timer; its docstring says
how each kernel is timed and how FLOPs and bytes are counted). Without CUDA, or with --dry-run, the
same code runs at tiny sizes on the CPU (a few seconds: CI runs it).

Measured, in this order (--budget-s stops it between measurements, and the JSON lists what was skipped):
1. launch overhead: a tiny kernel back to back, seconds per launch;
2. element-wise achieved bandwidth: copy, add, GELU, LayerNorm, softmax in bf16 and fp32 on 256 MiB
   tensors (CPU dry run: 4 MiB), well past an H100/H200's 50-60 MB L2;
3. square GEMMs n x n x n in fp32 (TF32 off), tf32, bf16, fp16, fp8 and fp8_fast (torch._scaled_mm
   without and with fast accumulation), n = 256..16384 in powers of 2 (CPU dry run: 64..256, fp8 only up
   to 64^3 multiply-adds: DRY_RUN_FP8_MACS);
4. the real GEMMs (m = tokens, k = input, n = output) of gpt2-124m (minigpt/config.py's preset:
   qkv, proj, fc1, fc2, head at 8 x 1024 = 8192 tokens, the micro-batch bench/gpu.sh trains it with)
   and of Llama 3 8B / 70B / 405B (LLAMA3 below: one 8192-token sequence), each also on one rank of
   tensor parallelism 2, 4, 8 (column-parallel qkv, fc1 / gate+up and head: output / tp; row-parallel
   proj / o and fc2 / down: input / tp), in bf16, fp8 and fp8_fast; every dimension rounded up to a
   multiple of 16 (fp8's requirement, so that every format times the same shape: gpt2's vocabulary
   50257 becomes 50272); CPU dry run: every dimension / 64 (then rounded up to 16), 64 tokens;
5. attention, bf16, causal: scaled_dot_product_attention against unfused (matmul, softmax, matmul),
   forward and forward + backward, sequence 1K, 2K, 4K, 8K at 16K tokens (batch = 16K / sequence),
   head dim 64 with 12 heads (gpt2-124m) and 128 with 32 heads (Llama 3 8B); CPU dry run: sequence
   64 and 128, 2 heads, 256 tokens;
6. weight-gradient GEMMs (dW = dY^T X: m = outputs, n = inputs, k = tokens) of GPT-3 175B at tp 4 over 2048 tokens
   and Llama 3 70B at tp 8 over 8192 (WGRAD_SHAPES), three ways (WGRAD_WAYS): writing bf16 (what the GEMM tables and
   the simulator's GEMM model describe), accumulating into an fp32 main gradient inside the GEMM (torch.addmm with
   out_dtype float32: cuBLAS reads and writes the fp32 result, as Megatron-core's gradient_accumulation_fusion and
   Transformer Engine's fuse_wgrad_accumulation run it; torch refuses it before CUDA: "refused"), and the bf16 GEMM
   then a separate fp32 add (the unfused path); CPU dry run: every dimension / 64, all in fp32.
Efficiency = achieved rate / the best rate measured in that format in this run; rates in TFLOP/s.

Why 6: the simulator prices the fused accumulation as the GEMM or its bytes, whichever is longer (the roofline's
max); a weight gradient over few tokens reads and writes 8 bytes of fp32 a weight for 2 x tokens FLOPs a weight, so
whether cuBLAS hides that epilogue behind its main loop decides a few percent of a Megatron step.

H200 wall time, estimated (`estimate_seconds`, printed by every run): each measurement makes a warm-up
call, a probe call and `repeats` runs of max(1, ceil(min_run_s / t)) calls, t = FLOPs / rate or bytes /
bandwidth + a 5 us launch, plus 20 ms of set-up each (random operands, Python), plus 10 s to start
Python, torch and CUDA. Rates (H200_RATES): dense bf16 790 TFLOP/s, fp32 60 TFLOP/s and a 4.3 TB/s copy
(this project's earlier measurements on such a machine, random data); fp16 as bf16 (the same datasheet
rate), tf32 395 (half of bf16, the datasheet's ratio), fp8 1200 (below the datasheet's 2x of bf16, to
stay on the long side); fused attention 400 TFLOP/s forward and 300 forward + backward (assumed: about
half of dense bf16), unfused charged its full square's FLOPs at the bf16 rate plus 3 (forward) or 9
(forward + backward) passes of its s x s matrix through HBM; the 5 us launch and 20 ms set-up are
assumptions too. The sum is about 57 s: the real GEMMs ~32 s (240 of them, mostly each one's 5 x 20 ms timed
runs), the square GEMMs ~6 s (fp32 at 16384, 0.15 s a call, ~1 s of it), attention ~4 s, the weight gradients ~3 s,
element-wise ~1 s, start-up 10 s; under the 2.5 minutes asked with room for rates half as good, and --budget-s caps it
whatever the GPU turns out to be. The CPU dry run takes about 4 s here (2-core AMD EPYC, torch 2.13; on a 2-core
Intel Xeon 131 s before fp8 was limited to DRY_RUN_FP8_MACS).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import torch

from minigpt.presets import preset
from parallel.calibrate.kernels import (ELEMENTWISE, FORMATS, attention_flops, launch_overhead, supported_formats,
                                        time_attention, time_call, time_elementwise, time_gemm)

# Meta, "The Llama 3 Herd of Models" (2024), Table 3: model dimension, FFN dimension, attention heads
# (all of head dim 128), 8 key/value heads. The vocabulary, 128,256 entries, is the released models'
# (their config.json; the paper rounds it to 128K tokens).
LLAMA3 = {"llama3-8b": (4096, 14336, 32), "llama3-70b": (8192, 28672, 64), "llama3-405b": (16384, 53248, 128)}
LLAMA3_KV_HEADS, LLAMA3_HEAD_DIM, LLAMA3_VOCAB = 8, 128, 128256
LLAMA3_TOKENS = 8192  # one sequence of 8192 tokens, the paper's pre-training context length
GPT2_MICRO_BATCH = 8  # bench/gpu.sh trains gpt2-124m at batch 8: 8 x 1024 tokens
TENSOR_PARALLEL = (1, 2, 4, 8)
COLUMN, ROW = "column", "row"  # which dimension tensor parallelism splits: output (column) or input (row)
H200_RATES = {"fp32": 60e12, "tf32": 395e12, "bf16": 790e12, "fp16": 790e12, "fp8": 1200e12, "fp8_fast": 1200e12,
              "hbm": 4.3e12, "launch_s": 5e-6, "sdpa_forward": 400e12, "sdpa_backward": 300e12,
              "setup_s": 0.02, "start_s": 10.0}  # see the module docstring


@dataclass(frozen=True)
class Plan:
    dry_run: bool
    square_sizes: tuple[int, ...]
    square_formats: tuple[str, ...]
    shape_formats: tuple[str, ...]
    shrink: int  # every model dimension / shrink (1 on a GPU)
    gpt2_tokens: int
    llama_tokens: int
    elementwise_bytes: int
    attention_seqs: tuple[int, ...]
    attention_tokens: int
    attention_heads: tuple[tuple[int, int], ...]  # (head dim, heads)
    min_run_s: float
    repeats: int


def make_plan(dry_run: bool) -> Plan:
    if dry_run:
        return Plan(True, (64, 128, 256), FORMATS, ("bf16", "fp8", "fp8_fast"), 64, 64, 64, 4 * 2**20, (64, 128),
                    256, ((64, 2), (128, 2)), 0.002, 3)
    return Plan(False, tuple(2**i for i in range(8, 15)), FORMATS, ("bf16", "fp8", "fp8_fast"), 1,
                GPT2_MICRO_BATCH * preset("gpt2-124m").seq_len, LLAMA3_TOKENS, 256 * 2**20, (1024, 2048, 4096, 8192),
                16384, ((64, 12), (128, 32)), 0.02, 5)


def round16(value: int) -> int:
    return max(16, -(-value // 16) * 16)


def model_gemms(plan: Plan) -> list[dict]:
    """Every real GEMM: {model, gemm, tp, split, m, n, k}, dimensions / plan.shrink, / tp, rounded up to 16."""
    gpt2 = preset("gpt2-124m")
    d, f, v = gpt2.d_model, gpt2.d_ff, gpt2.vocab_size
    layers = {"gpt2-124m": (plan.gpt2_tokens, [("qkv", d, 3 * d, COLUMN), ("proj", d, d, ROW),
                                               ("fc1", d, f, COLUMN), ("fc2", f, d, ROW), ("head", d, v, COLUMN)])}
    for name, (d, ffn, _heads) in LLAMA3.items():
        qkv = d + 2 * LLAMA3_KV_HEADS * LLAMA3_HEAD_DIM  # grouped-query attention: q of d, k and v of 8 heads each
        layers[name] = (plan.llama_tokens, [("qkv", d, qkv, COLUMN), ("o", d, d, ROW), ("gate_up", d, 2 * ffn, COLUMN),
                                            ("down", ffn, d, ROW), ("head", d, LLAMA3_VOCAB, COLUMN)])
    gemms = []
    for name, (tokens, shapes) in layers.items():
        for gemm, k, n, split in shapes:
            k, n = -(-k // plan.shrink), -(-n // plan.shrink)
            for tp in TENSOR_PARALLEL:
                kt, nt = (k, -(-n // tp)) if split == COLUMN else (-(-k // tp), n)
                gemms.append({"model": name, "gemm": gemm, "tp": tp, "split": split, "m": round16(tokens),
                              "n": round16(nt), "k": round16(kt)})
    return gemms


# name: (outputs, inputs, tokens) of a weight-gradient GEMM on one tensor-parallel rank: GPT-3 175B at tp 4 (one
# 2048-token sequence, the DGX-Cloud rows' micro-batch; fc2's is fc1's shape transposed, 12288 x 12288), Llama 3 70B
# at tp 8 (one 8192-token sequence; q of 8192 and k, v of 8 heads of 128 each, over 8)
WGRAD_SHAPES = {"gpt3-175b tp4 qkv": (3 * 12288 // 4, 12288, 2048), "gpt3-175b tp4 proj": (12288, 12288 // 4, 2048),
                "gpt3-175b tp4 fc1": (4 * 12288 // 4, 12288, 2048),
                "llama3-70b tp8 qkv": ((8192 + 2 * 8 * 128) // 8, 8192, 8192),
                "llama3-70b tp8 o": (8192, 8192 // 8, 8192),
                "llama3-70b tp8 gate_up": (2 * 28672 // 8, 8192, 8192), "llama3-70b tp8 down": (8192, 28672 // 8, 8192)}
WGRAD_WAYS = ("bf16_out", "fp32_accumulate", "separate_add")


def wgrad_call(way: str, outputs: int, inputs: int, tokens: int, device: torch.device):
    """One weight-gradient GEMM (outputs x tokens) @ (tokens x inputs) the `way` of WGRAD_WAYS: bf16 operands on a GPU
    (fp32 on the CPU dry run), the fp32 main gradient (outputs x inputs) the accumulating ways add into."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    grad = torch.randn(tokens, outputs, device=device, dtype=dtype)  # dY, token-major as the backward has it
    x = torch.randn(tokens, inputs, device=device, dtype=dtype)
    main = torch.zeros(outputs, inputs, device=device, dtype=torch.float32)
    if way == "fp32_accumulate":  # cuBLAS with an fp32 C read and an fp32 result written, beta 1
        if device.type == "cuda":
            return lambda: torch.addmm(main, grad.t(), x, out_dtype=torch.float32)
        return lambda: torch.addmm(main, grad.t(), x)
    out = torch.empty(outputs, inputs, device=device, dtype=dtype)
    if way == "bf16_out":
        return lambda: torch.mm(grad.t(), x, out=out)
    return lambda: main.add_(torch.mm(grad.t(), x, out=out))


def time_wgrad(way: str, outputs: int, inputs: int, tokens: int, device: torch.device, min_run_s: float,
               repeats: int) -> dict:
    call = wgrad_call(way, outputs, inputs, tokens, device)
    timing = time_call(call, device, min_run_s, repeats)
    del call
    flops = 2 * outputs * inputs * tokens
    return {"seconds": timing.seconds, "flops_per_s": flops / timing.seconds, "spread": timing.spread,
            "calls": timing.calls}


# ---------------------------------------------------------------- the jobs


# torch's CPU _scaled_mm runs fp8 at about 10 MFLOP/s on some CPUs (0.4 s for a 128 x 64 x 256 GEMM on an Intel
# Xeon here, where the dry run then took 131 s): the CPU dry run times fp8 GEMMs of at most 64^3 multiply-adds,
# which takes its code path in a fraction of a second each.
DRY_RUN_FP8_MACS = 64**3


def timed_in_dry_run(plan: Plan, fmt: str, m: int, n: int, k: int) -> bool:
    return not (plan.dry_run and fmt.startswith("fp8") and m * n * k > DRY_RUN_FP8_MACS)


def jobs(plan: Plan, device: torch.device) -> list[tuple[str, dict, callable]]:
    """(section, what, run) in the order they run: run() -> a result dict."""
    run_s, reps = plan.min_run_s, plan.repeats
    formats = [f for f in plan.square_formats if f in supported_formats(device)]
    todo = [("launch", {}, lambda: launch_overhead(device, run_s, reps))]
    for op in ELEMENTWISE:
        for fmt in ("bf16", "fp32"):
            todo.append(("elementwise", {"op": op, "format": fmt, "tensor_bytes": plan.elementwise_bytes},
                         lambda op=op, fmt=fmt: time_elementwise(op, fmt, plan.elementwise_bytes, device, run_s, reps)))
    for n in plan.square_sizes:
        for fmt in (f for f in formats if timed_in_dry_run(plan, f, n, n, n)):
            todo.append(("square", {"format": fmt, "m": n, "n": n, "k": n},
                         lambda fmt=fmt, n=n: time_gemm(fmt, n, n, n, device, run_s, reps)))
    for shape in model_gemms(plan):
        for fmt in (f for f in plan.shape_formats if timed_in_dry_run(plan, f, shape["m"], shape["n"], shape["k"])):
            todo.append(("shapes", {**shape, "format": fmt},
                         lambda s=shape, fmt=fmt: time_gemm(fmt, s["m"], s["n"], s["k"], device, run_s, reps)))
    for head_dim, heads in plan.attention_heads:
        for seq in plan.attention_seqs:
            batch = max(1, plan.attention_tokens // seq)
            for backward in (False, True):
                for fused in (True, False):
                    what = {"fused": fused, "backward": backward, "batch": batch, "heads": heads, "seq": seq,
                            "head_dim": head_dim}
                    todo.append(("attention", what, lambda w=what: time_attention(
                        w["fused"], w["backward"], w["batch"], w["heads"], w["seq"], w["head_dim"], device, run_s,
                        reps)))
    for name, (outputs, inputs, tokens) in WGRAD_SHAPES.items():
        o, i, t = (round16(-(-v // plan.shrink)) for v in (outputs, inputs, tokens))
        for way in WGRAD_WAYS:
            todo.append(("wgrad", {"gemm": name, "way": way, "outputs": o, "inputs": i, "tokens": t},
                         lambda way=way, o=o, i=i, t=t: time_wgrad(way, o, i, t, device, run_s, reps)))
    return todo


def job_seconds(section: str, what: dict, plan: Plan, rates: dict) -> float:
    """The estimated seconds of one job at `rates` (see the module docstring)."""
    if section == "launch":
        t = rates["launch_s"]
    elif section == "elementwise":
        t = (3 if what["op"] == "add" else 2) * what["tensor_bytes"] / rates["hbm"] + rates["launch_s"]
    elif section in ("square", "shapes"):
        m, n, k = what["m"], what["n"], what["k"]
        t = max(2 * m * n * k / rates[what["format"]], (m * k + k * n + m * n) * 2 / rates["hbm"]) + rates["launch_s"]
    elif section == "wgrad":  # the GEMM's FLOPs or bytes, and the fp32 main gradient read and written (8 bytes a
        o, i, tk = what["outputs"], what["inputs"], what["tokens"]  # weight) when it accumulates, 12 when apart
        main = {"bf16_out": 0, "fp32_accumulate": 8, "separate_add": 12}[what["way"]] * o * i / rates["hbm"]
        t = max(2 * o * i * tk / rates["bf16"], (o * tk + tk * i + o * i) * 2 / rates["hbm"]) + main + rates["launch_s"]
    else:
        b, h, s, d = what["batch"], what["heads"], what["seq"], what["head_dim"]
        flops = attention_flops(b, h, s, d, True, what["backward"])
        if what["fused"]:
            t = flops / rates["sdpa_backward" if what["backward"] else "sdpa_forward"]
        else:  # the full square's work, and the s x s matrix through HBM 3 (forward) or 9 (and backward) times
            passes = 9 if what["backward"] else 3
            t = 2 * flops / rates["bf16"] + passes * b * h * s * s * 2 / rates["hbm"]
    calls = 2 + plan.repeats * max(1, math.ceil(plan.min_run_s / t))
    return rates["setup_s"] + calls * t


def estimate_seconds(plan: Plan, device: torch.device, rates: dict = H200_RATES) -> dict:
    """{section: estimated seconds} at `rates` and "total" (with the start-up)."""
    sections: dict[str, float] = {}
    for section, what, _ in jobs(plan, device):
        sections[section] = sections.get(section, 0.0) + job_seconds(section, what, plan, rates)
    sections["total"] = rates["start_s"] + sum(sections.values())
    return {k: round(v, 1) for k, v in sections.items()}


def run_jobs(plan: Plan, device: torch.device, budget_s: float, started: float) -> dict:
    """Every job until the budget is spent: {section: [result, ...], "skipped": [...], "refused": [...]}."""
    results: dict[str, list] = {"launch": [], "elementwise": [], "square": [], "shapes": [], "attention": [],
                                "wgrad": [], "skipped": [], "refused": []}
    for section, what, run in jobs(plan, device):
        if time.perf_counter() - started > budget_s:
            results["skipped"].append({"section": section, **what})
            continue
        try:
            result = run()
        except (RuntimeError, ValueError) as error:  # fp8 before Hopper, out of memory, ...
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            results["refused"].append({"section": section, **what, "error": message})
            result = None
        if result is None:
            if device.type == "cuda":
                torch.cuda.empty_cache()  # after the error and its frames (holding the operands) are gone
            continue
        results[section].append({**what, **result})
    return results


# ---------------------------------------------------------------- the report


def add_efficiency(results: dict) -> dict:
    """Each GEMM's efficiency against the best rate measured in its format; {format: best TFLOP/s}."""
    best: dict[str, float] = {}
    for row in results["square"] + results["shapes"]:
        best[row["format"]] = max(best.get(row["format"], 0.0), row["flops_per_s"])
    for row in results["square"] + results["shapes"]:
        row["tflops"] = row["flops_per_s"] / 1e12
        row["efficiency"] = row["flops_per_s"] / best[row["format"]]
    return {fmt: best[fmt] / 1e12 for fmt in FORMATS if fmt in best}


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def cell(row: dict | None) -> str:
    return "-" if row is None else f"{row['tflops']:.3g} ({row['efficiency']:.0%})"


def gemm_tables(results: dict) -> str:
    square = {(r["m"], r["format"]): r for r in results["square"]}
    formats = [f for f in FORMATS if any(fmt == f for _, fmt in square)]
    sizes = sorted({n for n, _ in square})
    out = ["GEMM n x n x n: TFLOP/s (efficiency = / the format's best in this run)",
           table(["n"] + formats, [[str(n)] + [cell(square.get((n, f))) for f in formats] for n in sizes])]
    shapes: dict[tuple, dict] = {}
    for r in results["shapes"]:
        shapes.setdefault((r["model"], r["gemm"], r["tp"], r["m"], r["n"], r["k"]), {})[r["format"]] = r
    shape_formats = [f for f in FORMATS if any(f in by for by in shapes.values())]
    rows = [[model, gemm, str(tp), f"{m} x {n} x {k}"] + [cell(by.get(f)) for f in shape_formats]
            for (model, gemm, tp, m, n, k), by in shapes.items()]
    out += ["", "Real GEMMs (m tokens x n out x k in, one tensor-parallel rank): TFLOP/s (efficiency)",
            table(["model", "gemm", "tp", "m x n x k"] + shape_formats, rows)]
    return "\n".join(out)


def other_tables(results: dict) -> str:
    out = []
    if results["launch"]:
        out.append(f"Launch overhead: {results['launch'][0]['per_launch_s'] * 1e6:.2f} us per launch "
                   f"(spread {results['launch'][0]['spread']:.0%})")
    by = {(r["op"], r["format"]): r for r in results["elementwise"]}
    if by:
        ops = [op for op in ELEMENTWISE if any(o == op for o, _ in by)]
        rows = [[op] + [f"{by[(op, f)]['bytes_per_s'] / 1e9:.1f}" if (op, f) in by else "-" for f in ("bf16", "fp32")]
                for op in ops]
        out += ["", "Element-wise, GB/s (bytes read + written)", table(["op", "bf16", "fp32"], rows)]
    att: dict[tuple, dict] = {}
    for r in results["attention"]:
        att.setdefault((r["head_dim"], r["heads"], r["seq"], r["batch"]), {})[(r["fused"], r["backward"])] = r
    if att:
        def rate(row):
            return "-" if row is None else f"{row['flops_per_s'] / 1e12:.3g}"
        rows = [[str(d), str(h), str(s), str(b)] + [rate(by.get(key)) for key in
                                                    ((True, False), (False, False), (True, True), (False, True))]
                for (d, h, s, b), by in att.items()]
        out += ["", "Attention, bf16, causal: TFLOP/s (FlashAttention-2's FLOP count: 4 b h s^2 d / 2 forward, "
                    "x 3.5 forward + backward)",
                table(["head dim", "heads", "seq", "batch", "sdpa fwd", "unfused fwd", "sdpa fwd+bwd",
                       "unfused fwd+bwd"], rows)]
    return "\n".join(out + wgrad_table(results))


def wgrad_table(results: dict) -> list[str]:
    by: dict[tuple, dict] = {}
    for r in results["wgrad"]:
        by.setdefault((r["gemm"], r["outputs"], r["inputs"], r["tokens"]), {})[r["way"]] = r
    if not by:
        return []

    def ratio(ways: dict, way: str) -> str:
        if way not in ways or "bf16_out" not in ways:
            return "-"
        return f"{ways[way]['seconds'] / ways['bf16_out']['seconds']:.3f}"
    rates = [[f"{ways[w]['flops_per_s'] / 1e12:.3g}" if w in ways else "-" for w in WGRAD_WAYS] for ways in by.values()]
    rows = [[gemm, f"{o} x {i} x {t}", *rate, ratio(ways, "fp32_accumulate"), ratio(ways, "separate_add")]
            for ((gemm, o, i, t), ways), rate in zip(by.items(), rates)]
    return ["", "Weight gradients (outputs x inputs over tokens): TFLOP/s, and time over the bf16-out GEMM's",
            table(["gemm", "out x in x tokens", *WGRAD_WAYS, "fused / bf16", "apart / bf16"], rows)]


def describe_device(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"type": "cpu", "name": "cpu", "threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_bytes": int(props.total_memory), "sms": props.multi_processor_count}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes (automatic without CUDA)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop measuring after this many seconds")
    args = parser.parse_args(argv)
    if not args.budget_s > 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    plan = make_plan(args.dry_run or not cuda)
    device = torch.device("cuda" if cuda and not plan.dry_run else "cpu")
    if device.type == "cpu":
        # One thread: with several, a kernel waits at its barrier for any thread the OS preempted (a shared
        # 2-core machine made every tiny GEMM take one ~8 ms scheduler slice that way).
        torch.set_num_threads(1)
    estimate = estimate_seconds(make_plan(False), torch.device("cuda"))
    print(f"gpu_kernels: {describe_device(device)['name']}, {'dry run (tiny sizes)' if plan.dry_run else 'full'}, "
          f"budget {args.budget_s:.0f} s; the full run's H200 estimate: {estimate['total']:.0f} s", flush=True)
    torch.manual_seed(0)
    results = run_jobs(plan, device, args.budget_s, started)
    best = add_efficiency(results)
    print(gemm_tables(results) + "\n\n" + other_tables(results))
    elementwise_best = max((r["bytes_per_s"] for r in results["elementwise"]), default=None)
    report = {"device": describe_device(device), "torch": torch.__version__, "dry_run": plan.dry_run,
              "plan": asdict(plan), "h200_estimate_s": estimate, "best_tflops": best,
              "launch": results["launch"][0] if results["launch"] else {},
              "elementwise": {"best_bytes_per_s": elementwise_best, "results": results["elementwise"]},
              "gemm": {"square": results["square"], "shapes": results["shapes"], "wgrad": results["wgrad"]},
              "attention": results["attention"], "refused": results["refused"], "skipped": results["skipped"],
              "seconds": round(time.perf_counter() - started, 2)}
    with open(args.out, "w", encoding="utf-8") as file:
        file.write(json.dumps(report, indent=1) + "\n")
    skipped = f", {len(results['skipped'])} skipped (budget)" if results["skipped"] else ""
    print(f"\ngpu_kernels: {report['seconds']:.1f} s, {len(results['refused'])} refused{skipped}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
