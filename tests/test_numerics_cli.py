"""`minigpt numerics --json` and `minigpt train --precision` through click's CliRunner.

Every number is checked against a value derived here: the formats' bit layouts by hand, the master-weights
experiment redone with torch.optim.AdamW (tests/independent.py), and a mixed-precision run against the
same run in fp32.
"""

import json
import math

import pytest
from click.testing import CliRunner

from cli.main import main
from independent import master_weights_reference


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

    # (a) fp16's smallest subnormal is 2^-14 x 2^-10 = 2^-24: a 1e-8 gradient is under half of it and becomes 0.
    # Scaled by 2^16 it is 6.6e-4, a normal fp16 number (above 2^-14), stored to 11 significant bits: back in fp32
    # it is 1e-8 within 2^-11.
    a = experiments["a_underflow"]
    assert (a["gradient"], a["scale"]) == (1e-8, 2.0**16) and a["fp16_smallest_subnormal"] == 2.0**-24
    assert 1e-8 < 2.0**-25 and a["fp16_value"] == 0.0 and a["flushed_to_zero"]
    assert a["scaled_fp16_value"] == pytest.approx(1e-8 * 2**16, rel=2.0**-11)
    assert a["recovered_fp32_value"] == pytest.approx(1e-8, rel=2.0**-11)
    assert a["recovered_relative_error"] == pytest.approx(abs(a["recovered_fp32_value"] - 1e-8) / 1e-8)

    # (b) At 0.5 = 2^-1 the spacing is 2^(-1-m) for m mantissa bits: fp16 (10) 2^-11 and bf16 (7) 2^-8, whose halves
    # exceed 1e-7, so 0.5 + 1e-7 rounds back to 0.5; fp32 (23): spacing 2^-24 = 5.96e-8, and 1e-7 is 1.68 of those,
    # rounded to 2: the sum is 0.5 + 2^-23.
    b = experiments["b_swamping"]
    assert b["fp16_sum"] == b["bf16_sum"] == 0.5 and b["fp32_sum"] == 0.5 + 2.0**-23
    assert (b["fp16_ulp_at_base"], b["bf16_ulp_at_base"], b["fp32_ulp_at_base"]) == (2.0**-11, 2.0**-8, 2.0**-24)
    assert b["fp16_addend_lost"] and b["bf16_addend_lost"] and not b["fp32_addend_lost"]

    # (c) 70000 is past fp16's largest, (2 - 2^-10) 2^15 = 65504: inf. bf16 has fp32's exponents and 7 mantissa
    # bits: on [2^16, 2^17) its spacing is 2^(16-7) = 512, and 70000 / 512 = 136.7 rounds to 137 x 512 = 70144.
    # e4m3 has no infinity and saturates at 448; e5m2's largest is 57344, so it overflows to inf.
    c = experiments["c_overflow"]
    assert c["fp16_max"] == (2 - 2.0**-10) * 2**15 == 65504 and c["fp16_value"] == "inf" and c["fp16_is_inf"]
    assert c["bf16_value"] == 137 * 512 == 70144 and not c["bf16_is_inf"]
    assert c["bf16_relative_error"] == pytest.approx(144 / 70000)
    assert c["fp8_e4m3_value"] == 448 and c["fp8_e5m2_value"] == "inf"

    # (d) The same training with PyTorch's own AdamW: fp16 weights never move (every update, about lr = 1e-4, is
    # under half the spacing at 1.0, 2^-11 / 2), fp32 masters learn -- the loss falls as the reference's does.
    d = experiments["d_master_weights"]
    pure, master = master_weights_reference(False), master_weights_reference(True)
    assert d["fp16_half_spacing_at_1"] == 2.0**-12 * 2 and d["lr"] < 2.0**-12
    assert d["pure_fp16"]["gain_moved"] == pure["gain_moved"] == 0.0
    assert d["pure_fp16"]["loss_ratio"] == pytest.approx(pure["loss_ratio"], rel=1e-3) and pure["loss_ratio"] > 0.99
    assert d["fp32_master"]["first_loss"] == pytest.approx(master["first_loss"], rel=1e-6)
    assert d["fp32_master"]["final_loss"] == pytest.approx(master["final_loss"], rel=1e-2)
    assert d["fp32_master"]["loss_ratio"] < 0.5 and master["loss_ratio"] < 0.5


TRAIN = ["train", "--layers", "1", "--seq-len", "32", "--steps", "4", "--batch-size", "4", "--eval-every", "0", "--eval-batches", "1",
         "--json"]  # one validation batch, at the end: fp8 matmuls on a CPU take a second each


def train_summary(out, precision: str) -> dict:
    result = CliRunner().invoke(main, TRAIN + ["--precision", precision, "--out", str(out / "r")])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory) -> list[float]:
    """The same run in plain fp32: what the mixed-precision runs must track."""
    summary = train_summary(tmp_path_factory.mktemp("fp32"), "fp32")
    assert summary["compute_path"] == "native"
    return summary["losses"]


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8"])
def test_train_each_precision(tmp_path, precision, fp32_losses):
    summary = train_summary(tmp_path, precision)
    assert summary["precision"]["name"] == precision
    # 16-bit weights and gradients, fp32 masters and AdamW moments: 2 + 2 + 4 + 4 + 4 bytes a parameter (fp8
    # multiplies in fp8 but keeps bf16 weights).
    measured = summary["bytes_per_param"]["measured"]
    assert measured == {"compute": 2, "grad": 2, "master": 4, "adam_m": 4, "adam_v": 4}
    assert measured == {k: float(v) for k, v in summary["bytes_per_param"]["policy"].items()}
    losses = summary["losses"]
    assert len(losses) == 4
    # An untrained model predicts the 256 byte values about uniformly: a first loss of ln 256 = 5.545.
    assert losses[0] == pytest.approx(math.log(256), abs=0.05)
    # It learns: after 4 steps the loss is 0.4 below that (English text's bytes are far from uniform)...
    assert losses[-1] < math.log(256) - 0.4
    # ...as the fp32 run learns: the 16-bit (and fp8) rounding moves no loss by more than 0.02.
    assert losses == pytest.approx(fp32_losses, abs=0.02)
    if precision == "fp16":
        # the dynamic loss scaler starts at 2^16 and grows only after 1000 clean steps: 4 clean steps leave it there
        assert summary["loss_scale"] == 2.0**16 and summary["skipped_steps"] == 0


def test_bad_loss_scale_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["train", "--precision", "fp16", "--loss-scale", "huge", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
