"""Gemma 3's pieces trained in every layout, against one process on the same global batch (losses and gradient norms,
20 steps): a norm after each branch (post_norms), GeGLU, the embeddings times sqrt(d_model), the softmax scaled by
query_scale, every second block through a sliding window rotating by its own base and the others by a linearly
scaled one, per-head q/k norms, a tied head. Each rank's model states are the simulator's, byte for byte; a block's
saved tensors are the activation arithmetic. Against transformers' Gemma3ForCausalLM (every gradient, and written
back): test_hf.py and test_hf_readings.py."""

from __future__ import annotations


import pytest
import torch

from distributed import every_layout, layout_parity, layout_parity_test
from job.train_config import TrainConfig
from minigpt.model import GPT
from minigpt.presets import preset
from model_states import predicted_states, trained_with_states
from test_config import saved_bytes

# tiny-llama's sizes in Gemma 3's block over 32 tokens: a window of 11 in the first and third blocks (rotating by
# base 100), the second and fourth whole (base 10,000, positions halved), the softmax scaled by 24 ** -0.5
MODEL = preset("tiny-llama").with_(
    seq_len=32, mlp="geglu", qk_norm=True, post_norms=True, embed_scale=True, query_scale=24.0, window=11,
    full_attention_every=2, rope_local_theta=100.0, rope_linear=2.0, tied_head=True)
TOLERANCE = 1e-5  # relative, every step, losses and gradient norms (fp32)
LAYOUTS = {
    2: {"tp2-sp": dict(tp=2, sequence_parallel=True, micro_batches=2), "cp2": dict(cp=2),
        "pp2": dict(pp=2, micro_batches=2), "dp2-zero3": dict(dp=2, zero=3)},
    4: {"tp2-pp2": dict(tp=2, pp=2, micro_batches=2), "cp2-tp2-sp": dict(cp=2, tp=2, sequence_parallel=True)},
}


def config(**layout) -> TrainConfig:
    return TrainConfig(model=MODEL, steps=20, global_batch=8, eval_every=0, eval_batches=1, device="cpu", lr=1e-3,
                       min_lr=1e-4, **layout)


spawned, reference = layout_parity(trained_with_states, config, LAYOUTS)
test_every_layout_matches_one_process = layout_parity_test("gemma", LAYOUTS, TOLERANCE)
ALL = every_layout(LAYOUTS)


@pytest.mark.parametrize("world, name", ALL, ids=[name for _, name in ALL])
def test_model_states_per_rank_are_the_simulators(spawned, world, name):
    """Weights, gradients and AdamW moments each rank holds, as simulator/memory.py predicts them: the post norms
    beside the block's two others, replicated over tp."""
    cfg = config(**LAYOUTS[world][name])
    for run in spawned[name]:
        assert run["states"] == predicted_states(cfg, run["stage"]), name


def test_a_blocks_saved_tensors_are_the_activation_arithmetic():
    """What autograd keeps for one Gemma block against GPTConfig's bytes per token: the post norms' inputs and
    statistics beside the rest, GeGLU's four widths (SwiGLU's); per micro-batch beyond the count, the window's
    mask."""
    for window in (0, 7):
        cfg = MODEL.with_(window=window, full_attention_every=0, rope_local_theta=100.0 if window else None)
        model, batch, seq = GPT(cfg), 3, cfg.seq_len
        x = torch.randn(batch, seq, cfg.d_model, requires_grad=True)
        measured = saved_bytes(lambda: model.blocks[0](x), {p.data_ptr() for p in model.parameters()})
        mask = 4 * seq * seq if window else 0  # the (seq, seq) window mask SDPA's CPU kernel keeps as fp32
        assert measured == cfg.activation_bytes_per_token_per_layer() * batch * seq + mask, window
