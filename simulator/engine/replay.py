"""The SimPy replay of a schedule: one process per pipeline stage, the executor's semantics. Torch-free.

Each process walks its rank's action list (job/schedule.py) in order, split by
`batches`, with the rules of job/schedule_run.py's docstring:
  - compute and data-parallel actions never wait for a pipeline peer: the rank adds their
    seconds to its own clock, which runs ahead of SimPy's, and records each one's start and end;
  - a batch of sends and receives is posted at the rank's clock; each transfer starts when
    both of its sides are posted (rendezvous) and lasts its precomputed p2p time; the batch
    ends with its last transfer. A rank whose partner has not posted yet waits on a SimPy
    event; then one SimPy timeout brings SimPy's clock to the batch's end, so the work
    before the batch and the batch itself cost one timeout (the speed the 1T case needs);
  - data-parallel actions are priced from their place in the list (simulator/engine/data_parallel.py):
    those armed around a compute inside its cost, the others at their turn on the rank's one
    data-parallel stream; SyncEmbedding makes the first and last stage meet; OptimizerStep
    waits for every reduction still in flight, then runs the optimizer.

Attribution, per rank, of every second until the step ends (they add up to the step):
  compute   the matmuls and element-wise work of compute actions
  tp        tensor-parallel collectives inside compute actions (never hidden)
  cp        context parallelism's key/value exchange inside compute actions, what the attention
            does not hide (simulator/engine/context.py)
  dp        data-parallel communication the rank waits for (inside a backward or a ZeRO-3
            forward, before the optimizer, the update gathers: with Overlap.param_gather
            "forward" only what outlasts the wait before and the rank's first forward), and
            what the collectives it hides cost the compute they overlap (Overlap.dp_slowdown)
  pp        in a p2p batch, the duration of the transfer that ended it (it was moving data);
            and what the rank's asynchronous sends cost the compute they overlap
            (Overlap.p2p_slowdown, the sender's side only)
  bubble    in a p2p batch, the rest (waiting for the peer to post), plus the time after
            the rank's last action until the slowest rank ends the step
  optimizer the optimizer step
"""

from __future__ import annotations

from dataclasses import dataclass, field

import simpy

from minigpt.errors import ConfigError
from job.schedule import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    GatherParams,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceTiedGrad,
    Schedule,
    SendActivation,
    SendGrad,
    SyncEmbedding,
    armed_around,
    batches,
)
from simulator.engine.costs import RankCosts
from simulator.engine.links import no_garbage_collection
from simulator.engine.overlap import Overlap, slowed

CATEGORIES = ("compute", "tp", "cp", "ep", "amax", "dp", "pp", "bubble", "optimizer")
_COMPUTE = frozenset((Forward, Backward, BackwardInput, BackwardWeight))


@dataclass
class RankTally:
    """Seconds per category on one rank, its end, and its events (what, start, end).

    `what` is an action, a batch (tuple of actions) or a name: `named_events` turns them into
    the executor's (name, kind, start, end) only when a trace is asked for.
    """

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    end: float = 0.0
    hidden: dict[str, float] = field(default_factory=lambda: {"ep": 0.0})  # overlapped, in no category's seconds
    dp_tail: float = 0.0  # of seconds["dp"], what is exposed after the rank's last compute (the rest inside it)
    events: list[tuple[object, float, float]] = field(default_factory=list)

    def named_events(self) -> list[tuple[str, str, float, float]]:
        named = []
        for what, start, end in self.events:
            if isinstance(what, tuple):
                named.append(("+".join(a.name for a in what), "p2p", start, end))
            elif isinstance(what, str):
                named.append((what, "p2p" if what == "EmbeddingSync" else "dp", start, end))
            else:
                named.append((what.name, "compute" if type(what) in _COMPUTE else "dp", start, end))
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


# per p2p type: (is a send, carries a gradient)
_P2P = {SendActivation: (True, False), SendGrad: (True, True), RecvActivation: (False, False), RecvGrad: (False, True)}


class _Replay:
    """One replay: the SimPy environment, the transfers posted and not yet met, every rank's tally."""

    def __init__(self, schedule: Schedule, costs: list[RankCosts], p2p_seconds: dict[tuple[int, int], float],
                 embedding_sync: float, p2p_overlapped: bool, settings: Overlap | None = None) -> None:
        self.env = simpy.Environment()
        self.schedule, self.costs, self.p2p_seconds = schedule, costs, p2p_seconds
        self.embedding_sync, self.overlapped = embedding_sync, p2p_overlapped
        self.settings = settings
        pp = schedule.config.pp
        self.sending = [0.0] * pp  # when each rank's asynchronous sends stop moving data (p2p overlapped)
        self.meet: dict[tuple, tuple[float, _Waiter | None]] = {}
        self.tallies = [RankTally() for _ in range(pp)]

    def post(self, keys: list, posted: float) -> _Waiter:
        """Post transfers (key, seconds) at `posted`; those whose partner is already posted end now."""
        waiter = _Waiter()
        for key, seconds in keys:
            peer = self.meet.pop(key, None)
            if peer is None:
                self.meet[key] = (posted, waiter)
                waiter.count += 1
            else:
                end = (posted if posted > peer[0] else peer[0]) + seconds
                waiter.ends.append((end, seconds))
                peer[1].arrive(end, seconds)
        if waiter.count:
            waiter.event = self.env.event()
        return waiter

    @staticmethod
    def settle(ends: list, posted: float, totals: list) -> float:
        """A batch's end; the transfer that ended it was moving data (pp), the rest was waiting (bubble)."""
        end = max(e for e, _ in ends)
        moving = max(s for e, s in ends if e >= end - 1e-12 * end)
        totals[0] += moving
        totals[1] += end - posted - moving
        return end

    def exchange(self, rank: int, group: tuple, clock: float):
        """A batch of sends and receives posted at `clock` (a generator: it may wait for peers); returns
        (end, seconds of it spent moving data). post() and settle(), inlined: this is the hot path."""
        meet, p2p_seconds, overlapped = self.meet, self.p2p_seconds, self.overlapped
        waiter, end, moving = None, clock, 0.0
        for op in group:
            send, gradient = _P2P[type(op)]
            if send:
                key, seconds = (rank, op.peer, gradient, op.micro_batch, op.chunk), p2p_seconds[(rank, op.peer)]
            else:
                key, seconds = (op.peer, rank, gradient, op.micro_batch, op.peer_chunk), p2p_seconds[(op.peer, rank)]
            peer = meet.pop(key, None)
            if peer is None:
                if overlapped and send:  # the data leaves now; nobody waits on this side
                    meet[key] = (clock, None)
                    if clock + seconds > self.sending[rank]:
                        self.sending[rank] = clock + seconds
                    continue
                if waiter is None:
                    waiter = _Waiter()
                meet[key] = (clock, waiter)
                waiter.count += 1
            else:
                if not overlapped:
                    finish = (clock if clock > peer[0] else peer[0]) + seconds
                    peer[1].arrive(finish, seconds)
                elif send:  # the receive was posted first: it ends when the data arrives
                    peer[1].arrive(max(peer[0], clock + seconds), seconds)
                    if clock + seconds > self.sending[rank]:
                        self.sending[rank] = clock + seconds
                    continue
                else:  # the send left at peer[0]
                    finish = max(clock, peer[0] + seconds)
                if finish > end or (finish == end and seconds > moving):
                    end, moving = finish, seconds
        if waiter is not None:
            waiter.event = self.env.event()
            yield waiter.event
            for finish, seconds in waiter.ends:
                if finish > end or (finish == end and seconds > moving):
                    end, moving = finish, seconds
        return end, min(moving, end - clock)  # an overlapped receive waits only for what is still moving

    def sync_embedding(self, rank: int, clock: float, pp_bubble: list):
        """The tied embedding's two copies summed: the first and last stage meet (a generator)."""
        waiter = self.post([(("tied",), self.embedding_sync)], clock)
        if waiter.count:
            yield waiter.event
        return self.settle(waiter.ends, clock, pp_bubble)

    def overlap_costs(self, pricer) -> tuple[bool, float, float, bool]:
        """(early, dp slowdown, p2p slowdown, update gathers hidden in the next forward) for one rank.

        early: Overlap.dp "backward", a reduction no compute armed (the tied matrix's bucket) runs during the
        backward too. The slowdowns are what overlapping costs the compute (simulator/engine/overlap.py): slowed
        while the dp stream or an asynchronous send is busy; none on a CPU host whose gloo collectives run in
        turn (pricer.serial)."""
        settings = self.settings
        early = pricer is not None and pricer.settings.dp == "backward"
        dp_slowdown = pricer.settings.dp_slowdown if pricer is not None and not pricer.serial else 0.0
        p2p_slowdown = settings.p2p_slowdown if settings is not None and self.overlapped else 0.0
        return early, dp_slowdown, p2p_slowdown, settings is not None and settings.param_gather == "forward"

    @staticmethod
    def slowdowns(clock: float, total: float, dp_busy: float, sending: float, dp_slowdown: float,
                  p2p_slowdown: float) -> tuple[float, float]:
        """What a compute of `total` seconds starting at `clock` is lengthened by: (while the dp stream, busy until
        `dp_busy`, still moves collectives issued before; then while this rank's sends, until `sending`, move)."""
        dp_extra = pp_extra = 0.0
        if dp_slowdown and dp_busy > clock:
            dp_extra = slowed(clock, total, dp_busy, dp_slowdown) - clock - total
        if p2p_slowdown and sending > clock:
            pp_extra = slowed(clock, total + dp_extra, sending, p2p_slowdown) - clock - total - dp_extra
        return dp_extra, pp_extra

    @staticmethod
    def overhang(overhang: float, first_forward: tuple[float, float] | None, dp_slowdown: float) -> float:
        """What the update gathers still moving at the end of the step add to it; with Overlap.param_gather
        "forward" (first_forward given) the next step's wait and first forward, as in this one, hide them."""
        if first_forward is None:
            return overhang
        start, end = first_forward
        return max(0.0, overhang - end) + dp_slowdown * min(max(0.0, overhang - start), end - start)

    def run(self, rank: int):
        """Rank `rank`'s list, in batches (a SimPy process)."""
        env, tally, cost = self.env, self.tallies[rank], self.costs[rank]
        events, plain, pricer = tally.events, cost.actions, cost.pricer
        groups = batches(self.schedule.actions[rank])
        armed_by, _ = armed_around(groups)
        issued = {action for armed in armed_by.values() for action in armed}  # run inside their compute
        compute = tp = cp = ep = amax = dp = optimizer = 0.0
        dp_computed = 0.0  # the rank's exposed dp seconds when its last compute ended
        pp_bubble, dp_busy = [0.0, 0.0], 0.0  # dp_busy: when the rank's data-parallel stream has done what it was given
        computed = 0.0  # when the rank's last compute ended
        early, dp_slowdown, p2p_slowdown, gathers_into_forward = self.overlap_costs(pricer)
        first_forward = None  # (start, end) of the rank's first forward: the next step's hides the update gathers
        sending = self.sending
        clock = 0.0  # the rank's own time: work that needs no peer runs ahead of env.now
        for index, group in enumerate(groups):
            action = group[0]
            kind = type(action)
            if kind in _COMPUTE:
                armed = armed_by.get(index) if pricer is not None else None
                if armed or (pricer is not None and pricer.sums(action)):  # the latter: ZeRO-3's gradient sums
                    c = pricer.compute(action, armed or (), dp_busy - clock)
                    if c.comm_end is not None:
                        dp_busy = max(dp_busy, clock + c.comm_end)
                else:
                    c = plain[(kind, action.chunk)]
                total = c.total
                if (dp_slowdown and dp_busy > clock and not armed) or (p2p_slowdown and sending[rank] > clock):
                    dp_extra, pp_extra = self.slowdowns(clock, total, dp_busy if not armed else 0.0, sending[rank],
                                                        dp_slowdown, p2p_slowdown)
                    dp += dp_extra
                    pp_bubble[0] += pp_extra
                    total += dp_extra + pp_extra
                if first_forward is None and kind is Forward:
                    first_forward = (clock, clock + total)
                events.append((action, clock, clock + total))
                compute, tp, cp, ep, amax = compute + c.compute, tp + c.tp, cp + c.cp, ep + c.ep, amax + c.amax
                tally.hidden["ep"] += c.ep_hidden
                dp = dp_computed = dp + c.dp
                clock += total
                computed = clock
            elif kind in _P2P:
                end, moving = yield from self.exchange(rank, group, clock)
                pp_bubble[0] += moving
                pp_bubble[1] += end - clock - moving
                events.append((group, clock, end))
                clock = end
                yield env.timeout(clock - env.now)
            elif kind is SyncEmbedding:
                end = yield from self.sync_embedding(rank, clock, pp_bubble)
                events.append(("EmbeddingSync", clock, end))
                clock = end
            elif kind is OptimizerStep:
                ready = max(clock, dp_busy) + (pricer.seconds(action) if pricer is not None else 0.0)
                if ready > clock:
                    events.append(("GradReduce", clock, ready))
                events.append((action, ready, ready + cost.optimizer))
                dp += ready - clock
                optimizer += cost.optimizer
                clock = ready + cost.optimizer
            elif action in issued or pricer is None:  # issued by the compute it is armed for
                events.append((action, clock, clock))
            elif kind is ReduceTiedGrad:  # blocking, behind what the stream still carries
                end = max(clock, dp_busy) + pricer.seconds(action)
                events.append((action, clock, end))
                dp += end - clock
                clock = dp_busy = end
            else:  # issued at its turn and left running: a reduction no compute armed, the update gathers
                start = max(computed if early and kind is not GatherParams else clock, dp_busy)
                dp_busy = start + pricer.seconds(action)
                events.append((action, start, dp_busy))
        if dp_busy > clock:  # the step ends when the update gathers have landed
            overhang = self.overhang(dp_busy - clock, first_forward if gathers_into_forward else None, dp_slowdown)
            dp += overhang
            clock += overhang
        yield env.timeout(clock - env.now)
        tally.end = env.now
        tally.seconds.update(compute=compute, tp=tp, cp=cp, ep=ep, amax=amax, dp=dp, pp=pp_bubble[0],
                             bubble=pp_bubble[1], optimizer=optimizer)
        tally.dp_tail = dp - dp_computed


def replay(schedule: Schedule, costs: list[RankCosts], p2p_seconds: dict[tuple[int, int], float],
           embedding_sync: float = 0.0, p2p_overlapped: bool = False, settings: Overlap | None = None) -> list[RankTally]:
    """Run every rank's list; `p2p_seconds[(sender, receiver)]` per transfer; `embedding_sync` > 0
    makes the first and last rank meet before the optimizer (a tied head on several stages).
    `p2p_overlapped` (simulator/engine/overlap.py): sends do not wait, a receive waits for its data only.
    `settings` (the job's Overlap): its p2p_slowdown (a compute while the rank's own sends move) and
    param_gather; without it neither applies (the dp slowdown is the pricer's settings')."""
    run = _Replay(schedule, costs, p2p_seconds, embedding_sync, p2p_overlapped, settings)
    processes = [run.env.process(run.run(rank)) for rank in range(schedule.config.pp)]
    with no_garbage_collection():
        run.env.run()
    stuck = [rank for rank, process in enumerate(processes) if process.is_alive]
    if stuck:
        raise ConfigError(f"the schedule deadlocks: rank {stuck[0]} never finishes (run job.schedule.validate on it)")
    tallies = run.tallies
    step = max(t.end for t in tallies)
    for tally in tallies:
        tally.seconds["bubble"] += step - tally.end
    return tallies
