"""fp8 Linears in the op list (simulator/costs/ops.py) as they run: our executor's per-tensor quantisation
(precision/fp8.py) by default, Transformer Engine's fused casts, weights cast once a step and kept (Megatron-core's
is_first_microbatch), MXFP8 block scaling and the weight-gradient GEMM fused into the fp32 main gradient."""

import pytest
import torch

from job.layout import Layout
from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from precision.fp8 import Fp8Linear
from precision.policy import policy
from simulator.costs.compute import chunk_times
from simulator.costs.hardware import load_hardware
from simulator.costs.op_types import Gemm, Implementation, MemoryOp
from simulator.costs.ops import TORCH_QUANTIZE, block_ops, head_ops
from simulator.memory import predict_memory
from simulator.provenance import summary_rows

FP8, BF16 = policy("fp8"), policy("bf16")
MODEL = GPTConfig(vocab_size=512, seq_len=128, n_layers=4, n_heads=8, d_model=256, d_ff=1024)
TE = Implementation(fp8_weight_cache=True, fp8_fused_casts=True)  # Transformer Engine under Megatron-core
H100 = load_hardware("h100-sxm").gpu
LINEARS = ("qkv", "proj", "fc1", "fc2")


def ops_named(ops, phase_ops):
    return {op.name: op for op in phase_ops}


def block_linear_params(model: GPTConfig, tp: int = 1) -> int:
    d, f = model.d_model, model.d_ff
    return (3 * d * d + d * d + 2 * d * f) // tp


def test_the_defaults_are_our_executor_which_saves_a_fresh_e4m3_weight_in_every_forward():
    """precision/fp8.py's Fp8LinearFunction saves, per call, the e4m3 input and a newly cast e4m3 weight: what the
    op list's defaults keep per micro-batch for each Linear (qkv: d -> 3d)."""
    impl = Implementation()
    assert (impl.fp8_weight_cache, impl.fp8_fused_casts, impl.fp8_scaling, impl.wgrad_fusion) == (False, False,
                                                                                                  "tensor", False)
    d, rows = MODEL.d_model, 2 * MODEL.seq_len
    layer = Fp8Linear.from_linear(torch.nn.Linear(d, 3 * d, dtype=torch.bfloat16))
    saved = []

    def pack(tensor):
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            saved.append((tensor.data_ptr(), tensor.numel() * tensor.element_size()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        # two micro-batches, both outputs (and so both graphs' saved tensors) alive, as before their backwards
        outputs = [layer(torch.randn(rows, d, dtype=torch.bfloat16, requires_grad=True)) for _ in range(2)]
    (x1, w1), (x2, w2) = saved[:2], saved[2:]
    assert len(outputs) == 2 and w1[0] != w2[0]  # a new weight copy in each forward, each kept for its backward
    sizes = {t.name: t.bytes for t in block_ops(MODEL, 2, Layout(), FP8).saved}
    assert (x1[1], w1[1]) == (sizes["qkv.input_fp8"], sizes["qkv.weight_fp8"])


def test_our_executors_quantisation_is_six_torch_kernels_through_fp32():
    ops = block_ops(MODEL, 2, Layout(), FP8)
    forward = ops_named(ops, ops.forward)
    rows, d = 2 * MODEL.seq_len, MODEL.d_model
    chain = [forward[f"qkv.cast_input.{kernel}"] for kernel, _, _ in TORCH_QUANTIZE]
    assert sum(op.bytes for op in chain) == rows * d * (2 + 4 + 8 + 4 + 8 + 8 + 5)  # 39 bytes per element from bf16
    assert "qkv.cast_weight.cast" in forward and not any(name.endswith("transpose_input") for name in forward)
    backward = [op.name for op in ops.backward]
    for name in LINEARS:  # _scaled_mm's layouts: the weight, the gradient and the input transposed in the backward
        assert {f"{name}.transpose_weight", f"{name}.transpose_grad", f"{name}.transpose_input"} <= set(backward)


def test_transformer_engines_casts_are_fused_and_its_layernorm_writes_the_e4m3_input():
    ops = block_ops(MODEL, 2, Layout(), FP8, TE)
    forward = ops_named(ops, ops.forward)
    rows, d, e = 2 * MODEL.seq_len, MODEL.d_model, 2
    assert forward["ln1"].written == rows * d * 1 + rows * 2 * 4  # e4m3 output and the fp32 statistics
    assert "qkv.cast_input" not in forward and forward["qkv.transpose_input"].bytes == 2 * rows * d
    proj = forward["proj.cast_input"]  # cast + transpose in one pass, the amax in it too
    assert (proj.read, proj.written) == (rows * d * e, 2 * rows * d)
    assert not any(op.name.endswith(("transpose_weight", "transpose_grad")) for op in ops.backward)
    memory_bound = sum(op.bytes for op in ops.forward + ops.backward + ops.per_step if isinstance(op, MemoryOp))
    ours = block_ops(MODEL, 2, Layout(), FP8)
    assert memory_bound < 0.6 * sum(op.bytes for op in ours.forward + ours.backward if isinstance(op, MemoryOp))


def test_cached_fp8_weights_are_a_workspace_held_once_not_saved_per_micro_batch():
    """The issue's 68.5 GiB against 36.7 GiB: nothing is saved twice; every micro-batch in flight keeps its own
    e4m3 weight copy, as precision/fp8.py does. Transformer Engine with is_first_microbatch keeps one copy per
    layer (and its transpose) for the whole step: the per-micro-batch activations then fall below bf16's."""
    per_mb = {impl: block_ops(MODEL, 1, Layout(), FP8, impl) for impl in (Implementation(), TE)}
    plain = block_ops(MODEL, 1, Layout(), BF16)
    params = block_linear_params(MODEL)
    ours, te = per_mb[Implementation()], per_mb[TE]
    assert sum(t.bytes for t in ours.saved if t.name.endswith(".weight_fp8")) == params
    assert not any(t.name.endswith(".weight_fp8") for t in te.saved)
    assert te.workspace_bytes == 2 * params and ours.workspace_bytes == 0
    assert te.saved_bytes < plain.saved_bytes < ours.saved_bytes
    for impl in (Implementation(recompute="full"), Implementation("flash", "full", fp8_weight_cache=True)):
        full = block_ops(MODEL, 1, Layout(), FP8, impl)  # recomputed with the block: only its input is kept
        assert [t.name for t in full.saved] == ["x"]
        assert full.workspace_bytes == (params if impl.fp8_weight_cache else 0)  # one torch copy per weight
    big = GPTConfig(vocab_size=50257, seq_len=2048, n_layers=96, n_heads=96, d_model=12288, d_ff=49152)
    layout = Layout(tp=4, pp=8, dp=4, zero=1, sequence_parallel=True, virtual_chunks=12)
    in_flight = [20] * 8
    estimate = {name: predict_memory(big, layout, precision, 1, micro_batches_in_flight=in_flight, implementation=impl)
                for name, precision, impl in (("bf16", "bf16", None), ("ours", "fp8", None), ("te", "fp8", TE))}
    workspace = block_ops(big, 1, layout, FP8, TE).workspace_bytes
    assert workspace == 2 * block_linear_params(big, 4)
    first = {name: e.per_stage[0].activations for name, e in estimate.items()}  # one layer per chunk, 12 per rank
    per_micro_batch = first["te"] - 12 * workspace
    assert per_micro_batch < first["bf16"] < first["ours"]
    copies = block_linear_params(big, 4)  # one e4m3 byte per weight, per layer and micro-batch in flight
    assert first["ours"] - per_micro_batch == 20 * copies
    assert any("e4m3 copy" in note for note in estimate["ours"].notes)
    assert any("held once" in note for note in estimate["te"].notes)


def test_cached_weight_casts_run_once_a_step():
    layout = Layout()
    fused = Implementation(fp8_fused_casts=True)
    per_mb, cached = (chunk_times(MODEL, 2, 2, layout, H100, "fp8", profile=H100.matmul_efficiency, implementation=i)
                      for i in (fused, TE))
    assert per_mb.per_step_s == 0 < cached.per_step_s
    assert per_mb.forward_s == pytest.approx(cached.forward_s + cached.per_step_s)  # the same casts, moved
    ops = block_ops(MODEL, 2, layout, FP8, TE)
    assert {op.name for op in ops.per_step} == {f"{name}.cast_weight" for name in LINEARS}
    assert all(op.phase == "step" for op in ops.per_step)


def test_mxfp8_block_scaling_adds_a_scale_byte_per_32_and_needs_fused_casts():
    block = Implementation(fp8_fused_casts=True, fp8_scaling="block")
    rows, d = 2 * MODEL.seq_len, MODEL.d_model
    saved = {t.name: t.bytes for t in block_ops(MODEL, 2, Layout(), FP8, block).saved}
    assert saved["proj.input_fp8"] == rows * d + rows * d // 32
    assert saved["qkv.weight_fp8"] == 2 * (3 * d * d + 3 * d * d // 32)  # row-wise and column-wise, each scaled
    ops = block_ops(MODEL, 2, Layout(), FP8, block)
    forward = ops_named(ops, ops.forward)  # both directions quantised from 16 bits: by the norm before qkv and fc1
    assert "qkv.cast_input" not in forward and "qkv.transpose_input" not in forward
    assert forward["ln1"].written == 2 * (rows * d + rows * d // 32) + rows * 2 * 4
    assert forward["proj.cast_input"].written == 2 * (rows * d + rows * d // 32)
    with pytest.raises(ConfigError, match="block"):
        Implementation(fp8_scaling="block")
    with pytest.raises(ConfigError, match="fp8_scaling"):
        Implementation(fp8_fused_casts=True, fp8_scaling="1x128")
    with pytest.raises(ConfigError, match="fp8_weight_cache"):
        Implementation(fp8_weight_cache="yes")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_wgrad_fusion_accumulates_into_the_fp32_main_gradient_in_the_gemm(precision):
    fused = Implementation(wgrad_fusion=True)
    for build in (block_ops, head_ops):
        plain, merged = (build(MODEL, 2, Layout(), policy(precision), impl) for impl in (Implementation(), fused))
        assert any(op.name.endswith("grad_accumulate") for op in plain.backward)
        assert not any(op.name.endswith("grad_accumulate") for op in merged.backward)
        grads = {op.name: op for op in merged.backward if isinstance(op, Gemm) and op.name.endswith("weight_grad")}
        old = {op.name: op for op in plain.backward if isinstance(op, Gemm) and op.name.endswith("weight_grad")}
        for name, op in grads.items():  # the result read and written in fp32 instead of written in bf16
            assert op.bytes - old[name].bytes == op.m * op.n * (4 + 4 - 2)


def test_the_settings_are_said_with_the_prediction():
    data = {"compute": "x", "matmul_efficiency": {"fp8": {"kind": "GEMM model", "source": "s"}}, "kernel_overhead_s": 0.0,
            "achieved": {"hbm_fraction": 1, "nvlink_fraction": 1, "source": "s"},
            "implementation": TE.as_dict() | {"wgrad_fusion": True, "ub_chunks": True},
            "overlap": {"name": "executor", "tp": False, "dp": "x", "zero3_prefetch": 1, "p2p": False,
                        "param_gather": "none", "tp_slowdown": 0, "dp_slowdown": 0, "p2p_slowdown": 0}}
    row = dict(summary_rows(data))["implementation"]
    assert "fp8 weights cast once a step" in row and "fused fp8 casts" in row and "wgrad fused" in row
    assert "userbuffers' GEMMs in chunks" in row
    assert "fp8" not in dict(summary_rows(data | {"implementation": Implementation().as_dict()}))["implementation"]
    bf16_job = data | {"matmul_efficiency": {"bf16": {"kind": "GEMM model", "source": "s"}}}
    bf16 = dict(summary_rows(bf16_job))["implementation"]
    assert "fp8" not in bf16 and "wgrad fused" in bf16  # a bf16 job is not told the stack's fp8 settings
