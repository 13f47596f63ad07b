"""Scaling sweeps: how a job's throughput grows with GPUs, and where adding them stops paying. Torch-free.

Strong scaling keeps the global batch; weak scaling grows it with the GPU count (the
batch per GPU of the first point is kept). At each GPU count the layout is the given one
(tp and pp fixed, dp = GPUs / (tp x pp)) or the fastest that fits in memory among every
tp (dividing the heads and MLP width, at most one server) and pp (every chunk at least a
block) that divide the GPU count and the batch (context parallelism stays at the job's cp: dp =
GPUs / (tp x cp x pp); a mixture of experts' expert parallelism at the job's ep, where it divides the layout's
ranks routing distinct tokens), and whose schedule stays within
simulator/limits.py's MAX_SCHEDULE_SLOTS and MAX_ZERO3_GATHERS (the sweep's GPU counts and points
are limited there too). FSDP's settings are the job's at every point (`reshard_after_forward`, None: the stack's
default for the point's pp, simulator/engine/overlap.py's stack_reshards; `sync_grads_once`; `shard_group`, where it
divides the point's data ranks: a layout whose data ranks it does not divide is left out, as one whose routing ranks
ep does not divide).

Marginal gain: going from N0 to N1 GPUs, each added GPU brings (T1 - T0) / (N1 - N0)
samples/s; linear scaling would have it bring what a GPU brought at N0, T0 / N0. Their
ratio is the marginal efficiency; adding GPUs stops paying at the first point where it
falls below `threshold` (default DEFAULT_THRESHOLD = 0.5: an added GPU is worth less than
half a GPU already there) and stays below at every later point. Only points whose layout
fits in memory count: the baseline of speedup and efficiency is the first that fits, and a
point that does not fit has neither (nor a marginal efficiency).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from minigpt.config import OP_RECOMPUTE, GPTConfig
from minigpt.errors import ConfigError
from simulator.costs.compute import EfficiencyProfile
from simulator.costs.implementation import Implementation
from simulator.engine.overlap import Overlap, reshards, resolve_overlap
from simulator.engine.simulate import SimResult, micro_batches_per_replica, simulate_step
from simulator.search.bound import candidate_stack
from simulator.costs.hardware import Hardware, load_hardware
from simulator.limits import (MAX_SCHEDULE_SLOTS, MAX_ZERO3_GATHERS, check_layers, check_sweep, schedule_slots,
                              zero3_gathers)
from job.layout import Layout
from job.train_config import check_sharding, check_split, routing_ranks, shape_allows
from simulator.memory import predict_memory
from simulator.network.topology import CLUSTER_KINDS, Cluster, build_cluster, whole_servers

DEFAULT_THRESHOLD = 0.5
_EP_NOTE = ", ep={ep}, which must divide the ranks routing distinct tokens: dp x cp, x tp under sequence parallelism"
_SHARD_NOTE = ", --shard-group {group}, which must divide the data ranks: dp x cp"
SCALINGS = ("strong", "weak")


@dataclass(frozen=True)
class ClusterSpec:
    """How to build a cluster of any size: the GPU (preset name or loaded profile), server size, NIC preset
    (`fabric`), fabric kind (fat-tree, rail, rail-only), NICs per server and leaf oversubscription
    (simulator/network/topology.py's build_cluster)."""

    hardware: Hardware
    gpus_per_node: int
    fabric: str | None = None
    kind: str = "fat-tree"
    nics_per_node: int | None = None
    oversubscription: float = 1.0

    @classmethod
    def of(cls, gpu: str | Hardware, gpus_per_node: int | None = None, fabric: str | None = None,
           kind: str = "fat-tree", nics_per_node: int | None = None, oversubscription: float = 1.0) -> "ClusterSpec":
        hardware = load_hardware(gpu) if isinstance(gpu, str) else gpu
        if kind not in CLUSTER_KINDS:
            raise ConfigError(f"unknown topology kind {kind!r}: choose one of {', '.join(CLUSTER_KINDS)}")
        per_node = hardware.node.gpus_per_node if gpus_per_node is None else gpus_per_node
        if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
            raise ConfigError(f"gpus per node must be a positive integer, got {per_node!r}")
        spec = cls(hardware, per_node, fabric, kind, nics_per_node, oversubscription)
        spec.build(per_node)  # checks the NICs and the oversubscription now, not at the first point
        return spec

    def build(self, n_gpus: int) -> Cluster:
        """n_gpus GPUs: whole servers, or one partly filled server below a server's worth."""
        per_node, nodes = whole_servers(n_gpus, self.gpus_per_node, f"{n_gpus} GPUs")
        nics = self.nics_per_node
        if nics is not None and per_node < self.gpus_per_node:  # a partly filled server keeps its GPUs per NIC
            nics = max(1, -(-per_node * nics // self.gpus_per_node))
        return build_cluster(self.hardware, per_node, nodes, self.fabric, self.kind, nics, self.oversubscription)


@dataclass(frozen=True)
class Job:
    """Everything about the training job except the GPU count and layout."""

    model: GPTConfig
    precision: str = "bf16"
    global_batch: int = 8
    micro_batch: int = 1
    zero: int = 1
    schedule: str = "1f1b"
    virtual_chunks: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    profile: EfficiencyProfile | None = None
    cp: int = 1  # kept at every point of a sweep
    cp_kind: str = "ring"
    ep: int = 1  # kept at every point of a sweep: a mixture of experts' experts split over ep data ranks
    overlap: Overlap | str | None = None  # the stack's overlap (simulator/engine/overlap.py; None: our executor's)
    implementation: Implementation | None = None  # how its blocks are computed (None: the overlap's stack_default)
    reshard_after_forward: bool | None = None  # ZeRO-3 (None: the stack's default for each layout's pp)
    shard_group: int = 0  # hybrid sharding: ZeRO over groups of this many data ranks (0: over all of them)
    sync_grads_once: bool = False  # ZeRO-3 kept all step without pipelining too, its gradients reduced once

    def __post_init__(self) -> None:
        """FSDP's settings checked once, whatever the layouts (job/train_config.py's check_sharding: the flags go
        with ZeRO-3, a shard group with ZeRO 1-3) and their data ranks (those checked per layout)."""
        check_sharding(self.zero, self.shard_group or 1, self.shard_group, self.reshard_after_forward is not False,
                       self.sync_grads_once)

    def reshards(self, pp: int) -> bool:
        """ZeRO-3's reshard after the forward at a layout of `pp` stages: as given, else the stack's default."""
        return reshards(self.reshard_after_forward, self.zero, self.overlap or "executor", pp)

    def simulate(self, layout: Layout, cluster: Cluster, hardware: Hardware | None = None,
                 global_batch: int | None = None) -> SimResult:
        return simulate_step(self.model, layout, cluster, self.precision, global_batch or self.global_batch,
                             self.micro_batch, self.schedule, self.virtual_chunks, self.recompute, self.profile,
                             gpu=hardware, overlap=self.overlap, implementation=self.stack)

    @property
    def stack(self) -> Implementation:
        """How the blocks are computed: as given, or the overlap's stack with this job's recompute."""
        return self.implementation or candidate_stack(resolve_overlap(self.overlap), self.recompute)


def candidate_layouts(job: Job, n_gpus: int, gpus_per_node: int, global_batch: int,
                      tp: int | None = None, pp: int | None = None) -> list[Layout]:
    """Every tp x cp x pp x dp layout of n_gpus this job can run (tp or pp fixed when given; cp and ep the job's, ep
    dividing the ranks that route distinct tokens; tp 1 under torchtitan's op recompute, which is described without
    tensor parallelism)."""
    model, out, cp = job.model, [], job.cp
    per_server = 1 if job.recompute == OP_RECOMPUTE else min(n_gpus, gpus_per_node)  # a tp group inside one server
    for t in [tp] if tp else [t for t in range(1, per_server + 1) if n_gpus % t == 0 and per_server % t == 0]:
        if n_gpus % (t * cp) or not shape_allows(model, t, job.sequence_parallel, cp, job.cp_kind):
            continue
        rest = n_gpus // (t * cp)
        for p in [pp] if pp else [p for p in range(1, rest + 1) if rest % p == 0]:
            if rest % p or p * job.virtual_chunks > model.n_layers:
                continue
            dp = rest // p
            if global_batch % (job.micro_batch * dp) or routing_ranks(dp, cp, t, job.sequence_parallel) % job.ep \
                    or (job.shard_group and (dp * cp) % job.shard_group):
                continue
            m = micro_batches_per_replica(global_batch, job.micro_batch, dp)
            if (job.schedule == "interleaved" and m % p) or schedule_slots(p, job.virtual_chunks, m) > MAX_SCHEDULE_SLOTS \
                    or zero3_gathers(job.zero, dp * cp, m, model.n_layers) > MAX_ZERO3_GATHERS:
                continue
            out.append(Layout(tp=t, pp=p, dp=dp, zero=job.zero, sequence_parallel=job.sequence_parallel,
                              virtual_chunks=job.virtual_chunks, cp=cp, cp_kind=job.cp_kind, ep=job.ep,
                              reshard_after_forward=job.reshards(p), shard_group=job.shard_group,
                              sync_grads_once=job.sync_grads_once))
    return out


def best_layout(job: Job, n_gpus: int, spec: ClusterSpec, global_batch: int, tp: int | None = None,
                pp: int | None = None, cluster: Cluster | None = None) -> SimResult:
    """The fastest layout that fits (or, when none fits, the one needing the least memory)."""
    layouts = candidate_layouts(job, n_gpus, spec.gpus_per_node, global_batch, tp, pp)
    if not layouts:
        if not shape_allows(job.model, tp or 1, job.sequence_parallel, job.cp, job.cp_kind):
            check_split(job.model, tp or 1, job.sequence_parallel, job.cp, job.cp_kind)  # the shape's own reason
        raise ConfigError(
            f"no layout of {n_gpus} GPUs runs a global batch of {global_batch} in micro-batches of {job.micro_batch} "
            f"(tp={tp or 'any'}, pp={pp or 'any'}{_EP_NOTE.format(ep=job.ep) if job.ep > 1 else ''}"
            f"{_SHARD_NOTE.format(group=job.shard_group) if job.shard_group else ''}) within "
            f"{MAX_SCHEDULE_SLOTS:,} schedule slots (pp x virtual "
            f"chunks x micro-batches) and {MAX_ZERO3_GATHERS:,} ZeRO-3 gathers (simulator/limits.py): change the "
            f"batch, the GPU counts or the layout"
        )
    cluster = cluster or spec.build(n_gpus)
    gpu = spec.hardware.gpu
    fitting, smallest = [], None
    for layout in layouts:
        states = predict_memory(job.model, layout, job.precision, job.micro_batch, job.recompute, gpu,
                                micro_batches=micro_batches_per_replica(global_batch, job.micro_batch, layout.dp),
                                implementation=job.stack)
        if states.model_states > gpu.hbm_bytes:  # cannot fit whatever the schedule: skip the replay
            smallest = min(smallest or (states.total, layout), (states.total, layout), key=lambda x: x[0])
            continue
        fitting.append(job.simulate(layout, cluster, spec.hardware, global_batch))
    fits = [r for r in fitting if r.fits]
    if fits:
        return min(fits, key=lambda r: r.step_time_s)
    if fitting:
        return min(fitting, key=lambda r: r.memory.total)
    return job.simulate(smallest[1], cluster, spec.hardware, global_batch)


@dataclass
class ScalingPoint:
    gpus: int
    global_batch: int
    result: SimResult
    samples_per_s: float
    speedup: float | None = None  # throughput over the baseline's (the first point that fits); None: no baseline yet
    efficiency: float | None = None  # speedup / (gpus / baseline gpus)
    marginal: float | None = None  # marginal efficiency from the previous point that fits (module docstring)

    def as_dict(self) -> dict:
        r = self.result
        return {"gpus": self.gpus, "global_batch": self.global_batch, "layout": {"tp": r.layout.tp, "cp": r.layout.cp,
                "pp": r.layout.pp, "dp": r.layout.dp, "ep": r.layout.ep, "zero": r.layout.zero,
                "reshard_after_forward": r.layout.reshard_after_forward, "shard_group": r.layout.shard_group,
                "sync_grads_once": r.layout.sync_grads_once}, "micro_batches": r.micro_batches,
                "step_time_s": r.step_time_s, "samples_per_s": self.samples_per_s, "tflops_per_gpu": r.tflops_per_gpu,
                "mfu": r.mfu, "speedup": self.speedup, "efficiency": self.efficiency, "marginal_efficiency": self.marginal,
                "fits": r.fits, "breakdown": r.breakdown}


@dataclass
class ScalingSweep:
    scaling: str
    threshold: float
    points: list[ScalingPoint] = field(default_factory=list)

    @property
    def stop(self) -> ScalingPoint | None:
        """The point after which adding GPUs no longer pays: the first whose marginal efficiency is below
        `threshold` and after which no point that fits is above it again (a dip that recovers is not a stop)."""
        stop = None
        for point in self.points:
            if point.marginal is None:
                continue
            if point.marginal < self.threshold:
                stop = stop or point
            else:
                stop = None
        return stop

    def verdict(self) -> str:
        fitting = [p for p in self.points if p.result.fits]
        if not fitting:
            return "no point of the sweep fits in memory: there is no baseline to scale from"
        unfit = [p.gpus for p in self.points if not p.result.fits]
        note = f" ({', '.join(map(str, unfit))} GPUs: no layout fits, left out)" if unfit else ""
        stop = self.stop
        if stop is None:
            last = fitting[-1]
            return (f"adding GPUs still pays up to {last.gpus} GPUs: each added GPU brought at least "
                    f"{self.threshold:.0%} of a GPU's worth (efficiency at {last.gpus}: {last.efficiency:.0%}){note}")
        previous = [p for p in fitting if p.gpus < stop.gpus][-1]
        return (f"adding GPUs stops paying at {stop.gpus} GPUs: from {previous.gpus} to {stop.gpus} each added GPU "
                f"brings {stop.marginal:.0%} of what a GPU brought at {previous.gpus} (threshold {self.threshold:.0%}), "
                f"and no later point pays again; throughput {previous.samples_per_s:.3g} -> {stop.samples_per_s:.3g} "
                f"samples/s{note}")

    def as_dict(self) -> dict:
        stop = self.stop
        return {"scaling": self.scaling, "threshold": self.threshold, "stops_paying_at": stop.gpus if stop else None,
                "verdict": self.verdict(), "points": [p.as_dict() for p in self.points]}


def scaling_sweep(job: Job, gpu_counts: list[int], spec: ClusterSpec, scaling: str = "strong",
                  threshold: float = DEFAULT_THRESHOLD, tp: int | None = None, pp: int | None = None,
                  progress: Callable[[int, int], None] | None = None) -> ScalingSweep:
    """Throughput at each GPU count (see the module docstring); `progress(done, total)` after each point."""
    if scaling not in SCALINGS:
        raise ConfigError(f"unknown scaling {scaling!r}: choose strong (fixed global batch) or weak (batch grows with GPUs)")
    counts = sorted(set(gpu_counts))
    if len(counts) < 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise ConfigError(f"a sweep needs at least two different positive GPU counts, got {gpu_counts!r}")
    check_sweep(counts)
    check_layers(job.model.n_layers)
    if not 0 < threshold < 1:
        raise ConfigError(f"the threshold is a fraction of linear scaling in (0, 1), got {threshold!r}")
    sweep = ScalingSweep(scaling, threshold)
    for n in counts:
        batch = job.global_batch if scaling == "strong" else job.global_batch * n // counts[0]
        if scaling == "weak" and job.global_batch * n % counts[0]:
            raise ConfigError(f"weak scaling from {counts[0]} GPUs needs GPU counts that are multiples of it, got {n}")
        result = best_layout(job, n, spec, batch, tp, pp)
        add_point(sweep, ScalingPoint(n, batch, result, result.samples_per_s))
        if progress is not None:
            progress(len(sweep.points), len(counts))
    return sweep


def add_point(sweep: ScalingSweep, point: ScalingPoint) -> None:
    """`point` appended to `sweep` with its speedup, efficiency and marginal efficiency from its samples_per_s
    (the step's throughput, or a campaign's goodput: cli/options/campaign.py)."""
    fitting = [p for p in sweep.points if p.result.fits]
    if point.result.fits and not fitting:  # the baseline: the first point whose layout fits in memory
        point.speedup, point.efficiency = 1.0, 1.0
    elif point.result.fits:
        first, previous = fitting[0], fitting[-1]
        point.speedup = point.samples_per_s / first.samples_per_s
        point.efficiency = point.speedup / (point.gpus / first.gpus)
        added = (point.samples_per_s - previous.samples_per_s) / (point.gpus - previous.gpus)
        point.marginal = added / (previous.samples_per_s / previous.gpus)
    sweep.points.append(point)


def compare_zero(job: Job, layout: Layout, cluster: Cluster, hardware: Hardware | None = None,
                 global_batch: int | None = None, stages: tuple[int, ...] = (0, 1, 2, 3)) -> dict[int, SimResult]:
    """The same job and layout under each ZeRO stage: what sharding costs in time and saves in memory (FSDP's settings
    with ZeRO-3 as the job has them, the other stages without them; a shard group with ZeRO 1-3)."""
    def staged(stage: int) -> Layout:
        three = stage == 3  # the settings of ZeRO-3 alone; a shard group with ZeRO 1-3 (the layout's, the job's)
        return replace(layout, zero=stage, reshard_after_forward=job.reshards(layout.pp) if three else True,
                       sync_grads_once=job.sync_grads_once and three, shard_group=layout.shard_group if stage else 0)
    return {stage: job.simulate(staged(stage), cluster, hardware, global_batch) for stage in stages}


def zero_verdict(results: dict[int, SimResult]) -> str:
    """Whether ZeRO-3 beats the fastest stage that also fits, said plainly."""
    fits = {s: r for s, r in results.items() if r.fits}
    if 3 not in results:
        return ""
    three = results[3]
    others = {s: r for s, r in fits.items() if s != 3}
    if not others:
        return "only ZeRO-3 fits in memory here: its extra communication is the price of fitting at all"
    best = min(others, key=lambda s: others[s].step_time_s)
    ratio = three.step_time_s / others[best].step_time_s
    if ratio > 1:
        return (f"ZeRO-3 is {ratio:.2f}x slower than ZeRO-{best} here, and ZeRO-{best} fits: sharding the weights "
                f"gathers them every forward and backward (3 passes of the weights over the network, "
                f"all-reduce needs 2), so it only pays when nothing else fits")
    return (f"ZeRO-3 takes {ratio:.2f}x the step time of ZeRO-{best} here: its per-unit gathers and reduce-scatters "
            f"hide under compute (it loses where communication cannot hide: more replicas, less work per GPU)")
