"""A mixture of experts under context parallelism in the simulator: the routing counted over whole sequences
(job/exchange/experts.py's routing_exchanges, priced on the cp group's links as the context-parallel row), the
capacity shared out over the cp ranks, the experts' replicas at every cp place."""

from __future__ import annotations

import pytest

from job.exchange.experts import routed_rows, routing_exchanges
from job.layout import Layout
from minigpt.presets import preset
from simulator.costs.hardware import load_hardware
from simulator.engine.experts import routing_seconds
from simulator.engine.links import LinkCosts
from simulator.engine.simulate import simulate_step
from simulator.network.topology import build_cluster

H100 = load_hardware("h100-sxm")
TINY_MOE = preset("tiny-moe")
DROPPING = TINY_MOE.with_(capacity_factor=1.0)


def test_the_routing_exchange_lists_what_each_setting_needs():
    assert routing_exchanges(DROPPING, 1, 64, 1) == []
    kinds = lambda model: [(e.kind, e.bytes) for e in routing_exchanges(model, 2, 64, 1)]  # noqa: E731
    assert kinds(DROPPING) == [("all_gather", 64 * 2 * 8), ("all_reduce", 8 * 4)]
    assert kinds(TINY_MOE) == [("all_reduce", 8 * 4)]  # dropless: nothing to rank
    assert kinds(TINY_MOE.with_(aux_loss_coef=0.0)) == []  # no balance loss, no capacity: nothing crosses


def test_the_routing_is_priced_on_the_cp_links_and_again_when_recomputed():
    layout = Layout(cp=2, dp=2, ep=2)
    links = LinkCosts(build_cluster(H100, 4, 1), layout, H100.gpu)
    tokens = TINY_MOE.seq_len // 2
    gather, reduce = routing_exchanges(DROPPING, 2, tokens, 1)
    expected = links.cp_collective(0, "all_gather", 2 * gather.bytes) + links.cp_collective(0, "all_reduce",
                                                                                            reduce.bytes)
    assert routing_seconds(DROPPING, layout, 1, "none", links, 0) == (pytest.approx(expected), 0.0)
    assert routing_seconds(DROPPING, layout, 1, "full", links, 0) == (pytest.approx(expected),) * 2
    assert routing_seconds(DROPPING, Layout(dp=2, ep=2), 1, "none", links, 0) == (0.0, 0.0)


def test_a_cp_rank_keeps_its_share_of_the_capacity():
    """Capacity 0.5: each expert keeps ceil(0.5 x s x k / E) choices of a sequence; a cp rank's tokens send 1/cp."""
    model = TINY_MOE.with_(capacity_factor=0.5)
    whole = routed_rows(model, model.seq_len, 1)
    assert whole < model.seq_len * model.top_k
    assert routed_rows(model, model.seq_len // 2, 1, cp=2) == whole // 2


def test_the_experts_replicas_span_every_cp_place():
    layout = Layout(dp=4, cp=2, ep=2)
    links = LinkCosts(build_cluster(H100, 8, 1), layout, H100.gpu)
    groups = links.rank_groups("dp_experts", 0)
    assert len(groups) == 2 and all(len(group) == 4 for group in groups)  # dp x cp / ep ranks hold each half
    # the expert groups are consecutive ranks routing distinct tokens (cp faster than dp): each replica's two cp
    # ranks; the first member of each (cp place 0 of every replica) holds the first half: global ranks d x cp
    assert sorted(groups[0]) == [0, 2, 4, 6]
    assert sorted(r for group in links.rank_groups("ep", 0) for r in group) == list(range(8))


def test_a_moe_simulates_with_context_parallelism():
    """The cp row holds the routing exchange beside the attention's ring: a model that routes with a capacity and
    a balance loss shows more of it than one without either, everything else alike."""
    layout = Layout(cp=2, dp=2, ep=2)
    cluster = build_cluster(H100, 4, 1)
    quiet = simulate_step(TINY_MOE.with_(aux_loss_coef=0.0), layout, cluster, "bf16", 4, 1)
    counted = simulate_step(DROPPING, layout, cluster, "bf16", 4, 1)
    assert quiet.breakdown["cp_comm"] > 0 and counted.breakdown["cp_comm"] > quiet.breakdown["cp_comm"]
    assert counted.breakdown["ep_comm"] > 0
