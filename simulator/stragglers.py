"""Stragglers: a synchronous step waits for the slowest of its ranks. Torch-free.

Each rank's time for a step is its failure-free time times (1 + cv x Z), Z standard normal, independent across
ranks and steps (the stated distribution: `--straggler-cv`); the step takes the largest of the N ranks', so it
lasts step x (1 + cv x M_N) with M_N the maximum of N standard normals, whose mean grows like sqrt(2 ln N): the
cost of a straggler grows with the GPU count. `max_moments` gives M_N's mean and variance by numerical
integration of its density N phi(x) Phi(x)^(N-1); a checkpoint interval of n steps then lasts n x step x
(1 + cv E[M_N]) with standard deviation step x cv sqrt(n Var[M_N]) (a sum of n independent steps, drawn as a
normal: the central limit theorem, exact enough from a few steps on). `straggler_factor` is the mean of that:
what a synchronous step of N ranks costs over one rank's, as the step engine prices a measured host's compute
(simulator/engine/host.py: the coefficient of variation calibrate measured with N ranks busy).
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist

STANDARD = NormalDist()
POINTS = 4001  # Simpson's rule over [-10, 10]: the density of M_N lies well inside for N up to 2^20


@lru_cache(maxsize=64)
def max_moments(n: int) -> tuple[float, float]:
    """(mean, variance) of the maximum of n independent standard normals."""
    if n == 1:
        return 0.0, 1.0
    low, high = -10.0, 10.0
    h = (high - low) / (POINTS - 1)
    first = second = 0.0
    for i in range(POINTS):
        x = low + i * h
        weight = 1 if i in (0, POINTS - 1) else (4 if i % 2 else 2)
        density = n * STANDARD.pdf(x) * math.exp((n - 1) * math.log(max(STANDARD.cdf(x), 1e-300)))
        first += weight * x * density
        second += weight * x * x * density
    mean, moment = first * h / 3, second * h / 3
    return mean, max(0.0, moment - mean * mean)


def straggler_factor(cv: float, ranks: int) -> float:
    """A synchronous step's expected time over one rank's when each of `ranks` ranks varies by `cv`: 1 + cv E[M_N]."""
    return 1.0 + cv * max_moments(ranks)[0] if cv > 0 and ranks > 1 else 1.0


def cv_giving(factor: float, ranks: int) -> float:
    """The coefficient of variation whose straggler_factor at `ranks` ranks is `factor` (a measured slowest rank
    over the mean: parallel/calibrate/host.py's stragglers rows); 0 for one rank."""
    return (factor - 1) / max_moments(ranks)[0] if ranks > 1 else 0.0


def interval_seconds(steps: int, step_s: float, cv: float, ranks: int, z: float) -> float:
    """`steps` synchronous steps of `ranks` ranks, each rank's step step_s x (1 + cv x N(0, 1)); `z` a standard
    normal draw for the sum's spread (0: its mean)."""
    if cv == 0:
        return steps * step_s
    mean, variance = max_moments(ranks)
    return max(0.0, steps * step_s * (1 + cv * mean) + step_s * cv * math.sqrt(steps * variance) * z)
