"""Running a schedule symbolically: every rank a cursor, the executor's rules, unit-cost ticks. Torch-free.

The executor semantics modelled here (the torch executor must match them):
  - a rank runs its actions in order, split by `batches`: consecutive sends and
    receives are one batch, posted together (one batch_isend_irecv) and waited
    for together; the rank goes on only when every operation of the batch is done;
  - a send and a receive complete together, when both are posted (rendezvous:
    no send is assumed to be buffered, so no schedule relies on buffering);
  - between two ranks, in each direction, operations meet in posting order: the
    k-th send from a to b is the k-th receive on b from a (what NCCL does, and
    gloo with one tag), so both sides must list them in the same order;
  - a compute action never waits: its input must already be here (received, or
    computed on this rank) when the rank reaches it, or the schedule is wrong;
  - data-parallel actions (reductions, all-gathers, optimizer step) talk only to
    the replicas of this same pipeline rank, which run the same list, so they
    never wait for a pipeline peer; they take no time in this model. The one
    pipeline collective outside a batch, SyncEmbedding (first and last rank),
    comes after every compute and batch of both ranks, so it cannot deadlock.

Ticks (unit model, `Costs`): forward 1, backward 2, and for zero-bubble
schedules input gradient 1 and weight gradient 1; communication 0. A batch
ends at the latest tick at which one of its operations met its partner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from minigpt.errors import ConfigError
from job.schedule_actions import (
    RECVS,
    SENDS,
    Action,
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
    ReduceTiedGrad,
    Schedule,
    SendActivation,
    SendGrad,
    SyncEmbedding,
    batches,
)


# what each compute makes true on its rank: forward done, input gradient done ("B"), weight gradient done ("W")
_COMPUTE_FACTS = {Forward: ("F",), Backward: ("B", "W"), BackwardInput: ("B", "Bi"), BackwardWeight: ("W",)}
COMPUTE_TYPES = frozenset(_COMPUTE_FACTS)


@dataclass(frozen=True)
class Costs:
    """Ticks per compute action; everything else takes none."""

    forward: int = 1
    backward: int = 2
    backward_input: int = 1
    backward_weight: int = 1

    def table(self) -> dict[type, int]:
        return {Forward: self.forward, Backward: self.backward,
                BackwardInput: self.backward_input, BackwardWeight: self.backward_weight}

    def of(self, action: Action) -> int:
        return self.table().get(type(action), 0)


class TimedAction(NamedTuple):
    """An action and the ticks it starts and ends at (a tuple: there are many of them)."""

    action: Action
    start: int
    end: int


@dataclass(frozen=True)
class Timeline:
    """Per rank, every action with the tick it starts and ends at, in list order."""

    ranks: tuple[tuple[TimedAction, ...], ...]
    costs: Costs = Costs()

    @property
    def makespan(self) -> int:
        return max((t.end for rank in self.ranks for t in rank), default=0)

    def busy(self, rank: int) -> int:
        """Ticks `rank` computes (waiting inside a batch is not work)."""
        table = self.costs.table()
        return sum(table.get(type(t.action), 0) for t in self.ranks[rank])

    def bubble_fraction(self) -> float:
        """Idle share of the step: sum over ranks of (makespan - busy) / (ranks * makespan)."""
        span = self.makespan
        if span == 0:
            return 0.0
        return 1.0 - sum(self.busy(rank) for rank in range(len(self.ranks))) / (span * len(self.ranks))


class SymbolicRun:
    """Every rank a cursor over its batches; see the module docstring for the rules.

    What a rank holds is a set of facts: ("F", mb, c) forward done, ("B", mb, c)
    input gradient done, ("Bi", mb, c) by BackwardInput, ("W", mb, c) weight
    gradient done, ("act"/"grad", mb, c) received, ("R", c, b, mb) reduced (mb -1:
    once a step), ("G", c, b, phase) gathered, ("S", c) / ("T", c) the tied embedding
    synchronised / reduced, ("step",).
    """

    def __init__(self, schedule: Schedule, partners: dict, costs: Costs):
        self.config, self.partners = schedule.config, partners
        self.actions = schedule.actions
        self.needs = [[self.needs_of(rank, action) for action in actions] for rank, actions in enumerate(self.actions)]
        self.produces = [[self.produces_of(action) for action in actions] for actions in self.actions]
        ticks = costs.table()
        self.groups: list[list[tuple[int, int, bool, int]]] = []  # per rank: (first, end, is a p2p batch, ticks)
        for actions in self.actions:
            first, groups = 0, []
            for group in batches(actions):
                is_batch = type(group[0]) in SENDS or type(group[0]) in RECVS
                groups.append((first, first + len(group), is_batch, ticks.get(type(group[0]), 0)))
                first += len(group)
            self.groups.append(groups)
        p = self.config.pp
        self.position, self.clock = [0] * p, [0] * p
        self.posted: list[tuple[int, int, int] | None] = [None] * p  # the posted batch: (first, end, tick)
        self.matched: list[list[int | None]] = [[None] * len(actions) for actions in schedule.actions]
        self.timed: list[list[TimedAction]] = [[] for _ in range(p)]
        self.done: list[set[tuple]] = [set() for _ in range(p)]

    def finished(self, rank: int) -> bool:
        return self.position[rank] == len(self.groups[rank])

    def execute(self) -> None:
        progress = True
        while progress:
            progress = False
            for rank in range(self.config.pp):
                progress = self.advance(rank) or progress
        stuck = [rank for rank in range(self.config.pp) if not self.finished(rank)]
        if stuck:
            raise ConfigError(self.deadlock_message(stuck[0]))

    def advance(self, rank: int) -> bool:
        """Run `rank` until it waits on a batch or ends; whether anything changed."""
        groups, done, timed, matched = self.groups[rank], self.done[rank], self.timed[rank], self.matched[rank]
        actions, needs, produces = self.actions[rank], self.needs[rank], self.produces[rank]
        position, clock = self.position[rank], self.clock[rank]
        moved = False
        while position < len(groups):
            first, end, is_batch, ticks = groups[position]
            if not is_batch:
                self.check_ready(rank, actions[first], needs[first])
                timed.append(TimedAction(actions[first], clock, clock + ticks))
                clock += ticks
                done.update(produces[first])
                position += 1
                moved = True
                continue
            if self.posted[rank] is None:
                for index in range(first, end):
                    self.check_ready(rank, actions[index], needs[index])
                self.posted[rank] = (first, end, clock)
                moved = True
            posted_at = self.posted[rank][2]
            for index in range(first, end):
                if matched[index] is None:
                    peer, peer_index = self.partners[(rank, index)]
                    peer_batch = self.posted[peer]
                    if peer_batch is None or not peer_batch[0] <= peer_index < peer_batch[1]:
                        break
                    matched[index] = self.matched[peer][peer_index] = max(posted_at, peer_batch[2])
                    moved = True
            else:
                for index in range(first, end):
                    timed.append(TimedAction(actions[index], posted_at, matched[index]))
                    done.update(produces[index])
                clock = max(matched[first:end])
                self.posted[rank] = None
                position += 1
                continue
            break
        self.position[rank], self.clock[rank] = position, clock
        return moved

    def deadlock_message(self, rank: int) -> str:
        first, end = self.groups[rank][self.position[rank]][:2]
        index = next(i for i in range(first, end) if self.matched[rank][i] is None)
        op = self.actions[rank][index]
        peer, _ = self.partners[(rank, index)]
        if self.finished(peer) or self.posted[peer] is None:
            return f"rank {rank} is stuck at {op}: no matching send"
        peer_first, peer_end = self.groups[peer][self.position[peer]][:2]
        blocking = next(self.actions[peer][i] for i in range(peer_first, peer_end) if self.matched[peer][i] is None)
        return (f"rank {rank} is stuck at {op}: deadlock, rank {peer} is stuck at {blocking} and "
                f"posts the matching {type(op.partner(rank)).__name__} only after it; put them in one batch or reorder")

    def check_ready(self, rank: int, action: Action, needs: list[tuple]) -> None:
        """Raise unless everything `action` consumes is already on this rank."""
        done = self.done[rank]
        if type(action) in (Backward, BackwardInput) and ("B", action.micro_batch, action.chunk) in done:
            raise ConfigError(f"rank {rank}: {action} is a second backward of mb {action.micro_batch}, "
                              f"chunk {action.chunk}")
        for fact in needs:
            if fact not in done:
                raise ConfigError(f"rank {rank}: {action} comes before {self.describe(fact)}, which it needs")

    def needs_of(self, rank: int, action: Action) -> list[tuple]:
        config, kind = self.config, type(action)
        if kind is Forward:  # the common case first
            chunk = action.chunk
            if chunk == 0:
                return []
            return [("F", action.micro_batch, chunk - 1) if (chunk - 1) % config.pp == rank
                    else ("act", action.micro_batch, chunk)]
        if kind in (Backward, BackwardInput):
            mb, chunk = action.micro_batch, action.chunk
            facts = [("F", mb, chunk)]
            if chunk < config.num_chunks - 1:
                facts.append(("B", mb, chunk + 1) if (chunk + 1) % config.pp == rank else ("grad", mb, chunk))
            return facts
        if kind is BackwardWeight:
            return [("Bi", action.micro_batch, action.chunk)]
        if kind is SendActivation:
            return [("F", action.micro_batch, action.chunk)]
        if kind is SendGrad:
            return [("B", action.micro_batch, action.chunk)]
        if kind in (AllReduceGrads, ReduceScatterGrads):
            mb = getattr(action, "micro_batch", -1)
            return [("W", m, action.chunk) for m in (range(config.micro_batches) if mb < 0 else [mb])]
        if kind is SyncEmbedding:
            return [("W", m, action.chunk) for m in range(config.micro_batches)]
        if kind is ReduceTiedGrad:
            return [("S", action.chunk)]
        if kind is OptimizerStep:
            return self.reductions(rank)
        if kind is GatherParams and action.phase == "update":
            return [("step",)]
        return []

    def reductions(self, rank: int) -> list[tuple]:
        """The facts of every reduction the optimizer of `rank` waits for."""
        config, plan = self.config, self.config.data_parallel
        per_step = config.zero_stage in (0, 1) or config.sums_grads
        facts: list[tuple] = []
        for chunk in config.chunks_of(rank):
            params = plan.of(chunk)
            for b in range(len(params.sizes)):
                facts += [("R", chunk, b, -1)] if per_step else [("R", chunk, b, m) for m in range(config.micro_batches)]
            if params.tied is not None and config.zero_stage >= 2:
                facts.append(("T", chunk))
        return facts

    @staticmethod
    def produces_of(action: Action) -> list[tuple]:
        kind = type(action)
        if kind in _COMPUTE_FACTS:
            return [(fact, action.micro_batch, action.chunk) for fact in _COMPUTE_FACTS[kind]]
        if kind in (RecvActivation, RecvGrad):
            return [("act" if kind is RecvActivation else "grad", action.micro_batch, action.chunk)]
        if kind in (AllReduceGrads, ReduceScatterGrads):
            return [("R", action.chunk, action.bucket, getattr(action, "micro_batch", -1))]
        if kind is GatherParams:
            return [("G", action.chunk, action.bucket, action.phase)]
        if kind is SyncEmbedding:
            return [("S", action.chunk)]
        if kind is ReduceTiedGrad:
            return [("T", action.chunk)]
        return [("step",)] if kind is OptimizerStep else []

    def describe(self, fact: tuple) -> str:
        """A fact as the action (or work) that makes it true, for messages."""
        what, *rest = fact
        p = self.config.pp
        if what in ("F", "Bi"):
            return str((Forward if what == "F" else BackwardInput)(*rest))
        if what == "B":
            return f"the backward of mb {rest[0]}, chunk {rest[1]}"
        if what == "W":
            return f"the weight gradient of mb {rest[0]}, chunk {rest[1]}"
        if what == "act":
            return str(RecvActivation(rest[0], rest[1], (rest[1] - 1) % p, rest[1] - 1))
        if what == "grad":
            return str(RecvGrad(rest[0], rest[1], (rest[1] + 1) % p, rest[1] + 1))
        if what == "R":
            chunk, bucket, mb = rest
            step = "once a step" if mb < 0 else f"micro-batch {mb}"
            return f"the gradient reduction of chunk {chunk}, bucket {bucket} ({step})"
        if what == "G":
            return f"a gather of chunk {rest[0]}, bucket {rest[1]} ({rest[2]})"
        if what == "S":
            return str(SyncEmbedding(rest[0]))
        if what == "T":
            return f"the tied gradient's all-reduce of chunk {rest[0]}"
        return "OptimizerStep()"

    def check_complete(self) -> None:
        """Every micro-batch through every chunk, forward and backward; every reduction, gather and the step."""
        config = self.config
        stage = config.zero_stage
        for rank in range(config.pp):
            done = self.done[rank]
            wanted: list[tuple] = []
            for chunk in config.chunks_of(rank):
                for mb in range(config.micro_batches):
                    wanted += [("F", mb, chunk), ("B", mb, chunk), ("W", mb, chunk)]
                units = range(len(config.data_parallel.of(chunk).sizes))
                if stage == 3:  # every unit gathered for its first forward and, unless kept, a backward
                    wanted += [("G", chunk, b, "forward") for b in units]
                elif stage:
                    wanted += [("G", chunk, b, "update") for b in units]
            for fact in wanted + self.reductions(rank) + [("step",)]:
                if fact not in done:
                    raise ConfigError(f"rank {rank} never runs {self.describe(fact)}: the step is incomplete")


def run_symbolically(schedule: Schedule, partners: dict[tuple[int, int], tuple[int, int]], costs: Costs) -> Timeline:
    """Execute every rank's list under the rules above; raise ConfigError at the first thing that breaks them."""
    run = SymbolicRun(schedule, partners, costs)
    run.execute()
    run.check_complete()
    return Timeline(tuple(tuple(rank) for rank in run.timed), costs)
