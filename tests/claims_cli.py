"""`minigpt` run in this process, as tests/test_claims.py and the claims' checks (tests/claims_*.py) call it."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import main


def invoke(*args: str) -> dict:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout, parse_constant=lambda name: pytest.fail(f"{name} is not strict JSON"))



def simulated(*args: str) -> dict:
    return invoke("simulate", *args, "--json")
