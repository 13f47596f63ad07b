"""fp8 parameters (Implementation.fp8_param_gather, `minigpt simulate --fp8-param-gather`): the fp8 Linears' weights
all-gathered by ZeRO at a byte each, held in fp8 by a stack that keeps them so (Megatron-core: the step's cast becomes
a transpose), the gathered ZeRO-3 units in fp8 under torchtitan's float8 all-gather; one line for a job that cannot."""

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from cli.main import main
from job.data_parallel import collectives
from job.exchange.experts import expert_gradient_reduction
from job.layout import Layout, block_tensors, embedding_tensors, expert_tensors, head_tensors, is_fp8_weight
from job.schedule_actions import AllReduceGrads, DataParallelPlan, GatherParams, ReduceScatterGrads
from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from precision.policy import FP8_BYTES, policy
from simulator.costs.hardware import load_hardware
from simulator.costs.implementation import Implementation
from simulator.costs.ops import block_ops
from simulator.engine.overlap import stack_implementation
from simulator.engine.simulate import simulate_step
from simulator.network.topology import build_cluster
from simulator.states import zero3_buffers, zero3_gather_bytes

MODEL = GPTConfig(vocab_size=512, seq_len=256, n_layers=4, n_heads=8, d_model=512, d_ff=2048)
CORE = Implementation(**stack_implementation("megatron-core"))
TITAN = Implementation(**stack_implementation("torchtitan-fsdp2"))
H100 = load_hardware("h100-sxm")


def fp8_elements(tp=1, layers=MODEL.n_layers):
    return layers * sum(t.numel for t in block_tensors(MODEL, tp) if is_fp8_weight(t))


def run(layout, implementation, overlap, batch=8):
    cluster = build_cluster(H100, min(8, layout.world_size), max(1, layout.world_size // 8))
    return simulate_step(MODEL, layout, cluster, "fp8", batch, 1, overlap=overlap, implementation=implementation)


def gathers(result):
    return sorted(c["bytes"] for c in result.collectives if c["group"] == "dp" and c["kind"] == "all_gather")


def test_the_fp8_weights_are_the_block_linears():
    names = {t.name: is_fp8_weight(t) for t in block_tensors(MODEL, 2) + embedding_tensors(MODEL, 2)
             + head_tensors(MODEL, 2, 2)}
    assert {n for n, fp8 in names.items() if fp8} == {"attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight",
                                                       "mlp.fc2.weight"}
    moe = GPTConfig(vocab_size=512, seq_len=256, n_layers=2, n_heads=8, d_model=512, d_ff=2048, n_experts=4, top_k=2,
                    n_shared_experts=1)
    fp8 = {t.name for t in block_tensors(moe, 1, True) if is_fp8_weight(t)}
    assert fp8 == {"attn.qkv.weight", "attn.proj.weight", "mlp.shared.fc1.weight", "mlp.shared.fc2.weight"}
    with_experts = {t.name for t in block_tensors(moe, 1, True) if is_fp8_weight(t, experts=True)}
    assert with_experts - fp8 == {"mlp.experts.w1", "mlp.experts.w2"}  # fp8 grouped experts; biases, router: no


def test_the_routed_experts_weights_are_gathered_in_fp8_with_fp8_grouped_experts():
    moe = GPTConfig(vocab_size=512, seq_len=256, n_layers=2, n_heads=8, d_model=512, d_ff=2048, n_experts=8, top_k=2)
    plain = expert_gradient_reduction(moe, 4, 8, 2, 2, shards=2)
    fp8 = expert_gradient_reduction(moe, 4, 8, 2, 2, shards=2, fp8_weights=True)
    weights = 2 * sum(t.numel for t in expert_tensors(moe, 4) if is_fp8_weight(t, experts=True))
    assert [(x.kind, x.bytes) for x in plain] == [("reduce_scatter", plain[0].bytes), ("all_gather", plain[0].bytes)]
    assert fp8[0] == plain[0] and plain[1].bytes - fp8[1].bytes == weights * (2 - FP8_BYTES)
    core = replace(CORE, fp8_param_gather=True)
    layout = Layout(dp=8, ep=4, zero=1)
    cluster = build_cluster(H100, 8, 1)
    results = [simulate_step(moe, layout, cluster, "fp8", 8, 1, overlap="megatron-core", implementation=impl)
               for impl in (CORE, core)]
    dense = sum(t.numel for t in block_tensors(moe, 1, True) if is_fp8_weight(t)) * moe.n_layers
    assert results[0].memory.parameters - results[1].memory.parameters == dense + weights


def test_a_gather_moves_its_fp8_weights_at_a_byte_each():
    plan = DataParallelPlan(4, 2, ())
    gather = GatherParams(chunk=0, bucket=0, phase="update", numel=1000)
    assert collectives(gather, plan) == [("all_gather", 2000, "shard")]
    assert collectives(gather, plan, 600) == [("all_gather", 400 * 2 + 600 * FP8_BYTES, "shard")]
    for reduction in (ReduceScatterGrads(chunk=0, bucket=0, numel=1000), AllReduceGrads(chunk=0, bucket=0, numel=1000)):
        assert collectives(reduction, plan, 600) == collectives(reduction, plan)  # gradients stay 16-bit


def test_megatron_core_keeps_the_weights_in_fp8_and_gathers_them_so():
    layout = Layout(tp=2, dp=4, zero=1, sequence_parallel=True)
    plain = run(layout, CORE, "megatron-core")
    fp8 = run(layout, replace(CORE, fp8_param_gather=True), "megatron-core")
    saved = fp8_elements(tp=2)  # one byte fewer for each fp8 weight on the rank (bf16: 2 bytes, fp8: 1)
    assert sum(gathers(plain)) - sum(gathers(fp8)) == saved
    assert [c for c in plain.collectives if c["kind"] == "reduce_scatter"] == \
        [c for c in fp8.collectives if c["kind"] == "reduce_scatter"]
    assert plain.memory.parameters - fp8.memory.parameters == saved
    # the cached row-wise e4m3 copy is the parameter now: the workspace keeps the transposed copy only
    assert plain.memory.activations - fp8.memory.activations == saved
    assert fp8.step_time_s < plain.step_time_s


def test_the_step_makes_the_transpose_instead_of_casting_the_weight():
    layout, fp8 = Layout(tp=2), policy("fp8")
    plain = block_ops(MODEL, 2, layout, fp8, CORE)
    kept = block_ops(MODEL, 2, layout, fp8, replace(CORE, fp8_param_gather=True))
    per_step = {op.name: op for op in kept.per_step}
    d, f = MODEL.d_model, MODEL.d_ff
    sizes = {"qkv": 3 * d * d // 2, "proj": d * d // 2, "fc1": f * d // 2, "fc2": d * f // 2}
    assert set(per_step) == {f"{name}.transpose_weight" for name in sizes}
    for name, elements in sizes.items():
        assert (per_step[f"{name}.transpose_weight"].read, per_step[f"{name}.transpose_weight"].written) == \
            (elements, elements)
    assert plain.workspace_bytes == 2 * kept.workspace_bytes == 2 * sum(sizes.values())
    assert kept.forward == plain.forward and kept.backward == plain.backward  # every micro-batch runs the same


def test_torchtitan_gathers_its_units_in_fp8_and_keeps_its_shards():
    layout = Layout(dp=8, zero=3)
    plain = run(layout, TITAN, "torchtitan-fsdp2")
    fp8 = run(layout, replace(TITAN, fp8_param_gather=True), "torchtitan-fsdp2")
    block = fp8_elements(layers=1)
    assert max(gathers(plain)) - max(gathers(fp8)) == block  # a block's unit: its fp8 weights at a byte each
    assert plain.memory.parameters == fp8.memory.parameters  # the shards stay 16-bit (torchao casts before gathering)
    assert fp8.memory.comm_buffers < plain.memory.comm_buffers


def test_zero3_buffers_with_the_weights_gathered_in_fp8():
    units = [[embedding_tensors(MODEL, 1)] + [block_tensors(MODEL, 1)] * 4 + [head_tensors(MODEL, 1, 1)]]
    sizes = [sum(t.numel for t in unit) for unit in units[0]]
    for hold in ("forward", "backward", "step"):
        assert zero3_gather_bytes(units, 8, 1, hold, 2, 2) == zero3_buffers([2 * s for s in sizes], 8, 1, hold)
        assert zero3_buffers(sizes, 8, 1, hold, weights=sizes) == zero3_buffers(sizes, 8, 1, hold)
        assert zero3_gather_bytes(units, 8, 1, hold, 2, FP8_BYTES) < zero3_gather_bytes(units, 8, 1, hold, 2, 2)


def test_the_stacks_that_cannot():
    with pytest.raises(ConfigError, match="needs fused casts"):
        Implementation(fp8_param_gather=True)
    with pytest.raises(ConfigError, match="per-tensor scaling"):
        replace(CORE, fp8_scaling="block", fp8_param_gather=True)


def invoke(*args):
    return CliRunner().invoke(main, ["simulate", "--model", "tiny", "--gpu", "h100-sxm", *args])


def test_the_flag_and_its_refusals():
    base = ("--tp", "2", "--dp", "4", "--zero", "1", "--sequence-parallel", "--overlap", "megatron-core")
    result = invoke(*base, "--precision", "fp8", "--fp8-param-gather", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["provenance"]["implementation"]["fp8_param_gather"] is True
    assert "--fp8-param-gather" in invoke("--help").output
    for args, words in ((("--precision", "bf16"), "needs --precision fp8"),
                        (("--precision", "fp8", "--zero", "0"), "needs ZeRO"),
                        (("--precision", "fp8", "--overlap", "executor"), "needs fused fp8 casts"),
                        (("--precision", "fp8", "--fp8-recipe", "mxfp8"), "per-tensor scaling only")):
        result = invoke(*base, *args, "--fp8-param-gather")
        assert result.exit_code == 2 and words in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1


def test_the_provenance_names_the_grouped_experts_only_for_a_mixture_of_experts():
    args = ("--precision", "fp8", "--overlap", "megatron-core", "--dp", "2", "--zero", "1", "--fp8-param-gather")
    dense = invoke(*args).output
    moe = CliRunner().invoke(main, ["simulate", "--model", "tiny-moe", "--gpu", "h100-sxm", *args]).output
    assert "fp8 weights kept and all-gathered in fp8" in dense and "fp8 grouped experts" not in dense
    assert "fp8 grouped experts" in moe
