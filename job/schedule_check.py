"""Proving a schedule right, and measuring its bubble. Torch-free.

`validate` checks every action on its own (in range, on the rank that holds
its chunk, talking to the right peer, listed once), pairs every send with its
receive (in posting order per direction), then runs the schedule symbolically
(job/schedule_run.py, whose docstring states the executor semantics) to
prove it complete and deadlock-free. Every failure is a ConfigError naming the
first offending action and its rank.
"""

from __future__ import annotations

from collections import defaultdict

from minigpt.errors import ConfigError
from job.schedule_actions import (
    RECVS,
    SENDS,
    Action,
    AllReduceGrads,
    Backward,
    BackwardWeight,
    Compute,
    DataParallel,
    Forward,
    GatherParams,
    PointToPoint,
    RecvGrad,
    ReduceScatterGrads,
    Schedule,
    SendActivation,
    SendGrad,
    reduce_kind,
)
from job.schedule_run import COMPUTE_TYPES, Costs, TimedAction, Timeline, run_symbolically

__all__ = ["Costs", "TimedAction", "Timeline", "bubble_fraction", "closed_form_bubble", "match_pairs",
           "ends_alive", "peak_alive", "peak_ends_in_flight", "peak_in_flight", "simulate_order", "validate"]


def validate(schedule: Schedule) -> None:
    """Raise ConfigError naming the first wrong action and its rank, or return if the schedule is right."""
    simulate_order(schedule)


def simulate_order(schedule: Schedule, costs: Costs = Costs()) -> Timeline:
    """Run the schedule symbolically (proving it) and return when each action runs."""
    _check_actions(schedule)
    return run_symbolically(schedule, match_pairs(schedule), costs)


def bubble_fraction(schedule: Schedule, costs: Costs = Costs()) -> float:
    """Idle share of the step: sum over ranks of (makespan - busy) / (ranks * makespan).

    With forward 1 and backward 2 this is (p-1)/(m+p-1) for GPipe and 1F1B and
    about (p-1)/(v*m+p-1) for the interleaved schedule (see `closed_form_bubble`).
    """
    return simulate_order(schedule, costs).bubble_fraction()


def closed_form_bubble(pp: int, micro_batches: int, kind: str, virtual_chunks: int = 1) -> float:
    """The textbook bubble: (p-1)/(m+p-1), (p-1)/(v*m+p-1) interleaved, (p-1)/(3m+p-1) for ZB-H1 (F=B=W)."""
    if kind == "zb-h1":
        return (pp - 1) / (3 * micro_batches + pp - 1)
    return (pp - 1) / (virtual_chunks * micro_batches + pp - 1)


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most micro-batch chunks whose activations are alive (forward done, weight gradient not)."""
    return [peak_alive(actions, lambda chunk: True) for actions in schedule.actions]


def peak_ends_in_flight(schedule: Schedule) -> list[tuple[int, int]]:
    """Per rank, the most micro-batches alive at once in the first chunk (the embedding's) and in the last chunk
    (the head's and loss's); 0 on a rank that holds neither. Without virtual chunks these are peak_in_flight's on
    the first and last ranks; with them a rank holds the embedding's or head's activations for the micro-batches of
    one chunk only, far fewer than all the chunks it has in flight (simulator/memory.py's predict_memory)."""
    return [ends_alive(actions, schedule.config.num_chunks) for actions in schedule.actions]


def ends_alive(actions, num_chunks: int) -> tuple[int, int]:
    """One rank's (first chunk's, last chunk's) peak of forwards alive (peak_ends_in_flight)."""
    return peak_alive(actions, lambda chunk: chunk == 0), peak_alive(actions, lambda chunk: chunk == num_chunks - 1)


def peak_alive(actions, counted) -> int:
    """The most forwards of the chunks `counted(chunk)` picks alive at once in a rank's actions (a forward's
    activations live until its backward, or under zero-bubble schedules its weight gradient)."""
    live = peak = 0
    for action in actions:
        if isinstance(action, Forward) and counted(action.chunk):
            live += 1
            peak = max(peak, live)
        elif isinstance(action, (Backward, BackwardWeight)) and counted(action.chunk):
            live -= 1
    return peak


def _check_actions(schedule: Schedule) -> None:
    """Each action on its own: in range, on the rank holding its chunk, talking to the right peer, once."""
    config = schedule.config
    if len(schedule.actions) != config.pp:
        raise ConfigError(f"the schedule lists {len(schedule.actions)} ranks but pp is {config.pp}")
    chunks, stage, p = config.num_chunks, config.zero_stage, config.pp
    gather_phases = ("forward", "backward", "weight") if stage == 3 else ("update",) if stage else ()
    for rank, actions in enumerate(schedule.actions):
        if len(set(actions)) < len(actions):
            seen: set[Action] = set()
            twice = next(action for action in actions if action in seen or seen.add(action))
            raise ConfigError(f"rank {rank} runs {twice} twice: every action runs once per step")
        for action in actions:
            if type(action) in COMPUTE_TYPES and 0 <= action.micro_batch < config.micro_batches \
                    and 0 <= action.chunk < chunks and action.chunk % p == rank:
                continue  # the common case, checked fast
            problem = _problem(action, rank, config, chunks, p, stage, gather_phases)
            if problem:
                raise ConfigError(f"rank {rank}: {action}: {problem}")


def _problem(action, rank, config, chunks, p, stage, gather_phases) -> str | None:
    """What is wrong with one action on its own, or None."""
    if not isinstance(action, Action) or type(action) in (Action, Compute, PointToPoint, DataParallel):
        return "not a schedule action (use Forward, SendActivation, ...)"
    if isinstance(action, (Compute, PointToPoint)) and not 0 <= action.micro_batch < config.micro_batches:
        return f"micro-batch out of range 0..{config.micro_batches - 1}"
    chunk = getattr(action, "chunk", rank)
    if not 0 <= chunk < chunks:
        return f"chunk out of range 0..{chunks - 1}"
    if chunk % p != rank:
        return f"chunk {chunk} lives on rank {chunk % p}"
    if isinstance(action, PointToPoint):
        peer_chunk = chunk + 1 if isinstance(action, (SendActivation, RecvGrad)) else chunk - 1
        if not 0 <= peer_chunk < chunks:
            return f"chunk {chunk} has no neighbour chunk {peer_chunk} to talk to"
        if action.peer_chunk != peer_chunk or action.peer != peer_chunk % p:
            return (f"its peer is chunk {peer_chunk} on rank {peer_chunk % p}, "
                    f"not chunk {action.peer_chunk} on rank {action.peer}")
        if peer_chunk % p == rank:
            return f"chunks {chunk} and {peer_chunk} are both here; they hand over in memory, without a send or receive"
    if isinstance(action, (AllReduceGrads, ReduceScatterGrads)) and type(action) is not reduce_kind(stage):
        return f"ZeRO stage {stage} reduces gradients with {reduce_kind(stage).__name__}"
    bucketed = isinstance(action, (AllReduceGrads, ReduceScatterGrads, GatherParams))
    count = len(config.data_parallel.of(chunk).sizes)
    if bucketed and not 0 <= action.bucket < count:
        return f"bucket out of range 0..{count - 1}"
    if bucketed and not -1 <= getattr(action, "micro_batch", -1) < config.micro_batches:
        return f"micro-batch out of range -1..{config.micro_batches - 1}"
    if isinstance(action, GatherParams) and action.phase not in gather_phases:
        return f"ZeRO stage {stage} gathers weights only in phases {gather_phases}"
    return None


def _transfer(op: PointToPoint) -> tuple[bool, int, int]:
    """What a send or receive carries, the same on both sides: (gradient?, micro-batch, sending chunk)."""
    if type(op) in (SendActivation, SendGrad):
        return type(op) is SendGrad, op.micro_batch, op.chunk
    return type(op) is RecvGrad, op.micro_batch, op.peer_chunk


def match_pairs(schedule: Schedule) -> dict[tuple[int, int], tuple[int, int]]:
    """Pair every send with its receive: (rank, index in its list) -> the partner's (rank, index).

    Between two ranks, per direction, the k-th send meets the k-th receive (posting
    order), as in NCCL; an interpreter can use this map instead of matching again.
    Assumes the actions passed the per-action checks (`validate` runs those first).
    """
    sends: dict[tuple[int, int], list[tuple[int, PointToPoint]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, PointToPoint]]] = defaultdict(list)
    for rank, actions in enumerate(schedule.actions):
        for index, action in enumerate(actions):
            if type(action) in SENDS:
                sends[(rank, action.peer)].append((index, action))
            elif type(action) in RECVS:
                recvs[(action.peer, rank)].append((index, action))
    partners: dict[tuple[int, int], tuple[int, int]] = {}
    for src, dst in sorted(set(sends) | set(recvs)):
        out, into = sends[(src, dst)], recvs[(src, dst)]
        sent = [_transfer(send) for _, send in out]
        received = [_transfer(recv) for _, recv in into]
        if sent != received:
            received_set, sent_set = set(received), set(sent)
            for (_, send), transfer in zip(out, sent):
                if transfer not in received_set:
                    raise ConfigError(f"rank {src} is stuck at {send}: no matching "
                                      f"{type(send.partner(src)).__name__} on rank {dst}")
            for (_, recv), transfer in zip(into, received):
                if transfer not in sent_set:
                    raise ConfigError(f"rank {dst} is stuck at {recv}: no matching send")
            (_, send), (_, recv) = next((s, r) for s, r, a, b in zip(out, into, sent, received) if a != b)
            raise ConfigError(
                f"rank {dst} posts {recv} where rank {src} posts {send}: between two ranks sends and "
                "receives meet in posting order, so list them in the same order on both ranks")
        for (i, _), (j, _) in zip(out, into):
            partners[(src, i)] = (dst, j)
            partners[(dst, j)] = (src, i)
    return partners
