"""torchrun's variables without a torchrun (parallel/launch/torchrun_env.py): a rank whose peers never come says what
it waits for, gives up after MINIGPT_RENDEZVOUS_TIMEOUT seconds in one line, and the bound is the rendezvous's
alone: the process group it joins keeps torch's default timeout. (Variables set only in part, or to values no
rank could use, are refused before any work: tests/test_bad_inputs.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minigpt.errors import ConfigError
from parallel.launch.torchrun_env import AGENT_VARIABLE, TIMEOUT_VARIABLE, TORCHRUN_VARIABLES, join_process_group

REPO = Path(__file__).parent.parent
SMALL = ["--layers", "1", "--seq-len", "32", "--batch-size", "4"]
GIVE_UP_S = 30.0  # 2 s of waiting, with torch's import and a busy machine around it


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_environment(rank: str, world_size: str = "2") -> dict[str, str]:
    return {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), TIMEOUT_VARIABLE: "2"}


def every_variable_set() -> dict[str, bool]:
    return {name: name in os.environ for name in TORCHRUN_VARIABLES}


def test_the_variables_are_those_elastic_sets_in_every_rank():
    """What is checked and refused here is what torch's elastic agent (torchrun's) puts in each rank."""
    from distributed import run_ranks

    assert run_ranks(2, every_variable_set) == [dict.fromkeys(TORCHRUN_VARIABLES, True)] * 2


@pytest.mark.parametrize("rank", ["0", "1"])  # rank 0 hosts the store and waits; rank 1 cannot reach it
def test_a_rank_whose_peers_never_come_gives_up_in_one_line(monkeypatch, capfd, rank):
    environment = torchrun_environment(rank)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(AGENT_VARIABLE, raising=False)
    start = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        join_process_group("gloo")
    assert time.monotonic() - start < GIVE_UP_S
    where = f"127.0.0.1:{environment['MASTER_PORT']}"
    assert str(caught.value) == (
        f"rank {rank} of WORLD_SIZE 2 waited 2 s for the other ranks at MASTER_ADDR:MASTER_PORT {where} and they "
        f"never came: unset RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT to run on this machine, or start "
        f"the run with torchrun (it starts every rank)")
    assert capfd.readouterr().err.splitlines() == [  # c10d's own retry warnings and C++ backtraces are not shown
        f"minigpt: rank {rank} of WORLD_SIZE 2 waits up to 2 s for the other ranks at MASTER_ADDR:MASTER_PORT "
        f"{where} (MINIGPT_RENDEZVOUS_TIMEOUT sets how long)"]


def test_the_bound_is_the_rendezvous_not_the_group(monkeypatch, capfd):
    """A group that met keeps torch's default timeouts (30 minutes for gloo), in its store and its backend; under
    torchrun's agent, which gathered the ranks already, the rank says nothing."""
    import torch
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    assert not dist.is_initialized()
    for name, value in torchrun_environment("0", world_size="1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(AGENT_VARIABLE, "a-run")
    join_process_group("gloo")
    try:
        group = dist.distributed_c10d._get_default_group()
        assert dist.distributed_c10d._get_default_store().timeout == default_pg_timeout
        assert group._get_backend(torch.device("cpu")).options._timeout == default_pg_timeout
    finally:
        dist.destroy_process_group()
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("rank", ["0", "1"])
def test_train_with_torchruns_variables_and_no_torchrun_ends_in_time(tmp_path, rank):
    """The whole command, as a user meets it: the waiting line, then one error line and exit code 2 within seconds,
    not torch's 30 minutes of silence; and --overwrite has cleared nothing, since a rank meets the others before
    rank 0 makes, locks or clears --out."""
    earlier = tmp_path / "run"
    earlier.mkdir()
    for name in ("config.json", "metrics.jsonl"):  # what --overwrite would clear of an earlier run
        (earlier / name).write_text("an earlier run's")
    environment = {**os.environ, **torchrun_environment(rank)}
    environment.pop(AGENT_VARIABLE, None)
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "cli", "train", *SMALL, "--steps", "2", "--out", str(earlier),
                             "--overwrite"], cwd=REPO, env=environment, capture_output=True, text=True, timeout=2 * GIVE_UP_S)
    assert time.monotonic() - start < GIVE_UP_S, result.stderr
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"minigpt: rank {rank} of WORLD_SIZE 2 waits up to 2 s"), lines
    assert lines[1].startswith(f"minigpt: error: rank {rank} of WORLD_SIZE 2 waited 2 s") and "never came" in lines[1]
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in earlier.iterdir()) == ["config.json", "metrics.jsonl"]
    assert all(p.read_text() == "an earlier run's" for p in earlier.iterdir())
