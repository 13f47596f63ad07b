"""`minigpt simulate --campaign DAYS`: the simulated step run for a whole campaign on a cluster whose parts fail.

The step (its time and tokens) is the one simulate just predicted; the checkpoint's bytes per GPU are its
memory estimate's weights, fp32 masters and Adam moments (what torch.distributed.checkpoint writes of each rank);
the failure rates, the storage's write bandwidth and the restart time are flags with cited defaults
(simulator/campaign/rates.py). Checked before anything is simulated: one line and exit code 2 on a bad value.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import click

from minigpt.errors import ConfigError

CAMPAIGN_RUNS = 20  # seeds a campaign's figures average over, unless --campaign-runs says

OPTIONS = (
    click.option("--campaign", "campaign_days", type=float, metavar="DAYS",
                 help="Run the predicted step for a whole campaign of DAYS on a cluster whose parts fail: goodput, "
                      "effective training time, interruptions and time lost by cause, the best checkpoint interval "
                      "(simulator/campaign/)."),
    click.option("--failure-rates", "failure_rates", metavar="NAME|FILE",
                 help="Failures per 1000 server-days by cause: a preset name (simulator/campaign/rates.py) or a "
                      "JSON file {\"cause\": rate, ...}. [default: rsc-1, Meta's A100 cluster in Kokolis et al. 2025]"),
    click.option("--checkpoint-every", "checkpoint_every", type=int, metavar="STEPS",
                 help="Steps between checkpoints [default: the interval that maximises goodput, found by simulation "
                      "and shown beside Young's and Daly's]."),
    click.option("--storage-gbps", "storage_gbps", type=float, metavar="GB/S",
                 help="Checkpoint write bandwidth per server, decimal GB/s [default: rates.py's cited figure]."),
    click.option("--restart-minutes", "restart_minutes", type=float, metavar="MIN",
                 help="From a failure to training again: detection, rescheduling, reload, warm-up "
                      "[default: rates.py's cited figure]."),
    click.option("--straggler-cv", "straggler_cv", type=float, metavar="CV",
                 help="Stragglers: each rank's step time varies as a normal of this coefficient of variation, "
                      "independently, and every step waits for the slowest of all GPUs (simulator/stragglers.py) "
                      "[default: 0, none]."),
    click.option("--campaign-runs", "campaign_runs", type=int,
                 help=f"Simulated campaigns (seeds) the figures average over [default: {CAMPAIGN_RUNS}]."),
)


def campaign_options(command: Callable) -> Callable:
    for option in reversed(OPTIONS):
        command = option(command)
    return command


def _number(options: dict, key: str, flag: str, allow_zero: bool = False) -> None:
    value = options.get(key)
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{flag} must be a finite number {'>= 0' if allow_zero else 'above 0'}, got {value:g}")


def check_campaign(options: dict) -> None:
    """Every campaign flag, one line each, before any simulation; the failure rates read into options."""
    from simulator.campaign.rates import read_rates

    flags = ("failure_rates", "checkpoint_every", "storage_gbps", "restart_minutes", "straggler_cv", "campaign_runs")
    if options["campaign_days"] is None:
        given = [f"--{key.replace('_', '-')}" for key in flags if options[key] is not None]
        if given:
            raise ConfigError(f"{given[0]} describes a campaign: add --campaign DAYS")
        return
    _number(options, "campaign_days", "--campaign")
    _number(options, "storage_gbps", "--storage-gbps")
    _number(options, "restart_minutes", "--restart-minutes", allow_zero=True)
    _number(options, "straggler_cv", "--straggler-cv", allow_zero=True)
    for key, flag in (("checkpoint_every", "--checkpoint-every"), ("campaign_runs", "--campaign-runs")):
        if options[key] is not None and options[key] < 1:
            raise ConfigError(f"{flag} must be a whole number >= 1, got {options[key]}")
    options["campaign_runs"] = options["campaign_runs"] or CAMPAIGN_RUNS
    options["rates"] = read_rates(options["failure_rates"])


def campaign_sweep(sweep, options: dict, hardware=None):
    """The sweep again with each point's campaign goodput (samples a second over the whole campaign) in place of
    its failure-free throughput: where adding GPUs stops paying once failures, checkpoints and stragglers count.
    Returns (that ScalingSweep, each fitting point's campaign by GPU count)."""
    from simulator.search.sweep import ScalingPoint, ScalingSweep, add_point

    with_failures, campaigns = ScalingSweep(sweep.scaling, sweep.threshold), {}
    for point in sweep.points:
        goodput = 0.0
        if point.result.fits:
            campaigns[point.gpus] = run_campaign(point.result, options, hardware)
            goodput = campaigns[point.gpus]["tokens_per_day"] / point.result.seq_len / 86_400
        add_point(with_failures, ScalingPoint(point.gpus, point.global_batch, point.result, goodput))
    return with_failures, campaigns


def failure_costs(per_gpu: float, gpus_per_node: int, options: dict, hardware) -> dict:
    """The checkpoint's and the restart's seconds, the storage bandwidth they imply and where they come from: the
    flags' where given; else, on a profile
    that measured them (simulator/costs/host.py's FailureCosts: `minigpt calibrate` on this machine), the server's
    measured checkpoint write of its GPUs' bytes, and a restart that notices the failure, starts the ranks and
    reads that checkpoint back; else rates.py's cited figures."""
    from simulator.campaign.model import checkpoint_seconds
    from simulator.campaign.rates import RESTART_S, STORAGE_GB_S

    host = None if hardware is None else hardware.gpu.measured
    measured = None if host is None else host.failure_costs
    server_bytes = per_gpu * gpus_per_node
    if options["storage_gbps"] is not None or measured is None:
        storage = options["storage_gbps"] or STORAGE_GB_S
        checkpoint = checkpoint_seconds(per_gpu, storage, gpus_per_node)
        write_from = "--storage-gbps" if options["storage_gbps"] is not None else "rates.py"
    else:
        checkpoint, write_from = measured.write.seconds(server_bytes), "measured by calibrate"
        storage = server_bytes / checkpoint / 1e9 if server_bytes > 0 else 1 / measured.write.beta / 1e9
    if options["restart_minutes"] is not None or measured is None:
        restart, restart_from = (RESTART_S, "rates.py") if options["restart_minutes"] is None else (
            options["restart_minutes"] * 60, "--restart-minutes")
    else:
        restart, restart_from = measured.restart_seconds(server_bytes), "measured by calibrate"
    return {"checkpoint_s": checkpoint, "restart_s": restart, "storage_gb_s_per_server": storage,
            "costs_from": {"checkpoint": write_from, "restart": restart_from}}


def run_campaign(result, options: dict, hardware=None) -> dict:
    """The campaign of `result`'s step (simulator/engine/simulate.py's SimResult) as the flags describe it;
    `hardware` (simulator/costs/hardware.py's Hardware): its measured failure costs where the flags give none."""
    from simulator.campaign.interval import best_interval, daly, young
    from simulator.campaign.model import Campaign
    from simulator.campaign.rates import SERVER_GPUS
    from simulator.campaign.run import simulate_campaign

    memory, layout = result.memory, result.layout
    per_gpu = memory.parameters + memory.master_weights + memory.adam_m + memory.adam_v
    gpus_per_node = min(SERVER_GPUS, layout.world_size)  # the rates' servers, not the cluster's NVLink domains
    costs = failure_costs(per_gpu, gpus_per_node, options, hardware)
    campaign = Campaign(step_s=result.step_time_s, tokens_per_step=result.global_batch * result.seq_len,
                        gpus=layout.world_size, gpus_per_node=gpus_per_node,
                        hours=options["campaign_days"] * 24, rates=options["rates"],
                        checkpoint_s=costs["checkpoint_s"], restart_s=costs["restart_s"], interval_steps=1,
                        straggler_cv=options["straggler_cv"] or 0.0)
    best, scanned = best_interval(campaign)
    chosen = options["checkpoint_every"] or best
    summary = simulate_campaign(replace(campaign, interval_steps=chosen), options["campaign_runs"]).summary()
    mtbf = campaign.mtbf_s
    return {**summary, "days": options["campaign_days"], "checkpoint_every": chosen, "best_interval": best,
            "young_steps": young(campaign.checkpoint_s, mtbf) / campaign.step_s if math.isfinite(mtbf) else None,
            "daly_steps": daly(campaign.checkpoint_s, mtbf) / campaign.step_s if math.isfinite(mtbf) else None,
            **costs, "checkpoint_bytes_per_gpu": per_gpu, "failure_rates": dict(campaign.rates.per_cause),
            "failure_rates_source": campaign.rates.source, "step_s": campaign.step_s,
            "tokens_per_step": campaign.tokens_per_step, "straggler_cv": campaign.straggler_cv,
            "scanned": [[n, ettr] for n, ettr in scanned]}
