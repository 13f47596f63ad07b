"""simulator/costs/compute.py: the matmul roofline, its efficiency curve and profile hook, chunk times and TP traffic."""

from dataclasses import replace

import pytest

from minigpt.config import GPTConfig
from minigpt.presets import preset
from minigpt.errors import ConfigError
from precision.policy import FORMAT_BYTES, policy
from simulator.costs.rates.achieved import Achieved
from simulator.costs.compute import (
    FALLBACK_CURVE,
    HALF_EFFICIENCY_DIM,
    EfficiencyProfile,
    chunk_times,
    efficiency,
    kernel_overhead,
    matmul_time,
    mfu,
    op_time,
    parse_efficiency_profile,
    step_flops,
)
from simulator.costs.op_types import Gemm, MemoryOp
from simulator.costs.ops import Implementation, block_ops
from simulator.provenance import efficiency_sources
from simulator.costs.hardware import load_hardware
from job.layout import Layout

PRESET_A100 = load_hardware("a100-80gb").gpu
# The datasheet alone (no efficiency table, nothing achieved): the fallback curve, full HBM bandwidth, no overhead.
A100 = replace(PRESET_A100, matmul_efficiency=None, achieved=None)
H100 = replace(load_hardware("h100-sxm").gpu, matmul_efficiency=None, achieved=None)
TINY = GPTConfig(vocab_size=256, seq_len=32, n_layers=2, n_heads=4, d_model=64, d_ff=128)
GPT2 = preset("gpt2-124m")


def test_efficiency_curve():
    assert efficiency(HALF_EFFICIENCY_DIM, "bf16") == 0.5 and HALF_EFFICIENCY_DIM == 128
    assert efficiency(384, "bf16") == pytest.approx(384 / (384 + 128))  # x / (x + 128), the stated curve
    sizes = [1, 16, 64, 128, 512, 1024, 4096, 8192, 65536]
    values = [efficiency(x, "bf16") for x in sizes]
    assert values == sorted(values) and all(0 < v < 1 for v in values)
    assert efficiency(8192, "bf16") > 0.98


def test_tiny_matmul_is_bandwidth_bound_big_one_reaches_peak_times_efficiency():
    tiny = matmul_time(2 * 16**3, 16, 16, 16, A100, "bf16")
    assert tiny == pytest.approx(3 * 16 * 16 * 2 / A100.hbm_bandwidth)
    assert tiny > 2 * 16**3 / (A100.flops("bf16") * efficiency(16, "bf16"))
    n = 8192
    flops = 2 * n**3
    big = matmul_time(flops, n, n, n, A100, "bf16")
    # the datasheet's 312 TFLOP/s dense bf16 at the fallback curve's n / (n + 128) (no table on this GPU)
    assert big == pytest.approx(flops / (312e12 * n / (n + 128)))
    assert flops / A100.flops("bf16") < big < 1.05 * flops / A100.flops("bf16")
    assert matmul_time(flops, n, n, n, A100, "fp32") > 10 * big  # no tensor cores for plain fp32
    assert matmul_time(flops, n, n, n, H100, "bf16") < big / 2


def test_profile_replaces_the_curve_and_adds_launch_latency():
    data = {"launch_latency": 4e-6, "bf16": [[64, 0.2], [1024, 0.6], [8192, 0.8]]}
    profile = parse_efficiency_profile(data)
    assert efficiency(64, "bf16", profile) == 0.2 and efficiency(8192, "bf16", profile) == 0.8
    assert efficiency(16, "bf16", profile) == 0.2 and efficiency(10**6, "bf16", profile) == 0.8  # clamped
    assert efficiency(256, "bf16", profile) == pytest.approx(0.4)  # halfway in log size between 64 and 1024
    assert efficiency(256, "fp16", profile) == efficiency(256, "fp16")  # an unmeasured format keeps the curve
    assert matmul_time(2 * 16**3, 16, 16, 16, A100, "bf16", profile=profile) > 4e-6
    n = 8192
    assert matmul_time(2 * n**3, n, n, n, A100, "bf16", profile=profile) == pytest.approx(
        2 * n**3 / (A100.flops("bf16") * 0.8) + 4e-6
    )
    assert EfficiencyProfile().efficiency("bf16", 100) is None


@pytest.mark.parametrize(
    "data",
    [
        [],
        {"bf17": [[1, 0.5]]},
        {"bf16": [[64, 0.2], [32, 0.5]]},
        {"bf16": [[64, 1.5]]},
        {"bf16": []},
        {"launch_latency": -1},
    ],
)
def test_bad_profile_raises_config_error(data):
    with pytest.raises(ConfigError):
        parse_efficiency_profile(data)


def test_bad_matmul_input():
    with pytest.raises(ConfigError, match="no fp8"):
        matmul_time(1, 16, 16, 16, A100, "fp8")
    with pytest.raises(ConfigError):
        matmul_time(1, 0, 16, 16, A100, "bf16")
    with pytest.raises(ConfigError):
        chunk_times(TINY, 0, 1, Layout(), A100, "bf16")
    with pytest.raises(ConfigError):
        chunk_times(TINY, 1, 1, Layout(tp=3), A100, "bf16")


def test_block_gemms_hold_the_config_flops():
    for tp in (1, 2, 4):
        ops = block_ops(GPT2, 2, Layout(tp=tp), policy("bf16"), Implementation("unfused"))
        flops = sum(op.flops for op in ops.forward)
        assert flops * tp == GPT2.block_forward_flops_per_token() * 2 * GPT2.seq_len
    whole = chunk_times(GPT2, GPT2.n_layers, 2, Layout(), A100, "bf16", first=True, last=True)
    assert whole.forward_flops == GPT2.forward_flops_per_token() * 2 * GPT2.seq_len
    assert whole.backward_flops == (GPT2.train_flops_per_token(attention="flash") - GPT2.forward_flops_per_token()) * 2 * GPT2.seq_len


def test_backward_op_by_op_and_recompute_adds_the_forward_it_reruns():
    plain = chunk_times(GPT2, 4, 4, Layout(), A100, "bf16", last=True)
    assert plain.forward_s < plain.backward_s < 3 * plain.forward_s and plain.recompute_s == 0
    assert 0 < plain.backward_weight_s < plain.backward_s / 2  # the weight gradients: half the GEMMs, no attention
    recomputed = chunk_times(GPT2, 4, 4, Layout(), A100, "bf16", recompute="full", last=True)
    blocks_only = chunk_times(GPT2, 4, 4, Layout(), A100, "bf16")
    assert recomputed.forward_s == plain.forward_s
    assert recomputed.recompute_s == pytest.approx(blocks_only.forward_s)
    assert recomputed.backward_s == pytest.approx(plain.backward_s + blocks_only.forward_s)
    assert 0 < plain.forward_elementwise_s < plain.forward_matmul_s
    selective = chunk_times(GPT2, 4, 4, Layout(), A100, "bf16", recompute="selective", attention="unfused")
    unfused = chunk_times(GPT2, 4, 4, Layout(), A100, "bf16", attention="unfused")
    core = [op for op in block_ops(GPT2, 4, Layout(), policy("bf16"), Implementation("unfused", "selective")).backward
            if op.phase == "recompute"]
    assert [op.name for op in core] == ["attention.scores", "attention.softmax", "attention.values", "attention.merge_heads"]
    assert selective.recompute_s == pytest.approx(4 * sum(op_time(op, A100) for op in core))  # the attention core only
    assert selective.backward_s == pytest.approx(unfused.backward_s + selective.recompute_s)


def test_op_times_are_rooflines_plus_the_kernel_overhead():
    achieved = Achieved(hbm_fraction=0.8, kernel_overhead=5e-6, source="a test")
    gpu = replace(A100, achieved=achieved)
    op = MemoryOp("gelu", 10**8, 10**8)
    assert op_time(op, A100) == pytest.approx(2e8 / A100.hbm_bandwidth)  # no achieved data: the datasheet, no overhead
    assert op_time(op, gpu) == pytest.approx(2e8 / (0.8 * A100.hbm_bandwidth) + 5e-6)
    big = Gemm("fc1", 8192, 8192, 8192, "bf16", bytes=3 * 8192**2 * 2)
    assert op_time(big, gpu) == pytest.approx(2 * 8192**3 / (312e12 * 8192 / (8192 + 128)) + 5e-6)  # fallback curve
    table = parse_efficiency_profile({"bf16": [[64, 0.2], [8192, 0.7]], "launch_latency": 3e-6, "source": "a paper"})
    assert op_time(big, gpu, table) == pytest.approx(2 * 8192**3 / (312e12 * 0.7) + 3e-6)
    assert kernel_overhead(gpu, table) == 3e-6 and kernel_overhead(gpu) == 5e-6
    sources = efficiency_sources(A100, ["bf16", "fp16"], table)
    assert sources == {"bf16": {"kind": "cited table", "source": "a paper"},
                       "fp16": {"kind": "fallback curve", "source": FALLBACK_CURVE}}


def test_tensor_parallelism_halves_big_matmuls():
    model = preset("gpt3-175b")
    one = chunk_times(model, 2, 1, Layout(), A100, "bf16")
    two = chunk_times(model, 2, 1, Layout(tp=2), A100, "bf16")
    assert two.forward_matmul_s == pytest.approx(one.forward_matmul_s / 2, rel=0.02)
    small = chunk_times(TINY, 2, 1, Layout(), A100, "bf16")
    assert chunk_times(TINY, 2, 1, Layout(tp=2), A100, "bf16").forward_s > small.forward_s / 2  # narrower, less efficient


def test_tensor_parallel_collective_bytes():
    b, layers = 4, 3
    width = b * GPT2.seq_len * GPT2.d_model * 2  # bf16
    assert chunk_times(GPT2, layers, b, Layout(), A100, "bf16").tp_comm_bytes_forward == 0
    plain = chunk_times(GPT2, layers, b, Layout(tp=2), A100, "bf16")
    assert plain.tp_comm_bytes_forward + plain.tp_comm_bytes_backward == 4 * width * layers
    assert {c.kind for c in plain.tp_collectives_forward + plain.tp_collectives_backward} == {"all_reduce"}
    sp = chunk_times(GPT2, layers, b, Layout(tp=2, sequence_parallel=True), A100, "bf16")
    kinds = {c.kind: c.bytes * c.calls for c in sp.tp_collectives_forward}
    assert kinds == {"all_gather": 2 * width * layers, "reduce_scatter": 2 * width * layers}
    replicated_grads = layers * 6 * GPT2.d_model * 2  # LayerNorms, proj and fc2 biases, summed over the group
    assert sp.tp_comm_bytes_backward == 4 * width * layers + replicated_grads
    recomputed = chunk_times(GPT2, layers, b, Layout(tp=2), A100, "bf16", recompute="full")
    assert recomputed.tp_comm_bytes_backward == plain.tp_comm_bytes_backward + plain.tp_comm_bytes_forward
    sharded = chunk_times(GPT2, layers, b, Layout(tp=2, sequence_parallel=True), A100, "bf16", sp_saved_input="sharded")
    assert sharded.tp_comm_bytes_backward == sp.tp_comm_bytes_backward + 2 * width * layers  # qkv's, fc1's inputs again
    ends = chunk_times(GPT2, layers, b, Layout(tp=2), A100, "bf16", first=True, last=True)
    loss = 3 * b * GPT2.seq_len * 4  # max, sum of exponentials, target logit: fp32 per token
    assert ends.tp_comm_bytes_forward == plain.tp_comm_bytes_forward + width + loss  # + the embedding's all-reduce
    assert ends.tp_comm_bytes_backward == plain.tp_comm_bytes_backward + width  # + the head's input gradient


def test_sequence_parallel_sums_the_gradients_of_the_replicated_norms_and_biases():
    """parallel/tensor/parallelize.py all-reduces every replicated parameter fed a piece of the sequence: a Llama shape has
    only its RMSNorm gains (two a block, the final norm's), a GPT its LayerNorms' gains and biases, proj's and fc2's."""
    b, layers = 2, 3
    grad = FORMAT_BYTES[policy("bf16").grad]
    for model, per_block, final in ((preset("tiny-llama"), 2, 1), (TINY, 6, 2)):
        width = b * model.seq_len * model.d_model * 2
        layout = Layout(tp=2, sequence_parallel=True)
        blocks = chunk_times(model, layers, b, layout, A100, "bf16")
        assert blocks.tp_comm_bytes_backward == 4 * width * layers + layers * per_block * model.d_model * grad
        last = chunk_times(model, layers, b, layout, A100, "bf16", last=True)
        assert last.tp_comm_bytes_backward == blocks.tp_comm_bytes_backward + width + final * model.d_model * grad


def test_a_llama_chunk_holds_the_config_flops():
    model = preset("llama3-8b")
    whole = chunk_times(model, model.n_layers, 1, Layout(tp=8, sequence_parallel=True), A100, "bf16", first=True,
                        last=True)
    assert whole.forward_flops * 8 == model.forward_flops_per_token() * model.seq_len
    assert whole.backward_flops * 8 == (model.train_flops_per_token(attention="flash")
                                        - model.forward_flops_per_token()) * model.seq_len


def test_step_flops_and_mfu():
    batch = 8
    flops = step_flops(GPT2, batch)
    assert flops == GPT2.train_flops_per_token() * batch * GPT2.seq_len
    assert step_flops(GPT2, batch, "full") > flops
    ideal = flops / (4 * A100.flops("bf16"))
    assert mfu(GPT2, batch, ideal, 4, A100, "bf16") == pytest.approx(1.0)
    assert mfu(GPT2, batch, 2 * ideal, 4, A100, "bf16") == pytest.approx(0.5)
    with pytest.raises(ConfigError):
        mfu(GPT2, batch, 0.0, 4, A100, "bf16")
    with pytest.raises(ConfigError):
        step_flops(GPT2, 0)
