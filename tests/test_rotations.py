"""Rotations of part of the model: part of each head (rotary_fraction: Phi-4-mini's 3/4, Nemotron-4's 1/2) by
LongRoPE's factors, and none in some blocks (nope_every: SmolLM3's), trained under tensor, context and pipeline
parallelism against one process on the same global batch (losses and gradient norms, 20 steps). Both against
transformers' Phi-3 and SmolLM3 (every gradient, and written back): test_hf.py and test_hf_readings.py."""

from __future__ import annotations


import pytest

from distributed import every_layout, named_parity
from job.train_config import TrainConfig
from minigpt.data import Corpus
from minigpt.presets import preset
from parity import assert_runs_match
from test_checkpoint import new_rank
from test_llama_parallel import train_history

# tiny-llama's shape over 32 tokens: half of each 32-wide head turned, by LongRoPE's long factors (the context past
# its original 16), cos and sin x 1.2
PARTIAL = preset("tiny-llama").with_(
    seq_len=32, n_layers=2, rotary_fraction=0.5,
    rope_longrope=((1.0, 1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5), (1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0), 16, 1.2))
# tiny-llama's shape over 32 tokens, its second and fourth blocks without rotary positions
NOPE = preset("tiny-llama").with_(seq_len=32, nope_every=2)
MODELS = {"partial": PARTIAL, "nope": NOPE}
TOLERANCE = 1e-5  # relative, every step, losses and gradient norms (fp32)
LAYOUTS = {
    2: {f"{model} {name}": (model, layout) for model in MODELS
        for name, layout in (("tp2", dict(tp=2)), ("cp2-allgather", dict(cp=2, cp_kind="allgather")))},
    4: {f"{model} {name}": (model, layout) for model in MODELS
        for name, layout in (("cp2-tp2-sp", dict(cp=2, tp=2, sequence_parallel=True)),
                             ("tp2-pp2", dict(tp=2, pp=2, micro_batches=2)))},
}


def config(model: str, **layout) -> TrainConfig:
    return TrainConfig(model=MODELS[model], steps=20, global_batch=8, eval_every=0, eval_batches=1, device="cpu",
                       lr=1e-3, min_lr=1e-4, **layout)


def trained(cfg: TrainConfig) -> dict:
    return train_history(new_rank(cfg), cfg, Corpus.load(None, cfg.model.seq_len))


spawned, references = named_parity(trained, config, MODELS, LAYOUTS)


ALL = every_layout(LAYOUTS)


def test_the_models_rotate_what_they_say():
    assert (PARTIAL.rotary_dim, PARTIAL.head_dim) == (16, 32)
    assert PARTIAL.longrope_factors == PARTIAL.rope_longrope[1] and PARTIAL.rope_attention_factor == 1.2
    assert [NOPE.layer_rotates(layer) for layer in range(NOPE.n_layers)] == [True, False, True, False]


@pytest.mark.parametrize("world, name", ALL, ids=[name for _, name in ALL])
def test_every_layout_matches_one_process(spawned, references, world, name):
    assert_runs_match(spawned[name], references[LAYOUTS[world][name][0]], name, TOLERANCE)
