"""The launcher and the 3D mesh, on real gloo ranks.

Spawning costs seconds per rank, so each spawned group runs many checks and returns facts
that the test then asserts on: one 8-rank group, one 4-rank group, two 2-rank launches and
one torchrun run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from distributed import run_ranks
from minigpt.errors import ConfigError, TrainingError
from parallel.launch.elastic import (
    TORCHRUN_VARIABLES,
    describe_failure,
    finish_worker,
    in_torchrun,
    init_worker,
    launch,
)
from parallel.mesh import MESH_DIMS, build_mesh

TESTS_DIR = Path(__file__).resolve().parent
CPU = torch.device("cpu")


# ---- functions the ranks run (module level: the spawned ranks import them by name) ----


def mesh_facts(pp: int, dp: int, tp: int, cp: int = 1) -> dict:
    """Build the mesh, use every group once, and report what this rank saw."""
    mesh = build_mesh(pp, dp, tp, CPU, cp)
    data = mesh.data_group()
    facts = {
        "rank": mesh.rank,
        "dist_rank": dist.get_rank(),
        "coords": (mesh.pp_rank, mesh.dp_rank, mesh.cp_rank, mesh.tp_rank),
        "data_ranks": dist.get_process_group_ranks(data) if data is not None else None,
        "world": mesh.world_size,
        "first": mesh.is_first_stage,
        "last": mesh.is_last_stage,
        "prev": mesh.prev_stage_rank,
        "next": mesh.next_stage_rank,
    }
    for dim in MESH_DIMS:
        group = mesh.group(dim)
        total = torch.tensor([mesh.rank])
        if group is not None:
            dist.all_reduce(total, group=group)
        facts[dim] = {
            "ranks": mesh.ranks_of(dim),
            "sum": int(total),
            "group_ranks": dist.get_process_group_ranks(group) if group is not None else None,
        }
    # Activations flow forward: each stage hears from the stage before it, by global rank.
    if mesh.next_stage_rank is not None:
        dist.send(torch.tensor([mesh.rank]), dst=mesh.next_stage_rank)
    if mesh.prev_stage_rank is not None:
        received = torch.tensor([-1])
        dist.recv(received, src=mesh.prev_stage_rank)
        facts["received_from_prev"] = int(received)
    try:
        build_mesh(pp, dp, tp * 2, CPU, cp)
    except ConfigError as error:
        facts["wrong_layout"] = str(error)
    return facts


def rank_report(tag: str) -> dict:
    """An entrypoint that runs unchanged under launch() and under torchrun."""
    device = init_worker("cpu")
    try:
        total = torch.tensor([dist.get_rank()])
        dist.all_reduce(total)
        return {
            "tag": tag,
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            "rank_sum": int(total),
            "device": str(device),
            "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "pid": os.getpid(),
        }
    finally:
        finish_worker()


def fail_on_rank_1(message: str) -> int:
    """Rank 1 raises while rank 0 waits for it in a collective."""
    init_worker("cpu")
    try:
        if dist.get_rank() == 1:
            raise ValueError(message)
        dist.barrier()
        return 0
    finally:
        finish_worker()


def add_one(value: int) -> int:
    return value + 1


def current_pid(_: object) -> int:
    return os.getpid()


# ---- tests ----


def check_rank_formula(facts: list[dict], pp: int, dp: int, tp: int, cp: int = 1) -> None:
    world = pp * dp * cp * tp
    assert [f["rank"] for f in facts] == list(range(world))
    assert len({f["coords"] for f in facts}) == world
    for f in facts:
        pp_rank, dp_rank, cp_rank, tp_rank = f["coords"]
        assert f["rank"] == f["dist_rank"] == ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
        assert f["world"] == world
        for dim, size in zip(MESH_DIMS, (pp, dp, cp, tp)):
            ranks = f[dim]["ranks"]
            assert len(ranks) == size and f["rank"] in ranks
            assert f[dim]["sum"] == sum(ranks), (dim, f)
            if size > 1:
                assert sorted(f[dim]["group_ranks"]) == ranks
            else:
                assert f[dim]["group_ranks"] is None  # no group, no collective
        cp_part = f" x cp {cp}" if cp > 1 else ""
        assert f["wrong_layout"] == (
            f"the layout pp {pp} x dp {dp}{cp_part} x tp {tp * 2} needs {world * 2} ranks "
            f"but {world} are running: change the layout or the launch"
        )


def test_mesh_on_8_ranks():
    facts = run_ranks(8, mesh_facts, 2, 2, 2)
    check_rank_formula(facts, 2, 2, 2)
    for f in facts:
        rank = f["rank"]
        base = rank - rank % 2
        assert f["tp"]["ranks"] == [base, base + 1]  # tensor parallel: adjacent ranks
        stage_base = rank - rank % 4
        assert f["dp"]["ranks"] == [stage_base + rank % 2, stage_base + rank % 2 + 2]
        assert f["pp"]["ranks"] == [rank % 4, rank % 4 + 4]
        first = rank < 4
        assert (f["first"], f["last"]) == (first, not first)
        assert f["prev"] == (None if first else rank - 4)
        assert f["next"] == (rank + 4 if first else None)
        assert f.get("received_from_prev") == f["prev"]


def test_mesh_with_context_parallelism_on_8_ranks():
    """dp 2 x cp 2 x tp 2: cp sits between dp and tp, and gradients are averaged over the dp x cp group."""
    facts = run_ranks(8, mesh_facts, 1, 2, 2, 2)
    check_rank_formula(facts, 1, 2, 2, 2)
    for f in facts:
        rank = f["rank"]
        assert f["tp"]["ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert f["cp"]["ranks"] == [rank % 2 + rank // 4 * 4, rank % 2 + rank // 4 * 4 + 2]
        assert f["dp"]["ranks"] == [rank % 4, rank % 4 + 4]
        assert f["data_ranks"] == [rank % 2 + offset for offset in (0, 2, 4, 6)]  # every (dp, cp) at this tp rank


def test_mesh_on_4_ranks_is_pure_data_parallel():
    facts = run_ranks(4, mesh_facts, 1, 4, 1)
    check_rank_formula(facts, 1, 4, 1)
    for f in facts:
        assert f["dp"]["ranks"] == [0, 1, 2, 3] and f["dp"]["sum"] == 6
        assert f["first"] and f["last"] and f["prev"] is None and f["next"] is None


def test_trivial_mesh_has_no_process_group():
    mesh = build_mesh(1, 1, 1, CPU)
    assert not dist.is_initialized() and mesh.device_mesh is None
    assert (mesh.world_size, mesh.rank, mesh.pp_rank, mesh.dp_rank, mesh.tp_rank) == (1, 0, 0, 0, 0)
    for dim in MESH_DIMS:
        assert mesh.group(dim) is None and mesh.ranks_of(dim) == [0]
    assert mesh.is_first_stage and mesh.is_last_stage
    assert mesh.prev_stage_rank is None and mesh.next_stage_rank is None
    with pytest.raises(ConfigError, match="mesh dimension must be one of pp, dp, cp, tp"):
        mesh.group("ep")
    with pytest.raises(ConfigError, match="needs 2 ranks but 1 are running: start it through"):
        build_mesh(1, 2, 1, CPU)
    with pytest.raises(ConfigError, match="tp size must be a positive integer"):
        build_mesh(1, 1, 0, CPU)


def test_launch_returns_rank_0_value():
    result = launch(rank_report, "spawned", 2, threads_per_rank=1)
    assert result["tag"] == "spawned" and result["rank"] == 0 and result["world"] == 2
    assert result["rank_sum"] == 1 and result["device"] == "cpu"
    assert result["threads"] == 1 and result["omp"] == "1"
    assert result["pid"] != os.getpid()
    assert multiprocessing.active_children() == []


def test_a_rendezvous_port_taken_before_the_store_binds_it_is_tried_again(monkeypatch):
    """The launch probes a free port for elastic's static rendezvous (parallel/launch/elastic.py); another process may
    take it before the agent's store listens on it: the launch then moves to another port."""
    import parallel.launch.elastic

    with socket.socket() as taken:
        taken.bind((parallel.launch.elastic.LOCAL_HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        offered, free_port = [], parallel.launch.elastic.local_rendezvous

        def first_the_taken_port() -> dict:
            rendezvous = free_port() if offered else {"rdzv_backend": "static", "rdzv_configs": {"rank": 0},
                                                      "rdzv_endpoint": f"{parallel.launch.elastic.LOCAL_HOST}:{port}"}
            offered.append(rendezvous["rdzv_endpoint"])
            return rendezvous

        monkeypatch.setattr(parallel.launch.elastic, "local_rendezvous", first_the_taken_port)
        result = launch(rank_report, "moved", 2, threads_per_rank=1)
    assert result["tag"] == "moved" and result["world"] == 2
    assert len(offered) == 2 and offered[0].endswith(f":{port}") and offered[1] != offered[0], offered


def test_failed_rank_is_one_line_naming_it():
    with pytest.raises(TrainingError) as caught:
        launch(fail_on_rank_1, "the data shard is empty", 2)
    message = str(caught.value)
    assert "\n" not in message
    # Rank 0 may die too, of the closed connection; the root cause must still be rank 1's.
    assert re.fullmatch(r"(rank 1 of 2 failed|ranks 0, 1 of 2 failed; the cause, rank 1): "
                        r"ValueError: the data shard is empty", message), message
    assert multiprocessing.active_children() == []  # the waiting rank 0 is gone too


def test_a_killed_rank_is_reported_by_its_signal(tmp_path):
    killed = ProcessFailure(local_rank=1, pid=1234, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none"))
    error = ChildFailedError(name="run_with_threads", failures={1: killed})
    assert describe_failure(error, str(tmp_path), 4) == "rank 1 of 4 failed: killed by SIGKILL"


def record_like_a_rank(path: Path, exception: Exception, written_ns: int, monkeypatch) -> None:
    """Write path the way elastic's record() wrapper does in a rank that raises."""
    path.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise exception
    except Exception as error:
        ErrorHandler().record_exception(error)
    os.utime(path, ns=(written_ns, written_ns))


def test_root_cause_is_the_error_recorded_first(tmp_path, monkeypatch, capsys):
    attempt = tmp_path / "run_abc" / "attempt_0"
    record_like_a_rank(attempt / "1" / "error.json", ValueError("bad\nbatch"), 10**18, monkeypatch)
    record_like_a_rank(attempt / "0" / "error.json", RuntimeError("Connection closed by peer"), 2 * 10**18, monkeypatch)
    # Elastic noticed rank 0 first, the peer that died of rank 1's failure.
    noticed = ProcessFailure(local_rank=0, pid=1234, exitcode=1, error_file=str(attempt / "0" / "error.json"))
    error = ChildFailedError(name="run_with_threads", failures={0: noticed})
    message = describe_failure(error, str(tmp_path), 2)
    assert message == "ranks 0, 1 of 2 failed; the cause, rank 1: ValueError: bad batch"
    printed = capsys.readouterr().err
    assert "rank 1's traceback" in printed and "ValueError: bad\nbatch" in printed


def test_single_rank_runs_in_this_process(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not in_torchrun()
    assert launch(add_one, 1, 1) == 2
    assert launch(current_pid, None, 1) == os.getpid()
    assert run_ranks(1, add_one, 41) == [42]
    assert init_worker("cpu") == CPU and not dist.is_initialized()
    assert init_worker().type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="world size must be a positive integer"):
        launch(add_one, 1, 0)
    with pytest.raises(ConfigError, match="threads per rank must be a positive integer"):
        launch(add_one, 1, 2, threads_per_rank=0)


def test_launch_under_torchrun_checks_its_world_size(monkeypatch):
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert in_torchrun()
    with pytest.raises(ConfigError, match="torchrun started 4 processes but the layout tp x cp x pp x dp needs 8"):
        launch(add_one, 1, 8)
    assert launch(add_one, 1, 4) == 2  # the ranks exist already: call the entrypoint here


def test_same_entrypoint_runs_under_torchrun(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {str(TESTS_DIR)!r})\n"
        "from test_launch_mesh import rank_report\n"
        "from parallel.launch.elastic import launch\n"
        "if __name__ == '__main__':\n"
        "    result = launch(rank_report, 'torchrun', 2)\n"
        "    if result['rank'] == 0:\n"
        "        print('RESULT', json.dumps(result), flush=True)\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--log-dir", str(tmp_path / "logs"), str(script)]  # not another /tmp/torchelastic_*
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in TORCHRUN_VARIABLES:
        env.pop(name, None)
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, done.stdout
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["tag"] == "torchrun" and result["rank"] == 0 and result["world"] == 2 and result["rank_sum"] == 1
