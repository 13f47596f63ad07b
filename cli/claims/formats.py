"""The article's number formats and 16-bit arithmetic, checked with torch (precision/formats.py).

Every fact is torch's own (`torch.finfo` through precision/formats.py, and real 16-bit tensor
arithmetic); the article's numbers are typed in only as what it says.
"""

from __future__ import annotations

import math

from cli.claims.claim import HOLDS, WRONG, Claim, Finding, percent, ratio_text

# The article's format table (1.2): largest value, exponent and mantissa bits, size against fp32.
ARTICLE_RANGE = {"fp32": 3.4e38, "fp16": 6.5e4, "bf16": 3.4e38, "fp8_e4m3": 4.3e1, "fp8_e5m2": 4.3e1}
ARTICLE_BITS = {"fp32": (8, 23), "fp16": (5, 10), "bf16": (8, 7), "fp8_e4m3": (4, 3), "fp8_e5m2": (5, 2)}
ARTICLE_SIZE = {"fp32": 1.0, "fp16": 0.5, "bf16": 0.5, "fp8_e4m3": 0.25, "fp8_e5m2": 0.25}
RANGE_TOLERANCE = 0.05  # the article gives two significant figures: within 5% is the same number
ARTICLE_DIGITS = {"fp16": 3, "fp32": 7}  # "约3位有效数字", "约7位有效数字"
DOT_LENGTH = 32_768  # "几万个数相加": tens of thousands of products summed


def significant_digits(mantissa_bits: int) -> float:
    """Decimal digits a format carries: log10 of 2^(stored bits + the implicit one)."""
    return (mantissa_bits + 1) * math.log10(2)


def check_formats() -> Finding:
    from precision.formats import FORMATS, format_facts

    facts = {name: format_facts(name) for name in FORMATS}
    wrong_range = [n for n, f in facts.items() if abs(ARTICLE_RANGE[n] - f.max) > RANGE_TOLERANCE * f.max]
    wrong_bits = [n for n, f in facts.items() if (f.exponent_bits, f.mantissa_bits) != ARTICLE_BITS[n]]
    wrong_size = [n for n, f in facts.items() if f.bytes / facts["fp32"].bytes != ARTICLE_SIZE[n]]
    numbers = {"formats": {n: f.as_dict() for n, f in facts.items()}, "article_range": ARTICLE_RANGE,
               "wrong_range": wrong_range, "wrong_bits": wrong_bits, "wrong_size": wrong_size}
    ours = ", ".join(f"{n} {f.max:.6g}" for n, f in facts.items()) + " (largest finite, torch.finfo)"
    wrong = wrong_range + [n for n in wrong_bits + wrong_size if n not in wrong_range]
    e4m3, e5m2 = facts["fp8_e4m3"].max, facts["fp8_e5m2"].max
    parts = [f"{n} reaches {facts[n].max:g}, not ±{ARTICLE_RANGE[n]:g} ({ratio_text(facts[n].max / ARTICLE_RANGE[n])})"
             for n in wrong_range]
    parts += [f"{n} has {facts[n].exponent_bits}/{facts[n].mantissa_bits} exponent/mantissa bits" for n in wrong_bits]
    parts += [f"{n} takes {facts[n].bytes / facts['fp32'].bytes:g}x of fp32" for n in wrong_size]
    right = [kind for kind, bad in (("ranges", wrong_range), ("bit counts", wrong_bits), ("sizes", wrong_size))
             if not bad]
    why = "; ".join(parts) + (f"; {' and '.join(right)} are as the article gives them" if right else "") if wrong \
        else "every range, bit count and size as the article gives it"
    f16, b16 = facts["fp16"], facts["bf16"]
    discussion = (
        f"torch's own dtypes give fp16 a largest value of {f16.max:g}, a smallest normal of "
        f"{f16.smallest_normal:.3g} and a smallest subnormal of {f16.smallest_subnormal:.3g}; bf16 keeps fp32's "
        f"{b16.exponent_bits} exponent bits, so its largest value is {b16.max:.4g} (fp32: {facts['fp32'].max:.4g}) "
        f"at an epsilon of {b16.eps:.3g} against fp16's {f16.eps:.3g}. The article's FP8 range cannot be either FP8 "
        f"format: e4m3 (the forward format, no infinities) reaches {e4m3:g} and e5m2 (the gradient format) {e5m2:g}, "
        f"with smallest subnormals of {facts['fp8_e4m3'].smallest_subnormal:.3g} and "
        f"{facts['fp8_e5m2'].smallest_subnormal:.3g}."
    )
    return Finding(ours, WRONG if wrong else HOLDS, why, numbers, discussion)


def check_fp16_smallest() -> Finding:
    import torch

    from precision.formats import format_facts, round_to

    fp16 = format_facts("fp16")
    tiny = 1e-7
    stored = float(round_to(torch.tensor([tiny]), "fp16")[0])
    numbers = {"article": None, "smallest_subnormal": fp16.smallest_subnormal, "smallest_normal": fp16.smallest_normal,
               "example": tiny, "example_in_fp16": stored, "example_relative_error": abs(stored - tiny) / tiny}
    ours = f"{fp16.smallest_subnormal:.3g} (subnormal); smallest normal {fp16.smallest_normal:.3g}"
    why = (f"the number is missing (an empty pair of backquotes): fp16's smallest positive value is "
           f"2^-24 = {fp16.smallest_subnormal:.3g}, and below {fp16.smallest_normal:.3g} precision thins out")
    discussion = (
        f"The sentence that motivates loss scaling leaves its number out. torch gives {fp16.smallest_subnormal:.3g} "
        f"(2^-24, one unit in the last place of the smallest exponent); between it and the smallest normal "
        f"{fp16.smallest_normal:.3g} fp16 keeps fewer significant bits: a gradient of {tiny:g} is stored as "
        f"{stored:.3g}, {percent(numbers['example_relative_error'])} off, before smaller ones flush to zero."
    )
    return Finding(ours, WRONG, why, numbers, discussion)


def check_swamping() -> Finding:
    from precision.formats import experiment_swamping, format_facts

    result = experiment_swamping(0.5, 1e-7)
    digits = {n: significant_digits(format_facts(n).mantissa_bits) for n in ("fp16", "bf16", "fp32")}
    lost = {n: result[f"{n}_addend_lost"] for n in ("fp16", "bf16", "fp32")}
    numbers = {**{k: v for k, v in result.items() if k != "finding"}, "significant_digits": digits}
    ours = (f"fp16 {result['fp16_sum']:.8g}, bf16 {result['bf16_sum']:.8g}, fp32 {result['fp32_sum']:.8g}; "
            f"digits fp16 {digits['fp16']:.1f}, bf16 {digits['bf16']:.1f}, fp32 {digits['fp32']:.1f}")
    digits_right = all(round(digits[n]) == d for n, d in ARTICLE_DIGITS.items())
    holds = lost["fp16"] and lost["bf16"] and not lost["fp32"] and digits_right
    base, addend = result["base"], result["addend"]
    why = (f"{addend:g} is less than half the spacing of the numbers at {base:g} in both 16-bit formats (spacing fp16 "
           f"{result['fp16_ulp_at_base']:.3g}, bf16 {result['bf16_ulp_at_base']:.3g}) and more than half fp32's "
           f"({result['fp32_ulp_at_base']:.3g})")
    discussion = (
        f"Adding {addend:g} to {base:g} in real torch tensors gives back exactly {result['fp16_sum']:g} in fp16 and "
        f"{result['bf16_sum']:g} in bf16 and "
        f"{result['fp32_sum']:.8g} in fp32: fp32 records the update, rounded to its spacing of "
        f"{result['fp32_ulp_at_base']:.3g}. The article's digit counts are right (fp16 {digits['fp16']:.2f}, fp32 "
        f"{digits['fp32']:.2f}); bf16, which the article recommends, carries even fewer ({digits['bf16']:.2f}), so "
        f"it needs fp32 master weights at least as much as fp16 does."
    )
    return Finding(ours, HOLDS if holds else WRONG, why, numbers, discussion)


def check_master_weights() -> Finding:
    from precision.experiments import experiment_master_weights

    result = experiment_master_weights()
    pure, master = result["pure_fp16"], result["fp32_master"]
    numbers = {k: v for k, v in result.items() if k != "finding"}
    ours = (f"pure fp16: gain moved {pure['gain_moved']:.2g}, loss x{pure['loss_ratio']:.2f}; fp32 masters: moved "
            f"{master['gain_moved']:.2g}, loss x{master['loss_ratio']:.2f}")
    holds = pure["gain_moved"] == 0 and master["loss_ratio"] < 0.5
    why = (f"AdamW updates of ~{result['lr']:g} are below half the fp16 spacing at 1.0 "
           f"({result['fp16_half_spacing_at_1']:.2g}): they round away in fp16 weights and add up in fp32 masters")
    discussion = (
        f"A LayerNorm gain trained for {result['steps']} AdamW steps with fp16 compute: with the fp16 weights "
        f"updated in place it moved by {pure['gain_moved']:.2g} and the loss stayed at x{pure['loss_ratio']:.2f} of "
        f"its start; with fp32 masters (precision/optimizer.py) the same updates moved it by "
        f"{master['gain_moved']:.2g} and the loss fell to x{master['loss_ratio']:.2f}. This is the article's \"the "
        f"weights never move\", measured."
    )
    return Finding(ours, HOLDS if holds else WRONG, why, numbers, discussion)


def running_sum(values: list[float], dtype) -> float:
    """Add `values` one by one into an accumulator of `dtype`, rounding after every addition (torch scalars)."""
    import torch

    total = torch.zeros((), dtype=dtype)
    for value in values:
        total = total + value
    return float(total)


def stalling_sum(addend: float, name: str) -> float:
    """The smallest power of two at which adding `addend` to a sum held in format `name` rounds away."""
    from precision.formats import ulp

    total = 1.0
    while ulp(total, name) / 2 < addend:
        total *= 2
    return total


def check_fp32_accumulate() -> Finding:
    import torch

    from precision.formats import format_facts, ulp

    generator = torch.Generator().manual_seed(0)
    x32, y32 = torch.rand(DOT_LENGTH, generator=generator), torch.rand(DOT_LENGTH, generator=generator)
    x, y = x32.half(), y32.half()
    products = (x.double() * y.double()).tolist()  # exact: a tensor core multiplies fp16 inputs exactly
    exact = math.fsum(products)
    errors = {name: abs(running_sum(products, dtype) - exact) / exact
              for name, dtype in (("fp16", torch.float16), ("fp32", torch.float32))}
    unrounded = math.fsum((x32.double() * y32.double()).tolist())  # the same dot product of the fp32 inputs
    rounding = abs(exact - unrounded) / unrounded  # what rounding the inputs to fp16 alone cost
    numbers = {"length": DOT_LENGTH, "exact": exact, "relative_error": errors, "input_rounding_error": rounding,
               "fp16_eps": format_facts("fp16").eps}
    ours = (f"a {DOT_LENGTH:,}-term fp16 dot product: fp16 accumulator off by {percent(errors['fp16'])}, "
            f"fp32 accumulator by {errors['fp32']:.1g}; the inputs' rounding to fp16 by {rounding:.1g}")
    holds = errors["fp16"] > 100 * errors["fp32"] and rounding < numbers["fp16_eps"]
    stall = stalling_sum(max(products), "fp16")
    numbers["fp16_stalls_from"] = stall
    why = (f"from a running sum of {stall:g} on, half the fp16 spacing ({ulp(stall, 'fp16') / 2:g}) exceeds the "
           f"largest product ({max(products):.3g}): every addition rounds away; fp32's "
           f"{format_facts('fp32').mantissa_bits + 1} bits keep them")
    discussion = (
        f"{DOT_LENGTH:,} products of fp16 numbers in [0, 1) (the exact sum {exact:.6g}), added one by one: an fp16 "
        f"accumulator ends {percent(errors['fp16'])} low, because from {stall:g} on every product is "
        f"smaller than half the spacing of the sum and rounds away; an fp32 accumulator is off by "
        f"{errors['fp32']:.1g}. Tensor cores, and our CPU emulation (precision/compute.py), accumulate in fp32. "
        f"The article's other half holds too: rounding the {DOT_LENGTH:,} inputs to fp16 (epsilon "
        f"{numbers['fp16_eps']:.3g}) moves the exact dot product by only {rounding:.1g} relative: single roundings "
        f"of either sign average out in the sum."
    )
    return Finding(ours, HOLDS if holds else WRONG, why, numbers, discussion)


CAST_VALUES = (1e-6, 1e-3, 0.5, 1.0, 3.0, 1e3, 1e5)  # across fp16's range and past both of its ends


def exponent_field(x, name: str) -> list[int]:
    """The stored exponent bits of `x` (an fp32 tensor) cast to format `name`, read from the bit pattern."""
    import torch

    from precision.formats import FORMATS, format_facts

    facts = format_facts(name)
    bits = x.to(FORMATS[name]).view(torch.int32 if facts.total_bits == 32 else torch.int16).to(torch.int64)
    return ((bits >> facts.mantissa_bits) & ((1 << facts.exponent_bits) - 1)).tolist()


def check_cast_bits() -> Finding:
    import torch

    from precision.formats import format_facts

    x = torch.tensor(CAST_VALUES)
    fields = {name: exponent_field(x, name) for name in ("fp32", "fp16", "bf16")}
    bias = {name: 2 ** (format_facts(name).exponent_bits - 1) - 1 for name in fields}
    copied = {name: fields[name] == fields["fp32"] for name in ("fp16", "bf16")}
    rebiased = [e32 - bias["fp32"] + bias["fp16"] for e32 in fields["fp32"]]
    fp16_values = x.half().float().tolist()
    numbers = {"values": list(CAST_VALUES), "exponent_fields": fields, "bias": bias, "copied": copied,
               "fp32_exponent_rebiased_to_fp16": rebiased,
               "in_fp16": [v if math.isfinite(v) else str(v) for v in fp16_values]}
    ours = (f"exponent bits of {', '.join(f'{v:g}' for v in CAST_VALUES)}: fp32 {fields['fp32']}, bf16 "
            f"{fields['bf16']}, fp16 {fields['fp16']}")
    verdict = WRONG if not copied["fp16"] else HOLDS
    why = (f"for BF16 it is right (the exponent field is copied: {copied['bf16']}); FP16's exponent has "
           f"{format_facts('fp16').exponent_bits} bits, not {format_facts('fp32').exponent_bits}: it is re-biased "
           f"({bias['fp32']} -> {bias['fp16']}), {CAST_VALUES[-1]:g} overflows to {fp16_values[-1]} and "
           f"{CAST_VALUES[0]:g} falls to a subnormal (field 0)")
    discussion = (
        f"Read from the bit patterns torch produces: the fp32 exponent fields of "
        f"{', '.join(f'{v:g}' for v in CAST_VALUES)} are {fields['fp32']}; cast to bf16 they are {fields['bf16']} "
        f"(copied, as the article says: bf16 is fp32 with the mantissa rounded to "
        f"{format_facts('bf16').mantissa_bits} bits); cast to fp16 they are {fields['fp16']}: each in-range exponent "
        f"is re-biased from {bias['fp32']} to {bias['fp16']}, {CAST_VALUES[-1]:g} becomes {fp16_values[-1]} (the "
        f"all-ones field) and {CAST_VALUES[0]:g} a subnormal, {fp16_values[0]:.3g}. The article's \"指数位照抄\" "
        f"describes the bf16 cast, not the fp16 one it names."
    )
    return Finding(ours, verdict, why, numbers, discussion)


CLAIMS = [
    Claim("formats", "The format table: ranges ±3.4e38 (FP32, BF16), ±6.5e4 (FP16), ±4.3e1 (FP8); bits and sizes",
          '1.2, table "浮点数格式对比"', "FP8 ±4.3e1; FP16 ±6.5e4; FP32, BF16 ±3.4e38", "minigpt numerics",
          check_formats),
    Claim("cast-bits", "Casting FP32 to FP16 rounds the mantissa from 23 to 10 bits and copies the exponent bits",
          '1.2, "尾数位从23砍到10（四舍五入），指数位照抄"', "the exponent is copied", "minigpt claims --only cast-bits",
          check_cast_bits),
    Claim("fp16-smallest", "FP16's smallest positive number, below which gradients underflow",
          '1.2, "FP16能表示的最小正数约为"', "(left blank)", "minigpt numerics", check_fp16_smallest),
    Claim("swamping", "0.5 + 0.0000001 stays 0.5 in FP16 (about 3 significant digits); FP32 (about 7) keeps it",
          '1.2, "为什么权重更新必须用FP32"', "0.5 + 1e-7 = 0.5; 3 and 7 digits", "minigpt numerics", check_swamping),
    Claim("master-weights", "Without FP32 master weights the small updates round away and the weights never move",
          '1.2, "权重永远不动"', "the weights never move", "minigpt numerics", check_master_weights),
    Claim("fp32-accumulate", "Matmul accumulators are FP32: summing tens of thousands of FP16 numbers would "
          "snowball, while single roundings average out", '1.2, "矩阵累加器细节" and "舍入误差会被求和平均掉"',
          "FP16 sums snowball; roundings average out", "minigpt claims --only fp32-accumulate", check_fp32_accumulate),
]
