"""The article's speed claims for A100/H100, simulated per GPU preset with the op-level model
(simulator/costs/ops.py priced by simulator/costs/compute.py on simulator/costs/hardware.json's cited tables). Torch-free but
for the CPU half of cast-cost."""

from __future__ import annotations

from dataclasses import replace

from cli.claims.claim import CAVEAT, HOLDS, WRONG, Claim, Finding, percent
from cli.claims.sim import SimCase
from job.layout import Layout
from minigpt.presets import preset
from precision.policy import FORMAT_BYTES, policy
from simulator.costs.compute import gemm_efficiency, hbm_speed, pass_times
from simulator.costs.hardware import load_hardware
from simulator.costs.op_types import FusedAttention, Gemm, Implementation
from simulator.costs.ops import block_ops

# The article's GPUs (A100/H100) and the H200: the presets of simulator/costs/hardware.json with published GEMM
# tables in every format these rows price (h100-96gb-500w reuses the H100 SXM's; b200 has MAMF points and no tf32).
GPUS = ("a100-40gb", "a100-80gb", "h100-sxm", "h200")
A100, H100 = "a100-80gb", "h100-sxm"
ARTICLE_SPEEDUP = (2.0, 3.0)
SPEED_MODEL, SPEED_MICRO_BATCH = "gpt2-124m", 8
SPEED_CASE = SimCase(SPEED_MODEL, micro_batch=SPEED_MICRO_BATCH, gpu="h100-sxm")  # the rows' command (bf16)
BLOCK_CASES = (("gpt2-124m", 8), ("llama3-8b", 1))  # (model, micro-batch): one block of each, forward and backward
SHARE_MODELS = ("gpt2-124m", "llama3-8b", "gpt3-175b")
ARTICLE_MATMUL_SHARE = 0.95
FP8_CASES = (SimCase("gpt2-124m", "fp8", micro_batch=8, gpu="h100-sxm"),
             SimCase("llama3-8b", "fp8", tp=8, gpu="h100-sxm"),
             SimCase("gpt3-175b", "fp8", tp=8, pp=16, dp=8, zero=1, global_batch=1536, gpu="h100-sxm"))


def _in_format(op, dtype: str):
    """The op with its matmuls in `dtype` (FlashAttention's too); memory-bound ops unchanged."""
    if isinstance(op, Gemm):
        return replace(op, dtype=dtype)
    if isinstance(op, FusedAttention):
        return replace(op, gemms=tuple(replace(g, dtype=dtype) for g in op.gemms))
    return op


def block_seconds(model: str, micro_batch: int, gpu_name: str, precision: str, matmul: str | None = None):
    """simulator/costs/compute.py's PassTimes of one block's forward and backward (matmuls in `matmul` if given)."""
    gpu = load_hardware(gpu_name).gpu
    ops = block_ops(preset(model), micro_batch, Layout(), policy(precision), Implementation())
    every = [_in_format(op, matmul) if matmul else op for op in ops.forward + ops.backward]
    return pass_times(every, gpu, gpu.matmul_efficiency)


def step_speedups() -> dict[str, dict]:
    """The simulated step of SPEED_MODEL in fp32 and in bf16 on every GPU preset."""
    steps = {}
    for gpu in GPUS:
        mixed = SimCase(SPEED_MODEL, micro_batch=SPEED_MICRO_BATCH, gpu=gpu)
        full = replace(mixed, precision="fp32").result
        steps[gpu] = {"fp32_s": full.step_time_s, "bf16_s": mixed.result.step_time_s,
                      "speedup": full.step_time_s / mixed.result.step_time_s,
                      "fp32_efficiency": full.provenance["matmul_efficiency"]["fp32"]["kind"]}
    return steps


def tf32_speedups() -> dict[str, dict[str, float]]:
    """Per model, per GPU preset: one block's time with TF32 matmuls over its time in bf16."""
    return {model: {gpu: block_seconds(model, mb, gpu, "fp32", "tf32").total
                         / block_seconds(model, mb, gpu, "bf16").total for gpu in GPUS}
            for model, mb in BLOCK_CASES}


def _in_range(ratio: float) -> bool:
    lo, hi = ARTICLE_SPEEDUP
    return lo <= round(ratio, 1) <= hi


def check_speedup() -> Finding:
    steps, tf32 = step_speedups(), tf32_speedups()
    inside = [f"{model} {gpu}" for model, by_gpu in tf32.items() for gpu, r in by_gpu.items() if _in_range(r)]
    verdict = HOLDS if all(_in_range(s["speedup"]) for s in steps.values()) else CAVEAT if inside else WRONG
    peak_ratio = {g: load_hardware(g).gpu.peak_flops["bf16"] / load_hardware(g).gpu.peak_flops["fp32"] for g in GPUS}
    width = preset(SPEED_MODEL).d_model
    a100 = load_hardware(A100).gpu
    rows = SPEED_MICRO_BATCH * preset(SPEED_MODEL).seq_len  # its proj GEMM, rows x width x width: tf32 by the cited
    small = {f: gemm_efficiency(rows, width, width, f, a100, a100.matmul_efficiency)  # table, bf16 by the GEMM model
             for f in ("tf32", "bf16")}
    numbers = {"steps": steps, "tf32_block_speedup": tf32, "inside_article_range": inside, "peak_ratio": peak_ratio,
               "a100_efficiency_at_width": small}
    by_gpu = "/".join(GPUS)
    ours = ("step fp32 -> bf16: " + ", ".join(f"{g} {s['speedup']:.1f}x" for g, s in steps.items())
            + f"; a block tf32 -> bf16 ({by_gpu}): "
            + ", ".join(f"{m} " + "/".join(f"{r:.1f}x" for r in rs.values()) for m, rs in tf32.items()))
    why = (f"against strict fp32 the tensor cores give {min(s['speedup'] for s in steps.values()):.0f}x or more; "
           f"2-3x is the gain over TF32 tensor cores ({', '.join(inside) or 'none'})")
    discussion = (
        f"Simulated for {SPEED_MODEL} (micro-batch {SPEED_MICRO_BATCH}, one GPU): " + "; ".join(
            f"{g}: {s['fp32_s'] * 1e3:.1f} ms in fp32, {s['bf16_s'] * 1e3:.1f} ms in bf16, {s['speedup']:.1f}x"
            for g, s in steps.items())
        + f". Strict fp32 runs on the CUDA cores (priced on the simulator's {steps[A100]['fp32_efficiency']}: no "
        f"cited fp32 table), whose dense peak is " + ", ".join(f"{r:.1f}x below bf16's on {g}"
                                                              for g, r in peak_ratio.items())
        + ". With fp32 matmuls on TF32 tensor cores instead (PyTorch's default from 1.7 to 1.11), one block's forward "
        f"and backward priced op by op is faster in bf16 by ({by_gpu}) " + "; ".join(
            f"{m} " + "/".join(f"{r:.1f}x" for r in rs.values()) for m, rs in tf32.items())
        + f"; within the article's 2-3x: {', '.join(inside) or 'none'}. On the A100 {SPEED_MODEL}'s {rows} x {width} x "
        f"{width} GEMM reaches {small['tf32']:.2f} of the TF32 peak (cited table) against {small['bf16']:.2f} of "
        f"bf16's (GEMM model). The CPU is another story (cpu-speed)."
    )
    return Finding(ours, verdict, why, numbers, discussion)


def check_fp16_bf16_same() -> Finding:
    numbers = {}
    for gpu in GPUS:
        peak = load_hardware(gpu).gpu.peak_flops
        bf16 = SimCase(SPEED_MODEL, micro_batch=SPEED_MICRO_BATCH, gpu=gpu)
        fp16 = replace(bf16, precision="fp16")
        numbers[gpu] = {"bf16_tflops": peak["bf16"] / 1e12, "fp16_tflops": peak["fp16"] / 1e12,
                        "step_ratio": fp16.result.step_time_s / bf16.result.step_time_s}
    holds = all(n["bf16_tflops"] == n["fp16_tflops"] and abs(n["step_ratio"] - 1) < 1e-9 for n in numbers.values())
    ours = "; ".join(f"{g}: {n['bf16_tflops']:g} = {n['fp16_tflops']:g} TFLOP/s, step ratio {n['step_ratio']:.3f}"
                     for g, n in numbers.items())
    why = ("the datasheets give both formats one dense peak and the cited GEMM tables are the same rows, so the "
           "simulator can only agree; the difference between them is numerical, not speed")
    discussion = (
        "simulator/costs/hardware.json holds the datasheets' dense peaks: " + "; ".join(
            f"{g} {n['bf16_tflops']:g} TFLOP/s in both" for g, n in numbers.items()) + f". Simulated, {SPEED_MODEL}'s "
        "step takes the same time in fp16 and bf16 on every GPU preset. What separates them is range (fp16-overflow, "
        "fp16-underflow) and the loss scaler fp16 needs, not throughput."
    )
    return Finding(ours, HOLDS if holds else WRONG, why, numbers, discussion)


def check_matmul_share() -> Finding:
    gpu = H100
    shares = {}
    for model in SHARE_MODELS:
        times = block_seconds(model, 1, gpu, "bf16")
        shares[model] = times.gemm / times.total
    verdict = (HOLDS if min(shares.values()) >= ARTICLE_MATMUL_SHARE - 0.005 else
               CAVEAT if max(shares.values()) >= ARTICLE_MATMUL_SHARE - 0.05 else WRONG)
    numbers = {"gpu": gpu, "gemm_time_share": shares}
    ours = f"GEMM share of a block's time on {gpu}: " + ", ".join(f"{m} {percent(s)}" for m, s in shares.items())
    why = ("FLOPs cannot tell (config.py counts matmul FLOPs only, the element-wise ops' few per element are left "
           "out); in time the memory-bound kernels (norms, GELU, residuals, casts) take "
           + ", ".join(f"{percent(1 - s)}" for s in shares.values()))
    discussion = (
        f"One block, forward and backward, micro-batch 1, bf16 on {gpu}, priced op by op: the matmuls (FlashAttention "
        "included) take " + ", ".join(f"{percent(s)} ({m})" for m, s in shares.items()) + " of the time. The "
        "memory-bound kernels do almost no arithmetic but read and write whole activations; their share shrinks as "
        "the width grows (the GEMMs grow with its square) and as the sequence grows (attention's matmuls count as "
        "GEMMs here), and it is what kernel fusion attacks."
    )
    return Finding(ours, verdict, why, numbers, discussion)


def check_cast_cost() -> Finding:
    import time

    import torch

    cases = {"gpt2-124m on one A100": SimCase("gpt2-124m"),
             "gpt3-175b, one GPU of tp8 x pp16": SimCase("gpt3-175b", tp=8, pp=16, dp=8, zero=1, global_batch=1536)}
    copy_bytes = FORMAT_BYTES["fp32"] + FORMAT_BYTES["bf16"]  # read the fp32 master, write the 16-bit copy
    gpu_ms = {}
    for label, case in cases.items():
        numel = max(stage.numel for stage in case.result.memory.per_stage)
        gpu_ms[label] = numel * copy_bytes / hbm_speed(load_hardware(case.gpu).gpu) * 1e3
    flat = torch.randn(preset("small").n_params())
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        flat.to(torch.bfloat16)
        best = min(best, time.perf_counter() - start)
    numbers = {"gpu_ms": gpu_ms, "cpu_ms_small": best * 1e3, "small_params": preset("small").n_params()}
    holds = all(ms < 100 for ms in gpu_ms.values())
    ours = ("; ".join(f"{label} {ms:.2f} ms" for label, ms in gpu_ms.items())
            + f"; this CPU, small ({numbers['small_params'] / 1e6:.1f}M): {best * 1e3:.1f} ms")
    why = (f"a cast reads {FORMAT_BYTES['fp32']} and writes {FORMAT_BYTES['bf16']} bytes a parameter: HBM time, "
           f"milliseconds for a GPU's share of any model")
    discussion = (
        f"Casting the fp32 masters to the 16-bit compute copy moves {copy_bytes} bytes per parameter through memory: "
        "at the achieved HBM bandwidth that is " + "; ".join(f"{ms:.2f} ms for {label}" for label, ms in gpu_ms.items())
        + f". On this CPU (one thread) the small preset's {numbers['small_params']:,} parameters cast in "
        f"{best * 1e3:.1f} ms. Our optimizer does this copy every step (precision/optimizer.py)."
    )
    return Finding(ours, HOLDS if holds else WRONG, why, numbers, discussion)


def check_fp8_speed() -> Finding:
    ratios = {case.label(precision=False): replace(case, precision="bf16").result.step_time_s
              / case.result.step_time_s for case in FP8_CASES}
    a100_fp8 = load_hardware("a100-80gb").gpu.peak_flops["fp8"]
    h100 = load_hardware("h100-sxm").gpu.peak_flops
    faster = [label for label, r in ratios.items() if r > 1]
    largest = FP8_CASES[-1].label(precision=False)
    verdict = HOLDS if len(faster) == len(ratios) else CAVEAT if largest in faster else WRONG
    numbers = {"bf16_over_fp8_step": ratios, "faster_in_fp8": faster, "a100_fp8_peak": a100_fp8,
               "h100_fp8_over_bf16_peak": h100["fp8"] / h100["bf16"]}
    ours = "bf16 / fp8 step on h100-sxm: " + ", ".join(f"{label} {r:.2f}x" for label, r in ratios.items())
    why = (f"fp8 pays where GEMMs dominate ({', '.join(faster) or 'nowhere'}); small models lose its casts and scaling "
           f"to memory-bound time" + ("; A100 has no fp8 tensor cores" if a100_fp8 is None else ""))
    discussion = (
        "Simulated on H100 with the block Linears in fp8 (e4m3 forward, e5m2 gradients, as precision/fp8.py runs them; "
        "attention and the head stay bf16): the bf16 step takes " + ", ".join(
            f"{r:.2f}x the fp8 step for {label}" for label, r in ratios.items()) + ". The article's \"mainly for very "
        "large training\" is what the op-level model says: the fp8 peak is "
        f"{numbers['h100_fp8_over_bf16_peak']:.1f}x bf16's, but the casts to fp8 and "
        "back are memory-bound work that only large matmuls amortise."
    )
    return Finding(ours, verdict, why, numbers, discussion)


CLAIMS = [
    Claim("speedup", "Mixed precision is 2-3x faster on modern GPUs (A100/H100)",
          'preface, "在现代GPU（A100/H100）上获得2-3倍加速"', "2-3x",
          f"{replace(SPEED_CASE, precision='fp32').command()}; {SPEED_CASE.command()}", check_speedup,
          needs_torch=False),
    Claim("fp16-bf16-same", "On A100/H100 BF16 and FP16 run at the same speed", '1.2, "BF16和FP16性能相同"',
          "the same", replace(SPEED_CASE, precision="fp16").command(),
          check_fp16_bf16_same, needs_torch=False),
    Claim("matmul-share", "95% of a large model's computation is matrix multiplication", '1.2, "95%的计算量是矩阵乘法"',
          "95%", "minigpt claims --only matmul-share", check_matmul_share, needs_torch=False),
    Claim("cast-cost", "Casting the whole model between FP32 and FP16 is a millisecond-scale job",
          '1.2, "整个模型转一遍是毫秒级的事"', "milliseconds", "minigpt claims --only cast-cost", check_cast_cost,
          timed=True),
    Claim("fp8-speed", "FP8 on H100 speeds matmuls up further, mainly in very large training",
          'preface, "FP8（前沿）"', "faster, mainly at very large scale", FP8_CASES[1].command(), check_fp8_speed,
          needs_torch=False),
]
