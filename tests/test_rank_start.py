"""Ranks forked from a server that imported torch (parallel/rank_start.py): forked from it, with the launching
process's environment as it is at the launch, and a preload that never touches CUDA (forking after CUDA is
initialised is unsafe, which is why the server imports and does nothing more)."""

from __future__ import annotations

import os
import subprocess
import sys

from distributed import run_ranks
from parallel.rank_start import PRELOAD, server_pid


def what_a_rank_sees(names: list[str]) -> dict:
    return {"ppid": os.getppid(), "env": {name: os.environ.get(name) for name in names}}


def test_ranks_are_forked_from_the_server_and_take_the_launchers_environment_at_the_launch(monkeypatch):
    monkeypatch.setenv("MINIGPT_TEST_GONE", "set before the first launch")
    run_ranks(2, what_a_rank_sees, [])  # the server runs from here on (if an earlier test did not start it)
    monkeypatch.setenv("MINIGPT_TEST_LATER", "set after the server started")
    monkeypatch.delenv("MINIGPT_TEST_GONE")
    names = ["MINIGPT_TEST_LATER", "MINIGPT_TEST_GONE", "RANK", "WORLD_SIZE", "OMP_NUM_THREADS"]
    seen = run_ranks(2, what_a_rank_sees, names)
    assert [rank["ppid"] for rank in seen] == [server_pid()] * 2
    for rank, view in enumerate(seen):
        assert view["env"] == {"MINIGPT_TEST_LATER": "set after the server started", "MINIGPT_TEST_GONE": None,
                               "RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}, view


CUDA_TRAPS = """
import sys, torch
def touched(*args, **kwargs):
    raise SystemExit("CUDA was touched while importing " + repr(sys.argv[1:]))
torch.cuda.is_available = torch.cuda.device_count = torch.cuda.init = touched
torch._C._cuda_getDeviceCount = touched
for name in sys.argv[1:]:
    __import__(name)
"""


def test_the_servers_preload_touches_no_cuda():
    """Every module the server imports (PRELOAD and the entrypoints' modules) imports without asking CUDA
    anything: a fork after cuInit would give every rank a broken CUDA."""
    modules = [name for name in PRELOAD if name != "__main__"] + ["parallel.train", "cli.main", "parallel.calibrate"]
    result = subprocess.run([sys.executable, "-c", CUDA_TRAPS, *modules], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
