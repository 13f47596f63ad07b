"""The vocabulary of a pipeline schedule: what one rank does, as plain, hashable data. Torch-free.

A schedule is, for every pipeline rank, an ordered list of these actions. Two
interpreters run the very same lists -- the torch executor (parallel/pipeline.py)
and the SimPy simulator -- so every fact they need is in the action itself:
which micro-batch, which chunk (always the *global* chunk index), which peer.

Chunks. With v virtual chunks per rank the model is cut into p*v chunks and
chunk c lives on rank c % p as its local chunk c // p (Megatron's interleaved
assignment): rank r holds chunks r, r+p, r+2p, ... Chunk 0 also holds the
embedding; chunk p*v-1 also holds the head and the loss. Activations flow
from chunk c to chunk c+1 and gradients back, so rank p-1 hands chunk p-1's
output to rank 0 (wrap-around) when v > 1. Neighbouring chunks on the same
rank (only when p == 1) hand over in memory, with no send and no receive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from minigpt.errors import ConfigError

KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1")
ZERO_STAGES = (0, 1, 2, 3)
GATHER_PHASES = ("forward", "backward", "update")


@dataclass(frozen=True, slots=True)
class Action:
    """One thing a rank does in a training step; `name` is short and unique within a rank."""

    @property
    def name(self) -> str:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name


# --- compute -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Compute(Action):
    """Work of one micro-batch on one chunk of layers, on the rank that holds the chunk."""

    micro_batch: int
    chunk: int
    letter = ""  # class attribute, not a field

    @property
    def name(self) -> str:
        return f"{self.letter}{self.micro_batch}c{self.chunk}"

    def __str__(self) -> str:
        return f"{type(self).__name__}(mb {self.micro_batch}, chunk {self.chunk})"


@dataclass(frozen=True, slots=True)
class Forward(Compute):
    letter = "F"


@dataclass(frozen=True, slots=True)
class Backward(Compute):
    """The full backward: input gradient and weight gradient together."""

    letter = "B"


@dataclass(frozen=True, slots=True)
class BackwardInput(Compute):
    """Zero-bubble half: the gradient w.r.t. the chunk's input (on the critical path)."""

    letter = "Bi"


@dataclass(frozen=True, slots=True)
class BackwardWeight(Compute):
    """Zero-bubble half: the weight gradients, deferrable; the activations live until it runs."""

    letter = "W"


# --- point to point ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PointToPoint(Action):
    """A send or receive between the ranks holding `chunk` (here) and `peer_chunk` (on `peer`)."""

    micro_batch: int
    chunk: int
    peer: int
    peer_chunk: int
    prefix = ""  # class attribute
    arrow = ""

    @property
    def name(self) -> str:
        return f"{self.prefix}{self.micro_batch}c{self.chunk}{self.arrow}r{self.peer}"

    def __str__(self) -> str:
        direction = "to" if isinstance(self, (SendActivation, SendGrad)) else "from"
        return f"{type(self).__name__}(mb {self.micro_batch}, chunk {self.chunk}, {direction} rank {self.peer})"


@dataclass(frozen=True, slots=True)
class SendActivation(PointToPoint):
    """Chunk `chunk`'s forward output, to chunk `peer_chunk` == chunk + 1."""

    prefix, arrow = "SendA", ">"

    def partner(self, rank: int) -> "RecvActivation":
        return RecvActivation(self.micro_batch, self.peer_chunk, rank, self.chunk)


@dataclass(frozen=True, slots=True)
class RecvActivation(PointToPoint):
    """The input of chunk `chunk`'s forward, from chunk `peer_chunk` == chunk - 1."""

    prefix, arrow = "RecvA", "<"

    def partner(self, rank: int) -> SendActivation:
        return SendActivation(self.micro_batch, self.peer_chunk, rank, self.chunk)


@dataclass(frozen=True, slots=True)
class SendGrad(PointToPoint):
    """The gradient w.r.t. chunk `chunk`'s input, to chunk `peer_chunk` == chunk - 1."""

    prefix, arrow = "SendG", ">"

    def partner(self, rank: int) -> "RecvGrad":
        return RecvGrad(self.micro_batch, self.peer_chunk, rank, self.chunk)


@dataclass(frozen=True, slots=True)
class RecvGrad(PointToPoint):
    """The gradient w.r.t. chunk `chunk`'s output, from chunk `peer_chunk` == chunk + 1."""

    prefix, arrow = "RecvG", "<"

    def partner(self, rank: int) -> SendGrad:
        return SendGrad(self.micro_batch, self.peer_chunk, rank, self.chunk)


SENDS = (SendActivation, SendGrad)
RECVS = (RecvActivation, RecvGrad)


# --- data parallel -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DataParallel(Action):
    """A collective over the data-parallel group (the replicas of this pipeline rank).

    It never waits for a pipeline peer, so it cannot take part in a pipeline deadlock.
    """


@dataclass(frozen=True, slots=True)
class AllReduceGrads(DataParallel):
    """ZeRO-0 (DDP): all-reduce one gradient bucket of a chunk, after its last backward."""

    chunk: int
    bucket: int = 0

    @property
    def name(self) -> str:
        return f"AllReduce.c{self.chunk}b{self.bucket}"


@dataclass(frozen=True, slots=True)
class ReduceScatterGrads(DataParallel):
    """ZeRO-1/2/3: reduce-scatter one gradient bucket of a chunk into this replica's shard."""

    chunk: int
    bucket: int = 0

    @property
    def name(self) -> str:
        return f"ReduceScatter.c{self.chunk}b{self.bucket}"


@dataclass(frozen=True, slots=True)
class GatherParams(DataParallel):
    """All-gather one bucket of a chunk's weights from the replicas' shards.

    phase "forward"/"backward": ZeRO-3, before the chunk's first forward / first backward;
    phase "update": ZeRO-1/2, after the optimizer step, to refresh the full weights.
    """

    chunk: int
    bucket: int = 0
    phase: str = "forward"

    @property
    def name(self) -> str:
        return f"AllGather.c{self.chunk}b{self.bucket}.{self.phase}"


@dataclass(frozen=True, slots=True)
class OptimizerStep(DataParallel):
    """The optimizer update of every chunk on this rank, after all its gradient reductions."""

    @property
    def name(self) -> str:
        return "OptimizerStep"

    def __str__(self) -> str:
        return "OptimizerStep()"


def reduce_kind(zero_stage: int) -> type[DataParallel]:
    """ZeRO-0 all-reduces gradients; stages 1-3 only need their shard, so they reduce-scatter."""
    return AllReduceGrads if zero_stage == 0 else ReduceScatterGrads


# --- configuration and the schedule ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScheduleConfig:
    """What a schedule is built from; checked on construction, so a bad one never exists."""

    pp: int
    micro_batches: int
    kind: str = "1f1b"
    virtual_chunks: int = 1
    zero_stage: int = 0
    buckets: int = 1  # gradient buckets per chunk: one reduction (and gather) each

    def __post_init__(self) -> None:
        for label, value in (("pipeline size (pp)", self.pp), ("micro-batches", self.micro_batches),
                             ("virtual chunks", self.virtual_chunks), ("buckets per chunk", self.buckets)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{label} must be a whole number >= 1, got {value!r}: pass 1 or more")
        if self.kind not in KINDS:
            raise ConfigError(f"unknown schedule {self.kind!r}: choose one of {', '.join(KINDS)}")
        if self.zero_stage not in ZERO_STAGES:
            raise ConfigError(f"ZeRO stage must be one of 0, 1, 2, 3, got {self.zero_stage!r}")
        if self.virtual_chunks > 1 and self.kind != "interleaved":
            raise ConfigError(
                f"{self.virtual_chunks} virtual chunks need the interleaved schedule, not {self.kind!r}: "
                "use --schedule interleaved or --virtual-chunks 1"
            )
        if self.kind == "interleaved" and self.micro_batches % self.pp:
            raise ConfigError(
                f"the interleaved schedule needs micro-batches to be a multiple of the pipeline size: "
                f"{self.micro_batches} is not a multiple of {self.pp}; "
                f"use e.g. {self.pp * -(-self.micro_batches // self.pp)}"
            )

    @property
    def num_chunks(self) -> int:
        return self.pp * self.virtual_chunks

    def chunks_of(self, rank: int) -> list[int]:
        """The global chunks rank `rank` holds, in local order."""
        return [local * self.pp + rank for local in range(self.virtual_chunks)]


def chunk_rank(chunk: int, pp: int) -> int:
    """The pipeline rank that holds global chunk `chunk`."""
    return chunk % pp


def local_chunk(chunk: int, pp: int) -> int:
    """Where global chunk `chunk` sits among its rank's chunks (0 .. v-1)."""
    return chunk // pp


@dataclass(frozen=True, slots=True)
class Schedule:
    """One training step: `actions[rank]` is what pipeline rank `rank` does, in order."""

    config: ScheduleConfig
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(rank) for rank in self.actions))

    def names(self) -> dict[int, list[str]]:
        return {rank: [action.name for action in actions] for rank, actions in enumerate(self.actions)}


def batches(actions: Sequence[Action]) -> list[tuple[Action, ...]]:
    """Split a rank's actions into what an executor runs as one unit.

    Consecutive sends and receives form one batch (one batch_isend_irecv, then wait
    for all of it); every other action is a batch of its own.
    """
    groups: list[tuple[Action, ...]] = []
    run: list[Action] = []
    for action in actions:
        if isinstance(action, PointToPoint):
            run.append(action)
            continue
        if run:
            groups.append(tuple(run))
            run = []
        groups.append((action,))
    if run:
        groups.append(tuple(run))
    return groups
