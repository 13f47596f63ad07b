"""fp8 routed experts (Implementation.fp8_experts, simulator/costs/layers/moe.py): Megatron-core's grouped experts run
in fp8 under an fp8 job (Transformer Engine's GroupedLinear), with their casts, e4m3 copies and amaxes; our executor
keeps them 16-bit (minigpt/moe.py)."""

from dataclasses import replace

import pytest

from job.layout import Layout
from minigpt.presets import preset
from precision.policy import policy
from simulator.costs.compute import chunk_times, op_time
from simulator.costs.hardware import load_hardware
from simulator.costs.op_types import Gemm, Implementation
from simulator.costs.ops import block_ops
from simulator.engine.overlap import stack_implementation

FP8, BF16 = policy("fp8"), policy("bf16")
MIXTRAL = preset("mixtral-8x7b")
CORE = Implementation(**stack_implementation("megatron-core"))
H100 = load_hardware("h100-sxm").gpu
EXPERT_GEMMS = ("experts.fc1", "experts.fc2", "experts.fc1.input_grad", "experts.fc2.input_grad",
                "experts.fc1.weight_grad", "experts.fc2.weight_grad")


def gemms(ops):
    return {op.name: op for op in (*ops.forward, *ops.backward) if isinstance(op, Gemm)}


def test_the_stack_runs_its_experts_in_fp8_and_our_executor_does_not():
    assert CORE.fp8_experts and not Implementation().fp8_experts
    assert not stack_implementation("torchtitan-fsdp2")["fp8_experts"]
    fp8 = gemms(block_ops(MIXTRAL, 1, Layout(), FP8, CORE, moe=True))
    assert {fp8[name].dtype for name in EXPERT_GEMMS} == {"fp8"}
    assert fp8["router"].dtype == "bf16"  # the router stays 16-bit
    for pol, impl in ((FP8, replace(CORE, fp8_experts=False)), (BF16, CORE)):
        plain = gemms(block_ops(MIXTRAL, 1, Layout(), pol, impl, moe=True))
        assert {plain[name].dtype for name in EXPERT_GEMMS} == {"bf16"}


def test_the_experts_casts_and_what_they_keep():
    rows = MIXTRAL.top_k * MIXTRAL.seq_len  # one sequence, every expert on this rank, balanced
    d, width_in, width = MIXTRAL.d_model, MIXTRAL.expert_in_width, MIXTRAL.expert_width
    experts = MIXTRAL.n_experts
    ops = block_ops(MIXTRAL, 1, Layout(), FP8, CORE, moe=True)
    forward = {op.name: op for op in ops.forward}
    backward = {op.name: op for op in ops.backward}
    # Transformer Engine's cast: read the 16-bit rows once, write the row-wise and the transposed e4m3 copies
    assert (forward["experts.fc1.cast_input"].read, forward["experts.fc1.cast_input"].written) == (
        rows * d * 2, 2 * rows * d)
    assert forward["experts.fc2.cast_input"].read == rows * width * 2
    # the weights cast once a step (Megatron-core's is_first_microbatch), all local experts' in one grouped cast
    per_step = {op.name: op for op in ops.per_step}
    assert per_step["experts.fc1.cast_weight"].read == experts * width_in * d * 2
    assert per_step["experts.fc2.cast_weight"].written == 2 * experts * d * width
    # the output gradients cast to e5m2 in both layouts before the input- and weight-gradient GEMMs
    assert backward["experts.fc2.cast_grad"].written == 2 * rows * d
    assert backward["experts.fc1.cast_grad"].written == 2 * rows * width_in
    saved = {t.name: t.bytes for t in ops.saved}
    assert saved["experts.fc1.input_fp8"] == rows * d and saved["experts.fc2.input_fp8"] == rows * width
    assert "experts.input" not in saved  # the 16-bit rows are not what the fp8 GEMM keeps
    plain = {t.name for t in block_ops(MIXTRAL, 1, Layout(), FP8, replace(CORE, fp8_experts=False), moe=True).saved}
    assert "experts.input" in plain and "experts.fc1.input_fp8" not in plain
    assert {t.name for t in ops.workspace} >= {"experts.fc1.weight_fp8", "experts.fc2.weight_fp8"}


def test_fp8_experts_are_faster_and_reduce_their_amaxes():
    layout = Layout(tp=1)
    fp8 = chunk_times(MIXTRAL, 1, 1, layout, H100, "fp8", implementation=CORE, moe_layers=1)
    plain = chunk_times(MIXTRAL, 1, 1, layout, H100, "fp8", implementation=replace(CORE, fp8_experts=False),
                        moe_layers=1)
    ops = block_ops(MIXTRAL, 1, layout, FP8, CORE, moe=True)
    gemm_s = sum(op_time(op, H100) for op in (*ops.forward, *ops.backward)
                 if isinstance(op, Gemm) and op.name in EXPERT_GEMMS)
    plain_ops = block_ops(MIXTRAL, 1, layout, FP8, replace(CORE, fp8_experts=False), moe=True)
    plain_s = sum(op_time(op, H100) for op in (*plain_ops.forward, *plain_ops.backward)
                  if isinstance(op, Gemm) and op.name in EXPERT_GEMMS)
    assert gemm_s < 0.75 * plain_s  # Mixtral's experts are big GEMMs: fp8's rate shows
    assert fp8.forward_s + fp8.backward_s < plain.forward_s + plain.backward_s
    # the grouped GEMMs' amaxes join the chunk's delayed-scaling reduction: one per local expert and GEMM
    assert fp8.fp8_gemms == plain.fp8_gemms + 2 * MIXTRAL.n_experts


@pytest.mark.parametrize("scaling", ["current", "block"])
def test_the_recipes_reach_the_experts(scaling):
    ops = block_ops(MIXTRAL, 1, Layout(), FP8, replace(CORE, fp8_scaling=scaling), moe=True)
    forward = {op.name: op for op in ops.forward}
    rows, d = MIXTRAL.top_k * MIXTRAL.seq_len, MIXTRAL.d_model
    if scaling == "current":  # the rows' amax read first, then the cast
        assert forward["experts.fc1.amax_input"].read == rows * d * 2
    else:  # MXFP8: a scale byte per 32 elements in each copy
        assert forward["experts.fc1.cast_input"].written == 2 * (rows * d + rows * d // 32)
