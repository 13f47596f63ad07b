"""The seed article's checkable claims, each one run here: its number against ours, and a verdict.

The article that started the project (seed/, in Chinese) makes claims about mixed precision, ZeRO,
tensor and pipeline parallelism. A `Claim` is what it says (short, in English), where it says it, the
number it gives (typed in: "the article says"), the minigpt command a reader can paste to see ours,
and a check. The check computes our number at run time with the project's own code -- torch for the
formats and the loss scaler, the training loop for live bytes, the simulator for GPUs and clusters,
the schedule for communication and bubbles -- and decides the verdict from that number alone, with
the reason. Nothing of ours is typed in.

The claims live by topic in cli/tools/claims_*.py; cli/claims/registry.py lists and runs them.
`minigpt claims` (cli/commands/claims.py) prints them; docs/claims.md is its `--markdown` output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

HOLDS = "holds"
CAVEAT = "holds with a caveat"
WRONG = "wrong"
UNCHECKABLE = "not checkable here"
VERDICTS = (HOLDS, CAVEAT, WRONG, UNCHECKABLE)


@dataclass(frozen=True)
class Finding:
    """What a check found: our number, the verdict and why, and the paragraph for docs/claims.md.

    `numbers` holds every number `ours`, `why` and `discussion` are written from (JSON-ready), so
    tests can check the verdict against the measurement."""

    ours: str
    verdict: str
    why: str
    numbers: dict
    discussion: str

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {VERDICTS}")


@dataclass(frozen=True)
class Claim:
    """One claim of the article and the check that computes ours."""

    name: str
    claim: str  # what the article says, short, in English
    where: str  # its place in the article: section, and a quote to find it by
    article: str  # the article's number, as it gives it
    command: str  # the minigpt command line(s) that show our number
    check: Callable[[], Finding] = field(repr=False)
    slow: bool = False  # trains for real (seconds): the CI tests leave it to the `slow` marker
    timed: bool = False  # its numbers are timings of this machine: they change from run to run
    needs_torch: bool = True  # False: simulator and schedule only


@dataclass(frozen=True)
class ClaimResult:
    claim: Claim
    finding: Finding
    seconds: float

    def as_dict(self) -> dict:
        c, f = self.claim, self.finding
        return {"name": c.name, "claim": c.claim, "where": c.where, "article": c.article, "command": c.command,
                "ours": f.ours, "verdict": f.verdict, "why": f.why, "numbers": f.numbers,
                "discussion": f.discussion, "seconds": self.seconds, "slow": c.slow, "timed": c.timed,
                "needs_torch": c.needs_torch}


def ratio_text(value: float) -> str:
    """1.0 -> '1.00x', 63.2 -> '63x': a ratio with as many digits as it needs."""
    return f"{value:.2f}x" if value < 10 else f"{value:.0f}x"


def percent(value: float) -> str:
    return f"{100 * value:.0f}%"


def one_thread() -> None:
    """torch on one thread: what a rank of ours uses, and on a shared machine the steadiest timing."""
    import torch

    torch.set_num_threads(1)
