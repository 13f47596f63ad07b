"""The simulator's mixture of experts and expert parallelism: a MoE block's op list (saved bytes equal to config.py's
counts, the experts' GEMMs and FLOPs equal to the active FLOPs), chunks mixing dense and MoE blocks, the all-to-alls
priced exactly as job/exchange/experts.py lists them, on NVLink inside a server and across the NICs beyond, the
experts' memory falling with ep, a routing imbalance (--expert-load: 1.0 is today's numbers exactly, more makes the
busiest rank's experts and all-to-alls slower, never faster; a training run's summary.json read), and the CLI's
refusals. Torch-free, no training ranks."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import main
from job.exchange.experts import (backward_exchanges, expert_gradient_reduction, expert_places, forward_exchanges,
                                  routed_rows)
from job.layout import Layout
from minigpt.errors import ConfigError
from minigpt.presets import preset
from precision.policy import FORMAT_BYTES, policy
from simulator.costs.compute import chunk_ops, chunk_times
from simulator.costs.tp_collectives import tp_collectives
from simulator.costs.hardware import load_hardware
from simulator.costs.op_types import Gemm, Implementation, model_flops
from simulator.costs.ops import block_ops
from simulator.engine.experts import check_expert_load, layer_exchange
from simulator.engine.links import LinkCosts
from simulator.engine.simulate import simulate_step
from simulator.memory import check_activations_against_config, predict_memory
from simulator.network.topology import build_cluster

H100 = load_hardware("h100-sxm")
TINY_MOE = preset("tiny-moe")
MIXTRAL = preset("mixtral-8x7b")
DEEPSEEK = preset("deepseek-v3")
SHAPES = {  # every router, loss and MLP option, with and without biases and shared experts
    "tiny-moe": TINY_MOE,
    "llama-style": preset("tiny-llama").with_(n_experts=4, top_k=1, n_shared_experts=2, router="sigmoid",
                                              aux_loss_coef=0.01),
    "top-1 softmax": TINY_MOE.with_(top_k=1, z_loss_coef=0.0, dropout=0.1),
    "dense first": TINY_MOE.with_(dense_layers=2, n_shared_experts=1, aux_loss_coef=0.0),
    "mixtral": MIXTRAL, "deepseek": DEEPSEEK,
    "not renormalised": TINY_MOE.with_(renormalize_gates=False),
    "every other": TINY_MOE.with_(moe_every=2),
    "qwen2-moe": preset("tiny-llama").with_(n_experts=4, top_k=2, n_shared_experts=2, shared_expert_gate=True,
                                            renormalize_gates=False, qkv_bias=True, dense_layers=1),
    "sigmoid as it is": DEEPSEEK.with_(renormalize_gates=False),
}


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


# ---------------------------------------------------------------- the op list


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_moe_saved_bytes_equal_config(name, precision):
    model, pol = SHAPES[name], policy(precision)
    for recompute in ("none", "selective", "full"):
        ops = block_ops(model, 2, Layout(), pol, Implementation(recompute=recompute), moe=True)
        per_token = model.activation_bytes_per_token_per_layer(FORMAT_BYTES[pol.compute], recompute, moe=True)
        per_sequence = model.moe_activation_bytes_per_sequence() if recompute != "full" else 0
        assert ops.saved_bytes == 2 * (per_token * model.seq_len + per_sequence)
    check_activations_against_config(model, pol)  # memory.py's check covers both kinds of block


def test_the_memory_check_sees_a_wrong_moe_count(monkeypatch):
    counted = TINY_MOE.moe_activation_bytes_per_token
    monkeypatch.setattr(type(TINY_MOE), "moe_activation_bytes_per_token", lambda self, b=4: counted(b) + 1)
    with pytest.raises(RuntimeError, match="MoE block"):
        check_activations_against_config(TINY_MOE, policy("bf16"))


@pytest.mark.parametrize("name", ["tiny-moe", "mixtral", "deepseek", "llama-style", "qwen2-moe"])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_gemms_are_grouped_and_their_flops_are_the_active_ones(name, ep):
    model = SHAPES[name]
    ops = block_ops(model, 1, Layout(dp=ep, ep=ep), policy("bf16"), moe=True)
    local = model.n_experts // ep
    rows = routed_rows(model, model.seq_len, 1)
    gemms = {op.name: op for op in ops.forward if isinstance(op, Gemm)}
    fc1, fc2, router = gemms["experts.fc1"], gemms["experts.fc2"], gemms["router"]
    assert (fc1.batch, fc1.m, fc1.n, fc1.k) == (local, rows // local, model.expert_in_width, model.d_model)
    assert (fc2.batch, fc2.m, fc2.n, fc2.k) == (local, rows // local, model.d_model, model.expert_width)
    assert (router.m, router.n, router.k) == (model.seq_len, model.n_experts, model.d_model)
    forward = sum(model_flops(op) for op in ops.forward)
    assert forward == model.seq_len * model.block_forward_flops_per_token(moe=True)
    backward = sum(model_flops(op) for op in ops.backward if op.phase == "backward")
    scores = model.seq_len * 2 * model.seq_len * model.n_heads * model.qk_head_dim  # the flash backward's, again
    assert backward == 2 * forward + scores  # input and weight gradients of every matmul


def test_a_chunk_counts_each_kind_of_block():
    """DeepSeek-V3's first three blocks are dense: a chunk of blocks 0-3 holds three dense and one MoE block."""
    layout, pol = Layout(dp=8, ep=8), policy("bf16")
    units = chunk_ops(DEEPSEEK, 4, 1, layout, pol, Implementation(), moe_layers=1)
    kinds = sorted((ops.saved_bytes, count) for ops, count in units)
    dense = block_ops(DEEPSEEK, 1, layout, pol, moe=False).saved_bytes
    moe = block_ops(DEEPSEEK, 1, layout, pol, moe=True).saved_bytes
    assert kinds == sorted([(dense, 3), (moe, 1)])
    ct = chunk_times(DEEPSEEK, 4, 1, layout, H100.gpu, "bf16", moe_layers=1)
    per_token = 3 * DEEPSEEK.block_forward_flops_per_token(False) + DEEPSEEK.block_forward_flops_per_token(True)
    assert ct.forward_flops == per_token * DEEPSEEK.seq_len
    everything_moe = chunk_times(DEEPSEEK, 4, 1, layout, H100.gpu, "bf16")
    assert everything_moe.forward_flops == 4 * DEEPSEEK.block_forward_flops_per_token(True) * DEEPSEEK.seq_len


def test_a_moe_block_has_one_tensor_parallel_all_reduce_each_way():
    """The experts are whole on every tensor-parallel rank (parallel/tensor/parallelize.py): only proj's sum."""
    layout = Layout(tp=2)
    dense = tp_collectives(MIXTRAL, 2, 1, layout, policy("bf16"), False, False)
    mixed = tp_collectives(MIXTRAL, 2, 1, layout, policy("bf16"), False, False, moe_layers=1)
    assert [c.calls for c in dense[0] + dense[1]] == [4, 4]
    assert [c.calls for c in mixed[0] + mixed[1]] == [3, 3]


def test_under_sequence_parallelism_a_moe_block_routes_each_tp_ranks_slice():
    """With --sequence-parallel each tp rank routes its 1/T of the tokens through whole experts (parallel/tensor/
    moe.py): the routed experts' GEMMs and the MoE's saved bytes are those of 1/T of the rows, the attention keeps its
    all-gather and reduce-scatter but the MoE has none, the routing's counts go over the tp group, the router's
    gradient is summed over it, and the experts' gradient all-reduce spans the tp places (T x dp / ep ranks)."""
    model, pol = MIXTRAL.with_(aux_loss_coef=0.01), policy("bf16")
    plain, sp = Layout(tp=2, dp=8, ep=8), Layout(tp=2, dp=8, ep=8, sequence_parallel=True)

    def expert_flops(layout):
        return sum(model_flops(op) for op in block_ops(model, 1, layout, pol, moe=True).forward
                   if isinstance(op, Gemm) and op.name.startswith("experts."))

    assert expert_flops(sp) > 0 and expert_flops(sp) * 2 == expert_flops(plain)
    forward, backward = tp_collectives(model, 1, 1, sp, pol, False, False, moe_layers=1)
    width = model.seq_len * model.d_model * 2
    assert [(c.kind, c.bytes, c.calls) for c in forward] == [
        ("all_reduce", model.n_experts * 4, 1), ("all_gather", width, 1), ("reduce_scatter", width, 1)]
    router = [c for c in backward if c.bytes == model.d_model * model.n_experts * FORMAT_BYTES[pol.grad]]
    assert [c.kind for c in router] == ["all_reduce"]
    assert not any(c.bytes > width for c in backward)  # the experts' gradients go to their replicas, not over tp
    assert sp.token_ranks == 2 * plain.token_ranks == 16
    reduction = expert_gradient_reduction(model, 8, sp.token_ranks, 1, 2)
    assert reduction and expert_gradient_reduction(model, 8, plain.token_ranks, 1, 2) == []


def test_expert_groups_fold_over_the_ranks_routing_distinct_tokens():
    """job/exchange/experts.py's expert_places, which the trainer and the simulator both build from: ep consecutive
    ranks (tp fastest, then cp, then dp) of those routing distinct tokens; without sequence parallelism a tp place's
    data ranks (its tp peers route the same tokens), with it every rank of the stage (Megatron-core's folding)."""
    groups, replicas = expert_places(dp=2, cp=1, tp=2, sequence_parallel=True, ep=4)
    assert groups == [[(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]] and replicas == []
    groups, replicas = expert_places(dp=4, cp=1, tp=2, sequence_parallel=False, ep=2)
    assert groups == [[(0, 0, 0), (1, 0, 0)], [(2, 0, 0), (3, 0, 0)], [(0, 0, 1), (1, 0, 1)], [(2, 0, 1), (3, 0, 1)]]
    assert replicas == [[(0, 0, 0), (2, 0, 0)], [(1, 0, 0), (3, 0, 0)], [(0, 0, 1), (2, 0, 1)], [(1, 0, 1), (3, 0, 1)]]
    groups, replicas = expert_places(dp=2, cp=2, tp=1, sequence_parallel=False, ep=2)  # over one replica's cp ranks
    assert groups == [[(0, 0, 0), (0, 1, 0)], [(1, 0, 0), (1, 1, 0)]]
    assert replicas == [[(0, 0, 0), (1, 0, 0)], [(0, 1, 0), (1, 1, 0)]]
    # Mixtral 8x22B's layout (tp 2 x pp 8 x dp 8, ep 8, SP) on DGX H100s: each expert group is one server's 8 GPUs
    layout = Layout(tp=2, pp=8, dp=8, ep=8, sequence_parallel=True)
    links = LinkCosts(build_cluster(H100, 8, 16), layout, H100.gpu)
    assert len(links.rank_groups("ep", 0)) == 2  # 16 ranks of the stage
    for group in links.rank_groups("ep", 0):
        assert len(group) == 8 and len({rank // 8 for rank in group}) == 1


# ---------------------------------------------------------------- the all-to-alls


class Recording:
    """Links that price every all-to-all at one figure and remember what they were asked."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, []

    def all_to_all(self, stage: int, nbytes: float) -> float:
        self.calls.append(nbytes)
        return self.seconds


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_priced_all_to_alls_are_job_experts(recompute):
    layout, links = Layout(dp=4, ep=4), Recording(1e-4)
    forward, backward = layer_exchange(MIXTRAL, layout, 2, 2, recompute, links, 0)
    sent = routed_rows(MIXTRAL, 2 * MIXTRAL.seq_len, 2)
    expected_f = forward_exchanges(MIXTRAL, 4, sent, 2)
    expected_b = backward_exchanges(MIXTRAL, 4, sent, 2, recompute=recompute)
    assert forward.priced == expected_f and backward.priced == expected_b
    assert links.calls == [e.bytes for e in expected_f + expected_b]
    assert forward.seconds == pytest.approx(3e-4) and backward.seconds == pytest.approx(len(expected_b) * 1e-4)
    assert layer_exchange(MIXTRAL, Layout(), 2, 2, recompute, links, 0)[0].priced == []  # ep 1: nothing moves


def test_all_to_all_on_nvlink_inside_a_server_and_across_nics_beyond():
    """ep 8 with tp 1 fills one 8-GPU server: each GPU sends 7/8 of its buffer over NVLink at NCCL's achieved rate.
    tp 8 x ep 2 puts the two members on two servers: half the buffer crosses each GPU's NIC."""
    cluster, nbytes = build_cluster(H100, 8, 2), 256 * 2**20
    gpu, nic = H100.gpu, H100.nic
    inside = LinkCosts(cluster, Layout(tp=1, dp=16, ep=8), gpu).all_to_all(0, nbytes)
    across = LinkCosts(cluster, Layout(tp=8, dp=2, ep=2), gpu).all_to_all(0, nbytes)
    nvlink = gpu.nvlink_bandwidth * gpu.reached.nvlink_fraction
    assert inside == pytest.approx(nbytes * 7 / 8 / nvlink, rel=0.02)
    assert across == pytest.approx(nbytes / 2 / (nic.bandwidth * nic.busbw_fraction), rel=0.02)
    assert across > 3 * inside


def test_simulated_step_shows_the_all_to_all_and_the_experts_reduction():
    layout = Layout(dp=16, pp=4, ep=8)
    result = simulate_step(MIXTRAL.with_(n_layers=8), layout, build_cluster(H100, 8, 8), "bf16", 64, 1)
    assert result.breakdown["ep_comm"] > 0 and result.moe
    assert result.parameters == {**MIXTRAL.with_(n_layers=8).param_breakdown(),
                                 "active": MIXTRAL.with_(n_layers=8).active_params()}
    groups = {c["group"] for c in result.collectives}
    assert {"ep", "dp_experts"} <= groups  # the norm's expert share, and the experts' gradients over 2 ranks
    [call] = expert_gradient_reduction(MIXTRAL, 8, 16, 2, 2)
    assert call.kind == "all_reduce"
    assert any(c["group"] == "dp_experts" and c["bytes"] == call.bytes and c["ranks"] == 2 for c in result.collectives)
    dense = simulate_step(MIXTRAL.with_(n_layers=8), Layout(dp=16, pp=4), build_cluster(H100, 8, 8), "bf16", 64, 1)
    assert dense.breakdown["ep_comm"] == 0


def test_zero_shards_the_experts_states_over_the_ranks_holding_them():
    """Under ZeRO 1-3 the ranks holding the same experts shard their optimizer states (Megatron-core's distributed
    optimizer): the gradients are reduce-scattered and the new weights all-gathered, both of the buffer padded to
    a multiple of those ranks, on the step's listing; ZeRO 0 keeps the one all-reduce."""
    model = MIXTRAL.with_(n_layers=8)
    layout = Layout(dp=16, pp=4, ep=8, zero=1)
    assert layout.expert_state_shards == 2 and Layout(dp=16, pp=4, ep=8).expert_state_shards == 1
    assert Layout(dp=16, pp=4, ep=16, zero=1).expert_state_shards == 1  # one rank holds each expert
    calls = expert_gradient_reduction(model, 8, 16, 2, 2, layout.expert_state_shards)
    assert [c.kind for c in calls] == ["reduce_scatter", "all_gather"]
    [whole] = expert_gradient_reduction(model, 8, 16, 2, 2)
    assert calls[0].bytes == calls[1].bytes == whole.bytes  # 2 x 8 x 2 experts' elements: already even
    assert expert_gradient_reduction(model, 8, 24, 1, 2, 3)[0].bytes % (3 * 2) == 0  # padded to the 3 ranks
    result = simulate_step(model, layout, build_cluster(H100, 8, 8), "bf16", 64, 1)
    listed = {(c["kind"], c["bytes"]) for c in result.collectives if c["group"] == "dp_experts" and c["ranks"] == 2}
    assert {(c.kind, c.bytes) for c in calls} <= listed


def test_sharded_expert_states_cut_the_experts_optimizer_memory():
    """The experts' fp32 masters fall by the ranks sharing them; their weights and gradients stay whole. On a
    middle stage of Mixtral (8 layers, pp 4: 2 MoE layers of 8 experts, E parameters each) at dp 16 and ZeRO-1,
    ep 8 holds 2 experts' states split 2 ways, E x 4 bytes of masters, where ep 1 holds all 16 experts split
    16 ways, the same; unsharded (before) it was 2 E x 4."""
    model = MIXTRAL.with_(n_layers=8)
    zero0 = predict_memory(model, Layout(dp=16, pp=4, ep=8), "bf16", 1).per_stage[1]
    sharded = predict_memory(model, Layout(dp=16, pp=4, ep=8, zero=1), "bf16", 1)
    no_ep = predict_memory(model, Layout(dp=16, pp=4, zero=1), "bf16", 1).per_stage[1]
    assert sharded.per_stage[1].master_weights == pytest.approx(no_ep.master_weights, rel=1e-5)
    assert sharded.per_stage[1].adam_m == pytest.approx(no_ep.adam_m, rel=1e-5)
    assert sharded.per_stage[1].parameters == zero0.parameters and sharded.per_stage[1].gradients == zero0.gradients
    assert any("sharded over the 2 ranks holding the same experts" in line for line in sharded.notes)


# ---------------------------------------------------------------- memory


def test_expert_memory_falls_with_ep():
    """Each rank holds E/ep experts, whole beside ZeRO 0 (parallel/expert/gradients.py): their share of the
    model states halves with each doubling of ep, the dense weights' stays."""
    states = [predict_memory(MIXTRAL, Layout(pp=4, dp=8, ep=ep), "bf16", 1).model_states for ep in (1, 2, 4, 8)]
    assert states == sorted(states, reverse=True) and len(set(states)) == 4
    expert_bytes = 8 * 8 * MIXTRAL.expert_params() * 16  # 8 layers a stage, 8 experts, 16 bytes a parameter
    assert states[0] - states[1] == pytest.approx(expert_bytes / 2, rel=1e-4)
    assert states[1] - states[3] == pytest.approx(expert_bytes / 2 - expert_bytes / 8, rel=1e-4)


def test_dispatch_buffers_are_in_the_activations():
    one = predict_memory(TINY_MOE, Layout(dp=2), "bf16", 2).activations
    two = predict_memory(TINY_MOE, Layout(dp=2, ep=2), "bf16", 2).activations
    assert two - one == 2 * routed_rows(TINY_MOE, 2 * TINY_MOE.seq_len, 2) * TINY_MOE.d_model * 2


# ---------------------------------------------------------------- the command line


def test_simulate_prints_the_all_to_all_row_and_active_mfu():
    result = invoke("simulate", "--model", "tiny-moe", "--ep", "2", "--dp", "2", "--gpu", "h100-sxm")
    assert result.exit_code == 0, result.output
    assert "expert all-to-all (exposed)" in result.output and "MFU, active" in result.output
    data = json.loads(invoke("simulate", "--model", "tiny-moe", "--ep", "2", "--dp", "2", "--json").output)
    assert data["breakdown"]["ep_comm"] > 0 and data["layout"]["ep"] == 2
    assert data["parameters"]["active"] < data["parameters"]["total"] and data["mfu_counts"] == "active parameters"
    flags = invoke("simulate", "--model", "tiny", "--experts", "4", "--top-k", "1", "--expert-width", "64", "--json")
    assert flags.exit_code == 0 and json.loads(flags.output)["parameters"]["total"] == \
        preset("tiny").with_(n_experts=4, top_k=1, d_expert=64).n_params()


def test_gpus_sets_dp_before_the_expert_group_is_checked():
    """`--gpus N` is the job's size (dp = N over tp x cp x pp); --ep's check reads that dp, not the default 1."""
    result = CliRunner().invoke(main, ["simulate", "--model", "tiny-moe", "--gpus", "4", "--ep", "4",
                                       "--global-batch", "8", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["layout"]["dp"] == 4 and data["layout"]["ep"] == 4
    result = CliRunner().invoke(main, ["simulate", "--model", "tiny-moe", "--gpus", "6", "--ep", "4"])
    assert result.exit_code == 2 and "does not divide the 6 ranks" in result.output


@pytest.mark.parametrize("args, says", [
    (["--model", "tiny-moe", "--ep", "3", "--dp", "3"], "does not divide the 8 experts"),
    (["--model", "tiny-moe", "--ep", "2", "--dp", "3"], "does not divide the 3 ranks that route distinct tokens"),
    (["--model", "tiny-moe", "--ep", "2"], "does not divide the 1 ranks"),
    (["--model", "tiny-moe", "--ep", "4", "--dp", "2", "--tp", "2"], "under --sequence-parallel tp x dp x cp"),
    (["--model", "tiny", "--ep", "2", "--dp", "2"], "this model is dense"),
    (["--model", "tiny-moe", "--top-k", "9"], "top_k=9 is above the 8 experts"),
    (["--model", "tiny-moe", "--capacity-factor", "0"], "capacity_factor must be a number above 0"),
    (["--model", "tiny-moe", "--experts", "-1"], "--experts must be a whole number"),
    (["--model", "tiny", "--top-k", "2"], "this model is dense"),
    (["--model", "tiny-moe", "--dense-layers", "4"], "leaves no MoE layer"),
    (["--model", "tiny-moe", "--expert-bias-rate", "-1"], "expert_bias_rate must be a finite number >= 0"),
    (["--model", "tiny-moe", "--no-expert-bias", "--expert-bias-rate", "0.01"], "only with expert_bias"),
    (["--model", "tiny", "--expert-bias-rate", "0.01"], "this model is dense"),
    (["--model", "tiny", "--no-renormalize-gates"], "--renormalize-gates sets a mixture of experts' field"),
])
def test_bad_expert_inputs_exit_2_in_one_line(args, says):
    result = CliRunner().invoke(main, ["simulate", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], result.output



# ---------------------------------------------------------------- routing imbalance (--expert-load)

MIXTRAL8 = MIXTRAL.with_(n_layers=8)
EP_LAYOUT = Layout(dp=16, pp=4, ep=8)


def simulated(load=None, layout=EP_LAYOUT, model=MIXTRAL8):
    return simulate_step(model, layout, build_cluster(H100, 8, layout.world_size // 8), "bf16", 64, 1,
                         expert_load=load)


def test_an_expert_load_of_one_is_todays_numbers_exactly():
    today = simulated()
    for same in (simulated(1.0), simulated(1)):
        assert (same.step_time_s, same.breakdown, same.per_rank) == (today.step_time_s, today.breakdown, today.per_rank)
        assert same.memory == today.memory
    assert block_ops(MIXTRAL, 1, Layout(dp=4, ep=4), policy("bf16"), Implementation(expert_load=1.0), moe=True) == \
        block_ops(MIXTRAL, 1, Layout(dp=4, ep=4), policy("bf16"), moe=True)
    assert today.provenance["experts"]["expert_load"] == 1.0 and "balanced" in today.provenance["experts"]["routing"]


def test_imbalance_grows_the_busiest_ranks_expert_gemms_and_all_to_alls():
    layout, pol, rows = Layout(dp=4, ep=4), policy("bf16"), routed_rows(MIXTRAL, MIXTRAL.seq_len, 1)
    gemms = {}
    for load in (1.0, 2.0):
        ops = block_ops(MIXTRAL, 1, layout, pol, Implementation(expert_load=load), moe=True)
        gemms[load] = {op.name: op for op in ops.forward + ops.backward if isinstance(op, Gemm)}
    for name, op in gemms[2.0].items():  # the experts' m doubles (2 local experts: rows / 2 each), the rest stays
        grows = name.startswith("experts.") and not name.endswith("weight_grad")
        assert op.m == (2 * gemms[1.0][name].m if grows else gemms[1.0][name].m), name
        assert op.k == (2 * gemms[1.0][name].k if name.startswith("experts.") and name.endswith("weight_grad")
                        else gemms[1.0][name].k), name
    assert gemms[2.0]["experts.fc1"].m == 2 * rows // 2
    links = LinkCosts(build_cluster(H100, 4, 1), layout, H100.gpu)
    even, busy = (layer_exchange(MIXTRAL, layout, 1, 2, "none", links, 0, load) for load in (1.0, 2.0))
    assert [e.bytes for e in busy[0].priced] == [even[0].priced[0].bytes] + [2 * e.bytes for e in even[0].priced[1:]]
    assert busy[0].seconds > even[0].seconds and busy[1].seconds > even[1].seconds
    assert layer_exchange(MIXTRAL, Layout(), 1, 2, "none", links, 0, 2.0)[0].priced == []  # ep 1: nothing moves


def test_a_larger_expert_load_is_never_faster():
    steps = [simulated(load) for load in (1.0, 1.25, 1.5, 2.0, 3.0)]
    for slower, faster in zip(steps[1:], steps):
        assert slower.step_time_s > faster.step_time_s
        assert slower.breakdown["ep_comm"] > faster.breakdown["ep_comm"]
        assert slower.breakdown["compute"] > faster.breakdown["compute"]
        assert slower.memory.activations > faster.memory.activations  # the busiest rank holds more rows
    assert "imbalanced (expert load 2)" in steps[3].provenance["experts"]["routing"]
    one_rank = Layout(dp=16, pp=4)  # ep 1: every expert on the rank, its own rows whatever their spread
    assert simulated(3.0, one_rank).step_time_s == simulated(1.0, one_rank).step_time_s
    assert simulated(4.0, Layout(dp=16, pp=4, ep=2)).step_time_s == simulated(2.0, Layout(dp=16, pp=4, ep=2)).step_time_s


def test_the_expert_load_is_checked_and_capped_by_the_capacity():
    assert check_expert_load(MIXTRAL, 2) == 2.0 and check_expert_load(preset("tiny"), 1) == 1.0
    assert check_expert_load(MIXTRAL.with_(capacity_factor=1.25), 3.0) == 1.25
    assert check_expert_load(MIXTRAL.with_(capacity_factor=0.5), 3.0) == 1.0
    for bad in (0.5, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ConfigError, match="finite number >= 1"):
            check_expert_load(MIXTRAL, bad)
    with pytest.raises(ConfigError, match="over top_k 2 = 4"):
        check_expert_load(MIXTRAL, 4.5)


def summary(tmp_path, layers: dict) -> str:
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"final_loss": 2.0, "expert_load": {"layers": layers, "choices": 10}}))
    return str(path)


def test_a_training_runs_summary_gives_the_mean_of_its_layers_loads(tmp_path):
    path = summary(tmp_path, {"0": {"counts": [3, 1], "shares": [0.75, 0.25], "max_over_mean": 1.5},
                              "1": {"counts": [5, 0], "shares": [1.0, 0.0], "max_over_mean": 2.5}})
    base = ("simulate", "--model", "tiny-moe", "--ep", "2", "--dp", "2", "--json")
    for where in (path, str(tmp_path)):  # the file, or the run directory holding it
        data = json.loads(invoke(*base, "--expert-load", where).output)
        assert data["provenance"]["experts"]["expert_load"] == 2.0
        assert "mean of the measured max_over_mean over 2 MoE layers" in data["expert_load_from"]
    given = json.loads(invoke(*base, "--expert-load", "2").output)
    assert given["step_time_s"] == data["step_time_s"] > json.loads(invoke(*base).output)["step_time_s"]
    table = invoke(*base[:-1], "--expert-load", path)
    assert table.exit_code == 0 and "expert load: 2.00 (the mean" in table.output
    assert "routing imbalanced (expert load 2)" in table.output
    plan = invoke("plan", "--model", "tiny-moe", "--gpus", "8", "--expert-load", path, "--json")
    assert plan.exit_code == 0 and json.loads(plan.output)["expert_load"] == 2.0


@pytest.mark.parametrize("value, says", [
    ("0.5", "finite number >= 1"), ("nan", "finite number >= 1"), ("inf", "finite number >= 1"),
    ("4.5", "over top_k 2 = 4"), ("missing.json", "does not exist"),
    ({"final_loss": 2.0}, "has no expert_load per layer"),
    ({"expert_load": {"layers": {"0": {"max_over_mean": 0.0}}}}, "layer 0's max_over_mean is 0.0"),
    ({"expert_load": {"layers": {"0": {"max_over_mean": "2"}}}}, "layer 0's max_over_mean is '2'"),
])
def test_a_bad_expert_load_exits_2_in_one_line(tmp_path, value, says):
    if isinstance(value, dict):
        (tmp_path / "summary.json").write_text(json.dumps(value))
        value = str(tmp_path / "summary.json")
    elif value == "missing.json":
        value = str(tmp_path / value)
    for command in (["simulate", "--ep", "2", "--dp", "2"], ["plan", "--gpus", "8"]):
        result = invoke(*command, "--model", "tiny-moe", "--expert-load", value)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1 and says in lines[0], result.output


def test_a_dense_model_takes_no_expert_load():
    result = invoke("simulate", "--model", "tiny", "--expert-load", "2")
    assert result.exit_code == 2 and "this model is dense" in result.output, result.output
    assert invoke("simulate", "--model", "tiny", "--expert-load", "1").exit_code == 0


def test_the_experts_reduction_is_priced_without_data_parallelism():
    """Under sequence parallelism the tp ranks route their own slices, so with dp 1 two of tp 4's ranks can hold the
    same experts at ep 2: their gradients' all-reduce is priced at the optimizer step (no data-parallel pricer)."""
    model = MIXTRAL.with_(n_layers=2)
    layout = Layout(tp=4, sequence_parallel=True, ep=2)
    assert layout.data_ranks == 1 and layout.token_ranks // layout.ep == 2
    result = simulate_step(model, layout, build_cluster(H100, 4, 1), "bf16", 8, 1)
    [call] = expert_gradient_reduction(model, 2, 4, 2, 2)
    assert any(c["group"] == "dp_experts" and c["bytes"] == call.bytes for c in result.collectives)
    alone = simulate_step(model, Layout(tp=4, sequence_parallel=True, ep=4), build_cluster(H100, 4, 1), "bf16", 8, 1)
    assert result.breakdown["optimizer"] > alone.breakdown["optimizer"]


def test_the_choice_bias_costs_one_small_all_reduce_a_step():
    """DeepSeek-V3's auxiliary-loss-free balancing all-reduces each stage's choice counts once a step (fp64, its MoE
    layers x 256 experts: under 30 KB a stage at pp 16): a price, and a small one (latency-bound, tens of us)."""
    layout = ["--model", "deepseek-v3", "--gpus", "1024", "--gpu", "h100-sxm", "--pp", "16", "--dp", "64", "--ep",
              "64", "--global-batch", "8192", "--json"]
    steps = []
    for bias in ([], ["--no-expert-bias"]):
        result = CliRunner().invoke(main, ["simulate", *layout, *bias])
        assert result.exit_code == 0, result.output
        steps.append(json.loads(result.stdout)["step_time_s"])
    assert 0 < steps[0] - steps[1] < 1e-3, steps


def test_a_mixture_in_every_other_block_is_priced_block_by_block():
    """--moe-every 2 (GShard's): blocks 1 and 3 of tiny-moe's four are mixtures, 0 and 2 dense: the parameters are
    the model's, and the all-to-alls of each step half those of a mixture in every block (one per MoE block)."""
    args = ["--model", "tiny-moe", "--pp", "2", "--dp", "2", "--ep", "2", "--json"]
    every, other = (json.loads(invoke("simulate", *args, *extra).stdout) for extra in ([], ["--moe-every", "2"]))
    model = TINY_MOE.with_(moe_every=2)
    assert (other["parameters"]["total"], other["parameters"]["active"]) == (model.n_params(), model.active_params())
    assert other["breakdown"]["ep_comm"] == pytest.approx(every["breakdown"]["ep_comm"] / 2, rel=1e-9)
    assert other["breakdown"]["compute"] < every["breakdown"]["compute"]
