"""One vocabulary of model flags: train, simulate and compare take the same names and build the same model."""

from __future__ import annotations

import json

from click.testing import CliRunner

from cli.compare import compare
from cli.main import main
from cli.model_options import model_from_options
from cli.simulate import simulate
from cli.train import train
from minigpt.config import PRESETS

MODEL_FLAGS = {"--model", "--layers", "--heads", "--kv-heads", "--d-model", "--d-ff", "--seq-len", "--vocab-size",
               "--untied", "--tied", "--mlp", "--norm", "--positions", "--rope-theta", "--bias", "--no-bias",
               "--dropout"}


def flags(command) -> set[str]:
    return {name for param in command.params for name in (*param.opts, *param.secondary_opts)}


def test_train_simulate_and_compare_take_the_same_model_flags():
    for command in (train, simulate, compare):
        assert MODEL_FLAGS <= flags(command), (command.name, MODEL_FLAGS - flags(command))


def test_the_flags_spell_out_a_preset():
    """tiny's shape made Llama-style flag by flag is the tiny-llama preset, and simulate prices them alike."""
    llama = ["--model", "tiny", "--kv-heads", "2", "--d-ff", "352", "--mlp", "swiglu", "--norm", "rmsnorm",
             "--positions", "rope", "--untied", "--no-bias"]
    options = dict(model="tiny", kv_heads=2, d_ff=352, mlp="swiglu", norm="rmsnorm", positions="rope", untied=True,
                   bias=False)
    assert model_from_options(options) == PRESETS["tiny-llama"]
    runs = [CliRunner().invoke(main, ["simulate", *args, "--gpu", "h100-sxm", "--json"])
            for args in (llama, ["--model", "tiny-llama"])]
    for run in runs:
        assert run.exit_code == 0, run.output
    spelled, preset = (json.loads(run.stdout) for run in runs)
    assert spelled["step_time_s"] == preset["step_time_s"] > 0
    assert spelled["memory_per_gpu"] == preset["memory_per_gpu"]
