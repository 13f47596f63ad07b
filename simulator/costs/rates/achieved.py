"""What real kernels and collectives reach on a GPU, as fractions of its datasheet figures. Torch-free.

A GPU entry of a hardware file may hold an "achieved" object beside its datasheet numbers:

    "achieved": {"hbm_fraction": 0.9,          element-wise kernels' bandwidth / the datasheet HBM bandwidth
                 "kernel_overhead": 4e-6,     seconds each kernel costs beyond its roofline time (launch, tail)
                 "nvlink_fraction": 0.8,      NCCL bus bandwidth of large collectives in a node / NVLink per direction
                 "tensor_sustained": {"bf16": 0.84, ...},  per format: the GEMM rate held back to back under the
                                              board's power limit / the rate of a short burst (what microbenchmark
                                              tables time); absent formats 1
                 "source": "..."}             where each number comes from (a published microbenchmark)

and a NIC entry a "busbw_fraction" (NCCL bus bandwidth across nodes / the port's line rate). Absent,
nothing is discounted (fractions 1, no overhead): the datasheet itself, as a calibrated profile
whose numbers are already measured wants it. Every number must name a published microbenchmark or
our own measurement, never a fit to an end-to-end training result. The presets (simulator/costs/hardware.json)
carry published values: BabelStream Copy/Triad for hbm_fraction, a null-kernel launch benchmark for
kernel_overhead, NCCL's ring bus bandwidth on 8 GPUs for nvlink_fraction (NVLink SHARP can beat the
wire for large all-reduces, which a fraction <= 1 does not express), nccl-tests across nodes per NIC
for busbw_fraction; docs/efficiency.md gives each value, its source, derivation and spread.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from minigpt.errors import ConfigError
from precision.policy import FLOP_FORMATS
from simulator.json_file import FRACTION, SECONDS, in_range

DATASHEET = "none: the datasheet figures as they are"


@dataclass(frozen=True)
class Achieved:
    hbm_fraction: float = 1.0
    kernel_overhead: float = 0.0
    nvlink_fraction: float = 1.0
    source: str = DATASHEET
    tensor_sustained: tuple[tuple[str, float], ...] = ()  # ((format, sustained / burst), ...)

    def sustained(self, fmt: str) -> float:
        """The share of its burst rate a GEMM in `fmt` holds when the tensor cores stay busy (1 when not given)."""
        for name, share in self.tensor_sustained:  # a few formats: a scan, in the GEMM pricing's hot path
            if name == fmt:
                return share
        return 1.0

    def as_dict(self) -> dict:
        data = asdict(self)
        data["tensor_sustained"] = dict(self.tensor_sustained)
        if not self.tensor_sustained:
            del data["tensor_sustained"]
        return data


def fraction(value: object, where: str) -> float:
    """A number in (0, 1] (at least simulator/json_file.py's FRACTION[0]); ConfigError naming `where` otherwise."""
    if not in_range(value, FRACTION):
        raise ConfigError(f"{where} must be a fraction in (0, 1] (at least {FRACTION[0]:g}), got {value!r}")
    return float(value)


def parse_achieved(data: object, where: str) -> Achieved | None:
    """The "achieved" object of a GPU entry, checked; None when absent."""
    if data is None:
        return None
    keys = {"hbm_fraction", "kernel_overhead", "nvlink_fraction", "tensor_sustained", "source"}
    if not isinstance(data, dict) or set(data) - keys or "source" not in data:
        raise ConfigError(f"{where}.achieved must be an object of {', '.join(sorted(keys))} (source required)")
    overhead = data.get("kernel_overhead", 0.0)
    if not in_range(overhead, SECONDS):
        raise ConfigError(f"{where}.achieved.kernel_overhead must be seconds >= 0 (at most {SECONDS[1]:g}), "
                          f"got {overhead!r}")
    source = data["source"]
    if not isinstance(source, str) or not source.strip():
        raise ConfigError(f"{where}.achieved.source must name where the numbers come from")
    sustained = data.get("tensor_sustained", {})
    if not isinstance(sustained, dict) or set(sustained) - set(FLOP_FORMATS):
        raise ConfigError(f"{where}.achieved.tensor_sustained must map formats among {', '.join(FLOP_FORMATS)} "
                          f"to fractions, got {sustained!r}")
    return Achieved(
        hbm_fraction=fraction(data.get("hbm_fraction", 1.0), f"{where}.achieved.hbm_fraction"),
        kernel_overhead=float(overhead),
        nvlink_fraction=fraction(data.get("nvlink_fraction", 1.0), f"{where}.achieved.nvlink_fraction"),
        source=source,
        tensor_sustained=tuple((fmt, fraction(value, f"{where}.achieved.tensor_sustained.{fmt}"))
                               for fmt, value in sorted(sustained.items())),
    )
