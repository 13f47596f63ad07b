"""cuDNN's fused attention (--attention-kernel cudnn, simulator/costs/rates/attention_rates.py): its table is the
derivation docs/efficiency.md states from the FlashAttention-3 paper's figures, recomputed here from their numbers;
a flash op is priced from the kernel's table, with the same ops and saved tensors; the flag reaches the provenance
and is refused in one line where it cannot be priced."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import main
from job.layout import Layout
from minigpt.config import GPTConfig
from precision.policy import policy
from simulator.costs.compute import kernel_overhead, op_time
from simulator.costs.hardware import load_hardware
from simulator.costs.op_types import FusedAttention
from simulator.costs.ops import Implementation, block_ops

ROOT = Path(__file__).resolve().parents[1]
PRESETS = json.loads((ROOT / "simulator" / "costs" / "hardware.json").read_text(encoding="utf-8"))["gpus"]
DOC = (ROOT / "docs" / "efficiency.md").read_text(encoding="utf-8")
SEQUENCES = (512, 1024, 2048, 4096, 8192, 16384)
FIGURES = {  # TFLOP/s as docs/efficiency.md quotes the figures: head size -> kernel, pass -> 512 ... 16K
    64: {"cudnn_fwd": (225, 288, 334, 363, 379, 388), "fa2_fwd": (180, 229, 262, 284, 295, 299),
         "cudnn_bwd": (266, 348, 395, 417, 432, 433), "fa2_bwd": (198, 238, 264, 279, 287, 291)},
    128: {"cudnn_fwd": (315, 410, 484, 518, 529, 539), "fa2_fwd": (191, 260, 298, 319, 333, 335),
          "cudnn_bwd": (305, 408, 465, 499, 518, 516), "fa2_bwd": (214, 260, 291, 310, 318, 322)},
}
FA2_FWD_BWD = {64: (141, 192, 232, 257, 273, 284), 128: (163, 221, 265, 294, 308, 328)}  # FlashAttention-2's figure


def derived(head: int, i: int) -> float:
    """docs/efficiency.md's derivation: FlashAttention-2's causal fwd + bwd time, its forward part replaced by
    cuDNN's causal forward and its backward part scaled by the backward ratio; TFLOP/s."""
    f = FIGURES[head]
    t = 1 / f["cudnn_fwd"][i] + (3.5 / FA2_FWD_BWD[head][i] - 1 / f["fa2_fwd"][i]) * f["fa2_bwd"][i] / f["cudnn_bwd"][i]
    return 3.5 / t


def test_the_figures_quoted_are_the_docs_and_the_table_is_their_derivation():
    for head, passes in FIGURES.items():
        for key, values in passes.items():
            kernel = "cuDNN" if key.startswith("cudnn") else "FlashAttention-2"
            label = "causal forward" if key.endswith("fwd") else "backward"
            assert f"| {head} | {kernel}, {label} | " + " | ".join(map(str, values)) + " |" in DOC
    printed = {head: re.findall(r"(\d+) \(([\d.]+)\)", next(line for line in DOC.splitlines()
                                if line.startswith(f"| h100-sxm, h200, h100-96gb-500w (cuDNN) | {head} |")))
               for head in FIGURES}
    for gpu in ("h100-sxm", "h200", "h100-96gb-500w"):
        entry = PRESETS[gpu]["attention_cudnn"]
        assert entry["kernel"] == "cuDNN fused attention" and "2407.08608" in entry["source"]
        for head in FIGURES:
            points = entry["causal"][str(head)]
            assert [s for s, _ in points] == list(SEQUENCES)
            for i, (_, fraction) in enumerate(points):
                rate = derived(head, i)
                assert fraction == round(rate * 1e12 / PRESETS[gpu]["peak_flops"]["bf16"], 4)
                assert abs(int(printed[head][i][0]) - rate) <= 0.5 and float(printed[head][i][1]) == fraction
    assert all("attention_cudnn" not in PRESETS[g] for g in ("a100-40gb", "a100-80gb"))


# cudnn-frontend's GB200 measurement (llama3.1_20260424_100750.csv): tokens, forward ms and TFLOP/s, backward ms and
# TFLOP/s, causal, bf16, head size 128, non-deterministic backward
GB200 = ((2048, 0.125, 1097.0, 0.389, 885.0), (4096, 0.391, 1408.0, 1.198, 1148.0),
         (8192, 1.397, 1574.0, 4.127, 1332.0), (16384, 5.150, 1708.0, 16.554, 1328.0),
         (32768, 21.692, 1622.0, 71.756, 1226.0))
GB200_BF16_PEAK = 2.5e15  # NVIDIA Blackwell architecture technical brief: GB200 at 1,200 W, dense


def test_the_b200_cudnn_table_is_the_gb200_measurement_over_its_own_peak():
    """Each point: the forward's FLOPs (its TFLOP/s x its time) x 3.5 (flash-attention's convention: the backward
    2.5 times the forward, as the measurement's own backward rate says) over the forward + backward time, over the
    GB200's dense peak."""
    entry = PRESETS["b200"]["attention_cudnn"]
    assert "cudnn-frontend" in entry["source"] and "GB200" in entry["source"] and list(entry["causal"]) == ["128"]
    for (seq, fwd_ms, fwd_tf, bwd_ms, bwd_tf), (point, fraction) in zip(GB200, entry["causal"]["128"], strict=True):
        forward_flops = fwd_tf * 1e12 * fwd_ms * 1e-3
        assert bwd_tf * 1e12 * bwd_ms * 1e-3 == pytest.approx(2.5 * forward_flops, rel=0.005)
        assert point == seq and fraction == round(3.5 * forward_flops / ((fwd_ms + bwd_ms) * 1e-3) / GB200_BF16_PEAK, 4)


def flash_pair(kernel: str) -> tuple[FusedAttention, FusedAttention]:
    model = GPTConfig(vocab_size=64, seq_len=4096, n_layers=1, n_heads=8, d_model=1024, d_ff=128)
    ops = block_ops(model, 1, Layout(), policy("bf16"), Implementation("flash", attention_kernel=kernel))
    return tuple(op for op in ops.forward + ops.backward if isinstance(op, FusedAttention))


def test_a_flash_op_is_priced_from_its_kernels_table_with_the_same_work():
    gpu = load_hardware("h100-sxm").gpu
    fa2, cudnn = flash_pair("flash-attn-2"), flash_pair("cudnn")
    for a, b in zip(fa2, cudnn):
        assert dataclasses.replace(a, kernel="cudnn") == b  # the same FLOPs, bytes and shapes
        expected = b.benchmark_flops / (989.4e12 * 0.843 * 0.4794)  # the cuDNN table at 4K, head size 128, held
        assert op_time(b, gpu) == pytest.approx(expected + kernel_overhead(gpu))
        assert op_time(a, gpu) - kernel_overhead(gpu) == pytest.approx(
            (op_time(b, gpu) - kernel_overhead(gpu)) * 0.4794 / 0.2971)
    with pytest.raises(Exception, match="attention-kernel flash-attn-2"):
        op_time(cudnn[0], load_hardware("a100-80gb").gpu)


def invoke(*args: str):
    return CliRunner().invoke(main, ["simulate", "--model", "llama3-8b", "--seq-len", "4096", "--dp", "8",
                                     "--zero", "3", "--global-batch", "8", *args])


def test_the_flag_prices_the_step_and_says_so():
    runs = {k: json.loads(invoke("--gpu", "h100-sxm", "--attention-kernel", k, "--json").output)
            for k in ("flash-attn-2", "cudnn")}
    fa2, cudnn = runs["flash-attn-2"], runs["cudnn"]
    assert cudnn["provenance"]["implementation"]["attention_kernel"] == "cudnn"
    assert cudnn["provenance"]["attention"].startswith("cuDNN fused attention table (")
    assert fa2["provenance"]["attention"].startswith("FlashAttention-2 table (")
    assert cudnn["step_time_s"] < fa2["step_time_s"]
    assert cudnn["memory_per_gpu"] == fa2["memory_per_gpu"]  # the same saved tensors
    table = invoke("--gpu", "h100-sxm", "--attention-kernel", "cudnn").output
    assert "flash (cudnn) attention" in table
    assert "--attention-kernel" in invoke("--help").output


@pytest.mark.parametrize("args,words", [
    (("--gpu", "a100-80gb", "--attention-kernel", "cudnn"), "which a100-80gb has none of"),
    (("--gpu", "h100-sxm", "--attention", "unfused", "--attention-kernel", "cudnn"), "it needs --attention flash"),
    (("--gpu", "h100-sxm", "--attention-kernel", "fa3"), "Invalid value for '--attention-kernel'"),
])
def test_what_cannot_be_priced_is_one_line_and_exit_code_2(args, words):
    result = invoke(*args)
    assert result.exit_code == 2 and words in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_context_parallelism_reads_the_kernels_table():
    data = json.loads(invoke("--gpu", "h100-sxm", "--dp", "4", "--cp", "2", "--zero", "3", "--global-batch", "4",
                             "--attention-kernel", "cudnn", "--json").output)
    assert data["provenance"]["context"]["attention"].startswith("cuDNN fused attention table read at the 1,024-token")


def step(*args: str) -> dict:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize("gpu,runs", [("h100-sxm", "cudnn"), ("h200", "cudnn"), ("a100-80gb", "flash-attn-2"),
                                      ("b200", "cudnn")])
def test_the_megatron_core_stack_runs_transformer_engines_choice(gpu, runs):
    """Megatron-core leaves the attention to Transformer Engine, which prefers cuDNN's FusedAttention on Hopper and
    later: the stack's default ("te") is cuDNN's table where the GPU's preset has one (Hopper, Blackwell) and
    FlashAttention-2's elsewhere (the A100, where TE picks flash-attn), the same step as stating it."""
    stack = ("--gpu", gpu, "--overlap", "megatron-core")
    default = step(*stack)
    assert default["provenance"]["implementation"]["attention_kernel"] == runs  # the report names the kernel run
    assert default["step_time_s"] == step(*stack, "--attention-kernel", runs)["step_time_s"]
    assert default["step_time_s"] == step(*stack, "--attention-kernel", "te")["step_time_s"]
    # other stacks run torch's SDPA: FlashAttention-2 unless asked
    assert step("--gpu", gpu)["provenance"]["implementation"]["attention_kernel"] == "flash-attn-2"
    if runs == "cudnn" and "attention_efficiency" in PRESETS[gpu]:  # both kernels measured there: cuDNN's faster
        assert default["step_time_s"] < step(*stack, "--attention-kernel", "flash-attn-2")["step_time_s"]
    elif runs == "cudnn":  # the B200: no FlashAttention-2 table; its flash-attn-2 is the GEMMs' fallback, not cuDNN's
        assert default["step_time_s"] != step(*stack, "--attention-kernel", "flash-attn-2")["step_time_s"]
    else:  # asking cuDNN's kernel by name where no table prices it is still one line
        refused = invoke(*stack, "--attention-kernel", "cudnn")
        assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1


def test_an_unfused_attention_under_the_megatron_core_stack_runs_no_fused_kernel():
    data = step("--gpu", "h100-sxm", "--overlap", "megatron-core", "--attention", "unfused")
    assert data["provenance"]["implementation"]["attention_kernel"] == "flash-attn-2"  # the field's neutral value
    assert data["provenance"]["attention"].startswith("unfused")


def test_the_megatron_core_stack_saves_the_sequence_parallel_shard():
    """Megatron's column-parallel Linears (Transformer Engine's too) save their input's shard under sequence
    parallelism and all-gather it again in the backward: the megatron-core stack's default; ours keeps the
    gathered input; --sp-saved-input states either under any stack."""
    job = ("--gpu", "h100-sxm", "--tp", "4", "--dp", "2", "--sequence-parallel")
    core = step(*job, "--overlap", "megatron-core")
    assert core["provenance"]["implementation"]["sp_saved_input"] == "sharded"
    sharded = step(*job, "--overlap", "megatron-core", "--sp-saved-input", "sharded")
    assert (core["step_time_s"], core["memory_per_gpu"]) == (sharded["step_time_s"], sharded["memory_per_gpu"])
    gathered = step(*job, "--overlap", "megatron-core", "--sp-saved-input", "gathered")
    assert gathered["memory_per_gpu"]["activations"] > core["memory_per_gpu"]["activations"]
    assert step(*job)["provenance"]["implementation"]["sp_saved_input"] == "gathered"  # our executor's
