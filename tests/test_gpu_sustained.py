"""bench/gpu_sustained.py, the lent GPU's sustained tensor-core rate, checked here in its CPU dry run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_sustained.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_the_dry_run_times_a_burst_and_windows_back_to_back(tmp_path):
    out = tmp_path / "sustained.json"
    done = run("--dry-run", "--seconds", "0.6", "--out", str(out))
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert (data["device"], data["m"], data["n"], data["k"]) == ("cpu (dry run)", 64, 128, 128)
    assert list(data["formats"]) == ["fp32"]  # the CPU runs its one format whatever --formats asks
    one = data["formats"]["fp32"]
    windows = one["windows"]
    assert len(windows) == 3  # 0.6 s in windows of 0.25 s
    assert all(b[0] > a[0] for a, b in zip(windows, windows[1:])) and all(rate > 0 for _, rate in windows)
    assert one["burst_flops_per_s"] > 0 and one["first_window_flops_per_s"] == windows[0][1]
    assert one["sustained_over_burst"] == one["last_10s_flops_per_s"] / one["burst_flops_per_s"]
    assert data["nvidia_smi"] is False and one["last_10s_gpu"] == {"sm_clock_mhz": None, "power_w": None,
                                                                  "temperature_c": None, "samples": 0}
    layer = data["layer"]  # the block's code path: measured on the CPU, priced on the h200 preset (not comparable)
    assert (layer["model"], layer["d_model"], layer["seq_len"]) == ("dry-run block", 64, 64)
    assert layer["burst_s"] > 0 and layer["last_10s_s"] > 0 and len(layer["windows"]) == 3
    predicted = layer["predicted"]
    assert predicted["preset"] == "h200" and predicted["ops"] > 20 and predicted["held_s"] >= predicted["burst_s"] > 0
    assert layer["measured_over_predicted"]["held"] == pytest.approx(layer["last_10s_s"] / predicted["held_s"])
    measured, priced = layer["classes"]["measured"], layer["classes"]["predicted"]  # the profiled iterations
    assert measured["iterations"] == 5 and measured["kernels"] > 20 and measured["gaps"] >= 0
    assert measured["gemm"] > 0 and measured["memory"] > 0 and measured["attention"] > 0  # SDPA's CPU kernel
    assert set(priced) == {"gemm", "attention", "memory", "overhead"} and all(v > 0 for v in priced.values())
    assert sum(priced.values()) == pytest.approx(predicted["held_s"])
    small = layer["small"]  # a block of short kernels (gpt2-124m x 8 on a GPU), profiled and priced by class too
    assert (small["model"], small["batch"], small["seq_len"]) == ("dry-run block", 2, 64)
    assert small["classes"]["measured"]["gemm"] > 0 and small["classes"]["measured"]["kernels"] > 20
    assert small["classes"]["predicted"]["gemm"] > priced["gemm"]  # twice the sequences: twice the GEMM work
    lines = done.stdout.strip().splitlines()
    assert "of the burst" in lines[0] and "h200 predicts" in lines[1] and len(lines) == 4
    assert lines[2].startswith("  by kernel class, ms an iteration, measured/predicted") and "gaps" in lines[2]
    assert lines[3].startswith("  dry-run block x 2, ms an iteration, measured/predicted")


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_sustained", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_kernels_are_classed_by_their_names_as_cublas_flash_attention_and_torch_name_them():
    kernel_class = load_script().kernel_class
    for name in ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_kernel",
                 "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", "cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32",
                 "ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_stages_64x3_tn", "splitKreduce_kernel"):
        assert kernel_class(name, True) == "gemm", name
    for name in ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>",
                 "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "fmha_cutlassF_bf16_aligned_64x128_rf_sm80",
                 "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"):
        assert kernel_class(name, True) == "attention", name
    for name in ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>",
                 "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>",
                 "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>"):
        assert kernel_class(name, True) == "memory", name
    assert kernel_class("aten::addmm", False) == "gemm" and kernel_class("aten::gelu", False) == "memory"
    assert kernel_class("aten::_scaled_dot_product_flash_attention_for_cpu", False) == "attention"


def test_the_block_by_class_is_its_ops_priced_one_by_one():
    from minigpt.presets import preset
    from simulator.costs.hardware import load_hardware

    script = load_script()
    gpt3 = script.predicted_layer(preset("gpt3-175b"), "h100-sxm", "bf16")
    classes, gpu = gpt3["classes"], load_hardware("h100-sxm").gpu
    assert sum(classes.values()) == pytest.approx(gpt3["held_s"])
    assert classes["overhead"] == pytest.approx(gpt3["ops"] * gpu.reached.kernel_overhead, rel=0.2)  # GEMM launches
    assert classes["gemm"] > classes["attention"] > 0 and classes["gemm"] > classes["memory"] > 0


def test_the_block_is_priced_as_the_simulator_prices_its_ops_held_and_in_a_burst():
    spec = importlib.util.spec_from_file_location("gpu_sustained", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from minigpt.presets import preset
    from simulator.costs.compute import op_time
    from simulator.costs.hardware import load_hardware
    gpt3 = script.predicted_layer(preset("gpt3-175b"), "h100-sxm", "bf16")
    gpu = load_hardware("h100-sxm").gpu
    share = gpu.reached.sustained("bf16")
    assert share < 1 and gpt3["burst_s"] < gpt3["held_s"] < gpt3["burst_s"] / share  # only tensor-core work slows
    assert script.predicted_layer(preset("gpt3-175b"), None, "bf16") is None  # no preset for this GPU
    from job.layout import Layout
    from precision.policy import policy
    from simulator.costs.op_types import Implementation
    from simulator.costs.ops import block_ops
    ops = block_ops(preset("gpt3-175b"), 1, Layout(), policy("bf16"), Implementation())
    accumulations = [op for op in ops.backward if op.name.endswith(".grad_accumulate")]
    assert len(accumulations) == 4 and gpt3["ops"] == len(ops.forward) + len(ops.backward) - 4
    everything = sum(op_time(op, gpu, gpu.matmul_efficiency) for op in (*ops.forward, *ops.backward))
    assert gpt3["held_s"] == pytest.approx(everything - sum(op_time(op, gpu, gpu.matmul_efficiency)
                                                            for op in accumulations))


def test_bad_input_exits_2_and_an_earlier_result_is_kept(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_sustained", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "sustained.json"
    out.write_text("earlier")
    new = str(tmp_path / "new.json")
    for args in (["--out", str(out)], *(["--seconds", bad, "--out", new] for bad in ("0", "-1", "nan", "inf")),
                 ["--formats", "bf16,int4", "--out", new], ["--formats", ",", "--out", new],
                 *(["--layer-seconds", bad, "--out", new] for bad in ("-1", "nan", "inf"))):
        with pytest.raises(SystemExit) as stop:
            script.main(["--dry-run", *args])
        assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "exists; give a new path" in err and err.count("must be a positive number of seconds") == 4
    assert err.count("takes a comma-separated list of bf16, fp16, fp8, fp8_fast, tf32, fp32") == 2
    assert err.count("--layer-seconds must be 0 or a positive number of seconds") == 3
    assert out.read_text() == "earlier" and not (tmp_path / "new.json").exists()
