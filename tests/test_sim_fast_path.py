"""simulator/engine/links.py: the fast path (routes by arithmetic, bottleneck shares) against the full
fluid model on every flow, achieved link bandwidth, and the sweep's fabric options and progress."""

from dataclasses import replace

import pytest

import simulator.engine.simulate
from minigpt.config import GPTConfig
from simulator.costs.rates.achieved import Achieved
from simulator.engine.simulate import simulate_step
from simulator.engine.links import LinkCosts
from simulator.costs.hardware import load_hardware, load_nic
from job.layout import Layout
from simulator.search.sweep import ClusterSpec, Job, scaling_sweep
from simulator.network.topology import Cluster, build_cluster

SMALL = GPTConfig(vocab_size=64, seq_len=256, n_layers=16, n_heads=16, d_model=512, d_ff=2048)
NDR, HDR = load_nic("ndr"), load_nic("hdr")
RADIX8 = replace(NDR, switch_radix=8)


def plain(name: str):
    """A preset with nothing discounted (the datasheet's links)."""
    hardware = load_hardware(name)
    return replace(hardware, gpu=replace(hardware.gpu, achieved=None), nic=replace(hardware.nic, busbw_fraction=1.0))


def transfers(links: LinkCosts, layout: Layout) -> dict:
    """Every kind of transfer the engine asks for."""
    out = {}
    for a in range(layout.pp):
        for b in (a - 1, a + 1):
            if 0 <= b < layout.pp:
                out[("p2p", a, b)] = links.p2p(a, b, 3e6)
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        out[("tp", kind)] = links.tp_collective(kind, 5e6)
        out[("pp", kind)] = links.pp_collective(kind, 4)
        for stage in range(layout.pp):
            out[("dp", stage, kind)] = links.dp_collective(stage, kind, 7e6)
    out[("embedding",)] = links.embedding_sync(2e6)
    return out


CASES = [
    (("h100-sxm", 8, 4), Layout(tp=2, pp=4, dp=4)),
    (("a100-80gb", 8, 8, HDR), Layout(tp=8, pp=2, dp=4)),  # four leaves: the embedding sync's flows meet
    (("a100-80gb", 8, 8, HDR), Layout(tp=1, pp=8, dp=8)),
    (("a100-80gb", 8, 8, HDR, "rail"), Layout(tp=4, pp=4, dp=4)),
    (("h100-sxm", 4, 20, RADIX8), Layout(tp=4, pp=4, dp=5)),  # three tiers
    (("h100-sxm", 4, 40, RADIX8), Layout(tp=4, pp=8, dp=5)),  # four tiers
    (("h100-sxm", 4, 20, RADIX8, "rail-only"), Layout(tp=1, pp=4, dp=20)),  # rings cross rails through NVLink
    (("h100-sxm", 4, 20, RADIX8, "fat-tree", None, 3), Layout(tp=4, pp=4, dp=5)),  # oversubscribed 3:1
    (("h100-sxm", 4, 12, RADIX8, "fat-tree", 2), Layout(tp=2, pp=4, dp=6)),  # two GPUs per NIC
]


@pytest.mark.parametrize("args, layout", CASES)
def test_fast_path_equals_the_fluid_model_on_every_flow(args, layout):
    cluster = build_cluster(*args)
    gpu = cluster.spec
    fast = transfers(LinkCosts(cluster, layout, gpu), layout)
    exact = transfers(LinkCosts(cluster, layout, gpu, exact=True), layout)
    for key in fast:
        assert fast[key] == pytest.approx(exact[key], rel=1e-9), key


@pytest.mark.parametrize("args, layout, schedule, v", [
    (("a100-80gb", 8, 8, HDR), Layout(tp=2, pp=4, dp=8, zero=1), "1f1b", 1),
    (("a100-80gb", 8, 8, HDR, "rail"), Layout(tp=4, pp=4, dp=4, zero=3), "gpipe", 1),
    (("h100-sxm", 4, 20, RADIX8), Layout(tp=4, pp=4, dp=5, zero=2), "interleaved", 2),
    (("h100-sxm", 4, 20, RADIX8, "rail-only"), Layout(tp=1, pp=4, dp=20, zero=0), "1f1b", 1),
])
def test_step_time_on_the_fast_path_equals_the_full_path(monkeypatch, args, layout, schedule, v):
    cluster = build_cluster(*args)
    batch = layout.dp * 8

    def step():
        return simulate_step(SMALL, layout, cluster, "bf16", batch, 1, schedule, v).step_time_s

    fast = step()

    class Exact(LinkCosts):
        def __init__(self, cluster, layout, gpu=None):
            super().__init__(cluster, layout, gpu, exact=True)

    monkeypatch.setattr(simulator.engine.simulate, "LinkCosts", Exact)
    assert step() == pytest.approx(fast, rel=1e-9)


@pytest.mark.parametrize("args, layout", [(("h100-sxm", 8, 4), Layout(tp=2, pp=4, dp=4)),
                                          (("a100-80gb", 8, 2, HDR), Layout(tp=1, pp=2, dp=8))])
def test_a_cluster_read_from_a_file_costs_the_same_where_the_fabric_is_one_leaf(args, layout):
    built = build_cluster(*args)
    loaded = Cluster(built.graph)  # routed on its graph, each distinct hop timed once (today's algorithm)
    fast, graph = transfers(LinkCosts(built, layout, built.spec), layout), transfers(LinkCosts(loaded, layout, built.spec), layout)
    for key in fast:
        assert fast[key] == pytest.approx(graph[key], rel=1e-9), key


# ------------------------------------------------------------------ achieved link bandwidth


def test_links_run_at_the_achieved_fraction_of_the_datasheet():
    hardware = plain("a100-80gb")  # on a node without nccl-tests' measured all-reduce (the ring as modelled)
    gpu = replace(hardware.gpu, achieved=Achieved(nvlink_fraction=0.8, source="test"), node="unmeasured")
    nic = replace(hardware.nic, busbw_fraction=0.9)
    cluster = build_cluster(replace(hardware, gpu=gpu, nic=nic), 8, 2)
    assert cluster.busbw_fraction == 0.9
    links, datasheet = LinkCosts(cluster, Layout(tp=8, pp=2), gpu), LinkCosts(cluster, Layout(tp=8, pp=2))
    s = 64e6
    nvlink = 2 * 7 * (gpu.nvlink_latency + s / 8 / (0.8 * gpu.nvlink_bandwidth))  # a ring: bus bandwidth = 0.8 x NVLink
    assert links.tp_collective("all_reduce", s) == pytest.approx(nvlink, rel=1e-12)
    assert datasheet.tp_collective("all_reduce", s) == pytest.approx(
        2 * 7 * (gpu.nvlink_latency + s / 8 / gpu.nvlink_bandwidth), rel=1e-12)
    across = nic.latency + nic.switch_latency + s / (0.9 * nic.bandwidth)
    assert links.p2p(0, 1, s) == pytest.approx(across, rel=1e-12)
    dp = LinkCosts(cluster, Layout(dp=16), gpu)
    dp.select("ring")  # the ring's links (on two servers NCCL would pick the tree: tests/test_sim_nccl.py)
    # busbw as nccl-tests defines it: 2(n-1)/n S / t tends to 0.9 x the line rate for large S
    big = 16e9
    busbw = 2 * 15 / 16 * big / dp.dp_collective(0, "all_reduce", big)
    assert busbw == pytest.approx(0.9 * nic.bandwidth, rel=1e-3)


def test_fractions_default_to_one_and_the_presets_carry_theirs():
    hardware = plain("h100-sxm")
    assert hardware.gpu.reached.nvlink_fraction == 1.0 and build_cluster(hardware, 8, 2).busbw_fraction == 1.0
    preset = load_hardware("h100-sxm")
    cluster = build_cluster(preset, 8, 2)
    links = LinkCosts(cluster, Layout(tp=8, pp=2), preset.gpu)
    assert links.fractions.nvlink == preset.gpu.reached.nvlink_fraction
    assert links.fractions.network == preset.nic.busbw_fraction == cluster.attributes["busbw_fraction"]


# ------------------------------------------------------------------ sweeps


def test_sweep_builds_the_fabric_asked_for_and_reports_progress():
    spec = ClusterSpec.of("h100-sxm", fabric="ndr", kind="rail-only", nics_per_node=4, oversubscription=2)
    cluster = spec.build(64)
    assert cluster.fabric.kind == "rail-only" and cluster.fabric.nics_per_node == 4 and cluster.fabric.oversubscription == 2
    assert spec.build(4).fabric.nics_per_node == 2  # half a server keeps two GPUs per NIC
    calls = []
    job = Job(SMALL, "bf16", global_batch=32, micro_batch=1, zero=1)
    sweep = scaling_sweep(job, [8, 16, 32], spec, "strong", tp=2, pp=2, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 3), (2, 3), (3, 3)] and len(sweep.points) == 3
