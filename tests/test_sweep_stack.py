"""`minigpt simulate --sweep` on a stack: --overlap, the flags that change how the stack computes (--attention,
--sp-saved-input, --fp8-recipe, --fp8-param-gather, --elementwise, --grad-reduce) and torchtitan's op recompute reach
every point, and each point is the step `simulate` gives its layout alone with the same flags."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import main


def invoke(*args: str):
    return CliRunner().invoke(main, ["simulate", *args, "--json"])


def layout_flags(point: dict) -> list[str]:
    lay = point["layout"]
    return ["--tp", str(lay["tp"]), "--pp", str(lay["pp"]), "--dp", str(lay["dp"]), "--zero", str(lay["zero"])]


@pytest.mark.parametrize("flags", [
    ("--model", "gpt2-124m", "--overlap", "megatron-core", "--attention", "unfused"),
    ("--model", "tiny", "--gpu", "h100-sxm", "--precision", "fp8", "--overlap", "megatron-core", "--zero", "1",
     "--fp8-recipe", "current", "--fp8-param-gather"),
    ("--model", "tiny-llama", "--gpu", "h100-sxm", "--overlap", "torchtitan-fsdp2", "--zero", "3", "--recompute", "op",
     "--grad-reduce", "compute"),
])
def test_every_point_runs_on_the_stack_asked_for_and_equals_simulate_alone(flags):
    sweep = invoke(*flags, "--sweep", "--gpus", "8,16", "--global-batch", "64")
    assert sweep.exit_code == 0, sweep.output
    data = json.loads(sweep.output)
    stack = flags[flags.index("--overlap") + 1]
    assert data["overlap"]["name"] == stack
    alone = json.loads(invoke(*flags, *layout_flags(data["sweep"]["points"][0]), "--global-batch", "64").output)
    assert data["implementation"] == alone["provenance"]["implementation"]
    for point in data["sweep"]["points"]:
        single = invoke(*flags, *layout_flags(point), "--global-batch", "64")
        assert single.exit_code == 0, single.output
        assert json.loads(single.output)["step_time_s"] == pytest.approx(point["step_time_s"], rel=1e-12)
    if "op" in flags:  # torchtitan's op policy is described without tensor parallelism: the sweep keeps tp 1
        assert all(p["layout"]["tp"] == 1 for p in data["sweep"]["points"])
        assert data["implementation"]["recompute"] == "op" and data["implementation"]["eager"] is True


def test_the_stack_changes_the_sweep_and_its_header_names_it():
    base = ("--model", "gpt2-124m", "--sweep", "--gpus", "8,16", "--global-batch", "64")
    steps = {stack: [p["step_time_s"] for p in json.loads(invoke(*base, "--overlap", stack).output)["sweep"]["points"]]
             for stack in ("executor", "megatron-core")}
    assert steps["executor"] != steps["megatron-core"]
    text = CliRunner().invoke(main, ["simulate", *base, "--overlap", "megatron-core"]).output
    assert text.splitlines()[0].endswith("overlap megatron-core")
