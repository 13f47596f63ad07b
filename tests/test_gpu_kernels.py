"""bench/gpu_kernels.py's CPU dry run, run as bench/gpu.sh runs it: `python bench/gpu_kernels.py` with only
the repository root on PYTHONPATH (no install) and no CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_kernels.py"


def bare_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return env


def run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "kernels.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], cwd=tmp_path, env=bare_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result, json.loads(out.read_text())


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    return run(tmp_path_factory.mktemp("kernels"))  # no CUDA here: the dry run without asking


def test_the_dry_run_measures_every_section_at_tiny_sizes(dry_run):
    result, report = dry_run
    assert report["dry_run"] is True and report["device"]["type"] == "cpu" and report["seconds"] < 20
    assert set(report["best_tflops"]) == {"fp32", "bf16", "fp16", "fp8", "fp8_fast"}  # no TF32 on a CPU
    square = report["gemm"]["square"]
    assert sorted({r["m"] for r in square}) == [64, 128, 256] and report["refused"] == [] and report["skipped"] == []
    shapes = report["gemm"]["shapes"]
    assert {r["model"] for r in shapes} == {"gpt2-124m", "llama3-8b", "llama3-70b", "llama3-405b"}
    assert {r["tp"] for r in shapes} == {1, 2, 4, 8} and {r["format"] for r in shapes} == {"bf16", "fp8", "fp8_fast"}
    assert all(r["m"] % 16 == 0 and r["n"] % 16 == 0 and r["k"] % 16 == 0 for r in shapes)
    for fmt, best in report["best_tflops"].items():  # efficiency is against the format's best rate in the run
        rows = [r for r in square + shapes if r["format"] == fmt]
        assert max(r["efficiency"] for r in rows) == pytest.approx(1.0)
        assert max(r["tflops"] for r in rows) == pytest.approx(best)
    assert len(report["elementwise"]["results"]) == 10 and report["elementwise"]["best_bytes_per_s"] > 0
    assert report["launch"]["per_launch_s"] > 0
    attention = report["attention"]
    assert len(attention) == 2 * 2 * 4 and {r["head_dim"] for r in attention} == {64, 128}
    assert {(r["kernel"], r["pass"]) for r in attention} == {(k, p) for k in ("sdpa", "unfused")
                                                             for p in ("forward", "forward+backward")}
    wgrad = report["gemm"]["wgrad"]  # every weight-gradient shape three ways, each shape / 64 rounded up to 16
    assert {(r["gemm"], r["way"]) for r in wgrad} == {(g, w) for g in ("gpt3-175b tp4 qkv", "gpt3-175b tp4 proj",
                                                                       "gpt3-175b tp4 fc1", "llama3-70b tp8 qkv",
                                                                       "llama3-70b tp8 o", "llama3-70b tp8 gate_up",
                                                                       "llama3-70b tp8 down")
                                                      for w in ("bf16_out", "fp32_accumulate", "separate_add")}
    fc1 = next(r for r in wgrad if r["gemm"] == "gpt3-175b tp4 fc1")
    assert (fc1["outputs"], fc1["inputs"], fc1["tokens"]) == (192, 192, 32) and all(r["flops_per_s"] > 0 for r in wgrad)
    for header in ("| n | fp32 |", "| model | gemm | tp |", "| op | bf16 | fp32 |", "| head dim | heads |",
                   "| gemm | out x in x tokens | bf16_out | fp32_accumulate | separate_add |"):
        assert header in result.stdout  # the markdown tables


def test_the_real_shapes_are_the_published_ones_divided_by_tensor_parallelism():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_kernels
    finally:
        sys.path.remove(str(ROOT / "bench"))
    gemms = {(g["model"], g["gemm"], g["tp"]): g for g in gpu_kernels.model_gemms(gpu_kernels.make_plan(False))}
    assert len(gemms) == 4 * 5 * 4
    assert gemms[("llama3-405b", "qkv", 1)] == {"model": "llama3-405b", "gemm": "qkv", "tp": 1, "split": "column",
                                                "m": 8192, "n": 16384 + 2 * 8 * 128, "k": 16384}
    gate_up = gemms[("llama3-70b", "gate_up", 4)]
    assert (gate_up["n"], gate_up["k"]) == (2 * 28672 // 4, 8192)
    assert (gemms[("llama3-8b", "down", 8)]["n"], gemms[("llama3-8b", "down", 8)]["k"]) == (4096, 14336 // 8)
    assert gemms[("llama3-8b", "head", 2)]["n"] == 128256 // 2
    assert gemms[("gpt2-124m", "head", 1)]["n"] == 50272 and gemms[("gpt2-124m", "qkv", 1)]["m"] == 8 * 1024
    assert gemms[("gpt2-124m", "fc2", 4)]["k"] == 3072 // 4
    estimate = gpu_kernels.estimate_seconds(gpu_kernels.make_plan(False), gpu_kernels.torch.device("cuda"))
    assert 20 < estimate["total"] < 150  # the docstring's H200 estimate: under 2.5 minutes


def test_the_budget_stops_it_and_says_what_was_skipped(tmp_path):
    _, report = run(tmp_path, "--dry-run", "--budget-s", "0.001")
    assert report["skipped"] and not report["gemm"]["square"]  # everything after the first check skipped
    assert {row["section"] for row in report["skipped"]} >= {"square", "shapes", "attention", "wgrad"}


def test_it_imports_torch_and_the_job_description_only():
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('k', sys.argv[1]); "
            "module = sys.modules['k'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            "print(sorted(m for m in ('simpy', 'click', 'networkx', 'simulator', 'cli') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code, str(SCRIPT)], env=bare_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
