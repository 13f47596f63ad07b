"""A MoE's dispatcher in the simulator (--ep-dispatcher): "alltoall", a copy of every routed row to its expert's
rank (our trainer's), and "deepep", each token once per destination server over the NICs and per rank over NVLink
(DeepEP's normal kernels; simulator/engine/experts.py)."""

from __future__ import annotations

import itertools
import json

import pytest
from click.testing import CliRunner

from cli.main import main
from job.exchange.experts import token_share
from job.layout import Layout
from minigpt.errors import ConfigError
from minigpt.presets import preset
from simulator.costs.hardware import load_hardware
from simulator.costs.implementation import Implementation
from simulator.engine.links import LinkCosts
from simulator.engine.simulate import simulate_step
from simulator.network.topology import build_cluster

H100 = load_hardware("h100-sxm")
QWEN = preset("qwen3-30b-a3b").with_(n_layers=2, seq_len=1024)  # 128 experts, top 8
MIXTRAL = preset("mixtral-8x7b").with_(n_layers=2, seq_len=1024)  # 8 experts, top 2


@pytest.mark.parametrize("experts, top_k, ep, members", [(8, 2, 4, 1), (8, 2, 4, 2), (12, 3, 6, 2), (16, 4, 8, 3)])
def test_token_share_counts_the_top_k_sets_that_reach_the_members(experts, top_k, ep, members):
    """Against every set of top_k distinct experts, each as likely (balanced routing)."""
    model = QWEN.with_(n_experts=experts, top_k=top_k)
    held = set(range(members * experts // ep))  # the first `members` ranks' experts
    sets = list(itertools.combinations(range(experts), top_k))
    reaching = sum(1 for chosen in sets if held & set(chosen))
    assert token_share(model, ep, members) == pytest.approx(reaching / len(sets), rel=1e-12)
    assert token_share(model.with_(top_k=1), ep, 1) == pytest.approx(1 / ep)  # one choice: a copy per row, as alltoall


@pytest.mark.parametrize("experts, top_k, groups, chosen, ep, members",
                         [(16, 4, 4, 2, 8, 2), (16, 4, 4, 2, 8, 3), (12, 3, 4, 2, 6, 1), (16, 2, 8, 1, 4, 1),
                          (16, 4, 4, 4, 8, 3)])
def test_token_share_under_group_limited_routing(experts, top_k, groups, chosen, ep, members):
    """Against every set of `chosen` groups, then every set of top_k of their experts, each as likely: DeepSeek-V3's
    node-limited routing (its 4 of 8 groups), balanced; with every group chosen the same as without groups."""
    model = QWEN.with_(n_experts=experts, top_k=top_k, expert_groups=groups, groups_per_token=chosen)
    held, size = set(range(members * experts // ep)), experts // groups
    shares = []
    for picked in itertools.combinations(range(groups), chosen):
        pool = [e for g in picked for e in range(g * size, (g + 1) * size)]
        sets = list(itertools.combinations(pool, top_k))
        shares.append(sum(1 for s in sets if held & set(s)) / len(sets))
    assert token_share(model, ep, members) == pytest.approx(sum(shares) / len(shares), rel=1e-12)
    assert token_share(model, ep, members) <= token_share(model.with_(expert_groups=1, groups_per_token=None), ep,
                                                          members) + 1e-12


def links(gpus_per_node: int, nodes: int, ep: int) -> LinkCosts:
    layout = Layout(dp=gpus_per_node * nodes, ep=ep)
    return LinkCosts(build_cluster(H100, gpus_per_node, nodes), layout, H100.gpu)


def test_inside_a_server_top_1_moves_what_the_all_to_all_moves():
    one = links(8, 1, 8)
    nbytes = 64 * 2**20
    assert one.ep_servers(0) == (1, 8)
    assert one.all_to_all_deduplicated(0, nbytes, 1 / 8, 1.0) == pytest.approx(one.all_to_all(0, nbytes))


def test_across_servers_each_token_crosses_the_nics_once_per_server():
    """ep 16 over two servers, Qwen3's top 8 of 128: the all-to-all sends half of the 8 copies of a token over the
    NICs (4 rows); the deduplicating dispatcher one row to the other server with probability token_share (nearly
    1), so the NIC phase takes about a quarter, and NVLink's forwarding (its share from both servers) runs beside it."""
    two = links(8, 2, 16)
    assert two.ep_servers(0) == (2, 8)
    tokens = 4096 * QWEN.d_model * 2  # one row of each token this rank routes, bf16
    alltoall = two.all_to_all(0, tokens * QWEN.top_k)
    per_rank, per_server = token_share(QWEN, 16, 1), token_share(QWEN, 16, 8)
    deduplicated = two.all_to_all_deduplicated(0, tokens, per_rank, per_server)
    assert 0.99 < per_server < 1 and deduplicated < alltoall / 3
    nics_only = two.all_to_all_deduplicated(0, tokens, 0.0, per_server)
    assert nics_only <= deduplicated and nics_only == pytest.approx(alltoall / 4 * per_server, rel=0.1)


def test_the_step_prices_the_rows_as_the_dispatcher_moves_them():
    cluster = build_cluster(H100, 8, 2)
    layout = Layout(dp=16, ep=16)
    plain = simulate_step(QWEN, layout, cluster, "bf16", 16, 1)
    deep = simulate_step(QWEN, layout, cluster, "bf16", 16, 1, ep_dispatcher="deepep")
    assert deep.breakdown["ep_comm"] < plain.breakdown["ep_comm"] / 2
    assert deep.breakdown["compute"] == plain.breakdown["compute"]
    assert deep.provenance["experts"]["dispatcher"] == "deepep"
    # top 2 of 8 experts at ep 8 inside one server: one expert a rank, so a token's two rows go to two ranks either way
    small = Layout(dp=8, ep=8)
    one = build_cluster(H100, 8, 1)
    ratio = (simulate_step(MIXTRAL, small, one, "bf16", 8, 1, ep_dispatcher="deepep").breakdown["ep_comm"]
             / simulate_step(MIXTRAL, small, one, "bf16", 8, 1).breakdown["ep_comm"])
    assert ratio == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="--ep-dispatcher"):
        Implementation(dispatcher="nccl")


def invoke(*args: str):
    return CliRunner().invoke(main, ["simulate", *args])


def test_the_flag_in_the_cli():
    result = invoke("--model", "tiny-moe", "--dp", "2", "--ep", "2", "--ep-dispatcher", "deepep", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["provenance"]["experts"]["dispatcher"] == "deepep"
    assert "--ep-dispatcher" in invoke("--help").output
    for args, words in ((["--model", "tiny-moe", "--ep-dispatcher", "deepep"], "--ep 1 has none"),
                        (["--model", "tiny-moe", "--ep-dispatcher", "nccl"], "'nccl' is not one of")):
        result = invoke(*args)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and words in lines[-1], result.output


def test_plan_searches_with_the_dispatcher_asked_for():
    """plan prices every candidate's rows as --ep-dispatcher says, in its bound and its simulations alike: its
    best layout's step is simulate's for that layout and dispatcher."""
    plan = lambda *extra: CliRunner().invoke(main, ["plan", "--model", "tiny-moe", "--gpus", "8", "--top", "1",  # noqa: E731
                                                    "--json", *extra])
    result = plan("--ep", "4", "--ep-dispatcher", "deepep")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    alltoall = json.loads(plan("--ep", "4").output)
    assert alltoall["ep_dispatcher"] == "alltoall"
    assert data["best"][0]["step_time_s"] < alltoall["best"][0]["step_time_s"]  # top 2 of 8 experts, 2 a rank
    best = data["best"][0]
    assert data["ep_dispatcher"] == "deepep" and best["ep"] == 4
    layout = Layout(tp=best["tp"], pp=best["pp"], dp=best["dp"], zero=best["zero"], ep=4, cp=best["cp"],
                    sequence_parallel=best["sequence_parallel"], virtual_chunks=best["virtual_chunks"])
    again = simulate_step(preset("tiny-moe"), layout, build_cluster(data["gpu"], 8, 1), data["precision"],
                          data["global_batch"],
                          best["micro_batch"], best["schedule"], best["virtual_chunks"], best["recompute"],
                          ep_dispatcher="deepep")
    assert again.step_time_s == pytest.approx(best["step_time_s"], rel=1e-9)
    for extra, words in ((["--ep", "1", "--ep-dispatcher", "deepep"], "--ep 1 has none"),
                         (["--ep-dispatcher", "nccl"], "'nccl' is not one of")):
        result = plan(*extra)
        assert result.exit_code == 2 and words in result.output.strip().splitlines()[-1], result.output
