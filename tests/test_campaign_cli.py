"""`minigpt simulate --campaign DAYS`: the campaign of the simulated step, its presets, its JSON and its bad inputs."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import main
from simulator.campaign.rates import LLAMA3_TABLE5, PRESETS, read_rates

STEP = ["simulate", "--model", "gpt2-124m", "--dp", "8", "--gpu", "h100-sxm", "--global-batch", "64"]


def invoke(*args: str):
    return CliRunner().invoke(main, [*STEP, *args])


def test_a_campaign_is_printed_and_in_the_json():
    result = invoke("--campaign", "3", "--failure-rates", "llama3-405b", "--campaign-runs", "4")
    assert result.exit_code == 0, result.output
    assert "campaign of 3 days" in result.output and "effective training time" in result.output
    data = json.loads(invoke("--campaign", "3", "--json", "--campaign-runs", "4").output)["campaign"]
    assert data["runs"] == 4 and 0 < data["ettr"] < 1 and data["failure_rates"] == {"all causes": 6.5}
    assert data["checkpoint_every"] == data["best_interval"]
    scanned = [n for n, _ in data["scanned"]]
    assert min(scanned) <= data["best_interval"] <= max(scanned)  # found inside the scan (Young and Daly: test_campaign)
    fixed = json.loads(invoke("--campaign", "3", "--json", "--campaign-runs", "2", "--checkpoint-every", "50").output)
    assert fixed["campaign"]["checkpoint_every"] == 50


def test_the_presets_are_their_sources_numbers():
    assert PRESETS["rsc-1"].total == 6.50 and PRESETS["rsc-2"].total == 2.34
    assert sum(LLAMA3_TABLE5.values()) == 419  # Table 5's unexpected interruptions
    assert PRESETS["llama3-405b"].total == pytest.approx(419 / (2048 * 54) * 1000)
    assert read_rates(None) is PRESETS["rsc-1"]


def test_a_rates_file_is_read(tmp_path):
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"gpu": 3.0, "network": 1.0}))
    data = json.loads(invoke("--campaign", "2", "--failure-rates", str(path), "--json", "--campaign-runs",
                             "2").output)["campaign"]
    assert data["failure_rates"] == {"gpu": 3.0, "network": 1.0}


@pytest.mark.parametrize("args, says", [
    (["--campaign", "-1"], "--campaign must be a finite number above 0"),
    (["--campaign", "nan"], "--campaign must be a finite number"),
    (["--campaign", "5", "--storage-gbps", "0"], "--storage-gbps must be a finite number above 0"),
    (["--campaign", "5", "--restart-minutes", "-2"], "--restart-minutes must be a finite number >= 0"),
    (["--campaign", "5", "--checkpoint-every", "0"], "--checkpoint-every must be a whole number >= 1"),
    (["--campaign", "5", "--failure-rates", "nowhere"], "neither a preset"),
    (["--storage-gbps", "3"], "add --campaign DAYS"),
    (["--straggler-cv", "0.1"], "add --campaign DAYS"),
    (["--campaign", "5", "--straggler-cv", "-1"], "--straggler-cv must be a finite number >= 0"),
    (["--campaign", "1e-9"], "shorter than one step"),
])
def test_bad_campaign_inputs_are_one_line_and_exit_2(args, says):
    result = invoke(*args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and says in lines[0], result.output


def test_a_bad_rates_file_is_one_line(tmp_path):
    path = tmp_path / "rates.json"
    for text, says in (("[1, 2]", "give an object"), ('{"gpu": -1}', "must be a finite number >= 0"),
                       ("{", "not a JSON file")):
        path.write_text(text)
        result = invoke("--campaign", "2", "--failure-rates", str(path))
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1 and says in lines[0], result.output


def test_a_sweep_with_campaigns_names_where_gpus_stop_paying_with_failures():
    """Each point's best layout run for the campaign: more servers fail more often, so the effective training time
    falls with the GPU count, and the sweep's verdict is said again on goodput."""
    args = ["simulate", "--model", "gpt2-124m", "--sweep", "--gpus", "64,512,4096", "--gpu", "h100-sxm",
            "--global-batch", "4096", "--campaign", "20", "--campaign-runs", "4"]
    data = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)["campaign_sweep"]
    ettr = [data["campaigns"][n]["ettr"] for n in ("64", "512", "4096")]
    assert ettr == sorted(ettr, reverse=True) and ettr[-1] < ettr[0] - 0.02
    points = data["sweep"]["points"]
    assert [p["gpus"] for p in points] == [64, 512, 4096] and points[0]["efficiency"] == 1.0
    assert "verdict" in data["sweep"] and data["sweep"]["threshold"] == 0.5
    text = CliRunner().invoke(main, args).output
    assert "run for a campaign of 20 days" in text and "with failures, checkpoints and restarts:" in text


def test_failures_count_the_rates_own_servers_not_the_nvlink_domains():
    """The rates are per 1000 days of 8-GPU servers (RSC-1's, Llama 3's): 128 GPUs are 16 of them whether the
    cluster puts them in 8-GPU servers or in two GB200 NVL72 racks of 64 (--gpus-per-node 64)."""
    mtbf = {}
    for per_node in ("8", "64"):
        result = CliRunner().invoke(main, ["simulate", "--model", "llama3-8b", "--gpu", "gb200", "--gpus", "128",
                                           "--gpus-per-node", per_node, "--global-batch", "256", "--campaign", "10",
                                           "--campaign-runs", "2", "--json"])
        assert result.exit_code == 0, result.output
        mtbf[per_node] = json.loads(result.output)["campaign"]["mtbf_hours"]
    assert mtbf["8"] == mtbf["64"] == pytest.approx(24 * 1000 / (6.50 * 128 / 8))
