"""A campaign as SimPy processes: training interrupted by failures, replicated over seeds. Torch-free.

One process trains: `interval_steps` steps, then a blocking checkpoint, again and again; after a failure it
restarts (`restart_s`) and goes on from the last checkpoint written in full. Another draws the failures: the time
to the next one exponential at the job's rate, its cause drawn in proportion to the causes' rates, and interrupts
the first wherever it is (computing, checkpointing or restarting again). With stragglers an interval's steps
last as long as their slowest ranks make them (simulator/stragglers.py), drawn from a generator of their own. Lost to a failure: the work since the
last complete checkpoint (the partial checkpoint included) and the restart it causes (a restart cut short by the
next failure is charged to the first). When the campaign's time is up, the steps done since the last checkpoint
count (the job's end writes them). Every run of the same seed draws the same failures, whatever the interval:
intervals compare on common random numbers (interval.py).
"""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from dataclasses import dataclass

import simpy

from simulator.campaign.model import Campaign
from simulator.stragglers import interval_seconds, max_moments

DAY_S = 86_400.0


@dataclass(frozen=True)
class RunResult:
    """One simulated campaign."""

    steps: int  # steps delivered
    failures: Counter  # by cause
    lost_s: Counter  # rework and restarts, by cause
    checkpoint_s: float  # time spent writing checkpoints
    wall_s: float


class _Campaign:
    def __init__(self, c: Campaign, seed: int):
        self.c, self.env, self.rng = c, simpy.Environment(), random.Random(seed)
        self.steps_rng = random.Random(f"{seed} stragglers")  # apart: the failures stay the same whatever the steps
        self.steps, self.failures, self.lost, self.checkpoints = 0, Counter(), Counter(), 0.0
        self.phase, self.since = "compute", 0.0  # what the trainer does, and since when its unsaved work began
        self.restart = None  # (cause, start) while restarting

    def train(self):
        c, env = self.c, self.env
        while True:
            try:
                if self.restart is not None:
                    yield env.timeout(c.restart_s)
                    self.lost[self.restart[0]] += c.restart_s
                    self.restart = None
                self.phase, self.since = "compute", env.now
                yield env.timeout(interval_seconds(c.interval_steps, c.step_s, c.straggler_cv, c.gpus,
                                                   self.steps_rng.gauss(0.0, 1.0) if c.straggler_cv else 0.0))
                self.phase = "checkpoint"
                yield env.timeout(c.checkpoint_s)
                self.steps += c.interval_steps
                self.checkpoints += c.checkpoint_s
            except simpy.Interrupt as stop:
                cause = stop.cause
                self.failures[cause] += 1
                if self.restart is not None:  # the restart cut short: charged to the failure that caused it
                    self.lost[self.restart[0]] += env.now - self.restart[1]
                else:
                    self.lost[cause] += env.now - self.since
                self.restart = (cause, env.now)

    def fail(self, trainer, rate: float, causes: list[str], weights: list[float]):
        while True:
            yield self.env.timeout(self.rng.expovariate(rate))
            trainer.interrupt(self.rng.choices(causes, weights)[0])

    def run(self) -> RunResult:
        c, env = self.c, self.env
        trainer = env.process(self.train())
        rate = c.rates.per_second(c.servers)
        if rate > 0:
            causes = [cause for cause, r in c.rates.per_cause.items() if r > 0]
            env.process(self.fail(trainer, rate, causes, [c.rates.per_cause[cause] for cause in causes]))
        wall = c.hours * 3600.0
        env.run(until=wall)
        tail = 0
        if self.restart is None:  # the steps done since the last checkpoint: the job's end saves them
            step = c.step_s * (1 + c.straggler_cv * max_moments(c.gpus)[0])  # a step with its slowest rank
            tail = c.interval_steps if self.phase == "checkpoint" else int((wall - self.since) / step + 1e-9)
        return RunResult(self.steps + min(tail, c.interval_steps), self.failures, self.lost, self.checkpoints, wall)


def simulate_once(c: Campaign, seed: int = 0) -> RunResult:
    return _Campaign(c, seed).run()


@dataclass(frozen=True)
class CampaignResult:
    """Means over `runs` simulated campaigns (seeds 0..runs-1 after `seed`), with the spread of the goodput."""

    campaign: Campaign
    runs: list[RunResult]

    @property
    def ettr(self) -> list[float]:
        """Effective training time ratio of each run: the delivered steps' failure-free time over the wall time."""
        return [r.steps * self.campaign.step_s / r.wall_s for r in self.runs]

    @property
    def tokens_per_day(self) -> list[float]:
        return [r.steps * self.campaign.tokens_per_step / (r.wall_s / DAY_S) for r in self.runs]

    def summary(self) -> dict:
        ettr, tokens = self.ettr, self.tokens_per_day
        n = len(self.runs)
        causes = sorted({cause for r in self.runs for cause in r.failures} | set(self.campaign.rates.per_cause))
        return {
            "runs": n,
            "ettr": statistics.fmean(ettr), "ettr_spread": _spread(ettr),
            "tokens_per_day": statistics.fmean(tokens), "tokens_per_day_spread": _spread(tokens),
            "interruptions": statistics.fmean(sum(r.failures.values()) for r in self.runs),
            "interruptions_by_cause": {cause: sum(r.failures[cause] for r in self.runs) / n for cause in causes},
            "lost_hours_by_cause": {cause: sum(r.lost_s[cause] for r in self.runs) / n / 3600 for cause in causes},
            "checkpoint_hours": statistics.fmean(r.checkpoint_s for r in self.runs) / 3600,
            "mtbf_hours": self.campaign.mtbf_s / 3600,
            "straggler_slowdown": self.campaign.straggler_cv * max_moments(self.campaign.gpus)[0],
        }


def _spread(values: list[float]) -> list[float]:
    """(5th, 95th) percentiles of the runs (the lowest and highest below 20 runs)."""
    ordered = sorted(values)
    if len(ordered) < 20:
        return [ordered[0], ordered[-1]]
    return [ordered[math.floor(0.05 * (len(ordered) - 1))], ordered[math.ceil(0.95 * (len(ordered) - 1))]]


def simulate_campaign(c: Campaign, runs: int = 20, seed: int = 0) -> CampaignResult:
    return CampaignResult(c, [simulate_once(c, seed + i) for i in range(runs)])
