"""A worker killed mid-run: the others stop within a bounded time and the message names the dead rank."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    found = []
    for task in tasks.iterdir():
        text = (task / "children").read_text() if (task / "children").exists() else ""
        found += [int(child) for child in text.split()]
    return found


def is_worker(pid: int) -> bool:
    return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()


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


def test_killed_rank_stops_the_run_with_its_name(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "cli", "train", "--dp", "2", "--steps", "100000", "--log-every", "1000",
               "--layers", "1", "--seq-len", "32", "--batch-size", "4", "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
            assert process.poll() is None, process.communicate()
            assert time.time() < deadline, "training never started"
            time.sleep(0.2)
        workers = [pid for pid in children(process.pid) if is_worker(pid)]
        assert len(workers) == 2, workers
        rank1 = [pid for pid in workers if not has_open(pid, (out / "metrics.jsonl").resolve())]
        assert len(rank1) == 1, workers
        os.kill(rank1[0], signal.SIGKILL)
        killed_at = time.time()
        _, stderr = process.communicate(timeout=60)
        assert time.time() - killed_at < 60
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("minigpt: run failed:") and "rank 1" in last, stderr[-2000:]
