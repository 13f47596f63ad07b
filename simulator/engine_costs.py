"""What every action of a schedule costs on one pipeline rank, computed once before the replay. Torch-free.

Compute comes from simulator/compute.py's `chunk_times` (per unit: the embedding, one block,
the head: the sum of simulator/ops.py's ops), or on a measured CPU host from its measured units
and core sharing (simulator/engine_host.py), tensor-parallel collectives from its byte counts
timed on the tp group's links, data-parallel collectives per bucket (ZeRO 0-2,
simulator/layout.py's buckets) or per unit (ZeRO-3) on the dp group's links. What overlaps what
is simulator/overlap.py's `Overlap`; its default, "executor", is our code (parallel/pipeline.py,
parallel/zero.py, parallel/zero3.py):

  tp      Megatron's collectives sit between the layer's matmuls: never hidden (Overlap.tp:
          hidden behind the same pass's Linear GEMMs as far as they last).
  ZeRO 0/1  gradients are reduced only in the rank's last gradient action, bucket by bucket
          as they become ready (stage 1: at most MAX_IN_FLIGHT in the air); the optimizer
          waits for the rest. With a tied head on several stages the executor reduces
          nothing during the backward: every bucket is reduced before the optimizer
          (Overlap.dp "backward": reduced in the backward all the same; "after": never in it).
  ZeRO 2  every backward reduce-scatters every bucket of the rank and waits at its end
          ("after": once its compute is done).
  ZeRO 3  every forward and backward gathers each unit (Overlap.zero3_prefetch units ahead,
          ours 1; the rank's first and last unit stay gathered after first use), every
          backward reduce-scatters every unit and waits at its end.
  ZeRO 1/2 all-gather the updated weights after the optimizer, bucket after bucket.
  optimizer  the step itself, after the squared gradient norm is all-reduced (one fp32
          number over dp when ZeRO shards gradients, then over tp, then over pp).

Zero-bubble halves: BackwardInput gets everything but the weight gradients (the input-gradient
GEMMs, the element-wise backward, the recomputation and all backward tp collectives);
BackwardWeight the weight-gradient GEMMs, their accumulation and bias sums (the op list says
which; half of a measured unit's backward), and the gradient reductions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from minigpt.config import GPTConfig
from job.schedule import ScheduleConfig
from job.train_config import bucket_numel
from precision.policy import FORMAT_BYTES, policy as precision_policy
from simulator.compute import EfficiencyProfile, chunk_times
from simulator.engine_host import HostCompute
from simulator.engine_links import LinkCosts
from simulator.engine_overlap import Segment, bucket_segments, bucket_spans, overlap, ready_offsets
from simulator.hardware import GPUSpec
from simulator.layout import Layout, buckets, padded_vocab, stage_units
from simulator.memory import MAX_IN_FLIGHT, MemoryEstimate
from simulator.op_types import Implementation
from simulator.overlap import Overlap


NORM_BYTES = FORMAT_BYTES["fp32"]


@dataclass(frozen=True)
class ActionCost:
    """Seconds an action holds its rank, split by cause; `comm_end`: when its reductions finish (ZeRO 0/1)."""

    total: float
    compute: float = 0.0
    tp: float = 0.0
    dp: float = 0.0
    comm_end: float | None = None


@dataclass
class RankCosts:
    """Per (kind, global chunk): kind F (forward), F1 (a chunk's first forward), B, Bi, W, and
    Blast/Wlast (the rank's last gradient action, which carries ZeRO 0/1's reductions)."""

    actions: dict[tuple[str, int], ActionCost]
    optimizer: float = 0.0
    reduce_before_step: float = 0.0  # reductions left for the optimizer to wait on, serially
    update_gather: dict[int, float] = field(default_factory=dict)  # per chunk, ZeRO-1/2

    @classmethod
    def uniform(cls, chunks: list[int], forward: float, backward: float, optimizer: float = 0.0) -> "RankCosts":
        """Every chunk alike and no communication: for checking the schedule's closed forms."""
        actions = {}
        for chunk in chunks:
            for kind, seconds in (("F", forward), ("F1", forward), ("B", backward), ("Blast", backward),
                                  ("Bi", backward / 2), ("W", backward / 2), ("Wlast", backward / 2)):
                actions[(kind, chunk)] = ActionCost(seconds, compute=seconds)
        return cls(actions, optimizer=optimizer)


@dataclass(frozen=True)
class Unit:
    tensors: list
    forward: float  # compute seconds
    backward: float  # recompute included
    forward_tp: float  # tensor-parallel seconds left exposed (simulator/overlap.py's tp setting)
    backward_tp: float
    numel: int  # padded to the dp size (ZeRO-3's flat unit)
    recompute: float = 0.0  # the part of `backward` that recomputes the forward
    weight: float = 0.0  # the weight-gradient part of `backward` (zero-bubble schedules' W)


def tp_seconds(links: LinkCosts, collectives) -> float:
    return sum(c.calls * links.tp_collective(c.kind, c.bytes) for c in collectives)


@dataclass
class _Job:
    """What every rank's costs are made of."""

    model: GPTConfig
    layout: Layout
    links: LinkCosts
    zero: int
    dp: int
    bucket_numel: int
    compute_bytes: int
    reduce_bytes: int
    tied_copy: bool  # a tied head on several stages
    serial: bool  # gloo on a CPU host: communication does not overlap compute
    overlap: Overlap

    @property
    def reduce_in_backward(self) -> bool:
        """ZeRO 0/1 reduce buckets during the last backward (else all of them wait for the optimizer)."""
        if self.dp == 1 or self.overlap.dp == "after":
            return False
        return self.overlap.dp == "backward" or not self.tied_copy


def _unit_times(job: _Job, gpu: GPUSpec, precision: str, micro_batch: int, implementation: Implementation,
                profile: EfficiencyProfile | None, host: HostCompute | None):
    """times(layers, first, last) -> (forward, backward, exposed tp forward, exposed tp backward, recompute, weight)."""
    memo: dict = {}
    hide = job.overlap.tp and not job.serial

    def times(layers: int, first: bool, last: bool):
        key = (layers, first, last)
        if key not in memo:
            ct = chunk_times(job.model, layers, micro_batch, job.layout, gpu, precision, implementation.recompute,
                             first, last, profile, implementation.attention, implementation.sp_saved_input)
            f, b, again, weight = ct.forward_s, ct.backward_s, ct.recompute_s, ct.backward_weight_s
            if host is not None:
                f, b, again = host.chunk(layers, first, last, micro_batch, implementation.recompute, (f, b, again))
                weight = (b - again) / 2  # measured units do not split the backward: half of it
            ftp, btp = tp_seconds(job.links, ct.tp_collectives_forward), tp_seconds(job.links, ct.tp_collectives_backward)
            if hide:  # hidden behind the Linears' GEMMs of the same pass, as far as they last
                ftp, btp = max(0.0, ftp - ct.forward_linear_s), max(0.0, btp - ct.backward_linear_s)
            memo[key] = (f, b, ftp, btp, again, weight)
        return memo[key]

    return times


def _zero3_actions(job: _Job, chunk: int, units: list[Unit], others: list[Unit], kept: set[int], dp_time,
                   actions: dict) -> None:
    """Every forward and backward gathers its units (prefetched) and a backward reduce-scatters them."""
    serial, prefetch = job.serial, job.overlap.zero3_prefetch
    after = job.overlap.dp == "after"

    def gather(u: Unit, first_use: bool) -> float:
        return dp_time("all_gather", u.numel, job.compute_bytes) if first_use or id(u) not in kept else 0.0

    def rs(u: Unit) -> float:
        return dp_time("reduce_scatter", u.numel, job.reduce_bytes)

    def reducing(segments: list[Segment], reductions: list[float]) -> list[Segment]:
        if not after:
            return segments
        return [replace(s, reduce=0.0) for s in segments] + [Segment(0.0, reduce=r) for r in reductions]

    f_compute, f_tp = sum(u.forward for u in units), sum(u.forward_tp for u in units)
    b_compute, b_tp = sum(u.backward for u in units), sum(u.backward_tp for u in units)
    w_compute = sum(u.weight for u in units)
    for kind, first_use in (("F", False), ("F1", True)):
        o = overlap([Segment(u.forward + u.forward_tp, gather(u, first_use)) for u in units], None, False, serial,
                    prefetch)
        actions[(kind, chunk)] = ActionCost(o.end, f_compute, f_tp, o.exposed)
    tail = [Segment(0.0, reduce=rs(u)) for u in others]
    rev = units[::-1]
    full = reducing([Segment(u.backward + u.backward_tp, gather(u, False), rs(u)) for u in rev], [rs(u) for u in rev])
    full = overlap(full + tail, MAX_IN_FLIGHT, True, serial, prefetch)
    bi = overlap([Segment(u.backward - u.weight + u.backward_tp, gather(u, False)) for u in rev], None, False, serial,
                 prefetch)
    w = reducing([Segment(u.weight, reduce=rs(u)) for u in rev], [rs(u) for u in rev])
    w = overlap(w + tail, MAX_IN_FLIGHT, True, serial, prefetch)
    for kind, o, c, t in (("B", full, b_compute, b_tp), ("Bi", bi, b_compute - w_compute, b_tp), ("W", w, w_compute, 0.0)):
        actions[(kind, chunk)] = ActionCost(o.end, c, t, o.exposed)


def _bucket_actions(job: _Job, chunk: int, units: list[Unit], spans: dict, bucket_reduce, actions: dict) -> None:
    """ZeRO 0-2: plain compute actions; the backward reduces buckets as parallel/zero.py does (simulator/overlap.py)."""
    f_compute, f_tp = sum(u.forward for u in units), sum(u.forward_tp for u in units)
    b_compute, b_tp = sum(u.backward for u in units), sum(u.backward_tp for u in units)
    w_compute = sum(u.weight for u in units)
    bi_compute = b_compute - w_compute
    forward = ActionCost(f_compute + f_tp, f_compute, f_tp)
    actions[("F", chunk)] = actions[("F1", chunk)] = forward
    actions[("B", chunk)] = ActionCost(b_compute + b_tp, b_compute, b_tp)
    actions[("Bi", chunk)] = ActionCost(bi_compute + b_tp, bi_compute, b_tp)
    actions[("W", chunk)] = ActionCost(w_compute, w_compute)
    if not (job.zero == 2 or job.reduce_in_backward):
        return
    limit = None if job.zero == 0 else MAX_IN_FLIGHT
    tail = [Segment(0.0, reduce=bucket_reduce(b.size)) for c, s in spans.items() if c != chunk for *_, b in s]
    tensors = [u.tensors for u in units]
    for kind, compute, tp, shares in (
        ("B", b_compute, b_tp, [u.backward + u.backward_tp for u in units]),
        ("W", w_compute, 0.0, [u.weight for u in units]),  # the weight-gradient part
    ):
        if job.overlap.dp == "after":  # ZeRO-2, not overlapped: every bucket once the compute is done
            segments = [Segment(compute + tp)] + [Segment(0.0, reduce=bucket_reduce(b.size)) for *_, b in spans[chunk]]
        else:
            segments = bucket_segments(spans[chunk], ready_offsets(tensors, shares), compute + tp, bucket_reduce)
        o = overlap(segments + tail, limit, wait_at_end=job.zero == 2, serial=job.serial)
        name = kind if job.zero == 2 else kind + "last"
        actions[(name, chunk)] = ActionCost(o.end, compute, tp, o.exposed, None if job.zero == 2 else o.comm_end)


def rank_costs(model: GPTConfig, layout: Layout, schedule: ScheduleConfig, links: LinkCosts, gpu: GPUSpec,
               precision: str, micro_batch: int, recompute: str, profile: EfficiencyProfile | None,
               memory: MemoryEstimate, bucket_mb: float, host: HostCompute | None = None,
               implementation: Implementation | None = None, overlap_settings: Overlap | None = None) -> list[RankCosts]:
    pol = precision_policy(precision)
    implementation = implementation or Implementation(recompute=recompute)
    compute_bytes = FORMAT_BYTES[pol.compute]
    job = _Job(model, layout, links, schedule.zero_stage, layout.dp, bucket_numel(bucket_mb, compute_bytes),
               compute_bytes, FORMAT_BYTES[pol.reduce], model.tied_head and layout.pp > 1,
               host is not None and host.serial, overlap_settings or Overlap())
    times = _unit_times(job, gpu, precision, micro_batch, implementation, profile, host)
    last_chunk = schedule.num_chunks - 1
    # The optimizer's one reduction of the squared gradient norm (precision/optimizer.py, parallel/build.py's
    # reduce_sum): an fp32 scalar all-reduced over dp (ZeRO >= 1: sharded gradients), then tp, then pp.
    norm_reduce = links.tp_collective("all_reduce", NORM_BYTES) + links.pp_collective("all_reduce", NORM_BYTES)
    ranks = []
    for rank, (per_chunk, placed) in enumerate(zip(stage_units(model, layout), layout.rank_chunks(model))):
        def dp_time(kind: str, numel: int, element: int, stage: int = rank) -> float:
            return links.dp_collective(stage, kind, numel * element)

        def bucket_reduce(numel: int) -> float:
            return dp_time("all_reduce" if job.zero == 0 else "reduce_scatter", numel, job.reduce_bytes)

        chunk_units: dict[int, list[Unit]] = {}
        for (chunk, _), unit_tensors in zip(placed, per_chunk):
            units = []
            for position, tensors in enumerate(unit_tensors):
                embedding = chunk == 0 and position == 0
                head = chunk == last_chunk and position == len(unit_tensors) - 1
                f, b, ftp, btp, again, weight = times(0 if embedding or head else 1, embedding, head)
                units.append(Unit(tensors, f, b, ftp, btp, buckets(tensors, None, job.dp)[0].size, again, weight))
            chunk_units[chunk] = units
        all_units = [u for chunk in chunk_units.values() for u in chunk]
        kept = {id(all_units[0]), id(all_units[-1])}
        actions: dict[tuple[str, int], ActionCost] = {}
        spans = {c: bucket_spans([t for u in us for t in u.tensors], job.bucket_numel, job.dp)
                 for c, us in chunk_units.items()}
        for chunk, units in chunk_units.items():
            if job.zero == 3:
                others = [u for c, us in chunk_units.items() if c != chunk for u in us]
                _zero3_actions(job, chunk, units, others, kept, dp_time, actions)
            else:
                _bucket_actions(job, chunk, units, spans, bucket_reduce, actions)
        for chunk in chunk_units:
            for kind in ("B", "W"):
                actions.setdefault((kind + "last", chunk), actions[(kind, chunk)])
        ranks.append(RankCosts(
            actions=actions,
            optimizer=optimizer_seconds(memory.per_stage[rank], pol, gpu) * (host.slowdown if host is not None else 1.0)
            + norm_reduce + (dp_time("all_reduce", 1, NORM_BYTES) if job.zero >= 1 else 0.0),
            reduce_before_step=_reduce_before_step(job, rank, spans, bucket_reduce, dp_time),
            update_gather={c: sum(dp_time("all_gather", b.size, compute_bytes) for *_, b in s) for c, s in spans.items()}
            if job.zero in (1, 2) and job.dp > 1 else {},
        ))
    return ranks


def _reduce_before_step(job: _Job, rank: int, spans, bucket_reduce, dp_time) -> float:
    """Reductions the optimizer waits for that no backward started: every bucket (ZeRO 0/1 when they are
    not reduced in the backward: a tied head on several stages under our executor, or overlap dp "after"),
    and the tied embedding's gradient all-reduce over dp (ZeRO 2/3, parallel/zero*.add_grad)."""
    if job.dp == 1:
        return 0.0
    seconds = 0.0
    if job.zero in (0, 1) and not job.reduce_in_backward:
        seconds += sum(bucket_reduce(b.size) for s in spans.values() for *_, b in s)
    if job.zero >= 2 and job.tied_copy and rank in (0, job.layout.pp - 1):
        numel = padded_vocab(job.model, job.layout.tp) // job.layout.tp * job.model.d_model
        seconds += dp_time("all_reduce", numel, job.reduce_bytes)
    return seconds


def optimizer_seconds(stage: MemoryEstimate, pol, gpu: GPUSpec) -> float:
    """AdamW on this rank's share: gradients read, moments (and masters) read and written, weights written, at HBM speed."""
    owned = stage.adam_m // FORMAT_BYTES[pol.optimizer_state]
    per_param = pol.bytes_per_param()
    weights = 2 * per_param["master"] + per_param["compute"] if pol.master else 2 * per_param["compute"]
    moved = owned * (per_param["grad"] + 2 * (per_param["adam_m"] + per_param["adam_v"]) + weights)
    return moved / gpu.hbm_bandwidth
