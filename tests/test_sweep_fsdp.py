"""`minigpt simulate --sweep` with FSDP's settings: --no-reshard-after-forward, --sync-grads-once and --shard-group
are kept at every point (a point whose data ranks the shard group does not divide is left out), torchtitan's stack
keeps pipelined ZeRO-3 units unless told, each point is the step `simulate` gives its layout alone with the same
flags, the ZeRO comparison puts the settings on ZeRO-3 only, and what cannot run is one line and exit code 2."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import main

JOB = ("--model", "tiny", "--gpu", "h100-sxm", "--global-batch", "64", "--zero", "3")


def invoke(*args: str):
    return CliRunner().invoke(main, ["simulate", *args])


def sweep_points(*flags: str) -> list[dict]:
    result = invoke(*JOB, *flags, "--sweep", "--gpus", "8,16,32", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["sweep"]["points"]


def alone(point: dict, *flags: str) -> float:
    lay = point["layout"]
    result = invoke(*JOB, *flags, "--tp", str(lay["tp"]), "--pp", str(lay["pp"]), "--dp", str(lay["dp"]), "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["step_time_s"]


@pytest.mark.parametrize("settings, fixed", [
    (("--no-reshard-after-forward", "--sync-grads-once", "--shard-group", "4"), ()),
    (("--no-reshard-after-forward",), ("--pp", "2")),
    (("--shard-group", "8"), ("--tp", "1")),
])
def test_every_point_keeps_the_settings_and_equals_simulate_alone(settings, fixed):
    points = sweep_points(*settings, *fixed)
    group = int(settings[-1]) if "--shard-group" in settings else 0
    for point in points:
        lay = point["layout"]
        assert lay["reshard_after_forward"] == ("--no-reshard-after-forward" not in settings)
        assert lay["sync_grads_once"] == ("--sync-grads-once" in settings) and lay["shard_group"] == group
        assert (lay["dp"] * lay["cp"]) % max(group, 1) == 0
        assert alone(point, *settings) == pytest.approx(point["step_time_s"], rel=1e-12)
    plain = sweep_points(*fixed)
    assert [p["step_time_s"] for p in plain] != [p["step_time_s"] for p in points]  # the settings reach the steps


def test_a_shard_group_that_divides_no_point_is_one_line():
    result = invoke(*JOB, "--shard-group", "3", "--sweep", "--gpus", "8,16")
    assert result.exit_code == 2 and "--shard-group 3, which must divide the data ranks" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_torchtitans_stack_keeps_pipelined_units_unless_told():
    """Under --overlap torchtitan-fsdp2 a pipelined point keeps its ZeRO-3 units (torchtitan's default), one without
    pipelining reshards; --reshard-after-forward asks for it everywhere."""
    points = sweep_points("--overlap", "torchtitan-fsdp2")
    assert {p["layout"]["pp"] > 1 for p in points} == {True, False}
    assert all(p["layout"]["reshard_after_forward"] == (p["layout"]["pp"] == 1) for p in points)
    told = sweep_points("--overlap", "torchtitan-fsdp2", "--reshard-after-forward")
    assert all(p["layout"]["reshard_after_forward"] for p in told)
    table = invoke(*JOB, "--overlap", "torchtitan-fsdp2", "--sweep", "--gpus", "8,16,32").output
    assert "ZeRO-3 without resharding after the forward at" in table


def test_the_zero_comparison_puts_the_settings_on_zero3_only():
    result = invoke(*JOB, "--no-reshard-after-forward", "--sync-grads-once", "--sweep", "--gpus", "8,16", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    kept, stages = data["sweep"]["points"][-1], data["zero_comparison"]["stages"]
    assert set(stages) == {"0", "1", "2", "3"}
    assert stages["3"]["step_time_s"] == pytest.approx(kept["step_time_s"], rel=1e-12)
    assert stages["3"]["layout"]["sync_grads_once"] and not stages["1"]["layout"]["sync_grads_once"]


@pytest.mark.parametrize("args, says", [
    (("--zero", "1", "--no-reshard-after-forward"), "needs --zero 3"),
    (("--sync-grads-once",), "needs --zero 3 --no-reshard-after-forward"),
    (("--zero", "0", "--shard-group", "2"), "ZeRO-0 shards nothing"),
])
def test_what_cannot_run_is_one_line_and_exit_code_2(args, says):
    result = invoke(*JOB, *args, "--sweep", "--gpus", "8,16")
    assert result.exit_code == 2, result.output
    assert says in result.output and len(result.output.strip().splitlines()) == 1
