"""The fastest training layouts of a model on N GPUs that fit in memory (`minigpt plan`). Torch-free.

Every candidate:
  tp      dividing the GPUs of a server (and the GPU count), allowed by the model's shape
          (job/train_config.py's check_tensor_parallel: heads, key/value heads, MLP width and,
          with sequence parallelism, the sequence length);
  SP      sequence parallelism off, and on when tp > 1;
  cp      context parallelism (ring), powers of two dividing GPUs / tp whose 2 x cp chunks split the
          sequence (job/train_config.py's check_context_parallel) into chunks of at least MIN_CP_CHUNK
          tokens (module constant: why);
  pp      dividing GPUs / (tp x cp), at most the layers (job/schedule.py's chunk_layers: a block a chunk);
  dp      GPUs / (tp x cp x pp);
  ep      a mixture of experts' expert parallelism: every divisor of the ranks routing distinct tokens (dp x cp,
          x tp under SP) that divides the experts (E / ep experts a rank; job/train_config.py's
          check_expert_parallel), or the one --ep asks for; 1 for a dense model;
  ZeRO    0, 1, 2 and 3 with several data-parallel ranks (dp x cp); 0 with one (every stage runs as 0 there);
  FSDP    (fsdp_options) ZeRO-3 resharding after the forward or not (kept from a unit's forward to its
          backward; all step under pipelining), kept all step with the gradients reduced once (--sync-grads-once)
          where pp is 1 and there are several micro-batches; ZeRO 1-3 sharded over every data rank and over each
          server's (hybrid sharding, --shard-group: shards inside a server, replicas across servers);
  micro-batch  MICRO_BATCH_SIZES that divide the batch per replica (or the one --micro-batch-size /
          --micro-batches asks for);
  schedule  1f1b; interleaved with INTERLEAVED_CHUNKS virtual chunks where the micro-batches are a
          multiple of pp and every chunk gets a block (pp 1: 1f1b only);
  recompute none, selective, full; and torchtitan's selective op policy ("op") under the torchtitan-fsdp2 stack,
          where it is described (a dense bias-free model without dropout, 16-bit, tp 1 and cp 1);
with flash attention and the overlap preset asked for (our executor's by default, as `minigpt simulate`: every
preset with its stack's own implementation, simulator/engine/overlap.py's stack_default), and a MoE's routing imbalance
as --expert-load gives it (1.0: balanced; the memory check, the bound and every simulation price the same). A candidate
beyond simulator/limits.py's schedule slots or ZeRO-3 gathers is refused, as the interleaved
schedule is where it cannot run: both are counted.

How the search stays exact with respect to the simulator and fast:
  1. memory: simulator/memory.py's predict_memory, called exactly as simulate_step calls it (the
     schedule's micro-batches in flight on each rank): a layout rejected here does not fit when
     simulated either, and costs no replay;
  2. a lower bound on the step of each layout that fits, without a replay (simulator/search/bound.py:
     the busiest rank's priced compute plus the pipeline's fill and drain, or its data-parallel
     collectives one after another on its stream, whichever is longer; the second term, which
     builds the schedule, only for a layout that reaches the front of the line);
  3. simulate_step in increasing bound order, stopping once the next bound exceeds the k-th
     best step simulated: every layout not simulated is slower than the k returned (branch and
     bound). The best returned is the simulator's fastest layout that fits (on a tie, one of them).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from minigpt.config import OP_RECOMPUTE, RECOMPUTE_MODES, GPTConfig
from minigpt.errors import ConfigError, check_positive_int
from job.layout import Layout
from job.schedule_actions import holds_all_step
from precision.policy import policy as precision_policy
from job.train_config import check_context_parallel, check_expert_parallel, routing_ranks, shape_allows
from simulator.engine.experts import check_dispatcher, check_expert_load
from simulator.engine.overlap import overlap_preset
from simulator.engine.simulate import SimResult, simulate_step
from simulator.costs.hardware import GPUSpec
from simulator.limits import (MAX_SCHEDULE_SLOTS, MAX_ZERO3_GATHERS, check_gpus, check_layers, schedule_slots,
                              zero3_gathers)
from simulator.memory import MemoryEstimate, predict_memory
from simulator.search.bound import BUCKET_MB, StepBound, candidate_stack, schedule_shape
from simulator.search.sweep import ClusterSpec

MICRO_BATCH_SIZES = (1, 2, 4, 8)
# The shortest chunk (seq / 2cp tokens) plan tries: the shortest sequence the published attention-kernel
# tables measured (FlashAttention-2's benchmark starts at 512: docs/efficiency.md). A ring computes blocks of
# one chunk; below that length the kernel's rate would be extrapolated, not cited. `simulate --cp` takes any cp.
MIN_CP_CHUNK = 512
INTERLEAVED_CHUNKS = 2
GIB = 2**30
REFUSALS = {
    "interleaved_micro_batches": "interleaved: micro-batches per replica not a multiple of pp",
    "interleaved_layers": f"interleaved: fewer layers than pp x {INTERLEAVED_CHUNKS} chunks",
    "schedule_slots": f"over simulator/limits.py's {MAX_SCHEDULE_SLOTS:,} schedule slots",
    "zero3_gathers": f"over simulator/limits.py's {MAX_ZERO3_GATHERS:,} ZeRO-3 gathers",
    "fp8_gather_zero0": "fp8 weights all-gathered (--fp8-param-gather): ZeRO 0 gathers none",
}


@dataclass(frozen=True)
class Candidate:
    """One way to run the job: a layout, its micro-batching, schedule and recompute."""

    tp: int
    pp: int
    dp: int
    zero: int
    sequence_parallel: bool
    micro_batch: int
    micro_batches: int  # per replica
    schedule: str
    virtual_chunks: int
    recompute: str
    cp: int = 1  # context parallelism, ring
    ep: int = 1  # expert parallelism: ep of the dp ranks split a mixture of experts' experts
    reshard_after_forward: bool = True  # ZeRO-3 only may keep its units (fsdp_options)
    shard_group: int = 0  # hybrid sharding (ZeRO 1-3): shards over groups of this many data ranks (0: over all)
    sync_grads_once: bool = False  # ZeRO-3 kept all step without pipelining, its gradients reduced once

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.pp, self.dp, self.zero, self.sequence_parallel, self.virtual_chunks, self.cp,
                      ep=self.ep, reshard_after_forward=self.reshard_after_forward, shard_group=self.shard_group,
                      sync_grads_once=self.sync_grads_once)

    def zero_label(self) -> str:
        """The ZeRO stage with its FSDP settings, short: "3", "3 kept", "3 kept all step", "1 / 8" (shards over
        groups of 8 data ranks)."""
        held = holds_all_step(self.reshard_after_forward, self.sync_grads_once, self.pp, self.micro_batches)
        kept = "" if self.reshard_after_forward else " kept all step" if held else " kept"
        return f"{self.zero}{kept}{f' / {self.shard_group}' if self.shard_group else ''}"

    def mesh(self) -> str:
        experts = f" (ep {self.ep})" if self.ep > 1 else ""
        return f"tp {self.tp} x cp {self.cp} x pp {self.pp} x dp {self.dp}{experts}"

    def describe(self) -> str:
        chunks = f" x{self.virtual_chunks}" if self.virtual_chunks > 1 else ""
        return (f"{self.mesh()}{', SP' if self.sequence_parallel else ''}, "
                f"{self.layout.zero_description()}, "
                f"{self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''} of "
                f"{self.micro_batch}, "
                f"{self.schedule}{chunks}, recompute {self.recompute}")

    def as_dict(self) -> dict:
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp, "zero": self.zero,
                "sequence_parallel": self.sequence_parallel, "micro_batch": self.micro_batch,
                "micro_batches": self.micro_batches, "schedule": self.schedule,
                "virtual_chunks": self.virtual_chunks, "recompute": self.recompute, "ep": self.ep,
                "reshard_after_forward": self.reshard_after_forward, "shard_group": self.shard_group,
                "sync_grads_once": self.sync_grads_once}


def tensor_parallel_options(model: GPTConfig, n_gpus: int, gpus_per_node: int) -> list[tuple[int, bool]]:
    """(tp, sequence parallel) pairs: tp inside one server, allowed by the model's shape."""
    per_server = min(n_gpus, gpus_per_node)
    return [(tp, sp) for tp in range(1, per_server + 1) if per_server % tp == 0 and n_gpus % tp == 0
            for sp in ((False, True) if tp > 1 else (False,)) if shape_allows(model, tp, sp)]


def context_parallel_options(model: GPTConfig, n_gpus: int, tp: int, sequence_parallel: bool,
                             fixed: int | None = None) -> list[int]:
    """cp sizes with this tp: `fixed` alone when given, else 1 and the powers of two whose chunks hold at least
    MIN_CP_CHUNK tokens; each dividing GPUs / tp and allowed by the shape."""
    sizes = [fixed] if fixed is not None else [1]
    while fixed is None and model.seq_len // (4 * sizes[-1]) >= MIN_CP_CHUNK:
        sizes.append(2 * sizes[-1])
    return [cp for cp in sizes if (n_gpus // tp) % cp == 0 and shape_allows(model, tp, sequence_parallel, cp)]


def expert_parallel_options(model: GPTConfig, routing: int, fixed: int | None = None) -> list[int]:
    """ep sizes with `routing` ranks routing distinct tokens (dp x cp, times tp under sequence parallelism:
    job/exchange/experts.py's expert_places): `fixed` alone when given (and dividing them), else every divisor of
    them that divides the experts; 1 for a dense model."""
    if not model.is_moe:
        return [1]
    sizes = [fixed] if fixed is not None else range(1, routing + 1)
    return [ep for ep in sizes if routing % ep == 0 and model.n_experts % ep == 0]


def micro_batch_sizes(per_replica: int, size: int | None, count: int | None) -> list[int]:
    """The micro-batch sizes searched for a replica's batch (one when the flags fix it)."""
    if size is not None and count is not None:
        return [size] if size * count == per_replica else []
    if size is not None:
        return [size] if per_replica % size == 0 else []
    if count is not None:
        return [per_replica // count] if per_replica % count == 0 else []
    return [s for s in MICRO_BATCH_SIZES if per_replica % s == 0]


def _schedules(model: GPTConfig, pp: int, m: int, refused: Counter, variants: int) -> list[tuple[str, int]]:
    """(kind, virtual chunks) searched; a refused interleaved schedule counts once per variant (recompute mode and
    FSDP settings: `variants`)."""
    if pp == 1:
        return [("1f1b", 1)]
    if m % pp:
        refused["interleaved_micro_batches"] += variants
        return [("1f1b", 1)]
    if pp * INTERLEAVED_CHUNKS > model.n_layers:
        refused["interleaved_layers"] += variants
        return [("1f1b", 1)]
    return [("1f1b", 1), ("interleaved", INTERLEAVED_CHUNKS)]


def enumerate_candidates(model: GPTConfig, n_gpus: int, gpus_per_node: int, global_batch: int,
                         micro_batch: int | None = None, micro_batches: int | None = None, cp: int | None = None,
                         ep: int | None = None, op_recompute: bool = False) -> tuple[list[Candidate], Counter]:
    """Every candidate of the module docstring, and the refusals counted by REFUSALS key; `cp` fixes context
    parallelism, `ep` expert parallelism (None: searched); `op_recompute`: recompute "op" searched too, where tp and cp
    are 1 (recompute_modes)."""
    out, refused = [], Counter()
    for tp, sp in tensor_parallel_options(model, n_gpus, gpus_per_node):
        for cp_size in context_parallel_options(model, n_gpus, tp, sp, cp):
            per_cp = n_gpus // (tp * cp_size)
            for pp in (p for p in range(1, min(per_cp, model.n_layers) + 1) if per_cp % p == 0):
                dp = per_cp // pp
                if global_batch % dp:
                    continue
                for size in micro_batch_sizes(global_batch // dp, micro_batch, micro_batches):
                    for ep_size in expert_parallel_options(model, routing_ranks(dp, cp_size, tp, sp), ep):
                        modes = recompute_modes(op_recompute and tp == 1 and cp_size == 1)
                        out += _pipelines(model, tp, sp, cp_size, pp, dp, size, global_batch // (dp * size), refused,
                                          ep_size, modes, gpus_per_node)
    return out, refused


def recompute_modes(op: bool) -> tuple[str, ...]:
    """The recompute modes searched: none, selective, full, and torchtitan's op policy where `op`."""
    return RECOMPUTE_MODES + ((OP_RECOMPUTE,) if op else ())


def op_recompute_searched(model: GPTConfig, precision: str, overlap: str) -> bool:
    """Whether plan searches recompute "op": under the stack whose policy it is (torchtitan-fsdp2), for a shape and
    precision it is described for (minigpt/config.py's op_recompute_refusal; 16-bit Linears); tp and cp are the
    candidate's (enumerate_candidates)."""
    return (overlap_preset(overlap).preset == "torchtitan-fsdp2" and model.op_recompute_refusal() is None
            and not precision_policy(precision).fp8_linears)


def fsdp_options(zero: int, data_ranks: int, pp: int, m: int, server_data_ranks: int) -> list[tuple[bool, bool, int]]:
    """(reshard_after_forward, sync_grads_once, shard_group) searched for a ZeRO stage: ZeRO-3 resharding after the
    forward or keeping its units (all step under pipelining), or kept all step with its gradients reduced once where
    pp is 1 and there are several micro-batches; ZeRO 1-3 each sharded over every data rank (0) and, where a server
    holds fewer of them (`server_data_ranks`) and divides them, over each server's (hybrid sharding: the gathers and
    reduce-scatters inside a server, the replicas' all-reduce between servers; `simulate --shard-group` takes any
    size, plan keeps to this one so that its search stays within seconds; a mixture of experts' routed experts keep
    their states sharded over the ranks holding the same experts, whatever the group). ZeRO-0: (True, False, 0)."""
    holds = [(True, False)]  # (reshard_after_forward, sync_grads_once)
    if zero == 3:
        holds.append((False, False))
        if pp == 1 and m > 1:  # under pipelining, kept units are held all step already
            holds.append((False, True))
    hybrid = zero > 0 and 2 <= server_data_ranks < data_ranks and data_ranks % server_data_ranks == 0
    groups = [0, server_data_ranks] if hybrid else [0]
    return [(reshard, once, group) for reshard, once in holds for group in groups]


def _pipelines(model: GPTConfig, tp: int, sp: bool, cp: int, pp: int, dp: int, size: int, m: int,
               refused: Counter, ep: int = 1, modes: tuple[str, ...] = RECOMPUTE_MODES,
               gpus_per_node: int = 8) -> list[Candidate]:
    """The candidates of one mesh and micro-batching: every ZeRO stage (with its FSDP settings: fsdp_options),
    schedule and recompute mode of `modes`. A server of `gpus_per_node` holds gpus_per_node / tp data ranks of a
    stage (the mesh puts pp outermost, tp innermost: job/layout.py)."""
    out = []
    for zero in (0, 1, 2, 3) if dp * cp > 1 else (0,):
        variants = [(recompute, *fsdp) for fsdp in fsdp_options(zero, dp * cp, pp, m, gpus_per_node // tp)
                    for recompute in modes]
        for schedule, v in _schedules(model, pp, m, refused, len(variants)):
            if schedule_slots(pp, v, m) > MAX_SCHEDULE_SLOTS:
                refused["schedule_slots"] += len(variants)
                continue
            if zero3_gathers(zero, dp * cp, m, model.n_layers) > MAX_ZERO3_GATHERS:
                refused["zero3_gathers"] += len(variants)
                continue
            out += [Candidate(tp, pp, dp, zero, sp, size, m, schedule, v, recompute, cp, ep, reshard, group, once)
                    for recompute, reshard, once, group in variants]
    return out


def candidate_memory(model: GPTConfig, candidate: Candidate, precision: str, gpu: GPUSpec,
                     expert_load: float = 1.0, overlap: str = "executor", changes: tuple = ()) -> MemoryEstimate:
    """predict_memory exactly as simulate_step calls it for this candidate (its schedule's in-flight micro-batches)
    under the `overlap` preset's stack with `changes` (candidate_stack)."""
    c = candidate
    shape = schedule_shape(c.pp, c.micro_batches, c.schedule, c.virtual_chunks)
    return predict_memory(model, c.layout, precision, c.micro_batch, c.recompute, gpu, BUCKET_MB, list(shape.in_flight),
                          micro_batches=c.micro_batches,
                          implementation=candidate_stack(overlap, c.recompute, expert_load, changes=changes),
                          ends_in_flight=shape.ends)


def simulate_candidate(model: GPTConfig, candidate: Candidate, cluster, spec: ClusterSpec, precision: str,
                       global_batch: int, expert_load: float = 1.0, dispatcher: str = "alltoall",
                       overlap: str = "executor", changes: tuple = ()) -> SimResult:
    c = candidate
    return simulate_step(model, c.layout, cluster, precision, global_batch, c.micro_batch, c.schedule,
                         c.virtual_chunks, c.recompute, gpu=spec.hardware, overlap=overlap, expert_load=expert_load,
                         ep_dispatcher=dispatcher,
                         implementation=candidate_stack(overlap, c.recompute, expert_load, dispatcher, changes))


@dataclass
class Plan:
    """The answer: the best layouts, and why every other candidate lost."""

    model: GPTConfig
    n_gpus: int
    gpu: str
    capacity: int
    global_batch: int
    precision: str
    top: int
    best: list[tuple[Candidate, SimResult, float]] = field(default_factory=list)  # (candidate, result, bound)
    candidates: int = 0  # in all, refusals included
    refused: dict[str, int] = field(default_factory=dict)
    too_big: list[tuple[Candidate, int]] = field(default_factory=list)  # (candidate, bytes per GPU it needs)
    simulated: list[tuple[Candidate, float, float]] = field(default_factory=list)  # (candidate, step s, bound s)
    pruned: int = 0  # fit, not simulated: their bound exceeds the slowest of the top best steps
    seconds: dict[str, float] = field(default_factory=dict)
    smallest_cp: int = 1  # the smallest context-parallel size among the layouts that fit
    expert_load: float = 1.0  # a MoE's routing imbalance priced (simulator/engine/experts.py's check_expert_load)
    expert_load_from: str = "balanced (the default)"  # where that number comes from (the command line says)
    fixed_ep: int | None = None  # expert parallelism as asked for (None: searched)
    dispatcher: str = "alltoall"  # how a MoE's rows travel (Implementation.dispatcher)
    overlap: str = "executor"  # the overlap preset, and its stack's implementation (simulator/engine/overlap.py)
    stack_changes: tuple[tuple[str, object], ...] = ()  # Implementation fields the stack's flags change

    @property
    def context_note(self) -> str | None:
        """One line when only context parallelism makes the job fit."""
        if self.smallest_cp == 1:
            return None
        return (f"a {self.model.seq_len}-token sequence does not fit without context parallelism: "
                f"cp >= {self.smallest_cp} needed")

    @property
    def expert_note(self) -> str:
        """What was searched of expert parallelism (a mixture of experts)."""
        if self.fixed_ep is not None:
            return f"ep fixed at {self.fixed_ep}"
        return (f"ep searched: every divisor of the ranks routing distinct tokens (dp x cp, x tp under sequence "
                f"parallelism) that divides the {self.model.n_experts} experts")

    @property
    def fitting(self) -> int:
        return len(self.simulated) + self.pruned

    @property
    def smallest_too_big(self) -> tuple[Candidate, int] | None:
        return min(self.too_big, key=lambda x: x[1]) if self.too_big else None

    def as_dict(self) -> dict:
        smallest = self.smallest_too_big
        return {
            "n_gpus": self.n_gpus, "gpu": self.gpu, "memory_capacity_bytes": self.capacity,
            "global_batch": self.global_batch, "precision": self.precision, "overlap": self.overlap,
            "stack_changes": dict(self.stack_changes),
            "model": self.model.describe(),
            "smallest_cp_that_fits": self.smallest_cp, "context_parallelism_note": self.context_note,
            **({"expert_load": self.expert_load, "expert_load_from": self.expert_load_from, "ep_dispatcher": self.dispatcher,
                "expert_parallelism": self.expert_note} if self.model.is_moe else {}),
            "best": [{**c.as_dict(), "step_time_s": r.step_time_s, "mfu": r.mfu, "tflops_per_gpu": r.tflops_per_gpu,
                      "samples_per_s": r.samples_per_s, "memory_per_gpu_bytes": r.memory.total,
                      "memory_margin_bytes": r.memory_margin_bytes, "lower_bound_s": bound, "breakdown": r.breakdown}
                     for c, r, bound in self.best],
            "search": {
                "candidates": self.candidates, "refused": {REFUSALS[k]: n for k, n in self.refused.items()},
                "did_not_fit": len(self.too_big),
                "smallest_need_among_those_bytes": smallest[1] if smallest else None,
                "smallest_need_among_those": smallest[0].as_dict() if smallest else None,
                "fit": self.fitting, "simulated": len(self.simulated), "pruned_by_bound": self.pruned,
                "slower": self.fitting - len(self.best), "seconds": self.seconds,
                "method": "memory: predict_memory as simulate_step calls it, for every candidate; step: "
                          "simulate_step for the candidates that fit, in increasing order of a lower bound "
                          "(simulator/search/bound.py), stopping once the bound exceeds the slowest of the top best steps",
            },
        }


def _fits_nowhere(plan: Plan) -> ConfigError:
    candidate, need = plan.smallest_too_big
    return ConfigError(
        f"no layout of {plan.n_gpus} x {plan.gpu} fits this model in memory: the smallest need is "
        f"{need / GIB:.1f} GiB per GPU ({candidate.describe()}), the GPU holds {plan.capacity / GIB:.1f} GiB; "
        f"give more GPUs, a GPU with more memory, a smaller model or a smaller global batch"
    )


def _check(model: GPTConfig, n_gpus: int, global_batch: int, top: int) -> None:
    check_positive_int("--gpus", n_gpus)
    check_gpus(n_gpus, "the plan (--gpus)")
    check_positive_int("--global-batch", global_batch)
    check_positive_int("--top", top)
    check_layers(model.n_layers)


def plan(model: GPTConfig, n_gpus: int, spec: ClusterSpec, global_batch: int, precision: str = "bf16",
         top: int = 5, micro_batch: int | None = None, micro_batches: int | None = None,
         progress: Callable[[str, int, int], None] | None = None, cp: int | None = None, ep: int | None = None,
         expert_load: float = 1.0, dispatcher: str = "alltoall", overlap: str = "executor",
         stack_changes: tuple[tuple[str, object], ...] = ()) -> Plan:
    """The `top` fastest candidates that fit (see the module docstring); `progress(stage, done, total)`;
    `cp` fixes context parallelism, `ep` expert parallelism (None: searched); `expert_load`: a MoE's routing
    imbalance (simulator/engine/experts.py); `overlap`: a preset of simulator/engine/overlap.py, with its stack,
    whose Implementation fields `stack_changes` changes (the stack's flags: fp8 recipe, fp8 weights, element-wise
    kernels, reduction format, attention kernel; with fp8 weights gathered, only ZeRO candidates)."""
    _check(model, n_gpus, global_batch, top)
    if cp is not None:
        check_context_parallel(model, cp)  # one line for a cp the sequence cannot take at all
    check_expert_parallel(model, ep or 1, ep or 1)  # one line for an ep the model cannot take
    expert_load = check_expert_load(model, expert_load)
    check_dispatcher(model, ep, dispatcher)
    pol = precision_policy(precision)  # tensor cores for its formats (its Linears' fp8 too), before any search
    for fmt in (pol.compute, *(("fp8",) if pol.fp8_linears else ())):
        spec.hardware.gpu.flops(fmt)
    if spec.hardware.gpu.measured is not None:
        raise ConfigError("plan searches GPU clusters: a calibrated CPU host profile's compute depends on how many "
                          "ranks share its cores; simulate its layouts one by one with `minigpt simulate`")
    cluster = spec.build(n_gpus)  # whole servers, or one error line
    clock = time.perf_counter()
    op = op_recompute_searched(model, precision, overlap)
    candidates, refused = enumerate_candidates(model, n_gpus, spec.gpus_per_node, global_batch, micro_batch,
                                               micro_batches, cp, ep, op)
    if dict(stack_changes).get("fp8_param_gather"):
        refused["fp8_gather_zero0"] = sum(c.zero == 0 for c in candidates)
        candidates = [c for c in candidates if c.zero > 0]
    gpu = spec.hardware.gpu
    result = Plan(model, n_gpus, spec.hardware.name, gpu.hbm_bytes, global_batch, precision, top,
                  candidates=len(candidates) + sum(refused.values()), refused=dict(refused), expert_load=expert_load,
                  fixed_ep=ep, dispatcher=dispatcher, overlap=overlap, stack_changes=tuple(stack_changes))
    if not candidates:
        raise ConfigError(f"no layout of {n_gpus} GPUs runs a global batch of {global_batch}"
                          f"{' with the micro-batching asked for' if micro_batch or micro_batches else ''}"
                          f"{f' with ranks routing distinct tokens a multiple of --ep {ep}' if ep else ''} "
                          f"within simulator/limits.py: give a global batch that is a multiple of the GPU count")
    fitting = []
    for index, candidate in enumerate(candidates):
        memory = candidate_memory(model, candidate, precision, gpu, expert_load, overlap, result.stack_changes)
        if memory.fits:
            fitting.append((candidate, memory))
        else:
            result.too_big.append((candidate, memory.total))
        if progress is not None and index % 64 == 63:
            progress("memory", index + 1, len(candidates))
    result.seconds["memory_s"] = time.perf_counter() - clock
    if not fitting:
        raise _fits_nowhere(result)
    if cp is None:  # what only a search of cp can say
        result.smallest_cp = min(c.cp for c, _ in fitting)
    _branch_and_bound(result, fitting, cluster, spec, progress)
    return result


def _branch_and_bound(result: Plan, fitting: list, cluster, spec: ClusterSpec, progress) -> None:
    """simulate_step in increasing bound order until the next bound exceeds the slowest step kept.

    Every candidate first gets the bound's compute term (cheap); the data-parallel term (it
    builds the schedule) only when the candidate reaches the front, which then goes back in line."""
    clock = time.perf_counter()
    model, precision = result.model, result.precision
    bound = StepBound(model, cluster, spec.hardware, precision, result.expert_load, result.dispatcher, result.overlap,
                      result.stack_changes)
    line = [(bound.compute_seconds(c.layout, c.micro_batches, c.schedule, c.micro_batch, c.recompute, memory), 0, i)
            for i, (c, memory) in enumerate(fitting)]
    heapq.heapify(line)
    result.seconds["bound_s"] = time.perf_counter() - clock
    clock = time.perf_counter()
    kept: list[tuple[float, int, Candidate, SimResult, float]] = []  # the top fastest: a max-heap on (-step, -turn)
    while line and not (len(kept) == result.top and line[0][0] > -kept[0][0]):
        low, refined, index = heapq.heappop(line)
        candidate, memory = fitting[index]
        c = candidate
        if not refined:  # 1 sorts after 0: a refined bound equal to an unrefined one waits behind it
            dp = bound.communication_seconds(c.layout, c.micro_batches, c.schedule, c.micro_batch, c.recompute, memory)
            heapq.heappush(line, (max(low, dp), 1, index))
            continue
        simulated = simulate_candidate(model, candidate, cluster, spec, precision, result.global_batch,
                                       result.expert_load, result.dispatcher, result.overlap, result.stack_changes)
        if not simulated.fits:  # predict_memory disagrees with itself: a bug, not an answer
            raise RuntimeError(f"{candidate.describe()}: the memory check said it fits, simulate_step says not")
        result.simulated.append((candidate, simulated.step_time_s, low))
        item = (-simulated.step_time_s, -len(result.simulated), candidate, simulated, low)
        if len(kept) < result.top:
            heapq.heappush(kept, item)
        elif item[:2] > kept[0][:2]:
            heapq.heapreplace(kept, item)
        if progress is not None:
            progress("simulate", len(result.simulated), len(fitting))
    result.pruned = len(fitting) - len(result.simulated)
    best = sorted(kept, key=lambda x: (-x[0], -x[1]))  # fastest first; on a tie, the one simulated first
    result.best = [(candidate, simulated, low) for _, _, candidate, simulated, low in best]
    result.seconds["simulate_s"] = time.perf_counter() - clock
