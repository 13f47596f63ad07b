"""Selective and full recomputation in training: the same losses bit for bit, and the activation memory the
simulator predicts (simulator/memory.py, from simulator/costs/ops.py's saved tensors). Full recomputation in the
parallel layouts, against one process: tests/test_fsdp.py, tests/test_context_training.py,
tests/test_moe_training.py."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from job.layout import Layout
from job.train_config import TrainConfig
from minigpt.presets import PRESETS
from minigpt.model import GPT
from parallel.recompute import Recomputed, apply_recompute
from parallel.run.train import train
from precision.policy import policy
from simulator.memory import loss_gradient_bytes, predict_memory, recomputed_bytes

SHAPES = {name: PRESETS[name].with_(seq_len=64, n_layers=2) for name in ("tiny", "tiny-llama", "tiny-deepseek")}
BATCH = 4


def run(tmp_path, name: str, recompute: str) -> dict:
    cfg = TrainConfig(model=SHAPES[name], steps=3, global_batch=BATCH, eval_every=0, eval_batches=1,
                      out_dir=str(tmp_path / f"{name}-{recompute}"), device="cpu", recompute=recompute)
    return train(cfg)


def predicted_activations(name: str, recompute: str) -> int:
    """What one micro-batch's forward keeps on one rank: the simulator's activations less the transient
    tensors of the one block whose backward recomputes and of the loss's backward (training measures the forward)."""
    model, fp32 = SHAPES[name], policy("fp32")
    memory = predict_memory(model, Layout(), "fp32", BATCH, recompute, micro_batches_in_flight=1)
    return (memory.activations - recomputed_bytes(model, Layout(), fp32, BATCH, recompute)
            - loss_gradient_bytes(model, Layout(), fp32, BATCH))


@pytest.mark.parametrize("name", list(SHAPES))
def test_recompute_same_losses_and_predicted_memory(tmp_path, name):
    runs = {recompute: run(tmp_path, name, recompute) for recompute in ("none", "selective", "full")}
    for recompute in ("selective", "full"):
        assert runs[recompute]["losses"] == runs["none"]["losses"], recompute  # bit for bit
    measured = {r: s["memory_per_rank"][0]["activations"] for r, s in runs.items()}
    model = SHAPES[name]
    # what the core kept of its own: the fp32 log-sum-exp, one per query head and token, in every block (and under
    # latent attention its zero-padded values and padded output)
    own = 4 * model.n_heads + 4 * model.padded_values_width
    assert measured["none"] - measured["selective"] == model.n_layers * own * BATCH * model.seq_len
    # full: each block its input alone (B x T x d fp32), beside the embeddings' and the head's own
    assert measured["full"] < measured["none"] / 4
    for recompute, bytes_measured in measured.items():
        predicted = predicted_activations(name, recompute)
        assert abs(predicted / bytes_measured - 1) < 0.05, (recompute, predicted, bytes_measured)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "tiny-moe"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fully_recomputed_blocks_give_the_same_gradients(name, dropout):
    """Every parameter's gradient bit for bit: the rerun draws the forward's dropout masks again (its random state
    restored), a mixture of experts routes the same tokens, and the blocks keep their parameters' names."""
    model = GPT(PRESETS[name].with_(seq_len=64, n_layers=2, dropout=dropout))
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    model(idx, idx).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    apply_recompute(model, "full")
    torch.manual_seed(1)
    model(idx, idx).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads.keys() == expected.keys()
    assert all(grads[n] is not None and torch.equal(grads[n], expected[n]) for n in expected)
    plain = GPT(model.config)
    plain.load_state_dict(model.state_dict())  # the same names: the blocks were not wrapped
    model.eval(), plain.eval()
    with torch.no_grad():  # evaluation: the same loss as the plain model's
        assert torch.equal(model(idx, idx), plain(idx, idx))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_recomputed_core_gives_the_same_gradients(qk_norm):
    """Every parameter's gradient, bit for bit: with Qwen3's query and key norms the core holds weights of its own,
    whose gradients the recomputation computes (it once returned the input's gradient only: they stayed None)."""
    torch.manual_seed(0)
    model = GPT(SHAPES["tiny-llama"].with_(qk_norm=qk_norm))
    idx = torch.randint(0, 256, (2, 64))
    model(idx, idx).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apply_recompute(model, "selective")
    assert all(isinstance(block.attn.core, Recomputed) for block in model.blocks)
    model(idx, idx).backward()
    grads = [p.grad for p in model.parameters()]
    assert len(grads) == len(expected) == len(list(model.parameters()))
    assert all(g is not None and torch.equal(g, e) for g, e in zip(grads, expected))


def test_selective_recompute_trains_qk_norm_as_without(tmp_path):
    """Qwen3-style training with selective recomputation: the same losses as without, and the norms' weights move."""
    shape = SHAPES["tiny-llama"].with_(qk_norm=True)
    runs = {}
    for recompute in ("none", "selective"):
        cfg = TrainConfig(model=shape, steps=3, global_batch=BATCH, eval_every=0, eval_batches=1, device="cpu",
                          out_dir=str(tmp_path / recompute), recompute=recompute)
        runs[recompute] = train(cfg)
    assert runs["selective"]["losses"] == runs["none"]["losses"]


def test_recomputed_core_runs_its_parameters_hooks_once():
    """Tensor parallelism sums the query and key norms' gradients over its group in a hook on each weight
    (parallel/tensor/parallelize.py): the rerun must not fire it a second time (it did: the sum counted twice)."""
    torch.manual_seed(0)
    model = apply_recompute(GPT(SHAPES["tiny-llama"].with_(qk_norm=True)), "selective")
    calls = []
    norms = [p for block in model.blocks for p in block.attn.core.inner.parameters()]
    for param in norms:
        param.register_hook(lambda grad, p=param: calls.append(id(p)) or grad * 2)  # as a sum over 2 ranks would
    idx = torch.randint(0, 256, (2, 64))
    model(idx, idx).backward()
    assert sorted(calls) == sorted(map(id, norms))  # each once


def fp8_histories() -> dict:
    """On each of 2 ranks: 3 fp8 steps of pp 2, interleaved over 4 micro-batches, without and with full
    recomputation (its reruns come in the order the forwards went, several forwards ahead of their backwards)."""
    from test_fsdp import history

    torch.set_num_threads(1)
    found = {}
    for recompute in ("none", "full"):
        cfg = TrainConfig(model=SHAPES["tiny-llama"].with_(n_layers=4), steps=3, global_batch=8, micro_batches=4,
                          pp=2, schedule="interleaved", virtual_chunks=2, precision="fp8", eval_every=0,
                          eval_batches=1, device="cpu", recompute=recompute)
        run = history(cfg)
        found[recompute] = (run["losses"], run["grad_norms"])
    return found


def test_full_recompute_in_fp8_is_the_same_computation():
    """fp8's delayed scaling under full recomputation: the rerun quantises with the scales its forward used and
    records nothing (precision/fp8.py's recompute_phase), so the histories, the scales and so the steps are those without
    recomputation, to the bit; one process, then pp 2 interleaved."""
    shape = SHAPES["tiny-llama"]
    runs = {}
    for recompute in ("none", "full"):
        cfg = TrainConfig(model=shape, steps=3, global_batch=BATCH, micro_batches=2, eval_every=0, eval_batches=1,
                          device="cpu", precision="fp8", recompute=recompute)
        runs[recompute] = train(cfg)
    assert runs["full"]["losses"] == runs["none"]["losses"]
    assert runs["full"]["grad_norms"] == runs["none"]["grad_norms"]
    for rank in run_ranks(2, fp8_histories):
        assert rank["full"] == rank["none"]


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_zero_bubble_defers_the_recomputed_weight_gradients(mode):
    """Under a zero-bubble split the rerun happens in the backward's first half, which computes the input's
    gradient and no weight's (the block's, or the core's norms under selective recomputation); the second half
    then gives every weight the gradient a plain backward gives."""
    from parallel.pipeline.weight_gradients import WeightGradients

    shape = SHAPES["tiny-llama"].with_(qk_norm=True)
    torch.manual_seed(0)
    plain, model = GPT(shape), GPT(shape)
    model.load_state_dict(plain.state_dict())
    apply_recompute(model, mode)
    x = torch.randn(2, 64, shape.d_model, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, 64, shape.d_model, generator=torch.Generator().manual_seed(2))
    expected_x = torch.autograd.grad((torch.nn.Sequential(*plain.blocks)(x.requires_grad_()) * grad).sum(), x,
                                     retain_graph=True)[0]
    (torch.nn.Sequential(*plain.blocks)(x) * grad).sum().backward()
    chunk = torch.nn.Sequential(*model.blocks)
    chunk.index = 0
    split, again = WeightGradients([chunk]), x.detach().requires_grad_()
    out = split.forward(chunk, again, (0, 0))
    grad_x = split.input_gradient((0, 0), out, grad, again)
    assert torch.equal(grad_x, expected_x)
    assert all(p.grad is None for p in chunk.parameters())  # nothing yet: every weight gradient waits
    split.weight_gradients((0, 0), lambda params: None)
    for (name, p), q in zip(chunk.named_parameters(), torch.nn.Sequential(*plain.blocks).parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
