"""A document mask priced (Implementation.document_length, `simulate --document-length`): the share of the square
the kernel keeps, against the masks training builds (minigpt/attention.py's document_ids) over sampled documents;
the fused op's products and the length its table is read at; a step's time and memory; bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from job.layout import Layout
from minigpt.attention import document_ids
from minigpt.errors import ConfigError
from minigpt.presets import preset
from parallel.context.chunks import positions
from precision.policy import policy
from simulator.costs.layers.attention import document_share
from simulator.costs.op_types import FusedAttention, unit_shape
from simulator.costs.ops import Implementation, block_ops
from test_tokenizer import run_cli

BF16 = policy("bf16")


def sampled_share(s: int, length: int, cp: int, samples: int = 1000) -> tuple[float, float]:
    """The busiest rank's mean share of its (s/cp) x s square kept by training's own mask over sequences whose
    tokens end a document with probability 1/length, and its standard error."""
    generator = torch.Generator().manual_seed(0)
    ends = (torch.rand(samples, s, generator=generator) < 1 / length).long()  # id 1 ends a document
    documents = document_ids(ends, 1)
    kept = (documents[:, :, None] == documents[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    per_row = kept.sum(-1).double()  # each query's keys, in each sample
    ranks = [positions(rank, cp, s) if cp > 1 else torch.arange(s) for rank in range(cp)]
    shares = [per_row[:, rows].sum(-1) / (len(rows) * s) for rows in ranks]  # each sample's, each rank's
    busiest = max(shares, key=lambda share: float(share.mean()))
    return float(busiest.mean()), float(busiest.std() / samples ** 0.5)


@pytest.mark.parametrize("length, cp", [(1, 1), (4, 1), (16, 2), (50, 1), (50, 4), (400, 2)])
def test_the_share_priced_is_the_share_trainings_masks_keep(length, cp):
    mean, error = sampled_share(128, length, cp)
    assert abs(document_share(128, length, cp) - mean) <= 4 * error + 1e-12, (mean, error)


def test_long_documents_are_the_causal_mask_and_one_token_documents_the_diagonal():
    s = 8192
    assert document_share(s, 10 ** 9, 1) == pytest.approx((s + 1) / (2 * s), rel=1e-4)
    assert document_share(s, 1, 4) == pytest.approx(1 / s, rel=1e-12)
    assert document_share(s, 1000, 1) == pytest.approx(1000 / s, rel=0.15)  # about L / s, less the early rows


def attention(model, implementation, layout=Layout()) -> FusedAttention:
    return next(op for op in block_ops(model, 1, layout, BF16, implementation).forward
                if isinstance(op, FusedAttention))


def test_a_document_mask_is_the_products_within_documents():
    """Llama 3 8B at 8K in documents of 1,000 tokens on average: the kept share of the square, read at twice the keys
    a row meets; the model's FLOPs (the square, as config.py counts) and every other op unchanged."""
    model = preset("llama3-8b")
    causal = attention(model, Implementation("flash", "none"))
    masked = attention(model, Implementation("flash", "none", document_length=1000))
    kept = document_share(8192, 1000, 1)
    assert masked.flops == int(masked.square_flops * kept) and masked.benchmark_flops == masked.flops
    assert masked.efficiency_seq == round(2 * kept * 8192) and causal.efficiency_seq == 8192
    assert masked.model_square == causal.model_square and masked.flops < causal.flops / 4
    ops = {documents: [op for op in block_ops(model, 1, Layout(), BF16, Implementation(
        "flash", "none", document_length=documents)).forward if not isinstance(op, FusedAttention)]
        for documents in (0, 1000)}
    assert ops[0] == ops[1000]
    at_cp = attention(model, Implementation("flash", "none", document_length=1000), Layout(cp=2))
    assert at_cp.flops == int(at_cp.square_flops * document_share(8192, 1000, 2))


def test_shorter_documents_make_a_shorter_step_in_the_same_memory():
    from simulator.engine.simulate import simulate_step
    from simulator.network.topology import build_cluster

    model = preset("llama3-8b")
    cluster = build_cluster("h100-sxm", 8, 1)
    steps, memory = [], []
    for length in (0, 10 ** 7, 8192, 2048, 512):
        result = simulate_step(model, Layout(dp=8, zero=3), cluster, "bf16", 8, 1, gpu="h100-sxm",
                               implementation=Implementation("flash", "none", document_length=length))
        steps.append(result.step_time_s)
        memory.append(result.memory.total)
    assert steps[1] == pytest.approx(steps[0], rel=1e-3)  # documents far longer than the sequence: causal
    assert steps[1] > steps[2] > steps[3] > steps[4]
    assert len(set(memory)) == 1


@pytest.mark.parametrize("args, says", [
    (["--document-length", "-3"], "whole number of tokens >= 0"),
    (["--document-length", "512", "--attention", "unfused"], "fused attention kernel"),
])
def test_bad_document_lengths_are_one_line(args, says):
    from test_tokenizer import one_line_error
    one_line_error(run_cli("simulate", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--dp", "8",
                           *args), says)


def test_a_windowed_block_prices_its_band_alone():
    model = preset("llama3-8b").with_(window=1024)
    shape = unit_shape(model, 1, Layout(), BF16, Implementation("flash", "none", document_length=100))
    assert attention(model, Implementation("flash", "none", document_length=100)) == attention(
        model, Implementation("flash", "none")) and shape.documents == 100


def test_implementation_checks_its_length():
    with pytest.raises(ConfigError, match="document-length"):
        dataclasses.replace(Implementation("flash", "none"), document_length=2.5)
