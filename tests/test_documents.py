"""Document masks (Llama 3's): each token attends only to the tokens of its own document in a packed sequence.

What the mask means: a packed sequence's logits are each document's logits alone (a rotary model sees only
relative positions), with a sliding window and with sinks, and not so without the mask. How it is computed: the
blockwise attention context parallelism runs (a one-rank ring and all-gather) gives the same outputs and gradients
as the whole-sequence mask. Trained: every layout gives one process's losses and gradient norms over 10 steps of
the embedded corpus with each line a document (the newline its end): context parallelism both ways (its ranks
number the documents of whole sequences from gathered ids), with tensor and sequence parallelism and selective
recomputation, under a zero-bubble pipeline with full recomputation (the reruns attend within the documents of
their own micro-batch, not of the one running beside them), under interleaving, and under ZeRO-3. And a run's
flags: one line and exit 2 where the data have no documents.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from distributed import run_ranks
from job.train_config import TrainConfig
from minigpt.attention import causal_attention, document_ids, document_mask, within_documents
from minigpt.data import Corpus, documents_words, embedded_corpus
from minigpt.errors import ConfigError
from minigpt.model import GPT
from minigpt.presets import preset
from parallel.context.allgather import allgather_attention
from parallel.context.ring import ring_attention
from parity import worst_gap
from test_checkpoint import new_rank
from test_llama_parallel import train_history
from test_tokenizer import one_line_error, run_cli

NEWLINE = 10  # the embedded corpus in bytes: each line a document
LLAMA = preset("tiny-llama").with_(seq_len=32, n_layers=2)
# GPT-OSS's attention: a window of 11 over the first block (bands across the chunks of 8 at cp 2), sinks in both
GPT_OSS = LLAMA.with_(window=11, full_attention_every=2, attention_sinks=True)
MODELS = {"llama": LLAMA, "gpt-oss": GPT_OSS}
STEPS = 10
TOLERANCE = 1e-5
LAYOUTS = {
    2: {"cp2-ring": dict(cp=2), "cp2-allgather": dict(cp=2, cp_kind="allgather")},
    4: {"cp2-tp2-sp-selective": dict(cp=2, tp=2, sequence_parallel=True, recompute="selective"),
        "cp2-pp2-zb-h1-full": dict(cp=2, pp=2, micro_batches=2, schedule="zb-h1", recompute="full"),
        "dp2-pp2-interleaved-selective": dict(dp=2, pp=2, micro_batches=2, schedule="interleaved", virtual_chunks=2,
                                              recompute="selective", layers=4),  # a block a chunk
        "dp2-tp2-zero3": dict(dp=2, tp=2, zero=3)},
}


def packed(model, first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of `first` (ending in the newline) and `second` packed in one sequence, with and without the
    mask."""
    tokens = torch.cat([first, second]).unsqueeze(0)
    return model(tokens, documents=document_ids(tokens, NEWLINE))[0], model(tokens)[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_a_packed_sequence_is_its_documents_alone(name):
    torch.manual_seed(0)
    model = GPT(MODELS[name]).eval()
    first, second = torch.randint(11, 256, (13,)), torch.randint(11, 256, (19,))
    first[-1] = NEWLINE
    with torch.no_grad():
        masked, unmasked = packed(model, first, second)
        alone = model(second.unsqueeze(0))[0]
        assert torch.allclose(masked[:13], model(first.unsqueeze(0))[0], atol=1e-5)
        assert torch.allclose(masked[13:], alone, atol=1e-5), (masked[13:] - alone).abs().max()
        assert (unmasked[13:] - alone).abs().max() > 1e-2  # the same tokens seeing the first document: not so


def test_document_ids_count_the_ends_before_each_token():
    tokens = torch.tensor([[5, NEWLINE, 7, 8, NEWLINE, NEWLINE, 9], [NEWLINE, 1, 2, 3, 4, 5, 6]])
    assert document_ids(tokens, NEWLINE).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("exchange", [ring_attention, allgather_attention])
@pytest.mark.parametrize("window, sinks", [(0, False), (11, True)])
def test_blockwise_attention_within_documents_is_the_masked_attention(exchange, window, sinks):
    """A one-rank ring or all-gather (two chunks of 16) against torch's attention under the whole mask: outputs
    and gradients of q, k, v and the sinks."""
    torch.manual_seed(1)
    q = torch.randn(2, 4, 32, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, 8, requires_grad=True) for _ in range(2))
    logits = torch.randn(4, requires_grad=True) if sinks else None
    tokens = torch.randint(0, 6, (2, 32))  # id 0 ends a document: about one token in six
    documents = document_ids(tokens, 0)
    ours = exchange(q, k, v, None, scale=0.3, window=window, sinks=logits, documents=documents)
    theirs = causal_attention(q, k, v, 0.3, window, group=2, sinks=logits, documents=documents)
    grad = torch.randn_like(ours)
    inputs = [q, k, v, *([logits] if sinks else [])]
    ours_grads = torch.autograd.grad(ours, inputs, grad)
    theirs_grads = torch.autograd.grad(theirs, inputs, grad)
    assert torch.allclose(ours, theirs, atol=1e-5)
    for mine, reference in zip(ours_grads, theirs_grads):
        assert torch.allclose(mine, reference, atol=1e-5)


def base(model: str, layers: int = 2, **changes) -> TrainConfig:
    return TrainConfig(model=MODELS[model].with_(n_layers=layers), steps=STEPS, global_batch=8, eval_every=0,
                       eval_batches=1, device="cpu", lr=1e-3, min_lr=1e-4, document_eod=NEWLINE, **changes)


def history(cfg: TrainConfig) -> dict:
    return train_history(new_rank(cfg), cfg, Corpus.load(None, cfg.model.seq_len))


def parity_runs(world: int) -> dict:
    torch.set_num_threads(1)
    return {f"{model} {name}": history(base(model, **changes))
            for model in MODELS for name, changes in LAYOUTS[world].items()}


@pytest.fixture(scope="module")
def spawned():
    return {**run_ranks(2, parity_runs, 2)[0], **run_ranks(4, parity_runs, 4)[0]}


def reference(name: str) -> dict:
    """One process on the model `name`'s layout trains."""
    model, layout = name.split()
    return history(base(model, LAYOUTS[4].get(layout, {}).get("layers", 2)))


def test_every_layout_within_documents_matches_one_process(spawned):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        references = {name: reference(name) for name in spawned}
        unmasked = history(dataclasses.replace(base("llama"), document_eod=None))
    finally:
        torch.set_num_threads(threads)
    gaps = {name: worst_gap(run, references[name]) for name, run in spawned.items()}
    print("worst relative gaps: " + "; ".join(f"{name} {gap}" for name, gap in gaps.items()))
    assert len(gaps) == len(MODELS) * sum(len(layouts) for layouts in LAYOUTS.values())
    for name, gap in gaps.items():
        assert gap.loss <= TOLERANCE and gap.grad_norm <= TOLERANCE, (name, str(gap))
    masked = references["llama cp2-ring"]
    assert masked["losses"][-1] < masked["losses"][0] - 0.5  # it learns
    assert abs(masked["losses"][1] - unmasked["losses"][1]) > 1e-3  # and the mask changes what it computes


def test_an_end_of_document_outside_the_vocabulary_is_refused():
    with pytest.raises(ConfigError, match="end-of-document id 300"):
        dataclasses.replace(base("llama"), document_eod=300)


def test_one_mask_a_micro_batch_serves_every_layer():
    """The mask is made once for the documents set and shared (the backward keeps one, not one a layer)."""
    documents = document_ids(torch.randint(0, 6, (2, 16)), 0)
    with within_documents(documents):
        assert document_mask(documents, 0, False) is document_mask(documents, 0, False)
        assert document_mask(documents, 5, True).shape == (2, 1, 16, 17)
    assert document_mask(documents, 0, False) is not document_mask(documents, 0, False)  # outside: made each time


@pytest.fixture(scope="module")
def documents_dir(tmp_path_factory):
    """A BPE with two special tokens, and JSON Lines documents encoded with each as the end (and with none)."""
    root = tmp_path_factory.mktemp("documents")
    text = embedded_corpus()[:40_000].decode()
    (root / "text.txt").write_text(text)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": part}) + "\n" for part in text.split("\n\n")))
    made = run_cli("tokenizer", "train", "--vocab-size", "300", "--special", "<|endoftext|>", "--special", "<|end|>",
                   "--data", str(root / "text.txt"), "--out", str(root / "bpe"))
    assert made.exit_code == 0, made.output
    for name, ends in (("eod", ["--eod", "<|endoftext|>"]), ("end", ["--eod", "<|end|>"]), ("plain", [])):
        encoded = run_cli("tokenizer", "encode", str(root / "docs.jsonl"), "--jsonl", "text", *ends, "--tokenizer",
                          str(root / "bpe"), "--out", str(root / name))
        assert encoded.exit_code == 0, encoded.output
    return root


def test_a_run_with_document_masks_from_a_plain_shell(documents_dir):
    result = run_cli("train", "--data", str(documents_dir / "eod"), "--document-mask", "--cp", "2", "--steps", "2",
                     "--global-batch", "4", "--eval-every", "0", "--no-save", "--out", str(documents_dir / "run"),
                     "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["config"]["document_eod"] == 0 and len(summary["losses"]) == 2  # <|endoftext|>: the first id


@pytest.mark.parametrize("data, says", [
    ([], "needs --data"),
    (["text.txt"], "text.txt' is not one"),
    (["plain"], "end in no token"),
    (["eod", "end"], "different ids"),
])
def test_data_without_documents_is_one_line_before_any_rank(documents_dir, data, says):
    sources = [arg for name in data for arg in ("--data", str(documents_dir / name))]
    one_line_error(run_cli("train", *sources, "--document-mask", "--steps", "2", "--out",
                           str(documents_dir / "never")), says)
    assert not (documents_dir / "never").exists()


def test_a_run_says_its_documents_mean_length_for_simulate(documents_dir):
    """The header line's words: the end-of-document id and the mean length its tokens.json counts
    (`minigpt simulate --document-length` takes it)."""
    header = json.loads((documents_dir / "eod" / "tokens.json").read_text())
    mean = header["tokens"] / sum(source["documents"] for source in header["sources"])
    assert documents_words([documents_dir / "eod"]) == f"ended by id 0, {mean:,.0f} tokens on average"
