"""Predict one training step of a layout on a cluster: SimPy replays the schedule the executor runs. Torch-free.

`simulate_step(model, layout, cluster, precision, global_batch, micro_batch, ...)` builds
`build_schedule(ScheduleConfig(pp, m, kind, v, zero))` -- the very lists
parallel/pipeline/executor.py executes -- and replays ONE data-parallel replica, one process per
pipeline stage (tp ranks, cp ranks and replicas are identical, so one of each stands for all: the
load-balanced split gives every cp rank the same work and the same exchange).

How (details in the modules it uses):
  1. simulator/engine/links.py times each distinct transfer once with the fluid link model
     of simulator/network/collectives.py on the cluster's own routes (p2p between two stages,
     one tp collective, one dp collective per bucket size), so the replay does not move
     every byte of every micro-batch through the fluid model;
  2. simulator/engine/costs.py turns chunk_times (simulator/costs/ops.py's op list, priced by
     simulator/costs/compute.py, each rank's s/cp tokens under context parallelism), the cp exchange
     (simulator/engine/context.py), those transfers and the overlap settings (simulator/engine/overlap.py;
     by default our executor's rules) into seconds per action, split into compute / tp / cp / exposed dp;
  3. simulator/engine/replay.py replays the lists as SimPy processes (rendezvous p2p or,
     overlapped, asynchronous sends; dp reductions waited for before the optimizer) and
     attributes every second.
The step time is the slowest rank's end; the breakdown is that (critical) rank's. Every
result carries its provenance (simulator/provenance.py): what its numbers rest on.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property, lru_cache
from pathlib import Path

from minigpt.config import GPTConfig
from minigpt.errors import ConfigError, check_positive_int
from job.data_parallel import schedule_config
from job.schedule import Schedule, ScheduleConfig, build_schedule, peak_ends_in_flight, peak_in_flight
from job.trace import chrome_trace_events, write_chrome_trace
from job.train_config import TrainConfig
from precision.policy import FORMAT_BYTES, policy as precision_policy
from simulator.costs.compute import EfficiencyProfile, mfu as model_flops_utilisation, step_flops
from simulator.engine.costs import rank_costs
from simulator.engine.experts import check_expert_load
from simulator.engine.host import HostLinks, host_compute, host_threads
from simulator.engine.links import LinkCosts
from simulator.engine.replay import CATEGORIES, RankTally, no_garbage_collection, replay
from simulator.costs.hardware import GPUSpec, Hardware, load_hardware
from simulator.costs.rates.attention_rates import kernel_table, te_kernel
from simulator.limits import check_job
from job.layout import Layout, embedding_copy, padded_vocab
from simulator.memory import MemoryEstimate, predict_memory
from simulator.costs.op_types import Implementation, check_cp_attention
from simulator.costs.userbuffers import Userbuffers
from simulator.engine.overlap import Overlap, resolve_overlap, stack_default, with_userbuffers
from simulator.provenance import provenance
from simulator.network.topology import Cluster

BREAKDOWN_NAMES = {"compute": "compute", "bubble": "pipeline_bubble", "tp": "tp_comm", "cp": "cp_comm", "ep": "ep_comm",
                   "amax": "amax_comm", "pp": "pp_comm", "dp": "dp_comm", "optimizer": "optimizer"}
DECIMAL_GB = 1e9  # job totals are reported in decimal GB (1 GB = 1e9 bytes)


@dataclass
class SimResult:
    """One simulated training step. Seconds, bytes, FLOP/s; `breakdown` adds up to `step_time_s`.

    tflops_per_gpu and mfu count the model's FLOPs (config.py, no recomputation; a mixture of experts' active
    ones: top_k routed and the shared experts per token) over the step time and GPUs; mfu divides by the dense
    peak of the precision's compute format.
    `job_state_bytes`: the whole model's training state (as if tp = pp = dp = 1);
    `gpus_for_state`: how many of these GPUs that state needs at the least."""

    n_gpus: int
    gpu: str
    layout: Layout
    precision: str
    schedule: str
    micro_batch: int
    micro_batches: int
    global_batch: int
    recompute: str
    step_time_s: float
    breakdown: dict[str, float]
    critical_rank: int
    per_rank: list[dict[str, float]]
    tflops_per_gpu: float
    mfu: float
    memory: MemoryEstimate
    job_state_bytes: dict[str, int]
    gpus_for_state: int
    seq_len: int
    tallies: list[RankTally] = field(repr=False, default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    host: dict | None = None  # on a measured CPU host: threads per rank, ranks busy on average, compute slowdown
    attention: str = "flash"
    overlap: Overlap = field(default_factory=Overlap)
    provenance: dict = field(default_factory=dict)  # what the numbers rest on (simulator/provenance.py)
    collectives: list[dict] = field(default_factory=list)  # each distinct collective call: NCCL's algorithm (links.py)
    parameters: dict = field(default_factory=dict)  # the model's total and active (per token: a MoE's top_k) counts
    # communication seconds of the critical rank that ran hidden beside compute, in no row of `breakdown`:
    # "ep_comm", expert parallelism's all-to-alls behind the shared experts (Overlap.ep)
    hidden: dict[str, float] = field(default_factory=dict)

    @property
    def moe(self) -> bool:
        """A mixture of experts: its MFU counts the FLOPs of the active parameters (config.train_flops_per_token)."""
        return self.parameters.get("active", 0) != self.parameters.get("total", 0)

    @cached_property
    def timelines(self) -> list[dict]:
        """Per stage rank, the step as job/trace.py's Trace.as_dict() holds the executor's."""
        return [{"rank": rank, "steps": [{"step": 0, "start": 0.0, "end": self.step_time_s, "events": t.named_events()}]}
                for rank, t in enumerate(self.tallies)]

    @property
    def fits(self) -> bool:
        return bool(self.memory.fits)

    @property
    def memory_margin_bytes(self) -> int:
        """HBM left over on the most loaded GPU (negative: short by that much)."""
        return (self.memory.capacity or 0) - self.memory.total

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step_time_s

    @property
    def tokens_per_s(self) -> float:
        return self.samples_per_s * self.seq_len

    def memory_per_gpu(self) -> dict[str, int]:
        m = self.memory
        return {"parameters": m.parameters, "gradients": m.gradients, "master_weights": m.master_weights,
                "optimizer_states": m.adam_m + m.adam_v, "activations": m.activations,
                "comm_buffers": m.comm_buffers, "total": m.total}

    def as_dict(self) -> dict:
        """Everything but the timelines, JSON-ready."""
        return {
            "n_gpus": self.n_gpus, "gpu": self.gpu, "layout": asdict(self.layout), "precision": self.precision,
            "schedule": self.schedule, "micro_batch": self.micro_batch, "micro_batches": self.micro_batches,
            "global_batch": self.global_batch, "recompute": self.recompute,
            "step_time_s": self.step_time_s, "breakdown": self.breakdown, "critical_rank": self.critical_rank,
            "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu, "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s, "seq_len": self.seq_len, "memory_per_gpu": self.memory_per_gpu(),
            "memory_capacity_bytes": self.memory.capacity, "memory_stage": self.memory.stage, "fits": self.fits,
            "memory_margin_bytes": self.memory_margin_bytes, "memory_notes": list(self.memory.notes),
            "job_state_bytes": self.job_state_bytes,
            "job_state_gb": {k: v / DECIMAL_GB for k, v in self.job_state_bytes.items()},
            "gpus_for_state": self.gpus_for_state, "per_rank": self.per_rank, "timings_s": self.timings,
            "host": self.host, "attention": self.attention, "overlap": self.overlap.as_dict(),
            "provenance": self.provenance, "collectives": self.collectives, "parameters": self.parameters,
            "mfu_counts": "active parameters" if self.moe else "all parameters", "hidden": self.hidden,
        }

    def trace_events(self) -> list[dict]:
        """The Chrome trace events job/trace.py writes for the executor: one track per stage, schedule names."""
        return chrome_trace_events(self.timelines)

    def write_chrome_trace(self, path: str | Path) -> Path:
        return write_chrome_trace(Path(path), self.timelines)


@lru_cache(maxsize=4)
def cached_schedule(config: ScheduleConfig) -> Schedule:
    """build_schedule, remembered: sweeps ask for the same schedules again and again."""
    return build_schedule(config)


def step_schedule(model: GPTConfig, layout: Layout, micro_batches: int, kind: str, bucket_mb: float,
                  precision: str) -> Schedule:
    """The schedule this simulator replays for a job: the one the executor runs (job/data_parallel.py's
    `schedule_config`, with the run's real buckets and units over the dp x cp data-parallel group, or its
    shard groups under hybrid sharding, and ZeRO-3's gathers as `layout.reshard_after_forward` places them)."""
    return cached_schedule(schedule_config(model, layout, micro_batches, kind, bucket_mb, precision))


def ddp_bucket_mb(implementation: Implementation, layout: Layout, pol) -> float:
    """The MiB of gradients a data-parallel reduction takes at once: DDP's bucket_cap_mb (our executor's), or the
    stack's bucket of parameters (Implementation.bucket_params) in the compute format's bytes, as bucket_numel counts
    them (job/train_config.py)."""
    params = implementation.bucket_params(layout.dp * layout.cp)
    return TrainConfig.bucket_mb if params is None else params * FORMAT_BYTES[pol.compute] / 2**20


def bucket_sizes(implementation: Implementation, layout: Layout, pol, given: float | None) -> tuple[float, float]:
    """(MiB of the reductions' buckets, MiB the memory model sizes our ZeRO's bucket buffers by): `given` for both,
    or the stack's buckets (ddp_bucket_mb) and DDP's 25 MiB, since Megatron-core reduces in place in its buffers."""
    if given is not None:
        return given, given
    return ddp_bucket_mb(implementation, layout, pol), TrainConfig.bucket_mb


def micro_batches_per_replica(global_batch: int, micro_batch: int, dp: int) -> int:
    per_step = check_positive_int("micro_batch", micro_batch) * dp
    if check_positive_int("global_batch", global_batch) % per_step:
        lower, upper = global_batch // per_step * per_step, -(-global_batch // per_step) * per_step
        raise ConfigError(
            f"global batch {global_batch} is not a multiple of micro-batch {micro_batch} x dp {dp} = {per_step}: "
            f"use {upper}" + (f" or {lower}" if lower else "")
        )
    return global_batch // per_step


def resolve_gpu(cluster: Cluster, gpu: GPUSpec | Hardware | str | None) -> GPUSpec:
    if isinstance(gpu, GPUSpec):
        return gpu
    if isinstance(gpu, Hardware):
        return gpu.gpu
    name = gpu if gpu is not None else cluster.attributes.get("gpu")
    if not name:
        raise ConfigError(f"{cluster.origin}: the topology does not name its GPU: pass the GPU (--gpu or --hardware)")
    return load_hardware(name).gpu


WAITS = {"tp": ("all_reduce", "all_gather", "reduce_scatter"), "dp": ("all_reduce", "all_gather", "reduce_scatter"),
         "cp": ("p2p", "all_gather"), "ep": ("all_to_all",), "pp": ("p2p",)}  # a tally's waits: what they run


def collective_cpu_share(host, kinds: tuple[str, ...]) -> float | None:
    """The share of a core a rank computes while in one of these collectives: the median of those measured with no
    more busy ranks than cores (more, and a rank also waits for a core, which its share does not see); None when
    none was measured."""
    shares = [c.cpu_share for c in host.collectives
              if c.kind in kinds and c.cpu_share is not None and c.active <= host.cores]
    return statistics.median(shares) if shares else None


def idle_seconds(tally, shares: dict[str, float]) -> float:
    """Seconds a rank leaves its core to the others in one step: its bubbles, and of each exposed wait in
    collectives all but the share of a core the collective computes (`shares`; 1, busy, where not measured)."""
    return tally.seconds["bubble"] + sum(tally.seconds[name] * (1 - shares[name]) for name in WAITS)


def share_idle_cores(run, tallies, host, compute, links, ranks: int, threads: int, rounds: int = 5):
    """Ranks idle in pipeline bubbles or blocked in collectives leave their cores to the others (a mean-field take on
    sharing).

    The sharing slowdown and the collectives were measured with every rank busy; a pipeline's ranks wait in
    bubbles, and every rank in its blocking collectives, which compute only the share of a core calibrate measured
    (collective_cpu_share), so on average ranks x (1 - idle / step) of them are busy at once. The step
    is replayed with the slowdown and the collective times of that many busy ranks until it settles."""
    shares = {name: collective_cpu_share(host, kinds) for name, kinds in WAITS.items()}
    shares = {name: 1.0 if share is None else share for name, share in shares.items()}
    for _ in range(rounds):
        step = max(t.end for t in tallies)
        busy = max(1.0, ranks * sum(1 - idle_seconds(t, shares) / step for t in tallies) / len(tallies))
        if abs(busy - links.active) <= 0.01 * links.active:
            break
        links.active, compute = busy, replace(compute, slowdown=host.slowdown(busy, threads))
        tallies = run(compute)
    return tallies, compute


def _compute_side(spec: GPUSpec, model: GPTConfig, layout: Layout, cluster: Cluster, compute_format: str,
                  threads_per_rank: int | None):
    """(host compute, links, threads): a calibrated CPU host's measured compute and collectives, else none and the fabric."""
    host = spec.measured  # a calibrated CPU host: measured compute, sharing and collectives
    if host is None:
        return None, LinkCosts(cluster, layout, spec), None
    threads = host_threads(host, layout.world_size, threads_per_rank)
    return host_compute(host, model, layout, threads, compute_format), HostLinks(cluster, layout, host), threads


def _implementation(model: GPTConfig, settings: Overlap, implementation: Implementation | None, attention: str,
                    recompute: str, sp_saved_input: str | None, expert_load: float | None,
                    ep_dispatcher: str | None) -> Implementation:
    """How the blocks are computed: as given, or the three flags with the stack the overlap preset names (its own fp8
    casts, weight gradients: overlap.py); a MoE's load and dispatcher over either."""
    implementation = implementation or stack_default(settings, attention, recompute, sp_saved_input)
    if expert_load is not None:
        implementation = replace(implementation, expert_load=check_expert_load(model, expert_load))
    if ep_dispatcher is not None:
        implementation = replace(implementation, dispatcher=ep_dispatcher)
    return implementation


def _kernel_on(implementation: Implementation, spec: GPUSpec) -> Implementation:
    """The implementation with the attention kernel that runs on `spec`: Transformer Engine's choice ("te") made
    (attention_rates.te_kernel), so that the report names it; one line where an asked kernel has no table here."""
    kernel_table(spec, implementation.attention_kernel)
    if implementation.attention_kernel != "te":
        return implementation
    return replace(implementation, attention_kernel=te_kernel(spec) if implementation.attention == "flash"
                   else "flash-attn-2")  # an unfused attention runs no fused kernel


def simulate_step(model: GPTConfig, layout: Layout, cluster: Cluster, precision: str, global_batch: int,
                  micro_batch: int, schedule_kind: str = "1f1b", virtual_chunks: int = 1, recompute: str = "none",
                  profile: EfficiencyProfile | None = None, gpu: GPUSpec | Hardware | str | None = None,
                  bucket_mb: float | None = None, threads_per_rank: int | None = None,
                  attention: str = "flash", overlap: Overlap | str | None = None,
                  sp_saved_input: str | None = None, nccl_algo: str = "auto",
                  implementation: Implementation | None = None, expert_load: float | None = None,
                  ep_dispatcher: str | None = None, userbuffers: Userbuffers | None = None) -> SimResult:
    """One training step of `model` laid out as `layout` on `cluster` (see the module docstring).

    `attention`, `recompute`, `sp_saved_input` (None: the stack's): how a block is computed (costs/ops.py), or all
    of it as `implementation` (costs/implementation.py's Implementation: fp8 and weight-gradient settings too);
    `overlap`: an Overlap or a preset name (simulator/engine/overlap.py; default: our executor's);
    `nccl_algo`: "auto" (each collective as NCCL would pick it) or an algorithm forced (simulator/network/nccl.py);
    `expert_load`: a mixture of experts' routing imbalance (Implementation.expert_load; None: the implementation's,
    1.0 balanced), priced on the busiest rank of each expert group, which the step waits for; `ep_dispatcher`: how
    its rows travel (Implementation.dispatcher; None: the implementation's, "alltoall"); `userbuffers`: a
    megatron-core stack's tp overlap settings; `bucket_mb`: the gradient buckets (None: the stack's, bucket_sizes)."""
    clock = time.perf_counter()
    pol = precision_policy(precision)
    settings = resolve_overlap(overlap)
    implementation = _implementation(model, settings, implementation, attention, recompute, sp_saved_input,
                                     expert_load, ep_dispatcher)
    attention, recompute = implementation.attention, implementation.recompute
    v = check_positive_int("virtual_chunks", virtual_chunks)
    if layout.virtual_chunks not in (1, v):
        raise ConfigError(f"the layout has {layout.virtual_chunks} virtual chunks but virtual_chunks={v}: give one of them")
    layout = replace(layout, virtual_chunks=max(v, layout.virtual_chunks))
    layout.check(model)
    check_cp_attention(layout.cp, attention)
    check_job(model.n_layers, layout.pp, layout.dp, layout.virtual_chunks, global_batch, micro_batch,
              layout.world_size, layout.effective_zero, layout.cp)  # the stated limits, for callers of the API too
    spec = resolve_gpu(cluster, gpu)
    spec.flops(pol.compute)  # the GPU must have tensor cores for the compute format
    implementation = _kernel_on(implementation, spec)
    if profile is None:
        profile = spec.matmul_efficiency  # the GPU's efficiency tables (cited or measured), when it has them
    if userbuffers is not None:
        implementation, settings = with_userbuffers(implementation, settings, userbuffers, layout, profile,
                                                    "fp8" if pol.fp8_linears else pol.compute)
    compute, links, threads = _compute_side(spec, model, layout, cluster, pol.compute, threads_per_rank)
    links.select(nccl_algo)  # NCCL's choice per collective, or the algorithm forced (simulator/network/nccl.py)
    m = micro_batches_per_replica(global_batch, micro_batch, layout.dp)
    reduced_mb, buffers_mb = bucket_sizes(implementation, layout, pol, bucket_mb)
    with no_garbage_collection():
        schedule = step_schedule(model, layout, m, schedule_kind, reduced_mb, precision)
    config = schedule.config
    timings = {"schedule_s": time.perf_counter() - clock}

    clock = time.perf_counter()
    memory = predict_memory(model, layout, precision, micro_batch, recompute, spec, buffers_mb, peak_in_flight(schedule),
                            attention, implementation.sp_saved_input, settings.zero3_prefetch, m,
                            implementation=implementation, ends_in_flight=peak_ends_in_flight(schedule))
    activation = micro_batch * layout.activation_rows(model) * model.d_model * FORMAT_BYTES[pol.compute]
    tied = embedding_copy(model, layout.pp) is not None  # its gradient summed over the first and last stage
    sync_bytes = padded_vocab(model, layout.tp) // layout.tp * model.d_model * FORMAT_BYTES[pol.grad]
    timings["costs_s"] = time.perf_counter() - clock

    def run(compute):
        costs = rank_costs(model, layout, config, links, spec, precision, micro_batch, recompute, profile, memory,
                           reduced_mb, compute, implementation, settings)
        p2p = {}
        for chunk in range(config.num_chunks - 1):
            a, b = chunk % layout.pp, (chunk + 1) % layout.pp
            if a != b:
                p2p[(a, b)] = links.p2p(a, b, activation)
                p2p[(b, a)] = links.p2p(b, a, activation)
        return replay(schedule, costs, p2p, links.embedding_sync(sync_bytes) if tied else 0.0, settings.p2p,
                      settings)

    clock = time.perf_counter()
    tallies = run(compute)
    if (host := spec.measured) is not None and host.device == "cpu" and layout.world_size > 1:
        tallies, compute = share_idle_cores(run, tallies, host, compute, links, layout.world_size, threads)
    timings["replay_s"] = time.perf_counter() - clock
    return _result(model, layout, spec, precision, schedule_kind, micro_batch, m, global_batch, implementation,
                   settings, memory, tallies, timings, profile, compute, links, threads)


def _result(model, layout, spec, precision, schedule_kind, micro_batch, m, global_batch, implementation, settings,
            memory, tallies, timings, profile, compute, links, threads) -> SimResult:
    step = max(t.end for t in tallies)
    if not step > 0:
        raise ConfigError("the simulated step takes no time: give the cluster finite bandwidths or the model some work")
    critical = max(range(len(tallies)), key=lambda r: tallies[r].end)
    per_rank = [{BREAKDOWN_NAMES[k]: t.seconds[k] for k in CATEGORIES} for t in tallies]
    n, pol = layout.world_size, precision_policy(precision)
    job = predict_memory(model, Layout(), precision, micro_batch, implementation=Implementation(
        recompute=implementation.recompute, optimizer=implementation.optimizer))
    state = {"parameters": job.parameters, "gradients": job.gradients, "master_weights": job.master_weights,
             "optimizer_states": job.adam_m + job.adam_v, "total": job.model_states}
    return SimResult(
        n_gpus=n, gpu=spec.name, layout=layout, precision=precision, schedule=schedule_kind, micro_batch=micro_batch,
        micro_batches=m, global_batch=global_batch, recompute=implementation.recompute, step_time_s=step,
        breakdown=per_rank[critical], critical_rank=critical, per_rank=per_rank,
        tflops_per_gpu=step_flops(model, global_batch) / step / n / 1e12,
        mfu=model_flops_utilisation(model, global_batch, step, n, spec, pol.compute),
        memory=memory, job_state_bytes=state, gpus_for_state=math.ceil(job.model_states / spec.hbm_bytes),
        seq_len=model.seq_len, tallies=tallies, timings=timings,
        host=None if compute is None else {"threads_per_rank": threads, "busy_ranks": links.active,
                                           "compute_slowdown": compute.slowdown,
                                           "straggler_cv": compute.straggler_cv, "straggler_factor": compute.straggler,
                                           "units_measured": compute.units is not None,
                                           **({"units_missing": compute.missing} if compute.missing else {})},
        attention=implementation.attention, overlap=settings,
        provenance=provenance(spec, profile, pol, implementation, settings, compute, layout, model.seq_len,
                              model.is_moe),
        collectives=links.collective_calls(), parameters={**model.param_breakdown(), "active": model.active_params()},
        hidden={BREAKDOWN_NAMES[k]: v for k, v in tallies[critical].hidden.items()},
    )
