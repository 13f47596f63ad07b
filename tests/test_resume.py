"""`minigpt train --save-every` then `--resume`: the same per-step losses as one uninterrupted run,
in the same layout and in another one."""

import json
import shutil
import subprocess
import sys

import pytest

ARGS = ["--layers", "2", "--seq-len", "32", "--batch-size", "8", "--steps", "8", "--save-every", "4"]


def run(tmp_path, out, *extra):
    command = [sys.executable, "-m", "cli", "train", *ARGS, "--out", str(out), "--json", *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.mark.parametrize("resumed_layout", [[], ["--dp", "2", "--zero", "3"]], ids=["same-layout", "dp2-zero3"])
def test_stop_and_resume_gives_the_same_losses(tmp_path, resumed_layout):
    out = tmp_path / "run"
    whole = run(tmp_path, out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000004", "step-000008"]
    shutil.rmtree(out / "checkpoints" / "step-000008")  # as if the run had stopped after step 4
    resumed = run(tmp_path, out, "--resume", *resumed_layout)
    assert resumed["first_step"] == 4
    if resumed_layout:
        gaps = [abs(a - b) / b for a, b in zip(resumed["losses"], whole["losses"][4:])]
        assert max(gaps) < 1e-4
    else:
        assert resumed["losses"] == whole["losses"][4:]  # bit for bit
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(8)) + list(range(4, 8))


def test_resume_without_checkpoints_is_one_line(tmp_path):
    command = [sys.executable, "-m", "cli", "train", "--resume", "--out", str(tmp_path / "empty")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and "no complete checkpoint" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
