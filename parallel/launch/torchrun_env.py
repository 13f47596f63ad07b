"""torchrun's variables: all of them or none, and a rendezvous that says what it waits for and gives up in time.

A process that finds RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its environment is one
rank of a group (parallel/launch/rank_start.py's in_torchrun). Left over in a shell without a torchrun, they made
a run wait for ranks that never came, silently, for torch's default of 30 minutes. So:

- only some of them set is refused before any work (`check_torchrun_variables`, which also refuses values
  that are not a rank, a world size or a port);
- all of them set, a rank joins its group through `join_process_group`: it says on stderr what it waits for
  (unless torchrun's agent started it, whose rendezvous has gathered every node already), and ranks that do
  not all meet within `rendezvous_timeout_s()` (MINIGPT_RENDEZVOUS_TIMEOUT, default 60 s) end in one
  ConfigError line. Under torchrun the ranks of every node meet in init_process_group, not at the agent's
  store (up before they start): the bound covers both. Once met, the process group and its collectives keep
  torch's default timeouts.

Torch is imported by `join_process_group` alone.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys

from minigpt.errors import ConfigError
from parallel.launch.rank_start import TORCHRUN_VARIABLES, restart_count
TIMEOUT_VARIABLE = "MINIGPT_RENDEZVOUS_TIMEOUT"
# Ranks started by hand on several machines arrive seconds apart; a minute is long enough for that and short
# enough that a forgotten `export RANK=...` is noticed while the user still waits for the run to start.
DEFAULT_RENDEZVOUS_TIMEOUT_S = 60.0
AGENT_VARIABLE = "TORCHELASTIC_RUN_ID"  # set by torchrun's (and elastic_launch's) agent in every rank it starts
MAX_REASON_CHARS = 200


def unset_hint() -> str:
    return f"unset {', '.join(TORCHRUN_VARIABLES)} to run on this machine, or start the run with torchrun"


def check_torchrun_variables() -> None:
    """None or all of TORCHRUN_VARIABLES set, with values a rank can use; ConfigError otherwise."""
    given = [name for name in TORCHRUN_VARIABLES if name in os.environ]
    if not given:
        return
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ConfigError(f"torchrun's variables are set only in part ({', '.join(given)} set, {', '.join(missing)} "
                          f"not), as if a torchrun had started this process: {unset_hint()}")
    world = whole_number("WORLD_SIZE", 1, None)
    whole_number("RANK", 0, world - 1)
    whole_number("LOCAL_RANK", 0, None)
    whole_number("MASTER_PORT", 1, 65535)
    if not os.environ["MASTER_ADDR"].strip():
        raise ConfigError(f"MASTER_ADDR is empty: {unset_hint()}")
    rendezvous_timeout_s()


def whole_number(name: str, low: int, high: int | None) -> int:
    text = os.environ[name]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ConfigError(f"{name}={text!r} must be an integer {bound}: {unset_hint()}")
    return value


def tensor_parallel_across_nodes(tp: int) -> str | None:
    """Under torchrun, the warning for a tensor-parallel group that spans nodes; None when each is inside one.

    torchrun numbers a node's ranks consecutively (RANK = node rank x LOCAL_WORLD_SIZE + LOCAL_RANK) and the mesh
    puts tp innermost (parallel/mesh.py), so the groups are tp consecutive ranks: inside one node exactly when tp
    divides the node's LOCAL_WORLD_SIZE. Otherwise the run is still correct, only slower (two all-reduces per
    layer and micro-batch over the network), which a model too large for one node's tp may need: a warning, not a
    refusal."""
    if "RANK" not in os.environ or "LOCAL_WORLD_SIZE" not in os.environ:
        return None
    local = whole_number("LOCAL_WORLD_SIZE", 1, None)
    if local % tp == 0:
        return None
    return (f"--tp {tp} does not divide the {local} ranks of a node (torchrun --nproc-per-node {local}): each "
            f"tensor-parallel group spans nodes, and its all-reduces (two per layer and micro-batch) cross the "
            f"network; a --tp that divides --nproc-per-node keeps every group inside one node")


def rank_placement() -> dict:
    """Where this rank runs: its host, its node (torchrun's GROUP_RANK, 0 on one machine) and its local rank."""
    return {"host": socket.gethostname(), "node": int(os.environ.get("GROUP_RANK", "0")),
            "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}


def rendezvous_timeout_s() -> float:
    """Seconds a rank waits for the others to reach MASTER_ADDR:MASTER_PORT: MINIGPT_RENDEZVOUS_TIMEOUT, or 60."""
    text = os.environ.get(TIMEOUT_VARIABLE)
    if text is None:
        return DEFAULT_RENDEZVOUS_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"{TIMEOUT_VARIABLE} must be a number of seconds > 0, got {text!r}")
    return seconds


def where() -> str:
    return f"MASTER_ADDR:MASTER_PORT {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"


def whom() -> str:
    return f"rank {os.environ['RANK']} of WORLD_SIZE {os.environ['WORLD_SIZE']}"


def waiting_line(seconds: float) -> str:
    return (f"minigpt: {whom()} waits up to {seconds:g} s for the other ranks at {where()} "
            f"({TIMEOUT_VARIABLE} sets how long)")


def failure_line(error: Exception, seconds: float) -> str:
    """One line for a rendezvous that failed: the others never came, or torch's reason."""
    reason = " ".join(str(error).split())
    if "timed out" in reason.lower() or "wait timeout" in reason.lower():
        return f"{whom()} waited {seconds:g} s for the other ranks at {where()} and they never came: {missing_hint()}"
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 3] + "..."
    return f"{whom()} cannot meet the other ranks at {where()}: {reason}: {missing_hint()}"


def missing_hint() -> str:
    """What to do about ranks that never came: without torchrun, start them with it; under torchrun's agent (which
    started them), look at the node whose ranks ended before they joined (a flag refused there, a crash)."""
    if AGENT_VARIABLE in os.environ:
        return (f"a rank of another node ended before it joined, and that node's output says why "
                f"({TIMEOUT_VARIABLE} sets how long a rank waits)")
    return f"{unset_hint()} (it starts every rank)"


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 sent to /dev/null: c10d's C++ logs a retry warning, with a C++ backtrace, each
    time a rank cannot reach the store yet; the rank's own line says what happened."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def rendezvous(seconds: float):
    """(store, rank, world size) of torch's env:// rendezvous, which gathers every rank at the store of
    MASTER_ADDR:MASTER_PORT (rank 0 hosts it unless torchrun's agent does), within `seconds`."""
    from datetime import timedelta

    import torch.distributed as dist

    with quiet_stderr():
        try:
            store, rank, world_size = next(dist.rendezvous("env://", timeout=timedelta(seconds=seconds)))
        except (dist.DistError, ValueError) as error:
            raise ConfigError(failure_line(error, seconds)) from None
    # Ranks the elastic agent started again after a failure meet at the same store as the dead ones did (a static
    # rendezvous keeps one for every attempt): each attempt's keys under a prefix of its own, or the new ranks
    # would read the dead ranks' addresses
    attempt = restart_count()
    return (store if attempt == 0 else dist.PrefixStore(f"minigpt/attempt_{attempt}/", store)), rank, world_size


def join_process_group(backend: str, device=None) -> None:
    """dist.init_process_group(backend, device_id=device) through env://, bounded by rendezvous_timeout_s() until
    every rank has met; from then on the group's own timeout (its collectives, its store) is torch's default.

    Under torchrun's agent the rendezvous returns at once (the agent's store is up before any rank starts) and the
    ranks first meet in init_process_group (gloo connects every pair, NCCL passes its id through the store), which
    waits for as long as the group's timeout: 30 minutes, for a rank of another node that ended before it joined (a
    flag refused there, a crash). So the group is made with the rendezvous's bound and given torch's default after."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

    check_torchrun_variables()
    seconds = rendezvous_timeout_s()
    if AGENT_VARIABLE not in os.environ:
        print(waiting_line(seconds), file=sys.stderr, flush=True)
    store, rank, world_size = rendezvous(seconds)
    group_timeout = default_pg_nccl_timeout if backend == "nccl" and default_pg_nccl_timeout else default_pg_timeout
    # NCCL_DEBUG's lines, when asked for, are printed as NCCL starts: only gloo's retry warnings are hidden
    with quiet_stderr() if backend == "gloo" else contextlib.nullcontext():
        try:
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, device_id=device,
                                    timeout=timedelta(seconds=seconds))
        except dist.DistError as error:
            raise ConfigError(failure_line(error, seconds)) from None
    store.set_timeout(group_timeout)
    dist.distributed_c10d._set_pg_timeout(group_timeout)
