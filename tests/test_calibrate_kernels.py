"""parallel/calibrate/kernels.py on the CPU: the timer, each GEMM format, element-wise bytes, launches, attention.

The CUDA branches differ only in the clock (CUDA events) and the TF32 switch; the switch is checked
here on a CUDA device object (setting the flag needs no GPU), the rest runs the same code on the CPU.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from parallel.calibrate.kernels import (ELEMENTWISE, FORMATS, attention_flops, gemm_call, launch_overhead,
                                        matmul_mode, supported_formats, time_attention, time_call, time_elementwise,
                                        time_gemm, unfused_attention)

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_the_timer_reports_the_median_call_and_its_spread():
    calls = []

    def sleep():
        calls.append(1)
        time.sleep(0.002)

    timing = time_call(sleep, CPU, min_run_s=0.01, repeats=3)
    assert 0.0019 < timing.seconds < 0.02
    assert timing.calls >= 2 and timing.repeats == 3 and timing.spread >= 0
    assert len(calls) == 2 + 3 * timing.calls  # a warm-up, a probe, the timed runs
    with pytest.raises(ValueError):
        time_call(sleep, CPU, repeats=0)


def test_every_cpu_format_times_a_gemm_with_its_flops():
    assert supported_formats(CPU) == tuple(f for f in FORMATS if f != "tf32")
    assert supported_formats(CUDA) == FORMATS
    for fmt in supported_formats(CPU):
        result = time_gemm(fmt, 32, 48, 16, CPU, min_run_s=0.001, repeats=2)
        assert (result["format"], result["m"], result["n"], result["k"]) == (fmt, 32, 48, 16)
        assert result["flops"] == 2 * 32 * 48 * 16 and result["seconds"] > 0 and result["spread"] >= 0
        assert result["flops_per_s"] == pytest.approx(result["flops"] / result["seconds"])


def test_fp8_is_scaled_mm_of_e4m3_operands_with_bf16_output_and_dimensions_of_16():
    for fmt in ("fp8", "fp8_fast"):
        out = gemm_call(fmt, 32, 48, 16, CPU)()
        assert out.shape == (32, 48) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="multiples of 16"):
        gemm_call("fp8", 32, 40, 16, CPU)  # refused everywhere, so a CPU dry run fails as a GPU would
    assert gemm_call("bf16", 8, 4, 2, CPU)().dtype == torch.bfloat16  # other formats take any shape


def test_tf32_is_on_only_for_tf32_and_a_cpu_has_none():
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        for start in (True, False):
            torch.backends.cuda.matmul.allow_tf32 = start
            with matmul_mode("tf32", CUDA):
                assert torch.backends.cuda.matmul.allow_tf32 is True
            with matmul_mode("fp32", CUDA):
                assert torch.backends.cuda.matmul.allow_tf32 is False  # fp32 is fp32
            assert torch.backends.cuda.matmul.allow_tf32 is start  # restored
        with pytest.raises(ValueError, match="CUDA"):
            with matmul_mode("tf32", CPU):
                pass
        with pytest.raises(ValueError, match="unknown GEMM format"):
            time_gemm("int8", 16, 16, 16, CPU)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_elementwise_counts_bytes_read_and_written():
    size = 4096 * 64 * 4  # 64 fp32 rows
    rows = {op: time_elementwise(op, "fp32", size, CPU, 0.001, 2) for op in ELEMENTWISE}
    for op, row in rows.items():
        assert row["tensor_bytes"] == size and row["bytes_per_s"] == pytest.approx(row["bytes_moved"] / row["seconds"])
        assert row["bytes_moved"] == (3 if op == "add" else 2) * size
    assert time_elementwise("copy", "bf16", size, CPU, 0.001, 2)["tensor_bytes"] == size  # twice the elements
    with pytest.raises(ValueError, match="unknown element-wise op"):
        time_elementwise("exp", "fp32", size, CPU)


def test_launch_overhead_is_a_few_microseconds_per_launch():
    result = launch_overhead(CPU, 0.005, 3)
    assert 0 < result["per_launch_s"] < 1e-3 and result["calls"] > 1


def test_attention_flops_and_the_unfused_kernel_equals_sdpa():
    assert attention_flops(1, 1, 2, 1) == 8  # 4 * 1 * 1 * 2^2 * 1, halved for the causal mask
    assert attention_flops(1, 1, 2, 1, causal=False) == 16
    assert attention_flops(2, 3, 64, 8, backward=True) == pytest.approx(3.5 * attention_flops(2, 3, 64, 8))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool).triu(1)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(unfused_attention(q, k, v, mask), expected, atol=1e-5)
    for fused in (True, False):
        for backward in (False, True):
            row = time_attention(fused, backward, 2, 2, 32, 16, CPU, 0.001, 2)
            assert row["kernel"] == ("sdpa" if fused else "unfused") and row["flops_per_s"] > 0
            assert row["flops"] == attention_flops(2, 2, 32, 16, True, backward)
