"""Megatron-core's --recompute-modules in the simulator (simulator/costs/recorder.py's MODULES): what a block keeps
and runs again when the norms, a mixture of experts' activation or latent attention's up projections are
recomputed without their outputs (CheckpointWithoutOutput), core_attn as --recompute selective, and the refusals."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import main
from job.layout import Layout
from minigpt.errors import ConfigError
from minigpt.presets import preset
from precision.policy import policy
from simulator.costs.implementation import Implementation
from simulator.costs.ops import block_ops

BF16 = policy("bf16")


def ops(model, moe=None, **implementation):
    return block_ops(model, 1, Layout(), BF16, Implementation(**implementation), moe)


def names(op_list) -> set[str]:
    return {saved.name for saved in op_list.saved}


def rerun(op_list) -> list[str]:
    return [op.name for op in op_list.backward if op.phase == "recompute"]


def test_the_norms_outputs_are_freed_and_the_norms_run_again():
    """Llama 3 8B's block: the two norms' outputs and their statistics go (the Linears after them read them again
    once the norms rerun); their inputs, the residual stream, stay."""
    model = preset("llama3-8b")
    plain, modules = ops(model), ops(model, recompute_modules=("layernorm",))
    gone = names(plain) - names(modules)
    assert gone == {"qkv.input", "ln1.statistics", "fc1.input", "ln2.statistics"}
    assert plain.saved_bytes - modules.saved_bytes == sum(s.bytes for s in plain.saved if s.name in gone)
    assert rerun(modules) == ["ln1", "ln2"] and rerun(plain) == []
    assert "x" in names(modules) and "ln2.input" in names(modules)


def test_a_mixture_of_experts_activation_is_computed_again():
    """Qwen3-30B-A3B's MoE block: SwiGLU's product and silu(gate) go, the experts' fc1 output stays."""
    model = preset("qwen3-30b-a3b")
    plain, modules = ops(model, True), ops(model, True, recompute_modules=("moe_act",))
    assert names(plain) - names(modules) == {"experts.swiglu.silu", "experts.swiglu.output"}
    assert "experts.hidden" in names(modules) and rerun(modules) == ["experts.swiglu"]
    gpt_oss = preset("gpt-oss-120b")  # the clamped SwiGLU keeps its input alone: its output goes
    assert names(ops(gpt_oss, True)) - names(ops(gpt_oss, True, recompute_modules=("moe_act",))) == {
        "experts.clamped_swiglu.output"}


def test_latent_attentions_up_projections_and_rotation_run_again():
    """DeepSeek-V3's block: the rotated q, k, v the attention keeps go; the normed latent they come from stays; the up
    projections, the assembly and the rotation run again. Selective recomputation (core_attn) reruns the core
    alone, Megatron-core's rotation being part of the up projections' module."""
    model = preset("deepseek-v3")
    plain, modules = ops(model, True), ops(model, True, recompute_modules=("mla_up_proj",))
    assert names(plain) - names(modules) == {"rope.output"} and "latent.normed" in names(modules)
    assert rerun(modules) == ["q_up", "kv_up", "attention.assemble_keys", "attention.assemble", "rope"]
    assert plain.saved_bytes > modules.saved_bytes
    both = ops(model, True, recompute_modules=("mla_up_proj", "core_attn"))
    assert both.saved_bytes < modules.saved_bytes and "rope" in rerun(both) and "attention.flash" in rerun(both)


def test_core_attn_is_selective_recomputation():
    for model in (preset("llama3-8b"), preset("deepseek-v3")):
        selective, core = ops(model, recompute="selective"), ops(model, recompute_modules=("core_attn",))
        assert selective.saved == core.saved and selective.backward == core.backward


def test_a_block_recomputed_whole_is_not_told_modules():
    full = ops(preset("llama3-8b"), recompute="full")
    assert rerun(full)[:1] == ["ln1"] and "ln1" in rerun(full) and "ln2" in rerun(full)
    with pytest.raises(ConfigError, match="recompute full"):
        Implementation(recompute="full", recompute_modules=("layernorm",))
    with pytest.raises(ConfigError, match="--recompute-modules"):
        Implementation(recompute_modules=("attention",))
    with pytest.raises(ConfigError, match="latent attention"):
        ops(preset("llama3-8b"), recompute_modules=("mla_up_proj",))
    with pytest.raises(ConfigError, match="mixture of experts"):
        ops(preset("llama3-8b"), recompute_modules=("moe_act",))


def test_the_flag_prices_the_step_and_its_memory():
    """From the command line: each module takes memory off and time on; a bad module is one line and exit 2."""
    runner = CliRunner()

    def simulate(*flags):
        result = runner.invoke(main, ["simulate", "--model", "deepseek-v3", "--gpus", "1024", "--tp", "2", "--pp",
                                      "16", "--ep", "64", "--sequence-parallel", "--gpu", "h100-sxm",
                                      "--global-batch", "8192", *flags, "--json"])
        return result

    base = json.loads(simulate().output)
    for module in ("layernorm", "moe_act", "mla_up_proj"):
        found = json.loads(simulate("--recompute-modules", module).output)
        assert found["step_time_s"] > base["step_time_s"]
        assert found["memory_per_gpu"]["activations"] < base["memory_per_gpu"]["activations"], module
    for bad, word in ((["--recompute-modules", "attention"], "--recompute-modules"),
                      (["--recompute-modules", "layernorm", "--recompute", "full"], "recompute full")):
        result = simulate(*bad)
        assert result.exit_code == 2 and word in result.output and len(result.output.strip().splitlines()) == 1


def test_plan_searches_the_modules_with_recompute_none_and_selective():
    """minigpt plan with --recompute-modules: the modules go with recompute none and selective (a block recomputed
    whole reruns them anyway), and the search runs to its table."""
    from simulator.search.bound import candidate_stack

    changes = (("recompute_modules", ("moe_act",)),)
    assert candidate_stack("executor", "none", changes=changes).recompute_modules == ("moe_act",)
    assert candidate_stack("executor", "full", changes=changes).recompute_modules == ()
    result = CliRunner().invoke(main, ["plan", "--model", "tiny-moe", "--gpus", "4", "--gpu", "h100-sxm",
                                       "--recompute-modules", "moe_act"])
    assert result.exit_code == 0 and "fastest" in result.output, result.output
