"""bench/published.py's tables: the rows as copied, with their source, and a row simulated as the bench does."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import main

BENCH = Path(__file__).resolve().parents[1] / "bench"


def published():
    spec = importlib.util.spec_from_file_location("published", BENCH / "published.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dgx_cloud_rows_are_the_validation_files():
    """The ten rows of NVIDIA's DGX-Cloud GPT-3 175B benchmark, copied with their source and never changed."""
    table = json.loads((BENCH / "published_runs.json").read_text())["dgxc_gpt3_175b_h100"]
    original = Path(__file__).resolve().parents[2] / "shared" / "validation" / "dgxc-gpt3-175b-h100.json"
    if original.is_file():  # beside the project on the machine that copied them
        assert json.loads(original.read_text())["rows"] == table["rows"]
    assert "dgxc-benchmarking" in table["source"] and len(table["rows"]) == 10
    assert {(r["precision"], r["n_gpus"]) for r in table["rows"]} == {
        (p, n) for p in ("bf16", "fp8") for n in (128, 256, 512, 1024, 2048)}
    for row in table["rows"]:
        assert row["tp"] * row["pp"] * row["cp"] * row["dp"] == row["n_gpus"] and row["gb"] == 64 * row["dp"]


def test_the_next_release_differs_from_the_acceptance_table_only_where_its_source_says():
    """v25.02's rows (beside the acceptance table, not instead of it): the same jobs, 6 virtual chunks, cuDNN's
    attention (NVTE_FUSED_ATTN=1 against v25.01's 0), new times."""
    data, module = json.loads((BENCH / "published_runs.json").read_text()), published()
    old, new = data["dgxc_gpt3_175b_h100"], data["dgxc_gpt3_175b_h100_v25_02"]
    assert "v25.02" in new["source"] and "NVTE_FUSED_ATTN=1" in new["source"]
    for a, b in zip(old["rows"], new["rows"], strict=True):
        assert b["v"] == 6 and b["id"] == a["id"].replace("DGXC-", "DGXC2502-")
        assert b["attention_kernel"] == "cudnn" and "attention_kernel" not in a
        assert {k: v for k, v in a.items() if k not in ("id", "v", "pub_s", "pub_mfu")} == \
            {k: v for k, v in b.items() if k not in ("id", "v", "pub_s", "pub_mfu", "attention_kernel")}
        assert module.dgxc_command(b)[-3:] == ["--attention-kernel", "cudnn", "--json"]
    # v25.01 ran flash-attn (its configure.sh: NVTE_FUSED_ATTN=0), stated beside the rows copied unchanged
    assert old["attention_kernel"] == "flash-attn-2" and "NVTE_FUSED_ATTN=0" in old["assumed"]
    by_id = {row["id"]: row for row in new["rows"]}
    assert by_id["DGXC2502-GPT3-128-bf16"]["pub_s"] == 8.309 and by_id["DGXC2502-GPT3-2048-fp8"]["pub_s"] == 5.96


def test_a_dgx_cloud_row_simulates_as_the_bench_runs_it():
    module = published()
    row = module.stated_rows(json.loads((BENCH / "published_runs.json").read_text())["dgxc_gpt3_175b_h100"])[0]
    args = module.dgxc_command(row)
    assert args[1:4] == ["-m", "cli", "simulate"] and args[-3:] == ["--attention-kernel", "flash-attn-2", "--json"]
    result = CliRunner().invoke(main, args[3:])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["n_gpus"] == 128 and data["layout"]["tp"] == 4 and data["step_time_s"] > 0
    assert data["provenance"]["overlap"]["name"] == "megatron-core"  # the stack's own overlap, a stated preset
    assert "proj_fprop leaves 24 SMs" in data["provenance"]["implementation"]["userbuffers"]  # the run's own yaml


def test_the_moe_rows_cite_their_runs_and_simulate_as_the_bench_runs_them():
    """Every published MoE row names its source and where in it; its layout multiplies to its GPUs; the first row
    simulates through the command the bench builds and prints a step time."""
    table = json.loads((BENCH / "published_runs.json").read_text())["moe_training"]
    assert table["rows"] and table["sources"]
    for row in table["rows"] + table["outside_mape"]:
        assert row["source"] and row["where"], row["id"]
        assert row["tp"] * row["pp"] * row["cp"] * row["dp"] == row["n_gpus"], row["id"]
        assert row["dp"] * row["cp"] * (row["tp"] if row["sp"] else 1) % row["ep"] == 0, row["id"]  # routing ranks
    args = published().moe_command(table["rows"][0])
    assert args[1:4] == ["-m", "cli", "simulate"] and args[-1] == "--json"
    result = CliRunner().invoke(main, args[3:])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["step_time_s"] > 0


def test_the_torchtitan_rows_cite_their_tables_and_simulate_as_the_bench_runs_them():
    table = json.loads((BENCH / "published_runs.json").read_text())["torchtitan_llama3_h100"]
    assert "llama3_h100_202412_torchtitan.md" in table["source"] and "9dec370" in table["assumed"]
    assert [(r["n_gpus"], r["elementwise"], r["tps"]) for r in table["rows"]] == [
        (8, "eager", 5762), (8, "fused", 6667), (128, "eager", 5605), (128, "fused", 6514)]
    args = published().torchtitan_command(table["rows"][0])
    result = CliRunner().invoke(main, args[3:])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["fits"] and report["provenance"]["implementation"]["eager"]
    assert report["provenance"]["implementation"]["recompute"] == "op"


def test_the_torchtitan_long_context_rows_cite_their_table_and_simulate_as_the_bench_runs_them():
    table = json.loads((BENCH / "published_runs.json").read_text())["torchtitan_cp_llama3_h100"]
    assert "Table 2" in table["source"] and "9dec370" in table["source"] and "allgather" in table["assumed"]
    rows = table["rows"]
    assert [(r["dp"], r["cp"], r["s"], r["tps"], r["memory_gib"]) for r in rows] == [
        (8, 1, 32768, 3890, 83.9), (4, 2, 65536, 2540, 84.2), (2, 4, 131072, 1071, 84.0), (1, 8, 262144, 548, 84.5)]
    assert all(r["n_gpus"] == r["dp"] * r["cp"] == 8 for r in rows)
    args = published().torchtitan_cp_command(rows[1])
    result = CliRunner().invoke(main, args[3:])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["fits"] and report["layout"]["cp"] == 2 and report["layout"]["cp_kind"] == "allgather"
    assert report["provenance"]["implementation"]["recompute"] == "full"


def test_the_llama3_rows_cite_their_table_and_hold_16m_tokens():
    table = json.loads((BENCH / "published_runs.json").read_text())["llama3_405b_h100"]
    assert "2407.21783" in table["source"] and "Table 4" in table["source"] and table["assumed"]
    assert [(r["n_gpus"], r["pub_tflops"]) for r in table["rows"]] == [(8192, 430), (16384, 400)]
    for row in table["rows"]:
        assert row["tp"] * row["cp"] * row["pp"] * row["dp"] == row["n_gpus"] and row["gb"] * row["s"] == 2**24


def test_the_implied_rate_is_the_factor_that_meets_the_published_step(tmp_path):
    """The two-point solve is exact enough: simulated again with the tensor-core peaks times the factor it finds,
    a DGX-Cloud row lands on its published step; the scaled profile changes the tensor-core peaks alone."""
    from simulator.costs.hardware import load_hardware

    module = published()
    base = load_hardware("h100-sxm").gpu
    scaled = load_hardware(str(module.scaled_profile("h100-sxm", 0.5, tmp_path))).gpu
    for fmt, peak in base.peak_flops.items():
        assert scaled.peak_flops[fmt] == (peak * 0.5 if fmt in ("bf16", "fp16", "fp8") else peak)
    assert (scaled.hbm_bandwidth, scaled.nvlink_bandwidth) == (base.hbm_bandwidth, base.nvlink_bandwidth)
    row = json.loads((BENCH / "published_runs.json").read_text())["dgxc_gpt3_175b_h100"]["rows"][0]
    args = module.dgxc_command(row)
    found = module.implied("dgxc", row["id"], args, row["pub_s"], tmp_path)
    assert found["error"] < 0 and 0.5 < found["factor"] < 1 and 0.5 < found["tensor_core_share"] < 1
    profile = module.scaled_profile("h100-sxm", found["factor"], tmp_path)
    again = module.simulated(args, profile, row["id"])["step_time_s"]
    assert abs(again / row["pub_s"] - 1) < 0.01


def test_the_moe_rows_carry_their_runs_tensor_parallel_overlap():
    """Grok-1's yaml turns TE's tp overlap off; the ModelZoo's Mixtral 8x22B turns it on without a settings file
    (TE's defaults): the bench passes each as the run set it."""
    rows = {row["id"]: row for row in json.loads((BENCH / "published_runs.json").read_text())["moe_training"]["rows"]}
    module = published()
    grok = module.moe_command(rows["DGXC-GROK1-314B-2048-bf16"])
    assert "--no-tp-overlap" in grok and "--tp-overlap-cfg" not in grok
    zoo = module.moe_command(rows["MODELZOO-MIXTRAL-8x22B-128-bf16"])
    settings = Path(zoo[zoo.index("--tp-overlap-cfg") + 1])
    assert settings.is_file() and set(json.loads(settings.read_text())) == {"source"}  # every overlap TE's default
    assert "--no-tp-overlap" not in zoo


def test_the_gb200_rows_cite_their_release_and_simulate_as_the_bench_runs_them():
    """NVIDIA/dgxc-benchmarking v25.05's Llama 3.1 405B on GB200 NVL72: tp 4 x pp 8 x cp 2 x vp 8, one sequence of 8,192
    a micro-batch, global batch GPUs / 2; each precision's run with its recipe's userbuffers settings (NeMo v2.3.1)."""
    table = json.loads((BENCH / "published_runs.json").read_text())["dgxc_llama31_405b_gb200"]
    assert "v25.05" in table["source"] and "v2.3.1" in table["source"] and "fp8_param_gather True" in table["source"]
    by_id = {row["id"]: row for row in table["rows"]}
    assert by_id["DGXC2505-LLAMA31-405B-128-bf16"]["pub_s"] == 9.347 and by_id["DGXC2505-LLAMA31-405B-512-fp8"]["pub_s"] == 6.244
    for row in table["rows"]:
        assert row["tp"] * row["pp"] * row["cp"] * row["dp"] == row["n_gpus"] and row["gb"] == row["n_gpus"] // 2
        # the published MFU is its FLOPs a sequence over its peak (2.45 PF bf16, 4.9 PF fp8), to the rounding
        peak = {"bf16": 2.45e15, "fp8": 4.9e15}[row["precision"]]
        assert row["gb"] * row["seq_flops"] / row["pub_s"] / row["n_gpus"] / peak == pytest.approx(row["pub_mfu"], abs=0.002)
        settings = json.loads((BENCH / row["ub"]).read_text())
        assert f"userbuffers_{row['precision']}_b200_h16384_tp4_cp2_mbs1_seqlen8192" in settings["source"]
    module = published()
    fp8 = by_id["DGXC2505-LLAMA31-405B-128-fp8"]
    args = module.dgxc_command(fp8)
    assert args[args.index("--model") + 1] == "llama3-405b" and args[args.index("--gpus-per-node") + 1] == "64"
    assert "--fp8-param-gather" in args and args[args.index("--dropout") + 1] == "0.0"
    result = CliRunner().invoke(main, args[3:])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["n_gpus"] == 128 and data["layout"]["cp"] == 2 and data["step_time_s"] > 0
    assert "proj_fprop leaves 1 SMs" in data["provenance"]["implementation"]["userbuffers"]


def test_the_h100_llama_rows_of_the_2025_stack_cite_their_release_and_simulate_as_the_bench_runs_them():
    """NVIDIA/dgxc-benchmarking v25.04.01's Llama 3.1 8B, 70B and 405B on DGX H100 (NeMo 25.02.01): each row's
    published MFU is its FLOPs a sequence over the H100's peak; 70B and 405B carry their recipe's userbuffers."""
    table = json.loads((BENCH / "published_runs.json").read_text())["dgxc_llama31_h100"]
    assert "v25.04.01" in table["source"] and "d2b21556" in table["source"] and "NCCL_NVLS_ENABLE=0" in table["source"]
    assert len(table["rows"]) == 28 and {r["model"] for r in table["rows"]} == {"llama3-8b", "llama3-70b", "llama3-405b"}
    for row in table["rows"]:
        assert row["tp"] * row["pp"] * row["cp"] * row["dp"] == row["n_gpus"]
        peak = {"bf16": 989e12, "fp8": 1979e12}[row["precision"]]
        assert row["gb"] * row["seq_flops"] / row["pub_s"] / row["n_gpus"] / peak == pytest.approx(row["pub_mfu"], abs=0.002)
        assert ("ub" in row) == (row["tp"] > 1) and row["sp"] == (row["tp"] > 1)
    by_id = {row["id"]: row for row in table["rows"]}
    assert by_id["DGXC2504-LLAMA31-70B-64-fp8"]["pp"] == 8 and by_id["DGXC2504-LLAMA31-70B-64-bf16"]["cp"] == 2
    module = published()
    args = module.dgxc_command(by_id["DGXC2504-LLAMA31-8B-8-bf16"])
    assert "--sequence-parallel" not in args and "--tp-overlap-cfg" not in args
    result = CliRunner().invoke(main, args[3:])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["n_gpus"] == 8 and data["layout"]["cp"] == 2 and data["layout"]["dp"] == 4 and data["step_time_s"] > 0


def test_the_nemotron_rows_cite_their_release_and_simulate_as_the_bench_runs_them():
    """NVIDIA/dgxc-benchmarking v25.04.01's Nemotron-4 15B and 340B on DGX H100: the squared-ReLU MLP, a 256K
    vocabulary, no userbuffers file on H100 (Transformer Engine's defaults); each MFU its FLOPs a sequence over the peak."""
    table = json.loads((BENCH / "published_runs.json").read_text())["dgxc_nemotron4_h100"]
    assert "v25.04.01" in table["source"] and "squared ReLU" in table["source"] and len(table["rows"]) == 24
    for row in table["rows"]:
        assert row["tp"] * row["pp"] * row["cp"] * row["dp"] == row["n_gpus"] and row["mlp"] == "relu2"
        peak = {"bf16": 989e12, "fp8": 1979e12}[row["precision"]]
        assert row["gb"] * row["seq_flops"] / row["pub_s"] / row["n_gpus"] / peak == pytest.approx(row["pub_mfu"], abs=0.002)
    by_id = {row["id"]: row for row in table["rows"]}
    assert by_id["DGXC2504-NEMOTRON4-340B-256-bf16"]["v"] == 12 and by_id["DGXC2504-NEMOTRON4-15B-16-fp8"]["mb"] == 2
    args = published().dgxc_command(by_id["DGXC2504-NEMOTRON4-15B-2048-bf16"])
    assert "--tp-overlap-cfg" not in args and args[args.index("--mlp") + 1] == "relu2" and "--untied" in args
    result = CliRunner().invoke(main, args[3:])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["layout"]["dp"] == 1024 and data["provenance"]["implementation"]["ddp_buckets"] == "megatron"
    assert data["step_time_s"] > 0
