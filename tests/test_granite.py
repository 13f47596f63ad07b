"""Granite's scalings (its muP multipliers) trained in every layout, against one process on the same global batch
(losses and gradient norms, 20 steps): the embeddings times a number (the first pipeline stage's), each branch times
another before its residual add (summed over tp, scattered under sequence parallelism, as the branch is), the
softmax scaled by a number of its own (the ring's and all-gather's blocks too), the logits divided (a
vocabulary-parallel head's shard). A block saves what the activation arithmetic counts; a step priced with them.
Against transformers' GraniteForCausalLM (every gradient, and written back): test_hf.py and test_hf_readings.py."""

from __future__ import annotations

import pytest
import torch

from distributed import layout_parity, layout_parity_test
from job.layout import Layout
from job.train_config import TrainConfig
from minigpt.errors import ConfigError
from minigpt.model import GPT
from minigpt.presets import preset
from model_states import trained_with_states
from test_config import saved_bytes

# tiny-llama over 32 tokens with Granite 3's scalings: the embeddings x 12, each branch x 0.22, the softmax scale
# 1/128 (its attention_multiplier), the logits / 16
MODEL = preset("tiny-llama").with_(seq_len=32, tied_head=True, embed_multiplier=12.0, residual_multiplier=0.22,
                                   attention_multiplier=0.0078125, logit_divisor=16.0)
TOLERANCE = 1e-5
LAYOUTS = {
    2: {"tp2-sp": dict(tp=2, sequence_parallel=True, micro_batches=2), "cp2": dict(cp=2),
        "pp2-zb-h1": dict(pp=2, micro_batches=2, schedule="zb-h1"), "dp2-zero3": dict(dp=2, zero=3)},
}


def config(model=MODEL, **layout) -> TrainConfig:
    return TrainConfig(model=model, steps=20, global_batch=8, eval_every=0, eval_batches=1, device="cpu", lr=1e-3,
                       min_lr=1e-4, **layout)


spawned, reference = layout_parity(trained_with_states, config, LAYOUTS)
test_every_layout_matches_one_process = layout_parity_test("granite", LAYOUTS, TOLERANCE)


def test_each_scaling_changes_the_model():
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 32))
    plain = GPT(MODEL.with_(embed_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=None,
                            logit_divisor=1.0))
    with torch.no_grad():
        base = plain(tokens)
        for change in (dict(embed_multiplier=12.0), dict(residual_multiplier=0.22),
                       dict(attention_multiplier=0.0078125), dict(logit_divisor=16.0)):
            scaled = GPT(plain.config.with_(**change))
            scaled.load_state_dict(plain.state_dict())
            assert not torch.allclose(scaled(tokens), base, atol=1e-4), change


def test_a_blocks_saved_tensors_are_the_activation_arithmetic():
    """Multiplying by a Python number keeps nothing for the backward: a block saves what Llama's does."""
    model, batch = GPT(MODEL), 3
    x = torch.randn(batch, MODEL.seq_len, MODEL.d_model, requires_grad=True)
    measured = saved_bytes(lambda: model.blocks[0](x), {p.data_ptr() for p in model.parameters()})
    assert measured == MODEL.activation_bytes_per_token_per_layer() * batch * MODEL.seq_len


def test_a_step_is_priced_with_the_scalings():
    from simulator.engine.simulate import simulate_step
    from simulator.network.topology import build_cluster

    cluster, llama = build_cluster("h100-sxm", 8, 1), preset("llama3-8b")
    scaled = llama.with_(embed_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                         logit_divisor=16.0)
    steps = [simulate_step(model, Layout(dp=8, zero=3), cluster, "bf16", 8, 1, gpu="h100-sxm").step_time_s
             for model in (llama, scaled)]
    assert steps[0] < steps[1] < 1.02 * steps[0]  # four passes over the residual stream a block, two over the logits


@pytest.mark.parametrize("change, says", [(dict(embed_multiplier=0.0), "embed_multiplier"),
                                          (dict(embed_scale=True), "set one"),
                                          (dict(query_scale=24.0), "set one")])
def test_bad_scalings_are_refused(change, says):
    with pytest.raises(ConfigError, match=says):
        MODEL.with_(**change)


def test_a_shape_no_granite_layout_holds_is_refused_at_export():
    """A mixture of experts with Granite's scalings would lose them in Mixtral's layout: one line instead."""
    from minigpt.hf.layouts import layout_of

    assert layout_of(MODEL) == "granite"
    moe = preset("tiny-moe").with_(mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, residual_multiplier=0.5)
    with pytest.raises(ConfigError, match="Granite layout, which cannot hold this mixtral shape"):
        layout_of(moe)
