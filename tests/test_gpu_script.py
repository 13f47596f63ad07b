"""bench/gpu.sh, the one script a lent GPU runs, checked here in its CPU dry run so that it cannot rot.

The dry run is run as a bare machine would run it: from the repository root on PYTHONPATH (no
install needed), with simpy and click hidden from the interpreter (a sitecustomize that lets
them load only from a wheel on sys.path, as bench/vendor's are), so the vendored wheels must carry
those steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu.sh"
STEPS = ("kernels", "calibrate", "compare", "precision", "train")
HIDDEN = ("simpy", "click")

# Loaded at interpreter start through PYTHONPATH: simpy and click are found only inside a wheel.
SITECUSTOMIZE = f'''
import importlib.machinery, sys

class OnlyFromWheels:
    hidden = {HIDDEN!r}

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in self.hidden or "." in name:
            return None
        wheels = [entry for entry in sys.path if entry.endswith(".whl")]
        spec = importlib.machinery.PathFinder.find_spec(name, wheels)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=name)
        return spec

sys.meta_path.insert(0, OnlyFromWheels())
'''


def bare_environment(tmp_path: Path) -> dict:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    env.update(PYTHON=sys.executable, PYTHONPATH=str(hide), OUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    return env


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("gpu")
    env = bare_environment(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import simpy"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "hidden by the test" in probe.stderr  # the bare machine is really bare
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    return result, tmp_path / "out"


def test_the_dry_run_runs_every_step_and_exits_0(dry_run):
    result, out = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FAILED" not in result.stdout
    for module in HIDDEN:
        assert f"gpu.sh: {module} is not installed here: using {module}-" in result.stdout
    summary = (out / "summary.md").read_text()
    for step in STEPS:
        assert f"| {step} | ok |" in summary, summary
    assert "no result file" not in summary and "without the expected fields" not in summary, summary


def test_the_dry_run_writes_at_most_8_files_with_real_results(dry_run):
    _, out = dry_run
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8, files  # what a device call brings back
    assert {"env.txt", "gpu.log", "summary.md", "kernels.json", "gpu-profile.json", "compare.json",
            "precision.json", "train.json"} == set(files)
    profile = json.loads((out / "gpu-profile.json").read_text())
    (gpu,) = profile["gpus"].values()
    assert gpu["peak_flops"]["bf16"] > 0 and "bf16" in gpu["matmul_efficiency"]  # the per-format path ran
    train = json.loads((out / "train.json").read_text())
    assert train["precision"]["compute"] == "bf16" and len(train["losses"]) == 8
    precision = json.loads((out / "precision.json").read_text())
    assert [row["run"] for row in precision["rows"]][:2] == ["minigpt fp32", "minigpt bf16"]
    assert "cuda: none" in (out / "env.txt").read_text()


def test_require_gpu_without_cuda_says_so_in_one_line(tmp_path):
    env = bare_environment(tmp_path)
    result = subprocess.run(["bash", str(SCRIPT), "--require-gpu"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 3
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1
    assert "no CUDA device" in result.stderr
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written


def test_an_unknown_argument_is_refused(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), "--gpu"], env=bare_environment(tmp_path), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "unknown argument" in result.stderr
