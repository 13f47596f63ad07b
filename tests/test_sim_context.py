"""The simulator's context parallelism (cp): per-rank compute and memory of seq/cp tokens, the key/value
exchange priced exactly as job/exchange/context.py lists it, the dp x cp data-parallel group, the CLI's refusals,
and the Llama 3 405B command at 131,072 tokens. Torch-free, no training ranks."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from cli.main import main
from job.exchange.context import GRAD_BYTES, backward_exchanges, forward_exchanges, kv_elements
from job.layout import Layout
from minigpt.presets import preset
from minigpt.errors import ConfigError
from precision.policy import policy
from simulator.costs.compute import chunk_times
from simulator.costs.tp_collectives import tp_collectives
from simulator.costs.hardware import NICSpec, load_hardware
from simulator.costs.ops import block_ops
from simulator.engine.context import layer_exchange
from simulator.engine.links import LinkCosts
from simulator.engine.simulate import simulate_step, step_schedule
from simulator.memory import predict_memory
from simulator.network.topology import build_cluster
from simulator.search.plan import MIN_CP_CHUNK, context_parallel_options, plan
from simulator.search.sweep import ClusterSpec

H100 = load_hardware("h100-sxm")
TINY_LLAMA = preset("tiny-llama")  # 4 heads, 2 kv heads, seq 128
GPT = preset("tiny").with_(seq_len=256)  # learned positions, biases, tied head
LLAMA_405B = ["simulate", "--model", "llama3-405b", "--seq-len", "131072", "--tp", "8", "--cp", "16", "--pp", "16",
              "--dp", "8", "--gpu", "h100-sxm", "--global-batch", "128"]


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


# ---------------------------------------------------------------- the layout


def test_layout_counts_cp_in_the_world_and_the_data_parallel_group():
    assert Layout(2, 3, 4, 1, True, 1) == Layout(tp=2, pp=3, dp=4, zero=1, sequence_parallel=True, cp=1)
    layout = Layout(tp=2, pp=3, dp=1, zero=1, cp=4)
    assert layout.world_size == 24 and layout.data_ranks == 4 and layout.effective_zero == 1
    assert Layout(dp=1, cp=1, zero=2).effective_zero == 0
    with pytest.raises(ConfigError, match="cp_kind"):
        Layout(cp=2, cp_kind="tree")
    with pytest.raises(ConfigError, match="divisible by 32"):
        Layout(cp=16).check(TINY_LLAMA.with_(seq_len=1000))


# ---------------------------------------------------------------- compute: 1/cp of every op


@pytest.mark.parametrize("model", [TINY_LLAMA, GPT], ids=["llama", "gpt"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_per_rank_flops_are_one_cp_th_of_cp_1(model, recompute):
    for tp, cp in ((1, 4), (2, 2), (2, 8)):
        one = chunk_times(model, 2, 2, Layout(tp=tp), H100.gpu, "bf16", recompute, True, True)
        split = chunk_times(model, 2, 2, Layout(tp=tp, cp=cp), H100.gpu, "bf16", recompute, True, True)
        assert split.forward_flops * cp == one.forward_flops and split.backward_flops * cp == one.backward_flops
        # the causal kernel's own products: 1/cp of the whole causal attention's (the load-balanced split)
        kernel = [block_ops(model, 2, Layout(tp=tp, cp=c), policy("bf16")).flops for c in (1, cp)]
        assert kernel[1] * cp == pytest.approx(kernel[0], rel=1e-12)


def test_tensor_parallel_collectives_carry_the_ranks_tokens():
    one, split = (tp_collectives(TINY_LLAMA, 2, 1, Layout(tp=2, cp=cp), policy("bf16"), True, True) for cp in (1, 4))
    for a, b in zip(one[0] + one[1], split[0] + split[1]):
        assert (a.kind, a.calls, a.bytes) == (b.kind, b.calls, b.bytes * 4)


def test_the_attention_table_is_read_at_the_chunk_length():
    ops = block_ops(TINY_LLAMA, 1, Layout(cp=4), policy("bf16"))
    attention = [op for op in ops.forward + ops.backward if op.name.startswith("attention.flash")
                 and hasattr(op, "efficiency_seq")]
    assert {op.efficiency_seq for op in attention} == {128 // 8} and {op.causal_seq for op in attention} == {128}


def test_unfused_attention_with_cp_is_refused_by_the_api_too():
    with pytest.raises(ConfigError, match="log-sum-exp"):
        simulate_step(TINY_LLAMA, Layout(cp=2), build_cluster(H100, 2, 1), "bf16", 1, 1, attention="unfused")


# ---------------------------------------------------------------- the exchange


class Recording:
    """Links that record what the exchange asks of them and take `seconds` per pass."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, []

    def cp_pass(self, stage: int, nbytes: float) -> float:
        self.calls.append(("p2p", nbytes))
        return self.seconds

    def cp_collective(self, stage: int, kind: str, nbytes: float) -> float:
        self.calls.append((kind, nbytes))
        return self.seconds


@pytest.mark.parametrize("kind", ["ring", "allgather"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_priced_exchange_is_job_contexts(kind, recompute):
    layout = Layout(tp=2, cp=4, cp_kind=kind)
    links = Recording(1e-3)
    forward, backward = layer_exchange(TINY_LLAMA, layout, 2, 2, recompute, links, 0, (1.0, 2.0, 1.0))
    expected_f = forward_exchanges(TINY_LLAMA, 2, 4, kind, 2, 2)
    expected_b = backward_exchanges(TINY_LLAMA, 2, 4, kind, 2, 2, recompute)
    assert forward.priced == expected_f and backward.priced == expected_b
    # each call of the links carries the exchange's bytes (a collective: its whole buffer, cp x a rank's part)
    asked = [(k, n if k == "p2p" else n // 4) for k, n in links.calls]
    priced = [(e.kind, e.bytes) for e in expected_f + expected_b]
    if kind == "ring":  # the backward's key/value and dk/dv passes, each alone and both sharing the link at once
        (_, keys), (_, grads) = priced[-2:]
        priced[-2:] = [("p2p", keys), ("p2p", grads), ("p2p", keys + grads)]
    assert asked == priced


def test_ring_exposure_follows_the_trainer():
    """Forward: each of cp - 1 passes behind a block (attention / cp); backward: a pass behind each of the cp
    blocks (a key/value pass, both kinds sharing the link, or a dk/dv pass), and the last hop home exposed.
    (Recording prices any pass at its one figure, whatever its size.)"""
    cp, attention = 8, (8e-3, 16e-3, 8e-3)
    layout = Layout(cp=cp)
    fast, slow = Recording(0.5e-3), Recording(3e-3)
    f_fast, b_fast = layer_exchange(TINY_LLAMA, layout, 1, 2, "none", fast, 0, attention)
    f_slow, b_slow = layer_exchange(TINY_LLAMA, layout, 1, 2, "none", slow, 0, attention)
    assert f_fast.seconds == 0 and f_slow.seconds == pytest.approx((cp - 1) * (3e-3 - 1e-3))
    assert b_fast.seconds == pytest.approx(0.5e-3)  # every pass behind a 2 ms block but the last hop home
    assert b_slow.seconds == pytest.approx(cp * (3e-3 - 2e-3) + 3e-3)


def test_ring_exposure_on_real_links_is_zero_when_fast_and_positive_when_slow():
    model = TINY_LLAMA.with_(seq_len=32768)
    layout = Layout(cp=8)
    nvlink = build_cluster(H100, 8, 1)  # the ring on one server's NVLink
    slow_nic = NICSpec("slow", "a test NIC: 1 GB/s", 1e9, 5e-6, 1.3e-7, 40)
    across = build_cluster(H100, 1, 8, slow_nic)  # one GPU a server: every hop crosses the network
    exposures = []
    for cluster in (nvlink, across):
        links = LinkCosts(cluster, layout, H100.gpu)
        ct = chunk_times(model, 1, 1, layout, H100.gpu, "bf16")
        attention = (ct.attention_forward_s, ct.attention_backward_s, ct.attention_recompute_s)
        exposures.append(layer_exchange(model, layout, 1, 2, "none", links, 0, attention))
    (f_fast, b_fast), (f_slow, b_slow) = exposures
    assert f_fast.seconds == 0 and f_slow.seconds > 0
    assert b_slow.seconds > b_fast.seconds > 0  # the last dk/dv hop home is always paid


def test_allgather_exchange_is_exposed_and_priced_as_collectives():
    cluster = build_cluster(H100, 8, 1)
    layout = Layout(cp=8, cp_kind="allgather")
    links = LinkCosts(cluster, layout, H100.gpu)
    forward, backward = layer_exchange(TINY_LLAMA, layout, 1, 2, "none", links, 0, (1.0, 1.0, 0.0))
    kv = kv_elements(TINY_LLAMA, 1, 8, 1) * 2
    assert forward.seconds == pytest.approx(2 * links.cp_collective(0, "all_gather", 8 * kv)) and forward.seconds > 0
    assert backward.seconds == pytest.approx(2 * links.cp_collective(0, "reduce_scatter", 8 * kv))


# ---------------------------------------------------------------- groups and placement


def test_groups_follow_the_mesh_order_pp_dp_cp_tp():
    layout = Layout(tp=2, cp=4, dp=2, pp=2)
    links = LinkCosts(build_cluster(H100, 8, 4), layout, H100.gpu)
    assert links.rank(1, 1, 1, 3) == ((1 * 2 + 1) * 4 + 3) * 2 + 1
    assert links.rank_groups("cp", 0)[0] == [0, 2, 4, 6]  # adjacent tp x cp ranks: one server here
    dp_groups = links.rank_groups("dp", 1)
    assert len(dp_groups) == 2 and all(len(g) == 8 for g in dp_groups)  # dp x cp ranks of a stage, per tp rank
    assert dp_groups[0] == [16, 18, 20, 22, 24, 26, 28, 30]


def test_weight_gradients_and_zero_shard_over_dp_x_cp():
    for zero in (1, 2, 3):
        cp = predict_memory(GPT, Layout(dp=2, cp=4, zero=zero), "bf16", 1)
        dp = predict_memory(GPT, Layout(dp=8, zero=zero), "bf16", 1)
        assert (cp.adam_m, cp.gradients, cp.parameters) == (dp.adam_m, dp.gradients, dp.parameters)
    schedule = step_schedule(GPT, Layout(dp=1, cp=2, zero=1), 1, "1f1b", 25.0, "bf16")
    assert schedule.config.zero_stage == 1 and schedule.config.plan.dp == 2  # reduce-scatters over 2 ranks


def test_pipeline_activations_are_the_ranks_tokens(monkeypatch):
    sent = []
    original = LinkCosts.p2p

    def p2p(self, a, b, nbytes):
        sent.append(nbytes)
        return original(self, a, b, nbytes)

    monkeypatch.setattr(LinkCosts, "p2p", p2p)
    simulate_step(GPT, Layout(pp=2, cp=4), build_cluster(H100, 8, 1), "bf16", 4, 1)
    assert set(sent) == {GPT.seq_len // 4 * GPT.d_model * 2}


# ---------------------------------------------------------------- memory


def _kv(model, tp, cp, micro_batch):
    return micro_batch * (model.kv_heads // tp) * (model.seq_len // cp) * model.head_dim


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_ring_activations_are_one_cp_th_plus_the_exchange_buffers(cp, recompute):
    tp, mb = 2, 2
    one = predict_memory(TINY_LLAMA, Layout(tp=tp), "bf16", mb, recompute).activations
    split = predict_memory(TINY_LLAMA, Layout(tp=tp, cp=cp), "bf16", mb, recompute).activations
    kv = _kv(TINY_LLAMA, tp, cp, mb)
    received = (1 if cp == 2 else 2) * 2 * kv * 2  # k and v computed with, and the next arriving (bf16)
    gradients = 3 * (2 * kv * 4)  # dk, dv fp32: the block's own, the previous block's being sent, the arriving
    assert one % cp == 0 and split == one // cp + received + gradients


def test_allgather_activations_keep_the_gathered_keys_and_values():
    tp, cp, mb = 1, 4, 1
    model = TINY_LLAMA
    one = predict_memory(model, Layout(tp=tp), "bf16", mb).activations
    split = predict_memory(model, Layout(tp=tp, cp=cp, cp_kind="allgather"), "bf16", mb).activations
    gathered = 2 * model.kv_heads * model.seq_len * model.head_dim * 2  # the whole sequence's k and v, bf16
    backward = 2 * cp * _kv(model, tp, cp, mb) * (4 + 2)  # their fp32 gradients and the bf16 copies scattered
    assert split == one // cp + model.n_layers * gathered + backward


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize("args, words", [
    (["--attention", "unfused", "--cp", "2"], "only a fused (flash) attention"),
    (["--seq-len", "1000", "--cp", "16"], "divisible by 32"),
    (["--seq-len", "16", "--cp", "16"], "at most 8"),
    (["--cp", "2", "--cp-kind", "tree"], "--cp-kind must be one of ring, allgather"),
    (["--cp", "0"], "--cp must be a positive integer"),
])
def test_bad_context_parallel_flags_are_one_line_and_exit_2(args, words):
    result = invoke("simulate", "--model", "tiny-llama", *args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in result.output


def test_llama3_405b_at_128k_tokens_with_cp_16():
    table = invoke(*LLAMA_405B)
    assert table.exit_code == 0, table.output
    for words in ("context-parallel exchange (exposed)", "MFU", "memory per GPU", "tp 8 x cp 16 (ring)", "why:"):
        assert words in table.output, words
    data = json.loads(invoke(*LLAMA_405B, "--json").output)
    assert math.isfinite(data["step_time_s"]) and data["step_time_s"] > 0 and 0 < data["mfu"] < 1
    assert data["n_gpus"] == 16384 and data["layout"]["cp"] == 16 and data["breakdown"]["cp_comm"] > 0
    assert sum(data["breakdown"].values()) == pytest.approx(data["step_time_s"], rel=1e-9)


def test_a_million_token_sequence_is_simulated():
    data = json.loads(invoke("simulate", "--model", "llama3-8b", "--seq-len", "1048576", "--tp", "8", "--cp", "32",
                             "--gpu", "h100-sxm", "--recompute", "full", "--json").output)
    assert data["seq_len"] == 1048576 and math.isfinite(data["step_time_s"]) and data["n_gpus"] == 256


def test_cp_1_prints_no_exchange_row_and_prices_none():
    result = invoke("simulate", "--model", "tiny-llama", "--tp", "2", "--gpu", "h100-sxm")
    assert result.exit_code == 0 and "context-parallel" not in result.output
    plain = simulate_step(TINY_LLAMA, Layout(tp=2), build_cluster(H100, 2, 1), "bf16", 2, 1)
    same = simulate_step(TINY_LLAMA, Layout(tp=2, cp=1), build_cluster(H100, 2, 1), "bf16", 2, 1)
    assert plain.breakdown["cp_comm"] == 0 and plain.step_time_s == same.step_time_s


# ---------------------------------------------------------------- plan


def test_plan_searches_cp_and_says_when_only_cp_fits():
    model = preset("llama3-8b").with_(seq_len=1048576)
    assert context_parallel_options(model, 64, 4, True) == [1, 2, 4, 8, 16]
    assert context_parallel_options(model.with_(seq_len=2048), 64, 1, False) == [1, 2]  # chunks of >= 512 tokens
    assert MIN_CP_CHUNK == 512
    found = plan(model, 64, ClusterSpec.of("h100-sxm"), 8)
    assert found.smallest_cp > 1 and f"cp >= {found.smallest_cp} needed" in found.context_note
    assert all(candidate.cp >= found.smallest_cp for candidate, _, _ in found.best)
    result = invoke("plan", "--model", "llama3-8b", "--seq-len", "1048576", "--gpus", "64", "--gpu", "h100-sxm",
                    "--global-batch", "8")
    assert result.exit_code == 0, result.output
    assert "a 1048576-token sequence does not fit without context parallelism: cp >=" in result.output
    assert " x cp " in result.output


def test_plan_with_cp_fixed_searches_the_rest():
    model = preset("llama3-8b").with_(seq_len=1048576)
    found = plan(model, 64, ClusterSpec.of("h100-sxm"), 8, cp=16)
    assert {candidate.cp for candidate, _, _ in found.best} == {16}
    assert found.context_note is None  # a fixed cp says nothing of the smallest that fits
    bad = invoke("plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--cp", "3")
    assert bad.exit_code == 2 and "equal chunks" in bad.output and len(bad.output.strip().splitlines()) == 1
