"""One vocabulary of flags: train, simulate and compare take the same model, layout and batch flag names
(and build the same model from them), and one TOML file serves them all."""

from __future__ import annotations

import json

from click.testing import CliRunner

from cli.commands.compare import compare
from cli.main import main
from cli.options.model import model_from_options
from cli.commands.simulate import simulate
from cli.commands.train import train
from minigpt.presets import PRESETS

MODEL_FLAGS = {"--model", "--layers", "--heads", "--kv-heads", "--d-model", "--d-ff", "--seq-len", "--vocab-size",
               "--untied", "--tied", "--mlp", "--norm", "--positions", "--rope-theta", "--bias", "--no-bias",
               "--dropout"}


LAYOUT_AND_BATCH_FLAGS = {"--tp", "--pp", "--dp", "--zero", "--schedule", "--virtual-chunks", "--sequence-parallel",
                          "--global-batch", "--batch-size", "--micro-batches", "--micro-batch-size", "--micro-batch",
                          "--precision", "--recompute", "--config", "--json"}


def flags(command) -> set[str]:
    return {name for param in command.params for name in (*param.opts, *param.secondary_opts)}


def test_train_simulate_and_compare_take_the_same_model_flags():
    for command in (train, simulate, compare):
        assert MODEL_FLAGS <= flags(command), (command.name, MODEL_FLAGS - flags(command))
        missing = LAYOUT_AND_BATCH_FLAGS - flags(command)
        assert not missing, (command.name, missing)


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


def test_one_toml_file_serves_every_command(tmp_path):
    """Top-level keys go to each command that takes them (the others' are skipped and named once); a table
    named after a command gives it its own values; a key no command takes is refused in one line."""
    from minigpt.presets import preset

    path = tmp_path / "job.toml"
    path.write_text('model = "tiny-llama"\ntp = 2\nglobal-batch = 8\nsteps = 3\nlr = 0.001\n'
                    '[simulate]\ngpu = "h100-sxm"\nmicro-batch-size = 2\n')
    result = CliRunner().invoke(main, ["simulate", "--config", str(path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["layout"]["tp"], report["global_batch"], report["micro_batch"]) == (2, 8, 2)
    assert report["gpu"] == "h100-sxm"
    assert result.stderr.count("\n") == 1 and "steps, lr" in result.stderr and "skipped" in result.stderr
    from cli.commands.train import build_train_config, train as train_command

    parent = main.make_context("minigpt", ["train"], resilient_parsing=True)  # the group, as the console script
    ctx = train_command.make_context("train", ["--config", str(path), "--out", str(tmp_path / "run")], parent=parent)
    cfg = build_train_config(ctx.params)
    assert (cfg.model, cfg.tp, cfg.global_batch, cfg.steps, cfg.lr) == (preset("tiny-llama"), 2, 8, 3, 0.001)
    path.write_text("tp = 2\nlearning-rate = 0.1\n")
    refused = CliRunner().invoke(main, ["simulate", "--config", str(path)])
    assert refused.exit_code == 2 and "unknown or non-scalar key 'learning-rate'" in refused.stderr


def test_a_run_that_cannot_fit_in_ram_is_refused_before_it_starts():
    """The simulator's memory model, summed over the ranks, against the RAM available (cli/tools/memory_check.py)."""
    import pytest

    from cli.tools.memory_check import BUILD_BYTES_PER_PARAM, PROCESS_BYTES, check_cpu_memory, predicted_rank_bytes
    from job.train_config import TrainConfig
    from minigpt.errors import ConfigError

    cfg = TrainConfig(dp=2, zero=1, global_batch=8)
    needed = check_cpu_memory(cfg, available=2**40)
    assert needed == 2 * sum(predicted_rank_bytes(cfg)) + 2 * (PROCESS_BYTES + BUILD_BYTES_PER_PARAM * 842_496)
    with pytest.raises(ConfigError, match="GiB of RAM"):
        check_cpu_memory(cfg, available=needed - 1)


def test_every_command_spells_precision_alike_and_auto_follows_the_device():
    """--precision: the same choices and default (auto) in train, compare, simulate and plan; auto is bf16 on a
    GPU preset and fp32 for a run on this CPU, and the run says so."""
    from cli.commands.plan import plan
    from cli.options.precision import simulated_precision, training_precision

    for command in (train, compare, simulate, plan):
        option = next(param for param in command.params if param.name == "precision")
        assert option.default == "auto" and list(option.type.choices) == ["auto", "fp32", "bf16", "fp16", "fp8"]
    assert simulated_precision("auto") == "bf16" and simulated_precision("fp16") == "fp16"
    assert training_precision("auto", "cpu", 4) == "fp32" and training_precision("fp8", "cpu", 1) == "fp8"
    result = CliRunner().invoke(main, ["simulate", "--model", "tiny", "--gpu", "a100-80gb", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["precision"] == "bf16", result.output


def test_auto_precision_simulates_a_calibrated_cpu_host_in_fp32(tmp_path):
    """A CPU host profile trains in fp32 (compare runs it so): simulate's auto picks fp32 for it, as train does."""
    from fuzzing import cpu_profile_document

    profile = tmp_path / "cpu.json"
    profile.write_text(json.dumps(cpu_profile_document()))
    result = CliRunner().invoke(main, ["simulate", "--model", "tiny", "--hardware", str(profile), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["precision"] == "fp32", result.output
