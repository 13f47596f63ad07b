"""What several test modules share, made once a session: the ranks' server and a quick calibrated profile of this
machine."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

PROFILE_RANKS = 4  # on a 2-core machine the sharing rows reach twice the cores
PROFILE_MODELS = ("tiny", "tiny-moe")  # the shapes whose units it measures: a dense block and a mixture of experts'


@pytest.fixture(scope="session", autouse=True)
def rank_server() -> None:
    """The server every test's ranks are forked from (parallel/launch/rank_start.py), started with the first test and
    with what the tests' ranks import: the training loop and torch.distributed.checkpoint (a second a rank)."""
    from parallel.launch.rank_start import start_rank_server

    start_rank_server("parallel.run.train", "parallel.checkpoint.sharded")


@pytest.fixture(scope="session")
def quick_profile(tmp_path_factory) -> Path:
    """`minigpt calibrate --quick` on PROFILE_RANKS gloo ranks, from the command line as a user runs it: one
    calibration (about half a minute here, 4-5 s of it tiny-moe's units) for every test that needs a measured CPU
    profile. --allow-busy: a
    profile whatever else the machine runs, marked unreliable when it was busy (tests/test_calibrate_noise.py
    checks the refusal and the mark)."""
    from cli.main import main

    path = tmp_path_factory.mktemp("calibrate") / "profile.json"
    result = CliRunner().invoke(main, ["calibrate", "--out", str(path), "--ranks", str(PROFILE_RANKS), "--quick",
                                       "--allow-busy", "--model", ",".join(PROFILE_MODELS)])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output
    return path
