"""Every claim of cli/claims/'s topic modules in the table's order, picked by name and run (timed)."""

from __future__ import annotations

import time
from typing import Callable

from cli.claims import formats, loss_scaling, memory, parallel, speed, training, zero
from cli.claims.claim import Claim, ClaimResult, one_thread
from minigpt.errors import ConfigError

# Not numbers, so not claims to run: what the article misnames, said once under the table.
TEXT_ERRATA = (
    '1.3 calls ZeRO "DeepSpeek的核心创新" (DeepSpeek\'s core innovation): the framework is DeepSpeed '
    '(Microsoft; Rajbhandari et al. 2020), which the article\'s own references name correctly ("DeepSpeed官方文档").',
)


def all_claims() -> list[Claim]:
    """Every claim, grouped by topic in the article's order."""
    return [*formats.CLAIMS, *loss_scaling.CLAIMS, *training.CLAIMS, *speed.CLAIMS, *memory.CLAIMS, *zero.CLAIMS,
            *parallel.CLAIMS]


def select(names: tuple[str, ...] | list[str] = ()) -> list[Claim]:
    """The claims named (all when none), in the table's order; ConfigError for a name that is none."""
    claims = all_claims()
    known = {claim.name: claim for claim in claims}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigError(f"unknown claim {unknown[0]!r} for --only: choose one of {', '.join(known)}")
    return [claim for claim in claims if not names or claim.name in names]


def run_claims(claims: list[Claim], progress: Callable[[Claim], None] | None = None) -> list[ClaimResult]:
    """Run each claim's check once, timed (torch on one thread); `progress(claim)` before each."""
    results = []
    for claim in claims:
        if progress is not None:
            progress(claim)
        if claim.needs_torch:
            one_thread()
        start = time.perf_counter()
        finding = claim.check()
        results.append(ClaimResult(claim, finding, time.perf_counter() - start))
    return results
