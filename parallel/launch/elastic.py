"""Starting the ranks of a run: torch's elastic launcher locally, or torchrun's ranks as they are.

One entrypoint serves every way a run starts:

- `python train.py` with a 1 x 1 x 1 layout runs the entrypoint in this process, without a
  process group, so the single-process run is the same code as every other layout;
- `python train.py` with more ranks starts them on this machine through
  `torch.distributed.launcher.api.elastic_launch`, the engine under torchrun, so failure
  reports, rendezvous and cleanup are torch's and not ours;
- `torchrun --nproc-per-node N train.py` (one node or many) already started the ranks:
  `launch` sees torchrun's environment and just calls the entrypoint in this rank.

Inside the entrypoint a rank calls `init_worker()` first and `finish_worker()` in a finally.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from minigpt.errors import ConfigError, Interrupted, TrainingError, check_positive_int, check_threads_per_rank
from parallel.launch.rank_start import (
    START_METHOD, TORCHRUN_VARIABLES, adopt_environment, in_torchrun, launching_environment, start_rank_server,
)
from parallel.launch.torchrun_env import check_torchrun_variables, join_process_group
from parallel.launch.peer_watch import lost_peer_line, watch_torchrun_rank
from parallel.launch.watchdog import (
    DEFAULT_TIMEOUT_S, HEARTBEAT_DIR_VARIABLE, LAUNCHER_VARIABLE, Watchdog, check_timeout, start_heartbeat,
)

Arg = TypeVar("Arg")
Result = TypeVar("Result")

# Seconds between the agent's looks at its workers: a failed rank is noticed this fast.
MONITOR_INTERVAL_S = 0.1
# Seconds a rank that raised waits before it exits. Elastic names the first rank whose end it notices, and the
# peers of a rank that died fail a moment after it (their connections to it break): ending at once, they are
# often noticed in the same look, and the lowest rank is named. Lingering a few looks names the one that failed.
FAILURE_LINGER_S = 5 * MONITOR_INTERVAL_S


def launch(
    entrypoint: Callable[[Arg], Result],
    arg: Arg,
    world_size: int,
    threads_per_rank: int = 1,
    watchdog_s: float = DEFAULT_TIMEOUT_S,
    max_restarts: int = 0,
) -> Result:
    """Run entrypoint(arg) on world_size ranks and return what rank 0's call returned.

    entrypoint must be a module-level function and arg picklable: the ranks are forked from a
    server that has imported torch and nothing more (parallel/launch/rank_start.py), since forking this
    process, which may hold torch's thread pools and, on GPUs, a CUDA context, is unsafe.
    Under torchrun every rank gets its own call's value back (rank 0's is the one that counts)
    and threads_per_rank is left to torchrun, which sets OMP_NUM_THREADS itself.
    Locally launched ranks are watched (parallel/launch/watchdog.py): one silent for watchdog_s seconds ends the
    run with a TrainingError naming it; 0 turns the watchdog off. Under torchrun the ranks watch each other
    through their agents' store, each leaves when its agent is gone, and one whose collective broke because a
    peer ended says so in one line (parallel/launch/peer_watch.py). `max_restarts`: times the elastic agent
    starts every rank again after one fails (the entrypoint sees TORCHELASTIC_RESTART_COUNT; under torchrun,
    torchrun's own --max-restarts).
    """
    check_torchrun_world(world_size)
    check_threads_per_rank("threads per rank", threads_per_rank)
    check_timeout(watchdog_s)
    if in_torchrun():  # torchrun started this rank and the others: it watches its agent, and its peers
        watch = watch_torchrun_rank(watchdog_s)
        try:
            return entrypoint(arg)
        except RuntimeError as error:  # a peer that ended first: one line here, the cause is in its node's output
            line = lost_peer_line(error)
            if line is None:
                raise
            raise TrainingError(line) from None
        finally:
            if watch is not None:
                watch.stop()
    if world_size == 1:
        return entrypoint(arg)
    return launch_local(entrypoint, arg, world_size, threads_per_rank, watchdog_s, max_restarts)


def check_torchrun_world(world_size: int) -> None:
    """Under torchrun, the processes it started must be the layout's: ConfigError otherwise."""
    check_torchrun_variables()
    check_positive_int("world size", world_size)
    if in_torchrun() and int(os.environ["WORLD_SIZE"]) != world_size:
        raise ConfigError(
            f"torchrun started {os.environ['WORLD_SIZE']} processes but the layout tp x cp x pp x dp needs {world_size}: "
            f"start torchrun with {world_size} processes in all (--nnodes x --nproc-per-node) "
            f"or change the layout"
        )


def run_with_threads(entrypoint: Callable[[Arg], Result], arg: Arg, threads: int, environment: dict[str, str]) -> Result:
    """The function each locally launched rank runs: take the launching process's environment, pin the
    thread count, then the entrypoint.

    Ranks share the machine's cores; each one using all of them would oversubscribe the CPU
    many times over. OMP_NUM_THREADS covers OpenMP as the interpreter starts; this covers
    torch's own intra-op pool.
    """
    adopt_environment(environment)
    torch.set_num_threads(threads)
    start_heartbeat(int(os.environ["RANK"]))
    # Ctrl-C reaches every process of the terminal's group: the launching process says so on one line,
    # and a rank leaves at once and quietly instead of printing a KeyboardInterrupt traceback each.
    signal.signal(signal.SIGINT, _leave_quietly)
    # How elastic ends the ranks of a stopped or restarting group: the default action, which the kernel carries out
    # at once and quietly. A Python handler runs only between bytecodes, so a rank blocked in C++ (a store wait
    # in init_process_group for a peer killed as the group started, a gloo collective) would hold it until
    # elastic's 30 s grace ran out and SIGKILL came: a failure during a restart cost 31 s instead of 1 s.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return entrypoint(arg)
    except BaseException:
        time.sleep(FAILURE_LINGER_S)
        raise


def _leave_quietly(signal_number: int, frame) -> None:
    sys.stderr.flush()
    os._exit(128 + signal_number)


def quiet_elastic_logs() -> None:
    """Elastic's logs as it shuts ranks down (a stopped or failed run) are not for our user: the CLI says what
    happened in one line, and describe_failure prints the root cause's traceback when it was not one of our
    own errors. Its loggers set their own levels, so each one is set."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


LOCAL_HOST = "127.0.0.1"
PORT_ATTEMPTS = 3


def local_rendezvous() -> dict:
    """Elastic's static rendezvous on a free local port: the agent's TCPStore, which the ranks join.

    torchrun --standalone's c10d rendezvous (port 0) would do as well, but sleeps a random 0-0.3 s before
    its first round, to spread out nodes that join at once: one node has nothing to spread, and every local
    run and test group paid 0.15 s on average. The port is free when probed; were it taken before the store
    binds it, the launch fails with EADDRINUSE before any rank starts, and is tried again on another.
    """
    with socket.socket() as probe:
        probe.bind((LOCAL_HOST, 0))
        port = probe.getsockname()[1]
    return {"rdzv_backend": "static", "rdzv_endpoint": f"{LOCAL_HOST}:{port}", "rdzv_configs": {"rank": 0}}


def launch_on_a_free_port(config: LaunchConfig, entrypoint: Callable[[Arg], Result], arg: Arg,
                          threads_per_rank: int) -> dict[int, Result]:
    """elastic_launch of the ranks; tried again on a new port where another process took the probed one."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return elastic_launch(config, run_with_threads)(entrypoint, arg, threads_per_rank,
                                                            launching_environment())
        except dist.DistNetworkError as error:
            if "EADDRINUSE" not in str(error) or attempt == PORT_ATTEMPTS:
                raise
            config = replace(config, **local_rendezvous())


def launch_local(
    entrypoint: Callable[[Arg], Result], arg: Arg, world_size: int, threads_per_rank: int,
    watchdog_s: float = DEFAULT_TIMEOUT_S, max_restarts: int = 0,
) -> Result:
    """Start world_size ranks on this machine as `torchrun --standalone` would (with a static rendezvous), and
    wait for them (started again after a failure, up to `max_restarts` times)."""
    saved = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", HEARTBEAT_DIR_VARIABLE, LAUNCHER_VARIABLE)}
    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank)  # the ranks take it with the rest of the environment
    start_rank_server(entrypoint.__module__)
    quiet_elastic_logs()
    try:
        # Elastic writes each rank's error file under the log directory, the ranks their heartbeats beside;
        # ours goes away afterwards instead of piling up as /tmp/torchelastic_* directories.
        with tempfile.TemporaryDirectory(prefix="minigpt-launch-") as log_dir:
            heartbeats = Path(log_dir) / "heartbeats"
            heartbeats.mkdir()
            if watchdog_s:
                os.environ[HEARTBEAT_DIR_VARIABLE] = str(heartbeats)
                os.environ[LAUNCHER_VARIABLE] = str(os.getpid())
            else:
                os.environ.pop(HEARTBEAT_DIR_VARIABLE, None)
                os.environ.pop(LAUNCHER_VARIABLE, None)
            config = LaunchConfig(
                min_nodes=1,
                max_nodes=1,
                nproc_per_node=world_size,
                run_id=str(uuid.uuid4()),
                **local_rendezvous(),
                max_restarts=max_restarts,
                monitor_interval=MONITOR_INTERVAL_S,
                start_method=START_METHOD,
                logs_specs=DefaultLogsSpecs(log_dir=log_dir),  # stdout and stderr stay inherited
            )
            watchdog = Watchdog(str(heartbeats), world_size, watchdog_s)
            try:
                with watchdog if watchdog_s else contextlib.nullcontext():
                    results = launch_on_a_free_port(config, entrypoint, arg, threads_per_rank)
            except ChildFailedError as error:
                if watchdog.verdict is not None:  # the rank it killed, not "killed by SIGKILL"
                    raise TrainingError(watchdog.verdict.line(world_size, watchdog_s)) from None
                if {failure.exitcode for failure in error.failures.values()} <= {128 + signal.SIGINT, -signal.SIGINT}:
                    raise Interrupted(signal.SIGINT) from None  # Ctrl-C: the ranks left before this process noticed
                # One line for the CLI; elastic has logged the failed rank's traceback to stderr.
                raise TrainingError(describe_failure(error, log_dir, world_size)) from None
            except SignalException as error:  # SIGINT or SIGTERM to this process: elastic ended the ranks
                raise Interrupted(int(error.sigval)) from None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return results[0]


MAX_CAUSE_CHARS = 300  # the failure stays one readable line
OUR_ERRORS = ("TrainingError:", "ConfigError:", "CorruptCheckpoint:")  # a rank's anticipated failures


@dataclass(frozen=True)
class RecordedError:
    """What elastic's record() wrapper wrote for a rank that raised."""

    rank: int
    written_ns: int
    message: str  # "Type: message", on one line
    traceback: str


def describe_failure(error: ChildFailedError, log_dir: str, world_size: int) -> str:
    """'rank 1 of 2 failed: ValueError: ...': which ranks failed and the first one's cause.

    Elastic's ChildFailedError names only the one rank that torch.multiprocessing happened to
    notice first, often a peer that died of the broken connection a moment after the real
    failure. So every rank's error file is read, the one written first is the root cause, and its
    traceback is printed unless it is one of our own errors, whose message says it all (elastic's own
    log of whichever traceback it saw is silenced: quiet_elastic_logs).
    """
    recorded = recorded_errors(log_dir)
    failed = sorted(set(recorded) | set(error.failures))
    silent = [rank for rank in error.failures if rank not in recorded]
    if silent:  # a rank killed or exited without raising: the others' errors are its echo
        first = min(silent)
        cause = exit_cause(error.failures[first])
    elif recorded:
        root = min(recorded.values(), key=lambda entry: entry.written_ns)
        first, cause = root.rank, root.message
        if root.traceback and not root.message.startswith(OUR_ERRORS):  # ours say all in their message
            print(f"The root cause, rank {first}'s traceback:\n{root.traceback}", file=sys.stderr, flush=True)
    else:
        first = min(error.failures)
        cause = exit_cause(error.failures[first])
    if len(cause) > MAX_CAUSE_CHARS:
        cause = cause[: MAX_CAUSE_CHARS - 3] + "..."
    if len(failed) == 1:
        return f"rank {first} of {world_size} failed: {cause}"
    names = ", ".join(str(rank) for rank in failed)
    return f"ranks {names} of {world_size} failed; the cause, rank {first}: {cause}"


def recorded_errors(log_dir: str) -> dict[int, RecordedError]:
    """The exception of each rank that raised, by rank.

    Elastic's record() wrapper writes <log_dir>/<run>/attempt_<n>/<local rank>/error.json in
    every rank that raises; on one node the local rank is the global rank.
    """
    errors = {}
    for path in Path(log_dir).glob("*/attempt_*/*/error.json"):
        try:
            message = json.loads(path.read_text(encoding="utf-8")).get("message")
            written = path.stat().st_mtime_ns
        except (OSError, ValueError):
            continue  # a rank killed while writing it: its exit code still tells
        traceback = ""
        if isinstance(message, dict):
            traceback = str(message.get("extraInfo", {}).get("py_callstack", ""))
            message = message.get("message")
        if isinstance(message, str) and path.parent.name.isdigit():
            rank = int(path.parent.name)
            errors[rank] = RecordedError(rank, written, " ".join(message.split()), traceback)
    return errors


def exit_cause(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        try:
            return f"killed by {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            return f"killed by signal {-failure.exitcode}"
    return f"exited with code {failure.exitcode} without raising an exception"


def init_worker(device_type: str | None = None) -> torch.device:
    """Join the process group (when there is more than one rank) and return this rank's device.

    NCCL needs one GPU per local rank; with fewer GPUs than local ranks, or none, the ranks
    talk over gloo on the CPU. device_type "cpu" forces the CPU, "cuda" insists on GPUs,
    None picks CUDA when there is enough of it.
    """
    if device_type not in (None, "cpu", "cuda"):
        raise ConfigError(f"device type must be cpu or cuda, got {device_type!r}")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    use_cuda = device_type != "cpu" and gpus >= local_world_size
    if device_type == "cuda" and not use_cuda:
        raise ConfigError(
            f"CUDA was asked for but this node has {gpus} GPU(s) for {local_world_size} local ranks: "
            f"use fewer ranks per node or the CPU"
        )
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        # The current device: what NCCL's object collectives (all_gather_object, gather_object)
        # and torch.distributed.checkpoint put their byte tensors on.
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        if use_cuda:
            # Bound to this rank's GPU: NCCL sets up its communicator at once, and barrier()
            # and new groups use this GPU rather than guessing one.
            join_process_group("nccl", device)
        else:
            join_process_group("gloo")
    return device


def finish_worker() -> None:
    """Leave the process group on a clean exit, so the rank does not warn about a leaked group.

    Called from a finally while an exception is on its way out, it leaves the group alone:
    destroying it would close the connections at once, and peers blocked in a collective
    would fail with "connection closed" and might record that before this rank records the
    real cause. The process exits right after, which closes the connections anyway.
    """
    if sys.exc_info()[1] is not None:
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
