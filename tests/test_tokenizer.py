"""Tokenizers (minigpt/tokenizer.py): the byte tokenizer and a Hugging Face tokenizer.json behind one interface, the
byte-level BPE `minigpt tokenizer train` writes, a run trained in its tokens (vocabulary, corpus, RUN/tokenizer.json,
sample, resume) and the simulator's vocabulary following it."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from minigpt.data import VOCAB_SIZE, BatchLayout, Corpus, embedded_corpus, encode, get_batch
from minigpt.errors import ConfigError
from minigpt.presets import PRESETS
from minigpt.tokenizer import BYTES, FILE_NAME, ByteTokenizer, load_tokenizer, model_vocab_size, train_bpe
from parallel.run.directory import is_run_dir

VOCAB = 512
SLICE = 200_000  # characters of the embedded corpus a BPE is trained on: a fraction of a second


@pytest.fixture(scope="module")
def text() -> str:
    return embedded_corpus().decode("utf-8")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory, text):
    """A byte-level BPE of VOCAB tokens trained on the corpus's first SLICE characters, saved: DIR/tokenizer.json."""
    directory = tmp_path_factory.mktemp("bpe")
    train_bpe(text[:SLICE], VOCAB).save(directory)
    return directory


def run_cli(*args):
    return CliRunner().invoke(main, [*args])


def one_line_error(result, expected: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.output


def test_a_bpe_round_trips_the_whole_corpus_exactly(bpe_dir, text):
    bpe = load_tokenizer(bpe_dir)  # a directory holding tokenizer.json
    assert bpe.vocab_size == VOCAB and bpe.spec == str(bpe_dir / FILE_NAME)
    ids = bpe.encode(text)
    assert ids.dtype == torch.int16 and 0 <= int(ids.min()) and int(ids.max()) == VOCAB - 1  # every merge used
    assert len(text.encode("utf-8")) / len(ids) > 1.7  # merges learnt on 13% of the text compress all of it
    assert bpe.decode(ids) == text
    for odd in ("naïve café", "日本語のテキスト", "emoji 🚀🧪\tand\r\n  spaces ", "\x00\x7f", "'ll 's  \n\n"):
        assert bpe.decode(bpe.encode(odd)) == odd  # characters it never saw go through their bytes


def test_a_saved_tokenizer_loads_as_the_same_one(bpe_dir, tmp_path, text):
    bpe = load_tokenizer(bpe_dir / FILE_NAME)
    again = load_tokenizer(bpe.save(tmp_path / "copy").parent)
    assert again.fingerprint == bpe.fingerprint and again.vocab_size == VOCAB
    other = train_bpe(text[SLICE:2 * SLICE], VOCAB)
    assert other.vocab_size == VOCAB and other.fingerprint != bpe.fingerprint  # other text, other merges


def test_the_byte_tokenizer_is_the_data_modules_and_saves_as_its_equivalent(tmp_path):
    tokenizer = load_tokenizer(BYTES)
    assert isinstance(tokenizer, ByteTokenizer) and tokenizer.vocab_size == VOCAB_SIZE
    sample = "To be, or not to be — ça va 🚀\n"
    assert torch.equal(tokenizer.encode(sample), encode(sample)) and tokenizer.decode(encode(sample)) == sample
    as_file = load_tokenizer(tokenizer.save(tmp_path))  # the tokenizer.json an export of a byte run carries
    assert as_file.vocab_size == 256
    assert as_file.encode(sample).tolist() == list(sample.encode("utf-8")) and as_file.decode(encode(sample)) == sample


def test_the_byte_corpus_and_its_batches_are_unchanged(bpe_dir):
    """Bytes stay uint8 and give the batches they always did (the parity tests' losses rest on them); a BPE's ids
    are int16, and its batches hold ids above 255."""
    before, through = Corpus.load(None, 64), Corpus.load(None, 64, load_tokenizer(BYTES))
    assert through.train.dtype == torch.uint8 and torch.equal(before.train, through.train)
    layout = BatchLayout(8, 2, 2)
    for x, y in zip(get_batch(before.train, 64, layout, 3, 5, 1, 1), get_batch(through.train, 64, layout, 3, 5, 1, 1)):
        assert torch.equal(x, y) and x.dtype == torch.int64
    corpus = Corpus.load(None, 64, load_tokenizer(bpe_dir))
    assert corpus.train.dtype == torch.int16 and len(corpus.train) < len(before.train) * 0.6
    x, y = get_batch(corpus.train, 64, BatchLayout(8), 0, 0)
    assert x.dtype == torch.int64 and int(x.max()) >= 256 and int(x.max()) < VOCAB
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_the_vocabulary_follows_the_tokenizer(bpe_dir):
    assert model_vocab_size(bpe_dir, None) == VOCAB and model_vocab_size(bpe_dir, 1024) == 1024
    with pytest.raises(ConfigError, match="smaller than the vocabulary"):
        model_vocab_size(bpe_dir, 300)
    assert model_vocab_size(BYTES, None) == 256


def test_the_tokenizer_train_command_writes_a_file_that_loads(tmp_path, text):
    data = tmp_path / "data.txt"
    data.write_text(text[:100_000], encoding="utf-8")
    out = tmp_path / "tok"
    result = run_cli("tokenizer", "train", "--vocab-size", "400", "--data", str(data), "--out", str(out))
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    assert "\n" not in line and "vocabulary 400" in line and "bytes per token" in line
    tokenizer = load_tokenizer(out / FILE_NAME)
    assert tokenizer.vocab_size == 400 and tokenizer.decode(tokenizer.encode(text[:5000])) == text[:5000]
    result = run_cli("tokenizer", "train", "--vocab-size", "300", "--data", str(data), "--out", str(tmp_path / "j"),
                     "--json")
    report = json.loads(result.stdout)
    assert report["vocab_size"] == 300 and report["bytes"] == len(data.read_bytes())
    assert report["bytes_per_token"] == pytest.approx(report["bytes"] / report["tokens"])
    assert report["tokens"] == len(load_tokenizer(tmp_path / "j").encode(text[:100_000]))


def test_the_tokenizer_train_command_refuses_bad_input(tmp_path):
    data, empty, latin = tmp_path / "data.txt", tmp_path / "empty.txt", tmp_path / "latin.txt"
    data.write_text("some text " * 100)
    empty.write_text("")
    latin.write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        (["--vocab-size", "256"], "--vocab-size must be a whole number from 257"),
        (["--vocab-size", str(2**21)], "--vocab-size must be a whole number from 257"),
        (["--data", str(tmp_path / "missing.txt")], "does not exist"),
        (["--data", str(latin)], "is not UTF-8"),
        (["--data", str(empty)], "is empty"),
        (["--out", str(tmp_path / "full")], "is not empty"),
        (["--out", str(data)], "is not a directory"),
    ]
    for args, expected in cases:
        chosen = {"--vocab-size": "300", "--data": str(data), "--out": str(tmp_path / "new")}
        chosen.update(dict(zip(args[::2], args[1::2])))
        one_line_error(run_cli("tokenizer", "train", *[part for pair in chosen.items() for part in pair]), expected)
    assert not (tmp_path / "new").exists()


def test_train_refuses_a_bad_tokenizer_before_any_rank_starts(tmp_path, bpe_dir):
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": {"type": "BPE", "vocab": 3}}')
    out = tmp_path / "never"
    cases = [(["--tokenizer", str(broken)], "is not a Hugging Face tokenizer.json"),
             (["--tokenizer", str(tmp_path / "missing.json")], "does not exist"),
             (["--tokenizer", str(tmp_path)], "a directory without a tokenizer.json"),
             (["--tokenizer", str(bpe_dir), "--vocab-size", "300"], "smaller than the vocabulary")]
    for args, expected in cases:
        one_line_error(run_cli("train", "--steps", "2", "--out", str(out), *args), expected)
    assert not out.exists()


def test_simulate_takes_the_tokenizers_vocabulary(bpe_dir):
    def parameters(*args):
        result = run_cli("simulate", "--model", "tiny", "--gpu", "h100-sxm", *args, "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["parameters"]["total"]

    tiny = PRESETS["tiny"]
    assert tiny.tied_head and tiny.vocab_size == 256
    assert parameters("--tokenizer", str(bpe_dir)) - parameters() == (VOCAB - 256) * tiny.d_model  # one tied matrix
    assert parameters("--tokenizer", str(bpe_dir), "--vocab-size", "1024") - parameters() == 768 * tiny.d_model
    assert parameters("--tokenizer", BYTES) == parameters()


def test_a_run_directory_keeps_its_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / FILE_NAME).write_text("{}")
    assert is_run_dir(tmp_path)  # --overwrite clears a run that kept its tokenizer.json


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory, bpe_dir):
    """A tiny run of 10 steps in the BPE's tokens with a checkpoint at the end: (run directory, summary)."""
    out = tmp_path_factory.mktemp("bpe-run") / "run"
    result = run_cli("train", "--model", "tiny", "--steps", "10", "--tokenizer", str(bpe_dir / FILE_NAME),
                     "--seq-len", "64", "--batch-size", "8", "--eval-every", "0", "--save-every", "10",
                     "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


@pytest.mark.slow
def test_a_run_trains_in_the_tokenizers_vocabulary(bpe_run, bpe_dir):
    out, summary = bpe_run
    assert summary["config"]["model"]["vocab_size"] == VOCAB
    assert summary["config"]["tokenizer"] == str(bpe_dir / FILE_NAME)
    assert summary["n_params"] == PRESETS["tiny"].n_params() - 64 * 128 + (VOCAB - 256) * 128  # seq 64, vocab 512
    assert abs(summary["losses"][0] - math.log(VOCAB)) < 0.1  # uniform over 512 tokens at the start, not over 256
    assert summary["losses"][-1] < summary["losses"][0] - 0.3
    config = json.loads((out / "config.json").read_text())
    assert config["tokenizer"]["vocab_size"] == VOCAB and config["tokenizer"]["file"] == FILE_NAME
    kept = load_tokenizer(out / FILE_NAME)
    assert kept.fingerprint == load_tokenizer(bpe_dir).fingerprint == config["tokenizer"]["fingerprint"]
    assert (out / FILE_NAME).read_bytes() == (bpe_dir / FILE_NAME).read_bytes()  # a copy, as written


@pytest.mark.slow
def test_sample_speaks_the_runs_tokens(bpe_run, bpe_dir, text):
    from parallel.run.sample import SampleOptions, generate, load_model

    out, _ = bpe_run
    result = run_cli("sample", "--out", str(out), "--prompt", "ROMEO:", "--tokens", "25", "--temperature", "0")
    assert result.exit_code == 0, result.output
    printed = result.stdout.split("\n", 3)[-1]  # after the table's three lines
    got = json.loads(run_cli("sample", "--out", str(out), "--prompt", "ROMEO:", "--tokens", "25", "--temperature",
                             "0", "--json").stdout)
    assert got["tokens"] == 25 and got["tokenizer"] == str(out / FILE_NAME)
    assert printed.strip() == ("ROMEO:" + got["text"]).strip()
    model, _ = load_model(got["checkpoint"])
    bpe = load_tokenizer(bpe_dir)
    ids = generate(model, SampleOptions(prompt="ROMEO:", tokens=25, temperature=0), bpe)
    assert len(ids) == 25 and max(ids) < VOCAB and bpe.decode(ids) == got["text"]
    assert got["text"] != load_tokenizer(BYTES).decode(ids)  # decoded as BPE ids, not as bytes


@pytest.mark.slow
def test_resume_keeps_the_runs_tokenizer(bpe_run, tmp_path, text):
    out, _ = bpe_run
    other = tmp_path / "other"
    train_bpe(text[SLICE:2 * SLICE], VOCAB).save(other)
    for spec in (BYTES, str(other)):
        result = run_cli("train", "--steps", "12", "--resume", "--out", str(out), "--tokenizer", spec)
        one_line_error(result, "is not the tokenizer the run")
    assert not (out / "checkpoints" / "step-000012").exists()


@pytest.mark.slow
def test_sample_without_the_runs_copy_reads_the_tokenizer_the_run_named(bpe_run, tmp_path):
    out, _ = bpe_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("run.lock", FILE_NAME))
    args = ["--prompt", "ROMEO:", "--tokens", "10", "--temperature", "0", "--json"]
    here, there = (json.loads(run_cli("sample", "--out", str(run), *args).stdout) for run in (out, copy))
    assert there["tokenizer"].endswith("tokenizer.json") and there["tokenizer"] != here["tokenizer"]
    assert there["text"] == here["text"]
