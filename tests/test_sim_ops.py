"""simulator/costs/ops.py: the op list holds config.py's FLOPs exactly, and Korthikanti et al. 2022's activation bytes."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from minigpt.config import RECOMPUTE_MODES, GPTConfig
from minigpt.presets import preset
from minigpt.errors import ConfigError
from precision.policy import policy
from job.layout import Layout
from simulator.memory import layer_activation_bytes, predict_memory
from simulator.costs.op_types import FusedAttention, Gemm, MemoryOp, model_flops
from simulator.costs.ops import Implementation, block_ops, embedding_ops, head_ops, op_rows

BF16 = policy("bf16")
# Korthikanti et al.'s shape conventions: MLP width 4h, dropout on (attention and both residual branches).
MODEL = GPTConfig(vocab_size=512, seq_len=128, n_layers=3, n_heads=8, d_model=256, d_ff=1024, dropout=0.1)
TINY_LLAMA, LLAMA3_8B = preset("tiny-llama"), preset("llama3-8b")
# Each Llama option alone on the GPT shape, then the Llama presets with all of them.
SHAPES = {
    "gpt": MODEL,
    "no-bias": MODEL.with_(bias=False),
    "rmsnorm": MODEL.with_(norm="rmsnorm"),
    "swiglu": MODEL.with_(mlp="swiglu", d_ff=704),
    "relu2": MODEL.with_(mlp="relu2"),
    "rope": MODEL.with_(positions="rope"),
    "gqa": MODEL.with_(n_kv_heads=2),
    "tiny-llama": TINY_LLAMA,
    "llama3-8b": LLAMA3_8B,
    "window": MODEL.with_(positions="rope", window=40),  # a sliding window of 40 over 128 tokens: s x w in the FLOPs
}
SHAPES_TP = [(name, tp) for name, model in SHAPES.items() for tp in (1, 2, 4) if model.kv_heads % tp == 0]


def korthikanti(model: GPTConfig, b: int, t: int, sequence_parallel: bool = False, selective: bool = False) -> float:
    """Section 4 of "Reducing Activation Recomputation in Large Transformer Models": bytes per layer."""
    s, h, a = model.seq_len, model.d_model, model.n_heads
    attention = 0 if selective else 5 * a * s / (h * t)
    if sequence_parallel:
        return s * b * h * (34 / t + attention)
    return s * b * h * (10 + 24 / t + attention)


# a sliding window is priced in fused attention only (unfused is refused: test_sim_attention.py)
ATTENTION_SHAPES_TP = [(attention, shape, tp) for attention in ("flash", "unfused") for shape, tp in SHAPES_TP
                       if attention == "flash" or not SHAPES[shape].window]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("attention,shape,tp", ATTENTION_SHAPES_TP)
def test_flops_of_the_op_list_equal_config(recompute, attention, shape, tp):
    model, b = SHAPES[shape], 2
    layout = Layout(tp=tp)
    impl = Implementation(attention, recompute)
    block = block_ops(model, b, layout, BF16, impl)
    per_rank = (model.n_layers * block.model_flops + embedding_ops(model, b, layout, BF16, impl).model_flops
                + head_ops(model, b, layout, BF16, impl).model_flops)
    assert per_rank * tp == model.train_flops_per_token(recompute, attention) * b * model.seq_len
    if attention == "unfused":  # without flash's recomputed scores: the model FLOPs (plus the recompute asked for)
        assert model.train_flops_per_token(recompute, attention) == model.train_flops_per_token(recompute)
        assert block.flops == block.model_flops  # unfused attention computes the whole square, masked half too
    else:  # the causal kernel computes s (s + 1) / 2 of the square's s^2 products (tests/test_sim_attention.py)
        assert block.flops < block.model_flops
    assert sum(model_flops(op) for op in block.forward) * tp == model.block_forward_flops_per_token() * b * model.seq_len
    forward = model.n_layers * sum(model_flops(op) for op in block.forward)
    forward += sum(model_flops(op) for op in head_ops(model, b, layout, BF16, impl).forward)
    assert forward * tp == model.forward_flops_per_token() * b * model.seq_len


@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_saved_tensors_equal_config_for_every_shape(shape, recompute):
    """What the op list saves is what config.py counts from minigpt/model.py (flash attention, one rank)."""
    model, b = SHAPES[shape], 3
    for precision, dtype_bytes in (("fp32", 4), ("bf16", 2)):
        ops = block_ops(model, b, Layout(), policy(precision), Implementation("flash", recompute))
        assert ops.saved_bytes == model.activation_bytes_per_token_per_layer(dtype_bytes, recompute) * b * model.seq_len
        head = head_ops(model, b, Layout(), policy(precision))
        assert head.saved_bytes == model.head_activation_bytes_per_token(dtype_bytes) * b * model.seq_len


def test_a_llama_block_follows_its_shape():
    """llama3-8b at tp 4: GQA's narrower qkv, SwiGLU's 2f-wide fc1, RoPE, RMSNorm's one statistic, no biases."""
    model, b, tp, e = LLAMA3_8B, 1, 4, 2
    rows, d, hd, f = b * model.seq_len, model.d_model, model.head_dim, model.d_ff // tp
    heads, kv = model.n_heads // tp, model.kv_heads // tp  # 8 query heads, 2 key/value heads on a rank
    qkv = rows * (heads + 2 * kv) * hd * e
    ops = block_ops(model, b, Layout(tp=tp), BF16, Implementation())
    every = ops.forward + ops.backward
    names = [op.name for op in every]
    assert not [n for n in names if "bias" in n or "gelu" in n or "position" in n]
    gemms = {op.name: op for op in every if isinstance(op, Gemm)}
    assert (gemms["qkv"].m, gemms["qkv"].n, gemms["qkv"].k) == (rows, model.qkv_width // tp, d)
    assert gemms["fc1"].n == 2 * f and gemms["fc2"].k == f and gemms["proj"].k == heads * hd
    flash = {op.name: op for op in every if isinstance(op, FusedAttention)}
    forward, backward = flash["attention.flash"], flash["attention.flash_backward"]
    assert forward.gemms[0].batch == b * heads  # every query head scores the sequence
    assert (forward.read, forward.written) == (qkv, rows * heads * hd * e + rows * heads * 4)
    assert (backward.read, backward.written) == (qkv + rows * heads * hd * e + 2 * rows * heads * 4, qkv)
    memory = {op.name: op for op in every if isinstance(op, MemoryOp)}
    tables = 2 * model.seq_len * hd * 4  # fp32 cos and sin
    assert (memory["rope"].read, memory["rope"].written) == (qkv + tables, qkv)
    assert (memory["rope_backward"].read, memory["rope_backward"].written) == (qkv + tables, qkv)
    assert names.index("rope_backward") == names.index("attention.flash_backward") + 1
    assert (memory["swiglu"].read, memory["swiglu"].written) == (rows * 2 * f * e, rows * 2 * f * e)
    assert (memory["swiglu_backward"].read, memory["swiglu_backward"].written) == (4 * rows * f * e, 2 * rows * f * e)
    assert memory["ln1"].written == rows * d * e + rows * 4  # the output and one fp32 1/rms per row
    saved = {t.name: t.bytes for t in ops.saved}
    assert saved["rope.output"] == qkv and "q_k_v" not in saved  # the attention keeps the rotated copy only
    assert saved["fc1.output"] == rows * 2 * f * e and saved["swiglu.silu"] == saved["swiglu.output"] == rows * f * e
    assert saved["ln1.statistics"] == saved["ln2.statistics"] == rows * 4
    mha = block_ops(model.with_(n_kv_heads=None), b, Layout(tp=tp), BF16, Implementation())
    mha_flash = next(op for op in mha.forward if isinstance(op, FusedAttention))
    assert mha_flash.flops == forward.flops and mha_flash.read == rows * 3 * heads * hd * e > forward.read


def test_selective_recompute_with_rotary_positions_keeps_the_unrotated_qkv():
    """parallel/recompute.py saves the core's input; the rotation and the attention run again and keep nothing."""
    ops = block_ops(TINY_LLAMA, 1, Layout(), BF16, Implementation("flash", "selective"))
    assert [op.name for op in ops.backward if op.phase == "recompute"] == ["rope", "attention.flash"]
    assert sorted(t.name for t in ops.recomputed) == ["attention.logsumexp", "rope.output"]
    saved = {t.name: t.bytes for t in ops.saved}
    assert saved["q_k_v"] == TINY_LLAMA.seq_len * TINY_LLAMA.qkv_width * 2 and "rope.output" not in saved
    none = block_ops(TINY_LLAMA, 1, Layout(), BF16, Implementation("flash", "none"))
    assert "q_k_v" not in {t.name for t in none.saved}
    full = block_ops(TINY_LLAMA, 1, Layout(), BF16, Implementation("flash", "full"))
    assert [t.name for t in full.saved] == ["x"]


def test_rotary_positions_leave_the_embeddings_no_position_ops():
    for model, learned in ((MODEL, True), (MODEL.with_(positions="rope"), False), (TINY_LLAMA, False)):
        ops = embedding_ops(model, 2, Layout(), BF16)
        names = {op.name for op in ops.forward + ops.backward}
        assert ({"embedding.position_add", "embedding.position_grad"} <= names) == learned
        assert bool(names & {"embedding.position_add", "embedding.position_grad"}) == learned


def test_every_linear_has_an_input_and_a_weight_gradient_of_the_same_flops():
    ops = block_ops(MODEL, 2, Layout(tp=2), BF16, Implementation("unfused"))
    gemms = {op.name: op for op in ops.forward + ops.backward if isinstance(op, Gemm)}
    for name in ("qkv", "proj", "fc1", "fc2"):
        forward = gemms[name]
        dgrad, wgrad = gemms[f"{name}.input_grad"], gemms[f"{name}.weight_grad"]
        assert forward.flops == dgrad.flops == wgrad.flops
        assert (dgrad.m, dgrad.n, dgrad.k) == (forward.m, forward.k, forward.n)  # dX = dY W
        assert (wgrad.m, wgrad.n, wgrad.k) == (forward.n, forward.k, forward.m)  # dW = dY^T X
        assert forward.linear and forward.dtype == "bf16"
    assert not gemms["attention.scores"].linear
    assert gemms["attention.scores"].batch == 2 * MODEL.n_heads // 2  # b x a/t matmuls of s x s x head_dim
    assert sum(gemms[n].flops for n in ("attention.grad_q", "attention.grad_k", "attention.grad_v",
                                        "attention.grad_probs")) == 2 * (gemms["attention.scores"].flops
                                                                         + gemms["attention.values"].flops)


def test_flash_backward_recomputes_the_scores_and_keeps_no_square():
    ops = block_ops(MODEL, 2, Layout(), BF16, Implementation("flash"))
    (forward,) = [op for op in ops.forward if isinstance(op, FusedAttention)]
    (backward,) = [op for op in ops.backward if isinstance(op, FusedAttention)]
    assert len(forward.gemms) == 2 and len(backward.gemms) == 5 and 2 * backward.flops == 5 * forward.flops
    assert "attention.scores_recomputed" in {g.name for g in backward.gemms}
    rows, width = 2 * MODEL.seq_len, MODEL.d_model  # reads q, k, v, writes the output and log-sum-exp: no s x s
    assert forward.read == 3 * rows * width * 2 and forward.written == rows * width * 2 + rows * MODEL.n_heads * 4
    assert {t.name for t in ops.saved if t.small} == {"ln1.statistics", "ln2.statistics", "attention.logsumexp"}


def test_memory_bound_ops_move_the_bytes_they_read_and_write():
    b, tp = 2, 2
    for sequence_parallel in (False, True):
        ops = block_ops(MODEL, b, Layout(tp=tp, sequence_parallel=sequence_parallel), BF16, Implementation("unfused"))
        by_name = {op.name: op for op in ops.forward + ops.backward if isinstance(op, MemoryOp)}
        rows, f, e = b * MODEL.seq_len, MODEL.d_ff // tp, 2
        residual = rows // tp if sequence_parallel else rows  # element-wise work on s/t rows under sequence parallelism
        square = b * MODEL.n_heads // tp * MODEL.seq_len**2
        assert (by_name["gelu"].read, by_name["gelu"].written) == (rows * f * e, rows * f * e)
        assert (by_name["gelu_backward"].read, by_name["gelu_backward"].written) == (2 * rows * f * e, rows * f * e)
        assert (by_name["attention.softmax"].read, by_name["attention.softmax"].written) == (square * e, square * e)
        assert by_name["attention.dropout"].written == square * (e + 1)  # the output and a 1-byte mask
        assert by_name["ln1"].read == residual * MODEL.d_model * e
        assert by_name["ln1"].written == residual * MODEL.d_model * e + residual * 2 * 4  # output, mean and 1/std
        assert by_name["attention.residual_add"].read == 2 * residual * MODEL.d_model * e
        assert by_name["mlp.residual_dropout_backward"].read == residual * MODEL.d_model * (e + 1)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_unfused_activations_equal_korthikanti(tp):
    """sbh(34 + 5as/h) without tensor parallelism, sbh(10 + 24/t + 5as/(ht)) with it: 16-bit, dropout, no recompute."""
    b = 2
    ops = block_ops(MODEL, b, Layout(tp=tp), BF16, Implementation("unfused"))
    counted = sum(t.bytes for t in ops.saved if not t.small)
    assert counted == korthikanti(MODEL, b, tp)
    if tp == 1:
        s, h, a = MODEL.seq_len, MODEL.d_model, MODEL.n_heads
        assert counted == s * b * h * (34 + 5 * a * s / h)
    small = sum(t.bytes for t in ops.saved if t.small)  # the LayerNorms' fp32 mean and 1/std, which the paper leaves out
    assert small == 2 * b * MODEL.seq_len * 2 * 4
    assert layer_activation_bytes(MODEL, Layout(tp=tp), BF16, b, attention="unfused") == counted + small


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sequence_parallel_and_selective_recompute_equal_korthikanti(tp):
    b = 2
    layout = Layout(tp=tp, sequence_parallel=True)

    def counted(recompute: str, saved_input: str) -> int:
        ops = block_ops(MODEL, b, layout, BF16, Implementation("unfused", recompute, saved_input))
        return sum(t.bytes for t in ops.saved if not t.small)

    assert counted("none", "sharded") == korthikanti(MODEL, b, tp, sequence_parallel=True)
    assert counted("selective", "sharded") == MODEL.seq_len * b * MODEL.d_model * 34 / tp
    # our executor keeps the all-gathered input of qkv and fc1 (2 x 2sbh, not divided by t)
    s, h = MODEL.seq_len, MODEL.d_model
    assert counted("selective", "gathered") == s * b * h * (4 + 30 / tp)
    assert counted("full", "sharded") == s * b * h * 2 / tp  # the block input only
    selective = block_ops(MODEL, b, layout, BF16, Implementation("unfused", "selective", "sharded"))
    assert {t.name for t in selective.recomputed} == {"attention.probs", "attention.mask", "attention.dropped"}
    assert sum(t.bytes for t in selective.recomputed) == s * s * b * MODEL.n_heads * 5 / tp


def test_selective_recompute_reruns_the_attention_core_only():
    for attention, core in (("unfused", ["attention.scores", "attention.softmax", "attention.dropout",
                                         "attention.values", "attention.merge_heads"]),
                            ("flash", ["attention.flash"])):
        ops = block_ops(MODEL, 1, Layout(), BF16, Implementation(attention, "selective"))
        assert [op.name for op in ops.backward if op.phase == "recompute"] == core
    flash = block_ops(MODEL, 1, Layout(), BF16, Implementation("flash", "selective"))
    assert [t.name for t in flash.recomputed] == ["attention.logsumexp"]  # flash keeps no square to drop
    full = block_ops(MODEL, 1, Layout(), BF16, Implementation("flash", "full"))
    assert [t.name for t in full.saved] == ["x"] and len([op for op in full.backward if op.phase == "recompute"]) == \
        len(full.forward)


def test_fp8_linears_and_16_bit_attention_and_head():
    fp8 = policy("fp8")
    ops = block_ops(MODEL, 2, Layout(), fp8, Implementation("unfused"))
    dtypes = {op.name: op.dtype for op in ops.forward + ops.backward if isinstance(op, Gemm)}
    assert {dtypes[n] for n in ("qkv", "proj", "fc1", "fc2", "qkv.input_grad", "fc2.weight_grad")} == {"fp8"}
    assert dtypes["attention.scores"] == dtypes["attention.values"] == "bf16"
    head = head_ops(MODEL, 2, Layout(), fp8)
    assert {op.dtype for op in head.forward + head.backward if isinstance(op, Gemm)} == {"bf16"}
    assert {"qkv.input_fp8", "qkv.weight_fp8", "fc2.input_fp8"} <= {t.name for t in ops.saved}


def test_memory_prediction_follows_the_attention_kind():
    flash = predict_memory(MODEL, Layout(tp=2), "bf16", 2)
    unfused = predict_memory(MODEL, Layout(tp=2), "bf16", 2, attention="unfused")
    square = MODEL.n_layers * 2 * MODEL.n_heads // 2 * MODEL.seq_len**2 * 5  # 5 bytes per score element, per layer
    lse = MODEL.n_layers * 2 * MODEL.seq_len * MODEL.n_heads // 2 * 4
    assert unfused.activations - flash.activations == square - lse
    with pytest.raises(ConfigError, match="attention"):
        predict_memory(MODEL, Layout(), "bf16", 1, attention="fused")
    with pytest.raises(ConfigError, match="sp_saved_input"):
        Implementation(sp_saved_input="both")


def test_the_op_list_prints_with_one_name_per_op():
    rows = op_rows(block_ops(MODEL, 1, Layout(), BF16))
    assert rows[0][:2] == ["forward", "ln1"] and any(r[1] == "qkv" and "bf16" in r[2] for r in rows)
    assert all(isinstance(r[3], int) and r[3] > 0 for r in rows)
    layout = Layout(tp=2, sequence_parallel=True)
    for model, precision, attention in ((m, p, a) for m in (MODEL, TINY_LLAMA) for p in ("bf16", "fp8")
                                        for a in ("flash", "unfused")):
        for recompute in RECOMPUTE_MODES:
            ops = block_ops(model, 1, layout, policy(precision), Implementation(attention, recompute, "sharded"))
            for phase in ("forward", "recompute", "backward"):
                names = [op.name for op in ops.forward + ops.backward if op.phase == phase]
                assert len(names) == len(set(names)), names


def test_simulator_modules_have_no_import_cycle_and_no_torch():
    """Module-level imports between simulator/ modules form no cycle (lazy imports inside functions aside)."""
    root = Path(__file__).resolve().parents[1] / "simulator"
    graph = {}
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        deps = set()
        for node in tree.body:  # module level only
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("simulator."):
                deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[1] for a in node.names if a.name.startswith("simulator."))
        graph[path.stem] = deps
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for dep in graph.get(module, ()):
            assert state.get(dep) != 1, f"import cycle: {' -> '.join(trail + [dep])}"
            if dep not in state:
                visit(dep, trail + [dep])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])
    code = "import sys, simulator.costs.ops, simulator.engine.overlap, simulator.provenance; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_squared_relu_is_priced_as_gelu_is_under_its_own_name():
    """relu(x)^2 reads fc1's output and writes fc2's input, one kernel, and its backward reads two tensors and
    writes one, as GELU's: the same bytes and the same step, named for what it is."""
    def memory_ops(model):
        ops = block_ops(model, 2, Layout(tp=2), BF16, Implementation())
        return {op.name: (op.read, op.written) for op in (*ops.forward, *ops.backward)
                if isinstance(op, MemoryOp)}

    gelu, relu2 = memory_ops(MODEL), memory_ops(MODEL.with_(mlp="relu2"))
    assert gelu["gelu"] == relu2["relu2"] and gelu["gelu_backward"] == relu2["relu2_backward"]
    assert "gelu" not in relu2 and {k: v for k, v in gelu.items() if "gelu" not in k} == \
        {k: v for k, v in relu2.items() if "relu2" not in k}
