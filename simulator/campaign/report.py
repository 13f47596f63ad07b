"""Readable rows of a simulated campaign (cli/options/campaign.py's run_campaign dict). Torch-free."""

from __future__ import annotations

import math

GB = 1e9


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min" if seconds >= 60 \
        else f"{seconds:.1f} s"


def campaign_rows(c: dict) -> list[list[str]]:
    low, high = c["ettr_spread"]
    free = 86_400 / c["step_s"]  # failure-free steps a day
    tokens = c["tokens_per_day"]
    rows = [
        ["effective training time", f"{c['ettr']:.1%}", f"{low:.1%} to {high:.1%} over {c['runs']} runs"],
        ["goodput", f"{tokens:.4g} tokens/day", f"failure-free: {c['tokens_per_step'] * free:.4g} tokens/day "
                                                 f"({free:.4g} steps)"],
        ["job's mean time between failures", _hours(c["mtbf_hours"] * 3600) if math.isfinite(c["mtbf_hours"])
         else "no failures", f"{c['interruptions']:.1f} interruptions in the campaign"],
    ]
    for cause, count in sorted(c["interruptions_by_cause"].items(), key=lambda item: -item[1]):
        rows.append([f"  {cause}", f"{count:.1f} interruptions", f"{c['lost_hours_by_cause'][cause]:.1f} h lost "
                     "(rework and restarts)"])
    if c["straggler_cv"]:
        rows.append(["stragglers", f"+{c['straggler_slowdown']:.1%} a step", f"each rank's step +-{c['straggler_cv']:.1%}"
                     " (sd), every step waiting for the slowest GPU"])
    every = c["checkpoint_every"]
    formulas = "" if c["young_steps"] is None else (f"Young {c['young_steps']:.0f}, Daly {c['daly_steps']:.0f}, "
                                                    f"simulated best {c['best_interval']}")
    rows += [
        ["checkpoint", f"every {every} steps ({_hours(every * c['step_s'])})", formulas],
        ["  one write", _hours(c["checkpoint_s"]), f"{c['checkpoint_bytes_per_gpu'] / GB:.3g} GB a GPU at "
                                                   f"{c['storage_gb_s_per_server']:.3g} GB/s a server"
                                                   + _source(c, "checkpoint")],
        ["  time writing", f"{c['checkpoint_hours']:.1f} h", "in the campaign"],
        ["restart", _hours(c["restart_s"]), "the launcher's check, the ranks' start, the checkpoint read (measured "
                                            "by calibrate)" if _source(c, "restart") else
                                            "detection, rescheduling, reload, warm-up"],
    ]
    return rows


def _source(c: dict, cost: str) -> str:
    """Where a failure cost comes from, when it was measured (cli/options/campaign.py's failure_costs)."""
    where = c.get("costs_from", {}).get(cost, "")
    return f" ({where})" if where.startswith("measured") else ""


SWEEP_HEADERS = ["GPUs", "failure-free tokens/day", "effective training", "goodput tokens/day", "per GPU",
                 "marginal (with failures)"]


def campaign_sweep_rows(with_failures, campaigns: dict) -> list[list[str]]:
    """A row per GPU count of a sweep with campaigns (cli/options/campaign.py's campaign_sweep)."""
    rows = []
    for point in with_failures.points:
        c = campaigns.get(point.gpus)
        if c is None:
            rows.append([str(point.gpus), "does not fit", "", "", "", ""])
            continue
        free = c["tokens_per_step"] * 86_400 / c["step_s"]
        marginal = "" if point.marginal is None else f"{point.marginal:.0%}"
        rows.append([str(point.gpus), f"{free:.4g}", f"{c['ettr']:.1%}", f"{c['tokens_per_day']:.4g}",
                     f"{c['tokens_per_day'] / point.gpus:.4g}", marginal])
    return rows


def campaign_note(c: dict) -> str:
    return (f"(failures per 1000 server-days: {', '.join(f'{k} {v:g}' for k, v in c['failure_rates'].items())}; "
            f"{c['failure_rates_source']}; simulator/campaign/)")
