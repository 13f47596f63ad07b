"""simulator/costs/rates/gemm_fit.py: a CUDA profile's GEMM model, fitted to the GEMMs calibrate timed, recovers a
model it was generated from, and on our own H200 measurement prices GEMMs it never saw far better than the
smallest-side table it replaces; calibrate shows the fit, and a CPU profile keeps its table."""

import copy
import json

import click
import pytest
from click.testing import CliRunner

from cli.commands.calibrate import echo_formats
from simulator.costs.compute import matmul_time
from simulator.costs.hardware import load_hardware
from simulator.costs.rates.gemm_fit import K0_GRID, add_gemm_model, fit_gemm, log_error, measured_points, model_seconds
from simulator.costs.rates.gemm_model import GemmFit
from independent import H200_RUN  # tests/ is on sys.path under pytest

PROFILE = H200_RUN / "gpu-profile-after-fix.json"  # calibrate on the lent H200, 2026-12-04 (no GEMM model then)
KERNELS = H200_RUN / "kernels.json"  # bench/gpu_kernels.py on the same GPU the same day
H200_SMS = 132  # NVIDIA H200 SXM: the GH100 configuration of the H100 SXM5 (NVIDIA H100 whitepaper)


def h200_gpu() -> dict:
    return copy.deepcopy(next(iter(json.loads(PROFILE.read_text())["gpus"].values())))


def test_the_shapes_are_calibrates_own():
    rates = {"square": {"64": 1e12}, "gpt": {"64": 2e12}}
    assert measured_points(rates) == [(64, 64, 64, 2 * 64 ** 3 / 1e12), (128, 256, 64, 2 * 128 * 256 * 64 / 2e12)]


def test_a_fit_recovers_the_model_its_points_come_from():
    true, sms, peak, launch = GemmFit(0.8, 64, 4e-6), 132, 1e15, 3e-6
    points = [(m, n, k, model_seconds(m, n, k, true, sms, peak, launch))
              for size in (64, 128, 256, 512, 1024, 2048, 4096, 8192)
              for m, n, k in ((size, size, size), (2 * size, 4 * size, size))]
    fit, error = fit_gemm(points, sms, peak, launch)
    assert (fit.k0, fit.fixed) == (64, 4e-6)
    assert fit.large == pytest.approx(0.8, abs=2e-4)
    assert error < 1e-3
    worse = GemmFit(0.8, 128, 4e-6)  # another k0 on the grid fits worse: the grid point is a real minimum
    assert 128 in K0_GRID and log_error(points, worse, sms, peak, launch) > 10 * error


def fitted_h200(tmp_path):
    gpu = add_gemm_model(h200_gpu(), H200_SMS)
    profile = json.loads(PROFILE.read_text())
    profile["gpus"] = {"cuda-calibrated": gpu}
    path = tmp_path / "fitted.json"
    path.write_text(json.dumps(profile))
    return load_hardware(str(path)).gpu, gpu


def mean_abs(errors):
    return sum(abs(e) for e in errors) / len(errors)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_on_the_h200_the_fit_prices_gemms_it_never_saw(tmp_path, fmt):
    """The fit comes from calibrate's 16 square and GPT-shaped GEMMs; the check is the 80 GEMMs of gpt2-124m and
    Llama 3 8B/70B/405B (tp 1-8) bench/gpu_kernels.py timed: through the simulator's own pricing (matmul_time) with
    the fitted profile, against the same profile's smallest-side table."""
    fitted, entry = fitted_h200(tmp_path)
    table = load_hardware(str(PROFILE)).gpu
    shapes = [r for r in json.loads(KERNELS.read_text())["gemm"]["shapes"] if r["format"] == fmt]
    assert len(shapes) == 80

    def errors(gpu):
        return [matmul_time(2 * r["m"] * r["n"] * r["k"], r["m"], r["n"], r["k"], gpu, fmt,
                            profile=gpu.matmul_efficiency) / r["seconds"] - 1 for r in shapes]

    fit_errors, table_errors = errors(fitted), errors(table)
    assert mean_abs(fit_errors) < 0.10  # bf16 7.0%, fp8 9.1%
    assert mean_abs(table_errors) > 2.0  # bf16 206%, fp8 306%: short sides priced as tiny squares
    assert max(abs(e) for e in fit_errors) < 0.6
    assert entry["calibration"]["formats"][fmt]["gemm_fit"]["points"] == 16
    head = next(r for r in shapes if r["model"] == "gpt2-124m" and r["gemm"] == "head" and r["tp"] == 1)
    by_fit, by_table = (matmul_time(2 * head["m"] * head["n"] * head["k"], head["m"], head["n"], head["k"], gpu, fmt,
                                    profile=gpu.matmul_efficiency) / head["seconds"] - 1 for gpu in (fitted, table))
    assert abs(by_fit) < 0.2 and by_table > 1.0  # bf16 -6% against +121%, fp8 -19% against +298%


def test_every_measured_format_is_fitted_and_calibrate_says_so(tmp_path):
    gpu = add_gemm_model(h200_gpu(), H200_SMS)
    model = gpu["matmul_efficiency"]["gemm_model"]
    assert model["sms"] == H200_SMS
    assert set(model) - {"sms", "source"} == {"fp32", "tf32", "bf16", "fp16", "fp8"}
    for fmt in ("fp32", "tf32", "bf16", "fp16", "fp8"):
        assert 0 < model[fmt]["large"] <= 1
        assert gpu["calibration"]["formats"][fmt]["gemm_fit"]["rms_log_error"] < 0.25

    @click.command()
    def show():
        echo_formats(gpu, gpu["calibration"])

    out = CliRunner().invoke(show).output
    assert out.count("GEMM model by shape (fitted to its 16 GEMMs") == 5
    assert f"large {model['bf16']['large']:.3f}, k0 {model['bf16']['k0']}" in out


def test_a_format_not_measured_is_not_fitted_and_without_any_there_is_no_model():
    gpu = h200_gpu()
    gpu["calibration"]["formats"]["fp8"] = {"status": "refused by the device: no fp8"}
    assert "fp8" not in add_gemm_model(gpu, H200_SMS)["matmul_efficiency"]["gemm_model"]
    bare = h200_gpu()
    bare["calibration"]["formats"] = {fmt: {"status": "not measured"} for fmt in bare["calibration"]["formats"]}
    assert "gemm_model" not in add_gemm_model(bare, H200_SMS)["matmul_efficiency"]


def test_no_points_no_fit():
    with pytest.raises(ValueError, match="needs measured GEMMs"):
        fit_gemm([], 132, 1e15, 0.0)


def test_gpu_sh_summary_names_the_fit():
    """bench/gpu.sh's summary line for the calibrate step says the profile carries a fitted GEMM model."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_summary", H200_RUN.parents[2] / "bench" / "gpu_summary.py")
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    fitted = json.loads(PROFILE.read_text()) | {"gpus": {"cuda-calibrated": add_gemm_model(h200_gpu(), H200_SMS)}}
    line = summary.calibrate(fitted)
    assert "GEMM model fitted (rms): fp32 13%, tf32 15%, bf16 14%, fp16 15%, fp8 16%" in line
    assert "GEMM model" not in summary.calibrate(json.loads(PROFILE.read_text()))  # as calibrated on 2026-12-04


def test_the_fit_reads_the_shapes_calibrate_times(monkeypatch):
    """measured_points turns a profile's rates back into (m, n, k): the shapes parallel/calibrate/device.py times
    under those names, checked against the calls it makes (each faked to take one second)."""
    import torch

    import parallel.calibrate.device as device
    from parallel.calibrate.measure import make_plan

    calls = []

    def fake_gemm(fmt, m, n, k, where, min_run_s, repeats):
        calls.append((m, n, k))
        return {"flops_per_s": 2.0 * m * n * k, "spread": 0.0}  # every GEMM one second

    monkeypatch.setattr(device, "time_gemm", fake_gemm)
    rates, _ = device.format_rates(make_plan(1, quick=True), torch.device("cpu"), "fp32")
    points = measured_points(rates)
    assert sorted((m, n, k) for m, n, k, _ in points) == sorted(calls) and len(calls) == 2 * len(rates["square"])
    assert all(seconds == 1.0 for *_, seconds in points)
