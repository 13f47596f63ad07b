"""`minigpt compare`: predicted against measured on a quick calibrated profile."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from cli.commands.compare import compare
from cli.main import Group


@click.group(cls=Group)
def group() -> None:
    """A throwaway group: cli/main.py registers the command for real."""


group.add_command(compare)

TINY = ["--layers", "2", "--seq-len", "32", "--batch-size", "4", "--steps", "3", "--threads-per-rank", "1"]
# How far the predicted step may be from the measured one, on a profile calibrated on a quiet machine that still
# runs at its calibrated speed, for the matrix's shape (the tiny preset, batch 16): the matrix is within 2-7% for
# one rank and dp 2 (docs/results.md; -3.8% and -8.8% on this session's Intel machine), and a short run's median
# step moves by 5-15% within minutes here (the same doc): 25%, plus the calibration's own noise, which the report
# states (`prediction_confidence`): two quick profiles of one machine predicted this step at 108 and 123 ms, -8.8% and
# +27.9% of the measured step. Not for TINY's 6 ms steps (2 layers, batch 4),
# which the simulator misses by about 60%: the per-step overheads it does not price are most of such a step.
STEP_TIME_BOUND = 0.25
DRIFT_TOLERANCE = 0.1  # cli/commands/compare.py asks for a recalibration past it (one thread's block)
CORES_DRIFT_TOLERANCE = 0.2  # and past this for the threads row's ratio (cli/tools/compare.py's drift_too_large)


def machine_moved(drift: dict) -> bool:
    cores = drift["cores"]
    return abs(drift["change"]) > DRIFT_TOLERANCE or (cores is not None and abs(cores["change"]) > CORES_DRIFT_TOLERANCE)


def invoke(*args: str):
    return CliRunner().invoke(group, ["compare", *args])


@pytest.fixture
def profile(quick_profile):
    return str(quick_profile)  # tests/conftest.py: one calibration for the session


def check_memory(rows):
    for row in rows:
        if row["name"].split()[0] in ("parameters", "gradients", "optimizer"):
            assert row["measured"] > 0 and abs(row["relative_error"]) <= 0.02, row


def test_one_rank_prints_a_table(profile, tmp_path):
    result = invoke("--hardware", profile, *TINY, "--out", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output + result.stderr
    for words in ("predicted", "measured", "step time", "compute", "communication", "parameters (rank 0)", "%",
                  "prediction confidence ±"):  # the calibration's noise, beside the step time (reliable or not)
        assert words in result.output
    assert (tmp_path / "run" / "trace.json").is_file() and (tmp_path / "run" / "simulated.json").is_file()


def test_dp2_json(profile, tmp_path):
    result = invoke("--hardware", profile, *TINY, "--dp", "2", "--out", str(tmp_path / "run"), "--json")
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads(result.stdout)
    assert report["predicted_step_time_s"] > 0 and report["measured_step_time_s"] > 0
    assert isinstance(report["step_time_relative_error"], float)
    assert report["layout"]["dp"] == 2
    check_memory(report["rows"])
    drift = report["machine_drift"]  # the calibration's reference block timed again before training
    assert drift["calibrated_s"] > 0 and drift["now_s"] > 0
    assert drift["change"] == pytest.approx(drift["now_s"] / drift["calibrated_s"] - 1)
    cores = drift["cores"]  # the threads row timed again (None: a one-core machine, whose profile has none)
    assert cores is None or (cores["now_ratio"] > 0 and cores["calibrated_ratio"] > 0
                             and cores["change"] == pytest.approx(cores["now_ratio"] / cores["calibrated_ratio"] - 1))
    confidence = report["prediction_confidence"]  # the profile records its noise; this machine's share now
    assert confidence["known"] and isinstance(confidence["reliable"], bool) and confidence["confidence"] >= 0
    assert 0 < confidence["cpu_share_now"] <= 1 and confidence["line"] in report["rows"][0]["note"]
    host = report["simulated_host"]  # 2 ranks, one thread each, busy but while they wait in their all-reduces
    assert host["threads_per_rank"] == 1 and 1 <= host["busy_ranks"] <= 2 and host["compute_slowdown"] > 0
    json.loads((tmp_path / "run" / "simulated.json").read_text())
    rows, b = {row["name"]: row for row in report["rows"]}, report["predicted_breakdown"]
    # the exposed dp time split where the measurement splits it (the last backward's end): nothing lost or counted twice
    assert rows["compute"]["predicted"] + rows["dp communication + optimizer"]["predicted"] == pytest.approx(
        b["compute"] + b["dp_comm"] + b["optimizer"])
    assert b["optimizer"] <= rows["dp communication + optimizer"]["predicted"] <= b["dp_comm"] + b["optimizer"]
    error = report["step_time_relative_error"]
    assert error == pytest.approx(report["predicted_step_time_s"] / report["measured_step_time_s"] - 1)


def test_the_predicted_step_is_within_its_bound_on_a_quiet_profile(profile, tmp_path):
    """dp 2 with the matrix's shape (the tiny preset, batch 16): on a profile calibrated on a quiet machine that
    still runs at its calibrated speed, the predicted step is within STEP_TIME_BOUND of the measured one, plus the
    calibration's stated noise, for the round of the median error of three (a burst of other work on this shared
    VM during one round's few steps took one round 38% off in a CI run; --rounds is compare's answer to it);
    otherwise the report says why it may not be."""
    result = invoke("--hardware", profile, "--steps", "4", "--threads-per-rank", "1", "--dp", "2", "--rounds", "3",
                    "--out", str(tmp_path / "run"), "--json")
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads(result.stdout)
    error, confidence, drift = (report["step_time_relative_error"], report["prediction_confidence"],
                                report["machine_drift"])
    # the machine timed before each round: a slowdown that began after the first shows before a later one (in a CI
    # run the median round measured 1.64x the prediction on a profile called quiet, that round's drift within bounds)
    moved = machine_moved(drift) or any(machine_moved(r["machine_drift"]) for r in report["rounds"])
    if confidence["reliable"] and not moved:  # the calibration's noise on top
        assert abs(error) <= STEP_TIME_BOUND + confidence["confidence"], (confidence, drift, report["rows"])
    else:
        assert "UNRELIABLE" in confidence["line"] or moved, confidence


def test_tp2_pairs_the_tensor_parallel_communication(profile, tmp_path):
    result = invoke("--hardware", profile, *TINY, "--tp", "2", "--out", str(tmp_path / "run"), "--json")
    assert result.exit_code == 0, result.output + result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)["rows"]}
    tp, compute = rows["tp communication"], rows["compute"]
    assert tp["predicted"] > 0 and tp["measured"] > 0  # timed inside the blocking collectives during training
    breakdown = json.loads(result.stdout)["measured_breakdown"]
    assert compute["measured"] == pytest.approx(breakdown["compute_s"] - breakdown["tp_s"])
    assert "pipeline p2p + bubble" not in rows and "dp communication + optimizer" in rows


def test_cp2_prices_the_exchange_inside_the_compute(profile, tmp_path):
    """Context parallelism on the calibrated host: its own units (one rank's two chunks, the ring's blocks timed
    alone) and the measured p2p for the ring's passes, which training runs inside its compute actions."""
    result = invoke("--hardware", profile, *TINY, "--cp", "2", "--out", str(tmp_path / "run"), "--json")
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads(result.stdout)
    rows = {row["name"]: row for row in report["rows"]}
    assert report["layout"]["cp"] == 2 and report["layout"]["cp_kind"] == "ring"
    exchange = rows["context-parallel exchange"]
    assert exchange["predicted"] > 0 and exchange["measured"] is None  # not apart from the compute it runs in
    assert rows["compute"]["predicted"] > exchange["predicted"] and rows["compute"]["measured"] > 0
    assert report["measured_step_time_s"] > 0 and report["predicted_step_time_s"] > 0
    check_memory(report["rows"])
    # what the forward keeps is 1/cp of one rank's (the exchange's buffers live in the backward only)
    assert abs(rows["activations (rank 0)"]["relative_error"]) <= 0.02, rows["activations (rank 0)"]


def test_moe_ep2_prices_its_own_unit_and_pairs_the_all_to_alls(profile, tmp_path):
    """tiny-moe at ep 2 (the quick profile measured its MoE unit): the MoE blocks priced by their own unit, the
    experts' all-to-alls by the measured all_to_all, and paired with the time training spent inside them."""
    result = invoke("--hardware", profile, "--model", "tiny-moe", "--dp", "2", "--ep", "2", "--batch-size", "4",
                    "--steps", "3", "--threads-per-rank", "1", "--out", str(tmp_path / "run"), "--json")
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads(result.stdout)
    assert report["layout"]["ep"] == 2 and report["simulated_host"]["units_measured"]
    assert "units_missing" not in report["simulated_host"]
    rows = {row["name"]: row for row in report["rows"]}
    exchange, breakdown = rows["expert all-to-all"], report["measured_breakdown"]
    assert exchange["predicted"] > 0 and exchange["measured"] == breakdown["ep_s"] > 0
    assert rows["compute"]["measured"] == pytest.approx(breakdown["compute_s"] - breakdown["tp_s"] - breakdown["ep_s"])
    check_memory(report["rows"])


def test_memory_of_one_rank_within_2_percent(profile, tmp_path):
    from cli.commands.compare import build_compare_config
    from cli.tools.compare import check_compare, run_compare

    options = dict(model="tiny", seq_len=32, layers=2, steps=2, global_batch=4, micro_batches=1, out=str(tmp_path / "r"),
                   device="auto", precision="fp32", tp=1, pp=1, dp=1, zero=0, schedule="1f1b", virtual_chunks=1,
                   threads_per_rank=1)
    report = run_compare(check_compare(build_compare_config(options), profile))
    check_memory(report["rows"])


@pytest.mark.parametrize("args, words", [
    (["--hardware", "/nonexistent/p.json"], "does not exist"),
    (["--dp", "128", "--batch-size", "128"], "do not fit"),
    (["--dp", "3"], "batch"),
    (["--tp", "3"], "--tp 3"),
    (["--matrix", "--tp", "2"], "--tp with --matrix"),  # it leaked into the rows that leave tp alone
    (["--matrix", "--no-reshard-after-forward"], "--no-reshard-after-forward with --matrix"),
])
def test_bad_input_before_any_worker(profile, tmp_path, monkeypatch, args, words):
    import parallel.run.train

    monkeypatch.setattr(parallel.run.train, "launch", lambda *a, **k: pytest.fail("a worker was started"))
    if args[0] != "--hardware":
        args = ["--hardware", profile, *args]
    result = invoke(*args, "--out", str(tmp_path / "run"))
    assert result.exit_code == 2, result.output + result.stderr
    assert words in result.stderr


def test_matrix_runs_every_layout_and_reports_the_error(profile, tmp_path, monkeypatch):
    """The machinery of --matrix on four of its layouts, a MoE row among them (the whole matrix takes minutes)."""
    import cli.tools.compare_matrix as matrix

    from minigpt.presets import preset

    assert {name for name in matrix.MATRIX if name.startswith("moe")} == {"moe 1 rank", "moe ep2", "moe ep2 x dp4 zero1"}
    assert matrix.moe_of(preset("tiny")) == preset("tiny-moe")  # as tiny-moe is to tiny
    chosen = ("1 rank", "pp2 1f1b", "llama 1 rank", "moe ep2")
    monkeypatch.setattr(matrix, "MATRIX", {name: matrix.MATRIX[name] for name in chosen})
    result = invoke("--hardware", profile, *TINY, "--matrix", "--rounds", "2", "--json", "--out", str(tmp_path / "m"))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [row["layout"] for row in report["rows"]] == list(chosen) and report["rounds"] == 2
    for row in report["rows"]:  # each layout twice, in round-1 and round-2 of its directory
        assert len(row["rounds"]) == 2 and row["measured_spread"] >= 0
        assert (tmp_path / "m" / row["layout"].replace(" ", "-") / "round-2" / "trace.json").is_file()
    order = sorted(chosen, key=lambda name: (tmp_path / "m" / name.replace(" ", "-") / "round-2").stat().st_mtime)
    assert order == list(reversed(chosen))  # the second round walks the matrix backwards
    errors = [abs(row["step_time_error"]) for row in report["rows"]]
    assert report["step_time_mape"] == pytest.approx(sum(errors) / len(chosen))
    # TINY's 2 layers of 32 tokens are no preset's shape: no row has a measured unit, and the matrix says so once
    assert "no measured unit of the shape of 4 row(s)" in result.stderr and "no preset has this shape" in result.stderr
    assert report["worst_model_state_error"] < 0.02  # predicted parameter/gradient/optimizer bytes
    assert len(report["machine_drift"]) == 2  # before the first layout and after the last
    assert report["prediction_confidence"]["known"]
    for row in report["rows"]:
        assert abs(row["activations_error"]) < 0.2
    assert report["plot"] == str(tmp_path / "m" / "compare.png")  # a panel per layout (tests/test_plots.py: the PNG)
    assert (tmp_path / "m" / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(row["phases"][0]["name"] == "step time" for row in report["rows"])


def test_the_drift_line_asks_for_a_recalibration_when_either_time_moved(capsys):
    from cli.commands.compare import echo_drift

    steady = {"reference": "one tiny block", "calibrated_s": 0.020, "now_s": 0.021, "change": 0.05,
              "cores": {"threads": 2, "calibrated_ratio": 0.62, "now_ratio": 0.66, "change": 0.66 / 0.62 - 1}}
    echo_drift(steady)
    assert "on 2 threads 0.66x of one thread's time now, 0.62x then (+6.5%)" in capsys.readouterr().out
    assert not machine_moved(steady)
    for moved in ({**steady, "change": -0.15},  # one thread's block: a throttled or busier machine
                  {**steady, "cores": {**steady["cores"], "calibrated_ratio": 1.06, "change": 0.66 / 1.06 - 1}}):
        echo_drift(moved)  # CI's profile: the cores beside this one were busy at calibration, free now
        assert "recalibrate for a fair comparison" in capsys.readouterr().out and machine_moved(moved)
    echo_drift({**steady, "cores": None})  # a one-core profile has no threads row
    assert "threads" not in capsys.readouterr().out
