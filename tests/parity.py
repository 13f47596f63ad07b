"""Parity with a reference run, step by step, on the losses and on the gradient norms.

A loss alone can be fooled by a scale: a gradient multiplied by a constant leaves Adam's update
almost unchanged (and clipping hides it further), so the losses stay close while every gradient is
wrong. The global gradient norm before clipping (summary["grad_norms"]) is that scale's witness.

An fp16 step skipped by the loss scaler has a NaN norm: a step must be skipped in both runs
(NaN == NaN), a step skipped in one run only is an infinite gap.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Gap(NamedTuple):
    loss: float  # the worst relative gap over the steps
    grad_norm: float

    @property
    def worst(self) -> float:
        return max(self.loss, self.grad_norm)

    def __str__(self) -> str:
        return f"loss {self.loss:.1e}, grad norm {self.grad_norm:.1e}"


def relative_gap(ours: float, reference: float) -> float:
    """|ours - reference| / |reference|; 0 when both are NaN (a step both skipped), inf when one is."""
    if math.isnan(ours) or math.isnan(reference):
        return 0.0 if math.isnan(ours) and math.isnan(reference) else math.inf
    if ours == reference:
        return 0.0
    return abs(ours - reference) / abs(reference) if reference else math.inf


def worst_gap(run: dict, reference: dict) -> Gap:
    """The worst relative gap, over every step, of run's "losses" and of its "grad_norms" against the
    reference's (summaries of parallel/run/train.py, or dicts with those two lists). Both runs must
    have trained the same steps."""
    gaps = {}
    for key in ("losses", "grad_norms"):
        ours, theirs = run[key], reference[key]
        assert len(ours) == len(theirs) > 0, f"{key}: {len(ours)} steps against the reference's {len(theirs)}"
        gaps[key] = max(relative_gap(a, b) for a, b in zip(ours, theirs))
    return Gap(gaps["losses"], gaps["grad_norms"])


def history(summary: dict) -> dict:
    """What parity compares from a training summary."""
    return {"losses": summary["losses"], "grad_norms": summary["grad_norms"]}


def assert_runs_match(runs: list[dict], reference: dict, label: str, tolerance: float,
                      grad_norm_tolerance: float | None = None) -> None:
    """Every rank's run within `tolerance` of the reference on the losses and the gradient norms (the norms within
    `grad_norm_tolerance` when given), its gap printed under `label`."""
    for run in runs:
        gap = worst_gap(run, reference)
        print(f"{label}: {gap}")
        norms = tolerance if grad_norm_tolerance is None else grad_norm_tolerance
        assert gap.loss <= tolerance and gap.grad_norm <= norms, f"{label}: {gap}"
