"""`minigpt claims --json`: every row's verdict checked against its measured numbers, the numbers against
torch, the project's formulas and the commands the rows name, and docs/claims.md against a fresh run.

The fast rows run in CI in one invocation; the rows that train for real (`slow=True`, a few seconds
each) and the full command's wall time run under the `slow` marker: `python -m pytest -m slow
tests/test_claims.py`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from cli.tools.claims import CAVEAT, HOLDS, UNCHECKABLE, WRONG
from cli.tools.claims_registry import all_claims
from cli.tools.claims_report import markdown_row
from minigpt.config import preset
from precision.policy import policy

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = all_claims()
FAST = [c.name for c in CLAIMS if not c.slow]
SLOW = [c.name for c in CLAIMS if c.slow]
WALL_LIMIT_S = 120  # the whole command on two cores


def invoke(*args: str) -> dict:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout, parse_constant=lambda name: pytest.fail(f"{name} is not strict JSON"))


def by_name(report: dict) -> dict[str, dict]:
    return {row["name"]: row for row in report["claims"]}


@pytest.fixture(scope="module")
def fast_report() -> dict:
    return invoke("claims", "--json", *[arg for name in FAST for arg in ("--only", name)])


@pytest.fixture(scope="module")
def full_report() -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cli", "claims", "--json"], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    report["wall_s"] = wall
    return report


def simulated(*args: str) -> dict:
    return invoke("simulate", *args, "--json")


# ---------------------------------------------------------------- one check per row, from its numbers


def check_formats(row):
    n = row["numbers"]["formats"]
    assert n["fp16"]["max"] == torch.finfo(torch.float16).max == 65504
    assert n["fp8_e4m3"]["max"] == torch.finfo(torch.float8_e4m3fn).max == 448
    assert n["fp8_e5m2"]["max"] == torch.finfo(torch.float8_e5m2).max == 57344
    assert n["bf16"]["max"] == torch.finfo(torch.bfloat16).max and n["fp32"]["max"] == torch.finfo(torch.float32).max
    assert (n["bf16"]["exponent_bits"], n["bf16"]["mantissa_bits"]) == (8, 7)
    article = row["numbers"]["article_range"]
    wrong = [name for name, facts in n.items() if abs(article[name] - facts["max"]) > 0.05 * facts["max"]]
    assert wrong == ["fp8_e4m3", "fp8_e5m2"] == row["numbers"]["wrong_range"]
    assert row["verdict"] == WRONG and "448" in row["why"] and "57344" in row["why"]


def check_cast_bits(row):
    n = row["numbers"]
    x = torch.tensor(n["values"])
    assert n["exponent_fields"]["fp32"] == ((x.view(torch.int32) >> 23) & 0xFF).tolist()
    assert n["exponent_fields"]["bf16"] == ((x.bfloat16().view(torch.int16).to(torch.int64) >> 7) & 0xFF).tolist()
    assert n["exponent_fields"]["fp16"] == ((x.half().view(torch.int16).to(torch.int64) >> 10) & 0x1F).tolist()
    assert n["copied"] == {"fp16": False, "bf16": True} and n["bias"]["fp16"] == 15
    assert row["verdict"] == WRONG


def check_fp16_smallest(row):
    n = row["numbers"]
    fp16 = torch.finfo(torch.float16)
    assert n["smallest_subnormal"] == 2.0**-24 == fp16.smallest_normal * fp16.eps
    assert n["smallest_normal"] == torch.finfo(torch.float16).smallest_normal
    assert n["example_in_fp16"] == torch.tensor(n["example"]).half().item()
    assert n["article"] is None and row["verdict"] == WRONG


def check_swamping(row):
    n = row["numbers"]
    fp16 = (torch.tensor(0.5, dtype=torch.float16) + torch.tensor(1e-7, dtype=torch.float16)).item()
    fp32 = (torch.tensor(0.5) + torch.tensor(1e-7)).item()
    assert n["fp16_sum"] == fp16 == 0.5 and n["fp32_sum"] == fp32 != 0.5
    assert round(n["significant_digits"]["fp16"]) == 3 and round(n["significant_digits"]["fp32"]) == 7
    assert row["verdict"] == HOLDS


def check_master_weights(row):
    n = row["numbers"]
    assert n["pure_fp16"]["gain_moved"] == 0 and n["fp32_master"]["gain_moved"] > 0
    assert (n["fp32_master"]["loss_ratio"] < 0.5) == (row["verdict"] == HOLDS)


def check_fp32_accumulate(row):
    n = row["numbers"]
    assert n["exact"] == pytest.approx(0.25 * n["length"], rel=0.02)  # E[xy] of two U(0, 1)
    stall = torch.tensor(n["fp16_stalls_from"], dtype=torch.float16)
    assert (stall + 0.99).item() == stall.item() and (stall / 2 + 0.99).item() != (stall / 2).item()
    errors = n["relative_error"]
    assert errors["fp16"] > 0.5 and errors["fp32"] < 1e-4
    assert n["fp16_eps"] == torch.finfo(torch.float16).eps and n["input_rounding_error"] < n["fp16_eps"] / 10
    assert (errors["fp16"] > 100 * errors["fp32"]) == (row["verdict"] == HOLDS)


def check_fp16_underflow(row):
    from precision.scaler import LossScaler

    n = row["numbers"]
    assert n["default_scale"] == LossScaler().init_scale == n["article_scale"] == 65536
    assert n["fp16"]["lost"] == 1.0 and n["fp16_scaled"]["lost"] < 0.01 and n["fp16_scaled"]["relative_error"] < 0.01
    assert n["median_gradient"] < n["fp16_smallest_subnormal"] == 2.0**-24
    assert row["verdict"] == HOLDS


def check_bf16_no_scaling(row):
    n = row["numbers"]
    bf16, fp32 = torch.finfo(torch.bfloat16), torch.finfo(torch.float32)
    assert n["smallest_normal"]["bf16"] == bf16.smallest_normal == fp32.smallest_normal
    assert n["bf16"]["lost"] == 0 and n["bf16"]["relative_error"] < 2 * torch.finfo(torch.bfloat16).eps
    assert row["verdict"] == HOLDS


def check_fp16_overflow(row):
    n = row["numbers"]
    assert n["fp16_max"] == 65504 and n["fp16_value"] == "inf"
    assert n["bf16_value"] == torch.tensor(70000.0).bfloat16().item()
    assert n["step_skipped"] and n["scale_after"] == n["scale_before"] / 2
    assert row["verdict"] == CAVEAT


def check_bytes_per_role(row):
    n = row["numbers"]
    assert n["bf16_measured"] == {k: float(v) for k, v in policy("bf16").bytes_per_param().items()}
    assert n["bf16_measured"] == {"compute": 2, "grad": 2, "master": 4, "adam_m": 4, "adam_v": 4}
    assert n["totals"] == {"bf16": 16, "fp32": 16, "fp8": 16} and n["fp8_element_bytes"] == 1
    assert row["verdict"] == CAVEAT


def check_memory_measured(row):
    n = row["numbers"]
    assert n["model_states"]["fp32"] == n["model_states"]["bf16"] == 16 * preset("tiny").n_params()
    assert n["saving"] == pytest.approx(1 - n["total"]["bf16"] / n["total"]["fp32"])
    assert 0.45 < n["activation_ratio"] < 0.6
    expected = HOLDS if 0.4 <= n["saving"] <= 0.6 else CAVEAT
    assert row["verdict"] == expected


def check_cpu_speed(row):
    n = row["numbers"]
    assert n["speedup"] == pytest.approx(n["fp32_step_s"] / n["bf16_step_s"])
    assert row["verdict"] == (HOLDS if 2 <= round(n["speedup"], 1) <= 3 else CAVEAT)


def check_speedup(row):
    n = row["numbers"]
    for gpu, step in n["steps"].items():
        assert step["speedup"] == pytest.approx(step["fp32_s"] / step["bf16_s"])
    cli = simulated("--model", "gpt2-124m", "--precision", "fp32", "--micro-batch-size", "8", "--gpu", "h100-sxm")
    assert cli["step_time_s"] == pytest.approx(n["steps"]["h100-sxm"]["fp32_s"], rel=1e-12)
    in_range = [f"{model} {gpu}" for model, by_gpu in n["tf32_block_speedup"].items() for gpu, r in by_gpu.items()
                if 2 <= round(r, 1) <= 3]
    assert in_range == n["inside_article_range"] and set(n["steps"]) == {"a100-40gb", "a100-80gb", "h100-sxm", "h200"}
    all_fp32 = all(2 <= round(s["speedup"], 1) <= 3 for s in n["steps"].values())
    assert row["verdict"] == (HOLDS if all_fp32 else CAVEAT if in_range else WRONG)


def check_fp16_bf16_same(row):
    from simulator.hardware import load_hardware

    for gpu, n in row["numbers"].items():
        peaks = load_hardware(gpu).gpu.peak_flops
        assert n["bf16_tflops"] * 1e12 == peaks["bf16"] == peaks["fp16"] and n["step_ratio"] == pytest.approx(1)
    assert row["verdict"] == HOLDS


def check_matmul_share(row):
    shares = row["numbers"]["gemm_time_share"]
    assert all(0 < s < 1 for s in shares.values())
    low, high = min(shares.values()), max(shares.values())
    assert row["verdict"] == (HOLDS if low >= 0.945 else CAVEAT if high >= 0.9 else WRONG)


def check_cast_cost(row):
    from simulator.compute import hbm_speed
    from simulator.hardware import load_hardware

    gpu = load_hardware("a100-80gb").gpu
    expected = preset("gpt2-124m").n_params() * (4 + 2) / hbm_speed(gpu) * 1e3  # one GPU holds the whole model
    assert row["numbers"]["gpu_ms"]["gpt2-124m on one A100"] == pytest.approx(expected)
    assert row["verdict"] == (HOLDS if all(ms < 100 for ms in row["numbers"]["gpu_ms"].values()) else WRONG)


def check_fp8_speed(row):
    ratios = row["numbers"]["bf16_over_fp8_step"]
    largest = list(ratios)[-1]
    faster = [k for k, r in ratios.items() if r > 1]
    assert row["numbers"]["a100_fp8_peak"] is None
    assert row["verdict"] == (HOLDS if len(faster) == len(ratios) else CAVEAT if largest in faster else WRONG)


def check_memory_halved(row):
    cases = row["numbers"]["cases"]
    for label, case in cases.items():
        assert case["saving"] == pytest.approx(1 - case["bf16_gib"] / case["fp32_gib"])
        assert 0.45 <= case["activation_ratio"] <= 0.65
        if "dp" not in label:  # one replica: 16 bytes per parameter in both precisions
            assert case["model_state_ratio"] == pytest.approx(1, abs=1e-3)
    cli = simulated("--model", "gpt2-124m", "--precision", "fp32", "--micro-batch-size", "8", "--gpu", "a100-80gb")
    assert cli["memory_per_gpu"]["total"] / 2**30 == pytest.approx(cases["gpt2-124m mb 8"]["fp32_gib"])
    savings = [c["saving"] for c in cases.values()]
    low, high = min(savings), max(savings)
    assert row["verdict"] == (HOLDS if low >= 0.4 and high <= 0.6 else CAVEAT if high >= 0.4 else WRONG)


def check_gpt3_memory(row):
    n = row["numbers"]
    params = preset("gpt3-175b").n_params()
    assert n["n_params"] == params
    assert n["fp32_state_gb"]["parameters"] == pytest.approx(4 * params / 1e9)
    assert n["fp32_state_gb"]["optimizer_states"] == pytest.approx(8 * params / 1e9)
    assert n["bf16_state_gb"]["total"] == pytest.approx(n["fp32_state_gb"]["total"]) == pytest.approx(16 * params / 1e9)
    assert n["gpus_article_accounting"] == math.ceil((16 * params / 1e9 + 200) / 80) == 38
    assert n["gpus_for_state_80gib"] == math.ceil(16 * params / (80 * 2**30)) == 33
    assert row["verdict"] == CAVEAT


def check_ddp_fit(row):
    n = row["numbers"]
    assert n["largest_params"] == 80 * 2**30 / 16 and not n["ddp_fits"] and n["zero3_fits"]
    assert row["verdict"] == HOLDS


def check_memory_shares(row):
    n = row["numbers"]
    for label, shares in n["shares"].items():
        assert sum(shares.values()) == pytest.approx(1)
        assert n["distance"][label] == pytest.approx(max(abs(shares[k] - v) for k, v in n["article"].items()))
    fp32 = n["shares"]["gpt2-124m fp32"]
    assert fp32["parameters"] == fp32["gradients"] and fp32["optimizer"] == pytest.approx(2 * fp32["parameters"])
    assert row["verdict"] == (CAVEAT if min(n["distance"].values()) <= 0.05 else WRONG)


def check_optimizer_largest(row):
    n = row["numbers"]
    first = [label for label, s in n["shares"].items() if max(s, key=s.get) == "optimizer"]
    assert [label for label, name in n["largest"].items() if name == "optimizer"] == first
    assert row["verdict"] == (HOLDS if len(first) == len(n["shares"]) else CAVEAT if first else WRONG)


def _zero_common(row, stage: int) -> dict:
    n = row["numbers"]
    replicas = n["replicas"]
    paper = {1: 16 / (4 + 12 / replicas), 2: 16 / (2 + 14 / replicas), 3: replicas}[stage]
    assert n["paper_saving"] == pytest.approx(paper)
    assert n["saving"] == pytest.approx(paper, rel=0.03)
    return n


def check_zero1(row):
    n = _zero_common(row, 1)
    assert all(r == pytest.approx(1, abs=1e-3) for r in n["volume_over_ddp"].values())
    assert row["verdict"] == CAVEAT


def check_zero2(row):
    n = _zero_common(row, 2)
    assert n["volume_over_ddp"]["1"] == pytest.approx(1, abs=1e-3)
    assert n["volume_over_ddp"]["4"] == pytest.approx((4 + 1) / 2, abs=1e-3)  # a reduce-scatter per micro-batch
    assert row["verdict"] == CAVEAT


def check_zero3(row):
    n = _zero_common(row, 3)
    assert n["saving"] <= n["replicas"] and n["paper_limit"] is None
    assert 1 < n["volume_over_ddp"]["1"] <= 1.5 and n["volume_over_ddp"]["4"] > n["volume_over_ddp"]["1"]
    assert row["verdict"] == WRONG


def check_zero3_not_best(row):
    n = row["numbers"]
    for label, stages in n["cases"].items():
        best = min(stages["0"]["step_s"], stages["1"]["step_s"])
        assert n["zero3_over_best_of_0_1"][label] == pytest.approx(stages["3"]["step_s"] / best)
    slower = [r > 1 for r in n["zero3_over_best_of_0_1"].values()]
    assert row["verdict"] == (HOLDS if all(slower) else CAVEAT if any(slower) else WRONG)


def check_fsdp_offload(row):
    assert row["verdict"] == UNCHECKABLE and "simulator" in row["why"] and row["numbers"] == {}


def check_more_gpus(row):
    n = row["numbers"]
    stop = None
    for point in n["points"]:
        if point["marginal"] is not None:
            stop = (stop or point["gpus"]) if point["marginal"] < n["threshold"] else None
    assert n["stops_paying_at"] == stop
    cli = invoke("simulate", *row["command"].split()[2:], "--json")
    assert cli["sweep"]["stops_paying_at"] == stop
    assert row["verdict"] == (HOLDS if stop else WRONG)


def check_bubble(row):
    n = row["numbers"]
    p, m = n["pp"], n["micro_batches"]
    textbook = {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1), "interleaved": (p - 1) / (2 * m + p - 1),
                "zb-h1": (p - 1) / (3 * m + p - 1)}
    for kind, value in textbook.items():
        assert n["replays"][kind]["replayed"] == pytest.approx(value, abs=1e-12)
    cli = invoke("schedule", "--pp", str(p), "--micro-batches", str(m), "--schedule", "1f1b", "--json")
    assert cli["bubble_fraction"] == pytest.approx(textbook["1f1b"], abs=1e-12)
    assert n["gpt3_formula"] == pytest.approx(15 / (n["gpt3_micro_batches"] + 15))
    close = abs(n["gpt3_simulated"] - n["gpt3_formula"]) <= 0.1 * n["gpt3_formula"]
    assert row["verdict"] == (HOLDS if close else CAVEAT)


def check_tp_in_node(row):
    n = row["numbers"]
    assert n["tp_in_pp_across_s"] == pytest.approx(n["tp_in_server_s"] + 2 * n["pp_across_servers_s"])
    assert n["pp_in_tp_across_s"] == pytest.approx(n["tp_across_servers_s"] + 2 * n["pp_in_server_s"])
    assert n["tp_across_servers_s"] > n["tp_in_server_s"] and n["pp_across_servers_s"] > n["pp_in_server_s"]
    placed, swapped = n["tp_in_pp_across_s"], n["pp_in_tp_across_s"]
    assert row["verdict"] == (HOLDS if swapped > 2 * placed else CAVEAT if swapped > placed else WRONG)


def check_strategies(row):
    n = row["numbers"]
    model = preset("llama3-8b")
    assert n["volume_gb"]["DDP"] == pytest.approx(2 * 2 * model.n_params() / 1e9, rel=1e-3)  # all-reduce of bf16 grads
    activation = model.seq_len * model.d_model * 2
    assert n["volume_gb"]["PP"] == pytest.approx(2 * 8 * activation / 1e9)  # a middle stage: 8 sends each way
    inverted = [(a, b) for a in n["article_comm_rank"] for b in n["article_comm_rank"]
                if n["article_comm_rank"][a] < n["article_comm_rank"][b] and n["volume_gb"][a] > n["volume_gb"][b]]
    assert [tuple(pair) for pair in n["comm_inversions"]] == inverted
    assert row["verdict"] == (WRONG if n["comm_inversions"] or n["memory_inversions"] else HOLDS)


CHECKS = {name.removeprefix("check_").replace("_", "-"): check for name, check in globals().items()
          if name.startswith("check_")}


def test_every_claim_has_a_check_and_a_command():
    assert set(CHECKS) == {c.name for c in CLAIMS}
    for claim in CLAIMS:
        assert claim.command.startswith(("minigpt ", "for z in")), claim.command
        assert "minigpt " in claim.command and claim.where and claim.article


@pytest.mark.parametrize("name", FAST)
def test_fast_row(fast_report, name):
    row = by_name(fast_report)[name]
    CHECKS[name](row)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_slow_row(full_report, name):
    row = by_name(full_report)[name]
    CHECKS[name](row)


@pytest.mark.slow
def test_the_whole_command_runs_in_time_and_every_row_checks(full_report):
    assert full_report["wall_s"] < WALL_LIMIT_S, full_report["wall_s"]
    rows = by_name(full_report)
    assert list(rows) == [c.name for c in CLAIMS]
    for name in FAST:
        CHECKS[name](rows[name])


@pytest.mark.slow
def test_a_zero_row_counts_what_training_moves(tmp_path, fast_report):
    """zero2's volumes, counted from the schedule, are the bytes a real 2-rank run of its command moves."""
    row = by_name(fast_report)["zero2"]
    command = row["command"].split("; ")[1].split()[1:] + ["--out", str(tmp_path / "run")]
    summary = invoke(*command)
    measured = {kind: c["volume"] for kind, c in summary["comm_bytes_per_step"]["dp"].items() if c["volume"]}
    assert measured == row["numbers"]["volume"]["4"]


def test_docs_claims_md_is_the_commands_output(fast_report):
    """Rows that are neither timed nor computed by torch are the same on any machine: they must stand in the
    committed docs/claims.md as a fresh run writes them; every other row must at least be there, same verdict."""
    from cli.tools.claims import ClaimResult, Finding

    doc = (ROOT / "docs" / "claims.md").read_text(encoding="utf-8")
    claims = {c.name: c for c in CLAIMS}
    for name, row in by_name(fast_report).items():
        claim = claims[name]
        finding = Finding(row["ours"], row["verdict"], row["why"], row["numbers"], row["discussion"])
        line = markdown_row(ClaimResult(claim, finding, row["seconds"]))
        if not claim.needs_torch and not claim.timed:
            assert line in doc, f"docs/claims.md is stale for {name}: run minigpt claims --markdown docs/claims.md"
            assert row["discussion"] in doc
        else:
            assert f"| **{name}**: " in doc and f"**{row['verdict']}**" in doc
    for name in SLOW:
        assert f"| **{name}**: " in doc


def test_torch_free_rows_run_without_torch():
    code = ("import sys; from cli.tools.claims_registry import run_claims, select; "
            "run_claims([c for c in select() if not c.needs_torch]); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_the_table_names_each_command():
    result = CliRunner().invoke(main, ["claims", "--only", "bubble", "--only", "zero1"])
    assert result.exit_code == 0, result.output
    assert "$ minigpt schedule --pp 4 --micro-batches 8 --schedule 1f1b" in result.stdout
    assert "bubble:" in result.stdout and "zero1:" in result.stdout and "formats:" not in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--only", "nope"], "unknown claim 'nope'"),
    (["--only", "bubble", "--markdown", "MD"], "--markdown writes the whole table"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    args = [str(tmp_path / "x.md") if arg == "MD" else arg for arg in args]
    result = CliRunner().invoke(main, ["claims", *args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minigpt: error:") and message in lines[0]
    assert not (tmp_path / "x.md").exists()
