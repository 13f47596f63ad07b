"""Multi-head latent attention in the simulator (simulator/costs/layers/latent.py): the tensors its ops save are the
trainer's count (minigpt/config.py's, itself checked against torch's saved tensors in tests/test_config.py), its
GEMMs have the shapes minigpt/model.py's LatentAttention multiplies on a tensor-parallel rank, its FLOPs are the
model's, and the zero-padded values cost what they cost where the kernel needs them (FlashAttention-2) and nothing
where it does not (cuDNN's fused attention, as Transformer Engine runs MLA)."""

from __future__ import annotations

import pytest

from job.layout import Layout
from minigpt.presets import preset
from precision.policy import policy
from simulator.costs.op_types import FusedAttention, Gemm, Implementation, model_flops
from simulator.costs.ops import block_ops
from simulator.memory import check_activations_against_config, predict_memory

MODEL = preset("tiny-deepseek")  # query latent 64, kv latent 32, 4 heads of 32 + 16 rotated, values 32
SHAPES = {
    "tiny-deepseek": MODEL,
    "no-query-latent": MODEL.with_(q_lora_rank=0, d_value=24),
    "values-as-wide-as-queries": MODEL.with_(d_value=48),
    "deepseek-v3": preset("deepseek-v3").with_(seq_len=256),
}


@pytest.mark.parametrize("name", SHAPES)
def test_saved_tensors_are_the_trainers_count(name):
    """Dense and MoE blocks, every recompute mode, fp32 and bf16: check_activations_against_config raises on any
    difference between the ops' saved tensors and minigpt/config.py's activation bytes."""
    for precision in ("fp32", "bf16"):
        check_activations_against_config(SHAPES[name], policy(precision))


def gemms(ops) -> dict[str, Gemm]:
    return {op.name: op for op in ops.forward if isinstance(op, Gemm)}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gemm_shapes_on_a_tensor_parallel_rank(sequence_parallel):
    """tp 2: the down projection whole over this rank's residual rows (1/2 of them under sequence parallelism), the
    up projections over every row for this rank's 2 heads, proj over those heads' values."""
    b, s, d, heads = 2, MODEL.seq_len, MODEL.d_model, MODEL.n_heads // 2
    found = gemms(block_ops(MODEL, b, Layout(tp=2, sequence_parallel=sequence_parallel), policy("bf16"),
                            moe=False))
    rows = b * s
    local = rows // 2 if sequence_parallel else rows
    assert (found["down"].m, found["down"].n, found["down"].k) == (local, 64 + 32 + 16, d)
    assert (found["q_up"].m, found["q_up"].n, found["q_up"].k) == (rows, heads * 48, 64)
    assert (found["kv_up"].m, found["kv_up"].n, found["kv_up"].k) == (rows, heads * (32 + 32), 32)
    assert (found["proj"].m, found["proj"].n, found["proj"].k) == (rows, d, heads * 32)
    assert "qkv" not in found


def test_flops_are_the_models_and_padding_costs_where_the_kernel_needs_it():
    """Forward matmul FLOPs (the attention over the whole square, config.py's convention) are the model's under
    either kernel; under FlashAttention-2 the kernel computes the values' product at the query's width, 48 columns
    for 32, and the padded columns' products are its own (priced, not counted as the model's)."""
    tokens, layout, bf16 = MODEL.seq_len, Layout(), policy("bf16")
    cudnn = block_ops(MODEL, 1, layout, bf16, Implementation(attention_kernel="cudnn"), moe=False)
    flash = block_ops(MODEL, 1, layout, bf16, Implementation(), moe=False)
    model = MODEL.block_forward_flops_per_token(moe=False) * tokens
    assert sum(model_flops(op) for op in cudnn.forward) == sum(model_flops(op) for op in flash.forward) == model
    padding = 2 * MODEL.seq_len * MODEL.n_heads * (MODEL.qk_head_dim - MODEL.v_head_dim) * tokens
    attention = next(op for op in flash.forward if isinstance(op, FusedAttention))
    assert attention.padded_flops == padding and attention.square_flops == model_flops(attention) + padding
    assert [(g.m, g.n, g.k) for g in attention.gemms] == [(tokens, tokens, 48), (tokens, 48, tokens)]
    backward = next(op for op in flash.backward if isinstance(op, FusedAttention))
    assert backward.padded_flops == 2 * padding
    # saved: the padded values and the padded output, 4 heads x 48 columns each per token, under FlashAttention-2
    assert flash.saved_bytes - cudnn.saved_bytes == 2 * MODEL.n_heads * MODEL.qk_head_dim * tokens * 2
    assert {op.name for op in flash.forward} - {op.name for op in cudnn.forward} == {"attention.pad_values",
                                                                                     "attention.cut_output"}


def test_deepseek_v3_attention_is_latent():
    """DeepSeek-V3's preset now carries MLA: per token and layer 2 (s x 128 x (192 + 128)) attention FLOPs forward
    (the 128-head attention of width 7,168 it approximated had 2 (s x 128 x 112)), and its projections' 187.1M
    weights."""
    deepseek = preset("deepseek-v3")
    assert deepseek.is_mla and deepseek.qkv_width == 128 * (192 + 192 + 128)
    assert deepseek.attention_core_flops_per_token() == 2 * 4096 * 128 * (192 + 128)
    estimate = predict_memory(deepseek, Layout(tp=2, pp=16, dp=32, ep=64, sequence_parallel=True), "bf16", 1,
                              recompute="full")
    assert estimate.total > 0
