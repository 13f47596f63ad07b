"""A worker killed mid-run: the others stop within a bounded time, the message names the dead
rank, the last complete checkpoint stays loadable and --resume continues from it."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minigpt.presets import preset
from parallel.checkpoint.files import check_checkpoint, latest_checkpoint
from parallel.launch.rank_start import launched_ranks
from job.train_config import TrainConfig

# A constant learning rate (no warmup, no decay): a run's steps do not depend on its --steps, so a run stopped
# anywhere and resumed can be held against a fresh run of as many steps, loss for loss.
ARGS = ["--dp", "4", "--layers", "1", "--seq-len", "32", "--batch-size", "8", "--log-every", "1000",
        "--warmup", "0", "--lr", "2e-3", "--min-lr", "2e-3"]


ranks_of = launched_ranks  # the ranks a `minigpt train` process launched (parallel/launch/rank_start.py)


def has_open(pid: int, path: Path) -> bool:
    """Rank 0 is the rank that holds the run's metrics file open (ranks set RANK after they start,
    so /proc/PID/environ cannot tell them apart)."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if Path(os.readlink(fd)) == path:
                return True
        except OSError:
            continue
    return False


def start_until_checkpoint(tmp_path, out: Path, new_session: bool = False, extra: tuple = (),
                           steps: int = 100_000) -> subprocess.Popen:
    """A 4-rank run into `out` that checkpoints every 2 steps, returned once its first checkpoint is complete
    (with a finite number of `steps`, it prints its summary as JSON)."""
    command = [sys.executable, "-m", "cli", "train", *ARGS, "--steps", str(steps), "--save-every", "2", *extra,
               "--out", str(out)] + (["--json"] if steps < 100_000 else [])
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                               start_new_session=new_session)
    deadline = time.time() + 180
    try:
        while latest_checkpoint(out / "checkpoints") is None:
            assert process.poll() is None, process.communicate()
            assert time.time() < deadline, "no checkpoint was written"
            time.sleep(0.2)
    except BaseException:
        process.kill()
        raise
    return process


def test_killed_rank_stops_the_run_and_resume_continues(tmp_path, uninterrupted):
    out = tmp_path / "run"
    process = start_until_checkpoint(tmp_path, out)
    try:
        workers = ranks_of(process.pid)
        assert len(workers) == 4, workers
        others = [pid for pid in workers if not has_open(pid, (out / "metrics.jsonl").resolve())]
        assert len(others) == 3, workers
        os.kill(others[-1], signal.SIGKILL)
        killed_at = time.time()
        _, stderr = process.communicate(timeout=60)
        assert time.time() - killed_at < 60
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1
    last = stderr.strip().splitlines()[-1]
    # "rank 3 of 4 failed: killed by SIGKILL", or "ranks 0, 3 of 4 failed; the cause, rank 3: killed by SIGKILL"
    assert last.startswith("minigpt: run failed: "), stderr[-2000:]
    assert re.search(r"rank [123](?: of 4 failed)?: killed by SIGKILL$", last), last

    latest = latest_checkpoint(out / "checkpoints")
    cfg = TrainConfig(model=preset("tiny").with_(n_layers=1, seq_len=32), global_batch=8, dp=4, out_dir=str(out))
    check_checkpoint(latest, cfg)  # complete, untruncated, same shape
    assert_resumes_exactly(tmp_path, out, uninterrupted)


REFERENCE_STEPS = 16  # an uninterrupted run this long is the reference every stopped run resumes towards


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    """The losses of a fresh run of REFERENCE_STEPS steps, never stopped."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    command = [sys.executable, "-m", "cli", "train", *ARGS, "--steps", str(REFERENCE_STEPS), "--out", str(out), "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=out.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)["losses"]


def assert_resumes_exactly(tmp_path: Path, out: Path, uninterrupted: list[float]) -> None:
    """--resume continues the newest checkpoint to REFERENCE_STEPS with exactly the uninterrupted run's losses
    (saving nothing more: what is checked is the resume, and a checkpoint every 2 steps would be most of its time)."""
    done = int(latest_checkpoint(out / "checkpoints").name.split("-")[1])
    assert done < REFERENCE_STEPS, done
    resume = [sys.executable, "-m", "cli", "train", *ARGS, "--steps", str(REFERENCE_STEPS), "--out", str(out),
              "--resume", "--save-every", "0", "--json"]
    resumed = subprocess.run(resume, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads(resumed.stdout)
    assert summary["first_step"] == done and summary["losses"] == uninterrupted[done:]


def test_non_finite_loss_stops_the_run_naming_the_step(tmp_path):
    command = [sys.executable, "-m", "cli", "train", "--layers", "1", "--seq-len", "32", "--batch-size", "4",
               "--steps", "30", "--lr", "1000", "--grad-clip", "0", "--warmup", "0", "--out", str(tmp_path / "run")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert re.match(r"minigpt: run failed: step \d+: the loss is .* not finite under fp32", last), last


def stop_with(tmp_path, sig: int, whole_group: bool) -> tuple[subprocess.CompletedProcess, list[int], Path]:
    """A 4-rank run stopped by `sig` once it has a checkpoint: to its process group (Ctrl-C in a terminal
    reaches every process) or to the launching process alone (a scheduler's SIGTERM)."""
    out = tmp_path / "run"
    process = start_until_checkpoint(tmp_path, out, new_session=True)
    try:
        workers = ranks_of(process.pid)
        (os.killpg if whole_group else os.kill)(process.pid, sig)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), workers, out


def test_sigint_and_sigterm_stop_a_4_rank_run_in_one_line(tmp_path, uninterrupted):
    """Ctrl-C (SIGINT to the group) and a scheduler's SIGTERM (to the launcher): exit 128 + the signal within
    seconds, one line naming it and no traceback, no rank left running, the run's lock released and its
    last checkpoint complete."""
    from concurrent.futures import ThreadPoolExecutor

    # The two runs at once: each mostly waits (for its first checkpoint, for its ranks to leave).
    with ThreadPoolExecutor(2) as pool:
        stopped = [pool.submit(stop_and_resume, tmp_path / sig.name, sig, whole_group, uninterrupted)
                   for sig, whole_group in ((signal.SIGINT, True), (signal.SIGTERM, False))]
        for run in stopped:
            run.result()  # raises what failed in that run


def stop_and_resume(tmp_path: Path, sig: int, whole_group: bool, uninterrupted: list[float]) -> None:
    import fcntl

    tmp_path.mkdir()
    result, workers, out = stop_with(tmp_path, sig, whole_group)
    assert result.returncode == 128 + sig, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == f"minigpt: stopped by {sig.name}: the run ended early; its checkpoints so far are " \
                        f"kept (--resume continues)", result.stderr[-2000:]
    assert "Traceback" not in result.stderr and len(workers) == 4
    time.sleep(0.5)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "a rank outlived the run"
    with open(out / "run.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the stopped run still held it
    cfg = TrainConfig(model=preset("tiny").with_(n_layers=1, seq_len=32), global_batch=8, dp=4, out_dir=str(out))
    check_checkpoint(latest_checkpoint(out / "checkpoints"), cfg)
    assert_resumes_exactly(tmp_path, out, uninterrupted)


def test_a_full_disk_ends_the_run_in_one_line_and_keeps_the_checkpoints_before(tmp_path):
    """ENOSPC on a 14 MiB file system that holds two checkpoints of this run, not three: one line, exit 1,
    nothing half-written left, and the newest complete checkpoint verifies. Needs a tmpfs mount (root)."""
    import pytest

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=14m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        out = disk / "run"
        command = [sys.executable, "-m", "cli", "train", "--dp", "2", "--layers", "2", "--steps", "8",
                   "--save-every", "2", "--out", str(out)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert result.returncode == 1, result.stderr[-2000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("minigpt: run failed: "), result.stderr[-2000:]
        assert "cannot write checkpoint" in lines[0] and "nothing of it is left" in lines[0]
        names = sorted(p.name for p in (out / "checkpoints").iterdir())
        assert names and not [n for n in names if n.endswith(".tmp")], names
        cfg = TrainConfig(model=preset("tiny").with_(n_layers=2), dp=2, out_dir=str(out))
        check_checkpoint(latest_checkpoint(out / "checkpoints"), cfg)
        import shutil

        shutil.copytree(out, tmp_path / "copied", ignore=shutil.ignore_patterns("run.lock"))  # room to go on
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
    done = int(latest_checkpoint(tmp_path / "copied" / "checkpoints").name.split("-")[1])
    started = [subprocess.Popen(command[:-2] + ["--out", str(tmp_path / name), *more, "--json"], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
               for name, more in (("copied", ["--resume"]), ("fresh", []))]  # the two at once
    outputs = [run.communicate(timeout=300) for run in started]
    assert [run.returncode for run in started] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    resumed, fresh = (json.loads(stdout)["losses"] for stdout, _ in outputs)
    assert resumed == fresh[done:] and len(resumed) == 8 - done


def rank_of(pid: int) -> int:
    """The rank a worker process is, from the heartbeat files its launcher watches (parallel/launch/watchdog.py)."""
    import tempfile

    for beat in Path(tempfile.gettempdir()).glob("minigpt-launch-*/heartbeats/*"):
        try:
            if int(beat.read_text()) == pid:
                return int(beat.name)
        except (OSError, ValueError):
            continue
    raise AssertionError(f"no heartbeat file names process {pid}")


def test_a_stopped_rank_ends_the_run_naming_it_and_resume_is_exact(tmp_path, uninterrupted):
    """SIGSTOP to one rank of four: within the watchdog's 5 s (plus a poll and the ranks' exit) the run ends
    with exit 1 and one line naming that rank, no process left (the stopped one included), and the newest
    checkpoint resumes to exactly the losses of a run never interrupted."""
    out = tmp_path / "run"
    process = start_until_checkpoint(tmp_path, out, extra=["--watchdog", "5"])
    try:
        workers = ranks_of(process.pid)
        assert len(workers) == 4, workers
        stopped = workers[-1]
        rank = rank_of(stopped)
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.time()
        _, stderr = process.communicate(timeout=60)
        took = time.time() - stopped_at
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1, stderr[-2000:]
    assert took < 30, took
    lines = stderr.strip().splitlines()
    assert lines[-1].startswith(f"minigpt: run failed: rank {rank} of 4 stopped responding: no heartbeat for "), \
        stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    time.sleep(0.5)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "a rank outlived the run"

    assert_resumes_exactly(tmp_path, out, uninterrupted)


def finish_after(process: subprocess.Popen, kill) -> tuple[str, str]:
    """`kill()` the run's ranks as the test wants, then its (stdout, stderr) once it ends, which must be with 0; the
    run is killed if anything fails first."""
    try:
        kill()
        stdout, stderr = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr[-2000:]
    return stdout, stderr


def test_a_killed_rank_is_restarted_and_the_run_ends_as_an_uninterrupted_one(tmp_path):
    """--max-restarts 1: a rank killed after the first checkpoint, torch's elastic agent starts every rank again,
    they resume from the newest checkpoint that verifies, and the run finishes with the losses of a run never
    stopped, bit for bit, from the step it resumed at."""
    steps, out = 40, tmp_path / "run"
    reference = [sys.executable, "-m", "cli", "train", *ARGS, "--steps", str(steps), "--out", str(tmp_path / "ref"),
                 "--json"]
    process = start_until_checkpoint(tmp_path, out, extra=("--max-restarts", "1"), steps=steps)

    def kill_one() -> None:
        others = [pid for pid in ranks_of(process.pid) if not has_open(pid, (out / "metrics.jsonl").resolve())]
        os.kill(others[-1], signal.SIGKILL)

    stdout, stderr = finish_after(process, kill_one)
    said = [line for line in stderr.splitlines() if line.startswith("minigpt: restart 1 of 1 after a failure")]
    assert len(said) == 1 and "resuming from step-" in said[0], stderr[-2000:]
    summary = json.loads(stdout)
    uninterrupted = subprocess.run(reference, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-2000:]
    losses = json.loads(uninterrupted.stdout)["losses"]
    first = summary["first_step"]
    assert 0 < first < steps and said[0].endswith(f"from step-{first:06d}")
    assert summary["losses"] == losses[first:]


def test_a_rank_killed_as_a_restart_starts_costs_a_restart_not_elastics_grace(tmp_path):
    """A failure while a restart's ranks start: the survivors are blocked in C++ (init_process_group's store wait
    for the dead peer), where a Python SIGTERM handler never runs, so elastic waited its 30 s grace before SIGKILL
    (a restart cost 31 s instead of 1 s, measured by bench/campaign.py). The ranks now take SIGTERM's default
    action: a second restart follows within seconds and the run ends."""
    out = tmp_path / "run"
    process = start_until_checkpoint(tmp_path, out, extra=("--max-restarts", "2"), steps=60)
    killed = []

    def kill_twice() -> None:
        first = set(ranks_of(process.pid))
        os.kill(sorted(first)[-1], signal.SIGKILL)
        deadline = time.time() + 60
        while len(set(ranks_of(process.pid)) - first) < 4:  # the restart's ranks, as soon as they exist
            assert process.poll() is None and time.time() < deadline, "no restart began"
            time.sleep(0.002)
        os.kill(sorted(set(ranks_of(process.pid)) - first)[-1], signal.SIGKILL)
        killed.append(time.time())

    _, stderr = finish_after(process, kill_twice)
    said = [line for line in stderr.splitlines() if line.startswith("minigpt: restart ")]
    assert [line.split(" after")[0] for line in said] == ["minigpt: restart 1 of 2", "minigpt: restart 2 of 2"], stderr
    assert time.time() - killed[0] < 20, f"the second restart took {time.time() - killed[0]:.1f} s (elastic's grace: 30 s)"
