"""Blocks through a sliding window and every N-th attending to the whole context (GPTConfig.full_attention_every:
Gemma 3's 5 local to 1 global, GPT-OSS's alternation): each block's window in the model, its FLOPs, the simulator's
price block by block (and of blocks without rotary positions, GPTConfig.nope_every), and the refusals. Training parity under context parallelism is in test_context_training.py
(its windowed model has the pattern), the logits and gradients against transformers' Qwen3 in test_hf.py."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from job.layout import Layout
from minigpt.errors import ConfigError
from minigpt.model import GPT
from minigpt.presets import preset
from precision.policy import policy
from simulator.costs.hardware import load_hardware
from simulator.costs.ops import block_ops
from simulator.engine.simulate import simulate_step
from simulator.network.topology import build_cluster

PATTERN = preset("tiny-llama").with_(seq_len=32, n_layers=6, window=5, full_attention_every=3)


def test_every_nth_block_attends_to_the_whole_context_and_the_others_through_the_window():
    assert [PATTERN.layer_window(layer) for layer in range(6)] == [5, 5, 0, 5, 5, 0]
    torch.manual_seed(0)
    model = GPT(PATTERN).eval()
    assert [block.attn.core.window for block in model.blocks] == [5, 5, 0, 5, 5, 0]
    # each block computes as the same block of a model whose every block attends as it does
    alike = {window: GPT(PATTERN.uniform(window)).eval() for window in (5, 0)}
    for other in alike.values():
        other.load_state_dict(model.state_dict())
    x = torch.randn(2, 32, PATTERN.d_model)
    with torch.no_grad():
        for layer, block in enumerate(model.blocks):
            same = alike[PATTERN.layer_window(layer)].blocks[layer](x)
            other = alike[5 - PATTERN.layer_window(layer)].blocks[layer](x)
            assert torch.equal(block(x), same) and not torch.allclose(block(x), other)
    assert "(1 block in 3 full)" in PATTERN.describe()


def test_the_flops_count_each_blocks_keys():
    """Four windowed blocks score 5 keys a query, two the whole 32: the model's FLOPs (and selective recompute's, full
    recompute's and the flash backward's scores) are the blocks' own summed: a sixth of the sum over six models whose
    every block attends as one of the pattern's does (each the same head and embeddings, and six such blocks)."""
    per_block = [PATTERN.uniform(PATTERN.layer_window(layer)) for layer in range(6)]
    assert PATTERN.attended_by_blocks == 4 * 5 + 2 * 32
    assert PATTERN.blocks_forward_flops_per_token() == sum(c.block_forward_flops_per_token() for c in per_block)
    for recompute, attention in (("none", None), ("selective", "flash"), ("full", "flash"), ("none", "flash")):
        assert 6 * PATTERN.train_flops_per_token(recompute, attention) == sum(
            c.train_flops_per_token(recompute, attention) for c in per_block)
    full, windowed = PATTERN.uniform(0), PATTERN.uniform(5)
    assert windowed.train_flops_per_token() < PATTERN.train_flops_per_token() < full.train_flops_per_token()


@pytest.mark.parametrize("fields, word", [
    (dict(window=0, full_attention_every=2), "needs a sliding window"),
    (dict(window=5, full_attention_every=-1), "whole number >= 0"),
    (dict(window=5, full_attention_every=2.0), "whole number >= 0"),
    (dict(window=5, full_attention_every=2, mtp_depth=1), "multi-token prediction"),
])
def test_a_pattern_is_checked(fields, word):
    with pytest.raises(ConfigError, match=word):
        preset("tiny-llama").with_(**fields)


def test_the_simulator_prices_each_block_through_its_own_window():
    """Llama 3 8B at 32K tokens on 8 H100s (tp 8): the step of one block in two through a 4,096 window is the mean of
    the steps of every block windowed and none (each block priced as its kind; one stage, nothing overlapped between
    blocks), within 0.1%; one in six full sits a sixth of the way (5 full blocks of 32)."""
    cluster = build_cluster(load_hardware("h100-sxm"), 8, 1)
    base = preset("llama3-8b").with_(seq_len=32768, window=4096)

    def step(model):
        return simulate_step(model, Layout(tp=8), cluster, "bf16", 4, 1).step_time_s

    windowed, full = step(base), step(base.with_(window=0))
    assert full > 1.2 * windowed
    assert step(base.with_(full_attention_every=2)) == pytest.approx((windowed + full) / 2, rel=1e-3)
    assert step(base.with_(full_attention_every=6)) == pytest.approx((27 * windowed + 5 * full) / 32, rel=1e-3)


def test_the_simulator_prices_blocks_without_rotation_as_their_kind():
    """SmolLM3's pattern (nope_every 4) on Llama 3 8B: a quarter of the blocks without the rotation's kernels, the
    step a quarter of the way from every block rotating to none (within 1% of that gap: 0.4% here, the step not
    quite linear in a block's time), the ops of such a block
    without rope's."""
    cluster = build_cluster(load_hardware("h100-sxm"), 8, 1)
    base = preset("llama3-8b").with_(seq_len=8192)

    def step(model):
        return simulate_step(model, Layout(dp=8), cluster, "bf16", 8, 1).step_time_s

    rotating, unrotated = step(base), step(base.with_(nope_every=1))
    assert rotating > unrotated
    assert step(base.with_(nope_every=4)) == pytest.approx(rotating - (rotating - unrotated) / 4,
                                                           abs=1e-2 * (rotating - unrotated))
    names = {rotates: {op.name for op in block_ops(base.with_(nope_every=4).uniform(0, rotates), 1, Layout(),
                                                    policy("bf16")).forward} for rotates in (True, False)}
    assert "rope" in names[True] and "rope" not in names[False]


@pytest.mark.parametrize("args, word", [
    (["--full-attention-every", "2"], "needs a sliding window"),
    (["--window", "4096", "--full-attention-every", "-2"], "whole number >= 0"),
    (["--nope-every", "-1"], "nope_every must be a whole number"),
])
def test_bad_patterns_get_one_line_and_exit_2(args, word):
    for command in ("simulate", "train"):
        result = CliRunner().invoke(main, [command, "--model", "llama3-8b" if command == "simulate" else "tiny-llama",
                                           *args])
        assert result.exit_code == 2 and word in result.output and len(result.output.strip().splitlines()) == 1, \
            result.output
