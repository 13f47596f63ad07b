"""Pipeline parallelism: the model cut into chunks, and the executor of job/schedule.py.

The blocks are cut into pp x v contiguous chunks (`chunk_layers`: evenly, or by a stage layout); chunk 0 also
holds the embeddings, the last chunk the final norm, head and loss. Pipeline
rank r holds chunks r, r + p, ... (the schedule's rule). Every rank builds the
whole model from the same seed first, so each chunk starts with exactly the
weights one process would have, then drops the blocks it does not hold.

`PipelineExecutor.run_step` interprets one rank's action list through one
dispatch table (action type -> method; an action not in it is refused, by name,
when the executor is built): compute actions run forward or backward of a
micro-batch on a chunk; runs of consecutive sends/receives are posted together
with batch_isend_irecv and waited for, as the schedule's validator assumes;
data-parallel actions go to ZeRO's `issue` (parallel/data/zero.py, zero3.py). The
gathers listed right before a compute and the reductions right after it are
armed while it runs: ZeRO's hooks issue them the moment a unit is needed or a
bucket's gradients are in (the overlap with the backward), and nothing else --
a hook that needs a collective the schedule does not list raises. SyncEmbedding
sums a tied embedding's two copies; OptimizerStep runs the optimizer. Every action is stamped by the step clock
(parallel/clock.py) for the Chrome trace: on CUDA with device events, so the
trace holds when the GPU did the work, not when the host enqueued it. Every
tensor handed to a collective or a send/receive lives on the rank's device
(NCCL takes CUDA tensors only).

Zero-bubble schedules split a backward in two (parallel/pipeline/weight_gradients.py):
BackwardInput computes the activation gradients only -- the chunk's input
gradient, which SendGrad hands to the previous stage -- and BackwardWeight the
parameter gradients later, where ZeRO's and tensor parallelism's parameter
hooks fire as in a whole backward. The first chunk has no input gradient to
send: there BackwardInput does nothing and BackwardWeight the whole backward.

With a tied head and more than one stage, the first stage's embedding and the
last stage's head are two copies of one matrix: their gradients are summed over
the pair of ranks (the embedding group) before the optimizer sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from minigpt.attention import within_documents
from minigpt.model import embedded, output_logits, predict_ahead, prediction_loss
from minigpt.moe import aux_loss_weight
from parallel.expert import is_expert_shard
from minigpt.errors import ConfigError
from parallel.clock import Event, StepClock
from parallel.tensor.layers import VocabParallelEmbedding
from parallel.backward import backward_from
from parallel.pipeline.weight_gradients import WeightGradients
from job.layout import MTP_EMBEDDING, embedding_copy
from job.schedule import (
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
    armed_around,
    batches,
    chunk_layers,
)


class Chunk(nn.Module):
    """Global chunk `index`: optional embeddings, a run of blocks, optional norm + head + loss."""

    def __init__(self, model: nn.Module, index: int, layers: range, first: bool, last: bool):
        super().__init__()
        self.index, self.first, self.last = index, first, last
        self.config = model.config  # the embeddings' scale and the head output's (model.py's embedded, output_logits)
        if first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        if last:  # registered in job/layout.py's last_unit order (ZeRO's buckets follow the parameters')
            self.norm_f, self.mtp, self.head, self.loss = model.norm_f, model.mtp, model.head, model.loss
            self.mtp_weight, self.seq_len = model.config.mtp_weight, model.config.seq_len

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        """The chunk's output; on the last chunk the logits, with a multi-token prediction and `targets` the
        logits and each depth's (minigpt/model.py's predict_ahead)."""
        if self.first:  # GPT.embed, on this stage's modules
            ids, x = x, embedded(self.tok_emb(x), self.config)
            if self.pos_emb is not None:
                x = x + self.pos_emb(torch.arange(ids.shape[1], device=ids.device))
            x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        if self.last:
            normed = self.norm_f(x)
            if len(self.mtp) and targets is not None:  # the head once, over every depth (zero-bubble's split
                # backward counts a module's weight gradient once a forward)
                hidden = predict_ahead(self.mtp, self.lookup(), normed, targets)
                logits = output_logits(self.head(torch.cat([normed, *hidden])), self.config)
                return tuple(logits.chunk(1 + len(hidden)))
            x = output_logits(self.head(normed), self.config)
        return x

    def lookup(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The multi-token prediction's embedding lookup on this (last) chunk: the stage's own copy under pipelining
        (a module, whose output zero-bubble's weight gradients see: split_model's `mtp_embedding`); with the
        embeddings on the same chunk their module's forward, not the module: its ZeRO-3 hooks (gather, prefetch the
        next unit) belong to the chunk's own lookup."""
        if not self.first:
            return self.mtp_embedding
        return self.tok_emb.forward  # called past the module: no hook runs (a vocabulary-parallel one's sum does)

    def losses(self, out, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last chunk's (next-token loss, training objective) of its output `out` (minigpt/model.py's
        prediction_loss)."""
        logits, *ahead_logits = out if isinstance(out, tuple) else (out,)
        return prediction_loss(self.loss, logits, ahead_logits, targets, self.mtp_weight, self.seq_len)

    def units(self) -> list[list[nn.Module]]:
        """ZeRO-3's gather units: the embeddings, each block, the norm, multi-token prediction modules and head."""
        units = [[m for m in (self.tok_emb, self.pos_emb) if m is not None]] if self.first else []
        units += [[block] for block in self.blocks]
        copy = [self.mtp_embedding] if self.last and not self.first and len(self.mtp) else []  # after the head: its
        # tensors are job/layout.py's last_unit's (a tied head's weight is the copy itself, listed once)
        return units + ([[self.norm_f, *([self.mtp] if len(self.mtp) else []), self.head, *copy]] if self.last else [])


class StageModel(nn.Module):
    """The chunks one pipeline rank holds: what ZeRO shards and the optimizer updates."""

    def __init__(self, chunks: list[Chunk]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.by_index = {chunk.index: chunk for chunk in chunks}

    def units(self) -> list[tuple[int, list[nn.Module]]]:
        """ZeRO-3's units with the global chunk of each, in forward order."""
        return [(chunk.index, unit) for chunk in self.chunks for unit in chunk.units()]

    def chunk_ids(self) -> list[int]:
        """The global chunk of each parameter group, in `parameter_groups` order."""
        return [chunk.index for chunk in self.chunks]

    def parameter_groups(self) -> list[list[tuple[str, nn.Parameter]]]:
        """Parameters by chunk: a gradient bucket never spans two chunks (their backwards interleave)."""
        seen: set[int] = set()
        groups = []
        for number, chunk in enumerate(self.chunks):
            group = []
            for name, param in chunk.named_parameters():
                if id(param) not in seen and not is_expert_shard(param):  # experts: parallel/expert/gradients.py
                    seen.add(id(param))
                    group.append((f"chunks.{number}.{name}", param))
            groups.append(group)
        return [group for group in groups if group]


def split_model(model: nn.Module, pp: int, pp_rank: int, virtual_chunks: int,
                stage_layers: tuple[int, ...] = ()) -> StageModel:
    """This rank's chunks of the (already precision- and tensor-parallel) model; `stage_layers`: the blocks of
    each chunk (TrainConfig.stage_layers; (): the even split)."""
    num_chunks = pp * virtual_chunks
    layers = chunk_layers(len(model.blocks), num_chunks, stage_layers)
    chunks = [
        Chunk(model, index, layers[index], first=index == 0, last=index == num_chunks - 1)
        for index in range(pp_rank, num_chunks, pp)
    ]
    if pp > 1 and model.config.tied_head:
        for chunk in chunks:
            if chunk.last:  # the head's own copy of the embedding matrix
                inner = getattr(chunk.head, "inner", chunk.head)
                inner.weight = nn.Parameter(inner.weight.detach().clone())
    copy = embedding_copy(model.config, pp)  # the last stage's copy of the embedding, if it holds one
    for chunk in chunks:  # the multi-token prediction's lookups read it: a tied head's weight, or one of their own
        if chunk.last and len(chunk.mtp) and copy is not None:  # (registered last, as job/layout.py's last_unit)
            weight = getattr(chunk.head, "inner", chunk.head).weight if copy != MTP_EMBEDDING else \
                nn.Parameter(model.tok_emb.weight.detach().clone())
            chunk.mtp_embedding = embedding_like(model.tok_emb, weight)
    return StageModel(chunks)


def embedding_like(embedding: nn.Module, weight: nn.Parameter) -> nn.Module:
    """An embedding that looks up as `embedding` does (a vocabulary-parallel one its shard), on `weight`."""
    if isinstance(embedding, VocabParallelEmbedding):
        return VocabParallelEmbedding(weight, embedding.start, embedding.comm)
    module = nn.Embedding(*weight.shape, _weight=weight.data)
    module.weight = weight
    return module


@dataclass
class StepRecord:
    """What one step of the executor measured on this rank."""

    loss_sum: float = 0.0
    result: object = None  # the optimizer's StepResult (OptimizerStep)
    # (name, kind, start, end) as the clock's stamps: StepClock.resolve turns them into seconds
    events: list[Event] = field(default_factory=list)


@dataclass
class StepData:
    """What the actions of one step read: the micro-batches, the loss scaling, the record they add to."""

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    scale: Callable[[torch.Tensor], torch.Tensor]
    record: StepRecord
    activation_meter: object = None  # measures the first forward, then None
    optimize: Callable[[], object] | None = None  # the optimizer step, run at OptimizerStep
    index: int = 0  # the group of actions running
    documents: list | None = None  # each micro-batch's document ids (None: its sequences attend across documents)


class PipelineExecutor:
    def __init__(self, stage: StageModel, schedule: Schedule, pp_rank: int, pp_ranks: list[int],
                 data_parallel, device: torch.device, tied: "TiedEmbedding | None", comm):
        self.stage, self.pp_rank, self.pp_ranks, self.comm = stage, pp_rank, pp_ranks, comm
        self.actions = schedule.actions[pp_rank]
        self.table = self.dispatch_table()
        for action in self.actions:
            self.handler(action)  # refuse an unknown action before any rank starts the step
        self.groups = batches(self.actions)
        self.armed, self.closes = armed_around(self.groups)
        self.micro_batches = schedule.config.micro_batches
        self.num_chunks = schedule.config.num_chunks
        self.data_parallel, self.device, self.tied = data_parallel, device, tied
        split = any(type(a) is BackwardWeight for a in self.actions)
        self.split = WeightGradients([c for c in stage.chunks if not c.first]) if split else None
        # a micro-batch's inputs -> its whole sequences' document ids, attention kept within each (parallel/run/
        # build.py sets it for a run with document masks; every rank of a stage calls it, in micro-batch order)
        self.document_ids: Callable[[torch.Tensor], torch.Tensor] | None = None

    def dispatch_table(self) -> dict[type, Callable[[tuple, StepData], str]]:
        """Action type -> the method that runs a batch starting with one; it returns the trace kind."""
        return {
            Forward: self.run_forward,
            Backward: self.run_backward,
            BackwardInput: self.run_backward_input,
            BackwardWeight: self.run_backward_weight,
            SendActivation: self.exchange,
            RecvActivation: self.exchange,
            SendGrad: self.exchange,
            RecvGrad: self.exchange,
            AllReduceGrads: self.run_data_parallel,
            ReduceScatterGrads: self.run_data_parallel,
            GatherParams: self.run_data_parallel,
            SyncEmbedding: self.sync_embedding,
            ReduceTiedGrad: self.reduce_tied,
            OptimizerStep: self.optimizer_step,
        }

    def handler(self, action) -> Callable[[tuple, StepData], str]:
        handler = self.table.get(type(action))
        if handler is None:
            raise ConfigError(f"rank {self.pp_rank}: the pipeline executor cannot run {action} "
                              f"({type(action).__name__}): it has no entry in PipelineExecutor.dispatch_table")
        return handler

    def run_step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor], scale, activation_meter=None,
                 clock: StepClock | None = None, optimize: Callable[[], object] | None = None) -> StepRecord:
        """One training step's actions. `scale(loss)` turns a micro-batch loss into what backward starts from;
        `optimize()` is the optimizer step (OptimizerStep's work), returning its StepResult.

        `clock`: the step's clock, started by the caller, who resolves the record's stamps after
        finishing it; without one the actions get host perf_counter times (CPU-accurate only)."""
        clock = clock or StepClock(torch.device("cpu"))
        step = StepData(inputs, targets, scale, StepRecord(), activation_meter, optimize)
        if self.document_ids is not None:
            step.documents = [self.document_ids(x) for x in inputs]
        # a MoE's router losses enter the gradient as each micro-batch's loss does (minigpt/moe.py)
        aux_loss_weight(float(scale(1.0)) / self.micro_batches)  # the loss scale, times 1 / micro-batches
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.grads_in: dict[tuple[int, int], torch.Tensor] = {}
        if self.split is not None:
            self.split.reset()
        for index, group in enumerate(self.groups):
            start = clock.stamp()
            step.index = index
            kind = self.handler(group[0])(group, step)
            step.record.events.append(("+".join(a.name for a in group), kind, start, clock.stamp()))
        return step.record

    def computing(self, step: StepData, run: Callable[[], None]) -> str:
        """Run a compute with the data-parallel actions listed around it armed (parallel/data/zero.py)."""
        action = self.groups[step.index][0]
        self.data_parallel.begin_compute(action.chunk, self.armed.get(step.index, ()))
        run()
        self.data_parallel.end_compute()
        return "compute"

    def run_data_parallel(self, group, step: StepData) -> str:
        action = group[0]
        skipped = getattr(step.record.result, "skipped", False)
        if isinstance(action, GatherParams) and action.phase == "update" and skipped:
            return "dp"  # the optimizer skipped the step: the weights did not change
        self.data_parallel.issue(action)
        if step.index in self.closes:
            self.data_parallel.end_reductions()
        return "dp"

    def sync_embedding(self, group, step: StepData) -> str:
        self.tied.sync(add=self.data_parallel.stage < 2)
        return "p2p"

    def reduce_tied(self, group, step: StepData) -> str:
        self.tied.add_to_data_parallel()
        return "dp"

    def optimizer_step(self, group, step: StepData) -> str:
        if step.optimize is not None:
            step.record.result = step.optimize()
        return "dp"  # waiting for the last reductions, then the update (as the simulator counts it)

    def run_forward(self, group, step: StepData) -> str:
        if step.activation_meter is not None:
            with step.activation_meter.measure_forward():
                self.computing(step, lambda: self.forward(group[0], step))
            step.activation_meter = None
            return "compute"
        return self.computing(step, lambda: self.forward(group[0], step))

    def run_backward(self, group, step: StepData) -> str:
        return self.computing(step, lambda: self.backward(group[0]))

    def run_backward_input(self, group, step: StepData) -> str:
        """The input gradient only; on the first chunk (no input gradient) nothing: its W does it all."""
        action = group[0]
        chunk = self.stage.by_index[action.chunk]
        if chunk.first:
            return "compute"
        return self.computing(step, lambda: self.input_gradient(action, chunk))

    def input_gradient(self, action, chunk: Chunk) -> None:
        key = (action.micro_batch, action.chunk)
        grad = self.output_grad(action, chunk)
        x = self.inputs[key]
        x.grad = self.split.input_gradient(key, self.outputs.pop(key), grad, x)

    def run_backward_weight(self, group, step: StepData) -> str:
        action = group[0]
        if self.stage.by_index[action.chunk].first:
            return self.computing(step, lambda: self.backward(action))
        key = (action.micro_batch, action.chunk)
        return self.computing(step, lambda: self.split.weight_gradients(key, self.data_parallel.before_weight_grads))

    def forward(self, action: Forward, step: StepData) -> None:
        chunk = self.stage.by_index[action.chunk]
        key = (action.micro_batch, action.chunk)
        if chunk.first:
            x = step.inputs[action.micro_batch]
        elif key in self.inputs:
            x = self.inputs[key]
        else:  # the previous chunk is on this rank (pp = 1): hand over in memory
            x = self.outputs.pop((action.micro_batch, action.chunk - 1)).detach().requires_grad_()
            self.inputs[key] = x
        targets = step.targets[action.micro_batch] if chunk.last else None
        split = self.split is not None and not chunk.first
        with within_documents(step.documents[action.micro_batch] if step.documents else None):
            out = self.split.forward(chunk, x, key, targets) if split else chunk(x, targets)
        if chunk.last:
            loss, objective = chunk.losses(out, targets)
            step.record.loss_sum += loss.item()
            self.outputs[key] = step.scale(objective / self.micro_batches)
        else:
            self.outputs[key] = out

    def output_grad(self, action, chunk: Chunk) -> torch.Tensor | None:
        """The gradient a backward of `action` starts from: None on the last chunk (a loss)."""
        if chunk.last:
            return None
        key = (action.micro_batch, action.chunk)
        grad = self.grads_in.pop(key, None)
        if grad is None:  # the next chunk is on this rank
            grad = self.inputs.pop((action.micro_batch, action.chunk + 1)).grad
        return grad

    def backward(self, action) -> None:
        """The whole backward of a micro-batch on a chunk: input and parameter gradients."""
        chunk = self.stage.by_index[action.chunk]
        grad = self.output_grad(action, chunk)
        backward_from(self.outputs.pop((action.micro_batch, action.chunk)), grad)

    def exchange(self, group, step: StepData | None = None) -> str:
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
        return "p2p"

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The loss of one batch through every chunk in order (forward only); every rank returns it."""
        x, loss = inputs, torch.zeros((), dtype=torch.float64, device=self.device)
        documents = None if self.document_ids is None else self.document_ids(inputs)
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
            with within_documents(documents):
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
    hands ZeRO zeros; at SyncEmbedding, after the rank's last compute, the buffers are
    all-reduced over the pair of ranks and added to the gradient ZeRO reduces: for
    ZeRO-0/1 into the full gradient before the bucket's reduction that follows, for
    ZeRO-2/3 by an all-reduce over the replicas (ReduceTiedGrad).
    """

    def __init__(self, param: nn.Parameter, group, data_parallel):
        self.param, self.group, self.data_parallel = param, group, data_parallel
        self.grad = torch.zeros_like(param)
        param.register_hook(self.capture)

    def capture(self, grad: torch.Tensor) -> torch.Tensor:
        self.grad.add_(grad)
        return torch.zeros_like(grad)

    def sync(self, add: bool) -> None:
        dist.all_reduce(self.grad, group=self.group)
        if add:
            self.add_to_data_parallel()

    def add_to_data_parallel(self) -> None:
        self.data_parallel.add_grad(self.param, self.grad)
        self.grad.zero_()


def embedding_groups(mesh) -> dict[int, object]:
    """One process group per (dp, cp, tp) triple of first and last pipeline ranks; every rank builds all of them."""
    groups = {}
    for dp_rank in range(mesh.dp):
        for cp_rank in range(mesh.cp):
            for tp_rank in range(mesh.tp):
                first = mesh.global_rank(0, dp_rank, cp_rank, tp_rank)
                last = mesh.global_rank(mesh.pp - 1, dp_rank, cp_rank, tp_rank)
                group = dist.new_group([first, last])
                if mesh.rank in (first, last):
                    groups[mesh.rank] = group
    return groups
