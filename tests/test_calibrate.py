"""`minigpt calibrate`: a quick calibration on 2 gloo ranks writes a profile the simulator loads."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from cli.calibrate import calibrate
from cli.main import Group
from minigpt.errors import ConfigError


@click.group(cls=Group)
def group() -> None:
    """A throwaway group: cli/main.py registers the command for real."""


group.add_command(calibrate)


def invoke(*args: str):
    return CliRunner().invoke(group, ["calibrate", *args])


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("calibrate") / "profile.json"
    result = invoke("--out", str(path), "--ranks", "2", "--quick")
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output
    return path


def test_the_quick_profile_loads_and_holds_the_measurements(profile_path):
    from simulator.hardware import load_hardware

    hardware = load_hardware(str(profile_path))
    gpu = hardware.gpu
    assert hardware.name == "cpu-calibrated"
    assert gpu.source.startswith("measured by minigpt calibrate on ")
    assert gpu.peak_flops["fp32"] > 0 and gpu.hbm_bandwidth > 0 and gpu.nvlink_bandwidth > 0
    table = gpu.matmul_efficiency.points["fp32"]
    assert [n for n, _ in table] == [64, 256, 512]
    assert all(0 < e <= 1.05 for _, e in table)
    assert max(e for _, e in table) > 0.3  # the best size sits near the (measured) peak
    assert gpu.matmul_efficiency.launch_latency > 0
    assert set(gpu.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    for fit in gpu.collectives.values():
        assert fit.alpha >= 0 and fit.beta > 0 and len(fit.points) == 3
    note = gpu.calibration
    assert note["ranks"] == 2 and note["ranks_per_core"] == pytest.approx(2 / note["cores"])
    assert note["block"]["forward_s"] > 0 and note["block"]["backward_s"] > 0
    assert not list(profile_path.parent.glob(".*.tmp"))  # the atomic write left no temporary file


def test_the_profile_drives_the_simulator(profile_path):
    from cli.main import main
    from minigpt.config import preset
    from simulator.engine import simulate_step
    from simulator.hardware import load_hardware, save_hardware
    from simulator.layout import Layout
    from simulator.topology import build_cluster

    hardware = load_hardware(str(profile_path))
    cluster = build_cluster(hardware, 2, 1, None, "fat-tree")
    result = simulate_step(preset("tiny"), Layout(dp=2), cluster, "fp32", 16, 8,
                           profile=hardware.gpu.matmul_efficiency, gpu=hardware)
    assert result.step_time_s > 0

    cli = CliRunner().invoke(main, ["simulate", "--hardware", str(profile_path), "--model", "tiny",
                                    "--precision", "fp32", "--dp", "2", "--json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.output)["gpu"] == "cpu-calibrated"

    again = save_hardware(hardware, profile_path.parent / "again.json")  # the optional fields round-trip
    reloaded = load_hardware(str(again)).gpu
    assert reloaded.matmul_efficiency == hardware.gpu.matmul_efficiency
    assert reloaded.collectives == hardware.gpu.collectives and reloaded.calibration == hardware.gpu.calibration


def test_fit_alpha_beta():
    from parallel.calibrate import fit_alpha_beta

    alpha, beta = fit_alpha_beta([(1000, 1e-4 + 1e-9 * 1000), (10**6, 1e-4 + 1e-3), (10**7, 1e-4 + 1e-2)])
    assert alpha == pytest.approx(1e-4) and beta == pytest.approx(1e-9)
    alpha, beta = fit_alpha_beta([(1, 0.0), (2, 3.0), (3, 4.0)])  # negative intercept: through the origin
    assert alpha == 0 and beta > 0
    alpha, beta = fit_alpha_beta([(1, 5.0), (2, 4.0)])  # falling: the largest point's t / S
    assert alpha >= 0 and beta > 0


@pytest.mark.parametrize("args, words", [
    (["--ranks", "0"], "--ranks must be a positive integer"),
    (["--ranks", "-3"], "--ranks must be a positive integer"),
    (["--threads-per-rank", "0"], "--threads-per-rank"),
    (["--model", "nope"], "unknown model preset"),
])
def test_bad_flags_are_bad_input_before_any_rank_starts(tmp_path, monkeypatch, args, words):
    import parallel.calibrate

    def no_launch(*_args, **_kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(parallel.calibrate, "launch", no_launch)
    result = invoke("--out", str(tmp_path / "p.json"), *args)
    assert result.exit_code == 2, result.output
    assert words in result.output and not (tmp_path / "p.json").exists()


def test_bad_out_paths_are_bad_input(tmp_path, monkeypatch):
    import parallel.calibrate

    monkeypatch.setattr(parallel.calibrate, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    (tmp_path / "file.txt").write_text("x")
    for out, words in [(str(tmp_path), "is a directory"),
                       (str(tmp_path / "missing" / "p.json"), "does not exist"),
                       (str(tmp_path / "file.txt" / "p.json"), "does not exist"),
                       ("/proc/minigpt-profile.json", "cannot write"),
                       (str(tmp_path / "p.txt"), "must end in .json")]:
        result = invoke("--out", out, "--quick")
        assert result.exit_code == 2, (out, result.output)
        assert words in result.output, (out, result.output)


def test_a_bad_collectives_entry_is_a_config_error(profile_path, tmp_path):
    from simulator.hardware import load_hardware

    data = json.loads(profile_path.read_text())
    gpu = next(iter(data["gpus"].values()))
    gpu["collectives"]["p2p"]["beta"] = -1.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="collectives.p2p.beta"):
        load_hardware(str(bad))
