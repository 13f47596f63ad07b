"""Loss scaling, checked on a real gradient: fp16 underflow, the rescue by precision/scaler.py, bf16 without it.

One 256 x 256 Linear, forward and backward in the format itself (torch autograd, CPU), against the
same computation in fp32. The loss is weighted so that the fp32 gradient's median magnitude is the
1e-8 of `minigpt numerics`'s experiment (a): the whole tensor is then as small as that one number.
"""

from __future__ import annotations

from dataclasses import dataclass

from cli.claims.claim import CAVEAT, HOLDS, WRONG, Claim, Finding, percent

WIDTH, ROWS = 256, 64
MEDIAN_GRADIENT = 1e-8  # experiment (a)'s gradient, precision/formats.py's experiment_underflow default
ARTICLE_SCALE = 2.0**16  # "如2^16", "如65536"
OVERFLOW_VALUE = 70000.0  # experiment (c) of `minigpt numerics`: just above fp16's largest value
SCALED_GRADIENT = 2.0  # an ordinary gradient: times the default scale 2^16 it is past fp16's largest value


@dataclass(frozen=True)
class GradientCheck:
    """A gradient computed in one format against the fp32 one."""

    lost: float  # share of the fp32 gradient's nonzero entries that came out 0
    relative_error: float  # ||g - g32|| / ||g32||
    scale: float | None  # the loss scale, if any


def _inputs():
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, WIDTH, generator=generator), 0.02 * torch.randn(WIDTH, WIDTH, generator=generator)


def weight_gradient(dtype, loss_weight: float, scaler=None):
    """d(loss_weight * mean(y^2))/dW for y = x W^T, computed in `dtype`, as an fp32 tensor (unscaled by `scaler`)."""
    import torch
    from torch import nn

    x, weight = _inputs()
    layer = nn.Linear(WIDTH, WIDTH, bias=False).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(weight.to(dtype))
    loss = (layer(x.to(dtype)).float() ** 2).mean() * loss_weight
    (loss if scaler is None else scaler.scale_loss(loss)).backward()
    gradient = layer.weight.grad.float()
    if scaler is not None:
        scaler.unscale_([gradient])
    return gradient


def reference_gradient():
    """(the fp32 gradient at MEDIAN_GRADIENT, the loss weight that puts it there)."""
    import torch

    unit = weight_gradient(torch.float32, 1.0)
    weight = MEDIAN_GRADIENT / unit.abs().median().item()
    return weight_gradient(torch.float32, weight), weight


def compare(gradient, reference, scale: float | None = None) -> GradientCheck:
    nonzero = reference != 0
    lost = ((gradient == 0) & nonzero).float().sum().item() / nonzero.sum().item()
    return GradientCheck(lost, ((gradient - reference).norm() / reference.norm()).item(), scale)


def gradients() -> dict[str, GradientCheck]:
    import torch

    from precision.scaler import LossScaler

    reference, weight = reference_gradient()
    scaler = LossScaler()  # the project's default: dynamic, from 2^16
    return {
        "fp16": compare(weight_gradient(torch.float16, weight), reference),
        "fp16_scaled": compare(weight_gradient(torch.float16, weight, scaler), reference, scaler.scale),
        "bf16": compare(weight_gradient(torch.bfloat16, weight), reference),
    }


def _as_numbers(checks: dict[str, GradientCheck]) -> dict:
    return {name: {"lost": c.lost, "relative_error": c.relative_error, "scale": c.scale} for name, c in checks.items()}


def check_fp16_underflow() -> Finding:
    from precision.formats import format_facts

    checks = gradients()
    fp16, scaled = checks["fp16"], checks["fp16_scaled"]
    numbers = {"median_gradient": MEDIAN_GRADIENT, "elements": WIDTH * WIDTH, **_as_numbers(checks),
               "default_scale": scaled.scale, "article_scale": ARTICLE_SCALE,
               "fp16_smallest_subnormal": format_facts("fp16").smallest_subnormal}
    ours = (f"fp16 backward: {percent(fp16.lost)} of the gradient is 0; with the loss x{scaled.scale:g} "
            f"(precision/scaler.py): {100 * scaled.lost:.3g}% lost, relative error {scaled.relative_error:.1g}")
    holds = fp16.lost > 0.5 and scaled.lost < 0.01 and scaled.relative_error < 0.01 and scaled.scale == ARTICLE_SCALE
    why = (f"the gradient ({MEDIAN_GRADIENT:g} typical) is below fp16's smallest subnormal "
           f"({numbers['fp16_smallest_subnormal']:.3g}); x{scaled.scale:g} lifts it into range, and unscaling in "
           f"fp32 gives it back")
    discussion = (
        f"A real {WIDTH}x{WIDTH} weight gradient, backpropagated in fp16 through a Linear layer with the loss weighted "
        f"so that the fp32 gradient's median is {MEDIAN_GRADIENT:g}: without scaling {percent(fp16.lost)} of its "
        f"entries come out zero (relative error {fp16.relative_error:.2g}). With our LossScaler at its default "
        f"{scaled.scale:g} (the article's 2^16) the backward runs on scaled values, the fp32 copy is divided by the "
        f"scale, and only {100 * scaled.lost:.3g}% of the entries are lost, at a relative error of "
        f"{scaled.relative_error:.2g}: numerically the same gradient, as the article says."
    )
    return Finding(ours, HOLDS if holds else WRONG, why, numbers, discussion)


def check_bf16_no_scaling() -> Finding:
    from precision.formats import format_facts

    checks = gradients()
    bf16, scaled = checks["bf16"], checks["fp16_scaled"]
    normal = {n: format_facts(n).smallest_normal for n in ("bf16", "fp32")}
    numbers = {**_as_numbers(checks), "smallest_normal": normal}
    ours = (f"bf16 backward, unscaled: {percent(bf16.lost)} lost, relative error {bf16.relative_error:.1g}; "
            f"smallest normal {normal['bf16']:.3g} (fp32 {normal['fp32']:.3g})")
    holds = bf16.lost == 0 and normal["bf16"] == normal["fp32"]
    why = (f"bf16's exponent range is fp32's, so nothing underflows; what remains is rounding to "
           f"{format_facts('bf16').mantissa_bits + 1} significant bits (relative error {bf16.relative_error:.1g}, "
           f"which no loss scale changes)")
    discussion = (
        f"The same gradient computed in bf16 without any scaling loses {percent(bf16.lost)} of its entries: bf16's "
        f"smallest normal, {normal['bf16']:.3g}, is fp32's. Its relative error, {bf16.relative_error:.2g}, is the "
        f"price of bf16's short mantissa and is larger than scaled fp16's {scaled.relative_error:.2g}: bf16 trades "
        f"precision for range, which is why its updates need fp32 masters. The article's own code sample creates a "
        f"GradScaler around a bf16 autocast; by its own text (and this measurement) that scaler is not needed."
    )
    return Finding(ours, HOLDS if holds else WRONG, why, numbers, discussion)


def check_fp16_overflow() -> Finding:
    import torch

    from precision.formats import experiment_overflow, format_facts
    from precision.scaler import LossScaler

    overflow = experiment_overflow(OVERFLOW_VALUE)
    scaler = LossScaler()
    gradient = torch.tensor([SCALED_GRADIENT])
    scaled = (gradient * scaler.scale).half()
    flag = scaler.found_overflow([scaled])
    before = scaler.scale
    skipped = scaler.update(flag)
    fp16_max = format_facts("fp16").max
    numbers = {"fp16_max": fp16_max, "article_max": 65504.0, **{k: v for k, v in overflow.items() if k != "finding"},
               "scaled_gradient": str(float(scaled[0])), "scale_before": before, "scale_after": scaler.scale,
               "step_skipped": skipped}
    ours = (f"fp16 max {fp16_max:g}; {OVERFLOW_VALUE:g} -> {overflow['fp16_value']} in fp16, "
            f"{overflow['bf16_value']:g} in bf16; a gradient of {SCALED_GRADIENT:g} scaled by {before:g} -> "
            f"{float(scaled[0]):g}: step skipped, scale {before:g} -> {scaler.scale:g}")
    holds = fp16_max == numbers["article_max"] and overflow["fp16_is_inf"] and not overflow["bf16_is_inf"] and skipped
    why = (f"±{fp16_max:g} is right; under loss scaling a gradient overflows long before it is large "
           f"({SCALED_GRADIENT:g} x {before:g} > "
           f"{fp16_max:g}), and the dynamic scaler then skips the step and halves the scale")
    discussion = (
        f"fp16's largest value is {fp16_max:g}, as the article says, and {OVERFLOW_VALUE:g} becomes "
        f"{overflow['fp16_value']} in fp16 while bf16 stores {overflow['bf16_value']:g}. Under loss scaling the "
        f"overflow fp16 training meets is the scaled gradient's: a gradient of {SCALED_GRADIENT:g} times the default "
        f"scale {before:g} is {float(scaled[0]):g} in fp16, precision/scaler.py flags it, the step is skipped and "
        f"the scale drops to {scaler.scale:g}. Underflow (fp16-underflow) and this overflow are the two edges loss "
        f"scaling walks between; bf16, with fp32's range, meets neither at these sizes."
    )
    return Finding(ours, CAVEAT if holds else WRONG, why, numbers, discussion)


CLAIMS = [
    Claim("fp16-underflow", "Small gradients become 0 in FP16; multiplying the loss by 65536 (2^16) keeps them",
          '1.2, "为什么需要损失缩放"', "x65536 keeps them; numerically equivalent",
          "minigpt claims --only fp16-underflow; minigpt numerics",
          check_fp16_underflow),
    Claim("bf16-no-scaling", "BF16 needs no loss scaling: FP32's exponent, so small gradients do not underflow",
          '1.2, "BF16不需要损失缩放"', "no underflow, no scaling",
          "minigpt claims --only bf16-no-scaling", check_bf16_no_scaling),
    Claim("fp16-overflow", "FP16's range is too small (±65504): values overflow, one reason to prefer BF16",
          '1.2, "FP16的数值范围太小（±65504）"; misconception 1', "±65504",
          "minigpt numerics; minigpt claims --only fp16-overflow", check_fp16_overflow),
]
