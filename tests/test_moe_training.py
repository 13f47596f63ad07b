"""A mixture of experts trained in every layout: expert parallelism (--ep) and the layouts before it, against one
process on the same global batch, step by step (losses and gradient norms), with top-2 dropless routing, top-1
with a capacity that drops tokens, and top-2 with a capacity. The all-to-alls real training sends are counted
against job/exchange/experts.py's, call for call and byte for byte, with the uneven splits it measured.

Two spawned worlds: 2 ranks (ep 2, and the earlier layouts with experts: dp 2 ZeRO-1, tp 2, pp 2) and 4 ranks
(ep 4; ep 2 inside dp 4 under ZeRO-1 and ZeRO-3; ep 2 x tp 2; ep 2 x pp 2). The one-process references run here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from distributed import run_ranks
from job.exchange.experts import backward_exchanges, expert_gradient_reduction, forward_exchanges
from job.train_config import TrainConfig
from minigpt.config import preset
from minigpt.errors import ConfigError
from parallel.expert.dispatch import ExpertParallel
from parity import worst_gap
from test_fsdp import history

MODELS = {
    "top2": preset("tiny-moe").with_(seq_len=32, n_layers=2),
    "top1-drop": preset("tiny-moe").with_(seq_len=32, n_layers=2, top_k=1, capacity_factor=1.0),
    "top2-drop": preset("tiny-moe").with_(seq_len=32, n_layers=2, capacity_factor=1.25),
}
TOLERANCE = 1e-5  # relative, every step, losses and gradient norms (fp32)
LAYOUTS = {
    2: {"ep2": ("top2", dict(dp=2, ep=2)),
        "ep2-top1-drop": ("top1-drop", dict(dp=2, ep=2, micro_batches=2)),
        "dp2-zero1": ("top2", dict(dp=2, zero=1)),
        "tp2": ("top2-drop", dict(tp=2, micro_batches=2)),
        "pp2": ("top2", dict(pp=2, micro_batches=2))},
    4: {"ep4": ("top2", dict(dp=4, ep=4)),
        "ep2-dp4-zero1": ("top2-drop", dict(dp=4, ep=2, zero=1)),
        "ep2-dp4-zero3": ("top1-drop", dict(dp=4, ep=2, zero=3, micro_batches=2)),
        "ep2-tp2": ("top2", dict(dp=2, ep=2, tp=2)),
        "ep2-pp2": ("top2-drop", dict(dp=2, ep=2, pp=2, micro_batches=2))},
}


def config(model: str, **layout) -> TrainConfig:
    return TrainConfig(model=MODELS[model], steps=20, global_batch=8, eval_every=0, eval_batches=1, device="cpu",
                       lr=1e-3, min_lr=1e-4, **layout)


def counted_history(cfg: TrainConfig) -> dict:
    """history() of tests/test_fsdp.py, with each expert layer's routed rows (sent, received) recorded in order and
    the expert groups' calls of the last step."""
    routed: list[tuple[int, int]] = []
    forward = ExpertParallel.forward

    def recording(self, x, counts):
        received = []
        local = self.local.forward
        self.local.forward = lambda rows, sizes: received.append(rows.shape[0]) or local(rows, sizes)
        try:
            out = forward(self, x, counts)
        finally:
            del self.local.forward
        routed.append((int(counts.sum()), received[0]))
        return out

    ExpertParallel.forward = recording
    try:
        found = history(cfg)
    finally:
        ExpertParallel.forward = forward
    found["routed_last_step"] = routed[-routed_per_step(cfg):] if cfg.ep > 1 else []
    return found


def routed_per_step(cfg: TrainConfig) -> int:
    return cfg.model.n_moe_layers // cfg.pp * cfg.micro_batches


def spawned_world(world: int) -> dict:
    torch.set_num_threads(1)
    found = {}
    for name, (model, layout) in LAYOUTS[world].items():
        cfg = config(model, **layout)
        calls = {}
        import parallel.run.build as build  # the ranks' comms, to read the expert groups' logs after the run

        original = build.build_rank

        def keep(*args, **kwargs):
            rank = original(*args, **kwargs)
            calls["comms"] = rank.comms
            return rank

        build.build_rank = keep
        import test_fsdp
        test_fsdp.build_rank = keep
        try:
            found[name] = counted_history(cfg)
        finally:
            build.build_rank = original
            test_fsdp.build_rank = original
        comms = calls["comms"]
        found[name]["ep_log"] = list(comms["ep"].log) if "ep" in comms else []
        found[name]["ep_replicas_log"] = list(comms["ep_replicas"].log) if "ep_replicas" in comms else []
    return found


@pytest.fixture(scope="module")
def spawned():
    runs = {}
    for world in LAYOUTS:
        for rank in run_ranks(world, spawned_world, world):
            for name, run in rank.items():
                runs.setdefault(name, []).append(run)
    return runs


@pytest.fixture(scope="module")
def references():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {model: history(config(model)) for model in MODELS}
    finally:
        torch.set_num_threads(threads)


ALL = [(world, name) for world, layouts in LAYOUTS.items() for name in layouts]


@pytest.mark.parametrize("world, name", ALL, ids=[name for _, name in ALL])
def test_every_layout_matches_one_process(spawned, references, world, name):
    model, _ = LAYOUTS[world][name]
    for run in spawned[name]:
        gap = worst_gap(run, references[model])
        assert gap.worst <= TOLERANCE, f"{name}: {gap}"


EP = [(world, name) for world, name in ALL if LAYOUTS[world][name][1].get("ep", 1) > 1]


@pytest.mark.parametrize("world, name", EP, ids=[name for _, name in EP])
def test_all_to_alls_are_the_descriptions(spawned, world, name):
    """The expert group's calls of the last step, in order, are job/exchange/experts.py's for the rows each layer
    routed: every forward's counts, dispatch and combine, then the backwards' two (in reverse order)."""
    model, layout = LAYOUTS[world][name]
    cfg = config(model, **layout)
    uneven = False
    for run in spawned[name]:
        routed = run["routed_last_step"]
        assert len(routed) == routed_per_step(cfg)
        uneven |= any(sent != received for sent, received in routed)
        expected_forward = [e for sent, received in routed for e in forward_exchanges(cfg.model, cfg.ep, sent, 4, received)]
        expected_backward = [e for sent, received in routed
                             for e in backward_exchanges(cfg.model, cfg.ep, sent, 4, received)]
        expected = sorted((e.kind, e.bytes) for e in expected_forward + expected_backward)
        log = run["ep_log"]
        # the step's last calls: the sums of the gradient norm's expert share (one all-reduce of 8 bytes)
        step_calls = [call for call in log if call[0] == "all_to_all"][-len(expected):]
        assert sorted(step_calls) == expected
        forward_order = [(e.kind, e.bytes) for e in expected_forward]
        assert [c for c in log if c[0] == "all_to_all"][-len(expected):][:3] == forward_order[:3]
        reduction = expert_gradient_reduction(cfg.model, cfg.ep, cfg.dp, cfg.model.n_moe_layers // cfg.pp, 4)
        replicas = run["ep_replicas_log"]
        assert replicas[-1:] == ([] if reduction is None else [(reduction.kind, reduction.bytes)])
    assert uneven, f"{name}: every layer sent as many rows as it received: the splits were not uneven"


def test_expert_parallel_refuses_what_it_cannot_split():
    with pytest.raises(ConfigError, match="--ep 3 does not divide the 8 experts"):
        config("top2", dp=3, ep=3)
    with pytest.raises(ConfigError, match="--ep 2 does not divide --dp 1"):
        config("top2", ep=2)
    with pytest.raises(ConfigError, match="this model is dense"):
        dataclasses.replace(config("top2"), model=preset("tiny").with_(seq_len=32), dp=2, ep=2)
    with pytest.raises(ConfigError, match="sequence-parallel"):
        config("top2", tp=2, sequence_parallel=True)
