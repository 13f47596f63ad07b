"""The checkpoint interval that maximises a campaign's goodput, and the formulas it is checked against. Torch-free.

With failures at a constant rate (mean time between them M), a checkpoint of delta seconds and a restart of R:
  Young 1974 (Commun. ACM 17(9), "A first order approximation to the optimum checkpoint interval"): the compute
      between checkpoints tau = sqrt(2 delta M);
  Daly 2006 (Future Gener. Comput. Syst. 22(3), "A higher order estimate of the optimum checkpoint interval for
      restart dumps"): tau = sqrt(2 delta M) [1 + (1/3) sqrt(delta / 2M) + (1/9) (delta / 2M)] - delta while
      delta < 2M, else tau = M; and the expected wall time of each tau of compute,
      M e^(R/M) (e^((tau + delta)/M) - 1), whose ratio to tau is `daly_ettr`'s inverse.
`best_interval` finds the optimum by simulation instead (run.py, common random numbers over the candidates: each
seed draws the same failures whatever the interval), a parabola through the best candidate and its neighbours
in log interval; the formulas are its check where their assumptions hold (exponential failures, delta << M).
"""

from __future__ import annotations

import math
from dataclasses import replace

from simulator.campaign.model import Campaign
from simulator.campaign.run import simulate_campaign


def young(checkpoint_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly(checkpoint_s: float, mtbf_s: float) -> float:
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s


def daly_ettr(tau_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """The compute tau over its expected wall time (Daly 2006's model): the effective training time ratio."""
    if math.isinf(mtbf_s):
        return tau_s / (tau_s + checkpoint_s)
    return tau_s / (mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((tau_s + checkpoint_s) / mtbf_s))


def best_interval(c: Campaign, runs: int = 8, seed: int = 0, points: int = 11) -> tuple[int, list[tuple[int, float]]]:
    """(the interval in steps that maximises the mean goodput, the (interval, mean ETTR) scanned): candidates on a
    log grid from a tenth to ten times Daly's, on common random numbers. Without failures: no checkpoint but the
    one at the end pays, so the longest interval the campaign holds."""
    whole = max(1, int(c.hours * 3600 / c.step_s))
    if math.isinf(c.mtbf_s) or c.checkpoint_s == 0:
        return whole if math.isinf(c.mtbf_s) else 1, []
    guess = max(daly(c.checkpoint_s, c.mtbf_s), c.step_s) / c.step_s
    candidates = sorted({min(whole, max(1, round(guess * 10 ** (2 * i / (points - 1) - 1)))) for i in range(points)})
    scanned = [(n, _mean_ettr(replace(c, interval_steps=n), runs, seed)) for n in candidates]
    best = max(range(len(scanned)), key=lambda i: scanned[i][1])
    if 0 < best < len(scanned) - 1:  # a parabola through the best and its two neighbours, in log interval
        (a, ya), (b, yb), (d, yd) = ((math.log(n), y) for n, y in scanned[best - 1 : best + 2])
        denominator = (a - b) * (a - d) * (b - d)
        curvature = (d * (yb - ya) + b * (ya - yd) + a * (yd - yb)) / denominator
        if curvature < 0:
            slope = (d * d * (ya - yb) + b * b * (yd - ya) + a * a * (yb - yd)) / denominator
            vertex = round(math.exp(-slope / (2 * curvature)))
            return min(max(vertex, scanned[best - 1][0]), scanned[best + 1][0]), scanned
    return scanned[best][0], scanned


def _mean_ettr(c: Campaign, runs: int, seed: int) -> float:
    values = simulate_campaign(c, runs, seed).ettr
    return sum(values) / len(values)
