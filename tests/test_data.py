"""Tokenizer, corpus and the determinism of batches."""

import pytest
import torch

from minigpt.data import (
    VOCAB_SIZE,
    BatchLayout,
    Corpus,
    decode,
    embedded_corpus,
    encode,
    get_batch,
    validation_batches,
)
from minigpt.errors import ConfigError


@pytest.mark.parametrize("text", ["", "hello", "naïve café", "日本語のテキスト", "emoji 🚀🧪 and\ttabs\n", "\x00\x7f"])
def test_round_trip(text):
    tokens = encode(text)
    assert tokens.dtype == torch.uint8 and len(tokens) == len(text.encode('utf-8'))
    assert all(0 <= t < VOCAB_SIZE for t in tokens.tolist())
    assert decode(tokens) == text


def test_multibyte_characters_take_several_tokens():
    assert len(encode("é")) == 2 and len(encode("🚀")) == 4


def test_embedded_corpus_is_real_text_of_a_megabyte():
    data = embedded_corpus()
    assert len(data) > 1_000_000
    text = data.decode("utf-8")
    assert "To be, or not to be" in text


def test_split_and_batches_are_deterministic():
    corpus = Corpus.load(None, seq_len=64)
    assert len(corpus.val) / (len(corpus.train) + len(corpus.val)) == pytest.approx(0.1, abs=1e-3)
    layout = BatchLayout(global_batch=8)
    a = get_batch(corpus.train, 64, layout, seed=1, step=5)
    b = get_batch(corpus.train, 64, layout, seed=1, step=5)
    c = get_batch(corpus.train, 64, layout, seed=1, step=6)
    d = get_batch(corpus.train, 64, layout, seed=2, step=5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], d[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted by one


def test_any_layout_sees_the_same_global_batch():
    tokens = encode("the quick brown fox jumps over the lazy dog " * 50)
    whole = get_batch(tokens, 16, BatchLayout(global_batch=8), seed=3, step=7)[0]
    for micro_batches, dp in [(2, 1), (1, 4), (2, 2), (4, 2)]:
        layout = BatchLayout(8, micro_batches, dp)
        pieces = [
            get_batch(tokens, 16, layout, seed=3, step=7, micro_batch=m, dp_rank=r)[0]
            for m in range(micro_batches)
            for r in range(dp)
        ]
        assert torch.equal(torch.cat(pieces), whole)


def test_validation_batches_are_fixed():
    tokens = encode("abcdefghij" * 100)
    first = [x for x, _ in validation_batches(tokens, 8, 2, 3, seed=0)]
    second = [x for x, _ in validation_batches(tokens, 8, 2, 3, seed=0)]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_bad_data(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Corpus.load(tmp_path / "missing.txt", 16)
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ConfigError, match="needs at least"):
        Corpus.load(short, 16)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ConfigError, match="has 0 bytes"):
        Corpus.load(empty, 16)
    binary = tmp_path / "binary.bin"
    binary.write_bytes(b"\xff\xfe" * 200)
    with pytest.raises(ConfigError, match="not UTF-8"):
        Corpus.load(binary, 16)
    with pytest.raises(ConfigError, match="not divisible"):
        BatchLayout(global_batch=6, micro_batches=4)
