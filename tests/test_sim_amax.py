"""fp8 delayed scaling's amax all-reduces (simulator/engine/costs.py's amax_seconds): Transformer Engine's fp8_autocast
around each model chunk reduces the amaxes of the chunk's fp8 GEMMs once after its forward and once at the end of its
backward, on the compute stream, over Implementation.fp8_amax_group (Megatron-core: the stage's tp x cp x dp ranks)."""

from dataclasses import replace

import pytest

from job.layout import Layout
from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from simulator.costs.implementation import Implementation
from simulator.costs.hardware import load_hardware
from simulator.engine.links import LinkCosts
from simulator.engine.overlap import stack_implementation
from simulator.engine.simulate import simulate_step
from simulator.network.topology import build_cluster

MODEL = GPTConfig(vocab_size=512, seq_len=512, n_layers=4, n_heads=8, d_model=1024, d_ff=4096)
CORE = Implementation(**stack_implementation("megatron-core"))
H100 = load_hardware("h100-sxm")
BLOCK_GEMMS = 4  # qkv, proj, fc1, fc2


def run(layout, precision="fp8", implementation=CORE, batch=8, nodes=2, **kwargs):
    cluster = build_cluster(H100, min(8, layout.world_size), nodes)
    return simulate_step(MODEL, layout, cluster, precision, batch, 1, overlap="megatron-core",
                         implementation=implementation, **kwargs)


def amax_calls(result):
    return {(c["group"], c["bytes"]): c for c in result.collectives if c["group"].startswith("amax")}


def test_each_chunk_reduces_its_amaxes_after_its_forward_and_its_backward():
    layout = Layout(tp=2, dp=8, zero=1)  # 16 ranks over the two servers
    result = run(layout)
    gemms = BLOCK_GEMMS * MODEL.n_layers  # one chunk: the four blocks
    calls = amax_calls(result)
    # three fp32 amaxes per GEMM forward (input, weight, output), two backward (the two gradients)
    assert set(calls) == {("amax_data", 3 * 4 * gemms), ("amax_data", 2 * 4 * gemms)}
    assert all(c["ranks"] == 16 and c["servers"] == 2 and c["kind"] == "all_reduce" for c in calls.values())
    micro_batches = 8 // layout.dp
    expected = micro_batches * sum(c["seconds"] for c in calls.values())
    assert result.breakdown["amax_comm"] == pytest.approx(expected, rel=1e-12)
    without = run(layout, implementation=replace(CORE, fp8_amax_group="none"))
    assert without.breakdown["amax_comm"] == 0 and not amax_calls(without)
    assert result.breakdown["compute"] == pytest.approx(without.breakdown["compute"], rel=1e-12)
    assert sum(result.breakdown.values()) == pytest.approx(result.step_time_s, rel=1e-12)
    # the gradients' reduce-scatter, on its own stream, moves on while the last backward's amaxes are reduced
    assert 0 < result.step_time_s - without.step_time_s <= expected
    alone = Layout(tp=8)  # no data-parallel stream: the step is longer by all of it
    tp8, tp8_without = run(alone, nodes=1), run(alone, nodes=1, implementation=replace(CORE, fp8_amax_group="none"))
    assert tp8.step_time_s - tp8_without.step_time_s == pytest.approx(tp8.breakdown["amax_comm"], rel=1e-9)
    assert tp8.breakdown["amax_comm"] == pytest.approx(8 * sum(c["seconds"] for c in amax_calls(tp8).values()))


def test_the_groups_and_what_has_no_amax_to_reduce():
    layout = Layout(tp=2, dp=8, zero=1)
    data, tp_only = run(layout), run(layout, implementation=replace(CORE, fp8_amax_group="tp_cp"))
    assert {c["ranks"] for c in amax_calls(tp_only).values()} == {2}  # the tp pair inside a server
    assert 0 < tp_only.breakdown["amax_comm"] < data.breakdown["amax_comm"]  # two GPUs of a server, not 16 of two
    assert run(Layout(dp=1), nodes=1, batch=1).breakdown["amax_comm"] == 0  # alone: no one to reduce with
    for quiet in (run(layout, "bf16"),  # no fp8 Linears
                  run(layout, implementation=replace(CORE, fp8_scaling="block")),  # MXFP8: no amax history
                  run(layout, implementation=Implementation())):  # our executor keeps each rank's amaxes
        assert quiet.breakdown["amax_comm"] == 0 and not amax_calls(quiet)


def test_every_chunk_of_every_stage_pays_and_zero3_too():
    layout = Layout(tp=2, pp=2, dp=4, zero=1, virtual_chunks=2)
    result = run(layout, schedule_kind="interleaved", virtual_chunks=2)
    calls = amax_calls(result)
    gemms = BLOCK_GEMMS * MODEL.n_layers // 4  # one block per chunk
    assert set(calls) == {("amax_data", 3 * 4 * gemms), ("amax_data", 2 * 4 * gemms)}
    micro_batches = 8 // layout.dp
    per_rank = micro_batches * layout.virtual_chunks * sum(c["seconds"] for c in calls.values())
    assert [rank["amax_comm"] for rank in result.per_rank] == pytest.approx([per_rank] * 2, rel=1e-12)
    sharded = Layout(tp=2, dp=8, zero=3)  # ZeRO-3: the reduction closes the chunk after its units' gathers
    with_amax, without = run(sharded), run(sharded, implementation=replace(CORE, fp8_amax_group="none"))
    assert with_amax.breakdown["amax_comm"] > 0
    assert with_amax.step_time_s > without.step_time_s


def test_the_links_time_the_groups_as_nccl_would():
    cluster = build_cluster(H100, 8, 4)
    layout = Layout(tp=4, dp=8)
    links = LinkCosts(cluster, layout, H100.gpu)
    assert links.groups("amax_data", 0)[0] == [list(range(32))]  # the stage's tp x dp ranks: one group
    assert links.groups("amax_tp_cp", 0)[0] == [list(range(4 * d, 4 * d + 4)) for d in range(8)]
    wide, narrow = links.amax_all_reduce(0, "data", 48), links.amax_all_reduce(0, "tp_cp", 48)
    assert wide > narrow > 0  # four servers' latency against one NVLink hop
    assert LinkCosts(build_cluster(H100, 8, 1), Layout(dp=8), H100.gpu).amax_all_reduce(0, "tp_cp", 48) == 0


def test_a_bad_group_is_refused():
    with pytest.raises(ConfigError, match="fp8_amax_group must be one of none, tp_cp, data"):
        Implementation(fp8_amax_group="world")
