"""What the loss's backward holds beside its saved log-probabilities, measured on this CPU with torch's memory timeline:
the bytes per logit simulator/memory.py's LOSS_GRADIENTS charges the last stage's peak (loss_gradient_bytes)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from job.layout import Layout
from minigpt.presets import preset
from parallel.tensor.layers import VocabParallelCrossEntropy
from precision.policy import policy
from simulator.memory import LOSS_GRADIENTS, loss_gradient_bytes
from simulator.costs.implementation import Implementation

ROWS, VOCAB, WIDTH = 512, 8192, 64
FP32 = 4


class OneRank:
    """VocabParallelCrossEntropy's collectives over a tp group of one: the whole vocabulary on this rank."""

    def max(self, tensor):
        return tensor

    def sum(self, tensor):
        return tensor


def peak_per_logit(loss_fn, tmp_path) -> float:
    """The most bytes alive at once during a head's forward and backward, above what was alive before (the inputs,
    the weights and their gradients from a first run), per logit: the memory timeline's peak over its start."""
    torch.manual_seed(0)
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    w = torch.randn(VOCAB, WIDTH, requires_grad=True)
    targets = torch.randint(0, VOCAB, (ROWS,))

    def step():
        logits = x @ w.t()
        loss = loss_fn(logits, targets)
        del logits
        loss.backward()

    step()  # the gradients' own buffers exist from here on
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    path = tmp_path / "timeline.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # export_memory_timeline: deprecated, still torch's own
        prof.export_memory_timeline(str(path), device="cpu")
    _, sizes = json.loads(path.read_text())
    return (max(map(sum, sizes)) - sum(sizes[0])) / (ROWS * VOCAB)


def test_torchs_cross_entropy_holds_two_fp32_gradients_beside_its_log_probabilities(tmp_path):
    """F.cross_entropy on fp32 logits (our model at tp 1, torchtitan's): log_softmax saves its output, and the
    backward holds nll_loss's gradient and log_softmax's beside it."""
    measured = peak_per_logit(lambda logits, t: F.cross_entropy(logits.float(), t), tmp_path)
    assert measured == pytest.approx(FP32 + LOSS_GRADIENTS["torch"], rel=0.01)


def test_our_vocab_parallel_cross_entropy_holds_one(tmp_path):
    """parallel/tensor/layers.py's VocabParallelCrossEntropy (our executor under tp): it saves the exponentials, made in
    place of the shifted logits, and its backward makes the gradient in place of them, so its peak is the forward's:
    the fp32 logits beside the exponentials. A rank holding padded vocabulary masks a copy of its logits: one more."""
    def ours(vocab):
        return lambda logits, t: VocabParallelCrossEntropy.apply(logits, t, 0, vocab, OneRank())

    assert peak_per_logit(ours(VOCAB), tmp_path) == pytest.approx(FP32 + LOSS_GRADIENTS["ours-tp"], rel=0.01)
    assert peak_per_logit(ours(VOCAB - 100), tmp_path) == pytest.approx(2 * FP32 + LOSS_GRADIENTS["ours-tp"], rel=0.01)


def test_the_stacks_losses_and_what_they_cost_a_step():
    """Per stack on Llama 3 8B, one 8,192-token sequence: torch's cross entropy (ours, torchtitan's) holds two fp32
    gradients a logit of the 128,256-word vocabulary, ours under tp one of its shard, Megatron's in place only the
    bf16 copy of its gradient (none in fp32)."""
    model, bf16, fp32 = preset("llama3-8b"), policy("bf16"), policy("fp32")
    logits = model.seq_len * 128256
    assert loss_gradient_bytes(model, Layout(), bf16, 1) == logits * 2 * FP32
    assert loss_gradient_bytes(model, Layout(), bf16, 1, Implementation(loss="torch")) == logits * 2 * FP32
    assert loss_gradient_bytes(model, Layout(tp=2), bf16, 1) == logits // 2 * FP32
    assert loss_gradient_bytes(model, Layout(), bf16, 1, Implementation(loss="fused")) == logits * 2
    assert loss_gradient_bytes(model, Layout(), fp32, 1, Implementation(loss="fused")) == 0
