"""Cluster graphs: shapes of the built topologies, routes, files in and out, bad files rejected."""

import json

import networkx as nx
import pytest

from minigpt.errors import ConfigError
from simulator.costs.hardware import load_hardware, load_nic
from simulator.network.topology import Cluster, build_cluster, load_cluster, save_cluster


def types_on(cluster, route):
    nodes = [route[0][0]] + [v for _, v in route]
    return [cluster.graph.nodes[node]["type"] for node in nodes]


def counts(cluster):
    return cluster.summary()["devices"], cluster.graph.number_of_edges()


# ------------------------------------------------------------------ shapes


def test_fat_tree_on_one_leaf_has_no_spine():
    devices, edges = counts(build_cluster("h100-sxm", 8, 2, kind="fat-tree"))
    assert devices == {"gpu": 16, "nvswitch": 2, "nic": 16, "leaf": 1}
    assert edges == 2 * (16 + 16 + 16)  # gpu-nvswitch, gpu-nic, nic-leaf, both directions


def test_fat_tree_with_spines():
    # HDR switches have 40 ports: 20 down per leaf, so 3 x 8 NICs fill two leaves (20 + 4); the busiest
    # leaf needs 20 cables up, and one 40-port spine takes both leaves' 20 (merged into one edge each)
    cluster = build_cluster("a100-80gb", 8, 3, fabric="hdr", kind="fat-tree")
    devices, edges = counts(cluster)
    assert devices == {"gpu": 24, "nvswitch": 3, "nic": 24, "leaf": 2, "spine": 1}
    assert edges == 2 * (3 * 24) + 2 * 2
    nic_leaf = {nic: next(n for n in cluster.graph.successors(nic) if n.startswith("leaf")) for nic in cluster.graph if "nic" in nic}
    assert sum(leaf == "leaf0" for leaf in nic_leaf.values()) == 20
    assert cluster.graph.edges["leaf0", "spine0"]["bandwidth"] == 20 * load_nic("hdr").bandwidth


def test_rail_optimised():
    cluster = build_cluster("h100-sxm", 8, 2, kind="rail")
    devices, edges = counts(cluster)
    assert devices == {"gpu": 16, "nvswitch": 2, "nic": 16, "leaf": 8, "spine": 1}
    assert edges == 2 * (3 * 16) + 2 * 8
    for node in range(2):
        for local in range(8):
            (leaf,) = [n for n in cluster.graph.successors(f"node{node}/nic{local}") if n.startswith("leaf")]
            assert cluster.graph.nodes[leaf]["rail"] == local


def test_links_carry_hardware_numbers():
    hardware = load_hardware("h100-sxm")
    cluster = build_cluster(hardware, 8, 2)
    graph = cluster.graph
    assert graph.edges["node0/gpu3", "node0/nvswitch"]["bandwidth"] == hardware.gpu.nvlink_bandwidth
    assert graph.edges["node0/nic3", "leaf0"]["bandwidth"] == hardware.nic.bandwidth
    assert cluster.route_latency(0, 1) == pytest.approx(hardware.gpu.nvlink_latency)
    assert cluster.route_latency(0, 8) == pytest.approx(hardware.nic.latency + hardware.nic.switch_latency)
    assert cluster.route_bandwidth(0, 8) == hardware.nic.bandwidth
    hdr = build_cluster("h100-sxm", 8, 2, fabric="hdr")
    assert hdr.route_bandwidth(0, 8) == load_nic("hdr").bandwidth


def test_rank_order_is_node_major():
    cluster = build_cluster("h100-sxm", 4, 3)
    assert cluster.gpus[:5] == ["node0/gpu0", "node0/gpu1", "node0/gpu2", "node0/gpu3", "node1/gpu0"]
    assert [cluster.node_of(rank) for rank in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert cluster.gpu_id(5) == "node1/gpu1" and cluster.node_of("node2/gpu0") == 2
    with pytest.raises(ConfigError, match="outside"):
        cluster.gpu_id(12)
    with pytest.raises(ConfigError, match="not a GPU"):
        cluster.gpu_id("node0/nic0")


def test_bad_build_arguments():
    with pytest.raises(ConfigError, match="nodes must be a positive integer"):
        build_cluster("h100-sxm", 8, 0)
    with pytest.raises(ConfigError, match="unknown cluster kind 'torus'"):
        build_cluster("h100-sxm", 8, 2, kind="torus")
    with pytest.raises(ConfigError, match="unknown network fabric"):
        build_cluster("h100-sxm", 8, 2, fabric="xdr")
    with pytest.raises(ConfigError, match="unknown hardware"):
        build_cluster("v100", 8, 2)


# ------------------------------------------------------------------ routes


@pytest.mark.parametrize("kind", ["fat-tree", "rail"])
def test_routes_inside_a_node_use_the_nvswitch(kind):
    cluster = build_cluster("h100-sxm", 8, 2, kind=kind)
    for src in range(8, 16):
        for dst in range(8, 16):
            route = cluster.route(src, dst)
            if src == dst:
                assert route == []
            else:
                assert types_on(cluster, route) == ["gpu", "nvswitch", "gpu"]


@pytest.mark.parametrize("kind", ["fat-tree", "rail"])
def test_routes_across_nodes_go_through_the_nics(kind):
    cluster = build_cluster("h100-sxm", 8, 8, kind=kind)
    for src, dst in [(0, 8), (7, 8), (3, 60), (63, 0)]:
        route = cluster.route(src, dst)
        kinds = types_on(cluster, route)
        assert kinds[:3] == ["gpu", "nic", "leaf"] and kinds[-2:] == ["nic", "gpu"]
        assert kinds[3:-2] in ([], ["spine", "leaf"])
        assert all(cluster.graph.has_edge(u, v) for u, v in route)
        assert route[0][0] == cluster.gpu_id(src) and route[-1][1] == cluster.gpu_id(dst)
        # the GPU's own NIC on both ends
        assert route[0][1] == cluster.gpu_id(src).replace("gpu", "nic")
        assert route[-1][0] == cluster.gpu_id(dst).replace("gpu", "nic")


def test_same_rail_stays_on_its_leaf_and_other_rails_cross_a_spine():
    cluster = build_cluster("h100-sxm", 8, 2, kind="rail")
    assert "spine" not in types_on(cluster, cluster.route(3, 11))
    assert "spine" in types_on(cluster, cluster.route(7, 8))


def cables(cluster, edge):
    return cluster.graph.edges[edge]["bandwidth"] / cluster.nic.bandwidth


def test_shifted_flows_between_leaves_never_share_a_cable():
    # rail 0's leaves: nodes 0-31 on leaf0, 32-63 on leaf8; 32 flows leaf8 -> leaf0 (node i+32 -> node i)
    cluster = build_cluster("h100-sxm", 8, 64, kind="rail")
    assert cluster.fabric.tiers == 2 and cluster.fabric.switch_counts == (16, 8)
    load: dict = {}
    for node in range(32):
        for edge in cluster.route(8 * (node + 32), 8 * node):
            load[edge] = load.get(edge, 0) + 1
    switch_edges = [e for e in load if "spine" in e[0] + e[1]]
    assert {e[1] for e in switch_edges if e[0] == "leaf8"} == {f"spine{i}" for i in range(8)}  # every spine used
    assert all(load[e] == cables(cluster, e) == 4 for e in switch_edges)  # each merged edge full, none over


def test_fat_tree_spreads_flows_over_spines():
    # 64 nodes x 8 NDR NICs = 16 leaves of 32: 512 cables up need 8 spines, each leaf sends 4 cables to each
    cluster = build_cluster("h100-sxm", 8, 64, kind="fat-tree")
    uplinks = [cluster.route(local, 32 + local)[2] for local in range(32)]
    assert all(u == "leaf0" for u, _ in uplinks)
    assert {v for _, v in uplinks} == {f"spine{i}" for i in range(8)}
    assert all(cables(cluster, ("leaf0", f"spine{i}")) == 4 for i in range(8))


# ------------------------------------------------------------------ files


def same_graph(a: Cluster, b: Cluster) -> None:
    assert dict(a.graph.nodes(data=True)) == dict(b.graph.nodes(data=True))
    assert {(u, v): d for u, v, d in a.graph.edges(data=True)} == {(u, v): d for u, v, d in b.graph.edges(data=True)}
    assert a.gpus == b.gpus
    assert all(a.route(s, d) == b.route(s, d) for s in range(len(a.gpus)) for d in range(len(a.gpus)))


@pytest.mark.parametrize("suffix", [".json", ".graphml"])
@pytest.mark.parametrize("kind", ["fat-tree", "rail"])
def test_files_round_trip(tmp_path, suffix, kind):
    cluster = build_cluster("a100-80gb", 4, 3, kind=kind)
    loaded = load_cluster(save_cluster(cluster, tmp_path / f"cluster{suffix}"))
    same_graph(cluster, loaded)
    assert loaded.graph.graph["kind"] == kind


def test_undirected_hand_written_file_loads(tmp_path):
    graph = nx.Graph()
    graph.add_node("a", type="gpu", node=0, local=0)
    graph.add_node("b", type="gpu", node=0, local=1)
    graph.add_node("s", type="nvswitch", node=0)
    graph.add_edge("a", "s", bandwidth=1e9, latency=1e-6)
    graph.add_edge("b", "s", bandwidth=1e9, latency=1e-6)
    path = tmp_path / "small.json"
    path.write_text(json.dumps(nx.node_link_data(graph, edges="links")))
    cluster = load_cluster(path)
    assert cluster.route("b", "a") == [("b", "s"), ("s", "a")]


def write_node_link(tmp_path, edit) -> str:
    data = nx.node_link_data(build_cluster("h100-sxm", 2, 2).graph, edges="edges")
    edit(data)
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(data))
    return path


def _drop_gpu_links(data):
    data["edges"] = [e for e in data["edges"] if "node1/gpu1" not in (e["source"], e["target"])]


BROKEN_FILES = {
    "unknown node type": (lambda d: d["nodes"][0].update(type="router"), "unknown type 'router'"),
    "edge without bandwidth": (lambda d: d["edges"][0].pop("bandwidth"), "no numeric 'bandwidth'"),
    "negative bandwidth": (lambda d: d["edges"][0].update(bandwidth=-5), "bandwidth > 0"),
    "disconnected GPU": (_drop_gpu_links, "node1/gpu1"),
    "GPU without place": (lambda d: [n.pop("local") for n in d["nodes"] if n["type"] == "gpu"], "'local'"),
    "no GPUs": (lambda d: d.update(nodes=[n for n in d["nodes"] if n["type"] != "gpu"], edges=[]), "no GPU"),
    "not node-link": (lambda d: d.pop("edges"), "not node-link"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_FILES))
def test_malformed_files_are_rejected(tmp_path, case):
    edit, message = BROKEN_FILES[case]
    with pytest.raises(ConfigError, match=message):
        load_cluster(write_node_link(tmp_path, edit))


def test_unreadable_files_are_rejected(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{nodes: ")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_cluster(bad_json)
    bad_graphml = tmp_path / "bad.graphml"
    bad_graphml.write_text("<graphml><graph>")
    with pytest.raises(ConfigError, match="not valid GraphML"):
        load_cluster(bad_graphml)
    with pytest.raises(ConfigError, match="does not exist"):
        load_cluster(tmp_path / "missing.graphml")
    with pytest.raises(ConfigError, match=r"\.json \(node-link\) or \.graphml"):
        load_cluster(tmp_path / "cluster.yaml")
    with pytest.raises(ConfigError, match=r"\.json \(node-link\) or \.graphml"):
        save_cluster(build_cluster("h100-sxm", 2, 1), tmp_path / "cluster.txt")
