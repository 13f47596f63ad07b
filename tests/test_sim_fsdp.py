"""FSDP's two settings in the one schedule both interpreters run, and in the simulator: ZeRO-3 without
resharding after the forward (fewer gathers, more memory) and hybrid sharding (HSDP: gathers and
reduce-scatters inside a shard group, the pieces all-reduced across the replica groups). Torch-free; the
trained side is tests/test_fsdp.py and tests/test_schedule_collectives.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from click.testing import CliRunner

from cli.main import main
from job.data_parallel import collectives, schedule_config
from job.layout import Layout, Tensor
from job.schedule import GatherParams, ReduceScatterGrads, build_schedule, validate
from minigpt.config import GPTConfig
from minigpt.presets import preset
from minigpt.errors import ConfigError
from simulator.engine.links import LinkCosts
from simulator.engine.simulate import simulate_step
from simulator.memory import predict_memory
from simulator.states import zero3_buffers, zero3_gather_bytes
from simulator.network.topology import build_cluster

MODEL = GPTConfig(vocab_size=256, seq_len=16, n_layers=6, n_heads=2, d_model=32, d_ff=64)


def actions(layout: Layout, micro_batches: int, kind: str = "1f1b"):
    config = schedule_config(MODEL, layout, micro_batches, kind, 25.0, "fp32")
    schedule = build_schedule(config)
    validate(schedule)
    return config, schedule


def gathers(schedule, rank: int = 0) -> Counter:
    return Counter(a.phase for a in schedule.actions[rank] if isinstance(a, GatherParams))


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "zb-h1"])
def test_without_resharding_a_unit_is_gathered_once_per_micro_batch(kind):
    """dp 4, 8 units (embeddings, 6 blocks, head), the first and last kept: resharding gathers the 6 blocks for
    every forward and backward; without it, once per micro-batch: for its forward (1F1B), or, where forwards
    run back to back (GPipe: freed after each backward), for the first forward and the backwards after the first."""
    _, plain = actions(Layout(dp=4, zero=3), 3, kind)
    _, kept = actions(Layout(dp=4, zero=3, reshard_after_forward=False), 3, kind)
    assert sum(gathers(plain).values()) == 2 + 3 * 2 * 6
    expected = {"forward": 2 + 6, "backward": 2 * 6} if kind == "gpipe" else {"forward": 2 + 3 * 6}
    assert gathers(kept) == Counter(expected)
    reductions = [sum(isinstance(a, ReduceScatterGrads) for a in s.actions[0]) for s in (plain, kept)]
    assert reductions[0] == reductions[1] == 3 * 8  # every unit, every micro-batch either way


@pytest.mark.parametrize("kind, virtual", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_under_pipelining_a_unit_is_gathered_once_per_step(kind, virtual):
    """torchtitan's way: each unit of a rank gathered once, kept to the chunk's last backward."""
    layout = Layout(pp=2, dp=2, zero=3, virtual_chunks=virtual, reshard_after_forward=False)
    config, schedule = actions(layout, 4, kind)
    for rank in range(2):
        units = sum(len(config.plan.of(chunk).sizes) for chunk in config.chunks_of(rank))
        assert gathers(schedule, rank) == Counter({"forward": units}), rank
        reductions = [a for a in schedule.actions[rank] if isinstance(a, ReduceScatterGrads)]
        assert len(reductions) == units and all(a.micro_batch == -1 for a in reductions)  # summed, reduced once


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "zb-h1"])
def test_grads_synced_once_without_pipelining(kind):
    """--sync-grads-once (FSDP2's gradient sync off between micro-batches): as under pipelining, each unit gathered
    once and reduced once a step; the simulator holds every unit and its summed gradients all step, and prices the
    8 reductions in place of 3 x 8."""
    layout = Layout(dp=4, zero=3, reshard_after_forward=False, sync_grads_once=True)
    config, schedule = actions(layout, 3, kind)
    assert config.zero3_hold == 3
    assert gathers(schedule) == Counter({"forward": 8})
    assert sum(isinstance(a, ReduceScatterGrads) for a in schedule.actions[0]) == 8
    cluster = build_cluster("h100-sxm", 8, 1)
    kept = Layout(dp=8, zero=3, reshard_after_forward=False)
    once = Layout(dp=8, zero=3, reshard_after_forward=False, sync_grads_once=True)
    model = preset("llama3-8b")
    steps = {lay: simulate_step(model, lay, cluster, "bf16", 32, 1) for lay in (kept, once)}
    assert steps[once].breakdown["dp_comm"] < steps[kept].breakdown["dp_comm"]
    assert steps[once].memory.comm_buffers > steps[kept].memory.comm_buffers


def test_hybrid_sharding_reduces_in_a_group_then_across():
    layout = Layout(dp=8, zero=3, shard_group=2)
    config, schedule = actions(layout, 2)
    assert (config.plan.dp, config.plan.replicas) == (2, 4)
    assert all(size % 2 == 0 for _, params in config.plan.chunks for size in params.sizes)  # padded to N, not 8
    calls = [c for a in schedule.actions[0] if isinstance(a, ReduceScatterGrads) for c in collectives(a, config.plan)]
    scatters = [c for c in calls if c.kind == "reduce_scatter"]
    assert [c.group for c in calls] == ["shard", "replicas"] * len(scatters)
    assert all(piece.nbytes * 2 == whole.nbytes for whole, piece in zip(calls[::2], calls[1::2]))
    assert all(c.group == "shard" for a in schedule.actions[0] if isinstance(a, GatherParams)
               for c in collectives(a, config.plan))


def test_hybrid_memory_shards_over_the_group():
    model = preset("gpt2-124m")
    whole = predict_memory(model, Layout(dp=64, zero=3), "bf16", 1)
    hybrid = predict_memory(model, Layout(dp=64, zero=3, shard_group=8), "bf16", 1)
    by_eight = predict_memory(model, Layout(dp=8, zero=3), "bf16", 1)
    assert hybrid.model_states == by_eight.model_states == pytest.approx(8 * whole.model_states, rel=0.01)
    assert any("hybrid sharding" in note for note in hybrid.notes)


def test_the_shard_group_is_timed_on_its_own_ranks():
    """64 GPUs in servers of 8: a shard group of 8 is one server (NVLink), the whole group spans 8 servers; the
    replica group's ring crosses the network. Without hybrid sharding "shard" is the dp x cp ring."""
    cluster = build_cluster("h100-sxm", 8, 8)
    plain, hybrid = LinkCosts(cluster, Layout(dp=64, zero=3)), LinkCosts(cluster, Layout(dp=64, zero=3, shard_group=8))
    size = 64 * 2**20
    assert plain.sharded_collective(0, "all_gather", size) == plain.dp_collective(0, "all_gather", size)
    assert plain.sharded_collective(0, "all_reduce", size, "replicas") == 0.0
    inside = hybrid.sharded_collective(0, "all_gather", size)
    assert 0 < inside < plain.dp_collective(0, "all_gather", size) / 2
    assert hybrid.sharded_collective(0, "all_reduce", size / 8, "replicas") > 0


def run_simulate(*flags: str) -> dict:
    result = CliRunner().invoke(main, ["simulate", "--json", *flags])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_stack_reducing_in_fp32_moves_its_gradients_at_four_bytes_and_its_weights_as_before():
    """FSDP2's reduce_dtype float32 (torchtitan's only choice, Implementation.grad_reduce_fp32): bf16 training's
    reduce-scatters and all-reduces at 4 bytes an element, its gathers still at 2."""
    config = schedule_config(MODEL, Layout(dp=8, zero=3, shard_group=2), 2, "1f1b", 25.0, "bf16")
    schedule = build_schedule(config)
    for action in schedule.actions[0]:
        if isinstance(action, (ReduceScatterGrads, GatherParams)):
            plain, fp32 = collectives(action, config.plan), collectives(action, config.plan, reduce_bytes=4)
            factor = 1 if isinstance(action, GatherParams) else 2
            assert [c.nbytes * factor for c in plain] == [c.nbytes for c in fp32]
    flags = ["--model", "gpt2-124m", "--dp", "16", "--zero", "3", "--global-batch", "16", "--overlap",
             "torchtitan-fsdp2", "--elementwise", "fused", "--json"]
    result = CliRunner().invoke(main, ["simulate", *flags])
    report = json.loads(result.output)
    assert report["provenance"]["implementation"]["grad_reduce_fp32"]
    scatters = {c["bytes"] for c in report["collectives"] if c["kind"] == "reduce_scatter"}
    gathers = {c["bytes"] for c in report["collectives"] if c["kind"] == "all_gather"}
    assert scatters and {2 * size for size in gathers} == scatters
    stated = json.loads(CliRunner().invoke(main, ["simulate", *flags, "--grad-reduce", "compute"]).output)
    assert not stated["provenance"]["implementation"]["grad_reduce_fp32"]
    assert stated["breakdown"]["dp_comm"] < report["breakdown"]["dp_comm"]
    # the gradients' staging and reduce-scatters in fp32, the gathered weights in bf16
    assert stated["memory_per_gpu"]["comm_buffers"] < report["memory_per_gpu"]["comm_buffers"]
    units = [[[Tensor("a", 300, False)], [Tensor("b", 500, False)], [Tensor("c", 200, False)]]]
    sizes = [304, 504, 200]  # padded to a multiple of 8 ranks
    assert zero3_gather_bytes(units, 8, 1, "forward", 2, 2, reduce_bytes=4) == zero3_buffers(
        [4 * n for n in sizes], 8, 1, "forward", [2 * n for n in sizes])
    assert zero3_gather_bytes(units, 8, 1, "forward", 2, 2) == 2 * zero3_buffers(sizes, 8, 1, "forward")


def test_no_resharding_on_8_gpus_gathers_less_and_holds_more():
    flags = ["--model", "gpt2-124m", "--dp", "8", "--zero", "3", "--micro-batches", "4", "--global-batch", "64"]
    plain, kept = run_simulate(*flags), run_simulate(*flags, "--no-reshard-after-forward")
    assert kept["breakdown"]["dp_comm"] < plain["breakdown"]["dp_comm"]
    assert kept["memory_per_gpu"]["comm_buffers"] > plain["memory_per_gpu"]["comm_buffers"]
    assert kept["breakdown"]["compute"] == plain["breakdown"]["compute"]


def test_hybrid_sharding_on_64_gpus_gathers_inside_a_server():
    flags = ["--model", "llama3-8b", "--dp", "64", "--zero", "3", "--global-batch", "128"]
    plain, hybrid = run_simulate(*flags), run_simulate(*flags, "--shard-group", "8")
    assert hybrid["breakdown"]["dp_comm"] < plain["breakdown"]["dp_comm"] / 2
    assert hybrid["memory_per_gpu"]["parameters"] == pytest.approx(8 * plain["memory_per_gpu"]["parameters"], rel=0.01)
    assert hybrid["layout"]["shard_group"] == 8


@pytest.mark.parametrize("changes, message", [
    (dict(dp=4, zero=3, shard_group=3), "does not divide"),
    (dict(dp=4, zero=0, shard_group=2), "needs --zero 1, 2 or 3"),
    (dict(dp=4, zero=2, reshard_after_forward=False), "needs --zero 3"),
    (dict(dp=4, zero=3, sync_grads_once=True), "needs --zero 3 --no-reshard-after-forward"),
    (dict(dp=4, zero=3, shard_group=-2), "--shard-group must be a positive integer"),
    (dict(dp=4, zero=3, shard_group=1), "one rank"),
])
def test_bad_settings_are_refused_by_the_layout(changes, message):
    with pytest.raises(ConfigError, match=message):
        Layout(**changes)


@pytest.mark.parametrize("command", ["train", "simulate", "compare"])
def test_help_lists_both_options(command):
    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "--shard-group" in result.output and "--no-reshard-after-forward" in result.output
    assert "--sync-grads-once" in result.output


def test_torchtitans_stack_does_not_reshard_under_pipelining_unless_told():
    """torchtitan's default policy (its parallelize: reshard_after_forward = not pp_enabled): under --overlap
    torchtitan-fsdp2 a pipelined ZeRO-3 run keeps its units when the flag is not given; given, the flag decides; our
    executor reshards; plan's candidates follow the stack the same way."""
    def run(*flags):
        result = CliRunner().invoke(main, ["simulate", "--model", "tiny", "--pp", "2", "--dp", "2", "--zero", "3",
                                           "--global-batch", "8", "--json", *flags])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)
    default = run("--overlap", "torchtitan-fsdp2")
    assert default["step_time_s"] == run("--overlap", "torchtitan-fsdp2", "--no-reshard-after-forward")["step_time_s"]
    assert default["step_time_s"] != run("--overlap", "torchtitan-fsdp2", "--reshard-after-forward")["step_time_s"]
    assert run()["step_time_s"] == run("--reshard-after-forward")["step_time_s"]  # ours reshards


def test_plan_searches_fsdp_settings_for_zero3():
    """plan's ZeRO-3 candidates come resharding, kept (all step under pipelining), kept all step with gradients
    reduced once (pp 1, several micro-batches); ZeRO 1-3 each over every data rank and over a server's (hybrid
    sharding). Each candidate's layout says the same."""
    from simulator.search.plan import enumerate_candidates, fsdp_options
    assert fsdp_options(1, 16, 1, 4, 8) == [(True, False, 0), (True, False, 8)]
    assert fsdp_options(0, 16, 1, 4, 8) == [(True, False, 0)]  # ZeRO-0 shards nothing
    assert fsdp_options(3, 16, 2, 4, 8) == [(True, False, 0), (True, False, 8), (False, False, 0), (False, False, 8)]
    assert fsdp_options(3, 16, 1, 4, 8)[-2:] == [(False, True, 0), (False, True, 8)]
    assert fsdp_options(3, 16, 1, 1, 8) == fsdp_options(3, 16, 2, 1, 8)  # one micro-batch: nothing to sum
    assert fsdp_options(3, 8, 1, 1, 8) == fsdp_options(3, 24, 1, 1, 16) == [(True, False, 0), (False, False, 0)]
    candidates, _ = enumerate_candidates(MODEL, 16, 8, 32)
    zero3 = [c for c in candidates if c.zero == 3]
    assert {(c.reshard_after_forward, c.sync_grads_once, c.shard_group) for c in zero3} == {
        (True, False, 0), (True, False, 4), (True, False, 8), (False, False, 0), (False, False, 4), (False, False, 8),
        (False, True, 0), (False, True, 4), (False, True, 8)}
    assert all(c.shard_group in (0, 8 // c.tp) for c in zero3)
    assert all(c.reshard_after_forward and not c.sync_grads_once for c in candidates if c.zero != 3)
    assert {c.shard_group > 0 for c in candidates if c.zero in (1, 2)} == {True, False}
    assert not any(c.shard_group for c in candidates if c.zero == 0)
    assert all((c.layout.reshard_after_forward, c.layout.sync_grads_once, c.layout.shard_group)
               == (c.reshard_after_forward, c.sync_grads_once, c.shard_group) for c in candidates)


def test_a_mixture_of_experts_under_hybrid_sharding_shards_its_experts_as_without():
    """--shard-group with --ep (as tests/test_moe_training.py trains it, against one process): the dense weights'
    collectives go over the shard group and its replicas, the routed experts' over the ranks holding the same experts,
    as without the group; plan searches the combination."""
    def collectives_of(*flags):
        result = CliRunner().invoke(main, ["simulate", "--model", "tiny-moe", "--dp", "4", "--ep", "2", "--zero", "3",
                                           "--global-batch", "8", "--json", *flags])
        assert result.exit_code == 0, result.output
        found = json.loads(result.output)["collectives"]
        return ({(c["kind"], c["bytes"]) for c in found if c["group"] == "dp_experts"},
                {c["group"] for c in found if c["group"].startswith("dp") and c["group"] != "dp_experts"})
    experts, dense = collectives_of("--shard-group", "2")
    assert dense == {"dp_shard", "dp_replicas"} and experts and experts == collectives_of()[0]
    from simulator.search.plan import enumerate_candidates
    candidates, _ = enumerate_candidates(preset("tiny-moe"), 16, 8, 32)
    assert any(c.ep > 1 and c.shard_group for c in candidates)
