"""A whole campaign with failures, checkpoints and restarts (simulator/campaign/): the SimPy simulation against the
closed forms it must meet where their assumptions hold, and its inputs' checks."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from minigpt.errors import ConfigError
from simulator.campaign.interval import best_interval, daly, daly_ettr, young
from simulator.campaign.model import Campaign, FailureRates, checkpoint_seconds
from simulator.campaign.run import simulate_campaign, simulate_once

SERVERS = 100
MTBF_S = 3 * 3600.0
RATE = 1000 * 86_400 / (MTBF_S * SERVERS)  # per 1000 server-days: the job fails every 3 hours on 100 servers


def campaign(**changes) -> Campaign:
    base = Campaign(step_s=1.0, tokens_per_step=1000, gpus=8 * SERVERS, gpus_per_node=8, hours=1500,
                    rates=FailureRates({"gpu": RATE * 0.75, "network": RATE * 0.25}), checkpoint_s=60.0,
                    restart_s=600.0, interval_steps=1000)
    return replace(base, **changes)


def test_without_failures_goodput_is_the_steps_tokens_over_its_time():
    quiet = campaign(rates=FailureRates({"gpu": 0.0}), checkpoint_s=0.0, hours=24.0, step_s=0.7)
    result = simulate_campaign(quiet, runs=2).summary()
    assert result["tokens_per_day"] == pytest.approx(1000 / 0.7 * 86_400, rel=1e-4)
    assert result["ettr"] == pytest.approx(1.0, rel=1e-4) and result["interruptions"] == 0
    assert quiet.mtbf_s == math.inf and best_interval(quiet)[0] == int(24 * 3600 / 0.7)


def test_the_simulated_time_ratio_is_dalys_expected_one():
    """Daly 2006's expected wall time per interval (exponential failures, restarts that can fail too), against
    the simulation's mean over 8 runs of about 500 failures each."""
    c = campaign()
    assert c.mtbf_s == pytest.approx(MTBF_S)
    simulated = simulate_campaign(c, runs=8).summary()
    assert simulated["ettr"] == pytest.approx(daly_ettr(1000, 60, 600, MTBF_S), rel=0.01)
    assert simulated["interruptions"] == pytest.approx(c.hours * 3600 / MTBF_S, rel=0.05)
    shares = simulated["interruptions_by_cause"]
    assert shares["gpu"] / simulated["interruptions"] == pytest.approx(0.75, abs=0.03)


def test_the_best_interval_is_youngs_and_dalys_where_they_hold():
    """delta = 60 s << M = 3 h: the simulated optimum within 5% of both (Daly's is the closer, being the higher
    order)."""
    c = campaign()
    best, scanned = best_interval(c)
    assert best == pytest.approx(daly(60, MTBF_S), rel=0.05) and best == pytest.approx(young(60, MTBF_S), rel=0.05)
    ettrs = [ettr for _, ettr in scanned]
    peak = ettrs.index(max(ettrs))
    assert 0 < peak < len(ettrs) - 1  # the scan brackets it
    assert abs(best - daly(60, MTBF_S)) <= abs(best - young(60, MTBF_S))


def test_every_second_is_delivered_checkpointed_or_lost():
    """The wall time splits into the delivered steps, the checkpoints written, and what the failures cost (their
    rework and restarts), but for the campaign's unfinished end: part of a step, of a checkpoint or of a restart."""
    c = campaign(hours=300)
    run = simulate_once(c, seed=3)
    assert sum(run.failures.values()) > 50
    unaccounted = run.wall_s - run.steps * c.step_s - run.checkpoint_s - sum(run.lost_s.values())
    assert 0 <= unaccounted <= c.step_s + c.checkpoint_s + c.restart_s


def test_more_servers_fail_more_often():
    small, large = campaign(gpus=800), campaign(gpus=8000)
    assert large.mtbf_s == pytest.approx(small.mtbf_s / 10)


def test_checkpoint_seconds_is_each_gpus_share_of_the_servers_bandwidth():
    assert checkpoint_seconds(10e9, 20.0, 8) == pytest.approx(4.0)


@pytest.mark.parametrize("changes, says", [
    (dict(step_s=0.0), "step time must be a finite number above 0"),
    (dict(step_s=math.inf), "step time must be a finite number"),
    (dict(hours=-1.0), "length in hours must be a finite number above 0"),
    (dict(checkpoint_s=math.nan), "checkpoint time must be a finite number >= 0"),
    (dict(restart_s=-5.0), "restart time must be a finite number >= 0"),
    (dict(interval_steps=0), "interval steps must be a whole number >= 1"),
    (dict(hours=1e-4, step_s=1.0), "shorter than one step"),
])
def test_bad_campaigns_are_one_line(changes, says):
    with pytest.raises(ConfigError, match=says):
        campaign(**changes)


@pytest.mark.parametrize("rates, says", [({"gpu": -1.0}, "must be a finite number >= 0"),
                                         ({"gpu": math.inf}, "must be a finite number"), ({}, "name no cause")])
def test_bad_rates_are_one_line(rates, says):
    with pytest.raises(ConfigError, match=says):
        FailureRates(rates)
