"""A rank that stops responding ends the run within a stated time, and the message names it.

Every rank that `parallel/launch/elastic.py` starts on this machine runs a daemon thread that touches
its own heartbeat file, `<dir>/<rank>`, every HEARTBEAT_S seconds. The thread needs nothing
from the training loop, so a rank that computes, checkpoints or waits in a collective for a
peer keeps beating; only a process that is stopped (SIGSTOP, a debugger, a frozen machine) or
wedged as a whole goes quiet. The launching process's watchdog thread looks at the files every
POLL_S seconds: a rank whose heartbeat is older than the timeout is killed (SIGKILL reaches a
stopped process too), which breaks its peers out of their collectives, elastic ends the rest,
and the launch reports the verdict in one line instead of "killed by SIGKILL".

A rank is judged from its first beat on; one that never beats (stopped while importing torch)
is judged against the launch's start with STARTUP_GRACE_S added. Under torchrun there is no
launching process of ours: the ranks beat into their agents' store and watch each other instead
(parallel/launch/peer_watch.py), with the same timeout.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from minigpt.errors import ConfigError
from parallel.launch.rank_start import server_pid

HEARTBEAT_DIR_VARIABLE = "MINIGPT_HEARTBEAT_DIR"  # set by the launcher, read by each rank it starts
LAUNCHER_VARIABLE = "MINIGPT_LAUNCHER_PID"  # the launching process: a rank that outlives it leaves
HEARTBEAT_S = 1.0
POLL_S = 0.5
# Seconds a rank may take to start beating: the server it is forked from imports torch first (1-3 s
# here); a machine busy with other work can take several times that.
STARTUP_GRACE_S = 60.0
# The default timeout: a beat is one write of a few bytes from a thread that holds the GIL for
# microseconds, so even 8 ranks on 2 busy cores beat within a second or two; a minute of silence is a
# process that is not running.
DEFAULT_TIMEOUT_S = 60.0


def check_timeout(seconds: float) -> None:
    """0 turns the watchdog off; otherwise at least two heartbeats long, and finite."""
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"--watchdog must be a number of seconds >= 0 (0: off), got {seconds!r}")
    if 0 < seconds < 2 * HEARTBEAT_S:
        raise ConfigError(f"--watchdog {seconds:g} is shorter than two heartbeats ({2 * HEARTBEAT_S:g} s): "
                          f"give at least {2 * HEARTBEAT_S:g} s, or 0 to turn it off")


def start_heartbeat(rank: int) -> None:
    """In a launched rank: beat into the launcher's directory, if it gave one, until the process ends. A rank
    whose launching process has ended (killed: it had no chance to end its ranks) ends too, at its next beat,
    instead of training on for no one."""
    directory = os.environ.get(HEARTBEAT_DIR_VARIABLE)
    if not directory:
        return
    path = Path(directory) / str(rank)
    path.write_text(str(os.getpid()), encoding="utf-8")
    launcher = int(os.environ.get(LAUNCHER_VARIABLE, "0"))

    def beat() -> None:
        while True:
            if launcher and not running(launcher):
                os._exit(128 + signal.SIGHUP)  # as a terminal's hang-up would end it
            try:
                os.utime(path)
            except OSError:  # the launcher is gone and took the directory with it
                return
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, name="minigpt-heartbeat", daemon=True).start()


@dataclass(frozen=True)
class Silent:
    """The watchdog's verdict: which rank went quiet, and for how long."""

    rank: int
    seconds: float

    def line(self, world_size: int, timeout_s: float) -> str:
        return (f"rank {self.rank} of {world_size} stopped responding: no heartbeat for {self.seconds:.0f} s "
                f"(the watchdog allows {timeout_s:g} s, --watchdog); the process was stopped or frozen, so the "
                f"run was ended; its checkpoints so far are kept (--resume continues)")


class Watchdog:
    """The launching process's side: watch `world_size` heartbeat files under `directory`."""

    def __init__(self, directory: str, world_size: int, timeout_s: float):
        self.directory = Path(directory)
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.started = time.time()
        self.verdict: Silent | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="minigpt-watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            silent = self.silent_rank(time.time())
            if silent is not None:
                self.verdict = silent
                self._kill(silent.rank)
                return

    def silent_rank(self, now: float) -> Silent | None:
        """The rank silent the longest past the timeout, if any; ranks whose process has ended are not silent."""
        worst = None
        for rank in range(self.world_size):
            path = self.directory / str(rank)
            try:
                age, allowed = now - path.stat().st_mtime, self.timeout_s
                pid = int(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):  # not started yet (or its first write is under way)
                age, allowed, pid = now - self.started, self.timeout_s + STARTUP_GRACE_S, None
            if age > allowed and (pid is None or running(pid)) and (worst is None or age > worst.seconds):
                worst = Silent(rank, age)
        return worst

    def _kill(self, rank: int) -> None:
        """SIGKILL the silent rank; one that never wrote its pid cannot be told from the others, so every rank
        this process started goes (its peers would be ended by elastic a moment later anyway): the children of
        the server they were forked from (parallel/launch/rank_start.py)."""
        try:
            pids = [int((self.directory / str(rank)).read_text(encoding="utf-8"))]
        except (OSError, ValueError):
            pids = child_processes(server_pid() or os.getpid())
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # it has just ended: elastic's exit codes tell the rest


def child_processes(pid: int) -> list[int]:
    """The processes `pid` started, as /proc lists them."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def running(pid: int) -> bool:
    """True while process `pid` exists and has not ended (a zombie waiting for its parent has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    return state not in ("Z", "X")
