"""`minigpt compare`'s prediction in the same breath: units timed again beside the training, rounds, a robust row."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.test_compare import invoke


@pytest.fixture
def profile(quick_profile):
    return str(quick_profile)  # tests/conftest.py: one calibration for the session


def test_retimed_units_are_the_runs_medians_at_the_micro_batch(profile):
    """Retimed.apply scales every series of the layout's unit so that at its micro-batch it is the median of the
    runs timed now, leaves the other units as the profile holds them, and notes the block against the profile's."""
    from job.layout import Layout
    from minigpt.presets import preset
    from parallel.calibrate.retime import Retimed
    from simulator.costs.hardware import load_hardware
    from simulator.costs.host import SPLIT_SERIES, UNIT_SERIES

    hardware = load_hardware(profile)
    host, model, layout = hardware.gpu.measured, preset("tiny"), Layout(tp=1, pp=1, dp=1)
    unit = host.unit_times(model, 1, dtype="fp32")
    assert unit is not None  # the quick profile measures tiny
    retimed = Retimed(model, micro_batch=4, repeats=2, min_run_s=0.0)
    retimed.time(host, layout)
    retimed.time(host, layout)  # before and after a training: the runs of both
    (series,) = retimed.runs.values()
    assert set(series) == {*UNIT_SERIES, *SPLIT_SERIES} and all(len(runs) >= 4 for runs in series.values())
    now, notes = retimed.apply(hardware, layout)
    fresh = now.gpu.measured.unit_times(model, 1, dtype="fp32")
    for name in (*UNIT_SERIES, *SPLIT_SERIES):  # zero-bubble's halves of the block's backward timed again too
        assert fresh.seconds(name, 4) == pytest.approx(statistics.median(series[name]), rel=1e-9)
        ratio = [new / old for new, old in zip(fresh.series[name], unit.series[name])]
        assert max(ratio) == pytest.approx(min(ratio), rel=1e-9)  # one factor along the series
    others = [u for u in host.units if u is not unit]
    assert others and all(u in now.gpu.measured.units for u in others)  # the profile's, untouched
    assert hardware.gpu.measured.unit_times(model, 1, dtype="fp32") is unit  # the profile itself is not changed
    (note,) = notes
    assert note["unit"] == "blocks" and note["now"] == pytest.approx(
        statistics.median(series["block_forward"]) + statistics.median(series["block_backward"]))
    assert note["profile"] == pytest.approx(unit.seconds("block_forward", 4) + unit.seconds("block_backward", 4))


def test_one_rank_on_several_threads_has_its_speed_up_timed_again(profile):
    """A one-rank layout on 2 threads: the block timed on 2 threads and on one, in turn, and the median ratio
    replaces the sharing table's (1, 2) row, which the simulation of that rank then uses."""
    from job.layout import Layout
    from minigpt.presets import preset
    from parallel.calibrate.retime import Retimed
    from simulator.costs.hardware import load_hardware

    hardware = load_hardware(profile)
    retimed = Retimed(preset("tiny"), micro_batch=4, repeats=3, min_run_s=0.0, threads=2)
    retimed.time(hardware.gpu.measured, Layout())
    assert len(retimed.ratios) == 1 and retimed.ratios[0] > 0
    now, notes = retimed.apply(hardware, Layout())
    assert now.gpu.measured.slowdown(1, 2) == retimed.ratios[0]
    assert [row for row in now.gpu.measured.sharing if row[:2] != (1, 2)] == [
        row for row in hardware.gpu.measured.sharing if row[:2] != (1, 2)]  # the ranks' rows stay the profile's
    assert notes[-1]["measure"] == "ratio" and notes[-1]["now"] == retimed.ratios[0]
    assert notes[-1]["profile"] == hardware.gpu.measured.slowdown(1, 2)
    two_ranks = Retimed(preset("tiny"), micro_batch=4, repeats=3, min_run_s=0.0, threads=2)
    two_ranks.time(hardware.gpu.measured, Layout(dp=2))
    assert two_ranks.ratios == []  # ranks sharing the cores: the profile's table


def test_a_shape_the_profile_did_not_measure_is_not_retimed(profile):
    from job.layout import Layout
    from minigpt.presets import preset
    from parallel.calibrate.retime import Retimed
    from simulator.costs.hardware import load_hardware

    hardware = load_hardware(profile)
    odd = preset("tiny").with_(n_layers=2, seq_len=32)  # no unit of this sequence length
    retimed = Retimed(odd, micro_batch=4, repeats=2, min_run_s=0.0)
    retimed.time(hardware.gpu.measured, Layout(tp=1, pp=1, dp=1))
    assert retimed.runs == {} and retimed.apply(hardware, Layout(tp=1, pp=1, dp=1)) == (hardware, [])


def test_the_row_is_the_round_of_the_median_error():
    from cli.tools.compare_matrix import matrix_row

    def report(predicted, measured):
        rows = [{"name": name, "relative_error": 0.0} for name in
                ("parameters (rank 0)", "gradients (rank 0)", "optimizer (rank 0)", "activations (rank 0)")]
        return {"predicted_step_time_s": predicted, "measured_step_time_s": measured,
                "step_time_relative_error": predicted / measured - 1, "rows": rows, "traces": {"measured": str(measured)}}

    rounds = [report(0.10, 0.10), report(0.12, 0.08), report(0.10, 0.125)]  # errors 0, +50%, -20%
    row = matrix_row("x", rounds)
    assert row["step_time_error"] == pytest.approx(0.0) and row["measured_step_time_s"] == 0.10
    assert row["measured_spread"] == pytest.approx((0.125 - 0.08) / 0.10)
    assert row["predicted_spread"] == pytest.approx((0.12 - 0.10) / 0.10)
    assert [r["step_time_error"] for r in row["rounds"]] == [r["step_time_relative_error"] for r in rounds]
    two = matrix_row("x", rounds[1:])  # an even count: the lower of the two middle errors
    assert two["step_time_error"] == pytest.approx(-0.2)
    assert matrix_row("x", rounds[:1])["measured_spread"] is None


def test_rounds_of_one_layout(profile, tmp_path):
    """--rounds 2: two trainings in round-1 and round-2, each priced with its own units timed beside it."""
    result = invoke("--hardware", profile, "--steps", "2", "--batch-size", "4", "--threads-per-rank", "1",
                    "--rounds", "2", "--out", str(tmp_path / "run"), "--json")
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads(result.stdout)
    assert [r["run_dir"] for r in report["rounds"]] == [str(tmp_path / "run" / f"round-{k}") for k in (1, 2)]
    assert report["step_time_relative_error"] == sorted(r["step_time_relative_error"] for r in report["rounds"])[0]
    assert all(r["machine_drift"]["now_s"] > 0 for r in report["rounds"])  # the machine timed before each round
    (units,) = report["units_now"]  # the tiny preset's blocks, timed again (one thread: no threads' ratio)
    assert units["now"] > 0 and units["profile"] > 0 and "timed beside the training" in report["rows"][0]["note"]
    text = invoke("--hardware", profile, "--steps", "2", "--batch-size", "4", "--threads-per-rank", "1",
                  "--rounds", "2", "--profile-units", "--out", str(tmp_path / "again"))
    assert text.exit_code == 0, text.output + text.stderr
    assert "2 rounds (the table is the round of the median error)" in text.output and "spread" in text.output
    assert "timed beside the training" not in text.output  # --profile-units: as calibrated


@pytest.mark.parametrize("rounds", ["0", "-1", "x"])
def test_bad_rounds_are_one_line(profile, tmp_path, rounds):
    result = invoke("--hardware", profile, "--rounds", rounds, "--out", str(tmp_path / "run"))
    assert result.exit_code == 2 and "--rounds" in result.stderr and not (tmp_path / "run").exists()
