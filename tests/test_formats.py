"""precision/formats.py: format facts against torch.finfo and the IEEE 754 / OCP FP8 specs."""

import json
import math

import pytest
import torch

from minigpt.errors import ConfigError
from precision.formats import (
    FORMATS,
    FormatFacts,
    all_format_facts,
    experiment_overflow,
    experiment_swamping,
    experiment_underflow,
    format_facts,
    round_to,
    ulp,
)


def _cast(value: float, name: str) -> float:
    return float(torch.tensor([value], dtype=torch.float64).to(FORMATS[name]).double()[0])


def test_formats_cover_the_five_names_in_order():
    assert list(FORMATS) == ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
    assert [f.name for f in all_format_facts()] == list(FORMATS)
    assert all(isinstance(f, FormatFacts) for f in all_format_facts())


@pytest.mark.parametrize("name", list(FORMATS))
def test_facts_agree_with_finfo(name):
    facts, info = format_facts(name), torch.finfo(FORMATS[name])
    assert facts.total_bits == info.bits
    assert facts.max == info.max
    assert facts.smallest_normal == info.smallest_normal
    assert facts.eps == info.eps
    assert facts.bytes * 8 == facts.total_bits
    assert 1 + facts.exponent_bits + facts.mantissa_bits == facts.total_bits
    assert facts.dtype == str(FORMATS[name]).removeprefix("torch.")


@pytest.mark.parametrize("name", list(FORMATS))
def test_bit_layout_is_consistent(name):
    facts = format_facts(name)
    bias = 2 ** (facts.exponent_bits - 1) - 1
    assert facts.smallest_normal == 2.0 ** (1 - bias)
    assert facts.eps == 2.0**-facts.mantissa_bits
    assert facts.smallest_subnormal == 2.0 ** (1 - bias - facts.mantissa_bits)


@pytest.mark.parametrize("name", list(FORMATS))
def test_smallest_subnormal_is_the_smallest_value_torch_keeps(name):
    tiny = format_facts(name).smallest_subnormal
    assert _cast(tiny, name) == tiny
    assert _cast(tiny / 2, name) == 0.0  # a tie, rounds to even: zero
    assert _cast(tiny * 0.75, name) == tiny


@pytest.mark.parametrize("name", list(FORMATS))
def test_max_is_the_largest_finite_value(name):
    facts = format_facts(name)
    assert _cast(facts.max, name) == facts.max
    # the next representable value up would be max + ulp; halfway is past the range
    beyond = _cast(facts.max + ulp(facts.max, name), name)
    assert not math.isfinite(beyond) or beyond == facts.max


def test_known_ieee_and_ocp_facts():
    fp32, fp16, bf16 = format_facts("fp32"), format_facts("fp16"), format_facts("bf16")
    e4m3, e5m2 = format_facts("fp8_e4m3"), format_facts("fp8_e5m2")
    assert e4m3.max == 448 and (e4m3.exponent_bits, e4m3.mantissa_bits) == (4, 3)
    assert e5m2.max == 57344 and (e5m2.exponent_bits, e5m2.mantissa_bits) == (5, 2)
    assert fp16.max == 65504 and (fp16.exponent_bits, fp16.mantissa_bits) == (5, 10)
    assert fp16.smallest_subnormal == pytest.approx(5.96e-8, rel=1e-3)
    assert fp16.smallest_normal == pytest.approx(6.10e-5, rel=1e-3)
    assert (bf16.exponent_bits, bf16.mantissa_bits) == (8, 7)
    assert (fp32.exponent_bits, fp32.mantissa_bits) == (8, 23)
    assert fp32.eps == 2.0**-23
    assert bf16.smallest_normal == fp32.smallest_normal  # same exponent range
    assert [f.bytes for f in all_format_facts()] == [4, 2, 2, 1, 1]


def test_as_dict_is_json_ready():
    data = format_facts("fp16").as_dict()
    assert data["name"] == "fp16" and data["max"] == 65504.0
    assert set(data) == {
        "name", "dtype", "total_bits", "exponent_bits", "mantissa_bits", "max",
        "smallest_normal", "smallest_subnormal", "eps", "bytes",
    }
    json.dumps(data, allow_nan=False)


def test_unknown_format_raises_config_error():
    with pytest.raises(ConfigError, match="fp8_e4m3"):
        format_facts("fp8")
    with pytest.raises(ConfigError):
        round_to(torch.ones(2), "int8")
    with pytest.raises(ConfigError, match="floating"):
        round_to(torch.ones(2, dtype=torch.int64), "fp16")


def test_round_to_rounds_to_nearest_and_returns_fp32():
    x = torch.tensor([1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-12, 1 / 3])
    out = round_to(x, "fp16")
    assert out.dtype == torch.float32 and out.shape == x.shape
    # ties go to even: 1 + half-ulp -> 1, 1 + 1.5 ulp -> 1 + 2 ulp
    assert out[0].item() == 1.0
    assert out[1].item() == 1.0 + 2 * 2.0**-10
    assert out[2].item() == 1.0
    assert abs(out[3].item() - 1 / 3) <= ulp(1 / 3, "fp16") / 2
    assert out[3].item() != x[3].item()
    assert torch.equal(round_to(x, "fp32"), x)  # fp32 is the identity
    assert round_to(x, "bf16")[3].item() == pytest.approx(1 / 3, rel=2.0**-8)


def test_round_to_overflow_behaviour_matches_the_docstring():
    big = torch.tensor([70000.0, -70000.0, float("inf"), float("nan")])
    fp16 = round_to(big, "fp16")
    assert fp16[0].item() == math.inf and fp16[1].item() == -math.inf
    assert torch.isfinite(round_to(big[:2], "bf16")).all()
    e5m2 = round_to(big, "fp8_e5m2")
    assert e5m2[0].item() == math.inf and e5m2[2].item() == math.inf
    e4m3 = round_to(big, "fp8_e4m3")  # no inf in e4m3fn: torch saturates to +-448
    assert e4m3[:3].tolist() == [448.0, -448.0, 448.0]
    for name in FORMATS:
        assert math.isnan(round_to(big, name)[3].item())


def test_ulp_is_the_gap_to_the_next_value():
    for name in FORMATS:
        for value in (0.5, 1.0, 3.0, format_facts(name).smallest_normal):
            step = ulp(value, name)
            assert _cast(value + step, name) == value + step
            assert _cast(value + step * 0.49, name) == value
    assert ulp(1.0, "fp32") == 2.0**-23
    assert ulp(0.0, "fp16") == format_facts("fp16").smallest_subnormal


def test_experiment_underflow():
    result = experiment_underflow()
    json.dumps(result, allow_nan=False)
    assert result["fp16_value"] == 0.0 and result["flushed_to_zero"] is True
    assert result["scale"] == 65536
    assert result["scaled_fp16_value"] >= format_facts("fp16").smallest_normal
    assert result["recovered_fp32_value"] == pytest.approx(1e-8, rel=2.0**-11)
    assert 0 < result["recovered_relative_error"] <= 2.0**-11
    assert isinstance(result["finding"], str) and "\n" not in result["finding"]
    # with too small a scale the gradient still vanishes: the numbers are computed
    assert experiment_underflow(scale=2.0)["scaled_fp16_value"] == 0.0


def test_experiment_swamping():
    result = experiment_swamping()
    json.dumps(result, allow_nan=False)
    assert result["fp16_sum"] == 0.5 and result["bf16_sum"] == 0.5
    assert result["fp32_sum"] != 0.5 and result["fp32_sum"] == pytest.approx(0.5 + 1e-7, abs=6e-8)
    assert result["fp16_addend_lost"] and result["bf16_addend_lost"]
    assert not result["fp32_addend_lost"]
    assert result["fp16_ulp_at_base"] == 2.0**-11
    assert result["bf16_ulp_at_base"] == 2.0**-8
    assert result["fp32_ulp_at_base"] == 2.0**-24
    assert "fp16, bf16" in result["finding"]
    # an addend larger than half of fp16's spacing survives: computed, not canned
    assert not experiment_swamping(addend=2.0**-10)["fp16_addend_lost"]


def test_experiment_overflow():
    result = experiment_overflow()
    json.dumps(result, allow_nan=False)
    assert result["fp16_is_inf"] and result["fp16_value"] == "inf"
    assert not result["bf16_is_inf"]
    # bf16 keeps 7 mantissa bits: on [2^16, 2^17) its spacing is 2^(16-7) = 512; 70000 / 512 = 136.7 -> 137 x 512
    assert result["bf16_value"] == 137 * 512 == 70144
    assert result["bf16_relative_error"] == pytest.approx(abs(result["bf16_value"] - 7e4) / 7e4)
    assert result["fp8_e4m3_value"] == 448.0 and result["fp8_e5m2_is_inf"]
    assert "inf" in result["finding"]
    assert not experiment_overflow(60000.0)["fp16_is_inf"]
