"""TensorBoard's event files in a `minigpt train` run directory (parallel/run/tensorboard.py): every scalar at
every step, equal to metrics.jsonl's numbers (as float32, TensorBoard's scalar type), each rank's memory, the
validation loss where it was evaluated; a resumed run adds the later steps and shows none twice; without the
package the run goes on and says how to get them."""

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cli.main import main
from parallel.run.directory import is_run_dir

pytest.importorskip("tensorboard", reason="the test extra installs tensorboard (pyproject.toml)")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader  # noqa: E402

TRAIN = ["train", "--layers", "2", "--seq-len", "32", "--batch-size", "4", "--eval-every", "1", "--json"]
# metrics.jsonl's key -> the tag a user finds in TensorBoard
SCALARS = {"loss": "loss/train", "lr": "optimizer/learning_rate", "grad_norm": "optimizer/grad_norm",
           "loss_scale": "optimizer/loss_scale", "tokens_per_s": "speed/tokens_per_s", "mfu": "speed/mfu",
           "step_time_s": "speed/step_time_s", "val_loss": "loss/validation"}


def train(*args: str):
    result = CliRunner().invoke(main, [*TRAIN, *args])
    assert result.exit_code == 0, result.output
    return result


def scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard shows them (older files' steps purged where a later run restarted)."""
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def metrics(out: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a step logged again (a resumed run) keeps its last line."""
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def expected(records: dict[int, dict]) -> dict[str, list[tuple[int, float]]]:
    """What the events must hold: metrics.jsonl's numbers as float32, and each rank's bytes in all (the first
    line's by category, and after a resume that run's first line's) at every step."""
    want = {tag: [(s, np.float32(r[key])) for s, r in sorted(records.items()) if key in r]
            for key, tag in SCALARS.items()}
    memory = None
    for step, record in sorted(records.items()):
        memory = record.get("memory_per_rank", memory)
        for rank, categories in enumerate(memory):
            want.setdefault(f"memory/rank{rank}", []).append((step, np.float32(sum(categories.values()))))
    return want


@pytest.mark.slow
def test_every_scalar_of_every_step_on_two_ranks(tmp_path):
    out = tmp_path / "run"
    result = train("--dp", "2", "--steps", "3", "--out", str(out))
    assert f"tensorboard: {out / 'tensorboard'} (tensorboard --logdir {out})" in result.stderr.splitlines()
    records = metrics(out)
    assert sorted(records) == [0, 1, 2] and len(records[0]["memory_per_rank"]) == 2
    got, want = scalars(out), expected(records)
    assert sorted(got) == sorted(want) and {"memory/rank0", "memory/rank1", *SCALARS.values()} == set(got)
    for tag, points in want.items():
        assert [step for step, _ in got[tag]] == [0, 1, 2], tag  # one point a step, validation too (--eval-every 1)
        assert got[tag] == points, tag
    summary = json.loads(result.stdout)
    assert [value for _, value in got["loss/train"]] == [np.float32(loss) for loss in summary["losses"]]
    assert all(value > 1e5 for _, value in got["memory/rank1"])  # bytes: the weights alone are 1.7 MB
    assert is_run_dir(out)  # --overwrite would clear it


@pytest.mark.slow
def test_a_resumed_run_adds_its_steps_and_shows_none_twice(tmp_path):
    """Resumed from step 2 of a 4-step run: steps 2 and 3 are written again, and TensorBoard shows the resumed
    run's (the older file's from step 2 on are purged), each step once."""
    out = tmp_path / "run"
    train("--steps", "4", "--save-every", "2", "--out", str(out))
    first = metrics(out)
    train("--steps", "6", "--save-every", "2", "--resume", str(out / "checkpoints" / "step-000002"))
    files = sorted((out / "tensorboard").iterdir())
    assert len(files) == 2
    written = [e.step for f in files for e in EventFileLoader(str(f)).Load()
               if any(v.tag == "loss/train" for v in e.summary.value)]
    assert written == [0, 1, 2, 3, 2, 3, 4, 5]  # on disk: the first run's steps, then the resumed run's
    got, want = scalars(out), expected(metrics(out))
    for tag, points in want.items():
        assert [step for step, _ in got[tag]] == list(range(6)), tag
        assert got[tag] == points, tag
    # the resumed run measured its own first step: its bytes are the first run's
    assert got["memory/rank0"][5][1] == got["memory/rank0"][0][1] == np.float32(
        sum(first[0]["memory_per_rank"][0].values()))


@pytest.mark.slow
def test_without_tensorboard_the_run_goes_on_and_says_how_to_get_it(tmp_path, monkeypatch):
    import cli.commands.train

    monkeypatch.setattr(cli.commands.train, "tensorboard_installed", lambda: False)
    out = tmp_path / "run"
    result = train("--steps", "2", "--out", str(out))
    lines = [line for line in result.stderr.splitlines() if line.startswith("tensorboard:")]
    assert lines == ["tensorboard: not installed, so no event files (pip install 'minigpt[tensorboard]' gives them)"]
    assert not (out / "tensorboard").exists() and len(metrics(out)) == 2


def test_overwrite_clears_a_tensorboard_folder_of_event_files_only(tmp_path):
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    (run / "tensorboard" / "events.out.tfevents.1.host.1.0").write_bytes(b"")
    assert is_run_dir(run)
    (run / "tensorboard" / "notes.txt").write_text("mine")
    assert not is_run_dir(run)  # not a folder only runs write: --overwrite refuses it


def test_a_mixtures_sources_each_have_a_validation_tag(tmp_path):
    from minigpt.data import embedded_corpus

    for name, part in (("a.txt", slice(0, 40_000)), ("b.txt", slice(40_000, 80_000))):
        (tmp_path / name).write_bytes(embedded_corpus()[part])
    out = tmp_path / "run"
    train("--data", str(tmp_path / "a.txt"), "--data", str(tmp_path / "b.txt"), "--steps", "2", "--out", str(out))
    got, records = scalars(out), metrics(out)
    for source in ("a.txt", "b.txt"):
        tag = f"loss/validation/{source}"
        assert got[tag] == [(step, np.float32(records[step]["val_by_source"][source])) for step in (0, 1)], tag
