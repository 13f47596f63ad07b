"""What a training campaign is made of, and the checks on it. Torch-free.

A campaign runs one job's step (seconds, tokens) for `hours` of wall-clock time on `gpus` GPUs in servers of
`gpus_per_node`. Its parts fail at constant rates (exponential times between failures: the model of Young 1974,
Daly 2006 and Kokolis et al. 2025), given per cause as failures per 1000 server-days, so the job's failure rate
is the sum over causes times its servers: one failure anywhere stops every rank of a synchronous job. Each stop
costs the work since the last checkpoint that was written in full, and a restart (detecting the failure,
rescheduling, reloading the checkpoint, warming up) of `restart_s`. A checkpoint every `interval_steps` steps
blocks training for `checkpoint_s` (the sharded checkpoint's bytes per GPU over each GPU's share of the storage
write bandwidth: `checkpoint_seconds`). With `straggler_cv` every step waits for the slowest of the `gpus` ranks
(simulator/stragglers.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minigpt.errors import ConfigError

SERVER_DAY_S = 86_400.0


def _positive(name: str, value, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be a finite number {'>= 0' if allow_zero else 'above 0'}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class FailureRates:
    """Failures per 1000 server-days, by cause; `source`: where the numbers come from."""

    per_cause: dict[str, float]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.per_cause:
            raise ConfigError("the failure rates name no cause: give at least one rate (0 for none)")
        for cause, rate in self.per_cause.items():
            _positive(f"the failure rate of {cause!r} (per 1000 server-days)", rate, allow_zero=True)

    @property
    def total(self) -> float:
        return sum(self.per_cause.values())

    def per_second(self, servers: int) -> float:
        """The job's failure rate (1/s) on `servers` servers."""
        return self.total / 1000.0 * servers / SERVER_DAY_S


@dataclass(frozen=True)
class Campaign:
    step_s: float  # one training step, failure-free (minigpt simulate's step time)
    tokens_per_step: int
    gpus: int
    gpus_per_node: int
    hours: float  # the campaign's wall-clock length
    rates: FailureRates
    checkpoint_s: float  # one blocking checkpoint write
    restart_s: float  # from a failure to training again: detection, rescheduling, reload, warm-up
    interval_steps: int  # steps between checkpoints
    straggler_cv: float = 0.0  # each rank's step time varies by this coefficient of variation (simulator/stragglers.py)

    def __post_init__(self) -> None:
        _positive("the step time", self.step_s)
        _positive("the campaign's length in hours", self.hours)
        _positive("the checkpoint time", self.checkpoint_s, allow_zero=True)
        _positive("the restart time", self.restart_s, allow_zero=True)
        _positive("the stragglers' coefficient of variation", self.straggler_cv, allow_zero=True)
        for name in ("tokens_per_step", "gpus", "gpus_per_node", "interval_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name.replace('_', ' ')} must be a whole number >= 1, got {value!r}")
        if self.hours * 3600 < self.step_s:
            raise ConfigError(f"a campaign of {self.hours:g} h is shorter than one step ({self.step_s:g} s)")

    @property
    def servers(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def mtbf_s(self) -> float:
        """The job's mean time between failures, seconds (inf without failures)."""
        rate = self.rates.per_second(self.servers)
        return math.inf if rate == 0 else 1.0 / rate


def checkpoint_seconds(bytes_per_gpu: float, write_gb_s_per_node: float, gpus_per_node: int) -> float:
    """One sharded checkpoint: every GPU writes its own states at once (torch.distributed.checkpoint's layout), each
    at its share of its server's storage write bandwidth (decimal GB/s)."""
    _positive("the checkpoint's bytes per GPU", bytes_per_gpu, allow_zero=True)
    bandwidth = _positive("the storage write bandwidth (GB/s per server)", write_gb_s_per_node)
    return bytes_per_gpu * gpus_per_node / (bandwidth * 1e9)
