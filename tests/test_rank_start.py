"""Ranks forked from a server that imported torch (parallel/launch/rank_start.py): forked from it, with the launching
process's environment as it is at the launch, and a preload that never touches CUDA (forking after CUDA is
initialised is unsafe, which is why the server imports and does nothing more)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from distributed import run_ranks
from parallel.launch.rank_start import PRELOAD, server_pid


def what_a_rank_sees(names: list[str]) -> dict:
    return {"ppid": os.getppid(), "env": {name: os.environ.get(name) for name in names}}


def test_ranks_are_forked_from_the_server_and_take_the_launchers_environment_at_the_launch(monkeypatch):
    monkeypatch.setenv("MINIGPT_TEST_GONE", "set before the first launch")
    run_ranks(2, what_a_rank_sees, [])  # the server runs from here on (if an earlier test did not start it)
    monkeypatch.setenv("MINIGPT_TEST_LATER", "set after the server started")
    monkeypatch.delenv("MINIGPT_TEST_GONE")
    names = ["MINIGPT_TEST_LATER", "MINIGPT_TEST_GONE", "RANK", "WORLD_SIZE", "OMP_NUM_THREADS"]
    seen = run_ranks(2, what_a_rank_sees, names)
    assert [rank["ppid"] for rank in seen] == [server_pid()] * 2
    for rank, view in enumerate(seen):
        assert view["env"] == {"MINIGPT_TEST_LATER": "set after the server started", "MINIGPT_TEST_GONE": None,
                               "RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}, view


CUDA_TRAPS = """
import sys, torch
def touched(*args, **kwargs):
    raise SystemExit("CUDA was touched while importing " + repr(sys.argv[1:]))
torch.cuda.is_available = torch.cuda.device_count = torch.cuda.init = touched
torch._C._cuda_getDeviceCount = touched
for name in sys.argv[1:]:
    __import__(name)
"""


def test_the_servers_preload_touches_no_cuda():
    """Every module the server imports (PRELOAD and the entrypoints' modules) imports without asking CUDA
    anything: a fork after cuInit would give every rank a broken CUDA."""
    modules = [name for name in PRELOAD if name != "__main__"] + ["parallel.run.train", "cli.main", "parallel.calibrate.measure",
                                                                  "parallel.checkpoint.sharded"]
    result = subprocess.run([sys.executable, "-c", CUDA_TRAPS, *modules], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def modules_after_two_steps(out_dir: str) -> dict:
    """A rank's run of a pipeline with a zero-bubble split and recomputation: every backward that starts from
    a gradient (parallel/backward.py); which of the costly modules it imported on the way."""
    import torch

    from job.train_config import TrainConfig
    from minigpt.config import GPTConfig
    from parallel.run.train import train_on_rank

    model = GPTConfig(vocab_size=256, seq_len=16, n_layers=4, n_heads=2, d_model=16, d_ff=32)
    cfg = TrainConfig(model=model, steps=2, global_batch=4, micro_batches=2, eval_batches=1, device="cpu", pp=2,
                      schedule="zb-h1", recompute="selective", out_dir=out_dir)
    train_on_rank(cfg, torch.device("cpu"))
    return {name: name in sys.modules for name in ("sympy", "torch.fx.experimental.symbolic_shapes")}


RANKS_OF_A_FRESH_SERVER = """
import sys
from distributed import run_ranks
from test_rank_start import modules_after_two_steps
if __name__ == "__main__":
    print(run_ranks(2, modules_after_two_steps, sys.argv[1]))
"""


def test_a_pipeline_rank_does_not_import_sympy(tmp_path):
    """torch's autograd imports sympy (0.6 s a rank) for a backward given an explicit gradient; the pipeline,
    the zero-bubble split and recomputation start theirs from a scalar instead (parallel/backward.py). Run from
    a process of its own: this session's server preloads torch.distributed.checkpoint, which imports sympy."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_OF_A_FRESH_SERVER)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                            timeout=300, env=environment, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = {"sympy": False, "torch.fx.experimental.symbolic_shapes": False}
    assert result.stdout.strip().splitlines()[-1] == repr([expected, expected]), result.stdout[-2000:]


FLAGS_WITHOUT_TORCH = """
import sys
import parallel.gpu_files
parallel.gpu_files.GPU_DEVICE_FILES = ("/nonexistent/nvidiactl",)
from cli.commands.train import build_train_config, train
options = train.make_context("train", sys.argv[1:]).params
options.pop("as_json")
cfg = build_train_config(options)
print(cfg.world_size, cfg.precision, "torch" in sys.modules)
"""


def test_flags_are_checked_without_torch_on_a_machine_without_a_gpu_driver():
    """Where no GPU driver's device file exists, the precision auto picks and the ranks that fill the job are
    known without torch, so `minigpt train` starts the ranks' server before it imports torch itself."""
    for flags, expected in ((["--model", "tiny"], "1 fp32 False"), (["--zero", "1"], "2 fp32 False")):
        result = subprocess.run([sys.executable, "-c", FLAGS_WITHOUT_TORCH, *flags], capture_output=True, text=True,
                                timeout=120)
        assert result.stdout.strip() == expected, result.stderr[-2000:]


def test_a_gpu_driver_makes_the_flags_ask_torch(monkeypatch):
    import parallel.gpu_files
    from cli.options.precision import training_precision
    from parallel.device import cuda_device_count

    monkeypatch.setattr(parallel.gpu_files, "GPU_DEVICE_FILES", ("/nonexistent/nvidiactl",))
    assert not parallel.gpu_files.may_have_gpus()
    assert training_precision("auto", "auto", 1) == "fp32"
    monkeypatch.setattr(parallel.gpu_files, "GPU_DEVICE_FILES", ("/",))  # a driver's file, as far as it can tell
    assert parallel.gpu_files.may_have_gpus()
    assert training_precision("auto", "auto", 1) == ("bf16" if cuda_device_count() >= 1 else "fp32")
