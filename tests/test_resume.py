"""20 steps in one run, or 10 steps, stop, resume, 10 more: the same per-step losses,
bit for bit in the same layout and within the parity tolerance in another one."""

import json
import shutil
import subprocess
import sys

import pytest

ARGS = ["--layers", "2", "--seq-len", "32", "--batch-size", "8", "--steps", "20", "--save-every", "10"]


def run(tmp_path, out, *extra):
    command = [sys.executable, "-m", "cli", "train", *ARGS, "--out", str(out), "--json", *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.mark.parametrize("resumed_layout", [[], ["--dp", "2", "--zero", "3"]], ids=["same-layout", "dp2-zero3"])
def test_stop_and_resume_gives_the_same_losses(tmp_path, resumed_layout):
    out = tmp_path / "run"
    whole = run(tmp_path, out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000010", "step-000020"]
    shutil.rmtree(out / "checkpoints" / "step-000020")  # as if the run had stopped after 10 steps
    resumed = run(tmp_path, out, "--resume", *resumed_layout)
    assert resumed["first_step"] == 10
    if resumed_layout:
        gaps = [abs(a - b) / b for a, b in zip(resumed["losses"], whole["losses"][10:])]
        assert max(gaps) < 1e-4
    else:
        assert resumed["losses"] == whole["losses"][10:]  # bit for bit
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(20)) + list(range(10, 20))


def test_resume_without_checkpoints_is_one_line(tmp_path):
    command = [sys.executable, "-m", "cli", "train", "--resume", "--out", str(tmp_path / "empty")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and "no complete checkpoint" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_resumed_run_keeps_its_save_every_and_says_what_a_new_step_count_does(tmp_path):
    from job.train_config import TrainConfig
    from parallel.run.resume import ResumePoint, continue_settings

    saved = TrainConfig(steps=20, save_every=10, out_dir=str(tmp_path)).as_dict()
    point = ResumePoint(tmp_path / "checkpoints" / "step-000020", 20, settings=saved)
    cfg = TrainConfig(steps=30, out_dir=str(tmp_path), resume=True)
    resumed, lines = continue_settings(cfg, point, save_every_given=False)
    assert resumed.save_every == 10 and "every 10 steps, as the run did" in lines[0]
    assert "--steps 30 where the run was started with 20" in lines[1]
    assert f"{cfg.learning_rate(20):.2e} at step 20" in lines[1] and "last step used 2.00e-04" in lines[1]
    kept, quiet = continue_settings(TrainConfig(steps=20, save_every=5, out_dir=str(tmp_path), resume=True), point,
                                    save_every_given=True)
    assert kept.save_every == 5 and quiet == []  # the flag given wins; the same steps need no word
    # a warmup-stable-decay run resumed to decay now (its stable rate kept until the last fifth of 30 steps)
    wsd = TrainConfig(steps=20, lr_schedule="constant", out_dir=str(tmp_path)).as_dict()
    decaying = TrainConfig(steps=30, lr_schedule="wsd", out_dir=str(tmp_path), resume=True)
    _, said = continue_settings(decaying, ResumePoint(point.path, 20, settings=wsd), save_every_given=True)
    assert "--lr-schedule wsd 0.2 where the run was started with constant:" in said[1]
    assert "2.00e-03 at step 20" in said[1] and decaying.decay_start == 24
    _, quiet = continue_settings(TrainConfig(steps=20, decay_fraction=0.5, out_dir=str(tmp_path), resume=True),
                                 point, save_every_given=True)
    assert quiet == []  # cosine either way: a decay fraction it does not use changes nothing
    for odd in ({"steps": 0, "save_every": True}, {"steps": 10, "warmup_steps": "x", "save_every": -1}):
        odd_point = ResumePoint(point.path, 20, settings=odd)  # a hand-edited state.json's settings
        same, said = continue_settings(cfg, odd_point, save_every_given=False)
        assert same.save_every == cfg.save_every and len(said) == ("warmup_steps" in odd)  # default warmup, no crash
