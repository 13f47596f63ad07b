"""ZeRO data parallelism, stages 0-2, written here on torch.distributed.

All stages lay the parameters out flat (precision/flat.py) in buckets of whole
parameters, each padded to a multiple of the data-parallel size N, and start a
bucket's collective from a post-accumulate-grad hook as soon as its last
gradient is in, so communication overlaps the rest of the backward pass.
Rank r owns piece r of every bucket; the optimizer updates those pieces of the
flat weights in place (no second copy of the weights).

  stage 0  (DDP)   every rank keeps all weights, gradients and optimizer states;
                   gradients are all-reduced bucket by bucket.
  stage 1          fp32 masters and AdamW moments for the rank's pieces only.
                   Gradients are accumulated in a full buffer and reduce-scattered
                   (the ZeRO paper's P_os: a rank needs only its pieces reduced,
                   so an all-reduce would move half as much again for nothing),
                   as many in the air as there are buckets (their outputs are 1/N);
                   after the update the new weights are all-gathered.
  stage 2          no full gradient buffer: each parameter's gradient is copied
                   into its bucket's staging buffer and dropped; a full bucket is
                   reduce-scattered into the rank's gradient shard and freed, every
                   micro-batch, with at most MAX_IN_FLIGHT buckets in the air.
Stage 3 (parameters sharded too) is parallel/data/zero3.py; parallel/run/build.py picks the stage.

Gradients are divided by N before they are summed, so the sum is the mean over
the global batch. With a single data-parallel rank every stage is stage 0.

Hybrid sharding (HSDP, `replicas`): stages 1-3 shard over the N ranks of `comm`, a shard group, and
`replicas` is the replica group (the ranks at the same place in every shard group); every
reduce-scatter's piece is then all-reduced over it, as it lands, and gradients are divided by
N x replicas. Without hybrid sharding `replicas` has one rank and does nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from job.schedule_actions import AllReduceGrads, GatherParams, ReduceScatterGrads
from parallel.comm import Collectives
from precision.flat import Bucket, FlatParameters, gather_ranges

BUCKET_REDUCTIONS = (AllReduceGrads, ReduceScatterGrads)
MAX_IN_FLIGHT = 2  # stage 2's reduce-scatters allowed to overlap the backward at once (bounds staging memory)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def add_to_shard(comm: Collectives, shard_grad: torch.Tensor, grad: torch.Tensor, segment, pieces,
                 replicas: Collectives) -> None:
    """Average `grad` (one parameter's, laid at `segment` of a flat space) over the group and the
    replicas (hybrid sharding: one all-reduce over each) and add the parts that fall in this rank's
    `pieces` ((start, end) of the flat space, offset in `shard_grad`) -- for a gradient made outside
    the hooks, such as a tied copy's."""
    full = grad.reshape(-1).to(shard_grad.dtype) / (comm.size * replicas.size)
    comm.all_reduce(full)
    replicas.all_reduce(full)
    for (start, end), offset in pieces:
        lo, hi = max(start, segment.start), min(end, segment.end)
        if lo < hi:
            shard_grad[offset + lo - start : offset + hi - start].add_(full[lo - segment.start : hi - segment.start])


class Replicated:
    """Stage 0: DDP with bucketed, overlapped gradient all-reduce.

    Every collective is a schedule action (job/schedule_actions.py) the executor hands to `issue`.
    The reductions listed right after a compute are armed for it (`begin_compute`); a bucket's
    hook, once its last gradient of that compute is in, issues the armed reduction at once, so
    it overlaps the rest of the backward; the action's own turn in the list then finds it done
    (or issues it: a bucket no gradient reached). A reduction not armed waits for its turn."""

    stage = 0

    def __init__(self, model: nn.Module, comm: Collectives, bucket_numel: int, grads: bool = True,
                 replicas: Collectives | None = None):
        self.comm = comm
        self.replicas = replicas or Collectives(None, "dp_replicas")  # hybrid sharding (stages 1-2): module docstring
        groups = model.parameter_groups() if hasattr(model, "parameter_groups") else None
        self.flat = FlatParameters(model, bucket_numel=bucket_numel, pad_to=comm.size, grads=grads, groups=groups)
        self.ranges = [(0, self.flat.padded_numel)]
        chunk_ids = model.chunk_ids() if hasattr(model, "chunk_ids") else [0]
        self.key_of: dict[int, tuple[int, int]] = {}  # bucket index -> (global chunk, bucket within it)
        for bucket in self.flat.buckets:
            chunk = chunk_ids[bucket.group]
            self.key_of[bucket.index] = (chunk, sum(1 for k in self.key_of.values() if k[0] == chunk))
        self.bucket_at = {key: self.flat.buckets[index] for index, key in self.key_of.items()}
        self.in_flight: list[tuple] = []  # (handle, bucket, output, staging)
        self.pending: dict[int, int] = {}  # bucket index -> gradients still to come in this compute
        self.armed: dict[tuple[int, int], object] = {}  # (chunk, bucket) -> its reduction after this compute
        self.issued: set = set()
        self.updates: list = []  # handles of the update gathers (stages 1, 2)
        self.comm_buffer_peak = 0
        for index, param in enumerate(self.flat.params):
            param.register_post_accumulate_grad_hook(lambda p, i=index: self.on_grad(i, p))

    @property
    def weights(self) -> list[torch.Tensor]:
        """This rank's pieces of the flat weights, which the optimizer updates in place."""
        return [self.flat.data[start:end] for start, end in self.ranges]

    @property
    def decay_ranges(self) -> list[tuple[int, int]]:
        return self.flat.decay_ranges(self.ranges)

    def ranges_of(self, param_ids: set[int]) -> list[tuple[int, int]]:
        """Where the parameters `param_ids` lie in `weights` laid end to end."""
        return self.flat.local_ranges(self.ranges, lambda index: id(self.flat.params[index]) in param_ids)

    def sharding(self) -> tuple[int, int, bool]:
        """(ranks a reduction spans, copies of each shard, whether ZeRO-3 reshards after the forward): the plan's."""
        return self.comm.size, self.replicas.size, True

    def layout(self) -> dict[int, tuple[int, ...]]:
        """Each chunk's bucket sizes (padding included), to check against the schedule's plan."""
        sizes: dict[int, list[int]] = {}
        for bucket in self.flat.buckets:
            sizes.setdefault(self.key_of[bucket.index][0], []).append(bucket.numel)
        return {chunk: tuple(s) for chunk, s in sizes.items()}

    # ---------------------------------------------------------------- the step, action by action

    def begin_step(self) -> None:
        self.flat.zero_grad()
        self.issued = set()

    def begin_compute(self, chunk: int, armed: list) -> None:
        """A compute of `chunk` starts; `armed`: the data-parallel actions listed around it."""
        self.pending = {b.index: len(b.params) for key, b in self.bucket_at.items() if key[0] == chunk}
        self.armed = {(a.chunk, a.bucket): a for a in armed if isinstance(a, BUCKET_REDUCTIONS)}

    def end_compute(self) -> None:
        self.armed = {}

    def on_grad(self, index: int, param: torch.Tensor) -> None:
        bucket = self.flat.bucket_of[index]
        if bucket.index not in self.pending:
            return
        self.pending[bucket.index] -= 1
        if self.pending[bucket.index] == 0:
            self.bucket_ready(bucket)

    def bucket_ready(self, bucket: Bucket) -> None:
        """Every gradient of `bucket` is in for this compute: start its reduction if it is armed."""
        action = self.armed.get(self.key_of[bucket.index])
        if action is not None:
            self.issue(action)

    def issue(self, action) -> None:
        """Run one data-parallel action of the schedule (a reduction issued early is not issued again)."""
        if action in self.issued:
            return
        self.issued.add(action)
        if isinstance(action, BUCKET_REDUCTIONS):
            self.launch(self.bucket_at[(action.chunk, action.bucket)])
        elif isinstance(action, GatherParams) and action.phase == "update":
            self.gather_update(self.bucket_at[(action.chunk, action.bucket)])
        else:
            raise ValueError(f"ZeRO stage {self.stage} cannot run {action}")

    def launch(self, bucket: Bucket) -> None:
        grads = self.flat.grad[bucket.start : bucket.end]
        if self.comm.size > 1:
            grads.div_(self.comm.size)
        self.in_flight.append((self.comm.all_reduce(grads, async_op=True), bucket, None, None))

    def gather_update(self, bucket: Bucket) -> None:
        raise ValueError("ZeRO-0 holds every weight: there is nothing to gather")

    def end_reductions(self) -> None:
        """After a micro-batch's reductions (ZeRO-2 frees its staging buffers here)."""

    def before_weight_grads(self, params: list[torch.Tensor]) -> None:
        """Called before a zero-bubble weight gradient of `params`: every weight is here already."""

    def add_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Add a gradient computed outside autograd's hooks (a tied copy's), before the reduction."""
        segment = self.flat.segments[self.index_of(param)]
        self.flat.grad[segment.start : segment.end].add_(grad.reshape(-1))

    def index_of(self, param: torch.Tensor) -> int:
        return next(i for i, p in enumerate(self.flat.params) if p is param)

    def wait_in_flight(self, keep: int = 0) -> None:
        """Finish collectives, oldest first, until at most `keep` are in the air."""
        while len(self.in_flight) > keep:
            handle, bucket, output, _ = self.in_flight.pop(0)
            handle.wait()
            if output is not None:
                self.replicas.all_reduce(output)  # hybrid sharding: the piece summed over the replicas
                self.land(bucket, output)

    def land(self, bucket: Bucket, output: torch.Tensor) -> None:
        """Where a finished reduce-scatter's piece goes (stages 1 and 2)."""

    def finish_grads(self) -> torch.Tensor:
        """Wait for every reduction; the optimizer's gradients, laid out like `weights` end to end."""
        self.wait_in_flight()
        if self.ranges == [(0, self.flat.padded_numel)]:
            return self.flat.grad  # this rank owns everything: no copy
        return gather_ranges(self.flat.grad, self.ranges)

    def after_update(self) -> None:
        """Outside a scheduled step (a loaded checkpoint): refresh every weight. Stage 0 holds them all."""

    def end_step(self) -> None:
        for handle in self.updates:
            handle.wait()
        self.updates = []

    # ---------------------------------------------------------------- the optimizer's reductions

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return value

    # ---------------------------------------------------------------- accounting

    def parameter_storages(self) -> set[int]:
        """Storages that hold weights (left out when activations are measured)."""
        return {self.flat.data.untyped_storage().data_ptr()}

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and (peak) communication buffers."""
        return {
            "parameters": nbytes(self.flat.data),
            "gradients": 0 if self.flat.grad is None else nbytes(self.flat.grad),
            "comm_buffers": self.comm_buffer_peak,
        }


class ShardedOptimizer(Replicated):
    """Stage 1: optimizer states for this rank's pieces; gradients reduce-scattered; weights all-gathered."""

    stage = 1

    def __init__(self, model: nn.Module, comm: Collectives, bucket_numel: int, grads: bool = True,
                 replicas: Collectives | None = None):
        super().__init__(model, comm, bucket_numel, grads=grads, replicas=replicas)
        self.ranges = self.flat.shard_ranges(comm.rank, comm.size)

    def launch(self, bucket: Bucket) -> None:
        self.reduce_scatter(bucket, self.flat.grad[bucket.start : bucket.end])

    def reduce_scatter(self, bucket: Bucket, grads: torch.Tensor, staging: torch.Tensor | None = None) -> None:
        if self.comm.size * self.replicas.size > 1:
            grads.div_(self.comm.size * self.replicas.size)
        output = torch.empty(bucket.numel // self.comm.size, dtype=grads.dtype, device=grads.device)
        handle = self.comm.reduce_scatter(output, grads, async_op=True)
        self.in_flight.append((handle, bucket, output, staging))  # staging lives until it is done
        self.comm_buffer_peak = max(self.comm_buffer_peak, self.buffer_bytes())
        if self.stage == 2:  # its staging buffers are whole buckets: bound them; stage 1's pieces are 1/N
            self.wait_in_flight(keep=MAX_IN_FLIGHT)

    def buffer_bytes(self) -> int:
        return sum(nbytes(out) + (nbytes(staging) if staging is not None else 0) for _, _, out, staging in self.in_flight)

    def land(self, bucket: Bucket, output: torch.Tensor) -> None:
        start, end = self.ranges[bucket.index]
        self.flat.grad[start:end].copy_(output)

    def gather_update(self, bucket: Bucket) -> None:
        """All-gather the updated pieces of `bucket` (waited for at the end of the step)."""
        start, end = self.ranges[bucket.index]
        piece = self.flat.data[start:end].clone()  # the input may not alias the output
        self.updates.append(self.comm.all_gather(self.flat.data[bucket.start : bucket.end], piece, async_op=True))

    def after_update(self) -> None:
        for bucket in self.flat.buckets:
            self.gather_update(bucket)
        self.end_step()

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return self.comm.sum(value)


class ShardedGradients(ShardedOptimizer):
    """Stage 2: gradients reduce-scattered bucket by bucket into this rank's shard; no full gradient kept."""

    stage = 2

    def __init__(self, model: nn.Module, comm: Collectives, bucket_numel: int, replicas: Collectives | None = None):
        super().__init__(model, comm, bucket_numel, grads=False, replicas=replicas)
        self.shard_grad = torch.zeros(sum(e - s for s, e in self.ranges), dtype=self.flat.dtype, device=self.flat.device)
        self.piece_offsets = []
        offset = 0
        for start, end in self.ranges:
            self.piece_offsets.append(offset)
            offset += end - start
        self.staging: dict[int, torch.Tensor] = {}

    def begin_step(self) -> None:
        super().begin_step()
        self.shard_grad.zero_()

    def on_grad(self, index: int, param: torch.Tensor) -> None:
        bucket = self.flat.bucket_of[index]
        if bucket.index not in self.pending:
            raise RuntimeError(f"ZeRO-2: a gradient of bucket {self.key_of[bucket.index]} outside a backward of its "
                               "chunk: there is no buffer to keep it in")
        if bucket.index not in self.staging:
            self.staging[bucket.index] = torch.zeros(bucket.numel, dtype=self.flat.dtype, device=self.flat.device)
        segment = self.flat.segments[index]
        self.staging[bucket.index][segment.start - bucket.start : segment.end - bucket.start].copy_(param.grad.reshape(-1))
        param.grad = None
        super().on_grad(index, param)

    def bucket_ready(self, bucket: Bucket) -> None:
        if self.key_of[bucket.index] not in self.armed:
            raise RuntimeError(f"ZeRO-2: bucket {self.key_of[bucket.index]} is ready but the schedule reduces no "
                               "such bucket after this compute")
        super().bucket_ready(bucket)

    def launch(self, bucket: Bucket) -> None:
        staging = self.staging.pop(bucket.index, None)
        if staging is None:  # no parameter of this bucket got a gradient
            staging = torch.zeros(bucket.numel, dtype=self.flat.dtype, device=self.flat.device)
        self.reduce_scatter(bucket, staging, staging)

    def buffer_bytes(self) -> int:
        return super().buffer_bytes() + sum(nbytes(t) for t in self.staging.values())

    def land(self, bucket: Bucket, output: torch.Tensor) -> None:
        offset = self.piece_offsets[bucket.index]
        self.shard_grad[offset : offset + output.numel()].add_(output)

    def end_reductions(self) -> None:
        self.wait_in_flight()

    def add_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Average over the data-parallel group and add this rank's pieces to its shard."""
        segment = self.flat.segments[self.index_of(param)]
        add_to_shard(self.comm, self.shard_grad, grad, segment, zip(self.ranges, self.piece_offsets), self.replicas)

    def finish_grads(self) -> torch.Tensor:
        self.wait_in_flight()
        return self.shard_grad

    def memory(self) -> dict[str, int]:
        return {**super().memory(), "gradients": nbytes(self.shard_grad)}


STAGES = {0: Replicated, 1: ShardedOptimizer, 2: ShardedGradients}
