"""Past one machine, on torch's own launcher: two torchrun agents on this computer stand in for two servers of two
ranks each, started with README's "Across machines" line as written. Tensor parallelism stays inside each server,
data parallelism crosses them, rank 0 alone claims the run directory and reports, the ranks of both write every
checkpoint, and the run gives one process's losses; one agent killed mid-run (its process group: its ranks live in
sessions of their own) ends the other within a minute, and both started again with --resume give the losses of the
run never stopped. Under --watchdog a frozen rank ends every node. The quick checks: tp's groups against
torchrun's numbering, ranks under an agent whose peers never come, the peer watch's verdicts, a rank whose agent
is gone, a rank other than 0 refusing a directory as rank 0 would, and the SLURM script's torchrun lines."""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from minigpt.errors import ConfigError
from parallel.launch.peer_watch import DONE, PeerWatch, lost_peer_line
from parallel.launch.rank_start import TORCHRUN_VARIABLES
from parallel.launch.torchrun_env import (
    AGENT_VARIABLE, TIMEOUT_VARIABLE, join_process_group, tensor_parallel_across_nodes,
)
from parallel.launch.watchdog import STARTUP_GRACE_S, running
from parallel.mesh import global_rank

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).parent / "torchrun"
README_MARKER = "<!-- torchrun nodes example"
AGENT_S = 300  # one agent's whole run: importing torch, two ranks, 20 steps, on two busy cores
ENDS_WITHIN_S = 60  # the other agent, once one is killed or a rank frozen
STEPS = 20


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def readme_line() -> list[str]:
    """The torchrun line of README's "Across machines" example, as words."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = text[text.index(README_MARKER):].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def with_value(words: list[str], flag: str, value: str) -> list[str]:
    index = words.index(flag)
    return [*words[: index + 1], value, *words[index + 2:]]


def clean_environment() -> dict[str, str]:
    """This process's environment without any launcher's variables (a test run under torchrun keeps none)."""
    env = {name: value for name, value in os.environ.items()
           if name not in TORCHRUN_VARIABLES and not name.startswith(("TORCHELASTIC_", "MINIGPT_"))}
    for name in ("GROUP_RANK", "LOCAL_WORLD_SIZE", "ROLE_RANK", "GROUP_WORLD_SIZE"):
        env.pop(name, None)
    return env


def child_ranks(agent: int) -> dict[int, int]:
    """{global rank: pid} of the ranks an agent started (its children, RANK from their environment)."""
    found = {}
    for task in Path(f"/proc/{agent}/task").iterdir():
        for child in (task / "children").read_text().split():
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            rank = [entry[5:] for entry in environ if entry.startswith(b"RANK=")]
            if rank:
                found[int(rank[0])] = int(child)
    return found


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g} s"
        time.sleep(0.02)


class Agents:
    """Two torchrun agents running README's line, each in a session of its own (a server's stand-in). The first is
    started alone until it listens at the endpoint, so it hosts the agents' rendezvous store (the one whose end
    the other's agent notices by itself): killing the second tests what the ranks do."""

    def __init__(self, logs: Path, out: Path, *extra: str):
        logs.mkdir(parents=True, exist_ok=True)
        self.logs, self.port = logs, free_port()
        words = with_value(with_value(readme_line(), "--rdzv-endpoint", f"localhost:{self.port}"),
                           "--rdzv-id", f"nodes-{self.port}")
        self.command = [str(TORCHRUN), *with_value(words, "--out", str(out))[1:], *extra]
        self.agents: list[subprocess.Popen] = []
        self.ranks: dict[int, int] = {}
        for node in range(2):
            with open(logs / f"agent{node}.out", "w") as stdout, open(logs / f"agent{node}.err", "w") as stderr:
                self.agents.append(subprocess.Popen(self.command, cwd=REPO, env=clean_environment(), stdout=stdout,
                                                    stderr=stderr, start_new_session=True))
            if node == 0:
                wait_for(self.listening, 60, "the first agent's rendezvous store")

    def listening(self) -> bool:
        assert self.agents[0].poll() is None, self.stderr(0)
        with socket.socket() as client:
            return client.connect_ex(("127.0.0.1", self.port)) == 0

    def note_ranks(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                self.ranks.update(child_ranks(agent.pid))

    def wait(self, seconds: float) -> list[int]:
        deadline = time.monotonic() + seconds
        return [agent.wait(timeout=max(1.0, deadline - time.monotonic())) for agent in self.agents]

    def stdout(self, node: int) -> str:
        return (self.logs / f"agent{node}.out").read_text()

    def stderr(self, node: int) -> str:
        return (self.logs / f"agent{node}.err").read_text()

    def __enter__(self) -> "Agents":
        return self

    def __exit__(self, *exc) -> None:
        """Nothing outlives a test: the agents' groups and every rank seen (a stopped one too) get SIGKILL."""
        for pid in [agent.pid for agent in self.agents if agent.poll() is None]:
            os.killpg(pid, signal.SIGKILL)
        for pid in self.ranks.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for agent in self.agents:
            agent.wait(timeout=30)


def summary_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[float]:
    """The README line's run in one process: its train flags without --tp and --dp, same global batch and seed."""
    words = readme_line()
    train = words[words.index("train") + 1:]
    for flag in ("--tp", "--dp"):
        index = train.index(flag)
        del train[index: index + 2]
    out = tmp_path_factory.mktemp("one") / "run"
    done = subprocess.run([sys.executable, "-m", "cli", "train", *with_value(train, "--out", str(out))], cwd=REPO,
                          env=clean_environment(), capture_output=True, text=True, timeout=AGENT_S)
    assert done.returncode == 0, done.stderr
    losses = summary_of(out)["losses"]
    assert len(losses) == STEPS
    return losses


def assert_close(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference)
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 1e-5, (losses, reference)


@pytest.mark.slow
def test_two_agents_train_as_one_process(tmp_path, one_process):
    out = tmp_path / "run"
    with Agents(tmp_path / "logs", out) as agents:
        codes = agents.wait(AGENT_S)
    assert codes == [0, 0], agents.stderr(0) + agents.stderr(1)
    summary = summary_of(out)
    assert_close(summary["losses"], one_process)
    # torchrun's numbering: RANK = node x 2 + local rank; tp innermost keeps each tp pair on one node, dp crosses
    placement = summary["placement"]
    assert [(p["node"], p["local_rank"]) for p in placement] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    tp_groups = [[global_rank(0, d, t, 2, 2) for t in range(2)] for d in range(2)]
    dp_groups = [[global_rank(0, d, t, 2, 2) for d in range(2)] for t in range(2)]
    assert all(len({placement[r]["node"] for r in group}) == 1 for group in tp_groups)
    assert all(len({placement[r]["node"] for r in group}) == 2 for group in dp_groups)
    # every checkpoint holds a shard of each rank, the two of the other node's too
    for step in range(5, STEPS + 1, 5):
        saved = out / "checkpoints" / f"step-{step:06d}"
        assert (saved / "COMPLETE").is_file()
        assert sorted(p.name for p in saved.glob("*.distcp")) == [f"__{rank}_0.distcp" for rank in range(4)]
    # rank 0 alone reports, and owns the directory's lock
    printed = agents.stdout(0) + agents.stdout(1)
    assert printed.count("layout: tp 2 x pp 1 x dp 2 = 4 processes") == 1
    assert printed.count(f"step {STEPS - 1:>5}") == 1
    assert (out / "run.lock").is_file()
    assert not list(out.glob(".minigpt-probe-*"))


@pytest.mark.slow
def test_a_run_resumes_exactly_after_an_agent_is_killed(tmp_path, one_process):
    out = tmp_path / "run"
    saved = out / "checkpoints" / "step-000010" / "COMPLETE"
    with Agents(tmp_path / "first", out) as agents:
        wait_for(lambda: saved.exists() or any(a.poll() is not None for a in agents.agents), AGENT_S,
                 "the checkpoint at step 10")
        assert all(a.poll() is None for a in agents.agents), "the run ended before the kill: nothing was tested"
        agents.note_ranks()
        orphans = list(child_ranks(agents.agents[1].pid).values())
        os.killpg(agents.agents[1].pid, signal.SIGKILL)  # the agent alone: its ranks are in sessions of their own
        killed = time.monotonic()
        assert agents.agents[0].wait(timeout=2 * ENDS_WITHIN_S) != 0
        assert time.monotonic() - killed < ENDS_WITHIN_S
        wait_for(lambda: not any(running(pid) for pid in orphans), 20, "the killed agent's ranks ending")
        assert "its torchrun agent (process" in agents.stderr(1)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 10 <= len(metrics) < STEPS  # killed mid-run, after the checkpoint at step 10

    with Agents(tmp_path / "again", out, "--resume") as agents:
        codes = agents.wait(AGENT_S)
    assert codes == [0, 0], agents.stderr(0) + agents.stderr(1)
    summary = summary_of(out)
    first = summary["first_step"]
    assert first in (10, 15)  # the newest complete checkpoint when the agent was killed
    assert f"resuming {out}/checkpoints/step-{first:06d} at step {first} of {STEPS}" in agents.stdout(0) + agents.stdout(1)
    assert_close(summary["losses"], one_process[first:])


@pytest.mark.slow
def test_a_frozen_rank_ends_every_node_under_the_watchdog(tmp_path):
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    with Agents(tmp_path / "logs", out, "--steps", "200", "--watchdog", "5") as agents:
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, AGENT_S, "two steps")
        agents.note_ranks()
        frozen = max(child_ranks(agents.agents[1].pid))  # the second node's last rank
        os.kill(agents.ranks[frozen], signal.SIGSTOP)
        stopped = time.monotonic()
        codes = agents.wait(2 * ENDS_WITHIN_S)
        assert time.monotonic() - stopped < ENDS_WITHIN_S
        assert codes[0] != 0 and codes[1] != 0
        said = agents.stderr(0) + agents.stderr(1)
    assert f"rank {frozen} of 4 stopped responding: no heartbeat for" in said
    assert "(the watchdog allows 5 s, --watchdog)" in said
    assert len((out / "metrics.jsonl").read_text().splitlines()) < 200


@pytest.mark.parametrize("local", [1, 2, 4, 8])
def test_tensor_parallel_groups_stay_inside_a_node_when_tp_divides_it(monkeypatch, local):
    """With torchrun's numbering and tp innermost, tp's groups are inside a node exactly when tp divides the node's
    ranks; otherwise a warning (the run is correct, only slower)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    for tp in (1, 2, 4, 8):
        for pp, dp in ((1, 2), (2, 1), (2, 2)):
            world = pp * dp * tp
            if world % local:
                continue
            groups = [[global_rank(p, d, t, dp, tp) for t in range(tp)] for p in range(pp) for d in range(dp)]
            inside = all(len({rank // local for rank in group}) == 1 for group in groups)
            assert inside == (local % tp == 0), (local, tp, pp, dp)
            warning = tensor_parallel_across_nodes(tp)
            assert (warning is None) == inside
            if warning is not None:
                assert warning.startswith(f"--tp {tp} does not divide the {local} ranks of a node")


def test_ranks_under_torchruns_agent_whose_peers_never_come_give_up_in_time(monkeypatch, capfd):
    """Under the agent the rendezvous returns at once (its store is up); the ranks meet in init_process_group, which
    waited the group's 30 minutes for a node whose ranks had ended: now MINIGPT_RENDEZVOUS_TIMEOUT bounds it."""
    agents_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    environment = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(agents_store.port), TIMEOUT_VARIABLE: "2", AGENT_VARIABLE: "a-run",
                   "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        join_process_group("gloo")
    assert time.monotonic() - start < 30
    assert not dist.is_initialized()
    assert str(caught.value) == (
        f"rank 0 of WORLD_SIZE 2 waited 2 s for the other ranks at MASTER_ADDR:MASTER_PORT 127.0.0.1:"
        f"{agents_store.port} and they never came: a rank of another node ended before it joined, and that node's "
        f"output says why (MINIGPT_RENDEZVOUS_TIMEOUT sets how long a rank waits)")
    assert capfd.readouterr().err == ""  # no waiting line under the agent, and c10d's retry warnings hidden


def test_the_peer_watch_judges_the_next_rank_and_every_rank_follows_its_verdict():
    store = dist.HashStore()
    watches = [PeerWatch(store, rank, 2, 5.0, now=0.0) for rank in range(2)]
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as sleeper:
        store.set(watches[0].key(1) + "/process", f"{socket.gethostname()} {sleeper.pid}")  # rank 1's process
        assert watches[1].beat(1.0) is None and watches[0].beat(1.0) is None
        assert watches[1].beat(2.0) is None and watches[0].beat(2.0) is None  # rank 1's count moved at 2 s
        assert watches[0].beat(6.9) is None  # rank 1 silent 4.9 s: allowed
        verdict, mine = watches[0].beat(7.5)
        assert mine and verdict.startswith("rank 1 of 2 stopped responding: no heartbeat for 6 s "
                                           "(the watchdog allows 5 s, --watchdog)")
        assert sleeper.wait(timeout=10) == -signal.SIGKILL  # killed where it runs: on this host
    assert watches[1].beat(8.0) == (verdict, False)  # every other rank reads the stop key at its next beat

    store = dist.HashStore()
    first, second = (PeerWatch(store, rank, 2, 5.0, now=0.0) for rank in range(2))
    assert first.beat(STARTUP_GRACE_S + 4.0) is None  # never beaten yet: the startup grace on top
    second.finish()  # done is not silent
    assert int(store.add(second.key(1), 0)) >= DONE and first.beat(1000.0) is None


def test_a_rank_whose_agent_is_gone_leaves(tmp_path):
    """torchrun starts each rank in a session of its own: a SIGKILL to the agent's group leaves them running, unless
    each watches its agent."""
    rank_code = ("from parallel.launch.peer_watch import RankWatch\nimport time\nRankWatch(0)\ntime.sleep(60)\n")
    agent_code = ("import subprocess, sys, time\n"
                  f"rank = subprocess.Popen([sys.executable, '-c', {rank_code!r}], stderr=open({str(tmp_path / 'rank.err')!r}, 'w'))\n"
                  "print(rank.pid, flush=True)\ntime.sleep(60)\n")
    environment = {**clean_environment(), "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), AGENT_VARIABLE: "a-run",
                   "PYTHONPATH": str(REPO)}
    agent = subprocess.Popen([sys.executable, "-c", agent_code], env=environment, stdout=subprocess.PIPE, text=True)
    try:
        rank = int(agent.stdout.readline())
        time.sleep(1.5)  # its watch is running
        assert running(rank)
    finally:
        agent.kill()
        agent.wait(timeout=10)
    wait_for(lambda: not running(rank), 10, "the orphaned rank leaving")
    assert (tmp_path / "rank.err").read_text() == (
        f"minigpt: error: rank 1 of 2: its torchrun agent (process {agent.pid}) is gone, so it leaves too; the run's "
        f"checkpoints so far are kept (--resume continues)\n")


def test_a_rank_but_0_refuses_the_run_directory_as_rank_0_would(tmp_path):
    """Every node's ranks check --out alike, so a refused one ends every node at once, not after a wait for rank 0;
    they do not lock it (rank 0 does), and an earlier run's files stay."""
    earlier = tmp_path / "run"
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text("an earlier run's")
    environment = {**clean_environment(), "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), AGENT_VARIABLE: "a-run"}
    done = subprocess.run([sys.executable, "-m", "cli", "train", "--tp", "2", "--dp", "2", "--steps", "2",
                           "--out", str(earlier)], cwd=REPO, env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"minigpt: error: --out {str(earlier)!r} is not empty (metrics.jsonl): continue that run with --resume, "
        f"clear it with --overwrite, or pick a new --out"]
    assert sorted(p.name for p in earlier.iterdir()) == ["metrics.jsonl"]


def test_a_rank_but_0_checks_without_taking_the_lock(tmp_path):
    from parallel.run.directory import LOCK_FILE, RunClaim

    out = tmp_path / "run"
    out.mkdir()
    held = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # rank 0's claim, made first
    try:
        (out / ".minigpt-probe-another-rank").mkdir()  # another rank's check, under way
        assert RunClaim(out, resume=False, overwrite=False, lock=False).lock is None
        with pytest.raises(ConfigError, match="is in use by another minigpt run"):
            RunClaim(out, resume=False, overwrite=False)
    finally:
        os.close(held)


@pytest.mark.parametrize("message, line", [
    ("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:36745. "
     "This is typically caused by a remote worker crashing.", "Connection closed by peer [127.0.0.1]:36745"),
    ("[pair.cc:537] Read error [127.0.0.1]:2471: Connection reset by peer. This is typically", "Connection reset by peer"),
    ("the data shard is empty", None),
])
def test_a_collective_broken_by_a_peers_end_is_one_line(monkeypatch, message, line):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    said = lost_peer_line(RuntimeError(message))
    if line is None:
        assert said is None
    else:
        assert said == (f"rank 1 of 4 lost a peer rank ({line}): the output of the node whose ranks ended first says "
                        f"why; the run's checkpoints so far are kept (--resume continues)")


def test_the_slurm_script_starts_one_torchrun_per_node_meeting_at_the_first(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames node-[a-b]" ] && printf "node-a\\nnode-b\\n"\n')
    (fake / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "srun.args"}\n')
    for tool in ("scontrol", "srun"):
        (fake / tool).chmod(0o755)
    out = tmp_path / "run"
    environment = {**clean_environment(), "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[a-b]",
                   "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "minigpt", "GPUS_PER_NODE": "2",
                   "OUT": str(out)}

    def srun_words() -> list[str]:
        done = subprocess.run(["bash", str(REPO / "docs" / "slurm" / "train.sbatch"), "--tp", "2", "--steps", "20"],
                              env=environment, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return (tmp_path / "srun.args").read_text().splitlines()

    torchrun = ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", "node-a:29500", "--rdzv-id", "77", "-m", "cli", "train", "--out", str(out)]
    srun = ["--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    assert srun_words() == [*srun, *torchrun, "--tp", "2", "--steps", "20"]
    (out / "checkpoints").mkdir(parents=True)  # requeued: on from the newest checkpoint
    assert srun_words() == [*srun, *torchrun, "--resume", "--tp", "2", "--steps", "20"]
    # the README's line has the same torchrun flags, in the same order
    readme = readme_line()
    assert [w for w in readme if w.startswith("-")][:6] == [w for w in torchrun if w.startswith("-")][:6]
