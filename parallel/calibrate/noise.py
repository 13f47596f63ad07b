"""How quiet the machine was while `minigpt calibrate` measured it: the CPU a thread got, and the spread of repeats.

Why: every time in a profile was measured on this machine's cores, and other work on them stretches each one
(a one-rank step predicted 20x too slow after a calibration on a busy machine: issue 16) without anything in
the numbers saying so. So calibrate measures its own conditions and writes them into the profile's
measured["reliability"] (`reliability`; simulator/costs/host.py checks its fields, `minigpt compare` prints them):

- CPU share: one thread's CPU seconds (time.thread_time) over the wall seconds (time.perf_counter) while it
  computes: about 1 on a quiet machine; with k other runnable threads on c cores about c / (k + 1) (4 spinning
  processes on 2 cores: 0.4). Taken three ways: `cpu_share`, a PROBE_S spin of the calling process before the
  ranks start and again after they end; and rank 0's own share over the measurements it makes alone (the
  matmuls, the copy, the reference block and the units: `Noise.timed`), which also sees load that came and
  went in between. And the cores rank 0 got while it timed its block on every core's thread (the sharing
  table's threads row: its process's CPU seconds over the wall seconds times the cores; `Noise.threads_share`),
  which is the only one to see another process on another core. Not on CUDA, where a host thread waiting for its GPU may spin or sleep (None there).
- the threads row's time itself (`threads_ratio`: the block on every core's thread over one thread's time, the
  sharing table's [1, cores] row): a share sees the cores a process was given, not what they computed. A VM whose
  host runs other work on the same physical cores (or whose cores are hyperthreads of one) gives its threads
  every core's time and no speed-up: CI here once measured 1.06 with 99.6% of both cores, and that profile
  predicted a dp 2 step 63% too slow (its two ranks had slowed each other as the threads had). On this
  project's 2-core VM, quiet, the ratio is 0.54-0.70 (six runs of the tiny block at micro-batch 8).
- spread: of the repeated runs of one measurement, (slowest - fastest) / median, parallel/calibrate/kernels.py's
  convention: the reference block's runs, and each unit series' runs, weighted by the series' median time
  (`Noise.weighted_spread`: a step's compute is a sum of such times, and the short pieces, noisy on any machine,
  weigh little in it). The matmuls' spread (the worst over sizes, per format) is recorded and not judged: a
  quick run times tiny matmuls for 5 ms, which is noisy on any machine. Spreads see what a share cannot: on
  this project's shared 2-core VM a thread got 97% of a core while the units' runs spread by 34% (other work
  on the other core, the memory bus and the caches slows a thread without taking its core).

The thresholds rest on one tolerance, TOLERANCE = 10%: the change in the reference block at which `minigpt
compare`'s drift line asks for a recalibration (cli/commands/compare.py). A profile is reliable when every share is at
least 1 / (1 + TOLERANCE) = 91% (a time is stretched by at most that 10%), the block's and the units'
spreads are at most 2 x TOLERANCE = 20% (half the runs' range, the uncertainty of their median, is then 10%),
and every core's threads run the block in at most FREE_CORES_RATIO = 91% of one thread's time (at least 10%
faster: the other cores computed).
Below REFUSE_SHARE = 50% of a core every time is stretched two-fold or more, an error larger than the quantity
itself: calibrate refuses (ConfigError: one line, exit 2, nothing written) unless --allow-busy, which writes
the profile marked unreliable. Between the two it writes the profile marked unreliable and warns.
`confidence` = (1 / the lowest share - 1) + the larger spread / 2: how far the calibration's own times may sit
from this machine's unloaded times (the stretch of the load, one-sided, plus half the runs' range). It
bounds the calibration's noise only, not the simulator's model error, which `compare` measures.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

from minigpt.errors import ConfigError

TOLERANCE = 0.10  # compare's drift line asks for a recalibration past a 10% change of the reference block
RELIABLE_SHARE = 1 / (1 + TOLERANCE)  # 91% of a core: a time stretched by at most TOLERANCE
RELIABLE_SPREAD = 2 * TOLERANCE  # a range of 20% of the median: half of it, the median's uncertainty, is TOLERANCE
FREE_CORES_RATIO = RELIABLE_SHARE  # every core's threads at most 91% of one thread's time: the cores computed
REFUSE_SHARE = 0.5  # below half a core every time is at least doubled: refused unless --allow-busy
WHEN = {"before": "before the ranks started", "alone": "while rank 0 measured alone", "after": "after the ranks ended",
        "threads": "per core while rank 0 timed a thread on each"}
PROBE_S = 0.3  # a probe's spin: about a hundred scheduler time slices, enough to average them


def cpu_share(window_s: float = PROBE_S) -> float:
    """The share of one core this thread gets while it spins for window_s seconds (0 to 1)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall < window_s:
        pass  # pure Python: holds the GIL and one core, touches no memory
    return min(1.0, (time.thread_time() - cpu) / max(time.perf_counter() - wall, 1e-9))


def spread(values: list[float]) -> float | None:
    """(slowest - fastest) / median of repeated runs; None for fewer than two runs."""
    if len(values) < 2:
        return None
    median = statistics.median(values)
    return (max(values) - min(values)) / median if median > 0 else 0.0


@dataclass
class Noise:
    """Rank 0's record of its measurements alone: thread CPU and wall seconds inside `timed`, and per kind the
    (spread, median seconds) of each measurement's repeated runs."""

    cpu_s: float = 0.0
    wall_s: float = 0.0
    runs: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    cores_cpu_s: float = 0.0  # the process's CPU and wall seconds inside timed_on_cores, summed over its entries
    cores_wall_s: float = 0.0  # (the wall seconds times the cores)

    @property
    def threads_share(self) -> float | None:
        """The share of every core the process got while the threads row was timed (None: not timed)."""
        return min(1.0, self.cores_cpu_s / self.cores_wall_s) if self.cores_wall_s > 0 else None

    @contextlib.contextmanager
    def timed_on_cores(self, cores: int):
        """Record the share of `cores` cores this process gets inside the block (its every thread's CPU time),
        over every block entered so far."""
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.cores_cpu_s += time.process_time() - cpu
            self.cores_wall_s += max(time.perf_counter() - wall, 1e-9) * cores

    @contextlib.contextmanager
    def timed(self):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.cpu_s += time.thread_time() - cpu
            self.wall_s += time.perf_counter() - wall

    def add(self, kind: str, runs: list[float]) -> None:
        value = spread(runs)
        if value is not None:
            self.runs.setdefault(kind, []).append((value, statistics.median(runs)))

    def weighted_spread(self, kind: str) -> float | None:
        """The spreads of `kind`'s measurements weighted by their median times: the spread of a sum of those times
        (a step's compute is one) when the noise of every run moves together, the worst case."""
        pairs = self.runs.get(kind)
        total = sum(seconds for _, seconds in pairs or ())
        return sum(value * seconds for value, seconds in pairs) / total if total > 0 else None

    def as_dict(self, on_cpu: bool) -> dict:
        """{"cpu_share_alone": share or None (CUDA, or nothing timed), "cpu_share_threads": threads_share,
        "spread_units": weighted_spread("units")}."""
        share = min(1.0, self.cpu_s / self.wall_s) if on_cpu and self.wall_s > 0 else None
        return {"cpu_share_alone": share, "cpu_share_threads": self.threads_share if on_cpu else None,
                "spread_units": self.weighted_spread("units")}


def check_quiet(share: float | None, when: str, allow_busy: bool) -> float | None:
    """share, or ConfigError when it is below REFUSE_SHARE and the caller did not allow a busy machine.
    when: "before", "alone" or "after" (WHEN)."""
    if share is not None and share < REFUSE_SHARE and not allow_busy:
        raise ConfigError(f"the machine is busy: calibrate's measuring thread got {share:.0%} of a core {WHEN[when]} "
                          f"(below {REFUSE_SHARE:.0%}, every time it measures would be stretched "
                          f"{1 / max(share, 1e-3):.1f}x); stop other work and calibrate again, or pass --allow-busy "
                          f"to write a profile marked unreliable")
    return share


def reliability(before: float | None, after: float | None, noise: dict | None, block_spread: float | None,
                matmul_spreads: dict | None, allowed_busy: bool, threads_ratio: float | None = None) -> dict:
    """The profile's measured["reliability"] (the module docstring says what each field is and the thresholds).
    threads_ratio: the sharing table's [1, cores] row (None: one core, or CUDA)."""
    noise = noise or {}
    shares = {"before": before, "alone": noise.get("cpu_share_alone"), "after": after,
              "threads": noise.get("cpu_share_threads")}
    spreads = {"block": block_spread, "units": noise.get("spread_units")}
    known_shares = [s for s in shares.values() if s is not None]
    known_spreads = [s for s in spreads.values() if s is not None]
    why = []
    lowest = min(known_shares) if known_shares else None
    if lowest is not None and lowest < RELIABLE_SHARE:
        when = ", ".join(f"{s:.0%} of a core {WHEN[k]}" for k, s in shares.items() if s is not None and s < RELIABLE_SHARE)
        why.append(f"measured on a busy machine (a measuring thread got {when}; {RELIABLE_SHARE:.0%} needed)")
    widest = max(known_spreads) if known_spreads else None
    if widest is not None and widest > RELIABLE_SPREAD:
        runs = ", ".join(f"{k} {s:.0%}" for k, s in spreads.items() if s is not None and s > RELIABLE_SPREAD)
        why.append(f"repeated runs disagree ({runs} spread; at most {RELIABLE_SPREAD:.0%} needed)")
    if threads_ratio is not None and threads_ratio > FREE_CORES_RATIO:
        why.append(f"the other cores did not compute: every core's thread ran the block in {threads_ratio:.0%} of one "
                   f"thread's time (at most {FREE_CORES_RATIO:.0%} needed; a busy host, or cores that share one)")
    if not known_shares:
        why.append("the CPU share was not measured")
    confidence = None if lowest is None else (1 / max(lowest, 1e-3) - 1) + (widest or 0.0) / 2
    matmuls = [s for s in (matmul_spreads or {}).values() if s is not None]
    return {**{f"cpu_share_{k}": _rounded(v) for k, v in shares.items()},
            **{f"spread_{k}": _rounded(v) for k, v in spreads.items()},
            "spread_matmuls": _rounded(max(matmuls) if matmuls else None), "threads_ratio": _rounded(threads_ratio),
            "confidence": _rounded(confidence), "reliable": not why,
            "why": "; ".join(why) if why else "a quiet machine: every share and spread within the thresholds",
            "allowed_busy": allowed_busy,
            "note": f"parallel/calibrate/noise.py: reliable when every CPU share >= {RELIABLE_SHARE:.0%} and the "
                    f"block's and units' spreads <= {RELIABLE_SPREAD:.0%} and every core's threads <= {FREE_CORES_RATIO:.0%} "
                    f"of one thread's time; refused below {REFUSE_SHARE:.0%} of a core "
                    f"unless --allow-busy; confidence = (1 / lowest share - 1) + widest spread / 2, the "
                    f"calibration's own noise (not the simulator's model error)"}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def details(data: dict) -> str:
    """The measured shares and spreads of a reliability object, in a line."""
    shares = ", ".join(f"{data[f'cpu_share_{k}']:.0%} {k}" for k in ("before", "alone", "after")
                       if data.get(f"cpu_share_{k}") is not None)
    spreads = ", ".join(f"{k} {data[f'spread_{k}']:.0%}" for k in ("block", "units", "matmuls")
                        if data.get(f"spread_{k}") is not None)
    threads = ("" if data.get("threads_ratio") is None else
               f"; every core's threads {data['threads_ratio']:.2f}x of one thread's time")
    return f"CPU share of a core {shares or 'not measured'}; spread of repeated runs: {spreads or 'not measured'}{threads}"


def summary(data: dict | None, what: str = "calibration") -> str:
    """One line on a profile's reliability object (None: a profile without one), for calibrate's and compare's output."""
    if data is None:
        return (f"{what} confidence unknown: the profile records no measurement noise (a preset, or calibrated "
                f"before calibrate recorded it); profile reliability unknown")
    confidence = data.get("confidence")
    bound = "unknown" if confidence is None else f"±{confidence:.0%}"
    state = "reliable" if data.get("reliable") else f"UNRELIABLE: {data.get('why')}"
    return f"{what} confidence {bound} (from the calibration's measured CPU share and spread); profile {state}"
