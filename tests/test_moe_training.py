"""A mixture of experts trained in every layout: expert parallelism (--ep) and the layouts before it, against one
process on the same global batch, step by step (losses and gradient norms), with top-2 dropless routing, top-1
with a capacity that drops tokens, and top-2 with a capacity. The all-to-alls real training sends are counted
against job/exchange/experts.py's, call for call and byte for byte, with the uneven splits it measured.

Two spawned worlds: 2 ranks (ep 2, ep 2 over the cp ranks, ep 2 with full recomputation, and the earlier layouts
with experts: dp 2 ZeRO-1, tp 2, pp 2, cp 2, tp 2 with sequence parallelism) and 4 ranks (ep 4; ep 2 inside dp 4
under ZeRO-1 and ZeRO-3; ep 2 x tp 2, with and without sequence parallelism; ep 4 folded over tp 2 x dp 2 under
sequence parallelism; ep 2 x pp 2; cp 2 x tp 2, with and without it). The one-process references run here.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import pytest
import torch

from distributed import every_layout, named_parity
from job.exchange.context import backward_exchanges as context_backward, forward_exchanges as context_forward
from job.exchange.experts import backward_exchanges, expert_gradient_reduction, forward_exchanges, routing_exchanges
from job.layout import Layout
from job.train_config import TrainConfig
from minigpt.presets import preset
from minigpt.data import Corpus
from minigpt.errors import ConfigError
from minigpt.moe import biased_layers
from parallel.expert.dispatch import ExpertParallel
from parallel.mesh import build_mesh
from parallel.run.build import build_rank
from parallel.run.train import micro_batches
from model_states import held_states, predicted_states
from parity import assert_runs_match
from precision.policy import policy as precision_policy
from simulator.costs.tp_collectives import tp_collectives

MODELS = {
    "top2": preset("tiny-moe").with_(seq_len=32, n_layers=2),
    "top1-drop": preset("tiny-moe").with_(seq_len=32, n_layers=2, top_k=1, capacity_factor=1.0),
    "top2-drop": preset("tiny-moe").with_(seq_len=32, n_layers=2, capacity_factor=1.25),
    # Qwen3's block: heads wider than width / heads, query and key norms (their gradients summed over tp), SwiGLU
    "qwen": preset("tiny-moe").with_(seq_len=32, n_layers=2, d_head=48, n_kv_heads=2, qk_norm=True, mlp="swiglu",
                                      norm="rmsnorm", positions="rope", bias=False, tied_head=False),
    # DeepSeek-V3's auxiliary-loss-free balancing: sigmoid scores chosen with a bias that moves 0.01 a step by the
    # whole batch's load (a rate large enough to change which experts are chosen within the 20 steps)
    "biased": preset("tiny-moe").with_(seq_len=32, n_layers=2, router="sigmoid", expert_bias=True,
                                        expert_bias_rate=0.01),
    # OLMoE's block (q and k normalised over all heads, their sums of squares summed over tp) routed as DeepSeek-V2
    # routes: each token's 2 experts from its best 2 of 4 groups, each group scored by its best expert, the softmax
    # scores as they are, x 2
    "olmoe-v2": preset("tiny-moe").with_(seq_len=32, n_layers=2, n_kv_heads=2, qk_norm=True, qk_norm_whole=True,
                                          mlp="swiglu", norm="rmsnorm", positions="rope", bias=False,
                                          renormalize_gates=False, expert_groups=4, groups_per_token=2,
                                          group_score_top=1, routed_scale=2.0, aux_loss_coef=0.01),
    # Qwen2-MoE's (q, k and v biases, a gated shared expert, the gates as chosen), a mixture in every second block
    # (1 and 3: GShard's), the others dense
    "qwen2-moe": preset("tiny-moe").with_(seq_len=32, n_layers=4, n_kv_heads=2, qkv_bias=True, bias=False,
                                           mlp="swiglu", norm="rmsnorm", positions="rope", n_shared_experts=1,
                                           shared_expert_gate=True, renormalize_gates=False, aux_loss_coef=0.01,
                                           moe_every=2),
}
TOLERANCE = 1e-5  # relative, every step, losses and gradient norms (fp32)
LAYOUTS = {
    2: {"ep2": ("top2", dict(dp=2, ep=2)),
        "ep2-top1-drop": ("top1-drop", dict(dp=2, ep=2, micro_batches=2)),
        "dp2-zero1": ("top2", dict(dp=2, zero=1)),
        "tp2": ("top2-drop", dict(tp=2, micro_batches=2)),
        "pp2": ("top2", dict(pp=2, micro_batches=2)),
        "tp2-qwen": ("qwen", dict(tp=2)),
        "cp2": ("top2", dict(cp=2)),
        "cp2-top1-drop": ("top1-drop", dict(cp=2, micro_batches=2)),
        "tp2-sp": ("top2-drop", dict(tp=2, sequence_parallel=True, micro_batches=2)),
        "ep2-over-cp2": ("top2", dict(cp=2, ep=2)),
        "ep2-full-recompute": ("top2-drop", dict(dp=2, ep=2, micro_batches=2, recompute="full")),
        "biased-tp2-sp": ("biased", dict(tp=2, sequence_parallel=True, micro_batches=2)),
        "biased-ep2-over-cp2": ("biased", dict(cp=2, ep=2)),
        "olmoe-v2-tp2-sp": ("olmoe-v2", dict(tp=2, sequence_parallel=True, micro_batches=2)),
        "qwen2-moe-tp2-sp": ("qwen2-moe", dict(tp=2, sequence_parallel=True, micro_batches=2))},
    4: {"ep4": ("top2", dict(dp=4, ep=4)),
        "ep2-dp4-zero1": ("top2-drop", dict(dp=4, ep=2, zero=1)),
        "ep2-dp4-zero3": ("top1-drop", dict(dp=4, ep=2, zero=3, micro_batches=2)),
        "ep2-dp4-zero3-shard2": ("top2-drop", dict(dp=4, ep=2, zero=3, shard_group=2, micro_batches=2)),
        "ep2-dp4-zero1-shard2": ("top2", dict(dp=4, ep=2, zero=1, shard_group=2)),
        "ep2-tp2": ("top2", dict(dp=2, ep=2, tp=2)),
        "ep2-pp2": ("top2-drop", dict(dp=2, ep=2, pp=2, micro_batches=2)),
        "ep2-cp2": ("top2-drop", dict(dp=2, ep=2, cp=2)),
        "cp2-tp2-allgather": ("top1-drop", dict(cp=2, tp=2, cp_kind="allgather")),
        "ep2-tp2-sp": ("top2-drop", dict(dp=2, ep=2, tp=2, sequence_parallel=True)),
        "cp2-tp2-sp": ("top1-drop", dict(cp=2, tp=2, sequence_parallel=True)),
        "ep4-over-tp2-dp2-sp": ("top2", dict(dp=2, ep=4, tp=2, sequence_parallel=True)),
        "biased-ep2-tp2": ("biased", dict(dp=2, ep=2, tp=2)),
        "biased-ep2-pp2": ("biased", dict(dp=2, ep=2, pp=2, micro_batches=2)),
        "biased-ep2-dp4-zero3": ("biased", dict(dp=4, ep=2, zero=3)),
        "qwen2-moe-ep2-pp2": ("qwen2-moe", dict(dp=2, ep=2, pp=2, micro_batches=2))},
}


def config(model: str, **layout) -> TrainConfig:
    return TrainConfig(model=MODELS[model], steps=20, global_batch=8, eval_every=0, eval_batches=1, device="cpu",
                       lr=1e-3, min_lr=1e-4, **layout)


def trained(cfg: TrainConfig) -> dict:
    """cfg.steps steps on this rank: losses, gradient norms, the rows each expert layer routed in the last step
    (sent, received) in order, and the expert groups' calls (parallel/comm.py's log) of that step."""
    device, routed = torch.device("cpu"), []
    mesh = build_mesh(cfg.pp, cfg.dp, cfg.tp, device, cfg.cp, cfg.shard_group)
    rank, corpus = build_rank(cfg, mesh, device, precision_policy(cfg.precision)), Corpus.load(None, cfg.model.seq_len)
    for module in rank.stage.modules():
        if isinstance(module, ExpertParallel):  # record what each call sends and what its experts receive
            module.local.register_forward_hook(lambda m, args, out: routed[-1].append(args[0].shape[0]))
            module.register_forward_pre_hook(lambda m, args: routed.append([int(args[1].sum())]))
    found = {"losses": [], "grad_norms": []}
    for step in range(cfg.steps):
        routed.clear()
        inputs, targets = micro_batches(corpus, cfg, step, mesh, device)
        outcome = rank.train_step(cfg, step, inputs, targets)
        found["losses"].append(outcome.loss)
        found["grad_norms"].append(outcome.result.grad_norm)
    found["routed_last_step"] = [tuple(pair) for pair in routed]
    found["expert_bias"] = {module.layer: module.expert_bias.tolist() for module in biased_layers(rank.stage)}
    found["ep_log"] = list(rank.comms["ep"].log) if "ep" in rank.comms else []
    found["ep_replicas_log"] = list(rank.comms["ep_replicas"].log) if "ep_replicas" in rank.comms else []
    found["cp_log"] = list(rank.comms["cp"].log)
    found["tp_log"] = list(rank.comms["tp"].log)
    found["place"] = (mesh.pp_rank, mesh.tp_rank)  # ranks of one place hold the same dense weights (ZeRO 0-2)
    if cfg.zero < 3:  # ZeRO-3's weights are shards between the steps (their storage freed): no replicas
        dense = torch.cat([p.detach().reshape(-1) for n, p in rank.stage.named_parameters() if ".experts." not in n])
        found["dense_digest"] = hashlib.sha256(str(dense.view(torch.int32).tolist()).encode()).hexdigest()
    found["states"] = held_states(rank)
    if "ep" in rank.comms:  # the ranks at the same place of the expert group hold the same experts
        experts = torch.cat([p.detach().reshape(-1) for n, p in rank.stage.named_parameters() if ".experts." in n])
        found["expert_place"] = (mesh.pp_rank, rank.comms["ep"].rank)
        found["expert_digest"] = hashlib.sha256(str(experts.view(torch.int32).tolist()).encode()).hexdigest()
    return found


def routed_per_step(cfg: TrainConfig) -> int:
    return cfg.model.n_moe_layers // cfg.pp * cfg.micro_batches


spawned, references = named_parity(trained, config, MODELS, LAYOUTS)


ALL = every_layout(LAYOUTS)


@pytest.mark.parametrize("world, name", ALL, ids=[name for _, name in ALL])
def test_every_layout_matches_one_process(spawned, references, world, name):
    assert_runs_match(spawned[name], references[LAYOUTS[world][name][0]], name, TOLERANCE)


BIASED = [(world, name) for world, name in ALL if LAYOUTS[world][name][0] == "biased"]


@pytest.mark.parametrize("world, name", BIASED, ids=[name for _, name in BIASED])
def test_every_rank_moves_the_choice_bias_as_one_process(spawned, references, world, name):
    """After 20 steps every rank holds the choice bias one process holds (each layer's, moved by the whole batch's
    load every step: summed over the ranks routing other tokens), and it has moved: not every expert alike."""
    expected = references["biased"]["expert_bias"]
    assert all(max(bias) - min(bias) >= 0.02 for bias in expected.values()), expected
    for run in spawned[name]:
        assert run["expert_bias"], name  # every stage holds a MoE layer
        for layer, bias in run["expert_bias"].items():
            assert max(abs(a - b) for a, b in zip(bias, expected[layer])) <= 1e-6, (name, layer, bias, expected[layer])


EP = [(world, name) for world, name in ALL if LAYOUTS[world][name][1].get("ep", 1) > 1]


@pytest.mark.parametrize("world, name", EP, ids=[name for _, name in EP])
def test_ranks_holding_the_same_experts_keep_them_equal_bit_for_bit(spawned, world, name):
    """After 20 steps the ranks at the same place of the expert group hold the same experts, to the bit: one
    all-reduce of their gradients under ZeRO 0, or (ZeRO 1-3, their optimizer states sharded over them) each
    updating its piece and all-gathering the others'."""
    digests: dict[tuple, set] = {}
    for run in spawned[name]:
        digests.setdefault(run["expert_place"], set()).add(run["expert_digest"])
    assert len(digests) == LAYOUTS[world][name][1]["ep"] * LAYOUTS[world][name][1].get("pp", 1)
    assert all(len(found) == 1 for found in digests.values()), (name, digests)


@pytest.mark.parametrize("world, name", EP, ids=[name for _, name in EP])
def test_model_states_per_rank_are_the_simulators(spawned, world, name):
    """Weights, gradients, masters and AdamW moments each rank holds, byte for byte as simulator/memory.py predicts
    them: the experts' states sharded over the ranks holding the same experts under ZeRO 1-3, whole under ZeRO 0."""
    model, layout = LAYOUTS[world][name]
    cfg = config(model, **layout)
    for run in spawned[name]:
        assert run["states"] == predicted_states(cfg, run["place"][0]), name


REPLICATED = [(world, name) for world, name in EP if LAYOUTS[world][name][1].get("zero", 0) < 3]


@pytest.mark.parametrize("world, name", REPLICATED, ids=[name for _, name in REPLICATED])
def test_data_parallel_replicas_stay_equal_bit_for_bit(spawned, world, name):
    """The ranks of one tp and pp place hold the same dense weights after 20 clipped steps, to the bit: the gradient
    norm's dense and expert parts are summed apart (precision/optimizer.py's norm_split), so the clipping factor is
    the same number on every rank. Taking the experts' share out of the whole (what this was) rounded differently on
    ranks holding other experts, and the replicas drifted apart in the last bits."""
    digests: dict[tuple, set] = {}
    for run in spawned[name]:
        digests.setdefault(run["place"], set()).add(run["dense_digest"])
    layout = LAYOUTS[world][name][1]
    assert len(digests) * layout.get("dp", 1) * layout.get("cp", 1) == len(spawned[name])
    assert all(len(found) == 1 for found in digests.values()), (name, digests)


@pytest.mark.parametrize("world, name", EP, ids=[name for _, name in EP])
def test_all_to_alls_are_the_descriptions(spawned, world, name):
    """The expert group's calls of the last step, in order, are job/exchange/experts.py's for the rows each layer
    routed: every forward's counts, dispatch and combine, then the backwards' two (in reverse order)."""
    model, layout = LAYOUTS[world][name]
    cfg = config(model, **layout)
    uneven = False
    for run in spawned[name]:
        routed = run["routed_last_step"]
        if cfg.recompute == "full":  # each layer routed again in its backward, the same rows: every routing twice
            counts = collections.Counter(routed)
            assert all(n % 2 == 0 for n in counts.values()), counts
            routed = [split for split, n in counts.items() for _ in range(n // 2)]
        assert len(routed) == routed_per_step(cfg)
        uneven |= any(sent != received for sent, received in routed)
        expected_forward = [e for sent, received in routed for e in forward_exchanges(cfg.model, cfg.ep, sent, 4, received)]
        expected_backward = [e for sent, received in routed
                             for e in backward_exchanges(cfg.model, cfg.ep, sent, 4, received, cfg.recompute)]
        expected = sorted((e.kind, e.bytes) for e in expected_forward + expected_backward)
        log = run["ep_log"]
        # the last step's all-to-alls (the log, reset every step, also holds the sum of the norm's expert share)
        step_calls = [call for call in log if call[0] == "all_to_all"]
        assert sorted(step_calls) == expected
        forward_order = [(e.kind, e.bytes) for e in expected_forward]
        assert step_calls[:3] == forward_order[:3]  # the first layer's counts, dispatch, combine, in that order
        shards = Layout.of(cfg).expert_state_shards
        reduction = expert_gradient_reduction(cfg.model, cfg.ep, Layout.of(cfg).token_ranks,
                                              cfg.model.n_moe_layers // cfg.pp, 4, shards)
        replicas = run["ep_replicas_log"]
        norm = [("all_reduce", 4)] if shards > 1 else []  # the experts' squared norm over their pieces
        assert replicas == [(e.kind, e.bytes) for e in reduction[:1]] + norm + [(e.kind, e.bytes) for e in reduction[1:]]
    assert uneven, f"{name}: every layer sent as many rows as it received: the splits were not uneven"


CP = [(world, name) for world, name in ALL if LAYOUTS[world][name][1].get("cp", 1) > 1]


@pytest.mark.parametrize("world, name", CP, ids=[name for _, name in CP])
def test_routing_over_cp_exchanges_what_the_description_lists(spawned, world, name):
    """Under context parallelism each MoE layer's forward all-gathers the expert ids (with a capacity) and
    all-reduces the balance loss's counts over the cp group: the last step's collectives of the cp group, call for
    call and byte for byte, are job/exchange/experts.py's routing_exchanges for every layer and micro-batch (an
    all-gather counted at its gathered size)."""
    model, layout = LAYOUTS[world][name]
    cfg = config(model, **layout)
    micro_batch = cfg.global_batch // (cfg.micro_batches * cfg.dp)
    per_layer = routing_exchanges(cfg.model, cfg.cp, micro_batch * cfg.model.seq_len // cfg.cp, micro_batch)
    assert [e.kind for e in per_layer] == (["all_gather"] if cfg.model.capacity_factor else []) + ["all_reduce"]
    # the attention's own collectives (all-gather kind) beside them: job/exchange/context.py's
    attention = [e for e in context_forward(cfg.model, cfg.tp, cfg.cp, cfg.cp_kind, micro_batch, 4)
                 + context_backward(cfg.model, cfg.tp, cfg.cp, cfg.cp_kind, micro_batch, 4) if e.kind != "p2p"]
    calls = [(e.kind, e.bytes * (1 if e.kind == "all_reduce" else cfg.cp)) for e in per_layer + attention
             for _ in range(e.calls)]
    expected = calls * (cfg.model.n_moe_layers // cfg.pp) * cfg.micro_batches
    for run in spawned[name]:
        assert sorted(call for call in run["cp_log"] if call[0] != "send") == sorted(expected)


def test_expert_parallel_refuses_what_it_cannot_split():
    with pytest.raises(ConfigError, match="--ep 3 does not divide the 8 experts"):
        config("top2", dp=3, ep=3)
    with pytest.raises(ConfigError, match="--ep 2 does not divide the 1 ranks that route distinct tokens"):
        config("top2", ep=2)
    with pytest.raises(ConfigError, match="--ep 4 does not divide the 2 ranks"):  # tp ranks route the same tokens
        config("top2", dp=2, tp=2, ep=4)
    config("top2", dp=2, tp=2, ep=4, sequence_parallel=True)  # under SP they route their own slices: folded
    with pytest.raises(ConfigError, match="this model is dense"):
        dataclasses.replace(config("top2"), model=preset("tiny").with_(seq_len=32), dp=2, ep=2)


def test_the_norm_counts_once_what_the_stage_holds_whole():
    """Under tensor parallelism the gradient norm counts a weight every tp rank holds whole once (build_rank's
    `replicated`). On the last stage of tp 2 x ep 2 x pp 2 with a tied head and multi-token prediction those are the
    norms, the biases added after a sum, the routers, the expert slices and the module's projection, and never the
    head's copy that cutting the stage makes (the ids are taken while the parameters are alive: a replaced
    parameter's id is the next object's, and the tied copy took the whole experts' in some runs: gradient norms 30%
    off one process's)."""
    from types import SimpleNamespace

    from minigpt.model import GPT
    from parallel.expert.apply import apply_expert_parallel
    from parallel.expert.gradients import expert_shards
    from parallel.pipeline.executor import split_model
    from parallel.run.build import replicated_ids
    from parallel.tensor.parallelize import parallelize

    model = GPT(preset("tiny-moe").with_(seq_len=32, n_layers=2, tied_head=True, mtp_depth=1))
    group = SimpleNamespace(size=2, rank=0)
    replicated = parallelize(model, group)
    apply_expert_parallel(model, group)
    replicated += [param for _, param in expert_shards(model)]
    stage = split_model(model, 2, 1, 1)
    ids = replicated_ids(replicated, stage)
    whole = {name for name, param in stage.named_parameters() if id(param) in ids}
    split = {name for name, param in stage.named_parameters() if id(param) not in ids}
    assert split == {f"chunks.0.{block}.attn.{name}" for block in ("blocks.0", "mtp.0.block")
                     for name in ("qkv.inner.weight", "qkv.inner.bias", "proj.inner.weight")} | {
        "chunks.0.head.inner.weight"}  # the vocabulary rows (its lookups' too), the heads' columns and rows
    assert {name.split(".")[-2] for name in whole} == {"proj", "ln1", "ln2", "local", "router", "eh_proj", "enorm",
                                                       "hnorm", "norm", "norm_f"}  # proj: the attention's bias


SP = [(world, name) for world, name in ALL if LAYOUTS[world][name][1].get("sequence_parallel")]


@pytest.mark.parametrize("world, name", SP, ids=[name for _, name in SP])
def test_sequence_parallel_moe_collectives_are_the_simulators(spawned, world, name):
    """Under sequence parallelism each tp rank routes its own slice of the tokens: its MoE blocks issue no all-gather
    or reduce-scatter around the experts, the routing's counts (and with a capacity the expert ids) go over the tp
    group, and the router's, shared and (without ep) routed experts' gradients are summed over it. The last step's
    tp-group calls, byte for byte, are simulator/costs/tp_collectives.py's tp_collectives for the whole stage, every
    micro-batch (one more all-reduce of the step: the gradient norm's sum over the group)."""
    model, layout = LAYOUTS[world][name]
    cfg = config(model, **layout)
    micro_batch = cfg.global_batch // (cfg.micro_batches * cfg.dp)
    forward, backward = tp_collectives(cfg.model, cfg.model.n_layers, micro_batch, Layout.of(cfg),
                                       precision_policy(cfg.precision), True, True, moe_layers=cfg.model.n_moe_layers)
    kinds = [c.kind for c in forward]
    assert kinds.count("all_gather") == 2 + (1 if cfg.model.capacity_factor else 0)  # attention's, the head's, ids
    expected = sorted((c.kind, c.bytes) for c in forward + backward for _ in range(c.calls * cfg.micro_batches))
    for run in spawned[name]:
        assert sorted(run["tp_log"][:-1]) == expected, name
        assert run["tp_log"][-1][0] == "all_reduce"
