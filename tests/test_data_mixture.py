"""A mixture of data sources (`minigpt train --data A --data B --data-weights 3,1`, minigpt/data.py's Mixture):
each source in its share of every run of samples, the same global batch for any layout and after any resume, the
same losses in tp 2 x dp 2 as in one process."""

from __future__ import annotations

import json

import pytest
import torch

from minigpt.data import BatchLayout, Corpus, Mixture, embedded_corpus, get_batch
from test_tokenizer import one_line_error, run_cli

SEQ = 16


def labelled(shares: tuple[float, ...]) -> Mixture:
    """A mixture of streams whose every token is its source's number (1, 2, ...), so a sample says where it came
    from."""
    return Mixture(tuple(torch.full((500 + 100 * i,), i + 1, dtype=torch.uint8) for i in range(len(shares))), shares)


def sources_of(inputs: torch.Tensor) -> torch.Tensor:
    assert (inputs == inputs[:, :1]).all()  # a sample is read from one source
    return inputs[:, 0] - 1


@pytest.mark.parametrize("shares", [(0.75, 0.25), (0.5, 0.3, 0.2), (0.9, 0.05, 0.05)])
def test_every_run_of_samples_holds_each_source_in_its_share(shares):
    mixture, batch = labelled(shares), 16
    drawn = torch.cat([sources_of(get_batch(mixture, SEQ, BatchLayout(batch), 0, step)[0]) for step in range(60)])
    for length in (batch, 100, len(drawn)):  # any samples in a row: the first N, a step's, any window
        for start in range(0, len(drawn) - length + 1, 37):
            counts = torch.bincount(drawn[start:start + length], minlength=len(shares))
            for source, share in enumerate(shares):
                assert abs(counts[source].item() - share * length) <= 3, (shares, start, length, counts)


def test_every_layout_reads_the_same_global_batch():
    mixture = labelled((0.6, 0.4))
    whole = get_batch(mixture, SEQ, BatchLayout(8), 3, 5)
    for micro_batches, dp in ((2, 2), (4, 1), (1, 4)):
        layout = BatchLayout(8, micro_batches, dp)
        parts = [get_batch(mixture, SEQ, layout, 3, 5, micro, rank) for micro in range(micro_batches)
                 for rank in range(dp)]
        for index in range(2):
            assert torch.equal(torch.cat([part[index] for part in parts]), whole[index])
    assert not torch.equal(get_batch(mixture, SEQ, BatchLayout(8), 3, 6)[0], whole[0])  # another step, other samples


def test_sources_are_read_at_their_own_offsets_and_one_source_is_the_plain_stream(tmp_path):
    text = embedded_corpus()[:60_000]
    (tmp_path / "a.txt").write_bytes(text[:40_000])
    (tmp_path / "b.txt").write_bytes(text[40_000:])
    plain = Corpus.load(tmp_path / "a.txt", 64)
    assert torch.equal(Corpus.load((str(tmp_path / "a.txt"),), 64).train, plain.train)
    mixed = Corpus.load((str(tmp_path / "a.txt"), str(tmp_path / "b.txt")), 64)
    assert mixed.train.shares == pytest.approx((2 / 3, 1 / 3), rel=1e-3)  # by default, each source's tokens
    assert "a.txt (0.667) + " in mixed.source and mixed.source.endswith("b.txt (0.333)")
    weighted = Corpus.load((str(tmp_path / "a.txt"), str(tmp_path / "b.txt")), 64, weights=(1, 3))
    assert weighted.train.shares == (0.25, 0.75)
    inputs, _ = get_batch(weighted.train, 64, BatchLayout(32), 0, 0)
    a, b = bytes(plain.train.numpy()), bytes(weighted.train.streams[1].numpy())
    found = [bytes(row.to(torch.uint8).numpy()) for row in inputs]
    from_a = (weighted.train.sources(0, 32) == 0).sum().item()  # 8 of 32 at 1 : 3, give or take one
    assert abs(from_a - 8) <= 1 and sum(row in a for row in found) == from_a  # each read from its source
    assert sum(row in b for row in found) == 32 - from_a


def test_a_mixture_trains_in_tp2_dp2_as_in_one_process(tmp_path):
    text = embedded_corpus()[:100_000]
    (tmp_path / "a.txt").write_bytes(text[:60_000])
    (tmp_path / "b.txt").write_bytes(text[60_000:])
    data = ["--data", str(tmp_path / "a.txt"), "--data", str(tmp_path / "b.txt"), "--data-weights", "0.3,0.7"]
    losses = {}
    for name, layout in (("one", ["--dp", "1"]), ("tp2dp2", ["--tp", "2", "--dp", "2"])):
        result = run_cli("train", *data, *layout, "--steps", "3", "--global-batch", "4", "--eval-every", "0",
                         "--no-save", "--out", str(tmp_path / name), "--json")
        assert result.exit_code == 0, result.output
        summary = json.loads(result.stdout)
        losses[name] = summary["losses"]
        assert summary["data"].endswith("b.txt (0.7)")
        by_source = summary["val_by_source"]  # each source's fixed batches; the loss their mean in the shares
        assert list(by_source) == ["a.txt", "b.txt"]  # each source by its file's name
        assert summary["val_loss"] == pytest.approx(0.3 * by_source["a.txt"] + 0.7 * by_source["b.txt"], rel=1e-12)
        losses[name + " val"] = list(by_source.values())
    assert losses["tp2dp2"] == pytest.approx(losses["one"], rel=1e-5) and losses["one"][-1] < losses["one"][0]
    assert losses["tp2dp2 val"] == pytest.approx(losses["one val"], rel=1e-5)


@pytest.mark.parametrize("args, says", [
    (["--data-weights", "1"], "1 weights for 1 --data source"),
    (["--data", "B", "--data-weights", "1,x"], "numbers separated by commas"),
    (["--data", "B", "--data-weights", "1,-2"], "numbers above 0"),
    (["--data", "B", "--data-weights", "1,2,3"], "3 weights for 2 --data source(s)"),
    (["--data", "missing.txt"], "does not exist"),
])
def test_bad_mixtures_are_one_line_before_any_rank(tmp_path, args, says):
    (tmp_path / "a.txt").write_bytes(embedded_corpus()[:20_000])
    (tmp_path / "B").write_bytes(embedded_corpus()[20_000:40_000])
    args = [str(tmp_path / arg) if arg in ("B", "missing.txt") else arg for arg in args]
    one_line_error(run_cli("train", "--data", str(tmp_path / "a.txt"), *args, "--steps", "2", "--out",
                           str(tmp_path / "never")), says)
    assert not (tmp_path / "never").exists()


def test_a_resumed_mixture_continues_with_the_same_batches(tmp_path):
    """Four steps with a checkpoint at two, then a resume from that checkpoint: the last two losses of the
    uninterrupted run, bit for bit (a sample's source and offset are functions of its step and place, not of what ran
    before)."""
    text = embedded_corpus()[:100_000]
    (tmp_path / "a.txt").write_bytes(text[:50_000])
    (tmp_path / "b.txt").write_bytes(text[50_000:])
    common = ["--data", str(tmp_path / "a.txt"), "--data", str(tmp_path / "b.txt"), "--data-weights", "1,3",
              "--global-batch", "4", "--eval-every", "0", "--steps", "4", "--out", str(tmp_path / "run"), "--json"]
    straight = run_cli("train", *common, "--save-every", "2")
    assert straight.exit_code == 0, straight.output
    again = run_cli("train", *common, "--resume", str(tmp_path / "run" / "checkpoints" / "step-000002"))
    assert again.exit_code == 0, again.output
    losses, resumed = json.loads(straight.stdout)["losses"], json.loads(again.stdout)
    assert resumed["first_step"] == 2 and resumed["losses"] == losses[2:]
