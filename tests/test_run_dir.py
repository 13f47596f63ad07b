"""A run owns its directory, and resumes only from checkpoints that verify.

Two runs on one directory (a real second process while the first holds the lock), --overwrite,
a non-empty --out, checkpoints with bytes flipped at the same size (skipped by --resume, refused
by --resume PATH, in one process and with 2 ranks), resume at or past --steps, and fp16 runs
that cannot go on. One short run (6 steps, checkpoints at 2, 4, 6) is the fixture; every test
works on a copy of it.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from cli.main import main
from minigpt.errors import TrainingError
from parallel.run.directory import LOCK_FILE, RunClaim

SMALL = ["--layers", "1", "--seq-len", "32", "--batch-size", "4", "--log-every", "100"]
STEPS = ["--steps", "6", "--save-every", "2"]


def train(*args):
    return CliRunner().invoke(main, ["train", *SMALL, *args])


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def flip_a_byte(path, at=None):
    """Change one byte of `path`, keeping its size."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x5A
    path.write_bytes(bytes(data))


def listing(root) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run: its directory and summary (losses of steps 0-5)."""
    out = tmp_path_factory.mktemp("whole") / "run"
    result = train(*STEPS, "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


@pytest.fixture
def run(whole, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(whole[0], copy)
    return copy


def test_newest_valid_checkpoint_resumes_bit_for_bit_saying_what_it_skipped(whole, run):
    flip_a_byte(next((run / "checkpoints" / "step-000006").glob("*.distcp")))  # the newest: corrupt
    result = train(*STEPS, "--out", str(run), "--resume", "--json")
    assert result.exit_code == 0, result.output
    skipped = [line for line in result.stderr.splitlines() if line.startswith("resume: skipped")]
    assert skipped == [skipped[0]] and "step-000006 (corrupt: __0_0.distcp does not match its sha256" in skipped[0]
    assert f"resuming {run / 'checkpoints' / 'step-000004'} at step 4 of 6" in result.stderr
    resumed = json.loads(result.stdout)
    assert resumed["first_step"] == 4 and resumed["losses"] == whole[1]["losses"][4:]  # bit for bit
    again = train(*STEPS, "--out", str(run), "--resume")  # the corrupt step-000006 was saved afresh
    assert again.exit_code == 0 and "nothing left to do" in again.stdout, again.output


def test_resume_path_takes_the_chosen_checkpoint_and_finds_its_run(whole, run):
    chosen = run / "checkpoints" / "step-000002"
    result = train(*STEPS, "--resume", str(chosen), "--json")  # no --out: the checkpoint's run
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["run_dir"] == str(run) and summary["first_step"] == 2
    assert summary["losses"] == whole[1]["losses"][2:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(6)) + list(range(2, 6))  # appended, as a resumed run does


@pytest.mark.parametrize("layout", [[], ["--dp", "2"]], ids=["one-process", "2-ranks"])
@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "state.json", "rank-00000.json"])
def test_a_flipped_byte_is_refused_in_one_line(run, layout, name):
    chosen = run / "checkpoints" / "step-000004"
    flip_a_byte(chosen / name, at=None if name.endswith(("distcp", "metadata")) else 20)
    before = listing(run)
    result = train(*STEPS, "--out", str(run), "--resume", str(chosen), *layout)
    assert result.exit_code == 2, result.output
    line = one_line(result)
    assert line.startswith(f"minigpt: error: checkpoint {chosen} is corrupt") and "sha256" in line, line
    assert listing(run) == before


def test_no_checkpoint_that_verifies_is_one_line(run):
    for checkpoint in (run / "checkpoints").iterdir():
        flip_a_byte(checkpoint / ".metadata")
    result = train(*STEPS, "--out", str(run), "--resume", "--dp", "2")
    assert result.exit_code == 2, result.output
    line = one_line(result)
    assert "no checkpoint in" in line and "step-000006 is corrupt" in line and "step-000002 is corrupt" in line


@pytest.mark.parametrize("steps", ["6", "3"], ids=["at", "past"])
def test_resume_at_or_past_steps_has_nothing_to_do(run, steps):
    before = listing(run)
    result = train("--steps", steps, "--out", str(run), "--resume", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["nothing_to_do"].endswith("nothing left to do (raise --steps to train further)")
    assert result.stderr.strip() == f"checkpoint {run / 'checkpoints' / 'step-000006'} is at step 6 and --steps " \
                                    f"is {steps}: nothing left to do (raise --steps to train further)"
    assert listing(run) == before


def test_a_non_empty_out_is_refused_and_overwrite_clears_it(run):
    before = listing(run)
    result = train("--steps", "2", "--out", str(run))
    assert result.exit_code == 2 and "is not empty" in one_line(result) and "--overwrite" in one_line(result)
    assert listing(run) == before
    result = train("--steps", "3", "--out", str(run), "--overwrite", "--json")
    assert result.exit_code == 0, result.output
    # the old run's checkpoints (steps 2, 4, 6) are gone with it: only the new run's final one is there
    assert [path.name for path in (run / "checkpoints").iterdir()] == ["step-000003"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]


def test_overwrite_never_clears_a_directory_of_other_files(tmp_path):
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "thesis.tex").write_text("years of work")
    (keep / "metrics.jsonl").write_text("")
    result = train("--steps", "2", "--out", str(keep), "--overwrite")
    assert result.exit_code == 2 and "thesis.tex" in one_line(result)
    assert sorted(p.name for p in keep.iterdir()) == ["metrics.jsonl", "thesis.tex"]


def test_a_second_run_is_refused_while_the_first_holds_the_lock(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "cli", "train", *SMALL, "--steps", "100000", "--out", str(out)]
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while not (out / LOCK_FILE).exists() or not (out / LOCK_FILE).read_text().strip():
            assert first.poll() is None, first.communicate()[1][-2000:]
            assert time.time() < deadline, "the first run never took its lock"
            time.sleep(0.1)
        for extra in ([], ["--resume"], ["--overwrite"]):
            second = train("--steps", "2", "--out", str(out), *extra)
            assert second.exit_code == 2, second.output
            assert one_line(second) == (f"minigpt: error: --out {str(out)!r} is in use by another minigpt run "
                                        f"(process {first.pid}): wait for it to end, or pick another --out")
        assert first.poll() is None  # the first run goes on, untouched
    finally:
        first.send_signal(signal.SIGKILL)  # a crash: the kernel drops the lock with the process
        first.wait(timeout=30)
    with RunClaim(out, resume=True, overwrite=False) as claim:  # no stale lock left behind
        claim.take()
        assert (out / LOCK_FILE).read_text().strip() == str(os.getpid())


def test_fp16_that_skips_every_step_stops_naming_the_step(tmp_path):
    result = train("--steps", "40", "--precision", "fp16", "--loss-scale", "1e30", "--out", str(tmp_path / "r"))
    assert result.exit_code == 1, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("minigpt: run failed: step 19: 20 steps in a row skipped under fp16"), last


def test_fp16_with_a_non_finite_loss_on_the_first_step_stops():
    from parallel.run.step import StepOutcome
    from parallel.run.train import MAX_SKIPPED_IN_A_ROW, History, check_finite
    from precision.optimizer import StepResult

    def outcome(loss):
        return StepOutcome(loss, StepResult(math.inf, True, 65536.0), 0.0, 1.0, [], 0.0, {})

    scaler = object()  # any scaler: the checks only ask whether there is one
    with pytest.raises(TrainingError, match=r"^step 7: the loss is nan on the run's first step under fp16"):
        check_finite("fp16", scaler, 7, outcome(math.nan), History(first_step=7, skipped_in_a_row=1))
    check_finite("fp16", scaler, 8, outcome(math.nan), History(first_step=7, skipped_in_a_row=2))  # skipped, goes on
    with pytest.raises(TrainingError, match=rf"^step 30: {MAX_SKIPPED_IN_A_ROW} steps in a row skipped"):
        check_finite("fp16", scaler, 30, outcome(5.0), History(first_step=0, skipped_in_a_row=MAX_SKIPPED_IN_A_ROW))
