"""Megatron's fused bias kernels (Implementation.bias_fusion, simulator/costs/ops.py): fc1's bias inside its
activation, proj's and fc2's bias with the dropout and the residual add in one kernel (bias_dropout_add_fused_train,
Megatron-LM's defaults), and under Transformer Engine qkv's bias in its GEMMs' epilogues; the same tensors saved."""

from dataclasses import replace

import pytest

from job.layout import Layout
from minigpt.presets import build_config, preset
from precision.policy import policy
from simulator.costs.compute import op_time
from simulator.costs.hardware import load_hardware
from simulator.costs.op_types import Implementation, MemoryOp
from simulator.costs.ops import block_ops
from simulator.engine.overlap import stack_implementation

GPT = replace(preset("gpt3-175b"), dropout=0.1)  # biases and dropout, as the published GPT-3 runs
A100 = load_hardware("a100-80gb").gpu
LAYOUTS = (Layout(tp=8), Layout(tp=4, sequence_parallel=True))


def ops_of(fusion, layout=Layout(tp=8), model=GPT):
    return block_ops(model, 1, layout, policy("bf16"), Implementation(bias_fusion=fusion))


def names(ops):
    return [op.name for op in (*ops.forward, *ops.backward)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_fusion_removes_the_kernels_it_fuses(layout):
    none, megatron, te = (names(ops_of(f, layout)) for f in ("none", "megatron", "te"))
    fused = {"fc1.bias_add", "proj.bias_add", "fc2.bias_add", "attention.residual_dropout", "attention.residual_add",
             "mlp.residual_dropout", "mlp.residual_add"}
    assert fused <= set(none) and not fused & set(megatron) and not fused & set(te)
    joins = {"attention.bias_dropout_add", "mlp.bias_dropout_add"}
    assert joins <= set(megatron) and joins <= set(te) and not joins & set(none)
    assert "qkv.bias_add" in megatron and "qkv.bias_add" not in te  # Transformer Engine: in qkv's GEMM epilogue
    assert "qkv.bias_grad" in megatron and "qkv.bias_grad" not in te  # and its gradient in the wgrad GEMM's
    for kept in ("fc1.bias_grad", "proj.bias_grad", "fc2.bias_grad", "gelu_backward", "mlp.residual_dropout_backward"):
        assert kept in none and kept in megatron and kept in te  # their backwards stay kernels of their own


@pytest.mark.parametrize("fusion", ["none", "megatron"])
def test_qwen2s_qkv_bias_is_the_only_bias_kernel(fusion):
    """--no-bias --qkv-bias (Qwen2): qkv's bias add and its gradient, and no other Linear's."""
    qwen2 = replace(preset("llama3-8b"), bias=False, qkv_bias=True)
    def bias_kernels(model):
        return [name for name in names(ops_of(fusion, Layout(tp=2), model)) if name.endswith((".bias_add", ".bias_grad"))]
    assert bias_kernels(qwen2) == ["qkv.bias_add", "qkv.bias_grad"]
    assert bias_kernels(preset("llama3-8b")) == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_join_reads_the_stream_the_branch_and_the_bias_and_writes_the_sum_and_the_mask(layout):
    ops = ops_of("megatron", layout)
    join = next(op for op in ops.forward if op.name == "attention.bias_dropout_add")
    rows = 2048 // layout.tp if layout.sequence_parallel else 2048
    n = rows * GPT.d_model
    assert (join.read, join.written) == (2 * n * 2 + GPT.d_model * 2, n * 2 + n)  # bf16 stream and branch, 1-byte mask


def test_the_same_tensors_are_saved_and_the_fused_block_is_faster():
    saved = {f: sum(s.bytes for s in ops_of(f).saved) for f in ("none", "megatron", "te")}
    assert saved["none"] == saved["megatron"] == saved["te"]
    seconds = {f: sum(op_time(op, A100, A100.matmul_efficiency) for op in (*o.forward, *o.backward))
               for f, o in ((f, ops_of(f)) for f in ("none", "megatron", "te"))}
    assert seconds["te"] < seconds["megatron"] < seconds["none"]
    forward = [op for op in ops_of("none").forward if isinstance(op, MemoryOp)]
    moved = sum(op.bytes for op in forward) - sum(op.bytes for op in ops_of("megatron").forward
                                                  if isinstance(op, MemoryOp))
    n = 2048 * GPT.d_model * 2  # one bf16 residual-stream tensor
    ffn = 2048 * (GPT.d_ff // 8) * 2  # fc1's output on a rank
    # a join moved the branch through 3 kernels (bias add, dropout, add: 7 passes and the mask), now 1 (3 passes and
    # the mask, the bias read once either way); fc1's bias add (2 passes over its output, its bias) is gone
    assert moved == 2 * 4 * n + 2 * ffn + (GPT.d_ff // 8) * 2


def test_without_bias_or_dropout_nothing_changes_but_the_names():
    llama = build_config("llama3-8b", seq_len=4096)
    times = {f: sum(op_time(op, A100, A100.matmul_efficiency) for op in (*o.forward, *o.backward))
             for f, o in ((f, ops_of(f, Layout(tp=2), llama)) for f in ("none", "megatron", "te"))}
    assert times["none"] == pytest.approx(times["megatron"]) == pytest.approx(times["te"])


def test_the_megatron_stacks_fuse_and_the_others_do_not():
    assert stack_implementation("megatron-2021")["bias_fusion"] == "megatron"
    assert stack_implementation("megatron-core")["bias_fusion"] == "te"
    assert {stack_implementation(name)["bias_fusion"] for name in ("executor", "overlapped", "torchtitan-fsdp2")} == {
        "none"}
    with pytest.raises(Exception, match="bias_fusion"):
        Implementation(bias_fusion="magic")
