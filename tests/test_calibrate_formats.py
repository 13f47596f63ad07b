"""`minigpt calibrate`'s CUDA-only paths checked on the CPU: per-format peaks and tables, --device cuda,
--formats, and the link figures of a one-rank profile. The ranks' measurements are faked (no GPU here)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from minigpt.presets import preset
from minigpt.errors import ConfigError
from parallel.calibrate.measure import FORMATS, build_profile, default_formats, make_plan
from simulator.engine.simulate import simulate_step
from simulator.costs.hardware import FLOP_FORMATS, load_hardware, preset_for_device, preset_links
from job.layout import Layout
from simulator.network.topology import build_cluster
from independent import H200_RUN  # tests/ is on sys.path under pytest
from test_calibrate_host import H200, fake_rank

RTX = {**H200, "name": "NVIDIA GeForce RTX 4090"}
SIZES = (256, 1024, 4096)


def write(profile: dict, tmp_path, name: str = "profile.json"):
    path = tmp_path / name
    path.write_text(json.dumps(profile))
    return load_hardware(str(path))


def h200_profile(**changes) -> dict:
    plan = make_plan(1, quick=True)
    rank = fake_rank(0, H200, formats=changes.pop("formats", FORMATS), refused=changes.pop("refused", None))
    return build_profile([rank], plan, "cuda-calibrated", 16, "2030-01-01", **changes)


def test_the_formats_are_the_simulators():
    assert FORMATS == FLOP_FORMATS
    assert default_formats(torch.device("cuda", 0)) == FORMATS and default_formats(torch.device("cpu")) == ("fp32",)


def test_every_measured_format_gets_its_own_peak_and_table(tmp_path):
    profile = h200_profile(links_from=preset_links("NVIDIA H200"))
    (gpu,) = profile["gpus"].values()
    scale = {"fp32": 1, "tf32": 8, "bf16": 16, "fp16": 16, "fp8": 32}  # fake_rank's rates
    for fmt in FORMATS:  # the best rate measured in the format: the GPT-shaped matmul at 4096
        assert gpu["peak_flops"][fmt] == pytest.approx(5e13 * scale[fmt])
        assert [n for n, _ in gpu["matmul_efficiency"][fmt]] == list(SIZES)
        assert gpu["matmul_efficiency"][fmt][-1][1] == pytest.approx((4e13 + 5e13) / 2 / 5e13)
        assert gpu["calibration"]["formats"][fmt]["status"] == "measured"
    assert gpu["calibration"]["formats"]["bf16"]["of_datasheet"] == pytest.approx(8e14 / 989.4e12, rel=1e-3)
    assert "not the datasheet's" in gpu["source"] and "allow_tf32 = False" in gpu["calibration"]["peak_note"]
    hardware = write(profile, tmp_path)
    assert set(hardware.gpu.matmul_efficiency.points) == set(FORMATS)
    assert hardware.gpu.flops("bf16") == pytest.approx(8e14)


def test_a_bf16_simulation_runs_on_the_measured_bf16_numbers(tmp_path):
    from simulator.costs.compute import Matmul

    hardware = write(h200_profile(links_from=preset_links("NVIDIA H200")), tmp_path)
    table = hardware.gpu.matmul_efficiency
    mm = Matmul("fc1", 4096, 4096, 4096, "bf16")
    expected = mm.flops / (8e14 * table.efficiency("bf16", 4096)) + table.launch_latency
    assert mm.time(hardware.gpu, table) == pytest.approx(expected)  # the bf16 peak and table, not fp32's
    for precision in ("bf16", "fp8", "fp32"):
        result = simulate_step(preset("tiny"), Layout(), build_cluster(hardware, 1, 1), precision, 8, 8,
                               profile=table, gpu=hardware)
        assert result.step_time_s > 0


def test_a_refused_format_has_no_peak_and_the_simulator_says_so(tmp_path):
    profile = h200_profile(formats=("fp32", "tf32", "bf16", "fp16"), refused={"fp8": "no fp8 on this GPU"})
    (gpu,) = profile["gpus"].values()
    assert gpu["peak_flops"]["fp8"] is None and "fp8" not in gpu["matmul_efficiency"]
    assert gpu["calibration"]["formats"]["fp8"]["status"] == "refused by the device: no fp8 on this GPU"
    assert gpu["source"].endswith("not measured: fp8 (calibration.formats says why)")
    hardware = write(profile, tmp_path)
    with pytest.raises(ConfigError, match="no fp8"):
        simulate_step(preset("tiny"), Layout(), build_cluster(hardware, 1, 1), "fp8", 8, 8, gpu=hardware)


def test_one_gpu_takes_its_links_from_the_matching_preset(tmp_path):
    assert preset_for_device("NVIDIA H200") == "h200" and preset_for_device("NVIDIA GeForce RTX 4090") is None
    hardware = write(h200_profile(links_from=preset_links("NVIDIA H200")), tmp_path)
    h200 = load_hardware("h200")
    assert (hardware.gpu.nvlink_bandwidth, hardware.gpu.nvlink_latency) == (h200.gpu.nvlink_bandwidth,
                                                                           h200.gpu.nvlink_latency)
    assert (hardware.node.gpus_per_node, hardware.node.nics_per_node) == (8, 8)
    assert hardware.nic.bandwidth == h200.nic.bandwidth and "preset ndr" in hardware.nic.source
    note = hardware.gpu.calibration
    assert note["links"].startswith("not measured (one rank), from preset h200's datasheet figures")
    assert note["links_preset"] == "h200"


def test_one_gpu_takes_the_presets_attention_table_over_its_measured_peak(tmp_path):
    """A CUDA profile's attention is its preset's FlashAttention table at the same TFLOP/s over the measured bf16
    peak, and none without a matching preset."""
    h200 = load_hardware("h200").gpu
    hardware = write(h200_profile(links_from=preset_links("NVIDIA H200")), tmp_path)
    table = hardware.gpu.attention_efficiency
    assert table.kernel == h200.attention_efficiency.kernel and "not measured here" in table.source
    for head, seq in ((64, 1024), (128, 2048), (128, 16384)):  # the same TFLOP/s: share x peak unchanged
        assert table.fraction(head, seq) * hardware.gpu.flops("bf16") == pytest.approx(
            h200.attention_efficiency.fraction(head, seq) * h200.flops("bf16"), rel=1e-3)
    rtx = build_profile([fake_rank(0, RTX, formats=FORMATS)], make_plan(1, quick=True), "x", 16, "2030-01-01", None)
    assert "attention_efficiency" not in rtx["gpus"]["x"]


def test_a_cuda_calibration_measures_the_attention_kernel_and_prefers_it_to_the_preset(tmp_path):
    """On CUDA rank 0 times torch's SDPA at FlashAttention-2's benchmark shapes (measure_attention_rates); the profile's
    table is those rates over the measured bf16 peak, not the preset's. The function itself runs here on the CPU at
    tiny sizes (the GPU sizes are the preset tables' own)."""
    from parallel.calibrate.kernels import ATTENTION_HEAD_DIMS, ATTENTION_SEQS, measure_attention_rates

    assert ATTENTION_HEAD_DIMS == (64, 128) and ATTENTION_SEQS == (512, 1024, 2048, 4096, 8192)
    rates = measure_attention_rates(torch.device("cpu"), 0.001, 1, head_dims=(8, 16), seqs=(32, 64), width=32,
                                    tokens=128)
    assert set(rates) == {"8", "16"} and all([s for s, _ in points] == [32, 64] and all(r > 0 for _, r in points)
                                             for points in rates.values())
    plan = make_plan(1, quick=True)
    rank = fake_rank(0, H200, formats=FORMATS)
    rank["attention"] = {"64": [[1024, 2.4e14], [8192, 4.0e14]], "128": [[1024, 3.6e14], [8192, 5.2e14]]}
    profile = build_profile([rank], plan, "cuda-calibrated", 16, "2030-01-01", preset_links("NVIDIA H200"))
    table = write(profile, tmp_path).gpu.attention_efficiency
    assert table.kernel == "torch SDPA" and "measured by minigpt calibrate" in table.source
    assert table.fraction(128, 8192) == pytest.approx(5.2e14 / 8e14, abs=1e-4)  # over fake_rank's bf16 peak
    assert table.fraction(64, 1024) == pytest.approx(0.3, abs=1e-4)


def test_the_h200_measurement_of_2026_12_04_with_and_without_the_attention_table(tmp_path):
    """The profile `bench/gpu.sh` wrote on a lent H200 (docs/measurements/h200-2026-12-04), before the table was
    carried: attention priced as square GEMMs at the head size (its measured efficiency at 64: launch-bound tiny
    matmuls) put gpt2-124m's bf16 step at 3.97 s against the 42.6 ms measured in the same run (compare.json). With
    the preset's table the prediction lands within 25% of the measurement (docs/results.md)."""
    from parallel.calibrate.kernels import preset_attention

    profile = json.loads((H200_RUN / "gpu-profile.json").read_text())
    measured = json.loads((H200_RUN / "compare.json").read_text())["measured_step_time_s"]
    gpu = profile["gpus"]["cuda-calibrated"]
    assert "attention_efficiency" not in gpu

    def step() -> float:
        hardware = write(profile, tmp_path)
        return simulate_step(preset("gpt2-124m"), Layout(), build_cluster(hardware, 1, 1), "bf16", 8, 8,
                             profile=hardware.gpu.matmul_efficiency, gpu=hardware).step_time_s

    before = step()
    gpu["attention_efficiency"] = preset_attention(preset_links("NVIDIA H200"), gpu["peak_flops"]["bf16"])
    after = step()
    assert before > 50 * measured and abs(after / measured - 1) < 0.25


def test_the_h200_profile_with_bf16_units_prices_a_bf16_step_from_them(tmp_path):
    """The third H200 call (docs/measurements/h200-2026-12-04/*-bf16-units.json): calibrate timed the units in fp32
    and bf16; a bf16 simulation of gpt2-124m takes the bf16 units (no roofline), and lands within 5% of the step
    compare measured in the same call (+0.3%), its optimizer priced as our MasterAdamW's passes within 20% of the
    time measured after the last backward (3.13 against 3.60 ms; one fused pass, as priced before, gave 0.84)."""
    profile = json.loads((H200_RUN / "gpu-profile-bf16-units.json").read_text())
    measured = json.loads((H200_RUN / "compare-bf16-units.json").read_text())
    units = profile["gpus"]["cuda-calibrated"]["measured"]["units"]
    assert sorted(u["dtype"] for u in units) == ["bf16", "fp32"]
    hardware = write(profile, tmp_path)
    result = simulate_step(preset("gpt2-124m"), Layout(), build_cluster(hardware, 1, 1), "bf16", 8, 8,
                           profile=hardware.gpu.matmul_efficiency, gpu=hardware)
    assert result.host["units_measured"] and "units_missing" not in result.host
    assert abs(result.step_time_s / measured["measured_step_time_s"] - 1) < 0.05
    after_backward = measured["measured_breakdown"]["dp_s"]
    assert abs(result.breakdown["optimizer"] / after_backward - 1) < 0.20


def test_without_a_matching_preset_the_copy_bandwidth_placeholder_says_so(tmp_path):
    profile = build_profile([fake_rank(0, RTX)], make_plan(1, quick=True), "x", 16, "2030-01-01", None)
    (gpu,) = profile["gpus"].values()
    assert gpu["nvlink_bandwidth"] == 4e12 / 2 and gpu["nvlink_latency"] == 0.0
    assert "placeholder" in gpu["calibration"]["links"] and gpu["calibration"]["links_preset"] is None
    assert "placeholder" in next(iter(profile["nics"].values()))["source"]
    write(profile, tmp_path)


def test_measured_collectives_win_over_a_preset():
    plan = make_plan(2, quick=True)
    profile = build_profile([fake_rank(0, H200), fake_rank(1, H200)], plan, "x", 16, "2030-01-01",
                            preset_links("NVIDIA H200"))
    (gpu,) = profile["gpus"].values()
    assert gpu["calibration"]["links"].startswith("measured") and gpu["nvlink_bandwidth"] != 450e9
    assert gpu["calibration"]["datasheet_preset"] == "h200"


# ---------------------------------------------------------------- the command line


def invoke(*args: str):
    from test_calibrate import invoke as calibrate_invoke

    return calibrate_invoke(*args)


@pytest.mark.parametrize("args, words", [
    (["--device", "cuda"], "--device cuda was asked for but torch sees no CUDA device"),
    (["--formats", "fp32,tf32", "--device", "cpu"], "--formats tf32 needs CUDA"),
    (["--formats", "bf16"], "--formats must include fp32"),
    (["--formats", "fp32,int8"], "--formats must be distinct formats among"),
    (["--formats", "fp32,fp32"], "--formats must be distinct formats among"),
])
def test_cuda_and_format_requests_are_one_line_before_any_rank(tmp_path, monkeypatch, args, words):
    import parallel.calibrate.measure

    monkeypatch.setattr(parallel.calibrate.measure, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    result = invoke("--out", str(tmp_path / "p.json"), "--ranks", "1", *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minigpt: error:") and words in lines[0], result.stderr


def test_device_cuda_without_cuda_exits_2_from_the_real_command_line(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "cli", "calibrate", "--device", "cuda", "--out",
                             str(tmp_path / "p.json")], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().count("\n") == 0 and "no CUDA device" in result.stderr
    assert not (tmp_path / "p.json").exists()


def test_a_one_gpu_cuda_calibration_prints_every_format_and_where_the_links_come_from(tmp_path, monkeypatch):
    import parallel.calibrate.measure

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    plans = []
    monkeypatch.setattr(parallel.calibrate.measure, "calibrate",
                        lambda plan: plans.append(plan) or [fake_rank(0, H200, formats=FORMATS)])
    path = tmp_path / "gpu.json"
    result = invoke("--out", str(path), "--device", "cuda", "--quick", "--allow-busy")
    assert result.exit_code == 0, result.output
    assert plans[0].ranks == 1 and plans[0].device == "cuda" and plans[0].formats is None  # all, on the GPU
    assert "links: not measured (one rank), from preset h200's datasheet figures" in result.output
    for fmt in FORMATS:
        assert f"  {fmt:<5} peak (best measured)" in result.output
    assert "of preset h200's datasheet" in result.output
    assert result.output.count("GEMM model by shape (fitted to its") == len(FORMATS)  # the device's 132 SMs
    hardware = load_hardware(str(path))
    assert hardware.gpu.peak_flops["bf16"] > hardware.gpu.peak_flops["fp32"]
    model = hardware.gpu.matmul_efficiency.gemm  # GEMMs priced by shape, not by the smallest side
    assert model.sms == 132 and all(model.fit(fmt) is not None for fmt in FORMATS)


def test_the_cpu_dry_run_measures_the_formats_asked_for_and_simulates_bf16(tmp_path):
    """The per-format path for real, at CPU sizes: what bench/gpu.sh's dry run calibrates with."""
    from cli.main import main

    path = tmp_path / "cpu.json"
    result = invoke("--out", str(path), "--ranks", "1", "--quick", "--allow-busy", "--device", "cpu", "--formats", "fp32,bf16,fp8",
                    "--micro-batches", "1,2")
    assert result.exit_code == 0, result.output
    assert "not measured (one rank) and no preset matches the device" in result.output  # the placeholder, said
    (gpu,) = json.loads(path.read_text())["gpus"].values()
    assert gpu["peak_flops"]["bf16"] > 0 and gpu["peak_flops"]["fp8"] > 0
    assert "gemm_model" not in gpu["matmul_efficiency"] and "GEMM model" not in result.output  # no SMs on a CPU
    assert gpu["peak_flops"]["tf32"] == gpu["peak_flops"]["fp32"]
    # fp16 not measured: a CPU emulates it with fp32 matmuls (precision/compute.py), so fp32's rates stand for it
    assert gpu["peak_flops"]["fp16"] == gpu["peak_flops"]["fp32"]
    assert gpu["matmul_efficiency"]["fp16"] == gpu["matmul_efficiency"]["fp32"]
    assert gpu["calibration"]["formats"]["fp16"]["status"].startswith("emulated")
    assert {"fp32", "bf16", "fp8"} <= set(gpu["matmul_efficiency"])
    assert "precision/compute.py emulates 16-bit matmuls with fp32 ones" in gpu["source"]
    assert "fp32, bf16, fp8 matmuls on the CPU" in gpu["source"] and "bf16, fp8 measured with torch's native" in \
        gpu["source"] and gpu["source"].endswith("not measured: fp16 (calibration.formats says why)")
    assert all(unit["dtype"] == "fp32" for unit in gpu["measured"]["units"])
    cli = CliRunner().invoke(main, ["simulate", "--hardware", str(path), "--model", "tiny", "--precision", "bf16",
                                    "--json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.output)["step_time_s"] > 0
