"""The fabric as built: switch counts from the radix, tiers, oversubscription, NICs per node, rail-only routes."""

import itertools
import random
from dataclasses import replace

import pytest

from minigpt.errors import ConfigError
from simulator.network.collectives import Network
from simulator.network.fabric import Fabric
from simulator.costs.hardware import load_hardware, load_nic
from simulator.network.topology import Cluster, build_cluster, load_cluster, save_cluster

NDR, HDR = load_nic("ndr"), load_nic("hdr")
RADIX8 = replace(NDR, switch_radix=8)  # small switches: three and four tiers on a few dozen GPUs


def types_on(cluster, route):
    nodes = [route[0][0]] + [v for _, v in route]
    return [cluster.graph.nodes[node]["type"] for node in nodes]


# ------------------------------------------------------------------ switch counts


@pytest.mark.parametrize("nic, nodes, tiers, switches", [
    (NDR, 2, 1, (1,)),  # 16 NICs on one 32-down leaf
    (NDR, 4, 1, (1,)),
    (NDR, 8, 2, (2, 1)),  # 2 leaves x 32 cables up = one 64-port spine
    (NDR, 256, 2, (64, 32)),  # 2,048 NICs = R^2/2: the largest two-tier fabric
    (NDR, 257, 3, (65, 96, 64)),  # one more node: a third tier (3 pods of 32 leaves, 32 spines each)
    (NDR, 384, 3, (96, 96, 64)),  # 3,072 GPUs
    (HDR, 3, 2, (2, 1)),
    (HDR, 100, 2, (40, 20)),  # 800 NICs = R^2/2 for 40 ports
    (HDR, 384, 3, (154, 160, 80)),  # 3,072 A100s on HDR
    (HDR, 2048, 4, (820, 820, 1200, 800)),  # 16,384 A100s: past R^3/4 = 16,000 NICs, a fourth tier
])
def test_switch_counts(nic, nodes, tiers, switches):
    fabric = build_cluster("h100-sxm", 8, nodes, nic).fabric
    assert fabric.tiers == tiers
    assert fabric.switch_counts == switches


@pytest.mark.parametrize("args", [
    ("a100-80gb", 8, 3, HDR), ("h100-sxm", 8, 8, NDR), ("h100-sxm", 4, 9, RADIX8), ("h100-sxm", 4, 40, RADIX8),
    ("h100-sxm", 4, 20, RADIX8, "rail"), ("h100-sxm", 4, 20, RADIX8, "rail-only"), ("h100-sxm", 2, 60, replace(NDR, switch_radix=6)),
    ("h100-sxm", 4, 30, RADIX8, "fat-tree", None, 3),
])
def test_every_switch_respects_the_radix_and_the_tree_is_non_blocking_unless_asked(args):
    cluster = build_cluster(*args)
    graph, radix, nic = cluster.graph, cluster.nic.switch_radix, cluster.nic.bandwidth
    blocking = cluster.fabric.oversubscription > 1
    for switch, data in graph.nodes(data=True):
        if data["type"] not in ("leaf", "spine"):
            continue
        down = sum(graph.edges[switch, v]["bandwidth"] / nic for v in graph.successors(switch)
                   if graph.nodes[v]["type"] == "nic" or graph.nodes[v].get("tier", 0) < data["tier"])
        up = sum(graph.edges[switch, v]["bandwidth"] / nic for v in graph.successors(switch)
                 if graph.nodes[v]["type"] != "nic" and graph.nodes[v].get("tier", 0) > data["tier"])
        assert down + up <= radix, (switch, down, up)
        if up:
            assert up * (cluster.fabric.leaf_oversubscription if blocking and data["tier"] == 1 else 1) >= down, switch
    assert cluster.summary()["devices"] == Cluster(graph).summary()["devices"]
    assert cluster.summary()["edges"] == graph.number_of_edges()


def test_a_big_cluster_is_not_drawn_until_asked():
    cluster = build_cluster("a100-80gb", 8, 12_500, "hdr")  # 100,000 GPUs
    assert cluster.n_gpus == 100_000 and cluster.fabric.tiers == 4
    last = cluster.n_gpus - 1
    route = cluster.route(0, last)  # GPU, NIC, leaf, up three tiers, down three, NIC, GPU
    assert route[0] == ("node0/gpu0", "node0/nic0") and route[-1][1] == "node12499/gpu7" and len(route) == 10
    assert cluster.route_latency(0, last) == pytest.approx(HDR.latency + 7 * HDR.switch_latency)
    assert cluster.summary()["switches_per_tier"] == list(cluster.fabric.switch_counts)
    assert "graph" not in cluster.__dict__


# ------------------------------------------------------------------ oversubscription


def test_oversubscription_is_asked_for_and_stated():
    plain = build_cluster("h100-sxm", 8, 384)  # 3,072 NDR NICs: three tiers
    cheap = build_cluster("h100-sxm", 8, 384, oversubscription=3)  # 48 down, 16 up: two tiers
    assert plain.fabric.tiers == 3 and "non-blocking" in plain.describe()
    assert cheap.fabric.tiers == 2 and cheap.fabric.switch_counts == (64, 16)
    assert "oversubscribed 3:1 at the leaves" in cheap.describe()
    assert cheap.summary()["leaf_oversubscription"] == 3
    assert cheap.attributes["oversubscription"] == 3
    with pytest.raises(ConfigError, match="oversubscription must be a number >= 1"):
        build_cluster("h100-sxm", 8, 4, oversubscription=0.5)


def test_oversubscribed_uplinks_are_shared():
    # 2:1 with 8 ports: leaves of 5 NICs (ports 5 down, 3 up); all 5 NICs of leaf 0 send to leaf 1 at once
    cluster = build_cluster("h100-sxm", 5, 4, RADIX8, nics_per_node=5, oversubscription=2)
    assert cluster.fabric.leaf_down == 5 and cluster.fabric.uplinks[0] == 3
    net = Network(cluster)
    done = [net.transfer(i, 5 + i, 1e9) for i in range(5)]
    net.env.run(until=net.env.all_of(done))
    latency = cluster.route_latency(0, 5)
    assert net.env.now > latency + 1e9 / NDR.bandwidth * 1.5  # two flows share a cable somewhere


# ------------------------------------------------------------------ NICs per node


def test_nics_per_node_come_from_the_node_and_can_be_fewer():
    assert build_cluster("a100-80gb", 8, 2).fabric.nics_per_node == load_hardware("a100-80gb").node.nics_per_node == 8
    assert build_cluster("a100-80gb", 4, 2).fabric.nics_per_node == 4  # a partly filled server keeps one per GPU
    shared = build_cluster("h100-sxm", 8, 2, nics_per_node=4)
    assert shared.summary()["devices"]["nic"] == 8
    assert shared.route(1, 9)[0] == ("node0/gpu1", "node0/nic0")  # GPUs 0 and 1 share NIC 0
    assert types_on(shared, shared.route(0, 1)) == ["gpu", "nvswitch", "gpu"]  # never through the shared NIC
    net = Network(shared)
    both = net.env.all_of([net.transfer(0, 8, 1e9), net.transfer(1, 9, 1e9)])
    net.env.run(until=both)
    assert net.env.now == pytest.approx(shared.route_latency(0, 8) + 2e9 / NDR.bandwidth, rel=1e-9)  # one NIC, two flows
    for bad in (0, 9):
        with pytest.raises(ConfigError, match="nics_per_node must be a whole number from 1 to gpus_per_node"):
            build_cluster("h100-sxm", 8, 2, nics_per_node=bad)


# ------------------------------------------------------------------ rail-only


def test_rail_only_has_no_spine_between_rails_and_goes_through_nvlink_first():
    cluster = build_cluster("h100-sxm", 8, 4, kind="rail-only")
    assert cluster.fabric.trees == 8 and cluster.fabric.switch_counts == (8,)
    assert "rail-only" in cluster.describe() and "8 separate rails" in cluster.describe()
    nvlink, nic = load_hardware("h100-sxm").gpu.nvlink_latency, NDR
    same_rail = cluster.route(3, 11)
    assert types_on(cluster, same_rail) == ["gpu", "nic", "leaf", "nic", "gpu"]
    other_rail = cluster.route(3, 12)  # node0/gpu3 -> node1/gpu4: NVLink to node0/gpu4, then rail 4
    assert types_on(cluster, other_rail) == ["gpu", "nvswitch", "gpu", "nic", "leaf", "nic", "gpu"]
    assert other_rail[1][1] == "node0/gpu4" and other_rail[3][1] == "rail4/leaf0"
    assert cluster.route_latency(3, 12) == pytest.approx(nvlink + nic.latency + nic.switch_latency)
    assert not any(cluster.graph.has_edge(f"rail{a}/leaf0", f"rail{b}/leaf0") for a in range(8) for b in range(8))


def test_rail_only_rails_grow_their_own_tiers():
    cluster = build_cluster("h100-sxm", 4, 20, RADIX8, kind="rail-only")  # 20 nodes per rail, leaves of 4
    assert cluster.fabric.tiers == 2 and cluster.fabric.switch_counts == (20, 16)
    kinds = types_on(cluster, cluster.route(0, 4 * 19 + 1))  # rail 1 of the last node: NVLink, then rail 1's spine
    assert kinds == ["gpu", "nvswitch", "gpu", "nic", "leaf", "spine", "leaf", "nic", "gpu"]
    switch_edges = [edge for edge in cluster.route(0, 4 * 19 + 1) if "node" not in edge[0] + edge[1]]
    assert len(switch_edges) == 2 and all(a.startswith("rail1/") and b.startswith("rail1/") for a, b in switch_edges)


def test_a_saved_rail_only_cluster_routes_the_same_way(tmp_path):
    built = build_cluster("h100-sxm", 4, 3, kind="rail-only")
    loaded = load_cluster(save_cluster(built, tmp_path / "rail-only.json"))
    for src, dst in [(0, 5), (1, 4), (3, 8), (6, 6)]:
        assert loaded.route(src, dst) == built.route(src, dst)
    assert loaded.busbw_fraction == built.busbw_fraction == NDR.busbw_fraction


# ------------------------------------------------------------------ routes by arithmetic = routes on the graph


@pytest.mark.parametrize("args", [
    ("a100-80gb", 8, 3, HDR), ("h100-sxm", 8, 2, NDR, "rail"), ("h100-sxm", 4, 9, RADIX8), ("h100-sxm", 4, 40, RADIX8),
    ("h100-sxm", 4, 20, RADIX8, "rail"), ("h100-sxm", 4, 20, RADIX8, "rail-only"), ("h100-sxm", 4, 12, RADIX8, "fat-tree", 2),
    ("h100-sxm", 4, 30, RADIX8, "fat-tree", None, 3),
])
def test_routes_by_arithmetic_are_shortest_paths_of_the_drawn_graph(args):
    built = build_cluster(*args)
    graph = Cluster(built.graph)  # the same cluster, routed by breadth-first search
    pairs = list(itertools.product(range(built.n_gpus), repeat=2))
    for src, dst in random.Random(0).sample(pairs, min(len(pairs), 600)):
        route = built.route(src, dst)
        assert all(graph.graph.has_edge(*edge) for edge in route)
        assert all(a[1] == b[0] for a, b in zip(route, route[1:]))
        assert len(route) == len(graph.route(src, dst))
        assert built.route_latency(src, dst) == pytest.approx(graph.route_latency(src, dst), abs=1e-15)
        assert built.route_bandwidth(src, dst) == graph.route_bandwidth(src, dst)


def test_fabric_rejects_what_cannot_be_built():
    with pytest.raises(ConfigError, match="unknown cluster kind"):
        Fabric("dragonfly", 2, 8, 8, 64)
    with pytest.raises(ConfigError, match="at least 2 ports"):
        Fabric("fat-tree", 2, 8, 8, 1)
