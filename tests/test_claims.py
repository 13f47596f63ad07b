"""`minigpt claims --json`: every row's verdict checked against its measured numbers, the numbers against
torch, the commands the rows name, and docs/claims.md against a fresh run.

A check must be able to fail: it never re-runs a row's own rule on the row's own numbers. The numbers that
decide a verdict are derived here another way -- by hand from the model's shape and the datasheets
(simulator/hardware.json read as plain JSON, priced by tests/independent.py's roofline), from the real
model (parameters counted, FLOPs counted by torch's FlopCounterMode), from torch's own dtypes and
torch.optim.AdamW -- and the verdict is then worked out from those numbers with the article's own figure.
Where a number cannot be derived independently (a simulated pipeline bubble, a one-server ZeRO-3 slowdown
of a few percent) the check says so and derives what it can around it.

The fast rows run in CI in one invocation; the rows that train for real (`slow=True`, a few seconds
each) and the full command's wall time run under the `slow` marker: `python -m pytest -m slow
tests/test_claims.py`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from cli.tools.claims import CAVEAT, HOLDS, UNCHECKABLE, WRONG
from cli.tools.claims_registry import all_claims
from cli.tools.claims_report import markdown_row
from independent import (DATASHEETS, NICS, block_kernels, block_matmul_flops, gemm_flops, master_weights_reference,
                         model_params, price, ring_seconds, table_efficiency)
from minigpt.config import preset
from precision.policy import policy

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = all_claims()
FAST = [c.name for c in CLAIMS if not c.slow]
SLOW = [c.name for c in CLAIMS if c.slow]
WALL_LIMIT_S = 120  # the whole command on two cores


def invoke(*args: str) -> dict:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout, parse_constant=lambda name: pytest.fail(f"{name} is not strict JSON"))


def by_name(report: dict) -> dict[str, dict]:
    return {row["name"]: row for row in report["claims"]}


@pytest.fixture(scope="module")
def fast_report() -> dict:
    return invoke("claims", "--json", *[arg for name in FAST for arg in ("--only", name)])


@pytest.fixture(scope="module")
def full_report() -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cli", "claims", "--json"], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    report["wall_s"] = wall
    return report


def simulated(*args: str) -> dict:
    return invoke("simulate", *args, "--json")


# ---------------------------------------------------------------- one check per row, from its numbers


def check_formats(row):
    n = row["numbers"]["formats"]
    assert n["fp16"]["max"] == torch.finfo(torch.float16).max == 65504
    assert n["fp8_e4m3"]["max"] == torch.finfo(torch.float8_e4m3fn).max == 448
    assert n["fp8_e5m2"]["max"] == torch.finfo(torch.float8_e5m2).max == 57344
    assert n["bf16"]["max"] == torch.finfo(torch.bfloat16).max and n["fp32"]["max"] == torch.finfo(torch.float32).max
    assert (n["bf16"]["exponent_bits"], n["bf16"]["mantissa_bits"]) == (8, 7)
    article = row["numbers"]["article_range"]
    wrong = [name for name, facts in n.items() if abs(article[name] - facts["max"]) > 0.05 * facts["max"]]
    assert wrong == ["fp8_e4m3", "fp8_e5m2"] == row["numbers"]["wrong_range"]
    assert row["verdict"] == WRONG and "448" in row["why"] and "57344" in row["why"]


def check_cast_bits(row):
    n = row["numbers"]
    x = torch.tensor(n["values"])
    assert n["exponent_fields"]["fp32"] == ((x.view(torch.int32) >> 23) & 0xFF).tolist()
    assert n["exponent_fields"]["bf16"] == ((x.bfloat16().view(torch.int16).to(torch.int64) >> 7) & 0xFF).tolist()
    assert n["exponent_fields"]["fp16"] == ((x.half().view(torch.int16).to(torch.int64) >> 10) & 0x1F).tolist()
    assert n["copied"] == {"fp16": False, "bf16": True} and n["bias"]["fp16"] == 15
    assert row["verdict"] == WRONG


def check_fp16_smallest(row):
    n = row["numbers"]
    fp16 = torch.finfo(torch.float16)
    assert n["smallest_subnormal"] == 2.0**-24 == fp16.smallest_normal * fp16.eps
    assert n["smallest_normal"] == torch.finfo(torch.float16).smallest_normal
    assert n["example_in_fp16"] == torch.tensor(n["example"]).half().item()
    assert n["article"] is None and row["verdict"] == WRONG


def check_swamping(row):
    n = row["numbers"]
    fp16 = (torch.tensor(0.5, dtype=torch.float16) + torch.tensor(1e-7, dtype=torch.float16)).item()
    fp32 = (torch.tensor(0.5) + torch.tensor(1e-7)).item()
    assert n["fp16_sum"] == fp16 == 0.5 and n["fp32_sum"] == fp32 != 0.5
    # 10, 7 and 23 stored mantissa bits, plus the implicit one: (m + 1) log10(2) decimal digits, 3.3, 2.4 and 7.2.
    # The spacing at 0.5 = 2^-1 is 2^(-1-m): 1e-7 is below half of fp16's and bf16's, above half of fp32's.
    for name, mantissa in (("fp16", 10), ("bf16", 7), ("fp32", 23)):
        assert n["significant_digits"][name] == pytest.approx((mantissa + 1) * math.log10(2), rel=1e-12)
        assert n[f"{name}_ulp_at_base"] == 2.0 ** (-1 - mantissa)
        assert n[f"{name}_addend_lost"] == (1e-7 < 2.0 ** (-1 - mantissa) / 2)
    assert round(n["significant_digits"]["fp16"]) == 3 and round(n["significant_digits"]["fp32"]) == 7  # the article's
    assert row["verdict"] == HOLDS


def check_master_weights(row):
    """The experiment redone with torch.optim.AdamW (tests/independent.py): the fp16 run's gain must not move at all,
    the fp32-master run must learn as PyTorch's AdamW on fp32 weights learns."""
    n = row["numbers"]
    assert (n["steps"], n["lr"]) == (300, 1e-4) and n["fp16_half_spacing_at_1"] == 2.0**-11  # 10 mantissa bits
    pure, master = master_weights_reference(False), master_weights_reference(True)
    assert n["pure_fp16"]["gain_moved"] == pure["gain_moved"] == 0
    assert n["pure_fp16"]["loss_ratio"] == pytest.approx(pure["loss_ratio"], rel=1e-3)
    assert n["fp32_master"]["final_loss"] == pytest.approx(master["final_loss"], rel=1e-2)
    assert n["fp32_master"]["gain_moved"] == pytest.approx(master["gain_moved"], abs=2.0**-10)  # fp16 steps near 1
    # "the weights never move" (pure fp16), while the same updates on fp32 masters learn: the reference's loss falls
    # well below half its start.
    assert pure["gain_moved"] == 0 and master["loss_ratio"] < 0.5
    assert row["verdict"] == HOLDS


def check_fp32_accumulate(row):
    n = row["numbers"]
    assert n["exact"] == pytest.approx(0.25 * n["length"], rel=0.02)  # E[xy] of two U(0, 1)
    # Every product of two numbers in [0, 1) is below 1. fp16 keeps 10 mantissa bits: on [2^11, 2^12) its spacing is
    # 2^(11-10) = 2, half of it 1, so once the running sum reaches 2048 every addition rounds away (below 2048 the
    # spacing is at most 1: products above 0.5 still count). The fp16 sum ends at 2048 exactly.
    stall = 2.0 ** (10 + 1)
    assert n["fp16_stalls_from"] == stall
    s16 = torch.tensor(stall, dtype=torch.float16)
    assert (s16 + 0.99).item() == stall and (s16 / 2 + 0.99).item() != stall / 2
    errors = n["relative_error"]
    assert errors["fp16"] == pytest.approx(1 - stall / n["exact"], rel=1e-9)
    assert errors["fp32"] < 1e-4  # 32,768 roundings of at most 2^-24 relative each, mostly cancelling
    assert n["fp16_eps"] == 2.0**-10 and n["input_rounding_error"] < n["fp16_eps"] / 10
    # An fp16 accumulator loses three quarters (1 - 2048/8192), an fp32 one next to nothing: the article holds.
    assert row["verdict"] == HOLDS


def check_fp16_underflow(row):
    from precision.scaler import LossScaler

    n = row["numbers"]
    assert n["default_scale"] == LossScaler().init_scale == n["article_scale"] == 65536
    assert n["fp16"]["lost"] == 1.0 and n["fp16_scaled"]["lost"] < 0.01 and n["fp16_scaled"]["relative_error"] < 0.01
    assert n["median_gradient"] < n["fp16_smallest_subnormal"] == 2.0**-24
    assert row["verdict"] == HOLDS


def check_bf16_no_scaling(row):
    n = row["numbers"]
    bf16, fp32 = torch.finfo(torch.bfloat16), torch.finfo(torch.float32)
    assert n["smallest_normal"]["bf16"] == bf16.smallest_normal == fp32.smallest_normal
    assert n["bf16"]["lost"] == 0 and n["bf16"]["relative_error"] < 2 * torch.finfo(torch.bfloat16).eps
    assert row["verdict"] == HOLDS


def check_fp16_overflow(row):
    n = row["numbers"]
    assert n["fp16_max"] == 65504 and n["fp16_value"] == "inf"
    assert n["bf16_value"] == torch.tensor(70000.0).bfloat16().item()
    assert n["step_skipped"] and n["scale_after"] == n["scale_before"] / 2
    assert row["verdict"] == CAVEAT


def check_bytes_per_role(row):
    n = row["numbers"]
    assert n["bf16_measured"] == {k: float(v) for k, v in policy("bf16").bytes_per_param().items()}
    assert n["bf16_measured"] == {"compute": 2, "grad": 2, "master": 4, "adam_m": 4, "adam_v": 4}
    assert n["totals"] == {"bf16": 16, "fp32": 16, "fp8": 16} and n["fp8_element_bytes"] == 1
    assert row["verdict"] == CAVEAT


def check_memory_measured(row):
    n = row["numbers"]
    # Model states: 16 bytes per parameter in both precisions (fp32: weights, gradients, m, v at 4 each; bf16: 2 + 2
    # + fp32 masters 4 + m 4 + v 4), of the real tiny model's parameters.
    states = 16 * model_params("tiny")
    assert n["model_states"]["fp32"] == n["model_states"]["bf16"] == states
    assert n["saving"] == pytest.approx(1 - n["total"]["bf16"] / n["total"]["fp32"])
    # fp32 activations, counted by hand: per block the eager CPU model keeps x and LayerNorm 2's input, both norms'
    # outputs (the qkv and fc1 inputs), the fused q|k|v, the attention output and proj's contiguous input, and
    # GELU's input and output: 9 d + 2 f numbers a token, 4 bytes each (norm statistics, the head and the loss on
    # 256 byte values are a few percent more). Batch 8 of 128 tokens.
    tiny = preset("tiny")
    activations = tiny.n_layers * 8 * tiny.seq_len * (9 * tiny.d_model + 2 * tiny.d_ff) * 4
    assert n["fp32"]["activations"] == pytest.approx(activations, rel=0.05)
    # bf16 keeps each of them in 2 bytes (a few fp32 ones stay 4): the activations fall to between 0.5 and 0.6.
    assert 0.5 <= n["activation_ratio"] < 0.6
    # With the states unchanged the saving is at most half the activations' share: under the article's ~50%
    # (read as 40-60%), while the activations themselves halve: a caveat.
    bound = 0.5 * activations / (states + activations)  # 0.36
    assert n["saving"] <= bound * 1.05 and bound * 1.05 < 0.4
    assert row["verdict"] == CAVEAT


def check_cpu_speed(row):
    n = row["numbers"]
    assert n["speedup"] == pytest.approx(n["fp32_step_s"] / n["bf16_step_s"])
    # A CPU has no 16-bit matrix units: the bf16 run rounds its inputs to bf16 and multiplies in fp32, the fp32
    # run's work plus the casts. It cannot be twice as fast; with timing noise, clearly under 1.5x.
    assert "emulated" in n["bf16_compute_path"]
    assert n["speedup"] < 1.5
    assert row["verdict"] == CAVEAT


def in_article_range(ratio: float) -> bool:
    """The article's "2-3x" at its own precision (one decimal)."""
    return 1.95 <= ratio < 3.05


def check_speedup(row):
    n = row["numbers"]
    assert set(n["steps"]) == set(DATASHEETS) == {"a100-40gb", "a100-80gb", "h100-sxm", "h200"}
    gpt2 = preset("gpt2-124m")
    d, s, v, layers, tokens = gpt2.d_model, gpt2.seq_len, gpt2.vocab_size, gpt2.n_layers, 8 * gpt2.seq_len
    # One step's matmul FLOPs by hand: per token and block 2 x 12 d^2 (qkv 3d^2, proj d^2, fc1 and fc2 4d^2 each)
    # and 4 s d (scores and values over the full square), the head 2 d V; backward twice the forward.
    step_flops = 3 * tokens * (layers * (24 * d * d + 4 * s * d) + 2 * d * v)
    for gpu, step in n["steps"].items():
        sheet = DATASHEETS[gpu]
        assert step["speedup"] == pytest.approx(step["fp32_s"] / step["bf16_s"])
        fp32_floor = step_flops / sheet["peak_flops"]["fp32"]  # strict fp32 on the CUDA cores at 100% of the peak
        assert step["fp32_s"] >= fp32_floor
        assert step["bf16_s"] >= layers * sum(price(block_kernels(gpt2, 8, 2, "bf16", "bf16"), gpu))  # blocks alone
        assert fp32_floor / step["bf16_s"] > 3  # even at its peak strict fp32 is over 3x slower: not the article's
    cli = simulated("--model", "gpt2-124m", "--precision", "fp32", "--micro-batch-size", "8", "--gpu", "h100-sxm")
    assert cli["step_time_s"] == pytest.approx(n["steps"]["h100-sxm"]["fp32_s"], rel=1e-12)
    # Against TF32 tensor cores: one block priced by hand on each datasheet, fp32 tensors and TF32 matmuls over
    # bf16 ones. The datasheets' TF32 peak is half the bf16 one; the cited tables and the kernels' launch cost set
    # the rest.
    by_hand = {}
    for model, micro_batch in (("gpt2-124m", 8), ("llama3-8b", 1)):
        config = preset(model)
        for gpu in DATASHEETS:
            tf32 = sum(price(block_kernels(config, micro_batch, 4, "tf32", "tf32"), gpu))
            bf16 = sum(price(block_kernels(config, micro_batch, 2, "bf16", "bf16"), gpu))
            by_hand[f"{model} {gpu}"] = tf32 / bf16
            assert n["tf32_block_speedup"][model][gpu] == pytest.approx(tf32 / bf16, rel=0.01)
    inside = [label for label, ratio in by_hand.items() if in_article_range(ratio)]
    assert inside == n["inside_article_range"] == ["gpt2-124m h100-sxm", "gpt2-124m h200", "llama3-8b h100-sxm",
                                                   "llama3-8b h200"]
    # Not against strict fp32 (over 3x everywhere, above), but against TF32 on H100/H200: a caveat.
    assert row["verdict"] == CAVEAT


def check_fp16_bf16_same(row):
    assert set(row["numbers"]) == set(DATASHEETS)
    for gpu, n in row["numbers"].items():
        sheet = DATASHEETS[gpu]
        assert n["bf16_tflops"] * 1e12 == sheet["peak_flops"]["bf16"] == sheet["peak_flops"]["fp16"]
        # the same cited GEMM rows for both, and 2 bytes an element in both: every kernel costs the same
        assert sheet["matmul_efficiency"]["bf16"] == sheet["matmul_efficiency"]["fp16"]
        assert n["step_ratio"] == pytest.approx(1, abs=1e-9)
    assert row["verdict"] == HOLDS


def check_matmul_share(row):
    """The share of a block's time in matmuls, from a block priced by hand on the H100 datasheet (micro-batch 1,
    bf16); its matmul FLOPs are the real Block's as torch's FlopCounterMode counts them."""
    assert row["numbers"]["gpu"] == "h100-sxm"
    shares = row["numbers"]["gemm_time_share"]
    assert list(shares) == ["gpt2-124m", "llama3-8b", "gpt3-175b"]
    by_hand = {}
    for model, share in shares.items():
        config = preset(model)
        kernels = block_kernels(config, 1, 2, "bf16", "bf16")
        recomputed_scores = 2 * config.seq_len**2 * config.d_model  # FlashAttention-2's backward redoes q k^T
        assert gemm_flops(kernels) - recomputed_scores == block_matmul_flops(model)
        gemm, memory = price(kernels, "h100-sxm")
        by_hand[model] = gemm / (gemm + memory)
        assert share == pytest.approx(by_hand[model], abs=0.01)
    # The article's 95%, to its precision (94.5%), everywhere: no, gpt2-124m's memory-bound kernels take about half
    # its time. Within 5 points for some model (llama3-8b's long sequence): a caveat.
    assert by_hand["gpt2-124m"] < 0.6 and by_hand["llama3-8b"] >= 0.9
    low, high = min(by_hand.values()), max(by_hand.values())
    assert row["verdict"] == (HOLDS if low >= 0.945 else CAVEAT if high >= 0.90 else WRONG) == CAVEAT


def check_cast_cost(row):
    sheet = DATASHEETS["a100-80gb"]
    hbm = sheet["hbm_bandwidth"] * sheet["achieved"]["hbm_fraction"]  # 2.039 TB/s x 0.83 (BabelStream)
    gpt2 = model_params("gpt2-124m")
    assert gpt2 == 124_439_808  # GPT-2 small's published count
    ms = row["numbers"]["gpu_ms"]
    # Read the fp32 master (4 bytes), write the 16-bit copy (2 bytes), every parameter, at the achieved bandwidth.
    assert ms["gpt2-124m on one A100"] == pytest.approx(gpt2 * (4 + 2) / hbm * 1e3)  # 0.44 ms
    # GPT-3 over tp8 x pp16: a GPU holds a 128th of the model, a little more on the stages with the embeddings.
    share = model_params("gpt3-175b") / (8 * 16) * (4 + 2) / hbm * 1e3
    assert share <= ms["gpt3-175b, one GPU of tp8 x pp16"] <= 1.25 * share  # 4.8 to 6 ms
    assert 1.25 * share < 100  # milliseconds, as the article says
    assert row["verdict"] == HOLDS


# fp8-speed's cases, smallest to largest: (model, micro-batch, tp) of one GPU's blocks on h100-sxm.
FP8_BLOCKS = {"gpt2-124m mb 8": ("gpt2-124m", 8, 1), "llama3-8b tp8": ("llama3-8b", 1, 8),
              "gpt3-175b tp8 pp16 dp8 ZeRO-1": ("gpt3-175b", 1, 8)}


def check_fp8_speed(row):
    """From the datasheets: the A100 has no fp8 peak; on the H100 fp8's peak is twice bf16's, but the cited fp8 GEMM
    rates are below bf16's for small GEMMs, and fp8 adds casts. One block of each case priced by hand both ways
    bounds the simulated step."""
    n = row["numbers"]
    h100 = DATASHEETS["h100-sxm"]
    assert n["a100_fp8_peak"] is None and DATASHEETS["a100-80gb"]["peak_flops"]["fp8"] is None
    assert n["h100_fp8_over_bf16_peak"] == pytest.approx(1978.9 / 989.4)  # dense TFLOP/s, H100 SXM datasheet
    # The achieved GEMM rates (peak x the cited efficiency at the GEMM's smallest side), written out: at GPT-3's
    # side 2048 fp8 reaches 1978.9 x 0.511 = 1011 TFLOP/s against bf16's 989.4 x 0.757 = 749 (1.35x); at GPT-2's
    # width 768 fp8 1978.9 x 0.230 = 455 against bf16's 989.4 x 0.693 = 686: fp8 GEMMs are slower there.
    def rate(fmt, side):
        return h100["peak_flops"][fmt] * table_efficiency(h100["matmul_efficiency"][fmt], side)

    assert rate("fp8", 2048) / rate("bf16", 2048) == pytest.approx(1978.9 * 0.511 / (989.4 * 0.757))
    assert rate("fp8", 768) / rate("bf16", 768) == pytest.approx(455 / 686, rel=0.01)
    ratios = n["bf16_over_fp8_step"]
    assert list(ratios) == list(FP8_BLOCKS)  # smallest to largest
    block = {}
    for label, (model, micro_batch, tp) in FP8_BLOCKS.items():
        config = preset(model)
        bf16 = sum(price(block_kernels(config, micro_batch, 2, "bf16", "bf16", tp), "h100-sxm"))
        fp8 = sum(price(block_kernels(config, micro_batch, 2, "fp8", "bf16", tp), "h100-sxm"))
        block[label] = bf16 / fp8
        # fp8 changes only the blocks' Linears (attention, head, loss, communication, optimizer stay): a step is
        # a B16 + X against a B8 + X, which lies between B16/B8 and 1.
        low, high = sorted((block[label], 1.0))
        assert low - 0.005 <= ratios[label] <= high + 0.005, (label, block[label], ratios[label])
    assert block["gpt2-124m mb 8"] < 0.9 and ratios["gpt2-124m mb 8"] < 1  # fp8 slower for the small model
    assert block["gpt3-175b tp8 pp16 dp8 ZeRO-1"] > 1.05 and ratios["gpt3-175b tp8 pp16 dp8 ZeRO-1"] > 1  # faster
    # Faster only at the largest scale, not everywhere: "mainly in very large training" holds, with a caveat.
    assert n["faster_in_fp8"] == [label for label, r in ratios.items() if r > 1]
    assert row["verdict"] == CAVEAT


GPT3_LAYOUT = "gpt3-175b tp8 pp16 dp8 ZeRO-1"


def check_memory_halved(row):
    cases = row["numbers"]["cases"]
    assert list(cases) == ["gpt2-124m", "gpt2-124m mb 8", "llama3-8b tp8", GPT3_LAYOUT]
    for label, case in cases.items():
        assert case["saving"] == pytest.approx(1 - case["bf16_gib"] / case["fp32_gib"])
        # bf16 keeps every activation in 2 bytes instead of 4, but for a few fp32 ones (the loss's logits)
        assert 0.5 <= case["activation_ratio"] <= 0.65
    # Model states, bytes per parameter: one replica holds 4 + 4 + 8 (fp32) or 2 + 2 + 4 + 8 (bf16), 16 both; ZeRO-1
    # over 8 replicas shards the optimizer's part: 4 + 4 + 8/8 = 9 against 2 + 2 + 12/8 = 5.5.
    for label in ("gpt2-124m", "gpt2-124m mb 8", "llama3-8b tp8"):
        assert cases[label]["model_state_ratio"] == pytest.approx(1, abs=1e-3)
    assert cases[GPT3_LAYOUT]["model_state_ratio"] == pytest.approx(5.5 / 9, abs=1e-3)
    cli = simulated("--model", "gpt2-124m", "--precision", "fp32", "--micro-batch-size", "8", "--gpu", "a100-80gb")
    assert cli["memory_per_gpu"]["total"] / 2**30 == pytest.approx(cases["gpt2-124m mb 8"]["fp32_gib"])
    # gpt2-124m, one sequence: 16 x 124M = 2.0 GB of states against at most 1.4 GB of fp32 activations (per block
    # no more than 20 s h numbers -- 16 with FlashAttention and GELU's 4h -- and the loss's fp32 logits at most 3 s V
    # numbers): the saving is at most half the activations' share, 20%, far from the article's 50% (40-60%).
    gpt2, states = preset("gpt2-124m"), 16 * model_params("gpt2-124m")
    s, h, v = gpt2.seq_len, gpt2.d_model, gpt2.vocab_size
    most = (gpt2.n_layers * 20 * s * h + 3 * s * v) * 4
    assert cases["gpt2-124m"]["saving"] <= 0.5 * most / (states + most) < 0.4
    # GPT-3's first pipeline stage (6 blocks, tp8) holds 16 micro-batches in flight under 1F1B. Each block keeps at
    # least x, its two norms' inputs to qkv and fc1 (whole: no sequence parallelism) and this rank's q, k, v and
    # GELU's input and output (3 + 4 + 4 h/8 wide): 4 + 11/8 s h numbers, 4 bytes in fp32. Its states are at most
    # 9 bytes x 1.1 of a 128th of the model. bf16 halves the activations exactly (no loss on the first stage) and
    # keeps 5.5/9 of the states; even with 2 GB of buffers the saving is over 40%.
    gpt3 = preset("gpt3-175b")
    least_activations = 16 * 6 * (4 + 11 / 8) * gpt3.seq_len * gpt3.d_model * 4  # 52 GB
    most_states = 9 * 1.1 * model_params("gpt3-175b") / 128  # 13.5 GB
    assert cases[GPT3_LAYOUT]["activation_ratio"] == pytest.approx(0.5, abs=0.005)
    least = ((1 - 5.5 / 9) * most_states + 0.495 * least_activations) / (most_states + least_activations + 2e9)
    assert 0.4 < least <= cases[GPT3_LAYOUT]["saving"] <= 0.5
    # About 50% somewhere (where activations dominate), far from it elsewhere: a caveat.
    assert row["verdict"] == CAVEAT


def check_gpt3_memory(row):
    n = row["numbers"]
    # By hand: a block has 12 d^2 + 13 d parameters (qkv 3d^2 + 3d, proj d^2 + d, fc1 4d^2 + 4d, fc2 4d^2 + d,
    # two LayerNorms 4d); the embeddings (V + s) d, the final LayerNorm 2d, the head is tied. And the real model.
    c = preset("gpt3-175b")
    params = c.n_layers * (12 * c.d_model**2 + 13 * c.d_model) + (c.vocab_size + c.seq_len) * c.d_model + 2 * c.d_model
    assert n["n_params"] == params == model_params("gpt3-175b") == 174_604_259_328
    assert n["fp32_state_gb"]["parameters"] == pytest.approx(4 * params / 1e9)
    assert n["fp32_state_gb"]["optimizer_states"] == pytest.approx(8 * params / 1e9)
    assert n["bf16_state_gb"]["total"] == pytest.approx(n["fp32_state_gb"]["total"]) == pytest.approx(16 * params / 1e9)
    assert n["gpus_article_accounting"] == math.ceil((16 * params / 1e9 + 200) / 80) == 38
    assert n["gpus_for_state_80gib"] == math.ceil(16 * params / (80 * 2**30)) == 33
    assert row["verdict"] == CAVEAT


def check_ddp_fit(row):
    n = row["numbers"]
    capacity = DATASHEETS["a100-80gb"]["hbm_bytes"]
    assert capacity == 80 * 2**30 and n["capacity_bytes"] == capacity
    assert n["largest_params"] == capacity / 16
    # Llama 3 8B (8,030,261,248 parameters, the published checkpoint's count) needs 16 x 8.03e9 = 128 GB of state
    # under DDP before any activation: more than the 86 GB an "80 GB" A100 holds. Ten billion need 160 GB.
    params = model_params("llama3-8b")
    assert params == 8_030_261_248 and 16 * params > capacity and 16 * 10e9 > capacity
    assert not n["ddp_fits"] and n["ddp_gib"] * 2**30 > 16 * params
    assert n["zero3_fits"] and 16 * params / 8 < n["zero3_gib"] * 2**30 < capacity  # its state is an eighth
    assert row["verdict"] == HOLDS


ARTICLE_SHARES = {"parameters": 0.20, "gradients": 0.20, "optimizer": 0.40, "activations": 0.15, "other": 0.05}


def least_activation_bytes(name: str, micro_batch: int, element_bytes: int) -> int:
    """What the backward of a whole model on one GPU needs kept at the least: per block q, k, v and GELU's input
    and output (3 h + 2 x 4h numbers a token), and the loss's fp32 log-probabilities (V a token)."""
    c = preset(name)
    tokens = micro_batch * c.seq_len
    return tokens * (c.n_layers * 11 * c.d_model * element_bytes + c.vocab_size * 4)


def check_memory_shares(row):
    n = row["numbers"]
    assert n["article"] == ARTICLE_SHARES
    for label, shares in n["shares"].items():
        assert sum(shares.values()) == pytest.approx(1)
        assert n["distance"][label] == pytest.approx(max(abs(shares[k] - v) for k, v in ARTICLE_SHARES.items()))
        if "fp32" not in label:
            # Mixed precision: the 16-bit weights are 2 of the 16 bytes of state a parameter, so at most 12.5% of
            # the GPU: 7.5 points or more from the article's 20%.
            assert shares["parameters"] <= 2 / 16 + 1e-12
    fp32 = n["shares"]["gpt2-124m fp32"]
    assert fp32["parameters"] == fp32["gradients"] and fp32["optimizer"] == pytest.approx(2 * fp32["parameters"])
    # The one fp32 case, gpt2-124m on one GPU (no buffers): 4 + 4 + 8 bytes of state a parameter against at least
    # 0.62 GB of fp32 activations: over 23%, more than 5 points from the article's 15%.
    states, least = 16 * model_params("gpt2-124m"), least_activation_bytes("gpt2-124m", 1, 4)
    assert fp32["activations"] >= least / (states + least) > ARTICLE_SHARES["activations"] + 0.05
    # No configuration within 5 points of the article's split: wrong.
    assert row["verdict"] == WRONG


def check_optimizer_largest(row):
    n = row["numbers"]
    first = [label for label, s in n["shares"].items() if max(s, key=s.get) == "optimizer"]
    assert [label for label, name in n["largest"].items() if name == "optimizer"] == first
    # gpt3-175b on one GPU: 12 bytes of optimizer state (fp32 masters, m, v) a parameter, 2.1 TB, against at most
    # 0.17 TB of bf16 activations for its one sequence (34 s h bytes a block, Korthikanti et al.'s count with
    # dropout and the s x s terms, and 3 s V fp32 numbers of logits): the optimizer is the largest.
    gpt3 = preset("gpt3-175b")
    most = gpt3.n_layers * 34 * gpt3.seq_len * gpt3.d_model + 3 * gpt3.seq_len * gpt3.vocab_size * 4
    assert 12 * model_params("gpt3-175b") > most
    assert n["largest"]["gpt3-175b bf16"] == "optimizer"
    # gpt2-124m, 8 sequences: 12 x 124M = 1.5 GB of optimizer state against at least 3.3 GB of activations.
    assert least_activation_bytes("gpt2-124m", 8, 2) > 12 * model_params("gpt2-124m")
    assert n["largest"]["gpt2-124m bf16 mb 8"] == "activations"
    # The largest in some configurations, not in all: a caveat.
    assert row["verdict"] == CAVEAT


def _zero_common(row, stage: int) -> dict:
    n = row["numbers"]
    replicas = n["replicas"]
    paper = {1: 16 / (4 + 12 / replicas), 2: 16 / (2 + 14 / replicas), 3: replicas}[stage]
    assert n["paper_saving"] == pytest.approx(paper)
    assert n["saving"] == pytest.approx(paper, rel=0.03)
    return n


def check_zero1(row):
    n = _zero_common(row, 1)
    assert all(r == pytest.approx(1, abs=1e-3) for r in n["volume_over_ddp"].values())
    assert row["verdict"] == CAVEAT


def check_zero2(row):
    n = _zero_common(row, 2)
    assert n["volume_over_ddp"]["1"] == pytest.approx(1, abs=1e-3)
    assert n["volume_over_ddp"]["4"] == pytest.approx((4 + 1) / 2, abs=1e-3)  # a reduce-scatter per micro-batch
    assert row["verdict"] == CAVEAT


def check_zero3(row):
    n = _zero_common(row, 3)
    assert n["saving"] <= n["replicas"] and n["paper_limit"] is None
    assert 1 < n["volume_over_ddp"]["1"] <= 1.5 and n["volume_over_ddp"]["4"] > n["volume_over_ddp"]["1"]
    assert row["verdict"] == WRONG


def check_zero3_not_best(row):
    n = row["numbers"]
    for label, stages in n["cases"].items():
        best = min(stages["0"]["step_s"], stages["1"]["step_s"])
        assert n["zero3_over_best_of_0_1"][label] == pytest.approx(stages["3"]["step_s"] / best)
    # Across 8 servers (64 GPUs, one sequence each) ZeRO-3 all-gathers the bf16 weights once more than ZeRO-1 (for
    # the backward as well as the forward): 63/64 x 2 x 124M bytes through each GPU's 200 Gb/s NIC (x 0.96), 10 ms.
    # The most it can hide behind is the GPU's whole compute for its sequence, priced by hand: 12 blocks and the
    # head's three GEMMs, under 9 ms. So ZeRO-3's step is longer than the best of DDP and ZeRO-1 by over 1 ms.
    sheet, nic = DATASHEETS["a100-80gb"], NICS["hdr"]
    gpt2 = preset("gpt2-124m")
    weights = 2 * model_params("gpt2-124m")
    extra = ring_seconds("all_gather", weights, 64, nic["bandwidth"] * nic["busbw_fraction"], 0.0)
    head = 3 * 2 * gpt2.seq_len * gpt2.d_model * gpt2.vocab_size / (
        sheet["peak_flops"]["bf16"] * table_efficiency(sheet["matmul_efficiency"]["bf16"], gpt2.d_model))
    compute = gpt2.n_layers * sum(price(block_kernels(gpt2, 1, 2, "bf16", "bf16"), "a100-80gb")) + head
    across = n["cases"]["64 GPUs, 8 servers"]
    assert extra - compute > 1e-3
    assert across["3"]["step_s"] - min(across["0"]["step_s"], across["1"]["step_s"]) >= extra - compute
    # Inside one server the extra all-gather takes 2 x 124M x 7/8 bytes over NVLink, under 1 ms, against some 75 ms
    # of compute for 8 sequences: it can hide. The simulated 1.03x there (the gathers' and per-unit reduce-scatters'
    # latency) is the simulator's own number, which nothing here re-derives; the verdict rests on it for "holds".
    nvlink = sheet["nvlink_bandwidth"] * sheet["achieved"]["nvlink_fraction"]
    assert ring_seconds("all_gather", weights, 8, nvlink, sheet["nvlink_latency"]) < 1e-3
    inside = n["zero3_over_best_of_0_1"]["8 GPUs, one server"]
    assert 1 < inside < 1.1
    assert row["verdict"] == HOLDS


def check_fsdp_offload(row):
    assert row["verdict"] == UNCHECKABLE and "simulator" in row["why"] and row["numbers"] == {}


def check_more_gpus(row):
    n = row["numbers"]
    stop = None
    for point in n["points"]:
        if point["marginal"] is not None:
            stop = (stop or point["gpus"]) if point["marginal"] < n["threshold"] else None
    assert n["stops_paying_at"] == stop
    cli = invoke("simulate", *row["command"].split()[2:], "--json")
    assert cli["sweep"]["stops_paying_at"] == stop
    # From the datasheets, with one GPU's simulated throughput as the unit of work (64 sequences a step):
    # every step all-reduces the bf16 gradients, 2 x 124M bytes. Past one server the ring runs through each GPU's
    # 200 Gb/s NIC (x 0.96 bus bandwidth, NCCL): at 64 GPUs 2 x 63/64 x 249 MB / 24 GB/s = 20 ms, which no overlap
    # hides, against one sequence's compute: at most 64 / 20 ms = 3.1k samples/s, while 32 GPUs already reach 1.6k.
    # The 32 added GPUs bring at most (3.1k - 1.6k) / (32 x 105) = 45% of a GPU's worth: below the threshold (50%).
    points = {p["gpus"]: p for p in n["points"]}
    one = points[1]["samples_per_s"]
    sheet, nic = DATASHEETS["a100-80gb"], NICS["hdr"]
    grads = 2 * model_params("gpt2-124m")
    at_most_64 = 64 / ring_seconds("all_reduce", grads, 64, nic["bandwidth"] * nic["busbw_fraction"], 0.0)
    assert points[64]["samples_per_s"] <= at_most_64
    assert (at_most_64 - points[32]["samples_per_s"]) / (32 * one) < n["threshold"] == 0.5
    # Inside one server the same all-reduce over NVLink takes 2 x 7/8 x 249 MB / (300 GB/s x 0.78) = 1.9 ms against
    # 8 sequences of compute (76 ms): up to 8 GPUs every added GPU is worth nearly a whole one.
    nvlink = sheet["nvlink_bandwidth"] * sheet["achieved"]["nvlink_fraction"]
    for gpus in (2, 4, 8):
        floor = 64 / (64 / gpus / one + ring_seconds("all_reduce", grads, gpus, nvlink, sheet["nvlink_latency"]))
        assert floor / (gpus * one) > 0.95 and points[gpus]["efficiency"] > 0.95
    assert stop in (16, 32, 64)  # it stops paying past one server, by 64 GPUs
    assert row["verdict"] == HOLDS


def check_bubble(row):
    n = row["numbers"]
    p, m = n["pp"], n["micro_batches"]
    textbook = {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1), "interleaved": (p - 1) / (2 * m + p - 1),
                "zb-h1": (p - 1) / (3 * m + p - 1)}
    for kind, value in textbook.items():
        assert n["replays"][kind]["replayed"] == pytest.approx(value, abs=1e-12)
    cli = invoke("schedule", "--pp", str(p), "--micro-batches", str(m), "--schedule", "1f1b", "--json")
    assert cli["bubble_fraction"] == pytest.approx(textbook["1f1b"], abs=1e-12)
    # GPT-3 as tp8 x pp16 x dp8, a global batch of 1536 sequences: 1536 / 8 = 192 micro-batches of one per replica.
    assert n["gpt3_micro_batches"] == 1536 // 8
    assert n["gpt3_formula"] == pytest.approx(15 / (192 + 15))
    # The simulated bubble of the slowest rank is the simulator's own number (unequal stages, real costs, the
    # sends between servers): nothing here re-derives it, so the caveat rests on it (10.7% against 7.2%).
    close = abs(n["gpt3_simulated"] - n["gpt3_formula"]) <= 0.1 * n["gpt3_formula"]
    assert row["verdict"] == (HOLDS if close else CAVEAT)


def check_tp_in_node(row):
    n = row["numbers"]
    assert n["tp_in_pp_across_s"] == pytest.approx(n["tp_in_server_s"] + 2 * n["pp_across_servers_s"])
    assert n["pp_in_tp_across_s"] == pytest.approx(n["tp_across_servers_s"] + 2 * n["pp_in_server_s"])
    # By hand, GPT-3 as tp8 x pp16 on DGX A100s: a stage has 96/16 = 6 blocks; Megatron's tensor parallelism
    # all-reduces a micro-batch's hidden states (2048 x 12288 bf16 numbers, 50 MB) twice a block forward and twice
    # backward: 24 rings of 8 GPUs per micro-batch, over NVLink (300 GB/s x 0.78) inside a server or through each
    # GPU's NIC (25 GB/s x 0.96) across 8 servers; PP sends that one tensor to the next stage.
    sheet, nic = DATASHEETS["a100-80gb"], NICS["hdr"]
    nvlink = sheet["nvlink_bandwidth"] * sheet["achieved"]["nvlink_fraction"]
    network = nic["bandwidth"] * nic["busbw_fraction"]
    hidden = 2048 * 12288 * 2
    assert n["layers_per_stage"] == 6 and n["tp_collectives"] == 6 * 4
    tp_in = 24 * ring_seconds("all_reduce", hidden, 8, nvlink, sheet["nvlink_latency"])  # 9.5 ms
    tp_across = 24 * ring_seconds("all_reduce", hidden, 8, network, nic["latency"])  # 90 ms
    pp_in, pp_across = hidden / nvlink + sheet["nvlink_latency"], hidden / network + nic["latency"]  # 0.2, 2.1 ms
    assert n["tp_in_server_s"] == pytest.approx(tp_in, rel=0.02)
    assert n["tp_across_servers_s"] == pytest.approx(tp_across, rel=0.02)
    assert n["pp_in_server_s"] == pytest.approx(pp_in, rel=0.02)
    assert n["pp_across_servers_s"] == pytest.approx(pp_across, rel=0.02)
    # TP inside, PP across: 9.5 + 2 x 2.1 = 14 ms a micro-batch; the other way 90 + 2 x 0.2 = 90 ms, over twice it.
    placed, swapped = tp_in + 2 * pp_across, tp_across + 2 * pp_in
    assert swapped > 2 * placed
    assert row["verdict"] == HOLDS


def check_strategies(row):
    n = row["numbers"]
    model = preset("llama3-8b")
    params = model_params("llama3-8b")
    activation = model.seq_len * model.d_model * 2  # one sequence's hidden states in bf16, 67 MB
    # Volume per GPU and step (2S an all-reduce, S otherwise), 8 sequences on 8 GPUs, by hand:
    by_hand = {
        "DDP": 2 * 2 * params,  # one all-reduce of the bf16 gradients, 32 GB
        # Megatron TP, 8 micro-batches: 4 all-reduces of the hidden states a block (2 forward, 2 backward), the
        # vocabulary-parallel embedding's and the head's, 3 of fp32 numbers a token for the loss
        "TP": 8 * (2 * (4 * model.n_layers + 2) * activation + 3 * 2 * model.seq_len * 4),  # 140 GB
        "PP": 2 * 8 * activation,  # a middle stage sends 8 activations forward and 8 gradients back, 1 GB
        # ZeRO-3: the bf16 gradients reduce-scattered, the bf16 weights all-gathered for forward and backward (less
        # the units that stay gathered between the two)
        "ZeRO-3": 3 * 2 * params,  # 48 GB
    }
    for name, volume in by_hand.items():
        assert n["volume_gb"][name] == pytest.approx(volume / 1e9, rel=0.05 if name == "ZeRO-3" else 1e-3), name
    # The article ranks traffic DDP small < PP medium < TP = ZeRO-3 large. By hand DDP moves 30x PP's: inverted.
    article = {"DDP": 1, "PP": 2, "TP": 3, "ZeRO-3": 3}
    assert n["article_comm_rank"] == article
    inverted = [(a, b) for a in article for b in article if article[a] < article[b] and by_hand[a] > by_hand[b]]
    assert inverted == [("DDP", "PP")] and [tuple(pair) for pair in n["comm_inversions"]] == inverted
    # Memory: TP shards the states and the activations between its Linears by 8, ZeRO-3 only the states (16 B x
    # 8.0e9 / 8 = 16 GB each): TP needs less, against the article's "ZeRO-3 highest".
    assert n["memory_gib"]["TP"] < n["memory_gib"]["ZeRO-3"] and ["ZeRO-3", "TP"] in n["memory_inversions"]
    assert min(n["memory_gib"].values()) * 2**30 > 16 * params / 8
    # One inversion is enough: wrong.
    assert row["verdict"] == WRONG


CHECKS = {name.removeprefix("check_").replace("_", "-"): check for name, check in globals().items()
          if name.startswith("check_")}


def test_every_claim_has_a_check_and_a_command():
    assert set(CHECKS) == {c.name for c in CLAIMS}
    for claim in CLAIMS:
        assert claim.command.startswith(("minigpt ", "for z in")), claim.command
        assert "minigpt " in claim.command and claim.where and claim.article


@pytest.mark.parametrize("name", FAST)
def test_fast_row(fast_report, name):
    row = by_name(fast_report)[name]
    CHECKS[name](row)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_slow_row(full_report, name):
    row = by_name(full_report)[name]
    CHECKS[name](row)


@pytest.mark.slow
def test_the_whole_command_runs_in_time_and_every_row_checks(full_report):
    assert full_report["wall_s"] < WALL_LIMIT_S, full_report["wall_s"]
    rows = by_name(full_report)
    assert list(rows) == [c.name for c in CLAIMS]
    for name in FAST:
        CHECKS[name](rows[name])


@pytest.mark.slow
def test_a_zero_row_counts_what_training_moves(tmp_path, fast_report):
    """zero2's volumes, counted from the schedule, are the bytes a real 2-rank run of its command moves."""
    row = by_name(fast_report)["zero2"]
    command = row["command"].split("; ")[1].split()[1:] + ["--out", str(tmp_path / "run")]
    summary = invoke(*command)
    measured = {kind: c["volume"] for kind, c in summary["comm_bytes_per_step"]["dp"].items() if c["volume"]}
    assert measured == row["numbers"]["volume"]["4"]


def test_docs_claims_md_is_the_commands_output(fast_report):
    """Rows that are neither timed nor computed by torch are the same on any machine: they must stand in the
    committed docs/claims.md as a fresh run writes them; every other row must at least be there, same verdict."""
    from cli.tools.claims import ClaimResult, Finding

    doc = (ROOT / "docs" / "claims.md").read_text(encoding="utf-8")
    claims = {c.name: c for c in CLAIMS}
    for name, row in by_name(fast_report).items():
        claim = claims[name]
        finding = Finding(row["ours"], row["verdict"], row["why"], row["numbers"], row["discussion"])
        line = markdown_row(ClaimResult(claim, finding, row["seconds"]))
        if not claim.needs_torch and not claim.timed:
            assert line in doc, f"docs/claims.md is stale for {name}: run minigpt claims --markdown docs/claims.md"
            assert row["discussion"] in doc
        else:
            assert f"| **{name}**: " in doc and f"**{row['verdict']}**" in doc
    for name in SLOW:
        assert f"| **{name}**: " in doc


def test_torch_free_rows_run_without_torch():
    code = ("import sys; from cli.tools.claims_registry import run_claims, select; "
            "run_claims([c for c in select() if not c.needs_torch]); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_the_table_names_each_command():
    result = CliRunner().invoke(main, ["claims", "--only", "bubble", "--only", "zero1"])
    assert result.exit_code == 0, result.output
    assert "$ minigpt schedule --pp 4 --micro-batches 8 --schedule 1f1b" in result.stdout
    assert "bubble:" in result.stdout and "zero1:" in result.stdout and "formats:" not in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--only", "nope"], "unknown claim 'nope'"),
    (["--only", "bubble", "--markdown", "MD"], "--markdown writes the whole table"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    args = [str(tmp_path / "x.md") if arg == "MD" else arg for arg in args]
    result = CliRunner().invoke(main, ["claims", *args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minigpt: error:") and message in lines[0]
    assert not (tmp_path / "x.md").exists()
