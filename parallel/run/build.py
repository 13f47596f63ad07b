"""Everything one rank trains with, built in layers from the plain model outward:

  GPT (same seed on every rank) -> context parallel (its attention cores) -> recomputation ->
  precision policy -> tensor parallel -> expert parallel -> this pipeline rank's chunks -> ZeRO over dp x cp
  (or, hybrid sharding, over a shard group, replicated across the groups; the experts beside it, over their
  own group) -> master-weight AdamW on this rank's shard, and the schedule's executor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minigpt.model import GPT
from parallel.comm import Collectives
from parallel.context.apply import apply_context_parallel
from parallel.data.protocol import DataParallel
from parallel.run.step import StepOutcome, train_step
from parallel.mesh import Mesh, stage_group
from parallel.recompute import apply_recompute
from parallel.context.documents import sequence_documents
from parallel.pipeline.executor import PipelineExecutor, StageModel, TiedEmbedding, embedding_groups, split_model
from job.data_parallel import check_against_plan, schedule_config
from job.layout import Layout, embedding_copy
from job.schedule import ScheduleConfig, build_schedule
from parallel.tensor.parallelize import parallelize
from job.train_config import TrainConfig, bucket_numel as bucket_numel_of
from parallel.data.zero import STAGES, Replicated
from parallel.expert.apply import apply_expert_parallel, expert_groups
from parallel.expert.gradients import WithExperts, expert_shards
from parallel.data.zero3 import ShardedParameters
from precision.compute import apply_precision, dtype_of
from precision.optimizer import MasterAdamW
from precision.muon import MasterMuon
from parallel.run.muon import StageMatrices
from precision.policy import PrecisionPolicy
from precision.scaler import LossScaler


@dataclass
class Rank:
    """One rank's share of the job; `train_step` runs one step of it, begin to end."""

    mesh: Mesh
    policy: PrecisionPolicy
    stage: StageModel
    data_parallel: DataParallel
    optimizer: MasterAdamW | None  # set once the rank is built (make_optimizer)
    scaler: LossScaler | None
    executor: PipelineExecutor
    comms: dict[str, Collectives]

    def train_step(self, cfg: TrainConfig, step: int, inputs: list[torch.Tensor], targets: list[torch.Tensor],
                   activations=None) -> StepOutcome:
        """One optimizer step of this rank (parallel/run/step.py); every rank of the layout calls it."""
        return train_step(self, cfg, step, inputs, targets, activations)

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over every rank of the (copy-weighted) squared gradient norm; inf or nan if any
        rank has a non-finite gradient, so it is also the overflow check."""
        value = self.data_parallel.reduce_sum(value)
        return self.comms["pp"].sum(self.comms["tp"].sum(value))


def make_scaler(cfg: TrainConfig, loss_scaling: bool) -> LossScaler | None:
    if not loss_scaling:
        return None
    if cfg.loss_scale is not None:
        return LossScaler.static(cfg.loss_scale)
    return LossScaler(growth_interval=cfg.loss_scale_window)


def tied_copy(stage: StageModel) -> nn.Parameter | None:
    """This rank's copy of an embedding matrix split across stages (job/layout.py's embedding_copy: a tied head's,
    or the multi-token prediction's): the first chunk's embedding, or the last chunk's copy."""
    for chunk in stage.chunks:
        if chunk.first:
            return chunk.tok_emb.weight
        if chunk.last:
            if hasattr(chunk, "mtp_embedding"):
                return chunk.mtp_embedding.weight
            return getattr(chunk.head, "inner", chunk.head).weight
    return None


def make_data_parallel(stage: int, model: nn.Module, comm: Collectives, bucket_numel: int,
                       replicas: Collectives | None = None, config: ScheduleConfig | None = None) -> DataParallel:
    """The ZeRO stage `stage` over `comm`'s group (stage 0 when the group has one rank); hybrid sharding:
    `comm` a shard group and `replicas` the replica group. `config`: the schedule's, which says how long
    ZeRO-3 keeps a unit gathered without resharding after the forward (ScheduleConfig.zero3_hold)."""
    if comm.size == 1:
        return Replicated(model, comm, bucket_numel)
    if stage == 3:
        reshard = config is None or config.data_parallel.reshard_after_forward
        return ShardedParameters(model, comm, replicas, reshard, 1 if config is None else config.zero3_hold)
    return STAGES[stage](model, comm, bucket_numel, replicas=replicas)


def load_hf_weights(model: GPT, path: str) -> None:
    """The whole plain model's weights from a Hugging Face model directory (minigpt/hf/files.py), on every rank,
    before any parallelism cuts the model: each layout keeps its own pieces of the same tensors."""
    from minigpt.hf.files import read_hf_dir

    state = read_hf_dir(path, model.config)  # every parameter's name (a tied head once, as tok_emb.weight)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[name])
        for name, buffer in model.named_buffers():  # a MoE's choice bias (DeepSeek's e_score_correction_bias)
            if name in state:
                buffer.copy_(state[name])


def replicated_ids(replicated: list[nn.Parameter], stage: nn.Module) -> set[int]:
    """The ids of the `replicated` parameters (parallelize's, and the expert slices) that `stage` holds, taken while
    the list keeps every parameter it names alive: the whole experts expert parallelism replaced and other stages'
    blocks drop out, and no id of theirs can name a parameter made since (split_model's copies of a tied head or of
    the embedding), as CPython gives a freed object's id to the next one made at its address."""
    held = {id(param) for param in stage.parameters()}
    return {id(param) for param in replicated if id(param) in held}


def build_rank(cfg: TrainConfig, mesh: Mesh, device: torch.device, policy: PrecisionPolicy) -> Rank:
    comms = {dim: Collectives(mesh.group(dim), dim, device) for dim in ("tp", "pp", "cp")}
    comms["dp"] = Collectives(mesh.shard_group(), "dp", device)  # gradients are averaged over dp x cp: ZeRO's group
    replicas = Collectives(mesh.replica_group(), "dp_replicas", device)  # hybrid sharding's other half
    if replicas.size > 1:
        comms["dp_replicas"] = replicas
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    if cfg.init_from is not None and not cfg.resume:  # a resumed run's weights come from its checkpoint
        load_hf_weights(model, cfg.init_from)
    # before recomputation wraps the attention core it replaces; Gemma 2's capped scores blockwise at cp 1 too (a ring
    # of one rank: q, k, v, the output and the log-sum-exp kept, not the whole square the model's own path keeps)
    if cfg.cp > 1 or cfg.model.attention_softcap:
        apply_context_parallel(model, mesh.group("cp"), cfg.cp_kind, comms["cp"])
    model = apply_precision(apply_recompute(model, cfg.recompute), policy, device)  # built in fp32, then cast
    replicated = parallelize(model, comms["tp"], cfg.sequence_parallel)
    if cfg.ep > 1:  # the experts split over the expert group, after tensor parallelism left them whole
        comms["ep"], comms["ep_replicas"] = expert_groups(mesh, cfg.ep, device, cfg.sequence_parallel)
        apply_expert_parallel(model, comms["ep"])
        replicated += [param for _, param in expert_shards(model)] if mesh.tp > 1 else []  # the new slices
    stage = split_model(model, cfg.pp, mesh.pp_rank, cfg.virtual_chunks, cfg.stage_layers)
    replicated = replicated_ids(replicated, stage)
    del model  # blocks of other stages go with it
    bucket_numel = bucket_numel_of(cfg.bucket_mb, dtype_of(policy.compute).itemsize)
    layout = Layout.of(cfg)
    config = schedule_config(cfg.model, layout, cfg.micro_batches, cfg.schedule, cfg.bucket_mb, cfg.precision)
    data_parallel = make_data_parallel(cfg.zero, stage, comms["dp"], bucket_numel, replicas, config)
    if cfg.ep > 1:
        data_parallel = WithExperts(data_parallel, stage, comms["ep"], comms["ep_replicas"], mesh.data_ranks)

    tied = None
    shared = [(lo, hi, mesh.tp) for lo, hi in data_parallel.ranges_of(replicated)] if mesh.tp > 1 else []
    if embedding_copy(cfg.model, cfg.pp) is not None:
        groups = embedding_groups(mesh)  # collective: every rank takes part
        copy = tied_copy(stage)
        if copy is not None and mesh.rank in groups:
            tied = TiedEmbedding(copy, groups[mesh.rank], data_parallel)
            shared += [(lo, hi, 2) for lo, hi in data_parallel.ranges_of({id(copy)})]
    options = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                   decay_ranges=data_parallel.decay_ranges, masters_are_weights=policy.master is None,
                   shared_ranges=shared, norm_split=data_parallel.dense_numel if cfg.ep > 1 else None)
    kept = data_parallel.kept() if hasattr(data_parallel, "kept") else None
    element_bytes = data_parallel.weights[0].element_size() if isinstance(data_parallel.weights, list) \
        else data_parallel.weights.element_size()
    check_against_plan(config.plan, data_parallel.layout(), element_bytes, kept, data_parallel.sharding())
    schedule = build_schedule(config)
    executor = PipelineExecutor(stage, schedule, mesh.pp_rank, mesh.ranks_of("pp"), data_parallel, device, tied,
                                comms["pp"])
    micro_batch = cfg.global_batch // (cfg.micro_batches * cfg.dp)
    rows = layout.activation_rows(cfg.model)  # what a stage sends on: this rank's tokens of each sequence
    executor.set_activation((micro_batch, rows, cfg.model.d_model), dtype_of(policy.compute))
    if cfg.document_eod is not None:
        executor.document_ids = sequence_documents(cfg.document_eod, mesh.group("cp"))
    rank = Rank(mesh, policy, stage, data_parallel, None, make_scaler(cfg, policy.loss_scaling), executor, comms)
    rank.optimizer = make_optimizer(rank, cfg, options)  # Muon's reads where the rank holds each matrix
    return rank


def make_optimizer(rank: Rank, cfg: TrainConfig, options: dict) -> MasterAdamW:
    """The rank's optimizer over its data-parallel weights: AdamW, or Muon with AdamW for what is not a matrix."""
    if cfg.optimizer == "adamw":
        return MasterAdamW(rank.data_parallel.weights, **options)
    matrices = StageMatrices(rank, cfg, stage_group(rank.mesh))
    return MasterMuon(rank.data_parallel.weights, matrices.ranges(), matrices.orthogonalize,
                      momentum=cfg.muon_momentum, **options)
