"""Context parallelism (parallel/context/): the load-balanced split; ring and all-gather attention over 2 and 4
gloo ranks against torch's own causal attention on the whole sequence, outputs and gradients, with grouped-query
heads, without and through sliding windows; the ring's bytes counted; and the plain model made context-parallel from outside (learned positions, RoPE with
grouped-query attention, and Qwen3's wider heads with their query and key norms), its loss and gradients against one
process on the same batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_ranks
from minigpt.config import GPTConfig
from minigpt.model import GPT
from parallel.context.allgather import allgather_attention
from parallel.context.apply import apply_context_parallel, average_over
from parallel.context.chunks import check_split, chunk_ids, local_part, positions, whole_sequence
from parallel.context.ring import ring_attention

B, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 16, 8
KINDS = {"ring": ring_attention, "allgather": allgather_attention}
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
# Three small models: GPT-2's shape (learned positions, GELU, LayerNorm), Llama's (RoPE, grouped-query
# attention, SwiGLU, RMSNorm, no biases, untied head) and Qwen3's (Llama's with heads wider than width / heads and
# each query and key head RMS-normalised); 32 tokens split into 2 x cp chunks for cp 2 and 4.
MODELS = {
    "gpt": GPTConfig(vocab_size=64, seq_len=32, n_layers=2, n_heads=4, d_model=32, d_ff=64),
    "llama": GPTConfig(vocab_size=64, seq_len=32, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=48,
                       positions="rope", mlp="swiglu", norm="rmsnorm", bias=False, tied_head=False),
    "qwen3": GPTConfig(vocab_size=64, seq_len=32, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=48, d_head=12,
                       qk_norm=True, positions="rope", mlp="swiglu", norm="rmsnorm", bias=False, tied_head=False),
    # Mistral's: Llama's through a sliding window, here 7 tokens (chunks of 8 at cp 2, 4 at cp 4)
    "mistral": GPTConfig(vocab_size=64, seq_len=32, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=48,
                         window=7, positions="rope", mlp="swiglu", norm="rmsnorm", bias=False, tied_head=False),
    # GPT-OSS's attention: a sink per query head (merged once per row by the ring and the all-gather), the window in
    # the first block only
    "sinks": GPTConfig(vocab_size=64, seq_len=32, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=48,
                       window=7, full_attention_every=2, attention_sinks=True, positions="rope", mlp="swiglu",
                       norm="rmsnorm", tied_head=False),
}


def inputs() -> tuple[torch.Tensor, ...]:
    """q, k, v of the whole sequence (grouped-query: fewer key/value heads) and an output gradient."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, HEADS, SEQ, HEAD_DIM, generator=gen)
    k, v = (torch.randn(B, KV_HEADS, SEQ, HEAD_DIM, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(B, HEADS, SEQ, HEAD_DIM, generator=gen)


WINDOWS = (0, 3, 6, 11)  # no window; windows cutting chunks of 4 (cp 2) and 2 (cp 4) in bands, and spanning several


def reference(window: int = 0) -> dict[str, torch.Tensor]:
    """torch's causal attention on one process (through a sliding window: query i sees keys i - window < j <= i,
    written out as a mask here): the output and the gradients of q, k and v."""
    q, k, v, grad = inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    groups = HEADS // KV_HEADS
    i = torch.arange(SEQ)
    mask = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < window) if window else True)
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                         attn_mask=mask)
    out.backward(grad)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def local_run(kind: str, group, rank: int, cp: int, window: int = 0) -> dict:
    """One rank's attention over its two chunks, forward and backward."""
    q, k, v, grad = (local_part(t, rank, cp, 2) for t in inputs())
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = KINDS[kind](q, k, v, group, window=window)
    out.backward(grad)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def ranks_run() -> dict:
    """On 4 ranks: cp 4 over all of them, and cp 2 over (0, 1) and (2, 3) at once, each kind; and what the
    ring sent."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {}
    for kind in KINDS:
        for window in WINDOWS:
            results[(kind, 4, window)] = local_run(kind, dist.group.WORLD, rank, 4, window)
            results[(kind, 2, window)] = local_run(kind, pairs[rank // 2], rank % 2, 2, window)
    sent, models = {}, {}
    for cp, group in ((4, dist.group.WORLD), (2, pairs[rank // 2])):
        sent[cp] = count_ring_bytes(group, rank % cp, cp)
        for name in MODELS:
            for kind in KINDS:
                models[(name, kind, cp)] = model_step(name, kind, group, rank % cp, cp)
    return {"results": results, "sent": sent, "models": models}


def batch(config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(config.vocab_size, (3, config.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def model_step(name: str, kind: str | None, group, rank: int, cp: int) -> dict:
    """One forward and backward of the model on a batch: the loss and every parameter's gradient, averaged over
    the context-parallel group (kind None: one process, the whole sequence)."""
    config = MODELS[name]
    torch.manual_seed(0)
    model = GPT(config)
    inputs, targets = batch(config)
    if kind is not None:
        apply_context_parallel(model, group, kind)
        inputs, targets = local_part(inputs, rank, cp, 1), local_part(targets, rank, cp, 1)
    loss = model(inputs, targets)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    loss = loss.detach()
    if kind is not None:
        average_over(group, [loss, *grads.values()])
    return {"loss": loss, "grads": grads}


def count_ring_bytes(group, rank: int, cp: int) -> tuple[int, int]:
    """(bytes the ring sent in the forward, in forward and backward) from this rank."""
    from parallel.context.ring import Ring, RingAttention

    from parallel.comm import Collectives

    q, k, v, grad = (local_part(t, rank, cp, 2).clone().requires_grad_() for t in inputs())
    counter = Collectives(group, "cp")  # the counter training's ring counts its sends in
    out = RingAttention.apply(q, k, v, Ring(group, counter), HEAD_DIM ** -0.5, 0)
    forward = counter.bytes["send"]
    out.backward(grad.detach())
    return forward, counter.bytes["send"]


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(4, ranks_run)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_equals_torchs_on_the_whole_sequence(four_ranks, kind, cp, window):
    expected = reference(window)
    for first in range(0, 4, cp):  # every cp group of the run holds the whole sequence
        parts = [four_ranks[rank]["results"][(kind, cp, window)] for rank in range(first, first + cp)]
        for name, value in expected.items():
            torch.testing.assert_close(whole_sequence([p[name] for p in parts], 2), value, **TOLERANCE)


def test_the_ring_sends_its_keys_and_values_and_their_gradients(four_ranks):
    for cp in (2, 4):
        kv = 2 * B * KV_HEADS * (SEQ // cp) * HEAD_DIM * 4  # k and v of one rank's two chunks, fp32
        for result in four_ranks:
            forward, total = result["sent"][cp]
            assert forward == (cp - 1) * kv  # every step but the last passes k and v on
            assert total == 2 * (cp - 1) * kv + cp * kv  # again in the backward, and dk, dv (fp32) every step


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_one_rank_is_plain_causal_attention(kind, window):
    q, k, v, grad = inputs()
    expected = reference(window)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = KINDS[kind](q, k, v, None, window=window)
    out.backward(grad)
    for name, value in {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}.items():
        torch.testing.assert_close(value.detach(), expected[name], **TOLERANCE)


def test_the_load_balanced_split():
    assert [chunk_ids(rank, 4) for rank in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    x = torch.arange(16)
    assert local_part(x, 1, 4, 0).tolist() == [2, 3, 12, 13]
    assert positions(1, 4, 16).tolist() == [2, 3, 12, 13]  # each chunk's true offsets
    assert torch.equal(whole_sequence([local_part(x, r, 4, 0) for r in range(4)], 0), x)
    # every rank does the same causal work: the number of (query, key) pairs at or below the diagonal
    work = [sum(int(p) + 1 for p in positions(rank, 4, 16)) for rank in range(4)]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="2 x cp = 8 equal chunks"):
        check_split(12, 4)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("cp", [2, 4])
def test_the_model_made_context_parallel_equals_one_process(four_ranks, name, kind, cp):
    """Loss and every gradient, averaged over the group, against one process on the same batch."""
    expected = model_step(name, None, None, 0, 1)
    for result in four_ranks:
        got = result["models"][(name, kind, cp)]
        torch.testing.assert_close(got["loss"], expected["loss"], rtol=1e-6, atol=1e-6)
        assert got["grads"].keys() == expected["grads"].keys()  # the parameters keep their names
        for param, grad in expected["grads"].items():
            torch.testing.assert_close(got["grads"][param], grad, **TOLERANCE, msg=param)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("cp", [2, 4])
def test_a_rehearsal_computes_what_rank_0_computes(kind, cp):
    """parallel/calibrate times one rank's compute alone: rank 0 of a Rehearsal group, every other rank's keys and
    values a copy of its own. That is the attention of rank 0's queries over a sequence whose every rank's chunks
    hold rank 0's keys and values: torch's causal attention on that whole sequence, read at rank 0's chunks."""
    from parallel.context.ring import Rehearsal

    q, k, v, grad = (local_part(t, 0, cp, 2) for t in inputs())
    out = KINDS[kind](q, k, v, Rehearsal(cp))
    whole_k, whole_v = (whole_sequence([t] * cp, 2) for t in (k, v))
    whole_q = whole_sequence([q] * cp, 2)  # rank 0's queries at its own positions (the rest are not read)
    groups = HEADS // KV_HEADS
    expected = F.scaled_dot_product_attention(whole_q, whole_k.repeat_interleave(groups, 1),
                                              whole_v.repeat_interleave(groups, 1), is_causal=True)
    torch.testing.assert_close(out, local_part(expected, 0, cp, 2), **TOLERANCE)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    KINDS[kind](q, k, v, Rehearsal(cp)).backward(grad)  # the backward runs, alone, and reaches every input
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
