"""Under torchrun: a rank whose agent is gone leaves, and --watchdog watches the ranks of every node.

torchrun's agent starts each rank in a session of its own, so a signal to the agent's process group (a scheduler's
SIGKILL, the OOM killer) ends the agent alone, and its ranks, orphaned, would go on training with the other nodes'
ranks, the run whole in appearance. Each rank watches its parent, the agent, and leaves within a heartbeat of it
(exit code 129, as at a hang-up): its peers on the other nodes then fail in their next collective with it (its
connections close), and their agents end them.

A rank that is stopped or frozen (SIGSTOP, a debugger, a machine that hangs) keeps its connections open, and its
peers would wait in their collectives for the process group's timeout, 30 minutes. There is no launching process of
ours to watch heartbeat files (parallel/launch/watchdog.py), so the ranks beat into the store their agents share
(MASTER_ADDR:MASTER_PORT): every HEARTBEAT_S seconds each adds one to its own counter and reads the next rank's (a
ring: one read per rank and beat, whatever the world size). A counter that has not moved for --watchdog seconds
(STARTUP_GRACE_S more before its first beat) ends the run: the rank that saw it prints the verdict, leaves it in
the store's stop key, kills the silent rank where it runs on the same host (its agent then ends its node's ranks at
once, instead of waiting 30 s for a stopped process to take its SIGTERM) and exits; every other rank reads that
key at its next beat and exits too, the first rank of each node printing the verdict, so every node's agent ends
its ranks within seconds. A rank whose work is done marks its counter DONE: it beats no more, and is not silent.
A store that cannot be reached (its agent ended: the agents see that themselves) stops the beating quietly; one
that does not answer within --watchdog seconds (its node frozen) ends the run like a silent rank. A rank whose
collective broke because a peer's process ended says so in one line (`lost_peer_line`) instead of gloo's traceback.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

from parallel.launch.rank_start import restart_count
from parallel.launch.torchrun_env import AGENT_VARIABLE
from parallel.launch.watchdog import HEARTBEAT_S, STARTUP_GRACE_S, Silent

AGENT_GONE_EXIT = 128 + signal.SIGHUP
WATCHDOG_EXIT = 1
DONE = 1 << 40  # added to a rank's counter when its work is done
KEY_PREFIX = "minigpt/peer_watch/"
CONNECT_S = 5.0


def agent_gone_line(rank: int, world_size: int, agent: int) -> str:
    return (f"rank {rank} of {world_size}: its torchrun agent (process {agent}) is gone, so it leaves too; "
            f"the run's checkpoints so far are kept (--resume continues)")


def store_silent_line(timeout_s: float) -> str:
    return (f"the store of MASTER_ADDR:MASTER_PORT {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} did not "
            f"answer for {timeout_s:g} s (the watchdog allows {timeout_s:g} s, --watchdog): its node is stopped or "
            f"frozen, so the run was ended; its checkpoints so far are kept (--resume continues)")


def leave(line: str | None, code: int) -> None:
    """End this rank from the watching thread: the main thread may be inside a collective that never returns."""
    if line:
        print(f"minigpt: error: {line}", file=sys.stderr, flush=True)
    os._exit(code)


class PeerWatch:
    """One rank's side: its heartbeat into `store` and its look at the next rank's and at the stop key."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, now: float):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.watched = (rank + 1) % world_size
        self.prefix = f"{KEY_PREFIX}attempt_{restart_count()}/"  # ranks started again count afresh
        self.last_count, self.last_change = 0, now
        store.set(self.key(rank) + "/process", f"{socket.gethostname()} {os.getpid()}")

    def key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def beat(self, now: float) -> tuple[str, bool] | None:
        """Beat once; (the verdict, whether this rank reached it) when the run must end, else None."""
        self.store.add(self.key(self.rank), 1)
        if self.store.check([self.prefix + "stop"]):
            return self.store.get(self.prefix + "stop").decode("utf-8", "replace"), False
        if self.world_size == 1:
            return None
        count = int(self.store.add(self.key(self.watched), 0))
        if count >= DONE:
            return None
        if count != self.last_count:
            self.last_count, self.last_change = count, now
        allowed = self.timeout_s + (STARTUP_GRACE_S if count == 0 else 0.0)
        if now - self.last_change <= allowed:
            return None
        verdict = Silent(self.watched, now - self.last_change).line(self.world_size, self.timeout_s)
        self.store.set(self.prefix + "stop", verdict)
        self.kill_watched()
        return verdict, True

    def kill_watched(self) -> None:
        """SIGKILL the silent rank where it runs on this host (it reaches a stopped process too): its agent sees
        it end at once, instead of after its grace for SIGTERM. One on another host is its own agent's to end."""
        key = self.key(self.watched) + "/process"
        if not self.store.check([key]):
            return
        host, pid = self.store.get(key).decode("utf-8", "replace").rsplit(" ", 1)
        if host == socket.gethostname():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass  # it has ended already

    def finish(self) -> None:
        self.store.add(self.key(self.rank), DONE)


class RankWatch:
    """The thread of one torchrun rank: its agent, and with a timeout its peers. `stop()` when the work is done."""

    def __init__(self, timeout_s: float, end: Callable[[str | None, int], None] = leave):
        self.timeout_s, self.end = timeout_s, end
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.first_of_node = os.environ.get("LOCAL_RANK", "0") == "0"
        self.agent = os.getppid()
        self.peers: PeerWatch | None = None
        self.store_gone = False
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the store client is not shared between the thread and stop()
        self._thread = threading.Thread(target=self._watch, name="minigpt-peer-watch", daemon=True)
        self._thread.start()

    def _connect(self) -> None:
        """The client of the agents' store this thread beats through (its own: the rank's is the main thread's)."""
        from torch.distributed import TCPStore

        try:  # the store is up before the agent starts its ranks: a few seconds to reach it, not the watchdog's
            store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=min(self.timeout_s, CONNECT_S)), wait_for_workers=False)
            store.set_timeout(timedelta(seconds=self.timeout_s))
            peers = PeerWatch(store, self.rank, self.world_size, self.timeout_s, time.monotonic())
        except Exception:  # noqa: BLE001 - not reached this time: tried again at the next beat
            return
        with self._lock:
            if not self._stop.is_set():
                self.peers = peers

    def _watch(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if os.getppid() != self.agent:
                self.end(agent_gone_line(self.rank, self.world_size, self.agent), AGENT_GONE_EXIT)
                return
            if self.timeout_s and self.peers is None and not self.store_gone:
                self._connect()  # a rank that never beats would be judged silent: connected until it is
            with self._lock:
                outcome = None if self._stop.is_set() or self.peers is None else self._beat()
            if outcome is not None:
                verdict, mine = outcome
                self.end(verdict if mine or self.first_of_node else None, WATCHDOG_EXIT)
                return

    def _beat(self) -> tuple[str, bool] | None:
        began = time.monotonic()
        try:
            return self.peers.beat(began)
        except Exception:  # noqa: BLE001 - the store's errors, whatever torch names them
            if time.monotonic() - began >= 0.9 * self.timeout_s:
                return store_silent_line(self.timeout_s), True
            self.peers, self.store_gone = None, True  # its agent ended: the agents see to that
            return None

    def stop(self) -> None:
        """The rank's work is done: it is marked DONE (not silent) and the thread ends."""
        self._stop.set()
        with self._lock:
            if self.peers is not None:
                try:
                    self.peers.finish()
                except Exception:  # noqa: BLE001 - the store is gone: nobody is watching any more
                    pass
                self.peers = None


def watch_torchrun_rank(timeout_s: float) -> RankWatch | None:
    """In a rank that torchrun's agent started: watch the agent, and peers when `timeout_s` is not 0."""
    if AGENT_VARIABLE not in os.environ:
        return None
    return RankWatch(timeout_s)


# What gloo says in a rank whose peer's process ended (its connections closed): the peer's own output says why.
LOST_PEER = re.compile(r"(Connection (?:closed|reset) by peer(?: \[[^\]]*\]:\d+)?|Broken pipe)")


def lost_peer_line(error: BaseException) -> str | None:
    """One line for a torchrun rank whose collective failed because a peer rank ended; None for any other error."""
    found = LOST_PEER.search(str(error))
    if found is None:
        return None
    return (f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')} lost a peer rank "
            f"({found.group(1).strip()}): the output of the node whose ranks ended first says why; the run's "
            f"checkpoints so far are kept (--resume continues)")
