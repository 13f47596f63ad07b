"""FP8 matmuls for Linear layers with per-tensor delayed scaling, written here.

The compute path of a Linear layer runs in fp8; the weight Parameter keeps its own
dtype (bf16 under the fp8 policy, whose compute copy is bf16; fp32 for a plain fp32
Linear), so the optimizer never sees fp8.

- forward:  y  = x @ W.T + b       x, W quantised to float8_e4m3fn (more mantissa)
- backward: dx = g @ W             g quantised to float8_e5m2 (more range), W e4m3
            dW = g.T @ x           g e5m2, x e4m3 (the fp8 copies saved by forward)
            db = g.sum(0)          from the unquantised g, in fp32

Every matmul goes through `torch._scaled_mm`, which accumulates in fp32 and writes its
output directly in the dtype the layer computes in: y and dx in x's dtype, dW in W's
dtype (bf16 under the fp8 policy; fp32 for fp32 tensors), never fp32-then-cast. The bias
goes into `_scaled_mm` (the cuBLASLt epilogue) when the output is bf16 or fp16, cast to
the output dtype, because CUDA wants exactly that: it refuses a bias with fp32 output
("Bias is not supported when out_dtype is set to Float32") and wants the bias in the
output dtype. With fp32 output the bias is added afterwards, in fp32. The same rule
holds on every device, so the CPU tests see the arguments CUDA will get.
`torch._scaled_mm` has no derivative, hence `Fp8LinearFunction`.

Fast accumulation: the forward GEMM (e4m3 x e4m3) runs with `use_fast_accum=True`, the
two backward GEMMs (dgrad, wgrad: e5m2 x e4m3) without it, as NVIDIA Transformer Engine
does (its recipes' fp8_gemm_fprop uses fast accumulation, dgrad and wgrad use the split
accumulator). On Hopper, fast accumulation keeps the fp8 tensor core's partial sums in a
reduced-precision accumulator and promotes them to fp32 less often; that is cheap and
harmless for the forward, whose K (in_features) is short and whose output feeds the next
layer's own quantisation. Gradients are less forgiving: wgrad sums over every token of
the batch (K = batch x seq, thousands), e5m2 carries only 2 mantissa bits, and a biased
or truncated accumulation there goes straight into the weight update, so dgrad and wgrad
promote to fp32 at every step of K.

On the CPU the GEMMs are emulated (`EMULATED_DEVICES`): the same fp8 values, dequantised, in an
fp32 matmul, since torch's CPU `_scaled_mm` runs at about 10 MFLOP/s on some CPUs (an Intel Xeon
here); tests/test_fp8_scaled_mm.py turns the emulation off to check the `_scaled_mm` arguments.
Measured on CPU, torch 2.13: `_scaled_mm` accepts all four pairs of {e4m3fn, e5m2} x
{e4m3fn, e5m2}, any shape (1x1x1 and odd sizes included) and either memory layout of
both operands, so no fallback is taken on CPU. out_dtype fp32, bf16, fp16 and e4m3fn are
accepted (the default, no out_dtype, is the operands' fp8 dtype); the bf16/fp16 output
equals the fp32 output rounded once (bit for bit, K = 4096), and the fp32 output equals
the dequantised fp32 matmul bit for bit. A bias of fp32, bf16 or fp16 is accepted with
every output dtype (CPU is looser than CUDA) and is added before the single rounding.
`use_fast_accum` is accepted and has no effect on CPU (bit-identical results, K = 4096).
Scales must be float32 with one element (0-dim or shape (1,)); a float64 or bf16 scale,
a 2-element scale, or non-fp8 operands raise ValueError("Invalid scaling configuration.")
-- a ValueError, not a RuntimeError; mismatched shapes raise RuntimeError.

On CUDA, cuBLASLt wants a row-major, b column-major and every dimension a multiple of 16;
`fp8_matmul` arranges the layouts always and zero-pads to multiples of 16 on CUDA (zeros
add nothing to a dot product, so the padding is exact; the bias is zero-padded too).
Scales are 0-dim float32 tensors on the operands' device. e5m2 x e5m2, which CUDA
refuses, is never asked for here. Should a backend still refuse a pair (RuntimeError,
NotImplementedError or ValueError), `fp8_matmul` warns once, records the pair and the
reason in a registry (`fallbacks()`, which precision.compute.compute_path reports), and
computes that pair from then on as a dequantised fp32 matmul of the same fp8 values
(same numbers up to the output rounding, no fp8 speed). Out-of-memory is re-raised.

Per-tensor delayed scaling (`Fp8Meta`): the scale used at step t comes from the amax
history recorded at earlier steps, scale = fp8_max / (max(history) * 2**margin), with
fp8_max = torch.finfo(dtype).max (448 for e4m3fn, 57344 for e5m2). A tensor whose amax
grew past the history saturates (clamped to +-fp8_max) for that step; the next step's
scale sees the new amax.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

INPUT = "input"
WEIGHT = "weight"
GRAD_OUTPUT = "grad_output"
ROLES = (INPUT, WEIGHT, GRAD_OUTPUT)
ROLE_DTYPES = {INPUT: E4M3, WEIGHT: E4M3, GRAD_OUTPUT: E5M2}

# Dimension multiple that `_scaled_mm` requires, per device type (cuBLASLt: 16).
# CPU accepts any shape (measured with torch 2.13), so it is absent.
PAD_MULTIPLE = {"cuda": 16}
# Device types whose fp8 GEMMs are emulated, as 16-bit matmuls are there (precision/compute.py): the same fp8
# values, dequantised, in an fp32 matmul (fp32 accumulation, as _scaled_mm's), with the bias rounded as the fused
# path rounds it. torch's CPU _scaled_mm runs at about 10 MFLOP/s on some CPUs (33 s for one step of the tiny model
# on an Intel Xeon here, against 35 ms in fp32), and where it is fast its fp32 output is this matmul bit for bit.
EMULATED_DEVICES = {"cpu"}


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 format, from torch.finfo (448 e4m3fn, 57344 e5m2)."""
    return float(torch.finfo(dtype).max)


# The recomputed forward running now (parallel/recompute.py), as (phase, scales): None (no recomputation, or
# evaluation); "first", the forward without a graph, which appends each quantisation's scale to `scales`; "again",
# its rerun in the backward, which takes them back in the same order. One process runs one at a time.
RECOMPUTE_PHASE: list[tuple[str, collections.deque] | None] = [None]


@contextlib.contextmanager
def recompute_phase(phase: str, scales: collections.deque):
    """Every fp8 quantisation inside is `phase`'s, with `scales` the recomputed call's own (Fp8Meta.quantize)."""
    before, RECOMPUTE_PHASE[0] = RECOMPUTE_PHASE[0], (phase, scales)
    try:
        yield
    finally:
        RECOMPUTE_PHASE[0] = before


# Zero-bubble's split backward (parallel/pipeline/weight_gradients.py): "input" while a chunk's activation gradients
# are made (B), "weight" while its weights' are (W, later); None for a whole backward. An fp8 Linear's backward runs
# in both: its gradient is quantised (and its amax recorded) once, in B, and W multiplies that same quantised gradient
SPLIT_BACKWARD: list[str | None] = [None]


@contextlib.contextmanager
def split_backward(phase: str):
    """The fp8 Linears' backwards in this block run as `phase` ("input" or "weight") of a split backward."""
    before, SPLIT_BACKWARD[0] = SPLIT_BACKWARD[0], phase
    try:
        yield
    finally:
        SPLIT_BACKWARD[0] = before


class Fp8Meta:
    """Delayed-scaling state of one Linear layer: amax history and scale per role.

    Roles: "input" (activations, e4m3fn), "weight" (e4m3fn), "grad_output" (e5m2).
    Each role has a float32 amax history window of `history_len` entries (newest at
    index 0) and its current scale (the quantisation scale: fp8 = tensor * scale).

    The scale used for a tensor is fp8_max / (amax * 2**margin) where amax is the
    maximum over the history, i.e. over earlier steps only: the current tensor's amax
    does not enter its own scale, and values above the history saturate to +-fp8_max.
    Bootstrap: while the history is all zero (the first step), the current tensor's
    amax is used instead ("just-in-time" scaling), so the first step does not saturate.
    An amax of 0 gives scale 1. A non-finite amax (an overflowed gradient, which the
    loss scaler will skip) is recorded as 0 so that it does not poison the window.
    """

    def __init__(self, history_len: int = 16, margin: int = 0) -> None:
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        self.history_len = history_len
        self.margin = margin
        self.amax_history: dict[str, Tensor] = {
            role: torch.zeros(history_len, dtype=torch.float32) for role in ROLES
        }
        self.scale: dict[str, Tensor] = {
            role: torch.ones((), dtype=torch.float32) for role in ROLES
        }

    def _to(self, device: torch.device) -> None:
        for role in ROLES:
            if self.amax_history[role].device != device:
                self.amax_history[role] = self.amax_history[role].to(device)
                self.scale[role] = self.scale[role].to(device)

    def delayed_scale(self, role: str, current_amax: Tensor) -> Tensor:
        """Scale for `role` from the history (current amax only while it is empty)."""
        history_amax = self.amax_history[role].max()
        amax = torch.where(history_amax > 0, history_amax, current_amax)
        scale = fp8_max(ROLE_DTYPES[role]) / (amax * 2.0**self.margin)
        return torch.where(amax > 0, scale, torch.ones_like(scale))

    def record(self, role: str, amax: Tensor) -> None:
        """Push `amax` into the role's history window (newest at index 0)."""
        history = self.amax_history[role]
        amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
        history.copy_(torch.roll(history, 1))
        history[0] = amax

    @torch.no_grad()
    def quantize(self, role: str, tensor: Tensor, update: bool) -> tuple[Tensor, Tensor]:
        """(fp8 tensor, dequantisation scale 1/scale) with the delayed scale of `role`.

        With `update`, the tensor's amax is pushed into the history after use. Under full recomputation
        (RECOMPUTE_PHASE) a block's first forward also keeps each scale it used, with the recomputing call, and its
        rerun in the backward quantises with those, in the same order, recording nothing: the rerun is the forward's
        computation again, and the history holds one entry per forward, as without recomputation.
        """
        self._to(tensor.device)
        dtype = ROLE_DTYPES[role]
        data = tensor.detach().float()
        phase, scales = RECOMPUTE_PHASE[0] or (None, None)
        if phase == "again":
            scale = scales.popleft()
        else:
            amax = data.abs().amax() if data.numel() else torch.zeros((), device=data.device)
            scale = self.delayed_scale(role, amax)
            self.scale[role] = scale
            if update:
                self.record(role, amax)
            if phase == "first":
                scales.append(scale)
        limit = fp8_max(dtype)
        quantized = (data * scale).clamp_(-limit, limit).to(dtype)
        return quantized, scale.reciprocal()

    def state_dict(self) -> dict[str, Any]:
        return {
            "history_len": self.history_len,
            "margin": self.margin,
            "amax_history": {r: t.detach().cpu().clone() for r, t in self.amax_history.items()},
            "scale": {r: t.detach().cpu().clone() for r, t in self.scale.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history_len = int(state["history_len"])
        self.margin = int(state["margin"])
        self.amax_history = {r: t.clone().float() for r, t in state["amax_history"].items()}
        self.scale = {r: t.clone().float() for r, t in state["scale"].items()}


# Output dtypes `_scaled_mm` writes that a layer computes in (CPU and CUDA); any other
# activation dtype gets fp32 output, then a cast.
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Output dtypes with which the bias goes into `_scaled_mm` (CUDA: not with fp32 output).
BIAS_OUT_DTYPES = (torch.bfloat16, torch.float16)

FallbackKey = tuple[str, torch.dtype, torch.dtype]  # (device type, a dtype, b dtype)
_FALLBACKS: dict[FallbackKey, str] = {}


def fallbacks() -> dict[FallbackKey, str]:
    """The (device type, a dtype, b dtype) pairs `_scaled_mm` refused in this process,
    each with the reason; these pairs are computed as dequantised fp32 matmuls."""
    return dict(_FALLBACKS)


def reset_fallbacks() -> None:
    """Forget every recorded fallback (tests), so `_scaled_mm` is tried again."""
    _FALLBACKS.clear()


def _record_fallback(key: FallbackKey, out_dtype: torch.dtype, err: Exception) -> None:
    lines = str(err).splitlines()
    reason = f"{type(err).__name__}: {lines[0] if lines else ''} (out_dtype {out_dtype})"
    _FALLBACKS[key] = reason
    warnings.warn(f"torch._scaled_mm refused {key} ({reason}); "
                  "computing it as a dequantised fp32 matmul from now on", stacklevel=3)


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """Output dtype of a GEMM whose result ends up in `dtype`: itself if `_scaled_mm`
    writes it (fp32, bf16, fp16), else fp32 (cast afterwards)."""
    return dtype if dtype in OUT_DTYPES else torch.float32


def _pad_fp8(t: Tensor, rows: int, cols: int) -> Tensor:
    """Zero-pad a 2-D fp8 tensor to (rows, cols); byte 0 is +0.0 in both fp8 formats."""
    if t.shape == (rows, cols):
        return t
    raw = t.contiguous().view(torch.uint8)
    return F.pad(raw, (0, cols - t.shape[1], 0, rows - t.shape[0])).view(t.dtype)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _scaled_mm_padded(a: Tensor, b: Tensor, inv_scale_a: Tensor, inv_scale_b: Tensor,
                      out_dtype: torch.dtype, bias: Tensor | None, use_fast_accum: bool,
                      pad_multiple: int | None) -> Tensor:
    """One `torch._scaled_mm` call with the layouts, padding and bias CUDA wants."""
    m, n = a.shape[0], b.shape[1]
    multiple = PAD_MULTIPLE.get(a.device.type) if pad_multiple is None else pad_multiple
    if multiple:
        mp, kp, np_ = (_round_up(d, multiple) for d in (m, a.shape[1], n))
        a = _pad_fp8(a, mp, kp)
        b = _pad_fp8(b.t(), np_, kp).t()
    a = a.contiguous()  # row-major
    b = b.t().contiguous().t()  # column-major
    fused = bias is not None and out_dtype in BIAS_OUT_DTYPES
    mm_bias = F.pad(bias.to(out_dtype), (0, b.shape[1] - n)) if fused else None
    out = torch._scaled_mm(a, b, scale_a=inv_scale_a, scale_b=inv_scale_b, bias=mm_bias,
                           out_dtype=out_dtype, use_fast_accum=use_fast_accum)[:m, :n]
    if bias is not None and not fused:
        out = out + bias.to(out_dtype)  # fp32 output: the bias is added in fp32
    return out


def dequantised_matmul(a: Tensor, b: Tensor, inv_scale_a: Tensor, inv_scale_b: Tensor,
                       out_dtype: torch.dtype = torch.float32,
                       bias: Tensor | None = None) -> Tensor:
    """The fallback: fp32 matmul of the dequantised fp8 values, + bias in fp32, one cast."""
    out = (a.float() * inv_scale_a) @ (b.float() * inv_scale_b)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_matmul(a: Tensor, b: Tensor, inv_scale_a: Tensor, inv_scale_b: Tensor,
               pad_multiple: int | None = None, *, out_dtype: torch.dtype = torch.float32,
               bias: Tensor | None = None, use_fast_accum: bool = False) -> Tensor:
    """(a / scale_a) @ (b / scale_b) + bias in `out_dtype`, for 2-D fp8 a (M, K), b (K, N).

    inv_scale_* are the dequantisation scales (0-dim float32 on a's device). a is made
    row-major, b column-major. Dimensions are zero-padded to `pad_multiple` (default:
    what the device needs, PAD_MULTIPLE) and the result cropped back to (M, N). The bias
    (N,) goes into `_scaled_mm` in `out_dtype` when that is bf16/fp16, else it is added
    in fp32. A pair `_scaled_mm` refuses is recorded (`fallbacks()`), warned about once,
    and computed by `dequantised_matmul` from then on. On EMULATED_DEVICES (the CPU) it is
    `dequantised_matmul` always.
    """
    if a.device.type in EMULATED_DEVICES:
        fused = bias is not None and out_dtype in BIAS_OUT_DTYPES
        return dequantised_matmul(a, b, inv_scale_a, inv_scale_b, out_dtype, bias.to(out_dtype) if fused else bias)
    key = (a.device.type, a.dtype, b.dtype)
    if key not in _FALLBACKS:
        try:
            return _scaled_mm_padded(a, b, inv_scale_a, inv_scale_b, out_dtype, bias,
                                     use_fast_accum, pad_multiple)
        except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError since 2.5; the same class
            raise
        except (RuntimeError, NotImplementedError, ValueError) as err:
            _record_fallback(key, out_dtype, err)
    return dequantised_matmul(a, b, inv_scale_a, inv_scale_b, out_dtype, bias)


class Fp8LinearFunction(torch.autograd.Function):
    """y = x @ W.T + b with fp8 matmuls forward and backward (see module docstring).

    apply(x, weight, bias, meta, update_history). x may have any leading dimensions.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None,
                meta: Fp8Meta, update_history: bool) -> Tensor:
        out_features, in_features = weight.shape
        x2d = x.reshape(-1, in_features)
        x_fp8, inv_scale_x = meta.quantize(INPUT, x2d, update_history)
        w_fp8, inv_scale_w = meta.quantize(WEIGHT, weight, update_history)
        # Forward: e4m3 x e4m3 with fast accumulation (see module docstring).
        y = fp8_matmul(x_fp8, w_fp8.t(), inv_scale_x, inv_scale_w, out_dtype=gemm_dtype(x.dtype),
                       bias=bias, use_fast_accum=True)
        ctx.save_for_backward(x_fp8, w_fp8, inv_scale_x, inv_scale_w)
        ctx.meta = meta
        ctx.update_history = update_history
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        return y.to(x.dtype).reshape(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor):  # type: ignore[override]
        x_fp8, w_fp8, inv_scale_x, inv_scale_w = ctx.saved_tensors
        grad_2d = grad_y.reshape(-1, w_fp8.shape[0])
        phase = SPLIT_BACKWARD[0]
        if phase == "weight":  # zero-bubble's W: the gradient B quantised, no amax recorded again
            g_fp8, inv_scale_g = ctx.split_gradient
            del ctx.split_gradient
        else:
            g_fp8, inv_scale_g = ctx.meta.quantize(GRAD_OUTPUT, grad_2d, ctx.update_history)
        if phase == "input":  # zero-bubble's B: the input's gradient only; W takes the weight's and the bias's
            ctx.split_gradient = (g_fp8, inv_scale_g)
        grad_x = grad_w = grad_b = None
        activation, weights = phase != "weight", phase != "input"  # the halves this call makes (a whole one: both)
        # dgrad and wgrad: e5m2 x e4m3, fp32 (split) accumulation, no fast accumulation.
        if ctx.needs_input_grad[0] and activation:
            grad_x = fp8_matmul(g_fp8, w_fp8, inv_scale_g, inv_scale_w,
                                out_dtype=gemm_dtype(ctx.x_dtype), use_fast_accum=False)
            grad_x = grad_x.to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1] and weights:
            grad_w = fp8_matmul(g_fp8.t(), x_fp8, inv_scale_g, inv_scale_x,
                                out_dtype=gemm_dtype(ctx.w_dtype), use_fast_accum=False)
            grad_w = grad_w.to(ctx.w_dtype)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2] and weights:
            grad_b = grad_2d.float().sum(0).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b, None, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, meta: Fp8Meta,
               training: bool) -> Tensor:
    """F.linear(x, weight, bias) through fp8 matmuls with `meta`'s delayed scaling.

    `training` pushes this call's amaxes (input, weight, and grad_output in backward)
    into the history; in eval the history is read, never written.
    """
    return Fp8LinearFunction.apply(x, weight, bias, meta, training)


class Fp8Linear(nn.Module):
    """A Linear layer whose matmuls run in fp8; its Parameters keep their dtype.

    Build it from an nn.Linear with `from_linear`: the weight and bias Parameters are
    the same objects, so an optimizer that already owns them keeps working. The amax
    histories travel in the state_dict as extra state.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None,
                 history_len: int = 16, margin: int = 0) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.meta = Fp8Meta(history_len, margin)

    @classmethod
    def from_linear(cls, linear: nn.Linear, history_len: int = 16,
                    margin: int = 0) -> Fp8Linear:
        return cls(linear.weight, linear.bias, history_len, margin)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.bias, self.meta, self.training)

    def get_extra_state(self) -> dict[str, Any]:
        return self.meta.state_dict()

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.meta.load_state_dict(state)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, history_len={self.meta.history_len}, "
                f"margin={self.meta.margin}")
