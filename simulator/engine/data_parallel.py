"""The data-parallel actions of a schedule, priced from their place in the list. Torch-free.

No model of ZeRO lives here: the schedule (job/schedule_comm.py, built from the run's real
buckets and units by job/data_parallel.py) says which collective runs where, and
job/schedule_actions.py's `armed_around` says, as it does for the executor, which of them a
compute issues while it runs: the gathers listed right before it and the reductions right
after it. This module prices what that implies, with simulator/engine/dp_overlap.py's stream
model (one data-parallel stream, in issue order):

  - a compute with armed actions is cut into segments: ZeRO-3 per unit (its gather, issued
    Overlap.zero3_prefetch units ahead, and its reduction when its gradients are in), ZeRO 0-2
    per bucket (a reduction when the bucket's last gradient is in, ready_offsets); the
    compute waits as our code waits (ZeRO-2/3: MAX_IN_FLIGHT reduce-scatters in the air, and
    all of a micro-batch's at its end; ZeRO 0/1 let them run past);
  - Overlap.dp "after": the armed reductions start only when the compute is done;
  - a data-parallel action on its own (a reduction no compute armed, the tied copy's
    all-reduce, the update gathers) is priced at its turn by `seconds`.
Prices of a compute depend only on its type, chunk and the armed actions' buckets, phases
and kinds, so they are computed once per distinct combination.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from job.data_parallel import collectives
from job.schedule import (
    Action,
    AllReduceGrads,
    Backward,
    BackwardInput,
    BackwardWeight,
    DataParallelPlan,
    Forward,
    GatherParams,
    OptimizerStep,
    ReduceScatterGrads,
)
from job.layout import bucket_members, is_fp8_weight
from simulator.engine.dp_overlap import Segment, overlap, ready_offsets
from simulator.states import MAX_IN_FLIGHT
from simulator.engine.overlap import Overlap


@dataclass(frozen=True)
class ActionCost:
    """Seconds an action holds its rank, split by cause; `comm_end`: when the reductions it issued
    finish, from its start, when it does not wait for them (ZeRO 0/1)."""

    total: float
    compute: float = 0.0
    tp: float = 0.0
    dp: float = 0.0
    comm_end: float | None = None
    cp: float = 0.0  # context parallelism's exposed key/value exchange (simulator/engine/context.py)
    ep: float = 0.0  # expert parallelism's exposed all-to-alls (simulator/engine/experts.py)
    ep_hidden: float = 0.0  # and their seconds hidden behind the shared experts (Overlap.ep), not in `total`
    amax: float = 0.0  # fp8 amax all-reduces, exposed (simulator/engine/costs.py's amax_seconds)


class DataParallelPricer:
    """One pipeline rank's data-parallel prices: `compute(action, armed)` and `seconds(action)`."""

    def __init__(self, chunk_units: dict, plan: DataParallelPlan, zero: int, bucket_numel: int,
                 dp_time: Callable[[str, float, str], float], settings: Overlap, serial: bool, plain: dict,
                 experts_s: float = 0.0, fp8_gathers: bool = False, fp8_experts: bool = False,
                 reduce_bytes: int | None = None, copies: "UnitCopies | None" = None):
        self.units, self.plan, self.zero = chunk_units, plan, zero
        self.dp_time, self.settings, self.serial, self.plain = dp_time, settings, serial, plain
        # each bucket's first tensor (its last gradient in), cut as the plan's buckets (job/layout.py)
        cuts = {chunk: [members for members, _ in bucket_members([t for u in units for t in u.tensors], bucket_numel,
                                                                 plan.dp)]
                for chunk, units in chunk_units.items()} if zero < 3 else {}
        self.firsts = {chunk: [members.start for members in cut] for chunk, cut in cuts.items()}
        # fp8_gathers (Implementation.fp8_param_gather): each bucket's (unit's) fp8 weights, gathered at a byte each,
        # the routed experts' among them with fp8 grouped experts (`fp8_experts`)
        self.fp8 = _fp8_elements(chunk_units, cuts, zero, fp8_experts) if fp8_gathers else {}
        self.experts_s = experts_s  # expert parallelism's gradient reduction, issued with the optimizer step
        self.reduce_bytes = reduce_bytes  # a gradient element's bytes in the reductions (None: the compute format's)
        self.copies = copies  # ZeRO-3 copies on the compute stream around each gather and reduction
        self.memo: dict = {}
        self.timed: dict[tuple, float] = {}  # (kind, bytes) calls -> seconds
        self.by_action: dict[tuple, float] = {}  # seconds, by what an action's collectives depend on

    def seconds(self, action: Action) -> float:
        """The data-parallel collectives of `action` on this rank's dp group (hybrid sharding: a shard group,
        then the replica group), one after another: `dp_time(kind, bytes, group)` each; the optimizer step's
        with the routed experts' own reduction (`experts_s`: they are in no bucket, job/layout.py's stage_units)."""
        # what its collectives depend on (job/data_parallel.py's collectives, the fp8 elements by chunk and bucket)
        key = (type(action), getattr(action, "chunk", None), getattr(action, "bucket", None),
               getattr(action, "numel", None), getattr(action, "norm_over_dp", None))
        if key not in self.by_action:
            fp8 = self.fp8[action.chunk][action.bucket] if self.fp8 and type(action) is GatherParams else 0
            calls = tuple(collectives(action, self.plan, fp8, self.reduce_bytes))
            if calls not in self.timed:
                self.timed[calls] = sum(self.dp_time(kind, nbytes, group) for kind, nbytes, group in calls)
            self.by_action[key] = self.timed[calls] + (self.experts_s if type(action) is OptimizerStep else 0.0)
        return self.by_action[key]

    def compute(self, action, armed: tuple, comm_free: float = 0.0):
        """The cost of compute `action` with `armed` issued while it runs; the dp stream is busy
        `comm_free` seconds more from its start (reductions of an earlier compute still moving)."""
        key = (type(action), action.chunk, tuple((type(a), a.bucket, getattr(a, "phase", "")) for a in armed),
               action.micro_batch == 0)  # a unit held all step sums its gradients from the second micro-batch on
        if comm_free <= 0 and key in self.memo:
            return self.memo[key]
        plain = self.plain[(type(action), action.chunk)]
        copies = self.unit_copies(action, armed)
        segments, limit, wait = self.segments(action, armed, copies)
        o = overlap(segments, limit, wait, self.serial, self.settings.zero3_prefetch, comm_free,
                    self.settings.dp_slowdown)
        cost = ActionCost(o.end, plain.compute + sum(copies), plain.tp, o.exposed, None if wait else o.comm_end,
                          plain.cp, plain.ep, plain.ep_hidden, plain.amax)
        if comm_free <= 0:
            self.memo[key] = cost
        return cost

    def segments(self, action, armed: tuple, copies: list[float]) -> tuple[list[Segment], int | None, bool]:
        """(segments, reductions allowed in flight, whether the compute waits for them at its end); `copies`: each
        unit's compute-stream copies (unit_copies)."""
        if self.zero == 3:
            return self.unit_segments(action, armed, copies), MAX_IN_FLIGHT, True
        plain = self.plain[(type(action), action.chunk)]
        reduced = {a.bucket: a for a in armed if type(a) in (AllReduceGrads, ReduceScatterGrads)}
        limit = None if self.zero <= 1 else MAX_IN_FLIGHT  # ZeRO-1 bounds nothing (parallel/data/zero.py)
        if self.settings.dp == "after":
            tail = [Segment(0.0, reduce=self.seconds(reduced[b])) for b in sorted(reduced, reverse=True)]
            return [Segment(plain.total)] + tail, limit, self.zero == 2
        units = self.units[action.chunk]
        full = type(action) is Backward or action.chunk == 0  # chunk 0's weight gradient is its whole backward
        shares = [u.backward_total for u in units] if full else [u.weight for u in units]
        ready = ready_offsets([u.tensors for u in units], shares)
        firsts = self.firsts[action.chunk]
        segments, clock = [], 0.0
        for at, bucket in sorted((ready[firsts[b]], b) for b in reduced):
            at = min(at, plain.total)
            segments.append(Segment(compute=at - clock, reduce=self.seconds(reduced[bucket])))
            clock = at
        if plain.total > clock:
            segments.append(Segment(compute=plain.total - clock))
        return segments, limit, self.zero == 2

    def sums(self, action) -> bool:
        """Whether `action` sums its units' gradients on the compute stream with no reduction armed (UnitCopies.sum_s:
        ZeRO-3 holding its units all step), so its price is not the plain one even with nothing armed."""
        return self.copies is not None and self.copies.sum_s > 0 and type(action) in (Backward, BackwardWeight)

    def unit_copies(self, action, armed: tuple) -> list[float]:
        """Seconds of each unit's compute-stream copies (UnitCopies) that `armed` implies under ZeRO-3: a gather of the
        unit, a reduction of its gradients, or, `action` making them with no reduction armed, their sum (a stack
        summing them over the micro-batches: UnitCopies.sum_s); zeros where the stack makes none."""
        units = self.units[action.chunk]
        if self.zero != 3 or self.copies is None:
            return [0.0] * len(units)
        gathered = {a.bucket for a in armed if type(a) is GatherParams}
        reduced = {a.bucket for a in armed if type(a) is ReduceScatterGrads}
        grads = type(action) in (Backward, BackwardWeight) and self.copies.sum_s > 0
        return [self.copies.seconds(u.numel, len(u.tensors), i in gathered, i in reduced, grads, action.micro_batch == 0)
                for i, u in enumerate(units)]

    def unit_segments(self, action, armed: tuple, copies: list[float]) -> list[Segment]:
        """ZeRO-3: the chunk's units in the order the compute uses them, each with its armed gather and reduction."""
        units = self.units[action.chunk]
        gathers = {a.bucket: self.seconds(a) for a in armed if type(a) is GatherParams}
        reduces = {a.bucket: self.seconds(a) for a in armed if type(a) is ReduceScatterGrads}
        kind = type(action)
        order = range(len(units)) if kind is Forward else range(len(units) - 1, -1, -1)
        segments = []
        for index in order:
            u = units[index]
            if kind is Forward:
                compute = u.forward_total
            elif kind is Backward or (kind is BackwardWeight and action.chunk == 0):
                compute = u.backward_total
            elif kind is BackwardInput:
                compute = u.backward_input + u.backward_tp + u.backward_cp + u.backward_ep
            else:
                compute = u.weight
            reduce = 0.0 if self.settings.dp == "after" else reduces.get(index, 0.0)
            segments.append(Segment(compute + copies[index], gathers.get(index, 0.0), reduce))
        amax = self.plain[(kind, action.chunk)].amax  # the fp8 amax all-reduce at the chunk's end
        if amax:
            segments.append(Segment(amax))
        if self.settings.dp == "after":
            segments += [Segment(0.0, reduce=reduces[i]) for i in order if i in reduces]
        return segments


@dataclass(frozen=True)
class UnitCopies:
    """ZeRO-3's copies on the compute stream, per unit (Implementation.zero3_copies): after a gather, `out_s` an
    element of the unit and `out_kernels` kernels; before a reduction, `in_s` an element, `in_kernels` kernels and one
    more per tensor when `per_tensor` (a copy each); after a backward whose gradients are summed, not reduced (a unit
    held all step: ScheduleConfig.zero3_hold), `sum_s` an element and a kernel per tensor, the first micro-batch's
    `first_s` where it differs (None: the same; 0: nothing, the gradient kept where autograd wrote it), and a
    reduction after earlier micro-batches' sums `summed_in_s` an element where it differs (None: `in_s`; the last
    gradient summed too, and a kernel per tensor for it); `kernel_s` a launch."""

    out_s: float
    in_s: float
    kernel_s: float
    out_kernels: int = 1
    in_kernels: int = 1
    per_tensor: bool = False
    sum_s: float = 0.0
    first_s: float | None = None
    summed_in_s: float | None = None

    def seconds(self, numel: int, tensors: int, gathered: bool, reduced: bool, summed: bool = False,
                first: bool = False) -> float:
        """`summed`: a backward of a unit held all step (its gradients summed over the micro-batches); `first`: of
        the step's first micro-batch."""
        out = self.out_s * numel + self.out_kernels * self.kernel_s if gathered else 0.0
        if reduced and summed and not first and self.summed_in_s is not None:
            return out + self.summed_in_s * numel + (self.in_kernels + tensors) * self.kernel_s
        if reduced:
            return out + self.in_s * numel + (self.in_kernels + (tensors if self.per_tensor else 0)) * self.kernel_s
        per = self.first_s if first and self.first_s is not None else self.sum_s
        return out + (per * numel + tensors * self.kernel_s if summed and per else 0.0)


def _fp8_elements(chunk_units: dict, cuts: dict, zero: int, experts: bool) -> dict[int, list[int]]:
    """Per chunk, the fp8 Linears' weight elements (job/layout.py's is_fp8_weight) of each gather unit (ZeRO-3) or
    bucket (ZeRO 1-2, `cuts`: each bucket's tensors by position)."""
    out = {}
    for chunk, units in chunk_units.items():
        if zero == 3:
            out[chunk] = [sum(t.numel for t in u.tensors if is_fp8_weight(t, experts)) for u in units]
        else:
            tensors = [t for u in units for t in u.tensors]
            out[chunk] = [sum(tensors[i].numel for i in members if is_fp8_weight(tensors[i], experts))
                          for members in cuts[chunk]]
    return out
