"""Facts about the floating-point formats, computed from torch's dtypes.

Nothing here is typed in as a constant: every number comes from `torch.finfo`
and a little bit arithmetic, so the facts are whatever the installed torch
really does. The `experiment_*` functions feed the `minigpt numerics` command;
each returns a plain, JSON-safe dict of numbers plus a one-line "finding".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

import torch

from minigpt.errors import ConfigError

FORMATS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class FormatFacts:
    """What one floating-point format can hold."""

    name: str
    dtype: str
    total_bits: int
    exponent_bits: int
    mantissa_bits: int  # stored fraction bits, without the implicit leading 1
    max: float  # largest finite value
    smallest_normal: float
    smallest_subnormal: float
    eps: float  # distance from 1.0 to the next representable value
    bytes: int

    def as_dict(self) -> dict[str, str | int | float]:
        return asdict(self)


def _dtype(name: str) -> torch.dtype:
    if name not in FORMATS:
        raise ConfigError(
            f"unknown number format {name!r}: use one of {', '.join(FORMATS)}"
        )
    return FORMATS[name]


@lru_cache(maxsize=None)
def format_facts(name: str) -> FormatFacts:
    """The facts of format `name` (a key of FORMATS), derived from torch.finfo."""
    dtype = _dtype(name)
    info = torch.finfo(dtype)
    # eps = 2**-mantissa_bits exactly, so log2 is exact for these formats.
    mantissa_bits = int(round(-math.log2(info.eps)))
    exponent_bits = info.bits - 1 - mantissa_bits  # one sign bit
    return FormatFacts(
        name=name,
        dtype=str(dtype).removeprefix("torch."),
        total_bits=info.bits,
        exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits,
        max=float(info.max),
        smallest_normal=float(info.smallest_normal),
        # The last mantissa bit at the lowest exponent: smallest_normal * 2**-m.
        smallest_subnormal=float(info.smallest_normal) * float(info.eps),
        eps=float(info.eps),
        bytes=info.bits // 8,
    )


def all_format_facts() -> list[FormatFacts]:
    return [format_facts(name) for name in FORMATS]


def round_to(x: torch.Tensor, name: str) -> torch.Tensor:
    """Round `x` to format `name` and return it as fp32 again.

    This is how 16-bit compute is emulated on CPUs: inputs are rounded to the
    format, the arithmetic accumulates in fp32. Rounding is torch's plain cast
    (round to nearest, ties to even); nothing is clamped here. What torch
    (2.13, CPU) does with values beyond the format's max:

    - fp32, fp16, bf16, fp8_e5m2: overflow gives +-inf (fp16 already above
      65504 + half a spacing, e.g. 70000 -> inf; bf16 shares fp32's range).
    - fp8_e4m3 (float8_e4m3fn, "fn" = finite, no inf): the cast saturates to
      +-448, and even +-inf becomes +-448. NaN stays NaN in every format.

    The tests check these statements against the installed torch.
    """
    if not x.is_floating_point():
        raise ConfigError(
            f"round_to needs a floating-point tensor, got {x.dtype}: convert it "
            "with .float() first"
        )
    return x.to(torch.float32).to(_dtype(name)).to(torch.float32)


def ulp(value: float, name: str) -> float:
    """Spacing of format `name` at `value`: the gap to the next larger magnitude."""
    facts = format_facts(name)
    magnitude = abs(value)
    if magnitude < facts.smallest_normal:
        return facts.smallest_subnormal
    _, exponent = math.frexp(magnitude)  # magnitude = m * 2**exponent, 0.5 <= m < 1
    return math.ldexp(facts.eps, exponent - 1)


def _scalar(value: float, name: str) -> float:
    """`value` rounded to format `name`, as a Python float."""
    return float(round_to(torch.tensor([value], dtype=torch.float32), name)[0])


def _json_number(value: float) -> float | str:
    """A finite float as is; inf/nan as "inf", "-inf", "nan" (strict JSON has none)."""
    return value if math.isfinite(value) else str(value)


def experiment_underflow(gradient: float = 1e-8, scale: float = 2.0**16) -> dict:
    """A tiny gradient vanishes in fp16 unless the loss (hence the gradient) is scaled."""
    fp16 = format_facts("fp16")
    in_fp16 = _scalar(gradient, "fp16")
    scaled = torch.tensor([gradient], dtype=torch.float32) * scale
    scaled_fp16 = round_to(scaled, "fp16")
    recovered = float((scaled_fp16 / scale)[0])  # unscaled in fp32
    relative_error = abs(recovered - gradient) / abs(gradient)
    result = {
        "gradient": gradient,
        "fp16_smallest_subnormal": fp16.smallest_subnormal,
        "fp16_value": in_fp16,
        "flushed_to_zero": in_fp16 == 0.0,
        "scale": scale,
        "scaled_fp16_value": float(scaled_fp16[0]),
        "recovered_fp32_value": recovered,
        "recovered_relative_error": relative_error,
    }
    result["finding"] = (
        f"a {gradient:.3g} gradient becomes {in_fp16:.3g} in fp16 (smallest "
        f"subnormal {fp16.smallest_subnormal:.3g}); scaled by {scale:g} it is "
        f"stored as {float(scaled_fp16[0]):.4g} and unscaled in fp32 gives "
        f"{recovered:.4g} (relative error {relative_error:.2g})"
    )
    return result


def experiment_swamping(
    base: float = 0.5, addend: float = 1e-7, names: tuple[str, ...] = ("fp16", "bf16", "fp32")
) -> dict:
    """Adding a small number to a large one: low-precision sums drop it entirely."""
    result: dict = {"base": base, "addend": addend}
    lost = []
    for name in names:
        dtype = _dtype(name)
        total = torch.tensor([base], dtype=dtype) + torch.tensor([addend], dtype=dtype)
        value = float(total.to(torch.float32)[0])
        result[f"{name}_sum"] = value
        result[f"{name}_ulp_at_base"] = ulp(base, name)
        addend_lost = value == _scalar(base, name)
        result[f"{name}_addend_lost"] = addend_lost
        if addend_lost:
            lost.append(name)
    kept = [name for name in names if name not in lost]
    result["finding"] = (
        f"{base:g} + {addend:g} rounds back to exactly {base:g} in "
        f"{', '.join(lost) or 'no format'} (spacing at {base:g}: "
        + ", ".join(f"{name} {ulp(base, name):.3g}" for name in names)
        + f"); it survives in {', '.join(kept) or 'no format'}"
    )
    return result


def experiment_overflow(value: float = 70000.0) -> dict:
    """A value above fp16's max: inf in fp16, close and finite in bf16, per-format in fp8."""
    result: dict = {"value": value}
    for name in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"):
        rounded = _scalar(value, name)
        result[f"{name}_max"] = format_facts(name).max
        result[f"{name}_value"] = _json_number(rounded)
        result[f"{name}_is_inf"] = math.isinf(rounded)
        if math.isfinite(rounded):
            result[f"{name}_relative_error"] = abs(rounded - value) / abs(value)
    fp16_value, bf16_value = _scalar(value, "fp16"), _scalar(value, "bf16")
    bf16_text = (
        f"{bf16_value:g} (relative error {result['bf16_relative_error']:.2g})"
        if math.isfinite(bf16_value)
        else str(bf16_value)
    )
    result["finding"] = (
        f"{value:g} overflows fp16 (max {format_facts('fp16').max:g}) to {fp16_value:g}; "
        f"bf16, with fp32's exponent range, stores {bf16_text}"
    )
    return result
