"""How long compute takes on one GPU: a roofline per matmul, and the chunks of a pipeline built from them.

Torch-free. A matmul (m x k) @ (k x n), `batch` times, takes

    max(flops / (peak[dtype] * efficiency), bytes moved / HBM bandwidth) + launch latency

with bytes moved = batch * (m*k + k*n + m*n) * element bytes (each operand read once,
the result written once: the best a tiled kernel can do).

Efficiency curve (uncalibrated): efficiency(x) = x / (x + HALF_EFFICIENCY_DIM), x the
smallest of m, n, k. Stated assumption, not fitted to any published result: a GEMM
kernel cuts its output into tiles and streams the reduction through them; every tile
pays a fixed cost (filling the operand pipeline, writing the tile back) worth about as
much tensor-core time as one tile edge of work, and a tile edge is 128 elements, the
common tile size of tensor-core kernels. So a matmul whose smallest side is 128 runs at
half the peak, 1024 at 89%, 8192 at 98%; the ceiling is the datasheet peak itself. Real
kernels lose more (clocks, wave quantisation): uncalibrated times are optimistic, and
a calibrated profile replaces the curve.

Calibration hook: `EfficiencyProfile`, a table of measured efficiency by smallest
dimension per number format, plus a per-kernel launch latency: the optional
"matmul_efficiency" field of a GPU entry in a hardware profile (hardware.py reads it;
`minigpt calibrate` writes one table per measured format, each relative to that format's
measured peak_flops):

    "matmul_efficiency": {"launch_latency": 4e-6,
                          "fp32": [[64, 0.05], ...],
                          "bf16": [[64, 0.20], [256, 0.55], [1024, 0.78], [8192, 0.85]]}

`parse_efficiency_profile` checks exactly that object. Between points the efficiency is
interpolated linearly in log(size); outside them the nearest point holds. A format without
a table takes the uncalibrated curve against its peak.

Chunks (`chunk_times`): a pipeline chunk of `layers` blocks (plus the embedding on the
first, head and loss on the last) for one micro-batch on one tensor-parallel rank:
the block's matmuls (qkv, attention scores and values, proj, fc1, fc2) with their
shapes divided by tp, the head's over the padded vocabulary / tp, and the element-wise
work (LayerNorm, GELU, softmax, residuals, which config.py's FLOPs leave out) estimated
as moving twice the bytes the layer keeps for its backward through HBM. Backward = 2x
forward; recompute="full" adds one forward of the blocks to the backward. The
tensor-parallel collectives are returned as byte counts (parallel/comm.py's convention:
the full buffer S) for the engine to time on the links.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from minigpt.config import GPTConfig, check_recompute
from minigpt.errors import ConfigError
from precision.policy import FORMAT_BYTES, PrecisionPolicy, policy as precision_policy
from simulator.hardware import FLOP_FORMATS, GPUSpec
from simulator.layout import Layout, block_tensors, padded_vocab
from simulator.memory import head_activation_parts, layer_activation_bytes, parts_bytes

HALF_EFFICIENCY_DIM = 128  # smallest matmul side at which the uncalibrated curve reaches half the peak
ELEMENT_BYTES = {"fp32": FORMAT_BYTES["fp32"], "tf32": FORMAT_BYTES["fp32"], "bf16": FORMAT_BYTES["bf16"],
                 "fp16": FORMAT_BYTES["fp16"], "fp8": FORMAT_BYTES["fp8_e4m3"]}
LOSS_ALL_REDUCES = 3  # the vocabulary-parallel loss all-reduces max, sum of exponentials, target logit
LOSS_VALUE_BYTES = FORMAT_BYTES["fp32"]  # one fp32 number per token each


@dataclass(frozen=True)
class EfficiencyProfile:
    """Measured matmul efficiency by smallest dimension, per number format (the calibration hook)."""

    points: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict, hash=False)
    launch_latency: float = 0.0  # seconds per kernel

    def efficiency(self, dtype: str, smallest: int) -> float | None:
        """The measured efficiency at `smallest`, or None when this format was not measured."""
        table = self.points.get(dtype)
        if not table:
            return None
        if smallest <= table[0][0]:
            return table[0][1]
        for (x0, e0), (x1, e1) in zip(table, table[1:]):
            if smallest <= x1:
                t = (math.log(smallest) - math.log(x0)) / (math.log(x1) - math.log(x0))
                return e0 + t * (e1 - e0)
        return table[-1][1]


def parse_efficiency_profile(data: object, origin: str = "profile") -> EfficiencyProfile:
    """Check a "matmul_efficiency" object; every problem raises ConfigError naming the field."""
    where = f"{origin}: matmul_efficiency"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a JSON object of number formats and a launch_latency")
    unknown = sorted(set(data) - set(FLOP_FORMATS) - {"launch_latency"})
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {', '.join(unknown)}: use {', '.join(FLOP_FORMATS)}, launch_latency")
    latency = data.get("launch_latency", 0.0)
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency < math.inf:
        raise ConfigError(f"{where}.launch_latency must be seconds >= 0, got {latency!r}")
    points = {}
    for fmt in FLOP_FORMATS:
        if fmt not in data:
            continue
        table = data[fmt]
        ok = isinstance(table, list) and table and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool) and p[0] > 0
            and isinstance(p[1], (int, float)) and not isinstance(p[1], bool) and 0 < p[1] <= 1
            for p in table
        )
        if not ok or any(a[0] >= b[0] for a, b in zip(table, table[1:])):
            raise ConfigError(
                f"{where}.{fmt} must be [[size, efficiency], ...] with sizes > 0 increasing and 0 < efficiency <= 1"
            )
        points[fmt] = tuple((int(x), float(e)) for x, e in table)
    return EfficiencyProfile(points=points, launch_latency=float(latency))


def efficiency(smallest: int, dtype: str, profile: EfficiencyProfile | None = None) -> float:
    """Fraction of the peak a matmul whose smallest side is `smallest` reaches."""
    measured = profile.efficiency(dtype, smallest) if profile is not None else None
    return measured if measured is not None else smallest / (smallest + HALF_EFFICIENCY_DIM)


def matmul_time(flops: float, m: int, n: int, k: int, gpu: GPUSpec, dtype: str, batch: int = 1,
                profile: EfficiencyProfile | None = None) -> float:
    """Seconds for `batch` matmuls of (m x k) @ (k x n) holding `flops` FLOPs in all, on `gpu`, in `dtype`."""
    for name, value in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"matmul {name} must be a positive integer, got {value!r}")
    if not 0 <= flops < math.inf:
        raise ConfigError(f"matmul flops must be a finite number >= 0, got {flops!r}")
    compute = flops / (gpu.flops(dtype) * efficiency(min(m, n, k), dtype, profile))
    memory = batch * (m * k + k * n + m * n) * ELEMENT_BYTES[dtype] / gpu.hbm_bandwidth
    return max(compute, memory) + (profile.launch_latency if profile is not None else 0.0)


@dataclass(frozen=True)
class Matmul:
    name: str
    m: int
    n: int
    k: int
    dtype: str
    batch: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.batch

    def time(self, gpu: GPUSpec, profile: EfficiencyProfile | None = None) -> float:
        return matmul_time(self.flops, self.m, self.n, self.k, gpu, self.dtype, self.batch, profile)


def block_matmuls(model: GPTConfig, micro_batch_size: int, tp: int, policy: PrecisionPolicy) -> list[Matmul]:
    """One block's forward matmuls on one tensor-parallel rank (the sequence gathered under sequence parallelism)."""
    d, f, s, hd = model.d_model, model.d_ff, model.seq_len, model.head_dim
    tokens, heads = micro_batch_size * s, micro_batch_size * model.n_heads // tp
    linear = "fp8" if policy.fp8_linears else policy.compute
    return [
        Matmul("qkv", tokens, 3 * d // tp, d, linear),
        Matmul("attention_scores", s, s, hd, policy.compute, heads),
        Matmul("attention_values", s, hd, s, policy.compute, heads),
        Matmul("proj", tokens, d, d // tp, linear),
        Matmul("fc1", tokens, f // tp, d, linear),
        Matmul("fc2", tokens, d, f // tp, linear),
    ]


def head_matmul(model: GPTConfig, micro_batch_size: int, tp: int, policy: PrecisionPolicy) -> Matmul:
    """The LM head over this rank's share of the padded vocabulary (it stays 16-bit under fp8)."""
    return Matmul("head", micro_batch_size * model.seq_len, padded_vocab(model, tp) // tp, model.d_model, policy.compute)


@dataclass(frozen=True)
class TPCollective:
    """`calls` tensor-parallel collectives of `bytes` each (the full buffer S, as parallel/comm.py counts)."""

    kind: str  # all_reduce, all_gather, reduce_scatter
    bytes: int
    calls: int


def tp_collectives(model: GPTConfig, layers: int, micro_batch_size: int, layout: Layout, policy: PrecisionPolicy,
                   first: bool, last: bool) -> tuple[list[TPCollective], list[TPCollective]]:
    """Forward and backward collectives of one chunk for one micro-batch, as parallel/tensor_layers.py issues them.

    Per block: without sequence parallelism 2 all-reduces of b*s*h forward (after proj, fc2)
    and 2 backward (before qkv, fc1); with it 2 all-gathers + 2 reduce-scatters each way, plus
    a backward all-reduce of every replicated parameter's gradient (LayerNorms, proj/fc2 biases).
    """
    if layout.tp == 1:
        return [], []
    width = micro_batch_size * model.seq_len * model.d_model * FORMAT_BYTES[policy.compute]
    sp = layout.sequence_parallel
    forward, backward = [], []
    if first:  # the vocabulary-parallel embedding sums its pieces; SequenceSplit gathers back in the backward
        forward.append(TPCollective("all_reduce", width, 1))
        if sp:
            backward.append(TPCollective("all_gather", width, 1))
    if sp:
        forward += [TPCollective("all_gather", width, 2 * layers), TPCollective("reduce_scatter", width, 2 * layers)]
        backward += [TPCollective("all_gather", width, 2 * layers), TPCollective("reduce_scatter", width, 2 * layers)]
        grad_bytes = FORMAT_BYTES[policy.grad]
        replicated = [t for t in block_tensors(model, layout.tp) if t.replicated]
        backward += [TPCollective("all_reduce", t.numel * grad_bytes, layers) for t in replicated]
    else:
        forward.append(TPCollective("all_reduce", width, 2 * layers))
        backward.append(TPCollective("all_reduce", width, 2 * layers))
    if last:  # the head is column-parallel; the loss all-reduces three fp32 numbers per token
        if sp:
            forward.append(TPCollective("all_gather", width, 1))
        backward.append(TPCollective("reduce_scatter" if sp else "all_reduce", width, 1))
        forward.append(TPCollective("all_reduce", micro_batch_size * model.seq_len * LOSS_VALUE_BYTES, LOSS_ALL_REDUCES))
        if sp:
            backward += [TPCollective("all_reduce", model.d_model * FORMAT_BYTES[policy.grad], 2)]  # final LayerNorm
    return forward, backward


def total_bytes(collectives: list[TPCollective]) -> int:
    return sum(c.bytes * c.calls for c in collectives)


@dataclass(frozen=True)
class ChunkTimes:
    """One micro-batch through one pipeline chunk on one GPU (seconds), and its tensor-parallel traffic."""

    forward_s: float
    backward_s: float  # includes recompute_s
    forward_matmul_s: float
    forward_elementwise_s: float
    recompute_s: float
    forward_flops: int  # matmul FLOPs on this rank
    tp_comm_bytes_forward: int
    tp_comm_bytes_backward: int
    tp_collectives_forward: tuple[TPCollective, ...] = ()
    tp_collectives_backward: tuple[TPCollective, ...] = ()


def chunk_times(model: GPTConfig, layers: int, micro_batch_size: int, layout: Layout, gpu: GPUSpec, precision: str,
                recompute: str = "none", first: bool = False, last: bool = False,
                profile: EfficiencyProfile | None = None) -> ChunkTimes:
    """Forward and backward of `layers` blocks (+ embedding when `first`, head and loss when `last`)."""
    layout.check(model)
    check_recompute(recompute)
    policy = precision_policy(precision)
    if not isinstance(layers, int) or layers < 0 or (layers == 0 and not (first or last)):
        raise ConfigError(f"a chunk needs layers >= 0 and something to run, got layers={layers!r}")
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
    bandwidth = gpu.hbm_bandwidth
    blocks = block_matmuls(model, micro_batch_size, layout.tp, policy)
    block_matmul_s = sum(mm.time(gpu, profile) for mm in blocks)
    block_elementwise_s = 2 * layer_activation_bytes(model, layout, policy, micro_batch_size) / bandwidth
    block_s = block_matmul_s + block_elementwise_s
    matmul_s, elementwise_s = layers * block_matmul_s, layers * block_elementwise_s
    flops = layers * sum(mm.flops for mm in blocks)
    tokens = micro_batch_size * model.seq_len
    if first:  # an embedding lookup: rows read and written once
        elementwise_s += 2 * tokens * model.d_model * FORMAT_BYTES[policy.compute] / bandwidth
    if last:
        head = head_matmul(model, micro_batch_size, layout.tp, policy)
        matmul_s += head.time(gpu, profile)
        flops += head.flops
        head_parts = head_activation_parts(model, FORMAT_BYTES[policy.compute], layout.tp)
        elementwise_s += 2 * parts_bytes(head_parts, tokens, layout) / bandwidth
    forward_s = matmul_s + elementwise_s
    recompute_s = layers * block_s if recompute == "full" else 0.0
    forward, backward = tp_collectives(model, layers, micro_batch_size, layout, policy, first, last)
    if recompute == "full":  # the recomputed forward issues the blocks' forward collectives again
        backward += tp_collectives(model, layers, micro_batch_size, layout, policy, False, False)[0]
    return ChunkTimes(
        forward_s=forward_s, backward_s=2 * forward_s + recompute_s, forward_matmul_s=matmul_s,
        forward_elementwise_s=elementwise_s, recompute_s=recompute_s, forward_flops=flops,
        tp_comm_bytes_forward=total_bytes(forward), tp_comm_bytes_backward=total_bytes(backward),
        tp_collectives_forward=tuple(forward), tp_collectives_backward=tuple(backward),
    )


def step_flops(model: GPTConfig, global_batch: int, recompute: str = "none") -> int:
    """Matmul FLOPs of one training step over `global_batch` sequences (config.train_flops_per_token)."""
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global_batch must be a positive integer, got {global_batch!r}")
    return model.train_flops_per_token(recompute) * global_batch * model.seq_len


def mfu(model: GPTConfig, global_batch: int, step_time_s: float, n_gpus: int, gpu: GPUSpec, dtype: str) -> float:
    """Model FLOPs utilisation: the model's FLOPs (no recompute counted) / (time x GPUs x peak in `dtype`)."""
    if not step_time_s > 0 or not isinstance(n_gpus, int) or n_gpus < 1:
        raise ConfigError(f"mfu needs step_time_s > 0 and n_gpus >= 1, got {step_time_s!r} and {n_gpus!r}")
    return step_flops(model, global_batch) / (step_time_s * n_gpus * gpu.flops(dtype))
