"""GEMM efficiency by shape (m, n, k) and format on a GPU: output tiles over the SMs in waves. Torch-free.

A GEMM (m x k) @ (k x n), `batch` times, runs as output tiles of tm x tn, each tile on one SM at a
time, stepping along k; the tiles run in waves of as many tiles as the GPU has SMs (NVIDIA, "Matrix
Multiplication Background User's Guide", DU-09799-001, 2023: sections 2.3 "Typical Tile Dimensions
in cuBLAS" and 3 "Dimension Quantization Effects"). For a tile shape and a split of k into s slices
(split-K: the slices of one tile run as s work units, CUTLASS's split-K):

    units  = ceil(m / tm) x ceil(n / tn) x batch x s
    waves  = ceil(units / SMs)
    time   = waves x SMs x tm x tn x 2 x (ceil(k / s) + k0) / (large x peak)  +  fixed
    efficiency = 2 m n k batch / (peak x time)

minimised over the tile shapes TILES and s = 1..MAX_SPLIT (the library picks its fastest kernel).
`waves x SMs x tm x tn` against m x n is tile quantisation (partial edge tiles) and wave
quantisation (a last wave that leaves SMs idle) together: 133 tiles on 132 SMs take two waves,
about twice the time per useful tile of 132 (`wave_utilisation`). Per format three numbers:

  large   efficiency of full waves of full tiles as k grows: the SM's share of the peak a long
          tile reaches;
  k0      a fixed cost per tile, in units of k: prologue (filling the pipeline) and epilogue
          (writing the tile), so a tile of depth k runs at k / (k + k0) of `large`;
  fixed   seconds per kernel (GPU side: launch ramp, the first and last wave's fill and drain).

and, where a maximum-achievable-matmul measurement of the GPU exists, a fourth:

  mamf    the most any shape reached in a search over shapes (Bekman's MAMF: the best of a brute-force
          search of m, n, k), over the peak: no GEMM is priced faster than that, its fixed cost on top:
          time = max(tiles' time, 2 m n k batch / (mamf x peak)) + fixed. Which presets carry it, and why the
          others do not: docs/efficiency.md, "MAMF as a ceiling".

TILES: 128 x 128, 128 x 256, 256 x 128, the large output tiles NVIDIA's guide names cuBLAS's most
efficient (section 2.3) and CUTLASS's default tensor-core tile (its SM80 DefaultGemmConfiguration,
128 x 256 x 64); smaller tiles are left out (less efficient). All reach the same `large` here: the
published sweeps do not separate them. No reduction cost is charged for split-K (charging one at HBM
speed fitted the OpenXLA sweep worse) and stream-K scheduling is not modelled (it smooths waves: where
the library uses it, the model's wave losses are pessimistic).

The numbers per GPU and format are fitted to published GEMM sweeps, least squares in log of the rate
(docs/efficiency.md "GEMM model by shape" has every source, fit set, held-out point and spread):
bf16/fp16 on H100/H200 to OpenXLA's measured sm_90 table with `large` tied to Bekman's MAMF; fp8 on
H100 and H200 to the Azure AI-benchmarking-guide's cuBLASLt e4m3 sweeps; bf16/fp16 on A100 to its fp16
sweep; SMs from NVIDIA's architecture whitepapers (A100 108, H100 SXM5 132; H200 132). They live in a
hardware entry's "matmul_efficiency" object:

    "gemm_model": {"sms": 132, "source": "...",
                   "bf16": {"large": 0.8321, "k0": 64, "fixed": 6e-6}, ...}   (and "mamf" where it applies)

`parse_gemm_model` checks exactly that object; a format without an entry keeps the smallest-side
table (simulator/costs/rates/efficiency.py), as does a CPU's calibrated profile (no gemm_model); a GPU's
calibrated profile has one fitted to the GEMMs it timed (simulator/costs/rates/gemm_fit.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from minigpt.errors import ConfigError
from precision.policy import FLOP_FORMATS
from simulator.json_file import COUNT, FRACTION, SECONDS, in_range

TILES = ((128, 128), (128, 256), (256, 128))
MAX_SPLIT = 16
K0_RANGE = (0.0, 1e6)  # elements of k


def wave_utilisation(tiles: int, sms: int) -> float:
    """Share of the SM-time of a GEMM's waves that its `tiles` fill: tiles / (ceil(tiles / sms) x sms)."""
    return tiles / (math.ceil(tiles / sms) * sms)


@lru_cache(maxsize=65536)
def tile_work(m: int, n: int, k: int, batch: int, sms: int, k0: float) -> float:
    """The FLOPs the SMs are busy for, k0 and idle SMs of the last wave included: min over TILES and splits of
    waves x SMs x tm x tn x 2 x (ceil(k / s) + k0)."""
    best = math.inf
    for tm, tn in TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        for split in range(1, min(MAX_SPLIT, k) + 1):
            waves = math.ceil(tiles * split / sms)
            best = min(best, waves * sms * tm * tn * 2 * (math.ceil(k / split) + k0))
    return best


@dataclass(frozen=True)
class GemmFit:
    """One format's three fitted numbers (see the module docstring)."""

    large: float
    k0: float
    fixed: float  # seconds
    mamf: float = 1.0  # the most any shape reached in a search (a share of the peak); 1.0: no measurement


@dataclass(frozen=True)
class GemmModel:
    """The GPU's SM count and, per format, the fitted numbers; `source` says where they come from."""

    sms: int
    fits: tuple[tuple[str, GemmFit], ...] = ()
    source: str = ""

    def fit(self, dtype: str) -> GemmFit | None:
        return dict(self.fits).get(dtype)

    def seconds(self, m: int, n: int, k: int, dtype: str, peak: float, batch: int = 1, margin: int = 0) -> float | None:
        """GPU seconds of the GEMM at `peak` FLOP/s (the whole GPU's), or None when this format has no fit; `margin`:
        SMs it leaves to a collective (its waves over the rest, each SM at its share of the peak)."""
        fit = self.fit(dtype)
        if fit is None:
            return None
        if not isinstance(margin, int) or isinstance(margin, bool) or not 0 <= margin < self.sms:
            raise ConfigError(f"a GEMM's SM margin must be a whole number from 0 to {self.sms - 1} (this GPU has "
                              f"{self.sms} SMs), got {margin!r}")
        sms = self.sms - margin
        share = peak * sms / self.sms
        tiles = tile_work(m, n, k, batch, sms, fit.k0) / (fit.large * share)
        return max(tiles, 2 * m * n * k * batch / (fit.mamf * share)) + fit.fixed

    def efficiency(self, m: int, n: int, k: int, dtype: str, peak: float, batch: int = 1,
                   margin: int = 0) -> float | None:
        """Achieved FLOP/s over `peak` for the GEMM, or None when this format has no fit."""
        seconds = self.seconds(m, n, k, dtype, peak, batch, margin)
        return None if seconds is None else 2 * m * n * k * batch / (peak * seconds)

    def as_dict(self) -> dict:
        data: dict = {"sms": self.sms}
        if self.source:
            data["source"] = self.source
        data.update({fmt: {"large": f.large, "k0": f.k0, "fixed": f.fixed, **({"mamf": f.mamf} if f.mamf < 1 else {})}
                     for fmt, f in self.fits})
        return data


def parse_gemm_model(data: object, where: str) -> GemmModel:
    """Check a "gemm_model" object; every problem raises ConfigError naming the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a JSON object with sms and per-format fits")
    unknown = sorted(set(data) - set(FLOP_FORMATS) - {"sms", "source"})
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {', '.join(unknown)}: use sms, source, {', '.join(FLOP_FORMATS)}")
    sms = data.get("sms")
    if not isinstance(sms, int) or isinstance(sms, bool) or not in_range(sms, COUNT):
        raise ConfigError(f"{where}.sms must be the GPU's count of streaming multiprocessors (a whole number >= 1), "
                          f"got {sms!r}")
    source = data.get("source", "")
    if not isinstance(source, str):
        raise ConfigError(f"{where}.source must be text naming where the fits come from, got {source!r}")
    fits = []
    for fmt in FLOP_FORMATS:
        if fmt not in data:
            continue
        entry = data[fmt]
        ok = isinstance(entry, dict) and {"large", "k0", "fixed"} <= set(entry) <= {"large", "k0", "fixed", "mamf"} \
            and in_range(entry["large"], FRACTION) and in_range(entry["k0"], K0_RANGE) \
            and in_range(entry["fixed"], SECONDS) and in_range(entry.get("mamf", 1.0), FRACTION)
        if not ok:
            raise ConfigError(f"{where}.{fmt} must be {{\"large\": efficiency in ({FRACTION[0]:g}, 1], \"k0\": elements "
                              f">= 0, \"fixed\": seconds >= 0, optionally \"mamf\": the measured maximum in "
                              f"({FRACTION[0]:g}, 1]}}, got {entry!r}")
        fits.append((fmt, GemmFit(float(entry["large"]), float(entry["k0"]), float(entry["fixed"]),
                                  float(entry.get("mamf", 1.0)))))
    return GemmModel(int(sms), tuple(fits), source)
