"""`minigpt simulate`: the table, --json, the sweep with its two lessons, traces, topology files, bad input."""

import json

import click
import pytest
from click.testing import CliRunner

from cli.main import Group
from cli.commands.simulate import simulate
from simulator.network.topology import build_cluster, save_cluster


@click.group(cls=Group)
def group() -> None:
    """A throwaway group with the command registered the way cli/main.py will register it."""


group.add_command(simulate)


def invoke(*args: str):
    return CliRunner().invoke(group, ["simulate", *args])


def test_gpt3_in_fp32_reports_the_training_state_in_decimal_gb():
    result = invoke("--model", "gpt3-175b", "--precision", "fp32")
    assert result.exit_code == 0, result.output
    out = result.output
    # 174.6B parameters (the real count of the preset), 4 + 4 + 8 bytes each: ~700 / 700 / 1400 GB
    assert "parameters                         698.4 GB" in out
    assert "gradients                          698.4 GB" in out
    assert "optimizer states (Adam m, v)       1,396.8 GB" in out
    assert "16 bytes per parameter" in out and "at least 33 a100-80gb GPUs" in out
    assert "does not fit: short by" in out and "step time" in out and "MFU" in out


def test_json_has_the_promised_keys():
    result = invoke("--model", "gpt2-124m", "--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1",
                    "--global-batch", "16", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    for key in ("step_time_s", "tflops_per_gpu", "mfu", "breakdown", "memory_per_gpu", "fits"):
        assert key in data
    assert sum(data["breakdown"].values()) == pytest.approx(data["step_time_s"], rel=1e-9)
    memory = data["memory_per_gpu"]
    assert memory["total"] == sum(v for k, v in memory.items() if k != "total")
    assert data["fits"] is True and data["n_gpus"] == 8 and data["micro_batches"] == 8


def test_model_by_dimensions_trace_and_topology_file(tmp_path):
    topology = save_cluster(build_cluster("h100-sxm", 8, 2, "ndr", "rail"), tmp_path / "cluster.json")
    trace = tmp_path / "trace.json"
    result = invoke("--layers", "8", "--hidden", "1024", "--heads", "16", "--seq-len", "512", "--vocab", "1000",
                    "--tp", "4", "--pp", "2", "--dp", "2", "--schedule", "interleaved", "--virtual-chunks", "2",
                    "--global-batch", "8", "--topology", str(topology), "--trace", str(trace), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["gpu"] == "h100-sxm" and data["layout"]["virtual_chunks"] == 2  # the file names its GPU
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e.get("cat") == "compute"} == {0, 1}


def test_sweep_states_both_lessons_and_draws_the_plot(tmp_path):
    plot = tmp_path / "scaling.png"
    sweep = ["--model", "gpt2-124m", "--sweep", "--gpus", "4,8,16,32,64", "--global-batch", "64", "--tp", "1",
             "--pp", "1", "--fabric", "hdr"]
    result = invoke(*sweep, "--plot", str(plot))
    assert result.exit_code == 0, result.output
    out = result.output
    # from 8 to 16 GPUs the gradients' all-reduce leaves the server (19% of the step exposed), while every rank still
    # steps the whole model's AdamW as our executor runs it (a pass per element-wise op: engine/costs.py's
    # optimizer_bytes), which adding ranks does not shrink: each added GPU brings 48% of what one brought at 8
    assert "adding GPUs stops paying at 16 GPUs" in out
    assert "ZeRO stages at 16 GPUs" in out and "ZeRO-3 is" in out and "slower than ZeRO-" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(invoke(*sweep, "--json").output)
    assert data["sweep"]["stops_paying_at"] == 16 and data["zero_comparison"]["gpus"] == 16


@pytest.mark.parametrize("args,message", [
    (["--gpu", "b300"], "unknown hardware 'b300'"),
    (["--tp", "4", "--nodes", "2", "--gpus-per-node", "8"], "the cluster has 16"),
    (["--tp", "16", "--model", "gpt2-124m", "--heads", "16", "--hidden", "1024"], "spans servers"),
    (["--dp", "12"], "do not fill whole servers of 8"),
    (["--dp", "2", "--global-batch", "3"], "not a multiple"),
    (["--precision", "fp12"], "'fp12' is not one of"),
    (["--sweep", "--global-batch", "8"], "--sweep needs the GPU counts"),
    (["--sweep", "--gpus", "8,x", "--global-batch", "8"], "comma-separated"),
    (["--micro-batch", "0"], "--micro-batch must be a positive integer"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    result = invoke("--model", "gpt2-124m", *args) if "--model" not in args else invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_a_malformed_topology_file_is_bad_input(tmp_path):
    bad = tmp_path / "cluster.json"
    bad.write_text("{not json")
    result = invoke("--model", "gpt2-124m", "--topology", str(bad))
    assert result.exit_code == 2 and "not valid JSON" in result.output


def test_a_hardware_profile_loads_like_a_preset(tmp_path):
    from simulator.costs.hardware import load_hardware, save_hardware

    profile = save_hardware(load_hardware("h200"), tmp_path / "ours.json")
    result = invoke("--model", "gpt2-124m", "--dp", "8", "--hardware", str(profile), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["gpu"] == "h200" and data["memory_capacity_bytes"] == load_hardware("h200").gpu.hbm_bytes


def test_weak_scaling_grows_the_batch_and_compares_zero_at_that_batch():
    result = invoke("--model", "gpt2-124m", "--sweep", "--scaling", "weak", "--gpus", "8,16", "--global-batch", "32",
                    "--micro-batch", "4", "--zero", "1", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    points = data["sweep"]["points"]
    assert [p["global_batch"] for p in points] == [32, 64]
    compared = data["zero_comparison"]
    at = next(p for p in points if p["gpus"] == compared["gpus"])
    assert compared["stages"]["1"]["global_batch"] == at["global_batch"]
    assert compared["stages"]["1"]["step_time_s"] == pytest.approx(at["step_time_s"])


def test_help_lists_the_cost_model_and_overlap_flags():
    result = invoke("--help")
    assert result.exit_code == 0
    for flag in ("--attention [flash|unfused]", "--recompute [none|selective|full|op]", "--overlap",
                 "executor|megatron-2021|overlapped|megatron-core|torchtitan-fsdp2", "--tp-overlap / --no-tp-overlap",
                 "--dp-overlap", "share of SMs",
                 "--zero3-prefetch", "--p2p-overlap / --no-p2p-overlap", "--sp-saved-input"):
        assert flag in result.output, flag


def test_every_prediction_says_what_it_rests_on():
    args = ["--model", "gpt2-124m", "--tp", "2", "--pp", "2", "--dp", "2", "--global-batch", "16"]
    table = invoke(*args)
    assert table.exit_code == 0, table.output
    for words in ("what these numbers rest on", "bf16 GEMM efficiency", "achieved fractions", "overlap", "executor"):
        assert words in table.output
    data = json.loads(invoke(*args, "--attention", "unfused", "--recompute", "selective", "--overlap", "megatron-2021",
                             "--p2p-overlap", "--json").output)
    provenance = data["provenance"]
    assert provenance["implementation"] == {"attention": "unfused", "recompute": "selective", "sp_saved_input": "gathered",
                                            "fp8_weight_cache": False, "fp8_fused_casts": False, "fp8_scaling": "tensor",
                                            "wgrad_fusion": False, "ub_chunks": False, "fused_optimizer": True,
                                            "fp8_amax_group": "none", "fp8_experts": False,
                                            "fp8_param_gather": False, "fp8_recast": False, "eager": False,
                                            "grad_reduce_fp32": False, "attention_kernel": "flash-attn-2",
                                            "zero3_copies": "staging", "loss": "fused", "cp_attention": "fused",
                                            "expert_gemms": "grouped", "bias_fusion": "megatron",
                                            "ddp_buckets": "ddp"}
    assert provenance["attention"].startswith("unfused: its matmuls at the GEMM efficiency")
    assert provenance["overlap"] == {"name": "megatron-2021+custom", "tp": False, "dp": "after", "zero3_prefetch": 1,
                                     "p2p": True, "param_gather": "step", "ep": False, "tp_slowdown": 0.033, "dp_slowdown": 0.121,
                                     "p2p_slowdown": 0.015}
    assert provenance["matmul_efficiency"]["bf16"]["kind"] in ("GEMM model", "cited table", "measured table",
                                                             "fallback curve")
    assert "source" in provenance["achieved"] and data["attention"] == "unfused" and data["recompute"] == "selective"
    plain = json.loads(invoke(*args, "--overlap", "megatron-2021", "--json").output)  # the same stack's loss
    assert data["memory_per_gpu"]["activations"] > plain["memory_per_gpu"]["activations"]  # s x s scores kept
    assert "tensor_sustained" not in provenance["achieved"] and "tensor cores held" not in table.output  # A100
    h100 = invoke(*args, "--gpu", "h100-sxm")
    assert "tensor cores held at 84.3% of a burst under the power limit (bf16, fp16, fp8, tf32)" in h100.output
    assert json.loads(invoke(*args, "--gpu", "h100-sxm", "--json").output)["provenance"]["achieved"][
        "tensor_sustained"]["bf16"] == 0.843


def test_the_stack_presets_run_and_say_so():
    args = ["--model", "gpt2-124m", "--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1", "--global-batch", "16",
            "--sequence-parallel", "--json"]
    for preset, gathers in (("megatron-core", "forward"), ("torchtitan-fsdp2", "step")):
        result = invoke(*args, "--overlap", preset)
        assert result.exit_code == 0, result.output
        overlap = json.loads(result.output)["provenance"]["overlap"]
        assert overlap["name"] == preset and overlap["param_gather"] == gathers
    table = invoke(*args[:-1], "--overlap", "megatron-core")
    assert "slowed by tp 3.3%, dp 12.1%, p2p 1.5%" in table.output and "the next forward" in table.output


@pytest.mark.parametrize("args,message", [
    (["--attention", "fused"], "Invalid value for '--attention'"),
    (["--recompute", "half"], "Invalid value for '--recompute'"),
    (["--overlap", "magic"], "Invalid value for '--overlap'"),
    (["--dp-overlap", "sometimes"], "Invalid value for '--dp-overlap'"),
    (["--zero3-prefetch", "-1"], "Invalid value for '--zero3-prefetch'"),
    (["--sp-saved-input", "both"], "Invalid value for '--sp-saved-input'"),
])
def test_bad_cost_model_values_are_one_line_and_exit_code_2(args, message):
    result = invoke("--model", "gpt2-124m", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_fabric_flags_reach_the_cluster_and_bad_ones_are_one_line():
    from click.testing import CliRunner

    from cli.main import main
    from cli.options.cluster import TOPOLOGY_KINDS
    from simulator.network.topology import CLUSTER_KINDS

    assert tuple(TOPOLOGY_KINDS) == tuple(CLUSTER_KINDS)
    base = ["simulate", "--model", "gpt2-124m", "--tp", "4", "--dp", "64", "--global-batch", "256", "--micro-batch", "4"]
    runner = CliRunner()
    plain = runner.invoke(main, base + ["--json"])
    over = runner.invoke(main, base + ["--oversubscription", "4", "--json"])
    rail_only = runner.invoke(main, base + ["--topology-kind", "rail-only", "--nics-per-node", "4", "--json"])
    for result in (plain, over, rail_only):
        assert result.exit_code == 0, result.output
    assert "oversubscribed 4:1" in json.loads(over.stdout)["cluster"]
    assert "rail-only" in json.loads(rail_only.stdout)["cluster"] and "4 NICs per node" in json.loads(rail_only.stdout)["cluster"]
    assert json.loads(over.stdout)["step_time_s"] >= json.loads(plain.stdout)["step_time_s"]  # fewer uplinks never help
    for bad, words in ((["--oversubscription", "0.5"], "--oversubscription must be"),
                       (["--nics-per-node", "0"], "--nics-per-node must be")):
        result = runner.invoke(main, base + bad)
        assert result.exit_code == 2 and words in result.output and len(result.output.strip().splitlines()) == 1


def test_gpus_without_a_sweep_is_the_job_size_and_sets_dp():
    """`--gpus N` on one run was read only by --sweep and silently simulated one GPU; it now sets dp."""
    out = json.loads(invoke("--model", "gpt2-124m", "--gpus", "16", "--tp", "2", "--pp", "2", "--global-batch", "16",
                            "--json").output)
    assert out["n_gpus"] == 16 and out["layout"]["dp"] == 4
    agreeing = json.loads(invoke("--model", "gpt2-124m", "--gpus", "16", "--tp", "2", "--pp", "2", "--dp", "4",
                                 "--global-batch", "16", "--json").output)
    assert agreeing["step_time_s"] == out["step_time_s"]


@pytest.mark.parametrize("args, words", [
    (("--gpus", "12", "--tp", "8"), "--gpus 12 is not a multiple of tp x pp = 8"),
    (("--gpus", "16", "--tp", "8", "--dp", "4"), "--gpus 16 but tp x pp x dp = 32"),
    (("--gpus", "16", "--cp", "2", "--dp", "4"), "--gpus 16 but tp x cp x pp x dp = 8"),
    (("--gpus", "8,16"), "one run takes one GPU count"),
    (("--gpus", "0"), "--gpus must be a positive integer"),
])
def test_gpus_that_cannot_be_the_job_are_one_line_and_exit_2(args, words):
    result = invoke("--model", "gpt2-124m", *args)
    assert result.exit_code == 2 and words in result.output and len(result.output.strip().splitlines()) == 1, \
        result.output


@pytest.mark.parametrize("args, words", [
    (("--threshold", "0.3"), "--threshold describes a sweep"),
    (("--scaling", "weak"), "--scaling describes a sweep"),
    (("--campaign-runs", "5"), "--campaign-runs describes a campaign"),
])
def test_flags_of_a_sweep_or_a_campaign_on_a_plain_run_are_refused(args, words):
    """They did nothing there, silently; the same flags with --sweep (or --campaign) still run."""
    result = invoke("--model", "gpt2-124m", *args)
    assert result.exit_code == 2 and words in result.output, result.output


@pytest.mark.parametrize("args, words", [
    (("--cp-kind", "allgather"), "--cp-kind says how context-parallel ranks exchange"),
    (("--sp-saved-input", "sharded"), "--sp-saved-input says what sequence parallelism's Linears keep"),
])
def test_flags_of_a_parallelism_the_job_does_not_have_are_refused(args, words):
    """Without --cp 2+ (or --sequence-parallel) they described nothing and were dropped silently."""
    result = invoke("--model", "gpt2-124m", *args)
    assert result.exit_code == 2 and words in result.output, result.output
    with_it = invoke("--model", "gpt2-124m", "--tp", "2", "--cp", "2", "--sequence-parallel", *args)
    assert with_it.exit_code == 0, with_it.output
