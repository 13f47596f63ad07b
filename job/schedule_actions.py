"""The vocabulary of a pipeline schedule: what one rank does, as plain, hashable data. Torch-free.

A schedule is, for every pipeline rank, an ordered list of these actions. Two
interpreters run the very same lists -- the torch executor (parallel/pipeline/executor.py)
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
GATHER_PHASES = ("forward", "backward", "weight", "update")


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
    """ZeRO-0 (DDP): all-reduce one gradient bucket of a chunk, once a step after its last weight gradient.

    `numel`: the bucket's elements, padding included (job/data_parallel.py's plan; 0 when symbolic)."""

    chunk: int
    bucket: int = 0
    numel: int = 0

    @property
    def name(self) -> str:
        return f"AllReduce.c{self.chunk}b{self.bucket}"


@dataclass(frozen=True, slots=True)
class ReduceScatterGrads(DataParallel):
    """ZeRO-1/2/3: reduce-scatter one gradient bucket (ZeRO-3: unit) of a chunk into this replica's shard.

    micro_batch -1: once a step, after the chunk's last weight gradient (ZeRO-1, and ZeRO-3 holding its units all
    step, which sums their gradients over the micro-batches: ScheduleConfig.zero3_hold); otherwise after that
    micro-batch's weight gradient (ZeRO-2 and 3 otherwise keep no full gradient to accumulate in)."""

    chunk: int
    bucket: int = 0
    numel: int = 0
    micro_batch: int = -1

    @property
    def name(self) -> str:
        step = "" if self.micro_batch < 0 else f".mb{self.micro_batch}"
        return f"ReduceScatter.c{self.chunk}b{self.bucket}{step}"


@dataclass(frozen=True, slots=True)
class GatherParams(DataParallel):
    """All-gather one bucket (ZeRO-3: unit) of a chunk's weights from the replicas' shards.

    phase "forward"/"backward"/"weight" (a zero-bubble weight gradient): ZeRO-3, right before the compute of `micro_batch` that needs the
    unit while it is not gathered (the executor issues it when the unit before it starts: prefetch);
    phase "update": ZeRO-1/2, after the optimizer step, to refresh the full weights (micro_batch -1).
    """

    chunk: int
    bucket: int = 0
    phase: str = "forward"
    numel: int = 0
    micro_batch: int = -1

    @property
    def name(self) -> str:
        step = "" if self.micro_batch < 0 else f".mb{self.micro_batch}"
        return f"AllGather.c{self.chunk}b{self.bucket}.{self.phase}{step}"


@dataclass(frozen=True, slots=True)
class SyncEmbedding(Action):
    """A tied head on several stages: sum the embedding's and the head copy's gradients over the
    pair of ranks holding chunk 0 and the last chunk. The last thing either does before its
    reductions of that matrix: it waits for the other rank, so it comes after every compute."""

    chunk: int

    @property
    def name(self) -> str:
        return f"SyncEmbedding.c{self.chunk}"

    def __str__(self) -> str:
        return f"SyncEmbedding(chunk {self.chunk})"


@dataclass(frozen=True, slots=True)
class ReduceTiedGrad(DataParallel):
    """ZeRO-2/3: all-reduce the tied copy's summed gradient over the replicas (`numel` elements,
    unpadded); each keeps the pieces of its shard. ZeRO-0/1 add it to a bucket reduced after it."""

    chunk: int
    numel: int = 0

    @property
    def name(self) -> str:
        return f"AllReduceTied.c{self.chunk}"


@dataclass(frozen=True, slots=True)
class OptimizerStep(DataParallel):
    """The optimizer update of every chunk on this rank, after all its gradient reductions.

    `norm_over_dp`: ZeRO 1-3 shard the gradients, so the squared gradient norm (one fp32
    number) is all-reduced over the replicas first."""

    norm_over_dp: bool = False

    @property
    def name(self) -> str:
        return "OptimizerStep"

    def __str__(self) -> str:
        return "OptimizerStep()"


def reduce_kind(zero_stage: int) -> type[DataParallel]:
    """ZeRO-0 all-reduces gradients; stages 1-3 only need their shard, so they reduce-scatter."""
    return AllReduceGrads if zero_stage == 0 else ReduceScatterGrads


# --- the data-parallel layout a schedule is built from --------------------------------------------


@dataclass(frozen=True, slots=True)
class ChunkParams:
    """How one chunk's parameters are cut for data parallelism on its rank.

    `sizes`: elements of each gradient bucket (ZeRO 0-2) or gather unit (ZeRO-3), padding included;
    `kept`: ZeRO-3 units that stay gathered from their first use to the end of the step;
    `tied`: the bucket (unit) holding this chunk's copy of a tied embedding split across stages."""

    sizes: tuple[int, ...]
    kept: tuple[bool, ...] = ()
    tied: int | None = None
    tied_numel: int = 0  # the tied copy's own elements (ZeRO-2/3 all-reduce it unpadded)

    def is_kept(self, unit: int) -> bool:
        return bool(self.kept) and self.kept[unit]


@dataclass(frozen=True, slots=True)
class DataParallelPlan:
    """The real bucket and unit layout of a run (job/data_parallel.py builds it; the executor checks
    its own flat buffers against it), or, `symbolic`, equal unnamed buckets for drawing schedules.

    `dp`: the ranks a reduction and a gather span (Layout.shard_ranks: a shard group under hybrid sharding,
    else every data rank); `replicas`: copies of each shard (hybrid sharding: a reduce-scatter's piece is then
    all-reduced over them); `reshard_after_forward`: ZeRO-3 frees a unit after each forward (job/schedule_comm.py);
    `sync_grads_once`: ZeRO-3 without resharding holds its units all step without pipelining too (holds_all_step)."""

    dp: int
    element_bytes: int  # of the weights and gradients ZeRO moves (the compute format)
    chunks: tuple[tuple[int, ChunkParams], ...]  # (global chunk, its layout), every chunk of the model
    replicas: int = 1
    reshard_after_forward: bool = True
    sync_grads_once: bool = False

    def of(self, chunk: int) -> ChunkParams:
        for index, params in self.chunks:
            if index == chunk:
                return params
        raise KeyError(f"chunk {chunk} is not in the data-parallel plan")

    @classmethod
    def symbolic(cls, num_chunks: int, buckets: int) -> "DataParallelPlan":
        return cls(1, 0, tuple((chunk, ChunkParams((0,) * buckets)) for chunk in range(num_chunks)))


# --- configuration and the schedule ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScheduleConfig:
    """What a schedule is built from; checked on construction, so a bad one never exists."""

    pp: int
    micro_batches: int
    kind: str = "1f1b"
    virtual_chunks: int = 1
    zero_stage: int = 0
    buckets: int = 1  # without a plan: gradient buckets (ZeRO-3: units) per chunk, of unknown size
    plan: DataParallelPlan | None = None  # the run's real buckets and units (job/data_parallel.py)

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

        if self.plan is not None and sorted(c for c, _ in self.plan.chunks) != list(range(self.num_chunks)):
            raise ConfigError(f"the data-parallel plan describes chunks {[c for c, _ in self.plan.chunks]}, "
                              f"not the {self.num_chunks} chunks of this schedule")

    @property
    def num_chunks(self) -> int:
        return self.pp * self.virtual_chunks

    @property
    def data_parallel(self) -> DataParallelPlan:
        """The plan, or `buckets` buckets of unknown size in every chunk."""
        return self.plan or DataParallelPlan.symbolic(self.num_chunks, self.buckets)

    @property
    def zero3_hold(self) -> int:
        """How many backwards of a ZeRO-3 unit in a step end its stay gathered (job/schedule_comm.py's frees_after):
        1 (after each; resharding or not) or, without resharding after the forward under pipelining or with
        sync_grads_once, the step's micro-batches (after the chunk's last backward, as torchtitan runs it). Held so,
        a unit's gradients are summed over the micro-batches, unsharded, and reduce-scattered once, after its last
        backward, as torch's pipelining runs FSDP2 (torch.distributed.pipelining's stage: gradient sync and the
        reshard after the backward off but for the last backward; NeMo Automodel's enable_fsdp_optimizations does
        the same without pipelining)."""
        plan = self.data_parallel
        held = holds_all_step(plan.reshard_after_forward, plan.sync_grads_once, self.pp, self.micro_batches)
        return self.micro_batches if held else 1

    @property
    def sums_grads(self) -> bool:
        """ZeRO-3 holding its units all step (zero3_hold): their gradients summed, reduced once a step."""
        return self.zero_stage == 3 and self.zero3_hold > 1

    def chunks_of(self, rank: int) -> list[int]:
        """The global chunks rank `rank` holds, in local order."""
        return [local * self.pp + rank for local in range(self.virtual_chunks)]


def holds_all_step(reshard_after_forward: bool, sync_grads_once: bool, pp: int, micro_batches: int | None) -> bool:
    """Whether ZeRO-3 keeps its units gathered all step, summing their gradients (ScheduleConfig.zero3_hold): without
    resharding after the forward, under pipelining or with sync_grads_once, over several micro-batches (None:
    several). The one rule for the schedule and for the simulator's memory (simulator/states.py's zero3_hold)."""
    return not reshard_after_forward and (pp > 1 or sync_grads_once) and (micro_batches is None or micro_batches > 1)


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


def armed_around(groups: Sequence[tuple[Action, ...]]) -> tuple[dict[int, tuple[Action, ...]], set[int]]:
    """What both interpreters run a compute with: for each compute's index in `groups` (`batches`),
    the data-parallel actions armed while it runs -- the gathers listed right before it (ZeRO-3:
    issued as its units are needed, one ahead) and the reductions right after it (issued as their
    buckets' gradients come in) -- and the indices that end a run of reductions after a compute
    (ZeRO-2/3 wait for them there)."""
    armed: dict[int, tuple[Action, ...]] = {}
    closes: set[int] = set()
    for index, group in enumerate(groups):
        if not isinstance(group[0], Compute):
            continue
        before, after = index - 1, index + 1
        while before >= 0 and type(groups[before][0]) is GatherParams and groups[before][0].phase != "update":
            before -= 1
        while after < len(groups) and type(groups[after][0]) in (AllReduceGrads, ReduceScatterGrads):
            after += 1
        if after > index + 1 or before < index - 1:
            armed[index] = tuple(g[0] for g in groups[before + 1 : index]) + tuple(g[0] for g in groups[index + 1 : after])
        if after > index + 1:
            closes.add(after - 1)
    return armed, closes


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
