"""How locally launched ranks start: forked from a server that has already imported torch.

A fresh interpreter that imports torch costs 1-3 s of CPU here; eight of them on two cores cost a
run most of its time. The ranks are therefore forked from multiprocessing's forkserver with torch,
torch.distributed and the entrypoint's module preloaded: the server pays the import once, and each
rank is a fork of it, ready in milliseconds. This is safe where plain fork is not: the server
only imports (no CUDA context, no OpenMP or intra-op threads have run in it), so a rank may still
initialise CUDA and its thread pools as a spawned one would. torch's elastic agent starts and
watches the ranks as before (start method "forkserver"); torchrun's own ranks are untouched.

The server is started once per launching process and reused by every launch from it (a test
session forks every group's ranks from one warm server). A command that knows it will launch
ranks starts it first thing (`start_rank_server`), so the server's import of torch runs on one
core while the launching process imports torch on the other.

A forked rank inherits the server's environment, which is the launching process's as it was
when the server started, not as it is at the launch: each rank is handed the launching process's
environment at the launch and takes it (`adopt_environment`), keeping what elastic set for it.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
from pathlib import Path

START_METHOD = "forkserver"
# What every rank needs before its entrypoint: torch, its distributed package and elastic's worker
# wrapper, and this package's launcher. "__main__" is the launching script (the console script
# `minigpt`, a bench script): preloaded, a rank does not run it again as multiprocessing does otherwise.
PRELOAD = (
    "__main__",
    "torch",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing.api",
    "parallel.launch.elastic",
)
# What torchrun and elastic put in every worker's environment.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Set by elastic for each worker (torch.distributed.elastic.agent.server.local_elastic_agent, and
# TORCHELASTIC_* for its error file and run id): a rank keeps these over the launching process's.
WORKER_VARIABLES = frozenset(TORCHRUN_VARIABLES) | {
    "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
}
WORKER_PREFIXES = ("TORCHELASTIC_",)


def launched_ranks(launcher_pid: int) -> list[int]:
    """The pids of the ranks a launching process started on this machine (Linux /proc): the children of the fork
    server it started (start_rank_server), itself its child. For tests and benches that stop a rank."""
    def children(pid: int) -> list[int]:
        found = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text() if (task / "children").exists() else ""
            found += [int(child) for child in text.split()]
        return found

    servers = [c for c in children(launcher_pid) if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return [rank for server in servers for rank in children(server)]


def restart_count() -> int:
    """How many times torch's elastic agent has started this rank's group again after a failure (0: the first)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def in_torchrun() -> bool:
    """True in a process that torchrun or elastic started as one rank of a group."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def start_rank_server(*modules: str) -> None:
    """Start the server the ranks are forked from, importing PRELOAD and `modules` there; it returns at
    once (the server imports in the background). A server already running is kept as it is."""
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is None:  # not started yet: the preload list still applies
        multiprocessing.get_context(START_METHOD).set_forkserver_preload([*PRELOAD, *modules])
    server.ensure_running()


def server_pid() -> int | None:
    """The running server's process id (its children are the ranks), None before it starts."""
    return multiprocessing.forkserver._forkserver._forkserver_pid


def launching_environment() -> dict[str, str]:
    """What a rank should see of the environment: the launching process's, now."""
    return dict(os.environ)


def adopt_environment(launching: dict[str, str]) -> None:
    """In a forked rank: the launching process's environment, with elastic's worker variables kept."""
    worker = {name: value for name, value in os.environ.items()
              if name in WORKER_VARIABLES or name.startswith(WORKER_PREFIXES)}
    os.environ.clear()
    os.environ.update(launching)
    os.environ.update(worker)

