"""Pipeline parallelism: the model cut into chunks, and the executor of parallel/schedule.py.

The blocks are cut into pp x v contiguous chunks (`chunk_layers`); chunk 0 also
holds the embeddings, the last chunk the final norm, head and loss. Pipeline
rank r holds chunks r, r + p, ... (the schedule's rule). Every rank builds the
whole model from the same seed first, so each chunk starts with exactly the
weights one process would have, then drops the blocks it does not hold.

`PipelineExecutor.run_step` interprets one rank's action list: compute actions
run forward or backward of a micro-batch on a chunk; runs of consecutive
sends/receives are posted together with batch_isend_irecv and waited for, as
the schedule's validator assumes; data-parallel actions are where ZeRO's own
hooks do their work (bucket reductions during the backward, ZeRO-3 gathers in
module hooks), so the executor only marks them in the trace. Every action is
stamped by the step clock (parallel/clock.py) for the Chrome trace: on CUDA with
device events, so the trace holds when the GPU did the work, not when the host
enqueued it. Every tensor handed to a collective or a send/receive lives on the
rank's device (NCCL takes CUDA tensors only).

With a tied head and more than one stage, the first stage's embedding and the
last stage's head are two copies of one matrix: their gradients are summed over
the pair of ranks (the embedding group) before the optimizer sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from parallel.clock import Event, StepClock
from parallel.schedule import (
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    Schedule,
    SendActivation,
    SendGrad,
    batches,
    chunk_layers,
)


class Chunk(nn.Module):
    """Global chunk `index`: optional embeddings, a run of blocks, optional norm + head + loss."""

    def __init__(self, model: nn.Module, index: int, layers: range, first: bool, last: bool):
        super().__init__()
        self.index, self.first, self.last = index, first, last
        if first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        if last:
            self.norm_f, self.head, self.loss = model.norm_f, model.head, model.loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head(self.norm_f(x))
        return x

    def units(self) -> list[list[nn.Module]]:
        """ZeRO-3's gather units: the embeddings, each block, the norm and head."""
        units = [[self.tok_emb, self.pos_emb]] if self.first else []
        units += [[block] for block in self.blocks]
        return units + ([[self.norm_f, self.head]] if self.last else [])


class StageModel(nn.Module):
    """The chunks one pipeline rank holds: what ZeRO shards and the optimizer updates."""

    def __init__(self, chunks: list[Chunk]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.by_index = {chunk.index: chunk for chunk in chunks}

    def units(self) -> list[list[nn.Module]]:
        return [unit for chunk in self.chunks for unit in chunk.units()]

    def parameter_groups(self) -> list[list[tuple[str, nn.Parameter]]]:
        """Parameters by chunk: a gradient bucket never spans two chunks (their backwards interleave)."""
        seen: set[int] = set()
        groups = []
        for number, chunk in enumerate(self.chunks):
            group = []
            for name, param in chunk.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    group.append((f"chunks.{number}.{name}", param))
            groups.append(group)
        return [group for group in groups if group]


def split_model(model: nn.Module, pp: int, pp_rank: int, virtual_chunks: int) -> StageModel:
    """This rank's chunks of the (already precision- and tensor-parallel) model."""
    num_chunks = pp * virtual_chunks
    layers = chunk_layers(len(model.blocks), num_chunks)
    chunks = [
        Chunk(model, index, layers[index], first=index == 0, last=index == num_chunks - 1)
        for index in range(pp_rank, num_chunks, pp)
    ]
    if pp > 1 and model.config.tied_head:
        for chunk in chunks:
            if chunk.last:  # the head's own copy of the embedding matrix
                inner = getattr(chunk.head, "inner", chunk.head)
                inner.weight = nn.Parameter(inner.weight.detach().clone())
    return StageModel(chunks)


@dataclass
class StepRecord:
    """What one step of the executor measured on this rank."""

    loss_sum: float = 0.0
    # (name, kind, start, end) as the clock's stamps: StepClock.resolve turns them into seconds
    events: list[Event] = field(default_factory=list)


class PipelineExecutor:
    def __init__(self, stage: StageModel, schedule: Schedule, pp_rank: int, pp_ranks: list[int],
                 data_parallel, device: torch.device, tied: "TiedEmbedding | None", comm):
        self.stage, self.pp_rank, self.pp_ranks, self.comm = stage, pp_rank, pp_ranks, comm
        self.actions = schedule.actions[pp_rank]
        self.groups = batches(self.actions)
        self.micro_batches = schedule.config.micro_batches
        self.num_chunks = schedule.config.num_chunks
        self.data_parallel, self.device, self.tied = data_parallel, device, tied
        backwards = [a for a in self.actions if isinstance(a, Backward)]
        # Buckets are reduced during the last backward, overlapped, unless a tied copy's
        # gradient still has to be added after it: then all are reduced at the end.
        self.last_backward = backwards[-1] if backwards and tied is None else None

    def run_step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor], scale, activation_meter=None,
                 clock: StepClock | None = None) -> StepRecord:
        """One training step's actions. `scale(loss)` turns a micro-batch loss into what backward starts from.

        `clock`: the step's clock, started by the caller, who resolves the record's stamps after
        finishing it; without one the actions get host perf_counter times (CPU-accurate only)."""
        clock = clock or StepClock(torch.device("cpu"))
        record = StepRecord()
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.grads_in: dict[tuple[int, int], torch.Tensor] = {}
        measured = activation_meter is None
        for group in self.groups:
            start = clock.stamp()
            action = group[0]
            if isinstance(action, Forward):
                if not measured:
                    with activation_meter.measure_forward():
                        self.forward(action, inputs, targets, scale, record)
                    measured = True
                else:
                    self.forward(action, inputs, targets, scale, record)
                kind = "compute"
            elif isinstance(action, Backward):
                self.data_parallel.begin_micro_batch(last=action == self.last_backward)
                self.backward(action)
                self.data_parallel.end_micro_batch()
                kind = "compute"
            elif isinstance(action, (SendActivation, RecvActivation, SendGrad, RecvGrad)):
                self.exchange(group)
                kind = "p2p"
            else:
                kind = "dp"  # performed by ZeRO's hooks and the training loop; marked here
            name = "+".join(a.name for a in group)
            record.events.append((name, kind, start, clock.stamp()))
        if self.tied is not None:
            start = clock.stamp()
            self.tied.sync()
            record.events.append(("EmbeddingSync", "p2p", start, clock.stamp()))
        return record

    def forward(self, action: Forward, inputs, targets, scale, record: StepRecord) -> None:
        chunk = self.stage.by_index[action.chunk]
        key = (action.micro_batch, action.chunk)
        if chunk.first:
            x = inputs[action.micro_batch]
        elif key in self.inputs:
            x = self.inputs[key]
        else:  # the previous chunk is on this rank (pp = 1): hand over in memory
            x = self.outputs.pop((action.micro_batch, action.chunk - 1)).detach().requires_grad_()
            self.inputs[key] = x
        out = chunk(x)
        if chunk.last:
            loss = chunk.loss(out, targets[action.micro_batch])
            record.loss_sum += loss.item()
            self.outputs[key] = scale(loss / self.micro_batches)
        else:
            self.outputs[key] = out

    def backward(self, action: Backward) -> None:
        key = (action.micro_batch, action.chunk)
        out = self.outputs.pop(key)
        chunk = self.stage.by_index[action.chunk]
        if chunk.last:
            out.backward()
        else:
            grad = self.grads_in.pop(key, None)
            if grad is None:  # the next chunk is on this rank
                grad = self.inputs[(action.micro_batch, action.chunk + 1)].grad
                del self.inputs[(action.micro_batch, action.chunk + 1)]
            out.backward(grad)

    def exchange(self, group) -> None:
        operations, received = [], []
        for action in group:
            peer = self.pp_ranks[action.peer]
            key = (action.micro_batch, action.chunk)
            if isinstance(action, SendActivation):
                tensor = self.outputs[key].detach().contiguous()
            elif isinstance(action, SendGrad):
                tensor = self.inputs.pop(key).grad.contiguous()
            if isinstance(action, (SendActivation, SendGrad)):
                self.comm.count("send", tensor)
                operations.append(dist.P2POp(dist.isend, tensor, peer))
            else:
                buffer = torch.empty(self.activation_shape, dtype=self.activation_dtype, device=self.device)
                operations.append(dist.P2POp(dist.irecv, buffer, peer))
                received.append((action, key, buffer))
        for request in dist.batch_isend_irecv(operations):
            request.wait()
        for action, key, buffer in received:
            if isinstance(action, RecvActivation):
                self.inputs[key] = buffer.requires_grad_()
            else:
                self.grads_in[key] = buffer

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The loss of one batch through every chunk in order (forward only); every rank returns it."""
        x, loss = inputs, torch.zeros((), dtype=torch.float64, device=self.device)
        for index in range(self.num_chunks):
            holder = index % len(self.pp_ranks)
            if holder != self.pp_rank:
                continue
            chunk = self.stage.by_index[index]
            if not chunk.first:
                previous = (index - 1) % len(self.pp_ranks)
                if previous != self.pp_rank:
                    x = torch.empty(self.eval_shape(inputs), dtype=self.activation_dtype, device=self.device)
                    dist.recv(x, self.pp_ranks[previous])
            x = chunk(x)
            if chunk.last:
                loss = chunk.loss(x, targets).double()
            else:
                following = (index + 1) % len(self.pp_ranks)
                if following != self.pp_rank:
                    dist.send(x.contiguous(), self.pp_ranks[following])
        if self.comm.group is not None:
            dist.all_reduce(loss, group=self.comm.group)  # only the last stage's is non-zero
        return float(loss)

    def eval_shape(self, inputs: torch.Tensor) -> tuple[int, ...]:
        return (inputs.shape[0], *self.activation_shape[1:])

    def set_activation(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Shape and format of what travels between stages (the same both ways)."""
        self.activation_shape, self.activation_dtype = shape, dtype


class TiedEmbedding:
    """Sums the gradients of the embedding (first stage) and the head's copy (last stage).

    During the step a tensor hook moves each contribution into a side buffer and
    hands ZeRO zeros; after the last backward the buffers are all-reduced over the
    pair of ranks and added to the gradient ZeRO will reduce.
    """

    def __init__(self, param: nn.Parameter, group, data_parallel):
        self.param, self.group, self.data_parallel = param, group, data_parallel
        self.grad = torch.zeros_like(param)
        param.register_hook(self.capture)

    def capture(self, grad: torch.Tensor) -> torch.Tensor:
        self.grad.add_(grad)
        return torch.zeros_like(grad)

    def sync(self) -> None:
        dist.all_reduce(self.grad, group=self.group)
        self.data_parallel.add_grad(self.param, self.grad)
        self.grad.zero_()


def embedding_groups(mesh) -> dict[int, object]:
    """One process group per (dp, tp) pair of first and last pipeline ranks; every rank builds all of them."""
    groups = {}
    for dp_rank in range(mesh.dp):
        for tp_rank in range(mesh.tp):
            first = (0 * mesh.dp + dp_rank) * mesh.tp + tp_rank
            last = ((mesh.pp - 1) * mesh.dp + dp_rank) * mesh.tp + tp_rank
            group = dist.new_group([first, last])
            if mesh.rank in (first, last):
                groups[mesh.rank] = group
    return groups
