"""`minigpt numerics --json` and `minigpt train --precision` through click's CliRunner."""

import json

import pytest
from click.testing import CliRunner

from cli.main import main


def test_numerics_json_reports_the_computed_facts():
    result = CliRunner().invoke(main, ["numerics", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    facts = {f["name"]: f for f in report["formats"]}
    assert facts["fp8_e4m3"]["max"] == 448
    assert facts["fp8_e5m2"]["max"] == 57344
    assert facts["fp16"]["smallest_subnormal"] == pytest.approx(5.96e-8, rel=1e-3)
    assert facts["fp16"]["smallest_normal"] == pytest.approx(6.10e-5, rel=1e-3)
    experiments = report["experiments"]
    assert experiments["a_underflow"]["flushed_to_zero"]
    assert experiments["b_swamping"]["fp16_addend_lost"] and not experiments["b_swamping"]["fp32_addend_lost"]
    assert experiments["c_overflow"]["fp16_is_inf"] and not experiments["c_overflow"]["bf16_is_inf"]
    assert experiments["d_master_weights"]["pure_fp16"]["gain_moved"] == 0.0


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8"])
def test_train_each_precision(tmp_path, precision):
    args = ["train", "--layers", "1", "--seq-len", "32", "--steps", "4", "--batch-size", "4", "--json"]
    result = CliRunner().invoke(main, args + ["--precision", precision, "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["precision"]["name"] == precision
    measured = summary["bytes_per_param"]["measured"]
    assert measured == {k: float(v) for k, v in summary["bytes_per_param"]["policy"].items()}
    assert all(loss == loss for loss in summary["losses"])  # no NaN
    if precision == "fp16":
        assert summary["loss_scale"] > 0


def test_bad_loss_scale_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["train", "--precision", "fp16", "--loss-scale", "huge", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
