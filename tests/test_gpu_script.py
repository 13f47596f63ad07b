"""bench/gpu.sh, the one script a lent GPU runs, checked here in its CPU dry run so that it cannot rot.

The dry run is run as a bare machine would run it: by the interpreter of a new virtualenv that holds
torch and what torch itself requires, nothing else (no minigpt install, no simpy, click or numpy: the
packages are linked in from this interpreter's site-packages), so the script must find the repository
itself and take simpy and click from the wheels in bench/vendor. A one-GPU run starts no process group,
so nothing needs torch.distributed's numpy-based object collectives.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu.sh"
STEPS = ("kernels", "calibrate", "compare", "precision", "train", "sustained")
VENDORED = ("simpy", "click")
ABSENT = VENDORED + ("numpy", "minigpt")


def requirements(name: str) -> set[str]:
    """The distributions `name` needs whatever extras are asked for, found installed here, itself included."""
    needed, todo = set(), [name]
    while todo:
        try:
            dist = importlib.metadata.distribution(todo.pop())
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement for another platform
        if dist.metadata["Name"].lower() in needed:
            continue
        needed.add(dist.metadata["Name"].lower())
        todo += [re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in dist.requires or [] if "extra ==" not in r]
    return needed


def torch_only_venv(where: Path) -> Path:
    """A new virtualenv whose site-packages links in torch and its requirements only; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    source = Path(sysconfig.get_paths()["purelib"])
    (target,) = where.glob("lib/python*/site-packages")
    for name in requirements("torch"):
        dist = importlib.metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith((".", "/"))}
        for top in tops - {"bin", "__pycache__"}:
            if (source / top).exists() and not (target / top).exists():
                (target / top).symlink_to(source / top)
    return where / "bin" / "python"


def bare_environment(tmp_path: Path, python: Path | str = sys.executable) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT", "VIRTUAL_ENV")}
    env.update(PYTHON=str(python), OUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    return env


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    return torch_only_venv(tmp_path_factory.mktemp("venv") / "venv")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, bare_python):
    tmp_path, python = tmp_path_factory.mktemp("gpu"), bare_python
    for module in ABSENT:  # the bare machine is really bare
        probe = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True, cwd=tmp_path)
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr
    assert subprocess.run([str(python), "-W", "ignore", "-c", "import torch"], cwd=tmp_path).returncode == 0
    result = subprocess.run(["bash", str(SCRIPT)], env=bare_environment(tmp_path, python), capture_output=True,
                            text=True, timeout=600, cwd=tmp_path)
    return result, tmp_path / "out"


def test_the_dry_run_runs_every_step_and_exits_0(dry_run):
    result, out = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FAILED" not in result.stdout
    for module in VENDORED:
        assert f"gpu.sh: {module} is not installed here: using {module}-" in result.stdout
    summary = (out / "summary.md").read_text()
    for step in STEPS:
        assert f"| {step} | ok |" in summary, summary
    assert "no result file" not in summary and "without the expected fields" not in summary, summary


def test_the_dry_run_writes_at_most_8_files_with_real_results(dry_run):
    _, out = dry_run
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8, files  # what a device call brings back
    assert {"gpu.log", "summary.md", "kernels.json", "gpu-profile.json", "compare.json", "precision.json",
            "train.json", "sustained.json"} == set(files)
    profile = json.loads((out / "gpu-profile.json").read_text())
    (gpu,) = profile["gpus"].values()
    assert gpu["peak_flops"]["bf16"] > 0 and "bf16" in gpu["matmul_efficiency"]  # the per-format path ran
    train = json.loads((out / "train.json").read_text())
    assert train["precision"]["compute"] == "bf16" and len(train["losses"]) == 8
    precision = json.loads((out / "precision.json").read_text())
    assert [row["run"] for row in precision["rows"]][:2] == ["minigpt fp32", "minigpt bf16"]
    assert "cuda: none" in (out / "gpu.log").read_text()  # the machine, first in the log
    sustained = json.loads((out / "sustained.json").read_text())
    assert list(sustained["formats"]) == ["fp32"] and sustained["formats"]["fp32"]["burst_flops_per_s"] > 0
    assert sustained["layer"]["predicted"]["preset"] == "h200"  # the block priced by the simulator on a bare machine
    assert "a dry-run block" in (out / "summary.md").read_text()


def test_require_gpu_without_cuda_says_so_in_one_line(tmp_path, bare_python):
    env = bare_environment(tmp_path, bare_python)  # torch warns there that numpy is missing: not on stderr
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
