"""A whole campaign with failures, checkpoints and restarts (simulator/campaign/): the SimPy simulation against the
closed forms it must meet where their assumptions hold, and its inputs' checks."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

import pytest

from minigpt.errors import ConfigError
from simulator.campaign.interval import best_interval, daly, daly_ettr, young
from simulator.campaign.model import Campaign, FailureRates, checkpoint_seconds
from simulator.campaign.run import simulate_campaign, simulate_once
from simulator.stragglers import max_moments

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
    (dict(straggler_cv=-0.1), "coefficient of variation must be a finite number >= 0"),
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


# ---------------------------------------------------------------- stragglers

def test_the_slowest_ranks_moments_are_the_order_statistics():
    """The maximum of n standard normals: 1/sqrt(pi) and 1 - 1/pi for two; 1.42360 for eight (the tabulated
    expected normal order statistic); a sample of maxima of 16 agrees."""
    assert max_moments(1) == (0.0, 1.0)
    assert max_moments(2) == (pytest.approx(1 / math.sqrt(math.pi), rel=1e-6), pytest.approx(1 - 1 / math.pi, rel=1e-6))
    assert max_moments(8)[0] == pytest.approx(1.42360, abs=1e-5)
    rng = random.Random(0)
    sample = [max(rng.gauss(0, 1) for _ in range(16)) for _ in range(20_000)]
    mean, variance = max_moments(16)
    assert statistics.fmean(sample) == pytest.approx(mean, rel=0.01)
    assert statistics.variance(sample) == pytest.approx(variance, rel=0.05)


@pytest.mark.parametrize("gpus", [8, 800, 80_000])
def test_a_straggler_costs_what_the_order_statistics_predict(gpus):
    """No failures, no checkpoints: each step lasts its slowest rank's, 1 + cv E[M_N] times the step, so the
    effective training time is its inverse and falls as the GPUs grow."""
    cv = 0.05
    c = campaign(rates=FailureRates({"gpu": 0.0}), checkpoint_s=0.0, hours=200.0, gpus=gpus, straggler_cv=cv,
                 interval_steps=500)
    ettr = simulate_campaign(c, runs=3).summary()["ettr"]
    assert ettr == pytest.approx(1 / (1 + cv * max_moments(gpus)[0]), rel=2e-3)


def test_more_ranks_straggle_more():
    slowdowns = [simulate_campaign(campaign(gpus=g, straggler_cv=0.02, hours=100.0), runs=2).summary()
                 ["straggler_slowdown"] for g in (8, 64, 512, 4096)]
    assert slowdowns == sorted(slowdowns) and slowdowns[0] > 0
