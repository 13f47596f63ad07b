"""The data-parallel layout of a run, for the schedule both interpreters run. Torch-free.

`plan_for` cuts every chunk's parameters (job/layout.py: the tensors each rank holds, in
the model's order) the way the executor lays them out: ZeRO 0-2 in gradient buckets of
whole parameters (precision/flat.py), ZeRO-3 in gather units (parallel/data/zero3.py: the
embeddings, each block, the final norm and head), each padded to a multiple of the
ranks ZeRO shards over (Layout.shard_ranks: dp x cp, or a shard group of N under hybrid
sharding). The executor checks its own flat buffers against this plan before
the first step (parallel/run/build.py), so the schedule cannot describe other buckets than
the ones that run. `collectives` says what each data-parallel action moves, and over which
group: what parallel/comm.py counts when the executor runs it, and what the simulator prices.

Hybrid sharding (HSDP, Layout.shard_group N): gathers and reduce-scatters span a shard group;
each reduce-scatter's piece (1/N of the bucket or unit) is then all-reduced over the replica
group (the ranks at the same place in every shard group); the tied copy's all-reduce runs over
the shard group, then the replica group; the squared gradient norm over the shard group only
(every replica group holds the same shards once reduced).
"""

from __future__ import annotations

from typing import NamedTuple

from minigpt.config import GPTConfig
from precision.policy import FORMAT_BYTES, policy as precision_policy, weight_bytes
from job.layout import Layout, Tensor, bucket_members, embedding_copy, stage_units
from job.train_config import bucket_numel
from job.schedule_actions import (
    Action,
    AllReduceGrads,
    ChunkParams,
    DataParallelPlan,
    GatherParams,
    OptimizerStep,
    ReduceScatterGrads,
    ReduceTiedGrad,
    ScheduleConfig,
)

NORM_BYTES = 4  # the squared gradient norm: one fp32 number


def _padded(numel: int, pad_to: int) -> int:
    return -(-numel // pad_to) * pad_to


def _tied_tensor(model: GPTConfig, layout: Layout, chunk: int) -> str | None:
    """The name of this chunk's copy of an embedding split across stages (job/layout.py's embedding_copy: a tied
    head's, or the multi-token prediction's), if it holds one."""
    copy = embedding_copy(model, layout.pp)
    if copy is None:
        return None
    last = layout.pp * layout.virtual_chunks - 1
    return "tok_emb.weight" if chunk == 0 else copy if chunk == last else None


def _chunk_params(tensors: list[Tensor], units: list[list[Tensor]], kept: tuple[bool, ...], zero: int,
                  pad_to: int, bucket_numel: int | None, tied_name: str | None) -> ChunkParams:
    if zero == 3:
        sizes = tuple(_padded(sum(t.numel for t in unit), pad_to) for unit in units)
        members = []
        first = 0
        for unit in units:
            members.append(range(first, first + len(unit)))
            first += len(unit)
    else:
        cut = bucket_members(tensors, bucket_numel, pad_to)
        sizes, members = tuple(size for _, size in cut), [m for m, _ in cut]
        kept = ()
    tied, tied_numel = None, 0
    if tied_name is not None:
        index = next(i for i, t in enumerate(tensors) if t.name == tied_name)
        tied = next(b for b, m in enumerate(members) if index in m)
        tied_numel = tensors[index].numel
    return ChunkParams(sizes, kept, tied, tied_numel)


def plan_for(model: GPTConfig, layout: Layout, bucket_numel: int | None, element_bytes: int) -> DataParallelPlan:
    """Every chunk's buckets (ZeRO 0-2) or units (ZeRO-3) under `layout`'s effective ZeRO stage.

    `bucket_numel`: elements a gradient bucket collects before it is cut (job/train_config.bucket_numel);
    `element_bytes`: of the weights and gradients ZeRO holds (the compute format)."""
    zero, pad_to = layout.effective_zero, layout.shard_ranks  # the stage's dp x cp ranks, or a shard group of them
    chunks = []
    for per_chunk, placed in zip(stage_units(model, layout), layout.rank_chunks(model)):
        count = sum(len(units) for units in per_chunk)
        position = 0
        for (chunk, _), units in zip(placed, per_chunk):
            # ZeRO-3 keeps the rank's first and last unit gathered for the whole step
            kept = tuple(position + i in (0, count - 1) for i in range(len(units)))
            position += len(units)
            tensors = [t for unit in units for t in unit]
            chunks.append((chunk, _chunk_params(tensors, units, kept, zero, pad_to, bucket_numel,
                                                _tied_tensor(model, layout, chunk))))
    return DataParallelPlan(layout.shard_ranks, element_bytes, tuple(sorted(chunks)), layout.shard_replicas,
                            layout.reshard_after_forward or zero != 3, layout.sync_grads_once and zero == 3)


class Call(NamedTuple):
    """One collective: its kind, its bytes in parallel/comm.py's convention, and its group: "shard" (the plan's
    dp ranks: every data rank, or a shard group under hybrid sharding) or "replicas" (the replica group)."""

    kind: str
    nbytes: int
    group: str = "shard"


def collectives(action: Action, plan: DataParallelPlan, fp8_elements: int = 0,
                reduce_bytes: int | None = None) -> list[Call]:
    """Every data-parallel collective `action` issues, in order, in parallel/comm.py's convention (the
    whole buffer for all-reduce, the gathered size for all-gather and reduce-scatter); none over one replica.
    `fp8_elements`: of a gather's elements, the fp8 weights a stack keeping its weights in fp8 gathers at one byte
    each (Implementation.fp8_param_gather; our executor gathers everything in the compute format). `reduce_bytes`:
    the bytes a gradient element travels in when a stack reduces in another format (Implementation.grad_reduce_fp32;
    None: the compute format, as our executor)."""
    if plan.dp * plan.replicas == 1:
        return []
    size = reduce_bytes or plan.element_bytes  # the gradients' reductions; the gathers move weights
    across = plan.replicas > 1
    if isinstance(action, AllReduceGrads):
        return [Call("all_reduce", action.numel * size)]
    if isinstance(action, ReduceScatterGrads):  # hybrid: the piece, all-reduced over the replicas
        piece = [Call("all_reduce", action.numel // plan.dp * size, "replicas")] if across else []
        return [Call("reduce_scatter", action.numel * size)] + piece
    if isinstance(action, GatherParams):
        return [Call("all_gather", weight_bytes(action.numel, fp8_elements, plan.element_bytes))]
    if isinstance(action, ReduceTiedGrad):
        tied = Call("all_reduce", action.numel * size)
        return [tied, tied._replace(group="replicas")] if across else [tied]
    if isinstance(action, OptimizerStep) and action.norm_over_dp:
        return [Call("all_reduce", NORM_BYTES)]
    return []


def schedule_config(model: GPTConfig, layout: Layout, micro_batches: int, kind: str, bucket_mb: float,
                    precision: str) -> ScheduleConfig:
    """The schedule of a run, for both interpreters: its kind over the layout's effective ZeRO
    stage, with the real buckets (`bucket_mb` MiB of the compute format each) and units."""
    element_bytes = FORMAT_BYTES[precision_policy(precision).compute]
    plan = plan_for(model, layout, bucket_numel(bucket_mb, element_bytes), element_bytes)
    return ScheduleConfig(layout.pp, micro_batches, kind, layout.virtual_chunks, layout.effective_zero, plan=plan)


def check_against_plan(plan: DataParallelPlan, sizes: dict[int, tuple[int, ...]], element_bytes: int,
                       kept: dict[int, tuple[bool, ...]] | None = None,
                       sharding: tuple[int, int, bool] | None = None) -> None:
    """Raise unless a rank's real buckets (units), element size and, given, sharding (its group's ranks,
    its replicas, whether ZeRO-3 reshards after the forward) are the plan's."""
    problems = []
    if plan.dp > 1 and element_bytes != plan.element_bytes:
        problems.append(f"elements of {element_bytes} bytes, not {plan.element_bytes}")
    planned = (plan.dp, plan.replicas, plan.reshard_after_forward)
    if sharding is not None and sharding != planned:
        problems.append(f"sharded as (ranks, replicas, reshard after forward) {sharding}, planned {planned}")
    for chunk, real in sorted(sizes.items()):
        expected = plan.of(chunk)
        if real != expected.sizes:
            problems.append(f"chunk {chunk}: sizes {real}, planned {expected.sizes}")
        if kept is not None and kept.get(chunk) != expected.kept:
            problems.append(f"chunk {chunk}: kept units {kept.get(chunk)}, planned {expected.kept}")
    if problems:
        raise RuntimeError("the schedule's data-parallel plan (job/data_parallel.py) disagrees with the model's "
                           "flat buffers: " + "; ".join(problems))
