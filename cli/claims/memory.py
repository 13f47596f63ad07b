"""The article's memory arithmetic, checked with the simulator's memory model (simulator/memory.py, as
simulate_step sizes a GPU) and minigpt/config.py's parameter counts. Torch-free."""

from __future__ import annotations

import math
from dataclasses import replace

from cli.claims.claim import CAVEAT, HOLDS, WRONG, Claim, Finding, percent
from cli.claims.sim import GIB, SimCase, memory_shares
from precision.policy import policy

GPT3 = dict(tp=8, pp=16, dp=8, zero=1, global_batch=1536)  # a published GPT-3 layout (README's example)
# One sequence per micro-batch, the shapes' own sequence lengths.
HALVING_CASES = (SimCase("gpt2-124m"), SimCase("gpt2-124m", micro_batch=8), SimCase("llama3-8b", tp=8),
                 SimCase("gpt3-175b", **GPT3))
SHARE_CASES = (SimCase("gpt2-124m", "fp32"), SimCase("gpt2-124m"), SimCase("gpt2-124m", micro_batch=8),
               SimCase("llama3-8b", tp=8), SimCase("gpt3-175b"), SimCase("gpt3-175b", **GPT3))
ARTICLE_SHARES = {"parameters": 0.20, "gradients": 0.20, "optimizer": 0.40, "activations": 0.15, "other": 0.05}
SHARE_TOLERANCE = 0.05  # "~20%": within 5 points
ARTICLE_GPT3_GB = {"parameters": 700, "gradients": 700, "optimizer_states": 1400, "activations": 200, "total": 3000}
ARTICLE_GPUS, ARTICLE_GPU_GB = 38, 80
DECIMAL_GB = 1e9
ARTICLE_TOO_BIG = 10e9  # "百亿参数模型": a model of ten billion parameters


def _as_fp32(case: SimCase) -> SimCase:
    return replace(case, precision="fp32")


def check_memory_halved() -> Finding:
    rows = {}
    for case in HALVING_CASES:
        full, mixed = _as_fp32(case).result.memory, case.result.memory
        rows[case.label(precision=False)] = {
            "fp32_gib": full.total / GIB, "bf16_gib": mixed.total / GIB, "saving": 1 - mixed.total / full.total,
            "activation_ratio": mixed.activations / full.activations,
            "model_state_ratio": mixed.model_states / full.model_states}
    savings = [row["saving"] for row in rows.values()]
    low, high = min(savings), max(savings)
    verdict = HOLDS if low >= 0.4 and high <= 0.6 else CAVEAT if high >= 0.4 else WRONG
    ours = f"per GPU -{percent(low)} to -{percent(high)}: " + ", ".join(
        f"{label} -{percent(row['saving'])}" for label, row in rows.items())
    states = {label: row["model_state_ratio"] for label, row in rows.items()}
    activations = [r["activation_ratio"] for r in rows.values()]
    why = (f"only what is computed and kept halves (activations x{min(activations):.2f}-{max(activations):.2f}); the "
           f"{sum(policy('bf16').bytes_per_param().values())} bytes of model state per parameter do not (model "
           f"states x{min(states.values()):.2f}-{max(states.values()):.2f}), so the saving is large only where "
           f"activations dominate")
    discussion = (
        "Per GPU, bf16 against fp32, one sequence per micro-batch (the simulator's memory model, which "
        "`minigpt compare` checks against training): " + "; ".join(
            f"{label}: {row['fp32_gib']:.1f} -> {row['bf16_gib']:.1f} GiB (-{percent(row['saving'])}, activations "
            f"x{row['activation_ratio']:.2f}, model states x{row['model_state_ratio']:.2f})"
            for label, row in rows.items())
        + ". Model states shrink only where ZeRO shards the fp32 part: under ZeRO-1 the replicated 16-bit weights and "
        "gradients halve while the sharded masters are new. The article's 50% is the limit where activations are "
        "all there is."
    )
    return Finding(ours, verdict, why, {"cases": rows, "commands": [c.command() for c in HALVING_CASES]}, discussion)


def check_gpt3_memory() -> Finding:
    full = SimCase("gpt3-175b", "fp32", **GPT3)
    result, mixed = full.result, SimCase("gpt3-175b", **GPT3).result
    params = full.config.n_params()
    state_gb = {k: v / DECIMAL_GB for k, v in result.job_state_bytes.items()}
    mixed_gb = {k: v / DECIMAL_GB for k, v in mixed.job_state_bytes.items()}
    activations_gb = SimCase("gpt3-175b", "fp32").result.memory.activations / DECIMAL_GB  # one 2048-token sequence
    gpus = math.ceil((state_gb["total"] + ARTICLE_GPT3_GB["activations"]) / ARTICLE_GPU_GB)
    batch = ARTICLE_GPT3_GB["activations"] / activations_gb
    capacity_gib = result.memory.capacity / GIB
    numbers = {"n_params": params, "fp32_state_gb": state_gb, "bf16_state_gb": mixed_gb,
               "activations_gb_per_sequence": activations_gb, "gpus_article_accounting": gpus,
               "gpus_for_state_80gib": result.gpus_for_state, "article_gb": ARTICLE_GPT3_GB,
               "article_gpus": ARTICLE_GPUS}
    ours = (f"{params / 1e9:.1f}B params: {state_gb['parameters']:.1f} + {state_gb['gradients']:.1f} + "
            f"{state_gb['optimizer_states']:.1f} = {state_gb['total']:.1f} GB; +{ARTICLE_GPT3_GB['activations']} GB: "
            f"{gpus} GPUs of {ARTICLE_GPU_GB} GB; the state alone: {result.gpus_for_state} of {capacity_gib:.0f} GiB")
    arithmetic = abs(state_gb["parameters"] - ARTICLE_GPT3_GB["parameters"]) / ARTICLE_GPT3_GB["parameters"] < 0.01
    verdict = CAVEAT if arithmetic and gpus == ARTICLE_GPUS else WRONG
    why = (f"right for fp32 training; mixed precision holds the same {mixed_gb['total']:.1f} GB (fp32 masters take "
           f"the place of fp32 weights), and {ARTICLE_GPT3_GB['activations']} GB of activations is {batch:.1f} "
           f"sequences of {full.config.seq_len} tokens")
    discussion = (
        f"minigpt/config.py counts {params:,} parameters for GPT-3's shape; in fp32 the weights, gradients and AdamW "
        f"m, v take {state_gb['parameters']:.1f}, {state_gb['gradients']:.1f} and {state_gb['optimizer_states']:.1f} "
        f"GB (decimal), the article's {ARTICLE_GPT3_GB['parameters']}, {ARTICLE_GPT3_GB['gradients']} and "
        f"{ARTICLE_GPT3_GB['optimizer_states']}. Mixed precision does not change the sum: bf16 weights "
        f"{mixed_gb['parameters']:.1f} GB, gradients {mixed_gb['gradients']:.1f}, fp32 masters "
        f"{mixed_gb['master_weights']:.1f} and moments {mixed_gb['optimizer_states']:.1f}, {mixed_gb['total']:.1f} "
        f"GB in all. One sequence keeps {activations_gb:.1f} GB of fp32 activations without recomputation, so the "
        f"article's {ARTICLE_GPT3_GB['activations']} GB stands for a batch of about {batch:.1f} sequences. Its "
        f"{ARTICLE_GPUS} GPUs are (state + {ARTICLE_GPT3_GB['activations']} GB) / {ARTICLE_GPU_GB} GB rounded up "
        f"({gpus}); an \"80 GB\" A100 holds {capacity_gib:.0f} GiB, and the state alone needs "
        f"{result.gpus_for_state} of them, before activations, buffers, and the fact that a model is split into "
        f"whole layers."
    )
    return Finding(ours, verdict, why, numbers, discussion)


def check_ddp_fit() -> Finding:
    ddp, zero3 = SimCase("llama3-8b", dp=8), SimCase("llama3-8b", dp=8, zero=3)
    capacity = ddp.result.memory.capacity
    per_param = sum(policy(ddp.precision).bytes_per_param().values())
    largest = capacity / per_param
    numbers = {"bytes_per_param": per_param, "capacity_bytes": capacity, "largest_params": largest,
               "ddp_gib": ddp.result.memory.total / GIB, "ddp_fits": ddp.result.fits,
               "zero3_gib": zero3.result.memory.total / GIB, "zero3_fits": zero3.result.fits}
    ours = (f"{per_param} B/param: at most {largest / 1e9:.2f}B params in {capacity / GIB:.0f} GiB (state alone); "
            f"llama3-8b under DDP {numbers['ddp_gib']:.0f} GiB per GPU, under ZeRO-3 over {ddp.dp} "
            f"{numbers['zero3_gib']:.0f} GiB")
    holds = ARTICLE_TOO_BIG * per_param > capacity and not ddp.result.fits
    why = (f"a 10B model's state is {ARTICLE_TOO_BIG * per_param / GIB:.0f} GiB, "
           f"{ARTICLE_TOO_BIG * per_param / capacity:.1f}x a GPU; already "
           f"{largest / 1e9:.1f}B parameters fill one before any activation")
    discussion = (
        f"Data parallelism keeps the whole training state on every GPU: {per_param} bytes per parameter in mixed "
        f"precision, so an {capacity / GIB:.0f} GiB GPU holds at most {largest / 1e9:.2f} billion parameters with "
        f"nothing else. Llama 3 8B on {ddp.dp} GPUs needs {numbers['ddp_gib']:.0f} GiB per GPU under DDP "
        f"({fits_text(ddp.result.fits)}) and {numbers['zero3_gib']:.0f} GiB with ZeRO-3 "
        f"({fits_text(zero3.result.fits)}): `{ddp.command()}` against `{zero3.command()}`."
    )
    return Finding(ours, HOLDS if holds else WRONG, why, numbers, discussion)


def fits_text(fits: bool) -> str:
    return "fits" if fits else "does not fit"


def state_split(precision: str) -> str:
    """Bytes per parameter of weights : gradients : optimizer (masters and moments), e.g. '2 : 2 : 12'."""
    b = policy(precision).bytes_per_param()
    return f"{b['compute']} : {b['grad']} : {b['master'] + b['adam_m'] + b['adam_v']}"


def _shares() -> dict[str, dict[str, float]]:
    return {case.label(): memory_shares(case.result) for case in SHARE_CASES}


def _share_text(shares: dict[str, float]) -> str:
    return "/".join(f"{100 * shares[k]:.0f}" for k in ARTICLE_SHARES)


def check_memory_shares() -> Finding:
    shares = _shares()
    distance = {label: max(abs(s[k] - ARTICLE_SHARES[k]) for k in ARTICLE_SHARES) for label, s in shares.items()}
    closest = min(distance, key=distance.get)
    activations = [s["activations"] for s in shares.values()]
    numbers = {"shares": shares, "distance": distance, "closest": closest, "article": ARTICLE_SHARES,
               "commands": [c.command() for c in SHARE_CASES]}
    ours = "p/g/o/a/other %: " + "; ".join(f"{label} {_share_text(s)}" for label, s in shares.items())
    verdict = CAVEAT if distance[closest] <= SHARE_TOLERANCE else WRONG
    why = (f"no configuration has these shares (closest: {closest}, {100 * distance[closest]:.0f} points off); "
           f"activations move from {percent(min(activations))} to {percent(max(activations))} with batch, sequence "
           f"and layout, and mixed precision splits the state {state_split('bf16')} bytes" if verdict == WRONG else
           f"{closest} is within {100 * distance[closest]:.0f} points; activations move from "
           f"{percent(min(activations))} to {percent(max(activations))}")
    states_share = "/".join(f"{100 * ARTICLE_SHARES[k]:.0f}" for k in ("parameters", "gradients", "optimizer"))
    discussion = (
        "Shares of one GPU's memory (parameters / gradients / optimizer states with fp32 masters / activations / "
        "buffers), from the simulator's memory model: " + "; ".join(
            f"{label}: {_share_text(s)}" for label, s in shares.items())
        + f". In fp32 the model states split {state_split('fp32')} bytes, the article's {states_share}; in mixed "
          f"precision {state_split('bf16')}. The activations' share is no constant: it grows with the tokens per "
          f"micro-batch and with the micro-batches a pipeline stage "
        "keeps in flight, and shrinks as model states grow. Configurations: " + "; ".join(
            f"`{c.command()}`" for c in SHARE_CASES) + "."
    )
    return Finding(ours, verdict, why, numbers, discussion)


def check_optimizer_largest() -> Finding:
    shares = _shares()
    largest = {label: max(s, key=s.get) for label, s in shares.items()}
    optimizer_first = [label for label, name in largest.items() if name == "optimizer"]
    numbers = {"largest": largest, "shares": shares}
    ours = "; ".join(f"{label}: {name} ({percent(shares[label][name])})" for label, name in largest.items())
    verdict = HOLDS if len(optimizer_first) == len(largest) else CAVEAT if optimizer_first else WRONG
    others = [label for label in largest if label not in optimizer_first]
    why = (f"largest in {len(optimizer_first)} of {len(largest)} configurations; activations are larger in "
           f"{', '.join(others)}" if others else "largest in every configuration")
    discussion = (
        f"With fp32 masters counted as optimizer state (the ZeRO paper's accounting), the optimizer is the largest "
        f"category in {len(optimizer_first)} of {len(largest)} configurations "
        f"({', '.join(optimizer_first) or 'none'}). Where a micro-batch holds many tokens, or a pipeline stage keeps "
        f"many micro-batches, activations outgrow it ({', '.join(others) or 'none'}): then recomputation and "
        f"sequence parallelism, not ZeRO-1, are what saves memory."
    )
    return Finding(ours, verdict, why, numbers, discussion)


CLAIMS = [
    Claim("memory-halved", "Mixed precision cuts training memory by about 50%", 'preface, "显存占用减少约50%"',
          "about 50%", f"{_as_fp32(HALVING_CASES[1]).command()}; {HALVING_CASES[1].command()}", check_memory_halved,
          needs_torch=False),
    Claim("gpt3-memory", "GPT-3 175B needs 700 + 700 + 1400 GB (+200 GB activations, ~3000 GB): 38 A100s of 80 GB",
          '1.1, table and "需要38张GPU"', "700 + 700 + 1400 + 200 GB; 38 GPUs",
          SimCase("gpt3-175b", "fp32", **GPT3).command(), check_gpt3_memory, needs_torch=False),
    Claim("ddp-fit", "DDP keeps the whole model on every GPU: a ten-billion-parameter model does not fit one",
          '1.3 DDP, "百亿参数模型单个GPU放不下"', "10B does not fit", SimCase("llama3-8b", dp=8).command(),
          check_ddp_fit, needs_torch=False),
    Claim("memory-shares", "Memory splits ~20% parameters, ~20% gradients, ~40% optimizer, ~15% activations, ~5% other",
          '1.4, table "显存组成详解"', "20/20/40/15/5%", SHARE_CASES[0].command(), check_memory_shares,
          needs_torch=False),
    Claim("optimizer-largest", "Optimizer states are the largest memory consumer", '1.4, "关键洞察"',
          "the largest", SHARE_CASES[2].command(), check_optimizer_largest, needs_torch=False),
]
