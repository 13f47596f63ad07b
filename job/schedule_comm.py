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

Data-parallel actions never sit inside a batch: ZeRO-3 gathers a chunk's
weights right before its first forward and right before its first backward;
a chunk's gradient reductions come right before the next compute (after its
batch) once the chunk's last weight gradient is computed, or at the end; then
OptimizerStep; then, for ZeRO-1/2, the gathers of the updated weights.
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
    ScheduleConfig,
    SendActivation,
    SendGrad,
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
    buckets = range(config.buckets)
    last_weight_grad = {action.chunk: action for action in order if isinstance(action, (Backward, BackwardWeight))}
    gathered: set[tuple[int, str]] = set()
    pending: list[Action] = []  # reductions waiting for a place outside a batch
    out: list[Action] = []
    for index, action in enumerate(order):
        out += _in_batch_order(boundaries[index])
        out += pending
        pending = []
        phase = "forward" if isinstance(action, Forward) else "backward"
        if config.zero_stage == 3 and not isinstance(action, BackwardWeight) and (action.chunk, phase) not in gathered:
            gathered.add((action.chunk, phase))
            out += [GatherParams(action.chunk, bucket, phase) for bucket in buckets]
        out.append(action)
        if last_weight_grad[action.chunk] is action:
            pending += [reduce_kind(config.zero_stage)(action.chunk, bucket) for bucket in buckets]
    out += _in_batch_order(boundaries[len(order)])
    out += pending
    out.append(OptimizerStep())
    if config.zero_stage in (1, 2):
        out += [GatherParams(chunk, bucket, "update") for chunk in config.chunks_of(rank) for bucket in buckets]
    return tuple(out)
