"""Numbers derived without the code they check: for tests that must not re-run the implementation's formula.

Nothing here imports the simulator, the claims or the optimizer under test. What it uses:

- the datasheets themselves, simulator/costs/hardware.json read as plain JSON (`DATASHEETS`): peak FLOP/s,
  HBM bandwidth, the cited GEMM efficiency tables and fitted GEMM models, the measured per-kernel overhead;
- the model's shape (minigpt/config.py's presets: the numbers, not its arithmetic), and the real model
  (minigpt/model.py) built on the meta device where a count should come from the model itself;
- torch.optim.AdamW, PyTorch's own optimizer, as the reference for precision/optimizer.py.

`block_kernels` lists, by hand, the kernels one transformer block runs for one micro-batch on one
tensor-parallel rank (forward and backward, FlashAttention-2, each kernel reading its inputs from HBM
once and writing its outputs once), and `price` prices them on a GPU's datasheet with a roofline:
a GEMM by the GPU's fitted GEMM model for its format (`model_efficiency`: output tiles in waves over the
SMs, docs/efficiency.md "GEMM model") or else at the cited efficiency for its smallest side, a causal
FlashAttention pass at its published
rate by sequence and head size (or its kept half of the square at the GEMM table's efficiency), a
memory-bound kernel at the achieved HBM bandwidth, plus the launch cost of every kernel. The arithmetic is written out here, so a test can
compare the simulator's op model (simulator/costs/ops.py, simulator/costs/compute.py) with it.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATASHEETS: dict = json.loads((ROOT / "simulator" / "costs" / "hardware.json").read_text(encoding="utf-8"))["gpus"]
NICS: dict = json.loads((ROOT / "simulator" / "costs" / "hardware.json").read_text(encoding="utf-8"))["nics"]
H200_RUN = ROOT / "docs" / "measurements" / "h200-2026-12-04"  # what the lent H200 measured (docs/results.md)


def _piecewise(points: list, x: float, fraction) -> float:
    """Sorted (x, y) points read at x: y along fraction(x, x0, x1) between two points, the nearest point outside."""
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * fraction(x, x0, x1)
    raise AssertionError("unreachable")


def table_efficiency(table: list[list[float]], side: int) -> float:
    """A cited efficiency table read at a GEMM's smallest side: linear in log(side) between its points, the
    nearest point outside them (the reading docs/efficiency.md states)."""
    return _piecewise(sorted(table), side, lambda x, x0, x1: math.log(x / x0) / math.log(x1 / x0))


def model_efficiency(model: dict, m: int, n: int, k: int, peak: float, fmt: str) -> float:
    """docs/efficiency.md's GEMM model, written out: output tiles of 128 x 128, 128 x 256 or 256 x 128, k split
    into 1 to 16 slices, in waves of as many tiles as the GPU has SMs; each tile of depth k' costs k' + k0; the
    fastest tile and split, never faster than the measured maximum ("mamf") where the preset gives one; the kernel's
    fixed seconds on top."""
    fit, sms = model[fmt], model["sms"]
    best = min(math.ceil(math.ceil(m / tm) * math.ceil(n / tn) * split / sms) * sms * tm * tn * 2
               * (math.ceil(k / split) + fit["k0"])
               for tm, tn in ((128, 128), (128, 256), (256, 128)) for split in range(1, min(16, k) + 1))
    tiles = max(best / (fit["large"] * peak), 2 * m * n * k / (fit.get("mamf", 1.0) * peak))
    return 2 * m * n * k / (peak * (tiles + fit["fixed"]))


# precision/fp8.py's per-tensor quantisation as torch runs it, bytes moved per element by each kernel: an fp32 copy
# of the 16-bit tensor (read e, write 4), |x| (4 + 4), its max (4), times the scale (4 + 4), clamped (4 + 4), cast
# to one byte (4 + 1).
def torch_quantize(elements: int, e: int) -> list[tuple]:
    return [("memory", elements * moved) for moved in (e + 4, 8, 4, 8, 8, 5)]


def block_kernels(config, micro_batch: int, element_bytes: int, linear: str, attention: str,
                  tp: int = 1) -> list[tuple]:
    """The kernels of one block, forward and backward, on one tensor-parallel rank (tp splits the heads and the
    MLP; the residual stream, norms and residual adds stay whole), as ("gemm", flops, (m, n, k), format)
    and ("memory", bytes read + written). `linear` is the format of the four Linears' GEMMs ("fp8": our
    executor's e4m3/e5m2 copies of their inputs, weights and output gradients are made first, `torch_quantize`,
    and its fp8 GEMMs' backward transposes the weight, the gradient and the input), `attention` FlashAttention's."""
    s, d, f, t = config.seq_len, config.d_model, config.d_ff, tp
    rows = micro_batch * s
    e = element_bytes
    head_dim = d // config.n_heads
    kv_heads = config.n_kv_heads or config.n_heads
    qkv = (config.n_heads + 2 * kv_heads) * head_dim // t  # q for every head, k and v for the key/value heads
    swiglu = config.mlp == "swiglu"
    fc1 = (2 * f if swiglu else f) // t  # SwiGLU's gate and up projections, fused
    kernels: list[tuple] = []
    for n_in, n_out in ((d, qkv), (d // t, d), (d, fc1), (f // t, d)):  # qkv, proj, fc1, fc2
        if linear == "fp8":  # input, weight, output gradient quantised; three one-byte transposes (read 1, write 1)
            for elements in (rows * n_in, n_in * n_out, rows * n_out):
                kernels += torch_quantize(elements, e)
            kernels += [("memory", 2 * n_in * n_out), ("memory", 2 * rows * n_out), ("memory", 2 * rows * n_in)]
        # the forward (rows x out, over in), the input gradient (rows x in, over out), the weight gradient (out x in,
        # over the rows): 2 * rows * in * out FLOPs each
        for shape in ((rows, n_out, n_in), (rows, n_in, n_out), (n_out, n_in, rows)):
            kernels.append(("gemm", 2 * rows * n_in * n_out, shape, linear))
        kernels.append(("memory", 3 * n_in * n_out * e))  # the weight gradient added to its buffer: read 2, write 1
        if config.bias:
            kernels.append(("memory", 2 * rows * n_out * e))  # bias add
            kernels.append(("memory", rows * n_out * e))  # bias gradient: a sum over the rows
    # FlashAttention over the s x s square of this rank's query heads (a * head_dim = d): q k^T and p v forward
    # (4 b s^2 d over the whole square); backward the scores again and four gradient matmuls (10 b s^2 d). The
    # causal kernel computes only the products the mask keeps (`price`).
    kernels.append(("attention", 4 * micro_batch * s * s * d // t, head_dim, attention, s))
    kernels.append(("attention", 10 * micro_batch * s * s * d // t, head_dim, attention, s))
    kernels.append(("memory", 2 * rows * d // t * e))  # its backward's pre-pass, rowsum(dO * O)
    for _ in range(2):  # the attention half and the MLP half
        kernels.append(("memory", 2 * rows * d * e))  # norm: read x, write y
        kernels.append(("memory", 3 * rows * d * e))  # norm backward: read x and dy, write dx
        kernels.append(("memory", 3 * rows * d * e))  # residual add: read 2, write 1
        kernels.append(("memory", 3 * rows * d * e))  # the two gradients meeting at the residual, summed
    width = rows * f // t * e
    if swiglu:
        kernels += [("memory", 4 * width), ("memory", 6 * width)]  # read gate, up; write silu(gate), product; bwd
    else:
        kernels += [("memory", 2 * width), ("memory", 3 * width)]  # GELU; its backward reads x and dy
    if config.positions == "rope":
        kernels += [("memory", 2 * rows * qkv * e)] * 2  # rotate q and k (v copied), and back in the backward
    return kernels


def causal_attention_efficiency(table: dict, head_dim: int, seq: int) -> float:
    """A published causal attention table ({"64": [[s, fraction], ...], ...}) read as docs/efficiency.md says:
    linear in log2(s) between its sequences and linear in the head size between its head sizes, the nearest
    point outside either."""
    rows = sorted((int(size), table_efficiency(points, seq)) for size, points in table.items())  # log s, as log2
    return _piecewise(rows, head_dim, lambda x, x0, x1: (x - x0) / (x1 - x0))


def price(kernels: list[tuple], gpu: str) -> tuple[float, float]:
    """(seconds in GEMMs, FlashAttention included; seconds in memory-bound kernels) on `gpu`'s datasheet.
    A causal FlashAttention pass on a GPU with a published table: half its square's FLOPs (the kernel
    benchmark's count) at the table's share of the format's peak; otherwise the s (s + 1) / 2 of the s^2
    products the mask keeps at the GEMM table's efficiency for the head size. Every tensor-core time is a burst's
    stretched by the GPU's achieved.tensor_sustained for the format (1 where absent)."""
    sheet = DATASHEETS[gpu]
    hbm = sheet["hbm_bandwidth"] * sheet["achieved"]["hbm_fraction"]
    held = sheet["achieved"].get("tensor_sustained", {})  # a burst's rate held under the power limit, per format
    launch = sheet["matmul_efficiency"]["launch_latency"]
    gemm = memory = 0.0
    for kernel in kernels:
        if kernel[0] == "gemm":
            _, flops, (m, n, k), dtype = kernel
            peak, model = sheet["peak_flops"][dtype], sheet["matmul_efficiency"].get("gemm_model", {})
            if dtype in model:
                rate = peak * model_efficiency(model, m, n, k, peak, dtype)
            else:
                rate = peak * table_efficiency(sheet["matmul_efficiency"][dtype], min(m, n, k))
            gemm += flops / (rate * held.get(dtype, 1.0)) + launch
        elif kernel[0] == "attention":
            _, square, head_dim, dtype, seq = kernel
            table = sheet.get("attention_efficiency", {}).get("causal")
            peak = sheet["peak_flops"][dtype] * held.get(dtype, 1.0)
            if table is not None:  # measured in 16-bit; any format at the same share of its own peak
                gemm += square / 2 / (peak * causal_attention_efficiency(table, head_dim, seq))
            else:
                rate = peak * table_efficiency(sheet["matmul_efficiency"][dtype], head_dim)
                gemm += square * (seq + 1) / (2 * seq) / rate
            gemm += launch
        else:
            memory += kernel[1] / hbm + launch
    return gemm, memory


def gemm_flops(kernels: list[tuple]) -> int:
    """Matmul FLOPs as torch's FlopCounterMode counts them: attention over its whole square."""
    return sum(k[1] for k in kernels if k[0] in ("gemm", "attention"))


@lru_cache(maxsize=None)
def model_params(name: str) -> int:
    """Parameters of the real model (minigpt/model.py's GPT), built on the meta device: no memory, no arithmetic
    of config.py's."""
    import torch

    from minigpt.presets import preset
    from minigpt.model import GPT

    with torch.device("meta"):
        model = GPT(preset(name))
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter


@lru_cache(maxsize=None)
def block_matmul_flops(name: str, micro_batch: int = 1) -> int:
    """Forward and backward matmul FLOPs of one real Block (minigpt/model.py), counted by
    torch.utils.flop_counter.FlopCounterMode on the meta device."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from minigpt.presets import preset
    from minigpt.model import Block

    config = preset(name)
    with torch.device("meta"):
        block = Block(config)
        x = torch.empty(micro_batch, config.seq_len, config.d_model, requires_grad=True)
    counter = FlopCounterMode(display=False)
    with counter:
        block(x).sum().backward()
    return counter.get_total_flops()


def ring_seconds(kind: str, size: float, ranks: int, bandwidth: float, latency: float) -> float:
    """A ring collective of a `size`-byte buffer over `ranks` ranks (the textbook bus-bandwidth cost): an
    all-reduce sends 2 (n-1)/n of it through every link in 2 (n-1) steps, an all-gather or reduce-scatter
    half that."""
    steps = (2 if kind == "all_reduce" else 1) * (ranks - 1)
    return steps * size / ranks / bandwidth + steps * latency


@lru_cache(maxsize=None)
def master_weights_reference(master_weights: bool, steps: int = 300, lr: float = 1e-4, width: int = 64,
                             seed: int = 0) -> dict:
    """precision/experiments.py's experiment, redone with torch.optim.AdamW: a LayerNorm gain (from 1.0) and bias
    trained toward a gain about 2% away, fp16 compute. With `master_weights` the optimizer updates fp32 copies
    that are cast to fp16 for each forward; without, the weights live in fp16 (every update is rounded to fp16)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 300 steps on a 256 x 64 batch: one thread is the fastest, and steady
    try:
        return _train_gain(master_weights, steps, lr, width, seed)
    finally:
        torch.set_num_threads(threads)


def _train_gain(master_weights: bool, steps: int, lr: float, width: int, seed: int) -> dict:
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(seed)
    target_gain = 1 + 0.02 * torch.randn(width, generator=generator)
    x = torch.randn(256, width, generator=generator)
    y = F.layer_norm(x, (width,), target_gain)
    gain = torch.ones(width, requires_grad=True)
    bias = torch.zeros(width, requires_grad=True)
    optimizer = torch.optim.AdamW([gain, bias], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(F.layer_norm(x.half(), (width,), gain.half(), bias.half()).float(), y)
        loss.backward()
        optimizer.step()
        if not master_weights:  # the fp16 weight is all there is: the update survives only as fp16 rounds it
            with torch.no_grad():
                gain.copy_(gain.half().float())
                bias.copy_(bias.half().float())
        losses.append(loss.item())
    return {"first_loss": losses[0], "final_loss": losses[-1], "loss_ratio": losses[-1] / losses[0],
            "gain_moved": (gain.detach().half().float() - 1).abs().max().item()}
