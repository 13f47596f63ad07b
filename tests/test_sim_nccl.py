"""Collectives as NCCL runs them (simulator/network/nccl.py on top of simulator/engine/links.py's ring).

Every expected number below is a published measurement (docs/efficiency.md, "Collective algorithms"),
typed here from its source rather than read back from simulator/network/nccl.json, so a change of the
data or of the model that moves a prediction away from what was measured fails here.
"""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from cli.main import Group
from cli.commands.simulate import simulate
from cli.options.collectives import NCCL_ALGOS
from job.layout import Layout
from minigpt.presets import build_config
from minigpt.errors import ConfigError
from simulator.costs.rates.achieved import Achieved
from simulator.costs.hardware import load_hardware
from simulator.engine.links import LinkCosts
from simulator.engine.simulate import simulate_step
from simulator.network import nccl
from simulator.network.cluster import Cluster
from simulator.network.topology import build_cluster
from nccl_calls import links, tp_call  # tests/ is on sys.path under pytest

KIB, MIB, GIB = 2**10, 2**20, 2**30


@click.group(cls=Group)
def group() -> None:
    """A throwaway group with the command registered the way cli/main.py registers it."""


group.add_command(simulate)


def dp_call(costs: LinkCosts, nbytes: float) -> dict:
    costs.dp_collective(0, "all_reduce", nbytes)
    return next(c for c in costs.calls.values() if c["group"] == "dp" and c["bytes"] == nbytes)


def busbw(call: dict) -> float:
    n = call["ranks"]
    factor = 2 * (n - 1) / n if call["kind"] == "all_reduce" else (n - 1) / n
    return call["bytes"] * factor / call["seconds"]


def b200():
    """The b200 preset: NVLink 5, 900 GB/s a direction, the ring at Bekman's 682.2 GB/s busbw (NCCL_NVLS_ENABLE=0,
    8 GiB) as its achieved NVLink fraction."""
    hardware = load_hardware("b200")
    assert hardware.gpu.reached.nvlink_fraction == pytest.approx(682.2 / 900, abs=5e-4)
    return hardware


# ---------------------------------------------------------------- the data and the flag


def test_the_data_cites_every_entry_and_the_flag_offers_the_models_choices():
    raw = json.loads(nccl.DATA_FILE.read_text())
    for section in ("nodes", "nics"):
        for name, entry in raw[section].items():
            assert len(entry["source"]) > 40, (section, name)
    assert "source" in raw["algorithms"]
    assert NCCL_ALGOS == nccl.CHOICES
    presets = {load_hardware(name).node.name for name in ("a100-80gb", "h100-sxm", "h200")}
    assert presets <= set(nccl.catalog().nodes)
    assert not any(nccl.catalog().in_network.values())  # in-network reduction is off unless a fabric says so


def test_a_bad_algorithm_is_one_line_and_exit_2():
    with pytest.raises(ConfigError, match="nccl-algo"):
        links("h100-sxm", 8, 1, Layout(tp=8)).select("shar")
    result = CliRunner().invoke(group, ["simulate", "--nccl-algo", "shar"])
    assert result.exit_code == 2 and "--nccl-algo must be one of" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_bad_data_is_refused_naming_the_field():
    raw = json.loads(nccl.DATA_FILE.read_text())
    raw["nodes"]["dgx-h100"]["nvls"]["busbw"] = -1
    with pytest.raises(ConfigError, match="nodes.dgx-h100.nvls.busbw"):
        nccl.parse_catalog(raw)
    raw = json.loads(nccl.DATA_FILE.read_text())
    raw["nics"]["ndr"]["in_network_reduction"] = "yes"
    with pytest.raises(ConfigError, match="nics.ndr.in_network_reduction"):
        nccl.parse_catalog(raw)


# ---------------------------------------------------------------- one server: the floor, the crossover, the bandwidth


@pytest.mark.parametrize("gpu, size, published, tolerance", [
    ("a100-80gb", 32 * KIB, 43.83e-6, 0.03),  # Bekman, nccl-tests on 8x A100 at 32 KiB
    ("a100-80gb", 8 * KIB, 8192 * 1.75 / 0.33e9, 0.03),  # Azure ND A100 v4: 0.33 GB/s busbw at 8 KiB
    ("h100-sxm", 1 * KIB, 1024 * 1.75 / 0.07e9, 0.03),  # Azure ND H100 v5: 0.07 GB/s at 1 KiB (25.6 us)
    ("h100-sxm", 8 * KIB, 8192 * 1.75 / 0.53e9, 0.05),  # 0.53 GB/s at 8 KiB (27.0 us)
    ("h200", 16 * KIB, 16384 * 1.75 / 0.93e9, 0.03),  # Azure ND H200 v5: 0.93 GB/s at 16 KiB (30.8 us)
    ("h200", 512 * KIB, 524288 * 1.75 / 29.38e9, 0.03),  # 29.38 GB/s at 512 KiB (31.2 us)
])
def test_a_small_all_reduce_costs_the_published_floor(gpu, size, published, tolerance):
    costs = links(gpu, 8, 1, Layout(tp=8))
    call = tp_call(costs, size)
    assert call["seconds"] == pytest.approx(published, rel=tolerance)
    assert call["seconds"] > call["ring_seconds"]  # the links alone would be faster than NCCL ever is
    assert tp_call(costs, 4)["seconds"] == pytest.approx(call["seconds"], rel=0.03)  # a floor: 4 bytes cost as much


def test_smaller_groups_and_fewer_steps_pay_less_of_the_floor():
    eight, four = links("a100-80gb", 8, 1, Layout(tp=8)), links("a100-80gb", 4, 1, Layout(tp=4))
    assert tp_call(four, 4)["seconds"] < tp_call(eight, 4)["seconds"]
    assert tp_call(eight, 4, "all_gather")["seconds"] < tp_call(eight, 4)["seconds"]


@pytest.mark.parametrize("gpu", ["h200", "h100-sxm"])
def test_nvls_takes_over_from_the_ring_where_the_published_runs_switch(gpu):
    """Bekman, 8x H200, NCCL 2.27.7 (NCCL_DEBUG_SUBSYS=TUNING): Ring LL up to 1 MiB, NVLS Simple from 2 MiB
    (the H100 node has the same NVSwitch 3 and NVLink 4)."""
    costs, ring = links(gpu, 8, 1, Layout(tp=8)), links(gpu, 8, 1, Layout(tp=8), "ring")
    for size in (4, 64 * KIB, 512 * KIB, 1 * MIB):
        call = tp_call(costs, size)
        assert (call["algorithm"], call["protocol"]) == ("ring", "LL"), size
    for size in (2 * MIB, 4 * MIB, 64 * MIB, 4 * GIB):
        call = tp_call(costs, size)
        assert (call["algorithm"], call["protocol"]) == ("nvls", "Simple"), size
        forced = tp_call(ring, size)["seconds"]  # NCCL_NVLS_ENABLE=0: slower, or at 2-4 MiB both at a floor (the
        assert call["seconds"] < forced if size > 4 * MIB else call["seconds"] <= forced  # Simple's, nccl-tests')
    for kind in ("all_gather", "reduce_scatter"):  # Bekman: NCCL ran these on the ring at 16 GiB
        assert tp_call(costs, 16 * GIB, kind)["algorithm"] == "ring"


@pytest.mark.parametrize("gpu, size, algorithm, published", [
    ("h100-sxm", 8 * GIB, "auto", 478.87e9),  # Azure ND H100 v5, NVLS, 8 GiB
    ("h200", 8 * GIB, "auto", 479.98e9),  # Azure ND H200 v5, NVLS, 8 GiB
    ("h200", 16 * GIB, "auto", 482.26e9),  # Bekman 8x H200, NVLS, 16 GiB
    ("h200", 16 * GIB, "ring", 367.61e9),  # Bekman, NCCL_NVLS_ENABLE=0: the ring
    ("h200", 8 * GIB, "ring", 365.6e9),  # Bekman's GPU-count table, 8 GPUs with NVLS off
    ("a100-80gb", 16 * GIB, "auto", 234.89e9),  # Bekman 8x A100 (ring)
    ("a100-80gb", 8 * GIB, "auto", 231.58e9),  # Azure ND A100 v4
])
def test_large_all_reduces_reach_the_published_bus_bandwidth(gpu, size, algorithm, published):
    assert busbw(tp_call(links(gpu, 8, 1, Layout(tp=8), algorithm), size)) == pytest.approx(published, rel=0.02)


@pytest.mark.parametrize("gpus, algorithm, published", [
    (4, "ring", 363.3e9), (5, "nvls", 414.2e9), (6, "nvls", 435.6e9), (7, "nvls", 460.0e9), (8, "nvls", 473.1e9)])
def test_nvls_from_five_h200s_as_bekman_measured(gpus, algorithm, published):
    """Bekman, one 8x H200 node, 8 GiB, n GPUs: the algorithm NCCL picked and its busbw (the model keeps NVLS's
    algorithm bandwidth at the 8-GPU figure; measured, it grows 4% from 5 to 8 GPUs: 6% at 5)."""
    call = tp_call(links("h200", gpus, 1, Layout(tp=gpus)), 8 * GIB)
    assert call["algorithm"] == algorithm
    assert busbw(call) == pytest.approx(published, rel=0.06)


@pytest.mark.parametrize("gpus, algorithm, published", [(5, "ring", 677.8e9), (6, "nvls", 778.2e9),
                                                        (8, "nvls", 838.0e9)])
def test_b200_switches_to_nvls_at_six_gpus(gpus, algorithm, published):
    """Bekman, 8x B200 (p6-b200, NCCL 2.27.7, 8 GiB): the ring at 5 GPUs, NVLS from 6."""
    call = tp_call(links("b200", gpus, 1, Layout(tp=gpus), hardware=b200()), 8 * GIB)
    assert call["algorithm"] == algorithm
    assert busbw(call) == pytest.approx(published, rel=0.08)


def test_a100_has_no_nvls_and_a_forced_one_falls_back_to_the_ring_saying_why():
    costs = links("a100-80gb", 8, 1, Layout(tp=8), "nvls")
    call = tp_call(costs, 1 * GIB)
    assert call["algorithm"] == "ring" and "no NVLink SHARP" in call["note"]
    assert tp_call(links("a100-80gb", 8, 1, Layout(tp=8)), 1 * GIB)["algorithm"] == "ring"


# ---------------------------------------------------------------- across servers: ring and tree


def test_tree_wins_small_all_reduces_across_many_servers_and_the_ring_large_ones():
    """NCCL maintainers (NVIDIA/nccl #790): the ring has the better peak bandwidth, the tree the better base
    latency as one scales; 64 servers of 8x H100 on NDR, a data-parallel group of one GPU a server."""
    costs = links("h100-sxm", 8, 64, Layout(tp=8, dp=64))
    small, large = dp_call(costs, 1 * MIB), dp_call(costs, 1 * GIB)
    assert small["algorithm"] == "tree" and small["seconds"] < small["ring_seconds"] / 4
    assert large["algorithm"] == "ring" and large["seconds"] == large["ring_seconds"]
    sizes = [2**k for k in range(16, 33)]
    picks = [dp_call(costs, s)["algorithm"] for s in sizes]
    switch = picks.index("ring")
    assert picks[:switch] == ["tree"] * switch and picks[switch:] == ["ring"] * (len(sizes) - switch)


def test_the_ring_latency_grows_with_the_servers_and_the_tree_latency_with_their_log():
    def small(nodes: int, algorithm: str) -> float:
        return dp_call(links("h100-sxm", 8, nodes, Layout(tp=8, dp=nodes), algorithm), 8)["seconds"]

    assert small(256, "ring") / small(16, "ring") == pytest.approx(255 / 15, rel=0.02)
    assert small(256, "tree") / small(16, "tree") == pytest.approx(8 / 4, rel=0.02)


def test_on_two_servers_the_tree_beats_the_ring_even_for_large_messages():
    """NVIDIA/nccl #946 (sjeaugey): on two nodes the tree puts half the traffic on the network and can reach
    about twice the network speed, so NCCL uses it for large sizes; #812: Tree above Ring on 2 DGX A100."""
    call = dp_call(links("a100-80gb", 8, 2, Layout(dp=16)), 1 * GIB)
    assert call["algorithm"] == "tree" and call["seconds"] < call["ring_seconds"]


def test_four_h200_servers_run_a_large_all_reduce_on_the_ring():
    """Bekman, 4 servers of 8x H200, 4 GiB over 32 ranks: NCCL picked the ring; NVLSTree forced was slower."""
    costs = links("h200", 8, 4, Layout(dp=32))
    call = dp_call(costs, 4 * GIB)
    assert call["algorithm"] == "ring"
    forced = dp_call(links("h200", 8, 4, Layout(dp=32), "nvlstree"), 4 * GIB)
    assert forced["algorithm"] == "nvlstree" and forced["seconds"] > call["seconds"]


def test_in_network_reduction_only_where_the_fabric_says_so():
    built = build_cluster(load_hardware("h100-sxm"), 8, 16)
    graph = built.graph.copy()
    graph.graph["in_network_reduction"] = True
    layout = Layout(tp=8, dp=16)
    sharp = LinkCosts(Cluster(graph), layout, built.spec)
    plain = LinkCosts(built, layout, built.spec)
    with_sharp, without = dp_call(sharp, 1 * GIB), dp_call(plain, 1 * GIB)
    assert with_sharp["algorithm"] == "collnet" and without["algorithm"] != "collnet"
    assert with_sharp["seconds"] < without["seconds"]
    plain.select("collnet")
    assert "reduces nothing in the network" in dp_call(plain, 1 * GIB)["note"]


# ---------------------------------------------------------------- what the user sees


def test_a_forced_algorithm_is_used_and_listed():
    model = build_config("gpt2-124m", n_layers=2, n_heads=16, d_model=2048)
    cluster = build_cluster(load_hardware("h100-sxm"), 8, 2)
    auto = simulate_step(model, Layout(tp=8, dp=2), cluster, "bf16", 8, 1)
    ring = simulate_step(model, Layout(tp=8, dp=2), cluster, "bf16", 8, 1, nccl_algo="ring")
    tp = [c for c in auto.collectives if c["group"] == "tp" and c["bytes"] >= 2 * MIB]
    assert tp and all(c["algorithm"] == "nvls" for c in tp)
    assert {c["algorithm"] for c in ring.collectives} == {"ring"}
    assert ring.breakdown["tp_comm"] > auto.breakdown["tp_comm"]
    assert auto.as_dict()["collectives"] == auto.collectives


def test_the_json_and_the_table_list_each_collective_with_its_algorithm():
    args = ["simulate", "--model", "gpt2-124m", "--layers", "2", "--heads", "16", "--hidden", "2048", "--gpu", "h100-sxm", "--tp", "8", "--dp", "2",
            "--global-batch", "8"]
    result = CliRunner().invoke(group, [*args, "--json"])
    assert result.exit_code == 0, result.output
    calls = json.loads(result.output)["collectives"]
    assert calls and {"kind", "group", "ranks", "bytes", "algorithm", "protocol", "seconds"} <= set(calls[0])
    assert {c["group"] for c in calls} >= {"tp", "dp"}
    assert any(c["algorithm"] == "nvls" for c in calls)
    text = CliRunner().invoke(group, [*args, "--nccl-algo", "RING"])
    assert text.exit_code == 0, text.output
    assert "ring alone" in text.output and "nvls/" not in text.output and "ring/LL" in text.output


def test_decisions_are_made_once_per_distinct_call():
    costs = links("h100-sxm", 8, 4, Layout(tp=8, dp=4))
    first = costs.dp_collective(0, "all_reduce", 123 * MIB)
    calls = dict(costs.calls)
    assert costs.dp_collective(0, "all_reduce", 123 * MIB) == first and costs.calls == calls
    assert len(costs.collective_calls()) == 1


def test_an_all_reduce_on_one_server_is_no_faster_than_nccl_tests_measured_at_its_size():
    """Azure's ND A100 v4 all_reduce_perf (NCCL 2.18.5, 8 GPUs): 166.63 GB/s bus bandwidth at 64 MiB, 174.18 at 128
    MiB; between them read linearly in log2 of the size; where the links' ring would be faster, the measurement
    holds."""
    from simulator.network.nccl import catalog
    a100 = catalog().nodes["dgx-a100"]
    assert a100.measured_seconds(64 * MIB, 8) == pytest.approx(64 * MIB * 1.75 / 166.63e9)
    middle = (166.63e9 + 174.18e9) / 2  # 2^26.5 bytes: half way in log2
    assert a100.measured_seconds(2**26.5, 8) == pytest.approx(2**26.5 * 1.75 / middle)
    assert a100.measured_seconds(64 * MIB, 4) == 0  # measured on 8 GPUs only
    assert a100.measured_seconds(16 * GIB, 8) == pytest.approx(16 * GIB * 1.75 / 231.58e9)  # the last size held
    costs = links("a100-80gb", 8, 1, Layout(tp=8))
    call = tp_call(costs, 80 * MIB)  # Megatron 2021's tp all-reduce of GPT 76.1B's activations
    assert call["seconds"] == pytest.approx(a100.measured_seconds(80 * MIB, 8))
    assert call["seconds"] > 1.3 * call["ring_seconds"]  # the links' ring: 227 GB/s; nccl-tests: about 168
    assert catalog().nodes["dgx-h100"].measured_seconds(64 * MIB, 8) == 0  # no table of an 8x H100 node stored
