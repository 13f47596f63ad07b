"""`minigpt simulate --sweep` of a mixture of experts with expert parallelism: --ep is kept at every point (as --cp
is), --expert-load and --ep-dispatcher reach every point, each point is the step `simulate` gives its layout alone
with the same flags, and an --ep that no point's layout can split its token-routing ranks by is one line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import main

MOE = ("--model", "mixtral-8x7b", "--layers", "4", "--gpu", "h100-sxm", "--global-batch", "64")


def invoke(*args: str):
    return CliRunner().invoke(main, ["simulate", *args])


def layout_flags(point: dict) -> list[str]:
    lay = point["layout"]
    return ["--tp", str(lay["tp"]), "--pp", str(lay["pp"]), "--dp", str(lay["dp"]), "--ep", str(lay["ep"]),
            "--zero", str(lay["zero"])]


def test_every_point_keeps_ep_and_equals_simulate_alone():
    flags = (*MOE, "--ep", "8", "--expert-load", "1.5", "--ep-dispatcher", "deepep")
    sweep = invoke(*flags, "--sweep", "--gpus", "16,32", "--json")
    assert sweep.exit_code == 0, sweep.output
    points = json.loads(sweep.output)["sweep"]["points"]
    assert [p["gpus"] for p in points] == [16, 32] and all(p["layout"]["ep"] == 8 for p in points)
    for point in points:
        single = invoke(*(f for f in flags if f != "--sweep"), *layout_flags(point), "--json")
        assert single.exit_code == 0, single.output
        alone = json.loads(single.output)
        assert alone["step_time_s"] == pytest.approx(point["step_time_s"], rel=1e-12)
        assert alone["provenance"]["experts"]["expert_load"] == 1.5
    table = invoke(*flags, "--sweep", "--gpus", "16,32").output
    assert "(ep 8)" in table


def test_the_expert_load_and_the_dispatcher_reach_the_points():
    # servers of 4: the expert group of 8 spans two, where a deduplicating dispatcher sends less over the NICs
    fixed = (*MOE, "--ep", "8", "--tp", "1", "--pp", "1", "--gpus-per-node", "4", "--sweep", "--gpus", "16,32", "--json")
    steps = {}
    for extra in ((), ("--expert-load", "2"), ("--ep-dispatcher", "deepep")):
        result = invoke(*fixed, *extra)
        assert result.exit_code == 0, result.output
        steps[extra] = [p["step_time_s"] for p in json.loads(result.output)["sweep"]["points"]]
    balanced = steps[()]
    assert all(busy > even for busy, even in zip(steps[("--expert-load", "2")], balanced))
    assert all(fewer < even for fewer, even in zip(steps[("--ep-dispatcher", "deepep")], balanced))


@pytest.mark.parametrize("args, says", [
    (("--ep", "8", "--sweep", "--gpus", "2,4"), "ep=8, which must divide the ranks routing distinct tokens"),
    (("--ep", "3", "--sweep", "--gpus", "8,16"), "does not divide the 8 experts"),
    (("--ep-dispatcher", "deepep", "--sweep", "--gpus", "8,16"), "--ep 1 has none"),
])
def test_an_ep_no_point_can_run_is_one_line(args, says):
    result = invoke(*MOE, *args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], result.output
