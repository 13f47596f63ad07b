"""Kernel timing, the one home of it: GEMMs per number format, element-wise bandwidth, launches, attention.

Torch and parallel/device.py's timer only (nothing that needs simpy or click), so that
bench/gpu_kernels.py runs it on a bare machine with the repository on PYTHONPATH; `minigpt calibrate`
(parallel/calibrate/device.py) times its matmuls and its copy here too.

Timing (`time_call`): one warm-up call, one call timed alone to choose how many calls make a timed run
last about `min_run_s`, then `repeats` timed runs of that many calls back to back. A measurement is the
median seconds per call, and it reports its noise: `spread` = (slowest run - fastest run) / median.
A run is timed by parallel/device.py's `device_seconds`: two torch.cuda.Events around the calls on
CUDA (the GPU's own clock, no host synchronisation inside the run), time.perf_counter on a CPU.

GEMM formats (`FORMATS`): (m x k) @ (k x n) on random normal operands, 2*m*n*k FLOPs
- fp32: float32 with TF32 off (torch.backends.cuda.matmul.allow_tf32 = False), true fp32;
- tf32: float32 with TF32 on; CUDA only (a CPU has no TF32);
- bf16, fp16: torch.mm in that dtype (on a CPU: torch's own CPU kernels; measured on this project's
  2-core AMD EPYC with AVX512-BF16, torch 2.13: bf16 native and fast, fp16 slow);
- fp8, fp8_fast: torch._scaled_mm of float8_e4m3fn operands, a row-major and b column-major (what
  cuBLASLt wants), every dimension a multiple of 16, per-tensor scales of 1.0, bf16 output, with
  use_fast_accum False (fp8, as precision/fp8.py calls it) and True (fp8_fast). torch 2.13's CPU build
  runs _scaled_mm too, so a CPU dry run takes the same path.

Element-wise (`time_elementwise`): copy, add, GELU, LayerNorm (rows of ROW), softmax (rows of ROW) in
bf16 and fp32; bytes moved = bytes read + bytes written (copy, GELU, LayerNorm, softmax: 2 x the tensor;
add: 3 x; LayerNorm's weight and bias, ROW elements each, are left out). Size: give tensors well past
the last-level cache (on an H100/H200 the L2 is 50-60 MB: bench/gpu_kernels.py uses 256 MiB).

Attention (`time_attention`): scaled_dot_product_attention against an unfused attention (matmul, scale,
causal mask, softmax, matmul) at the same shapes, causal, forward or forward + backward. FLOPs counted
as FlashAttention-2's benchmark counts them (Dao 2023, benchmarks/benchmark_flash_attention.py in
Dao-AILab/flash-attention): forward 4 * batch * heads * seq^2 * head_dim, halved when causal;
backward 2.5 x the forward. The unfused kernel does the full square's work but is charged the same
useful FLOPs, so the two rates compare time for the same result.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from parallel.device import device_seconds, synchronize

FORMATS = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp8_fast")
TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP8_MULTIPLE = 16  # cuBLASLt's _scaled_mm: every dimension a multiple of 16 (checked on every device)
ELEMENTWISE = ("copy", "add", "gelu", "layernorm", "softmax")
ELEMENTWISE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ROW = 4096  # LayerNorm's and softmax's row length: a d_model of Llama 3 8B, a 4K attention row
MAX_CALLS = 20000  # a timed run never holds more calls (a tiny kernel at ~2 us: 40 ms)


@dataclass(frozen=True)
class Timing:
    """Median seconds per call over `repeats` runs of `calls` calls, and the runs' spread."""

    seconds: float
    spread: float  # (slowest run - fastest run) / median
    calls: int
    repeats: int

    def as_dict(self) -> dict:
        return asdict(self)


def time_call(fn: Callable[[], object], device: torch.device, min_run_s: float = 0.02, repeats: int = 5) -> Timing:
    """Time fn: a warm-up, a probe, then `repeats` runs of enough calls to last about min_run_s each."""
    if repeats < 1 or not min_run_s >= 0:
        raise ValueError(f"time_call needs repeats >= 1 and min_run_s >= 0, got {repeats} and {min_run_s}")
    fn()  # warm-up: lazy initialisation, cuBLAS handles, the caching allocator
    synchronize(device)
    once = max(device_seconds(fn, 1, device), 1e-7)
    calls = max(1, min(MAX_CALLS, math.ceil(min_run_s / once)))
    runs = [device_seconds(fn, calls, device) / calls for _ in range(repeats)]
    median = statistics.median(runs)
    return Timing(median, (max(runs) - min(runs)) / median if median > 0 else 0.0, calls, repeats)


# ---------------------------------------------------------------- GEMMs


def supported_formats(device: torch.device) -> tuple[str, ...]:
    """The formats this device can be asked for (fp8 may still be refused by an older GPU: time_gemm raises)."""
    return FORMATS if device.type == "cuda" else tuple(f for f in FORMATS if f != "tf32")


@contextlib.contextmanager
def matmul_mode(fmt: str, device: torch.device):
    """TF32 on for tf32 and off for every other format while inside (CUDA); the setting is restored after."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown GEMM format {fmt!r}: use one of {', '.join(FORMATS)}")
    if fmt == "tf32" and device.type != "cuda":
        raise ValueError("tf32 needs a CUDA GPU: a CPU has no TF32 (its fp32 matmul is the fp32 format)")
    if device.type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = fmt == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def gemm_call(fmt: str, m: int, n: int, k: int, device: torch.device) -> Callable[[], torch.Tensor]:
    """A call computing one (m x k) @ (k x n) in `fmt` on freshly made random operands."""
    if fmt in ("fp8", "fp8_fast"):
        if any(d % FP8_MULTIPLE for d in (m, n, k)):
            raise ValueError(f"fp8 GEMM dimensions must be multiples of {FP8_MULTIPLE}, got {m} x {n} x {k}")
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)  # row-major
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # (k, n), column-major
        one = torch.ones((), device=device)
        fast = fmt == "fp8_fast"
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)
    dtype = TORCH_DTYPES[fmt]
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def time_gemm(fmt: str, m: int, n: int, k: int, device: torch.device, min_run_s: float = 0.02,
              repeats: int = 5) -> dict:
    """{format, m, n, k, flops, seconds, flops_per_s, spread, calls} of one GEMM shape in `fmt`.
    ValueError for a format or shape this device cannot take; RuntimeError when torch refuses it."""
    with matmul_mode(fmt, device):
        call = gemm_call(fmt, m, n, k, device)
        timing = time_call(call, device, min_run_s, repeats)
    del call
    flops = 2 * m * n * k
    return {"format": fmt, "m": m, "n": n, "k": k, "flops": flops, "seconds": timing.seconds,
            "flops_per_s": flops / timing.seconds, "spread": timing.spread, "calls": timing.calls}


def launch_overhead(device: torch.device, min_run_s: float = 0.02, repeats: int = 5) -> dict:
    """Seconds per launch of a tiny kernel (an in-place add on one element) issued back to back."""
    x = torch.zeros(1, device=device)
    timing = time_call(lambda: x.add_(1.0), device, min_run_s, repeats)
    return {"kernel": "x.add_(1.0) on a 1-element fp32 tensor, back to back", "per_launch_s": timing.seconds,
            "spread": timing.spread, "calls": timing.calls}


# ---------------------------------------------------------------- element-wise


def elementwise_call(op: str, dtype: torch.dtype, numel: int, device: torch.device) -> tuple[Callable, int, int]:
    """(a call of `op` on tensors of about `numel` elements (whole rows of ROW), the bytes it moves
    (read + written), the bytes of one tensor)."""
    rows = max(1, numel // ROW)
    x = torch.randn(rows, ROW, device=device, dtype=dtype)
    size = x.numel() * x.element_size()
    if op == "copy":
        out = torch.empty_like(x)
        return (lambda: out.copy_(x)), 2 * size, size
    if op == "add":
        y, out = torch.randn_like(x), torch.empty_like(x)
        return (lambda: torch.add(x, y, out=out)), 3 * size, size
    if op == "gelu":
        return (lambda: F.gelu(x)), 2 * size, size
    if op == "layernorm":
        weight, bias = torch.ones(ROW, device=device, dtype=dtype), torch.zeros(ROW, device=device, dtype=dtype)
        return (lambda: F.layer_norm(x, (ROW,), weight, bias)), 2 * size, size
    if op == "softmax":
        return (lambda: torch.softmax(x, dim=-1)), 2 * size, size
    raise ValueError(f"unknown element-wise op {op!r}: use one of {', '.join(ELEMENTWISE)}")


def time_elementwise(op: str, fmt: str, tensor_bytes: int, device: torch.device, min_run_s: float = 0.02,
                     repeats: int = 5) -> dict:
    """{op, format, tensor_bytes, bytes_moved, seconds, bytes_per_s, spread} of one element-wise kernel."""
    dtype = ELEMENTWISE_DTYPES[fmt]
    numel = max(ROW, tensor_bytes // torch.empty((), dtype=dtype).element_size())
    call, moved, size = elementwise_call(op, dtype, numel, device)
    timing = time_call(call, device, min_run_s, repeats)
    del call
    return {"op": op, "format": fmt, "tensor_bytes": size, "bytes_moved": moved,
            "seconds": timing.seconds, "bytes_per_s": moved / timing.seconds, "spread": timing.spread}


# ---------------------------------------------------------------- attention


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool = True,
                    backward: bool = False) -> float:
    """Useful FLOPs as FlashAttention-2's benchmark counts them (see the module docstring)."""
    forward = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
    return forward * (3.5 if backward else 1.0)


def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v as three kernels and an s x s matrix in memory."""
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def attention_call(fused: bool, backward: bool, batch: int, heads: int, seq: int, head_dim: int,
                   device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Callable:
    """A call of causal attention (SDPA when fused, else unfused_attention), forward or forward + backward."""
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=backward)
               for _ in range(3))
    mask = None if fused else torch.ones(seq, seq, device=device, dtype=torch.bool).triu(1)

    def forward() -> torch.Tensor:
        if fused:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return unfused_attention(q, k, v, mask)

    if not backward:
        def call():
            with torch.no_grad():
                return forward()
        return call
    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)
    return lambda: torch.autograd.grad(forward(), (q, k, v), grad)


def time_attention(fused: bool, backward: bool, batch: int, heads: int, seq: int, head_dim: int,
                   device: torch.device, min_run_s: float = 0.02, repeats: int = 5) -> dict:
    """{kernel, pass, batch, heads, seq, head_dim, flops, seconds, flops_per_s, spread}, bf16, causal."""
    call = attention_call(fused, backward, batch, heads, seq, head_dim, device)
    timing = time_call(call, device, min_run_s, repeats)
    del call
    flops = attention_flops(batch, heads, seq, head_dim, True, backward)
    return {"kernel": "sdpa" if fused else "unfused", "pass": "forward+backward" if backward else "forward",
            "batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim, "flops": flops,
            "seconds": timing.seconds, "flops_per_s": flops / timing.seconds, "spread": timing.spread}


# FlashAttention-2's benchmark shapes (benchmarks/benchmark_flash_attention.py: model width 2048, 16K tokens a batch),
# the shapes of the preset tables (simulator/costs/rates/attention_rates.py), so a measured table reads as theirs.
ATTENTION_HEAD_DIMS = (64, 128)
ATTENTION_SEQS = (512, 1024, 2048, 4096, 8192)
ATTENTION_WIDTH = 2048
ATTENTION_TOKENS = 16384


def measure_attention_rates(device: torch.device, min_run_s: float = 0.02, repeats: int = 5,
                            head_dims: tuple[int, ...] = ATTENTION_HEAD_DIMS, seqs: tuple[int, ...] = ATTENTION_SEQS,
                            width: int = ATTENTION_WIDTH, tokens: int = ATTENTION_TOKENS) -> dict[str, list]:
    """{head size: [[sequence, FLOP/s], ...]} of torch's fused causal attention (SDPA, bf16, forward + backward, the
    FLOPs counted as FlashAttention-2's benchmark counts them), at `width` / head size heads and `tokens` / sequence
    sequences; a point torch refuses (memory, an unsupported size) is left out."""
    table: dict[str, list] = {}
    for head_dim in head_dims:
        for seq in seqs:
            try:
                r = time_attention(True, True, max(1, tokens // seq), max(1, width // head_dim), seq, head_dim,
                                   device, min_run_s, repeats)
            except (RuntimeError, ValueError):
                continue
            table.setdefault(str(head_dim), []).append([seq, r["flops_per_s"]])
    return table


SDPA_KERNEL = "torch SDPA"  # the kernel of a measured table (precision-free: the executor's attention)


def _attention_entry(kernel: str, rates: dict[str, list], peak_bf16: float, source: str) -> dict:
    """A profile's "attention_efficiency" (simulator/costs/rates/attention_rates.py) from
    {head size: [[sequence, FLOP/s], ...]} over the profile's bf16 peak, each share at most 1."""
    causal = {size: [[seq, round(min(1.0, rate / peak_bf16), 4)] for seq, rate in points]
              for size, points in rates.items() if points}
    return {"kernel": kernel, "causal": causal, "source": source}


def attention_table(rates: dict[str, list] | None, peak_bf16: float | None) -> dict | None:
    """The profile's attention table from measure_attention_rates' rates over the measured bf16 peak; None without
    rates or a peak."""
    if not rates or not peak_bf16:
        return None
    return _attention_entry(SDPA_KERNEL, rates, peak_bf16, (
        f"measured by minigpt calibrate: torch.nn.functional.scaled_dot_product_attention, causal, bf16, forward + "
        f"backward, at FlashAttention-2's benchmark shapes (width {ATTENTION_WIDTH}, {ATTENTION_TOKENS} tokens a "
        f"batch) and FLOP count, over this profile's measured bf16 peak ({peak_bf16 / 1e12:.0f} TFLOP/s)"))


def preset_attention(links_from: dict | None, peak_bf16: float | None) -> dict | None:
    """The matching preset's table (simulator.costs.hardware.preset_links' "attention_efficiency") for a CUDA
    profile that could not measure its own: the preset's TFLOP/s over this profile's measured bf16 peak; None
    without a preset, a table or a peak. Without any table the roofline would price attention as square GEMMs at the
    head size (64: tiny square matmuls, launch-bound), a hundred times slow."""
    table = None if links_from is None else links_from.get("attention_efficiency")
    datasheet = None if links_from is None else links_from.get("peak_flops", {}).get("bf16")
    if table is None or not datasheet or not peak_bf16:
        return None
    rates = {size: [[seq, share * datasheet] for seq, share in points] for size, points in table["causal"].items()}
    return _attention_entry(table["kernel"], rates, peak_bf16, (
        f"{table['source']}; from preset {links_from['preset']} (simulator/costs/hardware.json), not measured here: "
        f"its TFLOP/s over this profile's measured bf16 peak ({peak_bf16 / 1e12:.0f} TFLOP/s) instead of the "
        f"datasheet's ({datasheet / 1e12:.0f})"))
