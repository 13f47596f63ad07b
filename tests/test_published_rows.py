"""bench/published.py's tables: the rows as copied, with their source, and a row simulated as the bench does."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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


def test_a_dgx_cloud_row_simulates_as_the_bench_runs_it():
    module = published()
    row = json.loads((BENCH / "published_runs.json").read_text())["dgxc_gpt3_175b_h100"]["rows"][0]
    args = module.dgxc_command(row)
    assert args[1:4] == ["-m", "cli", "simulate"]
    result = CliRunner().invoke(main, args[3:])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["n_gpus"] == 128 and data["layout"]["tp"] == 4 and data["step_time_s"] > 0
    assert data["provenance"]["overlap"]["name"] == "megatron-core"  # the stack's own overlap, a stated preset


def test_the_moe_rows_cite_their_runs_and_simulate_as_the_bench_runs_them():
    """Every published MoE row names its source and where in it; its layout multiplies to its GPUs; the first row
    simulates through the command the bench builds and prints a step time."""
    table = json.loads((BENCH / "published_runs.json").read_text())["moe_training"]
    assert table["rows"] and table["sources"]
    for row in table["rows"] + table["outside_mape"]:
        assert row["source"] and row["where"], row["id"]
        assert row["tp"] * row["pp"] * row["cp"] * row["dp"] == row["n_gpus"], row["id"]
        assert row["dp"] % row["ep"] == 0, row["id"]
    args = published().moe_command(table["rows"][0])
    assert args[1:4] == ["-m", "cli", "simulate"] and args[-1] == "--json"
    result = CliRunner().invoke(main, args[3:])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["step_time_s"] > 0
