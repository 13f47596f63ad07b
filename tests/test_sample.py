"""`minigpt sample`: text from the newest checkpoint of a run trained in one process or in
tp 2 x dp 2, loaded into one plain GPT; the loaded weights are the run's (the validation
loss they give is the one the parallel run measured)."""

import json

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from minigpt.data import Corpus, validation_batches
from parallel.run.sample import SampleOptions, generate, load_model

TRAIN = ["train", "--layers", "2", "--seq-len", "32", "--batch-size", "8", "--steps", "4", "--save-every", "2",
         "--eval-every", "0", "--json"]
LAYOUTS = {"one": [], "tp2-dp2": ["--tp", "2", "--dp", "2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One short run per layout, each with checkpoints at steps 2 and 4: {name: (run dir, summary)}."""
    found = {}
    for name, layout in LAYOUTS.items():
        out = tmp_path_factory.mktemp(name) / "run"
        result = CliRunner().invoke(main, [*TRAIN, *layout, "--out", str(out)])
        assert result.exit_code == 0, result.output
        found[name] = (out, json.loads(result.stdout))
    return found


def sample(*args):
    result = CliRunner().invoke(main, ["sample", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", LAYOUTS)
def test_sample_gives_text_of_the_requested_length(runs, name):
    out, _ = runs[name]
    got = sample("--out", str(out), "--tokens", "25", "--prompt", "ROMEO:")
    assert got["tokens"] == 25 and got["step"] == 4  # the newest checkpoint
    assert got["checkpoint"].endswith("step-000004")
    assert got["layout"]["world_size"] == (1 if name == "one" else 4)
    model, _ = load_model(got["checkpoint"])
    assert len(generate(model, SampleOptions(prompt="ROMEO:", tokens=25, seed=0))) == 25


@pytest.mark.parametrize("name", LAYOUTS)
def test_greedy_is_deterministic_and_seeds_repeat(runs, name):
    out, _ = runs[name]
    greedy = [sample("--out", str(out), "--tokens", "30", "--temperature", "0")["text"] for _ in range(2)]
    assert greedy[0] == greedy[1]
    checkpoint = str(out / "checkpoints" / "step-000004")
    assert sample("--checkpoint", checkpoint, "--tokens", "30", "--temperature", "0")["text"] == greedy[0]
    drawn = [sample("--out", str(out), "--tokens", "40", "--temperature", "1.5", "--seed", str(seed))["text"]
             for seed in (1, 1, 2)]
    assert drawn[0] == drawn[1]
    assert drawn[0] != drawn[2]  # 40 draws at temperature 1.5 from a barely trained model
    top1 = sample("--out", str(out), "--tokens", "30", "--temperature", "1.5", "--top-k", "1", "--seed", "3")
    assert top1["text"] == greedy[0]  # top-1 is greedy whatever the temperature


@pytest.mark.parametrize("name", LAYOUTS)
def test_loaded_weights_are_the_runs(runs, name):
    """The one-process model from the checkpoint gives the validation loss the run itself measured
    at its last step (the same batches), so it holds the run's weights: the logits agree."""
    out, summary = runs[name]
    model, state = load_model(out / "checkpoints" / "step-000004")
    cfg = summary["config"]
    corpus = Corpus.load(None, 32)
    batch = max(1, cfg["global_batch"] // cfg["micro_batches"])
    with torch.no_grad():
        batches = validation_batches(corpus.val, 32, batch, cfg["eval_batches"], cfg["seed"])
        losses = [float(model(x, y)) for x, y in batches]
    assert sum(losses) / len(losses) == pytest.approx(summary["val_loss"], rel=1e-5)
    assert state["layout"]["tp"] == (2 if name == "tp2-dp2" else 1)


def test_a_prompt_longer_than_the_context_keeps_its_end(runs):
    out, _ = runs["one"]
    long = "x" * 100 + "ROMEO:"
    got = sample("--out", str(out), "--prompt", long, "--tokens", "10", "--temperature", "0")
    tail = sample("--out", str(out), "--prompt", long[-32:], "--tokens", "1", "--temperature", "0")
    assert got["tokens"] == 10 and got["text"][0] == tail["text"][0]


def test_table_prints_the_prompt_and_text(runs):
    out, _ = runs["one"]
    result = CliRunner().invoke(main, ["sample", "--out", str(out), "--prompt", "KING:", "--tokens", "5"])
    assert result.exit_code == 0, result.output
    assert "step-000004" in result.stdout and "KING:" in result.stdout


def bad_inputs(runs, tmp_path):
    out = str(runs["one"][0])
    (tmp_path / "empty").mkdir()
    unfinished = tmp_path / "unfinished"
    (unfinished / "checkpoints" / "step-000002.tmp").mkdir(parents=True)
    return [
        (["--out", str(tmp_path / "missing")], "does not exist"),
        (["--out", str(tmp_path / "empty")], "no checkpoint that verifies"),
        (["--out", str(unfinished)], "no checkpoint that verifies"),
        (["--checkpoint", str(unfinished / "checkpoints" / "step-000002.tmp")], "incomplete"),
        (["--checkpoint", str(tmp_path / "nothing")], "does not exist"),
        ([], "exactly one of"),
        (["--out", out, "--checkpoint", out], "exactly one of"),
        (["--out", out, "--temperature", "-0.5"], "temperature"),
        (["--out", out, "--temperature", "nan"], "temperature"),
        (["--out", out, "--top-k", "0"], "top-k"),
        (["--out", out, "--tokens", "0"], "tokens"),
        (["--out", out, "--tokens", "many"], "many"),
        (["--out", out, "--prompt", ""], "prompt"),
    ]


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path):
    for args, words in bad_inputs(runs, tmp_path):
        result = CliRunner().invoke(main, ["sample", *args])
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], (args, result.stderr)


def test_a_changed_newest_checkpoint_is_skipped_for_the_newest_that_verifies(runs, tmp_path):
    """Bytes flipped in the newest checkpoint after its save: sample says so on one line and reads the older one."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["one"][0], run)
    newest = sorted((run / "checkpoints").iterdir())[-1]
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["sample", "--out", str(run), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["step"] == 2
    assert result.stderr.count("\n") == 1 and f"skipped {newest.name}" in result.stderr and "sha256" in result.stderr


@pytest.mark.slow
def test_every_run_keeps_its_final_weights_unless_told_not_to(tmp_path, monkeypatch):
    """`minigpt train --model tiny --steps 30`, no other flag, then `minigpt sample --out RUN` prints text;
    --no-save leaves no checkpoint (and sample says so in one line)."""
    monkeypatch.chdir(tmp_path)  # the default run directory, runs/<time>-<shape>, lands here
    result = CliRunner().invoke(main, ["train", "--model", "tiny", "--steps", "30"])
    assert result.exit_code == 0, result.output
    (run,) = (tmp_path / "runs").iterdir()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000030"]
    result = CliRunner().invoke(main, ["sample", "--out", str(run), "--tokens", "40", "--prompt", "ROMEO:"])
    assert result.exit_code == 0, result.output
    text = result.output.split("ROMEO:", 1)[1]
    assert len(text.strip()) > 10  # 40 bytes of text after the prompt
    result = CliRunner().invoke(main, ["train", "--model", "tiny", "--steps", "3", "--no-save", "--out", "quiet"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "quiet" / "checkpoints").exists()
    result = CliRunner().invoke(main, ["sample", "--out", "quiet"])
    assert result.exit_code == 2 and "--no-save" in result.output, result.output
    result = CliRunner().invoke(main, ["train", "--no-save", "--save-every", "5", "--out", "both"])
    assert result.exit_code == 2 and "give one or the other" in result.output and not (tmp_path / "both").exists()
