"""Collectives against their alpha-beta closed forms, and the fair sharing of links.

The closed-form tests use one server whose n GPUs hang on an NVSwitch, every edge with
bandwidth B and latency a. A GPU-to-GPU path is two edges (GPU -> switch -> GPU), so
one message costs alpha = 2a, and the bandwidth seen is beta = B (the two edges are
crossed at once, not store-and-forward).
"""

import math

import networkx as nx
import pytest

from minigpt.errors import ConfigError
from simulator.network.collectives import (
    Flow,
    LinkFractions,
    Network,
    hierarchical_all_reduce,
    ring_all_reduce,
    set_max_min_rates,
    simulate_collective,
)
from simulator.network.topology import Cluster, build_cluster

B = 100e9  # bytes/s per edge
A = 1e-6  # seconds per edge
ALPHA = 2 * A  # one GPU -> NVSwitch -> GPU message
S = 64e6  # bytes


def star(n: int, bandwidth: float = B, latency: float = A) -> Cluster:
    graph = nx.DiGraph()
    graph.add_node("switch", type="nvswitch", node=0)
    for i in range(n):
        graph.add_node(f"gpu{i}", type="gpu", node=0, local=i)
        graph.add_edge(f"gpu{i}", "switch", bandwidth=bandwidth, latency=latency)
        graph.add_edge("switch", f"gpu{i}", bandwidth=bandwidth, latency=latency)
    return Cluster(graph)


def run(cluster, kind, n, nbytes=S, **options):
    return simulate_collective(cluster, kind, list(range(n)), nbytes, **options)


# ------------------------------------------------------------------ closed forms


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_all_reduce(n):
    expected = 2 * (n - 1) * ALPHA + 2 * (n - 1) / n * S / B
    assert run(star(n), "all-reduce", n) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("kind", ["all-gather", "reduce-scatter"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_gather_and_reduce_scatter(kind, n):
    expected = (n - 1) * ALPHA + (n - 1) / n * S / B
    assert run(star(n), kind, n) == pytest.approx(expected, rel=1e-9)


def test_p2p_and_broadcast_to_one():
    assert run(star(2), "p2p", 2) == pytest.approx(S / B + ALPHA, rel=1e-9)
    assert run(star(2), "broadcast", 2) == pytest.approx(S / B + ALPHA, rel=1e-9)


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_binomial_broadcast(n):
    rounds = math.ceil(math.log2(n))
    assert run(star(n), "broadcast", n) == pytest.approx(rounds * (ALPHA + S / B), rel=1e-9)
    root_last = simulate_collective(star(n), "broadcast", list(range(n)), S, root=n - 1)
    assert root_last == pytest.approx(rounds * (ALPHA + S / B), rel=1e-9)


def test_tree_all_reduce():
    # 7 ranks: a full binary tree of depth 2; a parent takes two children's messages over
    # its one incoming link (or sends two over its outgoing link), so each level costs alpha + 2S/B.
    assert run(star(7), "tree-all-reduce", 7) == pytest.approx(4 * (ALPHA + 2 * S / B), rel=1e-9)
    assert run(star(2), "tree-all-reduce", 2) == pytest.approx(2 * (ALPHA + S / B), rel=1e-9)


@pytest.mark.parametrize("chunks", [1, 4, 16])
def test_pipelined_tree_all_reduce(chunks):
    # 2 ranks: chunk c goes up while chunk c-1 comes down on the reverse links.
    expected = (chunks + 1) * (ALPHA + S / chunks / B)
    assert run(star(2), "tree-all-reduce", 2, chunks=chunks) == pytest.approx(expected, rel=1e-9)


def test_empty_and_single_groups():
    assert run(star(4), "all-reduce", 1) == 0.0
    assert run(star(4), "tree-all-reduce", 1) == 0.0
    assert run(star(4), "all-reduce", 4, nbytes=0) == pytest.approx(6 * ALPHA, rel=1e-9)


# ------------------------------------------------------------------ sharing


def test_two_flows_over_one_link_take_twice_as_long():
    cluster = star(3, latency=0.0)
    alone = simulate_collective(cluster, "p2p", [0, 2], S)
    net = Network(cluster)
    both = net.env.all_of([net.transfer(0, 2, S), net.transfer(1, 2, S)])
    net.env.run(until=both)
    assert alone == pytest.approx(S / B, rel=1e-12)
    assert net.env.now == pytest.approx(2 * alone, rel=1e-12)


def test_rates_are_recomputed_when_a_flow_ends():
    net = Network(star(3, latency=0.0))
    short, long = net.transfer(0, 2, S), net.transfer(1, 2, 2 * S)
    ends = {}
    for name, event in (("short", short), ("long", long)):
        event.callbacks.append(lambda _event, name=name: ends.__setitem__(name, net.env.now))
    net.env.run()
    assert ends["short"] == pytest.approx(2 * S / B, rel=1e-12)  # at B/2 while both run
    assert ends["long"] == pytest.approx(3 * S / B, rel=1e-12)  # then alone at B


def test_progressive_filling_gives_spare_bandwidth_to_others():
    # flow x is held to B/4 by its first edge; y then gets the rest of the shared edge.
    capacity = {("x0", "s"): B / 4, ("y0", "s"): B, ("s", "d"): B}
    x = Flow(edges=[("x0", "s"), ("s", "d")], remaining=1.0, done=None)
    y = Flow(edges=[("y0", "s"), ("s", "d")], remaining=1.0, done=None)
    set_max_min_rates([x, y], capacity.__getitem__)
    assert x.rate == pytest.approx(B / 4) and y.rate == pytest.approx(3 * B / 4)


def test_concurrent_all_reduces_on_disjoint_gpus_do_not_interfere():
    cluster = star(8)
    alone = run(cluster, "all-reduce", 4)
    net = Network(cluster)
    both = net.env.all_of([ring_all_reduce(net, [0, 1, 2, 3], S), ring_all_reduce(net, [4, 5, 6, 7], S)])
    net.env.run(until=both)
    assert net.env.now == pytest.approx(alone, rel=1e-9)


# ------------------------------------------------------------------ real clusters


@pytest.mark.parametrize("kind, nodes", [("fat-tree", 2), ("rail", 2), ("fat-tree", 8), ("rail", 8)])
def test_flat_ring_across_nodes_is_bound_by_the_nic(kind, nodes):
    cluster = build_cluster("h100-sxm", 8, nodes, kind=kind)
    n, nic = 8 * nodes, cluster.route_bandwidth(7, 8)
    flat = run(cluster, "all-reduce", n)
    # every step waits for the slowest transfer crossing the NICs (no two share a link)
    slowest = max(cluster.route_latency(i, (i + 1) % n) for i in range(7, n, 8))
    expected = 2 * (n - 1) * (slowest + S / n / nic)
    assert flat >= 2 * (n - 1) / n * S / nic
    assert flat == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("kind", ["fat-tree", "rail"])
def test_hierarchical_all_reduce_beats_the_flat_ring(kind):
    cluster = build_cluster("h100-sxm", 8, 2, kind=kind)
    flat = run(cluster, "all-reduce", 16)
    hierarchical = run(cluster, "hierarchical-all-reduce", 16)
    nvlink, nic = cluster.route_bandwidth(0, 1), cluster.route_bandwidth(0, 8)
    inside = 7 * (cluster.route_latency(0, 1) + S / 8 / nvlink)  # reduce-scatter, and again all-gather
    across = 2 * (cluster.route_latency(0, 8) + S / 16 / nic)  # 8 rings of 2 ranks on 8 NICs at once
    assert hierarchical == pytest.approx(2 * inside + across, rel=1e-9)
    assert hierarchical < flat / 4


def test_hierarchical_all_reduce_on_one_node_is_the_ring():
    cluster = build_cluster("h100-sxm", 8, 2)
    assert run(cluster, "hierarchical-all-reduce", 8) == pytest.approx(run(cluster, "all-reduce", 8), rel=1e-9)


# ------------------------------------------------------------------ achieved bandwidth


@pytest.mark.parametrize("n", [2, 8])
def test_nvlink_fraction_scales_the_bus_bandwidth_of_a_ring(n):
    fractions = LinkFractions(nvlink=0.75)
    time = simulate_collective(star(n), "all-reduce", list(range(n)), S, fractions=fractions)
    assert time == pytest.approx(2 * (n - 1) * ALPHA + 2 * (n - 1) / n * S / (0.75 * B), rel=1e-9)
    # nccl-tests' bus bandwidth of this run, latency aside, is the fraction of the link
    assert 2 * (n - 1) / n * S / (time - 2 * (n - 1) * ALPHA) == pytest.approx(0.75 * B, rel=1e-9)


def test_network_fraction_applies_across_nodes_only():
    cluster = build_cluster("h100-sxm", 8, 2)
    fractions = LinkFractions(nvlink=0.5, network=0.8)
    across = simulate_collective(cluster, "p2p", [0, 8], S, fractions=fractions)
    inside = simulate_collective(cluster, "p2p", [0, 1], S, fractions=fractions)
    assert across == pytest.approx(cluster.route_latency(0, 8) + S / (0.8 * cluster.route_bandwidth(0, 8)), rel=1e-9)
    assert inside == pytest.approx(cluster.route_latency(0, 1) + S / (0.5 * cluster.route_bandwidth(0, 1)), rel=1e-9)
    assert simulate_collective(cluster, "p2p", [0, 8], S) == pytest.approx(
        cluster.route_latency(0, 8) + S / cluster.route_bandwidth(0, 8), rel=1e-9)  # none given: the datasheet


@pytest.mark.parametrize("bad", [0, 1.5, -0.2, True])
def test_fractions_must_be_fractions(bad):
    with pytest.raises(ConfigError, match="bandwidth fraction must be in"):
        LinkFractions(network=bad)


# ------------------------------------------------------------------ bad input


def test_bad_input_is_rejected():
    cluster = star(4)
    with pytest.raises(ConfigError, match="unknown collective 'allreduce'"):
        simulate_collective(cluster, "allreduce", [0, 1], S)
    with pytest.raises(ConfigError, match="twice"):
        simulate_collective(cluster, "all-reduce", [0, 1, 1], S)
    with pytest.raises(ConfigError, match="non-negative byte count"):
        simulate_collective(cluster, "all-reduce", [0, 1], -1)
    with pytest.raises(ConfigError, match="group of two"):
        simulate_collective(cluster, "p2p", [0, 1, 2], S)
    with pytest.raises(ConfigError, match="chunks must be a positive integer"):
        simulate_collective(cluster, "tree-all-reduce", [0, 1], S, chunks=0)
    with pytest.raises(ConfigError, match="not a position"):
        simulate_collective(cluster, "broadcast", [0, 1], S, root=2)
    with pytest.raises(ConfigError, match="outside"):
        simulate_collective(cluster, "all-reduce", [0, 9], S)
    two_nodes = build_cluster("h100-sxm", 4, 2)
    net = Network(two_nodes)
    with pytest.raises(ConfigError, match="same number of ranks on every server"):
        hierarchical_all_reduce(net, [0, 1, 2, 4], S)
