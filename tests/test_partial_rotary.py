"""Part of each head rotated (rotary_fraction: Phi-4-mini's 3/4, Nemotron-4's 1/2) by LongRoPE's factors, trained
under tensor, context and pipeline parallelism against one process on the same global batch (losses and gradient
norms, 20 steps). The rotation against transformers' Phi-3 (every gradient, and written back): test_hf.py and
test_hf_readings.py."""

from __future__ import annotations

import pytest
import torch

from distributed import by_layout, one_thread, run_ranks
from job.train_config import TrainConfig
from minigpt.data import Corpus
from minigpt.presets import preset
from parity import worst_gap
from test_checkpoint import new_rank
from test_llama_parallel import train_history

# tiny-llama's shape over 32 tokens, half of each 32-wide head turned, by LongRoPE's long factors (the context past
# its original 16), cos and sin x 1.2
MODEL = preset("tiny-llama").with_(
    seq_len=32, n_layers=2, rotary_fraction=0.5,
    rope_longrope=((1.0, 1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5), (1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0), 16, 1.2))
TOLERANCE = 1e-5  # relative, every step, losses and gradient norms (fp32)
LAYOUTS = {
    2: {"tp2": dict(tp=2), "cp2-allgather": dict(cp=2, cp_kind="allgather")},
    4: {"cp2-tp2-sp": dict(cp=2, tp=2, sequence_parallel=True), "tp2-pp2": dict(tp=2, pp=2, micro_batches=2)},
}


def config(**layout) -> TrainConfig:
    return TrainConfig(model=MODEL, steps=20, global_batch=8, eval_every=0, eval_batches=1, device="cpu", lr=1e-3,
                       min_lr=1e-4, **layout)


def trained(cfg: TrainConfig) -> dict:
    return train_history(new_rank(cfg), cfg, Corpus.load(None, cfg.model.seq_len))


def spawned_world(world: int) -> dict:
    torch.set_num_threads(1)
    return {name: trained(config(**layout)) for name, layout in LAYOUTS[world].items()}


@pytest.fixture(scope="module")
def spawned():
    runs = {}
    for world in LAYOUTS:
        by_layout(run_ranks(world, spawned_world, world), runs)
    return runs


@pytest.fixture(scope="module")
def reference():
    with one_thread():
        return trained(config())


ALL = [(world, name) for world, layouts in LAYOUTS.items() for name in layouts]


def test_the_model_turns_half_of_each_head_by_its_long_factors():
    assert (MODEL.rotary_dim, MODEL.head_dim) == (16, 32)
    assert MODEL.longrope_factors == MODEL.rope_longrope[1] and MODEL.rope_attention_factor == 1.2


@pytest.mark.parametrize("world, name", ALL, ids=[name for _, name in ALL])
def test_every_layout_matches_one_process(spawned, reference, world, name):
    for run in spawned[name]:
        gap = worst_gap(run, reference)
        print(f"partial rotation {name}: {gap}")
        assert gap.worst <= TOLERANCE, f"{name}: {gap}"
