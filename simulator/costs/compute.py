"""How long compute takes on one GPU: a roofline per kernel of the op list, and pipeline chunks built from them.

Torch-free. The ops come from simulator/costs/ops.py (every GEMM and memory-bound kernel of a block,
the embeddings, the head and the loss, forward and backward, per tensor-parallel rank). Each
one costs its roofline plus a fixed cost per kernel:

    GEMM             max(flops / (peak[dtype] * efficiency), bytes / HBM) + overhead
    FlashAttention   max(sum of its GEMMs' flops / (peak * efficiency), bytes / HBM) + overhead
    memory-bound     bytes / HBM + overhead

with HBM = hbm_bandwidth * gpu.reached.hbm_fraction, peak = the datasheet's times
gpu.reached.sustained(dtype) (the share of a burst's rate the tensor cores hold under the power limit:
`tensor_peak`) and overhead = the profile's measured launch_latency when it has one, else
gpu.reached.kernel_overhead (simulator/costs/rates/achieved.py: 1 and 0 when the GPU says nothing).

Efficiency (`gemm_efficiency`): where the profile has a GEMM model for the format (a preset's
"gemm_model", simulator/costs/rates/gemm_model.py), the model by (m, n, k): output tiles in waves over the
GPU's SMs, a fixed cost per tile along k and per kernel, fitted to published sweeps (a GPU's calibrated
profile: to the GEMMs calibrate timed on it, simulator/costs/rates/gemm_fit.py). Otherwise the
GPU's table for the format (EfficiencyProfile, the "matmul_efficiency" field
of a hardware entry: cited data in a preset, our measurement in a calibrated profile), by the
matmul's smallest side, interpolated linearly in log(size), the nearest point outside the
table. A format with neither falls back to the uncalibrated curve x / (x + HALF_EFFICIENCY_DIM),
x the smallest side: a stated assumption (every 128-wide output tile pays about one tile edge
of fixed cost), not fitted to anything, optimistic; `efficiency_sources` says which one each
format got: every prediction says it (simulator/provenance.py).

    "matmul_efficiency": {"launch_latency": 4e-6, "source": "...",
                          "fp32": [[64, 0.05], ...],
                          "bf16": [[64, 0.20], [256, 0.55], [1024, 0.78], [8192, 0.85]]}

`parse_efficiency_profile` checks exactly that object (`source` optional).

Chunks (`chunk_times`): `layers` blocks (plus the embeddings on the first chunk, the final
norm, head and loss on the last) for one micro-batch on one tensor-parallel rank: the sum of
their ops' times, forward, and backward (which starts with the recomputed ops). The
tensor-parallel collectives are returned as byte counts (parallel/comm.py's convention: the
full buffer S) for the engine to time on the links, with the GEMM time of the Linears around
them (what could hide them, simulator/engine/overlap.py). Ops run once a step rather than per
micro-batch (fp8 weight casts kept across micro-batches, Implementation.fp8_weight_cache) are
`per_step_s`, which the engine charges once a step with the optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from precision.policy import FORMAT_BYTES, PrecisionPolicy, policy as precision_policy
from simulator.costs.rates.efficiency import EfficiencyProfile, parse_efficiency_profile  # noqa: F401 (re-exported)
from simulator.costs.hardware import GPUSpec
from job.layout import Layout
from simulator.costs.rates.attention_rates import kernel_table, seconds as attention_seconds
from simulator.costs.recorder import is_weight_gradient
from simulator.costs.op_types import (RECOMPUTE, FusedAttention, Gemm, Implementation, Op, OpList,
                                      model_flops)
from simulator.costs.ops import block_ops, embedding_ops, head_ops, mtp_units
from simulator.costs.layers.fp8 import sp_amax_reductions
from simulator.costs.tp_collectives import TPCollective, total_bytes, tp_collectives, whole_norm_sums

HALF_EFFICIENCY_DIM = 128  # smallest matmul side at which the uncalibrated curve reaches half the peak
FALLBACK_CURVE = f"fallback curve x/(x+{HALF_EFFICIENCY_DIM}) (no table: uncalibrated, optimistic)"
ELEMENT_BYTES = {"fp32": FORMAT_BYTES["fp32"], "tf32": FORMAT_BYTES["fp32"], "bf16": FORMAT_BYTES["bf16"],
                 "fp16": FORMAT_BYTES["fp16"], "fp8": FORMAT_BYTES["fp8_e4m3"]}


def hbm_speed(gpu: GPUSpec) -> float:
    """Bytes/s a streaming kernel reaches: the datasheet bandwidth times the achieved fraction."""
    return gpu.hbm_bandwidth * gpu.reached.hbm_fraction


def tensor_peak(gpu: GPUSpec, dtype: str) -> float:
    """FLOP/s the tensor cores hold in `dtype` through a training run: the dense peak times the share of a
    burst's rate they keep back to back under the board's power limit (achieved.tensor_sustained; 1 if not given).
    The efficiency tables and the GEMM model describe bursts (microbenchmarks of a few timed calls): a kernel's
    whole burst time, its fixed cost included, is stretched by the lower clock that holds the power limit."""
    return gpu.flops(dtype) * gpu.reached.sustained(dtype)


def efficiency(smallest: int, dtype: str, profile: EfficiencyProfile | None = None) -> float:
    """Fraction of the peak a matmul whose smallest side is `smallest` reaches, by the profile's table."""
    measured = profile.efficiency(dtype, smallest) if profile is not None else None
    return measured if measured is not None else smallest / (smallest + HALF_EFFICIENCY_DIM)


def gemm_efficiency(m: int, n: int, k: int, dtype: str, gpu: GPUSpec, profile: EfficiencyProfile | None = None,
                    batch: int = 1, margin: int = 0) -> float:
    """Fraction of `gpu`'s peak in `dtype` that `batch` GEMMs (m x k) @ (k x n) reach: the profile's GEMM model for the
    format when it has one, else its table by the smallest side (`efficiency`). `margin`: SMs the GEMM leaves to a
    collective, which only the GEMM model (it counts SMs) can price."""
    model = profile.gemm if profile is not None else None
    shaped = model.efficiency(m, n, k, dtype, gpu.flops(dtype), batch, margin) if model is not None else None
    if shaped is None and margin:
        raise ConfigError(f"a GEMM that leaves {margin} SMs to a collective (set_sm_margin) needs the GPU's GEMM model "
                          f"in {dtype} (its SM count): this profile has none; drop the margin from the tp overlap "
                          f"configuration")
    return shaped if shaped is not None else efficiency(min(m, n, k), dtype, profile)


def matmul_time(flops: float, m: int, n: int, k: int, gpu: GPUSpec, dtype: str, batch: int = 1,
                profile: EfficiencyProfile | None = None) -> float:
    """Seconds for `batch` matmuls of (m x k) @ (k x n) holding `flops` FLOPs in all, on `gpu`, in `dtype`."""
    for name, value in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"matmul {name} must be a positive integer, got {value!r}")
    if not 0 <= flops < math.inf:
        raise ConfigError(f"matmul flops must be a finite number >= 0, got {flops!r}")
    compute = flops / (tensor_peak(gpu, dtype) * gemm_efficiency(m, n, k, dtype, gpu, profile, batch))
    memory = batch * (m * k + k * n + m * n) * ELEMENT_BYTES[dtype] / hbm_speed(gpu)
    return max(compute, memory) + (profile.launch_latency if profile is not None else 0.0)


@dataclass(frozen=True)
class Matmul:
    """One named matmul (m x k) @ (k x n), `batch` times: the roofline without the op list around it."""

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


def kernel_overhead(gpu: GPUSpec, profile: EfficiencyProfile | None = None) -> float:
    """Seconds every kernel costs beyond its roofline: a profile's measured launch latency, else the GPU's achieved overhead."""
    if profile is not None and profile.launch_latency > 0:
        return profile.launch_latency
    return gpu.reached.kernel_overhead


def _gemm_compute(g: Gemm, gpu: GPUSpec, profile: EfficiencyProfile | None) -> float:
    """At the efficiency of one chunk's shape when it runs in chunks (each a GEMM of its own, in turn); a batch on
    parallel streams round by round, each round's GEMMs sharing the SMs (their tiles in one set of waves)."""
    rows = -(-g.m // g.chunks)
    peak, flops = tensor_peak(gpu, g.dtype), 2 * g.m * g.n * g.k
    return sum(flops * batch / (peak * gemm_efficiency(rows, g.n, g.k, g.dtype, gpu, profile, batch, g.sm_margin))
               for batch in g.rounds)


def _attention_compute(op: FusedAttention, gpu: GPUSpec, profile: EfficiencyProfile | None) -> float:
    """A fused attention kernel: causal, on a GPU with a published table, at the kernel's measured share of the
    peak for its head size and sequence (attention_rates.py); else the products the mask keeps at the GEMMs'
    efficiency."""
    scores = op.gemms[0]  # s x s x head_dim: the scores, or the backward's recomputed scores
    table = kernel_table(gpu, op.kernel)
    if op.causal_seq and table is not None:  # at the length the kernel works on: a ring's chunk under cp (layers/attention.py)
        peak = tensor_peak(gpu, scores.dtype)
        return attention_seconds(table, op.benchmark_flops, scores.k, op.efficiency_seq, peak)
    square = sum(_gemm_compute(g, gpu, profile) for g in op.gemms)
    return square * op.flops / op.square_flops


def op_time(op: Op, gpu: GPUSpec, profile: EfficiencyProfile | None = None) -> float:
    """Seconds of one op of simulator/costs/ops.py on `gpu` (see the module docstring)."""
    memory = op.bytes / hbm_speed(gpu)
    if isinstance(op, Gemm):
        compute = _gemm_compute(op, gpu, profile)
    elif isinstance(op, FusedAttention):
        compute = _attention_compute(op, gpu, profile)
    else:
        compute = 0.0
    return max(compute, memory) + kernel_overhead(gpu, profile) * (op.launches if isinstance(op, Gemm) else 1)


@dataclass(frozen=True)
class PassTimes:
    """Seconds of a list of ops, split into GEMMs (the Linears' apart) and memory-bound kernels."""

    total: float = 0.0
    gemm: float = 0.0
    linear: float = 0.0  # the Linears' GEMMs: what can hide tensor-parallel collectives
    memory: float = 0.0
    attention: float = 0.0  # the fused attention kernels: what a context-parallel ring's passes hide behind

    def __add__(self, other: "PassTimes") -> "PassTimes":
        return PassTimes(self.total + other.total, self.gemm + other.gemm, self.linear + other.linear,
                         self.memory + other.memory, self.attention + other.attention)

    def __mul__(self, times: int) -> "PassTimes":
        return PassTimes(self.total * times, self.gemm * times, self.linear * times, self.memory * times,
                         self.attention * times)


SHARED = "shared."  # a MoE's shared experts' ops (simulator/costs/ops.py's _mlp prefix)


def shared_halves(ops, gpu: GPUSpec, profile: EfficiencyProfile | None = None, times: int = 1) -> tuple[float, float]:
    """Seconds of a MoE's shared experts among `ops`, x `times`: (fc1 and its activation, fc2), their weight
    gradients left out (zero-bubble schedules run those apart). What can hide expert parallelism's dispatch and
    combine all-to-alls when the shared experts run beside them (Overlap.ep: simulator/engine/experts.py)."""
    first = second = 0.0
    for op in ops:
        if op.name.startswith(SHARED) and not is_weight_gradient(op):
            seconds = op_time(op, gpu, profile) * times
            if op.name.startswith(f"{SHARED}fc2"):
                second += seconds
            else:
                first += seconds
    return first, second


def _plus(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return a[0] + b[0], a[1] + b[1]


def pass_times(ops, gpu: GPUSpec, profile: EfficiencyProfile | None = None) -> PassTimes:
    total = gemm = linear = memory = attention = 0.0
    for op in ops:
        seconds = op_time(op, gpu, profile)
        total += seconds
        if isinstance(op, (Gemm, FusedAttention)):
            gemm += seconds
            linear += seconds if isinstance(op, Gemm) and op.linear else 0.0
            attention += seconds if isinstance(op, FusedAttention) else 0.0
        else:
            memory += seconds
    return PassTimes(total, gemm, linear, memory, attention)


@dataclass(frozen=True)
class ChunkTimes:
    """One micro-batch through one pipeline chunk on one GPU (seconds), and its tensor-parallel traffic."""

    forward_s: float
    backward_s: float  # includes recompute_s
    forward_matmul_s: float  # GEMMs and FlashAttention
    forward_elementwise_s: float  # memory-bound kernels
    recompute_s: float
    forward_flops: int  # matmul FLOPs on this rank, as config.py counts them (attention's whole square)
    tp_comm_bytes_forward: int
    tp_comm_bytes_backward: int
    tp_collectives_forward: tuple[TPCollective, ...] = ()
    tp_collectives_backward: tuple[TPCollective, ...] = ()
    backward_weight_s: float = 0.0  # the weight-gradient part of backward_s (GEMMs, accumulation, bias sums)
    forward_linear_s: float = 0.0  # the Linears' GEMMs of the forward: what could hide its tp collectives
    backward_linear_s: float = 0.0  # the same in the backward (recompute included)
    backward_flops: int = 0  # recompute included
    attention_forward_s: float = 0.0  # the fused attention kernels of the forward (what a cp ring's passes hide behind)
    attention_backward_s: float = 0.0  # of the backward, the recomputed forward's left out
    attention_recompute_s: float = 0.0  # of the recomputed forward
    per_step_s: float = 0.0  # once per step, not per micro-batch: fp8 weight casts kept across micro-batches
    # a MoE's shared experts, (fc1 and activation, fc2) each, weight gradients left out (shared_halves)
    shared_forward_s: tuple[float, float] = (0.0, 0.0)
    shared_backward_s: tuple[float, float] = (0.0, 0.0)  # the recomputed forward's left out
    shared_recompute_s: tuple[float, float] = (0.0, 0.0)
    fp8_gemms: int = 0  # the Linears' GEMMs of the forward that run in fp8 (each has amaxes to reduce: engine/costs.py)
    sp_amaxes: tuple[int, int] = (0, 0)  # current scaling's amax all-reduces over tp (forward, backward): layers/fp8.py


def moe_count(model: GPTConfig, layers: int, moe_layers: int | None) -> int:
    """How many of a chunk's `layers` blocks are a mixture of experts' (None: all of a MoE model's, as
    GPTConfig.block_params counts a block of the model's main kind)."""
    if not model.is_moe:
        return 0
    moe = layers if moe_layers is None else moe_layers
    if not isinstance(moe, int) or isinstance(moe, bool) or not 0 <= moe <= layers:
        raise ConfigError(f"moe_layers must be a whole number of the chunk's {layers} blocks, got {moe_layers!r}")
    return moe


def chunk_ops(model: GPTConfig, layers: int, micro_batch_size: int, layout: Layout, policy: PrecisionPolicy,
              implementation: Implementation, first: bool = False, last: bool = False,
              moe_layers: int | None = None) -> list[tuple[OpList, int]]:
    """The op lists of a chunk, each with how many times it runs: embeddings, `layers` blocks (`moe_layers` of them
    a mixture of experts', moe_count), head and loss."""
    units = []
    moe = moe_count(model, layers, moe_layers)
    if first:
        units.append((embedding_ops(model, micro_batch_size, layout, policy, implementation), 1))
    for kind, count in ((False, layers - moe), (True, moe)):
        if count:
            units.append((block_ops(model, micro_batch_size, layout, policy, implementation, kind), count))
    if last:
        units.append((head_ops(model, micro_batch_size, layout, policy, implementation), 1))
        units += mtp_units(model, micro_batch_size, layout, policy, implementation)
    return units


def chunk_times(model: GPTConfig, layers: int, micro_batch_size: int, layout: Layout, gpu: GPUSpec, precision: str,
                recompute: str = "none", first: bool = False, last: bool = False,
                profile: EfficiencyProfile | None = None, attention: str = "flash",
                sp_saved_input: str = "gathered", implementation: Implementation | None = None,
                moe_layers: int | None = None) -> ChunkTimes:
    """Forward and backward of `layers` blocks (+ embedding when `first`, head and loss when `last`), `moe_layers` of
    them a mixture of experts' (None: all of a MoE model's; moe_count).

    `implementation` (simulator/costs/implementation.py), when given, is how the blocks are computed, its attention,
    recompute and sp_saved_input in place of the three arguments; without it they make one with the rest default."""
    layout.check(model)
    implementation = implementation or Implementation(attention, recompute, sp_saved_input)
    recompute = implementation.recompute
    policy = precision_policy(precision)
    if not isinstance(layers, int) or layers < 0 or (layers == 0 and not (first or last)):
        raise ConfigError(f"a chunk needs layers >= 0 and something to run, got layers={layers!r}")
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
    forward = again = backward = weight = step = PassTimes()
    forward_flops = backward_flops = fp8_gemms = 0
    sp_amaxes = (0, 0)
    current = policy.fp8_linears and implementation.fp8_scaling == "current"
    shared = {"forward": (0.0, 0.0), "backward": (0.0, 0.0), "recompute": (0.0, 0.0)}
    moe = moe_count(model, layers, moe_layers)
    for ops, count in chunk_ops(model, layers, micro_batch_size, layout, policy, implementation, first, last, moe):
        step += pass_times(ops.per_step, gpu, profile) * count
        rerun = [op for op in ops.backward if op.phase == RECOMPUTE]
        grads = [op for op in ops.backward if op.phase != RECOMPUTE]
        forward += pass_times(ops.forward, gpu, profile) * count
        again += pass_times(rerun, gpu, profile) * count
        backward += pass_times(grads, gpu, profile) * count
        weight += pass_times([op for op in grads if is_weight_gradient(op)], gpu, profile) * count
        if moe and model.n_shared_experts:
            for name, listed in (("forward", ops.forward), ("backward", grads), ("recompute", rerun)):
                shared[name] = _plus(shared[name], shared_halves(listed, gpu, profile, count))
        forward_flops += count * sum(model_flops(op) for op in ops.forward)
        fp8_gemms += count * sum(op.batch for op in ops.forward if isinstance(op, Gemm) and op.linear and op.dtype == "fp8")
        if current:
            sp_amaxes = _plus(sp_amaxes, tuple(count * n for n in sp_amax_reductions(ops.forward, layout.sequence_parallel
                                                                                        and layout.tp > 1)))
        backward_flops += count * sum(model_flops(op) for op in ops.backward)
    sharded = layout.sequence_parallel and implementation.sp_saved_input == "sharded"
    fwd, bwd = tp_collectives(model, layers, micro_batch_size, layout, policy, first, last, sharded, moe)
    if recompute == "full":  # the recomputed forward issues the blocks' forward collectives again
        bwd += tp_collectives(model, layers, micro_batch_size, layout, policy, False, False, moe_layers=moe)[0]
    elif recompute == "selective":  # the attention core's: OLMo 2's norms' sums
        bwd += whole_norm_sums(model, layers, micro_batch_size, layout)
    return ChunkTimes(
        forward_s=forward.total, backward_s=backward.total + again.total, forward_matmul_s=forward.gemm,
        forward_elementwise_s=forward.memory, recompute_s=again.total, forward_flops=forward_flops,
        tp_comm_bytes_forward=total_bytes(fwd), tp_comm_bytes_backward=total_bytes(bwd),
        tp_collectives_forward=tuple(fwd), tp_collectives_backward=tuple(bwd), backward_weight_s=weight.total,
        forward_linear_s=forward.linear, backward_linear_s=backward.linear + again.linear, backward_flops=backward_flops,
        attention_forward_s=forward.attention, attention_backward_s=backward.attention,
        attention_recompute_s=again.attention, per_step_s=step.total, shared_forward_s=shared["forward"],
        shared_backward_s=shared["backward"], shared_recompute_s=shared["recompute"], fp8_gemms=fp8_gemms,
        sp_amaxes=sp_amaxes,
    )


def step_flops(model: GPTConfig, global_batch: int, recompute: str = "none", attention: str | None = None) -> int:
    """Matmul FLOPs of one training step over `global_batch` sequences (config.train_flops_per_token)."""
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global_batch must be a positive integer, got {global_batch!r}")
    return model.train_flops_per_token(recompute, attention) * global_batch * model.seq_len


def mfu(model: GPTConfig, global_batch: int, step_time_s: float, n_gpus: int, gpu: GPUSpec, dtype: str) -> float:
    """Model FLOPs utilisation: the model's FLOPs (no recompute counted) / (time x GPUs x peak in `dtype`)."""
    if not step_time_s > 0 or not isinstance(n_gpus, int) or n_gpus < 1:
        raise ConfigError(f"mfu needs step_time_s > 0 and n_gpus >= 1, got {step_time_s!r} and {n_gpus!r}")
    return step_flops(model, global_batch) / (step_time_s * n_gpus * gpu.flops(dtype))
