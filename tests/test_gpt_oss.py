"""GPT-OSS's pieces trained in every layout, against one process on the same global batch (losses and gradient
norms, 20 steps): attention sinks (one per query head, split with the heads under tp, merged once per row by context
parallelism's ring and all-gather), the clamped SwiGLU experts with biases, a router with a bias, every other block
through a sliding window, YaRN unrounded. A tp 2 run's checkpoint loads at pp 2; each rank's model states are the
simulator's, byte for byte. The pieces against transformers' GptOssForCausalLM (every gradient): test_hf.py; the
presets' sizes against the model card: test_published_sizes in test_config.py."""

from __future__ import annotations

import pytest
import torch

from distributed import every_layout, layout_world, one_process, run_worlds
from job.layout import Layout
from job.train_config import TrainConfig
from minigpt.data import Corpus
from minigpt.errors import ConfigError
from minigpt.presets import preset
from parallel.checkpoint.sharded import gather_global_state, load_checkpoint, save_checkpoint
from model_states import predicted_states, trained_with_states
from parity import assert_runs_match
from test_checkpoint import mismatches, new_rank, train

# tiny-moe's sizes in GPT-OSS's block: 4 heads (2 key/value) with sinks and biases, a window of 11 over 32 tokens in
# the first block, the whole context in the second, YaRN x4 over 16 tokens unrounded, 8 clamped-SwiGLU experts of
# 256 (2 a token) with biases, a biased router
MODEL = preset("tiny-moe").with_(
    seq_len=32, n_layers=2, n_kv_heads=2, mlp="clamped-swiglu", norm="rmsnorm", positions="rope", tied_head=False,
    attention_sinks=True, router_bias=True, window=11, full_attention_every=2,
    rope_yarn=(4.0, 16, 32.0, 1.0, 0.0, 0.0), rope_yarn_truncate=False)
TOLERANCE = 1e-5  # relative, every step, losses and gradient norms (fp32)
LAYOUTS = {
    2: {"tp2-sp": dict(tp=2, sequence_parallel=True, micro_batches=2), "ep2": dict(dp=2, ep=2),
        "pp2": dict(pp=2, micro_batches=2), "dp2-zero3": dict(dp=2, zero=3),
        "tp2-selective": dict(tp=2, recompute="selective"), "ep2-full": dict(dp=2, ep=2, recompute="full"),
        "cp2": dict(cp=2), "cp2-allgather": dict(cp=2, cp_kind="allgather")},
    4: {"ep2-tp2": dict(dp=2, ep=2, tp=2), "tp2-pp2": dict(tp=2, pp=2, micro_batches=2),
        "ep2-dp4-zero3": dict(dp=4, ep=2, zero=3, micro_batches=2),
        "cp2-tp2-sp": dict(cp=2, tp=2, sequence_parallel=True), "cp2-ep2": dict(cp=2, dp=2, ep=2)},
}
SAVED_AT = 3


def config(**layout) -> TrainConfig:
    return TrainConfig(model=MODEL, steps=20, global_batch=8, eval_every=0, eval_batches=1, device="cpu", lr=1e-3,
                       min_lr=1e-4, **layout)


def spawned_world(world: int, out_dir: str) -> dict:
    runs = layout_world(trained_with_states, config, LAYOUTS, world)
    if world == 2:  # a tp 2 checkpoint (the sinks split with the heads) loaded at pp 2 (each block's whole)
        saving = config(tp=2)
        rank, corpus = new_rank(saving), Corpus.load(None, MODEL.seq_len)
        train(rank, saving, corpus, range(SAVED_AT))
        path = save_checkpoint(out_dir, rank, saving, SAVED_AT)
        at_pp2 = config(pp=2, micro_batches=2)
        loaded = new_rank(at_pp2)
        load_checkpoint(path, loaded, at_pp2)
        state, back = gather_global_state(rank, saving), gather_global_state(loaded, at_pp2)
        sinks = state["model.blocks.0.attn.core.sinks"]  # the gathered tensors are views of one buffer: not sent
        runs["saved"] = {"mismatches": mismatches(state, back), "sinks": (tuple(sinks.shape), sinks.abs().sum().item())}
    return runs


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return run_worlds(spawned_world, LAYOUTS, lambda world: str(tmp_path_factory.mktemp(f"oss{world}")))


@pytest.fixture(scope="module")
def reference():
    return one_process(trained_with_states, config)


ALL = every_layout(LAYOUTS)


@pytest.mark.parametrize("world, name", ALL, ids=[name for _, name in ALL])
def test_every_layout_matches_one_process(spawned, reference, world, name):
    assert_runs_match(spawned[name], reference, f"gpt-oss {name}", TOLERANCE)


@pytest.mark.parametrize("world, name", ALL, ids=[name for _, name in ALL])
def test_model_states_per_rank_are_the_simulators(spawned, world, name):
    """Weights, gradients and AdamW moments each rank holds, as simulator/memory.py predicts them: the sinks split
    over tp with the heads, the router's bias and the experts' biases where their weights are."""
    cfg = config(**LAYOUTS[world][name])
    for run in spawned[name]:
        assert run["states"] == predicted_states(cfg, run["stage"]), name


def test_a_tp2_checkpoint_loads_at_pp2_as_it_was_saved(spawned):
    """Every global tensor (weights, masters, moments) of a tp 2 run after 3 steps, gathered from its checkpoint
    loaded at pp 2, is the one tp 2 held: the sinks' halves, the router's and experts' biases in place."""
    for saved in spawned["saved"]:
        shape, size = saved["sinks"]
        assert shape == (MODEL.n_heads,) and size > 0  # whole, and trained away from its zeros
        assert not saved["mismatches"], saved["mismatches"]


def test_the_simulator_prices_sinks_under_our_context_parallelism_only():
    """Our ring and all-gather merge the sinks (trained above); torch's context_parallel and Transformer Engine's ring,
    as the simulator describes them, take none: one line."""
    from simulator.costs.implementation import Implementation
    from simulator.costs.ops import block_ops
    from precision.policy import policy

    model = MODEL.with_(window=0, full_attention_every=0)
    assert block_ops(model, 1, Layout(cp=2), policy("bf16"), Implementation()).saved_bytes > 0
    with pytest.raises(ConfigError, match="attention sinks"):
        block_ops(model, 1, Layout(cp=2), policy("bf16"), Implementation(cp_attention="torch"))


def test_a_blocks_saved_tensors_are_the_activation_arithmetic():
    """What autograd keeps for one block with sinks and the clamped SwiGLU, against GPTConfig's bytes per token: the
    clamped SwiGLU keeps its input alone (3 widths with fc2's input, against SwiGLU's 4), the sinks q, k, v and the
    output padded by SINK_COLUMNS; beyond the count, per micro-batch, the sink's key and value rows and the mask."""
    from test_config import saved_bytes
    from minigpt.config import SINK_COLUMNS
    from minigpt.model import GPT

    for window in (0, 7):
        cfg = preset("tiny-llama").with_(attention_sinks=True, mlp="clamped-swiglu", window=window)
        model, batch, seq = GPT(cfg), 3, cfg.seq_len
        x = torch.randn(batch, seq, cfg.d_model, requires_grad=True)
        measured = saved_bytes(lambda: model.blocks[0](x), {p.data_ptr() for p in model.parameters()})
        rows = 2 * batch * cfg.kv_heads * (cfg.head_dim + SINK_COLUMNS) * 4  # the sink's key and value, fp32
        mask = seq * (seq + 1) * 4  # the (seq, seq + 1) mask SDPA's CPU kernel keeps as fp32
        assert measured == cfg.activation_bytes_per_token_per_layer() * batch * seq + rows + mask
        assert cfg.mlp_saved_widths == 3 and cfg.sink_padding_width > 0


@pytest.mark.parametrize("window", [0, 4])
def test_sinks_are_a_softmax_column_whose_value_is_zero(window):
    """minigpt/attention.py's one SDPA call against transformers' eager GPT-OSS attention written out (the scores,
    the sinks' logits as one more column, softmax, the column dropped), in fp64: outputs and every gradient, the
    sinks' included, to 1e-12; grouped-query heads, with and without a window of 4 over 10 tokens."""
    from minigpt.attention import causal_attention

    torch.manual_seed(0)
    batch, heads, kv_heads, seq, width = 2, 4, 2, 10, 16
    q = torch.randn(batch, heads, seq, width, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seq, width, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.randn(heads, dtype=torch.float64, requires_grad=True)
    ours = causal_attention(q, k, v, width ** -0.5, window, heads // kv_heads, sinks)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * width ** -0.5
    distance = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
    scores = scores.masked_fill(~((distance >= 0) & ((distance < window) if window else True)), float("-inf"))
    column = sinks.view(1, heads, 1, 1).expand(batch, heads, seq, 1)
    theirs = torch.cat([scores, column], -1).softmax(-1)[..., :-1] @ v.repeat_interleave(2, 1)
    assert (ours - theirs).abs().max() < 1e-12
    for a, b in zip(torch.autograd.grad(ours.square().sum(), [q, k, v, sinks]),
                    torch.autograd.grad(theirs.square().sum(), [q, k, v, sinks])):
        assert (a - b).abs().max() < 1e-12
