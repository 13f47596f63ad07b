"""The SimPy replay of a schedule: one process per pipeline stage, the executor's semantics. Torch-free.

Each process walks its rank's action list (parallel/schedule.py) in order, split by
`batches`, with the rules of parallel/schedule_run.py's docstring:
  - compute and data-parallel actions never wait for a pipeline peer: the rank adds their
    seconds to its own clock, which runs ahead of SimPy's, and records each one's start and end;
  - a batch of sends and receives is posted at the rank's clock; each transfer starts when
    both of its sides are posted (rendezvous) and lasts its precomputed p2p time; the batch
    ends with its last transfer. A rank whose partner has not posted yet waits on a SimPy
    event; then one SimPy timeout brings SimPy's clock to the batch's end, so the work
    before the batch and the batch itself cost one timeout (the speed the 1T case needs);
  - at OptimizerStep: the tied embedding's gradient sync (first and last stage meet), the
    wait for the gradient reductions still in flight, the optimizer; ZeRO-1/2's
    update gathers follow as their own actions.

Attribution, per rank, of every second until the step ends (they add up to the step):
  compute   the matmuls and element-wise work of compute actions
  tp        tensor-parallel collectives inside compute actions (never hidden)
  dp        data-parallel communication the rank waits for (inside a backward or a ZeRO-3
            forward, before the optimizer, the update gathers)
  pp        in a p2p batch, the duration of the transfer that ended it (it was moving data)
  bubble    in a p2p batch, the rest (waiting for the peer to post), plus the time after
            the rank's last action until the slowest rank ends the step
  optimizer the optimizer step
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import simpy

from minigpt.errors import ConfigError
from parallel.schedule import (
    AllReduceGrads,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    GatherParams,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceScatterGrads,
    Schedule,
    SendActivation,
    SendGrad,
    batches,
)
from simulator.engine_costs import RankCosts

CATEGORIES = ("compute", "tp", "dp", "pp", "bubble", "optimizer")
_LETTER = {Forward: "F", Backward: "B", BackwardInput: "Bi", BackwardWeight: "W"}


@dataclass
class RankTally:
    """Seconds per category on one rank, its end, and its events (what, start, end).

    `what` is an action, a batch (tuple of actions) or a name: `named_events` turns them into
    the executor's (name, kind, start, end) only when a trace is asked for.
    """

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    end: float = 0.0
    events: list[tuple[object, float, float]] = field(default_factory=list)

    def named_events(self) -> list[tuple[str, str, float, float]]:
        named = []
        for what, start, end in self.events:
            if isinstance(what, tuple):
                named.append(("+".join(a.name for a in what), "p2p", start, end))
            elif isinstance(what, str):
                named.append((what, "p2p" if what == "EmbeddingSync" else "dp", start, end))
            else:
                named.append((what.name, "compute" if type(what) in _LETTER else "dp", start, end))
        return named


class _Waiter:
    """A posted batch: how many of its transfers still miss their partner, and their ends."""

    __slots__ = ("count", "ends", "event")

    def __init__(self) -> None:
        self.count, self.ends, self.event = 0, [], None

    def arrive(self, end: float, seconds: float) -> None:
        self.ends.append((end, seconds))
        self.count -= 1
        if self.count == 0:
            self.event.succeed()


@contextmanager
def no_garbage_collection() -> Iterator[None]:
    """Pause the cyclic garbage collector: a big replay allocates ~10^5 tuples that it would scan
    again and again (a third of the replay's time at 3,000 GPUs); nothing here makes cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# per p2p type: (is a send, carries a gradient)
_P2P = {SendActivation: (True, False), SendGrad: (True, True), RecvActivation: (False, False), RecvGrad: (False, True)}


def replay(schedule: Schedule, costs: list[RankCosts], p2p_seconds: dict[tuple[int, int], float],
           embedding_sync: float = 0.0) -> list[RankTally]:
    """Run every rank's list; `p2p_seconds[(sender, receiver)]` per transfer; `embedding_sync` > 0
    makes the first and last rank meet before the optimizer (a tied head on several stages)."""
    env = simpy.Environment()
    pp = schedule.config.pp
    meet: dict[tuple, tuple[float, _Waiter]] = {}
    tallies = [RankTally() for _ in range(pp)]
    sync_ranks = {0, pp - 1} if embedding_sync > 0 and pp > 1 else set()
    meet_pop = meet.pop

    def post(keys: list, posted: float) -> _Waiter:
        """Post transfers (key, seconds) at `posted`; those whose partner is already posted end now."""
        waiter = _Waiter()
        for key, seconds in keys:
            peer = meet.pop(key, None)
            if peer is None:
                meet[key] = (posted, waiter)
                waiter.count += 1
            else:
                end = (posted if posted > peer[0] else peer[0]) + seconds
                waiter.ends.append((end, seconds))
                peer[1].arrive(end, seconds)
        if waiter.count:
            waiter.event = env.event()
        return waiter

    def settle(ends: list, posted: float, totals: list) -> float:
        """A batch's end; the transfer that ended it was moving data (pp), the rest was waiting (bubble)."""
        end = max(e for e, _ in ends)
        moving = max(s for e, s in ends if e >= end - 1e-12 * end)
        totals[0] += moving
        totals[1] += end - posted - moving
        return end

    def run(rank: int):
        tally, cost = tallies[rank], costs[rank]
        events, actions = tally.events, cost.actions
        actions_list = schedule.actions[rank]
        last_grad = next((a for a in reversed(actions_list) if type(a) in (Backward, BackwardWeight)), None)
        reductions = "+".join(a.name for a in actions_list if type(a) in (AllReduceGrads, ReduceScatterGrads))
        first_forward: set[int] = set()
        compute = tp = dp = optimizer = 0.0
        pp_bubble = [0.0, 0.0]
        comm_end = None  # when the reductions started by the last gradient action finish
        clock = 0.0  # the rank's own time: work that needs no peer runs ahead of env.now
        for group in batches(actions_list):
            action = group[0]
            kind = type(action)
            letter = _LETTER.get(kind)
            if letter is not None:
                if kind is Forward and action.chunk not in first_forward:
                    first_forward.add(action.chunk)
                    letter = "F1"
                elif action is last_grad:
                    letter += "last"
                c = actions[(letter, action.chunk)]
                events.append((action, clock, clock + c.total))
                if c.comm_end is not None:
                    comm_end = clock + c.comm_end
                compute += c.compute
                tp += c.tp
                dp += c.dp
                clock += c.total
            elif kind in _P2P:  # post() and settle(), inlined: this is the hot path
                waiter, end, moving = None, clock, 0.0
                for op in group:
                    send, gradient = _P2P[type(op)]
                    if send:
                        key, seconds = (rank, op.peer, gradient, op.micro_batch, op.chunk), p2p_seconds[(rank, op.peer)]
                    else:
                        key, seconds = (op.peer, rank, gradient, op.micro_batch, op.peer_chunk), p2p_seconds[(op.peer, rank)]
                    peer = meet_pop(key, None)
                    if peer is None:
                        if waiter is None:
                            waiter = _Waiter()
                        meet[key] = (clock, waiter)
                        waiter.count += 1
                    else:
                        finish = (clock if clock > peer[0] else peer[0]) + seconds
                        peer[1].arrive(finish, seconds)
                        if finish > end or (finish == end and seconds > moving):
                            end, moving = finish, seconds
                if waiter is not None:
                    waiter.event = env.event()
                    yield waiter.event
                    for finish, seconds in waiter.ends:
                        if finish > end or (finish == end and seconds > moving):
                            end, moving = finish, seconds
                pp_bubble[0] += moving
                pp_bubble[1] += end - clock - moving
                events.append((group, clock, end))
                clock = end
                yield env.timeout(clock - env.now)
            elif kind is OptimizerStep:
                if rank in sync_ranks:
                    waiter = post([(("tied",), embedding_sync)], clock)
                    if waiter.count:
                        yield waiter.event
                    end = settle(waiter.ends, clock, pp_bubble)
                    events.append(("EmbeddingSync", clock, end))
                    clock = end
                ready = max(clock, comm_end if comm_end is not None else clock) + cost.reduce_before_step
                if ready > clock:
                    events.append((reductions or "GradReduce", clock, ready))
                    dp += ready - clock
                events.append((action, ready, ready + cost.optimizer))
                optimizer += cost.optimizer
                clock = ready + cost.optimizer
            elif kind is GatherParams and action.phase == "update":
                gather = cost.update_gather.get(action.chunk, 0.0) if action.bucket == 0 else 0.0
                events.append((action, clock, clock + gather))
                dp += gather
                clock += gather
            else:  # reductions and ZeRO-3 gathers: their work is inside the compute actions (marks, as in the executor)
                events.append((action, clock, clock))
        yield env.timeout(clock - env.now)
        tally.end = env.now
        tally.seconds.update(compute=compute, tp=tp, dp=dp, pp=pp_bubble[0], bubble=pp_bubble[1], optimizer=optimizer)

    processes = [env.process(run(rank)) for rank in range(pp)]
    with no_garbage_collection():
        env.run()
    stuck = [rank for rank, process in enumerate(processes) if process.is_alive]
    if stuck:
        raise ConfigError(f"the schedule deadlocks: rank {stuck[0]} never finishes (run parallel.schedule.validate on it)")
    step = max(t.end for t in tallies)
    for tally in tallies:
        tally.seconds["bubble"] += step - tally.end
    return tallies
