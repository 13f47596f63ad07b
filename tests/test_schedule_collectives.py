"""The schedule is the description of a step, data parallelism included: on every rank and every
step, the data-parallel collectives parallel/comm.py counts during real training are, call for
call and byte for byte, those of the schedule the simulator replays (simulator/engine/simulate.py's
`step_schedule`, priced action by action by job/data_parallel.py's `collectives`).

A bucket's reduction starts from the hook the moment its gradients are in, so reductions of one
compute may be issued in another order than listed; every step's calls are compared as sorted
lists, and the per-kind call counts and byte totals must agree exactly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from distributed import run_ranks
from job.data_parallel import collectives
from job.layout import Layout
from job.train_config import TrainConfig
from minigpt.config import GPTConfig
from minigpt.data import Corpus
from parallel.run.build import build_rank
from parallel.mesh import build_mesh
from parallel.run.train import micro_batches
from precision.policy import policy as precision_policy
from simulator.engine.simulate import step_schedule

MODEL = GPTConfig(vocab_size=256, seq_len=16, n_layers=4, n_heads=2, d_model=32, d_ff=64)
MOE = dataclasses.replace(MODEL, n_experts=4, top_k=2)
BASE = TrainConfig(model=MODEL, steps=2, global_batch=8, eval_every=0, eval_batches=1, device="cpu")
STEPS = 2

LAYOUTS = {
    2: {
        "dp2 zero0 m2 small buckets": dict(dp=2, zero=0, micro_batches=2, bucket_mb=0.01),
        "dp2 zero1 m2": dict(dp=2, zero=1, micro_batches=2, bucket_mb=0.02),
        "dp2 zero2 m4": dict(dp=2, zero=2, micro_batches=4, bucket_mb=0.005),
        "dp2 zero3 m2": dict(dp=2, zero=3, micro_batches=2),
        "dp2 zero2 bf16": dict(dp=2, zero=2, micro_batches=2, precision="bf16", bucket_mb=0.01),
    },
    4: {
        "tp2 dp2 zero1": dict(tp=2, dp=2, zero=1, micro_batches=2, bucket_mb=0.01),
        "pp2 dp2 zero2 1f1b": dict(pp=2, dp=2, zero=2, micro_batches=4, bucket_mb=0.01),
        "pp2 dp2 zero3 interleaved": dict(pp=2, dp=2, zero=3, micro_batches=4, schedule="interleaved",
                                          virtual_chunks=2),
        "pp2 dp2 zero3 full recompute": dict(pp=2, dp=2, zero=3, micro_batches=2, recompute="full"),
        "pp2 dp2 zero3 zb-h1 full recompute": dict(pp=2, dp=2, zero=3, micro_batches=4, schedule="zb-h1",
                                                   recompute="full"),
        "pp2 dp2 zero0 zb-h1": dict(pp=2, dp=2, zero=0, micro_batches=4, schedule="zb-h1", bucket_mb=0.01),
        "pp2 dp2 zero1 interleaved": dict(pp=2, dp=2, zero=1, micro_batches=4, schedule="interleaved",
                                          virtual_chunks=2, bucket_mb=0.01),
        "pp2 dp2 zero3 zb-h1": dict(pp=2, dp=2, zero=3, micro_batches=2, schedule="zb-h1"),
        # multi-token prediction under pipelining: the last stage's embedding copy, summed with the first's
        "pp2 dp2 zero1 mtp": dict(pp=2, dp=2, zero=1, micro_batches=2, bucket_mb=0.01,
                                  model=dataclasses.replace(MODEL, tied_head=False, mtp_depth=1)),
        # a stage layout, interleaved: the first chunk the embeddings alone
        "pp2 dp2 zero2 stages 0,2,1,1": dict(pp=2, dp=2, zero=2, micro_batches=4, schedule="interleaved",
                                             virtual_chunks=2, stage_layers=(0, 2, 1, 1), bucket_mb=0.01),
        # FSDP as today's stacks run it: no resharding after the forward, hybrid sharding (HSDP)
        "dp4 zero3 no-reshard m2": dict(dp=4, zero=3, micro_batches=2, reshard_after_forward=False),
        "dp4 zero3 sync-once m2": dict(dp=4, zero=3, micro_batches=2, reshard_after_forward=False,
                                       sync_grads_once=True),
        "pp2 dp2 zero3 no-reshard 1f1b": dict(pp=2, dp=2, zero=3, micro_batches=4, reshard_after_forward=False),
        "pp2 dp2 zero3 no-reshard zb-h1": dict(pp=2, dp=2, zero=3, micro_batches=2, schedule="zb-h1",
                                               reshard_after_forward=False),
        "dp4 zero3 shard2 m2": dict(dp=4, zero=3, micro_batches=2, shard_group=2),
        "dp4 zero2 shard2": dict(dp=4, zero=2, micro_batches=2, bucket_mb=0.01, shard_group=2),
        "dp4 zero1 shard2": dict(dp=4, zero=1, micro_batches=2, bucket_mb=0.01, shard_group=2),
        # a mixture of experts under hybrid sharding: the dense weights' collectives (the experts' are
        # tests/test_moe_training.py's, over the ranks holding the same experts)
        "moe ep2 dp4 zero3 shard2": dict(dp=4, zero=3, micro_batches=2, shard_group=2, ep=2, model=MOE),
    },
    8: {
        "tp2 pp2 dp2 zero3": dict(tp=2, pp=2, dp=2, zero=3, micro_batches=4),
        "tp2 pp2 dp2 zero2 untied": dict(tp=2, pp=2, dp=2, zero=2, micro_batches=2, bucket_mb=0.01,
                                         model=dataclasses.replace(MODEL, tied_head=False)),
        "pp2 dp4 zero3 shard2": dict(pp=2, dp=4, zero=3, micro_batches=2, shard_group=2),
        "pp2 dp4 zero3 shard2 no-reshard": dict(pp=2, dp=4, zero=3, micro_batches=2, shard_group=2,
                                                reshard_after_forward=False),
    },
}


def planned(cfg: TrainConfig, pp_rank: int) -> list[tuple[str, int, str]]:
    """What the simulator's schedule says this rank's data-parallel groups move in a step: (kind, bytes, group),
    group "shard" (every data rank, or a shard group under hybrid sharding) or "replicas"."""
    schedule = step_schedule(cfg.model, Layout.of(cfg), cfg.micro_batches, cfg.schedule, cfg.bucket_mb, cfg.precision)
    plan = schedule.config.plan
    return [tuple(call) for action in schedule.actions[pp_rank] for call in collectives(action, plan)]


def counted_calls(rank) -> list[tuple[str, int, str]]:
    """What this step's data-parallel counters saw, tagged with their group as `planned` tags it."""
    replicas = rank.comms["dp_replicas"].log if "dp_replicas" in rank.comms else []
    return [(kind, size, "shard") for kind, size in rank.comms["dp"].log] + \
        [(kind, size, "replicas") for kind, size in replicas]


def counted_and_planned(world: int) -> dict:
    """On each rank: train every layout of this world size a few steps; per step, the counted calls."""
    torch.set_num_threads(1)
    device = torch.device("cpu")
    corpus = Corpus.load(None, MODEL.seq_len)
    found = {}
    for name, changes in LAYOUTS[world].items():
        cfg = dataclasses.replace(BASE, **changes)
        mesh = build_mesh(cfg.pp, cfg.dp, cfg.tp, device, cfg.cp, cfg.shard_group)
        rank = build_rank(cfg, mesh, device, precision_policy(cfg.precision))
        steps = []
        for step in range(STEPS):
            inputs, targets = micro_batches(corpus, cfg, step, rank.mesh, device)
            rank.train_step(cfg, step, inputs, targets)
            steps.append(counted_calls(rank))
        found[name] = {"counted": steps, "planned": planned(cfg, rank.mesh.pp_rank)}
    return found


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def ranks(request):
    return run_ranks(request.param, counted_and_planned, request.param)


def test_counted_collectives_are_the_replayed_schedule(ranks):
    for rank, found in enumerate(ranks):
        for name, result in found.items():
            planned_calls = sorted(result["planned"])
            assert planned_calls, f"{name}: the schedule moves nothing over dp"
            for step, counted in enumerate(result["counted"]):
                assert sorted(counted) == planned_calls, (
                    f"{name}, rank {rank}, step {step}: counted {len(counted)} calls "
                    f"({sum(b for _, b in counted)} B), planned {len(planned_calls)} "
                    f"({sum(b for _, b in planned_calls)} B)")


def test_layouts_cover_what_the_acceptance_asks():
    layouts = [changes for world in LAYOUTS.values() for changes in world.values()]
    assert len(layouts) >= 8
    assert {c.get("zero") for c in layouts} == {0, 1, 2, 3}
    assert len({c.get("bucket_mb") for c in layouts}) >= 3
    assert all(c.get("micro_batches", 1) > 1 for c in layouts)
    assert any(c.get("tp", 1) > 1 and c.get("pp", 1) == 1 for c in layouts)
    assert any(c.get("pp", 1) > 1 and c.get("tp", 1) == 1 for c in layouts)
    assert any(c.get("tp", 1) > 1 and c.get("pp", 1) > 1 and c.get("dp", 1) > 1 for c in layouts)
