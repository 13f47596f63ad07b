"""Matmul efficiency tables: measured or published efficiency by smallest dimension, per number format.

Torch-free, and below both hardware.py (which parses a GPU entry's "matmul_efficiency") and
compute.py (which prices matmuls with it). A GPU entry of a hardware file may hold

    "matmul_efficiency": {"launch_latency": 4e-6, "source": "...",
                          "bf16": [[64, 0.20], [256, 0.55], [1024, 0.78], [8192, 0.85]]}

efficiency = achieved FLOP/s / the format's dense peak, by the smallest side of the matmul. Between
points the efficiency is interpolated linearly in log(size); outside them the nearest point holds.

A preset's object may also hold "gemm_model" (simulator/costs/rates/gemm_model.py: the GPU's SM count and, per
format, a GEMM model by (m, n, k) with wave quantisation, fitted to published sweeps), and so does a GPU's
calibrated profile (fitted to the GEMMs calibrate timed: simulator/costs/rates/gemm_fit.py); compute.py prices a
format that has one with it, every other format (and a CPU's calibrated profile) with its table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from minigpt.errors import ConfigError
from simulator.json_file import FRACTION, SECONDS, in_range
from precision.policy import FLOP_FORMATS
from simulator.costs.rates.gemm_model import GemmModel, parse_gemm_model


@dataclass(frozen=True)
class EfficiencyProfile:
    """Measured matmul efficiency by smallest dimension, per number format (the calibration hook)."""

    points: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict, hash=False)
    launch_latency: float = 0.0  # seconds per kernel
    source: str = ""  # where the tables come from (a publication, or our measurement); optional
    gemm: GemmModel | None = None  # the shape model (gemm_model.py), for the formats it has fits of

    def efficiency(self, dtype: str, smallest: int) -> float | None:
        """The measured efficiency at `smallest`, or None when this format was not measured."""
        table = self.points.get(dtype)
        return along_log(table, smallest) if table else None

    def as_dict(self) -> dict:
        """The "matmul_efficiency" object this profile was parsed from (parse_efficiency_profile's schema)."""
        data: dict = {"launch_latency": self.launch_latency}
        if self.source:
            data["source"] = self.source
        data.update({fmt: [list(p) for p in points] for fmt, points in self.points.items()})
        if self.gemm is not None:
            data["gemm_model"] = self.gemm.as_dict()
        return data


def along_log(table: tuple[tuple[int, float], ...], x: float) -> float:
    """A table of (size, value) points, increasing in size, read at x: linear in log(size) between its points,
    the nearest point outside them."""
    if x <= table[0][0]:
        return table[0][1]
    for (x0, e0), (x1, e1) in zip(table, table[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return e0 + t * (e1 - e0)
    return table[-1][1]


def parse_efficiency_profile(data: object, origin: str = "profile") -> EfficiencyProfile:
    """Check a "matmul_efficiency" object; every problem raises ConfigError naming the field."""
    where = f"{origin}: matmul_efficiency"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a JSON object of number formats and a launch_latency")
    unknown = sorted(set(data) - set(FLOP_FORMATS) - {"launch_latency", "source", "gemm_model"})
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {', '.join(unknown)}: "
                          f"use {', '.join(FLOP_FORMATS)}, launch_latency, source, gemm_model")
    source = data.get("source", "")
    if not isinstance(source, str):
        raise ConfigError(f"{where}.source must be text naming where the tables come from, got {source!r}")
    latency = data.get("launch_latency", 0.0)
    if not in_range(latency, SECONDS):
        raise ConfigError(f"{where}.launch_latency must be seconds >= 0 (at most {SECONDS[1]:g}), got {latency!r}")
    points = {}
    for fmt in FLOP_FORMATS:
        if fmt not in data:
            continue
        table = data[fmt]
        ok = isinstance(table, list) and table and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool) and p[0] > 0
            and in_range(p[1], FRACTION)
            for p in table
        )
        if not ok or any(a[0] >= b[0] for a, b in zip(table, table[1:])):
            raise ConfigError(
                f"{where}.{fmt} must be [[size, efficiency], ...] with sizes > 0 increasing and 0 < efficiency <= 1 "
                f"(at least {FRACTION[0]:g})"
            )
        points[fmt] = tuple((int(x), float(e)) for x, e in table)
    gemm = parse_gemm_model(data["gemm_model"], f"{where}.gemm_model") if "gemm_model" in data else None
    return EfficiencyProfile(points=points, launch_latency=float(latency), source=source, gemm=gemm)
