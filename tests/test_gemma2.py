"""Gemma 2's soft caps trained in every layout, against one process on the same global batch (losses and gradient
norms, 20 steps): each attention score capped (cap x tanh(score / cap): the tensor-parallel ranks' heads, the
context-parallel ring's and all-gather's blocks, whose backward passes through tanh's derivative) and each output
logit (a vocabulary-parallel head's shard, the last pipeline stage's), in Gemma's block with every second block
through a window. Context parallelism's blocks against the whole square, capped; training runs them at cp 1 too,
keeping what flash attention keeps. The head's saved tensors with the cap are the simulator's; a step priced with the caps; the
Gemma 2 presets' sizes (test_config.py). Against transformers' Gemma2ForCausalLM (every gradient, and written back):
test_hf.py and test_hf_readings.py."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from distributed import layout_parity, layout_parity_test, one_process
from job.layout import Layout
from job.train_config import TrainConfig
from minigpt.attention import causal_attention, document_ids
from minigpt.errors import ConfigError
from minigpt.model import GPT, output_logits
from minigpt.presets import preset
from model_states import trained_with_states
from parallel.context.allgather import allgather_attention
from parallel.context.apply import ContextAttentionCore, apply_context_parallel
from parallel.context.ring import ring_attention
from precision.policy import policy
from simulator.costs.ops import Implementation, head_ops
from test_checkpoint import new_rank
from test_config import saved_bytes

# tiny-llama's sizes in Gemma 2's block over 32 tokens: a window of 11 in the first and third blocks, the softmax
# scaled by 24 ** -0.5; caps small enough (1 and 2) that the tiny model's scores and logits meet them
MODEL = preset("tiny-llama").with_(
    seq_len=32, mlp="geglu", post_norms=True, embed_scale=True, query_scale=24.0, window=11, full_attention_every=2,
    tied_head=True, attention_softcap=1.0, logit_softcap=2.0)
TOLERANCE = 1e-5  # relative, every step, losses and gradient norms (fp32)
LAYOUTS = {
    2: {"tp2-sp": dict(tp=2, sequence_parallel=True, micro_batches=2), "cp2": dict(cp=2),
        "cp2-allgather": dict(cp=2, cp_kind="allgather"),
        "pp2-zb-h1-selective": dict(pp=2, micro_batches=2, schedule="zb-h1", recompute="selective")},
    4: {"tp2-pp2": dict(tp=2, pp=2, micro_batches=2), "cp2-tp2-sp-full": dict(cp=2, tp=2, sequence_parallel=True,
                                                                             recompute="full")},
}


def config(model=MODEL, **layout) -> TrainConfig:
    return TrainConfig(model=model, steps=20, global_batch=8, eval_every=0, eval_batches=1, device="cpu", lr=1e-3,
                       min_lr=1e-4, **layout)


spawned, reference = layout_parity(trained_with_states, config, LAYOUTS)
test_every_layout_matches_one_process = layout_parity_test("gemma2", LAYOUTS, TOLERANCE)


def test_the_caps_change_what_is_trained(reference):
    """The logits' cap bends the run (3.98 against 3.78 after 20 steps); the tiny model's scores stay small beside
    the attention's cap, so its attention is checked block by block below and against transformers (test_hf.py)."""
    uncapped = one_process(trained_with_states, partial(config, MODEL.with_(attention_softcap=0.0, logit_softcap=0.0)))
    assert reference["losses"][-1] < reference["losses"][0] - 0.5  # it learns
    assert abs(uncapped["losses"][-1] - reference["losses"][-1]) > 0.1


@pytest.mark.parametrize("exchange", [ring_attention, allgather_attention])
@pytest.mark.parametrize("window, documented", [(0, False), (11, False), (0, True)])
def test_blockwise_attention_caps_scores_as_the_whole_square_does(exchange, window, documented):
    """A one-rank ring or all-gather (context parallelism's blocks) against the model's capped attention over the
    whole square: outputs and the gradients of q, k and v, where the scores (about 3 here) meet a cap of 2."""
    torch.manual_seed(1)
    q = (3 * torch.randn(2, 4, 32, 8)).requires_grad_()
    k, v = (torch.randn(2, 2, 32, 8, requires_grad=True) for _ in range(2))
    documents = document_ids(torch.randint(0, 6, (2, 32)), 0) if documented else None
    ours = exchange(q, k, v, None, scale=0.3, window=window, documents=documents, softcap=2.0)
    whole = causal_attention(q, k, v, 0.3, window, group=2, documents=documents, softcap=2.0)
    uncapped = causal_attention(q, k, v, 0.3, window, group=2, documents=documents)
    assert torch.allclose(ours, whole, atol=1e-5) and not torch.allclose(whole, uncapped, atol=1e-2)
    grad = torch.randn_like(ours)
    for mine, reference in zip(torch.autograd.grad(ours, (q, k, v), grad), torch.autograd.grad(whole, (q, k, v), grad)):
        assert torch.allclose(mine, reference, atol=1e-5)


def test_the_capped_heads_saved_tensors_are_the_simulators():
    """Autograd keeps the cap's tanh output beside the loss's (one logit-sized tensor more), as head_ops says."""
    rows, width, vocab = 64, MODEL.d_model, MODEL.vocab_size
    x = torch.randn(rows, width, requires_grad=True)
    head = torch.nn.Linear(width, vocab, bias=False)
    targets = torch.randint(0, vocab, (rows,))
    kept = {cap: saved_bytes(lambda: F.cross_entropy(output_logits(head(x), MODEL.with_(logit_softcap=cap)).float(), targets), {head.weight.data_ptr()})
            for cap in (0.0, 2.0)}
    fp32 = policy("fp32")
    predicted = {cap: head_ops(MODEL.with_(seq_len=rows, logit_softcap=cap), 1, Layout(), fp32).saved_bytes
                 for cap in (0.0, 2.0)}
    assert kept[2.0] - kept[0.0] == rows * vocab * 4 == predicted[2.0] - predicted[0.0]


def test_a_step_is_priced_with_the_caps_and_unfused_attention_refused():
    from simulator.costs.op_types import unit_shape
    from simulator.engine.simulate import simulate_step
    from simulator.network.topology import build_cluster

    cluster = build_cluster("h100-sxm", 8, 1)
    steps = {}
    for name, model in (("capped", preset("gemma2-9b")),
                        ("uncapped", preset("gemma2-9b").with_(attention_softcap=0.0, logit_softcap=0.0))):
        steps[name] = simulate_step(model, Layout(dp=8, zero=3), cluster, "bf16", 8, 1, gpu="h100-sxm").step_time_s
    assert steps["uncapped"] < steps["capped"] < 1.03 * steps["uncapped"]  # six passes over 256K-wide logits: 1.6%
    with pytest.raises(ConfigError, match="softcap"):
        unit_shape(MODEL.with_(window=0, full_attention_every=0), 1, Layout(), policy("bf16"),
                   Implementation("unfused", "none"))


def test_the_model_holds_a_sequence_of_any_length():
    """The capped attention computes the whole square (no fused kernel of torch's takes a cap): any length, as
    sampling feeds it."""
    model = GPT(MODEL).eval()
    with torch.no_grad():
        whole = model(torch.arange(7).unsqueeze(0))
        assert torch.allclose(model(torch.arange(5).unsqueeze(0)), whole[:, :5], atol=1e-5)


def test_training_keeps_what_flash_attention_keeps():
    """The executor runs the capped attention blockwise at cp 1 too (a ring of one rank): a block saves q, k, v, the
    output and the log-sum-exp, the activation arithmetic (the model's own path keeps the whole square)."""
    rank = new_rank(config())
    cores = [block.attn.core for chunk in rank.stage.chunks for block in chunk.blocks]
    assert cores and all(isinstance(core, ContextAttentionCore) for core in cores)
    model, x = GPT(MODEL.with_(window=0, full_attention_every=0)), torch.randn(3, 32, MODEL.d_model, requires_grad=True)
    eager = saved_bytes(lambda: model.blocks[0](x), {p.data_ptr() for p in model.parameters()})
    apply_context_parallel(model, None, "ring")
    blockwise = saved_bytes(lambda: model.blocks[0](x), {p.data_ptr() for p in model.parameters()})
    assert blockwise == model.config.activation_bytes_per_token_per_layer() * 3 * 32 < eager
    with pytest.raises(ConfigError, match="even --seq-len"):
        config(MODEL.with_(seq_len=31))
