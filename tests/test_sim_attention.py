"""Causal attention as kernels run it (simulator/costs/rates/attention_rates.py, op_types.FusedAttention): the products
the mask keeps, counted one by one; the published FlashAttention-2 rates, read back as docs/efficiency.md prints
them; and the price of a flash op with and without a GPU's table."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from job.layout import Layout
from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from precision.policy import policy
from simulator.costs.rates.attention_rates import parse_attention_efficiency
from simulator.costs.compute import kernel_overhead, op_time
from simulator.costs.hardware import load_hardware
from simulator.costs.op_types import FusedAttention
from simulator.costs.ops import Implementation, block_ops

ROOT = Path(__file__).resolve().parents[1]
PRESETS = json.loads((ROOT / "simulator" / "costs" / "hardware.json").read_text(encoding="utf-8"))["gpus"]
EFFICIENCY_DOC = (ROOT / "docs" / "efficiency.md").read_text(encoding="utf-8")
SEQUENCES = (512, 1024, 2048, 4096, 8192, 16384)


def flash_ops(s: int, heads: int = 4, head_dim: int = 16, b: int = 3,
              precision: str = "bf16") -> tuple[FusedAttention, FusedAttention]:
    model = GPTConfig(vocab_size=64, seq_len=s, n_layers=1, n_heads=heads, d_model=heads * head_dim, d_ff=128)
    ops = block_ops(model, b, Layout(), policy(precision), Implementation("flash"))
    forward = next(op for op in ops.forward if isinstance(op, FusedAttention))
    backward = next(op for op in ops.backward if isinstance(op, FusedAttention))
    return forward, backward


@pytest.mark.parametrize("s", [1, 2, 7, 64])
def test_a_causal_ops_flops_are_the_products_the_mask_keeps(s):
    heads, head_dim, b = 4, 16, 3
    forward, backward = flash_ops(s, heads, head_dim, b)
    kept = sum(1 for query in range(s) for key in range(s) if key <= query)  # query i sees keys 0..i
    per_gemm = 2 * head_dim * kept * b * heads  # one multiply-add of head_dim products per kept pair
    assert forward.flops == len(forward.gemms) * per_gemm == 2 * per_gemm  # the scores and the values
    assert backward.flops == 5 * per_gemm  # the recomputed scores and four gradient GEMMs
    assert forward.square_flops == 2 * 2 * head_dim * s * s * b * heads  # what unfused attention computes
    assert forward.benchmark_flops == forward.square_flops // 2  # the kernels' benchmark convention


def test_the_unfused_attention_computes_the_whole_square():
    model = GPTConfig(vocab_size=64, seq_len=32, n_layers=1, n_heads=4, d_model=64, d_ff=128)
    ops = block_ops(model, 2, Layout(), policy("bf16"), Implementation("unfused"))
    assert not any(isinstance(op, FusedAttention) for op in ops.forward + ops.backward)
    assert ops.flops == ops.model_flops


def doc_row(presets: str, head_dim: int) -> list[tuple[int, float]]:
    """docs/efficiency.md's row: (TFLOP/s, fraction) at 512 ... 16K."""
    line = next(line for line in EFFICIENCY_DOC.splitlines() if line.startswith(f"| {presets} | {head_dim} |"))
    return [(int(tf), float(fr)) for tf, fr in re.findall(r"(\d+) \(([\d.]+)\)", line)]


@pytest.mark.parametrize("gpu,row", [("a100-40gb", "a100-40gb, a100-80gb"), ("a100-80gb", "a100-40gb, a100-80gb"),
                                     ("h100-sxm", "h100-sxm, h200"), ("h200", "h100-sxm, h200")])
def test_every_preset_gpu_carries_the_published_table_docs_print(gpu, row):
    entry = PRESETS[gpu]["attention_efficiency"]
    assert entry["kernel"] == "FlashAttention-2" and "flash2_" in entry["source"] and "docs/efficiency.md" in entry["source"]
    peak = PRESETS[gpu]["peak_flops"]["bf16"]
    for head_dim in (64, 128):
        printed = doc_row(row, head_dim)
        assert [s for s, _ in entry["causal"][str(head_dim)]] == list(SEQUENCES)
        for (tflops, fraction), (_, value) in zip(printed, entry["causal"][str(head_dim)]):
            assert value == fraction == round(tflops * 1e12 / peak, 4)
            assert str(tflops) in entry["source"]  # the figure's numbers, as the JSON's source quotes them


def test_the_rate_is_the_published_one_at_its_points_and_interpolated_between():
    table = load_hardware("a100-80gb").gpu.attention_efficiency
    assert table.fraction(128, 2048) == 0.4968 and table.fraction(64, 4096) == 0.5
    between = table.fraction(128, round(2048 * math.sqrt(2)))  # halfway in log2(s)
    assert between == pytest.approx((0.4968 + 0.5545) / 2, abs=1e-4)
    assert table.fraction(96, 2048) == pytest.approx((0.4487 + 0.4968) / 2)  # halfway between the head sizes
    assert table.fraction(128, 128) == 0.3173 and table.fraction(128, 1 << 20) == 0.6058  # held outside
    assert table.fraction(256, 2048) == 0.4968 and table.fraction(32, 2048) == 0.4487


def test_a_flash_op_is_priced_at_the_kernels_rate_or_at_the_gemms_for_the_kept_share():
    forward, backward = flash_ops(4096, heads=8, head_dim=128, b=1)
    gpu = load_hardware("h100-sxm").gpu
    for op in (forward, backward):
        expected = op.benchmark_flops / (989.4e12 * 0.843 * 0.2971)  # the kernel's burst share, held at 0.843
        assert op_time(op, gpu) == pytest.approx(expected + kernel_overhead(gpu))
    plain = dataclasses.replace(gpu, attention_efficiency=None)  # no table: the GEMMs' efficiency, kept share
    whole = dataclasses.replace(forward, causal_seq=0)
    assert op_time(forward, plain) - kernel_overhead(plain) == pytest.approx(
        (op_time(whole, plain) - kernel_overhead(plain)) * 4097 / 8192)
    fp32, _ = flash_ops(4096, heads=8, head_dim=128, b=1, precision="fp32")  # the 16-bit kernels' share of the
    assert fp32.gemms[0].dtype == "fp32"                                         # fp32 peak
    assert op_time(fp32, gpu) == pytest.approx(fp32.benchmark_flops / (67e12 * 0.2971) + kernel_overhead(gpu))


def test_bad_tables_are_refused_in_one_line():
    good = {"kernel": "FlashAttention-2", "source": "a figure", "causal": {"64": [[512, 0.3], [1024, 0.4]]}}
    assert parse_attention_efficiency(good, "gpu").fraction(64, 512) == 0.3
    for bad in ({**good, "extra": 1}, {**good, "source": " "}, {**good, "causal": {}},
                {**good, "causal": {"x": [[512, 0.3]]}}, {**good, "causal": {"64": [[1024, 0.3], [512, 0.4]]}},
                {**good, "causal": {"64": [[512, 1.5]]}}, {**good, "causal": {"64": [[512.5, 0.3]]}}, []):
        with pytest.raises(ConfigError, match="attention_efficiency"):
            parse_attention_efficiency(bad, "gpu")


def test_the_table_survives_a_profile_round_trip(tmp_path):
    from simulator.costs.hardware import save_hardware

    hardware = load_hardware("h200")
    again = load_hardware(str(save_hardware(hardware, tmp_path / "h200.json")))
    assert again.gpu.attention_efficiency == hardware.gpu.attention_efficiency is not None


def brute_band(s: int, window: int, cp: int) -> float:
    """The busiest context-parallel rank's share of its (s/cp) x s square that a sliding window keeps, counted pair
    by pair over its load-balanced chunks."""
    from parallel.context.chunks import positions

    shares = []
    for rank in range(cp):
        rows = positions(rank, cp, s).tolist() if cp > 1 else range(s)
        shares.append(sum(1 for i in rows for j in range(s) if 0 <= i - j < window) / (len(rows) * s))
    return max(shares)


@pytest.mark.parametrize("s, window, cp", [(64, 5, 1), (64, 64, 1), (64, 100, 1), (64, 5, 2), (64, 12, 2),
                                           (64, 20, 4), (96, 7, 4), (128, 40, 8)])
def test_a_sliding_windows_share_is_the_pairs_it_keeps(s, window, cp):
    from simulator.costs.layers.attention import window_share

    assert window_share(s, window, cp) == pytest.approx(brute_band(s, window, cp), rel=1e-12)


def test_a_sliding_window_is_the_band_a_kernel_computes():
    """Llama 3 8B at 32K tokens through a window of 4,096: the fused attention keeps sum_i min(i + 1, w) products,
    read at the causal table's 2 w; the model's FLOPs count the s x w band; unfused attention and the stacks whose
    context parallelism has no window are refused."""
    from minigpt.presets import preset
    from simulator.costs.op_types import unit_shape

    BF16 = BF16_POLICY = policy("bf16")
    model = preset("llama3-8b").with_(seq_len=32768, window=4096)
    layout, impl = Layout(), Implementation("flash", "none")
    flash = next(op for op in block_ops(model, 1, layout, BF16, impl).forward if isinstance(op, FusedAttention))
    s, w = 32768, 4096
    kept = w * (w + 1) // 2 + (s - w) * w
    assert flash.flops == pytest.approx(flash.square_flops * kept / s ** 2, rel=1e-9)
    assert flash.efficiency_seq == 2 * w and flash.benchmark_flops == flash.flops
    assert flash.square_flops * w // s == flash.model_square
    full = next(op for op in block_ops(model.with_(window=0), 1, layout, BF16, impl).forward
                if isinstance(op, FusedAttention))
    assert flash.flops < full.flops / 4  # the band keeps 23% of the causal triangle's products
    for bad_impl, bad_layout, word in ((Implementation("unfused", "none"), layout, "fused attention"),
                                       (Implementation("flash", "none", cp_attention="torch"), Layout(cp=2),
                                        "context_parallel")):
        with pytest.raises(ConfigError, match=word):
            unit_shape(model, 1, bad_layout, BF16_POLICY, bad_impl)
