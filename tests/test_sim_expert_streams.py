"""Transformer Engine's GroupedLinear as Megatron-core runs its experts (Implementation.expert_gemms "te-streams"): a
cuBLAS GEMM per local expert, round robin on TE's 4 compute streams (multi_stream_cublas_gemm), priced round by round
with each round's GEMMs sharing the SMs; our executor's and torchtitan's experts stay one grouped kernel."""

from dataclasses import replace

import pytest

from job.layout import Layout
from minigpt.presets import preset
from precision.policy import policy
from simulator.costs.compute import gemm_efficiency, kernel_overhead, op_time, tensor_peak
from simulator.costs.hardware import load_hardware
from simulator.costs.op_types import Gemm, Implementation
from simulator.costs.ops import block_ops
from simulator.engine.overlap import stack_implementation

QWEN = preset("qwen3-30b-a3b")
H100 = load_hardware("h100-sxm").gpu
CORE = Implementation(**stack_implementation("megatron-core"))
EXPERT_GEMMS = ("experts.fc1", "experts.fc2", "experts.fc1.input_grad", "experts.fc2.input_grad",
                "experts.fc1.weight_grad", "experts.fc2.weight_grad")


def expert_gemms(ops):
    return {op.name: op for op in (*ops.forward, *ops.backward) if isinstance(op, Gemm) and op.name in EXPERT_GEMMS}


@pytest.mark.parametrize("batch, rounds", [(1, [1]), (4, [4]), (8, [4, 4]), (10, [4, 4, 2])])
def test_a_batch_on_four_streams_runs_four_at_a_time(batch, rounds):
    one = Gemm("experts.fc1", 4096, 1536, 2048, "bf16", batch, streams=4)
    assert one.rounds == rounds and one.launches == len(rounds)
    assert Gemm("experts.fc1", 4096, 1536, 2048, "bf16", batch).rounds == [batch]  # grouped: one kernel


def test_each_round_is_priced_as_its_gemms_sharing_the_sms():
    profile = H100.matmul_efficiency
    gemm = Gemm("experts.fc2", 4096, 2048, 768, "bf16", 10, streams=4)
    peak, flops = tensor_peak(H100, "bf16"), 2 * 4096 * 2048 * 768
    rounds = sum(flops * b / (peak * gemm_efficiency(4096, 2048, 768, "bf16", H100, profile, b)) for b in (4, 4, 2))
    assert op_time(gemm, H100, profile) == pytest.approx(rounds + 3 * kernel_overhead(H100, profile))
    grouped = replace(gemm, streams=0)
    assert op_time(grouped, H100, profile) < op_time(gemm, H100, profile)  # one set of waves over all ten


def test_the_megatron_core_stack_runs_a_gemm_per_expert_and_the_others_one_kernel():
    assert CORE.expert_gemms == "te-streams" and Implementation().expert_gemms == "grouped"
    assert stack_implementation("torchtitan-fsdp2")["expert_gemms"] == "grouped"
    layout = Layout(dp=16, ep=16)  # 128 experts over 16 ranks: 8 local ones
    core = expert_gemms(block_ops(QWEN, 1, layout, policy("bf16"), CORE, moe=True))
    ours = expert_gemms(block_ops(QWEN, 1, layout, policy("bf16"), replace(CORE, expert_gemms="grouped"), moe=True))
    assert set(core) == set(EXPERT_GEMMS) and {op.streams for op in core.values()} == {4}
    assert {op.streams for op in ours.values()} == {0} and {op.batch for op in core.values()} == {8}
    for name in EXPERT_GEMMS:  # the same work and bytes, in two rounds of four kernels
        assert (core[name].flops, core[name].bytes) == (ours[name].flops, ours[name].bytes)
        assert op_time(core[name], H100, H100.matmul_efficiency) > op_time(ours[name], H100, H100.matmul_efficiency)


def test_one_local_expert_is_priced_alike_either_way():
    layout = Layout(dp=128, ep=128)  # one expert a rank
    core = expert_gemms(block_ops(QWEN, 1, layout, policy("bf16"), CORE, moe=True))
    ours = expert_gemms(block_ops(QWEN, 1, layout, policy("bf16"), replace(CORE, expert_gemms="grouped"), moe=True))
    for name in EXPERT_GEMMS:
        assert op_time(core[name], H100, H100.matmul_efficiency) == op_time(ours[name], H100, H100.matmul_efficiency)


def test_an_unknown_way_is_refused():
    with pytest.raises(Exception, match="expert_gemms"):
        Implementation(expert_gemms="magic")
