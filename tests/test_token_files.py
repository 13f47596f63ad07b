"""Token directories (`minigpt tokenizer encode`, minigpt/data.py): text encoded once, memory-mapped by every rank of
`minigpt train --data DIR`; the same batches, and the same losses, as the text they came from."""

from __future__ import annotations

import json

import numpy as np
import pytest
from minigpt.data import TOKENS_FILE, TOKENS_HEADER, BatchLayout, Corpus, embedded_corpus, get_batch, validation_batches
from minigpt.tokenizer import load_tokenizer, train_bpe, write_token_dir
from test_tokenizer import one_line_error, run_cli

SLICE = 200_000  # bytes of the embedded corpus: enough for seq 128, a fraction of a second to encode


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two text files (the corpus's first SLICE bytes in two parts) and the whole, a BPE of 400 tokens; the two
    encoded in bytes ("bytes") and by the BPE ("tokens"), the whole by the BPE ("whole")."""
    root = tmp_path_factory.mktemp("data")
    text = embedded_corpus()[:SLICE]
    (root / "a.txt").write_bytes(text[:SLICE // 3])
    (root / "b.txt").write_bytes(text[SLICE // 3:])
    (root / "whole.txt").write_bytes(text)
    train_bpe(text.decode("utf-8"), 400).save(root / "bpe")
    for spec, name in (("bytes", "bytes"), (str(root / "bpe"), "tokens")):
        result = run_cli("tokenizer", "encode", str(root / "a.txt"), str(root / "b.txt"), "--tokenizer", spec,
                         "--out", str(root / name), "--json")
        assert result.exit_code == 0, result.output
    result = run_cli("tokenizer", "encode", str(root / "whole.txt"), "--tokenizer", str(root / "bpe"), "--out",
                     str(root / "whole"))
    assert result.exit_code == 0 and "tokens (uint16) of 1 file" in result.stdout, result.output
    return root


def test_encoded_text_gives_the_texts_batches(sources):
    """Encoded bytes: every id the text's, the same global batches for any layout and the same validation batches.
    Encoded by a BPE: two files encoded one after the other, each whole, as the tokenizer encodes them."""
    text, dirs = Corpus.load(sources / "whole.txt", 128), Corpus.load(sources / "bytes", 128)
    assert isinstance(dirs.train, np.memmap) and dirs.train.dtype == np.uint8
    assert np.array_equal(dirs.train, text.train.numpy()) and np.array_equal(dirs.val, text.val.numpy())
    for step in range(3):
        for micro in range(2):
            for rank in range(2):
                ours = get_batch(dirs.train, 128, BatchLayout(8, 2, 2), 0, step, micro, rank)
                theirs = get_batch(text.train, 128, BatchLayout(8, 2, 2), 0, step, micro, rank)
                assert all((a == b).all() and a.dtype == b.dtype for a, b in zip(ours, theirs))
    for ours, theirs in zip(validation_batches(dirs.val, 128, 4, 2, 0), validation_batches(text.val, 128, 4, 2, 0)):
        assert all((a == b).all() for a, b in zip(ours, theirs))
    bpe = load_tokenizer(sources / "bpe")
    header = json.loads((sources / "tokens" / TOKENS_HEADER).read_text())
    expected = np.concatenate([bpe.encode((sources / name).read_text()).numpy() for name in ("a.txt", "b.txt")])
    assert header["dtype"] == "uint16" and header["tokens"] == len(expected) and [s["path"] for s in header[
        "sources"]] == [str(sources / "a.txt"), str(sources / "b.txt")]
    encoded = Corpus.load(sources / "tokens", 128, bpe)
    assert np.array_equal(np.concatenate([encoded.train, encoded.val]), expected)


def test_a_run_on_encoded_text_trains_as_on_the_text(sources, tmp_path):
    """tp 2 x dp 2, each rank mapping the directory: the losses of the run on the text, bit for bit; the data's own
    tokenizer is the run's without --tokenizer."""
    common = ["--steps", "3", "--tp", "2", "--dp", "2", "--global-batch", "4", "--eval-every", "0", "--no-save",
              "--json"]
    losses = {}
    for name, data in (("text", ["--data", str(sources / "whole.txt"), "--tokenizer", str(sources / "bpe")]),
                       ("tokens", ["--data", str(sources / "whole")])):
        result = run_cli("train", *common, *data, "--out", str(tmp_path / name))
        assert result.exit_code == 0, result.output
        losses[name] = json.loads(result.stdout)["losses"]
        assert (tmp_path / name / "tokenizer.json").is_file()
    assert losses["tokens"] == losses["text"] and losses["tokens"][-1] < losses["tokens"][0]


def test_damaged_or_mismatched_token_directories_are_one_line_before_any_rank(sources, tmp_path):
    def copy(name: str, header=None, ids=None):
        directory = tmp_path / name
        directory.mkdir()
        original = json.loads((sources / "tokens" / TOKENS_HEADER).read_text())
        (directory / TOKENS_HEADER).write_text(json.dumps({**original, **(header or {})}))
        stream = np.fromfile(sources / "tokens" / TOKENS_FILE, dtype="<u2")
        (ids if ids is not None else stream).astype("<u2").tofile(directory / TOKENS_FILE)
        (directory / "tokenizer.json").write_bytes((sources / "bpe" / "tokenizer.json").read_bytes())
        return str(directory)

    stream = np.fromfile(sources / "tokens" / TOKENS_FILE, dtype="<u2")
    cases = [
        (copy("count", {"tokens": 7}), [], "tokens.bin has"),
        (copy("format", {"format": "npy"}), [], "not a minigpt-tokens version 1 header"),
        (copy("dtype", {"dtype": "int8"}), [], "lacks a dtype"),
        (copy("past", ids=np.where(np.arange(len(stream)) == 5, 60000, stream)), [], "token id 60000"),
        (copy("short", {"tokens": 100}, ids=stream[:100]), [], "needs at least"),
        (str(sources / "tokens"), ["--tokenizer", "bytes"], "was encoded by the tokenizer"),
    ]
    for data, args, expected in cases:
        one_line_error(run_cli("train", "--steps", "2", "--data", data, *args, "--out", str(tmp_path / "never")),
                       expected)
    assert not (tmp_path / "never").exists()


def test_encode_refuses_bad_input_and_leaves_nothing(sources, tmp_path):
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [([str(tmp_path / "missing.txt")], [], "does not exist"),
             ([str(sources / "a.txt"), str(tmp_path / "latin.txt")], [], "is not UTF-8"),
             ([str(sources / "a.txt")], ["--tokenizer", str(tmp_path / "nope.json")], "does not exist"),
             ([str(sources / "a.txt")], ["--out", str(tmp_path / "full")], "is not empty")]
    for files, args, expected in cases:
        chosen = {"--out": str(tmp_path / "new"), **dict(zip(args[::2], args[1::2]))}
        one_line_error(run_cli("tokenizer", "encode", *files, *[part for pair in chosen.items() for part in pair]),
                       expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "latin.txt"]  # nothing made, nothing left
    header = write_token_dir(tmp_path / "empty_ok", [str(sources / "a.txt")], load_tokenizer("bytes"))
    assert header["tokens"] == SLICE // 3 and sorted(p.name for p in (tmp_path / "empty_ok").iterdir()) == [
        "tokenizer.json", TOKENS_FILE, TOKENS_HEADER]


def test_texts_are_encoded_in_pieces_as_whole(sources, tmp_path):
    """Read and encoded piece by piece (here of about 1,000 characters, cut at line starts whose context encodes as
    its two sides do; the byte tokenizer anywhere), a text's ids are those of the whole text encoded at once."""
    from minigpt.tokenizer import _pieces

    bpe, text = load_tokenizer(sources / "bpe"), (sources / "whole.txt").read_text()
    pieces = list(_pieces(str(sources / "whole.txt"), bpe, 1000))
    assert len(pieces) > 100 and "".join(piece for piece, _ in pieces) == text
    assert all(piece.endswith("\n") for piece, _ in pieces[:-1])  # cut at line starts
    for tokenizer, name in ((bpe, "bpe"), (load_tokenizer("bytes"), "bytes")):
        header = write_token_dir(tmp_path / name, [str(sources / "whole.txt")], tokenizer, piece_chars=997)
        ids = np.fromfile(tmp_path / name / TOKENS_FILE, dtype=header["dtype"])
        assert np.array_equal(ids, tokenizer.encode(text).numpy().astype(header["dtype"])), name
        assert header["sources"][0]["bytes"] == len(text.encode("utf-8"))


EOD = "<|endoftext|>"


@pytest.fixture(scope="module")
def with_eod(tmp_path_factory):
    """A BPE of 400 tokens with an end-of-document token (`minigpt tokenizer train --special`), and three documents
    as JSON Lines (a blank line among them, one beside other fields) and as a text file."""
    root = tmp_path_factory.mktemp("documents")
    result = run_cli("tokenizer", "train", "--vocab-size", "400", "--special", EOD, "--out", str(root / "bpe"))
    assert result.exit_code == 0, result.output
    documents = ["To be, or not to be: that is the question.", "Ô, café\nnaïve résumé", "third " * 50]
    lines = [json.dumps({"text": documents[0]}), "", json.dumps({"id": 7, "text": documents[1]}),
             json.dumps({"text": documents[2], "meta": {"source": "x"}})]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "one.txt").write_text(documents[2], encoding="utf-8")
    return root, documents


def test_documents_from_json_lines_each_end_with_the_eod_token(with_eod, tmp_path):
    root, documents = with_eod
    bpe = load_tokenizer(root / "bpe")
    eod = bpe.hf.token_to_id(EOD)
    assert eod == 0 and bpe.vocab_size == 400 and bpe.encode(f"a{EOD}b").tolist()[1] == eod  # its own id, unmerged
    result = run_cli("tokenizer", "encode", str(root / "docs.jsonl"), str(root / "one.txt"), "--jsonl", "text",
                     "--eod", EOD, "--tokenizer", str(root / "bpe"), "--out", str(tmp_path / "jsonl"), "--json")
    assert result.exit_code == 2  # one.txt is no JSON Lines file: refused, nothing left
    assert not (tmp_path / "jsonl").exists() and "one.txt:1 is not a JSON object" in result.stderr
    for name, files, args, texts in (("jsonl", ["docs.jsonl"], ["--jsonl", "text"], documents),
                                     ("text", ["one.txt", "one.txt"], [], [documents[2]] * 2)):
        result = run_cli("tokenizer", "encode", *[str(root / f) for f in files], *args, "--eod", EOD, "--tokenizer",
                         str(root / "bpe"), "--out", str(tmp_path / name), "--json")
        assert result.exit_code == 0, result.output
        header = json.loads(result.stdout)
        expected = [i for text in texts for i in [*bpe.encode(text).tolist(), eod]]
        assert np.fromfile(tmp_path / name / TOKENS_FILE, dtype=header["dtype"]).tolist() == expected
        assert header["eod"] == {"token": EOD, "id": eod} and sum(s["documents"] for s in header["sources"]) == 3 - (
            name == "text")
    result = run_cli("train", "--data", str(tmp_path / "jsonl"), "--data", str(tmp_path / "text"), "--seq-len", "16",
                     "--steps", "2", "--global-batch", "2", "--eval-every", "0", "--no-save", "--out",
                     str(tmp_path / "run"), "--json")
    assert result.exit_code == 0, result.output  # a mixture of the two, in the BPE both were encoded by


def test_documents_that_cannot_be_read_or_ended_are_one_line_and_leave_nothing(with_eod, tmp_path):
    root, _ = with_eod
    for name, line in (("not_json", "{text: 1}"), ("no_key", '{"body": "x"}'), ("not_text", '{"text": 3}'),
                       ("list", '["text"]'), ("deep", "[" * 100_000)):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
        one_line_error(run_cli("tokenizer", "encode", str(tmp_path / f"{name}.jsonl"), "--jsonl", "text",
                               "--tokenizer", str(root / "bpe"), "--out", str(tmp_path / "never")),
                       f"{name}.jsonl:2 is not a JSON object with a text under 'text'")
    for args, expected in ((["--eod", EOD], "the byte tokenizer's 256 ids are the bytes"),
                           (["--eod", "<eos>", "--tokenizer", str(root / "bpe")], f"its special tokens: '{EOD}'")):
        one_line_error(run_cli("tokenizer", "encode", str(root / "one.txt"), *args, "--out", str(tmp_path / "never")),
                       expected)
    for special in (["", "x"], ["a", "a"], [" <s>"]):
        one_line_error(run_cli("tokenizer", "train", "--vocab-size", "300", *[p for s in special for p in
                                                                             ("--special", s)],
                               "--out", str(tmp_path / "never")), "--special tokens must be distinct")
    assert not (tmp_path / "never").exists()
