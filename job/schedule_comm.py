"""Where the sends, receives and data-parallel actions go in a rank's list. Torch-free.

The schedule kinds (job/schedule.py) only order the compute actions; this
module turns those orders into complete action lists, mechanically, so every
kind gets the same guarantees. A rank's list is

    [batch 0] compute 0 [batch 1] compute 1 ... compute n-1 [batch n] tail

where batch k is the sends and receives posted at the boundary before compute k
(see `batches`: the executor posts them as one batch_isend_irecv and waits for
all of them). Inside a batch the sends come first, then the receives, each in
(activations before gradients, micro-batch, sending chunk) order, so two ranks
always list what passes between them in the same order.

Two ways to choose the boundary of each transfer:

  slots (gpipe, 1f1b, interleaved): the kind groups its computes into slots
    with no communication inside; the boundary between two slots carries the
    sends of the slot before and the receives of the slot after. One compute a
    slot gives Megatron's 1F1B exchanges ("send my forward output + receive the
    gradient for my next backward" in one batch); interleaved pairs each
    steady-state forward with its backward and so exchanges all four tensors at
    once, as Megatron does -- with one compute a slot it deadlocks.
  timed (zb-h1): the receive is posted at the consumer's boundary where, in the
    unit-cost timing with free communication, the data is produced; the send
    right after its compute. Both sides then meet exactly when the data is
    ready, so blocking batches cost the schedule nothing; the receive may come
    a few computes before its consumer (the tensor waits in a buffer).

Data-parallel actions never sit inside a batch; they follow the plan's real
buckets and units (ScheduleConfig.plan, job/data_parallel.py):
  - ZeRO-3 gathers a unit right before a compute that needs it while it is not
    gathered (forward, backward, weight gradient; every micro-batch, as units are
    freed after each use unless kept), in the order the compute uses them. Without
    resharding after the forward (FSDP2's reshard_after_forward=False) nothing is freed
    after a forward: a unit stays gathered for its backward of that micro-batch and is
    freed after each backward (weight gradient) of its chunk, so it is gathered again
    by the next compute that needs it -- the next forward under 1F1B (one gather per
    unit and micro-batch, none before a backward), the next backward where forwards
    run back to back (GPipe); under pipelining (pp > 1) it is freed only after the
    chunk's last backward of the step, as torchtitan runs it: one gather per unit and
    step, at its first forward. The rank's first and last units stay kept all step;
  - reductions come right after the compute that makes their gradients, last
    bucket first (a backward fills it first): ZeRO 0/1 once a step, after the
    chunk's last weight gradient; ZeRO 2/3 after every micro-batch's, but ZeRO-3
    holding its units all step (ScheduleConfig.zero3_hold), whose gradients are
    summed unsharded and reduce-scattered once, after the chunk's last backward, as
    torch's pipelining runs FSDP2;
  - a tied embedding split over stages: after every compute and batch,
    SyncEmbedding, then the tied matrix's own reduction (ZeRO 0/1: its bucket;
    ZeRO 2/3: ReduceTiedGrad);
  - then OptimizerStep; then, for ZeRO-1/2, the gathers of the updated weights.
Both interpreters arm the gathers right before a compute and the reductions
right after it while it runs (`armed_around`): that is where they overlap it.
"""

from __future__ import annotations

from bisect import bisect_left

from job.schedule_actions import (
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Compute,
    Forward,
    GatherParams,
    OptimizerStep,
    PointToPoint,
    RecvActivation,
    RecvGrad,
    ReduceScatterGrads,
    ReduceTiedGrad,
    ScheduleConfig,
    SendActivation,
    SendGrad,
    SyncEmbedding,
    chunk_rank,
    reduce_kind,
)
from job.schedule_check import Costs

Boundaries = list[list[PointToPoint]]  # per rank: len(order) + 1 boundaries


def input_recv(config: ScheduleConfig, rank: int, action: Compute) -> PointToPoint | None:
    """The receive `action` needs first, or None (first/last chunk, or the neighbour chunk is local)."""
    mb, chunk, p = action.micro_batch, action.chunk, config.pp
    if isinstance(action, Forward) and chunk > 0 and chunk_rank(chunk - 1, p) != rank:
        return RecvActivation(mb, chunk, chunk_rank(chunk - 1, p), chunk - 1)
    backward = isinstance(action, (Backward, BackwardInput))
    if backward and chunk < config.num_chunks - 1 and chunk_rank(chunk + 1, p) != rank:
        return RecvGrad(mb, chunk, chunk_rank(chunk + 1, p), chunk + 1)
    return None


def output_send(config: ScheduleConfig, rank: int, action: Compute) -> PointToPoint | None:
    """The send of what `action` produced for a chunk on another rank, or None."""
    mb, chunk, p = action.micro_batch, action.chunk, config.pp
    if isinstance(action, Forward) and chunk < config.num_chunks - 1 and chunk_rank(chunk + 1, p) != rank:
        return SendActivation(mb, chunk, chunk_rank(chunk + 1, p), chunk + 1)
    if isinstance(action, (Backward, BackwardInput)) and chunk > 0 and chunk_rank(chunk - 1, p) != rank:
        return SendGrad(mb, chunk, chunk_rank(chunk - 1, p), chunk - 1)
    return None


def _batch_order(op: PointToPoint) -> tuple[int, int, int, int]:
    receiving = isinstance(op, (RecvActivation, RecvGrad))
    gradient = isinstance(op, (SendGrad, RecvGrad))
    sender_chunk = op.peer_chunk if receiving else op.chunk
    return (receiving, gradient, op.micro_batch, sender_chunk)


def slot_boundaries(config: ScheduleConfig, rank: int, slots: list[list[Compute]]) -> Boundaries:
    """Receives of a slot before it, sends of a slot after it."""
    boundaries: Boundaries = [[] for _ in range(sum(len(slot) for slot in slots) + 1)]
    first = 0
    for slot in slots:
        boundaries[first] += [op for action in slot if (op := input_recv(config, rank, action))]
        first += len(slot)
        boundaries[first] += [op for action in slot if (op := output_send(config, rank, action))]
    return boundaries


def unit_times(config: ScheduleConfig, orders: list[list[Compute]],
               costs: Costs = Costs()) -> list[list[tuple[int, int]]]:
    """(start, end) of every compute when communication is free and instant: the ideal timing of the orders."""
    finished: dict[tuple[str, int, int], int] = {}
    times: list[list[tuple[int, int]]] = [[] for _ in orders]
    clock = [0] * len(orders)
    last = config.num_chunks - 1

    def key(action: Compute) -> tuple[str, int, int]:
        kind = "F" if isinstance(action, Forward) else "W" if isinstance(action, BackwardWeight) else "B"
        return kind, action.micro_batch, action.chunk

    def needs(action: Compute) -> list[tuple[str, int, int]]:
        mb, chunk = action.micro_batch, action.chunk
        if isinstance(action, Forward):
            return [("F", mb, chunk - 1)] if chunk > 0 else []
        if isinstance(action, BackwardWeight):
            return [("B", mb, chunk)]
        return [("F", mb, chunk)] + ([("B", mb, chunk + 1)] if chunk < last else [])

    progress = True
    while progress:
        progress = False
        for rank, order in enumerate(orders):
            while len(times[rank]) < len(order):
                action = order[len(times[rank])]
                if any(need not in finished for need in needs(action)):
                    break
                start = max([clock[rank]] + [finished[need] for need in needs(action)])
                clock[rank] = start + costs.of(action)
                finished[key(action)] = clock[rank]
                times[rank].append((start, clock[rank]))
                progress = True
    if any(len(t) < len(o) for t, o in zip(times, orders)):
        raise ValueError(f"the compute orders of {config} wait on each other in a cycle")
    return times


def timed_boundaries(config: ScheduleConfig, orders: list[list[Compute]]) -> list[Boundaries]:
    """Every transfer posted on both sides at the tick its data is produced (unit costs, free communication)."""
    times = unit_times(config, orders)
    starts = [[start for start, _ in rank_times] for rank_times in times]  # non-decreasing
    consumer_of = {(rank, recv): index for rank, order in enumerate(orders) for index, action in enumerate(order)
                   if (recv := input_recv(config, rank, action)) is not None}
    boundaries: list[Boundaries] = [[[] for _ in range(len(order) + 1)] for order in orders]
    for rank, order in enumerate(orders):
        for index, action in enumerate(order):
            send = output_send(config, rank, action)
            if send is None:
                continue
            boundaries[rank][index + 1].append(send)
            recv = send.partner(rank)
            ready = times[rank][index][1]
            at = bisect_left(starts[send.peer], ready, hi=consumer_of[(send.peer, recv)])
            boundaries[send.peer][at].append(recv)
    return boundaries


def _in_batch_order(ops: list[PointToPoint]) -> list[PointToPoint]:
    return sorted(ops, key=_batch_order) if len(ops) > 1 else ops


def assemble(config: ScheduleConfig, rank: int, order: list[Compute], boundaries: Boundaries) -> tuple[Action, ...]:
    """The complete list of one rank: batches, computes and data-parallel actions."""
    placer = _DataParallelPlacer(config, rank, order)
    out: list[Action] = []
    for index, action in enumerate(order):
        out += _in_batch_order(boundaries[index])
        out += placer.before(action)
        out.append(action)
        out += placer.after(action)
    out += _in_batch_order(boundaries[len(order)])
    return tuple(out + placer.tail())


class _DataParallelPlacer:
    """Where a rank's data-parallel actions go, from the plan's buckets and units (module docstring).

    ZeRO-3 units are gathered where a compute needs one that is not gathered: a forward needs every
    unit of its chunk, a backward (or weight gradient) too, an input gradient the units it runs
    through (none on chunk 0, whose weight gradient does the whole backward); a unit is freed after
    each forward and after each of its reductions, unless it is kept (the rank's first and last), or, without
    resharding after the forward, as `frees_after` says."""

    def __init__(self, config: ScheduleConfig, rank: int, order: list[Compute]):
        self.config, self.rank, self.zero = config, rank, config.zero_stage
        self.plan = config.data_parallel
        producers = [a for a in order if isinstance(a, (Backward, BackwardWeight))]
        self.last_weight_grad = {a.chunk: a for a in producers}
        self.resident: set[tuple[int, int]] = set()
        self.tied_chunk = next((c for c in config.chunks_of(rank) if self.plan.of(c).tied is not None), None)

    def sizes(self, chunk: int) -> tuple[int, ...]:
        return self.plan.of(chunk).sizes

    def before(self, action: Compute) -> list[Action]:
        if self.zero != 3 or (isinstance(action, BackwardInput) and action.chunk == 0):
            return []
        phase = "forward" if isinstance(action, Forward) else "weight" if isinstance(action, BackwardWeight) \
            else "backward"
        units = range(len(self.sizes(action.chunk)))
        out: list[Action] = []
        for unit in (units if phase == "forward" else reversed(units)):
            if (action.chunk, unit) not in self.resident:
                self.resident.add((action.chunk, unit))
                out.append(GatherParams(action.chunk, unit, phase, self.sizes(action.chunk)[unit], action.micro_batch))
        return out

    def after(self, action: Compute) -> list[Action]:
        chunk, params = action.chunk, self.plan.of(action.chunk)
        makes_grads = isinstance(action, (Backward, BackwardWeight))
        if self.zero == 3 and self.frees_after(action):
            self.resident -= {(chunk, u) for u in range(len(params.sizes)) if not params.is_kept(u)}
        if not makes_grads:
            return []
        order = range(len(params.sizes) - 1, -1, -1)  # a backward fills the last bucket first
        if self.zero >= 2 and not self.config.sums_grads:  # else summed, reduced after the chunk's last backward
            return [ReduceScatterGrads(chunk, b, params.sizes[b], action.micro_batch) for b in order]
        if self.last_weight_grad[chunk] is not action:
            return []
        if self.zero >= 2:  # ZeRO-3 holding its units all step: their summed gradients, once a step
            return [ReduceScatterGrads(chunk, b, params.sizes[b]) for b in order]
        return [self.reduction(chunk, b) for b in order if not (chunk == self.tied_chunk and b == params.tied)]

    def frees_after(self, action: Compute) -> bool:
        """Whether ZeRO-3 frees the chunk's units that are not kept after `action`: after every forward and
        backward (weight gradient); without resharding after the forward, after each backward, and held all step
        (ScheduleConfig.zero3_hold) only after the chunk's last backward of the step (parallel/data/zero3.py does
        the same)."""
        if isinstance(action, Forward):
            return self.plan.reshard_after_forward
        if not isinstance(action, (Backward, BackwardWeight)):
            return False
        held = self.config.zero3_hold > 1
        return self.plan.reshard_after_forward or not held or self.last_weight_grad[action.chunk] is action

    def reduction(self, chunk: int, bucket: int) -> Action:
        return reduce_kind(self.zero)(chunk, bucket, self.sizes(chunk)[bucket])

    def tail(self) -> list[Action]:
        out: list[Action] = []
        if self.tied_chunk is not None:
            params = self.plan.of(self.tied_chunk)
            out.append(SyncEmbedding(self.tied_chunk))
            if self.zero >= 2:
                out.append(ReduceTiedGrad(self.tied_chunk, params.tied_numel))
            else:
                out.append(self.reduction(self.tied_chunk, params.tied))
        out.append(OptimizerStep(norm_over_dp=self.zero >= 1))
        if self.zero in (1, 2):
            out += [GatherParams(chunk, b, "update", size)
                    for chunk in self.config.chunks_of(self.rank) for b, size in enumerate(self.sizes(chunk))]
        return out
