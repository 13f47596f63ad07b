"""`minigpt claims --json`: every row's verdict checked against its measured numbers, the numbers against
torch, the commands the rows name, and docs/claims.md against a fresh run.

A check must be able to fail: it never re-runs a row's own rule on the row's own numbers. The numbers that
decide a verdict are derived here another way -- by hand from the model's shape and the datasheets
(simulator/costs/hardware.json read as plain JSON, priced by tests/independent.py's roofline), from the real
model (parameters counted, FLOPs counted by torch's FlopCounterMode), from torch's own dtypes and
torch.optim.AdamW -- and the verdict is then worked out from those numbers with the article's own figure.
Where a number cannot be derived independently (a simulated pipeline bubble, a one-server ZeRO-3 slowdown
of a few percent) the check says so and derives what it can around it.

The fast rows run in CI in one invocation; the rows that train for real (`slow=True`, a few seconds
each) and the full command's wall time run under the `slow` marker: `python -m pytest -m slow
tests/test_claims.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import claims_parallel
import claims_precision
from claims_cli import invoke
from cli.main import main
from cli.claims.registry import all_claims
from cli.claims.report import markdown_row

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = all_claims()
FAST = [c.name for c in CLAIMS if not c.slow]
SLOW = [c.name for c in CLAIMS if c.slow]
WALL_LIMIT_S = 120  # the whole command on two cores


def by_name(report: dict) -> dict[str, dict]:
    return {row["name"]: row for row in report["claims"]}


@pytest.fixture(scope="module")
def fast_report() -> dict:
    return invoke("claims", "--json", *[arg for name in FAST for arg in ("--only", name)])


@pytest.fixture(scope="module")
def full_report() -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cli", "claims", "--json"], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    report["wall_s"] = wall
    return report


# One check per row, from its numbers: tests/claims_precision.py and tests/claims_parallel.py.
CHECKS = {name.removeprefix("check_").replace("_", "-"): check
          for module in (claims_precision, claims_parallel) for name, check in vars(module).items()
          if name.startswith("check_")}


def test_every_claim_has_a_check_and_a_command():
    assert set(CHECKS) == {c.name for c in CLAIMS}
    for claim in CLAIMS:
        assert claim.command.startswith(("minigpt ", "for z in")), claim.command
        assert "minigpt " in claim.command and claim.where and claim.article


@pytest.mark.parametrize("name", FAST)
def test_fast_row(fast_report, name):
    row = by_name(fast_report)[name]
    CHECKS[name](row)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_slow_row(full_report, name):
    row = by_name(full_report)[name]
    CHECKS[name](row)


@pytest.mark.slow
def test_the_whole_command_runs_in_time_and_every_row_checks(full_report):
    assert full_report["wall_s"] < WALL_LIMIT_S, full_report["wall_s"]
    rows = by_name(full_report)
    assert list(rows) == [c.name for c in CLAIMS]
    for name in FAST:
        CHECKS[name](rows[name])


@pytest.mark.slow
def test_a_zero_row_counts_what_training_moves(tmp_path, fast_report):
    """zero2's volumes, counted from the schedule, are the bytes a real 2-rank run of its command moves."""
    row = by_name(fast_report)["zero2"]
    command = row["command"].split("; ")[1].split()[1:] + ["--out", str(tmp_path / "run")]
    summary = invoke(*command)
    measured = {kind: c["volume"] for kind, c in summary["comm_bytes_per_step"]["dp"].items() if c["volume"]}
    assert measured == row["numbers"]["volume"]["4"]


def test_docs_claims_md_is_the_commands_output(fast_report):
    """Rows that are neither timed nor computed by torch are the same on any machine: they must stand in the
    committed docs/claims.md as a fresh run writes them; every other row must at least be there, same verdict."""
    from cli.claims.claim import ClaimResult, Finding

    doc = (ROOT / "docs" / "claims.md").read_text(encoding="utf-8")
    claims = {c.name: c for c in CLAIMS}
    for name, row in by_name(fast_report).items():
        claim = claims[name]
        finding = Finding(row["ours"], row["verdict"], row["why"], row["numbers"], row["discussion"])
        line = markdown_row(ClaimResult(claim, finding, row["seconds"]))
        if not claim.needs_torch and not claim.timed:
            assert line in doc, f"docs/claims.md is stale for {name}: run minigpt claims --markdown docs/claims.md"
            assert row["discussion"] in doc
        else:
            assert f"| **{name}**: " in doc and f"**{row['verdict']}**" in doc
    for name in SLOW:
        assert f"| **{name}**: " in doc


def test_torch_free_rows_run_without_torch():
    code = ("import sys; from cli.claims.registry import run_claims, select; "
            "run_claims([c for c in select() if not c.needs_torch]); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_the_table_names_each_command():
    result = CliRunner().invoke(main, ["claims", "--only", "bubble", "--only", "zero1"])
    assert result.exit_code == 0, result.output
    assert "$ minigpt schedule --pp 4 --micro-batches 8 --schedule 1f1b" in result.stdout
    assert "bubble:" in result.stdout and "zero1:" in result.stdout and "formats:" not in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--only", "nope"], "unknown claim 'nope'"),
    (["--only", "bubble", "--markdown", "MD"], "--markdown writes the whole table"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    args = [str(tmp_path / "x.md") if arg == "MD" else arg for arg in args]
    result = CliRunner().invoke(main, ["claims", *args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minigpt: error:") and message in lines[0]
    assert not (tmp_path / "x.md").exists()
