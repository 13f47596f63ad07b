"""The commands' pictures (cli/tools/plots.py): `simulate --plot` (one step's breakdown), `plan --plot` (the best
layouts), `compare` (predicted against measured by phase, and the matrix's panels); each a PNG matplotlib reads
back, not a blank one. `simulate --json` carries the model's parameter counts. A --plot path that cannot be written
is one line and exit code 2 before anything is simulated."""

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cli.main import main
from minigpt.presets import preset

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SIMULATE = ["simulate", "--model", "gpt2-124m", "--tp", "2", "--pp", "2", "--dp", "2", "--global-batch", "16",
            "--gpu", "a100-80gb"]
PLAN = ["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu", "a100-80gb", "--top", "3"]


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def check_picture(path: Path) -> None:
    """A PNG (its signature) that matplotlib reads back into an image of some size and more than two colours."""
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert len(np.unique(image.reshape(-1, image.shape[2]), axis=0)) > 2  # drawn on, not a blank


def test_simulate_draws_one_steps_breakdown(tmp_path):
    picture = tmp_path / "step.png"
    picture.write_bytes(b"an older picture")  # asked for again: replaced, as a user expects
    result = invoke(*SIMULATE, "--plot", str(picture))
    assert result.exit_code == 0, result.output
    assert f"picture: {picture}" in result.output.splitlines()
    check_picture(picture)
    report = json.loads(invoke(*SIMULATE, "--plot", str(tmp_path / "again.png"), "--json").stdout)
    assert report["plot"] == str(tmp_path / "again.png")
    check_picture(tmp_path / "again.png")


@pytest.mark.parametrize("model", ["gpt2-124m", "tiny-moe"])
def test_simulate_json_carries_the_parameter_counts(model):
    args = ["simulate", "--model", model, "--global-batch", "8", "--gpu", "h100-sxm", "--json"]
    if model == "tiny-moe":
        args += ["--dp", "2", "--ep", "2"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    params, config = json.loads(result.stdout)["parameters"], preset(model)
    assert params["total"] == config.n_params() and params["active"] == config.active_params()
    assert params["embedding"] == config.embedding_params() and params["head"] == config.head_params()
    assert params["blocks"] == config.blocks_params() and params["per_block"] == config.block_params()
    published = {"gpt2-124m": (124_439_808, 124_439_808), "tiny-moe": (2_429_184, 847_104)}  # README's table
    assert (params["total"], params["active"]) == published[model]
    assert ("per_expert" in params) == (model == "tiny-moe")


def test_a_sweep_json_carries_them_too(tmp_path):
    result = invoke("simulate", "--model", "gpt2-124m", "--sweep", "--gpus", "8,16", "--global-batch", "64",
                    "--plot", str(tmp_path / "scaling.png"), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["parameters"]["total"] == preset("gpt2-124m").n_params()
    assert report["plot"] == str(tmp_path / "scaling.png")
    check_picture(tmp_path / "scaling.png")


def test_plan_draws_its_best_layouts(tmp_path):
    picture = tmp_path / "plan.png"
    result = invoke(*PLAN, "--plot", str(picture), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["plot"] == str(picture) and len(report["best"]) == 3
    check_picture(picture)


@pytest.mark.parametrize("path, words", [
    ("{tmp}", "is a directory"),
    ("{tmp}/missing/out.png", "does not exist"),
    ("{tmp}/out.svg", "ending in .png"),
])
@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_a_plot_path_that_cannot_be_written_is_one_line_before_any_work(tmp_path, monkeypatch, command, path, words):
    import simulator.engine.simulate
    import simulator.search.plan

    for module, name in ((simulator.engine.simulate, "simulate_step"), (simulator.search.plan, "plan")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("work started before the --plot check"))
    result = invoke(*(SIMULATE if command == "simulate" else PLAN), "--plot", path.format(tmp=tmp_path))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minigpt: error:") and words in lines[0], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


@pytest.mark.slow
def test_compare_draws_predicted_against_measured_by_phase(quick_profile, tmp_path):
    """One rank, 3 short steps, on the session's quick profile (tests/conftest.py): compare.png beside the run's
    traces, named in the output and in --json; the matrix's picture drawn from the same report's phases."""
    from cli.tools.compare_matrix import matrix_row
    from cli.tools.plots import draw_compare_matrix
    from parallel.run.directory import is_run_dir

    out = tmp_path / "run"
    result = invoke("compare", "--hardware", str(quick_profile), "--layers", "2", "--seq-len", "32", "--batch-size",
                    "4", "--steps", "3", "--threads-per-rank", "1", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["plot"] == str(out / "compare.png")
    check_picture(out / "compare.png")
    assert is_run_dir(out)  # the picture is one of a run directory's own files
    row = matrix_row("1 rank", [report])
    times = {r["name"]: r for r in report["rows"] if r["unit"] == "s"}
    assert [p["name"] for p in row["phases"]] == list(times) and "step time" in times
    assert all(p["predicted"] == times[p["name"]]["predicted"] for p in row["phases"])
    matrix = {"rows": [row, {**row, "layout": "again"}], "step_time_mape": abs(row["step_time_error"])}
    check_picture(draw_compare_matrix(matrix, tmp_path / "matrix.png"))
