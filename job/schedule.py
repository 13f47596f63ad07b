"""What every pipeline rank does in one training step, as plain data. Torch-free.

`build_schedule(ScheduleConfig(...))` returns a `Schedule`: for each pipeline rank
the ordered list of actions (job/schedule_actions.py) that both the torch
executor and the SimPy simulator run, so a schedule is written once. `validate`
(job/schedule_check.py) runs it symbolically and proves it complete,
matched and deadlock-free; `simulate_order` times it with unit compute costs.

A schedule kind is only an order of compute actions per rank (grouped in slots,
see job/schedule_comm.py); the sends, receives and data-parallel actions
are then placed mechanically, the same way for every kind.

Chunks and layers: the model's blocks are cut into p*v contiguous chunks
(`chunk_layers`); global chunk c runs on rank c % p (Megatron's interleaved
assignment), chunk 0 also holds the embedding, chunk p*v-1 the head and loss.

  gpipe        all forwards in micro-batch order, then all backwards in reverse
               micro-batch order (last in, first out).
  1f1b         PipeDream-flush: p-rank-1 warm-up forwards, then one forward one
               backward, then the remaining backwards; backwards in micro-batch order.
  interleaved  Megatron's interleaved 1F1B over v chunks per rank: micro-batches
               go in groups of p through local chunk 0, then 1, ...; backwards
               walk the chunks in reverse; warm-up (v-1)*p + 2*(p-rank-1)
               forwards (at most m*v); each steady-state forward and backward
               share one slot.
  zb-h1        1F1B with the backward split into BackwardInput (on the critical
               path) and BackwardWeight (deferrable): rank r holds up to r weight
               gradients back while the input gradients run ahead, then, in the
               cool-down, follows each input gradient with one held-back weight
               gradient and ends with the rest. At most p activations are alive
               on any rank, 1F1B's peak (on its rank 0).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Sequence

from minigpt.errors import ConfigError
from job.schedule_actions import (
    GATHER_PHASES,
    KINDS,
    Action,
    AllReduceGrads,
    Backward,
    BackwardInput,
    BackwardWeight,
    ChunkParams,
    Compute,
    DataParallel,
    DataParallelPlan,
    Forward,
    GatherParams,
    OptimizerStep,
    PointToPoint,
    RecvActivation,
    RecvGrad,
    ReduceScatterGrads,
    ReduceTiedGrad,
    Schedule,
    ScheduleConfig,
    SendActivation,
    SendGrad,
    SyncEmbedding,
    armed_around,
    batches,
    chunk_rank,
    local_chunk,
    reduce_kind,
)
from job.schedule_check import (
    Costs,
    TimedAction,
    Timeline,
    bubble_fraction,
    closed_form_bubble,
    match_pairs,
    peak_ends_in_flight,
    peak_in_flight,
    simulate_order,
    validate,
)
from job.schedule_comm import assemble, input_recv, output_send, slot_boundaries, timed_boundaries

__all__ = [
    "GATHER_PHASES", "KINDS", "Action", "AllReduceGrads", "Backward", "BackwardInput",
    "BackwardWeight", "ChunkParams", "Compute", "Costs", "DataParallel", "DataParallelPlan", "Forward",
    "GatherParams", "OptimizerStep", "PointToPoint", "RecvActivation", "RecvGrad", "ReduceScatterGrads",
    "ReduceTiedGrad", "Schedule", "ScheduleConfig", "SendActivation", "SendGrad", "SyncEmbedding",
    "TimedAction", "Timeline", "armed_around", "batches", "bubble_fraction", "build_schedule", "check_stage_layers",
    "chunk_layers", "chunk_rank", "closed_form_bubble", "compute_order", "compute_slots", "count_kinds", "input_recv",
    "local_chunk", "match_pairs", "output_send", "peak_ends_in_flight", "peak_in_flight", "reduce_kind", "simulate_order",
    "validate",
]


def build_schedule(config: ScheduleConfig) -> Schedule:
    """Every rank's actions for one step of `config` (call `validate` to have it proven)."""
    slots = [compute_slots(config, rank) for rank in range(config.pp)]
    orders = [[action for slot in rank_slots for action in slot] for rank_slots in slots]
    if config.kind == "zb-h1":
        boundaries = timed_boundaries(config, orders)
    else:
        boundaries = [slot_boundaries(config, rank, rank_slots) for rank, rank_slots in enumerate(slots)]
    return Schedule(config, tuple(assemble(config, rank, orders[rank], boundaries[rank]) for rank in range(config.pp)))


def chunk_layers(n_layers: int, num_chunks: int, sizes: Sequence[int] = ()) -> list[range]:
    """The transformer blocks of each chunk: contiguous, `sizes` blocks each where given (a stage layout,
    Megatron's pipeline_model_parallel_layout or torchtitan's layers per stage), else sizes differing by at most one.

    The even split gives the first n_layers % num_chunks chunks one block more: the last chunk already
    carries the head and the loss, the heaviest non-block work. A stage layout may leave the first chunk
    (embeddings only) or the last (head and loss only) without blocks, never one between.
    """
    if sizes:
        check_stage_layers(sizes, n_layers, num_chunks)
    elif num_chunks < 1 or n_layers < num_chunks:
        raise ConfigError(
            f"{n_layers} layers cannot fill {num_chunks} pipeline chunks (pp x virtual chunks): "
            "every chunk needs at least one block; use fewer stages or chunks, or more layers"
        )
    else:
        base, extra = divmod(n_layers, num_chunks)
        sizes = [base + (1 if chunk < extra else 0) for chunk in range(num_chunks)]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [range(bounds[i], bounds[i + 1]) for i in range(num_chunks)]


def check_stage_layers(sizes: Sequence[int], n_layers: int, num_chunks: int) -> None:
    """A stage layout: one whole number of blocks per chunk (pp x virtual chunks of them, in global chunk
    order), adding up to the model's layers, at least one in every chunk but the first and the last."""
    if len(sizes) != num_chunks:
        raise ConfigError(f"--stage-layers gives {len(sizes)} chunk(s) but pp x virtual chunks = {num_chunks}: "
                          f"one block count per chunk")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes):
        raise ConfigError(f"--stage-layers takes whole numbers of blocks >= 0, got {list(sizes)}")
    if sum(sizes) != n_layers:
        raise ConfigError(f"--stage-layers adds up to {sum(sizes)} blocks but the model has {n_layers}")
    if any(n == 0 for n in sizes[1:-1]) or (num_chunks == 1 and n_layers == 0):
        raise ConfigError(f"--stage-layers {','.join(map(str, sizes))}: only the first chunk (embeddings) and the "
                          f"last (head and loss) may hold no block")


def count_kinds(actions: Iterable[Action]) -> dict[str, int]:
    """How many actions of each type, by class name."""
    counts: dict[str, int] = {}
    for action in actions:
        counts[type(action).__name__] = counts.get(type(action).__name__, 0) + 1
    return counts


def compute_slots(config: ScheduleConfig, rank: int) -> list[list[Compute]]:
    """The compute actions of `rank`, in order, grouped in slots with no communication inside.

    This is all that tells one schedule kind from another. Except for zb-h1 (timed
    placement), the boundary between two slots carries one batch: the sends of the
    slot before, then the receives of the slot after.
    """
    kinds = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb-h1": _zb_h1}
    return kinds[config.kind](config, rank)


def compute_order(config: ScheduleConfig, rank: int) -> list[Compute]:
    """Only the compute actions of `rank`, in order."""
    return [action for slot in compute_slots(config, rank) for action in slot]


def _gpipe(config: ScheduleConfig, rank: int) -> list[list[Compute]]:
    """All m activations live at once; the backwards free them last-in first-out."""
    m = config.micro_batches
    return [[Forward(i, rank)] for i in range(m)] + [[Backward(i, rank)] for i in reversed(range(m))]


def _one_f_one_b(config: ScheduleConfig, rank: int) -> list[list[Compute]]:
    """GPipe's bubble with at most p - rank activations alive: a backward frees one as soon as it can."""
    m = config.micro_batches
    warmup = min(config.pp - rank - 1, m)
    slots: list[list[Compute]] = [[Forward(i, rank)] for i in range(warmup)]
    for i in range(m - warmup):
        slots += [[Forward(warmup + i, rank)], [Backward(i, rank)]]
    return slots + [[Backward(i, rank)] for i in range(m - warmup, m)]


def _interleaved(config: ScheduleConfig, rank: int) -> list[list[Compute]]:
    """v chunks a rank shrink the bubble v times, for v times the messages and a deeper warm-up."""
    p, v, m = config.pp, config.virtual_chunks, config.micro_batches
    total = m * v

    def step(k: int, backward: bool) -> tuple[int, int]:
        """(micro-batch, global chunk) of the rank's k-th forward or backward."""
        group, within = divmod(k, p * v)
        local = within // p
        if backward:
            local = v - 1 - local
        return group * p + within % p, local * p + rank

    warmup = min((v - 1) * p + 2 * (p - rank - 1), total)
    slots: list[list[Compute]] = [[Forward(*step(k, False))] for k in range(warmup)]
    for k in range(total - warmup):
        slots.append([Forward(*step(warmup + k, False)), Backward(*step(k, True))])
    return slots + [[Backward(*step(k, True))] for k in range(total - warmup, total)]


def _zb_h1(config: ScheduleConfig, rank: int) -> list[list[Compute]]:
    """Input gradients run ahead on the critical path; held-back weight gradients fill the cool-down."""
    m = config.micro_batches
    warmup = min(config.pp - rank - 1, m)
    held_back = rank  # rank r keeps p - r - 1 + 1 + r = p activations at most
    order: list[Compute] = [Forward(i, rank) for i in range(warmup)]
    pending: deque[int] = deque()
    for i in range(m - warmup):
        order += [Forward(warmup + i, rank), BackwardInput(i, rank)]
        pending.append(i)
        if len(pending) > held_back:
            order.append(BackwardWeight(pending.popleft(), rank))
    for i in range(m - warmup, m):
        order.append(BackwardInput(i, rank))
        pending.append(i)
        order.append(BackwardWeight(pending.popleft(), rank))
    order += [BackwardWeight(i, rank) for i in pending]
    return [[action] for action in order]
